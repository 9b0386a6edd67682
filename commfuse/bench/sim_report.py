"""Presenting predictions: the table, JSON records, the trace and the Gantt chart.

Traces and charts are the benchmark's own (``commfuse.bench.trace`` and
``commfuse.bench.plot``): a predicted timeline is turned into the per-step
events the executor records (``post``, ``compute`` and ``wait`` spans, the
peers of every send and receive), so a predicted trace opens beside a
measured one with the same processes (one per algorithm), threads (a
``compute`` and a ``comm`` lane per rank) and span kinds. The simulator
knows more than the executor does: when the bytes of a step's messages were
actually on the wire. Traces add that as a ``wire`` span inside each
transfer, and the chart draws it the same way. An ``.svg`` path is drawn
here, without matplotlib, in the same layout.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from commfuse.errors import CommfuseValueError
from commfuse.sim._predict import Prediction

#: Ranks drawn or traced when not told: all of them up to this many, else the first ones.
DEFAULT_RANKS = 8


def table(predictions: Sequence[Prediction]) -> str:
    """The text table ``commfuse simulate`` prints."""
    head = ("algorithm", "predicted ms", "compute-only", "comm-only", "exposed", "hidden", "vs vanilla", "MFU")
    rows = [head]
    for p in predictions:
        speed = "" if p.speedup_vs_vanilla is None else f"{p.speedup_vs_vanilla:.3f}x"
        hidden = "-" if p.hidden_fraction is None else f"{p.hidden_fraction:.2f}"
        rows.append((p.algorithm, f"{1e3 * p.time:.3f}", f"{1e3 * p.compute_only:.3f}", f"{1e3 * p.comm_only:.3f}",
                     f"{1e3 * p.exposed:.3f}", hidden, speed, f"{100 * p.mfu:.1f}%"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = []
    for i, r in enumerate(rows):
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        lines.append("  ".join(cells))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def records(predictions: Sequence[Prediction]) -> list[dict]:
    return [p.record() for p in predictions]


def _ranks(n: int, ranks: Sequence[int] | None) -> list[int]:
    if ranks is None:
        return list(range(min(n, DEFAULT_RANKS)))
    bad = [r for r in ranks if not 0 <= r < n]
    if bad:
        raise CommfuseValueError(f"rank(s) {bad} are outside the world of {n} ranks")
    return list(ranks)


def _step_events(prediction: Prediction, rank: int) -> list[dict]:
    """Rank ``rank``'s steps as the executor's event dicts (``runtime.walks.execute(events=...)``)."""
    tl = prediction.timeline
    if tl is None or not tl.records:
        raise CommfuseValueError(f"the prediction of {prediction.algorithm} kept no timeline: predict with record=True")
    steps_of: dict[int, tuple] = {}
    out = []
    for rec in tl.records_of(rank):
        phase = tl.phases[rec.phase]
        schedule = phase.schedule
        event = {
            "label": phase.name,
            "algorithm": schedule.algorithm.value if schedule is not None else "compute",
            "step": max(rec.step, 0),
            "post": (rec.start, rec.post),
            "compute": (rec.post, rec.computed),
            "wait": (rec.computed, rec.end),
            "sends": [], "recvs": [], "collectives": [],
            "computes": rec.computed > rec.post,
            "wire": rec.comm,
        }
        if rec.step == -2:
            ring = schedule.ring
            event["label"] = f"{phase.name} fingerprint"
            event["sends"] = [(ring.next(rank), 1000), (ring.prev(rank), 1001)]
            event["recvs"] = [(ring.prev(rank), 1000), (ring.next(rank), 1001)]
        elif schedule is not None:
            if rec.phase not in steps_of:
                steps_of[rec.phase] = schedule.steps(rank)
            step = steps_of[rec.phase][rec.step]
            event["sends"] = [(t.peer, t.channel) for t in step.sends]
            event["recvs"] = [(t.peer, t.channel) for t in step.recvs]
            event["collectives"] = [f"{c.collective.value}[{c.part}]" for c in step.collectives]
        out.append(event)
    return out


def bench_run(predictions: Sequence[Prediction], ranks: Sequence[int] | None = None) -> dict:
    """The predictions in the shape of ``commfuse bench``'s rank-0 result, traces included."""
    if not predictions:
        raise CommfuseValueError("no predictions to trace")
    w = predictions[0].workload
    n = predictions[0].world_size
    chosen = _ranks(n, ranks)
    traces = {}
    for p in predictions:
        traces[p.algorithm] = [{"rank": r, "end": p.time, "events": _step_events(p, r)} for r in chosen]
    return {
        "world_size": n,
        "backend": f"simulated ({predictions[0].profile})",
        "device": predictions[0].profile,
        "results": [{"workload": w.name, "algorithms": [p.algorithm for p in predictions], "traces": traces}],
    }


def chrome_trace(predictions: Sequence[Prediction], ranks: Sequence[int] | None = None) -> dict:
    """The benchmark's Chrome/Perfetto trace of the predicted timelines, plus ``wire`` spans (bytes moving)."""
    from commfuse.bench.trace import chrome_trace as bench_trace

    run = bench_run(predictions, ranks)
    doc = bench_trace(run)
    pid = 0
    for res in run["results"]:
        for alg in res["algorithms"]:
            pid += 1
            for t in res["traces"][alg]:
                for e in t["events"]:
                    if e["wire"] is None:
                        continue
                    a, b = e["wire"]
                    doc["traceEvents"].append({
                        "name": f"{e['label']} step {e['step']} on the wire", "cat": "wire", "ph": "X",
                        "ts": round(1e6 * a, 3), "dur": round(1e6 * max(0.0, b - a), 3), "pid": pid,
                        "tid": 2 * t["rank"] + 1,
                        "args": {"workload": res["workload"], "algorithm": alg, "rank": t["rank"],
                                 "op": e["label"], "step": e["step"]},
                    })
    p0 = predictions[0]
    doc["otherData"].update(generator="commfuse simulate", profile=p0.profile, workload=p0.workload.describe(),
                            symmetric=p0.timeline.symmetric)
    return doc


def write_trace(predictions: Sequence[Prediction], path: str | Path, ranks: Sequence[int] | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(predictions, ranks)))
    return path


def write_plot(predictions: Sequence[Prediction], path: str | Path, ranks: Sequence[int] | None = None) -> Path:
    """The benchmark's Gantt chart of the predicted timelines (matplotlib); SVG without it."""
    path = Path(path)
    run = bench_run(predictions, ranks)
    if path.suffix.lower() == ".svg":  # drawn here: no matplotlib needed
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_svg(run))
        return path
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        raise CommfuseValueError(
            f"--plot {path.name} needs matplotlib (pip install matplotlib); without it, give a .svg path"
        ) from None
    from commfuse.bench import plot

    drawn = [t["rank"] for t in run["results"][0]["traces"][predictions[0].algorithm]]
    if drawn != list(range(len(drawn))):
        raise CommfuseValueError(
            f"the benchmark's chart draws ranks 0..k-1, not {drawn}: give --ranks as 0,1,...,k-1, or an .svg path "
            "(drawn here, any ranks)"
        )
    return plot.write(dict(run, world_size=len(drawn)), path)


# the benchmark's colours (commfuse.bench.plot.COLORS), and the wire
_COLOURS = {"compute": "#3b6fb6", "transfer": "#f2b66d", "wait": "#d1495b", "wire": "#7a7a7a"}


def _esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def _svg(run: dict) -> str:
    """The same chart as ``commfuse.bench.plot`` (panels per algorithm, a compute and a comm lane per rank) as SVG."""
    from commfuse.bench.trace import spans

    res = run["results"][0]
    width, left, lane_h = 1100, 130, 16
    end = max(t["end"] for alg in res["algorithms"] for t in res["traces"][alg]) or 1.0
    scale = (width - left - 20) / end
    out, y = [], 8
    for alg in res["algorithms"]:
        per_rank = res["traces"][alg]
        total = max(t["end"] for t in per_rank)
        out.append(f'<text x="8" y="{y + 12}" font-size="12" font-family="sans-serif">'
                   f'{_esc(res["workload"])}  {_esc(alg)}: {1e3 * total:.3f} ms (predicted)</text>')
        y += 18
        for t in sorted(per_rank, key=lambda t: t["rank"]):
            for lane in ("compute", "comm"):
                out.append(f'<text x="8" y="{y + lane_h - 4}" font-size="10" font-family="sans-serif">'
                           f'rank {t["rank"]} {lane}</text>')
                bars = [(s["start"], s["end"], s["kind"], s["name"]) for s in spans(t["events"]) if s["stream"] == lane]
                if lane == "comm":
                    bars += [(e["wire"][0], e["wire"][1], "wire", f"{e['label']} step {e['step']} on the wire")
                             for e in t["events"] if e["wire"] is not None]
                for s, e, kind, name in bars:
                    h = lane_h - 2 if kind in ("compute", "transfer") else (lane_h - 2) // 2
                    top = y + (lane_h - 2 - h) / 2
                    out.append(f'<rect x="{left + s * scale:.2f}" y="{top:.1f}" width="{max((e - s) * scale, 0.5):.2f}" '
                               f'height="{h}" fill="{_COLOURS[kind]}"><title>{_esc(name)} '
                               f'({1e3 * (e - s):.3f} ms)</title></rect>')
                y += lane_h
        out.append(f'<line x1="{left + total * scale:.1f}" y1="{y - lane_h * 2 * len(per_rank)}" '
                   f'x2="{left + total * scale:.1f}" y2="{y}" stroke="black" stroke-dasharray="4 3"/>')
        y += 14
    for i in range(11):
        x = left + end * i / 10 * scale
        out.append(f'<line x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + 5}" stroke="black"/>'
                   f'<text x="{x:.1f}" y="{y + 16}" font-size="9" text-anchor="middle" font-family="sans-serif">'
                   f'{1e3 * end * i / 10:.3g}</text>')
    y += 22
    legend = [("compute", "compute"), ("transfer", "transfer: posted until known done"),
              ("wait", "waiting on it: exposed"), ("wire", "bytes on the wire (simulated)")]
    x = left
    for kind, text in legend:
        out.append(f'<rect x="{x}" y="{y}" width="10" height="10" fill="{_COLOURS[kind]}"/>'
                   f'<text x="{x + 14}" y="{y + 9}" font-size="10" font-family="sans-serif">{_esc(text)}</text>')
        x += 14 + 7 * len(text) + 20
    y += 18
    out.append(f'<text x="{left}" y="{y + 4}" font-size="10" font-family="sans-serif">ms from the start</text>')
    height = y + 12
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}">\n<rect width="100%" height="100%" fill="white"/>\n'
            + "\n".join(out) + "\n</svg>\n")
