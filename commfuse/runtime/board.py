"""The group's notice board: how a failure on one rank, or where a stalled rank waits, reaches every rank.

commfuse's transfers cannot say why they stopped: a rank whose peer raised in
its compute, skipped a call, called another op, or is slow, just waits. So
every process group has a board in the key-value store its ranks already
share (the c10d store of the group). Nothing is written or read on the fast
path: a rank writes only when something went wrong on it, and reads only
while one of its waits has outlasted :data:`GRACE_S` (``COMMFUSE_GRACE_S``).

What is on it, under ``commfuse/<incarnation>/`` in the group's store (c10d
gives every group a store of its own; the incarnation counts the group's
states on this rank, one more after each ``commfuse.backends.release()`` and
for each group made again under the same name, in step on every rank, so a
group made again on the same store, or numbered again after ``release()``,
never reads the old numbering's notes; a note on a call only counts for the
call of the same number from the same thread):

* a log of notes, appended (``log/n`` counts them, ``log/<i>`` holds one):
  ``fail`` (a rank's part of call #seq failed: which op, step, exception, and
  whether it still completes the call's transfers), ``dead`` (a rank declared
  the group unusable, and why) and ``gaveup`` (a rank timed out waiting for
  ranks that never came: the stragglers it names read it when they arrive);
* ``at/<rank>``: where a stalled rank waits (call number, thread, signature
  digest and fingerprint, step, the ranks it waits for), deleted when its
  wait ends;
* ``drain/<lane>/<seq>/<rank>``: what a rank posted in call #seq, published when a rank that left the
  call serves it (``commfuse.runtime.drain``), so that every message gets its other end;
* ``knows/<lane>/<seq>/<rank>``: a rank acknowledges that it knows call #seq
  failed somewhere; a rank that failed sends the rest of the call's
  transfers to a peer only once that peer knows, so no rank ever computes on
  data made after a failure without being told first.

A :class:`Stall` is what a wait does once it has outlasted the grace period:
it posts its position, reads the new notes and the positions of the ranks it
waits for (following their waits), and comes to a verdict: a peer of this
call failed and completes its transfers (this rank now *knows*: it
acknowledges and keeps waiting, then stops computing and raises
:class:`~commfuse.errors.PeerFailedError` once the call's transfers are
done); a peer left the call and serves it (the call is drained, then
:class:`~commfuse.errors.PeerFailedError`, the group usable); a peer failed without taking part, declared the group dead, or is at
another call, thread or signature (the transfers can never pair: the group
is declared dead on this rank, which closes its connections so that its
peers hear of it at once, and a named error is raised); or nothing yet (a
peer is late: keep waiting; at the timeout the late rank is named).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from commfuse.errors import CommfuseTimeoutError, GroupDeadError, MismatchError, PeerFailedError
from commfuse.runtime.env import number

__all__ = ["GRACE_S", "POLL_S", "RECOVER", "Board", "Stall", "board_of", "declare_dead", "grace", "heard"]

#: A wait that lasts longer than this (seconds) reads the board; ``COMMFUSE_GRACE_S`` sets it. A failure on
#: one rank reaches its peers within about this plus two :data:`POLL_S`.
GRACE_S = 0.5

#: How many calls' failure notes a board keeps (:attr:`Board.fails`), oldest dropped first.
FAILS_KEPT = 64

#: How often a stalled wait reads the board again, in seconds.
POLL_S = 0.2
#: How many ranks a stalled wait follows along the chain of who waits for whom.
MAX_CHAIN = 64
#: What to do once a group is dead.
RECOVER = ("re-create the process group (torch.distributed.destroy_process_group(), then init_process_group(...), "
           "or a new group with new_group(...)) and call commfuse.backends.release() before using it")


def grace() -> float:
    """:data:`GRACE_S`, or ``COMMFUSE_GRACE_S`` (seconds, 0.001 to 600) when set."""
    return number("COMMFUSE_GRACE_S", GRACE_S, 0.001, 600)


class Board:
    """A group's board in its store (see the module). Every method swallows the store's own failures (a store
    that is gone makes the board mute, never a second error on top of the first)."""

    def __init__(self, store, rank: int, world_size: int, incarnation: int = 1) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        #: one incarnation's keys: a group's numbering restarts at each ``release()`` and each group made
        #: again under its name, and so does its board (GroupState.incarnation)
        self.prefix = f"commfuse/{incarnation}/"
        self.cursor = 0  # how many log entries this rank has read
        self.posted = False
        #: other ranks' ``fail`` notes read so far, by (lane, call number): a note read while this rank still
        #: waited in an earlier call (or by a reader that only looks for other kinds) is still there for the
        #: wait in its own call, which may begin later
        self.fails: dict[tuple, dict] = {}

    def _key(self, *parts) -> str:
        return self.prefix + "/".join(str(p) for p in parts)

    def log(self, kind: str, **entry) -> None:
        """Append a note of ``kind`` (fail, dead, gaveup) written by this rank."""
        entry.update(kind=kind, rank=self.rank, time=time.time())
        try:
            i = self.store.add(self._key("log", "n"), 1)
            self.store.set(self._key("log", i), json.dumps(entry))
        except Exception:  # noqa: BLE001 - a mute board: the caller's own error still reaches its user
            pass

    def news(self) -> list[dict]:
        """The notes appended since this rank last read, oldest first."""
        out = []
        try:
            n = self.store.add(self._key("log", "n"), 0)
            while self.cursor < n:
                key = self._key("log", self.cursor + 1)
                if not self.store.check([key]):  # counted, not yet written: read it next time
                    break
                note = json.loads(self.store.get(key))
                out.append(note)
                self.cursor += 1
                if note.get("kind") == "fail" and note.get("rank") != self.rank:
                    self.fails.setdefault((note.get("lane"), note.get("seq")), note)
                    while len(self.fails) > FAILS_KEPT:
                        del self.fails[next(iter(self.fails))]
        except Exception:  # noqa: BLE001
            pass
        return out

    def fail_of(self, lane, seq) -> dict | None:
        """The first other rank's ``fail`` note of call #seq on lane ``lane`` read so far, or None."""
        return self.fails.get((lane, seq))

    def post(self, position: dict) -> None:
        """Say where this rank waits (``at/<rank>``)."""
        try:
            self.store.set(self._key("at", self.rank), json.dumps(position))
            self.posted = True
        except Exception:  # noqa: BLE001
            pass

    def clear(self) -> None:
        if self.posted:
            self.posted = False
            try:
                self.store.delete_key(self._key("at", self.rank))
            except Exception:  # noqa: BLE001
                pass

    def position(self, rank: int) -> dict | None:
        """Where ``rank`` waits, or None when it is not stalled in a commfuse wait."""
        key = self._key("at", rank)
        try:
            if not self.store.check([key]):
                return None
            return json.loads(self.store.get(key))
        except Exception:  # noqa: BLE001
            return None

    def ack(self, lane: int, seq: int) -> None:
        """This rank knows that call #seq (on thread lane ``lane``) failed somewhere."""
        try:
            self.store.set(self._key("knows", lane, seq, self.rank), "1")
        except Exception:  # noqa: BLE001
            pass

    def knows(self, lane: int, seq: int, rank: int) -> bool:
        try:
            return self.store.check([self._key("knows", lane, seq, rank)])
        except Exception:  # noqa: BLE001
            return False


def board_of(state) -> Board | None:
    """The board of a group's state (made on first use), or None where there is none: a backend with no
    c10d process group (a traced backend, a test's object), or a store that cannot be had."""
    board = state.board
    if board is False:
        return None
    if board is not None:
        return board
    store = None
    group = state.group
    if group is not None:
        try:
            import torch.distributed.distributed_c10d as c10d

            store = c10d._get_process_group_store(group)
        except Exception:  # noqa: BLE001 - not a registered c10d group (destroyed, or not a group at all)
            store = None
    if store is None or state.rank is None:
        state.board = False
        return None
    board = state.board = Board(store, state.rank, state.world_size, state.incarnation)
    return board


def declare_dead(state, error: BaseException, poison: Callable[[], None] | None, cause: dict | None = None) \
        -> BaseException:
    """Mark the group unusable on this rank: every later commfuse call on it raises ``error``, the board
    says so (with the root of it: ``cause``, the note of the rank that declared it first, when this rank
    only heard), and ``poison()`` closes this rank's connections so that peers waiting on it hear of it at
    once (their transfers fail instead of waiting out the timeout). Returns ``error``."""
    if state.error is None:
        state.error = error
        board = board_of(state)
        if board is not None:
            if cause is not None:
                root = {"root_rank": cause.get("root_rank", cause.get("rank")), "root": cause.get("root"),
                        "error": cause.get("error")}
            else:
                root = {"root_rank": state.rank, "root": str(error)[:4000], "error": type(error).__name__}
            board.log("dead", **root)
    if poison is not None:
        try:
            poison()
        except Exception:  # noqa: BLE001 - the group is dead either way
            pass
    return error


#: The errors a dead note can carry, by name: a peer that hears of it raises the same class.
_ERRORS = {cls.__name__: cls for cls in (MismatchError, CommfuseTimeoutError, PeerFailedError, GroupDeadError)}


def heard(note: dict, rank: int, where: str) -> BaseException:
    """The error a rank raises on reading another rank's ``dead`` note: the class of the root error (a
    mismatch stays a :class:`MismatchError` on every rank), naming the rank that found it and why."""
    cls = _ERRORS.get(note.get("error"), GroupDeadError)
    root = note.get("root") or ""
    return cls(f"rank {rank}, {where}: the group was declared dead by rank {note.get('root_rank')}, which "
               f"found:\n  {root}" if "\n" not in root else
               f"rank {rank}, {where}: the group was declared dead by rank {note.get('root_rank')}, which found:\n"
               + root)


def _fail_text(note: dict) -> str:
    step = note.get("step")
    where = f"in step {step}" if step is not None else "before taking part"
    return (f"rank {note['rank']} failed call #{note['seq']} ({note.get('label')}) {where}: "
            f"{note.get('exc')}: {note.get('message')}")


class Stall:
    """One wait that has outlasted the grace period (see the module).

    ``position`` is this rank's: ``seq``, ``lane`` (a code), ``thread`` (a
    name), ``digest``, ``label``, ``check`` (whether it waits in the call
    check), ``waits`` (the peers of the wait), ``fp`` (the fingerprint's
    integers, for the peers' messages) and ``what`` (the step in words).
    ``describe(fp)`` reads a fingerprint back; ``poison`` closes this rank's
    connections when the group must be declared dead.
    """

    def __init__(self, state, position: dict, describe: Callable[[list], str],
                 poison: Callable[[], None] | None,
                 drain: Callable[[dict, dict], BaseException | None] | None = None) -> None:
        self.state, self.position, self.describe, self.poison = state, position, describe, poison
        #: ``drain(note, position)``: complete this wait's call with a peer that left it and serves it
        #: (``commfuse.runtime.drain``), returning the error to raise, or None where this wait cannot be
        #: drained (a whole collective: the group is then declared dead, and the dead note ends the other
        #: ranks' drains); None where no wait of the backend can (a stream-ordered one)
        self.drain = drain
        self.board = board_of(state)
        self.rank = state.rank
        self.suspects: dict[int, tuple] = {}  # rank -> what was seen of it last poll (a mismatch must persist)
        self.late: list[int] = []
        self.chain: list[str] = []
        self.failed: list[dict] = []  # other ranks' failure notes read so far (a mismatch's cause, often)
        self.looked = False  # whether the board's notes read before this wait began were looked at

    # -- what a wait calls -------------------------------------------------------------------------------------

    def poll(self) -> None:
        """Read the board once; raise a named error (having declared the group dead) on a verdict."""
        board = self.board
        if board is None:
            return
        me = self.position
        if not board.posted:
            me["since"], me["beat"] = time.time(), 0
        me["beat"] += 1  # posted again on every poll: a position that stops beating outlived its wait
        board.post(me)
        for note in self._news():
            self._read(note, me)
        self._follow(me)

    def read_news(self) -> None:
        """Read the new notes only (no position posted: a stream-ordered backend's watchdog, whose host is not
        waiting); raise a named error on a verdict."""
        if self.board is not None:
            for note in self._news():
                self._read(note, self.position)

    def timed_out(self, timeout: float, text: str) -> None:
        """The wait reached its timeout: name the late ranks, note it for them, declare the group dead."""
        if self.board is not None:
            self._follow(self.position, final=True)
        me = self.position
        if self.late:
            late = ", ".join(map(str, sorted(set(self.late))))
            who = "rank" if len(set(self.late)) == 1 else "ranks"
            detail = (f" {who} {late} never reached it: late (not waiting in any commfuse call, and no failure noted: "
                      "computing, or stuck in its own code), or hung")
        elif self.board is None:
            detail = ""
        else:
            detail = " (no rank it waits for, directly or through others, has noted a failure or stalled elsewhere)"
        if self.chain:
            detail += "; " + "; ".join(self.chain)
        if self.board is not None:
            self.board.log("gaveup", seq=me["seq"], lane=me["lane"], label=me["label"], what=me["what"],
                           late=sorted(set(self.late)), after=timeout)
        error = CommfuseTimeoutError(f"{text}.{detail}. The group is now dead on this rank: {RECOVER}")
        raise declare_dead(self.state, error, self.poison)

    def abandon(self, why: str) -> None:
        """The wait is left unfinished (interrupted): the group is declared dead, saying why."""
        me = self.position
        if self.board is not None:
            self.board.log("fail", seq=me["seq"], lane=me["lane"], label=me["label"], step=None,
                           exc="KeyboardInterrupt", message=why, continuing=False)
        declare_dead(self.state, GroupDeadError(
            f"rank {self.rank}: {why} (call #{me['seq']}, {me['label']}, {me['what']}); the group is dead: {RECOVER}"),
            self.poison)

    def finished(self) -> None:
        if self.board is not None:
            self.board.clear()

    # -- reading -----------------------------------------------------------------------------------------------

    def _news(self) -> list[dict]:
        """The board's new notes; on the first read, led by a failure note of this wait's call that was read
        before the wait began (while this rank still waited in an earlier call, or by a reader looking for
        other kinds): a peer that left the call, and serves it, must not be missed."""
        notes = self.board.news()
        if not self.looked:
            self.looked = True
            me = self.position
            earlier = self.board.fail_of(me["lane"], me["seq"])
            if earlier is not None and all(earlier is not n for n in notes):
                notes = [earlier] + notes
        return notes

    def _read(self, note: dict, me: dict) -> None:
        kind = note.get("kind")
        if note.get("rank") == self.rank:
            return
        if kind == "fail":
            self.failed = (self.failed + [note])[-3:]
        if kind == "dead":
            raise declare_dead(self.state, heard(note, self.rank, f"waiting in {me['what']} of call #{me['seq']}"),
                               self.poison, note)
        if kind == "gaveup" and self.rank in note.get("late", ()):
            raise declare_dead(self.state, CommfuseTimeoutError(
                f"rank {self.rank} (this rank) was late: rank {note['rank']} gave up waiting for it after "
                f"{note.get('after'):g} s in {note.get('what')} of call #{note.get('seq')} ({note.get('label')}); "
                f"the group is dead: {RECOVER}"), self.poison)
        if kind == "fail" and note.get("seq") == me["seq"] and note.get("lane") == me["lane"]:
            if note.get("continuing"):
                if self.state.told is None:
                    self.state.told = note
                    self.board.ack(me["lane"], me["seq"])
                return
            if note.get("serves"):  # it completes the call's transfers with every rank that waits in it
                drained = self.drain(note, me) if self.drain is not None else None
                if drained is not None:
                    raise drained
                # a whole collective cannot be drained: the dead note below stops every rank's drain too
            raise declare_dead(self.state, PeerFailedError(
                f"rank {self.rank}, waiting in {me['what']} of call #{me['seq']} ({me['label']}): "
                f"{_fail_text(note)}. The transfers it never posted cannot complete, so the group is dead: "
                f"{RECOVER}"), self.poison)

    def _follow(self, me: dict, final: bool = False) -> None:
        """Follow who waits for whom, from the ranks this wait needs. A rank this wait needs directly that
        waits in the same call with another signature or thread, or in the call check while this rank is
        not (or the reverse), or in a later call, or in an earlier call waiting for this rank, can never
        pair with this rank's transfers: a mismatch, once seen twice alike (a position can outlive its wait
        by the moment it takes to delete it, so the peer's position must still beat: it is posted again on
        each of its polls). A rank behind on an earlier call that waits for others is
        followed. Ranks with no position are late, so far."""
        board = self.board
        seen = {self.rank}
        direct = set(me["waits"])
        frontier = list(me["waits"])
        late, chain = [], []
        while frontier and len(seen) < MAX_CHAIN:
            p = frontier.pop(0)
            if p in seen:
                continue
            seen.add(p)
            pos = board.position(p)
            if pos is None:
                late.append(p)
                continue
            chain.append(f"rank {p} waits in {pos.get('what')} of call #{pos.get('seq')} ({pos.get('label')})")
            if pos.get("lane") == me["lane"] and pos.get("seq") == me["seq"]:
                agree = pos.get("digest") == me["digest"] and bool(pos.get("check")) == bool(me["check"])
            else:
                agree = (pos.get("lane") == me["lane"] and pos.get("seq", 0) < me["seq"]
                         and self.rank not in pos.get("waits", ()))  # behind, waiting for others
            if agree or p not in direct:
                frontier.extend(pos.get("waits", ()))
                continue
            seen_before = self.suspects.get(p)
            stamp = (pos.get("seq"), pos.get("since"), pos.get("digest"), pos.get("check"))
            beat = pos.get("beat", 0)
            self.suspects[p] = (stamp, beat)
            # the same wait seen again, and still beating: the peer is really waiting there now
            if final or (seen_before is not None and seen_before[0] == stamp and beat > seen_before[1]):
                self._mismatch(p, pos, me)
        self.late, self.chain = late, chain

    def _mismatch(self, p: int, pos: dict, me: dict) -> None:
        mine, theirs = self.describe(me.get("fp") or []), self.describe(pos.get("fp") or [])
        if pos.get("lane") == me["lane"] and pos.get("seq") != me["seq"]:
            what = ("the ranks are at different calls on the group: a rank skipped or added a call (one that "
                    "failed before communicating counts as one on its rank)")
        elif pos.get("lane") != me["lane"] and "recomputing" in f"{me.get('thread')}{pos.get('thread')}":
            what = (f"the ranks recompute different checkpointed regions in the backward (this rank: "
                    f"{me.get('thread')!r}, rank {p}: {pos.get('thread')!r}): activation checkpointing must "
                    "checkpoint the same modules, the same way, on every rank (commfuse.runtime.checkpointing)")
        elif pos.get("lane") != me["lane"]:
            what = (f"the ranks run the group's calls from different threads (this rank from thread "
                    f"{me.get('thread')!r}, rank {p} from {pos.get('thread')!r}): commfuse ops on one group must come "
                    "from one thread in the same order on every rank, or each thread needs its own group")
        elif pos.get("digest") != me["digest"]:
            what = "the ranks called different ops or shapes"
            if bool(pos.get("check")) != bool(me["check"]):
                what += (" (one of them checks the call, a signature it had not called before; the other had "
                         "checked its own before, so it does not)")
        else:
            what = ("one of them checks the call's fingerprint and the other does not (ranks that checked this "
                    "signature before do not check it again; COMMFUSE_CHECK=always makes every call compare)")
        said = "".join(f"\nWhat the board says: {_fail_text(note)}" for note in self.failed)
        raise declare_dead(self.state, MismatchError(
            f"rank {self.rank}: {what}:\n"
            f"  rank {self.rank} (this rank): {mine}, waiting in {me['what']}\n"
            f"  rank {p}: {theirs}, waiting in {pos.get('what')}{said}\n"
            f"Their transfers can never pair, so the group is dead: {RECOVER}"), self.poison)
