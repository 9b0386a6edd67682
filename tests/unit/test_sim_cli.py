"""Tier (a), no processes: ``commfuse simulate`` parses its arguments, prints the table, and writes bench-format JSON, traces and charts."""

from __future__ import annotations

import json

import pytest

from commfuse.cli import main, parser

BASE = ["simulate", "--profile", "h100-sxm", "--workload", "mlp", "--tp", "4", "--seq", "1024", "--hidden", "1024"]
BENCH_KEYS = {"workload", "algorithm", "world_size", "median_ms", "compute_only_ms", "comm_only_ms", "exposed_ms",
              "speedup_vs_vanilla", "hidden_fraction", "correct"}


def test_the_table_has_the_issues_rows(capsys):
    assert main(BASE) == 0
    out = capsys.readouterr().out
    assert "mlp forward, tp 4" in out and "h100-sxm" in out
    rows = [line.split()[0] for line in out.splitlines()[3:] if line.strip()]
    assert rows == ["vanilla", "sliced:2", "sliced:4", "ring", "bidirectional"]


def test_json_records_have_the_bench_keys(capsys):
    assert main([*BASE, "--chunks", "2,8", "--json"]) == 0
    captured = capsys.readouterr()
    records = json.loads(captured.out)
    assert "predicted ms" in captured.err  # the table moves to stderr
    assert [r["algorithm"] for r in records] == ["vanilla", "sliced:2", "sliced:8", "ring", "bidirectional"]
    for r in records:
        assert BENCH_KEYS <= set(r)
        assert r["world_size"] == 4 and r["workload"] == "mlp" and r["predicted"] is True
        assert r["exposed_ms"] == pytest.approx(r["median_ms"] - r["compute_only_ms"], abs=1e-5)
    vanilla = records[0]
    assert vanilla["speedup_vs_vanilla"] == 1.0


def test_json_to_a_file_and_exact_algorithms(tmp_path, capsys):
    target = tmp_path / "out" / "sim.json"
    assert main([*BASE, "--algorithms", "ring:2", "sliced:3", "--json", str(target)]) == 0
    records = json.loads(target.read_text())
    assert [r["algorithm"] for r in records] == ["vanilla", "ring:2", "sliced:3"]


def test_trace_and_plot_are_the_benchmarks_layout(tmp_path, capsys):
    trace, chart = tmp_path / "t.json", tmp_path / "g.svg"
    assert main([*BASE, "--trace", str(trace), "--plot", str(chart), "--ranks", "0,3"]) == 0
    doc = json.loads(trace.read_text())
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert len(names) == 5 and any(n.startswith("mlp ring") for n in names)  # one process per algorithm
    threads = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert threads == {"rank 0 compute", "rank 0 comm", "rank 3 compute", "rank 3 comm"}
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["cat"] for e in spans} >= {"compute", "transfer", "wire"}
    assert all(e["dur"] >= 0 for e in spans)
    assert doc["otherData"]["generator"] == "commfuse simulate"
    assert chart.read_text().startswith("<svg") and "rank 3 comm" in chart.read_text()


def test_png_chart_with_matplotlib(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the benchmark's chart needs matplotlib (pip install matplotlib)")
    chart = tmp_path / "g.png"
    assert main([*BASE, "--plot", str(chart), "--ranks", "0,1"]) == 0
    assert chart.read_bytes()[:4] == b"\x89PNG"
    assert main([*BASE, "--plot", str(chart), "--ranks", "1,3"]) == 2
    assert "give --ranks as 0,1,...,k-1" in capsys.readouterr().err


def test_full_engine_flag_gives_the_same_figures(capsys):
    assert main([*BASE, "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert main([*BASE, "--full", "--json"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert [r["median_ms"] for r in one] == pytest.approx([r["median_ms"] for r in full], rel=1e-9)


def test_set_overrides_a_profile_field(capsys):
    assert main([*BASE, "--json"]) == 0
    base = json.loads(capsys.readouterr().out)
    assert main([*BASE, "--set", "link.bandwidth=1e9", "--json"]) == 0
    slow = json.loads(capsys.readouterr().out)
    assert slow[0]["comm_only_ms"] > 10 * base[0]["comm_only_ms"]


def test_explain_names_the_crossover(capsys):
    assert main([*BASE, "--explain"]) == 0
    out = capsys.readouterr().out
    assert "winner by sequence length" in out and "fastest:" in out
    assert "bidirectional: on a switch" in out


def test_profiles_lists_the_shipped_ones(capsys):
    assert main(["simulate", "profiles"]) == 0
    out = capsys.readouterr().out
    for name in ("h100-sxm", "a100-sxm", "ascend-910b", "tpu-v5p", "paper-table1"):
        assert name in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["simulate", "--workload", "mlp", "--seq", "8", "--hidden", "8"], "needs --profile"),
        (["simulate", "--profile", "h100-sxm", "--workload", "mlp", "--hidden", "8"], "needs --seq"),
        ([*BASE[:2], "nope", *BASE[3:]], "no profile named 'nope'"),
        ([*BASE, "--tp", "3"], "ffn 4096 must divide by tp 3"),
        ([*BASE, "--dtype", "float32"], "gives compute rates for bfloat16"),
        ([*BASE, "--algorithms", "spiral"], "unknown algorithm 'spiral'"),
        ([*BASE, "--plot", "chart.png", "--set", "link.latency=-1"], "[link].latency"),
        (["simulate", "--profile", "h100-sxm", "--workload", "attention", "--tp", "2", "--seq", "8", "--hidden", "8",
          "--heads", "3"], "3 query heads do not split over tp 2"),
        (["simulate", "calibrate", "--link-rate", "fast"], "is not a rate"),
    ],
)
def test_bad_input_exits_2_naming_it(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv", [[*BASE, "--chunks", "0"], [*BASE, "--set", "bandwidth"], [*BASE, "--tp", "x"],
                                  [*BASE, "--workload", "nope"]])
def test_argparse_refuses_malformed_flags(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parser().parse_args(argv)
    assert e.value.code == 2


def test_calibrate_flags_parse():
    args = parser().parse_args(["simulate", "calibrate", "--link-rate", "800mbit", "--output", "x.toml", "--install",
                                "--quick", "--repeats", "3"])
    assert (args.action, args.link_rate, args.output, args.install, args.quick, args.repeats) == (
        "calibrate", "800mbit", "x.toml", True, True, 3)
    assert parser().parse_args(BASE).action is None
