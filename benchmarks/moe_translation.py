"""GShard's translation experiment in miniature: dense vs MoE-8 vs MoE-32 encoder-decoders on the
Django corpus (``data/translation``), BLEU per language.

Run from the repo root: ``python benchmarks/moe_translation.py [--small] [--seeds 0 1 2] [--steps N]``.
Prints progress and the per-language table on stderr, then ONE JSON object as the last line of stdout:

- ``test_bleu_dense``, ``test_bleu_moe_8``, ``test_bleu_moe_32``: test BLEU (sacrebleu corpus BLEU
  per tag, greedy), mean over tags (all 98 languages into English, English into fr and de), mean
  over seeds; ``test_chrf_*`` the same for chrF; ``bleu_per_seed`` the mean BLEU of each run.
- ``bleu_seed_spread``: the seed standard deviation (ddof=1) of a run's mean BLEU, the largest over
  the three models (``bleu_seed_std`` has each model's). The bar compares the difference of two
  models' seed means with it.
- ``bleu_gain_moe_32_per_seed``: MoE-32 minus dense per seed. Runs of one seed are paired: the same
  batches in the same order and the same dropout / routing random stream (the parameters differ:
  the models have different shapes); ``bleu_gain_moe_32_std`` their standard deviation (ddof=1).
- ``beam4_over_greedy_bleu``: beam search (4, alpha 0.6) BLEU over greedy BLEU, MoE-32 of the first
  seed, on the first 8 test pairs of each tag (``beam_test_pairs``; beam 4 on all costs 4 greedy
  decodings).
- ``cached_over_uncached_decode_speed``: greedy decoding tokens per second with the key-value cache
  over without (the prefix re-run each step), one batch of 64 test sources, MoE-32 seed 0, fastest
  of 3; ``cached_equals_uncached``: the two decodings' ids are equal.
- ``per_language``: tag -> training pairs, mean BLEU of each model, gain of MoE-32 over dense.

``--plot FILE.png`` also draws GShard's picture from ``per_language``: each tag's BLEU gain of MoE-32
over dense against its training pairs, with the mean of five size bands; ``--plot-from RESULT``
draws it from a saved run's output (its last line) without training.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from carlskit.moe import translation_comparison, translation_scores  # noqa: E402

NAMES = {0: "dense", 8: "moe_8", 32: "moe_32"}


def decode_speed(model, source: np.ndarray, rounds: int = 3) -> dict:
    """Greedy decoding of ``source`` with and without the cache: fastest of ``rounds`` after a warm-up."""
    best, outputs = {}, {}
    for cached in (True, False):
        outputs[cached] = model.generate(source, cached=cached, batch_size=len(source))  # compiles
        times = []
        for _ in range(rounds):
            started = time.perf_counter()
            model.generate(source, cached=cached, batch_size=len(source))
            times.append(time.perf_counter() - started)
        best[cached] = min(times)
    tokens = int(np.sum(outputs[True] != 256))  # emitted tokens (EOS included), the same both ways
    return {"cached_tokens_per_second": tokens / best[True], "uncached_tokens_per_second": tokens / best[False],
            "cached_over_uncached_decode_speed": best[False] / best[True],
            "cached_equals_uncached": bool(np.array_equal(outputs[True], outputs[False]))}


def plot_gain(out: dict, path: str) -> None:
    """Each tag's BLEU gain of MoE-32 over dense (mean over seeds) against its training pairs, and
    the mean gain of five bands of equal tag count (GShard's figure of gain against data size)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(out["per_language"].items(), key=lambda item: item[1]["train_pairs"])
    sizes = np.array([row["train_pairs"] for _, row in rows])
    gains = np.array([row["gain_moe_32"] for _, row in rows])
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.scatter(sizes, gains, s=10, alpha=0.6, label="one tag (mean over seeds)")
    for band in np.array_split(np.arange(len(rows)), 5):
        ax.plot([sizes[band].min(), sizes[band].max()], [gains[band].mean()] * 2, color="C3", lw=2)
    ax.plot([], [], color="C3", lw=2, label="mean of each fifth of the tags, by size")
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xscale("log")
    ax.set_xlabel("training pairs of the tag (log)")
    ax.set_ylabel("BLEU gain, MoE-32 - dense")
    ax.set_title(f"{out['steps']} steps, seeds {out['seeds']}: mean gain "
                 f"{out['test_bleu_moe_32'] - out['test_bleu_dense']:+.2f} BLEU")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", default=os.environ.get("CARLSKIT_SMALL") == "1")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--plot", default=None, help="also write the gain-against-size figure here (PNG)")
    parser.add_argument("--plot-from", default=None, help="a saved run's output: only draw --plot from it")
    args = parser.parse_args()
    if args.plot_from:
        if not args.plot:
            parser.error("--plot-from needs --plot FILE.png")
        with open(args.plot_from) as file:
            plot_gain(json.loads(file.read().strip().splitlines()[-1]), args.plot)
        return
    size = "small" if args.small else "full"
    started = time.perf_counter()

    def progress(run, step, record):
        if (step + 1) % 100 == 0:
            print(f"  E={run['num_experts']} seed {run['seed']} step {step + 1}: cross-entropy "
                  f"{record['cross_entropy']:.3f}", file=sys.stderr, flush=True)

    def finished(run):  # every run's scores as they come, so a cut-short run still leaves its figures
        print("RUN " + json.dumps({"num_experts": run["num_experts"], "seed": run["seed"],
                                   "train_seconds": run["train_seconds"], "valid_loss": run["valid_loss"],
                                   "scores": run["scores"]}), file=sys.stderr, flush=True)

    result = translation_comparison((0, 8, 32), seeds=args.seeds, size=size, steps=args.steps, callback=progress,
                                    on_run=finished)
    runs, tags, test = result["runs"], result["tags"], result["test"]
    out: dict = {"size": size, "steps": result["config"]["steps"], "seeds": args.seeds, "tags": tags,
                 "train_pairs": sum(result["train_sizes"].values()), "test_pairs": len(test),
                 "devices": str(jax.devices()), "load_average": os.getloadavg()[0]}
    out["bleu_per_seed"] = {NAMES[e]: [r["scores"]["mean"]["bleu"] for r in runs if r["num_experts"] == e]
                            for e in NAMES}
    for e, name in NAMES.items():
        mine = [r for r in runs if r["num_experts"] == e]
        out[f"test_bleu_{name}"] = float(np.mean([r["scores"]["mean"]["bleu"] for r in mine]))
        out[f"test_chrf_{name}"] = float(np.mean([r["scores"]["mean"]["chrf"] for r in mine]))
        out[f"train_seconds_{name}"] = float(np.mean([r["train_seconds"] for r in mine]))
        out[f"parameters_{name}"] = mine[0]["parameters"]
        out[f"valid_cross_entropy_{name}"] = float(np.mean([r["valid_loss"] for r in mine]))
    spread = (lambda v: float(np.std(v, ddof=1))) if len(args.seeds) > 1 else (lambda v: 0.0)
    out["bleu_seed_std"] = {name: spread(v) for name, v in out["bleu_per_seed"].items()}
    out["bleu_seed_spread"] = max(out["bleu_seed_std"].values())
    gains = np.subtract(out["bleu_per_seed"]["moe_32"], out["bleu_per_seed"]["dense"])
    out["bleu_gain_moe_32_per_seed"] = gains.tolist()
    out["bleu_gain_moe_32_std"] = spread(gains)
    out["per_language"] = {
        tag: {"train_pairs": result["train_sizes"][tag], "test_pairs": result["test_sizes"][tag],
              **{name: float(np.mean([r["scores"][tag]["bleu"] for r in runs if r["num_experts"] == e]))
                 for e, name in NAMES.items()}}
        for tag in tags
    }
    for row in out["per_language"].values():
        row["gain_moe_32"] = row["moe_32"] - row["dense"]
    print("SCORES " + json.dumps(out), file=sys.stderr, flush=True)  # the bar's figures, before decoding tests
    best = next(r for r in runs if r["num_experts"] == 32 and r["seed"] == args.seeds[0])
    model = best["model"]
    first, counts = [], collections.Counter()  # the first 8 test pairs of each tag
    for i, t in enumerate(test):
        counts[t[0]] += 1
        if counts[t[0]] <= 8:
            first.append(i)
    subset = [test[i] for i in first]
    beam = model.translate([t[1] for t in subset], [t[0] for t in subset], beam_size=4)
    beam_scores = translation_scores(beam, [t[2] for t in subset], [t[0] for t in subset])
    greedy_scores = translation_scores([best["hypotheses"][i] for i in first], [t[2] for t in subset],
                                       [t[0] for t in subset])
    out["beam_test_pairs"] = len(subset)
    out["test_bleu_moe_32_greedy_subset"] = greedy_scores["mean"]["bleu"]
    out["test_bleu_moe_32_beam4"] = beam_scores["mean"]["bleu"]
    out["beam4_over_greedy_bleu"] = beam_scores["mean"]["bleu"] / max(greedy_scores["mean"]["bleu"], 1e-9)
    source = model.encode_sources([t[1] for t in test[:64]], [t[0] for t in test[:64]])
    out.update(decode_speed(model, source))
    out["examples"] = [{"tag": t[0], "source": t[1], "reference": t[2], "greedy": best["hypotheses"][i], "beam4": b}
                       for i, t, b in list(zip(first, subset, beam))[:: max(1, len(subset) // 12)]]
    out["wall_seconds"] = time.perf_counter() - started
    out["load_average_end"] = os.getloadavg()[0]
    print(f"{'tag':>6} {'train':>6} {'dense':>6} {'moe_8':>6} {'moe_32':>6} {'gain':>6}", file=sys.stderr)
    for tag, row in sorted(out["per_language"].items(), key=lambda item: -item[1]["train_pairs"]):
        print(f"{tag:>6} {row['train_pairs']:>6} {row['dense']:6.2f} {row['moe_8']:6.2f} {row['moe_32']:6.2f} "
              f"{row['gain_moe_32']:+6.2f}", file=sys.stderr)
    if args.plot:
        plot_gain(out, args.plot)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
