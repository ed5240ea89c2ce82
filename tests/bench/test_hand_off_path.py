"""``gpu_check``'s ``hand_off`` section on CPU (``bench/gpu/hand_off.py``): the bytes a second process reads over the
Mooncake transfer engine arrive intact, every stage is timed, and the Kimi K2 projection follows from the figures
(the section a lent GPU runs, caught here first)."""

from __future__ import annotations

import pytest

from bench.gpu import hand_off
from tests.support.mooncake import master_binary


def test_the_hand_off_path_arrives_intact_and_its_projection_follows_from_its_rates():
    master_binary()  # the mooncake wheel and its library: skipped without them, failed under CI=true
    got = hand_off.run("cpu", 30, nbytes=1 << 20)
    assert got["intact"] and got["mib"] == 1
    assert all(rate > 0 for rate in got["gb_s"].values())
    assert got["gb_s"]["path"] < min(got["gb_s"]["d2h"], got["gb_s"]["tcp_read"], got["gb_s"]["h2d"])
    kimi = hand_off.PROJECTED_TOKENS * hand_off.KIMI_K2_BYTES_PER_TOKEN
    assert got["projection"]["seconds_at_measured_path"] == pytest.approx(kimi / (got["gb_s"]["path"] * 1e9))
