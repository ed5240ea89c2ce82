"""``topology=auto|nvlink|pcie``: record the real GPU links, and force PCIe-class transport on an NVLink box.

:func:`detect_links` asks NVML, per GPU pair, for P2P read and NVLink P2P status and the PCIe common
ancestor, and per GPU for its active NVLink count; on a box without NVML or GPUs it reports
``"no GPU: gloo over loopback"``. :func:`nccl_env` maps a mode to NCCL's own environment switches, and
:func:`plan` puts the two together (what was asked, what the box has, what will run, the env to set).

How ``pcie`` is forced on an NVLink box, and why exactly these switches:

- ``NCCL_P2P_DISABLE=1`` — turns off NCCL's P2P transport (CUDA direct access between GPUs). On an NVLink
  box every CUDA P2P copy between two NVLink-connected GPUs travels over NVLink, whatever NCCL's topology
  thinks, so P2P must go entirely: NCCL then uses its SHM transport, i.e. GPU → host memory → GPU over
  each GPU's PCIe link.
- ``NCCL_NVLS_ENABLE=0`` — turns off NVLink SHARP (NVSwitch multicast/reduction), which is not a P2P
  transport and would otherwise still carry all-reduce over NVLink.
- ``NCCL_SHM_DISABLE=0`` — keeps SHM on, so an inherited ``NCCL_SHM_DISABLE=1`` cannot push traffic onto the
  socket (NET) transport over loopback, which would measure the TCP stack, not PCIe.
- Not ``NCCL_P2P_LEVEL``: it is a maximum *distance* for P2P (LOC, NVL, PIX, PXB, PHB, SYS) and NVLink pairs
  are the nearest class, so ``PHB`` or ``SYS`` still use NVLink; only ``LOC`` (= P2P off) would exclude it.

What the A/B emulates: collectives staged through host memory over PCIe Gen5 x16 (the GPUs' own host
links) with NVLink unused — the transport of a PCIe box *without* GPU P2P. It is pessimistic against a
PCIe box that has P2P (RTX PRO 6000: ~54 GB/s P2P, docs/records/field_notes.md): host staging adds a copy and a hop, and
GPUs on different CPU sockets cross the socket link. It does not emulate the other box's GPUs (HBM
bandwidth, FLOPs and memory stay the NVLink box's), its PCIe switch layout, or traffic outside NCCL:
DeepEP (NVSHMEM/IPC) and CUDA IPC bypass these switches, so :func:`check_dispatcher` refuses dispatchers
that need NVLink under ``pcie``. The variables must be in the environment before the process group is
created, in every rank (scripts spawn ranks after :func:`apply_env`, which they inherit).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass

from parallelism.nvml import load, shutdown

MODES = ("auto", "nvlink", "pcie")
CPU_FALLBACK = "no GPU: gloo over loopback"

_PCIE_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_NVLS_ENABLE": "0", "NCCL_SHM_DISABLE": "0"}
_NVLINK_ENV = {"NCCL_P2P_DISABLE": "0", "NCCL_SHM_DISABLE": "0"}

_ANCESTOR = {0: "same board (internal)", 10: "PIX (one PCIe switch)", 20: "PXB (several PCIe switches)",
             30: "PHB (PCIe host bridge)", 40: "NODE (same NUMA node)", 50: "SYS (across CPU sockets)"}
_P2P_STATUS = {0: "ok", 1: "chipset not supported", 2: "GPU not supported", 3: "IOH topology not supported",
               4: "disabled by regkey", 5: "not supported"}


class TopologyError(ValueError):
    """A topology mode that this box cannot serve; the message says what the box has."""


@dataclass(frozen=True)
class TopologyConfig:
    """``conf/topology/*.yaml``: ``mode`` is one of :data:`MODES`."""

    mode: str = "auto"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise TopologyError(f"topology.mode must be one of {MODES}, got {self.mode!r}")


def nccl_env(mode: str) -> dict[str, str]:
    """NCCL environment for ``mode``: ``auto`` → nothing (NCCL chooses); ``nvlink`` → P2P and SHM explicitly
    on (undoes an inherited ``pcie`` env; NVLS left to NCCL); ``pcie`` → P2P off, NVLS off, SHM on (see the
    module docstring for why these and not ``NCCL_P2P_LEVEL``)."""
    TopologyConfig(mode)
    return {"auto": {}, "nvlink": dict(_NVLINK_ENV), "pcie": dict(_PCIE_ENV)}[mode]


def _guard(errors: list[str], what: str, fn, *args):
    try:
        return fn(*args)
    except Exception as err:  # NotSupported, NoPermission, missing symbol in an old driver, ...
        errors.append(f"{what}: {type(err).__name__}: {err}")
        return None


def _text(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def detect_links(nvml=None) -> dict:
    """The box's real GPU links, JSON-ready.

    ``{"kind": "nvlink" | "pcie" | "single_gpu" | "none", "backend": "nccl" | "gloo", "reason": str,
    "gpus": [{"index", "name", "nvlink_active", "pcie_gen", "pcie_width"}],
    "pairs": [{"a", "b", "p2p_read", "p2p_nvlink", "common_ancestor"}], "errors": [str]}``.
    ``kind`` is ``nvlink`` when any GPU pair reports NVLink P2P ok (or, without P2P answers, every GPU has
    active NVLinks), ``pcie`` for two or more GPUs otherwise. Every GPU of the box, by NVML index. ``nvml``: a
    module to use instead of ``pynvml``."""
    cpu = {"kind": "none", "backend": "gloo", "gpus": [], "pairs": [], "errors": []}
    try:
        nvml = load(nvml)
    except Exception as err:
        return {**cpu, "reason": f"{CPU_FALLBACK} (NVML unavailable: {type(err).__name__}: {err})"}
    try:
        count = nvml.nvmlDeviceGetCount()
        if count == 0:
            return {**cpu, "reason": f"{CPU_FALLBACK} (NVML found no GPU)"}
        return _links(nvml, count)
    finally:
        shutdown(nvml)


def _links(nvml, count: int) -> dict:
    errors: list[str] = []
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    gpus = []
    for i, h in enumerate(handles):
        active = 0
        for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                active += int(nvml.nvmlDeviceGetNvLinkState(h, link) == 1)
            except Exception as err:  # past the last link, or no NVLink at all
                if link == 0:
                    errors.append(f"gpu{i} nvlink state: {type(err).__name__}: {err}")
                break
        name = _guard(errors, f"gpu{i} name", nvml.nvmlDeviceGetName, h)
        gpus.append({"index": i, "name": _text(name) if name is not None else None, "nvlink_active": active,
                     "pcie_gen": _guard(errors, f"gpu{i} pcie gen", nvml.nvmlDeviceGetCurrPcieLinkGeneration, h),
                     "pcie_width": _guard(errors, f"gpu{i} pcie width", nvml.nvmlDeviceGetCurrPcieLinkWidth, h)})
    pairs = []
    for a in range(count):
        for b in range(a + 1, count):
            read = _guard(errors, f"p2p read {a}-{b}", nvml.nvmlDeviceGetP2PStatus, handles[a], handles[b],
                          nvml.NVML_P2P_CAPS_INDEX_READ)
            nvl = _guard(errors, f"p2p nvlink {a}-{b}", nvml.nvmlDeviceGetP2PStatus, handles[a], handles[b],
                         nvml.NVML_P2P_CAPS_INDEX_NVLINK)
            anc = _guard(errors, f"common ancestor {a}-{b}", nvml.nvmlDeviceGetTopologyCommonAncestor,
                         handles[a], handles[b])
            pairs.append({"a": a, "b": b, "p2p_read": None if read is None else _P2P_STATUS.get(read, str(read)),
                          "p2p_nvlink": None if nvl is None else _P2P_STATUS.get(nvl, str(nvl)),
                          "common_ancestor": None if anc is None else _ANCESTOR.get(anc, str(anc))})
    if count == 1:
        kind, reason = "single_gpu", "one GPU: no inter-GPU link"
    elif any(p["p2p_nvlink"] == "ok" for p in pairs) or (
            all(p["p2p_nvlink"] is None for p in pairs) and all(g["nvlink_active"] > 0 for g in gpus)):
        kind, reason = "nvlink", f"{count} GPUs with NVLink P2P"
    else:
        kind, reason = "pcie", f"{count} GPUs without NVLink P2P"
    return {"kind": kind, "backend": "nccl", "reason": reason, "gpus": gpus, "pairs": pairs, "errors": errors}


def plan(mode: str, links: dict | None = None) -> dict:
    """What ``topology=mode`` does on this box: ``{"mode", "links", "effective", "env", "note"}``.

    ``effective``: ``nvlink``, ``pcie``, ``pcie (emulated: NCCL P2P and NVLS off on an NVLink box)``, or the
    CPU fallback. ``nvlink`` on a box without NVLink raises :class:`TopologyError`. Without GPUs every mode
    runs gloo over loopback and ``env`` is empty (gloo ignores NCCL's switches)."""
    TopologyConfig(mode)
    links = detect_links() if links is None else links
    kind = links["kind"]
    if kind == "none":
        return {"mode": mode, "links": links, "effective": CPU_FALLBACK, "env": {},
                "note": f"mode {mode!r} has no effect without GPUs"}
    if kind == "single_gpu":
        return {"mode": mode, "links": links, "effective": "single_gpu", "env": {},
                "note": "one GPU: no collective crosses a link"}
    if mode == "nvlink" and kind != "nvlink":
        raise TopologyError(f"topology=nvlink, but this box has {kind} links ({links['reason']})")
    if mode == "auto":
        return {"mode": mode, "links": links, "effective": kind, "env": {}, "note": "NCCL chooses its transports"}
    if mode == "pcie" and kind == "nvlink":
        return {"mode": mode, "links": links, "effective": "pcie (emulated: NCCL P2P and NVLS off on an NVLink box)",
                "env": nccl_env("pcie"),
                "note": "host-staged SHM over PCIe: a PCIe box without GPU P2P; GPUs, HBM and non-NCCL traffic "
                        "are still the NVLink box's"}
    return {"mode": mode, "links": links, "effective": kind, "env": nccl_env(mode), "note": "native links"}


def apply_env(plan_: dict, environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Writes ``plan_["env"]`` into ``environ`` (default ``os.environ``) before any process group exists;
    returns what it set (for the report)."""
    env = os.environ if environ is None else environ
    env.update(plan_["env"])
    return dict(plan_["env"])


GLOO = "gloo: NCCL unused"


def prepare(mode: str, layout, links: dict | None = None, environ: MutableMapping[str, str] | None = None,
            backend: str = "nccl") -> dict:
    """What the scripts call before they start any rank (spawned ranks inherit the env; under torchrun each rank
    calls it before its process group exists): :func:`plan` for ``mode`` (``links``: detected links instead of
    asking NVML), a refusal of ``layout``'s dispatcher if it needs NVLink and the links are not NVLink
    (:func:`check_dispatcher`; without GPUs DeepEP's own capability check names what is missing), NCCL's
    switches written into ``environ`` (default ``os.environ``). A job on ``backend`` gloo (``device=cpu``, also
    on a GPU host) uses no NCCL: nothing is planned, checked or set, whatever the mode. Returns ``{"mode",
    "effective", "env", "note", "links", "gpus"}`` with the links' one-line reason and the GPU names, for logs
    and reports."""
    if backend != "nccl":
        return {"mode": mode, "effective": GLOO, "env": {}, "note": "NCCL's switches do not apply to gloo",
                "links": "not asked (gloo)", "gpus": []}
    chosen = plan(mode, links)
    if chosen["effective"] != CPU_FALLBACK:
        dispatcher = layout.resolved_dispatcher
        check_dispatcher(chosen, dispatcher, needs_nvlink=dispatcher == "deepep")
    apply_env(chosen, environ)
    return {"mode": mode, "effective": chosen["effective"], "env": chosen["env"], "note": chosen["note"],
            "links": chosen["links"]["reason"], "gpus": [g["name"] for g in chosen["links"]["gpus"]]}


def check_dispatcher(plan_: dict, dispatcher: str, needs_nvlink: bool) -> None:
    """Refuses a dispatcher that moves data outside NCCL over NVLink (DeepEP) when ``pcie`` is emulated or the
    box has no NVLink: the A/B would silently keep using NVLink, or fail later."""
    effective = plan_["effective"]
    if needs_nvlink and not effective.startswith("nvlink"):
        raise TopologyError(f"dispatcher {dispatcher!r} needs NVLink and bypasses NCCL's switches; topology is "
                            f"{effective!r}: use parallel.dispatcher=alltoall")
