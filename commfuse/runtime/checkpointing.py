"""What activation checkpointing needs from the runtime: recomputed calls told apart by their region, and
selective checkpointing's dispatch modes kept out of a fused op.

**Recomputed calls.** Non-reentrant checkpointing (``torch.utils.checkpoint``
with ``use_reentrant=False``, ``checkpoint_wrapper``, torch's composable
``checkpoint``, torchtitan's) drops a region's activations in the forward and
runs the region's forward again inside the backward, when the backward first
needs one of them. The commfuse calls of that recompute are numbered in the
backward's lane (``autograd``), between the backward calls, in the order every
rank's backward reaches them. Ranks that checkpoint alike make the same calls
there. Ranks that do not (one checkpoints a block and another does not, or one
checkpoints two blocks as one region and another as two) must never pair one
region's call with another's: with equal shapes the data would mix before any
rank noticed. So each call a recompute makes takes a lane of its own region
(:func:`lane_of`): while the forward runs under a region's saved-tensor hooks,
the region notes the number and lane of its first call on each group; while a
recompute runs under the hooks torch installs to refill that region, its calls
go in the lane ``autograd, recomputing the region of call #N`` (the code folds
N in), which goes into every tag and fingerprint. A rank that recomputes
another region, or none, waits in another lane: every rank names the mismatch
from the group's board (``MismatchError``), and no transfer pairs. Reentrant
checkpointing installs no hooks: its recompute runs in the ``autograd`` lane
and a difference shows at the first call that differs.

**Selective checkpointing.** ``torch.utils.checkpoint.create_selective_checkpoint_contexts``
(torchtitan's per-op policy) runs a checkpointed region's forward under one
``TorchDispatchMode`` that keeps the outputs of the ops its policy saves, by
op and by how many of that op came before, and the recompute under another
that hands those outputs back in the same order instead of running the ops.
A commfuse call does not run the same aten ops on every call (the first call
of a signature checks and plans, later ones walk a kept plan; a ring step
allocates a receive buffer or takes one back from its pool), so inside one
the counts of the forward and of the recompute part: the recompute would be
handed another op's output, or refused. So each fused op's front door
(:func:`atomic`, or :func:`selective` and :func:`aside_call` where a wrapper
would cost the repeated call) takes the modes of selective checkpointing off
this thread's dispatch stack and puts them back after, in their place: the op
(its planning, its buffers, its ring, the caller's compute inside it) runs
whole in the forward and whole again in the recompute, communication
included, and the policy sees the ops around it only. Other dispatch modes
stay where they are. The ops that are custom ops (``commfuse.library``) run as
such instead, where they can, so that the policy decides on each as one op.

Outside a region both cost one C call per call: the saved-tensor hooks' top,
read when a call takes its group, and the dispatch stack's depth, read at a
fused op's front door.
"""

from __future__ import annotations

import contextlib
import functools
import zlib

import torch

__all__ = ["TOP_HOOKS", "apart", "as_custom_op", "aside_call", "atomic", "depth", "hooks", "lane_of", "put_back",
           "recomputing", "selective", "set_aside", "stopped", "strands_running"]

# -- recomputed calls ---------------------------------------------------------------------------------------------


def _top_hooks_reader():
    """``read(False)``: the top of this thread's saved-tensor hooks, ``(pack, unpack)`` or None, as torch reads
    it. torch 2.8 added the call and later its ``ignore_is_tracing`` argument: without the argument it is
    wrapped, and without the call there are never any hooks to see (checkpointing then runs as described,
    with the recompute in the ``autograd`` lane)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return lambda ignore_is_tracing: None
    try:
        top(False)
    except TypeError:
        return lambda ignore_is_tracing: top()
    return top


#: ``TOP_HOOKS(False)``: the top of this thread's saved-tensor hooks, for the loop, which reads it on every call
TOP_HOOKS = _top_hooks_reader()


def hooks():
    """The saved-tensor hooks in force on this thread, ``(pack, unpack)``, or None (also on a torch without the
    call)."""
    return TOP_HOOKS(False)


def _region(pack) -> tuple[str | None, object]:
    """``("forward", frame)`` when ``pack`` is the hook a non-reentrant checkpoint region's forward saves its
    tensors with, ``("recompute", frame)`` when it is the hook of that region's recompute, else ``(None,
    None)``. torch keeps the region (its ``_CheckpointFrame``) in the hooks' closures: read there, by name, and
    anything else (another torch, another hook) is no region."""
    while hasattr(pack, "__wrapped__"):  # the recompute's hook is wrapped (torch._dynamo.disable)
        pack = pack.__wrapped__
    code = getattr(pack, "__code__", None)
    cells = getattr(pack, "__closure__", None)
    if code is None or not cells:
        return None, None
    name = getattr(pack, "__qualname__", "")
    try:
        if name.startswith("_checkpoint_hook."):
            return "forward", cells[code.co_freevars.index("frame")].cell_contents
        if name.startswith("_recomputation_hook."):
            return "recompute", cells[code.co_freevars.index("target_frame_ref")].cell_contents()
    except (ValueError, AttributeError, TypeError):
        pass
    return None, None


def recomputing() -> bool:
    """Whether this thread runs a non-reentrant checkpoint region's recompute (which may make fewer calls
    than the region's forward: the ops a selective policy saved are not run again)."""
    found = hooks()
    return found is not None and _region(found[0])[0] == "recompute"


#: the attribute a region's frame keeps, per group state, its first call's (lane code, number) in
_FIRST = "_commfuse_first_calls"
_RECOMPUTE = zlib.crc32(b"recompute") & 0xFFFF


def lane_of(state, which: tuple[str, int], seq: int, found) -> tuple[str, int]:
    """The lane call #seq (taken in lane ``which`` on ``state``'s group) goes in, given the saved-tensor hooks
    ``found`` in force: ``which`` itself, except in the recompute of a region whose forward made calls on the
    group, where it is that region's (see the module's docstring). A region's forward notes its first call."""
    kind, frame = _region(found[0])
    if frame is None:
        return which
    if kind == "forward":
        firsts = getattr(frame, _FIRST, None)
        if firsts is None:
            firsts = {}
            try:
                setattr(frame, _FIRST, firsts)
            except AttributeError:
                return which
        firsts.setdefault(state, (which[1], seq))
        return which
    first = getattr(frame, _FIRST, {}).get(state)
    if first is None:
        return which
    code, number = first
    salt = zlib.crc32(f"{code}:{number}".encode()) & 0xFFFF
    return (f"{which[0]}, recomputing the checkpointed region of call #{number}", (which[1] ^ _RECOMPUTE ^ salt)
            or 1)


_STOP: tuple | None = None


def stopped(error: BaseException) -> bool:
    """Whether ``error`` is how torch ends a recompute early, once it has refilled every tensor the backward
    needs (``early_stop``, on by default): raised on every rank at the same point of the same region, so the
    calls the region would have made next are made by no rank, and none of them is left (see ``op_calls``)."""
    global _STOP
    if _STOP is None:
        from torch.utils import checkpoint

        kind = getattr(checkpoint, "_StopRecomputationError", None)
        _STOP = (kind,) if kind is not None else ()
    return isinstance(error, _STOP)


# -- selective checkpointing --------------------------------------------------------------------------------------

#: how many (non-infrastructure) dispatch modes this thread has on: 0 almost always
depth = torch._C._len_torch_dispatch_stack
_at = torch._C._get_dispatch_stack_at
_pop = torch._C._pop_torch_dispatch_stack
_push = torch._C._push_on_torch_dispatch_stack

_KINDS: tuple | None = None


def _kinds() -> tuple:
    """The dispatch-mode classes of selective checkpointing (private in torch; a torch without them has
    none to set aside)."""
    global _KINDS
    if _KINDS is None:
        from torch.utils import checkpoint

        _KINDS = tuple(kind for kind in (getattr(checkpoint, "_CachingTorchDispatchMode", None),
                                         getattr(checkpoint, "_CachedTorchDispatchMode", None)) if kind is not None)
    return _KINDS


def selective(count: int) -> bool:
    """Whether selective checkpointing's modes are among this thread's ``count`` dispatch modes (``depth()``)."""
    kinds = _kinds()
    return any(isinstance(_at(i), kinds) for i in range(count))


def as_custom_op() -> bool:
    """Whether a fused op that is also a custom op runs as the op (``commfuse.library``) in eager mode, so that
    a selective checkpointing policy decides on it: while this thread runs inside selective checkpointing's
    modes (a region's forward or recompute), but not in ``commfuse.strands`` (:func:`strands_running`)."""
    count = depth()
    return bool(count) and not _STRANDS[0] and selective(count)


#: how many ``commfuse.strands`` runs are in progress: they hand stages to ops' waits, which inside an op's
#: kernel would run below autograd, so their fused ops run whole instead of as custom ops
_STRANDS = [0]


@contextlib.contextmanager
def strands_running():
    """While ``commfuse.strands`` runs its stages: no fused op runs as its custom op (:func:`as_custom_op`),
    in the forward as in the recompute."""
    _STRANDS[0] += 1
    try:
        yield
    finally:
        _STRANDS[0] -= 1


def set_aside(count: int) -> tuple | None:
    """Take selective checkpointing's modes off this thread's stack of ``count`` dispatch modes (the others
    stay, in their order). Returns what :func:`put_back` needs, or None when there was none to take."""
    if not selective(count):
        return None
    kinds = _kinds()
    modes = [_pop(None) for _ in range(count)][::-1]  # bottom first
    kept = [mode for mode in modes if not isinstance(mode, kinds)]
    for mode in kept:
        _push(mode)
    return modes, len(kept)


def put_back(aside: tuple) -> None:
    """Restore the stack :func:`set_aside` changed, as it was."""
    modes, kept = aside
    for _ in range(kept):
        _pop(None)
    for mode in modes:
        _push(mode)


def aside_call(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with selective checkpointing's modes set aside: for the hot front doors, which
    check ``depth()`` and :func:`selective` themselves (cheaper than :func:`atomic`'s wrapper on every call)."""
    aside = set_aside(depth())
    try:
        return fn(*args, **kwargs)
    finally:
        if aside is not None:
            put_back(aside)


_compiling = torch.compiler.is_compiling


def atomic(fn):
    """``fn`` (a fused op's front door) run with selective checkpointing's modes set aside: one op to the
    policy, run whole in the forward and whole again in the recompute."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if _compiling():  # traced: no modes to set aside (and Dynamo does not trace the stack's depth)
            return fn(*args, **kwargs)
        count = depth()
        if count:
            aside = set_aside(count)
            if aside is not None:
                try:
                    return fn(*args, **kwargs)
                finally:
                    put_back(aside)
        return fn(*args, **kwargs)

    return run


@contextlib.contextmanager
def apart():
    """Run what a commfuse op's wait is handed (``commfuse.strands`` runs a stage without transfers inside
    another stage's op) as it would run alone: the saved-tensor hooks of the code around the op (a
    checkpointed stage's region, or its recompute) and selective checkpointing's modes are set aside for it,
    and put back after."""
    popped = []
    while (found := TOP_HOOKS(False)) is not None:
        popped.append(found)
        torch._C._autograd._pop_saved_tensors_default_hooks()
    count = depth()
    aside = set_aside(count) if count else None
    try:
        yield
    finally:
        if aside is not None:
            put_back(aside)
        for pack, unpack in reversed(popped):
            torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)
