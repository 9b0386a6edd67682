"""Tier (a), no processes, CPU tensors: when a call qualifies for torch's symmetric-memory fused kernels,
and when not, each reason pinned at its boundary; the environment half decided from facts and probed
for real here. The kernels themselves are UNVERIFIED (no GPU)."""

from __future__ import annotations

import pytest
import torch

from commfuse_cuda.native import (
    Environment,
    all_gather_matmul_verdict,
    environment_verdict,
    matmul_reduce_scatter_verdict,
    probe_environment,
)


def t(*shape, dtype=torch.bfloat16, grad=False):
    return torch.zeros(shape, dtype=dtype, requires_grad=grad)


@pytest.mark.parametrize(
    "a, bs, gd, n, gathered, ok, reason",
    [
        (t(4, 16), [t(16, 8)], 0, 4, None, True, "along dim 0 of 4 equal shards into 1 GEMM"),
        (t(2, 4, 16), [t(16, 8), t(16, 2)], 1, 2, None, True, "along dim 1 of 2 equal shards into 2 GEMM"),
        (t(2, 4, 16), [t(16, 8)], -2, 2, None, True, "along dim 1"),
        (t(4, 16), [t(64, 8)], 1, 4, None, True, "the contraction dim"),
        (t(4, 16), [t(16, 8)], 0, 4, 16, True, "equal shards"),
        (t(4, 16), [t(16, 8)], 0, 1, None, False, "world size 1"),
        (t(16), [t(16, 8)], 0, 2, None, False, "needs at least 2"),
        (t(4, 16), [], 0, 2, None, False, "no weights"),
        (t(4, 16), [t(1, 16, 8)], 0, 2, None, False, "2-D weights"),
        (t(4, 16, dtype=torch.int32), [t(16, 8, dtype=torch.int32)], 0, 2, None, False, "dtype torch.int32"),
        (t(4, 16, dtype=torch.float64), [t(16, 8, dtype=torch.float64)], 0, 2, None, False, "dtype torch.float64"),
        (t(4, 16), [t(16, 8, dtype=torch.float16)], 0, 2, None, False, "but a_shard has torch.bfloat16"),
        (t(4, 16, grad=True), [t(16, 8)], 0, 2, None, False, "requires grad"),
        (t(4, 16), [t(16, 8)], 2, 2, None, False, "out of range"),
        (t(4, 16), [t(16, 8)], -3, 2, None, False, "out of range"),
        (t(4, 16), [t(16, 8)], 0, 4, 15, False, "uneven shards"),
        (t(4, 16), [t(15, 8)], 0, 4, None, False, "b[0] has 15 rows but the gathered a has K = 16"),
        (t(4, 16), [t(16, 8)], 1, 4, None, False, "K = 64"),
    ],
)
def test_all_gather_matmul_verdicts(a, bs, gd, n, gathered, ok, reason):
    v = all_gather_matmul_verdict(a, bs, gather_dim=gd, world_size=n, gathered_size=gathered)
    assert bool(v) is ok and reason in v.reason, v


def test_grad_does_not_disqualify_under_no_grad():
    with torch.no_grad():
        assert all_gather_matmul_verdict(t(4, 16, grad=True), [t(16, 8)], gather_dim=0, world_size=2)


@pytest.mark.parametrize(
    "a, b, sd, n, op, ok, reason",
    [
        (t(8, 16), t(16, 4), 0, 4, "sum", True, "sum reduce-scatter along dim 0 into 4"),
        (t(8, 16), t(16, 4), 1, 4, "avg", True, "avg reduce-scatter along dim 1"),
        (t(2, 6, 16), t(16, 4), -2, 3, "sum", True, "along dim 1 into 3"),
        (t(8, 16), t(16, 4), 0, 3, "sum", False, "dim 0 has size 8, which world size 3 does not divide"),
        (t(8, 16), t(16, 6), 1, 4, "sum", False, "dim 1 has size 6"),
        (t(8, 16), t(16, 4), 2, 2, "sum", False, "out of range"),
        (t(8, 16), t(16, 4), 0, 2, "max", False, "reduce_op 'max'"),
        (t(8, 16), t(15, 4), 0, 2, "sum", False, "K = 16 columns but b has 15 rows"),
        (t(16), t(16, 4), 0, 2, "sum", False, "at least 2"),
        (t(8, 16), t(2, 16, 4), 0, 2, "sum", False, "2-D weight"),
        (t(8, 16), t(16, 4), 0, 1, "sum", False, "world size 1"),
        (t(8, 16, dtype=torch.int64), t(16, 4, dtype=torch.int64), 0, 2, "sum", False, "torch.int64"),
    ],
)
def test_matmul_reduce_scatter_verdicts(a, b, sd, n, op, ok, reason):
    v = matmul_reduce_scatter_verdict(a, b, scatter_dim=sd, world_size=n, reduce_op=op)
    assert bool(v) is ok and reason in v.reason, v


def test_environment_verdicts():
    good = Environment("cuda", True, "nccl", True, "2.13.0")
    assert environment_verdict(good, "fused_all_gather_matmul")
    for env, reason in [
        (Environment("cuda", True, "nccl", False), "native kernels are off"),
        (Environment("cpu", True, "gloo", True), "tensors are on 'cpu'"),
        (Environment("cuda", False, "nccl", True, "2.3.0"), "torch 2.3.0 has no CUDA kernel"),
        (Environment("cuda", True, "gloo", True), "uses 'gloo'"),
        (Environment("cuda", True, "", True), "'no backend'"),
    ]:
        v = environment_verdict(env, "fused_all_gather_matmul")
        assert not v and reason in v.reason, (env, v)


def test_probe_here(monkeypatch):
    monkeypatch.delenv("COMMFUSE_CUDA_NATIVE", raising=False)
    env = probe_environment(torch.device("cpu"), None, "fused_all_gather_matmul", None)
    assert env.device_type == "cpu" and env.group_backend == "" and not env.enabled
    # torch registers the op's CUDA kernel from Python, so even a CPU build knows it.
    assert env.op_registered == hasattr(torch.ops.symm_mem, "fused_all_gather_matmul")
    monkeypatch.setenv("COMMFUSE_CUDA_NATIVE", "1")
    assert probe_environment(torch.device("cpu"), None, "fused_all_gather_matmul", None).enabled
