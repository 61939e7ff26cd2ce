"""CARLS section 4.3: trainer step time as the number of contrastive negatives N grows.

Two modes, same two-tower model (image MLP and caption MLP, hidden 1024), same batch of B pairs,
symmetric InfoNCE over the batch plus N negatives:
- bank:     the negatives' embeddings are read from the knowledge bank by the input pipeline
            (:class:`carlskit.training.BankNegatives`) and arrive in the batch as [N, D] arrays;
            the step encodes only the B pairs and scores them against the N constants.
- baseline: the batch carries the N negatives' raw images and captions and the step encodes them
            itself (forward and backward through both towers, as with in-batch negatives).
Step time: the median of the trainer's own per-step times (the jitted step, synchronised) after a
compile warm-up, measured round-robin over the configurations so a shared machine's load changes
hit them all alike.

    python benchmarks/negatives.py [--small]
Last line: JSON with bank_t4096_over_t16, baseline_t4096_over_t16 and per-N times.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

from carlskit.bank import KnowledgeBank
from carlskit.data import VOCABULARY, load_captioned_digits
from carlskit.paradigms.two_tower import TABLES, TwoTower, encode, loss_fn
from carlskit.training import BankNegatives, Trainer

TEMPERATURE = 0.05


def _in_step_info_nce(queries, positives, negatives):
    """InfoNCE over [positives; negatives] with cosine scores, gradients into both (no bank)."""
    candidates = jnp.concatenate([positives, negatives])
    candidates = candidates / jnp.linalg.norm(candidates, axis=-1, keepdims=True)
    queries = queries / jnp.linalg.norm(queries, axis=-1, keepdims=True)
    log_probabilities = jax.nn.log_softmax(queries @ candidates.T / TEMPERATURE, axis=1)
    return -jnp.mean(jnp.diagonal(log_probabilities))


def baseline_loss(model, batch):
    """The same symmetric InfoNCE, the negatives encoded inside the step (forward and backward)."""
    images, texts = model.embed_images(batch["images"]), model.embed_texts(batch["tokens"])
    negative_images = model.embed_images(batch["negative_pixels"])
    negative_texts = model.embed_texts(batch["negative_tokens"])
    image_to_text = _in_step_info_nce(images, texts, negative_texts)
    return (image_to_text + _in_step_info_nce(texts, images, negative_images)) / 2, {}


def pairs(data, batch_size: int, num_negatives: int = 0, seed: int = 0):
    """f(step) -> B training pairs; with ``num_negatives`` also that many other pairs' raw inputs."""
    rng = np.random.default_rng(seed)

    def batch(step: int) -> dict:
        ids = rng.choice(data.train_idx, batch_size + num_negatives, replace=False)
        positives, negatives = ids[:batch_size], ids[batch_size:]
        out = {"ids": positives, "images": data.images[positives], "tokens": data.tokens[positives]}
        if num_negatives:
            out["negative_pixels"] = data.images[negatives]
            out["negative_tokens"] = data.tokens[negatives]
        return out

    return batch


def interleaved_step_seconds(runs: dict, rounds: int, steps: int, warmup: int) -> dict:
    """Median step time of each ``(trainer, data)`` in ``runs``, measured round-robin (``rounds``
    rounds of ``steps`` steps each, after ``warmup`` compile steps), so load changes on a shared
    machine hit every configuration alike."""
    times: dict = {name: [] for name in runs}
    for trainer, data in runs.values():
        trainer.fit(data, warmup, progress=False, live=False)
    for _ in range(rounds):
        for name, (trainer, data) in runs.items():
            first = len(trainer.history)
            trainer.fit(data, steps, progress=False, live=False)
            times[name] += [record["step_seconds"] for record in trainer.history[first:]]
    return {name: float(np.median(values)) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    args = parser.parse_args()
    small = args.small or os.environ.get("CARLSKIT_SMALL") == "1"
    counts = [16, 256, 4096]
    batch_size, hidden, dim = 256, 1024, 128
    rounds, steps, warmup = (3, 2, 1) if small else (5, 2, 2)
    data = load_captioned_digits(9216, num_test=1024, seed=0)
    make_model = functools.partial(TwoTower, data.images.shape[1], len(VOCABULARY), hidden=hidden, dim=dim, seed=0)

    bank = KnowledgeBank()
    for table in TABLES:
        bank.create_table(table, dim=dim, initializer="zeros")
    written = encode(make_model(), {"images": jnp.asarray(data.images[data.train_idx]),
                                    "tokens": jnp.asarray(data.tokens[data.train_idx])})
    for table, values in written.items():
        bank.update(table, data.train_idx, np.asarray(values), version=0)

    loss = functools.partial(loss_fn, temperature=TEMPERATURE)
    runs = {}
    for n in counts:
        negatives = BankNegatives(bank, TABLES, num_negatives=n, candidates=data.train_idx)
        bank_trainer = Trainer(make_model(), optax.adam(1e-3), loss, knowledge=negatives)
        runs[("bank", n)] = (bank_trainer, pairs(data, batch_size))
        runs[("baseline", n)] = (Trainer(make_model(), optax.adam(1e-3), baseline_loss), pairs(data, batch_size, n))
    seconds = interleaved_step_seconds(runs, rounds, steps, warmup)
    results: dict = {"batch_size": batch_size, "hidden": hidden, "dim": dim, "negatives": counts,
                     "bank_step_s": {n: seconds[("bank", n)] for n in counts},
                     "baseline_step_s": {n: seconds[("baseline", n)] for n in counts}}
    for n in counts:
        print(f"N={n:5d}  bank {results['bank_step_s'][n] * 1e3:9.2f} ms/step   "
              f"baseline {results['baseline_step_s'][n] * 1e3:9.2f} ms/step", file=sys.stderr, flush=True)
    results["bank_t4096_over_t16"] = results["bank_step_s"][4096] / results["bank_step_s"][16]
    results["baseline_t4096_over_t16"] = results["baseline_step_s"][4096] / results["baseline_step_s"][16]
    bank.close()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
