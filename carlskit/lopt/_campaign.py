"""A resumable meta-training campaign for :class:`NominalAdamRule` (issue 41): interrupted runs add up.

One process, deterministic: outer step ``s`` depends only on the state after step ``s - 1`` (its
keys are ``fold_in(key, s)``), so a run resumed from the state saved at step ``s`` reaches the same
state at every later step as a run never interrupted. What it trains (Celo, Moudgil et al. 2025;
Harrison et al. 2022; VeLO's recipe):

* **Tasks**: ``num_structures`` structures picked once (``seed``) from the meta-training family,
  from each component of its mixture by weight (:func:`pick_structures`),
  each under Celo's weight-scale augmentation (:class:`RescaledTask`, scales log-uniform in
  ``[1/max_scale, max_scale]``, granularity cycling over ``granularities``), one PES state each.
* **Estimator**: PES (:func:`carlskit.lopt.meta_training.pes_gradient`), truncations of
  ``truncation_length`` steps in episodes of lengths log-uniform over
  ``[base_horizon, horizon_multiple * base_horizon]``.
* **Meta-loss**: ``log(L / R)`` per antithetic member (:func:`mean_log_loss_ratio`): ``L`` the
  truncation's mean training loss, ``R`` tuned Adam's final loss on that structure at
  ``base_horizon``, computed once when the campaign starts and kept in its state with the
  structure's initial loss: both ``L`` and ``R`` are floored at ``1e-3`` of it (a structure tuned
  Adam solves to 0 would give an infinite ratio and no gradient). A per-task
  constant cancels in an antithetic difference, so ``R`` sets the *value* (the logged meta-loss,
  0 = as good as tuned Adam), while the log makes every task's share of the gradient scale-free.
* **Phases**: steps ``< scheduler_steps`` train only ``meta_params["scheduler"]``, later ones only
  ``meta_params["correction"]``; each part has its own outer Adam state, the frozen part's
  parameters and state are not touched, and PES does not perturb it (``perturbation_mask``), so its
  estimate carries no noise from the frozen part.
* **Validation** every ``validate_every_steps`` on held-out problems: the geometric mean over
  problems and horizon multiples of the final loss against tuned Adam's (floored at ``1e-3`` of the
  initial loss, issue 30's protocol), Adam's figures computed once; the best one is kept.

The complete state (meta-parameters, both outer Adam states, every PES state, the key, the best
meta-parameters, Adam's baselines) is a pytree saved with :class:`carlskit.CheckpointStore` (atomic,
checksummed; version = outer step) every ``checkpoint_every_steps`` steps or ``checkpoint_every_seconds``;
its JSON metadata holds the step, phase, CPU-seconds and validation figures. After each save one
JSON line goes to ``campaign_log.jsonl`` (one ``write`` on an ``O_APPEND`` descriptor, fsync'd; a
resume repairs a torn last line and adds the line of a save the kill cut off). The log, the stop
requests (SIGINT / SIGTERM) and the CPU clock are :mod:`carlskit._campaign`'s, shared with the
translator's campaign.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from carlskit._campaign import LOG_NAME, CampaignClock, append_log_line, repair_log, stop_requests
from carlskit._checks import integer, positive_float, positive_int
from carlskit._errors import CorruptFileError
from carlskit._serialization import unflatten_into
from carlskit.checkpoints import CheckpointStore
from carlskit.lopt._estimators import antithetic_combine, pes_gradient, pes_init_state
from carlskit.lopt._inner import mean_log_loss_ratio
from carlskit.lopt._nominal import NominalAdamRule
from carlskit.lopt._optimizer import WIDE_ADAM_LEARNING_RATES, LearnedOptimizer, final_loss, tuned_adam
from carlskit.lopt._protocols import Task
from carlskit.lopt._rule_config import rule_from_config, rule_to_config
from carlskit.lopt._tasks import (
    QuadraticTask,
    RescaledTask,
    meta_training_family,
    validation_problems,
    wide_meta_training_family,
)

PyTree = Any
PARTS = ("scheduler", "correction")  # trained in this order: phase 1, phase 2
STATE_DIR = "state"
FLOOR_FRACTION = 1e-3


def _families() -> dict[str, Callable[[], tuple[tuple[float, tuple[Task, ...]], ...]]]:
    """Each family's structures as ``(weight, structures)`` per component of its mixture."""
    def wide():  # the structures under RescaledFamily (we rescale them ourselves)
        mixture = wide_meta_training_family().family
        return tuple((w, f.tasks()) for w, f in zip(mixture.weights, mixture.families))

    return {"wide": wide, "shipped": lambda: ((1.0, meta_training_family().tasks()),),
            "quadratic": lambda: ((1.0, (QuadraticTask(4, 10.0, 0.1), QuadraticTask(6, 30.0, 0.1))),)}


def pick_structures(components: Sequence[tuple[float, Sequence[Task]]], count: int, seed: int) -> tuple[Task, ...]:
    """``count`` structures, from each component of a mixture in proportion to its weight (largest
    remainders; every component at least one while ``count`` allows), at random within it: drawn
    uniformly from all structures, a mixture of 108 MLPs, 12 regressions and 3 quadratics gave
    MLPs only."""
    rng = np.random.default_rng(seed)
    sizes = np.asarray([len(tasks) for _, tasks in components])
    count = min(count, int(sizes.sum()))
    weights = np.asarray([w for w, _ in components], np.float64)
    share = count * weights / weights.sum()
    taken = np.minimum(np.floor(share).astype(int), sizes)
    if count >= len(components):
        taken = np.maximum(taken, np.minimum(1, sizes))
    while taken.sum() > count:  # the minimum of one pushed it over: take back where most over its share
        taken[int(np.argmax(np.where(taken > 1, taken - share, -np.inf)))] -= 1
    while taken.sum() < count:
        room = np.where(taken < sizes, share - taken, -np.inf)
        taken[int(np.argmax(room))] += 1
    picked = []
    for (_, tasks), n in zip(components, taken):
        picked += [tasks[int(i)] for i in sorted(rng.choice(len(tasks), int(n), replace=False))]
    return tuple(picked)


def _validation_sets() -> dict[str, Callable[[], dict[str, Task]]]:
    return {"validation": validation_problems,
            "quadratic": lambda: {"quadratic dim 8, condition 100": QuadraticTask(8, 100.0, 0.05)}}


@dataclasses.dataclass(frozen=True)
class CampaignConfig:
    """Everything that decides a campaign's trajectory (stored with its state; a resume uses the stored one).

    ``family`` / ``validation``: names of the meta-training structures (``"wide"``, ``"shipped"``,
    ``"quadratic"``) and of the held-out validation problems (``"validation"``, ``"quadratic"``).
    """

    seed: int = 0
    family: str = "wide"
    num_structures: int = 8
    granularities: tuple[str, ...] = ("global", "tensor", "entry")
    max_scale: float = 1e3
    base_horizon: int = 200
    horizon_multiple: int = 5
    truncation_length: int = 50
    num_tasks: int = 8
    std: float = 0.01
    meta_learning_rate: float = 3e-3
    scheduler_steps: int = 1000
    validation: str = "validation"
    validation_multiples: tuple[int, ...] = (1, 5)
    validate_every_steps: int = 50
    baseline_instances: int = 4
    adam_learning_rates: tuple[float, ...] = WIDE_ADAM_LEARNING_RATES
    rule: dict = dataclasses.field(default_factory=lambda: rule_to_config(NominalAdamRule()))

    def __post_init__(self) -> None:
        for name in ("num_structures", "base_horizon", "horizon_multiple", "truncation_length", "num_tasks",
                     "validate_every_steps", "baseline_instances"):
            object.__setattr__(self, name, positive_int(getattr(self, name), name))
        object.__setattr__(self, "seed", integer(self.seed, "seed", 0))
        object.__setattr__(self, "scheduler_steps", integer(self.scheduler_steps, "scheduler_steps", 0))
        for name in ("max_scale", "std", "meta_learning_rate"):
            object.__setattr__(self, name, positive_float(getattr(self, name), name))
        for name in ("granularities", "validation_multiples", "adam_learning_rates"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.family not in _families():
            raise ValueError(f"family must be one of {sorted(_families())}, got {self.family!r}")
        if self.validation not in _validation_sets():
            raise ValueError(f"validation must be one of {sorted(_validation_sets())}, got {self.validation!r}")
        if self.base_horizon % self.truncation_length:
            raise ValueError(f"base_horizon ({self.base_horizon}) must be a multiple of truncation_length "
                             f"({self.truncation_length})")
        if not isinstance(rule_from_config(self.rule), NominalAdamRule):
            raise ValueError(f"rule must describe a NominalAdamRule, got kind {self.rule.get('kind')!r}")

    def to_json(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_json(cls, document: dict[str, Any]) -> "CampaignConfig":
        return cls(**document)

    @property
    def horizon(self) -> int:
        """The longest PES episode: ``horizon_multiple * base_horizon``."""
        return self.horizon_multiple * self.base_horizon

    def phase(self, outer_step: int) -> int:
        """1 (scheduler) before ``scheduler_steps``, then 2 (correction)."""
        return 1 if outer_step < self.scheduler_steps else 2


class Campaign:
    """The compiled pieces of one :class:`CampaignConfig`: rule, structures, estimators, validation set.

    :meth:`of` keeps one per configuration in a process, so a resumed run (or a second run) reuses
    its compiled programs."""

    _made: dict[str, "Campaign"] = {}

    @classmethod
    def of(cls, config: CampaignConfig) -> "Campaign":
        name = json.dumps(config.to_json(), sort_keys=True)
        if name not in cls._made:
            cls._made[name] = cls(config)
        return cls._made[name]

    def __init__(self, config: CampaignConfig) -> None:
        self.config = config
        self.rule = rule_from_config(config.rule)
        self.base_tasks = pick_structures(_families()[config.family](), config.num_structures, config.seed)
        grains = config.granularities
        self.tasks = tuple(RescaledTask(task, config.max_scale, grains[i % len(grains)]) if grains else task
                           for i, task in enumerate(self.base_tasks))
        self.validation = _validation_sets()[config.validation]()
        # PES on one device, called directly: the phase's perturbation mask is a traced argument
        self._pes = dict(rule=self.rule, num_tasks=config.num_tasks, horizon=config.horizon,
                         truncation_length=config.truncation_length)
        template = jax.eval_shape(self.rule.init_meta_params, jax.random.PRNGKey(0))
        self.perturbation_masks = [{part: jax.tree.map(lambda _, on=float(part == trained): jnp.float32(on),
                                                       template[part]) for part in PARTS} for trained in PARTS]
        self.outer_optimizer = optax.adam(config.meta_learning_rate)
        self._apply = jax.jit(self._update, static_argnames=("part",))
        # one program instead of op-by-op PES initialisation (seconds of small compilations)
        self._initial_state = jax.jit(self._initial_state_eager)

    # ------------------------------------------------------------------ state
    def initial_state(self, baselines: np.ndarray, initial_losses: np.ndarray, validation_baselines: np.ndarray,
                      validation_initial: np.ndarray) -> dict[str, Any]:
        """Step 0's state: the untrained rule (Adam under its default schedule), fresh PES states."""
        return self._initial_state(*(jnp.asarray(a, jnp.float32) for a in (baselines, initial_losses,
                                                                           validation_baselines, validation_initial)))

    def _initial_state_eager(self, baselines, initial_losses, validation_baselines, validation_initial
                             ) -> dict[str, Any]:
        key = jax.random.PRNGKey(self.config.seed)
        meta_params = self.rule.init_meta_params(jax.random.fold_in(key, 0))
        pes_keys = jax.random.split(jax.random.fold_in(key, 1), len(self.tasks))
        return {"meta_params": meta_params, "best_meta_params": meta_params,
                "outer_state": {part: self.outer_optimizer.init(meta_params[part]) for part in PARTS},
                "pes": [pes_init_state(meta_params, k, task=task, **self._pes)
                        for task, k in zip(self.tasks, pes_keys)],
                "key": jax.random.fold_in(key, 2),
                "baselines": jnp.asarray(baselines, jnp.float32),
                "initial_losses": jnp.asarray(initial_losses, jnp.float32),
                "validation_baselines": jnp.asarray(validation_baselines, jnp.float32),
                "validation_initial": jnp.asarray(validation_initial, jnp.float32)}

    def state_template(self) -> PyTree:
        """Shapes and dtypes of :meth:`initial_state` (nothing computed): the target a resume loads into."""
        num_validation = len(self.validation) * len(self.config.validation_multiples)
        return jax.eval_shape(lambda: self._initial_state_eager(np.ones(len(self.tasks)), np.ones(len(self.tasks)),
                                                                np.ones(num_validation), np.ones(num_validation)))

    # ------------------------------------------------------------------ baselines
    def adam_reference(self, task: Task, num_steps: int, seed: int) -> tuple[float, float]:
        """``(final, initial)`` loss of Adam at its best rate of ``adam_learning_rates`` (``tuned_adam``)
        on ``baseline_instances`` instances from ``seed``, the instances it was tuned on (a baseline
        as strong as the grid allows, and one compiled program per task and length)."""
        rates = np.asarray(self.config.adam_learning_rates)
        rate, curves = tuned_adam(task, num_steps, self.config.baseline_instances, seed, rates)
        curves = curves[int(np.flatnonzero(rates == rate)[0])]
        return final_loss(curves), float(np.mean(curves[:, 0]))

    def baselines(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Tuned Adam's final and initial loss per meta-training structure (unscaled, at
        ``base_horizon``), and per validation problem and multiple. Computed once per campaign."""
        train = [self.adam_reference(task, self.config.base_horizon, 2000) for task in self.base_tasks]
        validation = [self.adam_reference(task, self.config.base_horizon * m, 3000)
                      for task in self.validation.values() for m in self.config.validation_multiples]
        return tuple(np.asarray([r[i] for r in rows], np.float32) for rows in (train, validation) for i in (0, 1))

    def validate(self, meta_params: PyTree, state: dict[str, Any]) -> float:
        """Geometric mean over validation problems and multiples of final loss / tuned Adam's (floored)."""
        lopt = LearnedOptimizer(self.rule, meta_params)
        finals = [final_loss(lopt.train_curves(task, self.config.base_horizon * m,
                                               self.config.baseline_instances, 3000))
                  for task in self.validation.values() for m in self.config.validation_multiples]
        value = mean_log_loss_ratio(jnp.asarray(finals, jnp.float32), state["validation_baselines"],
                                    state["validation_initial"], FLOOR_FRACTION)
        return float(np.exp(value))

    # ------------------------------------------------------------------ one outer step
    def meta_loss_gradient(self, meta_params: PyTree, pair_losses: jax.Array, accumulated_eps: PyTree,
                           baseline: jax.Array, initial_loss: jax.Array | None = None) -> tuple[PyTree, jax.Array]:
        """PES gradient of ``log(L / R)`` per member and its mean (the meta-loss) over valid pairs;
        with ``initial_loss``, both floored at ``1e-3`` of it (issue 30's protocol: a structure that
        tuned Adam solves to 0 would otherwise give ``log(L / 0)``, an infinite loss on both sides of
        every antithetic pair, and no gradient)."""
        reference = jnp.broadcast_to(baseline, (1,))
        initial = None if initial_loss is None else jnp.broadcast_to(initial_loss, (1,))
        ratios = jax.vmap(jax.vmap(lambda loss: mean_log_loss_ratio(jnp.maximum(loss, 1e-30)[None], reference,
                                                                    initial, FLOOR_FRACTION)))(pair_losses)
        grad, valid = antithetic_combine(ratios, accumulated_eps, self.config.std)
        meta_loss = jnp.sum(jnp.where(valid[:, None], ratios, 0.0)) / jnp.maximum(2 * jnp.sum(valid), 1)
        return grad, jnp.where(jnp.any(valid), meta_loss, jnp.nan)

    def _update(self, meta_params, outer_state, pair_losses, accumulated_eps, baseline, initial_loss, *, part):
        """The meta-loss's gradient through the outer Adam of ``part``; the other part is untouched."""
        grad, meta_loss = self.meta_loss_gradient(meta_params, pair_losses, accumulated_eps, baseline, initial_loss)
        updates, part_state = self.outer_optimizer.update(grad[part], outer_state[part], meta_params[part])
        return ({**meta_params, part: optax.apply_updates(meta_params[part], updates)},
                {**outer_state, part: part_state}, meta_loss)

    def step(self, state: dict[str, Any], outer_step: int) -> tuple[dict[str, Any], float]:
        """Outer step ``outer_step`` (``state`` is the state after ``outer_step`` steps); returns the
        new state and the meta-loss (mean ``log(L / R)``). When every antithetic pair diverged (NaN
        meta-loss) only the PES state moves on (its diverged tasks restart), as ``learner_apply``
        never applies such an estimate."""
        key = jax.random.fold_in(state["key"], outer_step)
        index = int(jax.random.randint(jax.random.fold_in(key, 0), (), 0, len(self.tasks)))
        phase = self.config.phase(outer_step)
        _, pes, metrics = pes_gradient(state["meta_params"], jax.random.fold_in(key, 1), state["pes"][index],
                                       task=self.tasks[index], std=self.config.std,
                                       min_horizon=self.config.base_horizon,
                                       perturbation_mask=self.perturbation_masks[phase - 1], **self._pes)
        part = PARTS[phase - 1]
        meta_params, outer_state, meta_loss = self._apply(state["meta_params"], state["outer_state"],
                                                          metrics["pair_losses"], pes.accumulated_eps,
                                                          state["baselines"][index], state["initial_losses"][index],
                                                          part=part)
        if not np.isfinite(float(meta_loss)):  # every pair diverged: no information, nothing applied
            meta_params, outer_state = state["meta_params"], state["outer_state"]
        if not all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(meta_params)):
            raise FloatingPointError(f"the meta-parameters became non-finite at outer step {outer_step}; lower "
                                     "meta_learning_rate or std")
        pes_states = list(state["pes"])
        pes_states[index] = pes
        return {**state, "meta_params": meta_params, "outer_state": outer_state, "pes": pes_states}, float(meta_loss)


# ---------------------------------------------------------------------------------------- on disk
def _store(run_dir: pathlib.Path) -> CheckpointStore:
    return CheckpointStore(run_dir / STATE_DIR, keep=2)


def load_state(run_dir: str | os.PathLike) -> tuple[Campaign, dict[str, Any], dict[str, Any]]:
    """``(campaign, state, metadata)`` of the newest saved state in ``run_dir``.

    Refuses, with :class:`carlskit.CorruptFileError` naming the file, when the newest state is
    damaged: it is never loaded, and an older one is not taken silently in its place (move the
    damaged version away to resume from the one before). ``FileNotFoundError`` when there is none.
    """
    store = _store(pathlib.Path(run_dir))
    versions = store.versions()
    if not versions:
        raise FileNotFoundError(f"no campaign state in {store.path!r}; start one with --campaign")
    newest = versions[-1]
    reason = store.verify(newest)
    if reason is not None:
        older = [v for v in versions[:-1] if store.verify(v) is None]
        raise CorruptFileError(store.file(newest), f"the newest campaign state (outer step {newest}) is damaged "
                                                   f"and is not loaded: {reason}; move v{newest:012d}.* away to "
                                                   f"resume from outer step {older[-1] if older else 'none'}")
    manifest = store.manifest(newest)
    campaign = Campaign.of(CampaignConfig.from_json(manifest["metadata"]["config"]))
    arrays, metadata = store.load(newest)
    state = unflatten_into(campaign.state_template(), arrays, metadata["key_impls"])
    metadata = {k: v for k, v in metadata.items() if k not in ("version", "wall_time", "key_impls")}
    return campaign, jax.tree.map(jnp.asarray, state), metadata


def _save(run_dir: pathlib.Path, state: dict[str, Any], metadata: dict[str, Any]) -> None:
    _store(run_dir).save(state, version=metadata["outer_step"], metadata=metadata)
    append_log_line(run_dir / LOG_NAME, metadata["log"])


def _number(value: float) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


# ---------------------------------------------------------------------------------------- the loop
def run_campaign(run_dir: str | os.PathLike, config: CampaignConfig | None = None, *, resume: bool = False,
                 stop_step: int | None = None, minutes: float | None = None, checkpoint_every_steps: int = 100,
                 checkpoint_every_seconds: float = 300.0, log: Callable[[str], None] = print
                 ) -> tuple[Campaign, dict[str, Any], dict[str, Any]]:
    """Run (``resume=False``: start ``config`` in an empty ``run_dir``) or continue (``resume=True``:
    the stored config) a campaign until outer step ``stop_step`` or ``minutes`` of wall time; returns
    ``(campaign, state, metadata)`` as last saved (the state is saved on the way out). SIGINT or
    SIGTERM stops it at the next step boundary, saved (a second SIGINT: at once, unsaved)."""
    run_dir = pathlib.Path(run_dir)
    checkpoint_every_steps = positive_int(checkpoint_every_steps, "checkpoint_every_steps")
    checkpoint_every_seconds = positive_float(checkpoint_every_seconds, "checkpoint_every_seconds")
    clock = CampaignClock()  # this run, from its start (the baselines of a new campaign count)
    if resume:
        campaign, state, metadata = load_state(run_dir)
        repair_log(run_dir / LOG_NAME, metadata["outer_step"], metadata["log"], key="outer_step")
        log(f"resumed at outer step {metadata['outer_step']} (phase {metadata['phase']})")
    else:
        if _store(run_dir).versions():
            raise FileExistsError(f"{run_dir} already holds a campaign; continue it with --resume")
        campaign = Campaign.of(config or CampaignConfig())
        baselines = campaign.baselines()
        state = campaign.initial_state(*baselines)
        validation = campaign.validate(state["meta_params"], state)
        metadata = {"outer_step": 0, "phase": campaign.config.phase(0), "cpu_seconds": 0.0, "wall_seconds": 0.0,
                    "best_validation": _number(validation), "best_step": 0, "validation": _number(validation),
                    "config": campaign.config.to_json()}
        log(f"tuned Adam baselines: {np.round(baselines[0], 5).tolist()}; untrained validation geomean "
            f"{validation:.4f}")
    cpu_before, wall_before = metadata["cpu_seconds"], metadata["wall_seconds"]
    config, outer_step = campaign.config, metadata["outer_step"]
    best = math.inf if metadata["best_validation"] is None else metadata["best_validation"]
    meta_losses: list[float] = []

    def snapshot() -> dict[str, Any]:
        cpu = round(cpu_before + clock.cpu_seconds, 3)
        wall = round(wall_before + clock.wall_seconds, 3)
        record = {"outer_step": outer_step, "phase": config.phase(outer_step), "cpu_seconds": cpu,
                  "validation_geomean": metadata["validation"], "best_validation_geomean": metadata["best_validation"],
                  "best_step": metadata["best_step"],
                  "meta_loss": _number(np.nanmean(meta_losses)) if np.isfinite(meta_losses).any() else None}
        return {**metadata, "outer_step": outer_step, "phase": config.phase(outer_step), "cpu_seconds": cpu,
                "wall_seconds": wall, "log": record}

    if not resume:
        _save(run_dir, state, snapshot())
    budget_seconds = math.inf if minutes is None else 60.0 * minutes
    last_save, saved_step = time.monotonic(), outer_step
    with stop_requests() as stop_requested:
        while (stop_step is None or outer_step < stop_step) and clock.running_for() < budget_seconds \
                and not stop_requested():
            state, meta_loss = campaign.step(state, outer_step)
            outer_step += 1
            meta_losses.append(meta_loss)
            if outer_step % config.validate_every_steps == 0:
                validation = campaign.validate(state["meta_params"], state)
                metadata = {**metadata, "validation": _number(validation)}
                if validation < best:
                    best = validation
                    state = {**state, "best_meta_params": state["meta_params"]}
                    metadata = {**metadata, "best_validation": _number(validation), "best_step": outer_step}
                log(f"outer step {outer_step} (phase {config.phase(outer_step)}): validation geomean "
                    f"{validation:.4f}, best {best:.4f}")
            due = time.monotonic() - last_save >= checkpoint_every_seconds
            if outer_step % checkpoint_every_steps == 0 or due:
                metadata = snapshot()
                _save(run_dir, state, metadata)
                last_save, saved_step, meta_losses = time.monotonic(), outer_step, []
        if saved_step != outer_step:
            metadata = snapshot()
            _save(run_dir, state, metadata)
    return campaign, state, metadata


def ship(run_dir: str | os.PathLike, out: str | os.PathLike, command: str,
         log: Callable[[str], None] = print) -> pathlib.Path | None:
    """Write the campaign's best meta-parameters to ``out`` only when their validation geomean beats
    the file already there (measured now, on the same problems and baselines); returns the file
    written or ``None``."""
    campaign, state, metadata = load_state(run_dir)
    best = metadata["best_validation"]
    current = math.inf
    if pathlib.Path(out).exists():
        shipped = LearnedOptimizer.load(out)
        if isinstance(shipped.rule, NominalAdamRule):
            current = campaign.validate(shipped.meta_params, state)
        else:  # another rule: its validation on these problems, through its own train_curves
            finals = [final_loss(shipped.train_curves(task, campaign.config.base_horizon * m,
                                                      campaign.config.baseline_instances, 3000))
                      for task in campaign.validation.values() for m in campaign.config.validation_multiples]
            current = float(np.exp(mean_log_loss_ratio(jnp.asarray(finals, jnp.float32), state["validation_baselines"],
                                                       state["validation_initial"], FLOOR_FRACTION)))
    if best is None or not best < current:
        log(f"not shipped: campaign best validation geomean {best} does not beat {out}'s {current:.4f}")
        return None
    lopt = LearnedOptimizer(campaign.rule, state["best_meta_params"], campaign.config.base_horizon, info={
        "command": command, "campaign": {key: metadata[key] for key in ("outer_step", "best_step", "cpu_seconds",
                                                                        "best_validation", "config")},
        "replaced_validation_geomean": _number(current)})
    path = lopt.save(None, out)
    log(f"shipped {path}: validation geomean {best:.4f} (was {current:.4f})")
    return path
