"""Traces from the executor's own events: spans per rank and stream, and the Chrome/Perfetto JSON.

The ranks record one iteration per algorithm inside
:func:`commfuse.runtime.record_events`, whose per-step dicts carry
``time.perf_counter`` spans ``post``, ``compute`` and ``wait`` (see
``commfuse.runtime.walks.execute``); the runner makes them relative to a
barrier every rank leaves at the same moment. From a step:

- a *compute* span ``compute[0] .. compute[1]`` when the step computes;
- a *transfer* span ``post[0] .. wait[1]`` when it sends, receives or runs a
  collective: from posting until the host knew it was done. The bytes may have
  landed earlier; on gloo nothing tells when, so this is an upper bound;
- a *wait* span ``wait[0] .. wait[1]`` inside it: the host blocked on the
  transfer (and added what arrived), the communication left exposed.

The file follows the Trace Event Format (``"traceEvents"``, complete events
``"ph": "X"`` with microsecond ``ts``/``dur``, metadata events naming
processes and threads), which chrome://tracing and https://ui.perfetto.dev
open. One process per (workload, algorithm), two threads per rank.
On accelerators these are host-side spans (when work was queued and waited
for), not device times: use the torch profiler there.
"""

from __future__ import annotations

import json
from pathlib import Path

#: A step whose compute span is shorter than this computed nothing (the
#: executor's empty compute is a few hundred nanoseconds).
EMPTY_COMPUTE_S = 2e-6


def spans(events: list[dict]) -> list[dict]:
    """Spans of one rank's iteration: dicts with stream ("compute"/"comm"), kind, start, end (s), name."""
    out = []
    for e in events:
        what = f"{e['label']} step {e['step']}"
        c0, c1 = e["compute"]
        computes = e["computes"] if "computes" in e else (c1 - c0) > EMPTY_COMPUTE_S
        if computes:
            out.append({"stream": "compute", "kind": "compute", "start": c0, "end": c1, "name": f"{what} compute",
                        "label": e["label"], "step": e["step"]})
        peers = [f"send->{p}" for p, _ in e["sends"]] + [f"recv<-{p}" for p, _ in e["recvs"]] + list(e["collectives"])
        if peers:
            out.append({"stream": "comm", "kind": "transfer", "start": e["post"][0], "end": e["wait"][1],
                        "name": f"{what} {' '.join(peers)}", "label": e["label"], "step": e["step"]})
            out.append({"stream": "comm", "kind": "wait", "start": e["wait"][0], "end": e["wait"][1],
                        "name": f"{what} wait", "label": e["label"], "step": e["step"]})
    return out


def chrome_trace(run: dict) -> dict:
    """The Trace Event Format document of every traced iteration in ``run`` (rank 0's result)."""
    events: list[dict] = []
    pid = 0
    for res in run["results"]:
        for alg in res["algorithms"]:
            per_rank = res["traces"].get(alg)
            if not per_rank:
                continue
            pid += 1
            end = max(t["end"] for t in per_rank)
            events.append({"name": "process_name", "ph": "M", "pid": pid,
                           "args": {"name": f"{res['workload']} {alg} ({1e3 * end:.2f} ms)"}})
            events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
            for t in per_rank:
                r = t["rank"]
                for stream, offset in (("compute", 0), ("comm", 1)):
                    tid = 2 * r + offset
                    events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                                   "args": {"name": f"rank {r} {stream}"}})
                    events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                                   "args": {"sort_index": tid}})
                for s in spans(t["events"]):
                    events.append({
                        "name": s["name"],
                        "cat": s["kind"],
                        "ph": "X",
                        "ts": round(1e6 * s["start"], 3),
                        "dur": round(1e6 * max(0.0, s["end"] - s["start"]), 3),
                        "pid": pid,
                        "tid": 2 * r + (0 if s["stream"] == "compute" else 1),
                        "args": {"workload": res["workload"], "algorithm": alg, "rank": r, "op": s["label"],
                                 "step": s["step"]},
                    })
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"generator": "commfuse bench", "world_size": run["world_size"], "backend": run["backend"],
                      "device": run["device"]},
    }


def write(run: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(run)))
    return path
