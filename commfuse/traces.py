"""``commfuse trace analyze DIR``: the flight recorder's dumps of every rank, merged, and what they say.

Each rank's recorder (``commfuse.runtime.recorder``) writes one JSON file per
group when a call fails, on SIGTERM, or on demand. This module reads the
files of one directory and takes those of one job: every dump names its job
(an identity its ranks agreed in the store), and the dumps of two jobs are
never merged; the newest job is analysed, unless ``--job`` names another, and
what was left out is said. It groups that job's dumps by process group, and
names:

* the rank or ranks that never posted a step their peers waited for (no
  dump at all: killed, or ended where Python could not act; a dump with no
  record of the call: late, hung, or stuck in its own code; started the call
  after its peers gave up: late), following who waits for whom, so that a
  rank that only waits on the straggler is not named in its place;
* the last call every rank completed;
* the first call on which ranks disagree (another op, shape, algorithm or
  site at the same call number);
* per rank, the time its host spent waiting on each peer (where the backend's
  host blocks in waits: gloo).

A file that cannot be used (unreadable, cut short, over ``--max-mib``, or with
a field of the wrong type or range: every field the analysis reads is
checked, :func:`check_dump`) is named in one line with what is wrong with it,
and its rank is never named for it: what that rank did is unknown. Dumps of a
commfuse that wrote no job identity are read, and said to carry none.

It prints a short verdict first and the detail after, and writes a Perfetto
(Chrome trace event format) file of the last calls. Times are the ranks' own
clocks turned into wall-clock time when each dump was written, so ranks on
different hosts line up as well as their clocks agree.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import reprlib
from collections import defaultdict
from pathlib import Path

from commfuse.cli import check_output_file, command, integer
from commfuse.errors import CommfuseValueError, first_line

__all__ = ["MAX_FILE_MIB", "MAX_WORLD_SIZE", "Folder", "Group", "Unusable", "analyze", "check_dump", "load",
           "perfetto", "read", "render"]

#: The most ranks a dump may say its group has (a larger ``world_size`` makes the file unusable).
MAX_WORLD_SIZE = 1 << 20
#: The largest dump file read, in MiB, unless ``--max-mib`` says otherwise (the recorder's default 64 calls
#: make a few hundred kB; a larger file is named as unusable, never read into memory).
MAX_FILE_MIB = 64
#: The most calls a dump may hold (the recorder's ``COMMFUSE_RECORDER`` bound), and steps a call may have.
MAX_CALLS = 1 << 16
MAX_STEPS = 1 << 16
_NS = (1 << 63) - 1
_STATUS = ("ok", "failed", "in progress")
#: how a dump file is named: ``commfuse-trace-<group>-rank<r>.json`` (the recorder's ``Recorder.dump``)
_NAMED = re.compile(r"commfuse-trace-(?P<group>.+)-rank(?P<rank>[0-9]{1,7})\.json\Z")
_SHOWN = reprlib.Repr()
_SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlong, _SHOWN.maxlist, _SHOWN.maxdict = 40, 40, 24, 4, 4


class _Bad(Exception):
    """A field of a dump that is missing or of the wrong type or range: ``field`` names it (``calls[3].lane``)."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"field {field} {why}")
        self.field = field


def _int(d: dict, key: str, field: str, low: int = 0, high: int = _NS, *, none: bool = False,
         optional: bool = False) -> int | None:
    if key not in d:
        if optional:
            return None
        raise _Bad(field, "is missing")
    v = d[key]
    if v is None and none:
        return None
    if type(v) is not int or not low <= v <= high:
        raise _Bad(field, f"is {_SHOWN.repr(v)}, not an integer from {low} to {high}"
                   + (" or null" if none else ""))
    return v


def _str(d: dict, key: str, field: str, *, none: bool = True, optional: bool = True, cap: int = 1 << 16) \
        -> str | None:
    if key not in d:
        if optional:
            return None
        raise _Bad(field, "is missing")
    v = d[key]
    if v is None and none:
        return None
    if type(v) is not str or len(v) > cap:
        raise _Bad(field, f"is {_SHOWN.repr(v)}, not a string of at most {cap} characters"
                   + (" or null" if none else ""))
    return v


def _list(d: dict, key: str, field: str, cap: int, *, none: bool = False, optional: bool = False) -> list | None:
    if key not in d:
        if optional:
            return [] if not none else None
        raise _Bad(field, "is missing")
    v = d[key]
    if v is None and none:
        return None
    if type(v) is not list or len(v) > cap:
        raise _Bad(field, f"is {_SHOWN.repr(v)}, not a list of at most {cap} items" + (" or null" if none else ""))
    return v


def _dict(v, field: str, *, none: bool = False) -> dict | None:
    if v is None and none:
        return None
    if type(v) is not dict:
        raise _Bad(field, f"is {_SHOWN.repr(v)}, not an object" + (" or null" if none else ""))
    return v


def _ranks_in(d: dict, key: str, field: str, world_size: int) -> list[int]:
    items = _list(d, key, field, world_size, optional=True) or []
    out = []
    for i, q in enumerate(items):
        if type(q) is not int or not 0 <= q < world_size:
            raise _Bad(f"{field}[{i}]", f"is {_SHOWN.repr(q)}, not a rank from 0 to {world_size - 1}")
        out.append(q)
    return out


def check_dump(data) -> dict:
    """A flight recorder's dump, checked field by field (type and range of every field the analysis reads) and
    copied into a new dict of those fields only. Raises ``ValueError`` naming the first bad field
    (``field world_size is 'x3', not an integer from 1 to 1048576``)."""
    from commfuse.runtime.recorder import FORMAT

    d = _dict(data, "(the file)")
    if d.get("format") != FORMAT:
        raise _Bad("format", f"is {_SHOWN.repr(d.get('format'))}, not {FORMAT!r}")
    ws = _int(d, "world_size", "world_size", 1, MAX_WORLD_SIZE)
    out = {"format": FORMAT, "group": _str(d, "group", "group", none=False, optional=False, cap=200),
           "rank": _int(d, "rank", "rank", 0, ws - 1), "world_size": ws,
           "has_job": "job" in d, "job": _str(d, "job", "job", cap=200) or None,
           "job_from": _str(d, "job_from", "job_from", cap=200),
           "host": _str(d, "host", "host", cap=1000), "pid": _int(d, "pid", "pid", none=True, optional=True),
           "reason": _str(d, "reason", "reason", cap=1000),
           "written_ns": _int(d, "written_ns", "written_ns")}
    error = _dict(d.get("error"), "error", none=True)
    if error is not None:
        error = {"type": _str(error, "type", "error.type"), "message": _str(error, "message", "error.message")}
    out["error"] = error
    calls = []
    for i, c in enumerate(_list(d, "calls", "calls", MAX_CALLS)):
        where = f"calls[{i}]"
        c = _dict(c, where)
        call = {"seq": _int(c, "seq", f"{where}.seq"),
                "lane": _str(c, "lane", f"{where}.lane", none=False, optional=False, cap=200),
                "op": _str(c, "op", f"{where}.op", cap=200), "algorithm": _str(c, "algorithm", f"{where}.algorithm",
                                                                               cap=200),
                "site": _str(c, "site", f"{where}.site", cap=1000), "error": _str(c, "error", f"{where}.error"),
                "start_ns": _int(c, "start_ns", f"{where}.start_ns"),
                "end_ns": _int(c, "end_ns", f"{where}.end_ns", none=True, optional=True)}
        digest = c.get("digest")
        if digest is not None and type(digest) is not int and (type(digest) is not str or len(digest) > 200):
            raise _Bad(f"{where}.digest", f"is {_SHOWN.repr(digest)}, not an integer, a string or null")
        call["digest"] = digest
        status = c.get("status")
        if status not in _STATUS:
            raise _Bad(f"{where}.status", f"is {_SHOWN.repr(status)}, not one of {', '.join(map(repr, _STATUS))}")
        call["status"] = status
        w = _dict(c.get("waiting"), f"{where}.waiting", none=True)
        if w is not None:
            w = {"step": _int(w, "step", f"{where}.waiting.step", 0, MAX_STEPS),
                 "since_ns": _int(w, "since_ns", f"{where}.waiting.since_ns", none=True, optional=True),
                 "waits_for": _ranks_in(w, "waits_for", f"{where}.waiting.waits_for", ws)}
        call["waiting"] = w
        steps = []
        for j, st in enumerate(_list(c, "steps", f"{where}.steps", MAX_STEPS, optional=True)):
            at = f"{where}.steps[{j}]"
            st = _dict(st, at)
            step = {"step": _int(st, "step", f"{at}.step", 0, MAX_STEPS),
                    "send_to": _ranks_in(st, "send_to", f"{at}.send_to", ws),
                    "recv_from": _ranks_in(st, "recv_from", f"{at}.recv_from", ws)}
            for key in ("post_ns", "wait_ns", "done_ns"):
                step[key] = _int(st, key, f"{at}.{key}", none=True, optional=True)
            for key in ("bytes_sent", "bytes_received"):
                step[key] = _int(st, key, f"{at}.{key}", -1, _NS, none=True, optional=True)
            if "device_wait_ns" in st:
                step["device_wait_ns"] = _int(st, "device_wait_ns", f"{at}.device_wait_ns", none=True)
            steps.append(step)
        call["steps"] = steps
        calls.append(call)
    out["calls"] = calls
    return out


class Unusable:
    """A file that looks like a dump (its name, or the head of its text) but cannot be used: ``why`` says what
    is wrong with it in one line; ``group``, ``rank`` and ``job`` are what its name or head still tell (None
    where nothing does). Its rank is never named for it: what that rank did is unknown."""

    __slots__ = ("file", "why", "group", "rank", "job")

    def __init__(self, file: str, why: str, group: str | None = None, rank: int | None = None,
                 job: str | None = None) -> None:
        self.file, self.why, self.group, self.rank, self.job = file, why, group, rank, job

    def line(self) -> str:
        known = [f"group {self.group}" if self.group is not None else None,
                 f"rank {self.rank}" if self.rank is not None else None,
                 f"job {self.job}" if self.job is not None else None]
        said = ", ".join(k for k in known if k)
        return f"{self.file}: {self.why}" + (f" ({said}, by what is left of it)" if said else "")


def _sniff(path: Path, text: str | None) -> tuple[str | None, int | None, str | None, bool]:
    """What the name and the head of an unreadable file say: its group, rank, job, and whether it is a dump."""
    from commfuse.runtime.recorder import FORMAT

    group = rank = job = None
    named = _NAMED.match(path.name)
    if named:
        group, rank = named["group"], int(named["rank"])
    ours = bool(named)
    if text is not None:
        head = text[:1 << 16]
        ours = ours or f'"format": "{FORMAT}"' in head
        found = re.search(r'"group":\s*"([^"\\]{0,200})"', head)
        group = found[1] if found else group
        found = re.search(r'[{,]\s*"rank":\s*([0-9]{1,7})\s*[,}]', head)
        rank = int(found[1]) if found and rank is None else rank  # the name the recorder gave it comes first
        found = re.search(r'"job":\s*"([^"\\]{1,200})"', head)
        job = found[1] if found else None
    return group, rank, job, ours


def _load_one(path: Path, max_bytes: int) -> dict | Unusable | None:
    """One file: its checked dump, an :class:`Unusable`, or None for a file that is not a dump (the Perfetto
    trace analyze writes beside them, any other JSON)."""
    from commfuse.runtime.recorder import FORMAT

    name = path.name
    try:
        size = path.stat().st_size
        if size > max_bytes:
            with path.open("rb") as f:
                group, rank, job, ours = _sniff(path, f.read(1 << 16).decode("utf-8", "replace"))
            if not ours:
                return None
            return Unusable(name, f"{size / 2**20:.1f} MiB, larger than the {max_bytes / 2**20:.0f} MiB analyze "
                                  "reads (--max-mib); not read", group, rank, job)
        raw = path.read_bytes()
    except OSError as e:
        group, rank, _, ours = _sniff(path, None)
        return Unusable(name, f"could not be read ({type(e).__name__}: {e.strerror or e})", group, rank) \
            if ours else None
    text = raw.decode("utf-8", "replace")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        group, rank, job, ours = _sniff(path, text)
        if not ours:
            return None
        what = "empty" if not raw.strip() else ("cut short (truncated)" if _cut(text) else "not JSON")
        return Unusable(name, f"{what}: {first_line(e, 120)}", group, rank, job)
    if not isinstance(data, dict) or (data.get("format") != FORMAT and not _NAMED.match(name)
                                      and not str(data.get("format", "")).startswith("commfuse-flight-recorder")):
        return None  # not a dump: some other JSON file in the folder
    try:
        dump = check_dump(data)
    except _Bad as e:
        group, rank, job, _ = _sniff(path, None)
        group = data.get("group") if type(data.get("group")) is str and len(data["group"]) <= 200 else group
        if rank is None and type(data.get("rank")) is int and 0 <= data["rank"] < MAX_WORLD_SIZE:
            rank = data["rank"]  # the name the recorder gave the file comes first
        job = data.get("job") if type(data.get("job")) is str and len(data["job"]) <= 200 else None
        return Unusable(name, str(e), group, rank, job)
    dump["_path"] = name
    return dump


def _cut(text: str) -> bool:
    """Whether JSON text ends before its brackets close (a file cut short), as opposed to text that is not JSON:
    with its complete strings taken out, a quote is left open or more brackets open than close."""
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', "", text)
    return '"' in bare or bare.count("[") + bare.count("{") > bare.count("]") + bare.count("}")


#: the job of the dumps that carry no identity (an older commfuse's, or a recorder that reached no store)
NO_JOB = None


class Folder:
    """The dumps of one folder, sorted by job: :attr:`job` is the one analysed (the newest, unless asked for
    one), :attr:`groups` its dumps by group name (each list ordered by rank), :attr:`left_out` one line per
    other job (its files, and when it last wrote), :attr:`unusable` the files that could not be used, and
    :attr:`notes` what the reader should know about the job's identity."""

    def __init__(self, directory: str | os.PathLike, job: str | None = None, max_mib: int = MAX_FILE_MIB) -> None:
        from commfuse.runtime.recorder import FORMAT

        folder = Path(directory)
        self.folder = folder
        if not folder.is_dir():
            raise CommfuseValueError(f"{folder}: not a folder (the flight recorder writes its dumps to "
                                     "COMMFUSE_TRACE_DIR, by default ./commfuse-traces)")
        dumps: list[dict] = []
        unusable: list[Unusable] = []
        for path in sorted(folder.glob("*.json")):
            got = _load_one(path, max_mib << 20)
            if isinstance(got, Unusable):
                unusable.append(got)
            elif got is not None:
                dumps.append(got)
        if not dumps:
            raise CommfuseValueError(f"{folder}: no flight recorder dumps ({FORMAT}) in it"
                                     + ("" if not unusable else " that could be used: "
                                        + "; ".join(u.line() for u in unusable)))
        jobs: dict[str | None, list[dict]] = defaultdict(list)
        for d in dumps:
            jobs[d["job"]].append(d)
        newest = {j: max(d["written_ns"] for d in ds) for j, ds in jobs.items()}
        if job is not None:
            job = NO_JOB if job == "none" else job
            if job not in jobs:
                raise CommfuseValueError(f"--job {job}: no dump of that job in {folder}; its jobs: "
                                         + ", ".join(_job_name(j) for j in sorted(jobs, key=lambda j: newest[j])))
            self.job = job
        else:  # the newest: the job whose latest dump was written last
            self.job = max(jobs, key=lambda j: (newest[j], j or ""))
        chosen = jobs[self.job]
        self.notes: list[str] = []
        if len(jobs) > 1:
            self.notes.append(f"{folder} holds the dumps of {len(jobs)} jobs: analysing {_job_name(self.job)}"
                              + (" (the newest)" if job is None else "") + "; the others are left out (--job ID "
                              "analyses another)")
        if self.job is NO_JOB:
            older = sorted({d["_path"] for d in chosen if not d["has_job"]})
            if older:
                self.notes.append(f"{_files(older)} carry no job identity (written by a commfuse that records "
                                  "none): were dumps of two runs of this group in the folder, they could not be "
                                  "told apart")
            unknown = sorted({d["_path"] for d in chosen if d["has_job"]})
            if unknown:
                self.notes.append(f"{_files(unknown)} carry no job identity (their recorder reached no store, and "
                                  "no TORCHELASTIC_RUN_ID was set)")
        self.left_out: list[str] = []
        for j in sorted(jobs, key=lambda j: -newest[j]):
            if j == self.job:
                continue
            files = sorted(d["_path"] for d in jobs[j])
            ago = newest[self.job] - newest[j]
            when = f"its last dump written {_ms(abs(ago))} {'before' if ago >= 0 else 'after'} the analysed job's"
            self.left_out.append(f"left out: {_job_name(j)}, {when}: {_files(files)}")
        # the files of one job and group, one per rank: a second file of a rank (a copy) is left out, the newer kept
        self.groups: dict[str, list[dict]] = {}
        by_group: dict[str, dict[int, dict]] = defaultdict(dict)
        for d in sorted(chosen, key=lambda d: d["written_ns"]):
            seen = by_group[d["group"]].get(d["rank"])
            if seen is not None:
                self.left_out.append(f"left out: {seen['_path']}, a dump of group {d['group']} rank {d['rank']} of "
                                     f"the same job, older than {d['_path']}")
            by_group[d["group"]][d["rank"]] = d
        self.groups = {g: [ranks[r] for r in sorted(ranks)] for g, ranks in sorted(by_group.items())}
        # an unusable file counts for the analysed job unless what is left of it names another job
        self.unusable: list[Unusable] = []
        for u in unusable:
            if u.job is not None and u.job != self.job:
                self.left_out.append(f"left out: {u.file}, unusable and of {_job_name(u.job)}: {u.why}")
            else:
                self.unusable.append(u)

    def dumps_from(self) -> str | None:
        """Where the analysed job's identity came from (``store``, ``TORCHELASTIC_RUN_ID``), when one did."""
        froms = sorted({d["job_from"] for ds in self.groups.values() for d in ds if d["job_from"]})
        return ", ".join(froms) or None


def _job_name(job: str | None) -> str:
    return "the dumps without a job identity" if job is NO_JOB else f"job {job}"


def _files(names: list[str]) -> str:
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")


def read(directory: str | os.PathLike, job: str | None = None, max_mib: int = MAX_FILE_MIB) -> Folder:
    """The dumps under ``directory`` (see :class:`Folder`); a folder with no usable dump raises, naming it and
    every file that could not be used."""
    return Folder(directory, job, max_mib)


def load(directory: str | os.PathLike, job: str | None = None) -> dict[str, list[dict]]:
    """The usable dumps of one job under ``directory`` (the newest, unless ``job`` names one), by group name,
    each list ordered by rank, each dump checked (:func:`check_dump`)."""
    return read(directory, job).groups


def _ms(ns: float) -> str:
    return f"{ns / 1e6:.1f} ms" if abs(ns) < 1e10 else f"{ns / 1e9:.1f} s"


def _ranks(ranks) -> str:
    """``rank 3``, ``ranks 0, 2``; runs of three or more as ``ranks 4-9``."""
    ranks = sorted(set(ranks))
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{ranks[i]}-{ranks[j]}")
        else:
            parts.extend(map(str, ranks[i:j + 1]))
        i = j + 1
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def _call_name(call: dict) -> str:
    """``call #N (op, algorithm)``, and ``at PATH`` where the call ran in a site (the module's path)."""
    site = call.get("site")
    return f"call #{call['seq']} ({call.get('op')}, {call.get('algorithm')})" + (f" at {site}" if site else "")


class Group:
    """The analysis of one process group's dumps: :attr:`verdict` (short lines) and :attr:`detail`."""

    def __init__(self, name: str, dumps: list[dict], unusable: list[Unusable] = ()) -> None:
        """``dumps``: one group's dumps of one job (each checked by :func:`check_dump` here unless
        :class:`Folder` did); ``unusable``: the files of the folder that could not be used, of which those
        that name this group and a rank of it are this group's: that rank is said to have an unusable dump,
        and never named for what it did."""
        self.name = name
        #: the reading of the folder the dumps came from (:class:`Folder`), where :func:`analyze` made the group
        self.folder: Folder | None = None
        checked = []
        for i, d in enumerate(dumps):
            if "_path" in d:
                checked.append(d)
                continue
            try:
                checked.append({**check_dump(d), "_path": f"dump {i}"})
            except _Bad as e:
                raise CommfuseValueError(f"group {name}, dump {i}: {e}") from None
        if not checked:
            raise CommfuseValueError(f"group {name}: no dumps to analyse")
        self.dumps = {d["rank"]: d for d in checked}
        sizes = defaultdict(list)
        for r, d in sorted(self.dumps.items()):
            sizes[d["world_size"]].append(r)
        #: the group's world size: the largest any of its dumps says (they disagree only when a file lies)
        self.world_size = max(sizes)
        #: the ranks whose dump could not be used, and why (their file and what is wrong with it)
        self.unusable: dict[int, str] = {}
        for u in unusable:
            if u.group == name and u.rank is not None and u.rank < self.world_size and u.rank not in self.dumps:
                self.unusable[u.rank] = f"{u.file}: {u.why}"
        self.missing = [r for r in range(self.world_size) if r not in self.dumps and r not in self.unusable]
        # (lane, seq) -> rank -> call
        self.calls: dict[tuple[str, int], dict[int, dict]] = defaultdict(dict)
        for rank, d in self.dumps.items():
            for c in d.get("calls", ()):
                self.calls[(c["lane"], c["seq"])][rank] = c
        self.verdict: list[str] = []
        self.detail: list[str] = []
        #: what the analysis concluded, for programs and tests
        self.culprits: dict[int, str] = {}
        self.stuck: tuple[str, int] | None = None
        self.disagree: tuple[str, int] | None = None
        self.last_complete: dict[str, int] = {}
        self.waits: dict[int, dict[int, int]] = {}
        if len(sizes) > 1:
            self.verdict.append("the dumps disagree on the group's world size: " + "; ".join(
                f"{_ranks(ranks)} {'say' if len(ranks) > 1 else 'says'} {ws}" for ws, ranks in sorted(sizes.items()))
                + f"; read as {self.world_size}")
        if all(d["job"] is None for d in checked):
            self._apart()
        for r, why in sorted(self.unusable.items()):
            self.verdict.append(f"rank {r}'s dump is unusable ({why}): nothing is concluded about rank {r}, and "
                                "it is not named for it")
        self._analyze()

    # -- the parts ----------------------------------------------------------------------------------------------

    def _analyze(self) -> None:
        self._disagreement()
        self._stuck_call()
        self._last_complete()
        self._waits()
        if not self.culprits and self.stuck is None and self.disagree is None:
            self.verdict.append("no rank failed or waits in the calls recorded"
                                + ("" if not self.missing else f"; {_ranks(self.missing)} left no dump"))

    def _apart(self) -> None:
        """Dumps without a job identity cannot be told apart by it; where one rank's recorded calls all ended
        before another's first began, say that they may be two runs' (the ranks of one run call together)."""
        spans = {}
        for r, d in self.dumps.items():
            calls = d["calls"]
            if calls:
                spans[r] = (min(c["start_ns"] for c in calls),
                            max(c["end_ns"] or c["start_ns"] for c in calls))
        if len(spans) < 2:
            return
        first = min(spans, key=lambda r: spans[r][1])  # the rank whose calls ended first
        last = max(spans, key=lambda r: spans[r][0])  # the rank whose calls began last
        gap = spans[last][0] - spans[first][1]
        if gap > 0:
            self.verdict.append(f"rank {first}'s recorded calls all ended {_ms(gap)} before rank {last}'s first "
                                "began, and the dumps carry no job identity: they may be two runs' dumps, which "
                                "the analysis below mixes (give each run its own COMMFUSE_TRACE_DIR)")

    def _disagreement(self) -> None:
        for key in sorted(self.calls, key=lambda k: (k[1], k[0])):
            by_rank = self.calls[key]
            kinds = defaultdict(list)
            for rank, c in by_rank.items():
                kinds[(c.get("op"), c.get("algorithm"), c.get("digest"), c.get("site"))].append(rank)
            if len(kinds) > 1:
                self.disagree = key
                # identical layers make calls of one signature: only the site tells a rank a layer behind
                sides = "; ".join(f"{_ranks(ranks)} called {op} ({alg}, signature digest {digest})"
                                  + (f" at {site}" if site else "")
                                  for (op, alg, digest, site), ranks in sorted(kinds.items(), key=lambda kv: kv[1]))
                self.verdict.append(f"the ranks disagree first on call #{key[1]} (thread {key[0]}): {sides}")
                return

    def _stuck_call(self) -> None:
        """The first call some rank did not complete, and who its waiting ranks were waiting for."""
        for key in sorted(self.calls, key=lambda k: (k[1], k[0])):
            by_rank = self.calls[key]
            if all(c["status"] == "ok" for c in by_rank.values()) and not self._absent_from(key):
                continue
            self.stuck = key
            break
        if self.stuck is None:
            if self.missing:
                self.verdict.append(f"{_ranks(self.missing)} left no dump (killed, or ended where Python could "
                                    "not act), and no recorded call of the others waits on it")
                for r in self.missing:
                    self.culprits[r] = "no dump"
            return
        key = self.stuck
        by_rank = self.calls[key]
        any_call = next(iter(by_rank.values()))
        waiting = {r: c for r, c in by_rank.items() if c.get("waiting") or c["status"] != "ok"}
        waited_on: dict[int, set[int]] = defaultdict(set)  # peer -> ranks that waited on it
        steps: dict[int, int] = {}
        for r, c in waiting.items():
            w = c.get("waiting")
            if w:
                for q in w.get("waits_for") or ():
                    waited_on[q].add(r)
                steps[r] = w["step"]
        gave_up = {r: c.get("end_ns") for r, c in by_rank.items() if c.get("end_ns") and c["status"] != "ok"}
        first_give_up = min(gave_up.values()) if gave_up else None
        # follow who waits for whom: a waited-on rank that itself waits inside this call is not the cause
        roots: dict[int, str] = {}
        for q, who in sorted(waited_on.items()):
            reason = self._why_absent(q, key, first_give_up)
            if reason is not None:
                roots[q] = reason
        if not roots:
            for q in self._absent_from(key) + self.missing:
                roots[q] = self._why_absent(q, key, first_give_up) or "has no record of the call"
        alike: dict[tuple, list[int]] = defaultdict(list)  # ranks named for the same reason: one line
        for q, reason in sorted(roots.items()):
            self.culprits[q] = reason
            who = tuple(sorted(waited_on.get(q, set())) or sorted(waiting))
            alike[(who, reason)].append(q)
        for (who, reason), named in alike.items():
            at = sorted({steps[r] for r in who if r in steps})
            where = f" in step {', '.join(map(str, at))}" if at else ""
            self.verdict.append(f"{_ranks(named)} never posted what {_ranks(who)} waited for{where} of "
                                f"{_call_name(any_call)} (thread {key[0]}): {reason}")
        if not roots:
            unknown = sorted(q for q in waited_on if q in self.unusable)
            if unknown:
                who = sorted(set().union(*(waited_on[q] for q in unknown)))
                self.verdict.append(f"{_ranks(who)} waited in {_call_name(any_call)} (thread {key[0]}) for "
                                    f"{_ranks(unknown)}, whose dump is unusable: no rank is named")
            else:
                failed = sorted(r for r, c in by_rank.items() if c["status"] == "failed")
                self.verdict.append(f"{_call_name(any_call)} "
                                    + (f"failed on {_ranks(failed)}" if failed else "did not complete")
                                    + "; no rank is named as the one the others waited for (see the errors below)")
        self.detail.append(f"{_call_name(any_call)} on thread {key[0]}, rank by rank:")
        shown = range(self.world_size) if self.world_size <= 64 else sorted({*self.dumps, *self.unusable})
        for r in shown:
            c = by_rank.get(r)
            if r in self.unusable:
                self.detail.append(f"  rank {r}: unusable dump ({self.unusable[r]})")
            elif r not in self.dumps:
                self.detail.append(f"  rank {r}: no dump")
            elif c is None:
                last = self._last_call(r)
                self.detail.append(f"  rank {r}: no record of this call; its last: "
                                   + (f"{_call_name(last)}, {last['status']}" if last else "none"))
            else:
                w = c.get("waiting")
                text = f"  rank {r}: {c['status']}"
                if w:
                    text += f", waiting in step {w['step']} for {_ranks(w.get('waits_for') or ())}"
                    if w.get("since_ns") and c.get("end_ns"):
                        text += f" for {_ms(c['end_ns'] - w['since_ns'])}"
                if c.get("error"):
                    text += f"; {c['error'][:160]}" + ("..." if len(c["error"]) > 160 else "")
                self.detail.append(text)
        if self.world_size > 64 and self.missing:
            self.detail.append(f"  {_ranks(self.missing)}: no dump")

    def _absent_from(self, key) -> list[int]:
        """Ranks with a dump but no record of call ``key``, while their last call is older (not those whose
        ring moved past it)."""
        out = []
        for r, d in self.dumps.items():
            if r in self.calls[key]:
                continue
            seqs = [c["seq"] for c in d.get("calls", ()) if c["lane"] == key[0]]
            if not seqs or max(seqs) < key[1]:
                out.append(r)
        return out

    def _last_call(self, rank: int) -> dict | None:
        calls = self.dumps[rank].get("calls", ())
        return max(calls, key=lambda c: c["start_ns"]) if calls else None

    def _why_absent(self, q: int, key, first_give_up) -> str | None:
        """Why rank ``q`` did not post its part of call ``key``, or None when it did (it waits there itself, or
        completed its part)."""
        if q in self.unusable:
            return None  # what it did is unknown: never named for a file that could not be read
        if q not in self.dumps:
            return "it left no dump (killed, or ended where Python could not act)"
        c = self.calls[key].get(q)
        if c is None:
            last = self._last_call(q)
            tail = f"; its last recorded call is {_call_name(last)} ({last['status']})" if last else ""
            return "its dump has no record of the call: it never reached it (late, hung, or stuck in its own " \
                   "code)" + tail
        if first_give_up is not None and c["start_ns"] > first_give_up:
            return (f"it started the call {_ms(c['start_ns'] - first_give_up)} after its peers gave up waiting: "
                    "late")
        w = c.get("waiting")
        if w and c["status"] != "ok":
            return None  # it waits on others itself: the chain goes on through them
        return None

    def _last_complete(self) -> None:
        lanes = {lane for lane, _ in self.calls}
        for lane in sorted(lanes):
            per_rank = []
            for r, d in self.dumps.items():
                ok = [c["seq"] for c in d.get("calls", ()) if c["lane"] == lane and c["status"] == "ok"]
                per_rank.append(max(ok) if ok else -1)
            last = min(per_rank) if per_rank else -1
            self.last_complete[lane] = last
            if last >= 0:
                c = next(c for c in self.calls[(lane, last)].values())
                note = "" if not self.missing else f" (of the ranks that left a dump; {_ranks(self.missing)} did not)"
                self.detail.append(f"the last call every rank completed on thread {lane}: {_call_name(c)}{note}")
            else:
                self.detail.append(f"thread {lane}: no call completed on every rank within the recorded calls")

    def _waits(self) -> None:
        for r, d in self.dumps.items():
            per_peer: dict[int, int] = defaultdict(int)
            for c in d.get("calls", ()):
                for s in c.get("steps", ()):
                    if s.get("wait_ns") is None:
                        continue
                    end = s.get("done_ns") or c.get("end_ns") or d.get("written_ns")
                    peers = s.get("recv_from") or s.get("send_to") or ()
                    for q in peers:
                        per_peer[q] += max(0, end - s["wait_ns"])
            self.waits[r] = dict(per_peer)
        lines = []
        for r in sorted(self.waits):
            if self.waits[r]:
                lines.append(f"  rank {r}: " + ", ".join(f"on rank {q} {_ms(ns)}" for q, ns in
                                                           sorted(self.waits[r].items())))
        if lines:
            self.detail.append("time each rank's host waited on each peer, over its recorded calls:")
            self.detail.extend(lines)

    def errors(self) -> list[str]:
        out = []
        for r in sorted({*self.dumps, *self.unusable}):
            d = self.dumps.get(r)
            if d is None:
                out.append(f"  rank {r}: unusable: {self.unusable[r]}")
                continue
            e = d.get("error")
            if e:
                first = first_line(e.get("message") or "", None)
                out.append(f"  rank {r} ({d.get('reason')}): {e.get('type')}: "
                           + (first if len(first) <= 400 else first[:397] + "..."))
            else:
                out.append(f"  rank {r}: dumped {d.get('reason')}")
        return out


def analyze(directory: str | os.PathLike, job: str | None = None, max_mib: int = MAX_FILE_MIB) -> list[Group]:
    """The analysis of every group of one job whose dumps are in ``directory``: the newest job, unless ``job``
    names one (:class:`Folder`). Each group's :attr:`Group.folder` is the folder's reading: the job, what was
    left out, the files that could not be used."""
    folder = read(directory, job, max_mib)
    groups = []
    for name, dumps in folder.groups.items():
        g = Group(name, dumps, folder.unusable)
        g.folder = folder
        groups.append(g)
    return groups


def _stray(groups: list[Group]) -> list[Unusable]:
    """The unusable files no group took (no group or rank known, or one the job has no dump of)."""
    folder = groups[0].folder if groups else None
    if folder is None:
        return []
    taken = {(g.name, r) for g in groups for r in g.unusable}
    return [u for u in folder.unusable if (u.group, u.rank) not in taken]


def render(groups: list[Group]) -> str:
    lines = []
    folder = groups[0].folder if groups else None
    if folder is not None:
        if folder.job is NO_JOB:
            lines.append("job: unknown (the dumps carry no job identity)")
        else:
            froms = folder.dumps_from()
            lines.append(f"job {folder.job}" + ("" if not froms else " (its identity agreed in the store)"
                                                 if froms == "store" else f" (its identity from {froms})"))
        lines.extend(f"  {n}" for n in folder.notes)
        lines.extend(f"  {n}" for n in folder.left_out)
        lines.extend(f"  unusable, its rank not named for it: {u.line()}" for u in _stray(groups))
    for g in groups:
        lines.append(f"group {g.name} ({g.world_size} ranks; dumps from {_ranks(g.dumps)}"
                     + (f"; unusable from {_ranks(g.unusable)}" if g.unusable else "")
                     + (f"; none from {_ranks(g.missing)}" if g.missing else "") + "):")
        lines.extend(f"  {v}" for v in g.verdict)
    lines.append("")
    for g in groups:
        lines.append(f"detail of group {g.name}:")
        lines.extend(f"  {d}" for d in g.detail)
        lines.append("  what each rank's dump says:")
        lines.extend(f"  {e}" for e in g.errors())
    return "\n".join(lines) + "\n"


# -- Perfetto ---------------------------------------------------------------------------------------------------


def _device_waits(call: dict) -> dict:
    """A device-stamped call's stalls per step (``COMMFUSE_DEVICE_TIMING``), as its slice's arguments."""
    return {f"device wait step {s['step']} (ms)": (None if s["device_wait_ns"] is None else s["device_wait_ns"] / 1e6)
            for s in call.get("steps", ()) if "device_wait_ns" in s}


def perfetto(groups: list[Group], last: int = 20) -> dict:
    """A Chrome trace event file (Perfetto, chrome://tracing) of the last ``last`` calls of each rank: one
    process per group and rank, one thread per lane; a slice per call and, inside it, per step where the
    host waited."""
    events = []
    starts = [c["start_ns"] for g in groups for d in g.dumps.values() for c in d.get("calls", ())]
    origin = min(starts) if starts else 0
    pid = 0
    for g in groups:
        for rank, d in sorted(g.dumps.items()):
            pid += 1
            events.append({"ph": "M", "name": "process_name", "pid": pid,
                           "args": {"name": f"group {g.name} rank {rank}"}})
            tids: dict[str, int] = {}
            calls = sorted(d.get("calls", ()), key=lambda c: c["start_ns"])[-last:]
            for c in calls:
                tid = tids.setdefault(c["lane"], len(tids) + 1)
                end = c.get("end_ns") or d.get("written_ns")
                events.append({"ph": "X", "pid": pid, "tid": tid, "name": f"#{c['seq']} {c.get('op')}",
                               "ts": (c["start_ns"] - origin) / 1e3, "dur": max(0, end - c["start_ns"]) / 1e3,
                               "args": {"algorithm": c.get("algorithm"), "status": c["status"],
                                        "error": c.get("error"), "site": c.get("site"),
                                        **_device_waits(c)}})
                for s in c.get("steps", ()):
                    if s.get("wait_ns") is None:  # a device-stamped step: a stall's length, not a moment
                        continue
                    done = s.get("done_ns") or end
                    peers = s.get("recv_from") or s.get("send_to") or []
                    events.append({"ph": "X", "pid": pid, "tid": tid,
                                   "name": f"wait step {s['step']} on {_ranks(peers)}",
                                   "ts": (s["wait_ns"] - origin) / 1e3, "dur": max(0, done - s["wait_ns"]) / 1e3,
                                   "args": {"bytes_received": s.get("bytes_received"),
                                            "bytes_sent": s.get("bytes_sent"),
                                            "completed": s.get("done_ns") is not None}})
            for lane, tid in tids.items():
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": lane}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


# -- the command --------------------------------------------------------------------------------------------------


def _arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION", help="what to do")
    a = sub.add_parser("analyze", help="merge the ranks' dumps in DIR and say who stopped first, where")
    a.add_argument("dir", metavar="DIR", help="the folder of the dumps (COMMFUSE_TRACE_DIR of the run)")
    a.add_argument("--perfetto", metavar="FILE", default=None,
                   help="where to write the Perfetto trace of the last calls (default: DIR/commfuse-trace.perfetto"
                   ".json; '-' for none)")
    a.add_argument("--last", type=integer(1, 100000), default=20, help="calls per rank in the trace (20)")
    a.add_argument("--json", action="store_true", help="print the findings as JSON instead of text")
    a.add_argument("--job", metavar="ID", default=None,
                   help="the job whose dumps to analyse, where DIR holds several (default: the newest; 'none': the dumps "
                   "that carry no job identity)")
    a.add_argument("--max-mib", type=integer(1, 1 << 20), default=MAX_FILE_MIB,
                   help=f"the largest dump file read, in MiB ({MAX_FILE_MIB}); a larger one is named, not read")


@command("trace", "read the flight recorder's dumps (trace analyze DIR)", _arguments)
def _trace(args: argparse.Namespace) -> int:
    target = args.perfetto if args.perfetto is not None else os.path.join(args.dir, "commfuse-trace.perfetto.json")
    if target != "-":
        check_output_file("--perfetto", target)
    groups = analyze(args.dir, args.job, args.max_mib)
    if args.json:
        folder = groups[0].folder
        stray = [u.line() for u in _stray(groups)]
        print(json.dumps([{"group": g.name, "job": folder.job, "job_from": folder.dumps_from(),
                           "notes": folder.notes, "left_out": folder.left_out, "unusable_files": stray,
                           "world_size": g.world_size, "verdict": g.verdict,
                           "culprits": g.culprits, "stuck": g.stuck, "disagree": g.disagree,
                           "last_complete": g.last_complete, "waits": g.waits, "missing": g.missing,
                           "unusable": g.unusable, "detail": g.detail} for g in groups], indent=1))
    else:
        print(render(groups), end="")
    if target != "-":
        Path(target).write_text(json.dumps(perfetto(groups, args.last)))
        if not args.json:
            print(f"Perfetto trace of the last {args.last} calls per rank: {target} (open it in ui.perfetto.dev)")
    return 0
