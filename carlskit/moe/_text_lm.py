"""MoE vs dense byte-level language models on real text: one routine for notebook 05 and
``benchmarks/moe.py``."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from carlskit._checks import choice, positive_int
from carlskit.moe._data import BYTE_VOCAB_SIZE, PAD_ID, stdlib_text_corpus
from carlskit.moe._model import MoEModel

# "small" keeps a headless notebook run (CARLSKIT_SMALL=1) to about a minute on a shared CPU; it
# is too short for the MoE models to pull ahead reliably. "full" is the benchmark's size: 1000 steps,
# past the steep part of the learning curve (at 300 steps every model still fell 0.15-0.25 bpb per 50
# steps and the seeds' spread hid the gap; from step ~450 on the 8-expert model stays below dense).
#: The problem sizes of the byte-level text language-model benchmark (``small`` for tests and
#: notebooks, ``full`` for the benchmark): model widths, steps, batch and sequence lengths.
TEXT_LM_SIZES: dict[str, dict[str, Any]] = {
    "small": dict(length=32, d_model=32, num_heads=2, ffn_dim=64, num_layers=2, batch_size=16, steps=90,
                  eval_every=30, validation_rows=64, learning_rate=5e-3),
    "full": dict(length=64, d_model=64, num_heads=4, ffn_dim=128, num_layers=2, batch_size=32, steps=1000,
                 eval_every=50, validation_rows=128, learning_rate=5e-3),
}


def text_lm_comparison(
    num_experts: Sequence[int] = (0, 8, 32),
    *,
    seeds: Sequence[int] = (0,),
    size: str = "full",
    capacity_factor: float = 1.25,
    second_expert_policy: str = "all",
    dtype: Any = jnp.float32,
    steps: int | None = None,
    callback: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Train byte-level LMs on :func:`~carlskit.moe.stdlib_text_corpus` and track validation
    bits per byte.

    For each seed and each entry of ``num_experts`` (0 = the dense model of equal per-token FLOPs:
    its MoE slot is an FFN of width 2 * ffn_dim), an :class:`~carlskit.moe.MoEModel` with the
    same embedding, attention and dense layers is trained for the same steps on the same batches
    (top-2, ``pad_id`` routing of the variable-length paragraphs). Policy "all" by default: every
    token is sent to both its experts (as far as capacity allows), so the MoE models do the dense
    model's per-token FLOPs rather than fewer. Validation
    bits per byte = cross-entropy in nats over the held-out paragraphs' real bytes / ln 2.

    Returns one dict per run: ``num_experts``, ``seed``, ``parameters``, ``steps`` (evaluation
    points), ``seconds`` (training wall time at those points, evaluation excluded),
    ``validation_bpb``, ``history`` (the full :meth:`~carlskit.moe.MoEModel.fit` history).
    ``callback(run)`` is called after each run; ``steps`` overrides the size's step count.
    """
    choice(size, "size", tuple(TEXT_LM_SIZES))
    config = dict(TEXT_LM_SIZES[size])
    if steps is not None:
        config["steps"] = positive_int(steps, "steps")
    train, validation = stdlib_text_corpus(config["length"])
    validation = validation[: config["validation_rows"]]
    runs = []
    for seed in seeds:
        for experts in num_experts:
            model = MoEModel(
                BYTE_VOCAB_SIZE, config["num_layers"], config["d_model"], config["num_heads"], experts,
                ffn_dim=config["ffn_dim"], max_length=config["length"], pad_id=PAD_ID,
                capacity_factor=capacity_factor, second_expert_policy=second_expert_policy, dtype=dtype,
                seed=seed,
            )
            history = model.fit(
                train, steps=config["steps"], batch_size=config["batch_size"],
                learning_rate=config["learning_rate"], seed=seed, eval_tokens=validation,
                eval_every=config["eval_every"],
            )
            evaluated = [record for record in history if "eval_loss" in record]
            run = {
                "num_experts": int(experts),
                "seed": int(seed),
                "parameters": int(sum(np.size(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))),
                "steps": [record["step"] for record in evaluated],
                "seconds": [record["seconds"] for record in evaluated],
                "validation_bpb": [record["eval_loss"] / math.log(2.0) for record in evaluated],
                "history": history,
            }
            runs.append(run)
            if callback is not None:
                callback(run)
    return runs
