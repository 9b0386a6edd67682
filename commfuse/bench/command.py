"""The ``commfuse bench`` subcommand (also ``python -m commfuse.bench``). Imports no torch at module level.

Three ways to run:

- by default it launches its own ranks on this machine (gloo on CPU, one
  thread each, :func:`commfuse.launch.launch`);
- under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
  ``MASTER_PORT`` set) every process is one rank: it joins the env://
  rendezvous with the backend that fits its device (NCCL on CUDA, HCCL on
  Ascend, gloo on CPU) and rank 0 prints;
- with ``--link-rate RATE`` it re-executes itself in a private network
  namespace whose loopback is limited to RATE (``netns``), then as above;
- with ``--fake-pg N`` it runs in this one process on torch's fake process
  group (rank 0 of N, transfers that complete at once) and times each op's
  GEMMs and overhead against the unsliced GEMM (``fakepg``).

``--compile [BACKEND]`` changes what the ranks measure: each layer (and
bare op) eager against ``torch.compile(..., fullgraph=True)``, interleaved
(``compiled``); with ``--fake-pg`` it adds the compiled op's column.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from commfuse.bench.config import (
    ALGORITHMS,
    COMPILE_BACKENDS,
    COMPILE_DEFAULT_ALGORITHMS,
    COMPILE_DEFAULT_WORKLOADS,
    COMPILE_WORKLOADS,
    MOE_EXPERTS,
    MOE_TOPK,
    PRESETS,
    WORKLOADS,
    BenchConfig,
    Shape,
    scaled,
)
from commfuse.cli import MAX_LAUNCHED_RANKS, check_outputs, command, integer, require_extra, seconds
from commfuse.errors import CommfuseError, CommfuseValueError

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

_SIZE_FLAGS = (("batch", "b"), ("seq", "s"), ("hidden", "h"), ("ffn", "ffn"), ("heads", "heads"),
               ("kv_heads", "kv_heads"))


def _timeout(text: str) -> float:
    """``--timeout``: seconds within the bounds the library puts on every wait."""
    from commfuse.runtime.groups import MAX_TIMEOUT_S, MIN_TIMEOUT_S  # imports torch: only when one is given

    return seconds(MIN_TIMEOUT_S, MAX_TIMEOUT_S)(text)


class _FakeGroupMode(argparse.Action):
    """``--fake-pg N``: store N, and route the parsed command to :func:`run_fake` instead of :func:`run`.

    The option is a mode of its own (one process, no ranks, no namespace), so
    it is dispatched where the arguments are parsed: ``commfuse``'s parser sets
    ``run`` as the subcommand's default before parsing, and this action,
    applied during parsing, replaces it.
    """

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.run = run_fake


def arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = (
        "workloads:\n" + "\n".join(f"  {w.name:<12} {w.summary}" for w in WORKLOADS.values())
        + "\n\npresets (before --scale): \n"
        + "\n".join(f"  {name:<21} {shape.text()}" for name, shape in PRESETS.items())
        + "\n\nexamples:\n"
        "  commfuse bench                                   # ag_matmul + matmul_rs, 2 ranks, plain loopback\n"
        "  commfuse bench --link-rate 2gbit --plot gantt.png --trace trace.json\n"
        "  commfuse bench -w mlp --preset paper-mlp --scale 8 --link-rate 1gbit\n"
        "  commfuse bench -w moe --link-rate 350mbit --plot moe.png   # mixture of experts, 4 experts, top-2\n"
        "  commfuse bench -w strands --link-rate 700mbit -r 5   # two micro-batches as two strands vs per-op ring\n"
        "  commfuse bench -w ring_attention -b 1 -s 4096 --kv-heads 2 --link-rate 100mbit   # context parallelism\n"
        "  torchrun --nproc-per-node 8 -m commfuse.bench -w all --preset paper-mlp --json out.json\n"
        "  commfuse bench --fake-pg 8 --device cuda --tokens 8192 --hidden 8192 --ffn 28672   # one GPU, no transfers\n"
        "  commfuse bench --compile                         # mlp, attention, fsdp_linear: eager vs torch.compile\n"
        "  commfuse bench --compile aot_eager -w mlp -a vanilla ring auto --preset tiny\n"
        "see docs/benchmarks.md for how to read the figures"
    )
    g = p.add_argument_group("what to measure")
    g.add_argument("-w", "--workloads", nargs="+", metavar="W",
                   help=f"workloads, or 'all' ({', '.join(WORKLOADS)}; 'all' leaves out those needing another "
                   "distribution, torchtitan, and strands and ring_attention, which time rows of their own; default: ag_matmul "
                   "matmul_rs; with "
                   f"--compile: {' '.join(COMPILE_DEFAULT_WORKLOADS)})")
    g.add_argument("-a", "--algorithms", nargs="+", metavar="A",
                   help=f"algorithms to compare (default: {' '.join(ALGORITHMS)}; with --compile: "
                   f"{' '.join(COMPILE_DEFAULT_ALGORITHMS)}); vanilla is always added")
    g.add_argument("--compile", nargs="?", const="inductor", choices=COMPILE_BACKENDS, metavar="BACKEND",
                   help="time each workload eager against torch.compile(..., fullgraph=True, backend=BACKEND) "
                   f"(default inductor; {', '.join(COMPILE_BACKENDS)}) instead of the algorithms against each "
                   f"other: the two interleaved, per algorithm, and the first compiled step (the compile) apart; "
                   f"workloads {', '.join(COMPILE_WORKLOADS)}. With --fake-pg: adds the compiled op's column")
    g.add_argument("--forward-only", action="store_true", help="layer workloads run forward only (default: +backward)")
    g.add_argument("--fingerprint", action="store_true",
                   help="time the ops' fingerprint exchange too, one small round trip per op call (default: only "
                   "the first, untimed, correctness run of each algorithm exchanges it)")
    g = p.add_argument_group("sizes (a preset, divided by --scale, then single sizes overridden)")
    g.add_argument("--preset", choices=list(PRESETS), default="small", help="starting sizes (default: small)")
    g.add_argument("--scale", type=integer(1), default=1, metavar="F",
                   help="divide the preset's b, s, h and ffn by F (default 1), e.g. --preset paper-mlp --scale 8")
    g.add_argument("-b", "--batch", type=integer(1), help="batch size b")
    g.add_argument("-s", "--seq", type=integer(1), help="whole sequence length s (each rank holds s/N)")
    g.add_argument("--tokens", type=integer(1), metavar="T",
                   help="tokens b*s of the GEMM workloads, as batch 1 and seq T (not with -b or -s)")
    g.add_argument("--hidden", type=integer(1), help="hidden size h")
    g.add_argument("--ffn", type=integer(1), help="MLP inner size (each rank holds ffn/N columns)")
    g.add_argument("--heads", type=integer(1), help="attention heads")
    g.add_argument("--kv-heads", type=integer(1), help="key/value heads (grouped-query attention)")
    g.add_argument("--experts", type=integer(1), default=None,
                   help=f"moe: experts, experts/N on each rank (default {MOE_EXPERTS}); their FFN size is --ffn")
    g.add_argument("--topk", type=integer(1), default=None,
                   help=f"moe: experts each token is routed to (default {MOE_TOPK})")
    g.add_argument("--dtype", choices=["float32", "float64", "bfloat16", "float16"],
                   help="default float32; with --fake-pg bfloat16 on CUDA")
    g = p.add_argument_group("how to run")
    g.add_argument("-n", "--world-size", default=2,
                   type=integer(1, MAX_LAUNCHED_RANKS, why=" (more ranks: one process per device under torchrun)"),
                   help=f"ranks to launch, 1 to {MAX_LAUNCHED_RANKS} (default 2; torchrun decides there)")
    g.add_argument("--threads", type=integer(1), default=1, help="torch threads per rank on CPU (default 1)")
    g.add_argument("-r", "--repeats", type=integer(1), default=10,
                   help="timed repeats per algorithm and mode (default 10)")
    g.add_argument("--warmup", type=integer(0), default=2, help="untimed repeats first (default 2)")
    g.add_argument("--device", help="device of the tensors (default: cpu when launching ranks; under torchrun the "
                   "accelerator if there is one)")
    g.add_argument("--link-rate", metavar="RATE",
                   help="run the ranks behind a loopback limited to RATE (tc units: 800mbit, 2gbit, ...) in a "
                   "private network namespace; needs root (default: plain loopback)")
    g.add_argument("--timeout", type=_timeout, default=1800.0,
                   help="seconds before the launched ranks are killed (default 1800; within the library's bounds "
                   "on a wait, commfuse.runtime.groups.MIN_TIMEOUT_S to MAX_TIMEOUT_S)")
    g.add_argument("--seed", type=int, default=0,
                   help="seeds the inputs, the layers' parameters and the order the algorithms run in each repeat "
                   "(default 0)")
    g = p.add_argument_group("output")
    g.add_argument("--json", nargs="?", const="-", metavar="FILE",
                   help="write the records as JSON to FILE, or to stdout (the table then goes to stderr)")
    g.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace of one iteration per algorithm")
    g.add_argument("--plot", metavar="FILE.png", help="write a Gantt chart of one iteration per algorithm (needs "
                   "matplotlib: commfuse's 'bench' extra)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    g = p.add_argument_group(
        "fake process group: one process, every transfer completes at once without moving data; times each "
        "algorithm of all_gather_matmul and matmul_reduce_scatter against the unsliced GEMM (docs/benchmarks.md)")
    g.add_argument("--fake-pg", type=integer(1), metavar="N", action=_FakeGroupMode,
                   help="run as rank 0 of a fake group of N ranks in this process (no launch, no torchrun); "
                   "--device cuda or cpu (default: cuda if there is one), -a, -w, sizes, --dtype, -r, --warmup, "
                   "--threads and --json apply")
    g.add_argument("--calls", type=integer(1), metavar="K",
                   help="with --fake-pg: calls per timed batch (default 20 on CUDA, 2 on CPU)")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    compile_backend = getattr(args, "compile", None)
    fake = getattr(args, "fake_pg", None) is not None
    given = args.workloads
    if given is None:
        given = ["ag_matmul", "matmul_rs"] if compile_backend is None or fake else list(COMPILE_DEFAULT_WORKLOADS)
    workloads: list[str] = []
    for item in given:
        for w in item.split(","):
            if w == "all":  # with --compile, every workload that compiles; never one that needs another distribution
                workloads += list(COMPILE_WORKLOADS if compile_backend is not None and not fake else
                                  [name for name, info in WORKLOADS.items() if info.requires is None and not info.rows])
            elif w:
                workloads.append(w)
    given = args.algorithms
    if given is None:
        given = list(ALGORITHMS) if compile_backend is None or fake else list(COMPILE_DEFAULT_ALGORITHMS)
    algorithms = [a for item in given for a in item.split(",") if a]
    if compile_backend is not None and not fake and (args.trace or args.plot):
        raise CommfuseValueError("--trace and --plot draw the executor's steps of the overlap benchmark; --compile "
                                 "times whole steps eager against compiled: drop --trace/--plot or --compile")
    shape = scaled(PRESETS[args.preset], args.scale)
    overrides = {name: getattr(args, name) for name, _ in _SIZE_FLAGS if getattr(args, name) is not None}
    tokens = getattr(args, "tokens", None)
    if tokens is not None:
        if args.batch is not None or args.seq is not None:
            raise CommfuseValueError("--tokens T stands for batch 1 and seq T: give it, or -b/-s, not both")
        overrides.update(batch=1, seq=tokens)
    shape = Shape(**{**shape.__dict__, **overrides})
    if args.link_rate is not None:
        from commfuse.bench.netns import parse_rate

        parse_rate(args.link_rate)
    return BenchConfig(
        workloads=tuple(dict.fromkeys(workloads)),
        algorithms=tuple(algorithms),
        shape=shape,
        preset=args.preset,
        scale=args.scale,
        world_size=args.world_size,
        threads=args.threads,
        repeats=args.repeats,
        warmup=args.warmup,
        dtype=args.dtype or "float32",
        device=args.device,
        backward=not args.forward_only,
        fingerprint=args.fingerprint,
        link_rate=args.link_rate,
        trace=bool(args.trace or args.plot),
        timeout=args.timeout,
        seed=args.seed,
        compile_backend=compile_backend,
        **{name: getattr(args, name) for name in ("experts", "topk") if getattr(args, name, None) is not None},
    )


def to_argv(args: argparse.Namespace) -> list[str]:
    """The command line that parses back to ``args`` (for re-executing in the shaped namespace)."""
    out = ["--preset", args.preset, "--scale", str(args.scale), "--world-size", str(args.world_size),
           "--threads", str(args.threads), "--repeats", str(args.repeats), "--warmup", str(args.warmup),
           "--timeout", repr(args.timeout), "--seed", str(args.seed)]
    if args.workloads is not None:
        out += ["--workloads", *args.workloads]
    if args.algorithms is not None:
        out += ["--algorithms", *args.algorithms]
    if getattr(args, "compile", None):
        out += ["--compile", args.compile]
    for name, _ in _SIZE_FLAGS:
        if getattr(args, name) is not None:
            out += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    if getattr(args, "tokens", None) is not None:
        out += ["--tokens", str(args.tokens)]
    for name in ("experts", "topk"):
        if getattr(args, name, None) is not None:
            out += ["--" + name, str(getattr(args, name))]
    if args.dtype:
        out += ["--dtype", args.dtype]
    if args.forward_only:
        out.append("--forward-only")
    if args.fingerprint:
        out.append("--fingerprint")
    if args.device:
        out += ["--device", args.device]
    if args.link_rate:
        out += ["--link-rate", args.link_rate]
    if args.json == "-":
        out.append("--json")
    elif args.json:
        out += ["--json", str(Path(args.json).resolve())]
    for flag in ("trace", "plot"):
        if getattr(args, flag):
            out += ["--" + flag, str(Path(getattr(args, flag)).resolve())]
    if args.no_progress:
        out.append("--no-progress")
    return out


def under_torchrun() -> bool:
    return all(os.environ.get(k) for k in TORCHRUN_ENV)


def execute_config(config: BenchConfig, *, progress: bool = False) -> dict:
    """Launch ``config.world_size`` gloo ranks on this machine; rank 0's result."""
    if config.device not in (None, "cpu"):
        raise CommfuseValueError(
            f"--device {config.device}: the ranks this command launches itself run on CPU with gloo; on "
            "accelerators start one process per device with torchrun (docs/benchmarks.md)"
        )
    config.check_world(config.world_size)
    _check_layers(config)
    from commfuse.bench import runner
    from commfuse.launch import launch

    return launch(runner.launched, config.world_size, config, progress, timeout=config.timeout,
                  threads=config.threads)[0]


def execute_torchrun(config: BenchConfig, *, progress: bool = False) -> dict | None:
    """Run as one rank of a torchrun job; rank 0's result, None on the other ranks."""
    import datetime

    import torch
    import torch.distributed as dist

    from commfuse.bench import runner

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    config.check_world(world)
    _check_layers(config)
    device = config.device
    if device is None:
        acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        device = acc.type if acc is not None else "cpu"
    dev = torch.device(device)
    if dev.type != "cpu":
        if dev.index is None:
            dev = torch.device(dev.type, local)
        torch.accelerator.set_device_index(dev.index)
    else:
        torch.set_num_threads(config.threads)
    backend = dist.get_default_backend_for_device(dev)
    dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=config.timeout))
    try:
        result = runner.run_rank(rank, world, config, str(dev), progress)
        dist.barrier()  # leave together
    finally:
        runner.release_backends()
        dist.destroy_process_group()
    return result if rank == 0 else None


def _check_layers(config: BenchConfig) -> None:
    import importlib.util

    for w in config.workloads:
        layer = WORKLOADS[w].layer
        if layer is None:
            continue
        if importlib.util.find_spec("commfuse.nn") is None:
            raise CommfuseValueError(
                f"workload {w} runs commfuse.nn.{layer}, and this installation has no commfuse.nn; "
                "run -w ag_matmul matmul_rs"
            )


def emit(result: dict, config: BenchConfig, args: argparse.Namespace) -> int:
    from commfuse.bench import report

    if result.get("mode") == "compile":
        return _emit_compiled(result, config, args)
    recs = report.records(result, config)
    strands = report.strands_records(result, config)
    attention = report.ring_attention_records(result, config)
    parts = []
    if recs:
        parts.append(report.table(recs, config) + "\n\n" + "\n".join(report.targets(recs, config)) + "\n")
    if strands:
        parts.append(report.strands_table(strands, config) + "\n\n" + "\n".join(report.strands_targets(
            strands, config)) + "\n")
    if attention:
        parts.append(report.ring_attention_table(attention, config) + "\n\n" + "\n".join(
            report.ring_attention_targets(attention, config)) + "\n")
    _write("\n".join(parts), recs + strands + attention, args.json)
    if args.trace:
        from commfuse.bench import trace

        path = trace.write(result, args.trace)
        print(f"wrote a trace of one iteration per algorithm to {path} (open in https://ui.perfetto.dev or "
              "chrome://tracing)", file=sys.stderr)
    if args.plot:
        from commfuse.bench import plot

        path = plot.write(result, args.plot)
        print(f"wrote a Gantt chart of one iteration per algorithm to {path}", file=sys.stderr)
    wrong = [f"{r['workload']} {r['algorithm']}" for r in recs if not r["correct"]]
    if wrong:
        print(f"commfuse bench: results differ from vanilla beyond tolerance: {', '.join(wrong)}", file=sys.stderr)
    wrong_rows = [f"strands {r['block']} {r['row']}" for r in strands if not r["correct"]]
    if wrong_rows:
        print(f"commfuse bench: results differ from ring beyond tolerance: {', '.join(wrong_rows)}", file=sys.stderr)
    wrong_attention = [f"ring_attention {r['row']}" for r in attention if not r["correct"]]
    if wrong_attention:
        print(f"commfuse bench: results differ from the unsharded attention beyond tolerance: "
              f"{', '.join(wrong_attention)}", file=sys.stderr)
    return 1 if wrong or wrong_rows or wrong_attention else 0


def _emit_compiled(result: dict, config: BenchConfig, args: argparse.Namespace) -> int:
    """``--compile``'s table and records; 1 if a workload did not compile or its compiled result differs."""
    from commfuse.bench import report

    recs = report.compile_records(result, config)
    _write(report.compile_table(recs, config) + "\n", recs, args.json)
    broken = [f"{r['workload']} {r['algorithm']}" for r in recs if r["compile_error"]]
    wrong = [f"{r['workload']} {r['algorithm']}" for r in recs if not r["compile_error"] and not r["correct"]]
    if broken:
        print(f"commfuse bench: did not compile with fullgraph=True: {', '.join(broken)}", file=sys.stderr)
    if wrong:
        print(f"commfuse bench: compiled results differ from eager beyond tolerance: {', '.join(wrong)}",
              file=sys.stderr)
    return 1 if broken or wrong else 0


@command("bench", "measure every overlap algorithm side by side on real ranks (docs/benchmarks.md)", arguments)
def run(args: argparse.Namespace) -> int:
    from commfuse.bench import netns

    torchrun = under_torchrun()
    if args.plot and (not torchrun or os.environ.get("RANK") == "0"):  # before any work; rank 0 draws it
        require_extra("bench", "--plot")
    if not torchrun or os.environ.get("RANK") == "0":  # before any work; rank 0 writes them
        check_outputs(args, "json", "trace", "plot")
    config = config_from_args(args)
    progress = not args.no_progress
    if config.link_rate:
        if torchrun:
            raise CommfuseValueError(
                "--link-rate shapes this machine's loopback for the ranks the benchmark launches itself; under "
                "torchrun the ranks use the real network: drop --link-rate"
            )
        # inside() checks the namespaces themselves (this process's against its parent's), so copied or stale
        # variables never make a run shape a loopback it did not create: such a run re-executes like any other
        if netns.inside() != config.link_rate:
            return netns.reexec(to_argv(args), config.link_rate)
        shown = netns.shape_loopback(config.link_rate)
        if progress:
            print(f"commfuse bench: private network namespace, {shown}", file=sys.stderr)
    if torchrun:
        result = execute_torchrun(config, progress=progress)
        if result is None:
            return 0
    else:
        result = execute_config(config, progress=progress)
    return emit(result, config, args)


def fake_config(args: argparse.Namespace) -> tuple[BenchConfig, int]:
    """(the run's config, calls per batch) for ``--fake-pg N``; names the flags that do not apply."""
    n = args.fake_pg
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise CommfuseValueError(f"--fake-pg must be an integer >= 1, got {n!r}")
    refused = [flag for flag, given in (("--link-rate", args.link_rate), ("--trace", args.trace),
                                          ("--plot", args.plot), ("--fingerprint", args.fingerprint),
                                          ("--forward-only", args.forward_only)) if given]
    if refused:
        raise CommfuseValueError(
            f"--fake-pg runs the bare ops in one process with no transfers and no checks; {', '.join(refused)} "
            f"{'does' if len(refused) == 1 else 'do'} not apply there: drop {'it' if len(refused) == 1 else 'them'}"
        )
    if under_torchrun():
        raise CommfuseValueError("--fake-pg runs in one process: start it as a plain command, not under torchrun")
    config = config_from_args(args)
    device = args.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype or ("float32" if device.split(":")[0] == "cpu" else "bfloat16")
    config = dataclasses.replace(config, world_size=n, device=device, dtype=dtype, link_rate=None, trace=False)
    calls = args.calls if args.calls is not None else (2 if device.split(":")[0] == "cpu" else 20)
    if isinstance(calls, bool) or not isinstance(calls, int) or calls < 1:
        raise CommfuseValueError(f"--calls must be an integer >= 1, got {calls!r}")
    return config, calls


def run_fake(args: argparse.Namespace) -> int:
    """``commfuse bench --fake-pg N ...``: one process, the fake group; table (and JSON) of rank 0's op times."""
    config, calls = fake_config(args)
    check_outputs(args, "json")  # before any work
    from commfuse.bench import fakepg

    result = fakepg.run(config, calls, progress=not args.no_progress)
    recs = fakepg.records(result, config)
    text = fakepg.table(recs) + "\n\n" + "\n".join(fakepg.targets(recs)) + "\n"
    _write(text, recs, args.json)
    return 0


def _write(text: str, recs: list, target: str | None) -> None:
    """The table to stdout (to stderr when the JSON records go to stdout, ``--json -``), the records to
    ``target``."""
    (sys.stdout if target != "-" else sys.stderr).write(text)
    if target == "-":
        sys.stdout.write(json.dumps(recs, indent=2) + "\n")
    elif target:
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        Path(target).write_text(json.dumps(recs, indent=2) + "\n")
        print(f"wrote {len(recs)} records to {target}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """``python -m commfuse.bench ...``: the same as ``commfuse bench ...``."""
    p = argparse.ArgumentParser(prog="python -m commfuse.bench",
                                description="measure every overlap algorithm side by side on real ranks")
    arguments(p)
    args = p.parse_args(argv)
    try:
        return getattr(args, "run", run)(args)  # --fake-pg routes to run_fake
    except CommfuseError as e:
        print(f"commfuse bench: error: {e}", file=sys.stderr)
        return 2
