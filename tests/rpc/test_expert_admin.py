"""The expert balancer's operator door on a real server (``rpc/expert_admin.py``, ``scripts/expert_balance.py``):
the load and placement dumped (a file that seeds ``eplb.placement_file``), a rebalance asked for and run at the next
step — layers move, versions rise, and with ``engine.batch_invariant=true`` a greedy request answers the same tokens
before and after. Without a balancer the engine refuses, naming the setting."""

import json
import subprocess
import sys

import pytest

from engine.config import EngineConfig, RequestError
from engine.engine import Engine
from engine.snapshot import expert_balance
from model.loader import load_model
from parallelism.comm import build_groups
from parallelism.layout import Layout
from tests.support.paths import REPO_ROOT
from tests.support.patience import patience
from tests.support.rpc_helpers import ServerProcess

PROMPT = [5, 17, 3, 99, 150, 7, 42, 8]


def test_dump_then_rebalance_moves_layers_and_changes_no_token(tiny_ckpts, tmp_path):
    srv = ServerProcess(tiny_ckpts["tiny_deepseek"], [
        "parallel.world_size=2", "parallel.attn_tp=2", "parallel.moe_ep=2", "engine.batch_invariant=true",
        "eplb.enabled=true", "eplb.redundant_experts=2", "eplb.window_steps=2", "eplb.interval_steps=100000",
        "eplb.min_gain=0"], tmp_path / "server.log")
    try:
        client = srv.wait_ready()
        before = client.generate(PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True).token_ids
        dumped = tmp_path / "load.json"
        out = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "expert_balance.py"), "--address",
                              srv.target, "get", "--out", str(dumped)], capture_output=True, text=True,
                             timeout=patience(60), cwd=REPO_ROOT)
        assert out.returncode == 0, out.stderr
        assert "placement versions [0, 0]" in out.stdout
        load = json.loads(dumped.read_text())["load"]
        assert len(load) == 2 and all(len(row) == 16 for row in load) and sum(map(sum, load)) > 0
        asked = client.expert_balance(rebalance=True)
        assert asked["rebalance_requested"] and asked["versions"] == [0, 0]
        assert [len(row) for row in asked["phy2log"]] == [18, 18]
        # the move runs before this request's first step
        after = client.generate(PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True).token_ids
        doc = client.expert_balance()
        balancer = doc["expert_load"]["balancer"]
        assert balancer["rebalances"] == 1 and balancer["layers_moved"] >= 1 and balancer["moved_bytes"] > 0
        assert doc["versions"] != [0, 0] and doc["phy2log"] != asked["phy2log"]
        assert after == before
    finally:
        srv.close()


def test_without_a_balancer_the_engine_names_the_setting(tiny_ckpts):
    model = load_model(tiny_ckpts["tiny_deepseek"], build_groups(Layout()))
    engine = Engine(model, EngineConfig.flat(num_blocks=16, max_model_len=128))
    with pytest.raises(RequestError, match="start it with eplb.enabled=true"):
        expert_balance(engine)
    counting = Engine(load_model(tiny_ckpts["tiny_deepseek"], build_groups(Layout())),
                      EngineConfig.flat(num_blocks=16, max_model_len=128, expert_load=True))
    assert expert_balance(counting)["load_is"] == "counts so far"
    with pytest.raises(RequestError, match="no expert balancer runs on this worker"):
        expert_balance(counting, rebalance=True)
