"""Config parsing and shard-on-load: sharded checkpoints, clear errors naming tensor and file."""

import json
import logging
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.batch import ForwardBatch
from model.checkpoint_names import CheckpointNames, image_tensors
from model.config import ConfigError, load_config, parse_config
from model.forward import full_logits
from model.loader import CheckpointError, DeviceConfig, load_model, load_target
from model.tiny import load_hf, write_tiny
from model.transformer import CausalLM
from parallelism.comm import build_groups
from parallelism.layout import Layout
from tests.support.paths import REPO_ROOT


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
    assert base == k2 == replace(k25, weight_prefix="") and k25.weight_prefix == "language_model."
    assert repr(k25) == repr(base)  # the KV namespace (kv_shape) is the computation's, not the files' spelling
    tied = parse_config({"model_type": "kimi_k25", "text_config": raw, "tie_word_embeddings": True})
    assert tied.tie_word_embeddings and not k25.tie_word_embeddings  # the wrapper's key decides, as in HF
    assert base.moe.n_group == 4 and base.moe.topk_group == 2 and base.moe_layers == (False, True, True)
    assert base.rope.kind == "yarn" and base.rope.interleaved


def test_qwen3_moe_parse(tiny_ckpts):
    cfg = load_config(tiny_ckpts["tiny_qwen3_moe"])
    assert (cfg.num_kv_heads, cfg.moe.scoring, cfg.moe_layers) == (2, "softmax", (False, True, True))


def test_written_preset_is_reproducible(tmp_path):
    a = load_file(write_tiny("tiny_qwen3_moe", tmp_path / "a") / "model.safetensors")
    b = load_file(write_tiny("tiny_qwen3_moe", tmp_path / "b") / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("model_type,prefix,stored", [
    ("deepseek_v3", "", "model.layers.1.mlp.experts.3.up_proj.weight"),
    ("kimi_k25 published", "language_model.", "language_model.model.layers.1.mlp.experts.3.up_proj.weight"),
    ("kimi_k25 HF save_pretrained", "language_model.", "language_model.model.blocks.1.mlp.experts.3.up_proj.weight"),
])
def test_one_mapping_spells_every_layout(model_type, prefix, stored):
    files = [stored, stored.replace("up_proj", "down_proj"), "vision_tower.encoder.blocks.0.wqkv.weight",
             "mm_projector.proj.0.weight", "model.mm_projector.pre_norm.weight"]
    spelling = CheckpointNames.of(prefix, files)
    assert spelling.stored("model.layers.1.mlp.experts.3.up_proj.weight") == stored, model_type
    assert spelling.stored("lm_head.weight") == f"{prefix}lm_head.weight"
    assert spelling.stored("model.embed_tokens.weight") == f"{prefix}model.embed_tokens.weight"
    assert image_tensors(files) == files[2:]


def test_kimi_k25_as_hf_saves_it_gives_hf_logits(tmp_path):
    """HF's own ``save_pretrained`` of ``Kimi_K25ForConditionalGeneration`` (``language_model.model.blocks.*``, the
    wrapper's ``tie_word_embeddings``, a vision tower beside): its text logits are HF's."""
    ckpt = write_tiny("tiny_kimi_k25", tmp_path / "k25")
    stored = load_file(ckpt / "model.safetensors")
    assert any(k.startswith("language_model.model.blocks.") for k in stored) and image_tensors(stored)
    seqs = [[5, 17, 3, 99, 150, 7, 64], [2, 4, 6]]
    hf = load_hf(ckpt)
    ours = full_logits(load_model(ckpt, build_groups(Layout())), seqs)
    for seq, got in zip(seqs, ours, strict=True):
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([seq])).logits[0]
        assert float((got - ref).abs().max() / ref.abs().max()) <= 1e-5


def test_published_kimi_k25_missing_a_language_tensor_is_named(quant_ckpts, tmp_path, caplog, monkeypatch):
    """The published layout (two shards, an index, vision tensors): a language tensor dropped from its shard and
    the index fails naming its stored name; the vision tensors are said to be left unread, once, before ranks."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "scripts"))
    from preflight import preflight

    d = _copy(quant_ckpts["kimi_k25_int4"][0], tmp_path / "k25")
    with caplog.at_level(logging.INFO, logger="preflight"):
        preflight(Layout(), str(d))
    unread = [r.getMessage() for r in caplog.records if "vision tower present, not loaded" in r.getMessage()]
    assert len(unread) == 1 and "images are not served yet" in unread[0]
    name, shard = "language_model.model.layers.2.mlp.gate.weight", "model-00002-of-00002.safetensors"
    tensors = load_file(d / shard)
    del tensors[name]
    save_file(tensors, d / shard)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    del index["weight_map"][name]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"^missing tensor '{name}' in checkpoint [^\n]*$"):
        load_model(d, build_groups(Layout()))
