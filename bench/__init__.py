"""Tooling the runtime never imports: cost model, telemetry summaries and verdicts, bench metrics and reports, GPU
checks."""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONF = REPO / "conf"
