"""A Gantt chart of the traced iterations (matplotlib, Agg backend): one lane per rank per stream.

One panel per (algorithm, workload): algorithms down, workloads across, a
shared time axis per workload, so that ``sliced``'s exposed tail (a transfer
with nothing computing beside it) and its absence under ``ring`` line up.
Spans are those of :func:`commfuse.bench.trace.spans`.
"""

from __future__ import annotations

from pathlib import Path

from commfuse.bench.trace import spans
from commfuse.errors import CommfuseError

COLORS = {"compute": "#3b6fb6", "transfer": "#f2b66d", "wait": "#d1495b"}


class PlotError(CommfuseError, RuntimeError):
    """The plot cannot be drawn here (matplotlib missing)."""


def _name_ops(ax, events: list[dict]) -> None:
    """Where an iteration runs several fused ops (a layer's forward and backward), name each above the lanes
    at its first step (the lowest rank's), without the layer's prefix: ``moe.dispatch.backward`` is written
    ``dispatch.backward``. A count exchange (``*.sizes``) is left unnamed."""
    starts: dict[str, float] = {}
    for e in events:
        label = e.get("label", "")
        if label and not label.endswith(".sizes"):
            starts[label] = min(starts.get(label, e["post"][0]), e["post"][0])
    if len(starts) < 2:
        return
    for i, (label, start) in enumerate(sorted(starts.items(), key=lambda kv: kv[1])):
        short = label.split(".", 1)[1] if "." in label else label
        # two rows, alternating, so that the names of ops that start close together do not overlap
        ax.text(1e3 * start, -0.78 if i % 2 else -0.5, short, fontsize=5.5, va="center", ha="left",
                color="#444444")


def write(run: dict, path: str | Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as e:  # the commands check before any work (commfuse.cli.require_extra); a caller may not
        from commfuse.cli import missing_extra

        raise PlotError(missing_extra("bench", "--plot") or f"--plot: matplotlib does not import ({e})") from None
    results = [r for r in run["results"] if r["traces"]]
    if not results:
        raise PlotError("nothing was traced: --plot needs the traced iteration of at least one workload")
    n = run["world_size"]
    algs = list(dict.fromkeys(a for r in results for a in r["algorithms"]))
    cols = len(results)
    fig_h = max(2.5, len(algs) * (0.5 + 0.32 * 2 * n))
    fig, axes = plt.subplots(len(algs), cols, figsize=(7.5 * cols, fig_h), squeeze=False, sharex="col")
    for c, res in enumerate(results):
        for row, alg in enumerate(algs):
            ax = axes[row][c]
            per_rank = res["traces"].get(alg)
            if not per_rank:
                ax.set_axis_off()
                ax.set_title(f"{res['workload']} {alg}: not applicable", fontsize=9)
                continue
            end = max(t["end"] for t in per_rank)
            _name_ops(ax, min(per_rank, key=lambda t: t["rank"])["events"])
            labels = []
            for t in sorted(per_rank, key=lambda t: t["rank"]):
                r = t["rank"]
                lane = {"compute": 2 * r, "comm": 2 * r + 1}
                for s in spans(t["events"]):
                    y = lane[s["stream"]]
                    height = 0.8 if s["kind"] != "wait" else 0.45
                    ax.broken_barh([(1e3 * s["start"], 1e3 * (s["end"] - s["start"]))], (y - height / 2, height),
                                   facecolors=COLORS[s["kind"]], edgecolor="black" if s["kind"] == "compute" else None,
                                   linewidth=0.3)
                labels += [f"rank {r} compute", f"rank {r} comm"]
            ax.axvline(1e3 * end, color="black", linewidth=0.8, linestyle="--")
            ax.set_yticks(range(2 * n))
            ax.set_yticklabels(labels, fontsize=7)
            ax.set_ylim(2 * n - 0.5, -1.0)
            ax.set_title(f"{res['workload']}  {alg}: {1e3 * end:.1f} ms", fontsize=9, loc="left")
            ax.tick_params(axis="x", labelsize=7)
            ax.grid(axis="x", linewidth=0.3, alpha=0.5)
        axes[-1][c].set_xlabel("ms from the barrier that starts the iteration", fontsize=8)
    fig.legend(
        handles=[Patch(color=COLORS["compute"], label="compute (one shard or chunk)"),
                 Patch(color=COLORS["transfer"], label="transfer: posted until known done (upper bound)"),
                 Patch(color=COLORS["wait"], label="host waits on it: exposed communication")],
        loc="lower center", ncol=3 if cols > 1 else 2, fontsize=8, frameon=False,
    )
    legend_rows = 1 if cols > 1 else 2
    fig.tight_layout(rect=(0, (0.12 + 0.2 * legend_rows) / fig_h, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
