"""Draining a call that one rank left: every transfer its peers posted in it is completed, so the group stays
usable.

A rank that fails between two commfuse calls (a stage's own code under ``commfuse.strands``, a layer's hook)
never enters the next call, while its peers do: they post that call's first transfers and wait. gloo cannot
take a posted transfer back. Left alone, such a transfer holds a waiter until gloo's own timeout closes every
connection of the group, and a receive left posted would swallow a later message of the same tag. So the rank
that left *serves* the call instead, without its inputs:

1. It notes on the board that it left call #seq and serves it (``fail`` with ``serves``), as
   :func:`commfuse.runtime.admission.announce_left` notes any call a rank leaves.
2. Each peer stalls in the call, reads the note, and publishes what it posted in the call
   (``drain/<lane>/<seq>/<rank>`` in the group's store): per (direction, peer, tag) how many messages so far,
   and the messages of its last posted step with their sizes. The rank that left publishes nothing posted.
3. Every rank reads every rank's account and posts the other end of each message that has none: for each
   pair and tag, the messages one side posted beyond what the other side posted, with the sizes the posting
   side gave (zeros are sent; what arrives is dropped). Then it waits for those and for its own.

Only the last posted step of a rank can hold a message without its other end: a rank leaves a step only once
its messages completed, and a completed message was matched. So the counts and the last step's sizes are all
any rank needs. Messages of one tag between two ranks pair in the order they were posted (gloo), so posting
the missing ends in the same order pairs each with its own.

A call whose waits include a whole collective (the ``vanilla`` algorithm, a transport's all-to-all) cannot
be served this way: its peer declares the group dead, as before, and its dead note on the board ends every
other rank's drain, which declares the group dead too.
A stream-ordered backend (NCCL, HCCL) never stalls on the host in a call, so it never gets here; there the
group still ends (see ``docs/reliability.md``).
"""

from __future__ import annotations

import datetime
import json
import time

import torch

from commfuse.errors import CommfuseTimeoutError, GroupDeadError, first_line
from commfuse.runtime.board import RECOVER, board_of, declare_dead, heard

__all__ = ["account", "drain_call"]

#: How often a draining rank reads the store for the accounts it still lacks, in seconds.
POLL_S = 0.02


def account(counts: dict, last: list) -> dict:
    """What a rank posted in a call, as it publishes it: ``counts`` maps (direction ``"s"``/``"r"``, peer,
    tag) to how many messages it posted; ``last`` lists its last posted step's messages in posting order as
    (direction, peer, tag, numel, dtype name)."""
    return {"counts": [[d, p, t, n] for (d, p, t), n in counts.items()], "last": [list(m) for m in last]}


def drain_key(board, lane: int, seq: int, rank: int) -> str:
    """Where ``rank`` publishes its account of call #seq (thread lane ``lane``) in the group's store: on the
    board of the group's incarnation, so that no call reads an account of an earlier numbering's call."""
    return board._key("drain", lane, seq, rank)


def _dtype(name: str) -> torch.dtype:
    found = getattr(torch, name.removeprefix("torch."), None)
    return found if isinstance(found, torch.dtype) else torch.uint8


def _missing(me: int, mine: dict, theirs: dict[int, dict]) -> list[tuple[str, int, int, int, str]]:
    """The ends this rank must post, in order: for each peer and tag, its messages to this rank beyond this
    rank's receives from it (receives to post), and its receives from this rank beyond this rank's sends to it
    (sends to post), each with the size the peer gave."""
    own = {(d, p, t): n for d, p, t, n in mine["counts"]}
    out = []
    for peer in sorted(theirs):
        acc = theirs[peer]
        for d, p, t, n in acc["counts"]:
            if p != me:
                continue
            mirror = "r" if d == "s" else "s"
            extra = n - own.get((mirror, peer, t), 0)
            if extra <= 0:
                continue
            sizes = [m for m in acc["last"] if m[0] == d and m[1] == me and m[2] == t][-extra:]
            out += [(mirror, peer, t, numel, dtype) for _, _, _, numel, dtype in sizes]
    return out


def drain_call(state, group, lane: int, seq: int, mine: dict, timeout: float, who: str,
               own_works=(), device: torch.device | str = "cpu") -> None:
    """Publish this rank's account of call #seq (``mine``, from :func:`account`), read every other rank's,
    post the ends that have none, and wait (bounded by ``timeout``) for them and for ``own_works`` (this
    rank's own posted works of the call). Returns once the call has no message left without its other end.

    Raises, having declared the group dead, where that cannot be done: a rank declared the group dead (one
    that waits in a whole collective does), or a rank gave no account within ``timeout`` (named). ``who`` says what
    this rank is doing, for those messages."""
    board = board_of(state)
    if board is None:
        raise declare_dead(state, GroupDeadError(f"rank {state.rank}: {who}: the group has no store to drain "
                                                 f"call #{seq} through; the group is dead: {RECOVER}"), None)
    store, me, n = board.store, state.rank, state.world_size
    try:
        store.set(drain_key(board, lane, seq, me), json.dumps(mine))
    except Exception as e:  # noqa: BLE001 - the store is gone: nothing can be drained
        raise declare_dead(state, GroupDeadError(
            f"rank {me}: {who}: could not publish this rank's part of call #{seq} ({type(e).__name__}: {e}); "
            f"the group is dead: {RECOVER}"), None) from e
    deadline = time.monotonic() + timeout
    theirs: dict[int, dict] = {}
    waiting = [q for q in range(n) if q != me]
    while waiting:
        for q in list(waiting):
            key = drain_key(board, lane, seq, q)
            try:
                if store.check([key]):
                    theirs[q] = json.loads(store.get(key))
                    waiting.remove(q)
            except Exception:  # noqa: BLE001 - read again next time, until the deadline
                pass
        for note in board.news():
            if note.get("kind") == "dead" and note.get("rank") != me:
                raise declare_dead(state, heard(note, me, f"draining call #{seq} ({who})"), None, note)
        if not waiting:
            break
        if time.monotonic() > deadline:
            late = ", ".join(map(str, waiting))
            raise declare_dead(state, CommfuseTimeoutError(
                f"rank {me}: {who}: rank {late} gave no account of call #{seq} within {timeout:g} s (it never "
                f"waited in the call: late, hung or gone), so its transfers cannot be completed and the group is "
                f"dead: {RECOVER}"), None)
        time.sleep(POLL_S)
    works = []
    for d, peer, tag, numel, dtype in _missing(me, mine, theirs):
        if d == "s":
            works.append(group.send([torch.zeros(numel, dtype=_dtype(dtype), device=device)], peer, tag))
        else:
            works.append(group.recv([torch.empty(numel, dtype=_dtype(dtype), device=device)], peer, tag))
    try:
        for work in works:
            left = deadline - time.monotonic()
            if left <= 0 or not work.wait(datetime.timedelta(seconds=left)):
                raise TimeoutError(f"not completed within {timeout:g} s")
        # this rank's own works are waited on by the waiter thread that the stalled wait left (a second
        # wait on one gloo work would never return): they are polled
        pending = list(own_works)
        while pending:
            pending = [w for w in pending if not w.is_completed()]
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"{len(pending)} of this rank's own transfers not completed within {timeout:g} s")
            if pending:
                time.sleep(POLL_S)
    except Exception as e:  # noqa: BLE001 - a transfer that cannot complete: the group ends here
        raise declare_dead(state, GroupDeadError(
            f"rank {me}: {who}: a transfer of call #{seq} could not be completed while draining it "
            f"({first_line(e, None, named=True)}); the group is dead: {RECOVER}"),
            None) from e
