"""The one table of what commfuse planned: one entry per call signature, bounded in bytes, one way to forget it all.

Each planning step keeps what it decided here under a key that starts with its kind (``"backend"``,
``"call"``, ``"plan"``, ``"schedule"``, ``"compiled"``, or an op's name), so a later call with the same
signature finds it in one dict look-up and decides nothing again. :func:`forget` clears the whole
table at once and runs the hooks registered with :func:`on_forget` (the runtime's group state, a
vendor's own caches). ``commfuse.backends.release`` calls it, and so do tests.

**What an entry holds, and the bound.** The table holds at most :func:`bound` bytes
(``COMMFUSE_PLAN_BYTES``, else :data:`DEFAULT_BOUND`; :func:`set_bound` in code), counting:

* the receive buffers a plan keeps in its backend's pool (``programs.BufferPool``): every (shape, dtype)
  its calls take buffers of is claimed there for as long as a plan in the table holds it, and reserves
  ``BufferPool.MAX_FREE`` buffers of that shape, held yet or not (the pool never keeps more), counted once
  per pool however many plans share the shape. The last plan to let a shape go drops its free buffers;
* the Python objects of each entry, estimated: :data:`ENTRY_BYTES` for any entry (its key, the record, the
  value's objects), and for a plan :data:`SLOT_BYTES` per slot and :data:`STEP_BYTES` per step of its
  compiled steps (its layout's lists and keys, its walk). ``tests/unit/test_plan_bound.py`` holds the
  estimate to what ``tracemalloc`` measures.

No entry holds any other tensor: a call's inputs, outputs and gathered copies belong to the caller.

**Eviction.** Past the bound, entries are evicted least recently used first, by second chance (a clock):
the oldest entry that was not used since the table last looked is evicted, one that was goes to the back.
"Used" costs a repeated call nothing it did not do before but one store: a plan's ``used`` flag, set as its
call gives the group back (``runtime.admission``); an entry found with :func:`find` or :func:`lookup` (the
planning paths, the layers, the backward passes) is marked on the next sweep. An op's runnable entry
lives as long as the plans it runs (it goes with them); a backend entry (one per group) is neither counted
nor evicted. An entry bigger than the whole bound is not kept (its call still runs, planned anew each time,
its buffers not pooled); this is said once (until :func:`forget`), at WARNING on the ``commfuse`` logger, and
so is the first signature planned again after it was evicted (the bound is smaller than what the program uses
over and over: raise it).

Eviction is safe whatever runs: a call in flight, an autograd graph or a captured device graph keeps
the plan objects it holds, and the buffers it took (a captured call's come from the graph's own memory
pool, never from the table's); a plan planned again finds its signature in the group's agreed
signatures (``GroupState.checked``, kept per group, not per plan), so it is not checked again and its
messages carry the same tags. Ranks may evict different entries (their shards, so their bytes, differ):
nothing they send depends on what their tables hold.

An op's key carries ``commfuse.planning.calls.C10D_WORLD._default_pg`` (torch.distributed's default group in place): once
that group is destroyed, or destroyed and made again, the op's next call misses its old entries, and
planning it calls ``commfuse.backends.fresh``, which forgets them all. The repeated call reads one attribute
for this and calls nothing.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from enum import Enum
from typing import Any

from commfuse.errors import CommfuseTypeError, CommfuseValueError

__all__ = [
    "DEFAULT_BOUND", "ENTRY_BYTES", "SLOT_BYTES", "STEP_BYTES", "bound", "entries", "find", "forget", "forget_holding",
    "get", "keys", "lookup", "on_forget", "remember", "set_bound", "usage",
]

log = logging.getLogger("commfuse")

#: The bound when neither :func:`set_bound` nor ``COMMFUSE_PLAN_BYTES`` gives one: 1 GiB, several times the
#: receive buffers of a Llama-70B layer under tensor parallelism of 8 at 8192 tokens (one shape, 16 MiB a
#: buffer in bf16, 64 MiB reserved), and a few percent of an accelerator's memory.
DEFAULT_BOUND = 1 << 30
#: The largest bound ``COMMFUSE_PLAN_BYTES`` and :func:`set_bound` take.
MAX_BOUND = 1 << 62
#: The estimated Python bytes of any entry (see the module), and of each slot and step of a plan's steps.
ENTRY_BYTES = 2048
SLOT_BYTES = 512
STEP_BYTES = 768
#: The kinds of entry that are never evicted, nor counted: one backend object per (backend, group, device),
#: which its group's plans and pool hang from.
PINNED = frozenset({"backend"})
#: How many of the latest :func:`find` hits the next sweep marks used; how many evicted keys it remembers, to
#: say when one is planned again.
FOUND_KEPT = 4096
EVICTED_KEPT = 1024
#: How many entries the clock's hand moves on as an entry is added below the bound (see ``_tick``).
TICK = 2

_ENTRIES: dict[tuple, Any] = {}
#: the records of the entries, by key
_RECORDS: dict[tuple, _Record] = {}
#: the same records in the clock's two lists, oldest first: entries used since the hand last passed them (and
#: new ones, pinned ones, those that go with a plan) are active; the hand moves the others to the inactive
#: list, whose oldest goes first unless it was used since it came there
_ACTIVE: OrderedDict[tuple, _Record] = OrderedDict()
_INACTIVE: OrderedDict[tuple, _Record] = OrderedDict()
#: each plan in the table -> the key of the entry that holds it
_OWNERS: dict[Any, tuple] = {}
#: values :func:`find` found since the last sweep (an append per hit: the sweep marks their entries). The
#: values, not the keys: a key is a tuple made afresh by each call, and keeping thousands of them alive made the
#: garbage collector run every few hundred calls, and now and then a full collection inside a call
_FOUND: deque = deque(maxlen=FOUND_KEPT)
#: each kept value's id -> the record of its entry (how the sweep finds what :data:`_FOUND` holds)
_BY_ID: dict[int, "_Record"] = {}
#: hashes of the latest evicted keys (to say when one is planned again)
_EVICTED: OrderedDict[int, None] = OrderedDict()
_LOCK = threading.Lock()
_HOOKS: list[Callable[[], None]] = []

#: The one look-up of the fast path: ``get(key)`` is the table's ``dict.get``, None when not planned.
get = _ENTRIES.get


class _Record:
    """What the table knows of one entry: its estimated bytes, whether it was used since the last sweep
    (``ref``, and ``plan.used``), the pool keys it claims, the entries that go with it (``followers``: the
    runnable entries of the ops that run its plan) and, for a follower, that it goes with them."""

    __slots__ = ("bytes", "ref", "plan", "pool", "keys", "followers", "follows", "pinned")

    def __init__(self, nbytes: int, plan, pool, keys: frozenset, pinned: bool) -> None:
        self.bytes, self.plan, self.pool, self.keys, self.pinned = nbytes, plan, pool, keys, pinned
        self.ref = True  # a new entry is used: it is about to run
        self.followers: list[tuple] = []
        self.follows = False  # it goes with the entries of the plans it runs (evicted with the first of them)


class _Bound:
    """The table's totals: the bound in force (None: read ``COMMFUSE_PLAN_BYTES`` at the next entry), whether
    code set it, the bytes held, and the counts :func:`usage` reports."""

    __slots__ = ("limit", "fixed", "held", "evictions", "replanned", "warned")

    def __init__(self) -> None:
        self.limit: int | None = None
        self.fixed = False
        self.held = 0
        self.evictions = 0
        self.replanned = 0
        self.warned: set[str] = set()


_BOUND = _Bound()


def _limit() -> int:
    limit = _BOUND.limit
    if limit is None:
        # imported here: commfuse.runtime's package imports torch, and commfuse.backends (which imports this
        # module) must not
        from commfuse.runtime.env import size

        limit = _BOUND.limit = size("COMMFUSE_PLAN_BYTES", DEFAULT_BOUND, 0, MAX_BOUND)
    return limit


def bound() -> int:
    """The bound in force, in bytes: :func:`set_bound`'s, else ``COMMFUSE_PLAN_BYTES``'s, else
    :data:`DEFAULT_BOUND`."""
    with _LOCK:
        return _limit()


def set_bound(nbytes: int | None) -> None:
    """Hold at most ``nbytes`` from now on (evicting down to it at once), whatever ``COMMFUSE_PLAN_BYTES``
    says; None goes back to the variable (read again at the next entry). Kept across
    ``commfuse.backends.release``."""
    if nbytes is not None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise CommfuseTypeError(f"the planning table's bound must be an int of bytes or None, got {nbytes!r}")
        if not 0 <= nbytes <= MAX_BOUND:
            raise CommfuseValueError(f"the planning table's bound must be from 0 to {MAX_BOUND} bytes, got {nbytes}")
    with _LOCK:
        _BOUND.limit, _BOUND.fixed = nbytes, nbytes is not None
        if nbytes is not None:
            _shrink(nbytes)


def _python_bytes(plan) -> int:
    """The estimated bytes of an entry's Python objects (see the module)."""
    if plan is None:
        return ENTRY_BYTES
    return ENTRY_BYTES + SLOT_BYTES * len(plan.compiled.slices) + STEP_BYTES * len(plan.steps)


def remember(key: tuple, value: Any, *, plan=None, pool=None, keys: Iterable[tuple] = (),
             follows: Iterable = ()) -> Any:
    """Keep ``value`` under ``key`` (a tuple that starts with its kind) and return what is kept: the first
    value, when two threads planned the same key at once, so every caller shares one entry.

    ``plan``: the runtime ``Plan`` the entry holds (its calls mark the entry used); ``pool`` and ``keys``: the
    pool keys its calls take buffers of, claimed while the entry is kept; ``follows``: the plans whose
    entries this entry goes with (an op's runnable entry, which runs them). Past the bound, entries are
    evicted (see the module); an entry bigger than the whole bound is returned but not kept."""
    with _LOCK:
        found = _ENTRIES.get(key)
        if found is not None:
            return found
        limit = _limit()
        nbytes = _python_bytes(plan)
        signature = hash(key)
        if signature in _EVICTED:
            del _EVICTED[signature]
            _BOUND.replanned += 1
            _warn_once("replanned", "the planning table evicted a %r entry and it was planned again: its bound, %d "
                       "bytes (COMMFUSE_PLAN_BYTES, commfuse.backends.plan_bytes), is smaller than what this "
                       "program plans over and over, which is now planned again each time it comes back; raise "
                       "it if that costs time (commfuse.backends.plan_usage() has the figures)", key[0], limit)
        claimed = frozenset(keys) if pool is not None else frozenset()
        kind = key[0] if key else None
        pinned = kind in PINNED
        if pinned:  # a backend object: one per group, not per signature, and never evicted: not counted
            nbytes = 0
        alone = nbytes + (pool.cost(claimed) if claimed else 0)
        if not pinned and alone > limit:
            _warn_once("too-big", "the planning table's bound, %d bytes (COMMFUSE_PLAN_BYTES, "
                       "commfuse.backends.plan_bytes), is smaller than one %r entry alone (%d bytes, with the "
                       "receive buffers it reserves): such entries are not kept, so their calls are planned again "
                       "each time and their buffers allocated each time; raise the bound", limit, kind, alone)
            return value
        record = _Record(nbytes, plan, pool if claimed else None, claimed, pinned)
        _ENTRIES[key] = value
        _RECORDS[key] = _ACTIVE[key] = record
        _BY_ID[id(value)] = record
        _BOUND.held += nbytes
        if claimed:
            _BOUND.held += pool.claim(claimed)
        if plan is not None:
            _OWNERS[plan] = key
        for followed in follows:
            owner = _OWNERS.get(followed)
            if owner is not None:
                _RECORDS[owner].followers.append(key)
                record.follows = True
        if _BOUND.held > limit:
            _shrink(limit)
        else:
            _tick()
        return value


def _warn_once(what: str, message: str, *args) -> None:
    if what not in _BOUND.warned:
        _BOUND.warned.add(what)
        log.warning(message, *args)


def _mark_found() -> None:
    """Mark the entries :func:`find` found since the last look as used."""
    records = _BY_ID
    for _ in range(len(_FOUND)):
        try:
            found = records.get(id(_FOUND.popleft()))
        except IndexError:  # another thread took them
            break
        if found is not None:
            found.ref = True


def _used(record: _Record) -> bool:
    """Whether ``record``'s entry was used since the hand last passed it (and forget that it was)."""
    plan = record.plan
    used = record.ref or (plan is not None and plan.used)
    if used:
        record.ref = False
        if plan is not None:
            plan.used = False
    return used


def _hand() -> bool:
    """Move the clock's hand over the oldest active entry: one used since it last passed (or pinned, or going
    with a plan) goes to the back of the active list, any other to the inactive list. False when none is
    active."""
    if not _ACTIVE:
        return False
    key, record = _ACTIVE.popitem(last=False)
    if _used(record) or record.pinned or record.follows:
        _ACTIVE[key] = record
    else:
        _INACTIVE[key] = record
    return True


def _tick(steps: int = TICK) -> None:
    """Move the hand on by ``steps`` entries as an entry is added below the bound: so when the bound is
    reached, what was used since the hand passed is told from what was not. Holds ``_LOCK``."""
    _mark_found()
    for _ in range(steps):
        if not _hand():
            return


def _shrink(limit: int) -> None:
    """Evict until the table holds at most ``limit`` bytes (or nothing but pinned entries and entries that go
    with others): the oldest inactive entry goes, unless it was used since it came there (then it is active
    again); with none inactive, the hand moves on. Holds ``_LOCK``."""
    if _BOUND.held <= limit:
        return
    _mark_found()
    turns = 3 * len(_RECORDS) + 1  # every entry passed twice, and evicted once, at most
    while _BOUND.held > limit and turns > 0:
        turns -= 1
        if not _INACTIVE:
            if not _hand():
                return
            continue
        key, record = _INACTIVE.popitem(last=False)
        if _used(record):
            _ACTIVE[key] = record
            continue
        del _RECORDS[key]
        _evict(key, record)


def _evict(key: tuple, record: _Record, counted: bool = True) -> None:
    """Drop one entry (already out of ``_RECORDS`` and the clock's lists), its claims in the pool and the
    entries that go with it. ``counted``: an eviction (counted, and remembered to say when it is planned
    again), not an entry forgotten with its group (:func:`forget_holding`)."""
    value = _ENTRIES.pop(key, None)
    if _BY_ID.get(id(value)) is record:
        del _BY_ID[id(value)]
    _BOUND.held -= record.bytes
    if record.pool is not None:
        _BOUND.held -= record.pool.unclaim(record.keys)
    if record.plan is not None and _OWNERS.get(record.plan) == key:
        del _OWNERS[record.plan]
    if counted:
        _BOUND.evictions += 1
        try:
            _EVICTED[hash(key)] = None
        except TypeError:  # pragma: no cover - every kept key was hashed already
            pass
        while len(_EVICTED) > EVICTED_KEPT:
            _EVICTED.popitem(last=False)
    for follower in record.followers:  # they run this plan: they go with it
        followed = _RECORDS.pop(follower, None)
        if followed is not None:
            _ACTIVE.pop(follower, None)
            _INACTIVE.pop(follower, None)
            _evict(follower, followed, counted)


def _owned(value: Any) -> bool:
    """Whether an entry's value is an object of its own (a backend, a resolved call) that other keys may hold
    to mean it, rather than a value any key may hold for itself (None, a number, a string, a dtype, an enum
    member, a tuple)."""
    kind = type(value)
    return kind.__module__ not in ("builtins", "torch") and not isinstance(value, Enum)


def _mentions(key, doomed: dict[int, Any]) -> bool:
    """Whether a key holds one of ``doomed`` (by identity), itself or inside a tuple it holds."""
    for part in key:
        if id(part) in doomed or (type(part) is tuple and _mentions(part, doomed)):
            return True
    return False


def forget_holding(obj: Any) -> int:
    """Forget every entry that holds ``obj`` (a process group torch.distributed destroyed): each entry whose
    key holds it, then each entry whose key holds what such an entry kept (the group's backend object, its
    resolved calls, their plans), and the entries that go with those plans; their claims in the pools go
    with them. Not evictions: nothing is counted, and planning such a key again warns of nothing. Entries
    of other groups, and those every group shares (schedules, compiled steps), stay. Returns how many
    entries went."""
    with _LOCK:
        doomed: dict[int, Any] = {id(obj): obj}  # the objects, kept alive while their ids are compared
        gone: dict[tuple, None] = {}
        grew = True
        while grew:  # a key holds the group, another holds that entry's value, and so on: a few rounds
            grew = False
            for key in list(_RECORDS):
                if key not in gone and _mentions(key, doomed):
                    gone[key] = None
                    value = _ENTRIES.get(key)
                    if _owned(value) and id(value) not in doomed:
                        doomed[id(value)] = value
                        grew = True
        dropped = 0
        for key in gone:
            record = _RECORDS.pop(key, None)
            if record is None:  # went already, with a plan it followed
                continue
            _ACTIVE.pop(key, None)
            _INACTIVE.pop(key, None)
            before = len(_ENTRIES)
            _evict(key, record, counted=False)
            dropped += before - len(_ENTRIES)
        kept = [value for value in _FOUND if id(value) not in doomed]  # hits not yet marked: no longer kept
        _FOUND.clear()
        _FOUND.extend(kept)
        return dropped


def find(key: tuple, make: Callable[..., Any], *args, **kwargs) -> Any:
    """What is kept under ``key``, made by ``make(*args, **kwargs)`` and kept the first time: for a value made
    by a lower layer (a schedule, compiled steps), so that planning descends into it; a planning module that
    makes the value itself looks it up with :func:`kept` and keeps it with :func:`keep`, and is not called
    back. An unhashable key (an option the caller cannot hash) is made every time and never kept."""
    found = kept(key)
    return keep(key, make(*args, **kwargs)) if found is None else found


def kept(key: tuple) -> Any:
    """What is kept under ``key``, or None (an unhashable key finds nothing; :func:`keep` does not keep it).
    A hit marks the entry used, as :func:`lookup`'s does."""
    try:
        found = _ENTRIES.get(key)
    except TypeError:
        return None
    if found is not None:
        _FOUND.append(found)
    return found


def keep(key: tuple, value: Any, **held) -> Any:
    """:func:`remember` ``value`` under ``key`` (``held``: what it holds, as :func:`remember` takes it) and
    return what is kept; an unhashable key keeps nothing and returns ``value``."""
    try:
        hash(key)
    except TypeError:
        return value
    return remember(key, value, **held)


def lookup(key: tuple) -> Any:
    """:data:`get` for planning paths: a hit marks the entry used (the sweep reads it), so what planning
    keeps finding is kept."""
    found = _ENTRIES.get(key)
    if found is not None:
        _FOUND.append(found)
    return found


def keys(kind: str | None = None) -> list[tuple]:
    """The keys the table holds (of one kind, when given): for tests."""
    return [key for key in list(_ENTRIES) if kind is None or (key and key[0] == kind)]


def entries(kind: str | None = None) -> int:
    """How many entries the table holds (of one kind, when given): for logs and tests."""
    if kind is None:
        return len(_ENTRIES)
    return sum(1 for key in list(_ENTRIES) if key and key[0] == kind)


def usage() -> dict[str, int]:
    """What the table holds, in figures: ``bytes`` (what counts against the bound: the two below), ``bound``,
    ``reserved`` (the receive buffers its plans claim, ``MAX_FREE`` per shape), ``objects`` (the estimated
    Python bytes), ``buffers`` (the bytes of the free buffers the pools hold now, at most ``reserved``),
    ``entries``, ``evictions`` and ``replanned`` (signatures planned again after they were evicted) since
    the process started."""
    with _LOCK:
        pools = {id(r.pool): r.pool for r in _RECORDS.values() if r.pool is not None}
        reserved = sum(pool.reserved for pool in pools.values())
        return {
            "bytes": _BOUND.held, "bound": _limit(), "reserved": reserved, "objects": _BOUND.held - reserved,
            "buffers": sum(pool.held() for pool in pools.values()), "entries": len(_ENTRIES),
            "evictions": _BOUND.evictions, "replanned": _BOUND.replanned,
        }


def on_forget(hook: Callable[[], None]) -> None:
    """Have :func:`forget` call ``hook()`` too: state that is not a plan but must go with the plans (the
    runtime's per-group call numbers, a backend's buffers)."""
    _HOOKS.append(hook)


def forget() -> None:
    """Forget every planned entry, let every pool's free buffers go, and run the :func:`on_forget` hooks.
    ``COMMFUSE_PLAN_BYTES`` is read again at the next entry, unless :func:`set_bound` set the bound."""
    with _LOCK:
        pools = {id(r.pool): r.pool for r in _RECORDS.values() if r.pool is not None}
        _ENTRIES.clear()
        _RECORDS.clear()
        _ACTIVE.clear()
        _INACTIVE.clear()
        _OWNERS.clear()
        _FOUND.clear()
        _BY_ID.clear()
        _EVICTED.clear()
        _BOUND.held = 0
        _BOUND.warned.clear()
        if not _BOUND.fixed:
            _BOUND.limit = None
    for pool in pools.values():
        pool.drop()
    for hook in list(_HOOKS):
        hook()
