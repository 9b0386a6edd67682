"""Tier (a), no processes: `commfuse bench` parses flags into the right run, names bad ones, writes valid output."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from commfuse.bench import command, netns, report, trace
from commfuse.bench.config import ALGORITHMS, PRESETS, BenchConfig, Shape, applies, scaled
from commfuse.cli import parser
from commfuse.errors import CommfuseError, CommfuseValueError


def _args(*argv: str):
    return parser().parse_args(["bench", *argv])


def test_defaults():
    cfg = command.config_from_args(_args())
    assert cfg.workloads == ("ag_matmul", "matmul_rs")
    assert cfg.algorithms == ALGORITHMS
    assert cfg.world_size == 2 and cfg.threads == 1
    assert cfg.shape == PRESETS["small"]
    assert cfg.link_rate is None and not cfg.trace and not cfg.fingerprint


def test_flags_reach_the_config():
    cfg = command.config_from_args(_args(
        "-w", "mlp,attention", "fsdp_linear", "-a", "ring", "sliced:4", "--preset", "paper-mlp", "--scale", "16",
        "--seq", "512", "-n", "4", "--threads", "2", "-r", "7", "--warmup", "0", "--dtype", "bfloat16",
        "--forward-only", "--fingerprint", "--link-rate", "800mbit", "--plot", "x.png",
    ))
    assert cfg.workloads == ("mlp", "attention", "fsdp_linear")
    assert cfg.algorithms == ("vanilla", "ring", "sliced:4")  # vanilla, the baseline, is always added
    assert cfg.shape == Shape(batch=2, seq=512, hidden=256, ffn=1024, heads=16)
    assert (cfg.world_size, cfg.threads, cfg.repeats, cfg.warmup) == (4, 2, 7, 0)
    assert cfg.dtype == "bfloat16" and not cfg.backward and cfg.fingerprint
    assert cfg.link_rate == "800mbit" and cfg.trace  # --plot needs the traced iteration


def test_all_workloads():
    cfg = command.config_from_args(_args("-w", "all"))
    assert cfg.workloads == ("ag_matmul", "matmul_rs", "mlp", "attention", "ulysses", "fsdp_linear", "llama_block",
                             "moe")


def test_strands_workload_times_rows_of_its_own():
    """`-w strands`: left out of `-w all`, its sizes checked against the world size (the Llama block's and the MoE
    block's), and refused with --forward-only (a backward beside the next forward is what it times)."""
    from commfuse.bench.config import STRAND_ROWS, WORKLOADS

    cfg = command.config_from_args(_args("-w", "strands", "--preset", "tiny"))
    assert cfg.workloads == ("strands",) and WORKLOADS["strands"].rows == tuple(STRAND_ROWS)
    assert list(STRAND_ROWS) == ["vanilla", "ring", "strands naive", "strands searched"]
    cfg.check_world(2)
    with pytest.raises(CommfuseValueError, match="workload strands: seq = 32 does not divide over world size 3"):
        cfg.check_world(3)
    with pytest.raises(CommfuseValueError, match="workload strands runs forward \\+ backward"):
        command.config_from_args(_args("-w", "strands", "--forward-only"))
    with pytest.raises(CommfuseValueError, match="traces none"):
        command.config_from_args(_args("-w", "strands", "--trace", "t.json"))


def test_moe_workload_is_accepted_with_its_sizes():
    """`-w moe`: the mixture-of-experts layer, every algorithm that applies to an all-to-all (not bidirectional);
    --experts and --topk reach the config (defaults 4 and 2), travel through to_argv and are checked."""
    from commfuse.bench.config import MOE_EXPERTS, MOE_TOPK, WORKLOADS

    cfg = command.config_from_args(_args("-w", "moe"))
    assert cfg.workloads == ("moe",) and cfg.algorithms == ALGORITHMS and cfg.backward
    assert (cfg.experts, cfg.topk) == (MOE_EXPERTS, MOE_TOPK) == (4, 2)
    assert WORKLOADS["moe"].layer == "MoE" and WORKLOADS["moe"].collective == "all_to_all"
    run = [a for a in cfg.algorithms if applies("moe", a)]
    assert run == ["vanilla", "sliced:2", "sliced:4", "serial", "ring", "auto"]
    cfg.check_world(2)
    args = _args("-w", "moe", "--experts", "8", "--topk", "1", "-a", "ring:2", "sliced:4", "--link-rate", "350mbit")
    cfg = command.config_from_args(args)
    assert (cfg.experts, cfg.topk, cfg.algorithms) == (8, 1, ("vanilla", "ring:2", "sliced:4"))
    assert command.config_from_args(_args(*command.to_argv(args))) == cfg
    with pytest.raises(CommfuseValueError, match="workload moe: experts \\(--experts\\) = 6 does not divide over "
                       "world size 4"):
        command.config_from_args(_args("-w", "moe", "--experts", "6")).check_world(4)
    with pytest.raises(CommfuseValueError, match="topk must be at most experts"):
        command.config_from_args(_args("-w", "moe", "--experts", "2", "--topk", "3"))
    with pytest.raises(CommfuseValueError, match="experts must be an integer >= 1"):  # --experts 0 fails to parse
        BenchConfig(workloads=("moe",), experts=0)


def test_moe_is_not_a_compiled_workload():
    with pytest.raises(CommfuseValueError, match="not moe"):
        command.config_from_args(_args("--compile", "-w", "moe"))


def test_scale_keeps_head_dim_at_least_16():
    s = scaled(PRESETS["paper-mlp"], 8)
    assert (s.batch, s.seq, s.hidden, s.ffn, s.heads) == (4, 512, 512, 2048, 32)
    assert scaled(PRESETS["paper-mlp"], 32).heads == 8  # h = 128: 8 heads of 16
    with pytest.raises(CommfuseValueError, match="--scale"):
        scaled(PRESETS["paper-mlp"], 0)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["-w", "nope"], "unknown workload"),
        (["-a", "ring:0"], "algorithm 'ring:0'"),
        (["-a", "vanilla:2"], "algorithm 'vanilla:2'"),
        (["-a", "serial:x"], "algorithm 'serial:x'"),
        (["-a", "ring", "ring"], "name one algorithm twice"),
        (["-a", "sliced", "sliced:2"], "name one algorithm twice"),  # the same algorithm, parsed
        (["--tokens", "64", "-b", "2"], "--tokens T stands for batch 1 and seq T"),
        (["--link-rate", "fast"], "--link-rate 'fast' is not a rate"),
        (["--link-rate", "800mb"], "is not a rate"),
    ],
)
def test_bad_flags_are_named(argv, match):
    with pytest.raises(CommfuseValueError, match=match):
        command.config_from_args(_args(*argv))


def test_a_config_made_in_python_checks_its_sizes_itself():
    """What the command's parser refuses (``-r 0``, ``--batch 0``), a BenchConfig refuses too."""
    with pytest.raises(CommfuseValueError, match="repeats must be an integer >= 1"):
        BenchConfig(repeats=0)
    with pytest.raises(CommfuseValueError, match="batch must be an integer >= 1"):
        BenchConfig(shape=Shape(batch=0, seq=8, hidden=8, ffn=8, heads=1))


def test_sizes_that_do_not_split_over_the_world_size_are_named():
    cfg = command.config_from_args(_args("-w", "attention", "--heads", "6", "--hidden", "96"))
    with pytest.raises(CommfuseValueError, match="workload attention: heads = 6 does not divide over world size 4"):
        cfg.check_world(4)
    cfg = command.config_from_args(_args("--seq", "3", "--batch", "1"))
    with pytest.raises(CommfuseValueError, match=r"ag_matmul: b\*s \(tokens\) = 3 does not divide over world size 2"):
        cfg.check_world(2)


def test_cli_reports_a_bad_flag_and_exits_2(capsys):
    from commfuse.cli import main

    assert main(["bench", "-a", "zigzag"]) == 2
    assert "unknown algorithm 'zigzag'" in capsys.readouterr().err


def test_to_argv_round_trips():
    args = _args("-w", "mlp", "-a", "ring", "--preset", "tiny", "--scale", "2", "--ffn", "96", "--kv-heads", "2",
                 "--forward-only", "--link-rate", "1gbit", "--json", "--trace", "t.json", "--no-progress")
    again = _args(*command.to_argv(args))
    assert command.config_from_args(again) == command.config_from_args(args)
    assert again.json == "-" and again.no_progress
    assert os.path.isabs(again.trace)


def test_bidirectional_does_not_apply_to_all_to_all():
    assert not applies("ulysses", "bidirectional") and not applies("ulysses", "bidirectional:2")
    assert applies("ulysses", "ring") and applies("ag_matmul", "bidirectional")
    assert applies("ulysses", "serial") and applies("matmul_rs", "serial:2")


def test_algorithms_follow_the_library_grammar():
    from commfuse.schedule import ALGORITHM_NAMES

    assert "serial" in ALGORITHMS and ALGORITHMS.index("serial") < ALGORITHMS.index("ring")
    for name in ALGORITHM_NAMES:  # every name the ops accept, the bench accepts
        assert name in BenchConfig(algorithms=(name,)).algorithms
    cfg = command.config_from_args(_args("-a", "serial:2", "ring:2", "--tokens", "96"))
    assert cfg.algorithms == ("vanilla", "serial:2", "ring:2")
    assert (cfg.shape.batch, cfg.shape.seq) == (1, 96)
    with pytest.raises(CommfuseValueError, match="algorithm 3 is not a string"):
        BenchConfig(algorithms=(3,))


def test_fake_pg_is_a_mode_of_its_own():
    assert _args().run is command.run
    args = _args("--fake-pg", "8", "--device", "cpu", "-a", "ring", "--calls", "3")
    assert args.run is command.run_fake
    cfg, calls = command.fake_config(args)
    assert cfg.world_size == 8 and cfg.device == "cpu" and cfg.dtype == "float32" and calls == 3
    assert cfg.algorithms == ("vanilla", "ring")
    cfg, calls = command.fake_config(_args("--fake-pg", "8", "--device", "cuda"))  # parsing needs no GPU
    assert cfg.dtype == "bfloat16" and calls == 20
    assert command.fake_config(_args("--fake-pg", "2", "--device", "cuda", "--dtype", "float16"))[0].dtype == "float16"
    # python -m commfuse.bench routes the same way
    p = command.argparse.ArgumentParser()
    command.arguments(p)
    assert p.parse_args(["--fake-pg", "2"]).run is command.run_fake


@pytest.mark.parametrize("argv, match", [
    (["--link-rate", "1gbit"], "--link-rate do"),
    (["--trace", "t.json"], "--trace do"),
])
def test_fake_pg_names_what_does_not_apply(argv, match):
    argv = argv if "--fake-pg" in argv else ["--fake-pg", "2", *argv]
    with pytest.raises(CommfuseValueError, match=match):
        command.fake_config(_args(*argv, "--device", "cpu"))


@pytest.mark.parametrize("text, bytes_per_s",
                         [("800mbit", 1e8), ("2gbit", 2.5e8), ("100mbps", 1e8), ("1.5Gbit", 1.875e8)])
def test_rates(text, bytes_per_s):
    assert netns.parse_rate(text) == pytest.approx(bytes_per_s)
    assert netns.burst_bytes(bytes_per_s) >= netns.MIN_BURST


def test_netns_refuses_to_shape_a_loopback_it_did_not_create(monkeypatch):
    monkeypatch.setenv(netns.ENV, "800mbit")
    monkeypatch.delenv(netns.PARENT_ENV, raising=False)
    with pytest.raises(netns.LinkRateError, match="refusing to shape"):
        netns.shape_loopback("800mbit")


@pytest.mark.skipif(shutil.which("setpriv") is None or os.geteuid() != 0, reason="needs root and setpriv to drop it")
def test_link_rate_without_root_says_how_to_run_instead():
    # A real unprivileged process: modules are imported as root first (a fresh clone may be unreadable to
    # other users), then the process drops to uid 65534 for good and runs the bench's own check.
    code = ("import os, commfuse.bench.netns as netns\n"
            "os.setgroups([]); os.setgid(65534); os.setuid(65534)\n"
            "try:\n    netns._require_tools()\nexcept netns.LinkRateError as e:\n    print(e)\n    raise SystemExit(2)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "--link-rate needs root" in done.stdout and "drop --link-rate" in done.stdout
    assert "uid 65534" in done.stdout


def test_python_m_commfuse_bench_help():
    done = subprocess.run([sys.executable, "-m", "commfuse.bench", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0
    assert "--link-rate" in done.stdout and "paper-mlp" in done.stdout


def test_command_module_imports_no_torch():
    code = "import sys, commfuse.bench.command, commfuse.bench.report; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr


# -- report, trace and plot from one run's result ------------------------------------------------------------


def _step(label, step, post, compute, wait, sends=(), recvs=(), collectives=()):
    return {"label": label, "schedule": "ring", "step": step, "post": list(post), "compute": list(compute),
            "wait": list(wait), "sends": [list(s) for s in sends], "recvs": [list(r) for r in recvs],
            "collectives": list(collectives)}


def _result() -> tuple[dict, BenchConfig]:
    """The shape of a rank-0 result for 2 ranks, 2 algorithms, 3 repeats (times in seconds)."""
    cfg = BenchConfig(workloads=("ag_matmul",), algorithms=("vanilla", "ring"), repeats=3, trace=True)
    wall = [[[0.030, 0.020, 0.010], [0.021, 0.020, 0.010]] for _ in range(3)]
    events = {
        "vanilla": [_step("all_gather_matmul", 0, (0.0, 0.0001), (0.0001, 0.0001), (0.0001, 0.010),
                          collectives=["all_gather[0]"]),
                    _step("all_gather_matmul", 1, (0.010, 0.010), (0.010, 0.030), (0.030, 0.030))],
        "ring": [_step("all_gather_matmul", 0, (0.0, 0.0001), (0.0001, 0.010), (0.010, 0.0105), sends=[(1, 0)],
                       recvs=[(1, 0)]),
                 _step("all_gather_matmul", 1, (0.0105, 0.0105), (0.0105, 0.021), (0.021, 0.021))],
    }
    traces = {alg: [{"rank": r, "end": ev[-1]["wait"][1], "events": ev} for r in range(2)]
              for alg, ev in events.items()}
    res = {"workload": "ag_matmul", "algorithms": ["vanilla", "ring"], "wall_s": wall,
           "outside_s": [[0.0, 0.0]] * 3, "correct": [True, True], "max_rel_error": [0.0, 1e-7],
           "taken": ["vanilla", "ring"], "unusable_modes": {}, "traces": traces}
    return {"world_size": 2, "backend": "gloo", "device": "cpu", "results": [res]}, cfg


def test_records_follow_the_documented_formulas():
    run, cfg = _result()
    recs = report.records(run, cfg)
    assert [set(r) for r in recs] == [set(report.SCHEMA_KEYS)] * 2
    van, ring = recs
    assert van["median_ms"] == 30.0 and van["exposed_ms"] == 10.0 and van["hidden_fraction"] == 0.0
    assert ring["exposed_ms"] == pytest.approx(1.0) and ring["hidden_fraction"] == pytest.approx(0.9)
    assert ring["speedup_vs_vanilla"] == pytest.approx(30 / 21, abs=1e-4)
    assert json.loads(json.dumps(recs)) == recs
    text = report.table(recs, cfg)
    assert "ring" in text and "1.43x" in text
    lines = "\n".join(report.targets(recs))
    assert "ring exposes 10.0% of its comm-only time" in lines and "ring vs vanilla 1.43x" in lines


def test_serial_takes_ring_speedup_apart():
    """collective = vanilla / serial, overlap = serial / ring; their product is ring's speed-up over vanilla."""
    run, _ = _result()
    cfg = BenchConfig(workloads=("ag_matmul",), algorithms=("vanilla", "serial", "ring"), repeats=3)
    res = run["results"][0]
    res["algorithms"] = ["vanilla", "serial", "ring"]
    res["wall_s"] = [[[0.030, 0.020, 0.010], [0.025, 0.020, 0.005], [0.020, 0.020, 0.005]] for _ in range(3)]
    res["outside_s"] = [[0.0, 0.0, 0.0]] * 3
    res["correct"], res["max_rel_error"], res["taken"] = [True] * 3, [0.0] * 3, ["vanilla", "serial", "ring"]
    recs = report.records(run, cfg)
    assert [set(r) for r in recs] == [set(report.SCHEMA_KEYS)] * 3
    van, serial, ring = recs
    assert serial["hidden_fraction"] == 0.0  # no overlap: compute + comm one after the other
    for r in recs:  # figures of the workload, on each of its records
        assert r["collective_effect"] == pytest.approx(30 / 25) and r["overlap_effect"] == pytest.approx(25 / 20)
    assert ring["collective_effect"] * ring["overlap_effect"] == pytest.approx(ring["speedup_vs_vanilla"])
    text = report.table(recs, cfg)
    assert "ring vs vanilla 1.50x = collective 1.20x (vanilla / serial) x overlap 1.25x (serial / ring)" in text
    assert "comm-only: vanilla 10.00 ms, serial 5.00 ms" in text
    lines = "\n".join(report.targets(recs))
    assert "of which collective 1.20x (vanilla / serial) and overlap 1.25x (serial / ring)" in lines
    # without serial there is nothing to take apart
    van_ring = report.records(*_result())
    assert all(r["collective_effect"] is None and r["overlap_effect"] is None for r in van_ring)
    assert "collective" not in "\n".join(report.targets(van_ring))


def test_moe_records_carry_experts_and_routing():
    run, _ = _result()
    cfg = BenchConfig(workloads=("moe",), algorithms=("vanilla", "ring"), repeats=3, experts=8, topk=2)
    res = run["results"][0]
    res["workload"], res["routing"] = "moe", [[1030, 1018], [990, 1058]]
    recs = report.records(run, cfg)
    assert [set(r) for r in recs] == [set(report.SCHEMA_KEYS)] * 2
    assert all(r["routing"] == [[1030, 1018], [990, 1058]] for r in recs)
    assert all(r["shape"]["experts"] == 8 and r["shape"]["topk"] == 2 for r in recs)
    text = report.table(recs, cfg)
    assert "experts=8 top-2" in text and "checked against moe_reference" in text
    assert "rank 0: 1030, 1018; rank 1: 990, 1058" in text
    assert "moe: comm-only / compute-only" in "\n".join(report.targets(recs))
    # the other workloads carry no routing
    assert all(r["routing"] is None and "experts" not in r["shape"] for r in report.records(*_result()))


def test_chrome_trace_has_compute_and_transfer_spans_per_rank():
    run, _ = _result()
    doc = json.loads(json.dumps(trace.chrome_trace(run)))
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    for alg in ("vanilla", "ring"):
        for rank in (0, 1):
            cats = {e["cat"] for e in spans if e["args"]["algorithm"] == alg and e["args"]["rank"] == rank}
            assert {"compute", "transfer", "wait"} <= cats
    # vanilla's step 0 computes nothing: no compute span for it
    assert not [e for e in spans
                if e["args"]["algorithm"] == "vanilla" and e["cat"] == "compute" and e["args"]["step"] == 0]
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert any(n.startswith("ag_matmul ring") for n in names)


def test_plot_writes_a_png(tmp_path):
    from commfuse.bench import plot  # needs the bench extra (matplotlib), which ci/setup.sh installs

    run, _ = _result()
    path = plot.write(run, tmp_path / "sub" / "gantt.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_a_traced_iteration_says_so(tmp_path):
    from commfuse.bench import plot

    run, _ = _result()
    run["results"][0]["traces"] = {}
    with pytest.raises(CommfuseError, match="nothing was traced"):
        plot.write(run, tmp_path / "x.png")


# -- --compile: eager against torch.compile --------------------------------------------------------------------


def test_compile_is_opt_in_with_its_own_defaults():
    assert command.config_from_args(_args()).compile_backend is None
    cfg = command.config_from_args(_args("--compile"))
    assert cfg.compile_backend == "inductor"
    assert cfg.workloads == ("mlp", "attention", "fsdp_linear") and cfg.algorithms == ("vanilla", "ring")
    cfg = command.config_from_args(_args("--compile", "aot_eager", "-w", "all", "-a", "auto"))
    assert cfg.compile_backend == "aot_eager" and cfg.algorithms == ("vanilla", "auto")
    assert cfg.workloads == ("mlp", "attention", "fsdp_linear", "ag_matmul", "matmul_rs")  # all that compile
    # with --fake-pg, --compile adds a column to the fake group's usual run
    cfg, _ = command.fake_config(_args("--fake-pg", "4", "--device", "cpu", "--compile", "aot_eager"))
    assert cfg.compile_backend == "aot_eager" and cfg.workloads == ("ag_matmul", "matmul_rs")
    assert cfg.algorithms == ALGORITHMS


@pytest.mark.parametrize("argv, match", [
    (["--compile", "-w", "ulysses"], "--compile times the workloads that compile whole"),
    (["--compile", "-w", "mlp", "llama_block"], "not llama_block"),
    (["--compile", "--trace", "t.json"], "drop --trace/--plot or --compile"),
])
def test_compile_names_what_does_not_apply(argv, match):
    with pytest.raises(CommfuseValueError, match=match):
        command.config_from_args(_args(*argv))


def test_compile_refuses_an_unknown_backend(capsys):
    with pytest.raises(SystemExit):
        _args("--compile", "tvm")
    assert "invalid choice: 'tvm'" in capsys.readouterr().err
    with pytest.raises(CommfuseValueError, match="--compile takes one of inductor, aot_eager, eager"):
        BenchConfig(workloads=("mlp",), compile_backend="tvm")


def test_to_argv_round_trips_compile_and_defaults():
    for argv in (("--compile", "aot_eager", "-w", "mlp", "--preset", "tiny"), ("--compile",), ()):
        args = _args(*argv)
        again = _args(*command.to_argv(args))
        assert command.config_from_args(again) == command.config_from_args(args)


def _compile_result() -> tuple[dict, BenchConfig]:
    """The shape of a rank-0 ``--compile`` result: 2 algorithms, 3 repeats, [repeat][algorithm][eager, compiled]."""
    cfg = BenchConfig(workloads=("mlp",), algorithms=("vanilla", "ring"), repeats=3, compile_backend="inductor")
    wall = [[[0.020, 0.010], [0.030, 0.040]] for _ in range(3)]
    res = {"workload": "mlp", "algorithms": ["vanilla", "ring"], "wall_s": wall, "first_compiled_s": [12.5, 1.25],
           "correct": [True, True], "max_rel_error": [1e-7, 2e-7], "compile_error": ["", ""]}
    return {"mode": "compile", "compile_backend": "inductor", "torch": "2.x", "world_size": 2, "backend": "gloo",
            "device": "cpu", "results": [res]}, cfg


def test_compile_records_and_table():
    run, cfg = _compile_result()
    recs = report.compile_records(run, cfg)
    van, ring = recs
    assert van["mode"] == "compile" and van["compiled"] == "ParallelMLP" and van["backward"] is True
    assert (van["eager_ms"], van["compiled_ms"]) == (20.0, 10.0)
    assert van["compiled_vs_eager"] == 0.5 and van["speedup"] == 2.0
    assert ring["compiled_vs_eager"] == pytest.approx(4 / 3, abs=1e-4) and ring["speedup"] == 0.75
    assert van["first_compiled_step_s"] == 12.5 and van["correct"] and van["compile_error"] is None
    assert json.loads(json.dumps(recs)) == recs
    text = report.compile_table(recs, cfg)
    for cell in ("eager ms (p25-p75)", "compiled ms (p25-p75)", "compiled / eager", "speed-up",
                 "first compiled step s", "0.500x", "2.00x", "1.333x", "0.75x", "12.50",
                 "torch.compile(fullgraph=True, backend='inductor')"):
        assert cell in text, cell
    # a workload that does not compile says so, and the command fails
    run["results"][0]["compile_error"] = ["", "Unsupported: graph break"]
    run["results"][0]["wall_s"] = [[[0.020, 0.010], [0.030, float("nan")]] for _ in range(3)]
    ring = report.compile_records(run, cfg)[1]
    assert ring["compiled_ms"] is None and not ring["correct"] and ring["compile_error"] == "Unsupported: graph break"
    assert "ring did not compile: Unsupported: graph break" in report.compile_table(report.compile_records(run, cfg),
                                                                                      cfg)
