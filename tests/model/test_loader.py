"""Config parsing and shard-on-load: sharded checkpoints, clear errors naming tensor and file."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.batch import ForwardBatch
from model.config import ConfigError, load_config, parse_config
from model.loader import CheckpointError, DeviceConfig, load_model, load_target
from model.tiny import load_hf, write_tiny
from model.transformer import CausalLM
from parallelism.comm import build_groups
from parallelism.layout import Layout


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_with_index_loads_the_same(tiny_ckpts, tmp_path):
    src = tiny_ckpts["tiny_deepseek"]
    sharded = tmp_path / "sharded"
    load_hf(src).save_pretrained(sharded, max_shard_size="200KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    batch = ForwardBatch.from_sequences([[3, 4, 5, 6], [7, 8]])
    a = load_model(src, build_groups(Layout()))
    b = load_model(sharded, build_groups(Layout()))
    assert torch.equal(a.logits(a(batch)), b.logits(b(batch)))



def test_load_target_on_cpu_is_load_model_with_the_references(tiny_ckpts):
    """The entry points' model: on CPU the same logits as ``load_model`` and the torch reference kernels."""
    src, batch = tiny_ckpts["tiny_deepseek"], ForwardBatch.from_sequences([[3, 4, 5, 6], [7, 8]])
    plain = load_model(src, build_groups(Layout()))
    target = load_target(src, build_groups(Layout()), 0, DeviceConfig())
    assert target.kernels.reasons["rms_norm"] == "torch reference: no CUDA device (cpu)"
    assert torch.equal(plain.logits(plain(batch)), target.logits(target(batch)))


@pytest.mark.parametrize("field", [dict(type="tpu"), dict(dtype="float33"), dict(kernels="cuda")])
def test_device_config_names_the_bad_field(field):
    with pytest.raises(ValueError, match=f"device.{next(iter(field))}"):
        DeviceConfig(**field)


def test_missing_tensor_names_tensor_and_dir(tiny_ckpts, tmp_path):
    d = _copy(tiny_ckpts["tiny_deepseek"], tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.1.mlp.experts.5.up_proj.weight'"):
        load_model(d, build_groups(Layout()))


def test_misshapen_tensor_names_tensor_file_and_shapes(tiny_ckpts, tmp_path):
    d = _copy(tiny_ckpts["tiny_deepseek"], tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.self_attn.kv_b_proj.weight"] = torch.zeros(10, 3)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'model.layers.0.self_attn.kv_b_proj.weight' in .*model.safetensors "
                                              r"has shape \[10, 3\], expected \[256, 32\]"):
        load_model(d, build_groups(Layout()))


def test_quantized_dtype_is_rejected(tiny_ckpts, tmp_path):
    d = _copy(tiny_ckpts["tiny_deepseek"], tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight"] = tensors["model.layers.0.mlp.down_proj.weight"].to(
        torch.float8_e4m3fn)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(CheckpointError, match="'model.layers.0.mlp.down_proj.weight'.*quantized dtype F8_E4M3"):
        load_model(d, build_groups(Layout()))


def test_unsupported_quantization_config_is_rejected(tiny_ckpts, tmp_path):
    d = _copy(tiny_ckpts["tiny_deepseek"], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="quant_method='gptq'"):
        load_config(d)


def test_each_rank_plans_only_its_slices(tiny_ckpts):
    """Under ep8, rank 3's plan names only experts 6 and 7 of each MoE layer (shard-on-load)."""
    cfg = load_config(tiny_ckpts["tiny_deepseek"])

    class FakeComm:  # a rank's view without processes: only rank/size are read at construction
        def __init__(self, kind, rank, size):
            self.kind, self.rank, self.size = kind, rank, size

    from parallelism.comm import CommCounter, ParallelGroups

    lay = Layout(world_size=8, attn_tp=8, moe_ep=8)
    c = lay.coords(3)
    groups = ParallelGroups(lay, 3, CommCounter(), FakeComm("world", 3, 8), FakeComm("attn_tp", c.attn_tp_rank, 8),
                            FakeComm("attn_dp", 0, 1), FakeComm("moe_tp", 0, 1), FakeComm("moe_ep", 3, 8))
    names = [n for n, _ in CausalLM(cfg, groups).checkpoint_plan()]
    experts = sorted({int(n.split(".")[5]) for n in names if ".experts." in n})
    assert experts == [6, 7]
    assert "model.layers.1.mlp.experts.0.up_proj.weight" not in names
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in names


def test_unsupported_model_type():
    with pytest.raises(ConfigError, match="model_type 'llama' is not supported"):
        parse_config({"model_type": "llama"})


def test_missing_field_is_named(tiny_ckpts):
    raw = json.loads(open(f"{tiny_ckpts['tiny_deepseek']}/config.json").read())
    del raw["kv_lora_rank"]
    with pytest.raises(ConfigError, match="missing field 'kv_lora_rank'"):
        parse_config(raw)


def test_kimi_configs_parse_as_deepseek(tiny_ckpts):
    raw = json.loads(open(f"{tiny_ckpts['tiny_deepseek']}/config.json").read())
    base = parse_config(raw)
    k2 = parse_config({**raw, "model_type": "kimi_k2"})
    k25 = parse_config({"model_type": "kimi_k25", "text_config": {**raw, "model_type": "deepseek_v3"},
                        "vision_config": {}})
    assert base == k2 == k25
    assert base.moe.n_group == 4 and base.moe.topk_group == 2 and base.moe_layers == (False, True, True)
    assert base.rope.kind == "yarn" and base.rope.interleaved


def test_qwen3_moe_parse(tiny_ckpts):
    cfg = load_config(tiny_ckpts["tiny_qwen3_moe"])
    assert (cfg.num_kv_heads, cfg.moe.scoring, cfg.moe_layers) == (2, "softmax", (False, True, True))


def test_written_preset_is_reproducible(tmp_path):
    a = load_file(write_tiny("tiny_qwen3_moe", tmp_path / "a") / "model.safetensors")
    b = load_file(write_tiny("tiny_qwen3_moe", tmp_path / "b") / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
