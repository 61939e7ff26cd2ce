"""Table configs: typed, checked once, round-tripped through JSON; the manifest keeps its format."""

import json
import math

import pytest

from carlskit._serialization import dumps_checked_json
from carlskit.bank import KnowledgeBank
from carlskit.bank._config import EmbeddingTableConfig, FeatureTableConfig, TableConfig

#: the table configs as a snapshot manifest of carlskit before the typed configs stored them
#: (written by main at d2bd370): snapshots saved then must load, and new ones read the same
OLD_MANIFEST_CONFIGS = {
    "emb": {"dim": 4, "epsilon": 1e-07, "hnsw_ef_search": 64, "hnsw_m": 32, "index": "hnsw",
            "index_metric": "dot", "init_scale": 0.5, "initial_accumulator_value": 0.1,
            "initializer": "normal", "kind": "embedding", "learning_rate": 0.1, "max_pending": 16,
            "optimizer": "adagrad", "outlier_threshold": 3.0, "pending_ttl_seconds": "inf", "seed": 3},
    "nbrs": {"kind": "feature", "schema": {"ids": ["int64", 2], "w": ["float32", 2]}},
}


def test_a_table_config_round_trips_through_strict_json():
    configs = [EmbeddingTableConfig(8, "uniform", 5, optimizer="adagrad", pending_ttl_seconds=float("inf"),
                                    index="hnsw", index_metric="l2"),
               FeatureTableConfig({"ids": ("int64", 3), "w": (float, 3)})]
    for config in configs:
        text = json.dumps(config.to_json(), allow_nan=False)  # strict JSON: no Infinity
        assert type(config).from_json(json.loads(text)) == config
        assert TableConfig.from_json(json.loads(text)) == config  # the kind picks the class
    assert configs[0].init_scale == EmbeddingTableConfig(8).init_scale == 1 / math.sqrt(8)
    assert configs[1].to_dict() == {"kind": "feature", "schema": {"ids": ["int64", 3], "w": ["float64", 3]}}
    with pytest.raises(ValueError, match="kind"):
        EmbeddingTableConfig.from_json(configs[1].to_json())


@pytest.mark.parametrize("options, error, named", [
    ({"lerning_rate": 0.1}, TypeError, "lerning_rate"),  # unknown option
    ({"optimizer": "adam"}, ValueError, "optimizer"),
    ({"combine": "median"}, ValueError, "combine"),
    ({"hnsw_m": 1}, ValueError, "hnsw_m"),
    ({"max_pending": 2.5}, TypeError, "max_pending"),
    ({"pending_ttl_seconds": float("nan")}, ValueError, "pending_ttl_seconds"),
    ({"init_scale": "big"}, TypeError, "init_scale"),
])
def test_a_bad_table_option_names_itself_and_creates_nothing(options, error, named):
    kb = KnowledgeBank(num_shards=2)
    with pytest.raises(error, match=named):
        kb.create_table("emb", 4, **options)
    with pytest.raises(error, match=named):
        TableConfig.from_json({"kind": "embedding", "dim": 4, **options})
    assert kb.tables == {}


def test_snapshots_keep_the_manifest_format_and_old_ones_load(tmp_path):
    kb = KnowledgeBank(num_shards=2)
    kb.create_table("emb", 4, seed=3, optimizer="adagrad", pending_ttl_seconds=float("inf"), index="hnsw")
    kb.create_feature_table("nbrs", {"ids": ("int64", 2), "w": ("float32", 2)})
    kb.save(tmp_path / "snap")
    manifest = tmp_path / "snap" / "manifest.json"
    content = json.loads(manifest.read_text())["content"]
    # the old format plus the admission/eviction options and combine, which old manifests lack (defaults then)
    new_options = {"min_count": 1, "max_idle_seconds": "inf", "max_rows_per_shard": None, "combine": "mean"}
    assert {t["name"]: t["config"] for t in content["tables"]} == {
        **OLD_MANIFEST_CONFIGS, "emb": {**OLD_MANIFEST_CONFIGS["emb"], **new_options}}
    for table in content["tables"]:  # as the old code wrote them (key order included)
        table["config"] = dict(sorted(OLD_MANIFEST_CONFIGS[table["name"]].items()))
    manifest.write_bytes(dumps_checked_json(content))
    restored = KnowledgeBank.load(tmp_path / "snap")
    assert restored.tables == kb.tables
    assert restored.tables["emb"]["pending_ttl_seconds"] == float("inf")
