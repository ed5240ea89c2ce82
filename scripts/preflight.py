"""What an entry point checks in the launching process before it starts a rank, and how it reports a user error.

:func:`preflight` reads what needs no weights — ``config.json``, the checkpoint index and shard headers
(``model/checkpoint_errors.py``; it says once that a vision tower is left unread), the model against the layout
(``model/layout_fit.py``), the input and output paths, the port — so a bad setup fails in a second instead of after
every rank loaded the model.
:func:`one_line_errors` turns a user error (a config, checkpoint, layout or path problem, or one a rank raised)
into one line ``error: ...`` and exit status 1; ``HYDRA_FULL_ERROR=1`` or ``debug=true`` brings the traceback
back. The port check can race with another process; the server's own bind error stays.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import tempfile
from pathlib import Path

from omegaconf import DictConfig
from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

from model.checkpoint_errors import check_checkpoint_files, read_json
from model.checkpoint_names import image_tensors
from model.config import ModelConfig, load_config
from model.layout_fit import check_layout_fits
from parallelism.layout import Layout
from spec_decode.decoder import check_drafter_fits
from spec_decode.dflash import DFlashConfig

log = logging.getLogger("preflight")


class PreflightError(ValueError):
    """A path or port the job cannot use; the message names the setting."""


def preflight(layout: Layout, ckpt: str, *, drafter: str | None = None, input: str | None = None,
              output: str | None = None, bind: tuple[str, int] | None = None, metrics_port: int | None = None,
              group: str = "generate") -> ModelConfig:
    """Checks everything that needs no weights; returns the model config. Raises on the first problem. ``group``:
    the config group of ``input``/``output`` (``generate``, ``logits``), for the messages; ``metrics_port``: the
    ``/metrics`` port, on ``bind``'s host."""
    if input is not None:
        check_json_file(f"{group}.input", input)
    if output is not None:
        check_writable(f"{group}.output", output)
    if bind is not None:
        check_bindable(*bind)
        if metrics_port is not None:
            check_bindable(bind[0], metrics_port, "server.metrics_port")
    names = check_checkpoint_files(ckpt)
    cfg = load_config(ckpt)
    if image_tensors(names):
        log.info("vision tower present, not loaded: images are not served yet (%d tensors under vision_tower.*, "
                 "mm_projector.* in %s)", len(image_tensors(names)), ckpt)
    check_layout_fits(cfg, layout, str(Path(ckpt) / "config.json"))
    if drafter is not None:
        check_drafter(drafter, cfg)
    return cfg


def check_drafter(drafter: str, target: ModelConfig) -> None:
    """The DFlash drafter's files and its fit to the target (``check_drafter_fits``), without its weights."""
    file = Path(drafter) / "config.json"
    check_json_file("spec_decode.drafter_path", str(file))
    check_checkpoint_files(drafter)
    try:
        dcfg = DFlashConfig.from_hf(read_json(file))
    except KeyError as err:
        raise PreflightError(f"{file}: missing field {err.args[0]!r} for a DFlash drafter") from None
    check_drafter_fits(dcfg, target, drafter)


def check_json_file(field: str, path: str) -> None:
    p = Path(path)
    if not p.is_file():
        raise PreflightError(f"{field}={path}: no such file")
    try:
        json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise PreflightError(f"{field}={path}: not valid JSON ({err})") from None


def check_writable(field: str, path: str) -> None:
    """``path`` can be created or overwritten: its directory exists and takes a file."""
    p = Path(path)
    if p.is_dir():
        raise PreflightError(f"{field}={path}: is a directory")
    parent = p.parent
    if not parent.is_dir():
        raise PreflightError(f"{field}={path}: directory {parent} does not exist")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=f".{p.name}.", suffix=".check"):
            pass
    except OSError as err:
        raise PreflightError(f"{field}={path}: cannot write in {parent} ({err.strerror})") from None
    if p.exists() and not os.access(p, os.W_OK):
        raise PreflightError(f"{field}={path}: file is not writable")


def check_bindable(host: str, port: int, key: str = "server.port") -> None:
    """``host:port`` can be bound now (SO_REUSEADDR, as gRPC binds). Port 0 (any free port) passes. ``key``: the
    setting that names the port, for the message."""
    if port == 0:
        return
    try:
        family, kind, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as err:
        raise PreflightError(f"server.host={host}: cannot resolve ({err.strerror})") from None
    with socket.socket(family, kind) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as err:
            raise PreflightError(f"{key}={port}: cannot bind {host}:{port} ({err.strerror}); is another "
                                 f"server on it? choose another {key}") from None


def debug_requested(cfg: DictConfig | None) -> bool:
    return os.environ.get("HYDRA_FULL_ERROR") == "1" or bool(cfg is not None and cfg.get("debug", False))


def one_line(err: BaseException) -> str:
    """The user-facing line for ``err``: a rank's error is its own last line, prefixed with the rank."""
    if isinstance(err, ProcessRaisedException):
        last = [ln for ln in str(err).splitlines() if ln.strip()][-1]
        return f"rank {err.error_index}: {last.strip()}"
    if isinstance(err, ProcessExitedException):  # killed or exited without raising: name it as a rank
        how = f"signal {err.signal_name}" if err.signal_name else f"exit code {err.exit_code}"
        return f"rank {err.error_index} (pid {err.error_pid}) terminated with {how}"
    return " ".join(str(err).split()) or type(err).__name__


def one_line_errors(main):
    """Decorates a hydra ``main(cfg)``: user errors exit 1 with one ``error: ...`` line unless debugging."""
    @functools.wraps(main)
    def wrapper(cfg: DictConfig):
        try:
            return main(cfg)
        except (ValueError, OSError, ProcessRaisedException) as err:
            if debug_requested(cfg):
                raise
            raise SystemExit(f"error: {one_line(err)}") from None

    return wrapper
