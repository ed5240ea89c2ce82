"""Shutdown and failure paths of a real server: SIGTERM drains (the in-flight stream completes, new requests are
UNAVAILABLE, exit 0); with 8 gloo ranks, greedy streams equal HF and ``kill -9`` of a non-zero rank ends the
stream UNAVAILABLE and the server exits non-zero in time; a stopped (hung) rank trips the step watchdog."""

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2

from tests.support.rpc_helpers import ServerProcess, hf_greedy, layout_args

PROMPTS = [[5, 17, 3, 99, 150, 7, 64, 31, 8, 202, 11], [2, 4, 6], [200, 1, 77, 90, 13, 45, 46], [9],
           [33, 34, 35, 36, 37, 38, 39, 40, 41], [120, 121]]
N_TOKENS = 10
CKPT = "tiny_deepseek"
EXIT_WITHIN_S = 60


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def watched_statuses(watch, until_first: bool = False) -> list[str]:
    """The statuses a ``grpc.health.v1`` Watch stream delivers until the server ends it (or the first one)."""
    statuses = []
    try:
        for resp in watch:
            statuses.append(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))
            if until_first:
                break
    except grpc.RpcError as gone:
        assert gone.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), gone
    return statuses


def rank_pids(client) -> dict[int, int]:
    return {r["rank"]: r["pid"] for r in client.engine_info()["ranks"]}


def test_sigterm_drains_in_flight_stream(tiny_ckpts, tmp_path):
    srv = ServerProcess(tiny_ckpts[CKPT], [*layout_args(2), "server.drain_timeout_s=60"], tmp_path / "server.log")
    try:
        client = srv.wait_ready()
        s = client.stream(PROMPTS[0], max_tokens=100, ignore_eos=True, temperature=0.0)
        it = iter(s)
        first = next(it)
        srv.signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while client.health() != "NOT_SERVING":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert client.health_check()[0] is False
        with pytest.raises(grpc.RpcError) as err:
            client.generate([1, 2], max_tokens=2)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.value.details()
        rest = list(it)
        assert s.result.finish_reason == "length" and len(first) + sum(map(len, rest)) == 100
        assert srv.wait(timeout=60) == 0, srv.log()
    finally:
        srv.close()


@pytest.fixture(scope="module")
def server8(tiny_ckpts, tmp_path_factory):
    log = tmp_path_factory.mktemp("rpc8") / "server.log"
    args = ["parallel=dp8_ep8", "server.step_timeout_s=30", "server.heartbeat_s=0.5"]  # idle heartbeats on 8 ranks
    srv = ServerProcess(tiny_ckpts[CKPT], args, log)
    client = srv.wait_ready()
    yield srv, client
    client.close()
    srv.close()


def test_8_ranks_streamed_greedy_matches_hf(server8, tiny_ckpts):
    _, client = server8
    ref = hf_greedy(tiny_ckpts[CKPT], PROMPTS, N_TOKENS)

    def streamed(prompt):
        s = client.stream(prompt, max_tokens=N_TOKENS, min_tokens=N_TOKENS, temperature=0.0)
        return [t for d in s for t in d], s.result.finish_reason

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(streamed, PROMPTS))
    assert results == [(r, "length") for r in ref]
    assert client.server_info()["engine"]["layout"] == "attn dp8, moe ep8 (alltoall)"


def test_kill9_of_a_rank_ends_streams_unavailable_and_exits(server8):
    srv, client = server8
    pids = rank_pids(client)
    assert len(pids) == 8
    streams = [client.stream(p, max_tokens=400, ignore_eos=True) for p in PROMPTS[:3]]
    iters = [iter(s) for s in streams]
    for it in iters:
        next(it)
    watch = client.health_stub.Watch(health_pb2.HealthCheckRequest(service=""))
    assert watched_statuses(watch, until_first=True) == ["SERVING"]  # the server holds the watch open
    with ThreadPoolExecutor(1) as pool:
        seen = pool.submit(watched_statuses, watch)
        os.kill(pids[3], signal.SIGKILL)
        t0 = time.monotonic()
        for it in iters:
            with pytest.raises(grpc.RpcError) as err:
                list(it)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
            assert f"rank 3 (pid {pids[3]}) exited" in err.value.details(), err.value.details()  # names the rank
        rc = srv.wait(timeout=EXIT_WITHIN_S)
        # a health watch opened before the kill saw NOT_SERVING before the process exited, and nothing after it
        assert seen.result(timeout=10) == ["NOT_SERVING"]
    assert rc != 0 and time.monotonic() - t0 < EXIT_WITHIN_S
    lines = [line for line in srv.log(20000).splitlines() if line.strip()]
    # the log's last line says which: rank 0's own, or the launcher's when it ended rank 0 first
    assert f"rank 3 (pid {pids[3]})" in lines[-1], lines[-3:]
    assert "never awaited" not in srv.log(20000)  # the health flip was scheduled on the loop and awaited
    assert not [r for r, pid in pids.items() if alive(pid)]  # no rank left behind
    with pytest.raises(grpc.RpcError) as err:  # nobody answers health any more
        client.health(timeout=2)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_hung_rank_trips_the_step_watchdog(tiny_ckpts, tmp_path):
    srv = ServerProcess(tiny_ckpts[CKPT], [*layout_args(2), "server.step_timeout_s=3"], tmp_path / "server.log")
    pids = {}
    try:
        client = srv.wait_ready()
        pids = rank_pids(client)
        s = client.stream(PROMPTS[0], max_tokens=400, ignore_eos=True)
        it = iter(s)
        next(it)
        os.kill(pids[1], signal.SIGSTOP)  # alive but stuck: its peers' collectives wait instead of failing
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            list(it)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "step_timeout_s" in err.value.details()
        assert f"rank 1 (pid {pids[1]}) is stopped" in err.value.details(), err.value.details()
        rc = srv.wait(timeout=EXIT_WITHIN_S)
        assert rc != 0 and time.monotonic() - t0 < EXIT_WITHIN_S
        assert not [r for r, pid in pids.items() if alive(pid)]
    finally:
        for pid in pids.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        srv.close()
