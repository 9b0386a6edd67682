"""Optional native lowering of whole fused ops to torch's symmetric-memory kernels.

The ops reach it through the plugin contract: ``commfuse.all_gather_matmul``
and ``matmul_reduce_scatter`` with ``algorithm="native"`` or ``"auto"`` ask
:meth:`CudaBackend.native_op <commfuse_cuda.backend.CudaBackend.native_op>`
once per call signature, which judges the call with the verdicts below and
returns a runner built on :func:`call_fused_all_gather_matmul` /
:func:`call_fused_matmul_reduce_scatter`.

torch ships ``torch.ops.symm_mem.fused_all_gather_matmul`` and
``fused_matmul_reduce_scatter``: micro-pipelined all-gather + GEMM and GEMM +
reduce-scatter over symmetric memory (NVLink peers). Where they exist and a
call qualifies, ``"native"`` runs them with the same meaning as the ring;
otherwise ``"native"`` raises with the reason and ``"auto"`` runs the ring.

Qualification has two halves, each a pure function tested on CPU tensors:

* the call (:func:`all_gather_matmul_verdict`, :func:`matmul_reduce_scatter_verdict`):
  ranks, dims, shapes, dtypes, devices, autograd, divisibility;
* the environment (:func:`environment_verdict` over :class:`Environment` facts
  from :func:`probe_environment`): a CUDA device, the op registered with a
  CUDA kernel, an NCCL process group, and the user's opt-in
  (``CudaBackend(enable_native=True)`` or ``COMMFUSE_CUDA_NATIVE=1``). It is
  opt-in because the kernels need every rank of the group to map the others'
  memory (one NVLink domain), which no API answers cheaply; off it,
  ``"native"`` fails instead of falling back.

UNVERIFIED here: the kernels themselves need GPUs. What the CPU tests prove
is the decision logic and the argument/result mapping, the latter by running
the mapping with torch's own reference implementation of the same op schema
(``_fused_all_gather_matmul_fallback``, which torch uses in its test mode) on
gloo ranks.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

#: dtypes the fused kernels are used for (their GEMMs run through aten.mm on CUDA).
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ENV = "COMMFUSE_CUDA_NATIVE"


@dataclass(frozen=True)
class Verdict:
    """Whether a call qualifies for a native kernel, and why (or why not)."""

    ok: bool
    reason: str

    def __bool__(self) -> bool:
        return self.ok


def _no(reason: str) -> Verdict:
    return Verdict(False, reason)


def _common(tensors: Sequence[tuple[str, torch.Tensor]], world_size: int) -> Verdict | None:
    if world_size < 2:
        return _no(f"world size {world_size}: nothing to communicate")
    first_name, first = tensors[0]
    for name, t in tensors:
        if t.dtype not in DTYPES:
            return _no(f"{name} has dtype {t.dtype}; the fused kernels are used for {', '.join(map(str, DTYPES))}")
        if t.dtype != first.dtype:
            return _no(f"{name} has dtype {t.dtype} but {first_name} has {first.dtype}")
        if t.device != first.device:
            return _no(f"{name} is on {t.device} but {first_name} is on {first.device}")
        if t.requires_grad and torch.is_grad_enabled():
            return _no(f"{name} requires grad and the symmetric-memory ops have no autograd formula")
    return None


def all_gather_matmul_verdict(
    a_shard: torch.Tensor,
    bs: Sequence[torch.Tensor],
    *,
    gather_dim: int,
    world_size: int,
    gathered_size: int | None = None,
) -> Verdict:
    """Whether ``all_gather_matmul(a_shard, bs, gather_dim=...)`` maps onto ``fused_all_gather_matmul``."""
    if a_shard.ndim < 2:
        return _no(f"a_shard has {a_shard.ndim} dims; the fused op needs at least 2")
    if not bs:
        return _no("no weights given")
    for i, b in enumerate(bs):
        if b.ndim != 2:
            return _no(f"b[{i}] has {b.ndim} dims; the fused op needs 2-D weights")
    bad = _common([("a_shard", a_shard)] + [(f"b[{i}]", b) for i, b in enumerate(bs)], world_size)
    if bad is not None:
        return bad
    if not -a_shard.ndim <= gather_dim < a_shard.ndim:
        return _no(f"gather_dim {gather_dim} is out of range for a_shard with {a_shard.ndim} dims")
    gd = gather_dim % a_shard.ndim
    length = a_shard.shape[gd]
    if gathered_size is not None and gathered_size != length * world_size:
        return _no(
            f"uneven shards: the gathered size {gathered_size} along dim {gd} is not {world_size} x {length}; "
            "the fused op gathers equal shards"
        )
    contraction = gd == a_shard.ndim - 1
    k = length * world_size if contraction else a_shard.shape[-1]
    for i, b in enumerate(bs):
        if b.shape[0] != k:
            return _no(f"b[{i}] has {b.shape[0]} rows but the gathered a has K = {k}")
    where = "the contraction dim" if contraction else f"dim {gd}"
    return Verdict(True, f"all-gather along {where} of {world_size} equal shards into {len(bs)} GEMM(s)")


def matmul_reduce_scatter_verdict(
    a: torch.Tensor, b: torch.Tensor, *, scatter_dim: int, world_size: int, reduce_op: str = "sum"
) -> Verdict:
    """Whether ``matmul_reduce_scatter(a, b, scatter_dim=...)`` maps onto ``fused_matmul_reduce_scatter``."""
    if a.ndim < 2:
        return _no(f"a has {a.ndim} dims; the fused op needs at least 2")
    if b.ndim != 2:
        return _no(f"b has {b.ndim} dims; the fused op needs a 2-D weight")
    bad = _common([("a", a), ("b", b)], world_size)
    if bad is not None:
        return bad
    if a.shape[-1] != b.shape[0]:
        return _no(f"a has K = {a.shape[-1]} columns but b has {b.shape[0]} rows")
    if reduce_op not in ("sum", "avg"):
        return _no(f"reduce_op {reduce_op!r}: the fused op reduces with sum or avg")
    out_shape = [*a.shape[:-1], b.shape[1]]
    if not -len(out_shape) <= scatter_dim < len(out_shape):
        return _no(f"scatter_dim {scatter_dim} is out of range for an output with {len(out_shape)} dims")
    sd = scatter_dim % len(out_shape)
    if out_shape[sd] % world_size:
        return _no(
            f"the output's dim {sd} has size {out_shape[sd]}, which world size {world_size} does not divide; "
            "the fused op scatters equal shards"
        )
    return Verdict(True, f"GEMM + {reduce_op} reduce-scatter along dim {sd} into {world_size} equal shards")


@dataclass(frozen=True)
class Environment:
    """What must hold outside the call for the native kernels to run."""

    device_type: str
    op_registered: bool  # torch.ops.symm_mem.<op> exists with a CUDA kernel
    group_backend: str  # "nccl", "gloo", ... ("" when there is no group)
    enabled: bool  # the user opted in (CudaBackend(enable_native=True) or COMMFUSE_CUDA_NATIVE=1)
    torch_version: str = ""


def environment_verdict(env: Environment, op: str) -> Verdict:
    if not env.enabled:
        return _no(
            f"native kernels are off (opt in with {ENV}=1 or CudaBackend(enable_native=True) when all ranks share "
            "an NVLink domain)"
        )
    if env.device_type != "cuda":
        return _no(f"tensors are on {env.device_type!r}, and torch's symmetric-memory kernels run on CUDA devices")
    if not env.op_registered:
        return _no(f"torch {env.torch_version} has no CUDA kernel for torch.ops.symm_mem.{op}")
    if env.group_backend != "nccl":
        return _no(f"the process group uses {env.group_backend or 'no backend'!r}; symmetric memory needs NCCL")
    return Verdict(True, f"torch.ops.symm_mem.{op} on an NCCL group")


def _has_cuda_kernel(op: str) -> bool:
    try:
        import torch.distributed._symmetric_memory  # noqa: F401 - registers the symm_mem ops
    except Exception:  # noqa: BLE001 - a torch without it simply has no native path
        return False
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(f"symm_mem::{op}", "CUDA"))
    except RuntimeError:  # the op is not registered at all
        return False


def probe_environment(device: torch.device, group, op: str, enable: bool | None) -> Environment:
    import torch.distributed as dist

    if enable is None:
        enable = os.environ.get(ENV, "0").strip().lower() in ("1", "true", "yes", "on")
    backend = ""
    if dist.is_available() and dist.is_initialized():
        try:
            backend = str(dist.get_backend(group))
        except (RuntimeError, ValueError):
            backend = ""
    return Environment(device.type, _has_cuda_kernel(op), backend, bool(enable), torch.__version__)


def _group_name(group) -> str:
    """The c10d name the symm_mem ops take: of ``group`` (None: the default group), or ``group`` itself when it
    is already a name (what :meth:`CudaBackend.native_op <commfuse_cuda.backend.CudaBackend.native_op>` resolves
    once per call signature, so its runners skip this look-up)."""
    if isinstance(group, str):
        return group
    import torch.distributed as dist

    return (group if group is not None else dist.group.WORLD).group_name


def call_fused_all_gather_matmul(op: Callable, a_shard, bs, gather_dim: int, group, return_gathered: bool):
    """Run ``op`` (the schema of ``symm_mem.fused_all_gather_matmul``) and shape its result like commfuse's op.

    ``group``: a process group, None (the default group) or its c10d name. Returns
    ``(gathered or None, [a @ b for b in bs])``.
    """
    gd = gather_dim % a_shard.ndim
    gathered, outs = op(a_shard, list(bs), gd, _group_name(group), return_A=return_gathered)
    return (gathered if return_gathered else None), list(outs)


def call_fused_matmul_reduce_scatter(op: Callable, a, b, scatter_dim: int, reduce_op: str, group):
    """Run ``op`` (the schema of ``symm_mem.fused_matmul_reduce_scatter``)."""
    return op(a, b, reduce_op, scatter_dim % a.ndim, _group_name(group))
