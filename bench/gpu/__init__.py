"""GPU checks (``scripts/gpu_check.py``): kernels against references and the machine, CUDA graphs of the
target and the drafter, whole speculative steps; each check also runs its CPU part in the tests."""
