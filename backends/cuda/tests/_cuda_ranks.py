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
    return out


def _reference_backend(**kwargs):
    """A CudaBackend on a CPU device whose native_op sees the facts of an NVLink node (a CUDA device, the ops'
    CUDA kernels, an NCCL group) and runs torch's reference implementation of the symm_mem op schemas on the
    gloo group. The user's opt-in is the real one (``enable_native`` or ``COMMFUSE_CUDA_NATIVE``)."""
    import dataclasses

    from torch.distributed import _symmetric_memory as symm

    from commfuse_cuda.backend import CudaBackend

    class ReferenceKernels(CudaBackend):
        decisions = 0
        runs = 0

        def native_op(self, op, **signature):
            type(self).decisions += 1
            return super().native_op(op, **signature)

        def _native_environment(self, kernel_name):
            real = super()._native_environment(kernel_name)
            return dataclasses.replace(real, device_type="cuda", op_registered=True, group_backend="nccl")

        def _native_kernel(self, kernel_name):
            reference = getattr(symm, f"_{kernel_name}_fallback")

            def counted(*args, **kwargs):
                type(self).runs += 1
                return reference(*args, **kwargs)

            return counted

    return ReferenceKernels(device="cpu", **kwargs)


def _raises(fn) -> str:
    try:
        fn()
    except cf.CommfuseError as e:
        return f"{type(e).__name__}: {e}"
    return "did not raise"


def native_through_the_ops(rank: int, n: int) -> dict:
    """algorithm="native" and "auto" through commfuse's ops with CudaBackend.native_op: on a backend that does
    not qualify (this CPU node), and with torch's reference kernels standing in for the GPU ones."""
    import os

    from commfuse_cuda.backend import CudaBackend

    os.environ.pop("COMMFUSE_CUDA_NATIVE", None)
    every, w, full = _inputs(rank, n)
    a = every[rank]
    out: dict = {}

    # This node, as it is: the opt-in is off; with it on, the tensors are on the CPU.
    plain = CudaBackend(device="cpu")
    out["off"] = _raises(lambda: cf.all_gather_matmul(a, w, algorithm="native", backend=plain))
    opted = CudaBackend(device="cpu", enable_native=True)
    out["cpu"] = _raises(lambda: cf.matmul_reduce_scatter(full[rank], w, algorithm="native", backend=opted))
    report: dict = {}
    got = cf.all_gather_matmul(a, w, algorithm="auto", backend=opted, report=report)
    out["auto-not-native"] = report["algorithm"] != "native" and torch.equal(got, torch.cat(every) @ w)

    # torch's reference kernels behind the plugin contract, opted in through the constructor.
    be = _reference_backend(enable_native=True)
    bs = [w, 2 * w]
    report = {}
    gathered, outs = cf.all_gather_matmul(a, bs, algorithm="native", return_gathered=True, backend=be,
                                          report=report)
    ring = cf.all_gather_matmul(a, bs, algorithm="ring", return_gathered=True, backend=be)
    out["ag-native"] = (report["algorithm"] == "native" and torch.equal(gathered, ring[0])
                        and all(torch.equal(x, y) for x, y in zip(outs, ring[1])))
    out["ag-reason"] = report["reason"]
    x = a.reshape(2, 2, 8)  # (batch, seq, hidden) gathered along the sequence
    report = {}
    got = cf.all_gather_matmul(x, w, gather_dim=1, algorithm="auto", backend=be, report=report)
    out["ag-auto-dim1"] = report["algorithm"] == "native" and torch.equal(
        got, cf.all_gather_matmul(x, w, gather_dim=1, algorithm="ring", backend=be))
    wk = torch.randint(-3, 4, (8 * n, 5), generator=torch.Generator().manual_seed(3)).float()
    out["ag-contraction"] = torch.equal(  # gather_dim the last (contraction) dim: partial products summed
        cf.all_gather_matmul(a, wk, gather_dim=-1, algorithm="native", backend=be),
        cf.all_gather_matmul(a, wk, gather_dim=-1, algorithm="ring", backend=be))
    for sd in (0, 1):
        big = torch.randint(-3, 4, (2 * n, 2 * n, 8), generator=torch.Generator().manual_seed(rank)).float()
        report = {}
        got = cf.matmul_reduce_scatter(big, w, scatter_dim=sd, algorithm="native", backend=be, report=report)
        out[f"rs-native-dim{sd}"] = report["algorithm"] == "native" and torch.equal(
            got, cf.matmul_reduce_scatter(big, w, scatter_dim=sd, algorithm="ring", backend=be))
    report = {}
    got = cf.matmul_reduce_scatter(full[rank], w, algorithm="auto", backend=be, report=report)
    out["rs-auto"] = report["algorithm"] == "native" and torch.equal(
        got, sum(f @ w for f in full).tensor_split(n)[rank])

    # Once per signature: a second call with the same signature runs the kernel without asking again.
    decided, ran = type(be).decisions, type(be).runs
    cf.all_gather_matmul(a, bs, algorithm="native", return_gathered=True, backend=be)
    out["decided-once"] = (type(be).decisions, type(be).runs - ran) == (decided, 1)

    # Calls that do not qualify: "native" raises naming why, "auto" runs the ring.
    out["float64"] = _raises(lambda: cf.all_gather_matmul(a.double(), w.double(), algorithm="native", backend=be))
    total = 4 * n - 1
    uneven = torch.ones(total, 8).tensor_split(n)[rank]
    out["uneven"] = _raises(lambda: cf.all_gather_matmul(uneven, w, gathered_size=total, algorithm="native",
                                                         backend=be))
    report = {}
    got = cf.all_gather_matmul(uneven, w, gathered_size=total, algorithm="auto", backend=be, report=report)
    out["uneven-auto-ring"] = report["algorithm"] != "native" and torch.equal(got, torch.ones(total, 8) @ w)
    odd = torch.ones(2 * n + 1, 8)
    out["indivisible"] = _raises(lambda: cf.matmul_reduce_scatter(odd, w, algorithm="native", backend=be))

    # Gradients: the kernels have no backward; "native" says so, "auto" runs the ring and differentiates.
    g = a.clone().requires_grad_()
    out["grad-native"] = _raises(lambda: cf.all_gather_matmul(g, w, algorithm="native", backend=be))
    y = cf.all_gather_matmul(g, w, algorithm="auto", backend=be)
    y.sum().backward()
    out["grad-auto"] = torch.equal(y.detach(), torch.cat(every) @ w) and g.grad is not None
    with torch.no_grad():
        out["no-grad-native"] = torch.equal(cf.all_gather_matmul(g, w, algorithm="native", backend=be),
                                            torch.cat(every) @ w)

    # The opt-in is read when a signature is first seen: the environment variable, with enable_native=None.
    lazy = _reference_backend()
    out["env-off"] = _raises(lambda: cf.all_gather_matmul(a, w, algorithm="native", backend=lazy))
    os.environ["COMMFUSE_CUDA_NATIVE"] = "1"
    try:
        report = {}
        cf.all_gather_matmul(a, [w], algorithm="native", backend=lazy, report=report)  # a new signature
        out["env-on"] = report["algorithm"]
    finally:
        os.environ.pop("COMMFUSE_CUDA_NATIVE", None)
    return out
