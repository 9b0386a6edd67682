"""``commfuse trace analyze DIR``: the flight recorder's dumps of every rank, merged, and what they say.

Each rank's recorder (``commfuse.runtime.recorder``) writes one JSON file per
group when a call fails, on SIGTERM, or on demand. This module reads the
files of one directory, groups them by process group, and names:

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

It prints a short verdict first and the detail after, and writes a Perfetto
(Chrome trace event format) file of the last calls. Times are the ranks' own
clocks turned into wall-clock time when each dump was written, so ranks on
different hosts line up as well as their clocks agree.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict
from pathlib import Path

from commfuse.cli import check_output_file, command, integer
from commfuse.errors import CommfuseValueError

__all__ = ["Group", "analyze", "load", "perfetto", "render"]


def load(directory: str | os.PathLike) -> dict[str, list[dict]]:
    """The dumps under ``directory``, by group name (each list ordered by rank). Files that are not dumps of
    this format are skipped; a directory with none raises, naming it."""
    from commfuse.runtime.recorder import FORMAT  # here: the package imports torch, which --help must not

    folder = Path(directory)
    if not folder.is_dir():
        raise CommfuseValueError(f"{folder}: not a folder (the flight recorder writes its dumps to "
                                 "COMMFUSE_TRACE_DIR, by default ./commfuse-traces)")
    groups: dict[str, list[dict]] = defaultdict(list)
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            continue
        data["_path"] = path.name
        groups[str(data.get("group"))].append(data)
    if not groups:
        raise CommfuseValueError(f"{folder}: no flight recorder dumps ({FORMAT}) in it")
    return {g: sorted(dumps, key=lambda d: d.get("rank", -1)) for g, dumps in sorted(groups.items())}


def _ms(ns: float) -> str:
    return f"{ns / 1e6:.1f} ms" if abs(ns) < 1e10 else f"{ns / 1e9:.1f} s"


def _ranks(ranks) -> str:
    ranks = sorted(set(ranks))
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _call_name(call: dict) -> str:
    """``call #N (op, algorithm)``, and ``at PATH`` where the call ran in a site (the module's path)."""
    site = call.get("site")
    return f"call #{call['seq']} ({call.get('op')}, {call.get('algorithm')})" + (f" at {site}" if site else "")


class Group:
    """The analysis of one process group's dumps: :attr:`verdict` (short lines) and :attr:`detail`."""

    def __init__(self, name: str, dumps: list[dict]) -> None:
        self.name = name
        self.dumps = {d["rank"]: d for d in dumps}
        self.world_size = max(int(d.get("world_size") or 0) for d in dumps)
        self.missing = [r for r in range(self.world_size) if r not in self.dumps]
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
        self._analyze()

    # -- the parts ----------------------------------------------------------------------------------------------

    def _analyze(self) -> None:
        self._disagreement()
        self._stuck_call()
        self._last_complete()
        self._waits()
        if not self.verdict:
            self.verdict.append("no rank failed or waits in the calls recorded"
                                + ("" if not self.missing else f"; {_ranks(self.missing)} left no dump"))

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
        for q, reason in sorted(roots.items()):
            self.culprits[q] = reason
            who = sorted(waited_on.get(q, set())) or sorted(waiting)
            at = sorted({steps[r] for r in who if r in steps})
            where = f" in step {', '.join(map(str, at))}" if at else ""
            self.verdict.append(f"rank {q} never posted what {_ranks(who)} waited for{where} of "
                                f"{_call_name(any_call)} (thread {key[0]}): {reason}")
        if not roots:
            failed = sorted(r for r, c in by_rank.items() if c["status"] == "failed")
            self.verdict.append(f"{_call_name(any_call)} failed on {_ranks(failed)}; no rank is named as the "
                                "one the others waited for (see the errors below)")
        self.detail.append(f"{_call_name(any_call)} on thread {key[0]}, rank by rank:")
        for r in range(self.world_size):
            c = by_rank.get(r)
            if r not in self.dumps:
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
        for r, d in sorted(self.dumps.items()):
            e = d.get("error")
            if e:
                message = e.get("message", "").strip().splitlines()
                first = message[0] if message else ""
                out.append(f"  rank {r} ({d.get('reason')}): {e.get('type')}: "
                           + (first if len(first) <= 400 else first[:397] + "..."))
            else:
                out.append(f"  rank {r}: dumped {d.get('reason')}")
        return out


def analyze(directory: str | os.PathLike) -> list[Group]:
    """The analysis of every group whose dumps are in ``directory``."""
    return [Group(name, dumps) for name, dumps in load(directory).items()]


def render(groups: list[Group]) -> str:
    lines = []
    for g in groups:
        lines.append(f"group {g.name} ({g.world_size} ranks; dumps from {_ranks(g.dumps)}"
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


@command("trace", "read the flight recorder's dumps (trace analyze DIR)", _arguments)
def _trace(args: argparse.Namespace) -> int:
    target = args.perfetto if args.perfetto is not None else os.path.join(args.dir, "commfuse-trace.perfetto.json")
    if target != "-":
        check_output_file("--perfetto", target)
    groups = analyze(args.dir)
    if args.json:
        print(json.dumps([{"group": g.name, "world_size": g.world_size, "verdict": g.verdict,
                           "culprits": g.culprits, "stuck": g.stuck, "disagree": g.disagree,
                           "last_complete": g.last_complete, "waits": g.waits, "missing": g.missing,
                           "detail": g.detail} for g in groups], indent=1))
    else:
        print(render(groups), end="")
    if target != "-":
        Path(target).write_text(json.dumps(perfetto(groups, args.last)))
        if not args.json:
            print(f"Perfetto trace of the last {args.last} calls per rank: {target} (open it in ui.perfetto.dev)")
    return 0
