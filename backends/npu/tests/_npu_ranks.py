"""Rank bodies for the npu backend's gloo tests (module-level so spawned ranks can import them)."""

from __future__ import annotations

import torch

import commfuse as cf


def ops_through_npu_backend_on_cpu(rank: int, n: int) -> dict:
    """NpuBackend with a CPU device on gloo: the HCCL path's code, minus the NPU."""
    from commfuse_npu.backend import NpuBackend

    be = NpuBackend(device="cpu")
    g = torch.Generator().manual_seed(5)
    shards = [torch.randint(-3, 4, (4, 8), generator=g).float() for _ in range(n)]
    full = [torch.randint(-3, 4, (4 * n, 8), generator=g).float() for _ in range(n)]
    w = torch.randint(-3, 4, (8, 5), generator=g).float()
    out = {"name": be.name, "traced": be.capabilities.execution == "traced"}
    for alg in ("ring", "bidirectional", "vanilla"):
        out[f"ag-{alg}"] = torch.equal(cf.all_gather_matmul(shards[rank], w, backend=be, algorithm=alg),
                                       torch.cat(shards) @ w)
        out[f"rs-{alg}"] = torch.equal(cf.matmul_reduce_scatter(full[rank], w, backend=be, algorithm=alg),
                                       sum(f @ w for f in full).tensor_split(n)[rank])
    return out
