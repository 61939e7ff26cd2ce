"""Issue 41's resumable meta-training campaign (``train_pretrained --campaign / --resume``), at smoke size.

The first test to run compiles the campaign's programs in this process (about 20 s of CPU, the
cost of every campaign process's start); the later ones reuse them.
"""

import math
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from carlskit import CorruptFileError
from carlskit._campaign import LOG_NAME, read_log
from carlskit.checkpoints import CheckpointStore
from carlskit.lopt import LearnedOptimizer, NominalAdamRule
from carlskit.lopt._campaign import STATE_DIR, Campaign, load_state, run_campaign, ship
from carlskit.lopt.train_pretrained import campaign_config, main, parse_args

ROOT = pathlib.Path(__file__).resolve().parents[2]
STOP_STEP = 16
SMALL = ["--small", "--validate-every", "4", "--scheduler-steps", "6", "--checkpoint-every-steps", "1"]


def _config():
    return campaign_config(parse_args(["--campaign", *SMALL]))


def _quiet(line):
    del line


def _assert_same_state(a, b):
    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow  # two cold compilations of the campaign's programs, one per process, side by side
def test_campaign_resumed_after_sigkill_reaches_the_uninterrupted_runs_state(tmp_path, monkeypatch,
                                                                              no_leftover_processes):
    """A campaign process killed with SIGKILL loses only the steps since its last save: resumed
    (``--resume``) from it, it reaches, at the same step, exactly the state (every array: meta-
    parameters, outer Adam states, PES states, best meta-parameters, baselines) and the log of a run
    with the same seed that was never interrupted."""
    killed = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-cache")}
    with open(tmp_path / "killed.out", "wb") as output:
        process = subprocess.Popen([sys.executable, "-m", "carlskit.lopt.train_pretrained", "--campaign", *SMALL,
                                    "--run-dir", str(killed), "--outer-steps", "100000"],
                                   env=env, stdout=output, stderr=subprocess.STDOUT)
    try:
        # Meanwhile (the other core), the uninterrupted run in this process.
        _, reference, reference_metadata = run_campaign(tmp_path / "reference", _config(), stop_step=STOP_STEP,
                                                        checkpoint_every_steps=5, log=_quiet)
        store = CheckpointStore(killed / STATE_DIR, keep=None)
        deadline = time.monotonic() + 120.0
        while (store.latest() or 0) < 3 and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process.poll() is None, (tmp_path / "killed.out").read_text()[-2000:]
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    saved = store.latest()
    assert 3 <= saved < STOP_STEP
    lines_before = [record["outer_step"] for record in read_log(killed / LOG_NAME)]
    assert lines_before[-1] in (saved - 1, saved)  # the kill may fall between a save and its log line

    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax-cache"))
    assert main(["--resume", "--run-dir", str(killed), "--outer-steps", str(STOP_STEP),
                 "--checkpoint-seconds", "3600"]) == 0
    campaign, resumed, metadata = load_state(killed)
    assert metadata["outer_step"] == reference_metadata["outer_step"] == STOP_STEP
    _assert_same_state(resumed, reference)
    for key in ("phase", "best_validation", "best_step", "validation", "config"):
        assert metadata[key] == reference_metadata[key], key
    log = read_log(killed / LOG_NAME)
    assert [r["outer_step"] for r in log] == list(range(saved + 1)) + [STOP_STEP]
    assert log[-1]["cpu_seconds"] > log[saved]["cpu_seconds"] > 0  # CPU-seconds add up over the runs
    assert log[-1]["validation_geomean"] == read_log(tmp_path / "reference" / LOG_NAME)[-1]["validation_geomean"]


@pytest.fixture(scope="module")
def small_campaign(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("campaign")
    run_campaign(run_dir, _config(), stop_step=2, checkpoint_every_steps=1, log=_quiet)
    return run_dir


@pytest.mark.parametrize("damaged", ["npz", "json"])
def test_a_damaged_newest_state_is_refused_with_a_clear_error_not_loaded(small_campaign, tmp_path, damaged):
    """One flipped byte in the newest state (arrays or manifest): resuming raises CorruptFileError
    naming the file and the step, instead of loading it or silently falling back to an older one."""
    run_dir = tmp_path / "copy"
    (run_dir / STATE_DIR).mkdir(parents=True)
    for file in (small_campaign / STATE_DIR).iterdir():
        (run_dir / STATE_DIR / file.name).write_bytes(file.read_bytes())
    store = CheckpointStore(run_dir / STATE_DIR, keep=None)
    newest = store.versions()[-1]
    target = pathlib.Path(store.file(newest, damaged))
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x10
    target.write_bytes(bytes(data))
    with pytest.raises(CorruptFileError, match=f"newest campaign state \\(outer step {newest}\\) is damaged"):
        load_state(run_dir)
    with pytest.raises(CorruptFileError):
        main(["--resume", "--run-dir", str(run_dir), "--outer-steps", "4"])
    assert store.versions()[-1] == newest  # nothing was written over it


def test_meta_loss_is_the_log_ratio_to_the_stored_tuned_adam_baseline(small_campaign):
    """The state holds tuned Adam's final loss per meta-training structure (computed once), and the
    meta-loss is measured against it: baselines e^2 times larger give a meta-loss exactly 2 lower
    (a step that ignored the stored baseline would give the same value). The PES gradient is the
    same (a per-task constant cancels in an antithetic difference), so the meta-parameters are too, up
    to float rounding."""
    campaign, state, _ = load_state(small_campaign)
    expected, _ = campaign.adam_reference(campaign.base_tasks[0], campaign.config.base_horizon, 2000)
    np.testing.assert_allclose(np.asarray(state["baselines"]), [expected], rtol=1e-6)
    step = 3
    scaled = {**state, "baselines": state["baselines"] * math.exp(2.0)}
    after, meta_loss = campaign.step(state, step)
    after_scaled, meta_loss_scaled = campaign.step(scaled, step)
    assert np.isfinite(meta_loss)
    assert meta_loss_scaled == pytest.approx(meta_loss - 2.0, abs=1e-5)
    del after, after_scaled  # (their meta-parameters differ by Adam-amplified rounding of tiny gradients)
    pair_losses = jax.numpy.asarray([[0.5, 0.7], [1.5, 1.2]][:campaign.config.num_tasks])
    eps = state["pes"][0].accumulated_eps
    grad, value = campaign.meta_loss_gradient(state["meta_params"], pair_losses, eps, state["baselines"][0])
    grad_scaled, value_scaled = campaign.meta_loss_gradient(state["meta_params"], pair_losses, eps,
                                                            state["baselines"][0] * math.exp(2.0))
    assert float(value_scaled) == pytest.approx(float(value) - 2.0, abs=1e-5)
    for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(grad_scaled)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)  # the same up to float rounding


def test_a_structure_tuned_adam_solves_to_zero_still_gives_a_gradient(small_campaign):
    """Tuned Adam reached a final loss of exactly 0 on one regression structure of the wide family:
    log(L / 0) is infinite for both members of every pair (no gradient, NaN meta-loss). Floored at
    1e-3 of the structure's initial loss (issue 30's protocol), the ratio is finite and so is the
    gradient; the state keeps each structure's initial loss for it."""
    campaign, state, _ = load_state(small_campaign)
    assert state["initial_losses"].shape == state["baselines"].shape and float(state["initial_losses"][0]) > 0
    pair_losses = jax.numpy.asarray([[0.5, 0.7], [1.5, 1.2]][:campaign.config.num_tasks])
    eps = state["pes"][0].accumulated_eps
    _, unfloored = campaign.meta_loss_gradient(state["meta_params"], pair_losses, eps, 0.0)
    assert not np.isfinite(float(unfloored))
    grad, value = campaign.meta_loss_gradient(state["meta_params"], pair_losses, eps, 0.0, 10.0)
    assert float(value) == pytest.approx(np.mean(np.log(np.asarray(pair_losses) / 1e-2)), rel=1e-5)
    assert any(float(np.abs(leaf).max()) > 0 for leaf in jax.tree.leaves(grad))


def test_phase_one_trains_only_the_scheduler_and_phase_two_only_the_correction(small_campaign):
    """Steps before ``scheduler_steps`` change the scheduler's meta-parameters and outer Adam state
    and leave the correction's bit for bit, and PES draws no noise for the correction; later steps
    the other way round."""
    campaign, state, _ = load_state(small_campaign)
    assert isinstance(campaign, Campaign) and campaign.config.scheduler_steps == 6
    for step, trained, frozen in ((2, "scheduler", "correction"), (6, "correction", "scheduler")):
        after, _ = campaign.step(state, step)
        _assert_same_state(after["meta_params"][frozen], state["meta_params"][frozen])
        _assert_same_state(after["outer_state"][frozen], state["outer_state"][frozen])
        changed = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(after["meta_params"][trained]),
                                                             jax.tree.leaves(state["meta_params"][trained]))]
        assert any(changed), trained
        # the noise PES drew this step for the frozen part is 0: each task's accumulated noise for
        # it is what it was (or 0 for a task that restarted)
        index = next(i for i, (a, b) in enumerate(zip(after["pes"], state["pes"])) if a is not b)
        for a, b in zip(jax.tree.leaves(after["pes"][index].accumulated_eps[frozen]),
                        jax.tree.leaves(state["pes"][index].accumulated_eps[frozen])):
            a, b = np.asarray(a), np.asarray(b)
            for task in range(a.shape[0]):
                assert np.array_equal(a[task], b[task]) or not np.any(a[task]), (trained, task)
        assert any(np.any(np.asarray(x)) for x in jax.tree.leaves(after["pes"][index].accumulated_eps[trained]))


def test_ship_writes_the_best_rule_only_when_held_out_validation_improves(small_campaign, tmp_path):
    """``--ship`` writes the campaign's best meta-parameters (a sealed file that loads as a
    NominalAdamRule optimizer) where there is nothing better, and leaves a file alone whose
    validation the campaign does not beat (here: the same rule, so not strictly better)."""
    out = tmp_path / "shipped.npz"
    assert main(["--ship", "--run-dir", str(small_campaign), "--out", str(out)]) == 0
    shipped = LearnedOptimizer.load(out)
    assert isinstance(shipped.rule, NominalAdamRule)
    _, state, metadata = load_state(small_campaign)
    _assert_same_state(shipped.meta_params, state["best_meta_params"])
    assert shipped.info["campaign"]["best_validation"] == metadata["best_validation"]
    written = out.read_bytes()
    assert ship(small_campaign, out, "test", log=_quiet) is None
    assert out.read_bytes() == written
    with pytest.raises(FileExistsError, match="--resume"):
        run_campaign(small_campaign, _config(), stop_step=3, log=_quiet)


def test_a_resume_repairs_a_torn_log_line_and_adds_the_line_a_kill_cut_off(small_campaign, tmp_path):
    """A kill during the log's append leaves a line without its newline, and one between a save and
    its append leaves no line for the newest state: a resume drops the torn bytes and writes that
    line, so the log again has one whole line per saved step."""
    run_dir = tmp_path / "copy"
    (run_dir / STATE_DIR).mkdir(parents=True)
    for file in (small_campaign / STATE_DIR).iterdir():
        (run_dir / STATE_DIR / file.name).write_bytes(file.read_bytes())
    lines = (small_campaign / LOG_NAME).read_bytes().splitlines(keepends=True)
    (run_dir / LOG_NAME).write_bytes(b"".join(lines[:-1]) + lines[-1][:20])  # newest line cut mid-way
    assert [r["outer_step"] for r in read_log(run_dir / LOG_NAME)] == [0, 1]
    _, _, metadata = run_campaign(run_dir, resume=True, stop_step=2, log=_quiet)
    assert metadata["outer_step"] == 2
    assert (run_dir / LOG_NAME).read_bytes() == (small_campaign / LOG_NAME).read_bytes()


def test_sigterm_stops_the_campaign_at_a_step_boundary_with_its_state_saved(small_campaign, tmp_path):
    """``kill -TERM`` (or Ctrl-C once) asks the loop to stop: it finishes the step it is in, saves it
    and returns, so stopping a campaign by hand loses nothing."""
    run_dir = tmp_path / "copy"
    (run_dir / STATE_DIR).mkdir(parents=True)
    for file in (small_campaign / STATE_DIR).iterdir():
        (run_dir / STATE_DIR / file.name).write_bytes(file.read_bytes())
    (run_dir / LOG_NAME).write_bytes((small_campaign / LOG_NAME).read_bytes())

    def terminate_after_validation(line):
        if "validation" in line:  # step 4: the first validation after the saved step 2
            os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    _, _, metadata = run_campaign(run_dir, resume=True, stop_step=100, checkpoint_every_steps=1000,
                                  checkpoint_every_seconds=3600.0, log=terminate_after_validation)
    assert metadata["outer_step"] == 4
    assert CheckpointStore(run_dir / STATE_DIR, keep=None).latest() == 4
    assert [r["outer_step"] for r in read_log(run_dir / LOG_NAME)] == [0, 1, 2, 4]
    assert signal.getsignal(signal.SIGTERM) == before  # the campaign's handler is gone again


def test_structures_are_picked_from_every_component_of_the_mixture_by_weight():
    from carlskit.lopt._campaign import _families, pick_structures

    components = _families()["wide"]()  # 108 MLPs (weight 3), 12 regressions (1), 3 quadratics (0.5)
    kinds = [type(t).__name__ for t in pick_structures(components, 8, 0)]
    assert kinds.count("MLPTask") == 5 and kinds.count("LinearRegressionTask") == 2 \
        and kinds.count("QuadraticTask") == 1
    assert len(set(pick_structures(components, 8, 0))) == 8 and pick_structures(components, 8, 0) \
        == pick_structures(components, 8, 0)
    assert [type(t).__name__ for t in pick_structures(components, 3, 1)] == \
        ["MLPTask", "LinearRegressionTask", "QuadraticTask"]  # each at least once while the count allows
    assert len(pick_structures(_families()["quadratic"](), 8, 0)) == 2  # no more than there are


def test_the_committed_campaign_loads_and_its_log_ends_at_its_state():
    """benchmarks/campaigns/lopt: the run a clone resumes. Its newest state verifies and loads (the
    config from its manifest), and its log ends at that state's outer step."""
    run = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "campaigns" / "lopt"
    campaign, state, metadata = load_state(run)
    records = read_log(run / LOG_NAME)
    assert records[-1]["outer_step"] == metadata["outer_step"] and records[0]["outer_step"] == 0
    assert metadata["best_validation"] == min(r["validation_geomean"] for r in records)
    assert isinstance(campaign.rule, NominalAdamRule) and state["initial_losses"].shape == (8,)
