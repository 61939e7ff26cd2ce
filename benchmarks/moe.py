"""GShard MoE benchmark: expert scaling, MoE vs dense FFN, capacity factor sweep.

Run from the repo root: ``python benchmarks/moe.py [--small]`` (or CARLSKIT_SMALL=1).
Prints progress, then ONE JSON object as the last line of stdout.

- ``t64_over_t8``: MoE layer forward+backward time with E=64 over E=8 experts, at fixed tokens
  per group S, groups G and capacity factor (so E * C is constant), default (scatter) dispatch.
  Target <= 1.5 (GShard: 1.7x for 16x experts and devices). Every layer variant is timed
  interleaved (``benchmarks/_timing.py``); ratios are medians of per-round ratios, with
  ``t64_over_t8_spread`` (and ``_spread`` beside each ratio) saying how far the rounds disagreed.
- ``moe_vs_dense_speed``: dense FFN time / MoE layer time, the dense FFN having the MoE's
  per-token FLOPs (width 2 * H for top-2), capacity factor 1.0 (MoE buffers then hold exactly the
  2 assignments per token the dense FFN pays for). Target >= 0.5.
- ``capacity_factors``: dropped-token fractions and train-step time of a small MoEModel trained on
  the toy multilingual corpus, for capacity factors 1.0, 1.25, 2.0, with and without aux loss.
- ``text_moe_bpb`` / ``text_dense_bpb``: validation bits per byte after the same number of steps
  of byte-level LMs on real English text (``pydoc_data.topics``, held-out paragraphs), MoE with 8
  and 32 experts (top-2) vs the dense model of equal per-token FLOPs, mean over ``--seeds`` seeds
  (``text_bpb_per_seed``, ``text_bpb_spread`` = max - min over seeds, ``text_moe_wins`` = seeds
  where the MoE model is below the dense one, ``text_train_seconds`` = mean training wall time).
  ``--only text`` runs just this part.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from carlskit.moe import (  # noqa: E402
    FeedForward,
    MoEFeedForward,
    MoEModel,
    text_lm_comparison,
    toy_multilingual_corpus,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import interleave, medians, ratio  # noqa: E402


def interleaved_times(calls: dict, rounds: int, calls_per_sample: int = 3) -> dict:
    """Seconds per call of each zero-argument call, sampled interleaved ``rounds`` times
    (``benchmarks/_timing.py``: one sample of each per round, order rotated) after one warm-up
    (compilation) call each; a sample is ``calls_per_sample`` calls in a row. Returns
    ``{name: [seconds per call, per round]}``; ratios are formed per round, so every pair compared
    was measured seconds apart, under the same load from other processes."""
    for call in calls.values():
        jax.block_until_ready(call())

    def sample(call):
        def run() -> float:
            start = time.perf_counter()
            for _ in range(calls_per_sample):
                jax.block_until_ready(call())
            return (time.perf_counter() - start) / calls_per_sample

        return run

    return interleave({name: sample(call) for name, call in calls.items()}, rounds, warmup=False)


def forward_backward(layer: nnx.Module):
    """jit(grad) of sum(layer(x)**2) w.r.t. parameters and x: one training step's compute."""
    graphdef, params = nnx.split(layer)

    def loss(params, x):
        out = nnx.merge(graphdef, params)(x)
        y = out[0] if isinstance(out, tuple) else out
        aux = out[1].aux_loss if isinstance(out, tuple) else 0.0
        return jnp.mean(jnp.square(y)) + 1e-2 * aux

    step = jax.jit(jax.grad(loss, argnums=(0, 1)))
    return lambda x: step(params, x)


def moe_step(x, d_model, hidden, num_experts, capacity_factor, dispatch):
    layer = MoEFeedForward(
        d_model, hidden, num_experts, capacity_factor=capacity_factor, second_expert_policy="all",
        dispatch=dispatch, rngs=nnx.Rngs(0),
    )
    step = forward_backward(layer)
    return lambda: step(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", default=os.environ.get("CARLSKIT_SMALL") == "1")
    parser.add_argument("--only", choices=("layers", "scaling", "text"), default=None,
                        help="run one part only (scaling: the layer timings without the capacity-factor sweep)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the text comparison")
    parser.add_argument("--jobs", type=int, default=1, help="processes for the text comparison (one seed each)")
    args = parser.parse_args()
    small = args.small
    groups, group_size, d_model, hidden = (4, 128, 32, 128) if small else (8, 256, 64, 256)
    rounds = 5 if small else 21
    x = jnp.asarray(np.random.default_rng(0).normal(size=(groups, group_size, d_model)).astype(np.float32))
    result: dict = {
        "device": jax.devices()[0].platform,
        "tokens": groups * group_size, "group_size": group_size, "d_model": d_model, "expert_hidden": hidden,
    }
    if args.only != "text":
        layer_benchmarks(result, x, small, rounds, sweep=args.only != "scaling")
    if args.only not in ("layers", "scaling"):
        text_benchmark(result, small, args.seeds, args.jobs)
    result["small"] = small
    print(json.dumps(result))


def _report(run: dict) -> None:
    print(f"[text] seed {run['seed']} experts {run['num_experts']}: validation bpb "
          f"{[round(b, 3) for b in run['validation_bpb']]} at steps {run['steps']}, "
          f"{run['seconds'][-1]:.1f} s training", flush=True)


def _text_seed(seed: int, size: str) -> list[dict]:
    """One seed's runs (a process-pool task: module-level so spawn can import it)."""
    return text_lm_comparison((0, 8, 32), seeds=(seed,), size=size, callback=_report)


def text_benchmark(result: dict, small: bool, seeds: int, jobs: int = 1) -> None:
    """MoE (8, 32 experts) vs dense of equal per-token FLOPs on real text, ``seeds`` seeds
    (``jobs`` > 1: seeds in parallel processes, so training wall times are then shared-CPU times)."""
    size = "small" if small else "full"
    if jobs > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            runs = [run for seed_runs in pool.map(_text_seed, range(seeds), [size] * seeds) for run in seed_runs]
    else:
        runs = text_lm_comparison((0, 8, 32), seeds=range(seeds), size=size, callback=_report)
    final = {}
    for run in runs:
        final.setdefault(run["num_experts"], []).append(run["validation_bpb"][-1])
    dense = np.asarray(final[0])
    result["text_dense_bpb"] = round(float(dense.mean()), 4)
    result["text_moe_bpb"] = {str(e): round(float(np.mean(final[e])), 4) for e in (8, 32)}
    result["text_bpb_per_seed"] = {str(e): [round(b, 4) for b in final[e]] for e in final}
    result["text_bpb_spread"] = {str(e): round(float(np.ptp(final[e])), 4) for e in final}
    result["text_moe_wins"] = {str(e): int(np.sum(np.asarray(final[e]) < dense)) for e in (8, 32)}
    result["text_train_seconds"] = {
        str(e): round(float(np.mean([r["seconds"][-1] for r in runs if r["num_experts"] == e])), 1) for e in final
    }
    result["text_steps"] = runs[0]["steps"][-1]
    result["text_seeds"] = seeds
    result["text_jobs"] = jobs
    result["text_bpb_curves"] = {
        f"E{r['num_experts']}_seed{r['seed']}": {"steps": r["steps"], "seconds": [round(t, 2) for t in r["seconds"]],
                                                 "bpb": [round(b, 4) for b in r["validation_bpb"]]}
        for r in runs
    }


def layer_benchmarks(result: dict, x: jax.Array, small: bool, rounds: int, sweep: bool = True) -> None:
    """Expert scaling, MoE vs dense FFN speed, and (``sweep``) the capacity-factor sweep."""
    d_model = x.shape[-1]
    hidden = 128 if small else 256

    # 1. Expert scaling at fixed tokens per group and capacity factor (E * C = 4 S constant), and
    # 2. the MoE layer vs a dense FFN with the same per-token FLOPs (top-2: dense width 2 * hidden).
    calls = {}
    for dispatch in ("scatter", "einsum"):
        for num_experts in (8, 16, 32, 64):
            calls[(dispatch, num_experts)] = moe_step(x, d_model, hidden, num_experts, 2.0, dispatch)
    for capacity_factor in (1.0, 1.25, 2.0):
        calls[("capacity", capacity_factor)] = moe_step(x, d_model, hidden, 8, capacity_factor, "scatter")
    dense_step = forward_backward(FeedForward(d_model, 2 * hidden, rngs=nnx.Rngs(0)))
    calls[("dense", 2 * hidden)] = lambda: dense_step(x)
    samples = interleaved_times({f"{kind}:{value}": call for (kind, value), call in calls.items()}, rounds)
    times = {tuple(name.split(":")): t for name, t in medians(samples).items()}
    times = {(kind, float(value) if kind == "capacity" else int(value)): t for (kind, value), t in times.items()}
    for (kind, value), t in times.items():
        print(f"[layer] {kind} {value}: {1e3 * t:.2f} ms", flush=True)
    result["step_ms_by_experts"] = {
        d: {e: round(1e3 * times[(d, e)], 3) for e in (8, 16, 32, 64)} for d in ("scatter", "einsum")
    }
    for key, numerator, denominator in (("t64_over_t8", "scatter:64", "scatter:8"),
                                        ("t64_over_t8_einsum", "einsum:64", "einsum:8")):
        result.update({name: round(value, 3) for name, value in ratio(samples, numerator, denominator, key).items()})
    result["einsum_over_scatter_E8"] = round(times[("einsum", 8)] / times[("scatter", 8)], 3)
    result["dense_ms"] = round(1e3 * times[("dense", 2 * hidden)], 3)
    for capacity_factor in (1.0, 1.25, 2.0):
        speed = ratio(samples, f"dense:{2 * hidden}", f"capacity:{capacity_factor}",
                      f"moe_vs_dense_speed_cf{capacity_factor}")
        result.update({name: round(value, 3) for name, value in speed.items()})
    result["moe_vs_dense_speed"] = result["moe_vs_dense_speed_cf1.0"]
    result["moe_vs_dense_speed_spread"] = result["moe_vs_dense_speed_cf1.0_spread"]

    # 3. Capacity factor x aux loss: drops and train-step time of a small MoEModel.
    if not sweep:
        return
    length, steps = (32, 60) if small else (64, 200)
    corpus, _ = toy_multilingual_corpus(512 if small else 2048, length, vocab_size=64, num_languages=8)
    sweep = {}
    for capacity_factor in (1.0, 1.25, 2.0):
        for aux_loss_weight in (0.0, 1e-2):
            model = MoEModel(
                64, 2, 32, 2, 8, capacity_factor=capacity_factor, aux_loss_weight=aux_loss_weight,
                max_length=length, seed=0,
            )
            history = model.fit(corpus, steps=steps, batch_size=16, learning_rate=3e-3, seed=0)
            tail = slice(-max(1, steps // 5), None)
            step_seconds = np.diff(history.column("seconds"))[tail]
            entry = {
                "dropped_tokens": round(float(np.mean(history.column("dropped_tokens")[tail])), 4),
                "dropped_first": round(float(np.mean(history.column("dropped_first")[tail])), 4),
                "dropped_second": round(float(np.mean(history.column("dropped_second")[tail])), 4),
                "max_expert_load": round(float(np.max(np.mean(history.column("expert_load")[tail], axis=0))), 4),
                "cross_entropy": round(float(np.mean(history.column("cross_entropy")[tail])), 4),
                "step_ms": round(1e3 * float(np.median(step_seconds)), 3),
            }
            sweep[f"cf{capacity_factor}_aux{aux_loss_weight}"] = entry
            print(f"[capacity] cf={capacity_factor} aux={aux_loss_weight} {entry}", flush=True)
    result["capacity_factors"] = sweep


if __name__ == "__main__":
    main()
