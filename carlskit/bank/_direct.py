"""The direct data path: batch calls to a distributed bank's shards over ZeroMQ, beside Dask.

A Dask actor call costs about 1 ms of client CPU and 1 ms of worker CPU in Dask's messaging layer
(measured with an actor that does no work: 2 shards x 2048 keys in, 2048 x 64 float32 out, 1.3M
rows/s at best on 2 cores), more than the shard's own work (0.2 ms for a 2048-key lookup). So each
shard actor also serves its hot batch methods (``lookup``, ``update``, ``apply_gradients``,
``row_metadata``) on a ZeroMQ ROUTER socket bound to its worker's host; the bank's client sends
one multipart message per shard per batch: a JSON header plus the raw array buffers (no pickle,
zero-copy sends). Everything else (table creation, ``nearest``, ``sample``, stats, snapshots)
keeps using the actor.

Trust: the endpoint and a random 128-bit token are handed out by the actor, i.e. over Dask's own
comm, and every request must carry the token (compared in constant time). That is the trust model
of a plain ``tcp://`` Dask cluster; a cluster on any other protocol (``tls://``, ``ucx://``,
``inproc://``) gets no direct path and the bank uses Dask's RPC for everything, so encryption is
never silently dropped.

Ordering: one server thread per shard handles requests in arrival order, and the shard's lock
serialises them with the actor's methods. One client socket per (thread, shard) keeps a thread's
requests in order; replies are matched to requests by id, so futures may be waited for in any
order and from any thread.
"""

from __future__ import annotations

import builtins
import hmac
import json
import os
import secrets
import struct
import threading
import time
import weakref
from typing import Any, Callable

import numpy as np

#: shard methods served on the direct path (everything else goes through the Dask actor)
DIRECT_METHODS = frozenset({"lookup", "update", "apply_gradients", "row_metadata", "ping"})
#: seconds between liveness checks while a reply is awaited (a lost worker never answers)
LIVENESS_SECONDS = 1.0
#: seconds a first ping on a new channel may take before the shard counts as unreachable from here
REACH_SECONDS = 10.0
#: milliseconds a waiting thread polls the socket before letting other threads use the channel
_WAIT_SLICE_MS = 10
#: milliseconds the server thread sleeps in poll before checking whether it should stop
_SERVER_POLL_MS = 200
_REQUEST_ID = struct.Struct("<Q")


class DirectPathLost(ConnectionError):
    """The shard behind a direct channel no longer answers (its worker or actor is gone)."""


class DirectRequestLost(DirectPathLost):
    """A request or its reply was lost in transit (a reset connection) while the server is alive:
    a write may or may not have been applied."""


class ShardError(Exception):
    """An error raised in a shard whose type is not a Python built-in (type name in the message)."""


def _error_message(error: BaseException) -> dict[str, str]:
    args = error.args
    text = args[0] if len(args) == 1 and isinstance(args[0], str) else str(error)
    return {"type": type(error).__name__, "message": text}


def _rebuilt_error(error: dict[str, str]) -> Exception:
    """The shard's error as the built-in exception type it had, else :class:`ShardError`."""
    kind = getattr(builtins, error["type"], None)
    if isinstance(kind, type) and issubclass(kind, Exception):
        return kind(error["message"])
    return ShardError(f"{error['type']}: {error['message']}")


# ----------------------------------------------------------------------------- message codec
def encode(value: Any) -> tuple[bytes, list[np.ndarray]]:
    """``value`` (arrays, tuples, lists, str-keyed dicts, JSON scalars) as a JSON header and the
    list of array buffers it refers to by index."""
    frames: list[np.ndarray] = []

    def spec(item: Any) -> Any:
        if isinstance(item, np.ndarray):
            frames.append(np.ascontiguousarray(item))
            return {"a": len(frames) - 1, "d": item.dtype.str, "s": list(item.shape)}
        if isinstance(item, np.generic):
            return item.item()
        if item is None or isinstance(item, (bool, int, float, str)):
            return item
        if isinstance(item, (tuple, list)):
            return {"t": [spec(x) for x in item]}
        if isinstance(item, dict):
            return {"m": {str(k): spec(v) for k, v in item.items()}}
        raise TypeError(f"cannot send a {type(item).__name__} on the direct path")

    return json.dumps(spec(value)).encode(), frames


def decode(header: bytes | memoryview, frames: list[Any]) -> Any:
    """Inverse of :func:`encode`; arrays are read-only views of the received buffers."""

    def value(item: Any) -> Any:
        if not isinstance(item, dict):
            return item
        if "a" in item:
            buffer = frames[item["a"]]
            buffer = getattr(buffer, "buffer", buffer)  # a zmq.Frame or any buffer
            return np.frombuffer(buffer, dtype=np.dtype(item["d"])).reshape(item["s"])
        if "t" in item:
            return tuple(value(x) for x in item["t"])
        return {k: value(v) for k, v in item["m"].items()}

    return value(json.loads(bytes(header)))


# ----------------------------------------------------------------------------- server (worker side)
def worker_host() -> str | None:
    """Host of this Dask worker's contact address when it speaks plain tcp, else None."""
    try:
        from distributed import get_worker
        from distributed.comm.addressing import get_address_host, parse_address

        address = get_worker().address
    except (ImportError, ValueError):  # not inside a worker
        return None
    scheme, _ = parse_address(address)
    return get_address_host(address) if scheme == "tcp" else None


class DirectServer:
    """Serves one shard's batch methods on a ZeroMQ ROUTER socket from a daemon thread.

    The thread holds the shard only weakly: releasing the actor stops the server (as does
    :meth:`stop`). Requests: ``[id, token, method, header, *arrays]``; replies: ``[id, b"ok",
    header, *arrays]`` or ``[id, b"error", {"type", "message"}]``.
    """

    def __init__(self, shard: Any, host: str) -> None:
        import zmq

        self.token = secrets.token_bytes(16)
        self._stop = threading.Event()
        self._socket = zmq.Context.instance().socket(zmq.ROUTER)
        self._socket.linger = 0
        self._socket.sndhwm = self._socket.rcvhwm = 0  # never drop a reply (ROUTER would, silently)
        if ":" in host:
            self._socket.ipv6 = True
        bracketed = f"[{host}]" if ":" in host else host
        port = self._socket.bind_to_random_port(f"tcp://{bracketed}")
        self.endpoint = f"tcp://{bracketed}:{port}"
        self._thread = threading.Thread(target=self._serve, args=(weakref.ref(shard),),
                                        name=f"carlskit-bank-direct-{shard.shard_index}-{port}",
                                        daemon=True)
        self._thread.start()
        weakref.finalize(shard, self._stop.set)

    @property
    def address(self) -> dict[str, str]:
        return {"endpoint": self.endpoint, "token": self.token.hex()}

    @property
    def serving(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def stop(self) -> None:
        self._stop.set()

    def _serve(self, shard_ref: Callable[[], Any]) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(_SERVER_POLL_MS):
                    continue
                frames = self._socket.recv_multipart(copy=False)
                if len(frames) < 5:  # not our protocol: nothing to answer to
                    continue
                peer, request_id = frames[0], frames[1]
                shard = shard_ref()
                if shard is None:
                    break
                reply = self._handle(shard, frames[2:])
                del shard
                self._socket.send_multipart([peer, request_id, *reply], copy=False)
        finally:
            self._socket.close(linger=0)

    def _handle(self, shard: Any, frames: list[Any]) -> list[Any]:
        token, method, header, arrays = frames[0], frames[1], frames[2], frames[3:]
        try:
            if not hmac.compare_digest(token.bytes, self.token):
                raise PermissionError("bad token for this shard's direct path")
            name = method.bytes.decode()
            if name not in DIRECT_METHODS:
                raise ValueError(f"method {name!r} is not served on the direct path")
            result_header, result_frames = encode(getattr(shard, name)(*decode(header.bytes, arrays)))
            return [b"ok", result_header, *result_frames]
        except Exception as error:  # noqa: BLE001 - every error goes back to the caller
            return [b"error", json.dumps(_error_message(error)).encode()]


# ----------------------------------------------------------------------------- client side
class DirectChannel:
    """One client socket to one shard's :class:`DirectServer`, for one thread (sockets are not
    thread-safe; the lock lets another thread wait for a reply sent from here)."""

    def __init__(self, endpoint: str, token: str) -> None:
        import zmq

        self._zmq = zmq
        self._token = bytes.fromhex(token)
        self._socket = zmq.Context.instance().socket(zmq.DEALER)
        self._socket.linger = 0
        self._socket.sndhwm = self._socket.rcvhwm = 0
        if endpoint.startswith("tcp://["):
            self._socket.ipv6 = True
        self._socket.connect(endpoint)
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._next_id = 0
        self._replies: dict[int, tuple[bytes, list[Any]]] = {}
        self._forgotten: set[int] = set()  # requests whose DirectCall was dropped unanswered

    def send(self, method: str, args: tuple) -> int:
        header, frames = encode(args)
        with self._lock:
            request_id = self._next_id
            self._next_id += 1
            try:
                self._socket.send_multipart([_REQUEST_ID.pack(request_id), self._token,
                                             method.encode(), header, *frames], copy=False)
                while self._socket.poll(0):  # replies nobody waits for yet leave ZeroMQ's queues
                    self._receive_one()
            except self._zmq.ZMQError as error:
                raise DirectPathLost(f"cannot send to the shard's direct path: {error}") from error
        return request_id

    def reaches_server(self, seconds: float = REACH_SECONDS) -> bool:
        """Whether a ping over this channel is answered within ``seconds`` (the endpoint may be
        unreachable from this process: NAT, firewall, a contact address that is not local)."""
        request_id = self.send("ping", ())
        deadline = time.monotonic() + seconds
        with self._lock:
            while request_id not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0 or not self._socket.poll(int(left * 1000) + 1):
                    break
                self._receive_one()
        if request_id in self._replies:
            self._replies.pop(request_id)
            return True
        self.forget(request_id)
        return False

    @property
    def pending_replies(self) -> int:
        """Replies received and not yet taken by their :class:`DirectCall`."""
        return len(self._replies)

    def _receive_one(self) -> None:
        frames = self._socket.recv_multipart(copy=False)
        request_id = _REQUEST_ID.unpack(frames[0].bytes)[0]
        self._replies[request_id] = (frames[1].bytes, frames[2:])
        if request_id in self._forgotten:  # stored first, checked second: see forget()
            self._forgotten.discard(request_id)
            self._replies.pop(request_id, None)

    def forget(self, request_id: int) -> None:
        """Drop the reply to ``request_id`` whenever it comes (its caller is gone). Lock-free, as
        it runs from ``__del__``: marked first, popped second, so either this or
        :meth:`_receive_one` removes a reply that arrives in between."""
        self._forgotten.add(request_id)
        if self._replies.pop(request_id, None) is not None:
            self._forgotten.discard(request_id)

    def done(self, request_id: int) -> bool:
        """Whether the reply has arrived; never waits (another thread may hold the socket)."""
        if request_id in self._replies:
            return True
        if self._lock.acquire(blocking=False):
            try:
                while request_id not in self._replies and self._socket.poll(0):
                    self._receive_one()
            finally:
                self._lock.release()
        return request_id in self._replies

    def result(self, request_id: int, alive: Callable[[], None]) -> Any:
        """The reply to ``request_id``, its error raised as the built-in type it had in the shard
        (else :class:`ShardError`). Waits in short slices, so other threads can send and receive
        on this channel meanwhile.

        Every :data:`LIVENESS_SECONDS` without a reply, ``alive()`` is called (outside the lock); it
        raises when the shard or its server is gone, re-raised as :class:`DirectPathLost`. A ping is
        then also sent on this channel: the server answers one connection's requests in order, so
        a ping answered while the request is not means the request or its reply was lost (a reset
        connection; ZeroMQ reconnects, but drops what was in flight), also :class:`DirectPathLost`.
        """
        last_check = time.monotonic()
        probe, probe_sent = None, 0.0
        try:
            while True:
                with self._lock:
                    if request_id in self._replies:
                        status, frames = self._replies.pop(request_id)
                        break
                    if probe is not None and probe in self._replies:
                        raise DirectRequestLost("the request or its reply was lost: a ping sent after it on the "
                                             "same connection was answered first (the connection was reset)")
                    if self._socket.poll(_WAIT_SLICE_MS):
                        self._receive_one()
                        continue
                now = time.monotonic()
                if now - last_check >= LIVENESS_SECONDS:
                    try:
                        alive()
                    except Exception as error:  # noqa: BLE001 - any failure means: not reachable
                        raise DirectPathLost(f"no reply from the shard's direct path, and "
                                             f"{type(error).__name__}: {error}") from error
                    if probe is None or now - probe_sent >= REACH_SECONDS:  # a lost probe is resent
                        if probe is not None:
                            self.forget(probe)
                        probe, probe_sent = self.send("ping", ()), now
                    last_check = time.monotonic()
        finally:
            if probe is not None:
                self.forget(probe)
        if status == b"ok":
            return decode(frames[0].bytes, frames[1:])
        raise _rebuilt_error(json.loads(frames[0].bytes))

    def close(self) -> None:
        if os.getpid() == self._pid and not self._socket.closed:
            self._socket.close(linger=0)

    __del__ = close


class DirectCall:
    """A request in flight on a :class:`DirectChannel`: ``result()`` / ``done()`` like the Dask
    actor futures the bank otherwise holds."""

    __slots__ = ("_channel", "_request_id", "_alive", "_taken", "_outcome")

    def __init__(self, channel: DirectChannel, request_id: int, alive: Callable[[], None]) -> None:
        self._channel, self._request_id, self._alive = channel, request_id, alive
        self._taken = False
        self._outcome: tuple[bool, Any] | None = None  # (raised, value or error) once answered

    def done(self) -> bool:
        return self._outcome is not None or self._channel.done(self._request_id)

    def result(self) -> Any:
        """The reply's value, or its error raised; later calls give the same again."""
        if self._outcome is None:
            self._taken = True
            try:
                self._outcome = (False, self._channel.result(self._request_id, self._alive))
            except DirectPathLost:
                raise  # nothing was received: a later call waits for the same reply again
            except Exception as error:  # noqa: BLE001 - the shard's error, kept for later calls
                self._outcome = (True, error)
        raised, value = self._outcome
        if raised:
            raise value
        return value

    def __del__(self) -> None:
        if not self._taken:  # sent and never waited for: its reply is nobody's
            self._channel.forget(self._request_id)


class DirectPath:
    """The client half of a bank's direct path: each shard's address and this process's
    per-thread channels. Pickles as the addresses only."""

    def __init__(self, addresses: list[dict[str, str] | None],
                 reach_seconds: float = REACH_SECONDS) -> None:
        self.addresses = list(addresses)
        self.reach_seconds = reach_seconds
        self._local = threading.local()
        self._unreachable: set[int] = set()  # shards whose endpoint this process cannot reach

    def __reduce__(self):
        return (DirectPath, (self.addresses, self.reach_seconds))

    def serves(self, shard: int, method: str) -> bool:
        return (method in DIRECT_METHODS and self.addresses[shard] is not None
                and shard not in self._unreachable)

    def _channel(self, shard: int) -> DirectChannel | None:
        """This thread's channel to ``shard``; a new one is first pinged, and a shard that does
        not answer within :data:`REACH_SECONDS` is left to Dask's RPC in this process (None)."""
        channels = getattr(self._local, "channels", None)
        if channels is None or channels.get("pid") != os.getpid():
            channels = self._local.channels = {"pid": os.getpid()}
        if shard not in channels:
            address = self.addresses[shard]
            channel = DirectChannel(address["endpoint"], address["token"])
            if not channel.reaches_server(self.reach_seconds):
                channel.close()
                self._unreachable.add(shard)
                return None
            channels[shard] = channel
        return channels[shard]

    def call(self, shard: int, method: str, args: tuple,
             alive: Callable[[], None]) -> DirectCall | None:
        """Send ``method(*args)`` to ``shard``; None when its endpoint is unreachable from here
        (the caller then uses the actor)."""
        channel = self._channel(shard)
        if channel is None:
            return None
        return DirectCall(channel, channel.send(method, args), alive)
