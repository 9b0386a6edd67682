"""The records a backend plugin hands to commfuse: frozen, validated on creation.

A plugin yields :class:`BackendSpec` records from its ``commfuse_backends`` hook.
Every field is checked in ``__post_init__`` so a malformed record fails where it
is made, with a message that names the field and the bad value, instead of
somewhere deep in the executor later. Sequences given as lists are stored as
tuples so the records stay hashable and immutable.

Nothing here imports torch; :meth:`BackendSpec.matches` does so lazily, and only
for the generic ``"accelerator"`` device type.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from commfuse.errors import CommfuseTypeError, PluginError
from commfuse.schedule import Collective

#: How a backend runs a schedule: step by step from Python, or traced into a graph (XLA).
EXECUTIONS = ("eager", "traced")
#: The whole collectives a backend may support natively.
COLLECTIVES = tuple(c.value for c in Collective if c.transport is c)
#: The ops that ask a backend for its own fused kernel (``native_op``), when declared in ``native_fused_ops``.
NATIVE_FUSED_OPS = ("all_gather_matmul", "matmul_reduce_scatter")
#: The ops a backend may run whole, inside its own graph (``run_op``), when declared in ``whole_ops``.
WHOLE_OPS = ("all_gather_matmul", "matmul_reduce_scatter", "all_gather_consume", "produce_reduce_scatter",
             "all_to_all_consume", "ring_attention")
#: The device type that stands for whatever non-CPU device ``torch.accelerator`` reports.
ACCELERATOR = "accelerator"

# Backend names, device types and fused-op names: lowercase identifiers.
_IDENTIFIER = re.compile(r"[a-z][a-z0-9_]*\Z")


def _check_type(owner: str, field: str, value: object, kind: type | tuple[type, ...], what: str) -> None:
    # bool is an int subclass: an int field must not silently accept True.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise CommfuseTypeError(f"{owner}.{field} must be {what}, got {type(value).__name__} {value!r}")


def _str_tuple(owner: str, field: str, value: object) -> tuple[str, ...]:
    """``value`` as a tuple of strings; a bare string is refused (("cpu",), not "cpu")."""
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise CommfuseTypeError(
            f"{owner}.{field} must be a tuple of strings, got {type(value).__name__} {value!r}"
            + (f" (write ({value!r},) for a single entry)" if isinstance(value, str) else "")
        )
    items = tuple(value)
    for item in items:
        if not isinstance(item, str):
            raise CommfuseTypeError(
                f"{owner}.{field} must hold only strings, got {type(item).__name__} {item!r} in {items!r}"
            )
    return items


def _identifiers(owner: str, field: str, items: tuple[str, ...]) -> None:
    for item in items:
        if not _IDENTIFIER.match(item):
            raise PluginError(
                f"{owner}.{field} entries must be lowercase identifiers (a-z, 0-9, _; starting with a letter), "
                f"got {item!r} in {items!r}"
            )
    if len(set(items)) != len(items):
        raise PluginError(f"{owner}.{field} lists an entry twice: {items!r}")


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do; commfuse reads these, never the vendor name.

    A declared capability is a promise: each field's comment names what in
    commfuse reads it and what it does with it. The defaults describe the most
    modest backend: host-driven, one stream, one link direction at a time, no
    native fused kernels, no claim of overlap, not capturable in a device graph.
    """

    #: Both directions of a link are usable at once (the bidirectional ring would pay off).
    #: Read by: auto's policy with a hardware profile (``commfuse.sim.plan``): bidirectional is a candidate
    #: only for backends that declare this. ``algorithm="bidirectional"`` asked for explicitly runs anyway;
    #: auto without a profile picks ring or vanilla only.
    bidirectional_links: bool = False
    #: Fused collective+GEMM kernels the backend has, among :data:`NATIVE_FUSED_OPS`.
    #: Read by: ``commfuse.ops`` (``_native``): for an op listed here, when ``algorithm`` is "native" or
    #: "auto", the backend's ``native_op(op, **signature)`` is asked once per call signature
    #: (``commfuse.runtime.protocol``); without ``native_op`` the entry is ignored and "native" raises.
    native_fused_ops: tuple[str, ...] = ()
    #: "eager" (the executor walks the steps) or "traced" (the schedule is lowered into a graph).
    #: Read by: the executor (``Plan``): a traced backend's calls skip the fingerprint check, which would
    #: have to compare values on the host in the middle of a trace.
    execution: str = "eager"
    #: Communication runs on its own stream, ordered against compute by the backend.
    #: Read by: ``commfuse.runtime.c10d.C10dBackend`` (and its subclasses): on a non-CPU device a wait is then
    #: stream-ordered (``work.wait()`` without a timeout: the host does not block) and the watchdog keeps
    #: the timeout; otherwise the host blocks in ``work.wait(timeout)``.
    streams: bool = False
    #: Whole collectives the backend supports natively.
    #: Read by: ``commfuse.planning.calls`` (``_check_collective``): ``vanilla`` and ``sliced`` raise, naming
    #: the algorithms that work, for a collective missing here.
    collectives: tuple[str, ...] = COLLECTIVES
    #: Transfers make progress while the host computes (or the device overlaps them with compute).
    #: Read by: auto's policy (``commfuse.planning.calls.choose_algorithm``): an eager backend that does not
    #: declare it gets ``vanilla`` from ``auto``, since its hops would add up behind the compute instead of
    #: hiding. (A traced backend's overlap is its compiler's, so ``execution="traced"`` is not affected.)
    overlap: bool = False
    #: Without a hardware profile, ``algorithm="auto"`` takes ``vanilla`` when one ring hop would carry fewer
    #: bytes than this: below it the backend's whole collective costs less than N - 1 hops. None: the ops'
    #: default, ``commfuse.ops.MIN_SLICE_BYTES``; 0: the ring at every size.
    #: Read by: ``commfuse.planning.calls.choose_algorithm`` (auto's policy).
    auto_min_slice_bytes: int | None = None
    #: The backend's planned calls (every call of a signature after its first) do no host sync and allocate
    #: from the device's caching allocator, so they can be captured in a device graph and replayed
    #: (``torch.cuda.graph``, ``torch.cuda.make_graphed_callables``, ``torch.compile(mode="reduce-overhead")``).
    #: Read by: ``commfuse.graphs.capture``, which refuses a backend that does not declare it, and the
    #: conformance suite's capture tier (``commfuse.testing.suite.CaptureTests``), which runs only where it is
    #: declared and checks replays against eager calls.
    capturable: bool = False
    #: Ops the backend runs whole, in its own graph, among :data:`WHOLE_OPS`: a traced backend whose ranks run
    #: one program, so that the rank is a value of the graph and not a Python int (the JAX lowering, where it
    #: is the device's ``axis_index``), and commfuse's step loop, which needs the rank as an int, cannot walk.
    #: Read by: ``commfuse.ops`` and ``commfuse.fused.matmul``: a call of an op listed here, on tensors of
    #: this backend's device, is handed to the backend's ``run_op(op, **arguments)``
    #: (``commfuse.runtime.protocol``) with the public op's arguments, and what it returns is the op's result.
    #: Such a backend's tensors are a tensor subclass (torchax's, for the JAX lowering): the ops ask only for
    #: a call whose tensors are not plain ``torch.Tensor`` (``produce_reduce_scatter`` without ``inputs``:
    #: always), so a plain tensor's call pays one type check (the matmul ops decide once per signature).
    #: Read by ``commfuse.backends.resolve`` too: with no group and no torch.distributed, a backend that
    #: declares whole ops is taken for tensors of its own device type (its ranks come from its runtime).
    whole_ops: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("bidirectional_links", "streams", "overlap", "capturable"):
            _check_type("Capabilities", name, getattr(self, name), bool, "a bool")
        limit = self.auto_min_slice_bytes
        if limit is not None:
            _check_type("Capabilities", "auto_min_slice_bytes", limit, int, "an int or None")
            if isinstance(limit, bool) or limit < 0:
                raise PluginError(f"Capabilities.auto_min_slice_bytes must be an int >= 0 or None, got {limit!r}")
        fused = _str_tuple("Capabilities", "native_fused_ops", self.native_fused_ops)
        _identifiers("Capabilities", "native_fused_ops", fused)
        for op in fused:
            if op not in NATIVE_FUSED_OPS:
                raise PluginError(
                    f"Capabilities.native_fused_ops entries must be among {NATIVE_FUSED_OPS} (the ops that ask a "
                    f"backend's native_op), got {op!r} in {fused!r}"
                )
        object.__setattr__(self, "native_fused_ops", fused)
        _check_type("Capabilities", "execution", self.execution, str, "a string")
        if self.execution not in EXECUTIONS:
            raise PluginError(f"Capabilities.execution must be one of {EXECUTIONS}, got {self.execution!r}")
        collectives = _str_tuple("Capabilities", "collectives", self.collectives)
        for c in collectives:
            if c not in COLLECTIVES:
                raise PluginError(
                    f"Capabilities.collectives entries must be among {COLLECTIVES}, got {c!r} in {collectives!r}"
                )
        if len(set(collectives)) != len(collectives):
            raise PluginError(f"Capabilities.collectives lists an entry twice: {collectives!r}")
        object.__setattr__(self, "collectives", collectives)
        whole = _str_tuple("Capabilities", "whole_ops", self.whole_ops)
        _identifiers("Capabilities", "whole_ops", whole)
        for op in whole:
            if op not in WHOLE_OPS:
                raise PluginError(
                    f"Capabilities.whole_ops entries must be among {WHOLE_OPS} (the ops that hand a call to a "
                    f"backend's run_op), got {op!r} in {whole!r}"
                )
        if whole and self.execution != "traced":
            raise PluginError(
                f"Capabilities.whole_ops {whole!r} needs execution='traced': an eager backend's ranks are Python "
                "ints, and commfuse's step loop runs its ops"
            )
        object.__setattr__(self, "whole_ops", whole)


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run on this machine, and if not, why and what to do about it."""

    ok: bool
    #: Why the backend cannot run; empty when ``ok``.
    reason: str = ""
    #: What the user can do to make it run; empty when ``ok``.
    fix: str = ""
    #: When ``ok``: what it would use here (e.g. "cuda devices with nccl"); informational.
    detail: str = ""

    def __post_init__(self) -> None:
        _check_type("Availability", "ok", self.ok, bool, "a bool")
        for name in ("reason", "fix", "detail"):
            _check_type("Availability", name, getattr(self, name), str, "a string")
        if self.ok and (self.reason or self.fix):
            raise PluginError(f"Availability.reason and .fix must be empty when ok, got reason={self.reason!r}")
        if not self.ok and not self.reason:
            raise PluginError("Availability.reason must say why when ok is False, got an empty reason")

    @classmethod
    def yes(cls, detail: str = "") -> Availability:
        return cls(True, detail=detail)

    @classmethod
    def no(cls, reason: str, fix: str = "") -> Availability:
        return cls(False, reason=reason, fix=fix)


@dataclass(frozen=True)
class BackendSpec:
    """One backend as a plugin announces it: what it runs on, what it can do, how to make one.

    ``check`` says whether the backend can run here; it is expected never to
    raise, and the plugin manager turns an exception into ``Availability.no``
    anyway. ``factory(group=None, device=None)`` returns the backend object.
    Both should import torch and vendor packages lazily, inside the call.
    """

    #: Lowercase identifier that users pass to ``commfuse.backends.get(name)``.
    name: str
    #: torch device types it runs on, e.g. ("cuda",); "accelerator" = whatever ``torch.accelerator`` reports.
    device_types: tuple[str, ...]
    capabilities: Capabilities
    check: Callable[[], Availability]
    factory: Callable[..., object]
    #: One line for listings (``commfuse backends``).
    description: str
    #: Higher wins when several available backends handle one device type.
    priority: int = 0
    #: How to install this backend's distribution or its requirements.
    install_hint: str = ""
    #: The distribution the spec came from; the plugin manager fills it in.
    distribution: str = "commfuse"

    def __post_init__(self) -> None:
        _check_type("BackendSpec", "name", self.name, str, "a string")
        if not _IDENTIFIER.match(self.name):
            raise PluginError(
                f"BackendSpec.name must be a lowercase identifier (a-z, 0-9, _; starting with a letter), "
                f"got {self.name!r}"
            )
        device_types = _str_tuple("BackendSpec", "device_types", self.device_types)
        if not device_types:
            raise PluginError(f"BackendSpec.device_types of backend {self.name!r} must name at least one device type")
        _identifiers("BackendSpec", "device_types", device_types)
        object.__setattr__(self, "device_types", device_types)
        _check_type("BackendSpec", "capabilities", self.capabilities, Capabilities, "a Capabilities")
        for name in ("check", "factory"):
            value = getattr(self, name)
            if not callable(value):
                raise CommfuseTypeError(f"BackendSpec.{name} must be callable, got {type(value).__name__} {value!r}")
        _check_type("BackendSpec", "description", self.description, str, "a string")
        if not self.description.strip():
            raise PluginError(f"BackendSpec.description of backend {self.name!r} must not be empty")
        _check_type("BackendSpec", "priority", self.priority, int, "an int")
        _check_type("BackendSpec", "install_hint", self.install_hint, str, "a string")
        _check_type("BackendSpec", "distribution", self.distribution, str, "a string")

    def matches(self, device_type: str) -> bool:
        """Whether this backend handles devices of ``device_type`` (e.g. "cpu", "cuda")."""
        if device_type in self.device_types:
            return True
        if ACCELERATOR not in self.device_types or device_type == "cpu":
            return False
        return device_type == _current_accelerator_type()


def _current_accelerator_type() -> str | None:
    """The device type ``torch.accelerator`` reports here, or None (no accelerator, or torch < 2.6)."""
    try:
        import torch

        device = torch.accelerator.current_accelerator()
    except Exception:  # noqa: BLE001 - a broken torch means no accelerator, not a crash in matching
        return None
    return None if device is None else device.type
