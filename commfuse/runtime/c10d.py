"""The built-in torch.distributed (c10d) backend: gloo on CPU, and the generic
accelerator path (CUDA + NCCL, NPU + HCCL, XPU ...) through the same code.

On gloo a step's sends and receives are posted one by one on the process
group (``ProcessGroup.send``/``recv``: the ring cannot deadlock, every send has
its receive in the same step, see ``commfuse.schedule``), and completion is
``work.wait(timeout)``, which blocks the host until the bytes are there while
transfers progress in gloo's own threads. On a device (NCCL, HCCL, ...) the
step's messages are coalesced into one group (NCCL needs a step's sends and
receives together, or a ring deadlocks) with the process group's own
coalescing calls, what ``batch_isend_irecv`` does inside; and when the
backend declares
``Capabilities.streams`` a wait is ``work.wait()`` with no timeout: it only
makes the current (compute) stream wait for the communication stream, so the
host never blocks. The timeout is then kept by the watchdog
(``commfuse.runtime.watchdog``), which polls each step's works, but for the
steps of a call captured in a device graph (the executor's plan says so):
their works stand for kernels that only a replay will run.

Tags: ``begin_call(seq)`` sets the call number that every following message's
tag carries (``channel + TAG_STRIDE * seq``), so on gloo, which matches
messages by tag, a call can only pair with the same call on its peers. NCCL
ignores tags; there the fingerprint check after a failed call does that work.

Where the transport lacks a whole all-to-all (gloo's ``dist.all_to_all`` of
tensor lists raises "Backend gloo does not support alltoall" on torch 2.9 and
2.11; 2.13 has it), :meth:`C10dBackend.collective` remembers that for the
group and runs it as pairwise point-to-point steps instead, without overlap,
and says so once on the ``commfuse`` logger (:class:`_PairwiseHandle`).
``COMMFUSE_PAIRWISE_ALL_TO_ALL=1`` takes that path on every group, so that it
can be tested where the transport has the collective.

The NCCL path was run on an H100 through ``commfuse-cuda`` (which adds a
high-priority communication stream and native fused kernels): see
docs/benchmarks.md and docs/reliability.md. HCCL and other accelerators are
unverified: no such device has been lent to this project.
"""

from __future__ import annotations

import datetime
import logging
import re
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from commfuse.errors import (
    BackendUnavailableError,
    CommfuseError,
    CommfuseTimeoutError,
    CommfuseValueError,
    CommunicationError,
    GroupDeadError,
    PeerFailedError,
    first_line,
)
from commfuse.runtime.board import RECOVER, Stall, board_of, declare_dead, heard
from commfuse.runtime.compiled import describe_stall, stall_position
from commfuse.runtime.drain import account, drain_call
from commfuse.runtime.env import flag
from commfuse.runtime.groups import (
    DEFAULT_TIMEOUT_S,
    MIN_TIMEOUT_S,
    PAIRWISE_CHANNEL,
    TAG_STRIDE,
    describe_fingerprint,
    group_state,
)
from commfuse.runtime.waiting import BACKSTOP_S, wait_blocking
from commfuse.runtime.watchdog import Posting, watchdog
from commfuse.runtime.protocol import Uneven
from commfuse.runtime.rider import Rider
from commfuse.schedule import Collective, Ring, Transfer

log = logging.getLogger("commfuse")

_LAST_DELTA = (0.0, datetime.timedelta(0))
_SUM = dist.ReduceScatterOptions()  # the default reduction, a sum; made once
# torch 2.13 renamed the single-tensor collectives (the old names warn); older torch has only the old ones
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_SINGLE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
#: What c10d raises where a backend lacks the all-to-all of tensor lists: torch's ``Backend::alltoall``
#: default, "Backend gloo does not support alltoall" ("ProcessGroup gloo ..." in older torch). gloo on
#: torch 2.9 and 2.11 has only the one-tensor form (``all_to_all_single``); 2.13 has both.
_NO_ALL_TO_ALL = re.compile(r"does not support alltoall\b")  # not "alltoall_base", all_to_all_single's
_told: set[tuple[str, Collective]] = set()  # (backend, collective) whose fallback this process has logged


def lacks_all_to_all(error: BaseException) -> bool:
    """Whether ``error`` is a backend's refusal of ``dist.all_to_all`` (it lacks the collective)."""
    return isinstance(error, RuntimeError) and _NO_ALL_TO_ALL.search(str(error)) is not None


#: Tags of the receives that close a gloo group's connections (:meth:`C10dBackend.poison`): above every data
#: tag (``channel + TAG_STRIDE * (sequence % SEQUENCE_WRAP)`` < 2 ** 30).
POISON_TAG = 1 << 30


def _backend_of(group) -> str | None:
    """The name of a process group's c10d backend ("gloo", "nccl", "fake"), or None."""
    try:
        return str(dist.get_backend(group))
    except Exception:  # noqa: BLE001 - not a registered group
        return None


def _timed_out(error: RuntimeError) -> bool:
    """Whether a transport's error is its timeout (gloo reports one as a RuntimeError)."""
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


def _delta(timeout: float) -> datetime.timedelta:
    """``timeout`` as the timedelta c10d wants, remembering the last one (calls repeat one timeout); the pair
    is replaced as one tuple, so a thread never reads one call's timeout with another's delta."""
    global _LAST_DELTA
    seconds, delta = _LAST_DELTA
    if seconds != timeout:
        delta = datetime.timedelta(seconds=timeout)
        _LAST_DELTA = (timeout, delta)
    return delta


def _wait_works(works, seconds: float) -> None:
    """Wait for each of ``works`` in turn, each bounded by ``seconds``; a transport's timeout is a TimeoutError."""
    seconds_, delta = _LAST_DELTA
    if seconds_ != seconds:
        delta = _delta(seconds)
    try:
        for work in works:
            work.wait(delta)
    except RuntimeError as e:
        if _timed_out(e):
            raise TimeoutError(str(e)) from e
        raise


class _Handle:
    """Works of one step plus the tensors they touch, kept alive until waited; the host waits.

    A wait runs on the calling thread's waiter (``commfuse.runtime.waiting``): Ctrl-C reaches Python at
    once, the wait is bounded by commfuse's timeout, and past the grace period it reads the group's board
    (a peer that failed, a mismatch, a straggler: ``commfuse.runtime.board``). What it says of itself is
    put together only then, from the backend's call at post time (the plan, the call number, the post's
    number in the call, its peers). A group whose transport completes every transfer at once (torch's
    ``fake`` group, the host-cost benchmark's) waits in place, as a wait that cannot block needs nothing
    more.
    """

    __slots__ = ("works", "outputs", "inflight", "backend", "plan", "checking", "post_no", "seq", "transfers",
                 "span")

    def __init__(self, works, outputs: list[torch.Tensor], inflight, backend: "C10dBackend | None" = None,
                 transfers=None) -> None:
        self.works = works
        self.outputs = outputs
        self.inflight = inflight
        self.backend = backend
        if backend is not None:
            self.plan, self.checking = backend._plan, backend._checking
            self.post_no, self.seq = backend._posts, backend._seq
            #: (sends, recvs) of a step's point-to-point transfers, or a frozenset of peer ranks; None: a whole
            #: collective (every peer)
            self.transfers = transfers

    @property
    def peers(self) -> list[int]:
        """The ranks this wait needs."""
        transfers = self.transfers
        if transfers is None:
            be = self.backend
            return [q for q in range(be.world_size) if q != be.rank]
        if isinstance(transfers, frozenset):
            return sorted(transfers)
        sends, recvs = transfers
        return sorted({t.peer for t, _ in sends} | {t.peer for t, _ in recvs})

    def done(self) -> bool:
        """Whether every transfer of the step has completed (a poll; never blocks)."""
        return all(work.is_completed() for work in self.works)

    def wait(self, timeout: float) -> list[torch.Tensor]:
        backend = self.backend
        if backend is None or backend._instant:
            _wait_works(self.works, timeout)
            self.inflight = None
            return self.outputs
        self.span = timeout + BACKSTOP_S
        try:
            wait_blocking(self._block, timeout, self)
        except CommfuseError:  # a verdict of the board (a drained call's PeerFailedError among them)
            raise
        except RuntimeError as e:
            raise self._failed(e) from e
        self.inflight = None
        return self.outputs

    def _block(self) -> None:
        """On the waiter: the works' own waits, bounded past commfuse's timeout (a backstop)."""
        _wait_works(self.works, self.span)

    # -- what commfuse.runtime.waiting asks of a wait --------------------------------------------------------

    def stall(self):
        """The board's view of this wait (a :class:`~commfuse.runtime.board.Stall`), or None."""
        found = stall_position(self.plan, self.checking, self.seq, self.post_no, self.peers)
        state = group_state(self.backend)
        if found is None or board_of(state) is None:
            return None
        return Stall(state, found[0], describe_fingerprint, self.backend.poison, self._drain)

    def _drain(self, note: dict, position: dict) -> BaseException | None:
        """A peer left the call this wait is in and serves it (``note``): account for what this rank posted in
        the call, complete every message that has no other end (``commfuse.runtime.drain``), and return the
        :class:`PeerFailedError` to raise, the group still usable. None for a wait in a whole collective,
        which cannot be drained (the stall says so, and the group is declared dead on every rank)."""
        if not isinstance(self.transfers, tuple):
            return None
        backend = self.backend
        state = group_state(backend)
        seq, lane = position["seq"], position["lane"]
        counts: dict = {}
        for sends, recvs, base in backend._call_posts:
            for kind, messages in (("s", sends), ("r", recvs)):
                for t, _ in messages:
                    key = (kind, t.peer, t.channel + base)
                    counts[key] = counts.get(key, 0) + 1
        last = []
        if backend._call_posts:
            sends, recvs, base = backend._call_posts[-1]
            last = [(kind, t.peer, t.channel + base, x.numel(), str(x.dtype).removeprefix("torch."))
                    for kind, messages in (("s", sends), ("r", recvs)) for t, x in messages]
        where = position.get("what", "a wait")
        drain_call(state, backend.group, lane, seq, account(counts, last),
                   self.plan.timeout if self.plan is not None else self.checking.timeout,
                   f"draining {where} of call #{seq}, which rank {note.get('rank')} left after {note.get('exc')}: "
                   f"{note.get('message')}", self.works, backend.device)
        error = PeerFailedError(
            f"rank {backend.rank}, waiting in {where} of call #{seq} ({position.get('label')}): rank "
            f"{note.get('rank')} left the call: {note.get('exc')}: {note.get('message')}. The call's transfers "
            "were drained (every message given its other end), so the group stays usable; this call's result "
            "is discarded")
        error._commfuse_drained = True
        state.dirty = True
        return error

    def timeout_text(self, timeout: float) -> str:
        found = stall_position(self.plan, self.checking, self.seq, self.post_no, self.peers)
        what = found[1] if found is not None else f"post {self.post_no} of call #{self.seq}"
        number = found[0]["seq"] if found is not None else self.seq
        return (f"rank {self.backend.rank} timed out after {timeout:g} s in {what} (call #{number} on "
                f"{group_state(self.backend).name}), waiting for rank {', '.join(map(str, sorted(set(self.peers))))}")

    def abandon(self, why: str) -> None:
        """The wait was left unfinished: note it on the board and end the group on this rank (a posted
        transfer cannot be taken back)."""
        backend = self.backend
        state = group_state(backend)
        found = stall_position(self.plan, self.checking, self.seq, self.post_no, self.peers)
        board = board_of(state)
        if found is not None and board is not None:
            position = found[0]
            board.log("fail", seq=position["seq"], lane=position["lane"], thread=position["thread"],
                      label=position["label"], step=None, exc=why.split(" ", 1)[0], message=why, continuing=False)
        where = found[1] if found is not None else "a wait"
        declare_dead(state, GroupDeadError(f"rank {backend.rank}: {why} in {where}; the group is dead: {RECOVER}"),
                     backend.poison)

    def _failed(self, error: RuntimeError) -> CommunicationError:
        """The transport failed this wait (a peer closed its connections): what the board says of why, and
        the group ends here too, so that ranks waiting on this one hear of it at once."""
        backend = self.backend
        state = group_state(backend)
        if isinstance(state.error, CommunicationError):
            return state.error  # this rank declared it dead already (a stall's verdict, a timeout)
        found = stall_position(self.plan, self.checking, self.seq, self.post_no, self.peers)
        what = found[1] if found is not None else f"post {self.post_no} of call #{self.seq}"
        call = (found[0]["seq"], found[0]["lane"]) if found is not None else (self.seq, None)
        told = _board_cause(state, backend.rank, f"waiting in {what}", call)
        if told is None:
            told = CommunicationError(
                f"rank {backend.rank} failed in {what}: the transport gave up ({first_line(error, 200) or type(error).__name__}), and no "
                f"rank noted why on the board: a peer died or closed its connections. The group is dead on this "
                f"rank: {RECOVER}")
            declare_dead(state, told, backend.poison)
        return state.error if isinstance(state.error, CommunicationError) else told


class _RiddenHandle(_Handle):
    """A gloo step that carried the call's digest pairs (``commfuse.runtime.rider``): its wait also reads the
    pairs that arrived."""

    __slots__ = ("rider", "arriving")

    def wait(self, timeout: float) -> list[torch.Tensor]:
        outputs = _Handle.wait(self, timeout)
        self.rider.absorb(self.arriving)
        return outputs


def _board_cause(state, rank: int, where: str, call: tuple = (None, None)) -> CommunicationError | None:
    """Why a transport failed, as the board tells it (the group is then declared dead here, with the same
    root): this rank was late, a rank declared the group dead, or a rank left a call; None when nobody
    noted anything. ``call``: the (number, lane code) of the call this rank waits in, when known. A rank
    that left that call is its cause; failures of earlier calls that every rank settled alike are history,
    and are named only when no note concerns a later call."""
    board = board_of(state)
    if board is None:
        return None
    fails = []
    for note in board.news():
        kind, who = note.get("kind"), note.get("rank")
        if who == rank:
            continue
        if kind == "gaveup" and rank in note.get("late", ()):
            return declare_dead(state, CommfuseTimeoutError(
                f"rank {rank} (this rank) was late, {where}: rank {who} gave up waiting for it after "
                f"{note.get('after'):g} s in {note.get('what')} of call #{note.get('seq')} ({note.get('label')}); "
                f"the group is dead: {RECOVER}"), None)
        if kind == "dead":
            return declare_dead(state, heard(note, rank, where), None, note)
        if kind == "fail":
            fails.append(note)
    if fails:
        # a note of the call waited in, else of the latest call; of equals, the last written
        seq, code = call
        failed = max(reversed(fails), key=lambda n: (
            seq is not None and n.get("seq") == seq and (code is None or n.get("lane") == code),
            n.get("seq") if isinstance(n.get("seq"), int) else -1))
        step = failed.get("step")
        return declare_dead(state, PeerFailedError(
            f"rank {rank}, {where}: rank {failed.get('rank')} failed call #{failed.get('seq')} "
            f"({failed.get('label')})" + (f" in step {step}" if step is not None else "")
            + f": {failed.get('exc')}: {failed.get('message')}; the group is dead: {RECOVER}"), None)
    return None


class _StreamHandle(_Handle):
    """A step on a stream-ordered backend: ``wait`` orders the current stream after the works and hands
    them to the watchdog, which enforces the timeout; the host does not block.

    What the watchdog says on expiry is put together only then: from the
    executor's plan of the call and the number of this post in it (the step,
    the op and the peers, as a host-blocking timeout names them), or, outside
    a plan (the fingerprint check), from ``what`` and the step's transfers.
    """

    __slots__ = ("what", "call")

    def done(self) -> bool:
        """Always: the host never waits on a stream-ordered step, so work handed to its wait
        (``commfuse.runtime.steps.FILLERS``) is queued one item per step, between the step's own kernels."""
        return True

    def __init__(self, works, outputs, inflight, backend: "C10dBackend", what: str | None) -> None:
        super().__init__(works, outputs, inflight, backend)
        self.what = what
        state = backend._commfuse_state if hasattr(backend, "_commfuse_state") else group_state(backend)
        self.call = (state.current(), state.lane)  # the host runs ahead: the call this step belongs to
        if what is None and self.plan is None:  # a post's transfers outside a plan's steps (the call check's)
            sends, _, recvs = inflight
            self.what = "transfers with rank " + ", ".join(map(str, sorted({t.peer for t, _ in (*sends, *recvs)})))

    def wait(self, timeout: float) -> list[torch.Tensor]:
        works = self.works
        for work in works:
            work.wait()
        plan = self.plan
        # A step captured in a device graph is not watched: its works stand for kernels that run only when the
        # graph is replayed, and polling them from the watchdog's thread in the middle of the capture would
        # query the device there (c10d keeps captured NCCL works from its own watchdog for the same reason).
        if works and (plan is None or not plan.capturing):
            watchdog().watch(works, time.monotonic() + timeout, lambda cause: self.describe(timeout, cause),
                             self.backend._expired, self.told)
        self.inflight = None
        return self.outputs

    def told(self) -> BaseException | None:
        """What the group's board says of this step's call once it has been pending past the grace period
        (asked by the watchdog, on its thread): the named error of a peer's failure or of a group declared
        dead (the group is then dead here too), else None. UNVERIFIED on a device (no GPU on this project's
        CI); the logic is the host-blocking waits' (``commfuse.runtime.board.Stall``)."""
        state = group_state(self.backend)
        found = stall_position(self.plan, self.checking, self.seq, self.post_no, self.peers)
        if found is None or board_of(state) is None:
            return None
        position = found[0]
        position["seq"], (position["thread"], position["lane"]) = self.call[0], self.call[1]
        try:
            Stall(state, position, describe_fingerprint, self.backend.poison).read_news()
        except CommunicationError as e:
            return e
        return None

    def describe(self, timeout: float, cause: str | None = None) -> str:
        """What the watchdog says of this step: it outlived ``timeout`` (``cause`` None), or its transfers
        failed with ``cause``."""
        if cause is None:
            detail = (f"the device had not finished them {timeout:g} s after they were posted (the host did not "
                      "block on them; commfuse's watchdog saw it): a peer died, hung, or called another op")
        else:
            detail = f"the transport failed them (commfuse's watchdog saw it): {cause}"
        return self.backend._describe_post(self.plan, self.checking, self.seq, self.post_no, self.what, detail,
                                           failed=cause is not None)


class _PairwiseHandle:
    """A whole all-to-all as ``n - 1`` pairwise steps of point-to-point transfers, run when waited: for a
    group whose transport lacks the collective (:meth:`C10dBackend.collective`). No overlap: nothing
    moves before ``wait``, and the steps run one after the other.

    At step ``k`` (1 .. n - 1) rank ``r`` sends its block for rank ``r + k`` there and receives the block
    of rank ``r - k`` (``Ring(n).next(r, k)`` and ``.prev(r, k)``); its own block is copied. Each step's
    send and receive are posted together (one coalesced group where the transport coalesces) and waited
    before the next step's: every rank's step ``k`` pairs with its two peers' step ``k``, so a step never
    waits for one that is not yet posted, whatever the transport's ordering. ``wait(timeout)`` bounds the
    whole exchange; a step still unfinished at the deadline raises ``TimeoutError`` naming the rank, the
    step and both peers. Messages carry ``PAIRWISE_CHANNEL`` on the call's tag base; consecutive
    exchanges of one call reuse it, which is safe because each finishes on a rank before the next starts
    and a pair's messages of one tag arrive in the order they were sent.
    """

    __slots__ = ("backend", "inputs", "outputs", "tag")

    def __init__(self, backend: "C10dBackend", inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
                 tag: int) -> None:
        self.backend, self.inputs, self.outputs, self.tag = backend, inputs, list(outputs), tag

    def wait(self, timeout: float) -> list[torch.Tensor]:
        be, outputs = self.backend, self.outputs
        if be is None:  # waited before (the executor drains a failed step's handles)
            return outputs
        self.backend = None
        g, r, n, tag = be.group, be.rank, be.world_size, self.tag
        ring = Ring(n)
        deadline = time.monotonic() + timeout
        outputs[r].copy_(self.inputs[r])
        for k in range(1, n):
            to, source = ring.next(r, k), ring.prev(r, k)
            send, recv = self.inputs[to], outputs[source]
            if not send.numel() and not recv.numel():  # an uneven exchange's empty pair: nothing travels
                continue
            if not send.numel() or not recv.numel():
                works = []
                if send.numel():
                    works.append(g.send([send], to, tag))
                if recv.numel():
                    works.append(g.recv([recv], source, tag))
            elif be._coalesce and be._coalescing_group():
                g._start_coalescing(be.device)
                try:
                    g.send([send], to, tag)
                    g.recv([recv], source, tag)
                finally:
                    work = g._end_coalescing(be.device)
                works = [work] if work is not None else []
            else:
                works = [g.send([send], to, tag), g.recv([recv], source, tag)]
            left = max(deadline - time.monotonic(), MIN_TIMEOUT_S)
            try:
                _Handle(works, [], None, be, frozenset((to, source))).wait(left)
            except TimeoutError as e:
                if isinstance(e, CommunicationError):
                    raise
                raise TimeoutError(
                    f"rank {r}: step {k} of {n - 1} of the pairwise all_to_all (the {be.name} backend lacks "
                    f"all_to_all), sending to rank {to} and receiving from rank {source}, was not done "
                    f"{timeout:g} s after the exchange began: {e}"
                ) from e
        return outputs


class _Complex:
    """A handle over complex tensors moved as their real views: ``wait`` gives them back complex."""

    __slots__ = ("handle",)

    def __init__(self, handle) -> None:
        self.handle = handle

    def wait(self, timeout: float) -> list[torch.Tensor]:
        return [torch.view_as_complex(t) for t in self.handle.wait(timeout)]


def _send_recv(group, sends, recvs, base: int) -> list:
    """A step's messages posted one by one on ``group`` (tag ``channel + base``): its works."""
    works = [group.send([x], t.peer, t.channel + base) for t, x in sends]
    works += [group.recv([x], t.peer, t.channel + base) for t, x in recvs]
    return works


def _coalesced(group, sends, recvs, base: int, device: torch.device) -> list:
    """A step's messages as one coalesced group on ``device`` (what NCCL needs): its one work."""
    group._start_coalescing(device)
    try:
        for t, x in sends:
            group.send([x], t.peer, t.channel + base)
        for t, x in recvs:
            group.recv([x], t.peer, t.channel + base)
    finally:
        work = group._end_coalescing(device)
    return [work] if work is not None else []


def _coalesces(group, device: torch.device) -> bool:
    """Whether ``group`` coalesces point-to-point calls on ``device`` (``_start_coalescing`` /
    ``_end_coalescing``, as NCCL does): the test batch_isend_irecv makes."""
    try:
        return bool(group._get_backend(device).supports_coalescing) and hasattr(group, "_start_coalescing")
    except Exception:  # noqa: BLE001 - no such backend on this group, or an older torch: send one by one
        return False


class C10dBackend:
    """Transfers through a ``torch.distributed`` process group."""

    capabilities = None  # set from the plugin record by ``commfuse.backends.get``

    def __init__(self, group=None, device=None, *, name: str = "gloo") -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise BackendUnavailableError(
                f"backend {name!r} needs an initialised torch.distributed process group: call "
                "torch.distributed.init_process_group(...) first (or run under torchrun)"
            )
        self.name = name
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        if self.rank < 0:
            raise BackendUnavailableError(
                f"this process (global rank {dist.get_rank()}) is not a member of the group it was given"
            )
        self.world_size = dist.get_world_size(self.group)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._tag_base = 0
        #: the point-to-point messages posted on gloo since the call (or its check) began, one (sends, recvs,
        #: tag base) per post: what this rank accounts for when a call it waits in is drained
        #: (``commfuse.runtime.drain``)
        self._call_posts: list = []
        self._seq = None
        self._plan = None
        self._checking = None  # the plan whose call check (fingerprint ring all-gather) is being posted
        self._posts = 0
        #: the digest the next call carries beside its transfers (:meth:`carry`), the call's that carries it, and
        #: the one a call carried before the call now running began (for :meth:`carried`)
        self._rider_next: Rider | None = None
        self._rider: Rider | None = None
        self._ridden: Rider | None = None
        self._coalescing: bool | None = None  # whether the group coalesces P2P (NCCL); on the first device post
        # gloo (and any CPU group) posts message by message; devices coalesce a step (NCCL needs it)
        self._coalesce = self.device.type != "cpu"
        self._stream_ordered: bool | None = None  # from capabilities.streams, on the first post
        self._held: Posting | None = None  # a stream-ordered backend's post in progress, for the watchdog
        #: a group whose transfers complete at once (torch's ``fake`` group): waits need no waiter
        self._instant = _backend_of(self.group) == "fake"
        if flag("COMMFUSE_PAIRWISE_ALL_TO_ALL", False):
            group_state(self).lacking.setdefault(Collective.ALL_TO_ALL, "COMMFUSE_PAIRWISE_ALL_TO_ALL is set")

    def begin_call(self, seq: int | None, plan=None) -> None:
        """The executor's call number for the messages that follow (None: untagged, the fingerprint check),
        and the plan of the call (its steps are what a stalled post's watchdog message names; the check's
        posts are not its steps)."""
        self._posts = 0
        self._call_posts = []
        if seq is None:
            self._seq, self._plan, self._checking, self._tag_base = None, None, plan, 0
        else:
            self._seq, self._plan, self._checking, self._tag_base = seq, plan, None, TAG_STRIDE * seq
            if self._rider_next is not None or self._rider is not None:
                self._ridden, self._rider, self._rider_next = self._rider, self._rider_next, None
        held = self._held
        if held is not None and plan is not None:
            held.timeout = plan.timeout

    def carries(self) -> bool:
        """Whether a call on this group can carry a digest beside its transfers (``commfuse.runtime.rider``):
        on gloo, on the CPU, with a peer that is not torch's ``fake`` group's stand-in."""
        return not (self._coalesce or self._instant or self.world_size <= 1)

    def carry(self, digest: int) -> None:
        """The next call on this group carries ``digest`` (where :meth:`carries`); :meth:`carried` says what
        it found."""
        if self.carries():
            self._rider_next = Rider(digest)

    def carried(self) -> bool | None:
        """The verdict of the call that carried the digest (``Rider.verdict``; later calls may have run since),
        None where none did; forgets it."""
        rider = self._rider or self._ridden or self._rider_next
        self._rider = self._ridden = self._rider_next = None
        return None if rider is None else rider.verdict()

    def _streams(self) -> bool:
        ordered = self._stream_ordered
        if ordered is None:
            ordered = self._stream_ordered = (
                bool(getattr(self.capabilities, "streams", False)) and self.device.type != "cpu"
            )
            if ordered:
                self._held = watchdog().posting(self._describe_held, self._record_error)
                plan = self._plan or self._checking
                self._held.timeout = plan.timeout if plan is not None else DEFAULT_TIMEOUT_S
        return ordered

    def _describe_held(self, timeout: float) -> str:
        detail = (f"the host was still inside the transport's post {timeout:g} s after entering it (NCCL sets "
                  "up a pair's communicator on its first transfer and waits there for the peer): a peer died, "
                  "hung, or never called")
        n, r = self.world_size, self.rank
        what = f"transfers with rank {(r + 1) % n} and {(r - 1) % n}" if self._checking is not None else "a post"
        return self._describe_post(self._plan, self._checking, self._seq, self._posts, what, detail)

    def _describe_post(self, plan, checking, seq, post_no: int, what: str | None, detail: str,
                       failed: bool = False) -> str:
        """What the watchdog says of post ``post_no`` (from 1) of a call: its step of ``plan`` (the op and the
        peers, as a host-blocking wait names them); else its step of the call check of ``checking``; else
        ``what`` with the call number. ``detail`` last."""
        if plan is not None:
            message = describe_stall(plan, post_no, detail, failed)
            if message is not None:
                return message
        if checking is not None:
            return (f"rank {self.rank}: step {post_no - 1} of the call check of {checking.label} (the "
                    f"fingerprints' ring all-gather), {what}: {detail}")
        return f"rank {self.rank}: {what} (call #{seq}, post {post_no}): {detail}"

    def poison(self) -> None:
        """Close this rank's connections of the group, so that every peer waiting on it fails at once instead
        of waiting out its timeout (the group was declared dead: ``commfuse.runtime.board.declare_dead``).
        gloo: a receive nobody will answer, waited 1 ms: gloo's own timeout closes every connection of the
        context (one per device; the tags cover four). A stream-ordered group is aborted where torch can."""
        if self.world_size <= 1 or self._instant:
            return
        if self._streams() or _backend_of(self.group) not in ("gloo", None):
            self._abort()
            return
        peer = (self.rank + 1) % self.world_size
        for k in range(4):
            try:
                self.group.recv([torch.empty(1)], peer, POISON_TAG + k).wait(datetime.timedelta(milliseconds=1))
            except Exception:  # noqa: BLE001 - what we want: gloo closed the connections
                pass

    def _abort(self) -> None:
        abort = getattr(self.group, "abort", None)
        if callable(abort):
            abort()
            return
        fallback = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if fallback is not None:
            fallback(self.group)

    def _record_error(self, error: BaseException) -> None:
        group_state(self).error = error

    def _handle(self, works, outputs, inflight, what: str | None, transfers=None):
        if self._streams():
            return _StreamHandle(works, outputs, inflight, self, what)
        if isinstance(transfers, tuple):  # a host-blocking wait on a device's coalesced step: drainable too
            self._call_posts.append((*transfers, self._tag_base))
        return _Handle(works, outputs, inflight, self, transfers)

    def _expired(self, error: BaseException) -> None:
        """The watchdog saw a step outlive its timeout: fail every later call on the group, abort it."""
        self._record_error(error)
        self._abort()

    def __repr__(self) -> str:
        return f"C10dBackend(name={self.name!r}, rank={self.rank}, world_size={self.world_size}, device={self.device})"

    def post(
        self, sends: Sequence[tuple[Transfer, torch.Tensor]], recvs: Sequence[tuple[Transfer, torch.Tensor]]
    ) -> _Handle:
        base = self._tag_base
        self._posts += 1
        g = self.group
        if not self._coalesce:  # gloo: message by message, written out (the common CPU step, kept lean)
            if self._rider is not None:
                return self._post_ridden(sends, recvs)
            works, buffers = [], []
            try:
                for t, x in sends:
                    works.append(g.send([x], t.peer, t.channel + base))
                for t, x in recvs:
                    works.append(g.recv([x], t.peer, t.channel + base))
                    buffers.append(x)
            except RuntimeError as e:  # the connections are closed: what the board says of why, if anything
                raise _Handle(works, [], None, self, (sends, recvs))._failed(e) from e
            self._call_posts.append((sends, recvs, base))
            return _Handle(works, buffers, sends, self, (sends, recvs))
        buffers = [x for _, x in recvs]
        # A device group (NCCL, HCCL) must see a step's sends and receives as one group, or a ring deadlocks.
        # This is what batch_isend_irecv does, without its per-call P2POp objects and list checks, whose host
        # cost decided the ring's speed on an H100 (docs/benchmarks.md, "Measured on an H100").
        coalescing = self._coalescing
        if coalescing is None:
            coalescing = self._coalescing = _coalesces(g, self.device)
            self._streams()
        if coalescing:
            works = self._issue(_coalesced, g, sends, recvs, base, self.device)
        else:
            works = self._issue(_send_recv, g, sends, recvs, base)
        return self._handle(works, buffers, (sends, buffers, recvs), None, (sends, recvs))

    def _post_ridden(self, sends, recvs) -> _RiddenHandle:
        """:meth:`post` on gloo of a step that carries the call's digest pairs too (``commfuse.runtime.rider``):
        one to and one from each peer of the step, on their own tag; drained like the step's own messages."""
        rider, base, g = self._rider, self._tag_base, self.group
        own = len(recvs)
        sends, recvs, arriving = rider.extend(sends, recvs)
        works = []
        try:
            for t, x in sends:
                works.append(g.send([x], t.peer, t.channel + base))
            for t, x in recvs:
                works.append(g.recv([x], t.peer, t.channel + base))
        except RuntimeError as e:
            raise _Handle(works, [], None, self, (sends, recvs))._failed(e) from e
        self._call_posts.append((sends, recvs, base))
        handle = _RiddenHandle(works, [x for _, x in recvs[:own]], sends, self, (sends, recvs))
        handle.rider, handle.arriving = rider, arriving
        return handle

    def _issue(self, call, *args, **kwargs):
        """``call(*args, **kwargs)``, a transport's issue, with the watchdog told that the host is inside it
        (stream-ordered backends; see :meth:`Watchdog.posting`)."""
        held = self._held
        if held is None:
            return call(*args, **kwargs)
        held.since = time.monotonic()
        try:
            return call(*args, **kwargs)
        finally:
            held.since = None

    def collective(
        self, kind: Collective, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]
    ) -> _Handle:
        if inputs and inputs[0].is_complex() or outputs and outputs[0].is_complex():
            # gloo has no complex collectives ("Invalid scalar type"): they move as their real views
            real = [torch.view_as_real(t) for t in inputs], [torch.view_as_real(t) for t in outputs]
            if isinstance(inputs, Uneven):
                real = Uneven(real[0]), Uneven(real[1])
            return _Complex(self.collective(kind, *real))
        g = self.group
        self._posts += 1
        if self._rider is not None:
            self._rider.wholes += 1
        self._streams()  # makes the watchdog's guard of a stream-ordered backend before its first issue
        if kind is Collective.ALL_GATHER:
            work = self._issue(dist.all_gather, list(outputs), inputs[0], group=g, async_op=True)
        elif kind is Collective.REDUCE_SCATTER:
            work = self._issue(dist.reduce_scatter, outputs[0], list(inputs), group=g, async_op=True)
        else:
            lacking = group_state(self).lacking
            if kind in lacking:
                return self._pairwise(kind, inputs, outputs, lacking[kind])
            if isinstance(inputs, Uneven):  # every rank of the call takes this path, alike or not here
                return self._uneven_all_to_all(inputs, outputs)
            try:
                work = self._issue(dist.all_to_all, list(outputs), list(inputs), group=g, async_op=True)
            except RuntimeError as e:
                if not lacks_all_to_all(e):
                    raise
                # the refusal comes before anything is sent, on every rank alike: the group is as it was
                why = lacking[kind] = f"torch {torch.__version__} refused it: {first_line(e, None)}"
                return self._pairwise(kind, inputs, outputs, why)
        return self._handle([work], list(outputs), (inputs, outputs), f"the whole {kind.value}")

    def _uneven_all_to_all(self, inputs, outputs) -> _Handle:
        """A whole all-to-all of blocks of different sizes (an MoE dispatch's): ``all_to_all_single`` with
        split sizes over the blocks laid end to end (gloo's list form wants one shape). The blocks that
        arrive are views of one receive buffer."""
        send = torch.cat([t.reshape(-1) for t in inputs]) if inputs else torch.empty(0)
        counts_in = [t.numel() for t in inputs]
        counts_out = [t.numel() for t in outputs]
        flat = torch.empty(sum(counts_out), dtype=outputs[0].dtype, device=outputs[0].device)
        views, at = [], 0
        for t, c in zip(outputs, counts_out):
            views.append(flat.narrow(0, at, c).view(t.shape))
            at += c
        work = self._issue(dist.all_to_all_single, flat, send, counts_out, counts_in, group=self.group,
                           async_op=True)
        return self._handle([work], views, (inputs, outputs), "the whole all_to_all (uneven blocks)")

    def _pairwise(self, kind: Collective, inputs, outputs, why: str) -> _PairwiseHandle:
        """The all-to-all the group's transport lacks, as pairwise steps (:class:`_PairwiseHandle`); the first
        time in this process for this backend, a WARNING on the ``commfuse`` logger says so and why."""
        if (self.name, kind) not in _told:
            _told.add((self.name, kind))
            log.warning(
                "commfuse: the %s backend lacks %s on %s (%s); commfuse runs it as pairwise send/receive "
                "steps instead, one per peer, without overlap (logged once per process)",
                self.name, kind.value, group_state(self).name, why,
            )
        return _PairwiseHandle(self, inputs, outputs, self._tag_base + PAIRWISE_CHANNEL)

    def _coalescing_group(self) -> bool:
        """Whether the group coalesces point-to-point calls on the device (asked once)."""
        coalescing = self._coalescing
        if coalescing is None:
            coalescing = self._coalescing = _coalesces(self.group, self.device)
        return coalescing

    def collective_into(self, kind: Collective, input: torch.Tensor, output: torch.Tensor) -> _Handle:
        """One whole all-gather or reduce-scatter over single tensors, rank by rank along dim 0 of the bigger
        one (torch's ``all_gather_into_tensor`` / ``reduce_scatter_tensor``, sum); ``wait`` returns
        ``[output]``."""
        if input.is_complex():  # moved as real views (see collective)
            return _Complex(self.collective_into(kind, torch.view_as_real(input), torch.view_as_real(output)))
        g = self.group
        self._posts += 1
        if self._rider is not None:
            self._rider.wholes += 1
        if not self._coalesce:
            if kind is Collective.ALL_GATHER:
                work = g._allgather_base(output, input)
            else:
                work = g._reduce_scatter_base(output, input, _SUM)
            return _Handle([work], [output], (input, output), self)
        self._streams()
        single = _ALL_GATHER_SINGLE if kind is Collective.ALL_GATHER else _REDUCE_SCATTER_SINGLE
        work = self._issue(single, output, input, group=g, async_op=True)
        return self._handle([work], [output], (input, output), f"the whole {kind.value}")

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, device=self.device)

    def timing_event(self):
        """A timing event of this backend's device (``torch.Event``, recorded on its current stream): the
        flight recorder's device stamps (``COMMFUSE_DEVICE_TIMING=1``). A device whose torch has no timing
        events refuses by name."""
        try:
            return torch.Event(device=self.device, enable_timing=True)
        except RuntimeError as e:
            raise CommfuseValueError(
                f"COMMFUSE_DEVICE_TIMING=1: the device {self.device} gives no timing events ({e}); unset it") from e
