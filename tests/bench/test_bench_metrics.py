"""vllm-bench-serve-style metric maths against hand-computed values (small integer timestamps)."""

import numpy as np
import pytest

from bench.metrics import (
    RequestRecord,
    comm_delta,
    comm_per_output_token,
    decode_step_time_s,
    describe,
    itls_s,
    percentile,
    summarize_requests,
    tpot_s,
)

# r1: sent at 0, chunks at 1, 2, 3, 5 -> TTFT 1, E2EL 5, TPOT (5-1)/(4-1) = 4/3, ITL 1, 1, 2
# r2: sent at 1, chunks at 3, 4      -> TTFT 2, E2EL 3, TPOT (3-2)/(2-1) = 1,   ITL 1
# r3: sent at 2, one chunk at 6      -> TTFT 4, E2EL 4, no TPOT (one token), no ITL
# r4: failed, ends at 7: counted as failed, stretches the wall time to 7 - 0 = 7 s
RECORDS = [
    RequestRecord(send_s=0, first_token_s=1, token_times_s=(1, 2, 3, 5), end_s=5, output_tokens=4, prompt_tokens=10),
    RequestRecord(send_s=1, first_token_s=3, token_times_s=(3, 4), end_s=4, output_tokens=2, prompt_tokens=20),
    RequestRecord(send_s=2, first_token_s=6, token_times_s=(6,), end_s=6, output_tokens=1, prompt_tokens=30),
    RequestRecord(send_s=2, first_token_s=2, token_times_s=(), end_s=7, output_tokens=0, prompt_tokens=40,
                  ok=False, error="UNAVAILABLE"),
]


def test_per_request_definitions():
    r1, r2, r3, _ = RECORDS
    assert tpot_s(r1) == pytest.approx(4 / 3) and tpot_s(r2) == 1 and tpot_s(r3) is None
    assert itls_s(r1) == [1, 1, 2] and itls_s(r2) == [1] and itls_s(r3) == []


def test_percentile_is_numpy_linear():
    # sorted [1, 2, 4]: p99 sits at index (3-1)*0.99 = 1.98 -> 2 + 0.98*(4-2) = 3.96
    assert percentile([4, 1, 2], 99) == pytest.approx(3.96)
    assert percentile([1, 1, 1, 2], 50) == 1.0  # index 1.5 between 1 and 1
    assert percentile([1, 1, 1, 2], 99) == pytest.approx(1.97)
    vals = [0.3, 7.0, 1.25, 2.0, 9.5]
    assert percentile(vals, 37) == pytest.approx(np.percentile(vals, 37))
    assert describe([]) == {"mean": None, "median": None, "p99": None}
    assert set(describe([1.0], percentiles=(90, 99.9))) == {"mean", "median", "p90", "p99.9"}


def test_cell_summary_hand_computed():
    s = summarize_requests(RECORDS)
    assert (s["completed"], s["failed"], s["duration_s"]) == (3, 1, 7)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (60, 7)
    assert s["request_throughput"] == pytest.approx(3 / 7)
    assert s["output_throughput"] == pytest.approx(1.0)
    assert s["total_token_throughput"] == pytest.approx(67 / 7)
    expected_ms = {
        "ttft": (7 / 3, 2, 3.96),          # [1, 2, 4]
        "tpot": (7 / 6, 7 / 6, 1 + 0.99 / 3),  # [1, 4/3]
        "itl": (1.25, 1, 1.97),            # pooled [1, 1, 2, 1]
        "e2el": (4, 4, 4.98),              # [5, 3, 4]
    }
    for name, (mean, median, p99) in expected_ms.items():
        assert s[f"mean_{name}_ms"] == pytest.approx(mean * 1e3), name
        assert s[f"median_{name}_ms"] == pytest.approx(median * 1e3), name
        assert s[f"p99_{name}_ms"] == pytest.approx(p99 * 1e3), name


def test_explicit_duration_and_empty_cell():
    s = summarize_requests(RECORDS, duration_s=14)
    assert s["output_throughput"] == pytest.approx(0.5)
    empty = summarize_requests([])
    assert empty["completed"] == 0 and empty["output_throughput"] is None and empty["mean_ttft_ms"] is None


def test_record_validation():
    with pytest.raises(ValueError, match="out of order"):
        RequestRecord(send_s=2, first_token_s=1, token_times_s=(1,), end_s=3, output_tokens=1, prompt_tokens=1)
    with pytest.raises(ValueError, match="never decrease"):
        RequestRecord(send_s=0, first_token_s=1, token_times_s=(1, 3, 2), end_s=3, output_tokens=3, prompt_tokens=1)
    with pytest.raises(ValueError, match="start at first_token_s"):
        RequestRecord(send_s=0, first_token_s=1, token_times_s=(2,), end_s=3, output_tokens=1, prompt_tokens=1)


def test_comm_per_output_token():
    before = {"attn_tp/all_reduce": {"calls": 10, "bytes": 1000}, "attn_tp/gather": {"calls": 3, "bytes": 30}}
    after = {"attn_tp/all_reduce": {"calls": 80, "bytes": 8000}, "attn_tp/gather": {"calls": 3, "bytes": 30},
             "world/all_reduce": {"calls": 14, "bytes": 2800}}
    c = comm_per_output_token(before, after, output_tokens=7)
    assert (c["calls"], c["bytes"]) == (84, 9800)
    assert (c["calls_per_token"], c["bytes_per_token"]) == (12, 1400)
    assert set(c["per_op"]) == {"attn_tp/all_reduce", "world/all_reduce"}  # unchanged ops drop out
    assert c["per_op"]["attn_tp/all_reduce"]["calls_per_token"] == 10
    assert c["per_op"]["world/all_reduce"]["bytes_per_token"] == 400
    with pytest.raises(ValueError, match="went down"):
        comm_delta(after, before)
    with pytest.raises(ValueError, match="output_tokens"):
        comm_per_output_token(before, after, 0)


def test_decode_step_time():
    assert decode_step_time_s(0.02) == 0.02
    assert decode_step_time_s(0.01, tau=3.5) == pytest.approx(0.035)
