"""Tier (b), real gloo ranks: the NpuBackend object (HCCL's c10d path) runs the ops on CPU devices and
equals the reference; on an NPU the same code runs with HCCL (UNVERIFIED here)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _npu_ranks  # noqa: E402

from commfuse.launch import launch  # noqa: E402


def test_ops_through_the_backend_object_on_gloo():
    for rank, res in enumerate(launch(_npu_ranks.ops_through_npu_backend_on_cpu, 2, timeout=300)):
        assert res.pop("name") == "npu" and res.pop("traced") is False
        assert all(res.values()), f"rank {rank}: {res}"
