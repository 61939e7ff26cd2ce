"""What every paradigm command shares: an optional Dask cluster and one JSON line of results."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any


def run_and_print(workers: int, run: Callable[[Any, int], dict]) -> dict:
    """``run(client, num_shards)`` with an embedded cluster of ``workers`` worker processes (no
    cluster when 0), closed afterwards; prints the result as one JSON object, the last line."""
    if workers < 0:
        raise ValueError(f"workers must be >= 0, got {workers}")
    client = None
    if workers > 0:
        from carlskit.cluster import connect

        client = connect(n_workers=workers)
    try:
        result = run(client, max(1, workers))
    finally:
        if client is not None:
            client.close()
    print(json.dumps(result))
    return result
