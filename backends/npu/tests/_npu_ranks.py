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


def _reference_kernels():
    """The two MC2 kernels with their documented signatures, computed with torch.distributed on the gloo group
    (stand-ins for torch_npu's, which need an Ascend NPU): what the backend's runners call them with and how
    they read the results is what the tests check."""
    import torch.distributed as dist

    calls: list = []

    def npu_all_gather_base_mm(x1, x2, hcom, world_size, *, bias=None, gather_index=0, gather_output=True,
                               comm_turn=0):
        assert x1.is_contiguous() and x1.ndim == 2 and x2.ndim == 2 and bias is None
        assert gather_index == 0 and comm_turn == 0 and world_size == dist.get_world_size()
        calls.append(("ag", hcom, gather_output))
        gathered = x1.new_empty((world_size * x1.shape[0], x1.shape[1]))
        dist.all_gather_into_tensor(gathered, x1)
        return gathered @ x2, (gathered if gather_output else x1.new_empty(0))

    def npu_mm_reduce_scatter_base(x1, x2, hcom, world_size, *, reduce_op="sum", bias=None, comm_turn=0):
        assert x1.is_contiguous() and reduce_op == "sum" and bias is None and comm_turn == 0
        calls.append(("rs", hcom))
        out = x1.new_empty((x1.shape[0] // world_size, x2.shape[1]))
        dist.reduce_scatter_tensor(out, (x1 @ x2).contiguous())
        return out

    return npu_all_gather_base_mm, npu_mm_reduce_scatter_base, calls


def _reference_backend(hcom: str = "hccl_world_group", domains=None):
    """An NpuBackend on a CPU device whose native_op sees an Atlas A2 node with an HCCL group named ``hcom``."""
    from commfuse_npu import mc2
    from commfuse_npu.backend import NpuBackend

    ag, rs, calls = _reference_kernels()

    class ReferenceMc2(NpuBackend):
        def _mc2_environment(self):
            return mc2.Verdict(True, "test: an Atlas A2 node, HCCL group"), "A2", hcom, self.world_size

        def _mc2_kernels(self):
            return ag, rs

    be = ReferenceMc2(device="cpu")
    be.domains = domains if domains is not None else mc2.DomainTracker()
    be.calls = calls
    return be


def _raises(fn) -> str:
    try:
        fn()
    except cf.CommfuseError as e:
        return f"{type(e).__name__}: {e}"
    return "did not raise"


def mc2_through_the_ops(rank: int, n: int) -> dict:
    """algorithm="native"/"auto" through commfuse's ops with NpuBackend.native_op."""
    from commfuse_npu.backend import NpuBackend

    g = torch.Generator().manual_seed(9)
    k = 256  # MC2's least k
    shards = [torch.randint(-1, 2, (4, k), generator=g).half() for _ in range(n)]
    full = [torch.randint(-1, 2, (4 * n, k), generator=g).half() for _ in range(n)]
    w = torch.randint(-1, 2, (k, 8), generator=g).half()
    out: dict = {}

    plain = NpuBackend(device="cpu")
    out["cpu"] = _raises(lambda: cf.all_gather_matmul(shards[rank], w, algorithm="native", backend=plain))

    be = _reference_backend()
    report: dict = {}
    gathered, y = cf.all_gather_matmul(shards[rank], w, algorithm="native", return_gathered=True, backend=be,
                                       report=report)
    out["ag-native"] = (report["algorithm"] == "native" and torch.equal(gathered, torch.cat(shards))
                        and torch.equal(y, cf.all_gather_matmul(shards[rank], w, algorithm="ring", backend=be)))
    out["ag-reason"] = report["reason"]
    report = {}
    y = cf.all_gather_matmul(shards[rank], w.t().contiguous().t(), algorithm="auto", backend=be, report=report)
    out["ag-auto-transposed-x2"] = report["algorithm"] == "native" and torch.equal(y, torch.cat(shards) @ w)
    report = {}
    y = cf.matmul_reduce_scatter(full[rank], w, algorithm="native", backend=be, report=report)
    out["rs-native"] = report["algorithm"] == "native" and torch.equal(
        y, cf.matmul_reduce_scatter(full[rank], w, algorithm="ring", backend=be))
    x1 = full[rank].t().contiguous().t()  # a transposed x1 of the same signature: the runner makes it contiguous
    out["rs-noncontiguous-x1"] = torch.equal(cf.matmul_reduce_scatter(x1, w, algorithm="native", backend=be), y)
    out["kernel-calls"] = [c[0] for c in be.calls]

    out["two-weights"] = _raises(lambda: cf.all_gather_matmul(shards[rank], [w, w], algorithm="native", backend=be))
    report = {}
    ys = cf.all_gather_matmul(shards[rank], [w, w], algorithm="auto", backend=be, report=report)
    out["two-weights-auto-ring"] = report["algorithm"] != "native" and torch.equal(ys[1], torch.cat(shards) @ w)
    out["float32"] = _raises(lambda: cf.all_gather_matmul(shards[rank].float(), w.float(), algorithm="native",
                                                          backend=be))
    out["avg"] = _raises(lambda: cf.matmul_reduce_scatter(full[rank], w, reduce_op="avg", algorithm="native",
                                                          backend=be))
    # One communication domain: a second HCCL group is refused by the same tracker.
    other = _reference_backend("tp_group", domains=be.domains)
    out["second-domain"] = _raises(lambda: cf.all_gather_matmul(shards[rank], w, algorithm="native", backend=other))
    return out
