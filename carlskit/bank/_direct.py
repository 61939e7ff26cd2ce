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

import hmac
import json
import os
import secrets
import struct
import threading
import weakref
from typing import Any, Callable

import numpy as np

#: shard methods served on the direct path (everything else goes through the Dask actor)
DIRECT_METHODS = frozenset({"lookup", "update", "apply_gradients", "row_metadata", "ping"})
#: seconds between liveness checks while a reply is awaited (a lost worker never answers)
LIVENESS_SECONDS = 1.0
#: milliseconds the server thread sleeps in poll before checking whether it should stop
_SERVER_POLL_MS = 200
_REQUEST_ID = struct.Struct("<Q")


class DirectPathLost(ConnectionError):
    """The shard behind a direct channel no longer answers (its worker or actor is gone)."""


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
    """Host of this Dask worker's listening address when it speaks plain tcp, else None."""
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
                                        name=f"carlskit-bank-direct-{shard.shard_index}",
                                        daemon=True)
        self._thread.start()
        weakref.finalize(shard, self._stop.set)

    @property
    def address(self) -> dict[str, str]:
        return {"endpoint": self.endpoint, "token": self.token.hex()}

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving; waits up to ``timeout`` seconds for the thread to close its socket."""
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

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
            message = {"type": type(error).__name__, "message": str(error)}
            return [b"error", json.dumps(message).encode()]


# ----------------------------------------------------------------------------- client side
_RAISED_AS_IS = {"ValueError": ValueError, "TypeError": TypeError, "KeyError": KeyError,
                 "PermissionError": PermissionError}


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
            self._socket.send_multipart([_REQUEST_ID.pack(request_id), self._token,
                                         method.encode(), header, *frames], copy=False)
            while self._socket.poll(0):  # replies nobody waits for yet leave ZeroMQ's queues
                self._receive_one()
        return request_id

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
        with self._lock:
            while request_id not in self._replies and self._socket.poll(0):
                self._receive_one()
            return request_id in self._replies

    def result(self, request_id: int, alive: Callable[[], None]) -> Any:
        """The reply to ``request_id``. Every :data:`LIVENESS_SECONDS` without it, ``alive()``
        is called; it raises when the shard is gone (re-raised as :class:`DirectPathLost`)."""
        with self._lock:
            while request_id not in self._replies:
                if self._socket.poll(int(LIVENESS_SECONDS * 1000)):
                    self._receive_one()
                    continue
                try:
                    alive()
                except Exception as error:  # noqa: BLE001 - any failure means: not reachable
                    raise DirectPathLost(f"no reply from the shard's direct path and its actor "
                                         f"does not answer ({type(error).__name__}: {error})"
                                         ) from error
            status, frames = self._replies.pop(request_id)
        if status == b"ok":
            return decode(frames[0].bytes, frames[1:])
        error = json.loads(frames[0].bytes)
        raise _RAISED_AS_IS.get(error["type"], RuntimeError)(error["message"])

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
                raise  # nothing was received: asking again asks the shard again
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

    def __init__(self, addresses: list[dict[str, str] | None]) -> None:
        self.addresses = list(addresses)
        self._local = threading.local()

    def __reduce__(self):
        return (DirectPath, (self.addresses,))

    def serves(self, shard: int, method: str) -> bool:
        return method in DIRECT_METHODS and self.addresses[shard] is not None

    def _channel(self, shard: int) -> DirectChannel:
        channels = getattr(self._local, "channels", None)
        if channels is None or channels.get("pid") != os.getpid():
            channels = self._local.channels = {"pid": os.getpid()}
        if shard not in channels:
            address = self.addresses[shard]
            channels[shard] = DirectChannel(address["endpoint"], address["token"])
        return channels[shard]

    def call(self, shard: int, method: str, args: tuple, alive: Callable[[], None]) -> DirectCall:
        channel = self._channel(shard)
        return DirectCall(channel, channel.send(method, args), alive)
