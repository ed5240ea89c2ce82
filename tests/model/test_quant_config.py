"""quantization_config parsing: the two formats users run parse, wherever the checkpoint puts them; anything
else is a ConfigError naming the field and the value; a layout that cuts a group or block fails before any
weight is read, naming the tensor and the degree."""

import copy
import json
from pathlib import Path

import pytest
import torch

from model.config import ConfigError, load_config, parse_config
from model.layout_fit import check_layout_fits
from model.quant.config import FP8, INT4
from model.quant.layout import check_layout
from model.quant.reference import act_quant, dequant_fp8, dequant_int4, unpack_int4
from parallelism.layout import Layout, LayoutError

INT4_CFG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                              "group_size": 32, "dynamic": False, "actorder": None}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None,
}
# Kimi K2.5 / K2.6's published list: regexes only, lm_head as a regex, the vision tower and projector too
PUBLISHED_K25_IGNORE = ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                        "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"]
FP8_CFG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def _raw(tiny_ckpts, quant=None, name="tiny_deepseek"):
    raw = json.loads(open(f"{tiny_ckpts[name]}/config.json").read())
    if quant is not None:
        raw["quantization_config"] = copy.deepcopy(quant)
    return raw


def test_int4_parses_and_selects_routed_experts_only(tiny_ckpts):
    q = parse_config(_raw(tiny_ckpts, INT4_CFG)).quant
    assert (q.method, q.group_size) == (INT4, 32)
    assert q.quantizes("model.layers.1.mlp.experts.7.down_proj")
    for name in ("model.layers.1.self_attn.q_b_proj", "model.layers.1.mlp.shared_experts.up_proj",
                 "model.layers.0.mlp.gate_proj", "lm_head"):
        assert not q.quantizes(name), name


def test_fp8_parses_with_hf_modules_to_not_convert(tiny_ckpts):
    q = parse_config(_raw(tiny_ckpts, {**FP8_CFG, "modules_to_not_convert": ["mlp.gate"]})).quant
    assert (q.method, q.block) == (FP8, (128, 128))
    assert q.quantizes("model.layers.0.mlp.gate_proj") and q.quantizes("model.layers.1.self_attn.kv_b_proj")
    assert not q.quantizes("model.layers.1.mlp.gate") and not q.quantizes("lm_head")


def test_kimi_k25_outer_quantization_config_is_kept(tiny_ckpts):
    """K2.5/K2.6 put quantization_config beside text_config: it used to be dropped silently."""
    wrapped = {"model_type": "kimi_k25", "text_config": _raw(tiny_ckpts), "quantization_config": INT4_CFG}
    assert parse_config(wrapped).quant == parse_config(_raw(tiny_ckpts, INT4_CFG)).quant.__class__(
        INT4, 32, targets=("Linear",), ignore=tuple(INT4_CFG["ignore"]), name_prefixes=("", "language_model."))
    inner = {"model_type": "kimi_k25", "text_config": _raw(tiny_ckpts, INT4_CFG)}
    assert parse_config(inner).quant.method == INT4
    published = {**wrapped, "quantization_config": {**INT4_CFG, "ignore": PUBLISHED_K25_IGNORE}}
    q = parse_config(published).quant
    assert q.quantizes("model.layers.1.mlp.experts.7.down_proj")
    for name in ("lm_head", "model.layers.1.self_attn.q_b_proj", "model.layers.1.mlp.shared_experts.up_proj"):
        assert not q.quantizes(name), name
    only_theirs = {**wrapped, "quantization_config": {**INT4_CFG, "ignore": [r"re:language_model\.lm_head$"]}}
    assert not parse_config(only_theirs).quant.quantizes("lm_head")  # the prefixed name is ignored
    quantized_head = {**wrapped, "quantization_config": {**INT4_CFG, "ignore": PUBLISHED_K25_IGNORE[:3]}}
    with pytest.raises(ConfigError, match="does not list lm_head"):
        parse_config(quantized_head)
    clash = {**wrapped, "text_config": _raw(tiny_ckpts, FP8_CFG)}
    with pytest.raises(ConfigError, match="differs from text_config.quantization_config"):
        parse_config(clash)


def _set(cfg, path, value):
    out = copy.deepcopy(cfg)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


W = ("config_groups", "group_0", "weights")
BAD = [
    (INT4_CFG, W + ("num_bits",), 8, r"config_groups.group_0.weights.num_bits=8"),
    (INT4_CFG, W + ("symmetric",), False, r"weights.symmetric=False"),
    (INT4_CFG, W + ("actorder",), "group", r"weights.actorder='group'"),
    (INT4_CFG, W + ("strategy",), "channel", r"weights.strategy='channel'"),
    (INT4_CFG, W + ("type",), "float", r"weights.type='float'"),
    (INT4_CFG, ("format",), "marlin-24", r"format='marlin-24'"),
    (INT4_CFG, ("config_groups", "group_0", "input_activations"), {"num_bits": 8}, r"input_activations="),
    (INT4_CFG, ("ignore",), ["re:.*self_attn.*"], r"lm_head"),
    (FP8_CFG, ("fmt",), "e5m2", r"fmt='e5m2'"),
    (FP8_CFG, ("activation_scheme",), "static", r"activation_scheme='static'"),
    (FP8_CFG, ("weight_block_size",), None, r"weight_block_size=None"),
    (FP8_CFG, ("quant_method",), "gptq", r"quant_method='gptq'"),
]


@pytest.mark.parametrize("base,path,value,message", BAD, ids=[m for *_, m in BAD])
def test_unsupported_scheme_names_field_and_value(tiny_ckpts, base, path, value, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(_raw(tiny_ckpts, _set(base, path, value)))


def test_layout_that_cuts_a_group_fails_naming_tensor_and_degree(tiny_ckpts):
    """moe_intermediate_size 16: expert-TP 2 leaves 8 columns of down_proj per rank, a quarter of a group;
    FP8 blocks of 16 rows do not fit the 24 q_b_proj rows attention-TP 8 leaves each rank."""
    int4 = parse_config(_raw(tiny_ckpts, INT4_CFG))
    check_layout(int4, Layout(world_size=8, attn_tp=8, moe_ep=8))
    with pytest.raises(LayoutError, match=r"moe_tp=2 cuts model.layers.1.mlp.experts.\*.down_proj.weight_packed"):
        check_layout(int4, Layout(world_size=8, attn_tp=8, moe_tp=2, moe_ep=4))
    with pytest.raises(LayoutError, match=r"moe_tp=2 cuts"):  # what the launchers' preflight runs
        check_layout_fits(int4, Layout(world_size=8, attn_tp=8, moe_tp=2, moe_ep=4))
    fp8 = parse_config(_raw(tiny_ckpts, {**FP8_CFG, "weight_block_size": [16, 16]}))
    check_layout(fp8, Layout())
    with pytest.raises(LayoutError, match=r"attn_tp=8 cuts model.layers.0.self_attn.q_b_proj.weight .*16 rows"):
        check_layout(fp8, Layout(world_size=8, attn_tp=8, moe_ep=8))
    fp8_32 = parse_config(_raw(tiny_ckpts, {**FP8_CFG, "weight_block_size": [32, 32]}))
    with pytest.raises(LayoutError, match=r"model.layers.1.mlp.experts.\*.gate_proj.weight has 16 rows.*stacked"):
        check_layout(fp8_32, Layout())


def test_layout_check_runs_before_weights_are_read(tiny_ckpts, tmp_path):
    from model.loader import load_model
    from parallelism.comm import build_groups

    raw = _raw(tiny_ckpts, {**FP8_CFG, "weight_block_size": [16, 16]})
    (tmp_path / "config.json").write_text(json.dumps(raw))  # no weights at all
    assert load_config(tmp_path).quant.block == (16, 16)
    with pytest.raises(LayoutError, match="moe_tp=2 cuts"):
        check_layout(load_config(tmp_path), Layout(world_size=2, attn_tp=1, attn_dp=2, moe_tp=2))
    with pytest.raises(Exception, match="no .*safetensors"):
        load_model(tmp_path, build_groups(Layout()))


def test_int4_unpack_by_hand():
    """Word 0x76543210 + 8 per nibble: first value in the lowest bits, stored offset by +8."""
    word = sum(((v + 8) & 0xF) << (4 * i) for i, v in enumerate([-8, -1, 0, 7, 3, -3, 1, 2]))
    packed = torch.tensor([[word - (1 << 32) if word >= 1 << 31 else word]], dtype=torch.int32)
    assert unpack_int4(packed).tolist() == [[-8, -1, 0, 7, 3, -3, 1, 2]]
    scale = torch.tensor([[0.5]])
    assert dequant_int4(packed, scale, 8).tolist() == [[-4.0, -0.5, 0.0, 3.5, 1.5, -1.5, 0.5, 1.0]]


def test_fp8_partial_blocks_and_activation_groups():
    """⌈out/B⌉ × ⌈in/B⌉ scales cover a weight whose dims are not multiples of the block."""
    w = torch.ones(5, 7).to(torch.float8_e4m3fn)
    s = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    d = dequant_fp8(w, s, (4, 4))
    assert d[0, 0] == 1 and d[0, 6] == 2 and d[4, 0] == 3 and d[4, 6] == 4
    x = torch.tensor([[1.0, -448.0, 2.0, 0.0, 0.0]])
    xq, scale = act_quant(x, 2)
    assert scale[0].tolist() == pytest.approx([1.0, 2.0 / 448, 1.0]) and xq.float()[0, :2].tolist() == [1.0, -448.0]


def _fake_groups(lay, rank):
    """A rank's view without processes: construction and loading read only rank/size."""
    from parallelism.comm import CommCounter, ParallelGroups

    class FakeComm:
        def __init__(self, kind, rank, size):
            self.kind, self.rank, self.size = kind, rank, size

    c = lay.coords(rank)
    return ParallelGroups(lay, rank, CommCounter(), FakeComm("world", rank, lay.world_size),
                          FakeComm("attn_tp", c.attn_tp_rank, lay.attn_tp), FakeComm("attn_dp", c.attn_dp_rank,
                                                                                       lay.attn_dp),
                          FakeComm("moe_tp", c.moe_tp_rank, lay.moe_tp), FakeComm("moe_ep", c.moe_ep_rank, lay.moe_ep))


@pytest.mark.parametrize("ckpt", ["kimi_k25_int4", "deepseek_fp8"])
def test_each_quantized_byte_is_read_by_the_ranks_that_hold_it(quant_ckpts, monkeypatch, ckpt):
    """tp2_ep4 (attention TP8, experts EP4 x expert-TP2), all 8 ranks loaded in turn: every sharded quantized
    tensor (packed weights and scales) is read exactly once over all ranks — each rank reads only its slice —
    and the replicated ones (kv_a_proj_with_mqa, q_a_proj) once per rank."""
    from collections import Counter

    from safetensors import safe_open

    import model.loader as loader
    from model.transformer import CausalLM

    path = quant_ckpts[ckpt][0]
    read = Counter()
    narrow, whole = loader.SliceSource.narrow, loader.SliceSource.read

    def count(fn):
        def run(self, *args):
            t = fn(self, *args)
            read[self.name] += t.numel() * t.element_size()
            return t
        return run
    monkeypatch.setattr(loader.SliceSource, "narrow", count(narrow))
    monkeypatch.setattr(loader.SliceSource, "read", count(whole))
    lay = Layout(world_size=8, attn_tp=8, moe_tp=2, moe_ep=4)
    for rank in range(8):
        model = CausalLM(load_config(path), _fake_groups(lay, rank))
        loader.load_weights(model, path)
    size = {}
    for shard in Path(path).glob("*.safetensors"):  # the published kimi_k25 layout comes in two shards
        with safe_open(str(shard), "pt") as f:
            size |= {k: f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys()}
    fp8_weight = k_is_proj if ckpt == "deepseek_fp8" else (lambda _: False)
    quantized = [k for k in size if k.endswith(("weight_packed", "weight_scale", "weight_scale_inv"))
                 or fp8_weight(k)]
    assert len(quantized) > 100
    for k in quantized:
        replicas = 8 if ("q_a_proj" in k or "kv_a_proj" in k) else 1
        assert read[k] == replicas * size[k], (k, read[k], size[k])


def k_is_proj(name: str) -> bool:
    return name.endswith(("_proj.weight", "_proj_with_mqa.weight"))


def test_checkpoint_that_disagrees_with_its_config_is_named(quant_ckpts, tmp_path):
    """A wrong ``weight_shape``, or a quantized config over unquantized tensors, fails naming the tensor."""
    import shutil

    from safetensors.torch import load_file, save_file

    from model.loader import CheckpointError, load_model
    from parallelism.comm import build_groups

    d = tmp_path / "shape"
    shutil.copytree(quant_ckpts["kimi_k2_int4"][0], d)
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.2.mlp.experts.3.up_proj.weight_shape"] = torch.tensor([256, 63])
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"experts.3.up_proj.weight_shape in .*model.safetensors is \[256, 63\], "
                                         r"expected \[256, 64\]"):
        load_model(d, build_groups(Layout()))
    d = tmp_path / "plain"
    shutil.copytree(quant_ckpts["kimi_k2_int4"][1], d)  # dequantized tensors, quantized config
    shutil.copy(f"{quant_ckpts['kimi_k2_int4'][0]}/config.json", d / "config.json")
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.1.mlp.experts.0.gate_proj.weight_packed'"):
        load_model(d, build_groups(Layout()))
