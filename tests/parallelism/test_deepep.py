"""The ``deepep`` dispatcher on CPU: its capability check, the pure layout helpers, and the dispatcher's glue
run against :class:`FakeBuffer` — DeepEP's documented semantics written in torch over gloo — compared with the
``alltoall`` dispatcher. DeepEP itself needs CUDA, NVSHMEM and NVLink GPUs; nothing here runs its kernels."""

import sys
import types
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from model.kernels import local_experts
from parallelism.comm import build_groups
from parallelism.deepep import (
    DeepEPDispatcher,
    buffer_bytes,
    choose_mode,
    deepep_mode,
    deepep_unavailable,
    expert_output_to_packed,
    low_latency_hidden_sizes,
    low_latency_unsupported,
    nvlink_unavailable,
    packed_to_expert_input,
)
from parallelism.dispatch import AllToAllDispatcher, make_dispatcher
from parallelism.dispatch_base import DeepEPUnavailable, Dispatcher
from parallelism.layout import ExpertPlacement, Layout
from tests.support.layouts import layout

E, K = 16, 3


def stand_in(lay: Layout, rank: int = 0):
    """What the capability check and Dispatcher.__init__ read of ParallelGroups, without process groups."""
    return SimpleNamespace(layout=lay, rank=rank, world=SimpleNamespace(group=None, size=lay.world_size, rank=rank))


def fake_deep_ep(with_use_fp8: bool = True) -> types.ModuleType:
    """A module with deep_ep.Buffer's method names (nothing runs): passes or fails the API check on purpose."""

    class Buffer:
        get_dispatch_layout = dispatch = combine = low_latency_combine = clean_low_latency_buffer = None
        get_low_latency_rdma_size_hint = get_dispatch_config = get_combine_config = destroy = None

        if with_use_fp8:
            def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                     use_fp8=True):
                pass
        else:
            def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                     async_finish=False, return_recv_hook=False):
                pass

    mod = types.ModuleType("deep_ep")
    mod.Buffer = Buffer
    return mod


# ------------------------------------------------------------------------------------------ capability


def test_without_deep_ep_the_error_names_alltoall(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # `import deep_ep` raises ImportError
    lay = layout("dp8_ep8", "dispatcher=deepep")
    reason = deepep_unavailable(stand_in(lay))
    assert reason is not None and "deep_ep" in reason and "docs/deepep.md" in reason
    with pytest.raises(DeepEPUnavailable) as err:
        make_dispatcher(stand_in(lay), ExpertPlacement(E, lay.moe_ep, lay.moe_tp))
    assert "parallel.dispatcher=alltoall" in str(err.value) and reason in str(err.value)


def _factory_error(ctx, lay):
    saved = sys.modules.get("deep_ep")
    sys.modules["deep_ep"] = None
    try:
        make_dispatcher(ctx.groups(lay), ExpertPlacement(E, lay.moe_ep, lay.moe_tp, lay.placement))
    except DeepEPUnavailable as err:
        return str(err)
    finally:
        if saved is None:
            sys.modules.pop("deep_ep", None)
        else:
            sys.modules["deep_ep"] = saved
    return None


def test_factory_refuses_on_every_rank_with_one_message(pool):
    """Through the real registry on 8 gloo ranks: all ranks refuse (none builds a buffer alone), same text."""
    messages = pool.run(_factory_error, layout("dp8_ep8", "dispatcher=deepep"))
    assert all(m is not None and "alltoall" in m for m in messages), messages
    assert len(set(messages)) == 1


def test_expert_tp_is_refused_before_anything_else(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", fake_deep_ep())  # a deep_ep that would pass its checks
    etp = layout("dp8_ep8", "dispatcher=deepep", "moe_tp=2", "moe_ep=4")
    reason = deepep_unavailable(stand_in(etp))
    assert reason is not None and "moe_tp=2" in reason and "expert-TP" in reason
    # the same deep_ep stand-in with moe_tp=1 gets past the layout, import and API checks to the CUDA one
    assert deepep_unavailable(stand_in(layout("dp8_ep8", "dispatcher=deepep"))) == "no CUDA device"
    with pytest.raises(DeepEPUnavailable, match="moe_tp=2"):
        DeepEPDispatcher(stand_in(etp), ExpertPlacement(E, 4, 2))


def test_group_sizes_without_intranode_configs_are_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", fake_deep_ep())
    for w in (1, 6):
        reason = deepep_unavailable(stand_in(Layout(world_size=w, attn_dp=w, moe_ep=w, dispatcher="deepep")))
        assert reason is not None and f"world_size={w}" in reason
    assert deepep_unavailable(stand_in(Layout(world_size=4, attn_dp=4, moe_ep=4))) == "no CUDA device"


def test_old_deep_ep_api_is_refused(monkeypatch):
    """The PyPI 1.0.0 snapshot's low_latency_dispatch has no use_fp8 (always FP8)."""
    monkeypatch.setitem(sys.modules, "deep_ep", fake_deep_ep(with_use_fp8=False))
    reason = deepep_unavailable(stand_in(layout("dp8_ep8", "dispatcher=deepep")))
    assert reason is not None and "use_fp8" in reason


def _fake_pynvml(nvlinked: set[tuple[int, int]], fail_init: bool = False) -> types.ModuleType:
    mod = types.ModuleType("pynvml")
    mod.NVML_P2P_CAPS_INDEX_NVLINK, mod.NVML_P2P_STATUS_OK, mod.calls = 2, 0, []

    def init():
        if fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def status(a, b, cap):
        mod.calls.append((a, b, cap))
        return 0 if (min(a, b), max(a, b)) in nvlinked else 4

    mod.nvmlInit, mod.nvmlShutdown = init, lambda: None
    mod.nvmlDeviceGetHandleByIndex = lambda i: i
    mod.nvmlDeviceGetP2PStatus = status
    return mod


def test_nvlink_check_asks_nvml_about_every_pair(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    full = {(a, b) for a in range(4) for b in range(a + 1, 4)}
    nvml = _fake_pynvml(full)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert nvlink_unavailable([0, 1, 2, 3]) is None
    assert sorted((a, b) for a, b, _ in nvml.calls) == sorted(full) and {c for *_, c in nvml.calls} == {2}
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(full - {(1, 3)}))
    reason = nvlink_unavailable([0, 1, 2, 3])
    assert reason is not None and "GPUs 1 and 3" in reason
    # CUDA_VISIBLE_DEVICES maps CUDA index 1 to physical GPU 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,3")
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml({(0, 1)}))
    assert nvlink_unavailable([0, 1]) is not None
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml({(0, 3)}))
    assert nvlink_unavailable([0, 1]) is None


def test_nvlink_check_turns_nvml_errors_into_a_reason(monkeypatch):
    nvml = _fake_pynvml(set())

    def not_supported(a, b, cap):
        raise RuntimeError("Not Supported")

    nvml.nvmlDeviceGetP2PStatus = not_supported
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    want = "NVML could not confirm NVLink between GPUs [0, 1] (RuntimeError: Not Supported)"
    assert nvlink_unavailable([0, 1]) == want


def test_nvlink_check_falls_back_to_peer_access(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(set(), fail_init=True))
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: (a, b) != (0, 2))
    reason = nvlink_unavailable([0, 1, 2])
    assert reason is not None and "GPU 0 cannot access GPU 2" in reason and "unconfirmed" in reason
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    assert nvlink_unavailable([0, 1, 2]) is None


# ------------------------------------------------------------------------------------------ pure helpers


def test_low_latency_shape_limits():
    assert low_latency_unsupported(7168, 8, 256, 8, 128, qp_depth=1024) is None
    assert "hidden size 7000" in low_latency_unsupported(7000, 8, 256, 8, 128, qp_depth=1024)
    assert "top_k=12" in low_latency_unsupported(7168, 12, 256, 8, 128, qp_depth=1024)
    assert "do not divide" in low_latency_unsupported(4096, 8, 100, 8, 128, qp_depth=1024)
    assert "multiple of 4" in low_latency_unsupported(4096, 8, 64, 2, 1, qp_depth=1024)  # 2*1
    assert low_latency_unsupported(4096, 8, 64, 2, 2, qp_depth=1024) is None  # 2*2
    assert "NVSHMEM_QP_DEPTH" in low_latency_unsupported(4096, 8, 64, 8, 512, qp_depth=1024)  # 2*513 > 1024
    assert low_latency_unsupported(4096, 8, 64, 8, 511, qp_depth=1024) is None
    assert "hidden size 3072" in low_latency_unsupported(3072, 8, 64, 8, 128, qp_depth=1024)  # v1.2.1: no 3072
    two_x = low_latency_hidden_sizes(types.SimpleNamespace(topk_idx_t=torch.int64))  # DeepEP 2.x exports it
    assert low_latency_unsupported(3072, 8, 64, 8, 128, qp_depth=1024, hidden_sizes=two_x) is None
    assert low_latency_hidden_sizes(None) == low_latency_hidden_sizes(types.SimpleNamespace()) == (
        2048, 2560, 4096, 5120, 6144, 7168, 8192)


def test_mode_choice():
    assert choose_mode(128, 128, True) == "low_latency"
    assert choose_mode(129, 128, True) == "normal"
    assert choose_mode(0, 128, True) == "low_latency"
    assert choose_mode(1, 128, False) == "normal"
    with pytest.raises(ValueError):
        with deepep_mode("fast"):
            pass


def test_routing_ids_become_deepep_numbering_through_the_physical_slots():
    """DeepEP numbers expert e as rank e // E_local, local index e % E_local: our physical slots. Routing ids are
    renamed through :meth:`Dispatcher.physical`; DeepEP's local index on a rank is then our local slot there."""
    lay = Layout(world_size=8, attn_dp=8, moe_ep=8, placement="round_robin")
    rr = ExpertPlacement(E, 8, 1, "round_robin")  # expert e on rank e % 8, slot e // 8
    d = Dispatcher(stand_in(lay, 0), rr)
    ids = d.physical(torch.arange(E)[:, None])[:, 0]
    assert ids.tolist() == [(e % 8) * 2 + e // 8 for e in range(E)]
    assert sorted(ids.tolist()) == list(range(E))
    for rank in range(8):
        d = Dispatcher(stand_in(lay, rank), rr)
        assert torch.equal(torch.where(torch.arange(E) // 2 == rank, torch.arange(E) % 2, -1), d.local_slot), rank
    assert d.physical(torch.tensor([[3, 8], [15, 0]])).tolist() == [[6, 1], [15, 0]]
    linear = ExpertPlacement(E, 8, 1, "linear")
    assert Dispatcher(stand_in(lay, 0), linear).physical(torch.arange(E)[:, None])[:, 0].tolist() == list(range(E))


def test_packed_rows_to_expert_input_hand_case():
    packed = torch.arange(2 * 3 * 2, dtype=torch.float32).view(2, 3, 2)  # 2 local experts, 3 rows, H=2
    inp = packed_to_expert_input(packed, torch.tensor([2, 1], dtype=torch.int32))
    assert inp.slots.tolist() == [[0], [0], [-1], [1], [-1], [-1]]
    assert inp.weights.tolist() == [[1.0]] * 6 and inp.weights.dtype == torch.float32
    assert torch.equal(inp.hidden, packed.view(6, 2))
    y = torch.randn(6, 2)
    assert torch.equal(expert_output_to_packed(y, (2, 3, 2)), y.view(2, 3, 2))


def test_packed_round_trip_through_real_experts():
    """Valid rows get their own expert's unweighted output; garbage (NaN) past the counts stays out of them."""
    gen = torch.Generator().manual_seed(0)
    el, r, h, inter = 3, 5, 8, 4
    w_gate_up, w_down = torch.randn(el, 2 * inter, h, generator=gen), torch.randn(el, h, inter, generator=gen)
    packed = torch.randn(el, r, h, generator=gen)
    counts = torch.tensor([5, 0, 2], dtype=torch.int32)
    for e, n in enumerate(counts.tolist()):
        packed[e, n:] = float("nan")
    y = expert_output_to_packed(local_experts(packed_to_expert_input(packed, counts), w_gate_up, w_down),
                                (el, r, h))
    for e, n in enumerate(counts.tolist()):
        g, u = (packed[e, :n] @ w_gate_up[e].T).chunk(2, dim=-1)
        want = (torch.nn.functional.silu(g) * u) @ w_down[e].T
        torch.testing.assert_close(y[e, :n], want)
        assert torch.equal(y[e, n:], torch.zeros(r - n, h))


class _Config:
    def __init__(self, nvl_per_byte, rdma):
        self.nvl_per_byte, self.rdma, self.seen = nvl_per_byte, rdma, []

    def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
        self.seen.append((hidden_bytes, num_ranks))
        return self.nvl_per_byte * hidden_bytes * num_ranks

    def get_rdma_buffer_size_hint(self, hidden_bytes, num_ranks):
        return self.rdma


class _SizedBuffer:
    dispatch_cfg, combine_cfg = _Config(10, 0), _Config(30, 7)
    get_dispatch_config = staticmethod(lambda n: _SizedBuffer.dispatch_cfg)
    get_combine_config = staticmethod(lambda n: _SizedBuffer.combine_cfg)
    get_low_latency_rdma_size_hint = staticmethod(lambda m, h, w, e: 1000 * m + 100 * h + 10 * w + e)


def test_buffer_size_arithmetic():
    # bf16 rows of 4096: 8192 bytes; nvl = max(10, 30) * 8192 * 8; rdma = the low-latency hint (> 7)
    assert buffer_bytes(_SizedBuffer, 8, 4096, 2, 64, 128, low_latency=True) == (30 * 8192 * 8,
                                                                                  128000 + 409600 + 80 + 64)
    assert buffer_bytes(_SizedBuffer, 8, 4096, 2, 64, 128, low_latency=False) == (30 * 8192 * 8, 7)
    assert _SizedBuffer.dispatch_cfg.seen[-1] == (8192, 8)
    buffer_bytes(_SizedBuffer, 4, 100, 1, 8, 4, low_latency=False)  # FP8 rows still sized at 2 bytes/element
    assert _SizedBuffer.combine_cfg.seen[-1] == (200, 4)


# ------------------------------------------------------------------------------------------ glue vs alltoall


class FakeBuffer:
    """DeepEP's documented Buffer semantics in torch, all ranks' data exchanged with all_gather_object.

    normal: each token once to every rank holding one of its experts, source-rank-major then token order;
    recv_topk_idx = local expert index or -1 (weight 0 there); combine sums rows per token, unweighted.
    low latency: rows packed per local expert ``[E_local, M * W, H]``, valid rows first (the rest NaN),
    counts int32; combine applies the routing weights (fp32 accumulation)."""

    def __init__(self, group, world_size: int, rank: int, num_experts: int):
        self.group, self.w, self.me, self.e = group, world_size, rank, num_experts
        self.epr = num_experts // world_size
        self.cleans, self.calls = 0, []

    def _gather(self, obj):
        if self.w == 1:
            return [obj]
        out = [None] * self.w
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def get_dispatch_layout(self, topk_idx, num_experts):
        t = topk_idx.shape[0]
        valid = topk_idx >= 0
        in_rank = torch.zeros(t, self.w, dtype=torch.bool)
        rows = torch.arange(t)[:, None].expand_as(topk_idx)[valid]
        in_rank[rows, topk_idx[valid] // self.epr] = True
        per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).int()
        return in_rank.sum(0).int(), None, per_expert, in_rank, None

    def dispatch(self, x, *, topk_idx, topk_weights, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                 num_tokens_per_expert):
        assert num_tokens_per_rdma_rank is None and x.dtype == torch.bfloat16 and topk_weights.dtype == torch.float32
        self.calls.append("dispatch")
        lo, rows, idx, wts, src = self.me * self.epr, [], [], [], []
        for r, (xr, ir, wr, inr) in enumerate(self._gather((x, topk_idx, topk_weights, is_token_in_rank))):
            t = inr[:, self.me].nonzero().flatten()
            local = (ir[t] >= lo) & (ir[t] < lo + self.epr)
            rows.append(xr[t])
            idx.append(torch.where(local, ir[t] - lo, -1))
            wts.append(torch.where(local, wr[t], 0.0))
            src += [(r, i) for i in t.tolist()]
        recv_idx = torch.cat(idx)
        counts = [int((recv_idx == i).sum()) for i in range(self.epr)]
        return torch.cat(rows), recv_idx, torch.cat(wts), counts, (x.shape[0], src), None

    def combine(self, x, handle):
        assert x.dtype == torch.bfloat16
        self.calls.append("combine")
        num_tokens, _ = handle
        out = torch.zeros(num_tokens, x.shape[1], dtype=x.dtype)
        for y, src in self._gather((x, handle[1])):
            for row, (r, t) in enumerate(src):
                if r == self.me:
                    out[t] += y[row]
        return out, None, None

    def clean_low_latency_buffer(self, max_tokens, hidden, num_experts):
        self.cleans += 1

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8=True):
        m = num_max_dispatch_tokens_per_rank
        assert not use_fp8 and x.dtype == torch.bfloat16 and x.shape[0] <= m and num_experts == self.e
        self.calls.append("ll_dispatch")
        parts = self._gather((x, topk_idx))
        packed = torch.full((self.epr, m * self.w, x.shape[1]), float("nan"), dtype=x.dtype)
        counts, src = torch.zeros(self.epr, dtype=torch.int32), [[] for _ in range(self.epr)]
        for i in range(self.epr):
            for r, (xr, ir) in enumerate(parts):
                for t in (ir == self.me * self.epr + i).any(dim=1).nonzero().flatten().tolist():
                    packed[i, len(src[i])] = xr[t]
                    src[i].append((r, t))
            counts[i] = len(src[i])
        return packed, counts, (src, m, x.shape[1], num_experts), None, None

    def low_latency_combine(self, x, topk_idx, topk_weights, handle):
        src, m, h, _ = handle
        assert x.shape == (self.epr, m * self.w, h) and x.dtype == torch.bfloat16 and x.is_contiguous()
        self.calls.append("ll_combine")
        parts = self._gather((x, src))
        out = torch.zeros(topk_idx.shape[0], h)
        for t in range(topk_idx.shape[0]):
            for j in range(topk_idx.shape[1]):
                e = int(topk_idx[t, j])
                if e >= 0:
                    owner, i = divmod(e, self.epr)
                    y, owner_src = parts[owner]
                    out[t] += topk_weights[t, j] * y[i, owner_src[i].index((self.me, t))].float()
        return out.to(torch.bfloat16), None, None


def identity_experts(inp):
    """Each row × the sum of its local choices' weights (exact in bf16 for the values below)."""
    w = torch.where(inp.slots >= 0, inp.weights, 0.0).sum(dim=1, keepdim=True)
    return (inp.hidden.float() * w).to(inp.hidden.dtype)


def _routing(seed: int, t: int, h: int):
    """Small-integer rows and power-of-two weights, so every sum here is exact in bf16."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-8, 9, (t, h), generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(t)]) if t else torch.zeros(0, K).long()
    weights = torch.tensor([0.5, 0.25, 0.125])[torch.randint(0, 3, (t, K), generator=gen)]
    return x, ids, weights


def _compare(ctx, lay, tokens, h, low_latency, max_decode_tokens=8, pinned=None):
    g = ctx.groups(lay)
    placement = ExpertPlacement(E, lay.moe_ep, lay.moe_tp, lay.placement)
    fake = FakeBuffer(g.world.group, g.world.size, g.world.rank, E)
    dep = DeepEPDispatcher(g, placement, low_latency=low_latency, max_decode_tokens=max_decode_tokens, buffer=fake)
    ref = AllToAllDispatcher(g, placement)
    x, ids, weights = _routing(100 + ctx.rank, tokens[ctx.rank], h)
    shared = torch.full((x.shape[0], h), 0.5, dtype=torch.bfloat16)
    ref_inp, ref_meta = ref.dispatch(x, ids, weights)
    want = ref.combine(identity_experts(ref_inp), ref_meta, shared)
    if pinned:
        with deepep_mode(pinned):
            inp, meta = dep.dispatch(x, ids, weights)
    else:
        inp, meta = dep.dispatch(x, ids, weights)
    got = dep.combine(identity_experts(inp), meta, shared)
    same_input = None
    if meta.mode == "normal":  # the received rows are the alltoall dispatcher's, slot for slot
        mask = ref_inp.slots >= 0
        same_input = (torch.equal(inp.hidden, ref_inp.hidden) and torch.equal(inp.slots, ref_inp.slots)
                      and torch.equal(inp.weights[mask], ref_inp.weights[mask])
                      and bool((inp.weights[~mask] == 0).all()))
    else:  # one row per (token, local expert) pair, weight 1
        mask = inp.slots >= 0
        same_input = (int(mask.sum()) == int(ref_inp.slots.ge(0).sum()) and bool((inp.weights == 1).all()))
    return {"mode": meta.mode, "equal": torch.equal(got, want), "dtype": got.dtype, "same_input": same_input,
            "calls": fake.calls, "cleans": fake.cleans, "graph_safe": dep.graph_safe,
            "counted": dict(g.counter.calls)}


TOKENS = [5, 0, 3, 1, 0, 7, 2, 4]  # uneven, two idle ranks, all <= 8


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
@pytest.mark.parametrize("low_latency", [False, True], ids=["normal", "low_latency"])
def test_deepep_glue_equals_alltoall(pool, placement, low_latency):
    lay = layout("dp8_ep8", "dispatcher=deepep", f"placement={placement}")
    h = 2048  # a hidden size the low-latency kernels take
    results = pool.run(_compare, lay, TOKENS, h, low_latency)
    for rank, r in enumerate(results):
        assert r["mode"] == ("low_latency" if low_latency else "normal"), rank
        assert r["equal"], f"rank {rank}: output differs from alltoall"
        assert r["same_input"], f"rank {rank}: ExpertInput differs from alltoall's"
        assert r["dtype"] == torch.bfloat16 and r["graph_safe"] == low_latency
        # low latency agrees on the mode with one counted all_reduce; normal-only needs no agreement
        assert r["counted"].get(("world", "all_reduce"), 0) == int(low_latency), r["counted"]


def test_auto_mode_is_one_decision_for_all_ranks(pool):
    """One rank over max_decode_tokens sends every rank down the normal path, including the idle ones."""
    lay = layout("dp8_ep8", "dispatcher=deepep")
    results = pool.run(_compare, lay, [5, 0, 3, 1, 0, 9, 2, 4], 2048, True)
    assert [r["mode"] for r in results] == ["normal"] * 8
    assert all(r["equal"] and r["same_input"] for r in results)


def _normal_then_low_latency(ctx, lay):
    g = ctx.groups(lay)
    placement = ExpertPlacement(E, lay.moe_ep, lay.moe_tp)
    fake = FakeBuffer(g.world.group, g.world.size, g.world.rank, E)
    dep = DeepEPDispatcher(g, placement, low_latency=True, max_decode_tokens=8, buffer=fake)
    modes, cleans = [], []
    for step, mode in enumerate(["low_latency", "normal", "low_latency", "low_latency"]):
        x, ids, weights = _routing(step * 10 + ctx.rank, 2, 2048)
        with deepep_mode(mode):
            inp, meta = dep.dispatch(x, ids, weights)
        dep.combine(identity_experts(inp), meta, None)
        modes.append(meta.mode)
        cleans.append(fake.cleans)
    return modes, cleans, dict(g.counter.calls)


def test_low_latency_buffer_is_cleaned_after_normal_steps_only(pool):
    for modes, cleans, counted in pool.run(_normal_then_low_latency, layout("dp8_ep8", "dispatcher=deepep")):
        assert modes == ["low_latency", "normal", "low_latency", "low_latency"]
        assert cleans == [0, 0, 1, 1]
        assert ("world", "all_reduce") not in counted  # pinned: no agreement collective


def test_graph_replay_cleans_the_low_latency_buffer_after_a_normal_step(monkeypatch):
    """``before_graph_replay`` (called by every CUDA-graph replay) does what an eager low-latency dispatch does
    after a normal one: clean once, then nothing until the next normal step."""
    from parallelism import deepep

    fake = FakeBuffer(None, 1, 0, E)
    shared = deepep._SharedBuffer(fake, True, 2048, 8, E, torch.int64, last_mode="normal")
    monkeypatch.setattr(deepep, "_SHARED", {0: shared})
    deepep.before_graph_replay()
    deepep.before_graph_replay()
    assert fake.cleans == 1 and shared.last_mode == "low_latency"


def test_release_destroys_every_buffer_once(monkeypatch):
    from parallelism import deepep

    destroyed = []
    fake = types.SimpleNamespace(destroy=lambda: destroyed.append(1))
    monkeypatch.setattr(deepep, "_SHARED", {0: deepep._SharedBuffer(fake, True, 2048, 8, E, torch.int64)})
    deepep.release_buffers()
    deepep.release_buffers()
    assert destroyed == [1] and deepep._SHARED == {}


def test_single_rank_matches_alltoall_with_real_experts():
    """World of one (no process group): DeepEP glue + real experts == alltoall + real experts, both paths;
    hidden 64 is no low-latency size, so asking for low latency falls back to the normal path."""
    g = build_groups(Layout())
    placement = ExpertPlacement(E, 1, 1)
    gen = torch.Generator().manual_seed(3)
    inter = 16
    for h in (64, 2048):
        w_gate_up = (torch.randn(E, 2 * inter, h, generator=gen) * h ** -0.5).to(torch.bfloat16)
        w_down = (torch.randn(E, h, inter, generator=gen) * inter ** -0.5).to(torch.bfloat16)
        x = torch.randn(6, h, generator=gen).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(6)])
        weights = torch.rand(6, K, generator=gen)
        ref = AllToAllDispatcher(g, placement)
        inp, meta = ref.dispatch(x, ids, weights)
        want = ref.combine(local_experts(inp, w_gate_up, w_down), meta, None).float()
        dep = DeepEPDispatcher(g, placement, low_latency=True, max_decode_tokens=8,
                               buffer=FakeBuffer(None, 1, 0, E))
        inp, meta = dep.dispatch(x, ids, weights)
        got = dep.combine(local_experts(inp, w_gate_up, w_down), meta, None).float()
        assert meta.mode == ("normal" if h == 64 else "low_latency")
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)  # weights applied twice would fail this


def test_graph_token_bound_is_the_low_latency_bound():
    g, placement = build_groups(Layout()), ExpertPlacement(E, 1, 1)
    assert DeepEPDispatcher(g, placement, low_latency=True, max_decode_tokens=96).graph_token_limit == 96
    assert DeepEPDispatcher(g, placement, low_latency=False).graph_token_limit is None  # not graph-safe at all


def test_fp32_activations_are_refused():
    g = build_groups(Layout())
    dep = DeepEPDispatcher(g, ExpertPlacement(E, 1, 1), buffer=FakeBuffer(None, 1, 0, E))
    with pytest.raises(TypeError, match="alltoall"):
        dep.dispatch(torch.zeros(2, 2048), torch.zeros(2, K, dtype=torch.int64), torch.ones(2, K))


def _split_compare(ctx, lay, tokens, h):
    """DeepEP (low latency, bound 8) and the all-to-all, both under attention TP2 (AttentionTPSplit)."""
    from parallelism.dispatch import AttentionTPSplit

    g = ctx.groups(lay)
    placement = ExpertPlacement(E, lay.moe_ep, lay.moe_tp, lay.placement)
    fake = FakeBuffer(g.world.group, g.world.size, g.world.rank, E)
    dep = AttentionTPSplit(DeepEPDispatcher(g, placement, low_latency=True, max_decode_tokens=8, buffer=fake),
                           g.attn_tp)
    ref = AttentionTPSplit(AllToAllDispatcher(g, placement), g.attn_tp)
    x, ids, weights = _routing(100 + lay.coords(ctx.rank).attn_dp_rank, tokens[lay.coords(ctx.rank).attn_dp_rank], h)
    shared = torch.full((x.shape[0], h), 0.25, dtype=torch.bfloat16)  # partial: 0.5 over the TP pair
    outs = []
    for disp in (dep, ref):
        inp, meta = disp.dispatch(x, ids, weights)
        outs.append(disp.combine(identity_experts(inp), meta, shared))
    return {"equal": torch.equal(*outs), "deepep_mode": dep.inner.last_mode, "limit": dep.graph_token_limit,
            "name": dep.name, "graph_safe": dep.graph_safe}


def test_deepep_under_attention_tp_equals_alltoall_and_doubles_the_token_bound(pool):
    """Mixed TP2 × DP4 attention: each TP rank hands DeepEP its share of ≤ 3 rows, and a group may hold twice
    the per-rank bound (16 tokens at ``max_decode_tokens=8``) in a captured step."""
    lay = layout("tp2xdp4_ep8", "dispatcher=deepep")
    for rank, r in enumerate(pool.run(_split_compare, lay, [5, 0, 3, 1], 2048)):
        assert r["equal"], f"rank {rank}: output differs from alltoall"
        assert (r["deepep_mode"], r["limit"], r["name"], r["graph_safe"]) == ("low_latency", 16, "deepep", True), r
