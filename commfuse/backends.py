"""Pick a backend: by name, or by the device the tensors live on.

Every backend, built-in or installed, arrives through the plugin system
(:mod:`commfuse.plugins`). ``get(device=...)`` takes, among the available
backends that handle the device type, the one with the highest priority, so an
installed vendor plugin (``commfuse-cuda``) wins over the generic
``accelerator`` path for the same device.

Asking for a backend that is not installed, or cannot run here, raises
:class:`~commfuse.errors.BackendUnavailableError` saying what to install or fix.
torch is imported only when a device has to be looked at or a backend made.
"""

from __future__ import annotations

import difflib
import os
import sys
from typing import TYPE_CHECKING

from commfuse.errors import BackendUnavailableError, CommfuseTypeError, CommfuseValueError
from commfuse.planning import table
from commfuse.plugins import manager
from commfuse.plugins.types import ACCELERATOR, Availability, BackendSpec

if TYPE_CHECKING:  # pragma: no cover
    import torch

#: Vendor backends commfuse knows of but does not ship, by backend name -> distribution.
#: Each serves the device type of its own name. Used only to say how to install them.
KNOWN_BACKENDS = {
    "cuda": "commfuse-cuda",
    "npu": "commfuse-npu",
    "xla": "commfuse-xla",
}

__all__ = [
    "KNOWN_BACKENDS", "availability", "available", "forget_destroyed", "fresh", "get", "install_hint", "on_release",
    "plan_bytes", "plan_usage", "process_group", "refuse_destroyed", "release", "resolve", "spec", "specs",
    "whole_op",
]


def specs() -> list[BackendSpec]:
    """Every backend found, sorted by name, whether or not it can run here."""
    return list(manager.backend_specs().values())


def spec(name: str) -> BackendSpec:
    """The spec of the installed backend ``name``; raises ``BackendUnavailableError`` saying how to install it."""
    if not isinstance(name, str):
        raise CommfuseTypeError(f"backend name must be a string, got {type(name).__name__} {name!r}")
    found = manager.backend_specs()
    if name in found:
        return found[name]
    message = f"no commfuse backend named {name!r} is installed (installed: {', '.join(found) or 'none'})"
    hint = install_hint(name)
    if hint:
        message += f"; to install it: {hint}"
    else:
        close = difflib.get_close_matches(name, list(found) + list(KNOWN_BACKENDS), n=1)
        if close:
            message += f"; did you mean {close[0]!r}?"
    raise BackendUnavailableError(message)


def install_hint(name: str) -> str:
    """How to install the known vendor backend ``name``, or "" when commfuse does not know it."""
    distribution = KNOWN_BACKENDS.get(name)
    if distribution is None:
        return ""
    return f"pip install {distribution} (or pip install -e backends/{name} from a checkout)"


def availability(name: str) -> Availability:
    """Whether the installed backend ``name`` can run here (checked once per discovery)."""
    return manager.registry().availability(spec(name))


def available() -> list[str]:
    """Names of the backends that can run here, sorted."""
    registry = manager.registry()
    return [name for name, s in registry.specs.items() if registry.availability(s).ok]


def get(name: str | None = None, device: object = None, *, group: object = None) -> object:
    """A backend object, chosen by ``name`` or by ``device``.

    ``device`` is a ``torch.device``, a device string ("cpu", "cuda:1") or a
    tensor (its ``.device``). With a name, the device (if any) must be one the
    backend handles; without one, the available backend of highest priority
    for the device type is taken (ties broken by name), and with neither the
    device type is "cpu". The factory gets ``group`` and the device as a
    ``torch.device``, or ``None`` when the caller gave no device.
    """
    registry = manager.registry()
    if name is not None:
        chosen = spec(name)
        avail = registry.availability(chosen)
        if not avail.ok:
            message = f"backend {name!r} (from {chosen.distribution!r}) is installed but cannot run here"
            fix = f"; to fix: {avail.fix}" if avail.fix else ""
            raise BackendUnavailableError(f"{message}: {avail.reason}{fix}")
        if device is not None and not chosen.matches(_device_type(device)):
            raise BackendUnavailableError(
                f"backend {name!r} runs on device types {chosen.device_types}, not on {_device_type(device)!r} "
                f"(device {device!r})"
            )
        return _made(chosen, group, device)

    device_type = _device_type("cpu" if device is None else device)
    candidates = sorted(
        (s for s in registry.specs.values() if s.matches(device_type)), key=lambda s: (-s.priority, s.name)
    )
    for candidate in candidates:
        if registry.availability(candidate).ok:
            return _made(candidate, group, device)
    raise BackendUnavailableError(_no_backend_message(device_type, registry))


def _made(chosen: BackendSpec, group, device):
    """Call the factory; the backend object carries its spec's name and capabilities unless it sets its own."""
    backend = chosen.factory(group=group, device=_torch_device(device))
    if getattr(backend, "capabilities", None) is None:
        try:
            backend.capabilities = chosen.capabilities
        except AttributeError:  # a slotted backend without the attribute keeps what it has
            pass
    return backend


def _no_backend_message(device_type: str, registry: manager.Registry) -> str:
    lines = [f"no available commfuse backend handles device type {device_type!r}; considered:"]
    for s in registry.specs.values():
        avail = registry.availability(s)
        if s.matches(device_type):
            why = f"unavailable: {avail.reason}" + (f" (fix: {avail.fix})" if avail.fix else "")
        else:
            why = f"handles device types {', '.join(s.device_types)}, not {device_type!r}"
            if ACCELERATOR in s.device_types:
                # Say what "accelerator" means here, which is the interesting part.
                why += f" ({avail.detail})" if avail.ok else f" (here: {avail.reason})"
        lines.append(f"  - {s.name} (from {s.distribution!r}): {why}")
    known = [n for n in KNOWN_BACKENDS if n == device_type and n not in registry.specs]
    for n in known:
        lines.append(f"a backend for {device_type!r} devices exists: {install_hint(n)}")
    return "\n".join(lines)


def _device_type(device: object) -> str:
    """The device type of a device string, torch.device or tensor; strings need no torch."""
    if isinstance(device, str):
        return device.split(":", 1)[0]
    import torch

    if isinstance(device, torch.Tensor):
        return device.device.type
    if isinstance(device, torch.device):
        return device.type
    raise CommfuseTypeError(
        f"device must be a torch.device, a device string such as 'cpu' or 'cuda:0', or a tensor, "
        f"got {type(device).__name__} {device!r}"
    )


def _torch_device(device: object) -> torch.device | None:
    if device is None:
        return None
    import torch

    if isinstance(device, torch.Tensor):
        return device.device
    if isinstance(device, str):
        try:
            return torch.device(device)
        except (RuntimeError, ValueError) as e:
            raise CommfuseValueError(f"device {device!r} is not a device torch knows: {e}") from None
    return device


# -- the process-wide cache of backend objects the ops use ---------------------------------------------------

def on_release(forget) -> None:
    """Have :func:`release` call ``forget()`` too (a vendor's own per-call state registers here); the same as
    ``commfuse.planning.table.on_forget``."""
    table.on_forget(forget)


#: The default process group commfuse last planned against (see :func:`fresh`), in a list so that it is
#: replaced as one value: None when it planned with no default group (a single process), :data:`_NEVER`
#: when it has planned nothing since it started or was released, :data:`_DESTROYED` when the group it
#: planned against was destroyed and none replaced it.
_NEVER = object()
_DESTROYED = object()
_SEEN: list = [_NEVER]


def fresh() -> None:
    """Forget everything planned (:func:`release`) when torch.distributed's default group is not the one
    commfuse last planned against: it was made after single-process calls, destroyed, or destroyed and made
    again (perhaps with other ranks in other places). Plans, call numbers and fingerprints of calls with
    ``group=None`` then follow the group in place now, never an old one's rank order, and never a
    single-process plan once a group exists. Planning calls it; a repeated call never needs to, since its
    key in the planning table carries the default group (``commfuse.planning.table``)."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")  # not imported: nothing was initialised
    current = getattr(getattr(c10d, "_world", None), "_default_pg", None)
    seen = _SEEN[0]
    if current is seen or (current is None and seen is _DESTROYED):
        return
    if seen is not _NEVER:
        release()
    _SEEN[0] = _DESTROYED if current is None and seen is not None and seen is not _NEVER else current


def process_group(group):
    """``group`` as a ProcessGroup: a ``DeviceMesh`` of one dimension (``mesh["tp"]``) gives its group; a mesh
    of more is refused by name (which of its dims the op runs over is for the caller to say); None and
    anything else come back as they are."""
    if group is None or type(group).__name__ != "DeviceMesh":
        return group

    mesh_module = sys.modules.get("torch.distributed.device_mesh")
    if mesh_module is None or not isinstance(group, mesh_module.DeviceMesh):
        return group
    if group.ndim != 1:
        names = group.mesh_dim_names
        raise CommfuseValueError(
            f"group is a {group.ndim}-D DeviceMesh {tuple(group.shape)}: commfuse runs over one of its dims; pass "
            f"the 1-D sub-mesh of that dim, e.g. mesh[{names[0] if names else '<dim name>'!r}], or its process "
            "group"
        )
    return group.get_group()


def resolve(backend=None, group=None, device=None):
    """The backend object an op call runs on, or None for a single process without torch.distributed.

    ``backend`` is a name, a backend object (returned as it is) or None (the
    one that fits ``device``). Objects are made once per (name, group, device)
    and kept until :func:`release`. With ``group=None`` and no initialised
    process group the call runs as world size 1, unless ``WORLD_SIZE`` > 1
    says the user meant a group, or this process had a default group that
    was destroyed: then this raises instead of giving a wrong, unsharded
    result. A group that was destroyed is refused by name.
    """
    if backend is not None and not isinstance(backend, str):
        return backend
    import torch.distributed as dist

    group = process_group(group)
    fresh()
    if group is None and not (dist.is_available() and dist.is_initialized()):
        size = os.environ.get("WORLD_SIZE", "")
        if size.isdigit() and int(size) > 1:
            raise CommfuseValueError(
                f"WORLD_SIZE={size} says this process is one of {size} ranks, but torch.distributed is not "
                "initialised and no group was given: call torch.distributed.init_process_group(...) first "
                "(running as a single process would give a wrong, unsharded result)"
            )
        if _SEEN[0] is _DESTROYED:
            raise CommfuseValueError(
                "torch.distributed's default process group was destroyed, and no group was given: initialise it "
                "again (torch.distributed.init_process_group(...)) before calling commfuse, or call "
                "commfuse.backends.release() first to run as a single process (running unsharded now would give "
                "a wrong result where the caller meant several ranks)"
            )
        if backend is None:
            backend = _whole_for(device)  # a traced backend's ranks come from its own runtime
            if backend is None:
                return None
    if group is not None:
        refuse_destroyed(group)
    key = ("backend", backend, group if group is not None else dist.group.WORLD, str(device))
    found = table.get(key)
    if found is None:
        forget_destroyed()  # a new group, most often: let go of those destroyed since
        found = table.remember(key, get(backend, device=device, group=group))
    return found


def whole_op(be, op: str) -> bool:
    """Whether backend object ``be`` runs ``op`` whole in its own graph (``Capabilities.whole_ops``)."""
    return be is not None and op in getattr(getattr(be, "capabilities", None), "whole_ops", ())


def _whole_for(device) -> str | None:
    """The name of the available backend that runs whole ops on ``device``'s type, or None: with no group and
    no torch.distributed, such a backend (a traced one, whose ranks are the devices of its own runtime, as in
    a JAX trace) is what the caller means, and world size 1 would be a wrong, unsharded result."""
    if device is None:
        return None
    kind = getattr(device, "type", None)  # a torch.device's, in one read; a tensor's .type is a method
    if not isinstance(kind, str):
        kind = _device_type(device)
    if kind == "cpu":
        return None
    key = ("whole-for", kind)
    found = table.kept(key)
    if found is None:
        found = table.keep(key, _whole_named(kind))
    return found or None


def _whole_named(kind: str) -> str:
    """:func:`_whole_for`'s search of the registry, for the planning table ("": none)."""
    registry = manager.registry()
    for s in sorted(registry.specs.values(), key=lambda s: (-s.priority, s.name)):
        if kind in s.device_types and s.capabilities.whole_ops and registry.availability(s).ok:
            return s.name
    return ""


def adopt(backend, *, group=None, device=None) -> None:
    """Have :func:`resolve` return ``backend`` for calls that name no backend on ``group`` (None: the default
    group) and ``device``, until :func:`release`: for a harness that makes its own backend object (the
    benchmark's fake process group) and wants the ops that resolve one, the compiled ones among them, to
    run on it."""
    import torch.distributed as dist

    group = process_group(group)
    table.remember(("backend", None, group if group is not None else dist.group.WORLD, str(device)), backend)


def refuse_destroyed(group) -> None:
    """Raise, by name, when ``group`` is a c10d process group that was destroyed."""
    from commfuse.runtime.groups import destroyed

    if destroyed(group):
        forget_destroyed()
        raise CommfuseValueError(
            f"process group {getattr(group, 'group_name', '') or group!r} was destroyed "
            "(torch.distributed.destroy_process_group): give a live group (a module made on the old group must be "
            "made again)"
        )


def forget_destroyed() -> int:
    """Let go of what commfuse holds for each process group that ``torch.distributed.destroy_process_group``
    destroyed without :func:`release`: the group's state (call numbers, agreed signatures, board, flight
    recorder), its backend object with its receive buffers, and its entries in the planning table. Then
    nothing of commfuse's holds the group, and torch frees it: gloo's connections (a listening socket and
    one per peer, a pipe and an epoll descriptor) and its threads (``gloo_tcp_loop`` and the group's two
    ``pt_gloo_runloop`` workers). A group with a call in flight is let go by a later sweep. Returns how many
    groups were let go.

    Planning calls it whenever it makes a backend object (a group's first call), and so does a call that
    names a destroyed group; a repeated call never does. Groups that stay are untouched, and so is each group
    name's count of incarnations (``commfuse.runtime.groups``), so a group made again under an old name keeps
    board keys of its own. The whole world destroyed (``destroy_process_group()``) is forgotten by
    :func:`fresh` at the next planning, as :func:`release` would."""
    if "torch.distributed.distributed_c10d" not in sys.modules:  # not imported: no group was ever made
        return 0
    from commfuse.runtime.groups import destroyed, forget_group, known_groups

    held = {id(group): group for group in known_groups()}
    held.update((id(key[2]), key[2]) for key in table.keys("backend"))
    let_go = 0
    for group in held.values():
        if destroyed(group) and forget_group(group):
            table.forget_holding(group)
            let_go += 1
    return let_go


def release() -> None:
    """Forget every cached backend object, resolved call, plan and group state, and let every receive buffer
    commfuse keeps go.

    Call it before ``torch.distributed.destroy_process_group()``: a backend (and
    its buffers) kept past destroy can abort the process at exit, and a later
    group must not inherit an old one's call numbers. Between, what commfuse
    keeps per call signature is bounded by :func:`plan_bytes`.
    """
    _SEEN[0] = _NEVER
    table.forget()


#: what :func:`plan_bytes` is given when it is asked, not told
_ASKED = object()


def plan_bytes(limit: int | None = _ASKED) -> int:
    """The bound, in bytes, on what commfuse keeps per call signature: the planning table, each signature's
    plan with its Python objects and the receive buffers it reserves (``BufferPool.MAX_FREE`` of each
    shape). ``plan_bytes(n)`` sets it to ``n`` first, evicting down to it at once, whatever
    ``COMMFUSE_PLAN_BYTES`` says; ``plan_bytes(None)`` goes back to the variable (else 1 GiB). Past the
    bound the least recently used signatures are evicted and planned again when they come back (see
    ``commfuse.planning.table``)."""
    if limit is not _ASKED:
        table.set_bound(limit)
    return table.bound()


def plan_usage() -> dict[str, int]:
    """What the planning table holds now, in bytes and counts (``commfuse.planning.table.usage``): ``bytes``
    against ``bound``, of which ``reserved`` for receive buffers (``buffers`` of them held now) and
    ``objects`` for Python objects; ``entries``, ``evictions``, ``replanned``."""
    return table.usage()
