"""What the fused matmul blocks share: the argument checks every op uses, a backend's native kernel
(:func:`native_kernel`), the plan of a signature a backend runs whole (:class:`HandedWholePlan`) and where
weight gradients go while they are deferred (:data:`WGRAD_SINK`).

Each block is whole in its own module: :mod:`commfuse.fused.all_gather_matmul` and
:mod:`commfuse.fused.matmul_reduce_scatter` (planner, plan class, forward, backward and autograd Function).
The public ops (``commfuse.ops``) and their ``torch.library`` forms (``commfuse.library``) both find their
entries in the planning table, under keys that begin with the op's name (the library's then say ``"op"``), so
an eager call and a compiled one never share an entry. The attention blocks import their checks from here too.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import torch

from commfuse.errors import CommfuseTypeError, CommfuseValueError
from commfuse.planning.derive import capped
from commfuse.schedule import parse_algorithm

__all__ = [
    "WGRAD_SINK", "HandedWholePlan", "add_deferred", "check_dim", "check_same", "check_tensor", "deferred_sink",
    "flat_rows", "grad_wanted", "is_dtensor", "native_kernel", "report_taken",
]

log = logging.getLogger("commfuse")


def check_tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise CommfuseTypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if type(value) is not torch.Tensor and is_dtensor(value):
        raise CommfuseTypeError(
            f"{name} is a DTensor (placements {tuple(value.placements)} on {value.device_mesh}): commfuse's "
            f"functional ops take this rank's local shard; pass {name}.to_local(), or parallelize the module "
            f"with commfuse.tp's styles, which take DTensors"
        )
    return value


def is_dtensor(value) -> bool:
    """Whether ``value`` is a DTensor (without importing torch.distributed.tensor when nothing has)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def check_dim(name: str, dim, ndim: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise CommfuseTypeError(f"{name} must be an int, got {dim!r}")
    if not -ndim <= dim < ndim:
        raise CommfuseValueError(f"{name}={dim} is out of range for a tensor with {ndim} dims")
    return dim % ndim


def check_same(name: str, tensors: Sequence[tuple[str, torch.Tensor]], config: tuple | None = None) -> None:
    """One dtype and one device for ``tensors``; a fused GEMM's mixed dtypes are refused as torch's matmul
    refuses them outside autocast, in the words of the layer (``config``'s name) when a layer called."""
    first_name, first = tensors[0]
    for other_name, t in tensors[1:]:
        if t.dtype != first.dtype:
            if config is not None:
                raise CommfuseValueError(
                    f"{config[0]}: its input has dtype {first.dtype} but its weight has {t.dtype} ({name}'s "
                    f"{first_name} and {other_name}); torch's nn.Linear and tensor-parallel styles refuse mixed "
                    "dtypes too (mat1 and mat2 must have the same dtype): run the model under torch.autocast, "
                    "which casts both to its dtype, or cast the input or the module to one dtype"
                )
            raise CommfuseValueError(
                f"{name}: {other_name} has dtype {t.dtype} but {first_name} has {first.dtype}; torch.matmul "
                "refuses mixed dtypes too: cast one to the other's dtype, or call it under torch.autocast, which "
                "casts both to its dtype"
            )
        if t.device != first.device:
            raise CommfuseValueError(f"{name}: {other_name} is on {t.device} but {first_name} is on {first.device}")


def grad_wanted(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def report_taken(report: dict | None, call, rows: int, label: str) -> None:
    """Let ``report`` say what the plan runs: ``call``'s algorithm as :func:`capped` leaves it for shards whose
    smallest has ``rows`` along the dim (the planning code caps with the same helper)."""
    if report is None or call is None:
        return
    taken = capped(call, rows, label)
    if taken is not call:
        report.update(algorithm=taken.spec.shown, reason=taken.reason)


def native_kernel(be, op: str, algorithm, taken: dict, **signature):
    """The backend's own fused kernel for this call signature, if it declares ``op`` and the call qualifies
    (``algorithm`` "native" or "auto"); else None. Returns (runner or None, the algorithm the ring takes:
    ``auto``'s own choice when the kernel is taken, since a call that wants gradients still runs the ring).

    "native" that does not qualify raises, naming why; autograd never takes the kernel (it has none).
    """
    spec = parse_algorithm(algorithm)
    if spec.name not in ("native", "auto"):
        return None, algorithm
    fallback = "auto"
    caps = getattr(be, "capabilities", None)
    declared = be is not None and op in getattr(caps, "native_fused_ops", ()) and hasattr(be, "native_op")
    if be is None or be.world_size == 1 or not declared:
        if spec.name == "native":
            what = "no backend (a single process)" if be is None else (
                f"backend {getattr(be, 'name', be)!r} declares no native {op}")
            raise CommfuseValueError(f"algorithm 'native' for {op}: {what}; use ring, bidirectional or auto")
        return None, algorithm
    runner, reason = be.native_op(op, **signature)
    if runner is None:
        if spec.name == "native":
            raise CommfuseValueError(f"algorithm 'native' for {op}: the call does not qualify: {reason}")
        return None, algorithm
    taken.update(algorithm="native", reason=reason, world_size=be.world_size)
    if spec.name == "auto":
        log.debug("auto chose native for %s: %s [world size %d, backend %r declares it in native_fused_ops and its "
                  "native_op accepted this signature; a call that wants gradients runs auto's ring-side choice]",
                  op, reason, be.world_size, getattr(be, "name", type(be).__name__))

    def run(*tensors):
        if torch.is_grad_enabled() and any(t.requires_grad for t in _flat_tensors(tensors)):
            if spec.name == "native":
                raise CommfuseValueError(
                    f"algorithm 'native' for {op}: the backend's fused kernel has no backward; run it under "
                    "torch.no_grad() or take 'auto' (which runs the ring when gradients are wanted)")
            return None
        return runner(*tensors)

    return run, fallback


def _flat_tensors(items):
    for item in items:
        if isinstance(item, torch.Tensor):
            yield item
        else:
            yield from item


class HandedWholePlan:
    """The plan of a signature whose backend runs ``op`` whole (``Capabilities.whole_ops``): every call hands
    the backend's ``run_op`` the op's two tensors, by the names in ``tensors``, and the signature's
    ``options``. It plans no ring, so it has no ``call``, ``sizes``, ``gd`` or fast path."""

    __slots__ = ("backend", "op", "tensors", "options", "report")

    #: what the fused matmul ops' plans carry beside their runner, none of which a whole op has
    resolved = call = sizes = gd = one_weight_no_grad = None
    plans = ()

    def __init__(self, *, backend, op: str, tensors: tuple[str, str], options: dict) -> None:
        self.backend, self.op, self.tensors, self.options = backend, op, tensors, options
        self.report = {"algorithm": "whole", "reason": f"handed whole to backend {getattr(backend, 'name', backend)!r}"}

    def __call__(self, a, b):
        first, second = self.tensors
        return self.backend.run_op(self.op, **{first: a, second: b}, **self.options)


# -- weight gradients, deferred or not -------------------------------------------------------------------------


def flat_rows(t: torch.Tensor) -> torch.Tensor:
    """All leading dims folded into rows: (..., C) -> (rows, C)."""
    return t.reshape(-1, t.shape[-1])


#: Where weight gradients go while they are deferred (``commfuse.strands``, as Zero Bubble pipelines split a
#: backward into its input and weight halves). While this list holds a callable, the backward of
#: ``all_gather_matmul`` (with the gathered input kept) and of ``matmul_reduce_scatter`` hands it each
#: weight-gradient GEMM as a closure (:func:`add_deferred`), instead of running it in the ring's step, and
#: returns no gradient for that weight to autograd: the closure adds into the weight's ``.grad`` itself. Only
#: for a leaf weight without gradient hooks (DDP's and FSDP's hooks must see their gradients), saved without
#: saved-tensor hooks: under activation checkpointing (or offloading) the weight a backward unpacks is a new
#: tensor that only shares the parameter's gradient accumulator, whose ``.grad`` nobody reads. Any other
#: weight's gradient is computed in the ring as always.
WGRAD_SINK: list = []


def deferred_sink(weight: torch.Tensor):
    """The sink a weight gradient of ``weight`` goes to, or None (computed now)."""
    if not WGRAD_SINK or not (weight.is_leaf and weight.requires_grad):
        return None
    if weight._backward_hooks or getattr(weight, "_post_accumulate_grad_hooks", None):
        return None
    return WGRAD_SINK[-1]


def add_deferred(sink, weight: torch.Tensor, x: torch.Tensor, dy: torch.Tensor) -> None:
    """Hand ``sink`` the GEMM ``weight.grad += x^T @ dy``, to run later."""
    sink(lambda: _add_grad(weight, x, dy))


def _add_grad(weight: torch.Tensor, x: torch.Tensor, dy: torch.Tensor) -> None:
    """``weight.grad += x^T @ dy`` (rows folded), as autograd's accumulation would leave it."""
    with torch.no_grad():
        g = (flat_rows(x).t() @ flat_rows(dy)).to(weight.dtype)
        if weight.grad is None:
            weight.grad = g
        else:
            weight.grad.add_(g)
