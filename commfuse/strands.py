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

:func:`forward` runs forwards only (inference, evaluation): micro-batches in pairs, one's forward stages
beside the other's.

The two strands run on one thread. Where the plan puts a stage with transfers beside one without (by the
stages' figures), the one without runs inside the other's first commfuse op, after its transfers are posted
and before its first wait. Finer units (one strand's GEMM slices filling the other's ring hops) are still to
do; docs/strands.md has what was measured and what is missing.

Every rank must run the same plan, or their ops would pair up wrongly: the plan is a function of the
profiles given, and :func:`run` checks on its first call that every rank of ``group`` holds the same one,
naming the ranks that differ.
"""

from __future__ import annotations

import statistics
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from commfuse.errors import CommfuseError, CommfuseTypeError, CommfuseValueError, GroupDeadError
from commfuse.runtime.checkpointing import apart, strands_running
from commfuse.runtime.groups import register_format
from commfuse.sim import _strands as planning

__all__ = ["Stage", "forward", "order", "profile", "run"]


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
    plan = _plan_name(stages, micro_batches, plan)
    n = len(stages)
    forward = [("F", k) for k in range(n)]
    backward = [("B", k) for k in reversed(range(n))]
    if plan == "sequential":
        return [((kind, i, k),) for i in range(micro_batches) for kind, k in forward + backward]
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


def _plan_name(stages: Sequence[Stage], micro_batches: int, plan: str) -> str:
    """``plan`` checked, ``"auto"`` resolved: searched where every stage has a compute figure."""
    if plan not in ("auto", "sequential", "alternate", "searched"):
        raise CommfuseValueError(f"plan must be auto, sequential, alternate or searched, got {plan!r}")
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise CommfuseValueError(f"micro_batches must be an int >= 1, got {micro_batches!r}")
    profiled = all(s.compute is not None for s in stages)
    if plan == "searched" and not profiled:
        missing = [s.name for s in stages if s.compute is None]
        raise CommfuseValueError(f"plan 'searched' needs every stage's compute figure; missing for {missing}")
    if plan == "auto":
        return "searched" if profiled else "alternate"
    return plan


def _profiles(stages: Sequence[Stage]) -> tuple[list, list]:
    """The stages' figures as the plan search's two strands: the forward, and the backward in its order."""
    first = [planning.Stage(s.name, s.compute, s.comm) for s in stages]
    second = [planning.Stage(s.name + " (backward)", 2 * s.compute if s.backward_compute is None
                             else s.backward_compute, s.comm if s.backward_comm is None else s.backward_comm)
              for s in reversed(stages)]
    return first, second


def _forward_slots(stages: Sequence[Stage], micro_batches: int, plan: str, slowdown: float) -> list[tuple]:
    """:func:`forward`'s slots: micro-batches in pairs (2p, 2p + 1), the second's forward stages beside the
    first's; an odd last micro-batch runs alone."""
    plan = _plan_name(stages, micro_batches, plan)
    n = len(stages)
    if plan == "sequential":
        return [(("F", i, k),) for i in range(micro_batches) for k in range(n)]
    if plan == "searched":
        first, _ = _profiles(stages)
        pairs = [(s.a, s.b) for s in planning.plan(first, first, slowdown=slowdown).slots]
    else:  # the naive skew: stage k of the first beside stage k - 1 of the second
        pairs = [(0, None)] + [(k, k - 1) for k in range(1, n)] + [(None, n - 1)]
    out = []
    for i in range(0, micro_batches - 1, 2):
        for a, b in pairs:
            out.append(tuple(e for e in (None if a is None else ("F", i, a), None if b is None else ("F", i + 1, b))
                             if e is not None))
    if micro_batches % 2:
        out += [(("F", micro_batches - 1, k),) for k in range(n)]
    return out


def order(stages: Sequence[Stage], *, micro_batches: int, plan: str = "auto", slowdown: float = 0.0,
          forward_only: bool = False) -> list:
    """The order :func:`run` runs the stages in: ``(kind, micro-batch, stage index)`` with kind ``"F"``
    (forward) or ``"B"`` (backward; stage indices count down). ``plan``: ``"sequential"`` (every micro-batch's
    forward then its backward), ``"alternate"`` (forward stage k of micro-batch i + 1, then backward stage k
    of micro-batch i), ``"searched"`` (the dynamic program over the stages' profiles) or ``"auto"`` (searched
    where every stage has a ``compute`` figure, else alternate). ``forward_only``: the order of
    :func:`forward` (micro-batches in pairs; ``"alternate"`` runs the second's stage k - 1 beside the first's
    stage k)."""
    slots = (_forward_slots if forward_only else _slots)(stages, micro_batches, plan, slowdown)
    return [entry for slot in slots for entry in slot]


def _tuple(value, who: str) -> tuple:
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
        return tuple(value)
    raise _own(CommfuseTypeError(f"{who} must return a tensor or a tuple of tensors, got "
                                 f"{type(value).__name__}" + (f" holding {[type(v).__name__ for v in value]}"
                                                              if isinstance(value, (tuple, list)) else "")))


def _own(error: CommfuseError) -> CommfuseError:
    """``error``, marked as a refusal of this module's own, made between the stages' calls: the peers are told
    of it as of any error in a stage's code (a commfuse error out of a call was told in that call)."""
    error._commfuse_strands_own = True
    return error


def _told_in_a_call(error: BaseException) -> bool:
    """Whether ``error`` reached the peers already, in the call it came out of: settled by a call, or a
    commfuse error that is not one of this module's own refusals (:func:`_own`)."""
    return getattr(error, "_commfuse_settled", None) is not None or (
        isinstance(error, CommfuseError) and not getattr(error, "_commfuse_strands_own", False))


def _detached(values: tuple) -> tuple:
    return tuple(v.detach().requires_grad_(v.requires_grad or v.is_floating_point()) for v in values)


def run(stages: Sequence[Stage], micro_batches: Sequence, loss_fn: Callable, *, plan: str = "auto",
        slowdown: float = 0.0, group=None, defer_weight_grads: bool | None = None) -> list[torch.Tensor]:
    """Forward and backward of ``micro_batches`` through ``stages`` as two strands (see the module docstring);
    returns each micro-batch's loss (detached). A micro-batch is a tuple ``(inputs, target)``: ``inputs`` (a
    tensor or a tuple of them) go to the first stage, and ``loss_fn(outputs, target)`` turns the last stage's
    outputs into a scalar loss. Parameters' gradients accumulate in ``.grad`` as sequential micro-batches'
    ``loss.backward()`` would leave them. ``group``: the process group the stages' commfuse ops run on, whose
    ranks must agree on the order (checked once per call; default the world, nothing without a process group).

    While one stage's op waits for its transfers, work that needs no transfer runs (``commfuse.runtime.steps
    .FILLERS``), so that it computes while they travel:

    - a stage without transfers that the plan puts beside one with transfers (by their figures);
    - weight gradients, deferred (``defer_weight_grads``, default: for every plan but ``"sequential"``): the
      backward of ``all_gather_matmul`` and ``matmul_reduce_scatter`` leaves each weight-gradient GEMM for a
      later wait, of either strand; whatever is left runs before ``run`` returns. Only leaf weights without
      gradient hooks are deferred (``commfuse.autograd.WGRAD_SINK``): a weight under DDP's or FSDP's hooks
      gets its gradient in the ring as always.

    A stage given ``comm=0`` must call no commfuse op (one op per group at a time).

    When a stage raises on one rank, every rank raises: the peers waiting in the next call this rank will
    not make are told which rank failed and why (``PeerFailedError``), and the calls it left are announced.
    An error inside a commfuse op's compute leaves the group usable, as for any op. So does one in a stage's
    own code on a gloo group: the failing rank completes the transfers its peers posted in the call they wait
    in (``commfuse.runtime.drain``). Where that cannot be done (a peer waits in a whole collective, or a
    stream-ordered group) the group is declared dead on every rank and the next call is refused by name
    (docs/strands.md). The weight gradients of a failed call are incomplete."""
    from commfuse import autograd
    from commfuse.runtime import steps

    batches = list(micro_batches)

    def decide():
        _check_stages(stages, "run")
        if not callable(loss_fn):
            raise CommfuseTypeError(f"commfuse.strands.run needs a loss_fn (outputs, target) -> scalar, got "
                                    f"{type(loss_fn).__name__}; commfuse.strands.forward runs forwards only")
        return _slots(stages, len(batches), plan, slowdown)

    slots, on = _start(decide, group, "run")
    if defer_weight_grads is None:
        defer_weight_grads = plan != "sequential"
    runner = _Runner(stages, batches, loss_fn, slots, on)
    if defer_weight_grads:
        autograd.WGRAD_SINK.append(runner.defer)
    try:
        with strands_running():
            runner.walk()
        try:
            runner.flush()
        except BaseException as e:
            runner.ran = len(runner.sequence)
            runner._tell_peers(e)
            raise
    finally:
        steps.FILLERS.clear()
        if defer_weight_grads:
            autograd.WGRAD_SINK.clear()
    return [loss.detach() for loss in runner.losses]


def forward(stages: Sequence[Stage], micro_batches: Sequence, *, plan: str = "auto", slowdown: float = 0.0,
            group=None) -> list:
    """Forward only (inference, evaluation) of ``micro_batches`` through ``stages`` as two strands: the
    micro-batches in pairs, the second's forward stages beside the first's (:func:`order` with
    ``forward_only=True``), a stage without transfers run inside the paired stage's first wait, as in
    :func:`run`. A micro-batch is what the first stage takes (a tensor or a tuple of them); returns each
    micro-batch's last-stage outputs (a tensor where the stage returns one). Runs under the caller's grad mode
    (``torch.no_grad()`` or ``torch.inference_mode()`` for inference). A stage failing on one rank stops every
    rank by name, as in :func:`run`."""
    from commfuse.runtime import steps

    batches = list(micro_batches)

    def decide():
        _check_stages(stages, "forward")
        return _forward_slots(stages, len(batches), plan, slowdown)

    slots, on = _start(decide, group, "forward")
    runner = _Runner(stages, batches, None, slots, on)
    try:
        with strands_running():
            runner.walk()
    finally:
        steps.FILLERS.clear()
    return [out[0] if len(out) == 1 else out for out in runner.outputs]


def _check_stages(stages: Sequence[Stage], who: str) -> None:
    if not stages:
        raise CommfuseValueError(f"commfuse.strands.{who} needs at least one stage")
    for s in stages:
        if not isinstance(s, Stage):
            raise CommfuseTypeError(f"stages must be commfuse.strands.Stage, got {type(s).__name__}")


def _start(decide: Callable[[], list], group, who: str) -> tuple[list, object]:
    """Before the first stage: refuse a dead group; then, agreed with every rank in one exchange through
    commfuse (its numbering and timeout), this rank's checks of its arguments and the order ``decide()``
    makes (a rank that refuses, say an empty list of micro-batches, is named on every rank and every rank
    raises; ranks holding other orders all raise ``MismatchError``; the group stays usable). Returns the order
    and the group the stages' calls are counted on."""
    from commfuse import autograd
    from commfuse.planning.agreement import agree
    from commfuse.runtime import steps
    from commfuse.runtime.admission import refuse_dead
    from commfuse.runtime.groups import state_of_group

    on = _group(group)
    if on is not None:  # before the order's check, which a dead group would leave waiting
        refuse_dead(state_of_group(on), f"commfuse.strands.{who}")

    def checked():
        if steps.FILLERS or autograd.WGRAD_SINK:
            raise CommfuseValueError(f"commfuse.strands.{who} cannot run inside another strands call (work is "
                                     "already handed to the ops' waits)")
        return decide()

    def described(slots: list) -> list:
        order = [e for slot in slots for e in slot]
        return [("the stage order's digest (different stage orders: give every rank the same stages, profiles "
                 "and plan)", zlib.crc32(repr(order).encode()))]

    slots = agree(on, f"commfuse.strands.{who}", checked, described, label=f"strands.{who}", device=_device(on),
                  so="no rank runs a stage (the group is usable)")
    return slots, on


def _device(group):
    """Where the agreement's tensors live: the CPU for a group with a CPU transport, else the accelerator (a
    plain "nccl" group refuses CPU tensors)."""
    if group is None:
        return None
    import torch.distributed as dist

    backend = str(dist.get_backend(group))
    return "cpu" if "gloo" in backend or "cpu" in backend or backend == "fake" else \
        torch.accelerator.current_accelerator()


register_format("strands.run", lambda v: "commfuse.strands.run's agreement of the ranks on their arguments and order")
register_format("strands.forward", lambda v: "commfuse.strands.forward's agreement of the ranks on their arguments "
                                             "and order")


def _group(group):
    """The group whose calls the stages make (None: no process group, nothing to count)."""
    import torch.distributed as dist

    if group is not None:
        return group
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


class _Runner:
    """One :func:`run`: the stages' saved tensors, the gradients between them, the work handed to waits and
    the errors it raised."""

    def __init__(self, stages: Sequence[Stage], batches: list, loss_fn: Callable, slots: list, group) -> None:
        self.stages, self.batches, self.loss_fn, self.slots, self.group = stages, batches, loss_fn, slots, group
        self.n = len(stages)
        profiled = all(s.compute is not None for s in stages)
        self.first, self.second = _profiles(stages) if profiled else (None, None)
        self.saved: dict = {}  # (micro-batch, stage) -> (detached inputs, outputs)
        self.carry: dict = {}  # micro-batch -> the outputs the next forward stage takes
        self.grads: dict = {}  # micro-batch -> the gradients of the outputs of the stage whose backward is next
        self.training = loss_fn is not None  # else forward only
        self.losses: list = [None] * len(batches)
        self.outputs: list = [None] * len(batches)  # forward only: each micro-batch's last outputs
        self.failed: list = []  # errors of work run inside another stage's wait, raised once that stage is done

    # -- the two halves of a stage ------------------------------------------------------------------------------

    def forward(self, i: int, k: int) -> None:
        stage = self.stages[k]
        if k == 0:
            batch = self.batches[i]
            if not self.training:
                inputs = _tuple(batch, f"micro-batch {i}")
            elif isinstance(batch, (tuple, list)) and len(batch) == 2:
                inputs = _tuple(batch[0], f"micro-batch {i}'s inputs")
            else:
                raise _own(CommfuseTypeError(f"micro-batch {i} must be a tuple (inputs, target), got "
                                             f"{type(batch).__name__}"))
        else:
            inputs = _detached(self.carry.pop(i)) if self.training else self.carry.pop(i)
        if not self.training:
            outputs = _tuple(stage.fn(*inputs), f"stage {stage.name!r} (micro-batch {i})")
            if k < self.n - 1:
                self.carry[i] = outputs
            else:
                self.outputs[i] = outputs
            return
        with torch.enable_grad():
            outputs = _tuple(stage.fn(*inputs), f"stage {stage.name!r} (micro-batch {i})")
            if k == self.n - 1:
                loss = self.loss_fn(outputs[0] if len(outputs) == 1 else outputs, self.batches[i][1])
                if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
                    raise _own(CommfuseValueError(f"loss_fn must return a scalar tensor, got "
                                                  f"{getattr(loss, 'shape', type(loss).__name__)} for micro-batch {i}"))
                self.losses[i] = loss
        self.saved[(i, k)] = (inputs, outputs)
        if k < self.n - 1:
            self.carry[i] = outputs

    def backward(self, i: int, k: int) -> None:
        inputs, outputs = self.saved.pop((i, k))
        if k == self.n - 1:
            torch.autograd.backward(self.losses[i])
        else:
            wanted = self.grads.pop(i)
            pairs = [(o, g) for o, g in zip(outputs, wanted) if g is not None and o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if k > 0:
            self.grads[i] = [t.grad if t.requires_grad else None for t in inputs]

    def step(self, entry: tuple) -> None:
        kind, i, k = entry
        (self.forward if kind == "F" else self.backward)(i, k)

    # -- work handed to waits -----------------------------------------------------------------------------------

    def _captured(self, work: Callable) -> Callable:
        def fill() -> None:
            try:
                with apart():  # as it would run alone: not in the region of the stage whose wait runs it
                    work()
            except BaseException as e:  # noqa: BLE001 - raised once the op whose wait ran it is complete
                self.failed.append(e)
        return fill

    def defer(self, work: Callable) -> None:
        """``commfuse.autograd.WGRAD_SINK``: a weight gradient, run in a later wait (below any stage handed in)."""
        from commfuse.runtime import steps

        steps.FILLERS.insert(0, self._captured(work))

    def flush(self) -> None:
        """Run the deferred weight gradients no wait took."""
        from commfuse.runtime import steps

        while steps.FILLERS:
            steps.FILLERS.pop()()
        self._raise_failed()

    def _raise_failed(self) -> None:
        if self.failed:
            error, self.failed = self.failed[0], []
            raise error

    # -- the walk -----------------------------------------------------------------------------------------------

    def comm(self, entry: tuple) -> float:
        kind, _, k = entry
        return self.first[k].comm if kind == "F" else self.second[self.n - 1 - k].comm

    def walk(self) -> None:
        """Every slot in order: a stage with transfers beside one without (by their figures) runs with the
        other handed to its first wait; anything else, one entry after the other."""
        self.ran = 0  # entries of self.sequence completed
        self.calls = None  # the counted calls of the entry that ran last
        self.inside = False  # whether that entry is still running (an error came out of it)
        try:
            for slot in self.slots:
                paired = self.paired(slot)
                if paired is not None:
                    self._overlapped(*paired)
                else:
                    for entry in slot:
                        self._counted(entry)
                self._raise_failed()
        except BaseException as e:
            self._tell_peers(e)
            raise

    @property
    def sequence(self) -> list:
        """``(entry, handed to a wait)`` in the order :meth:`walk` runs them."""
        out = []
        for slot in self.slots:
            paired = self.paired(slot)
            out += [(paired[0], False), (paired[1], True)] if paired is not None else [(e, False) for e in slot]
        return out

    def paired(self, slot: tuple) -> tuple | None:
        """``(sender, filler)`` where the slot holds a stage with transfers and one without (by their figures),
        the second to run in the first's wait; else None."""
        if len(slot) != 2 or self.first is None or (self.comm(slot[0]) > 0) == (self.comm(slot[1]) > 0):
            return None
        return slot if self.comm(slot[0]) > 0 else slot[::-1]

    def _key(self, entry: tuple) -> tuple:
        kind, _, k = entry
        stage = self.stages[k]
        return ("commfuse.strands", stage.name, kind, getattr(stage.fn, "__qualname__", ""))

    def _counted(self, entry: tuple) -> None:
        """Run ``entry``, its calls on the group counted (``counted_calls``: a rank that leaves it early
        announces the calls it did not make, once a run of the same stage has taught it how many there are)."""
        from commfuse.runtime.admission import autograd_lane, counted_calls

        kind, i, k = entry
        label = (f"commfuse.strands: the {'forward' if kind == 'F' else 'backward'} of stage "
                 f"{self.stages[k].name!r} (micro-batch {i})")
        self.calls = counted_calls(self.group, label, self._key(entry), autograd_lane() if kind == "B" else None)
        self.inside = True
        with self.calls:
            self.step(entry)
        self.inside = False
        self.ran += 1

    def _overlapped(self, sender: tuple, filler: tuple) -> None:
        """Run ``sender`` (a stage with transfers) with ``filler`` (one without) handed to its first wait; the
        filler runs after the sender when no op took it. The filler's error is raised after the sender is
        done, so the sender's op completes on every rank whatever the filler did."""
        from commfuse.runtime import steps

        ran: list = []
        fill = self._captured(lambda: (ran.append(True), self.step(filler)))
        steps.FILLERS.append(fill)
        try:
            self._counted(sender)
        finally:
            if not ran and fill in steps.FILLERS:
                steps.FILLERS.remove(fill)
        if not ran and not self.failed:
            self.step(filler)
        self.ran += 1

    def _tell_peers(self, error: BaseException) -> None:
        """After ``error`` on this rank, make the peers stop where this rank stopped, told why.

        - An error inside a call reached the peers in that call.
        - One between two calls of a stage reaches them at the stage's next call: ``counted_calls`` announces
          the calls this rank left, as many as it learned the stage makes (learned from the stage's earlier
          runs, so the same on every rank).
        - Otherwise the peers go on to the next entries. This rank announces the calls of the first entry that
          makes any, as many as the peers will make of it: they fail in its first call, naming this rank, and
          announce the rest, so every rank's call numbers stay alike.

        A stage whose calls were never counted (its first run failed) counts one. Past the last entry (a
        deferred weight gradient failed at the end) one call is announced: the peers hear of it at their
        next call. Where a guess was wrong, the group's next call is checked and names the ranks whose
        numbers differ; nothing hangs."""
        from commfuse.runtime.admission import autograd_lane, counted_calls, leave_calls

        calls = self.calls
        if calls is None or calls.state is None:
            return
        state, learned = calls.state, counted_calls._LEARNED
        rest = self.sequence[self.ran:]
        count = 1
        if self.inside:  # the error came out of rest[0], a counted entry
            if _told_in_a_call(error):
                return  # told in the call it came out of
            if getattr(calls, "left", 0):  # the entry's own count left the calls the peers wait in: nothing more
                return
            made, planned = state.seqs.get(calls.code, 0) - calls.start, learned.get(calls.key)
            if planned is not None and made < planned:
                return
            # never counted (its first run): the peers wait in its next call, in its lane; one is guessed
            rest = rest[1:] if planned is not None else [(rest[0][0], False)]
        which = None
        for entry, handed in rest:
            count = 0 if handed else learned.get(self._key(entry), 1)
            if count:
                which = autograd_lane() if entry[0] == "B" else None  # a backward's calls are autograd's
                break
        # the peers fail in the first of these calls, whose transfers they posted: this rank serves it (every
        # message they posted gets its other end), so the group stays usable; where it cannot, it is declared
        # dead on every rank, by name
        drained = leave_calls(state, f"commfuse.strands (left after {type(error).__name__} on rank {state.rank})", error,
                    count or 1, which)
        if drained and hasattr(error, "add_note"):  # Python 3.11+
            error.add_note(f"commfuse: rank {state.rank} left the strands' schedule after this error; the peers "
                           "were told in their next call, whose transfers this rank completed: the group stays "
                           "usable")


def profile(stages: Sequence[Stage], inputs, *, group=None, repeats: int = 3) -> list[Stage]:
    """``stages`` with their forward figures measured on ``group``, for the plan search: each stage's forward
    on ``inputs`` (the first stage's: a tensor or a tuple of them; each later stage takes what the one before
    returned) timed ``repeats`` times under ``commfuse.runtime.measure("compute_only")``,
    ``measure("comm_only")`` and ``measure("outside_only")``, in seconds: ``compute`` is the compute-only
    median; ``comm`` the transfers the comm-only runs made, from the steps they recorded
    (``commfuse.runtime.record_events``: each step's post to the end of its wait), their median. A stage whose
    forward makes no commfuse call gets ``comm=0`` and is timed compute-only alone; one that makes any never
    gets 0 (its calls recorded no step: the comm-only median less the outside-only one, or the comm-only
    median where that is not above 0). The backward figures are left to their defaults.

    Every rank of ``group`` must call it with the same stages, as :func:`run` is called; the figures come from
    the group's rank 0, so every rank plans alike. Runs under ``torch.no_grad``. The ranks start each timed run
    together through an exchange of commfuse's (numbered, bounded by its timeout) that carries each rank's
    verdict: a rank whose arguments are refused, or whose stage raised, is named on every rank there and every
    rank raises (the rank its own error, the others ``PeerFailedError``; a stage's calls it left are
    announced, as under :func:`run`), the group usable."""
    import time
    from dataclasses import replace

    from commfuse.planning.agreement import agree, share
    from commfuse.runtime import measure, record_events
    from commfuse.runtime.admission import refuse_dead
    from commfuse.runtime.groups import state_of_group

    on = _group(group)
    if on is not None:
        refuse_dead(state_of_group(on), "commfuse.strands.profile")
    what, label, device = "commfuse.strands.profile", "strands.profile", _device(on)
    so = "no rank goes on profiling (the group is usable)"

    def checked() -> tuple:
        if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
            raise CommfuseValueError(f"commfuse.strands.profile: repeats must be an int >= 1, got {repeats!r}")
        _check_stages(stages, "profile")
        return _tuple(inputs, "commfuse.strands.profile's inputs")

    values = agree(on, what, checked, lambda _: [("the stages (give every rank the same stages)",
                                                  [s.name for s in stages]), ("repeats", repeats)],
                   label=label, device=device, so=so)
    where = values[0].device
    state = None if on is None else state_of_group(on)
    error: list = []  # this rank's error since the ranks last met, told at the next meeting

    def attempt(stage: Stage, args: tuple, first: bool):
        """``stage.fn(*args)``, its calls counted; an ``Exception`` is kept for the next meeting, the calls
        the peers wait in left (the first run of a stage, before any call: its first call, as :func:`run`
        guesses)."""
        from commfuse.runtime.admission import counted_calls, leave_calls

        calls = counted_calls(on, f"{what}: stage {stage.name!r}", ("commfuse.strands.profile", stage.name,
                                                                 getattr(stage.fn, "__qualname__", "")))
        try:
            with calls:
                out = stage.fn(*args)  # in a measurement mode, what the ops return is not the stage's output
                return (_tuple(out, f"stage {stage.name!r}") if first else None), calls
        except Exception as e:  # noqa: BLE001 - told to every rank at the next meeting
            error.append(e)
            told = _told_in_a_call(e)
            if state is not None and first and not told and not getattr(calls, "left", 0) and \
                    state.seqs.get(calls.code, 0) == calls.start:
                leave_calls(state, f"{what} (left after {type(e).__name__} on rank {state.rank})", e, 1)
            return None, calls

    def meet(items: list) -> None:
        """Every rank here before the next timed run: this rank's error, if any, told to every rank."""
        if where.type != "cpu":  # an accelerator's queue drained first
            torch.accelerator.synchronize(where)

        def verdict():
            if error:
                raise error[0]
        agree(on, what, verdict, lambda _: items, label=label, device=device, so=so)

    figures = []
    with torch.no_grad():
        for k, stage in enumerate(stages):
            if k:  # after the stage before's last run: its error, if any, told before this one runs
                meet([])
            with record_events() as events:  # a normal run first: the outputs the next stage takes, a warm-up
                outputs, calls = attempt(stage, values, True)
            made = bool(events) or (state is not None and state.seqs.get(calls.code, 0) > calls.start)
            meet([(f"whether stage {stage.name!r} makes commfuse calls", made)])
            seconds, observed = {}, []
            for mode in ("compute_only", "comm_only", "outside_only") if made else ("compute_only",):
                samples = []
                for r in range(repeats):
                    if r or mode != "compute_only":
                        meet([])
                    with record_events() as steps:
                        start = time.perf_counter()
                        with measure(mode):
                            attempt(stage, values, False)
                        if where.type != "cpu":
                            torch.accelerator.synchronize(where)
                        samples.append(time.perf_counter() - start)
                    if mode == "comm_only":
                        observed.append(sum(e["wait"][1] - e["post"][0] for e in steps
                                            if e["sends"] or e["recvs"] or e["collectives"]))
                seconds[mode] = statistics.median(samples)
            figures += [seconds["compute_only"], _comm(seconds, observed) if made else 0.0]
            values = outputs
    if where.type != "cpu":
        torch.accelerator.synchronize(where)

    def mine() -> list:
        if error:
            raise error[0]
        return figures

    figures = share(on, what, mine, label=label, device=device, so=so)[0]  # rank 0's: one plan everywhere
    return [replace(s, compute=figures[2 * k], comm=figures[2 * k + 1]) for k, s in enumerate(stages)]


def _comm(seconds: dict, observed: list) -> float:
    """A stage's transfers in seconds, for one that makes commfuse calls: the median of what the comm-only runs'
    steps recorded; where they recorded none (the calls ran where this thread's record does not reach), the
    comm-only median less the outside-only one, or the comm-only median where that is not above 0."""
    if any(observed):
        return statistics.median(observed)
    rest = seconds["comm_only"] - seconds["outside_only"]
    return rest if rest > 0 else seconds["comm_only"]


register_format("strands.profile", lambda v: "commfuse.strands.profile's meeting of the ranks before a timed run")
