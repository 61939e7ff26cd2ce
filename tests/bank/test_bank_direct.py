"""The bank's direct data path (ZeroMQ sockets beside the shard actors): same answers as Dask's
actor RPC, a token that strangers lack, correct replies under threads and out-of-order waits, and
servers that stop with the bank."""

import gc
import socket
import threading

import numpy as np
import pytest

distributed = pytest.importorskip("distributed")
zmq = pytest.importorskip("zmq")

from process_helpers import wait_until  # noqa: E402

from carlskit.bank import (  # noqa: E402
    KnowledgeBank,
    ShardLostError,
    _direct,  # noqa: E402
)
from carlskit.bank._direct import (  # noqa: E402
    DirectCall,
    DirectChannel,
    DirectPath,
    DirectRequestLost,
    ShardError,
    _rebuilt_error,
    decode,
    encode,
)
from carlskit.bank._shard import _Shard  # noqa: E402

DIM = 8


def exercise(kb):
    """The same writes on any bank; returns everything the direct path serves, read back."""
    rng = np.random.default_rng(0)
    kb.create_table("emb", dim=DIM, seed=3, learning_rate=0.5, max_pending=4)
    kb.create_feature_table("nbrs", {"ids": ("int64", 3), "weights": ("float32", 3)})
    keys = np.arange(1, 301)
    kb.lookup("emb", keys[:200], insert_missing=True)
    kb.update("emb", keys[:80], rng.normal(size=(80, DIM)), version=5)
    for _ in range(3):
        kb.apply_gradients("emb", keys[40:260], rng.normal(size=(220, DIM)))
    kb.update("nbrs", keys[:6], {"ids": np.arange(18).reshape(6, 3),
                                 "weights": np.ones((6, 3), np.float32)}, version=2)
    probe = np.r_[keys, [10_000]]
    metadata = kb.row_metadata("emb", probe)
    metadata.pop("last_write_time")  # wall-clock times differ between the two banks
    return {"emb": kb.lookup("emb", probe), "nbrs": kb.lookup("nbrs", probe[:10]),
            "metadata": metadata, "stats": kb.stats()["tables"]["emb"]}


def servers_running(client, addresses) -> int:
    """How many of the shard servers at ``addresses`` have a thread running on the workers."""
    ports = {address["endpoint"].rsplit(":", 1)[1] for address in addresses}

    def count():
        return sum(t.name.startswith("carlskit-bank-direct") and t.name.rsplit("-", 1)[1] in ports
                   for t in threading.enumerate())

    return sum(client.run(count).values())


def test_direct_path_answers_like_dask_rpc(client):
    direct, dask = KnowledgeBank(client, num_shards=2), KnowledgeBank(client, 2, direct=False)
    assert (direct.transport, dask.transport) == ("direct", "dask")
    assert direct.stats()["transport"] == "direct" and "direct data path" in repr(direct)
    a, b = exercise(direct), exercise(dask)
    np.testing.assert_array_equal(a["emb"][0], b["emb"][0])
    np.testing.assert_array_equal(a["emb"][1], b["emb"][1])
    for field in ("ids", "weights"):
        np.testing.assert_array_equal(a["nbrs"][0][field], b["nbrs"][0][field])
    for name in a["metadata"]:
        np.testing.assert_array_equal(a["metadata"][name], b["metadata"][name])
    counted = ("rows", "gradients_received", "optimizer_steps", "lookup_shard_calls")
    assert {k: a["stats"][k] for k in counted} == {k: b["stats"][k] for k in counted}
    assert direct.ping() > 0
    direct.close(), dask.close()


def test_results_of_one_shard_are_the_callers_to_write(client):
    """With one shard nothing is merged: the reply's arrays are copied out of the message."""
    kb = KnowledgeBank(client, num_shards=1)
    kb.create_table("emb", dim=DIM)
    kb.create_feature_table("nbrs", {"ids": ("int64", 2)})
    values, found = kb.lookup("emb", np.arange(4), insert_missing=True)
    saved_values, saved_found = values.copy(), found.copy()
    records, _ = kb.lookup("nbrs", np.arange(4))
    saved_ids = records["ids"].copy()
    metadata = kb.row_metadata("emb", np.arange(4))
    saved_versions = metadata["version"].copy()
    values += 1.0
    found[:] = ~found
    records["ids"][:] = 7
    metadata["version"][:] = 12345
    # The caller's writes above changed its own arrays only: the bank answers as before.
    again, found_again = kb.lookup("emb", np.arange(4))
    np.testing.assert_array_equal(again, saved_values)
    np.testing.assert_array_equal(found_again, np.ones(4, bool))
    np.testing.assert_array_equal(kb.lookup("nbrs", np.arange(4))[0]["ids"], saved_ids)
    np.testing.assert_array_equal(kb.row_metadata("emb", np.arange(4))["version"], saved_versions)
    assert not saved_found.any()  # the first lookup inserted the rows
    kb.close()


def test_a_request_without_the_token_is_refused_and_changes_nothing(client):
    kb = KnowledgeBank(client, num_shards=1)
    kb.create_table("emb", dim=DIM, initializer="zeros")
    address = kb._shards.direct.addresses[0]
    stranger = DirectChannel(address["endpoint"], "00" * 16)
    request = stranger.send("update", ("emb", np.arange(3), np.ones((3, DIM), np.float32), 9))
    with pytest.raises(PermissionError, match="token"):
        stranger.result(request, alive=lambda: None)
    stranger.close()
    values, found = kb.lookup("emb", np.arange(3))
    assert not found.any() and not values.any()

    insider = DirectChannel(address["endpoint"], address["token"])
    refused = DirectCall(insider, insider.send("nearest", ("emb",)), alive=lambda: None)
    for _ in range(2):  # asked twice, the same error twice (nothing waits for a second reply)
        with pytest.raises(ValueError, match="'nearest' is not served"):
            refused.result()
    insider.close()
    kb.close()


def test_unawaited_calls_neither_pile_up_nor_lose_replies(client):
    """Fire-and-forget gradients (futures dropped) leave no replies behind; futures kept but not
    waited for get their replies later, however many there are."""
    kb = KnowledgeBank(client, num_shards=1)
    kb.create_table("emb", dim=DIM, initializer="zeros", max_pending=1_000_000)
    keys, gradients = np.arange(4), np.ones((4, DIM), np.float32)
    for _ in range(2000):
        kb.apply_gradients_async("emb", keys, gradients)  # future dropped at once
    kept = [kb.apply_gradients_async("emb", keys, gradients) for _ in range(2000)]
    assert all(future.result() is None for future in kept)
    # one socket, one server thread: replies in order, so every earlier call was applied too
    assert kb.stats()["tables"]["emb"]["gradients_received"] == 4 * 4000
    del kept
    kb.lookup("emb", keys)  # a blocking call drains anything still queued
    assert kb._shards.direct._channel(0).pending_replies == 0
    kb.close()


def test_codec_round_trips_nested_values_without_pickle():
    value = ({"a": np.arange(6, dtype=np.int32).reshape(2, 3), "b": [1.5, None, "x"]},
             np.zeros(0, bool), True, 7)
    header, frames = encode(value)
    assert b"pickle" not in header
    back = decode(header, [frame.tobytes() for frame in frames])
    np.testing.assert_array_equal(back[0]["a"], value[0]["a"])
    assert back[0]["a"].dtype == np.int32 and back[0]["b"] == (1.5, None, "x")
    assert back[1].shape == (0,) and back[2:] == (True, 7)
    with pytest.raises(TypeError, match="set"):
        encode({1, 2})


def test_threads_and_out_of_order_waits_get_their_own_replies(client):
    kb = KnowledgeBank(client, num_shards=2)
    kb.create_table("emb", dim=DIM, initializer="zeros")
    keys = np.arange(1, 2001)
    kb.update("emb", keys, np.repeat(keys[:, None], DIM, axis=1).astype(np.float32))

    futures = [kb.lookup_async("emb", keys[i::7]) for i in range(7)]
    for i in reversed(range(7)):  # waited for in reverse order of sending
        values, found = futures[i].result()
        assert found.all() and np.array_equal(values[:, 0], keys[i::7])

    errors = []

    def reader(offset):
        try:
            for round_ in range(30):
                part = keys[(offset + round_) % 5::5]
                values, _ = kb.lookup("emb", part)
                assert np.array_equal(values[:, 0], part)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors, errors

    sent_here = kb.lookup_async("emb", keys[:10])
    waited_elsewhere = []
    thread = threading.Thread(target=lambda: waited_elsewhere.append(sent_here.result()))
    thread.start(), thread.join()
    assert np.array_equal(waited_elsewhere[0][0][:, 0], keys[:10])
    kb.close()


def read_transport_and_values(kb, keys):
    return kb.transport, kb.lookup("emb", keys)[0]


def test_bank_in_a_dask_task_uses_the_direct_path(client):
    kb = KnowledgeBank(client, num_shards=2)
    kb.create_table("emb", dim=DIM, seed=1)
    keys = np.arange(100)
    expected, _ = kb.lookup("emb", keys, insert_missing=True)
    transport, values = client.submit(read_transport_and_values, kb, keys, pure=False).result()
    assert transport == "direct"
    np.testing.assert_array_equal(values, expected)
    kb.close()


def test_servers_stop_with_the_bank(client):
    """A shard's server stops when its actor is released: by close(), or by dropping the bank."""
    for release in ("close", "drop"):
        kb = KnowledgeBank(client, num_shards=2)
        addresses = kb._shards.direct.addresses
        assert servers_running(client, addresses) == 2
        if release == "close":
            kb.close()
        del kb
        gc.collect()  # a dropped bank's actor handles go with Python's collection
        wait_until(lambda: servers_running(client, addresses) == 0, seconds=30)


def test_closing_an_attached_bank_leaves_the_owner_working(client):
    owner = KnowledgeBank(client, num_shards=2)
    owner.create_table("emb", dim=DIM, seed=2)
    keys = np.arange(50)
    expected, _ = owner.lookup("emb", keys, insert_missing=True)
    owner.publish("carlskit-test-direct")
    KnowledgeBank.attach(client, "carlskit-test-direct").close()
    np.testing.assert_array_equal(owner.lookup("emb", keys)[0], expected)
    owner.close()  # the published dataset still holds the shards: attached banks keep working
    attached = KnowledgeBank.attach(client, "carlskit-test-direct")
    assert attached.transport == "direct"
    np.testing.assert_array_equal(attached.lookup("emb", keys)[0], expected)
    attached.close()
    client.unpublish_dataset("carlskit-test-direct")


def stop_direct_servers(dask_worker):
    for actor in list(dask_worker.state.actors.values()):
        server = getattr(actor, "_direct_server", None)
        if server is not None:
            server.stop()


def test_a_stopped_server_is_an_error_naming_the_shard_not_a_hang(client):
    kb = KnowledgeBank(client, num_shards=1)
    kb.create_table("emb", dim=DIM)
    kb.lookup("emb", np.arange(5), insert_missing=True)
    client.run(stop_direct_servers, workers=[kb.shard_workers[0]])
    wait_until(lambda: servers_running(client, kb._shards.direct.addresses) == 0, seconds=30)
    with pytest.raises(ShardLostError, match="shard 0 of 1.*direct server has stopped"):
        kb.lookup("emb", np.arange(5))
    kb.close()


def test_an_unreachable_endpoint_falls_back_to_the_actor(client):
    kb = KnowledgeBank(client, num_shards=2)
    kb.create_table("emb", dim=DIM, seed=4)
    keys = np.arange(100)
    expected, _ = kb.lookup("emb", keys, insert_missing=True)
    with socket.socket() as unused:  # a port nobody listens on
        unused.bind(("127.0.0.1", 0))
        dead_end = f"tcp://127.0.0.1:{unused.getsockname()[1]}"
    addresses = [dict(kb._shards.direct.addresses[0]), kb._shards.direct.addresses[1]]
    addresses[0]["endpoint"] = dead_end  # as seen from behind NAT, say
    behind_nat = KnowledgeBank._over(kb._shards.with_direct(DirectPath(addresses, reach_seconds=0.5)))
    np.testing.assert_array_equal(behind_nat.lookup("emb", keys)[0], expected)
    assert not behind_nat._shards.direct.serves(0, "lookup") and behind_nat._shards.direct.serves(1, "lookup")
    kb.close()


def test_a_host_that_cannot_be_bound_means_no_direct_path(client):
    shard = client.submit(_Shard, 0, 1, actor=True, pure=False).result()
    assert shard.open_direct_path("192.0.2.77").result() is None  # TEST-NET: not an interface
    assert shard.open_direct_path().result()["endpoint"].startswith("tcp://")


def test_shard_errors_keep_their_type_and_never_read_as_a_lost_shard(client):
    kb = KnowledgeBank(client, num_shards=2)
    kb.create_table("emb", dim=DIM)
    address = kb._shards.direct.addresses[0]
    channel = DirectChannel(address["endpoint"], address["token"])
    unknown = DirectCall(channel, channel.send("lookup", ("nope", np.arange(3), False)), lambda: None)
    with pytest.raises(KeyError) as raised:
        unknown.result()
    assert raised.value.args == ("nope",)
    channel.close()
    with pytest.raises(KeyError):  # through the bank's own call path: not a ShardLostError
        kb._shards.call("lookup", {0: ("nope", np.arange(3), False)})
    assert isinstance(_rebuilt_error({"type": "OverflowError", "message": "x"}), OverflowError)
    assert isinstance(_rebuilt_error({"type": "ZMQError", "message": "x"}), ShardError)
    with pytest.raises(ValueError, match="version must fit in int64"):
        kb.update("emb", [1], np.zeros((1, DIM)), version=2**70)
    metadata = kb.row_metadata("emb", np.zeros(0, np.int64))  # no keys, several shards
    assert all(len(column) == 0 for column in metadata.values()) and "version" in metadata
    kb.close()


def test_done_does_not_wait_while_another_thread_waits_on_the_channel(client):
    kb = KnowledgeBank(client, num_shards=1)
    kb.create_table("emb", dim=DIM, initializer="zeros", capacity=1 << 21)
    address = kb._shards.direct.addresses[0]
    channel = DirectChannel(address["endpoint"], address["token"])
    rows = 1 << 21  # an update the shard takes a while over
    big = channel.send("update", ("emb", np.arange(rows), np.ones((rows, DIM), np.float32), 1))
    waiting = threading.Event()

    def wait_for_big():
        waiting.set()
        channel.result(big, alive=lambda: None)

    waiter = threading.Thread(target=wait_for_big)
    waiter.start()
    waiting.wait()
    wait_until(channel._lock.locked, seconds=30, every=0.001)  # the waiter is polling the socket
    assert channel.done(big) is False  # answered at once, while the waiter holds the socket
    waiter.join()
    channel.close()
    kb.close()


@pytest.mark.timeout(60)
def test_a_reply_lost_to_a_reset_connection_is_an_error_not_a_hang(client, monkeypatch):
    monkeypatch.setattr(_direct, "LIVENESS_SECONDS", 0.05)  # check (and ping) often while waiting
    kb = KnowledgeBank(client, num_shards=1)
    rows = 1 << 21  # an update the shard takes a while over: several checks fall inside it
    kb.create_table("emb", dim=DIM, initializer="zeros", capacity=rows)
    address = kb._shards.direct.addresses[0]
    channel = DirectChannel(address["endpoint"], address["token"])
    values = np.ones((rows, DIM), np.float32)
    slow = channel.send("update", ("emb", np.arange(rows), values, 1))
    assert channel.result(slow, alive=lambda: None) is None  # pings queue behind it: no false alarm
    lost = channel.send("update", ("emb", np.arange(rows), values, 2))
    channel._socket.disconnect(address["endpoint"])  # a reset: ZeroMQ reconnects under a new
    channel._socket.connect(address["endpoint"])  # identity; the old request or reply is dropped
    with pytest.raises(DirectRequestLost, match="lost"):
        channel.result(lost, alive=lambda: None)
    assert channel.result(channel.send("ping", ()), alive=lambda: None) == 0  # the channel works on
    assert channel.pending_replies == 0
    channel.close()
    # Through the bank: an error naming the shard that says it still serves (not ShardLostError).
    pending = kb.lookup_async("emb", np.arange(rows))
    bank_channel = kb._shards.direct._channel(0)
    bank_channel._socket.disconnect(address["endpoint"])
    bank_channel._socket.connect(address["endpoint"])
    with pytest.raises(ConnectionError, match="shard 0 of 1: the request or its reply was lost.*retried") as raised:
        pending.result()
    assert not isinstance(raised.value, ShardLostError)
    np.testing.assert_array_equal(kb.lookup("emb", [0, rows - 1])[0], np.ones((2, DIM)))  # and works on
    kb.close()
