"""The ``scripts/logits.py`` contract, run as a user would (its own spawned ranks), against HF transformers."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from model.tiny import load_hf
from tests.support.paths import REPO_ROOT
from tests.support.patience import patience

ROOT = REPO_ROOT
SEQS = [[5, 17, 3, 99, 150, 7], [2, 4], [200, 1, 77]]  # fewer sequences than DP ranks


@pytest.mark.parametrize("overrides", [["parallel=dp8_ep8"], ["parallel=tp2_ep4"],
                                       ["parallel=ep8", "eplb.redundant_experts=8"]],  # replicas, each layer its map
                         ids=["dp8_ep8", "tp2_ep4", "ep8-eplb"])
def test_logits_script_matches_hf(tiny_ckpts, tmp_path, overrides):
    ckpt = tiny_ckpts["tiny_deepseek"]
    (tmp_path / "in.json").write_text(json.dumps(SEQS))
    out = tmp_path / "out.safetensors"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "logits.py"), f"model.path={ckpt}", *overrides,
                    f"logits.input={tmp_path / 'in.json'}", f"logits.output={out}"], check=True, timeout=patience(120))
    got = load_file(out)
    hf = load_hf(ckpt)
    assert sorted(got) == [f"seq_{i}" for i in range(len(SEQS))]
    for i, s in enumerate(SEQS):
        with torch.no_grad():
            ref = hf(torch.tensor([s])).logits[0]
        assert got[f"seq_{i}"].dtype == torch.float32 and got[f"seq_{i}"].shape == ref.shape
        assert (got[f"seq_{i}"] - ref).abs().max() / ref.abs().max() <= 1e-5


def test_logits_script_rejects_bad_token(tiny_ckpts, tmp_path):
    (tmp_path / "in.json").write_text(json.dumps([[1, 2, 100000]]))
    ckpt = tiny_ckpts["tiny_deepseek"]
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "logits.py"), f"model.path={ckpt}",
                        f"logits.input={tmp_path / 'in.json'}", f"logits.output={tmp_path / 'o.safetensors'}"],
                       capture_output=True, text=True, timeout=patience(60))
    assert r.returncode != 0 and "outside [0, 203)" in r.stderr + r.stdout


def test_logits_script_names_an_expert_placement_that_does_not_fit(tiny_ckpts, tmp_path):
    (tmp_path / "in.json").write_text(json.dumps(SEQS))
    ckpt = tiny_ckpts["tiny_deepseek"]
    base = [sys.executable, str(ROOT / "scripts" / "logits.py"), f"model.path={ckpt}", "parallel=ep8",
            f"logits.input={tmp_path / 'in.json'}", f"logits.output={tmp_path / 'o.safetensors'}"]
    r = subprocess.run([*base, "eplb.redundant_experts=3"], capture_output=True, text=True, timeout=patience(60))
    assert r.returncode != 0
    assert "eplb.redundant_experts=3 must be a non-negative multiple of parallel.moe_ep=8" in r.stderr + r.stdout
    (tmp_path / "placement.json").write_text(json.dumps({"phy2log": [list(range(16))]}))
    r = subprocess.run([*base, f"eplb.placement_file={tmp_path / 'placement.json'}"], capture_output=True, text=True,
                       timeout=patience(60))
    assert r.returncode != 0 and "has 1 MoE layers; the model has" in r.stderr + r.stdout
