"""Which ranks of this host have died or stopped, read from ``/proc`` (Linux): what rank 0 adds to an engine failure
so that every stream and the log name the rank, not only the collective that failed."""

from __future__ import annotations

from pathlib import Path

GONE_STATES = {"Z": "exited", "X": "exited", "T": "is stopped", "t": "is stopped"}  # zombie, dead, stopped, traced


def process_state(pid: int) -> str:
    """``pid``'s state letter from ``/proc/<pid>/stat`` ("" when there is no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[0]  # the command may hold spaces and parentheses


def gone_ranks(ranks: list[dict], host: str) -> str:
    """``"rank 3 (pid 123) exited"`` for each rank of ``ranks`` (``{"rank", "pid", "host"}``) on ``host`` whose
    process is gone, a zombie or stopped; "" when every one runs (or none is on this host)."""
    found = []
    for r in sorted(ranks, key=lambda r: r["rank"]):
        if r["host"] != host or r["rank"] == 0:
            continue
        state = process_state(r["pid"])
        what = "exited" if state == "" else GONE_STATES.get(state)
        if what:
            found.append(f"rank {r['rank']} (pid {r['pid']}) {what}")
    return ", ".join(found)
