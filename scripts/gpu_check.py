"""One call on one GPU (≤ 8 minutes): are the kernels right, fast, and where is the floor?

    python scripts/gpu_check.py [--sections a,b,c] [--budget NAME=SECONDS ...] [--budget-s 450] [--out DIR]
                                [--aot core|full|none]

Sections, in this order, each under its own time budget (``bench.gpu.report.BUDGETS_S``; ``--budget NAME=S``
overrides one, 0 skips it) inside the whole run's ``--budget-s``; each is recorded even when another fails:

- ``environment`` and ``kernel_select``: versions, the device, which implementation each op gets and why;
- ``aot_compile`` (CPU only): every kernel compiled for sm_90 and sm_100 without a GPU (``model.triton.aot``);
- ``correctness``: each Triton kernel against its torch reference on fresh random inputs — on a GPU in bf16 and fp32 at
  model-like sizes, on CPU in fp32 and fp16 under ``TRITON_INTERPRET=1`` at tiny sizes (pass rule:
  :func:`model.triton.cases.compare`);
- ``moe_timing`` (GPU): fused MoE vs the torch reference (``LocalExperts.forward``), decode and prefill, and
  on DeepEP's low-latency packed layout the masked grouped GEMM vs the sorted fused MoE vs the reference;
- ``bandwidth`` (GPU): device copy bandwidth of a 4 GiB copy, and the achieved bandwidth of paged decode
  attention (GQA and MLA) on memory-bound sizes as a fraction of it;
- ``power``: when ``pynvml`` (nvidia-ml-py) imports, NVML power while each kernel that moe_timing and bandwidth
  time runs back to back for 1.5 s (mean from the energy counter, % of the power limit, clocks, GPM activity);
- ``cuda_graphs`` (GPU): ``bench.gpu.graph_check.gpu_check``, decode and tree-verify graphs at budgets 8…256;
- ``draft_graphs`` (GPU): ``bench.gpu.draft_check.gpu_check``, the drafter step's graphs at budgets 8…256;
- ``spec_steps`` (GPU): ``bench.gpu.step_check.gpu_check``, whole speculative steps through the engine's runner
  — static (draft graph → verify graph → walk on the device, raising on any host sync in between) vs dynamic:
  same tokens?, step times, coverage;
- ``engine`` (GPU; on CPU only when named, a smoke version): ``bench.gpu.engine_check.run``, the engine end to end
  on the trained tiny_kimi pair — none / dflash / ddtree arms, tok/s, τ, coverage, tokens vs plain decoding, HF
  ``generate`` as the outside reference, DDTree projected onto the Kimi-shaped slice;
- ``invariance`` (GPU): ``bench.gpu.invariance.run``, ``engine.batch_invariant`` on the trained pair in bf16 —
  plain, DFlash and DDTree (budgets 16, 64) tokens at batch 8 and alone, with the flag on (they must not move) and
  off; every op of the batch-invariant kernel set, one row alone vs inside 2…257-row launches, bf16 and fp32;
  plain decode tok/s at batch 1 and 32, flag off vs on;
- ``roofline`` (GPU; on CPU only when named, a tiny dry run): ``bench.gpu.roofline.run``, decode steps of a
  Kimi-K2-shaped rank against the HBM floor;
- ``quant`` (GPU; on CPU only when named, the kernel choice alone): ``bench.gpu.quant_check.run``, the INT4 and FP8
  kernels in bf16 against their references, W4A16 MoE decode bytes/s vs the copy rate, FP8 vs bf16 GEMM.
- ``hand_off`` (GPU; on CPU only when named, the same at 64 MiB): ``bench.gpu.hand_off.run``, the prefill/decode
  hand-off between two processes: device → pinned host → Mooncake transfer engine over loopback TCP → pinned host
  → device, each stage's GB/s against a device copy, and the 80K-token Kimi K2 projection.

Writes ``gpu_report.json`` and ``gpu_report.md`` to ``--out``, else ``$OUT``, else a new directory under the
system temp dir (its path is printed; never the checkout unless ``--out`` says so). The last console lines say
which sections ran, which were skipped and why, and the verdict. Needs no hydra or omegaconf. The sections live
in ``bench/gpu/``.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

from bench.gpu.report import main  # noqa: E402

if __name__ == "__main__":
    main()
