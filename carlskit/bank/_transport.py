"""The shard set of a knowledge bank: where its shards live and how calls reach them.

A :class:`ShardSet` holds a bank's shards: plain :class:`~carlskit.bank._shard._Shard` objects in
this process, or Dask actors pinned to workers (round robin over the placement's workers). It
routes keys to shards (``splitmix64(key) mod num_shards``), submits one call per shard (the batch
calls on the direct ZeroMQ path of :mod:`carlskit.bank._direct` where the cluster speaks plain tcp,
the rest through Dask's actor RPC; calls to different shards are issued together, then awaited),
and collects the answers. A shard whose actor or worker is gone is recognised by type and actor
state (:func:`carlskit.cluster.is_worker_loss`, never an error message) and raised as
:class:`ShardLostError`, saying which shards applied their part. :meth:`ShardSet.rebuild` starts a
lost shard again on a live worker (what ``KnowledgeBank.recover`` fills from a snapshot).
"""

from __future__ import annotations

import collections
import functools
import gc
import threading
from typing import Any, Callable

import numpy as np

from carlskit._errors import WorkerLostError
from carlskit.bank._direct import DirectCall, DirectPath, DirectPathLost, DirectRequestLost
from carlskit.bank._hashing import shard_of
from carlskit.bank._shard import _Shard
from carlskit.bank._snapshot import run_parallel
from carlskit.cluster import ActorHost, Placement, actor_lost, is_worker_loss, worker_gone

#: Short batch methods run on the worker's event loop (``separate_thread=False``): this saves a
#: thread hand-off per call. Long ones (nearest, sample, stats, snapshots) keep Dask's actor thread.
_ON_EVENT_LOOP = frozenset({"lookup", "update", "apply_gradients", "row_metadata", "ping",
                            "table_configs"})


class ShardLostError(WorkerLostError):
    """A shard's actor (or its worker) is gone. ``bank.recover()`` rebuilds it alone from the
    latest snapshot (:meth:`KnowledgeBank.enable_snapshots`), or ``KnowledgeBank.load(snapshot)``
    restores the whole bank.

    A batch call that reaches several shards waits for all of them before raising, and says what
    happened: ``shard`` (the first lost one), ``lost_shards``, ``applied_shards`` (the shards that
    acknowledged the call: their part was applied), and for ``lookup``, ``update`` and
    ``apply_gradients`` (and ``row_metadata``) ``applied_keys`` / ``unapplied_keys`` (int64 arrays;
    None for other calls).
    A lost shard's part was not acknowledged: after ``recover()`` it is there only if the shard's
    write-ahead log recorded it before the worker died, so re-send ``unapplied_keys`` (an
    ``update`` is idempotent; a gradient counts once if it was sent with a ``push_id`` and is
    re-sent with the same one, else it may count twice).
    """

    def __init__(self, message: str, shard: int | None = None) -> None:
        super().__init__(message)
        self._bank: Any = None  # weakref to the bank that raised it
        self.shard = shard
        self.lost_shards: list[int] = [] if shard is None else [shard]
        self.applied_shards: list[int] = []
        self.applied_keys: np.ndarray | None = None
        self.unapplied_keys: np.ndarray | None = None

    @property
    def bank(self) -> Any:
        """The bank that raised this error (None once it is gone): its :meth:`~KnowledgeBank.recover`
        rebuilds the shard (what ``Trainer.fit`` does)."""
        return None if self._bank is None else self._bank()


class _Failed:
    """A shard call that could not even be sent (its error is raised when the batch is
    collected, after the other shards' calls were awaited)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def done(self) -> bool:
        return True


class BankFuture:
    """A bank call in flight (:meth:`KnowledgeBank.lookup_async`,
    :meth:`KnowledgeBank.apply_gradients_async`): one call per shard already sent.

    ``result()`` waits for every shard and returns what the blocking method returns (raising its
    errors, e.g. :class:`ShardLostError`); later calls return the same object. ``done()`` says
    whether every shard has answered, without waiting.
    """

    def __init__(self, shards: "ShardSet", pending: dict[int, Any],
                 finish: Callable[[dict[int, Any]], Any],
                 sent: dict[int, np.ndarray] | None = None) -> None:
        self._shards = shards
        self._sent = sent
        self._pending: dict[int, Any] | None = pending
        self._finish = finish
        self._value: Any = None
        self._lock = threading.Lock()

    def done(self) -> bool:
        pending = self._pending
        if pending is None or not self._shards.remote:
            return True
        return all(future.done() for future in pending.values())

    def result(self) -> Any:
        with self._lock:
            if self._pending is not None:
                self._value = self._finish(self._shards.collect(self._pending, self._sent))
                self._pending = None
            return self._value

    def __repr__(self) -> str:
        return f"<BankFuture: {'done' if self.done() else 'pending'}>"


class ShardSet:
    """The shards of one bank (a sequence: ``shards[i]`` is shard i's object or actor handle).

    Built by :meth:`start` (new shards), :meth:`attach` (a published bank's) or unpickling (handles
    to the same actors, e.g. inside a Dask task; they find their worker or client themselves).
    ``owned``: this set holds the futures that keep the actors alive, so it can publish, rebuild
    and release them. ``remote``: the shards are Dask actors (False: in this process).
    """

    def __init__(self, shards: list[Any], workers: list[str | None], *, remote: bool,
                 client: Any = None, futures: list[Any] | None = None,
                 direct: DirectPath | None = None, clock: Callable[[], float] | None = None,
                 placement: Placement | None = None) -> None:
        self.shards = list(shards)
        self.workers = list(workers)
        self.remote = remote
        self.client = client
        self.futures = list(futures or [])
        self.direct = direct
        self.clock = clock
        self.placement = placement or Placement()
        self.owner: Any = None  # weakref to the bank, named by the ShardLostErrors raised
        self.published: str | None = None

    @classmethod
    def start(cls, client: Any, num_shards: int, clock: Callable[[], float] | None,
              direct: bool, placement: Placement) -> "ShardSet":
        """New empty shards: in this process (``client`` None) or one Dask actor per shard."""
        if client is None:
            return cls([_Shard(i, num_shards, clock) for i in range(num_shards)], [None] * num_shards,
                       remote=False, clock=clock, placement=placement)
        workers = placement.candidates(client)
        if not workers:
            raise ValueError(f"client has no workers to host the bank's shards (placement: {placement})")
        shards = cls([], [workers[i % len(workers)] for i in range(num_shards)], remote=True,
                     client=client, clock=clock, placement=placement)
        shards.futures = [shards._start_actor(i, worker) for i, worker in enumerate(shards.workers)]
        shards.shards = [future.result() for future in shards.futures]
        if direct:
            shards.direct = _open_direct_path(shards.shards)
        return shards

    def _start_actor(self, index: int, worker: str) -> Any:
        """The future of a new actor for shard ``index`` (of ``len(self.workers)``) on ``worker``."""
        return self.client.submit(_Shard, index, len(self.workers), self.clock, worker_process=True,
                                  actor=True, workers=[worker], allow_other_workers=False, pure=False)

    @classmethod
    def attach(cls, client: Any, name: str) -> "ShardSet":
        """The shards published under ``name`` (:meth:`publish`), owned by the new set too."""
        handle = client.get_dataset(name)
        futures = list(handle["shards"])
        return cls([future.result() for future in futures], handle["workers"], remote=True,
                   client=client, futures=futures, direct=handle.get("direct"))

    def publish(self, name: str) -> None:
        """Make these shards reachable by other processes (:meth:`attach`)."""
        if not self.remote or not self.futures:
            raise ValueError("publish needs the distributed bank (client=...) that created the "
                             "shards, or one attached to them")
        if self.client is None:
            from distributed import get_client

            self.client = get_client()
        self.published = name
        self.client.publish_dataset(**{name: {"shards": self.futures, "workers": self.workers,
                                              "direct": self.direct}}, override=True)

    def with_direct(self, direct: DirectPath | None) -> "ShardSet":
        """Handles to the same shards that send batch calls on ``direct`` (None: actor RPC only)."""
        return ShardSet(self.shards, self.workers, remote=self.remote, direct=direct)

    def __reduce__(self):
        """Pickles as handles to the actors (the copy owns nothing and finds its own client)."""
        if not self.remote:
            raise TypeError("an in-process KnowledgeBank cannot be pickled; create it with a "
                            "Dask client to share it, or save() it and load() it elsewhere")
        return (functools.partial(ShardSet, remote=True, direct=self.direct),
                (self.shards, self.workers))

    def __len__(self) -> int:
        return len(self.shards)

    def __getitem__(self, index: int) -> Any:
        return self.shards[index]

    @property
    def owned(self) -> bool:
        return bool(self.futures)

    @property
    def transport(self) -> str:
        if not self.remote:
            return "in-process"
        return "direct" if self.direct is not None else "dask"

    def require_open(self) -> None:
        if not self.shards:
            raise ValueError("this KnowledgeBank is closed; load() a snapshot or create a new one")

    # ------------------------------------------------------------------ routing and calls
    def route(self, keys: np.ndarray) -> list[tuple[int, np.ndarray | None]]:
        """[(shard, positions of its keys)]; positions None means every key (single shard)."""
        num_shards = len(self.shards)
        if num_shards == 1:
            return [(0, None)]
        shard = shard_of(keys, num_shards)
        if num_shards <= np.iinfo(np.uint16).max:
            shard = shard.astype(np.uint16)  # numpy sorts 16-bit ints by radix sort: O(n)
        order = np.argsort(shard, kind="stable")
        bounds = np.searchsorted(shard[order], np.arange(num_shards + 1))
        return [(s, order[bounds[s]:bounds[s + 1]]) for s in range(num_shards)
                if bounds[s + 1] > bounds[s]]

    def submit(self, method: str, calls: dict[int, tuple]) -> dict[int, Any]:
        """Issue one call per shard in ``calls`` ({shard: args}) without waiting. Distributed: the
        Dask actor futures ({shard: future}); in-process: the results, computed at once. A call
        that cannot be sent is kept as a failure and raised by :meth:`collect` once the other
        shards' calls were awaited (so the error can say which shards applied theirs)."""
        self.require_open()
        if not self.remote:
            return {i: getattr(self.shards[i], method)(*args) for i, args in calls.items()}
        futures: dict[int, Any] = {}
        options = {"separate_thread": False} if method in _ON_EVENT_LOOP else {}
        direct = self.direct
        for i, args in calls.items():
            try:
                call = None
                if direct is not None and direct.serves(i, method):
                    alive = functools.partial(_direct_server_answers, self.shards[i],
                                              direct.addresses[i]["token"])
                    call = direct.call(i, method, args, alive)  # None: unreachable from here
                futures[i] = call if call is not None else getattr(self.shards[i], method)(
                    *args, **options)
            except Exception as error:  # noqa: BLE001 - classified by type and actor state
                lost = (isinstance(error, DirectPathLost) or is_worker_loss(error)
                        or self.actor_gone(i))
                futures[i] = _Failed(self.lost_error(i, error) if lost else error)
        return futures

    def result(self, i: int, future: Any) -> Any:
        """The result of one shard call; ShardLostError when its actor or worker is gone."""
        if isinstance(future, _Failed):
            raise future.error
        if isinstance(future, DirectCall):
            try:
                return future.result()
            except DirectRequestLost as error:  # the shard lives; only this call is in doubt
                raise ConnectionError(f"shard {i} of {len(self)}: {error}; the shard is still "
                                      f"serving, so the call can be retried (a write may already "
                                      f"have been applied)") from error
            except DirectPathLost as error:  # any other error is the shard's own: as is
                raise self.lost_error(i, error) from error
        try:
            return future.result()
        except Exception as error:
            if is_worker_loss(error) or self.actor_gone(i):
                raise self.lost_error(i, error) from error
            raise

    def collect(self, pending: dict[int, Any],
                keys_by_shard: dict[int, np.ndarray] | None = None) -> dict[int, Any]:
        """Wait for every call issued by :meth:`submit`; {shard: result}. A failed shard raises
        its own error, or ShardLostError naming it (with what was applied where) when its actor or
        worker is gone. ``keys_by_shard``: the keys each shard was sent (for the error)."""
        if not self.remote:
            return pending
        results: dict[int, Any] = {}
        lost: list[ShardLostError] = []
        other: BaseException | None = None
        for i, future in pending.items():
            try:
                results[i] = self.result(i, future)
            except ShardLostError as error:
                lost.append(error)
            except Exception as error:  # noqa: BLE001 - raised below, after every shard answered
                other = other or error
        if lost:
            raise _what_was_applied(lost, results, keys_by_shard)
        if other is not None:
            raise other
        return results

    def call(self, method: str, calls: dict[int, tuple],
             keys_by_shard: dict[int, np.ndarray] | None = None) -> dict[int, Any]:
        """One call per shard in ``calls`` ({shard: args}); distributed calls run concurrently.
        ``keys_by_shard``: the keys each shard is sent (a ShardLostError says which were applied)."""
        return self.collect(self.submit(method, calls), keys_by_shard)

    def call_all(self, method: str, *args: Any) -> list[Any]:
        """The same call on every shard; the results in shard order."""
        results = self.call(method, {i: args for i in range(len(self))})
        return [results[i] for i in range(len(self))]

    def call_parallel(self, method: str, calls: dict[int, tuple]) -> dict[int, Any]:
        """Like :meth:`call`, with in-process shards in threads (snapshot parts in parallel)."""
        if self.remote:
            return self.call(method, calls)
        self.require_open()
        items = list(calls.items())
        results = run_parallel([functools.partial(getattr(self.shards[i], method), *args)
                                for i, args in items])
        return {i: result for (i, _), result in zip(items, results)}

    # ------------------------------------------------------------------ loss and recovery
    def lost_error(self, index: int, error: BaseException) -> ShardLostError:
        """The ShardLostError of shard ``index``, caused by ``error``."""
        where = f" on worker {self.workers[index]}" if self.workers[index] else ""
        lost = ShardLostError(
            f"shard {index} of {len(self)}{where} is unreachable ({type(error).__name__}: "
            f"{error}); its rows are gone from this bank: bank.recover() rebuilds it alone from "
            f"the latest snapshot (see enable_snapshots), or KnowledgeBank.load(<snapshot>, "
            f"client) restores the whole bank", shard=index)
        lost.__cause__ = error
        lost._bank = self.owner
        return lost

    def actor_gone(self, index: int) -> bool:
        """Whether shard ``index``'s actor is known to be gone: the future that created it is no
        longer finished, or its worker left the cluster (state, never an error message)."""
        future = self.futures[index] if self.futures else getattr(self.shards[index], "_future", None)
        return actor_lost(future) or worker_gone(self.client, self.workers[index])

    def lost(self) -> list[int]:
        """Shards whose actor or worker is gone (each checked by its actor's state, then a ping)."""
        lost = []
        for i in range(len(self)):
            if self.actor_gone(i):
                lost.append(i)
                continue
            try:
                self.call("ping", {i: ()})
            except ShardLostError:
                lost.append(i)
        return lost

    def rebuild(self, shard: int, lost: list[int], fill: Callable[[Any], Any]) -> tuple[str, Any]:
        """Start lost ``shard`` again, empty, on a live worker of the placement; ``fill(actor)``
        restores its contents before it replaces the lost one (and the set is published again,
        if it was). Returns (worker, what ``fill`` returned)."""
        # The kit's ActorHost builds it on the chosen worker; once filled it replaces the lost one,
        # whose future the host releases (a failed fill drops the new actor and keeps the shard lost).
        host = ActorHost(self.client, self.placement, f"bank-shard-{shard}")
        host.future, host.worker = self.futures[shard], self.workers[shard]
        creating = host.submit(_Shard, shard, len(self.workers), self.clock, worker_process=True,
                               worker=self._pick_worker(lost))
        try:
            new = creating.result()
            filled = fill(new)
            address = new.open_direct_path().result() if self.direct is not None else None
        except BaseException:
            host.creating = None
            creating.release()
            raise
        actor = host.adopt(timeout=None)
        worker = host.worker
        self.shards[shard], self.futures[shard], self.workers[shard] = actor, host.future, worker
        if self.direct is not None:
            addresses = list(self.direct.addresses)
            addresses[shard] = address
            self.direct = DirectPath(addresses)
        if self.published is not None:
            self.publish(self.published)
        return worker, filled

    def _pick_worker(self, lost: list[int]) -> str:
        """A live worker of the placement for a rebuilt shard: the one holding the fewest live shards
        (:meth:`carlskit.cluster.Placement.choose` with their load), never one whose shard was lost."""
        dead = {self.workers[i] for i in lost}
        if not set(self.placement.candidates(self.client)) - dead:
            raise ShardLostError(f"no live worker to rebuild shards {lost} on (placement: {self.placement})")
        load = collections.Counter(w for i, w in enumerate(self.workers) if i not in lost)
        return self.placement.choose(self.client, exclude=dead, load=load)

    def close(self) -> None:
        """Release the shard actors (owned) or drop the handles / in-process shards."""
        owned = self.owned
        self.direct = None
        for future in self.futures:
            future.release()
        self.futures = []
        self.shards = []
        if owned:
            # Finished Dask actor calls can leave the actor handles in reference cycles, which
            # keep the actors (and their servers) alive until the next cyclic collection.
            gc.collect()


def _what_was_applied(lost: list[ShardLostError], results: dict[int, Any],
                      keys_by_shard: dict[int, np.ndarray] | None) -> ShardLostError:
    """The first lost shard's error, saying which shards (and keys) applied the call."""
    error = lost[0]
    error.lost_shards = [e.shard for e in lost]
    error.applied_shards = sorted(results)
    if keys_by_shard is not None:
        empty = np.empty(0, np.int64)
        error.applied_keys = np.concatenate([empty] + [keys_by_shard[i] for i in sorted(results)])
        error.unapplied_keys = np.concatenate(
            [empty] + [keys for i, keys in sorted(keys_by_shard.items()) if i not in results])
    return error


def _direct_server_answers(actor: Any, token: str, timeout: float = 30.0) -> None:
    """Raise unless the shard actor answers through Dask within ``timeout`` seconds that its
    direct server (with ``token``) is still running."""
    if not actor.direct_path_serving(token, separate_thread=False).result(timeout=timeout):
        raise DirectPathLost("the shard's direct server has stopped")


def _open_direct_path(actors: list[Any]) -> DirectPath | None:
    """Start every shard's direct server; None when no shard can serve one (not plain tcp)."""
    addresses = [future.result() for future in [actor.open_direct_path() for actor in actors]]
    return DirectPath(addresses) if any(addresses) else None

