"""The rank control plane (``engine/worker/control.py``) on 8 real gloo ranks: messages sent by rank 0 run on every
rank and reply as declared; a message out of order, or something that is not a message, makes the receiving ranks
raise at once, naming what they expected and what came, instead of hanging in a collective."""

from __future__ import annotations

import time

import pytest

from engine.step import RankReport
from engine.worker.control import ControlPlane, Envelope, Heartbeat, RankProtocolError, RankState, Reply, Shutdown
from engine.worker.loop import control_plane
from tests.support.layouts import layout


def _plane(ctx) -> ControlPlane:
    return ControlPlane(control_plane(ctx.groups(layout("tp8"))))


def _round_trip(ctx):
    """Rank 0 sends two heartbeats and a shutdown; the others serve until the shutdown."""
    plane, state = _plane(ctx), RankState(runner=None)
    if ctx.rank == 0:
        replies = [plane.send(Heartbeat(), state) for _ in range(2)]
        plane.send(Shutdown())
        return replies, plane.seq
    served = 1
    while plane.serve(state):
        served += 1
    return served, plane.seq


def test_messages_run_on_every_rank_and_reply_as_declared(pool):
    results = pool.run(_round_trip)
    replies, sent = results[0]
    assert sent == 3 and len(replies) == 2
    assert all(len(r) == 8 and all(isinstance(x, RankReport) and x.results is None for x in r) for r in replies)
    assert results[1:] == [(3, 3)] * 7  # every rank ran all three, numbered as rank 0 numbered them
    assert Heartbeat.reply is Reply.GATHER and Shutdown.reply is Reply.NONE


def _planted(ctx, what):
    """Rank 0 plants ``what`` where message 1 belongs; the others try to serve it."""
    comm = control_plane(ctx.groups(layout("tp8")))
    if ctx.rank == 0:
        comm.broadcast_object({"sequence": Envelope(5, Heartbeat()), "kind": Envelope(1, "heartbeat"),
                               "bare": "shutdown"}[what])
        return None
    started = time.monotonic()
    try:
        ControlPlane(comm).serve(RankState(runner=None))
    except RankProtocolError as err:
        return str(err), time.monotonic() - started
    return "served", time.monotonic() - started


@pytest.mark.parametrize(("what", "words"), [
    ("sequence", "expected message 1, got message 5 (Heartbeat): rank 0 and this rank are out of step"),
    ("kind", "cannot run message 1: a str is not a RankMessage"),
    ("bare", "expected message 1, got a str ('shutdown') that is not an Envelope"),
])
def test_a_planted_message_raises_at_once_naming_both(pool, what, words):
    results = pool.run(_planted, what)
    assert results[0] is None
    for rank, (message, seconds) in enumerate(results[1:], start=1):
        assert message == f"rank {rank} of the control plane {words}", message
        assert seconds < 5.0, seconds  # raised on receipt, not after a collective's timeout (120 s here)
