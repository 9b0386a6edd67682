"""Rank bodies for the cuda backend's gloo tests (module-level so spawned ranks can import them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import commfuse as cf


def _inputs(rank: int, n: int):
    g = torch.Generator().manual_seed(11)
    every = [torch.randint(-3, 4, (4, 8), generator=g).float() for _ in range(n)]
    w = torch.randint(-3, 4, (8, 5), generator=g).float()
    full = [torch.randint(-3, 4, (4 * n, 8), generator=g).float() for _ in range(n)]
    return every, w, full


def ops_through_cuda_backend_on_cpu(rank: int, n: int) -> dict:
    """CudaBackend with a CPU device on gloo: the same object as on a GPU, minus the streams."""
    from commfuse_cuda.backend import CudaBackend

    be = CudaBackend(device="cpu")
    every, w, full = _inputs(rank, n)
    out = {"streams": be.streams, "repr": repr(be)}
    for alg in ("ring", "bidirectional", "vanilla", "sliced"):
        got = cf.all_gather_matmul(every[rank], w, backend=be, algorithm=alg)
        out[f"ag-{alg}"] = torch.equal(got, torch.cat(every) @ w)
        got = cf.matmul_reduce_scatter(full[rank], w, backend=be, algorithm=alg)
        out[f"rs-{alg}"] = torch.equal(got, sum(f @ w for f in full).tensor_split(n)[rank])
    return out


def fused_mapping_with_torch_reference(rank: int, n: int) -> dict:
    """commfuse_cuda.native's argument/result mapping, run with torch's reference of the same op schema."""
    from torch.distributed import _symmetric_memory as symm

    from commfuse_cuda import native

    every, w, full = _inputs(rank, n)
    group = dist.group.WORLD
    out = {}
    gathered, outs = native.call_fused_all_gather_matmul(
        symm._fused_all_gather_matmul_fallback, every[rank], [w, 2 * w], 0, group, True
    )
    ref = cf.all_gather_matmul(every[rank], [w, 2 * w], return_gathered=True, algorithm="ring")
    out["ag"] = torch.equal(gathered, ref[0]) and all(torch.equal(a, b) for a, b in zip(outs, ref[1]))
    # A 3-D shard gathered along dim 1, as sequence parallelism over (batch, seq, hidden) does.
    x = every[rank].reshape(2, 2, 8)
    gathered, outs = native.call_fused_all_gather_matmul(symm._fused_all_gather_matmul_fallback, x, [w], 1, group, False)
    ref = cf.all_gather_matmul(x, w, gather_dim=1, algorithm="ring")
    out["ag-dim1"] = gathered is None and torch.equal(outs[0], ref)
    for sd in (0, 1):
        a = torch.randint(-3, 4, (2 * n, 2 * n, 8), generator=torch.Generator().manual_seed(rank)).float()
        got = native.call_fused_matmul_reduce_scatter(symm._fused_matmul_reduce_scatter_fallback, a, w, sd, "sum", group)
        ref = cf.matmul_reduce_scatter(a, w, scatter_dim=sd, algorithm="ring")
        out[f"rs-dim{sd}"] = torch.equal(got, ref)
    report: dict = {}
    out["try-cpu"] = native.try_fused_all_gather_matmul(every[rank], w, enable=True, report=report)
    out["try-cpu-report"] = report
    return out
