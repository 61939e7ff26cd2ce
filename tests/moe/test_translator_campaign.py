"""The translator's resumable campaign (issue 42): interrupted runs add up to the uninterrupted one;
SIGTERM stops it saved; a damaged newest state is skipped and the log follows the state loaded."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx

from carlskit._campaign import LOG_NAME, read_log
from carlskit.checkpoints import CheckpointStore
from carlskit.moe._translator_campaign import TranslatorConfig, load_config, run_translator_campaign

TINY = dict(languages=3, d_model=16, num_heads=2, ffn_dim=32, num_layers=2, num_experts=4, max_length=16,
            buckets=(8,), tokens_per_batch=96, warmup_steps=4, validate_every_steps=3, validation_per_tag=2)
ROOT = pathlib.Path(__file__).resolve().parents[2]


def weights(trainer) -> list[np.ndarray]:
    trainer.sync()
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(trainer.model, nnx.Param))]


def quiet(line: str) -> None:
    pass


def test_a_campaign_resumed_midway_ends_where_the_uninterrupted_one_does(tmp_path):
    _, straight, straight_log = run_translator_campaign(tmp_path / "a", TranslatorConfig(**TINY), stop_step=6,
                                                        log=quiet)
    run_translator_campaign(tmp_path / "b", TranslatorConfig(**TINY), stop_step=3, log=quiet)
    assert [r["step"] for r in read_log(tmp_path / "b" / LOG_NAME)] == [0, 3]
    _, resumed, resumed_log = run_translator_campaign(tmp_path / "b", resume=True, stop_step=6, log=quiet)
    assert resumed.step == straight.step == 6
    for got, want in zip(weights(resumed), weights(straight)):
        np.testing.assert_array_equal(got, want)
    assert [r["step"] for r in resumed_log] == [r["step"] for r in straight_log] == [0, 3, 6]
    assert resumed_log == read_log(tmp_path / "b" / LOG_NAME)
    cpu = [r["cpu_seconds"] for r in resumed_log]
    assert cpu == sorted(cpu) and cpu[-1] > 0  # CPU time adds up over the two runs
    np.testing.assert_allclose([r["train_loss"] for r in resumed_log[1:]],
                               [r["train_loss"] for r in straight_log[1:]], rtol=1e-6)
    assert load_config(tmp_path / "b") == TranslatorConfig(**TINY)


def test_a_damaged_newest_state_is_skipped_and_the_log_follows_the_state_loaded(tmp_path):
    run_translator_campaign(tmp_path, TranslatorConfig(**TINY), stop_step=6, log=quiet)
    store = CheckpointStore(tmp_path / "state")
    assert store.versions() == [3, 6]
    path = pathlib.Path(store.file(6))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    _, trainer, records = run_translator_campaign(tmp_path, resume=True, stop_step=3, log=quiet)
    assert trainer.step == 3
    assert [r["step"] for r in read_log(tmp_path / LOG_NAME)] == [0, 3]


def test_a_started_campaign_is_not_started_again_and_a_missing_one_not_resumed(tmp_path):
    campaign, _, _ = run_translator_campaign(tmp_path / "run", TranslatorConfig(**{**TINY, "buckets": (6, 10)}),
                                             stop_step=0, log=quiet)
    # length buckets: every pair in the first bucket that holds it whole, batches cut to that length
    pad = campaign.model.pad_id
    assert [length for length, _, _ in campaign.buckets] == [6, 10, 16]
    assert sum(len(rows) for _, _, rows in campaign.buckets) == len(campaign.source)
    for length, size, rows in campaign.buckets:
        assert size == 96 // length
        assert (campaign.source[rows, length:] == pad).all() and (campaign.target[rows, length:] == pad).all()
    widths = {campaign.batch_at(step)["source"].shape for step in range(40)}
    assert widths <= {(16, 6), (9, 10), (6, 16)} and len(widths) >= 2
    with pytest.raises(FileExistsError, match="--resume"):
        run_translator_campaign(tmp_path / "run", TranslatorConfig(**TINY), stop_step=0, log=quiet)
    with pytest.raises(FileNotFoundError, match="--campaign"):
        run_translator_campaign(tmp_path / "none", resume=True, log=quiet)
    with pytest.raises(ValueError, match="from_english"):
        run_translator_campaign(tmp_path / "bad", TranslatorConfig(**{**TINY, "from_english": ("xx",)}), log=quiet)
    with pytest.raises(ValueError, match="dropout_rate"):
        TranslatorConfig(dropout_rate=1.0)


def test_sigterm_stops_a_background_campaign_saved_and_resume_goes_on(tmp_path):
    run = tmp_path / "run"
    sets = [f"--set={k}={json.dumps(v)}" for k, v in {**TINY, "validate_every_steps": 100000}.items()]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen([sys.executable, "-m", "carlskit.moe.train_translator", "--campaign",
                                "--run-dir", str(run), *sets], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not read_log(run / LOG_NAME) and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.2)
        time.sleep(2.0)  # some steps past step 0
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 0, out[-2000:]
    records = read_log(run / LOG_NAME)
    stopped = records[-1]["step"]
    assert stopped > 0 and CheckpointStore(run / "state").latest() == stopped, out[-2000:]
    _, trainer, _ = run_translator_campaign(run, resume=True, stop_step=stopped + 2, log=quiet)
    assert trainer.step == stopped + 2


def test_the_committed_campaign_is_intact_and_its_log_ends_at_its_state():
    """benchmarks/campaigns/translator: the run a clone resumes (--resume --run-dir ...). Its newest
    state verifies (every byte checksummed), its config loads, and its log ends at that state."""
    run = ROOT / "benchmarks" / "campaigns" / "translator"
    store = CheckpointStore(run / "state")
    newest = store.latest()
    assert newest is not None and store.verify(newest) is None
    config = load_config(run)
    records = read_log(run / LOG_NAME)
    assert records[-1]["step"] == newest and records[0]["step"] == 0
    assert [r["step"] for r in records] == sorted(r["step"] for r in records)
    assert config.validate_every_steps > 0 and records[-1]["cpu_seconds"] > 0
