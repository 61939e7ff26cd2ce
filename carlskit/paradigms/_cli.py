"""What every paradigm shares: makers running beside its trainers, an optional Dask cluster and one
JSON line of results."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Sequence
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


@contextlib.contextmanager
def makers_running(makers: Sequence[tuple[Any, Any]], bank: Any, client: Any = None) -> Iterator[None]:
    """Run each ``(maker, checkpoint_store)`` beside the body: started on its store's checkpoints,
    and waited for until it has written the version-0 knowledge (so the first training step reads
    a filled bank); stopped when the body ends, after which the first maker error, if any, is
    raised as a RuntimeError (an error in the body propagates unchanged)."""
    for maker, store in makers:
        maker.start(store, bank, client)
    try:
        for maker, _ in makers:
            maker.wait_for_version(0)
        yield
    finally:
        for maker, _ in makers:
            maker.stop()
    errors = [f"{maker.name}: {error}" for maker, _ in makers for error in maker.status()["errors"]]
    if errors:
        raise RuntimeError(f"a maker failed: {errors[0]}")
