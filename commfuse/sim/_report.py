"""Presenting predictions: the table, JSON records, Chrome traces and a Gantt chart.

The trace is the Chrome trace-event format (``{"traceEvents": [...]}``, what
``chrome://tracing`` and Perfetto open): one ``pid`` per rank, named
``rank r``, with two threads, ``tid`` ``"compute"`` and ``"comm"``; every bar
is a complete event (``"ph": "X"``) with microsecond ``ts`` and ``dur``.
The Gantt chart draws the same bars, one row per rank and lane, one panel
per algorithm: with matplotlib (Agg backend, any format it writes) when it
is installed, else as a plain SVG file written here.
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
    head = ("algorithm", "time ms", "compute-only", "comm-only", "exposed", "hidden", "vs vanilla", "MFU")
    rows = [head]
    for p in predictions:
        speed = "" if p.speedup_vs_vanilla is None else f"{p.speedup_vs_vanilla:.3f}x"
        rows.append((p.algorithm, f"{1e3 * p.time:.3f}", f"{1e3 * p.compute_only:.3f}", f"{1e3 * p.comm_only:.3f}",
                     f"{1e3 * p.exposed:.3f}", f"{p.hidden_fraction:.2f}", speed, f"{100 * p.mfu:.1f}%"))
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


def _ranks(prediction: Prediction, ranks: Sequence[int] | None) -> list[int]:
    n = prediction.world_size
    if ranks is None:
        return list(range(min(n, DEFAULT_RANKS)))
    bad = [r for r in ranks if not 0 <= r < n]
    if bad:
        raise CommfuseValueError(f"rank(s) {bad} outside the world of {n} ranks")
    return list(ranks)


def _timeline(prediction: Prediction):
    if prediction.timeline is None or not prediction.timeline.events:
        raise CommfuseValueError(f"the prediction of {prediction.algorithm} kept no timeline: predict with record=True")
    return prediction.timeline


def chrome_trace(prediction: Prediction, ranks: Sequence[int] | None = None) -> dict:
    """The Chrome trace of one prediction's timeline (``ranks``: which to include; default the first 8)."""
    tl = _timeline(prediction)
    events = []
    for r in _ranks(prediction, ranks):
        events.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
        for lane in ("compute", "comm"):
            events.append({"name": "thread_name", "ph": "M", "pid": r, "tid": lane, "args": {"name": lane}})
        for e in tl.events_of(r):
            events.append({
                "name": e.name, "ph": "X", "pid": r, "tid": e.lane, "ts": round(1e6 * e.start, 3),
                "dur": round(1e6 * (e.end - e.start), 3),
                "args": {"phase": e.phase, "step": e.step, "algorithm": prediction.algorithm},
            })
    meta = prediction.record()
    meta["symmetric"] = tl.symmetric
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta}


def trace_paths(path: str | Path, algorithms: Sequence[str]) -> dict[str, Path]:
    """One file per algorithm: ``{algorithm}`` in ``path`` is replaced, else the name goes before the suffix."""
    path = str(path)
    out = {}
    for a in algorithms:
        safe = a.replace(":", "-")
        if "{algorithm}" in path:
            out[a] = Path(path.replace("{algorithm}", safe))
        elif len(algorithms) == 1:
            out[a] = Path(path)
        else:
            p = Path(path)
            out[a] = p.with_name(f"{p.stem}.{safe}{p.suffix or '.json'}")
    return out


def write_traces(predictions: Sequence[Prediction], path: str | Path, ranks: Sequence[int] | None = None) -> list[Path]:
    written = []
    paths = trace_paths(path, [p.algorithm for p in predictions])
    for p in predictions:
        target = paths[p.algorithm]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(chrome_trace(p, ranks)))
        written.append(target)
    return written


_COLOURS = {"compute": "#4c72b0", "comm": "#dd8452"}


def _bars(predictions: Sequence[Prediction], ranks):
    panels = []
    for p in predictions:
        tl = _timeline(p)
        rows = []
        for r in _ranks(p, ranks):
            for lane in ("compute", "comm"):
                rows.append((f"rank {r} {lane}", lane, [(e.start, e.end, e.name) for e in tl.events_of(r)
                                                        if e.lane == lane]))
        panels.append((p, rows))
    return panels


def plot(predictions: Sequence[Prediction], path: str | Path, ranks: Sequence[int] | None = None,
         title: str = "") -> Path:
    """Write a Gantt chart of the predictions' timelines to ``path`` (.svg without matplotlib; any format with it)."""
    path = Path(path)
    panels = _bars(predictions, ranks)
    try:
        import matplotlib
    except ModuleNotFoundError:
        if path.suffix.lower() != ".svg":
            raise CommfuseValueError(
                f"writing {path.name} needs matplotlib (pip install matplotlib); without it, ask for an .svg file"
            ) from None
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_svg(panels, title))
        return path
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = max(p.time for p, _ in panels) * 1e3 or 1.0
    heights = [len(rows) for _, rows in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 0.9 + 0.32 * sum(heights) + 0.5 * len(panels)),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, (p, rows) in zip(axes[:, 0], panels):
        for i, (label, lane, bars) in enumerate(rows):
            ax.broken_barh([(1e3 * s, 1e3 * (e - s)) for s, e, _ in bars], (i - 0.4, 0.8),
                           facecolors=_COLOURS[lane], edgecolor="white", linewidth=0.3)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([label for label, _, _ in rows], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, end * 1.02)
        ax.set_title(f"{p.algorithm}: {1e3 * p.time:.3f} ms", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("ms")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def _svg(panels, title: str) -> str:
    width, left, row_h, gap = 1100, 150, 14, 28
    end = max(p.time for p, _ in panels) or 1.0
    scale = (width - left - 20) / end
    y = 30 if title else 10
    out = []
    if title:
        out.append(f'<text x="10" y="20" font-size="13" font-family="sans-serif">{_esc(title)}</text>')
    for p, rows in panels:
        out.append(f'<text x="10" y="{y + 12}" font-size="12" font-family="sans-serif">'
                   f'{_esc(p.algorithm)}: {1e3 * p.time:.3f} ms</text>')
        y += 18
        for label, lane, bars in rows:
            out.append(f'<text x="10" y="{y + row_h - 3}" font-size="10" font-family="sans-serif">{_esc(label)}</text>')
            for s, e, name in bars:
                x, w = left + s * scale, max((e - s) * scale, 0.5)
                out.append(f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{row_h - 2}" '
                           f'fill="{_COLOURS[lane]}"><title>{_esc(name)} ({1e3 * (e - s):.3f} ms)</title></rect>')
            y += row_h
        y += gap
    ticks = []
    for i in range(11):
        t = end * i / 10
        x = left + t * scale
        ticks.append(f'<line x1="{x:.1f}" y1="{y - gap + 4}" x2="{x:.1f}" y2="{y - gap + 9}" stroke="black"/>'
                     f'<text x="{x:.1f}" y="{y - gap + 20}" font-size="9" text-anchor="middle" '
                     f'font-family="sans-serif">{1e3 * t:.3g}</text>')
    out += ticks
    height = y + 10
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}">\n<rect width="100%" height="100%" fill="white"/>\n'
            + "\n".join(out) + "\n</svg>\n")
