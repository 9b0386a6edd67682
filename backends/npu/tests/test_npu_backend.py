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


def test_mc2_through_the_ops_on_gloo():
    """algorithm="native"/"auto" reach NpuBackend.native_op through commfuse's ops; the runners call the MC2
    kernels (reference implementations of their documented signatures here) and read their results right."""
    for rank, res in enumerate(launch(_npu_ranks.mc2_through_the_ops, 2, timeout=300)):
        assert res.pop("cpu") == ("CommfuseValueError: algorithm 'native' for all_gather_matmul: the call does not "
                                  "qualify: tensors are on 'cpu'; MC2 kernels run on Ascend NPUs")
        assert res.pop("ag-reason") == ("npu_all_gather_base_mm: 2 x (4, 256) gathered, times (256, 8); "
                                        "communication domain 'hccl_world_group'")
        assert res.pop("kernel-calls") == ["ag", "ag", "rs", "rs"]
        assert "computes one GEMM per gather; the call has 2 weights" in res.pop("two-weights")
        assert "dtype float32" in res.pop("float32")
        assert "supports only 'sum'" in res.pop("avg")
        assert "'hccl_world_group' was used first, this call is on 'tp_group'" in res.pop("second-domain")
        assert all(res.values()), f"rank {rank}: {res}"
