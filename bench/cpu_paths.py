"""CPU code paths the row-invariance tests (``tests/e2e/test_cpu_code_paths.py``) and
``scripts/probe_row_invariance.py --code-paths`` run under, as environment switches read when a process starts: torch's
vector kernels (``ATEN_CPU_CAPABILITY``), oneDNN's (``ONEDNN_MAX_CPU_ISA``), MKL's (``MKL_ENABLE_INSTRUCTIONS``
on Intel CPUs, ``MKL_CBWR`` everywhere) and numpy's OpenBLAS (``OPENBLAS_CORETYPE``). The native path is the
machine's own (the suite's main run). Which switch changes the rounding on which CPU: docs/batch_invariance.md."""

CODE_PATHS = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
             "OPENBLAS_CORETYPE": "Haswell"},
    "baseline": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
                 "MKL_CBWR": "COMPATIBLE", "OPENBLAS_CORETYPE": "Prescott"},
}
