"""Dense vs MoE translation models on the Django corpus: one routine for notebook 10 and
``benchmarks/moe_translation.py``."""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
from flax import nnx

from carlskit._checks import choice, positive_int
from carlskit.moe._translation import TranslationModel, translation_scores

# "small" keeps the notebook's headless run (CARLSKIT_SMALL=1) near a minute on a shared CPU: far
# too short to translate, it only exercises the code. "full" is the benchmark's size: every language
# of the corpus into English (``languages=None``) and English into French and German, scored on
# every test pair that fits the 40-byte lengths (``test_per_language=None``: 5,625 over 100 tags; on
# the first 12 per tag, 1,187 pairs, one seed's BLEU gain of MoE-32 over dense read -1.64 where all
# 5,625 read +0.81). The widths are capacity-limited (d_model 32: dense 64k parameters, MoE-32 312k):
# at d_model 64 the dense model fits the 40k training pairs already and MoE's extra parameters only
# over-fit (BENCHMARKS.md). ``capacity_factor=1.0`` is GShard's C = 2S/E for top-2
# (carlskit's factor is per choice, see :func:`~carlskit.moe.expert_capacity`).
#: The problem sizes of the translation comparison (``small`` for tests and notebook 10's headless
#: run, ``full`` for ``benchmarks/moe_translation.py``): model widths, steps, batch, languages
#: (a count spread over the size range, or None for all), test sentences per tag (None: all).
TRANSLATION_SIZES: dict[str, dict[str, Any]] = {
    "small": dict(languages=4, from_english=("fr",), d_model=32, num_heads=2, ffn_dim=64, num_layers=1,
                  max_length=24, batch_size=32, steps=30, test_per_language=8, capacity_factor=1.0),
    "full": dict(languages=None, from_english=("fr", "de"), d_model=32, num_heads=2, ffn_dim=64, num_layers=2,
                 max_length=40, batch_size=64, steps=1000, test_per_language=None, capacity_factor=1.0),
}


def pick_languages(corpus, count: int | None) -> list[str]:
    """``count`` languages spread evenly over the corpus' training sizes, largest to smallest (so
    high- and low-resource languages are both in); all of them for ``count=None``."""
    ranked = corpus.languages
    if count is None:
        return list(ranked)
    count = min(positive_int(count, "count"), len(ranked))
    indices = np.unique(np.round(np.linspace(0, len(ranked) - 1, count)).astype(int))
    return [ranked[i] for i in indices]


def translation_tasks(corpus, languages: Sequence[str], from_english: Sequence[str], split: str,
                      max_length: int, limit: int | None = None) -> list[tuple[str, str, str]]:
    """``(tag, source, reference)`` for X -> English (tag ``"xx"``) of ``languages`` and English -> X
    (tag ``"2xx"``) of ``from_english``, pairs that fit ``max_length`` bytes (with tag / EOS) whole;
    at most ``limit`` per tag (the first ones: the corpus order is sorted, hence the same every run)."""
    tasks = []
    fits = lambda a, b: len(a.encode()) < max_length and len(b.encode()) < max_length  # noqa: E731
    for tag, language, into_english in ([(lang, lang, True) for lang in languages]
                                        + [(f"2{lang}", lang, False) for lang in from_english]):
        chosen = []
        for english, translation in corpus.pairs[language][split]:
            source, reference = (translation, english) if into_english else (english, translation)
            if fits(source, reference):
                chosen.append((tag, source, reference))
        tasks += chosen[:limit] if limit else chosen
    return tasks


def translation_comparison(
    num_experts: Sequence[int] = (0, 8, 32),
    *,
    corpus=None,
    seeds: Sequence[int] = (0,),
    size: str = "full",
    steps: int | None = None,
    beam_size: int = 1,
    callback: Callable[[dict, int, dict], None] | None = None,
    on_run: Callable[[dict], None] | None = None,
) -> dict:
    """Train a dense model and MoE models (same per-token FLOPs, same batches, same steps, Adafactor)
    on X -> English for :func:`pick_languages` and English -> X for a few, and score greedy (or
    ``beam_size``) translations of the test split with sacrebleu, per tag.
    The models of one seed are paired: the same batches in the same order and the same dropout and
    routing random stream (their parameters differ, as their shapes do).

    Returns ``{"config", "languages", "tags", "train_sizes" (training pairs per tag), "runs"}``;
    each run: ``num_experts``, ``seed``, ``parameters``, ``history`` (the fit history),
    ``train_seconds``, ``decode_seconds``, ``scores`` (per tag and
    ``"mean"``: BLEU, chrF), ``valid_loss`` (cross-entropy per target byte on 8 validation pairs per
    tag), ``hypotheses``, ``model``. ``callback(run, step, record)`` sees every
    training step (``run`` holds ``num_experts`` and ``seed``), ``on_run(run)`` every finished run.
    """
    from carlskit.data import load_translation_corpus

    choice(size, "size", tuple(TRANSLATION_SIZES))
    config = dict(TRANSLATION_SIZES[size])
    if steps is not None:
        config["steps"] = positive_int(steps, "steps")
    corpus = load_translation_corpus() if corpus is None else corpus
    languages = pick_languages(corpus, config["languages"])
    from_english = list(config["from_english"])
    train = translation_tasks(corpus, languages, from_english, "train", config["max_length"])
    valid = translation_tasks(corpus, languages, from_english, "valid", config["max_length"], 8)
    test = translation_tasks(corpus, languages, from_english, "test", config["max_length"],
                             config["test_per_language"])
    tags = languages + [f"2{lang}" for lang in from_english]
    result: dict[str, Any] = {
        "config": config, "languages": languages, "tags": tags, "runs": [],
        "train_sizes": {tag: sum(1 for t in train if t[0] == tag) for tag in tags},
        "test_sizes": {tag: sum(1 for t in test if t[0] == tag) for tag in tags},
    }
    for seed in seeds:
        for experts in num_experts:
            model = TranslationModel(tags, config["num_layers"], config["d_model"], config["num_heads"], experts,
                                     ffn_dim=config["ffn_dim"], max_source_length=config["max_length"],
                                     max_target_length=config["max_length"],
                                     capacity_factor=config["capacity_factor"], seed=seed)
            source = model.encode_sources([t[1] for t in train], [t[0] for t in train])
            target = model.encode_targets([t[2] for t in train])
            valid_source = model.encode_sources([t[1] for t in valid], [t[0] for t in valid])
            valid_target = model.encode_targets([t[2] for t in valid])
            run: dict[str, Any] = {"num_experts": int(experts), "seed": int(seed)}

            def on_step(step: int, record: dict, run=run) -> None:
                if callback is not None:
                    callback(run, step, record)

            history = model.fit(source, target, steps=config["steps"], batch_size=config["batch_size"], seed=seed,
                                callback=on_step)
            valid_loss = _valid_cross_entropy(model, valid_source, valid_target)
            started = time.perf_counter()
            hypotheses = model.translate([t[1] for t in test], [t[0] for t in test], beam_size=beam_size)
            run.update(
                parameters=int(sum(np.size(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))),
                history=history, train_seconds=history[-1]["seconds"] if history else 0.0,
                valid_loss=valid_loss, decode_seconds=time.perf_counter() - started,
                scores=translation_scores(hypotheses, [t[2] for t in test], [t[0] for t in test]),
                hypotheses=hypotheses, model=model,
            )
            result["runs"].append(run)
            if on_run is not None:
                on_run(run)
    result["test"] = test
    return result


def _valid_cross_entropy(model: TranslationModel, source: np.ndarray, target: np.ndarray) -> float:
    graphdef, state = nnx.split(model)
    loss = jax.jit(lambda s, a, b: nnx.merge(graphdef, s).loss_and_metrics(a, b)[1]["cross_entropy"])
    return float(loss(state, source, target))
