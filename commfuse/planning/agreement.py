"""Ranks that agree before they act: one exchange of each rank's verdict and decisions, through commfuse.

Set-up each rank does on its own (a style reading a module, ``commfuse.ep`` wrapping a model, ``strands``
ordering its stages, ``commfuse.graphs`` capturing a signature, ``nn`` gathering a parameter's shards back)
comes before something every rank must join (a scatter, the first forward's calls, a replay, the gather
itself). A rank that refused there alone would leave its peers inside that collective until its process
went away, and they would be told "connection closed" and nothing else; a rank that decided otherwise
(another width, another scale, another argument) would compute with a layout its peers do not share. So
every rank first says what it found, in one exchange over the group, and acts only when all agree. In
plain code::

    mine = (None or this rank's refusal: its class and first line, what it decided: [(name, value), ...])
    everyone = all_gather(mine)                  # through commfuse: numbered, bounded by its timeout
    if any rank refused:    raise                # a refusing rank its own error; the others PeerFailedError
                                                 # naming each refusing rank and what it said
    if the decisions differ: raise MismatchError # naming two ranks and each thing that differs
    return what this rank decided

Every rank leaves the exchange having made the same one call, so the group stays usable whatever was raised.
A group of one rank (or torch's ``fake`` group, one process standing for many) exchanges nothing. It lives
in the planning layer so that every layer above (``fused``, ``graphs``, ``nn``, ``tp``, ``ep``, ``strands``) can
use it.

:func:`agree_shared` is the per-call form for inputs the ranks must pass alike (ring attention's document
lengths, a layer's mask): one exchange of 8-byte digests on every call, and :func:`agree`'s exchange of the
readable values only where the digests differ. Where the call's own transfers can carry the digest
(:func:`carry`, ``commfuse.runtime.rider``: gloo, a ring), there is no exchange of its own: the call that
carried it says whether the ranks agree (:func:`agree_carried`), and only where they do not is anything
exchanged. :func:`agree_around` runs an op's calls with either, whichever its first call allows.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from commfuse import backends
from commfuse.errors import MismatchError, PeerFailedError, first_line
from commfuse.planning.calls import resolve_call
from commfuse.planning.consumers import collect
from commfuse.planning.gather import all_gather_consume_core
from commfuse.runtime.observe import unmeasured
from commfuse.schedule import Collective

__all__ = ["agree", "agree_around", "agree_carried", "agree_shared", "carries", "carry", "digest", "forget_carried",
           "share", "shown"]

T = TypeVar("T")

#: The bytes each rank sends: a length, then its verdict and decisions as JSON. Fixed, so that the exchange has
#: one signature whatever a rank found (its first call on a group is checked once, later ones are not).
PAYLOAD_BYTES = 8192
#: How many differences a MismatchError lists before it says how many more there are.
_SHOWN = 8


def agree(group, what: str, decide: Callable[[], T], described: Callable[[T], list[tuple[str, object]]], *,
          label: str, device=None, so: str = "no rank applies it (nothing was distributed; the group is usable)",
          differ: str = "the ranks decided differently") -> T:
    """``decide()`` on this rank, agreed with every rank of ``group`` before the caller acts on it.

    ``decided = decide()`` may raise (a refusal: any ``Exception``); ``described(decided)`` lists what it
    decided as ``(name, value)`` pairs (values: str, int, float, bool or None; anything else is compared by
    its ``repr``), which every rank must share. Then one exchange (an all-gather through commfuse, labelled
    ``label``, on ``device``'s backend) and:

    - a rank that refused raises its own error (a note says which other ranks refused, and that each was
      told); every other rank raises :class:`PeerFailedError` naming ``what``, each refusing rank and its
      error's class and first line;
    - decisions that differ: every rank raises :class:`MismatchError` naming ``what``, two ranks and each
      thing that differs, with both values;
    - else ``decided`` is returned.

    ``group`` None or of one rank, or torch's ``fake`` group: nothing is exchanged, a refusal is raised as
    it is. ``so`` says what then happens on every rank, in the errors."""
    error, decided, items = None, None, []
    try:
        decided = decide()
        items = [(str(name), _plain(value)) for name, value in described(decided)]
    except Exception as e:  # noqa: BLE001 - any refusal is told to the peers, then raised here unchanged
        error = e
    if _alone(group):
        if error is not None:
            raise error
        return decided
    table = _told(group, what, label, device, error, items, so, "and nothing was distributed")
    rows = [[(str(k), v) for k, v in row.get("decided", ())] for row in table]
    if all(row == rows[0] for row in rows):
        return decided
    name = _namer(group, dist.get_rank(group))
    raise MismatchError(f"{what}: {differ}, so {so}: {_differences(rows, name)}")


def share(group, what: str, decide: Callable[[], object], *, label: str, device=None,
          so: str = "no rank goes on (the group is usable)") -> list:
    """``decide()`` on this rank (a value JSON keeps: numbers, strings, booleans, None and lists of them) and
    every other rank's of ``group``, by rank, in one exchange as :func:`agree` makes (a refusal raised on
    every rank alike, by name); nothing is compared. ``group`` None or of one rank: ``[decide()]``."""
    error, value = None, None
    try:
        value = decide()
    except Exception as e:  # noqa: BLE001 - told to the peers, then raised here unchanged
        error = e
    if _alone(group):
        if error is not None:
            raise error
        return [value]
    return [row.get("decided") for row in _told(group, what, label, device, error, value, so, f"so {so}")]


#: The first integer of a digest row (:func:`agree_shared`): a row without it was not sent by this version.
_SHARED_MAGIC = 0x5EA6ED


def agree_shared(group, what: str, digest: int, described: Callable[[], list[tuple[str, object]]], *, label: str,
                 device=None, so: str = "no rank computed with them (the group is usable)") -> None:
    """Check that every rank of ``group`` passed the same per-call inputs ``what`` (document lengths, a mask),
    from this rank's ``digest`` of them (an int below 2**63), on every rank alike. In plain code::

        everyone = all_gather([magic, digest])       # through commfuse: numbered, bounded by its timeout
        if every digest is the same: return
        agree(described())                           # a second exchange, of the readable descriptions
        raise MismatchError                          # naming two ranks and what differs, on every rank

    ``described()`` lists the inputs as ``(name, value)`` pairs, as :func:`agree` compares them; it runs only
    when the digests differ. Every rank makes the same calls and raises the same way, so the group stays
    usable. ``group`` of one rank, or torch's ``fake`` group (one process standing for many, whose exchanges
    carry nothing): nothing is exchanged. ``device``: the inputs' device, whose backend carries the 16 bytes
    (on an accelerator reading them back is one device-to-host copy)."""
    pg = group
    if pg is None:
        if not (dist.is_available() and dist.is_initialized()):
            return
        pg = dist.group.WORLD
    if dist.get_world_size(pg) == 1 or dist.get_backend(pg) == "fake":
        return
    device = torch.device(device or "cpu")
    be = backends.resolve(None, group, device)
    if be is None or be.world_size == 1:
        return
    got = _gathered(be, group, device, torch.tensor([_SHARED_MAGIC, digest], dtype=torch.int64), label)
    rows = torch.stack(got).cpu().tolist()
    if all(row == rows[0] for row in rows) and rows[0][0] == _SHARED_MAGIC:
        return
    agree(pg, what, lambda: None, lambda _: described(), label=label, device=device, so=so,
          differ="the ranks passed different values")
    raise MismatchError(  # the descriptions agree, the digests do not: what differs is beyond the description
        f"{what}: the ranks passed different values, so {so}: their digests differ ("
        + ", ".join(f"rank {q}: {row[1] & 0xFFFFFFFFFFFFFFFF:#x}" for q, row in enumerate(rows))
        + ") where their descriptions agree")


#: The algorithms whose every step is point-to-point, on which a digest rides (the others run whole collectives).
_POINT_TO_POINT = frozenset(("ring", "bidirectional", "serial"))


def carries(call) -> bool:
    """Whether resolved ``call`` (a ``planning.calls.Call``; None: one rank) carries a digest (:func:`carry`):
    its backend can and its algorithm's steps are all point-to-point. The same answer on every rank of its
    group (the algorithm is agreed on the first call), known before the digest is."""
    if call is None or call.spec.name not in _POINT_TO_POINT:
        return False
    carrier = getattr(call.be, "carries", None)
    return carrier is not None and carrier()


def carry(call, digest: int) -> bool:
    """Whether ``call``, made next on its backend, carries ``digest`` (below 2**63) beside its own transfers
    (``commfuse.runtime.rider``): then :func:`agree_carried` after it compares, with no exchange of its own.
    False (:func:`carries` says no: a device, a plugin, torch's ``fake`` group, one rank, a whole
    collective): compare with :func:`agree_shared` before the call instead. Every rank answers alike."""
    if not carries(call):
        return False
    call.be.carry(digest)
    return True


def agree_carried(be, group, what: str, digest: int, described: Callable[[], list[tuple[str, object]]], *,
                  label: str, device=None,
                  so: str = "no rank returned a result computed with them (the group is usable)") -> None:
    """After the call that carried ``digest`` (:func:`carry`): return where every rank passed the same inputs;
    where they differ, every rank raises :class:`MismatchError` as :func:`agree_shared` does (which then
    runs, to name the ranks and the values). A call that gave no answer (it ran a whole collective, or
    failed before its first step) is followed by :func:`agree_shared`, so nothing goes unchecked."""
    verdict = forget_carried(be)
    if verdict is True:
        return
    agree_shared(group, what, digest, described, label=label, device=device, so=so)
    if verdict is False:  # the call's pairs differed and the digests did not: a peer that carried no pair
        raise MismatchError(f"{what}: the call's transfers carried digests that differ on some rank, so {so}, "
                            "though an exchange of the digests afterwards found them equal: a peer passed "
                            "inputs that changed during the call")


def agree_around(call, group, what: str, digest: int, described: Callable[[], list[tuple[str, object]]],
                 run: Callable[[], T], *, label: str, device=None) -> T:
    """``run()``, whose first call is ``call``, with the ranks' per-call inputs ``what`` compared: ``digest``
    rides that call's transfers where it can (:func:`carry`) and :func:`agree_carried` judges after it; else
    :func:`agree_shared` compares before ``run()``. Where they differ every rank raises
    :class:`MismatchError` and no rank returns ``run()``'s result; a ``run()`` that raises leaves no digest
    behind for the next call to carry."""
    if not carry(call, digest):
        agree_shared(group, what, digest, described, label=label, device=device)
        return run()
    try:
        out = run()
    except BaseException:
        forget_carried(call.be)
        raise
    agree_carried(call.be, group, what, digest, described, label=label, device=device)
    return out


def forget_carried(be) -> bool | None:
    """The verdict of the call that carried a digest on ``be`` (None: none did), forgotten: a caller whose call
    failed before it could ask leaves no digest for the next call to carry."""
    carried = getattr(be, "carried", None)
    return None if carried is None else carried()


def digest(data: bytes | tuple) -> int:
    """A 63-bit digest of ``data``, as :func:`agree_shared` compares them: BLAKE2b of bytes; Python's ``hash``
    of a tuple of ints (or of such tuples), which is the same in every process (ints are not salted), and
    costs a tenth of turning them into bytes first."""
    if isinstance(data, tuple):
        return hash(data) & 0x7FFFFFFFFFFFFFFF
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big") >> 1


def shown(text: str, most: int = 600) -> str:
    """``text`` as a ``described()`` value of :func:`agree_shared` shows it: cut after ``most`` characters."""
    return text if len(text) <= most else f"{text[:most]}... ({len(text)} characters)"


def _alone(group) -> bool:
    """Whether ``group`` exchanges nothing: None, one rank, or torch's ``fake`` group."""
    return group is None or dist.get_world_size(group) == 1 or dist.get_backend(group) == "fake"


def _told(group, what: str, label: str, device, error: BaseException | None, decided, so: str,
          then: str) -> list[dict]:
    """The exchange of every rank's verdict and ``decided``; any refusal raised on every rank, by name (``so``
    in the peers' error says what follows, ``then`` in the note on a refusing rank's own)."""
    try:
        table = _exchange(group, label, device, error, decided)
    except Exception as failed:
        if error is None:
            raise
        _note(error, f"commfuse: {what}: the peers could not be told of this refusal ({type(failed).__name__}: "
                     f"{first_line(failed)})")
        raise error from None
    rank = dist.get_rank(group)
    name = _namer(group, rank)
    refused = {q: row["refused"] for q, row in enumerate(table) if row.get("refused")}
    if refused:
        told = "; ".join(f"{name(q)}: {kind}: {message}" for q, (kind, message) in refused.items())
        if error is not None:
            others = {q: r for q, r in refused.items() if q != rank}
            _note(error, f"commfuse: every rank of the group was told of this refusal of {what} and raised, {then}"
                         + (f"; other ranks refused too: {told}" if others else ""))
            raise error
        raise PeerFailedError(
            f"{what}: {_ranks(refused, name)} refused it, so {so}: {told}")
    return table


def _plain(value):
    """``value`` as JSON keeps it exactly: a str, int, float, bool or None as it is, anything else its repr."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _exchange(group, label: str, device, error: BaseException | None, items: list) -> list[dict]:
    """Every rank's verdict and decisions, by rank: one all-gather of :data:`PAYLOAD_BYTES` each."""
    verdict = None if error is None else [type(error).__name__, first_line(error)]
    text = _encoded({"refused": verdict, "decided": items})
    if len(text) > PAYLOAD_BYTES - 4:  # decisions too many to send: their digest still tells the ranks apart
        digest = hashlib.sha256(json.dumps(items).encode()).hexdigest()
        text = _encoded({"refused": verdict, "decided": [("all decisions (too many to send), their digest", digest)]})
    if len(text) > PAYLOAD_BYTES - 4:
        text = _encoded({"refused": [verdict[0], verdict[1][:200]], "decided": []})
    device = torch.device(device or "cpu")
    mine = torch.zeros(PAYLOAD_BYTES, dtype=torch.uint8)
    mine[:4] = torch.tensor(list(len(text).to_bytes(4, "big")), dtype=torch.uint8)
    mine[4 : 4 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    got = _gathered(backends.resolve(None, group, device), group, device, mine, label)
    return [_decoded(bytes(t.cpu().tolist())) for t in got]


def _gathered(be, group, device: torch.device, mine: torch.Tensor, label: str) -> list[torch.Tensor]:
    """Every rank's ``mine``, by rank: one vanilla all-gather through commfuse on backend ``be`` (numbered,
    bounded by its timeout), on the backend's device (else ``device``)."""
    mine = mine.to(getattr(be, "device", None) or device)
    call = resolve_call(Collective.ALL_GATHER, "vanilla", group=group, backend=be, device=mine.device)
    with unmeasured():  # what the ranks say must travel inside the benchmark's measure() scopes too
        return all_gather_consume_core(call, mine, collect, 0, label=label)


def _encoded(payload: dict) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()


def _decoded(raw: bytes) -> dict:
    """A rank's payload, or one that says it could not be read (another version of commfuse)."""
    try:
        size = int.from_bytes(raw[:4], "big")
        row = json.loads(raw[4 : 4 + size].decode())
        if isinstance(row, dict):
            return row
    except (ValueError, UnicodeDecodeError):
        pass
    return {"refused": None, "decided": [("its payload", f"unreadable ({raw[:16].hex()}...)")]}


def _namer(group, rank: int) -> Callable[[int], str]:
    """How a rank of ``group`` is named: ``rank q``, with its global rank where that differs, and this rank
    marked."""
    ranks = dist.get_process_group_ranks(group)

    def name(q: int) -> str:
        text = f"rank {q}" if ranks[q] == q else f"rank {q} (global rank {ranks[q]})"
        return text + (" (this rank)" if q == rank else "")

    return name


def _ranks(ranks, name) -> str:
    ranks = sorted(ranks)
    return name(ranks[0]) if len(ranks) == 1 else "ranks " + ", ".join(name(q).removeprefix("rank ") for q in ranks)


def _differences(rows: list[list], name) -> str:
    """Each group of ranks whose decisions differ from the lowest rank's, named with what differs."""
    first = dict(rows[0])
    keys = [k for k, _ in rows[0]]
    parts, seen = [], []
    for q, row in enumerate(rows):
        if row == rows[0] or row in seen:
            continue
        seen.append(row)
        alike = [p for p, other in enumerate(rows) if other == row]
        theirs = dict(row)
        names = keys + [k for k, _ in row if k not in first]
        differ = [k for k in names if first.get(k, _ABSENT) != theirs.get(k, _ABSENT)]
        said = [f"{k}: {_value(first.get(k, _ABSENT))} on {name(0)}, {_value(theirs.get(k, _ABSENT))} on {name(q)}"
                for k in differ[:_SHOWN]]
        if len(differ) > _SHOWN:
            said.append(f"and {len(differ) - _SHOWN} more")
        who = _ranks(alike, name)
        parts.append(f"{name(0)} and {who} differ in {'; '.join(said)}")
    return ". ".join(parts)


_ABSENT = object()


def _value(value) -> str:
    return "absent" if value is _ABSENT else repr(value)


def _note(error: BaseException, text: str) -> None:
    try:
        error.add_note(text)
    except Exception:  # noqa: BLE001 - an exception that takes no notes keeps its message
        pass

