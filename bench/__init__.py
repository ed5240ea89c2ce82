"""Tooling the runtime never imports: cost model, telemetry, bench metrics and reports, GPU checks."""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "conf"
