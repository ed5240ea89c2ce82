import os

# Triton's interpreter on a CPU box (tests/support/interpret_triton.py): set before anything imports triton, since
# the installed triton (3.9.0) decides at import whether tl.zeros and the other builtins run interpreted
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def pool():
    """8 forked gloo ranks, once per test module."""
    from tests.support.rankpool import RankPool

    p = RankPool(8)
    yield p
    p.close()


@pytest.fixture(scope="session")
def tiny_ckpts(tmp_path_factory):
    """The two tiny HF checkpoints, written once per session."""
    from model.tiny import write_tiny

    root = tmp_path_factory.mktemp("ckpt")
    return {p: str(write_tiny(p, root / p)) for p in ("tiny_deepseek", "tiny_qwen3_moe")}


@pytest.fixture(scope="session")
def random_drafter(tmp_path_factory, tiny_ckpts):
    """An untrained DFlash drafter for the tiny DeepSeek checkpoint: losslessness must not depend on quality."""
    from spec_decode.dflash import DFlashConfig, DFlashDrafter

    torch.manual_seed(0)
    cfg = DFlashConfig(hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=64,
                       target_layer_ids=(0, 2), mask_token_id=202, block_size=5)
    out = tmp_path_factory.mktemp("drafter")
    DFlashDrafter(cfg).save(out)
    return str(out)


@pytest.fixture(scope="session")
def quant_ckpts(tmp_path_factory):
    """The tiny quantized checkpoints and their dequantized HF references, written once per session by
    scripts/make_quant_checkpoints.py: ``{preset: (quantized dir, dequantized dir)}``."""
    from tests.support.quant_ckpts import write_all

    return write_all(tmp_path_factory.mktemp("quant"))
