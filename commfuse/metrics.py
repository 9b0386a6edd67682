"""Live metrics from the flight recorder: per fused site, what the host waited and what was hidden; and the
straggler named.

:func:`snapshot` reads every group's recorder (``commfuse.runtime.recorder``)
and returns one flat dict of numbers, which a trainer can hand to its own
metrics (TensorBoard's ``add_scalar`` per key, ``wandb.log(snapshot())``)
without commfuse depending on either. Per site (a ``commfuse.nn`` layer or a
module a ``commfuse.tp`` style was applied to; outside one, the op and its
algorithm, ``all_gather_matmul.ring``), over the calls made since the
previous snapshot that the recorder still holds (its last
``COMMFUSE_RECORDER`` calls per group):

* ``commfuse/<group>/<site>/calls``, ``.../failed``, ``.../calls_total``;
* ``.../wait_ms``, ``.../wait_ms_per_call``: the time the host waited for
  the site's transfers: the communication left exposed;
* ``.../wait_ms/rank<q>``: of that, the waits for transfers from rank q;
* ``.../hidden_frac``: ``1 - exposed / planned``, the planned time being the
  cost model's for the bytes the site moved (``commfuse.sim``'s profile for
  the backend, ``COMMFUSE_PROFILE``); absent where no profile applies.

Where the backend's host does not block in waits (NCCL, HCCL, or torch's
``fake`` group) there are no host waits to time: only the counts are given,
unless ``COMMFUSE_DEVICE_TIMING=1``. Then, on a stream-ordered device, the
waits are the device's: how long the stream that waits for a step's
transfers stalled, between two timing events the step loop records around
the wait (``commfuse.runtime.recorder.DeviceStamps``). A snapshot reads only
events the device has passed and never blocks; calls it has not reached yet
are counted by a later snapshot.

The straggler: each rank publishes its own waiting and its calls' time over
its last :data:`WINDOW` calls in the group's store (one key per rank, written
by :func:`snapshot`) and reads its peers'. In a ring every rank waits for the
slowest one, directly or through the ranks between, except the slowest one
itself: so the rank that waits least is the candidate, and its excess is the
others' median wait per call less its own. It is named (:func:`verdict`) when
its excess is at least ``COMMFUSE_STRAGGLER_MS`` (1 ms) and at least
``COMMFUSE_STRAGGLER_SHARE`` (0.5) of the others' median time per call: its
peers spend half their calls waiting for it. The threshold is relative to the
call's own time because a loaded host slows every rank's compute unevenly: two
healthy ranks sharing two cores with other work differed by up to a third of
the call's time (24 ms on 78 ms calls), far more than a fixed 5 ms.
Where the call's time is not known (device stamps time the waits only, on
the device), the excess must be a quarter of the others' wait instead. The
verdict is in the snapshot (``commfuse/<group>/straggler_rank``, -1 for none,
and ``.../straggler_excess_ms``) and, each time it changes, a WARNING on the
``commfuse`` logger (``COMMFUSE_LOG=info`` shows it with the rank in front).
One snapshot costs each rank one store write and one read per group; at
thousands of ranks, ``snapshot(exchange=False)`` on most of them and a few
that exchange keep the store's load down.
"""

from __future__ import annotations

import json
import logging
import statistics
import weakref
from dataclasses import dataclass

from commfuse.runtime.board import board_of
from commfuse.runtime.env import number
from commfuse.runtime.recorder import DEVICE, device_waits, dump_all, group_name, recorders

__all__ = ["WINDOW", "Verdict", "dump_trace", "snapshot", "straggler_share", "straggler_threshold_ms", "verdict"]

log = logging.getLogger("commfuse")

#: Calls per rank the straggler verdict looks at (the most recent ones).
WINDOW = 16
#: Calls every rank must have published before a straggler is named.
MIN_CALLS = 4
#: Default of ``COMMFUSE_STRAGGLER_MS``: the least excess per call, whatever the call's time (clock noise).
STRAGGLER_MS = 1.0
#: Default of ``COMMFUSE_STRAGGLER_SHARE``: the least share of the others' time per call their excess wait is.
STRAGGLER_SHARE = 0.5
#: Where the calls' time is not known (device stamps): the excess must be this fraction of the others' wait.
RELATIVE = 0.25
_KEY = "commfuse/metrics/"


def straggler_threshold_ms() -> float:
    """``COMMFUSE_STRAGGLER_MS`` (milliseconds, >= 0), else :data:`STRAGGLER_MS`."""
    return number("COMMFUSE_STRAGGLER_MS", STRAGGLER_MS, 0.0, 1e9, unit="milliseconds")


def straggler_share() -> float:
    """``COMMFUSE_STRAGGLER_SHARE`` (a fraction from 0 to 1), else :data:`STRAGGLER_SHARE`."""
    return number("COMMFUSE_STRAGGLER_SHARE", STRAGGLER_SHARE, 0.0, 1.0, unit="a fraction of the call's time")


@dataclass(frozen=True, slots=True)
class Verdict:
    """What :func:`verdict` found, per call and in ns: the candidate ``rank`` (the one that waits least), the
    others' median wait (``others``), its own wait (``own``), their difference (``excess``), the others' median
    time per call (``call``, None where not known), the ``threshold`` the excess was held to, and whether the
    candidate is ``named`` a straggler."""

    rank: int
    others: float
    own: float
    excess: float
    call: float | None
    threshold: float
    named: bool


def verdict(published: list[dict], *, floor_ms: float | None = None, share: float | None = None) -> Verdict | None:
    """The straggler among the ranks' published figures, one dict per rank in rank order: ``calls``, and over
    those calls ``wait_ns``, the time waited, and ``call_ns``, the time they took (None where not known). None
    until every rank has :data:`MIN_CALLS` calls. ``floor_ms`` and ``share`` default to ``COMMFUSE_STRAGGLER_MS``
    and ``COMMFUSE_STRAGGLER_SHARE`` (see the module)."""
    if len(published) < 2 or any(p.get("calls", 0) < MIN_CALLS for p in published):
        return None
    floor = (straggler_threshold_ms() if floor_ms is None else floor_ms) * 1e6
    share = straggler_share() if share is None else share
    waits = [p["wait_ns"] / p["calls"] for p in published]
    slowest = min(range(len(waits)), key=waits.__getitem__)
    peers = [p for q, p in enumerate(published) if q != slowest]
    others = statistics.median(p["wait_ns"] / p["calls"] for p in peers)
    excess = others - waits[slowest]
    if all(p.get("call_ns") is not None for p in peers):
        call = statistics.median(p["call_ns"] / p["calls"] for p in peers)
        threshold = max(floor, share * call)
    else:
        call = None
        threshold = max(floor, RELATIVE * others)
    return Verdict(slowest, others, waits[slowest], excess, call, threshold, excess >= threshold)


def dump_trace(reason: str = "on demand", directory: str | None = None) -> list[str]:
    """Write every group's flight recorder of this process now (``COMMFUSE_TRACE_DIR``, or ``directory``);
    the paths written. For a program with its own SIGTERM handler, or at any moment worth keeping."""
    return dump_all(reason, directory)


class _Group:
    """What the snapshots of one recorder remember: the start of the last call folded, totals, the verdict."""

    __slots__ = ("cursor", "totals", "planned", "named", "__weakref__")

    def __init__(self) -> None:
        self.cursor = 0
        self.totals: dict[str, int] = {}
        self.planned: dict[int, float | None] = {}  # id(plan) -> planned comm ns per call
        self.named: int | None = None


_GROUPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _waits(call, plan) -> tuple[int, dict[int, int]] | None:
    """The wait in one recorded call, in ns, in all and per peer it received from: the host's, or with device
    stamps the device stream's (None until the device has passed the call's events)."""
    flat = call.steps
    total = 0
    peers: dict[int, int] = {}
    if not flat:
        return 0, peers
    if plan.stamps is DEVICE:
        flat = device_waits(flat)
        if flat is None:
            return None
    steps = plan.steps
    for j in range(0, len(flat) - 2, 3):
        index, began, done = flat[j], flat[j + 1], flat[j + 2]
        ns = done - began
        total += ns
        st = steps[index] if index < len(steps) else None
        if st is None:
            continue
        if st.collectives:
            sources = [q for q in range(plan.schedule.world_size) if q != plan.rank]
        else:
            sources = sorted({t.peer for t, _ in st.recvs}) or sorted({t.peer for t, _ in st.sends})
        for q in sources:
            peers[q] = peers.get(q, 0) + ns
    return total, peers


def _planned_ns(plan, memo: dict) -> float | None:
    """The cost model's time for the bytes one call of ``plan`` receives, in ns (None: no profile applies, or
    the bytes are not known)."""
    key = id(plan)
    if key in memo:
        return memo[key]
    value = None
    sizes = getattr(plan, "sizes", None)
    if sizes:
        try:
            from commfuse.sim import profile_for

            profile = profile_for(plan.backend)
        except Exception:  # noqa: BLE001 - a profile that cannot be read gives no planned time
            profile = None
        if profile is not None:
            link = profile.link
            value = sum(link.latency + received / link.rate for _, received in sizes.values()) * 1e9
    memo[key] = value
    return value


def snapshot(*, exchange: bool = True) -> dict[str, float]:
    """The metrics of every group of this process since the previous snapshot (see the module), as one flat
    dict; ``exchange``: also publish this rank's waits and name the straggler (one store write and read per
    group)."""
    out: dict[str, float] = {}
    for rec in recorders():
        state = rec.state
        if state.rank is None:
            continue
        m = _GROUPS.get(rec)
        if m is None:
            m = _GROUPS[rec] = _Group()
        group = group_name(state)
        _fold(rec, m, group, out)
        if exchange:
            _straggler(rec, m, group, out)
    return out


def _fold(rec, m: _Group, group: str, out: dict) -> None:
    sites: dict[str, list] = {}
    newest = m.cursor
    for call in rec.calls():
        if call.start <= m.cursor or call.status == "in progress":
            continue
        plan, _, _, site = call.head
        waits = _waits(call, plan) if plan is not None and plan.stamps else None
        if waits is None and plan is not None and plan.stamps is DEVICE and call.status == "ok":
            break  # the device has not reached this call's events yet: it and the calls after wait for the next
        newest = max(newest, call.start)
        if plan is None:
            continue
        name = site.label if site is not None else plan.name.removeprefix("commfuse.")
        entry = sites.get(name)
        if entry is None:
            entry = sites[name] = [0, 0, 0, 0.0, {}, True]  # calls, failed, wait ns, planned ns, peers, planned?
        entry[0] += 1
        entry[1] += call.status == "failed"
        if waits is not None:
            total, peers = waits
            entry[2] += total
            for q, ns in peers.items():
                entry[4][q] = entry[4].get(q, 0) + ns
            planned = _planned_ns(plan, m.planned)
            if planned is None:
                entry[5] = False
            else:
                entry[3] += planned
        else:
            entry[5] = False
    m.cursor = newest
    for name, (calls, failed, wait, planned, peers, has_plan) in sites.items():
        base = f"commfuse/{group}/{name}"
        m.totals[name] = m.totals.get(name, 0) + calls
        out[f"{base}/calls"] = calls
        out[f"{base}/failed"] = failed
        out[f"{base}/calls_total"] = m.totals[name]
        out[f"{base}/wait_ms"] = wait / 1e6
        out[f"{base}/wait_ms_per_call"] = wait / 1e6 / calls
        for q, ns in sorted(peers.items()):
            out[f"{base}/wait_ms/rank{q}"] = ns / 1e6
        if has_plan and planned > 0:
            out[f"{base}/hidden_frac"] = max(0.0, min(1.0, 1.0 - wait / planned))


def _straggler(rec, m: _Group, group: str, out: dict) -> None:
    state = rec.state
    board = board_of(state)
    if board is None or state.world_size <= 1:
        return
    calls = [c for c in rec.calls() if c.head[0] is not None and c.head[0].stamps and c.status == "ok"][-WINDOW:]
    if not calls:
        return
    wait, took = 0, 0
    for c in calls:
        waits = _waits(c, c.head[0])
        if waits is None:  # the device has not passed it yet: its successors neither
            calls = calls[:calls.index(c)]
            break
        wait += waits[0]
        if took is not None:  # a device-stamped call's host start and end time the enqueue, not the call
            took = None if c.head[0].stamps is DEVICE else took + c.end - c.start
    if not calls:
        return
    store, rank, n = board.store, state.rank, state.world_size
    try:
        store.set(f"{_KEY}{rank}", json.dumps({"calls": len(calls), "wait_ns": wait, "call_ns": took}))
        keys = [f"{_KEY}{q}" for q in range(n)]
        if not store.check(keys):
            return  # a peer has not published yet
        values = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(k) for k in keys]
        published = [json.loads(v) for v in values]
    except Exception:  # noqa: BLE001 - a store that cannot be read names no straggler
        return
    found = verdict(published)
    if found is None:
        return
    named = found.named
    out[f"commfuse/{group}/straggler_rank"] = found.rank if named else -1
    out[f"commfuse/{group}/straggler_excess_ms"] = found.excess / 1e6 if named else 0.0
    now = found.rank if named else None
    if now != m.named:
        m.named = now
        if named:
            of = "per call (median)" if found.call is None else f"of their {found.call / 1e6:.1f} ms per call (medians)"
            log.warning("commfuse: rank %d is a straggler on group %s: over their last calls its peers waited "
                        "%.1f ms %s and it waited %.1f ms; its excess is %.1f ms per call",
                        found.rank, group, found.others / 1e6, of, found.own / 1e6, found.excess / 1e6)
        else:
            log.info("commfuse: no straggler on group %s any more", group)
