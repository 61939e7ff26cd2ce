"""Graph-regularized SSL end to end: bank, makers and trainer together."""

import json
import subprocess
import sys

import numpy as np
import pytest

from carlskit.bank import KnowledgeBank
from carlskit.data import load_digits
from carlskit.paradigms import graph_reg
from carlskit.training import check_embedding_dim


def test_learned_graph_run_fills_the_bank_and_reports_staleness():
    data = load_digits(0.05, seed=0)
    config = graph_reg.GraphRegConfig(learned_graph=True, neighbors=5, steps=40, warmup_steps=5,
                                      checkpoint_every=5, hidden=32)
    result = graph_reg.train(data, config, regularize=True, seed=0)
    assert result["steps"] == 40
    embeddings, neighbors = result["maker_status"]
    assert embeddings["errors"] == [] and neighbors["errors"] == []
    assert embeddings["slices"][0]["rounds"] >= 1 and neighbors["slices"][0]["rounds"] >= 1
    assert result["mean_staleness"] is not None and result["mean_staleness"] >= 0
    staleness = [r["staleness"] for r in result["history"] if np.isfinite(r.get("staleness", np.nan))]
    assert staleness, "the trainer read bank embeddings"
    assert any(r.get("graph", 0) > 0 for r in result["history"]), "the regularizer was active"
    assert 0.5 < result["test_acc"] <= 1.0


def test_model_embedding_dim_must_match_the_table():
    bank = KnowledgeBank()
    bank.create_table("emb", dim=7)
    check_embedding_dim(bank, "emb", 7)
    with pytest.raises(ValueError, match="embedding dim 10 differs from bank table 'emb'.s dim 7"):
        check_embedding_dim(bank, "emb", 10)
    with pytest.raises(ValueError, match="no table 'missing'"):
        check_embedding_dim(bank, "missing", 7)


@pytest.mark.slow
def test_cora_graph_regularization_beats_the_plain_mlp():
    # No --data: Cora is the default and ships in data/planetoid (no set-up, no ../shared).
    out = subprocess.run([sys.executable, "-m", "carlskit.paradigms.graph_reg", "--steps", "200", "--neighbors", "16"],
                         capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "cora: MLP alone" in out.stderr and "cora: MLP + graph regularization" in out.stderr, "labelled bars"
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"base_test_acc", "graph_reg_test_acc", "steps", "seconds"} <= set(result)
    assert result["steps"] == 200
    assert result["graph_reg_test_acc"] >= result["base_test_acc"] + 0.10, result


def test_the_checkpoint_most_accurate_on_validation_is_the_result(tmp_path):
    import optax
    from flax import nnx

    from carlskit.data import synthetic_planetoid
    from carlskit.training import CheckpointStore, Trainer

    data = synthetic_planetoid(num_nodes=400, num_classes=3, num_features=90, feature_signal=0.3, homophily=0.85,
                               labels_per_class=8, num_val=120, num_test=150, seed=5)
    config = graph_reg.GraphRegConfig(steps=40, checkpoint_every=5, warmup_steps=5, batch_size=128, hidden=16)
    result = graph_reg.train(data, config, regularize=True, seed=0, workdir=str(tmp_path))
    assert result["val_acc"] >= result["last_val_acc"]
    # Replay the selection from the kept checkpoints: the latest of the most accurate on validation.
    store = CheckpointStore(tmp_path / "checkpoints", keep=None)
    model = graph_reg.MLP(data.num_features, 16, 3, dropout=0.5, seed=0)
    target = Trainer(model, optax.adamw(0.01), graph_reg.loss_fn).checkpoint_tree()
    scores = {}
    for version in store.versions():
        nnx.update(model, store.load(version, target=target)[0]["model"])
        scores[version] = graph_reg.accuracy(model, graph_reg._features(data), data.labels, data.val_idx)
    assert sorted(scores) == list(range(0, 41, 5))
    assert result["val_acc"] == max(scores.values())
    assert result["selected_step"] == max(s for s, v in scores.items() if v == max(scores.values()))
    nnx.update(model, store.load(result["selected_step"], target=target)[0]["model"])
    assert result["test_acc"] == graph_reg.accuracy(model, graph_reg._features(data), data.labels, data.test_idx)
