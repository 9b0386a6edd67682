"""Tier (a), no processes: the bench's peak-memory helper sees a span's allocation, forgets what an earlier span
touched, and says "n/a" where the process cannot tell."""

from __future__ import annotations

import pytest
import torch

from commfuse.bench import memory

MIB = 2 ** 20
requires_proc = pytest.mark.skipif(not memory._reset_high_water_mark(), reason="no /proc/self/clear_refs or VmHWM")


@requires_proc
def test_a_span_reports_what_it_touched_and_not_what_an_earlier_one_did():
    with memory.peak_memory("cpu") as big:
        t = torch.ones(64 * MIB // 4)  # 64 MiB, touched
        del t
    assert big.how.startswith("VmHWM") and big.bytes is not None and big.bytes >= 56 * MIB, big.bytes
    with memory.peak_memory("cpu") as small:
        t = torch.ones(MIB // 4)
        del t
    assert small.bytes is not None and small.bytes < 32 * MIB, small.bytes


def test_without_proc_the_figure_is_unknown(monkeypatch, tmp_path):
    monkeypatch.setattr(memory, "PROC", tmp_path / "absent")
    with memory.peak_memory("cpu") as peak:
        torch.ones(1024)
    assert peak.bytes is None and "not measured" in peak.how
    assert memory.text(peak.bytes) == "n/a" and memory.text(3 * MIB) == "3.0 MiB"
