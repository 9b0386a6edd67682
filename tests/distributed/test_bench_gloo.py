"""Tier (b), real gloo ranks: `commfuse bench` runs end to end and writes valid records, traces and Gantt charts.

The runs: ranks it launches itself, ranks under torchrun, ranks behind a shaped loopback.

Sizes are tiny and repeats few: these tests check what the benchmark writes,
never how fast anything was.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from commfuse.bench.report import SCHEMA_KEYS
from commfuse.cli import main

TINY = ["--preset", "tiny", "--repeats", "2", "--warmup", "0", "--no-progress"]
REQUIRED = {"workload", "algorithm", "world_size", "median_ms", "compute_only_ms", "comm_only_ms", "exposed_ms",
            "speedup_vs_vanilla", "hidden_fraction", "correct"}


def _check_records(recs: list[dict], workloads: list[str], algorithms: list[str], world_size: int) -> None:
    assert isinstance(recs, list)
    assert {(r["workload"], r["algorithm"]) for r in recs} == {(w, a) for w in workloads for a in algorithms}
    for r in recs:
        assert REQUIRED <= set(r) and set(r) == set(SCHEMA_KEYS)
        assert r["world_size"] == world_size and r["correct"] is True, r
        assert r["median_ms"] > 0 and r["compute_only_ms"] > 0
        assert r["exposed_ms"] == pytest.approx(r["median_ms"] - r["compute_only_ms"], abs=2e-3)
        assert r["hidden_fraction"] is None or 0.0 <= r["hidden_fraction"] <= 1.0
        if r["algorithm"] == "vanilla":
            assert r["speedup_vs_vanilla"] == 1.0


def _check_trace(path: Path, workloads: list[str], algorithms: list[str], world_size: int) -> None:
    doc = json.loads(path.read_text())
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    for w in workloads:
        for alg in algorithms:
            for rank in range(world_size):
                mine = [e for e in spans if e["args"]["workload"] == w and e["args"]["algorithm"] == alg
                        and e["args"]["rank"] == rank]
                cats = {e["cat"] for e in mine}
                assert {"compute", "transfer"} <= cats, (w, alg, rank, cats)
                assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in mine)
                # the executor's own step events: compute on one lane, transfers on the other
                assert {e["tid"] for e in mine if e["cat"] == "compute"} == {2 * rank}
                assert {e["tid"] for e in mine if e["cat"] == "transfer"} == {2 * rank + 1}


def _run(cmd: list[str], timeout: float, env=None) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own session; on timeout kill the whole session (torchrun's ranks included)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout} s:\n{out}\n{err}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def test_bench_end_to_end_json_trace_plot(tmp_path, capsys):
    out, tr, png = tmp_path / "records.json", tmp_path / "trace.json", tmp_path / "gantt.png"
    algs = ["vanilla", "sliced:2", "serial", "ring", "bidirectional", "auto"]
    rc = main(["bench", *TINY, "-w", "ag_matmul", "matmul_rs", "-a", *algs, "--json", str(out), "--trace", str(tr),
               "--plot", str(png)])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    assert "ag_matmul:" in printed.out and "targets (printed, never asserted)" in printed.out
    recs = json.loads(out.read_text())
    _check_records(recs, ["ag_matmul", "matmul_rs"], algs, 2)
    for w in ("ag_matmul", "matmul_rs"):
        by = {r["algorithm"]: r for r in recs if r["workload"] == w}
        serial, ring = by["serial"], by["ring"]
        # serial is measured like the others: its compute and its transfers apart too
        assert serial["comm_only_ms"] > 0 and serial["compute_only_ms"] > 0 and serial["taken"] == "serial"
        # ring's speed-up over vanilla = collective (vanilla / serial) x overlap (serial / ring), on every record
        assert {(r["collective_effect"], r["overlap_effect"]) for r in by.values()} == {
            (ring["collective_effect"], ring["overlap_effect"])}
        assert ring["collective_effect"] * ring["overlap_effect"] == pytest.approx(
            ring["speedup_vs_vanilla"], rel=1e-3)
    assert printed.out.count("= collective") == 2 and printed.out.count("of which collective") == 2
    _check_trace(tr, ["ag_matmul", "matmul_rs"], algs, 2)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_layer_workloads_three_ranks(tmp_path, capsys):
    out, tr = tmp_path / "records.json", tmp_path / "trace.json"
    workloads = ["mlp", "attention", "ulysses", "fsdp_linear"]
    rc = main(["bench", *TINY, "--repeats", "1", "-n", "3", "--seq", "48", "--heads", "6", "--hidden", "48",
               "--ffn", "96", "-w", *workloads, "-a", "vanilla", "ring", "--json", str(out), "--trace", str(tr)])
    assert rc == 0, capsys.readouterr().err
    recs = json.loads(out.read_text())
    _check_records(recs, workloads, ["vanilla", "ring"], 3)
    _check_trace(tr, workloads, ["vanilla", "ring"], 3)
    # every layer runs with its compute removed too (Ulysses and ShardedLinear through their consumers' stand-ins)
    for r in recs:
        assert r["comm_only_ms"] is not None and r["comm_only_ms"] > 0 and not r["unmeasured"], r


def test_llama_block_workload_times_both_plans(tmp_path, capsys):
    """The Llama block under torch's styles (vanilla) and commfuse's (ring), forward + backward, checked against
    each other; torch's plan is timed in the normal mode only (DTensor's collectives cannot be removed), the
    styles' in all three, which gives ring's comm-only / compute-only."""
    out = tmp_path / "records.json"
    rc = main(["bench", *TINY, "--repeats", "1", "-n", "2", "--seq", "16", "--heads", "4", "--hidden", "32",
               "--ffn", "64", "-w", "llama_block", "-a", "vanilla", "ring", "--json", str(out)])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    recs = {r["algorithm"]: r for r in json.loads(out.read_text())}
    assert set(recs) == {"vanilla", "ring"} and all(r["correct"] for r in recs.values()), recs
    assert all(r["median_ms"] > 0 for r in recs.values())
    assert recs["ring"]["taken"] == "ring", recs["ring"]
    assert recs["vanilla"]["comm_only_ms"] is None and recs["vanilla"]["compute_only_ms"] is None, recs
    assert recs["ring"]["comm_only_ms"] > 0 and recs["ring"]["compute_only_ms"] > 0, recs["ring"]
    assert "commfuse's modules against torch's styles (vanilla)" in printed.out + printed.err
    assert "ring's comm-only / compute-only" in printed.out + printed.err


def test_moe_workload_every_algorithm_against_the_reference(tmp_path, capsys):
    """`-w moe`: the mixture-of-experts layer forward + backward under every algorithm that applies to its
    all-to-alls, each checked against the one-process moe_reference (vanilla too), measured in all three modes,
    traced; the routing is reported per source rank."""
    out, tr = tmp_path / "records.json", tmp_path / "trace.json"
    algs = ["vanilla", "sliced:2", "serial", "ring", "auto"]
    rc = main(["bench", *TINY, "--repeats", "1", "--seq", "32", "--hidden", "16", "--ffn", "32", "--experts", "4",
               "--topk", "2", "-w", "moe", "-a", *algs, "bidirectional", "--json", str(out), "--trace", str(tr)])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    recs = json.loads(out.read_text())
    _check_records(recs, ["moe"], algs, 2)  # bidirectional does not apply to an all-to-all: left out
    _check_trace(tr, ["moe"], algs, 2)
    by = {r["algorithm"]: r for r in recs}
    for r in recs:
        assert r["comm_only_ms"] > 0 and not r["unmeasured"], r
        assert r["shape"]["experts"] == 4 and r["shape"]["topk"] == 2
        # top-2 of 16 tokens per rank: 32 rows from each rank, split over the two ranks' experts
        assert [sum(row) for row in r["routing"]] == [32, 32], r["routing"]
    assert by["ring"]["taken"] == "ring" and by["serial"]["taken"] == "serial" and by["vanilla"]["taken"] == "vanilla"
    assert "checked against moe_reference" in printed.out and "experts=4 top-2" in printed.out


def test_json_to_stdout_is_only_json(capsys):
    rc = main(["bench", *TINY, "-w", "ag_matmul", "-a", "vanilla", "ring", "--json"])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    _check_records(json.loads(printed.out), ["ag_matmul"], ["vanilla", "ring"], 2)
    assert "ag_matmul:" in printed.err  # the table went to stderr


def test_under_torchrun(tmp_path):
    """Each torchrun process is one rank joining the env:// rendezvous; rank 0 writes the records."""
    out = tmp_path / "records.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "commfuse.bench", *TINY, "-w", "ag_matmul", "-a", "vanilla", "ring", "--json", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = _run(cmd, 180, env)
    assert done.returncode == 0, done.stdout + done.stderr
    _check_records(json.loads(out.read_text()), ["ag_matmul"], ["vanilla", "ring"], 2)


@pytest.mark.skipif(os.geteuid() != 0 or not all(shutil.which(t) for t in ("unshare", "ip", "tc")),
                    reason="--link-rate needs root, unshare, ip and tc")
def test_link_rate_runs_in_a_shaped_namespace(tmp_path):
    out = tmp_path / "records.json"
    cmd = [sys.executable, "-m", "commfuse.bench", *TINY, "--link-rate", "1gbit", "-w", "ag_matmul", "-a", "vanilla",
           "ring", "--json", str(out)]
    done = _run(cmd, 180)
    assert done.returncode == 0, done.stdout + done.stderr
    recs = json.loads(out.read_text())
    _check_records(recs, ["ag_matmul"], ["vanilla", "ring"], 2)
    assert {r["link_rate"] for r in recs} == {"1gbit"}
    assert "loopback shaped to 1gbit" in done.stdout


def _check_compile_records(recs: list[dict], workloads: list[str], algorithms: list[str], backend: str) -> None:
    assert {(r["workload"], r["algorithm"]) for r in recs} == {(w, a) for w in workloads for a in algorithms}
    for r in recs:
        assert r["mode"] == "compile" and r["compile_backend"] == backend and r["world_size"] == 2, r
        assert r["compile_error"] is None and r["correct"] is True, r
        # both columns measured, positive (no timing target: these are tiny sizes on a shared CPU)
        assert r["eager_ms"] > 0 and r["compiled_ms"] > 0 and r["first_compiled_step_s"] > 0, r
        assert r["eager_p25_ms"] <= r["eager_ms"] <= r["eager_p75_ms"]
        assert r["compiled_vs_eager"] == pytest.approx(r["compiled_ms"] / r["eager_ms"], rel=1e-2)
        assert r["speedup"] == pytest.approx(r["eager_ms"] / r["compiled_ms"], rel=1e-2)


def test_compile_layers_eager_against_inductor(tmp_path, capsys):
    """`commfuse bench --compile`: the three layers forward + backward, eager and torch.compile(fullgraph=True) with
    inductor side by side on 2 gloo ranks, the compiled results checked against eager's. One algorithm (each is a
    compile of its own, 1-20 s on a CPU); the ring's compiled runs are the aot_eager test's."""
    out = tmp_path / "records.json"
    workloads = ["mlp", "attention", "fsdp_linear"]
    rc = main(["bench", *TINY, "--compile", "-w", *workloads, "-a", "vanilla", "--json", str(out)])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    recs = json.loads(out.read_text())
    _check_compile_records(recs, workloads, ["vanilla"], "inductor")
    assert all(r["backward"] for r in recs)
    for w, layer in (("mlp", "ParallelMLP"), ("attention", "ParallelAttention"), ("fsdp_linear", "ShardedLinear")):
        assert f"{w} ({layer}, forward + backward)" in printed.out
    for column in ("eager ms (p25-p75)", "compiled ms (p25-p75)", "compiled / eager", "speed-up",
                   "first compiled step s", "backend='inductor'"):
        assert column in printed.out, column


def test_compile_every_workload_aot_eager_json_to_stdout(capsys):
    """`--compile aot_eager -w all`: the layers and the bare ops, vanilla and ring (the ring's hops inside the
    compiled graph's custom ops), the JSON alone on stdout."""
    rc = main(["bench", *TINY, "--compile", "aot_eager", "-w", "all", "-a", "ring", "--json"])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    recs = json.loads(printed.out)
    workloads = ["mlp", "attention", "fsdp_linear", "ag_matmul", "matmul_rs"]
    _check_compile_records(recs, workloads, ["vanilla", "ring"], "aot_eager")
    assert {r["workload"] for r in recs if r["backward"]} == {"mlp", "attention", "fsdp_linear"}
    assert "ag_matmul (all_gather_matmul in a compiled function, forward)" in printed.err
    assert "compiled / eager" in printed.err


def test_strands_workload_times_its_rows_checked_against_ring(tmp_path, capsys):
    """`-w strands`: two micro-batches of the Llama block at TP 2 (and the MoE block at EP 2 where it is installed)
    as vanilla, ring, strands naive and strands searched, each checked against ring, with the simulator's
    prediction, the regime, the limit and the peak memory beside; the stage without transfers profiled as such."""
    from commfuse.bench.config import STRAND_ROWS

    out = tmp_path / "records.json"
    rc = main(["bench", *TINY, "--repeats", "1", "-w", "strands", "--json", str(out)])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    for row in STRAND_ROWS:
        assert f"\n  {row} " in printed.out, row
    assert "ok (ref)" in printed.out and "WRONG" not in printed.out
    assert "ring's transfers / compute-only" in printed.out and "the strands targets" in printed.out
    recs = [r for r in json.loads(out.read_text()) if r["row"] is not None]
    assert {r["block"] for r in recs} >= {"llama block, TP 2"}
    for block in {r["block"] for r in recs}:
        assert [r["row"] for r in recs if r["block"] == block] == list(STRAND_ROWS)
    for r in recs:
        assert r["mode"] == "strands" and r["correct"] is True and r["world_size"] == 2, r
        assert r["median_ms"] > 0 and r["predicted_ms"] > 0 and r["limit_ms"] > 0, r
        assert r["peak_mib"] is None or r["peak_mib"] >= 0
    llama = next(r for r in recs if r["block"] == "llama block, TP 2")
    figures = llama["figures_ms"]
    assert figures["attention core"][1] == 0 and all(m >= 0 for name, (_, m) in figures.items()
                                                     if name != "attention core"), figures
    # the regime's comm is the transfers alone: comm-only less the code around the ops (the attention core's
    # forward and backward run in outside-only, so it takes time)
    assert llama["ring_outside_only_ms"] > 0 and llama["ring_comm_ms"] <= llama["ring_comm_only_ms"], llama
    assert llama["limit_ms"] == max(llama["ring_compute_only_ms"], llama["ring_comm_ms"]), llama
    assert llama["searched_order"][0] == "F0.0" and len(llama["searched_order"]) == 4 * len(figures)


def test_ring_attention_workload_times_its_rows_checked_against_the_unsharded_attention(tmp_path, capsys):
    """`-w ring_attention`: causal grouped-query attention forward + backward on 2 ranks, every row (commfuse's ring,
    bidirectional and vanilla on zigzag shards, its ring on contiguous shards, torch's context-parallel ring with
    both rotate methods, Ulysses) run, checked against the unsharded attention of the whole sequence, with its
    columns (exposed communication on the rows whose collectives are commfuse's, the ranks' compute balance, the
    speed-up over torch, peak memory) and the targets printed."""
    from commfuse.bench.config import RING_ATTENTION_ROWS

    out = tmp_path / "records.json"
    rc = main(["bench", *TINY, "--repeats", "1", "--kv-heads", "2", "-w", "ring_attention", "--json", str(out)])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    for row in RING_ATTENTION_ROWS:
        assert f"\n  {row} " in printed.out, row
    assert "WRONG" not in printed.out and "the ring attention targets" in printed.out
    recs = json.loads(out.read_text())
    assert [r["row"] for r in recs] == list(RING_ATTENTION_ROWS)
    for r in recs:
        assert r["mode"] == "ring_attention" and r["world_size"] == 2 and r["not_run"] is None, r
        assert r["correct"] is True and r["max_rel_error"] <= 1e-4, r  # against the unsharded attention
        assert r["median_ms"] > 0 and r["speedup_vs_torch"] > 0 and (r["peak_mib"] is None or r["peak_mib"] >= 0)
        assert r["shape"] == {"batch": 1, "seq": 32, "heads": 4, "kv_heads": 2, "head_dim": 8}
        if r["who"] == "torch":  # torch's collectives: the measure modes cannot take them apart
            assert r["compute_only_ms"] is None and r["exposed_ms"] is None and r["compute_balance"] is None
            continue
        assert r["compute_only_ms"] > 0 and len(r["rank_compute_only_ms"]) == 2 and r["compute_balance"] >= 1.0
        assert r["exposed_ms"] == pytest.approx(r["median_ms"] - r["compute_only_ms"], abs=2e-3)
        # comm is comm-only less outside-only: every measure mode runs on commfuse's rows (the ring keeps the
        # blocks its backward needs when the compute is removed)
        assert r["comm_ms"] is not None and not r["unmeasured"], r
    assert next(r for r in recs if r["row"] == "ring")["layout"] == "zigzag"
    assert next(r for r in recs if r["row"] == "ring contiguous")["layout"] == "contiguous"
