import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_ckpts(tmp_path_factory):
    """The two tiny HF checkpoints, written once per session."""
    from model.tiny import write_tiny

    root = tmp_path_factory.mktemp("ckpt")
    return {p: str(write_tiny(p, root / p)) for p in ("tiny_deepseek", "tiny_qwen3_moe")}
