"""benchmarks/profile_decode.py: the trace summary (busy time, gaps, kernel ranking)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
from profile_decode import _intervals_busy, summarise_trace  # noqa: E402


def test_busy_union_of_intervals():
    assert _intervals_busy([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17


def test_summary_uses_device_events_and_ranks_kernels():
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}}]
    host = [{"ph": "X", "pid": 1, "name": "python", "ts": 0, "dur": 1000}]
    kernels = [{"ph": "X", "pid": 7, "name": "gemv", "ts": 0, "dur": 30},
               {"ph": "X", "pid": 7, "name": "gemv", "ts": 40, "dur": 30},
               {"ph": "X", "pid": 7, "name": "softmax", "ts": 80, "dur": 20}]
    s = summarise_trace({"traceEvents": meta + host + kernels}, top=5)
    assert s["source"] == "device" and s["kernels"] == 3
    assert s["window_us"] == 100 and s["busy_us"] == 80
    assert s["busy_fraction"] == pytest.approx(0.8)
    assert [k["name"] for k in s["top"]] == ["gemv", "softmax"]
    assert s["top"][0]["count"] == 2 and s["top"][0]["mean_us"] == 30
