"""Helpers shared by the entry points: hydra config → typed objects, model directory, logging."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from model.tiny import preset_dir  # noqa: E402
from parallelism.layout import Layout  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CONF_DIR = str(REPO / "conf")


def repo_path(path: str | None) -> str | None:
    """Relative paths in configs (e.g. the built-in model zoo) are relative to the repository root."""
    if path is None:
        return None
    p = Path(path)
    if not p.is_absolute():
        p = p.resolve() if p.exists() else REPO / p
    return str(p)


def layout_from(cfg: DictConfig) -> Layout:
    return Layout(**OmegaConf.to_container(cfg.parallel, resolve=True))


def model_dir(cfg: DictConfig) -> str:
    """``model.path`` if given, else the built-in preset's directory (written on first use)."""
    if cfg.model.get("path"):
        return repo_path(str(cfg.model.path))
    if not cfg.model.get("preset"):
        raise SystemExit("model.path=DIR is required for model=hf")
    return str(preset_dir(cfg.model.preset))


def placement(cfg: DictConfig) -> dict:
    """The ``device`` group (cpu | cuda) as a plain dict that travels to the ranks."""
    return OmegaConf.to_container(cfg.device, resolve=True) if "device" in cfg else {"type": "cpu"}


def load_target(ckpt: str, groups, rank: int, place: dict):
    """The rank's model in ``place["dtype"]`` on its device (rank r → ``cuda:<r % device_count>``), calling the
    kernels :func:`model.kernel_select.select_kernels` picks there."""
    import torch

    from model.kernel_select import select_kernels
    from model.loader import load_model

    dtype = getattr(torch, place.get("dtype", "float32"))
    model = load_model(ckpt, groups, dtype)
    device = torch.device("cpu")
    if place.get("type", "cpu") == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("device=cuda, but torch.cuda.is_available() is False on this machine: use device=cpu")
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        model.place(device)
    return model.use_kernels(select_kernels(device, place.get("kernels", "auto")))


def spec_config(cfg: DictConfig):
    from spec_decode.config import SpecConfig

    s = OmegaConf.to_container(cfg.spec_decode, resolve=True) if "spec_decode" in cfg else {}
    s["drafter_path"] = repo_path(s.get("drafter_path"))
    return SpecConfig(**s)


def prepare_ranks(cfg: DictConfig, layout: Layout, environ=None) -> tuple[dict, str, dict]:
    """What a script settles before it starts any rank: the ``device`` placement (:func:`placement`), the
    process-group backend it implies (``parallelism.launch.backend_for``) and ``topology=auto|nvlink|pcie``
    applied for that backend (``parallelism.topology.prepare``: NCCL's switches written into ``environ``, default
    ``os.environ``). Returns ``(placement, backend, topology summary)``; the summary is also logged."""
    from parallelism.launch import backend_for
    from parallelism.topology import prepare

    place = placement(cfg)
    backend = backend_for(place.get("type", "cpu"))
    mode = cfg.topology.mode if "topology" in cfg else "auto"
    summary = prepare(mode, layout, environ=environ, backend=backend)
    logging.getLogger("topology").info("topology=%s: %s; NCCL env %s", mode, summary["effective"], summary["env"])
    return place, backend, summary


def setup_logging(rank: int = 0) -> None:
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"%(asctime)s r{rank} %(levelname)s %(name)s: %(message)s")
