"""Ascend MC2 fused kernels, used exactly where their documented constraints hold.

torch_npu's ``npu_all_gather_base_mm(x1, x2, hcom, world_size, ...)`` computes
``all_gather(x1) @ x2`` and ``npu_mm_reduce_scatter_base(x1, x2, hcom,
world_size, ...)`` computes ``reduce_scatter(x1 @ x2)``, each with the
communication pipelined inside one kernel (MC2). Their documented
constraints (torch_npu API reference for both ops, CANN 8.0.RC2 and later):

* x1 is ``(m, k)`` and x2 is ``(k, n)``: both 2-D, the same k;
* k in [256, 65535);
* float16 or bfloat16, the same dtype for both (int8 needs the quantised
  variants' scales, which commfuse does not pass);
* world size 2, 4 or 8 on Atlas A2 (910B, HCCS all-mesh); 2, 4, 8, 16 or 32
  on Atlas A3 (910_93, HCCS double ring);
* reduce-scatter: m divisible by the world size, reduce op ``sum``;
* no bias (the current releases reject a non-zero one); ``gather_index``
  and ``comm_turn`` 0: x1 is gathered along its rows;
* x1 not transposed (contiguous); x2 may be a transposed view;
* one communication domain: every MC2 op of a model uses the same HCCL group.

:func:`mc2_verdict` checks a :class:`Mc2Request` against all of them (pure
Python, tested at every boundary); :class:`DomainTracker` enforces the last
one across calls. :func:`signature_verdict` judges one call signature of the
commfuse ops, for :meth:`NpuBackend.native_op
<commfuse_npu.backend.NpuBackend.native_op>` (the route ``algorithm="native"``
and ``"auto"`` take), and :func:`environment` says whether a device and group
can run MC2 at all. UNVERIFIED here: the kernels need Ascend hardware.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

K_MIN, K_END = 256, 65535  # k in [K_MIN, K_END)
WORLD_SIZES = {"A2": (2, 4, 8), "A3": (2, 4, 8, 16, 32)}
DTYPES = ("float16", "bfloat16")
OPS = ("all_gather_matmul", "matmul_reduce_scatter")


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str

    def __bool__(self) -> bool:
        return self.ok


@dataclass(frozen=True)
class Mc2Request:
    """One call, described by what the constraints talk about (no tensors: testable anywhere)."""

    op: str  # "all_gather_matmul" | "matmul_reduce_scatter"
    x1_shape: tuple[int, ...]  # a shard (all-gather) or the whole a (reduce-scatter)
    x2_shape: tuple[int, ...]
    dtype: str  # e.g. "bfloat16"
    x2_dtype: str
    world_size: int
    family: str | None  # "A2", "A3" or None when the product is not known
    dim: int = 0  # gather_dim / scatter_dim as the commfuse op got it
    bias: bool = False
    x1_contiguous: bool = True
    reduce_op: str = "sum"
    requires_grad: bool = False
    gathered_evenly: bool = True  # all-gather: every rank's x1 has m rows


def product_family(device_name: str) -> str | None:
    """"A2" for Atlas A2 (Ascend910B*), "A3" for Atlas A3 (Ascend910_93*), else None."""
    name = device_name.replace(" ", "")
    if name.startswith("Ascend910_93"):
        return "A3"
    if name.startswith("Ascend910B"):
        return "A2"
    return None


def _no(reason: str) -> Verdict:
    return Verdict(False, reason)


def mc2_verdict(r: Mc2Request) -> Verdict:
    """Whether ``r`` is inside every documented constraint of its MC2 kernel; the first one broken otherwise."""
    if r.op not in OPS:
        return _no(f"MC2 has no kernel for {r.op!r}; it has {OPS}")
    kernel = "npu_all_gather_base_mm" if r.op == "all_gather_matmul" else "npu_mm_reduce_scatter_base"
    if r.family not in WORLD_SIZES:
        return _no(f"{kernel} runs on Atlas A2 and A3; this device is {r.family or 'neither'}")
    if r.requires_grad:
        return _no(f"{kernel} is used for forward passes without autograd; an input requires grad")
    if len(r.x1_shape) != 2 or len(r.x2_shape) != 2:
        return _no(f"{kernel} takes 2-D x1 (m, k) and x2 (k, n); got x1 {list(r.x1_shape)} and x2 {list(r.x2_shape)}")
    if r.dim not in (0, -2):  # before the shapes: a call gathering the contraction dim has x2 rows != k
        what = "gather" if r.op == "all_gather_matmul" else "scatter"
        return _no(f"{kernel} {what}s along the rows (dim 0); asked for dim {r.dim}")
    (m, k), (k2, _) = r.x1_shape, r.x2_shape
    if k != k2:
        return _no(f"x1 has k = {k} but x2 has {k2} rows")
    if not K_MIN <= k < K_END:
        return _no(f"k = {k} is outside [{K_MIN}, {K_END}) that {kernel} supports")
    if r.dtype not in DTYPES:
        return _no(f"dtype {r.dtype}: {kernel} takes {' or '.join(DTYPES)} (int8 only with quantisation scales)")
    if r.x2_dtype != r.dtype:
        return _no(f"x2 has dtype {r.x2_dtype} but x1 has {r.dtype}")
    sizes = WORLD_SIZES[r.family]
    if r.world_size not in sizes:
        return _no(f"world size {r.world_size}: {kernel} on Atlas {r.family} supports {', '.join(map(str, sizes))}")
    if r.bias:
        return _no(f"{kernel} does not support a bias")
    if not r.x1_contiguous:
        return _no(f"{kernel} does not take a transposed (non-contiguous) x1")
    if r.op == "all_gather_matmul":
        if not r.gathered_evenly:
            return _no(f"{kernel} gathers equal shards; the ranks' row counts differ")
        return Verdict(True, f"{kernel}: {r.world_size} x ({m}, {k}) gathered, times ({k}, {r.x2_shape[1]})")
    if m % r.world_size:
        return _no(f"m = {m} is not divisible by the world size {r.world_size}, as {kernel} needs")
    if r.reduce_op != "sum":
        return _no(f"reduce_op {r.reduce_op!r}: {kernel} supports only 'sum'")
    return Verdict(True, f"{kernel}: ({m}, {k}) times ({k}, {r.x2_shape[1]}), summed and scattered over {r.world_size}")


class DomainTracker:
    """Enforces MC2's one-communication-domain rule: the first HCCL group used by MC2 is the only one."""

    def __init__(self) -> None:
        self._domain: str | None = None
        self._lock = threading.Lock()

    @property
    def domain(self) -> str | None:
        return self._domain

    def admit(self, domain: str) -> Verdict:
        with self._lock:
            if self._domain is None:
                self._domain = domain
            if domain != self._domain:
                return _no(
                    f"MC2 kernels of one model must share one communication domain; {self._domain!r} was used "
                    f"first, this call is on {domain!r}"
                )
            return Verdict(True, f"communication domain {domain!r}")

    def reset(self) -> None:
        with self._lock:
            self._domain = None


DOMAINS = DomainTracker()


def request_for(op: str, x1, x2, *, world_size: int, family: str | None, dim: int = 0, bias=None,
                reduce_op: str = "sum", gathered_evenly: bool = True) -> Mc2Request:
    """The :class:`Mc2Request` of a call with tensors ``x1`` and ``x2`` (any device, CPU included)."""
    import torch

    grad = torch.is_grad_enabled() and (x1.requires_grad or x2.requires_grad)
    return Mc2Request(
        op=op,
        x1_shape=tuple(x1.shape),
        x2_shape=tuple(x2.shape),
        dtype=str(x1.dtype).replace("torch.", ""),
        x2_dtype=str(x2.dtype).replace("torch.", ""),
        world_size=world_size,
        family=family,
        dim=dim if dim >= 0 else dim + x1.ndim,
        bias=bias is not None,
        x1_contiguous=x1.is_contiguous(),
        reduce_op=reduce_op,
        requires_grad=grad,
        gathered_evenly=gathered_evenly,
    )


def signature_verdict(op: str, signature: dict, *, world_size: int, family: str | None) -> Verdict:
    """Whether one call signature of a commfuse op (the keywords ``commfuse.ops`` gives a backend's
    ``native_op``) maps onto its MC2 kernel; pure, so tested anywhere.

    all_gather_matmul: ``a_shard``, ``bs`` (one weight: MC2 computes one GEMM per gather), ``gather_dim``,
    ``gathered_size`` (None or every rank's rows); matmul_reduce_scatter: ``a``, ``b``, ``scatter_dim``,
    ``reduce_op``. Not judged here: autograd (``commfuse.ops`` decides per call; the kernels have no
    backward) and x1's layout (the runner passes ``x1.contiguous()``, since strides are not part of a
    signature).
    """
    import dataclasses

    import torch

    if op == "all_gather_matmul":
        x1, bs, dim = signature["a_shard"], list(signature["bs"]), signature["gather_dim"]
        if len(bs) != 1:
            return _no(f"npu_all_gather_base_mm computes one GEMM per gather; the call has {len(bs)} weights")
        x2 = bs[0]
        gathered_size = signature.get("gathered_size")
        even = gathered_size is None or gathered_size == x1.shape[dim] * world_size
        with torch.no_grad():
            request = request_for(op, x1, x2, world_size=world_size, family=family, dim=dim, gathered_evenly=even)
    elif op == "matmul_reduce_scatter":
        x1, x2 = signature["a"], signature["b"]
        with torch.no_grad():
            request = request_for(op, x1, x2, world_size=world_size, family=family, dim=signature["scatter_dim"],
                                  reduce_op=signature["reduce_op"])
    else:
        return _no(f"MC2 has no kernel for {op!r}; it has {OPS}")
    return mc2_verdict(dataclasses.replace(request, x1_contiguous=True))


def x2_layout(x2):
    """``x2`` as MC2 takes it: contiguous or a transposed view of a contiguous tensor as it is, anything else
    copied (strides are not part of a call signature, so the runner checks this per call; it costs a stride
    look-up)."""
    if x2.is_contiguous():
        return x2
    k, _ = x2.shape
    s0, s1 = x2.stride()
    return x2 if (s0 == 1 and s1 == k) else x2.contiguous()


def environment(device, group) -> tuple[Verdict, str | None, str, int]:
    """(verdict, product family, hcom name, world size) of ``device`` and ``group`` (None: the default group);
    imports torch_npu only for an NPU device."""
    import torch.distributed as dist

    if device.type != "npu":
        return _no(f"tensors are on {device.type!r}; MC2 kernels run on Ascend NPUs"), None, "", 1
    import torch
    import torch_npu

    if not (dist.is_available() and dist.is_initialized()):
        return _no("no initialised torch.distributed process group"), None, "", 1
    group = group if group is not None else dist.group.WORLD
    if str(dist.get_backend(group)) != "hccl":
        return _no(f"the process group uses {dist.get_backend(group)!r}; MC2 needs HCCL"), None, "", 1
    family = product_family(torch.npu.get_device_name(device))
    rank = dist.get_rank(group)
    hcom = group._get_backend(torch.device("npu")).get_hccl_comm_name(rank)
    del torch_npu
    return Verdict(True, "npu device, HCCL group"), family, hcom, dist.get_world_size(group)
