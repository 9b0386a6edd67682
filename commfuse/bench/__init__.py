"""``commfuse bench``: every algorithm of a workload side by side, measured on real ranks.

The benchmark answers "how much does the overlap buy me here?". For each
workload it runs ``vanilla``, ``sliced:2``, ``sliced:4``, ``serial``, ``ring``,
``bidirectional`` and ``auto`` interleaved repeat by repeat, three ways each:
normally, with the transfers removed (``compute_only``) and with the compute
removed (``comm_only``, see :func:`commfuse.runtime.measure`). From those it
derives the exposed communication and the fraction of it that was hidden,
checks every algorithm's result against ``vanilla``, takes ring's speed-up
over vanilla apart with ``serial`` (the ring's hops with no overlap: vanilla /
serial is what the collective changes, serial / ring what the overlap buys),
and can write a Chrome/Perfetto trace and a Gantt chart of one iteration per
algorithm from the executor's own events. ``--fake-pg N`` instead times each
op in one process on torch's fake process group (no transfers) against the
unsliced GEMM: what slicing and commfuse's own overhead cost on a device
(and, on CUDA, the same calls captured in a CUDA graph and replayed).
``--compile [BACKEND]`` times the layers (and bare ops) eager against
``torch.compile(..., fullgraph=True)`` side by side instead.

Modules: ``command`` (the CLI; imports no torch), ``config`` (sizes, presets,
the run's settings; no torch), ``workloads`` and ``runner`` (what every rank
runs), ``report`` (records, table, targets; no torch), ``trace`` (Chrome
trace), ``plot`` (Gantt chart, matplotlib), ``netns`` (``--link-rate``),
``progress`` (the progress bar), ``fakepg`` (``--fake-pg``), ``compiled`` (``--compile``).
"""

from __future__ import annotations

from commfuse.bench.config import ALGORITHMS, PRESETS, WORKLOADS, BenchConfig, Shape

__all__ = ["ALGORITHMS", "PRESETS", "WORKLOADS", "BenchConfig", "Shape", "run"]


def run(config: BenchConfig, *, progress: bool = False) -> dict:
    """Run the benchmark described by ``config`` on its own ranks; return ``{"records", "traces", ...}``."""
    from commfuse.bench.command import execute_config

    return execute_config(config, progress=progress)
