"""Tier (b), real gloo ranks, and tier (a): the CUDA backend object runs every op on CPU devices (its
stream path off), its stream policy decisions are right, and the native lowering's argument mapping gives
commfuse's results when run with torch's own reference implementation of the symmetric-memory ops.
The stream path and the kernels themselves are UNVERIFIED here (no GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import _cuda_ranks  # noqa: E402

from commfuse.launch import launch  # noqa: E402
from commfuse_cuda.backend import comm_priority, high_priority_options, uses_streams  # noqa: E402


def test_comm_stream_takes_the_highest_priority():
    assert comm_priority((0, -5)) == -5  # CUDA counts down: the smallest number wins
    assert comm_priority((0, -1)) == -1
    assert comm_priority((0, 0)) == 0


def test_only_cuda_devices_get_a_comm_stream():
    assert uses_streams(torch.device("cuda", 3))
    assert not uses_streams(torch.device("cpu"))
    assert not uses_streams(torch.device("meta"))


def test_high_priority_nccl_options_exist_only_with_nccl():
    import torch.distributed as dist

    options = high_priority_options()
    if dist.is_nccl_available():
        assert options.is_high_priority_stream
    else:  # this machine's CPU build of torch
        assert options is None


@pytest.mark.parametrize("n", [2, 3])
def test_every_algorithm_runs_through_the_backend_object_on_gloo(n):
    for rank, res in enumerate(launch(_cuda_ranks.ops_through_cuda_backend_on_cpu, n, timeout=300)):
        assert res.pop("streams") is None
        assert "no streams" in res.pop("repr")
        assert all(res.values()), f"rank {rank}: {res}"


@pytest.mark.parametrize("n", [2, 3])
def test_native_mapping_equals_commfuse_with_torchs_reference_op(n):
    for rank, res in enumerate(launch(_cuda_ranks.fused_mapping_with_torch_reference, n, timeout=300)):
        assert all(res.values()), f"rank {rank}: {res}"


def test_native_through_the_ops_on_gloo():
    """algorithm="native"/"auto" reach CudaBackend.native_op through commfuse's ops; the runner maps to the
    symm_mem op schema (torch's reference implementation of it standing in for the GPU kernel)."""
    for rank, res in enumerate(launch(_cuda_ranks.native_through_the_ops, 2, timeout=300)):
        assert res.pop("off") == (
            "CommfuseValueError: algorithm 'native' for all_gather_matmul: the call does not qualify: native kernels "
            "are off (opt in with COMMFUSE_CUDA_NATIVE=1 or CudaBackend(enable_native=True) when all ranks share an "
            "NVLink domain)"), rank
        assert res.pop("cpu") == (
            "CommfuseValueError: algorithm 'native' for matmul_reduce_scatter: the call does not qualify: tensors "
            "are on 'cpu', and torch's symmetric-memory kernels run on CUDA devices"), rank
        assert res.pop("ag-reason") == ("all-gather along dim 0 of 2 equal shards into 2 GEMM(s); "
                                        "torch.ops.symm_mem.fused_all_gather_matmul on an NCCL group")
        assert "dtype torch.float64" in res.pop("float64")
        assert f"uneven shards: the gathered size 7 along dim 0 is not 2 x {4 - rank}" in res.pop("uneven")
        assert "dim 0 has size 5, which world size 2 does not divide" in res.pop("indivisible")
        assert "fused kernel has no backward; run it under torch.no_grad()" in res.pop("grad-native")
        assert "native kernels are off" in res.pop("env-off")
        assert res.pop("env-on") == "native"
        assert all(res.values()), f"rank {rank}: {res}"
