"""How long a test waits for work that has a known quiet-box duration: that bound times the box's load (the
1-minute load average per core, at least 1), or ``SWITCHYARD_TEST_PATIENCE`` times it when set. A loaded 2-core box
is then slow, not red; a hang still fails."""

import os


def patience(seconds: float) -> float:
    factor = os.environ.get("SWITCHYARD_TEST_PATIENCE")
    if factor is None:
        factor = max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
    return seconds * float(factor)
