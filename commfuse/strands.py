"""Two strands: micro-batches' blocks run as stages, the next micro-batch's forward interleaved with the
previous one's backward (DHelix, arXiv 2411.15871; DeepSeek-V3's DualPipe and Megatron-Core's combined 1F1B
pair a forward with a backward the same way).

A block is described as a list of :class:`Stage`, each a function from a tuple of tensors to a tuple of
tensors (what a stage needs later, such as the residual, it passes on in its tuple). :func:`run` runs the
micro-batches through them:

- each stage's forward runs on inputs detached from the previous stage's outputs, so each stage's
  backward runs alone: ``torch.autograd.backward`` on its outputs with the gradients the next stage's
  backward left on its inputs;
- micro-batch 0's forward runs alone; then micro-batch i + 1's forward stages and micro-batch i's
  backward stages run in the order of a plan (:mod:`commfuse.sim._strands`: searched from the stages'
  profiles, or alternated); the last backward runs alone;
- the losses come back, and the parameters' gradients are what sequential micro-batches leave
  (``loss_i.backward()`` for each i in turn, accumulated), up to the order of the additions.

The two strands run on one thread. Where the plan puts a stage with transfers beside one without (by the
stages' figures), the one without runs inside the other's first commfuse op, after its transfers are posted
and before its first wait. Finer units (one strand's GEMM slices filling the other's ring hops) are still to
do; docs/strands.md has what was measured and what is missing.

Every rank must run the same plan, or their ops would pair up wrongly: the plan is a function of the
profiles given, and :func:`run` checks on its first call that every rank of ``group`` holds the same one,
naming the ranks that differ.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from commfuse.errors import CommfuseTypeError, CommfuseValueError, MismatchError
from commfuse.sim import _strands as planning

__all__ = ["Stage", "order", "run"]


@dataclass(frozen=True)
class Stage:
    """One stage of a block: ``fn(*inputs) -> tensor or tuple of tensors``. ``compute`` and ``comm`` (seconds,
    measured or predicted, forward; ``backward_compute`` / ``backward_comm``, default twice and once those)
    feed the plan search; without them every stage counts alike and the plan alternates."""

    name: str
    fn: Callable
    compute: float | None = None
    comm: float = 0.0
    backward_compute: float | None = None
    backward_comm: float | None = None


def _slots(stages: Sequence[Stage], micro_batches: int, plan: str, slowdown: float) -> list[tuple]:
    """:func:`order`'s entries grouped into slots: a slot of two entries is a forward stage and a backward
    stage the plan runs together."""
    if plan not in ("auto", "sequential", "alternate", "searched"):
        raise CommfuseValueError(f"plan must be auto, sequential, alternate or searched, got {plan!r}")
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise CommfuseValueError(f"micro_batches must be an int >= 1, got {micro_batches!r}")
    n = len(stages)
    forward = [("F", k) for k in range(n)]
    backward = [("B", k) for k in reversed(range(n))]
    if plan == "sequential":
        return [((kind, i, k),) for i in range(micro_batches) for kind, k in forward + backward]
    profiled = all(s.compute is not None for s in stages)
    if plan == "searched" and not profiled:
        missing = [s.name for s in stages if s.compute is None]
        raise CommfuseValueError(f"plan 'searched' needs every stage's compute figure; missing for {missing}")
    if plan == "auto":
        plan = "searched" if profiled else "alternate"
    if plan == "searched":
        first, second = _profiles(stages)
        slots = planning.plan(first, second, slowdown=slowdown).slots
        pairs = [(None if s.a is None else s.a, None if s.b is None else n - 1 - s.b) for s in slots]
    else:
        pairs = [(k, n - 1 - k) for k in range(n)]
    out = [(("F", 0, k),) for k in range(n)]
    for i in range(1, micro_batches):
        for f, b in pairs:  # micro-batch i's forward beside micro-batch i - 1's backward
            out.append(tuple(e for e in (None if f is None else ("F", i, f), None if b is None else ("B", i - 1, b))
                             if e is not None))
    out += [(("B", micro_batches - 1, k),) for _, k in backward]
    return out


def _profiles(stages: Sequence[Stage]) -> tuple[list, list]:
    """The stages' figures as the plan search's two strands: the forward, and the backward in its order."""
    first = [planning.Stage(s.name, s.compute, s.comm) for s in stages]
    second = [planning.Stage(s.name + " (backward)", 2 * s.compute if s.backward_compute is None
                             else s.backward_compute, s.comm if s.backward_comm is None else s.backward_comm)
              for s in reversed(stages)]
    return first, second


def order(stages: Sequence[Stage], *, micro_batches: int, plan: str = "auto", slowdown: float = 0.0) -> list:
    """The order :func:`run` runs the stages in: ``(kind, micro-batch, stage index)`` with kind ``"F"``
    (forward) or ``"B"`` (backward; stage indices count down). ``plan``: ``"sequential"`` (every micro-batch's
    forward then its backward), ``"alternate"`` (forward stage k of micro-batch i + 1, then backward stage k
    of micro-batch i), ``"searched"`` (the dynamic program over the stages' profiles) or ``"auto"`` (searched
    where every stage has a ``compute`` figure, else alternate)."""
    return [entry for slot in _slots(stages, micro_batches, plan, slowdown) for entry in slot]


def _tuple(value, who: str) -> tuple:
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
        return tuple(value)
    raise CommfuseTypeError(f"{who} must return a tensor or a tuple of tensors, got "
                            f"{type(value).__name__}" + (f" holding {[type(v).__name__ for v in value]}"
                                                         if isinstance(value, (tuple, list)) else ""))


def _detached(values: tuple) -> tuple:
    return tuple(v.detach().requires_grad_(v.requires_grad or v.is_floating_point()) for v in values)


def _check_agreed(schedule: list, group) -> None:
    """Every rank of ``group`` holds ``schedule``, or all raise naming the ranks that differ."""
    import torch.distributed as dist

    if group is None and not dist.is_initialized():
        return
    n = dist.get_world_size(group)
    if n == 1:
        return
    digest = zlib.crc32(repr(schedule).encode())
    mine = torch.tensor([digest], dtype=torch.int64)
    every = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(every, mine, group=group)
    digests = [int(t.item()) for t in every]
    if len(set(digests)) > 1:
        rank = dist.get_rank(group)
        raise MismatchError(f"rank {rank}: commfuse.strands.run: the ranks hold different stage orders (digests by "
                            f"rank {digests}); give every rank the same stages, profiles and plan")


def run(stages: Sequence[Stage], micro_batches: Sequence, loss_fn: Callable, *, plan: str = "auto",
        slowdown: float = 0.0, group=None) -> list[torch.Tensor]:
    """Forward and backward of ``micro_batches`` through ``stages`` as two strands (see the module docstring);
    returns each micro-batch's loss (detached). A micro-batch is a tuple ``(inputs, target)``: ``inputs`` (a
    tensor or a tuple of them) go to the first stage, and ``loss_fn(outputs, target)`` turns the last stage's
    outputs into a scalar loss. Parameters' gradients accumulate in ``.grad`` as sequential micro-batches'
    ``loss.backward()`` would leave them. ``group``: the ranks that must agree on the order (checked once per
    call; default the world, nothing without a process group).

    Where the plan puts a stage with transfers beside one without (by their figures), the one without runs
    inside the other's first commfuse op, after its transfers are posted and before it waits for them
    (``commfuse.runtime.loop.FILLERS``): it computes while they travel. A stage given ``comm=0`` must call no
    commfuse op (one op per group at a time)."""
    if not stages:
        raise CommfuseValueError("commfuse.strands.run needs at least one stage")
    for s in stages:
        if not isinstance(s, Stage):
            raise CommfuseTypeError(f"stages must be commfuse.strands.Stage, got {type(s).__name__}")
    batches = list(micro_batches)
    slots = _slots(stages, len(batches), plan, slowdown)
    _check_agreed([e for slot in slots for e in slot], group)
    n = len(stages)
    first, second = _profiles(stages) if all(s.compute is not None for s in stages) else (None, None)
    saved: dict = {}  # (micro-batch, stage) -> (detached inputs, outputs)
    carry: dict = {}  # micro-batch -> the outputs the next forward stage takes
    grads: dict = {}  # micro-batch -> the gradients of the outputs of the stage whose backward is next
    losses: list = [None] * len(batches)

    def forward(i: int, k: int) -> None:
        stage = stages[k]
        if k == 0:
            batch = batches[i]
            if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
                raise CommfuseTypeError(f"micro-batch {i} must be a tuple (inputs, target), got {type(batch).__name__}")
            inputs = _tuple(batch[0], f"micro-batch {i}'s inputs")
        else:
            inputs = _detached(carry.pop(i))
        with torch.enable_grad():
            outputs = _tuple(stage.fn(*inputs), f"stage {stage.name!r} (micro-batch {i})")
            if k == n - 1:
                loss = loss_fn(outputs[0] if len(outputs) == 1 else outputs, batches[i][1])
                if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
                    raise CommfuseValueError(f"loss_fn must return a scalar tensor, got "
                                             f"{getattr(loss, 'shape', type(loss).__name__)} for micro-batch {i}")
                losses[i] = loss
        saved[(i, k)] = (inputs, outputs)
        if k < n - 1:
            carry[i] = outputs

    def backward(i: int, k: int) -> None:
        inputs, outputs = saved.pop((i, k))
        if k == n - 1:
            torch.autograd.backward(losses[i])
        else:
            wanted = grads.pop(i)
            pairs = [(o, g) for o, g in zip(outputs, wanted) if g is not None and o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if k > 0:
            grads[i] = [t.grad if t.requires_grad else None for t in inputs]

    def comm(entry) -> float:
        kind, _, k = entry
        return first[k].comm if kind == "F" else second[n - 1 - k].comm

    step = {"F": forward, "B": backward}
    for slot in slots:
        if len(slot) == 2 and first is not None and (comm(slot[0]) > 0) != (comm(slot[1]) > 0):
            sender, filler = slot if comm(slot[0]) > 0 else slot[::-1]
            _overlapped(step, sender, filler)
        else:
            for kind, i, k in slot:
                step[kind](i, k)
    return [loss.detach() for loss in losses]


def _overlapped(step: dict, sender: tuple, filler: tuple) -> None:
    """Run ``sender`` (a stage with transfers) with ``filler`` (one without) handed to its first commfuse op's
    wait; the filler runs after the sender when no op took it. The filler's error is raised after the sender
    is done, so the sender's op completes on every rank whatever the filler did."""
    from commfuse.runtime import loop

    failed: list = []

    def fill() -> None:
        try:
            step[filler[0]](filler[1], filler[2])
        except BaseException as e:  # noqa: BLE001 - raised once the sender's op is complete
            failed.append(e)
        finally:
            ran.append(True)

    ran: list = []
    loop.FILLERS.append(fill)
    try:
        step[sender[0]](sender[1], sender[2])
    finally:
        if not ran:
            loop.FILLERS.remove(fill)
    if failed:
        raise failed[0]
    if not ran:
        step[filler[0]](filler[1], filler[2])
