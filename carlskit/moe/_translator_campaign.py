"""The shipped translator's resumable training campaign (issue 42): interrupted runs add up.

A campaign trains one :class:`~carlskit.moe.TranslationModel` (every language of the corpus into
English, English into ``from_english``) in a run directory:

* ``config.json``: the :class:`TranslatorConfig` (checksummed JSON, written once; a resume uses it);
* ``state/``: the model and optimizer state, a :class:`carlskit.CheckpointStore` written by the
  :class:`carlskit.training.Trainer` (atomic, checksummed, version = step); a resume loads the
  newest intact one;
* ``campaign_log.jsonl``: one line per saved state: step, CPU and wall seconds over all runs, mean
  training loss since the last line, and greedy validation BLEU / chrF (sacrebleu 13a) on the ten
  largest languages into English and English into each ``from_english`` language, beside the same
  scores of the sources copied unchanged (``copy_*``: software strings keep names, placeholders
  and markup, so copying scores BLEU 20.9 into English on the test split).

Deterministic: batch ``s`` is drawn from ``(seed, s)`` and its dropout and routing key is
``fold_in(key(seed), s)``, so a run resumed at step ``s`` continues exactly as an uninterrupted one.
The learning rate follows the optimizer's own step count (in the saved state): Adafactor (GShard's
optimizer) under a linear warm-up and reciprocal square-root decay.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import time
from typing import Any, Callable, Sequence

import numpy as np
import optax

from carlskit._campaign import LOG_NAME, CampaignClock, append_log_line, repair_log, stop_requests
from carlskit._checks import integer, positive_float, positive_int
from carlskit._serialization import atomic_write, dumps_checked_json, filesystem, loads_checked_json

CONFIG_NAME = "config.json"
STATE_DIR = "state"
#: languages into English whose mean validation BLEU the log reports (the issue's bar: the ten largest)
TOP_LANGUAGES = 10


@dataclasses.dataclass(frozen=True)
class TranslatorConfig:
    """Everything that decides a translator campaign's trajectory (stored in its run directory).

    ``languages``: how many of the corpus' languages (largest first) translate into English (None:
    all); ``vocabulary``: the shipped shared sentencepiece vocabulary (False: UTF-8 bytes);
    ``max_length``: source and target length in tokens (pairs that do not fit whole are left out);
    ``buckets``: batches hold pairs of one length bucket (the longer of tag + source and target +
    end at most the bucket's length), cut to it, ``tokens_per_batch // length`` pairs each (fairseq's
    ``max_tokens``): the pairs average about 10 tokens, so a batch padded to ``max_length`` would
    be mostly padding;
    ``learning_rate`` peaks after ``warmup_steps`` and decays as ``1 / sqrt(step)``;
    ``validate_every_steps``: steps between saves (each save logs a validation line);
    The model's defaults are the campaign's size, chosen by measurement on one core (``BENCHMARKS.md``:
    d_model 256 x 3 layers cost 2.6-4.5x as much per step; MoE-16 costs what the dense model does at
    this width, where the 8k-piece embedding and softmax dominate).
    ``validation_per_tag``: validation pairs per reported tag, drawn at random (seeded): the corpus
    is stored sorted, so its first pairs are mostly placeholders and markup, which score high."""

    seed: int = 0
    corpus_version: int = 2
    languages: int | None = None
    from_english: tuple[str, ...] = ("fr", "de")
    vocabulary: bool = True
    num_layers: int = 2
    d_model: int = 128
    num_heads: int = 4
    ffn_dim: int = 512
    num_experts: int = 16
    capacity_factor: float = 2.0
    dropout_rate: float = 0.1
    max_length: int = 32
    buckets: tuple[int, ...] = (8, 12, 16, 24, 32)
    tokens_per_batch: int = 2048
    learning_rate: float = 1e-2
    warmup_steps: int = 500
    validate_every_steps: int = 300
    validation_per_tag: int = 64

    def __post_init__(self) -> None:
        for name in ("num_layers", "d_model", "num_heads", "ffn_dim", "max_length", "tokens_per_batch", "warmup_steps",
                     "validate_every_steps", "validation_per_tag", "corpus_version"):
            object.__setattr__(self, name, positive_int(getattr(self, name), name))
        for name in ("seed", "num_experts"):
            object.__setattr__(self, name, integer(getattr(self, name), name, minimum=0))
        if self.languages is not None:
            object.__setattr__(self, "languages", positive_int(self.languages, "languages"))
        for name in ("capacity_factor", "learning_rate"):
            object.__setattr__(self, name, positive_float(getattr(self, name), name))
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ValueError(f"dropout_rate must be in [0, 1), got {self.dropout_rate}")
        if isinstance(self.from_english, str) or not all(isinstance(t, str) and t for t in self.from_english):
            raise TypeError(f"from_english must be a sequence of language codes, got {self.from_english!r}")
        object.__setattr__(self, "from_english", tuple(self.from_english))
        buckets = tuple(sorted({positive_int(b, "buckets") for b in self.buckets if b < self.max_length}
                               | {self.max_length}))
        object.__setattr__(self, "buckets", buckets)
        if self.tokens_per_batch < self.max_length:
            raise ValueError(f"tokens_per_batch ({self.tokens_per_batch}) must hold one pair of max_length "
                             f"({self.max_length})")
        if not isinstance(self.vocabulary, bool):
            raise TypeError(f"vocabulary must be a bool, got {self.vocabulary!r}")

    def to_json(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_json(cls, document: dict[str, Any]) -> TranslatorConfig:
        return cls(**document)

    def schedule(self) -> optax.Schedule:
        """Linear warm-up to ``learning_rate`` over ``warmup_steps``, then ``lr * sqrt(warmup / step)``."""
        peak, warmup = self.learning_rate, float(self.warmup_steps)

        def rate(count):
            import jax.numpy as jnp

            step = jnp.maximum(count.astype(jnp.float32) + 1.0, 1.0)
            return peak * jnp.minimum(step / warmup, jnp.sqrt(warmup / step))

        return rate


class TranslatorCampaign:
    """The pieces of one :class:`TranslatorConfig`: corpus rows, model, optimizer, validation set."""

    def __init__(self, config: TranslatorConfig):
        from carlskit.data import load_translation_corpus, load_vocabulary
        from carlskit.moe._model import step_routing_keys
        from carlskit.moe._translation import TranslationModel

        self.config = config
        corpus = load_translation_corpus(version=config.corpus_version)
        ranked = corpus.languages
        languages = list(ranked if config.languages is None else ranked[: config.languages])
        missing = [lang for lang in config.from_english if lang not in corpus.pairs]
        if missing:
            raise ValueError(f"from_english languages {missing} are not in corpus version {config.corpus_version}")
        self.languages = languages
        self.tags = languages + [f"2{lang}" for lang in config.from_english]
        self.model = TranslationModel(
            self.tags, config.num_layers, config.d_model, config.num_heads, config.num_experts,
            ffn_dim=config.ffn_dim, max_source_length=config.max_length, max_target_length=config.max_length,
            dropout_rate=config.dropout_rate, capacity_factor=config.capacity_factor, seed=config.seed,
            tokenizer=load_vocabulary() if config.vocabulary else None)
        self.train_sizes: dict[str, int] = {}
        source, target, tags = self._pairs(corpus, "train", None)
        self.train_sizes = {tag: tags.count(tag) for tag in self.tags}
        self.source, self.target = self.model.encode_sources(source, tags), self.model.encode_targets(target)
        pad = self.model.pad_id
        longest = np.maximum((self.source != pad).sum(axis=1), (self.target != pad).sum(axis=1))
        which = np.searchsorted(np.asarray(config.buckets), longest)  # the first bucket that holds the pair
        #: per bucket: (length, batch size, row indices)
        self.buckets = [(length, max(1, config.tokens_per_batch // length), np.flatnonzero(which == i))
                        for i, length in enumerate(config.buckets) if np.any(which == i)]
        self._bucket_weights = np.asarray([len(rows) for _, _, rows in self.buckets], np.float64)
        self._bucket_weights /= self._bucket_weights.sum()
        reported = languages[:TOP_LANGUAGES] + [f"2{lang}" for lang in config.from_english]
        self.validation = self._pairs(corpus, "valid", config.validation_per_tag, reported)
        #: the same scores for the source copied unchanged: software strings keep names, placeholders
        #: and markup, so copying scores far above zero (the bar a translation must clear)
        self.copy_scores = self._summary(self.validation[0], self.validation)
        self._key_at = step_routing_keys(config.seed, None)

    def _pairs(self, corpus, split: str, limit: int | None, tags: Sequence[str] | None = None
               ) -> tuple[list[str], list[str], list[str]]:
        """``(sources, references, tags)`` of ``split`` that fit the model's lengths whole, at most
        ``limit`` per tag (a seeded random sample, in corpus order)."""
        sources, references, out_tags = [], [], []
        tokenizer, limit_length = self.model.tokenizer, self.config.max_length
        for tag in self.tags if tags is None else tags:
            english_out = not tag.startswith("2")
            pairs = corpus.pairs[tag if english_out else tag[1:]][split]
            pairs = [(xx, en) if english_out else (en, xx) for en, xx in pairs]
            lengths = tokenizer.encode([t for pair in pairs for t in pair])
            kept = [pair for i, pair in enumerate(pairs)
                    if len(lengths[2 * i]) + 1 <= limit_length and len(lengths[2 * i + 1]) + 1 <= limit_length]
            if limit is not None and len(kept) > limit:
                chosen = np.sort(np.random.default_rng([self.config.seed, len(tag), *tag.encode()]).choice(
                    len(kept), limit, replace=False))
                kept = [kept[i] for i in chosen]
            for source, reference in kept:
                sources.append(source)
                references.append(reference)
                out_tags.append(tag)
        return sources, references, out_tags

    def optimizer(self) -> optax.GradientTransformation:
        return optax.adafactor(self.config.schedule())

    def batch_at(self, step: int) -> dict:
        """Training batch ``step``, drawn from ``(seed, step)``: a bucket (in proportion to its pairs),
        pairs of it cut to its length, and the step's dropout and routing key."""
        generator = np.random.default_rng([self.config.seed, step])
        length, size, members = self.buckets[int(generator.choice(len(self.buckets), p=self._bucket_weights))]
        rows = members[generator.integers(0, len(members), size)]
        return {"source": self.model.shard_batch(self.source[rows, :length]),
                "target": self.model.shard_batch(self.target[rows, :length]), "rng": self._key_at(step)}

    def trainer(self, run_dir: pathlib.Path):
        """The campaign's :class:`~carlskit.training.Trainer`, at the newest intact state of ``run_dir``."""
        from carlskit.checkpoints import CheckpointStore
        from carlskit.moe._translation import _pairs_loss
        from carlskit.training import Trainer

        return Trainer(self.model, self.optimizer(), _pairs_loss, check_finite=False,
                       checkpoints=CheckpointStore(run_dir / STATE_DIR, keep=2),
                       checkpoint_every=self.config.validate_every_steps)

    def validate(self, beam_size: int = 1) -> dict[str, float]:
        """Validation BLEU / chrF of the model as it is now: the mean over the reported X -> English
        tags (``bleu_top``, ``chrf_top``) and each English -> X tag (``bleu_en_fr``, ...)."""
        return self._summary(self.model.translate(self.validation[0], self.validation[2], beam_size=beam_size),
                             self.validation)

    def _summary(self, hypotheses: list[str], validation: tuple) -> dict[str, float]:
        from carlskit.moe._translation import translation_scores

        _, references, tags = validation
        scores = translation_scores(hypotheses, references, tags)
        into_english = [tag for tag in scores if tag != "mean" and not tag.startswith("2")]
        out = {"bleu_top": float(np.mean([scores[t]["bleu"] for t in into_english])),
               "chrf_top": float(np.mean([scores[t]["chrf"] for t in into_english]))}
        for lang in self.config.from_english:
            out[f"bleu_en_{lang}"] = scores[f"2{lang}"]["bleu"]
        return out


def load_config(run_dir: str | os.PathLike) -> TranslatorConfig:
    """The stored configuration of the campaign in ``run_dir`` (checksummed; damage is a
    :class:`carlskit.CorruptFileError`)."""
    path = pathlib.Path(run_dir) / CONFIG_NAME
    if not path.exists():
        raise FileNotFoundError(f"no translator campaign in {str(run_dir)!r} ({CONFIG_NAME} missing); "
                                "start one with --campaign")
    return TranslatorConfig.from_json(loads_checked_json(path.read_bytes(), path))


def run_translator_campaign(run_dir: str | os.PathLike, config: TranslatorConfig | None = None, *,
                            resume: bool = False, stop_step: int | None = None, minutes: float | None = None,
                            log: Callable[[str], None] = print) -> tuple[TranslatorCampaign, Any, list[dict]]:
    """Start (``resume=False``: ``config`` in a new ``run_dir``) or continue (``resume=True``: the
    stored config, from the newest intact state) a campaign until step ``stop_step`` or ``minutes``
    of wall time. Saves and logs a validation line every ``validate_every_steps`` and on the way out;
    SIGINT or SIGTERM stop it at the next step, saved (a second SIGINT: at once, unsaved).
    Returns ``(campaign, trainer, log records)``."""
    run_dir = pathlib.Path(run_dir)
    if stop_step is not None:
        stop_step = integer(stop_step, "stop_step", minimum=0)
    if minutes is not None:
        minutes = positive_float(minutes, "minutes")
    if resume:
        config = load_config(run_dir)
    else:
        if (run_dir / CONFIG_NAME).exists():
            raise FileExistsError(f"{run_dir} already holds a translator campaign; continue it with --resume")
        config = TranslatorConfig() if config is None else config
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(*filesystem(run_dir / CONFIG_NAME), dumps_checked_json(config.to_json()))
    campaign = TranslatorCampaign(config)
    trainer = campaign.trainer(run_dir)
    records = repair_log(run_dir / LOG_NAME, trainer.step)
    clock = CampaignClock(records[-1]["cpu_seconds"] if records else 0.0,
                          records[-1]["wall_seconds"] if records else 0.0)
    log(f"{'resumed at' if trainer.step else 'starting at'} step {trainer.step}: {len(campaign.source):,} training "
        f"pairs, {len(campaign.tags)} tags, {_parameters(campaign.model):,} parameters")
    every = config.validate_every_steps

    def save_and_log(losses: list[float]) -> None:
        if records and records[-1]["step"] == trainer.step:  # stopped before its first step: saved already
            return
        trainer.sync()
        trainer.save_checkpoint()
        scores = campaign.validate()
        record = {"step": trainer.step, "cpu_seconds": clock.cpu_seconds, "wall_seconds": clock.wall_seconds,
                  "train_loss": float(np.mean(losses)) if losses else None,
                  **{f"valid_{k}": round(v, 3) for k, v in scores.items()},
                  **{f"copy_{k}": round(v, 3) for k, v in campaign.copy_scores.items()}}
        append_log_line(run_dir / LOG_NAME, record)
        records.append(record)
        log(f"step {record['step']}: loss {record['train_loss']}, validation BLEU top-{TOP_LANGUAGES} "
            f"{record['valid_bleu_top']:.2f}, " + ", ".join(f"en-{lang} {record[f'valid_bleu_en_{lang}']:.2f}"
                                                            for lang in config.from_english)
            + f" ({record['cpu_seconds'] / 3600:.2f} CPU-hours)")

    if not records:
        save_and_log([])
    deadline = math.inf if minutes is None else time.monotonic() + 60.0 * minutes
    with stop_requests() as stop_requested:
        while (stop_step is None or trainer.step < stop_step) and not stop_requested() \
                and time.monotonic() < deadline:
            steps = every - trainer.step % every
            if stop_step is not None:
                steps = min(steps, stop_step - trainer.step)
            first = len(trainer.history)
            handle = trainer.fit(campaign.batch_at, steps, block=False, progress=False, live=False)
            while not handle.done:
                if stop_requested() or time.monotonic() >= deadline:
                    handle.stop()
                time.sleep(0.2)
            handle.wait()
            save_and_log([r["loss"] for r in list(trainer.history)[first:]])
    return campaign, trainer, records


def _parameters(model) -> int:
    import jax
    from flax import nnx

    return int(sum(np.size(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))))
