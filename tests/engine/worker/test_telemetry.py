"""Telemetry: /proc/stat maths, the NVML path against a fake NVML module, summaries and the verdict on
recorded sample fixtures, and the floors on hand-worked numbers."""

import time
from types import SimpleNamespace

import pytest

from bench.cost.formulas import Floors, step_bytes, step_flops
from bench.cost.hardware import Hardware
from bench.cost.shapes import ModelShape
from bench.telemetry import compute_floors, energy_per_token_j, power_during, sampler_summary, summarize, verdict
from engine.worker.telemetry import (
    CpuBackend,
    NvmlBackend,
    TelemetrySampler,
    cpu_utilisation,
    open_backend,
    parse_proc_stat,
)
from parallelism.layout import Layout

# ------------------------------------------------------------------------------------------- CPU side
STAT0 = """cpu  100 0 100 700 100 0 0 0 0 0
cpu0 50 0 50 350 50 0 0 0 0 0
cpu1 50 0 50 350 50 0 0 0 0 0
intr 12345
"""
# cpu0: +60 user +20 system +15 idle +5 iowait -> 80 of 100 busy; cpu1: +10 +10 +70 +10 -> 20 of 100
STAT1 = """cpu  170 0 130 785 115 0 0 0 0 0
cpu0 110 0 70 365 55 0 0 0 0 0
cpu1 60 0 60 420 60 0 0 0 0 0
"""


def test_proc_stat_deltas():
    prev, cur = parse_proc_stat(STAT0), parse_proc_stat(STAT1)
    assert prev["cpu0"] == (100, 500)  # busy = total - idle - iowait
    u = cpu_utilisation(prev, cur)
    assert u["cpu_pct"] == pytest.approx([80.0, 20.0])
    assert u["cpu_total_pct"] == pytest.approx(50.0)


def test_cpu_backend_from_file(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text(STAT0)
    b = CpuBackend(stat_path=str(stat))
    stat.write_text(STAT1)
    sum(i * i for i in range(200_000))  # this process's own CPU time
    sample = b.sample()
    assert sample["cpu_pct"] == pytest.approx([80.0, 20.0]) and sample["process_cpu_pct"] > 0
    assert b.reason == "no NVML/GPU" and "power_w" in b.missing


def test_rank_sampler_hands_each_sample_to_the_gather_once():
    """A serving rank off CUDA samples CPU use (with the reason); ``fresh()`` gives the newest sample once."""
    import torch

    from engine.worker.telemetry import rank_sampler

    sampler = rank_sampler(torch.device("cpu"), interval_s=10)
    assert sampler.source == "cpu" and sampler.reason == "no NVML/GPU: the rank runs on cpu"
    assert sampler.fresh() is None
    first = sampler.sample_now()
    assert sampler.fresh() is first and sampler.fresh() is None
    for _ in range(6):  # past max_samples: the oldest are dropped, the newest still handed once
        last = sampler.sample_now()
    assert sampler.fresh() is last and sampler.fresh() is None and len(sampler.samples) == 4


def test_sampler_on_this_box_falls_back_to_cpu():
    sampler = TelemetrySampler(interval_s=0.01, backend=open_backend())  # no GPU here (or NVML absent)
    if sampler.source == "nvml":
        pytest.skip("a GPU with NVML is present")
    assert sampler.reason.startswith("no NVML/GPU")
    with sampler:
        mark = sampler.mark()
        time.sleep(0.06)
    samples = sampler.samples
    assert len(samples) >= 3 and all("cpu_total_pct" in s and "t" in s for s in samples)
    assert all(0 <= s["cpu_total_pct"] <= 100 for s in samples)
    s = sampler_summary(sampler, since=mark)
    assert s["source"] == "cpu" and s["reason"].startswith("no NVML/GPU") and s["cpu_total_pct"]["max"] >= 0


# ------------------------------------------------------------------------------------------ NVML side
class NVMLError(Exception):
    pass


class FakeNvml:
    """Two GPUs: gpu0 has GPM (Hopper), gpu1 refuses GPM and clocks. Power 300 W of 1100 W, energy +30 J per
    reading."""

    NVML_CLOCK_SM, NVML_CLOCK_MEM = 1, 2
    NVML_GPM_METRIC_SM_UTIL, NVML_GPM_METRIC_SM_OCCUPANCY, NVML_GPM_METRIC_DRAM_BW_UTIL = 2, 3, 10
    NVML_GPM_METRIC_ANY_TENSOR_UTIL = 5
    NVML_GPM_METRICS_GET_VERSION = 1

    class c_nvmlGpmMetricsGet_t:  # pynvml's name
        def __init__(self):
            self.metrics = [SimpleNamespace(metricId=0, nvmlReturn=0, value=0.0) for _ in range(8)]

    def __init__(self):
        self.energy = [1_000_000, 2_000_000]
        self.closed = False

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        self.closed = True

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetIndex(self, h):
        return h

    def nvmlDeviceGetPowerUsage(self, h):
        return 300_000

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return 1_100_000

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        self.energy[h] += 30_000
        return self.energy[h]

    def nvmlDeviceGetClockInfo(self, h, clock):
        if h == 1:
            raise NVMLError("Not Supported")
        return 1980 if clock == self.NVML_CLOCK_SM else 2619

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=100, memory=60)

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        if h == 1:
            raise NVMLError("Not Supported")
        return 0x4 | 0x40  # SW power cap, HW thermal slowdown

    def nvmlGpmQueryDeviceSupport(self, h):
        if h == 1:
            raise NVMLError("Not Supported")
        return SimpleNamespace(isSupportedDevice=1)

    def nvmlGpmSampleAlloc(self):
        return object()

    def nvmlGpmSampleGet(self, h, s):
        return s

    def nvmlGpmMetricsGet(self, mg):
        values = {2: 41.0, 3: 12.5, 5: 9.0, 10: 87.0}
        for m in mg.metrics[: mg.numMetrics]:
            m.value = values[m.metricId]
        return mg

    def nvmlGpmSampleFree(self, s):
        pass


def test_nvml_backend_metrics_and_missing_reasons():
    nv = FakeNvml()
    b = open_backend(nvml=nv)
    assert isinstance(b, NvmlBackend) and b.source == "nvml"
    g0, g1 = b.sample()["gpus"]
    assert g0["power_w"] == 300 and g0["power_limit_w"] == 1100 and g0["power_pct"] == pytest.approx(300 / 11)
    assert (g0["sm_clock_mhz"], g0["mem_clock_mhz"], g0["kernel_active_pct"]) == (1980, 2619, 100)
    assert (g0["sm_active_pct"], g0["sm_occupancy_pct"], g0["dram_active_pct"]) == (41.0, 12.5, 87.0)
    assert g0["tensor_active_pct"] == 9.0 and g0["throttle_reasons"] == ["sw_power_cap", "hw_thermal"]
    assert "sm_active_pct" not in g1 and "sm_clock_mhz" not in g1 and g1["power_w"] == 300
    assert "throttle_reasons" not in g1 and b.missing["throttle_reasons"].startswith("gpu1: NVMLError")
    assert b.missing["sm_active_pct"].startswith("gpu1: NVMLError: Not Supported")
    assert b.missing["sm_clock_mhz"].startswith("gpu1")
    b.close()
    assert nv.closed


def test_nvml_sampler_energy_per_token():
    sampler = TelemetrySampler(interval_s=10, backend=open_backend(nvml=FakeNvml()))
    for _ in range(3):
        sampler.sample_now()
    s = sampler_summary(sampler)
    # each GPU's counter rose 2 x 30 J between the first and the last sample
    assert s["energy_j"] == pytest.approx(120.0) and s["energy_source"] == "counter"
    assert energy_per_token_j(s, 40) == pytest.approx(3.0)
    assert s["power_w"] == {"mean": 300, "max": 300} and s["power_w_total_mean"] == 600
    assert s["sm_active_pct"]["mean"] == 41.0  # only gpu0 reports it


def test_a_cuda_rank_samples_its_own_gpu(monkeypatch):
    """The serving rank on CUDA device 1 samples NVML's GPU 1 only (found through CUDA_VISIBLE_DEVICES here, where
    CUDA cannot report the device's UUID); a GPU NVML does not know falls back to CPU figures with the reason."""
    import torch

    from engine.worker.telemetry import rank_backend

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    backend = rank_backend(torch.device("cuda", 1), nvml=FakeNvml())
    assert isinstance(backend, NvmlBackend) and backend.indices == [1]
    [g] = backend.sample()["gpus"]
    assert g["index"] == 1 and g["power_w"] == 300


    class OneGpu(FakeNvml):
        def nvmlDeviceGetHandleByIndex(self, i):
            if i > 0:
                raise NVMLError("Invalid Argument")
            return i

    cpu = rank_backend(torch.device("cuda", 1), nvml=OneGpu())
    assert cpu.source == "cpu" and cpu.reason == "no NVML/GPU: NVMLError: Invalid Argument"


def test_power_during_a_span_comes_from_the_energy_counter():
    """Mean power over a span is the counter's delta over its length (+30 J per reading on the fake GPU), not
    NVML's 1 s power average (300 W here, reported as ``last_1s_w``); GPM activity is over the same span."""
    nv, syncs, calls = FakeNvml(), [], []
    row = power_during(NvmlBackend(nv, [0]), lambda: calls.append(1), 0.05, lambda: syncs.append(1))
    assert row["calls"] == len(calls) >= 1 and len(syncs) == 2 and row["seconds"] >= 0.05
    assert row["mean_w"] == pytest.approx(30 / row["seconds"])
    assert row["pct_of_limit"] == pytest.approx(100 * row["mean_w"] / 1100)
    assert (row["last_1s_w"], row["limit_w"], row["sm_active_pct"], row["dram_active_pct"]) == (300, 1100, 41.0, 87.0)


def test_open_backend_reasons():
    class Broken:
        def nvmlInit(self):
            raise NVMLError("NVML Shared Library Not Found")

    class NoGpu(FakeNvml):
        def nvmlDeviceGetCount(self):
            return 0

    assert open_backend(nvml=Broken()).reason == "no NVML/GPU: NVMLError: NVML Shared Library Not Found"
    assert open_backend(nvml=NoGpu()).reason == "no NVML/GPU: NVML found no GPU"
    assert open_backend("cpu").source == "cpu"
    with pytest.raises(RuntimeError, match="no NVML/GPU"):
        open_backend("nvml", nvml=Broken())


# ------------------------------------------------------------------------------ recorded sample fixtures
def _gpu_samples(dram, sm, power_w=350.0, n=4, energy=True):
    """n samples one second apart, 2 GPUs, each drawing ``power_w`` of an 1100 W limit."""
    out = []
    for i in range(n):
        gpus = []
        for g in range(2):
            d = {"index": g, "power_w": power_w, "power_limit_w": 1100.0, "power_pct": 100 * power_w / 1100,
                 "sm_clock_mhz": 1965.0, "mem_clock_mhz": 3996.0, "kernel_active_pct": 100.0,
                 "sm_active_pct": sm, "dram_active_pct": dram}
            if energy:
                d["energy_mj"] = 5_000_000.0 + g * 1e6 + i * power_w * 1000
            gpus.append(d)
        out.append({"t": 100.0 + i, "gpus": gpus})
    return out


MEMORY_BOUND = _gpu_samples(dram=85.0, sm=40.0)       # B300-like decode: DRAM busy, SMs half idle, 32 % power
LAUNCH_BOUND = _gpu_samples(dram=12.0, sm=15.0, power_w=180.0)
CPU_ONLY = [{"t": 0.0, "cpu_total_pct": 97.0, "cpu_pct": [99.0, 95.0]},
            {"t": 0.5, "cpu_total_pct": 99.0, "cpu_pct": [100.0, 98.0]}]
FLOORS = Floors(memory_s=1.0e-3, compute_s=0.1e-3, interconnect_s=0.3e-3)


def test_summary_of_fixture():
    s = summarize(MEMORY_BOUND)
    assert s["num_samples"] == 4 and s["duration_s"] == 3 and s["num_gpus"] == 2
    assert s["power_pct"]["mean"] == pytest.approx(31.8, abs=0.05)
    assert s["energy_j"] == pytest.approx(2 * 350 * 3) and s["energy_source"] == "counter"
    no_counter = summarize(_gpu_samples(85.0, 40.0, energy=False))  # trapezoid over power samples
    assert no_counter["energy_j"] == pytest.approx(2 * 350 * 3) and no_counter["energy_source"] == "power integral"
    c = summarize(CPU_ONLY)
    assert c["cpu_total_pct"] == {"mean": 98.0, "max": 99.0} and c["cpu_pct_mean"] == [99.5, 96.5]


def test_verdict_memory_bound_and_consistent():
    v = verdict(1.5e-3, FLOORS, telemetry=summarize(MEMORY_BOUND))
    assert v["bound"] == "memory" and v["largest_floor"] == "memory"
    assert v["explained_s"] == pytest.approx(1.3e-3) and v["ratio"] == pytest.approx(1.5 / 1.3)
    assert v["telemetry_consistent"] is True
    assert "DRAM active 85 %" in v["evidence"] and any("utilization.gpu" in e for e in v["evidence"])
    assert v["floors_s"] == {"memory": 1.0e-3, "compute": 0.1e-3, "interconnect": 0.3e-3}


def test_verdict_host_launch_beyond_factor():
    v = verdict(5.0e-3, FLOORS, telemetry=summarize(LAUNCH_BOUND))
    assert v["bound"] == "host/launch" and v["ratio"] == pytest.approx(5 / 1.3)
    assert v["telemetry_consistent"] is True and "SM active 15 %" in v["evidence"]
    assert verdict(2.6e-3, FLOORS)["bound"] == "memory"  # 2.0x: not beyond the factor
    assert verdict(2.7e-3, FLOORS)["bound"] == "host/launch"
    assert verdict(2.7e-3, FLOORS, host_factor=3)["bound"] == "memory"


def test_verdict_flags_disagreeing_telemetry():
    v = verdict(1.2e-3, FLOORS, telemetry=summarize(LAUNCH_BOUND))  # floors say memory, DRAM is 12 % busy
    assert v["bound"] == "memory" and v["telemetry_consistent"] is False
    assert "telemetry disagrees with a memory verdict" in v["evidence"]


def test_verdict_interconnect_and_basis():
    ic = {"memory": 1.0e-3, "compute": 0.1e-3, "interconnect": 3.0e-3}
    assert verdict(4.5e-3, ic)["bound"] == "interconnect"
    near = {"memory": 1.0e-3, "compute": 0.1e-3, "interconnect": 1.2e-3}
    assert verdict(2.6e-3, near)["bound"] == "interconnect"                      # serial floor 2.2 ms: 1.18x
    largest = verdict(2.6e-3, near, basis="largest")                             # largest floor 1.2 ms: 2.17x
    assert largest["bound"] == "host/launch" and largest["ratio"] == pytest.approx(2.6 / 1.2)


def test_verdict_cpu_only_telemetry():
    v = verdict(50e-3, FLOORS, telemetry={**summarize(CPU_ONLY), "reason": "no NVML/GPU"})
    assert v["bound"] == "host/launch" and v["telemetry_consistent"] is None
    assert "host CPU 98 %" in v["evidence"] and "no NVML/GPU" in v["evidence"]


# ------------------------------------------------------------------------------------ floors, by hand
# A toy GQA model where every byte is countable: hidden 10, 2 heads x 5, 2 KV heads, 2 layers (1 dense),
# 4 experts top-4 (every expert active at T=1), intermediate 10, vocab 10, 1 byte per everything.
TOY = ModelShape(name="toy", num_layers=2, num_dense_layers=1, hidden=10, num_heads=2, vocab=10, num_experts=4,
                 top_k=4, moe_intermediate=10, num_shared_experts=0, dense_intermediate=10, num_kv_heads=2,
                 head_dim=5, weight_bytes=1, expert_weight_bytes=1, router_bytes=1, kv_bytes=1, act_bytes=1)
TOY_HW = Hardware(name="toy", num_gpus=2, mem_bw=1000.0, peak_flops=1000.0, mem_capacity=1e9, link="toy",
                  bus_bw=10.0, a2a_bw=10.0, alpha_s=1.0)


def test_floors_single_rank_by_hand():
    b = step_bytes(Layout(), TOY, batch=1, context=10)
    # attention q,o 2*100 + k,v 2*100 per layer x 2 = 800; dense 3*10*10 = 300; 4 experts x 300 = 1200;
    # router 4*10 = 40; lm_head 100; embedding row 10; KV (10 ctx + this token) x (2 kv heads x 5 x 2) x 2 layers
    # = 440 (bench.cost.floors.floor_bytes, the roofline's arithmetic)
    assert b == {"attention": 800, "kv_cache": 440, "dense_mlp": 300, "shared_experts": 0, "router": 40,
                 "routed_experts": pytest.approx(1200), "embedding": 10, "lm_head": 100}
    f = step_flops(Layout(), TOY, batch=1, context=10)
    # 2 x params for projections; attention core 2 heads x 10 ctx x 4*5 x 2 layers = 800; routed 2 x 4 x 300
    assert f == {"attention_proj": 1600, "attention_core": 800, "dense_mlp": 600, "shared_experts": 0,
                 "router": 80, "routed_experts": pytest.approx(2400), "lm_head": 200}
    fl = compute_floors(TOY, TOY_HW, Layout(), batch=1, context=10)
    assert fl.memory_s == pytest.approx(2.89) and fl.compute_s == pytest.approx(5.68) and fl.interconnect_s == 0
    assert fl.detail["experts"] == {"per_moe_layer": pytest.approx(4.0), "source": "formula"}


def test_floors_count_the_measured_experts_and_the_verdict_says_which():
    """2.5 distinct experts per MoE layer measured (``engine.expert_tally``) instead of the formula's 4: routed
    experts 2.5 x 300 = 750 B, memory floor 2.89 - 0.45 = 2.44 s; the verdict records the count and its source."""
    assert step_bytes(Layout(), TOY, batch=1, context=10, touched=2.5)["routed_experts"] == 750
    fl = compute_floors(TOY, TOY_HW, Layout(), batch=1, context=10, touched=2.5)
    assert fl.memory_s == pytest.approx(2.44)
    assert verdict(3.0, fl)["experts"] == {"per_moe_layer": 2.5, "source": "measured"}
    assert verdict(3.0, compute_floors(TOY, TOY_HW, Layout(), 1, 10))["experts"]["source"] == "formula"
    assert verdict(3.0, FLOORS)["experts"] is None  # floors given as plain numbers


def test_floors_two_ranks_by_hand():
    lay = Layout(world_size=2, attn_tp=2, moe_ep=2)
    fl = compute_floors(TOY, TOY_HW, lay, batch=1, context=10)
    # calls: attn_tp/all_reduce 1 + 2 + 1 = 4 and world/all_reduce 1, each 10 B: 1 s + 10*2(1/2)/10 = 2 s;
    # attn_tp/gather of 5 logits: 1 s + 5*(2-1)/10 = 1.5 s -> 11.5 s
    assert fl.interconnect_s == pytest.approx(11.5)
    # memory per rank: attention 400, dense 150, busiest of 2 groups holds both of its experts (2 x 300),
    # router 40, lm_head 50, embedding 10, KV: one KV head per rank, 10 ctx + this token -> 220
    assert fl.memory_s == pytest.approx((400 + 150 + 600 + 40 + 50 + 10 + 220) / 1000)
    measured = {"attn_tp/all_reduce": {"calls": 4, "bytes": 40}}  # a measured CommCounter step instead
    assert compute_floors(TOY, TOY_HW, lay, 1, 10, comm_per_step=measured).interconnect_s == pytest.approx(8.0)
