"""The shared store's client (``engine/worker/kv_store.py``) under attention TP: a block's replicated layer groups
(MLA's latent, the drafter) are written once, by TP rank 0, and read by every rank; its sharded groups once per rank.
Against a real ``mooncake_master`` on loopback, two clients standing for TP ranks 0 and 1 of one worker."""

import time

import torch

from engine.worker.kv_store import KVStore, StoreSettings, block_parts
from tests.support.mooncake import start_master

REPLICATED = torch.tensor([True] * 6 + [False] * 4)  # a 10-byte block row: 6 replicated bytes, then 4 sharded


def test_a_block_is_one_value_without_tp_and_its_replicas_have_one_writer_with_it():
    (whole,) = block_parts(REPLICATED, 0, 1)
    assert whole.writer and whole.suffix == "tp0of1" and whole.columns.tolist() == list(range(10))
    rep, own = block_parts(REPLICATED, 1, 2)
    assert (rep.suffix, rep.writer, rep.columns.tolist()) == ("rep", False, list(range(6)))
    assert (own.suffix, own.writer, own.columns.tolist()) == ("tp1of2", True, list(range(6, 10)))
    assert [(p.suffix, p.writer) for p in block_parts(torch.ones(8, dtype=torch.bool), 0, 4)] == [("rep", True)]
    assert [(p.suffix, p.writer) for p in block_parts(torch.ones(8, dtype=torch.bool), 3, 4)] == [("rep", False)]


def _client(master, tp_rank: int, replicated: torch.Tensor) -> KVStore:
    settings = StoreSettings(master=master.address, metadata=master.metadata, segment_gb=0.05, timeout_s=2.0,
                             namespace=b"test-kv-store", tp_rank=tp_rank, tp_size=2)
    return KVStore(settings, replicated)


def _wait_held(client: KVStore, hashes: list[int]) -> None:
    deadline = time.monotonic() + 20
    while client.held(hashes) < len(hashes):
        assert time.monotonic() < deadline, "the blocks never reached the store"
        time.sleep(0.05)


def test_tp_rank_1_reads_the_replicated_bytes_rank_0_wrote(tmp_path):
    master = start_master(tmp_path / "master.log")
    clients = []
    try:
        first, second = clients[:] = [_client(master, r, REPLICATED) for r in (0, 1)]
        rows = torch.randint(0, 256, (2, 3, 10), dtype=torch.uint8)
        rows[1, :, :6] = rows[0, :, :6]  # the replicated groups are the same on both ranks
        hashes = [11, 12, 13]
        first.put(hashes, rows[0])
        second.put(hashes, rows[1])  # writes only its shard
        _wait_held(first, hashes)
        _wait_held(second, hashes)
        assert torch.equal(first.get(hashes), rows[0]) and torch.equal(second.get(hashes), rows[1])
        assert (first.puts, second.puts) == (3, 3)
        assert first.group_put_bytes == 3 * ((6 + 16) + 2 * (4 + 16))  # replicas once, shards per rank, + digests
        only_replicated = _client(master, 1, torch.ones(10, dtype=torch.bool))  # nothing of its own to write
        clients.append(only_replicated)
        only_replicated.put([99], rows[0, :1])
        assert only_replicated.puts == 0 and only_replicated.held([99]) == 0
    finally:
        for c in clients:
            c.close()
        master.kill()


def test_a_master_that_just_died_is_an_outage_even_when_the_library_answers_at_once(tmp_path):
    """Right after the master dies the library answers a lookup with an error code in well under a millisecond, or
    (on a loaded box, once it has started reconnecting) hangs past the call's timeout: either way the outage is
    counted once — "unreachable" for the code, "timeout" for the hang — and the store is left alone, the lookup
    answering "nothing held"."""
    master = start_master(tmp_path / "master.log")
    client = _client(master, 0, torch.zeros(10, dtype=torch.bool))
    try:
        assert client.held([21]) == 0 and client.up  # connected: the block is simply not there
        master.kill()
        t0 = time.monotonic()
        assert client.held([21]) == 0
        fast = time.monotonic() - t0 < client.settings.timeout_s
        assert client.errors == ({"unreachable": 1} if fast else {"timeout": 1}) and not client.up
        client.put([21], torch.zeros(1, 10, dtype=torch.uint8))  # dropped while down, counted once per outage
        assert sum(client.errors.values()) == 1 and client.puts == 0
    finally:
        client.close()
        master.kill()


def test_a_store_that_went_away_is_said_to_be_back_once_it_answers(tmp_path, caplog, monkeypatch):
    """The master dies and a new one starts on its ports: one warning when a call fails, the store left alone for
    the pause, and the first call that succeeds after it says the store is back — one line per change of state."""
    import logging

    import engine.worker.kv_store as kv_store

    monkeypatch.setattr(kv_store, "RETRY_S", 0.5)
    master = start_master(tmp_path / "master.log")
    client = _client(master, 0, torch.zeros(10, dtype=torch.bool))
    try:
        with caplog.at_level(logging.INFO, logger="engine.worker.kv_store"):
            client.connect()
            assert client.up and not client.outage
            master.kill()
            assert client.held([31]) == 0 and client.outage
            master = start_master(tmp_path / "master2.log", (master.rpc, master.http, master.metrics))
            deadline = time.monotonic() + 30
            while client.outage:
                assert time.monotonic() < deadline, "the client never reached the new master"
                time.sleep(0.6)
                client.held([31])
            assert client.up  # the last call succeeded
        lines = [r.getMessage() for r in caplog.records]
        said = ["up" if "answered in" in m else "down" if "serving without" in m else "back" for m in lines
                if "shared KV store" in m]
        # one line per change of state, whatever the restart looked like to the library (it may fail a call once
        # more while the new master comes up): answered, then gone and back in turn, ending back
        assert said[0] == "up" and said[1:] == ["down", "back"] * (len(said) // 2) and len(said) >= 3, lines
    finally:
        client.close()
        master.kill()
