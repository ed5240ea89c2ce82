"""The prefill/decode hand-off's path between two processes on one host, for ``scripts/gpu_check.py``'s
``hand_off`` section (``docs/disaggregation.md``, "On a GPU").

The CUDA Mooncake wheel is too large to carry to a lent GPU machine, so the KV is staged through host memory, the
way a worker without GPU registration would move it: this process stages a KV-sized device tensor into pinned host
memory (D2H) and registers that buffer with a Mooncake transfer engine; a second process reads it over TCP on
loopback into its own registered pinned buffer and copies it onto the device (H2D), checking an integer checksum.
Each stage's payload GB/s, the whole path's, and the path against a device-to-device copy of the same run; then
what an 80K-token Kimi K2 hand-off (MLA latent, bf16) would take at the measured path rate and at the line rate of
one 400 Gb/s RDMA NIC (a projection, labelled as one).

``python -m bench.gpu.hand_off SESSION ADDRESS NBYTES DEVICE``: the reading side (prints one JSON line).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import torch

from bench.gpu.harness import copy_bandwidth, cuda_time_s

KIMI_K2_BYTES_PER_TOKEN = 576 * 61 * 2  # MLA latent (512 + 64 rope) × 61 layers × bf16
PROJECTED_TOKENS = 80_000
RDMA_NIC_GB_S = 50.0  # one 400 Gb/s NIC's line rate (8 per node on DGX H100/H200-class machines)
READS = 3


def loopback_engine():
    """A Mooncake transfer engine on 127.0.0.1 over TCP (P2P handshake), started."""
    from mooncake.engine import TransferEngine  # the test extra's wheel (non-CUDA build)

    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("the Mooncake transfer engine did not start on 127.0.0.1 over tcp")
    return engine


def _checksum(t: torch.Tensor) -> int:
    """Sum of the bytes taken as int64 words (wraps; the same on any device and order)."""
    return int(t.view(torch.int64).sum())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def read_side(session: str, address: int, nbytes: int, device: str) -> dict:
    """Reads ``nbytes`` at ``address`` of ``session`` ``READS`` times into a registered host buffer, then copies it
    to ``device``: each read's seconds, the H2D's, and the checksum of what arrived on the device."""
    dev = torch.device(device)
    engine = loopback_engine()
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    if engine.register_memory(host.data_ptr(), nbytes) != 0:
        raise RuntimeError("could not register the read buffer")
    reads = []
    for _ in range(READS):
        t0 = time.perf_counter()
        if engine.batch_transfer_sync_read(session, [host.data_ptr()], [address], [nbytes]) != 0:
            raise RuntimeError(f"reading {nbytes} bytes from {session} failed")
        reads.append(time.perf_counter() - t0)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    h2d = cuda_time_s(lambda: on_device.copy_(host, non_blocking=True), iters=3, warmup=1, device=dev)
    _sync(dev)
    return dict(read_s=reads, h2d_s=h2d, checksum=_checksum(on_device))


def run(device: str, budget_s: float, nbytes: int | None = None) -> dict | str:
    """The section: see the module docstring. ``nbytes``: the payload (1 GiB on CUDA, 64 MiB elsewhere)."""
    try:
        engine = loopback_engine()
    except (ImportError, RuntimeError) as e:
        return (f"skipped: the Mooncake transfer engine is not usable here ({e}); bring the "
                "mooncake-transfer-engine-non-cuda wheel and libibverbs1")
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    nbytes = nbytes or (2**30 if cuda else 2**26)
    kv = torch.randint(-2**62, 2**62, (nbytes // 8,), dtype=torch.int64, device=dev).view(torch.uint8)
    staged = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    d2h = cuda_time_s(lambda: staged.copy_(kv, non_blocking=True), iters=3, warmup=1, device=dev)
    _sync(dev)
    if engine.register_memory(staged.data_ptr(), nbytes) != 0:
        raise RuntimeError("could not register the staged KV")
    session = f"127.0.0.1:{engine.get_rpc_port()}"
    reader = subprocess.run([sys.executable, "-m", "bench.gpu.hand_off", session, str(staged.data_ptr()),
                             str(nbytes), device], capture_output=True, text=True, timeout=max(budget_s, 10))
    if reader.returncode != 0:
        raise RuntimeError(f"the reading process failed: {reader.stderr.strip().splitlines()[-3:]}")
    got = json.loads(reader.stdout.strip().splitlines()[-1])
    read_s = sorted(got["read_s"])[len(got["read_s"]) // 2]
    copy_gb_s = copy_bandwidth(dev) / 1e9  # read + write bytes of a device copy
    path_s = d2h + read_s + got["h2d_s"]
    rate = {name: nbytes / s / 1e9 for name, s in (("d2h", d2h), ("tcp_read", read_s), ("h2d", got["h2d_s"]),
                                                  ("path", path_s))}
    kimi = PROJECTED_TOKENS * KIMI_K2_BYTES_PER_TOKEN
    return dict(
        device=str(dev), mib=nbytes / 2**20, intact=got["checksum"] == _checksum(kv),
        gb_s=rate, device_copy_gb_s=copy_gb_s, path_vs_device_copy=rate["path"] / (copy_gb_s / 2),
        projection=dict(
            what=f"Kimi K2 {PROJECTED_TOKENS}-token hand-off: {kimi / 1e9:.2f} GB of MLA latent (bf16)",
            seconds_at_measured_path=kimi / (rate["path"] * 1e9),
            seconds_at_one_400gbps_rdma_nic=kimi / (RDMA_NIC_GB_S * 1e9),
            note="projection, not a measurement: line rate of one NIC, no protocol overhead, one DP rank's request"),
        note="GB/s of payload; device_copy_gb_s counts read + write bytes, so the path is compared with half of it")


if __name__ == "__main__":
    session_arg, address_arg, nbytes_arg, device_arg = sys.argv[1:5]
    print(json.dumps(read_side(session_arg, int(address_arg), int(nbytes_arg), device_arg)))
