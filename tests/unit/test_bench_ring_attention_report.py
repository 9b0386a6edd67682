"""Tier (a), no processes: `commfuse bench -w ring_attention`'s records, table and targets from a made-up run: each
column is the figure it names (exposed = median - compute-only as a share of comm-only less outside-only, the
slowest rank's times, the ranks' compute balance, the speed-up over the faster torch row), a wrong row is printed
WRONG and fails the run, a row that did not run says why, and the targets are judged only at their regime."""

from __future__ import annotations

import argparse

import pytest

from commfuse.bench import command, report
from commfuse.bench.config import RING_ATTENTION_ROWS, BenchConfig, Shape
from commfuse.errors import CommfuseValueError

MODES = ("compute_only", "comm_only", "outside_only")
SHAPE = Shape(batch=1, seq=4096, hidden=512, ffn=2048, heads=8, kv_heads=2)


def run_of(per_rank: dict, *, correct: dict | None = None, missing: dict | None = None, repeats: int = 3) -> dict:
    """A rank-0 result as ``commfuse.bench.ring_attention`` gives it: ``per_rank[row][mode]`` is each rank's ms."""
    missing = missing or {}
    rows = [r for r in RING_ATTENTION_ROWS if r not in missing]
    items = [(row, None) for row in rows] + [(row, mode) for row in rows if RING_ATTENTION_ROWS[row][0] != "torch"
                                             for mode in MODES]
    walls = [[[per_rank[row][mode or "normal"][rank] / 1e3 for row, mode in items] for _ in range(repeats)]
             for rank in range(2)]
    res = {"kind": "ring_attention", "workload": "ring_attention", "rows": list(RING_ATTENTION_ROWS),
           "missing": missing, "stock_context_parallel": "NotImplementedError: no sharding strategy",
           "algorithms": [], "traces": {}, "items": [list(i) for i in items], "wall_s": walls,
           "correct": {row: (correct or {}).get(row, True) for row in rows},
           "max_rel_error": {row: 0.5 if not (correct or {}).get(row, True) else 1e-6 for row in rows},
           "peak_bytes": {row: 64 * 2 ** 20 for row in rows}, "peak_how": "VmHWM", "unmeasured": {}}
    return {"world_size": 2, "backend": "gloo", "device": "cpu", "load": [1.0, 1.2], "cpus": 2, "results": [res]}


def times(ring_normal: float = 1050.0, comm_only: float = 1020.0) -> dict:
    """Each row's per-rank ms in each mode: ring (zigzag) balanced with transfers of comm_only - 20 ms, the
    contiguous ring's rank 1 computing 1.5x rank 0's, torch's rows slower than the ring."""
    commfuse = {"normal": [ring_normal - 10, ring_normal], "compute_only": [990.0, 1000.0],
                "comm_only": [comm_only - 5, comm_only], "outside_only": [20.0, 20.0]}
    out = {row: dict(commfuse) for row, (who, _, _) in RING_ATTENTION_ROWS.items() if who != "torch"}
    out["ring contiguous"] = {**commfuse, "compute_only": [800.0, 1200.0]}
    out["torch cp allgather"] = {"normal": [1400.0, 1500.0]}
    out["torch cp alltoall"] = {"normal": [1300.0, 1350.0]}
    return out


def config(preset: str = "small") -> BenchConfig:
    return BenchConfig(workloads=("ring_attention",), shape=SHAPE, repeats=3, preset=preset, link_rate="100mbit")


def test_records_compute_each_column_from_the_slowest_rank():
    recs = report.ring_attention_records(run_of(times()), config())
    assert [r["row"] for r in recs] == list(RING_ATTENTION_ROWS)
    ring = next(r for r in recs if r["row"] == "ring")
    assert ring["median_ms"] == 1050.0 and ring["compute_only_ms"] == 1000.0  # the slower rank's
    assert ring["comm_ms"] == 1000.0 and ring["comm_vs_compute"] == 1.0  # comm-only 1020 less outside-only 20
    assert ring["exposed_ms"] == 50.0 and ring["exposed_fraction"] == 0.05
    assert ring["rank_compute_only_ms"] == [990.0, 1000.0] and ring["compute_balance"] == pytest.approx(1000 / 990, 1e-3)
    assert ring["speedup_vs_torch"] == pytest.approx(1350 / 1050, 1e-3)  # the faster torch row (alltoall)
    assert ring["peak_mib"] == 64.0 and ring["correct"] and ring["not_run"] is None
    contiguous = next(r for r in recs if r["row"] == "ring contiguous")
    assert contiguous["compute_balance"] == 1.5 and contiguous["layout"] == "contiguous"
    for row in ("torch cp allgather", "torch cp alltoall"):  # their collectives: no measure modes
        r = next(r for r in recs if r["row"] == row)
        assert r["compute_only_ms"] is None and r["exposed_ms"] is None and r["compute_balance"] is None
    assert next(r for r in recs if r["row"] == "torch cp alltoall")["speedup_vs_torch"] == 1.0


def test_table_prints_every_row_and_the_targets_are_judged_at_their_regime():
    cfg = config()
    recs = report.ring_attention_records(run_of(times()), cfg)
    text = report.ring_attention_table(recs, cfg)
    for row in RING_ATTENTION_ROWS:
        assert f"\n  {row} " in text, row
    for column in ("median ms (p25-p75)", "compute-only", "comm", "exposed (of comm)", "vs torch cp",
                   "rank compute max/min", "peak memory", "result"):
        assert column in text
    assert "50.00 (5%)" in text and "WRONG" not in text
    assert "regime: ring's transfers 1000.00 ms" in text and "does not run here: NotImplementedError" in text
    lines = report.ring_attention_targets(recs, cfg)
    assert lines[1].endswith(": met") and "5.0%" in lines[1]
    sliced = [line for line in lines if line.startswith("    ring:")]  # ring:m beside ring, at its own regime
    assert [line.split(":")[1] for line in sliced] == ["2", "4"], lines
    assert all("5.0% of its communication exposed" in line and "compute-only 1.00" in line for line in sliced)
    torch_line = next(line for line in lines if "context_parallel" in line)
    balance = next(line for line in lines if line.startswith("  zigzag"))
    assert "1.29x" in torch_line and torch_line.endswith(": met")
    assert "1.01x" in balance and "contiguous: 1.50x" in balance and balance.endswith(": met")
    # slower link: transfers 2x compute, outside the regime: exposure and speed-up not judged; balance still is
    lines = report.ring_attention_targets(report.ring_attention_records(run_of(times(3050.0, 2020.0)), cfg), cfg)
    torch_line = next(line for line in lines if "context_parallel" in line)
    assert "not judged" in lines[1] and "set --link-rate" in lines[1] and "not judged" in torch_line
    assert lines[-1].endswith(": met")
    # exposing too much at the regime: MISSED
    lines = report.ring_attention_targets(report.ring_attention_records(run_of(times(1300.0)), cfg), cfg)
    assert lines[1].endswith(": MISSED")


def test_a_wrong_row_is_printed_wrong_and_fails_the_run(capsys):
    cfg = config()
    result = run_of(times(), correct={"bidirectional": False})
    recs = report.ring_attention_records(result, cfg)
    assert "WRONG (0.5)" in report.ring_attention_table(recs, cfg)
    args = argparse.Namespace(json=None, trace=None, plot=None)
    assert command.emit(result, cfg, args) == 1
    assert "ring_attention bidirectional" in capsys.readouterr().err


def test_a_row_that_cannot_run_says_why_and_nothing_is_judged_without_ring():
    cfg = config()
    why = "commfuse.ring_attention is not in this installation"
    missing = {row: why for row, (who, _, _) in RING_ATTENTION_ROWS.items() if who == "commfuse"}
    recs = report.ring_attention_records(run_of(times(), missing=missing), cfg)
    assert {r["row"] for r in recs if r["not_run"] == why} == set(missing) and all(r["correct"] for r in recs)
    assert f"  ring: not run: {why}" in report.ring_attention_table(recs, cfg)
    assert "ring did not run" in report.ring_attention_targets(recs, cfg)[1]


def test_the_workload_takes_its_sizes_and_refuses_what_it_cannot_shard():
    from commfuse.cli import parser

    args = parser().parse_args(["bench", "-w", "ring_attention", "-b", "1", "-s", "64", "--hidden", "64",
                                "--heads", "8", "--kv-heads", "2"])
    cfg = command.config_from_args(args)
    assert cfg.workloads == ("ring_attention",) and cfg.shape.kv_heads == 2
    cfg.check_world(2)
    with pytest.raises(CommfuseValueError, match="seq = 64 does not divide into 2 x world size = 6 chunks"):
        cfg.check_world(3)
    with pytest.raises(CommfuseValueError, match="heads 8 is not a multiple of kv_heads 3"):
        BenchConfig(workloads=("ring_attention",), shape=Shape(1, 64, 64, 64, 8, 3)).check_world(2)
    with pytest.raises(CommfuseValueError, match="ring_attention times forward \\+ backward"):
        command.config_from_args(parser().parse_args(["bench", "-w", "ring_attention", "--forward-only"]))
    assert "ring_attention" not in command.config_from_args(parser().parse_args(["bench", "-w", "all"])).workloads
