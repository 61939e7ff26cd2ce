"""Meta-train the learned optimizer that ships with carlskit (``LearnedOptimizer.pretrained()``) on
carlskit's own :class:`~carlskit.lopt.MetaTraining` cluster, then compare it with tuned Adam.

Reproduce the committed file (the time it took is stored in its ``info``)::

    python -m carlskit.lopt.train_pretrained --out carlskit/lopt/pretrained_mlp_lopt.npz

What it does:

1. Starts an embedded Dask cluster (``carlskit.connect``; ``--address`` uses yours) and a
   :class:`MetaTraining` run in ``--run-dir``: ``--workers`` ES workers estimate antithetic ES
   gradients of ``HierarchicalRule`` (full 200-step inner trainings, ``--num-tasks`` pairs each) on
   :func:`~carlskit.lopt.meta_training_family`, the learner applies them with Adam, and the
   evaluation chief evaluates every checkpoint on training structures (``train_subset``, other
   instances: ``heldout``) and on :func:`~carlskit.lopt.held_out_problems` (``ood``: families never
   meta-trained on).
2. Stops after ``--minutes`` (or ``--outer-steps``), picks the checkpoint with the lowest
   ``heldout`` validation loss (training structures only: the ``ood`` set is never used to choose),
   and writes it to ``--out`` (one ``.npz``, atomic, checksummed).
3. Compares it with Adam at its best learning rate on every held-out problem
   (:func:`~carlskit.lopt.compare_to_tuned_adam`) and stores the report in the file's ``info``
   (inside the one checksummed ``.npz``, so it cannot drift from the weights): the command, config,
   compute (wall seconds, CPU-seconds, outer steps, gradients), the evaluation of every checkpoint
   (final and mean losses per task set; whole curves of the chosen one), and the comparison table.

The resumable campaign of issue 41 (:mod:`carlskit.lopt._campaign`: ``NominalAdamRule``, PES over
sampled horizons up to 5x, weight-scale augmentation, log-ratio to tuned Adam, two phases, validation
on held-out problems) runs in one process under ``nice``::

    python -m carlskit.lopt.train_pretrained --campaign --run-dir lopt_campaign --minutes 60   # start
    python -m carlskit.lopt.train_pretrained --resume --run-dir lopt_campaign --minutes 60     # continue
    python -m carlskit.lopt.train_pretrained --ship --run-dir lopt_campaign \
        --out carlskit/lopt/pretrained_mlp_lopt.npz        # only if held-out validation improves

Its complete state is saved every ``--checkpoint-every-steps`` steps or ``--checkpoint-seconds``
seconds; a killed run loses only the steps since its last save, and SIGTERM (or one Ctrl-C) stops
it at the next step boundary, saved. ``--resume`` continues with the
stored configuration (the options that set it are ignored then).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import sys
import tempfile
import time

import numpy as np


def _number(value: float) -> float | None:
    """JSON has no NaN or inf: a diverged figure is stored as null."""
    value = float(value)
    return value if np.isfinite(value) else None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="file to write (.npz appended unless given)")
    parser.add_argument("--run-dir", default=None,
                        help="MetaTraining directory (default: a temporary one; campaign: lopt_campaign)")
    parser.add_argument("--campaign", action="store_true", help="start issue 41's resumable campaign in --run-dir")
    parser.add_argument("--resume", action="store_true", help="continue the campaign saved in --run-dir")
    parser.add_argument("--ship", action="store_true",
                        help="write the campaign's best rule to --out if its held-out validation beats that file's")
    parser.add_argument("--checkpoint-every-steps", type=int, default=100, help="campaign: save every this many steps")
    parser.add_argument("--scheduler-steps", type=int, default=1000,
                        help="campaign: outer steps of phase 1 (scheduler only) before phase 2 (correction only)")
    parser.add_argument("--validate-every", type=int, default=50, help="campaign: validation period in outer steps")
    parser.add_argument("--address", default=None, help="a Dask scheduler to use instead of an embedded cluster")
    parser.add_argument("--minutes", type=float, default=45.0, help="meta-training wall-clock budget")
    parser.add_argument("--outer-steps", type=int, default=100_000, help="stop earlier at this outer step")
    parser.add_argument("--workers", type=int, default=2, help="ES workers")
    parser.add_argument("--num-tasks", type=int, default=8, help="antithetic pairs per gradient")
    parser.add_argument("--horizon", type=int, default=200, help="inner steps per training (also the evaluation's)")
    parser.add_argument("--std", type=float, default=0.03, help="ES perturbation standard deviation")
    parser.add_argument("--meta-learning-rate", type=float, default=1e-2, help="Adam on the meta-parameters")
    parser.add_argument("--initial-learning-rate", type=float, default=3e-3, help="the untrained rule's Adam step")
    parser.add_argument("--checkpoint-seconds", type=float, default=180.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--family", choices=("shipped", "wide"), default=None,
                        help="meta-training distribution: meta_training_family() or wide_meta_training_family()")
    parser.add_argument("--estimator", choices=("es", "pes"), default="es", help="full-unroll ES or truncated PES")
    parser.add_argument("--truncation", type=int, default=50, help="PES: inner steps per estimate")
    parser.add_argument("--min-horizon", type=int, default=None, help="PES: episode lengths log-uniform from here")
    parser.add_argument("--aggregation", choices=("mean", "last"), default="mean", help="meta-objective per unroll")
    parser.add_argument("--patience", type=int, default=None,
                        help="early stopping: stop when this many evaluated checkpoints in a row did not improve "
                             "the validation loss (validation_problems(), neither trained on nor tested)")
    parser.add_argument("--compare-instances", type=int, default=8, help="instances per held-out problem")
    parser.add_argument("--small", action="store_true",
                        help="a smoke run (tests): 1 ES worker, 20-step trainings, 2 pairs, 2 held-out problems")
    args = parser.parse_args(argv)
    args.campaign_mode = args.campaign or args.resume or args.ship
    if args.campaign_mode:
        args.run_dir = args.run_dir or "lopt_campaign"
        if args.ship and not args.out:
            parser.error("--ship needs --out (the file to replace)")
        return args
    if args.out is None:
        parser.error("--out is required (except with --campaign, --resume)")
    args.family = args.family or "shipped"
    if args.small:
        args.workers, args.horizon, args.num_tasks, args.compare_instances = 1, 20, 2, 2
        args.checkpoint_seconds = min(args.checkpoint_seconds, 5.0)
    return args


def campaign_config(args: argparse.Namespace):
    """The :class:`~carlskit.lopt._campaign.CampaignConfig` the options describe (``--small``: a
    smoke-sized one on quadratics, for tests)."""
    from carlskit.lopt._campaign import CampaignConfig

    if args.small:
        return CampaignConfig(seed=args.seed, family="quadratic", num_structures=1, granularities=("tensor",),
                              base_horizon=20, horizon_multiple=2, truncation_length=10, num_tasks=2, std=args.std,
                              meta_learning_rate=args.meta_learning_rate, scheduler_steps=args.scheduler_steps,
                              validation="quadratic", validation_multiples=(1,),
                              validate_every_steps=args.validate_every, baseline_instances=2,
                              adam_learning_rates=(1e-2, 1e-1, 3e-1))
    return CampaignConfig(seed=args.seed, family=args.family or "wide", base_horizon=args.horizon,
                          truncation_length=args.truncation, num_tasks=args.num_tasks, std=args.std,
                          meta_learning_rate=args.meta_learning_rate, scheduler_steps=args.scheduler_steps,
                          validate_every_steps=args.validate_every)


def campaign_main(args: argparse.Namespace, command: str) -> int:
    """``--campaign`` / ``--resume`` / ``--ship``: see the module docstring."""
    from carlskit.lopt._campaign import run_campaign, ship

    if args.campaign or args.resume:
        _, _, metadata = run_campaign(args.run_dir, None if args.resume else campaign_config(args),
                                      resume=args.resume, stop_step=args.outer_steps, minutes=args.minutes,
                                      checkpoint_every_steps=args.checkpoint_every_steps,
                                      checkpoint_every_seconds=args.checkpoint_seconds,
                                      log=lambda line: print(line, flush=True))
        print(f"saved outer step {metadata['outer_step']}: best validation geomean {metadata['best_validation']} "
              f"(step {metadata['best_step']}), {metadata['cpu_seconds'] / 3600:.3f} CPU-hours", flush=True)
    if args.ship:
        ship(args.run_dir, args.out, command, log=lambda line: print(line, flush=True))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Compiled inner trainings are shared by the ES and evaluation workers (and later runs, resumes).
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(pathlib.Path(tempfile.gettempdir()) / "carlskit-jax-cache"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")
    if args.campaign_mode:
        return campaign_main(args, "python -m carlskit.lopt.train_pretrained "
                             + " ".join(sys.argv[1:] if argv is None else argv))

    import jax
    import optax

    import carlskit
    from carlskit.lopt import (
        EvalTaskSet,
        HierarchicalRule,
        LearnedOptimizer,
        MetaTraining,
        compare_to_tuned_adam,
        geometric_mean_ratio,
        held_out_problems,
        meta_training_family,
        validation_problems,
        wide_meta_training_family,
    )

    family = wide_meta_training_family() if args.family == "wide" else meta_training_family()
    problems = held_out_problems()
    if args.small:
        problems = dict(list(problems.items())[:2])
    rule = HierarchicalRule(initial_learning_rate=args.initial_learning_rate)
    start = LearnedOptimizer(rule, rule.init_meta_params(jax.random.PRNGKey(args.seed)), train_horizon=args.horizon)
    structures = family.tasks()
    picked = tuple(structures[i] for i in np.random.default_rng(args.seed).choice(len(structures), 4, replace=False))
    eval_sets = [EvalTaskSet("train_subset", picked, 4, seed=1, num_steps=args.horizon),
                 EvalTaskSet("heldout", picked, 4, seed=2, num_steps=args.horizon),
                 EvalTaskSet("ood", tuple(problems.values()), 4, seed=3, num_steps=args.horizon)]
    select = "heldout"
    if args.patience is not None:  # checkpoint selection and early stopping on a validation family
        eval_sets.append(EvalTaskSet("validation", tuple(validation_problems().values()), 4, seed=4,
                                     num_steps=args.horizon))
        select = "validation"
    run_dir = pathlib.Path(args.run_dir or tempfile.mkdtemp(prefix="carlskit-train-pretrained-"))
    client = carlskit.connect(args.address, n_workers=None if args.address else args.workers + 1)
    began, cpu_began = time.monotonic(), _cluster_cpu_seconds(client)
    training = MetaTraining(start, family, client, directory=run_dir, num_workers=args.workers, eval_workers=1,
                            num_tasks=args.num_tasks, num_steps=args.horizon, std=args.std,
                            outer_optimizer=optax.adam(args.meta_learning_rate),
                            checkpoint_every_seconds=args.checkpoint_seconds, eval_task_sets=eval_sets,
                            seed=args.seed, estimator=args.estimator,
                            truncation_length=args.truncation if args.estimator == "pes" else None,
                            min_num_steps=args.min_horizon, aggregation=args.aggregation)
    training.start()
    deadline = time.monotonic() + args.minutes * 60.0
    while time.monotonic() < deadline:
        with contextlib.suppress(TimeoutError):  # the time budget ran out: not an error
            training.wait(args.outer_steps, timeout=min(30.0, max(deadline - time.monotonic(), 0.1)))
            break
        if args.patience is not None and _stalled(training.eval_results, "validation", args.patience):
            print("early stop: the validation loss stopped improving", flush=True)
            break
    status = training.learner_status()
    training.stop(timeout=600.0)
    seconds = time.monotonic() - began
    cpu_seconds = _cluster_cpu_seconds(client) - cpu_began
    best = training.best_checkpoint(select, "valid")
    trained = training.learned_optimizer(best)
    print(f"meta-trained {status.get('outer_step')} outer steps in {seconds / 60:.1f} min; "
          f"checkpoint {best} has the lowest {select} validation loss", flush=True)

    rows = compare_to_tuned_adam(trained, problems, args.horizon, args.compare_instances,
                                 others={"untrained": start})
    prior = [{"ratio": row["untrained"] / row["tuned_adam"]} for row in rows]
    for row in rows:
        print(f"{row['problem']:42s} learned {row['learned']:.4f}  untrained {row['untrained']:.4f}  "
              f"tuned Adam {row['tuned_adam']:.4f} (lr {row['adam_learning_rate']:g})  ratio {row['ratio']:.3f}")
    geomean = geometric_mean_ratio(rows)
    print(f"geometric mean learned / tuned Adam: {geomean:.3f} (untrained: {geometric_mean_ratio(prior):.3f})")

    command = "python -m carlskit.lopt.train_pretrained " + " ".join(sys.argv[1:] if argv is None else argv)
    results = training.eval_results
    trained.info = {
        "command": command, "config": vars(args), "meta_training_family": repr(family),
        "held_out_problems": {name: repr(task) for name, task in problems.items()},
        "outer_steps": status.get("outer_step"), "checkpoint": best, "seconds": round(seconds, 1),
        "compute": {"wall_seconds": round(seconds, 1), "cluster_cpu_seconds": _number(round(cpu_seconds, 1)),
                    "cpu_hours": _number(round(cpu_seconds / 3600.0, 3)), "outer_steps": status.get("outer_step"),
                    "gradients_applied": status.get("applied"), "gradients_received": status.get("received"),
                    "dropped_fraction": status.get("dropped_fraction"), "cores": os.cpu_count()},
        "evaluation": {str(version): {name: {split: {"final": _number(np.mean(curve[-10:])),
                                                     "mean": _number(np.mean(curve))}
                                            for split, curve in splits.items()}
                                     for name, splits in sets.items()}
                       for version, sets in sorted(results.items())},
        "chosen_curves": {name: {split: [_number(x) for x in curve] for split, curve in splits.items()}
                          for name, splits in results[best].items()},
        "comparison": [{key: (_number(value) if isinstance(value, float) else value) for key, value in row.items()}
                       for row in rows],
        "geomean_vs_tuned_adam": _number(geomean),
        "geomean_untrained_vs_tuned_adam": _number(geometric_mean_ratio(prior)),
        "jax_version": jax.__version__,
    }
    path = trained.save(None, args.out)
    print(f"wrote {path}")
    client.close()
    return 0


def _stalled(results: dict, task_set: str, patience: int) -> bool:
    """True when the last ``patience`` evaluated checkpoints all have a higher mean ``valid`` loss on
    ``task_set`` than the best one before them (early stopping)."""
    losses = [float(np.mean(results[v][task_set]["valid"])) for v in sorted(results) if task_set in results[v]]
    return len(losses) > patience and min(losses[-patience:]) >= min(losses[:-patience])


def _cluster_cpu_seconds(client) -> float:
    """CPU seconds used so far by every Dask worker process plus this one (user + system)."""
    def cpu() -> float:
        times = os.times()
        return times.user + times.system

    try:
        return float(sum(client.run(cpu).values())) + cpu()
    except Exception:  # a worker gone mid-call: the figure is a lower bound, not an error
        return float("nan")


if __name__ == "__main__":
    raise SystemExit(main())
