"""The ``commfuse simulate`` subcommand (also ``python -m commfuse.sim``). Imports no torch at module level.

    commfuse simulate --profile NAME|FILE --workload W --tp N --seq S --hidden H [--batch B] [--dp N] ...
    commfuse simulate calibrate [--link-rate RATE] [--output FILE] [--install]
    commfuse simulate profiles

The first prints the predicted table for vanilla, sliced:c, ring and
bidirectional (``--json`` gives ``commfuse bench --json``'s records,
``--plot``/``--trace`` its chart and trace, ``--explain`` the reasons and
crossovers); ``calibrate`` measures this machine and writes a profile;
``profiles`` lists the profiles there are.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from commfuse.cli import command
from commfuse.errors import CommfuseValueError

WORKLOADS = ("mlp", "attention", "ag_matmul", "matmul_rs", "fsdp_linear")


def _csv_ints(text: str, low: int = 1) -> list[int]:
    try:
        values = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers such as '2,4', got {text!r}") from None
    if not values or any(v < low for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= {low}, got {text!r}")
    return values


def _ranks(text: str) -> list[int]:
    return _csv_ints(text, low=0)


def _setting(text: str) -> tuple[str, object]:
    key, eq, value = text.partition("=")
    if not eq or "." not in key:
        raise argparse.ArgumentTypeError(f"--set takes section.field=value (e.g. link.bandwidth=100e9), got {text!r}")
    try:
        parsed: object = float(value)
    except ValueError:
        parsed = value
    return key.strip(), parsed


def arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = (
        "examples:\n"
        "  commfuse simulate --profile paper-table1 --workload mlp --tp 4 --batch 32 --seq 4096 --hidden 4096\n"
        "  commfuse simulate --profile h100-sxm --workload fsdp_linear --dp 1024 --seq 4096 --hidden 8192 --explain\n"
        "  commfuse simulate calibrate --link-rate 800mbit --output local.toml\n"
        "  commfuse simulate profiles\n"
        "see docs/simulator.md"
    )
    sub = p.add_subparsers(dest="action", metavar="ACTION",
                           help="calibrate or list profiles instead of predicting (optional)")
    cal = sub.add_parser("calibrate", help="measure this machine (2 gloo ranks) and write a profile",
                         description="measure this machine (2 gloo ranks, 1 thread each) and write a profile")
    cal.add_argument("--link-rate", metavar="RATE",
                     help="measure behind a loopback limited to RATE (tc units: 800mbit, 2gbit) in a private network "
                     "namespace, as `commfuse bench --link-rate` runs; needs root")
    cal.add_argument("--output", "-o", metavar="FILE", help="write the profile here (default: print it)")
    cal.add_argument("--install", action="store_true",
                     help="also install it as the profile `algorithm=\"auto\"` uses for the gloo backend")
    cal.add_argument("--name", help="the profile's name (default: local-HOST[-RATE])")
    cal.add_argument("--repeats", type=int, default=7, help="repeats per figure (default 7)")
    cal.add_argument("--quick", action="store_true", help="fewer GEMM shapes (a rougher compute fit)")
    cal.add_argument("--raw", metavar="FILE", help="also write the raw measurements as JSON")
    sub.add_parser("profiles", help="list the shipped and installed profiles",
                   description="list the shipped and installed profiles")

    g = p.add_argument_group("what to simulate")
    g.add_argument("--profile", "-p", metavar="NAME|FILE", help="hardware profile: a shipped or installed name, or "
                   "a .toml file (see `commfuse simulate profiles`)")
    g.add_argument("--workload", "-w", choices=WORKLOADS, help="the layer")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (the ring of the TP workloads)")
    g.add_argument("--dp", type=int, default=1, help="data-parallel degree (the ring of fsdp_linear)")
    g.add_argument("--seq", "-s", type=int, help="sequence length (the whole sequence; each TP rank holds seq/tp)")
    g.add_argument("--hidden", type=int, help="hidden size")
    g.add_argument("--batch", "-b", type=int, default=1, help="batch size (per data-parallel rank)")
    g.add_argument("--ffn", type=int, help="MLP inner size (default 4 x hidden)")
    g.add_argument("--dtype", help="element type (default: the profile's)")
    g.add_argument("--pass", dest="passes", choices=("forward", "backward", "both"), default="forward",
                   help="which pass of the layer (default forward; attention, ag_matmul and matmul_rs: forward)")
    g.add_argument("--chunks", type=_csv_ints, default=[2, 4], metavar="C,C",
                   help="the sliced rows to show (default 2,4)")
    g.add_argument("--algorithms", "-a", nargs="+", metavar="A",
                   help="exactly these algorithms instead (ring:m, sliced:c, ...); vanilla is always added")
    g.add_argument("--set", dest="settings", type=_setting, action="append", default=[], metavar="SECTION.FIELD=V",
                   help="override a profile field, e.g. --set link.bandwidth=100e9 (repeatable)")
    g.add_argument("--fingerprint", action="store_true",
                   help="include the ops' fingerprint exchange (default: timed as `commfuse bench` times, without)")
    g.add_argument("--full", action="store_true",
                   help="simulate every rank even when all are alike (slower; the same figures)")
    g = p.add_argument_group("output")
    g.add_argument("--json", nargs="?", const="-", metavar="FILE",
                   help="the records (commfuse bench --json's keys) as JSON to FILE or stdout (the table then goes "
                   "to stderr)")
    g.add_argument("--plot", metavar="FILE", help="Gantt chart of every algorithm (matplotlib; .svg without it)")
    g.add_argument("--trace", metavar="FILE", help="Chrome/Perfetto trace of every algorithm")
    g.add_argument("--ranks", type=_ranks, metavar="R,R",
                   help="ranks in the plot and trace (default: the first 8)")
    g.add_argument("--explain", action="store_true",
                   help="say why: per-op hop vs compute times, and the sequence lengths where the winner changes")


@command("simulate", "predict every overlap algorithm on a hardware profile, or calibrate one (docs/simulator.md)",
         arguments)
def run(args: argparse.Namespace) -> int:
    if args.action == "calibrate":
        return _calibrate(args)
    if args.action == "profiles":
        return _profiles()
    return _simulate(args)


def _need(args: argparse.Namespace, *names: str) -> None:
    missing = [n for n in names if getattr(args, n) is None]
    if missing:
        flags = ", ".join("--" + n for n in missing)
        raise CommfuseValueError(f"commfuse simulate needs {flags} (or an action: calibrate, profiles)")


def _simulate(args: argparse.Namespace) -> int:
    from commfuse import sim
    from commfuse.sim import _planner, _report

    _need(args, "profile", "workload", "seq", "hidden")
    profile = sim.load_profile(args.profile)
    if args.settings:
        profile = profile.replace(**dict(args.settings))
    workload = sim.Workload(args.workload, tp=args.tp, seq=args.seq, hidden=args.hidden, batch=args.batch,
                            dp=args.dp, ffn=args.ffn, dtype=args.dtype or profile.compute.dtype, passes=args.passes)
    if args.algorithms:
        algorithms = [a for item in args.algorithms for a in item.split(",") if a]
    else:
        algorithms = ["vanilla", *(f"sliced:{c}" for c in args.chunks), "ring", "bidirectional"]
    want_timeline = bool(args.plot or args.trace)
    predictions = sim.compare(profile, workload, algorithms, record=want_timeline,
                              symmetric=False if args.full else None, check=args.fingerprint)
    alike = not args.full and all(phase.cost.uniform for a in algorithms for phase in workload.phases(a))
    head = (f"{workload.describe()} on profile {profile.name} ({profile.description or profile.source}); "
            f"{workload.world_size} ranks, " + ("every rank alike (simulated once)" if alike else
                                                "each simulated" + ("" if args.full else " (unequal shards)")))
    text = head + "\n" + _report.table(predictions) + "\n"
    if args.explain:
        text += "\n" + _planner.explain(profile, workload, predictions) + "\n"
    out = sys.stderr if args.json == "-" else sys.stdout
    out.write(text)
    if args.json == "-":
        sys.stdout.write(json.dumps(_report.records(predictions), indent=2) + "\n")
    elif args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(_report.records(predictions), indent=2) + "\n")
        print(f"wrote {len(predictions)} records to {args.json}", file=sys.stderr)
    if args.trace:
        path = _report.write_trace(predictions, args.trace, args.ranks)
        print(f"wrote the predicted trace to {path} (open in https://ui.perfetto.dev or chrome://tracing)",
              file=sys.stderr)
    if args.plot:
        path = _report.write_plot(predictions, args.plot, args.ranks)
        print(f"wrote the predicted Gantt chart to {path}", file=sys.stderr)
    return 0


def _profiles() -> int:
    from commfuse.sim import _profile

    rows = [("NAME", "WHERE", "DESCRIPTION")]
    for name in _profile.shipped():
        p = _profile.load_profile(name)
        rows.append((name, "shipped", p.description))
    folder = _profile.user_dir()
    if folder.is_dir():
        for path in sorted(folder.glob("*.toml")):
            try:
                desc = _profile.load_profile(str(path)).description
            except _profile.ProfileError as e:
                desc = f"BROKEN: {e}"
            rows.append((path.stem, str(path), desc))
    width = [max(len(r[i]) for r in rows) for i in range(2)]
    for r in rows:
        print(f"{r[0]:<{width[0]}}  {r[1]:<{width[1]}}  {r[2]}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from commfuse.sim import _calibrate, _profile

    rate = args.link_rate
    if rate and not _calibrate.inside(rate):
        argv = ["calibrate", "--link-rate", rate, "--repeats", str(args.repeats)]
        for flag in ("output", "name", "raw"):
            if getattr(args, flag):
                value = getattr(args, flag)
                argv += [f"--{flag}", str(Path(value).resolve()) if flag != "name" else value]
        if args.install:
            argv.append("--install")
        if args.quick:
            argv.append("--quick")
        return _calibrate.in_namespace(argv, rate)
    if rate:
        shown = _calibrate.shape_here(rate)
        print(f"commfuse simulate calibrate: private network namespace, {shown}", file=sys.stderr)
    print("commfuse simulate calibrate: measuring (2 gloo ranks, 1 thread each)...", file=sys.stderr)
    profile, comments, raw = _calibrate.calibrate(rate, repeats=args.repeats, quick=args.quick, name=args.name or "")
    if args.raw:
        Path(args.raw).write_text(json.dumps(raw))
    text = profile.to_toml(comments, header=_calibrate.header(profile, rate))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text)
        print(f"wrote profile {profile.name!r} to {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    if args.install:
        target = _profile.user_dir() / "gloo.toml"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        print(f"installed it as {target}: algorithm=\"auto\" on the gloo backend now uses it", file=sys.stderr)
    return 0
