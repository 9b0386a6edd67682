"""The ``commfuse simulate`` subcommand (also ``python -m commfuse.sim``). Imports no torch at module level.

    commfuse simulate --profile NAME|FILE --workload W --tp N --seq S --hidden H [--batch B] [--dp N] ...
    commfuse simulate --profile NAME|FILE --model llama3-8b|llama3-70b|llama3-405b|deepseek-v3 --tp N [--seq S ...]
    commfuse simulate --profile NAME|FILE --preset mixtral-8x7b|deepseek-v3 [--ep N --experts E --topk K ...]
    commfuse simulate --profile NAME|FILE -w ring_attention --cp N --seq S --hidden H [--heads Q --kv-heads K ...]
    commfuse simulate calibrate [--link-rate RATE] [--output FILE] [--install]
    commfuse simulate profiles

The first prints the predicted table for vanilla, sliced:c, ring and
bidirectional (``--json`` gives ``commfuse bench --json``'s records,
``--plot``/``--trace`` its chart and trace, ``--explain`` the reasons and
crossovers); ``--model`` the same for one training step of a whole model's
tensor-parallel layers (``commfuse.sim.MODELS``); ``calibrate`` measures this
machine and writes a profile; ``profiles`` lists the profiles there are.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from commfuse.cli import check_output_file, check_outputs, command, integer
from commfuse.errors import CommfuseValueError

WORKLOADS = ("mlp", "attention", "ag_matmul", "matmul_rs", "fsdp_linear", "moe", "ring_attention")
#: ``commfuse.sim._ring_attention``'s rows when not told, and its layouts (repeated: parsing imports no simulator).
RING_ATTENTION_ALGORITHMS = ("vanilla", "ring", "bidirectional", "ulysses")
LAYOUTS = ("zigzag", "contiguous", "none")
#: ``commfuse.sim.MOE_PRESETS``'s names (repeated here: parsing imports no simulator).
MOE_PRESETS = ("mixtral-8x7b", "deepseek-v3")
#: ``commfuse.sim.MODELS``'s names (repeated here for the same reason; a unit test keeps them equal).
MODELS = ("llama3-8b", "llama3-70b", "llama3-405b", "deepseek-v3")
#: The flags a ``--model`` fixes itself (its shapes, its workloads), by dest.
MODEL_FIXES = ("workload", "preset", "hidden", "ffn", "heads", "kv_heads", "head_dim", "causal", "gated", "cp",
               "layout", "kv_replicate", "experts", "topk", "skew", "grouping", "dp")
#: The flags that shape a head count or a head: the attention and ring_attention workloads take them.
HEAD_FLAGS = ("heads", "kv_heads", "head_dim")
#: The flags only the moe workload takes (their dests), and its defaults when neither they nor a preset say.
MOE_FLAGS = ("ep", "experts", "topk", "skew", "grouping")
MOE_DEFAULTS = {"ep": 1, "experts": 8, "topk": 2, "skew": 1.0, "grouping": "step"}
#: What Comet (ByteDance, "Comet: Fine-grained Computation-communication Overlapping for Mixture-of-Experts",
#: MLSys'25) reports, printed beside the moe predictions: its single-MoE-layer speed-up, its end-to-end
#: speed-up (both averages over its models), and the largest share of a layer's time the all-to-all took.
COMET_LAYER_SPEEDUP, COMET_E2E_SPEEDUP, COMET_A2A_SHARE = 1.96, 1.71, 0.47


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
        "  commfuse simulate --profile h100-sxm --model llama3-70b --tp 8\n"
        "  commfuse simulate --profile h100-sxm --workload fsdp_linear --dp 1024 --seq 4096 --hidden 8192 --explain\n"
        "  commfuse simulate --profile ascend-910b --preset deepseek-v3\n"
        "  commfuse simulate --profile h100-sxm --workload moe --ep 8 --experts 8 --topk 2 --seq 8192 --hidden 4096 "
        "--ffn 14336\n"
        "  commfuse simulate --profile h100-sxm -w ring_attention --cp 8 --seq 131072 --hidden 8192 --heads 64 "
        "--kv-heads 8 -a vanilla ring bidirectional ulysses 2d:2x4 2d:4x2\n"
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
    cal.add_argument("--repeats", type=integer(1), default=7, help="repeats per figure (default 7)")
    cal.add_argument("--quick", action="store_true", help="fewer GEMM shapes (a rougher compute fit)")
    cal.add_argument("--raw", metavar="FILE", help="also write the raw measurements as JSON")
    sub.add_parser("profiles", help="list the shipped and installed profiles",
                   description="list the shipped and installed profiles")

    g = p.add_argument_group("what to simulate")
    g.add_argument("--profile", "-p", metavar="NAME|FILE", help="hardware profile: a shipped or installed name, or "
                   "a .toml file (see `commfuse simulate profiles`)")
    g.add_argument("--workload", "-w", choices=WORKLOADS, help="the layer (moe: one mixture-of-experts layer under "
                   "expert parallelism, its dispatch and combine fused with the expert GEMMs)")
    g.add_argument("--model", choices=MODELS,
                   help="one training step of a whole model's tensor-parallel layers instead of one workload: the "
                   "model's attention (causal, its K/V heads or latent attention), MLP or MoE layers and LM head, "
                   "forward and backward (--pass), batch 1 x its pretraining context (--seq, --batch) under --tp "
                   "with sequence parallelism; deepseek-v3's routed experts over --ep (default --tp) "
                   "(docs/simulator.md)")
    g.add_argument("--tp", type=integer(1), default=None,
                   help="tensor-parallel degree (the ring of the TP workloads; default 1, and --model needs it)")
    g.add_argument("--dp", type=integer(1), default=1, help="data-parallel degree (the ring of fsdp_linear)")
    g.add_argument("--seq", "-s", type=integer(1),
                   help="sequence length (the whole sequence; each TP rank holds seq/tp; "
                   "moe: tokens per EP rank are batch x seq)")
    g.add_argument("--hidden", type=integer(1), help="hidden size")
    g.add_argument("--batch", "-b", type=integer(1), default=None,
                   help="batch size (per data-parallel rank; default 1)")
    g.add_argument("--ffn", type=integer(1), help="MLP inner size (default 4 x hidden; moe: each expert's)")
    g.add_argument("--dtype", help="element type (default: the profile's)")
    g.add_argument("--pass", dest="passes", choices=("forward", "backward", "both"), default=None,
                   help="which pass of the layer (default forward; moe and --model both)")
    g.add_argument("--swiglu", dest="gated", action="store_true", default=None,
                   help="-w mlp: a SwiGLU MLP, as Llama's (the gate and up projections in one gathered GEMM of "
                   "2 x ffn columns)")
    g = p.add_argument_group("attention (--workload attention, ring_attention)")
    g.add_argument("--heads", type=integer(1), help="query heads (default: attention, heads of hidden / tp columns "
                   "per rank; ring_attention, hidden / 128)")
    g.add_argument("--kv-heads", dest="kv_heads", type=integer(1), help="key/value heads (default --heads; fewer: "
                   "grouped-query attention)")
    g.add_argument("--head-dim", dest="head_dim", type=integer(1), help="head dim (default hidden / heads)")
    g.add_argument("--no-causal", dest="causal", action="store_false", default=None,
                   help="-w attention: every query attends to the whole sequence (default: causal; ring_attention's "
                   "is --layout none)")
    g.add_argument("--cp", type=integer(1), help="ring_attention: context-parallel degree, the ranks the sequence is "
                   "split over")
    g.add_argument("--layout", choices=LAYOUTS, help="how the sequence is laid out over the ranks: zigzag (default, "
                   "causal, every ring step equal), contiguous (causal, unbalanced) or none (not causal)")
    g.add_argument("--kv-replicate", dest="kv_replicate", action="store_true", default=None,
                   help="let Ulysses run over more ranks than K/V heads by copying each K/V head to cp/kv-heads ranks")
    g = p.add_argument_group("mixture of experts (--workload moe)")
    g.add_argument("--preset", choices=MOE_PRESETS,
                   help="a known MoE layer, EP 8, 8192 tokens per rank: mixtral-8x7b (hidden 4096, ffn 14336, "
                   "8 experts, top-2) or deepseek-v3 (hidden 7168, ffn 2048, 256 routed experts, top-8; the shared "
                   "expert left out); implies --workload moe, and the flags given override its sizes")
    g.add_argument("--ep", type=integer(1), help="expert-parallel degree: the ranks of the all-to-alls (default 1)")
    g.add_argument("--experts", type=integer(1), help="routed experts, a multiple of --ep (default 8)")
    g.add_argument("--topk", type=integer(1), help="experts per token, at most --experts (default 2)")
    g.add_argument("--skew", type=float,
                   help="routing skew: rank 0's share of every rank's rows over the balanced share, 1 (default, "
                   "balanced) to --ep")
    g.add_argument("--moe-grouping", dest="grouping", choices=("step", "source"),
                   help="how the expert GEMMs are called: step (default: one grouped GEMM per schedule step, "
                   "chunks computed as they arrive) or source (one per source's whole block, as commfuse.nn.MoE "
                   "does now)")
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
    g.add_argument("--strands", action="store_true",
                   help="two strands instead of one layer: a whole block (-w attention or mlp: the Llama block "
                        "under --tp; -w moe: the MoE block under --ep) as stages, two micro-batches' forward and "
                        "backward, the second's forward beside the first's backward; prints the searched plan and "
                        "its predicted step time against per-op rings (docs/simulator.md)")
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
    from commfuse.bench import sim_report as _report

    if args.model:
        return _model(args)
    if args.tp is None:
        args.tp = 1
    moe = _moe_arguments(args)
    _need(args, "profile", "workload", "seq", "hidden")
    check_outputs(args, "json", "plot", "trace")  # before any work
    profile = sim.load_profile(args.profile)
    if args.settings:
        profile = profile.replace(**dict(args.settings))
    if args.strands:
        return _strands(args, profile, moe)
    _check_workload_flags(args)
    if args.workload == "ring_attention":
        return _ring_attention(args, profile)
    passes = args.passes or ("both" if args.workload == "moe" else "forward")
    batch = 1 if args.batch is None else args.batch
    extra = {}
    if args.workload == "attention":
        extra = {f: getattr(args, f) for f in (*HEAD_FLAGS, "causal")}
    elif args.workload == "mlp":
        extra = {"gated": bool(args.gated)}
    workload = sim.Workload(args.workload, tp=args.tp, seq=args.seq, hidden=args.hidden, batch=batch,
                            dp=args.dp, ffn=args.ffn, dtype=args.dtype or profile.compute.dtype, passes=passes, **moe,
                            **extra)
    if args.algorithms:
        algorithms = [a for item in args.algorithms for a in item.split(",") if a]
    elif args.workload == "moe":  # all-to-all has no bidirectional form; ring:2 shows the parts instead
        algorithms = ["vanilla", *(f"sliced:{c}" for c in args.chunks), "ring", "ring:2"]
    else:
        algorithms = ["vanilla", *(f"sliced:{c}" for c in args.chunks), "ring", "bidirectional"]
    want_timeline = bool(args.plot or args.trace)
    predictions = sim.compare(profile, workload, algorithms, record=want_timeline,
                              symmetric=False if args.full else None, check=args.fingerprint)
    alike = not args.full and all(phase.cost.uniform for a in algorithms for phase in workload.phases(a))
    head = (f"{workload.describe()} on profile {profile.name} ({profile.description or profile.source}); "
            f"{workload.world_size} ranks, " + ("every rank alike (simulated once)" if alike else
                                                "each simulated" + ("" if args.full else
                                                                    " (causal: unequal steps)" if workload.causal
                                                                    else " (unequal shards)")))
    text = head + "\n" + _report.table(predictions) + "\n"
    if workload.name == "moe":
        text += _comet_lines(predictions) + "\n"
    if args.explain:
        text += "\n" + sim.explain(profile, workload, predictions) + "\n"
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


def _flags(dests, singular: str = "", plural: str = "") -> str:
    """The flags of ``dests`` (argparse dests), comma-separated, then ``singular`` or ``plural`` by their number."""
    text = ", ".join({"gated": "--swiglu", "causal": "--no-causal", "grouping": "--moe-grouping",
                      "passes": "--pass"}.get(f, "--" + f.replace("_", "-")) for f in dests)
    verb = singular if len(dests) == 1 else plural
    return f"{text} {verb}" if verb else text


def _check_workload_flags(args: argparse.Namespace) -> None:
    """Refuse, naming the flags, those the workload does not take (checked here so that the message names the
    command's flags, not the Python API's keywords)."""
    w = args.workload
    only = {"cp": ("ring_attention",), "layout": ("ring_attention",), "kv_replicate": ("ring_attention",),
            "heads": ("ring_attention", "attention"), "kv_heads": ("ring_attention", "attention"),
            "head_dim": ("ring_attention", "attention"), "causal": ("attention",), "gated": ("mlp",)}
    wrong: dict[tuple, list[str]] = {}
    for f, takes in only.items():
        if getattr(args, f) is not None and w not in takes:
            wrong.setdefault(takes, []).append(f)
    if wrong:
        said = "; ".join(f"{_flags(fs, 'applies', 'apply')} to --workload {' or '.join(sorted(takes))} only"
                         for takes, fs in wrong.items())
        hint = " (ring_attention's causal mask is its --layout: --layout none)" if w == "ring_attention" and \
            args.causal is not None else ""
        raise CommfuseValueError(f"{said}, not {w}{hint}")
    if w == "attention" and args.heads is None:
        needs = [f for f in ("kv_heads", "head_dim") if getattr(args, f) is not None]
        if needs:
            raise CommfuseValueError(f"{_flags(needs, 'needs', 'need')} --heads (the query heads) with --workload "
                                     "attention")


def _model(args: argparse.Namespace) -> int:
    """``--model``: one training step of a model preset's tensor-parallel layers, every algorithm."""
    from commfuse import sim

    fixed = [f for f in MODEL_FIXES if getattr(args, f) not in (None, 1 if f == "dp" else None)]
    if fixed:
        raise CommfuseValueError(f"--model {args.model} fixes its own shapes and layers; "
                                 f"{_flags(fixed, 'does', 'do')} not apply (give --workload with your own sizes "
                                 "instead)")
    for flag in ("plot", "trace", "explain", "strands"):
        if getattr(args, flag):
            raise CommfuseValueError(f"--model prints its table (and --json); --{flag} is not supported for it yet")
    _need(args, "profile")
    if args.tp is None:
        raise CommfuseValueError(f"--model {args.model} needs --tp, the tensor-parallel degree (e.g. --tp 8: the "
                                 "GPUs of one server)")
    model = sim.MODELS[args.model]
    if args.ep is not None and not model.experts:
        raise CommfuseValueError(f"--ep applies to a mixture-of-experts model (deepseek-v3), not {args.model}")
    check_outputs(args, "json")
    profile = sim.load_profile(args.profile)
    if args.settings:
        profile = profile.replace(**dict(args.settings))
    algorithms = ([a for item in args.algorithms for a in item.split(",") if a] if args.algorithms else
                  ["vanilla", *(f"sliced:{c}" for c in args.chunks), "ring", "bidirectional"])
    predictions = sim.compare_model(profile, model, algorithms, tp=args.tp, seq=args.seq,
                                    batch=1 if args.batch is None else args.batch, ep=args.ep, dtype=args.dtype,
                                    passes=args.passes or "both", symmetric=False if args.full else None,
                                    check=args.fingerprint)
    out = sys.stderr if args.json == "-" else sys.stdout
    out.write(model_table(predictions, profile) + "\n")
    if args.json:
        data = json.dumps([p.record() for p in predictions], indent=2) + "\n"
        if args.json == "-":
            sys.stdout.write(data)
        else:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(data)
            print(f"wrote {len(predictions)} records to {args.json}", file=sys.stderr)
    return 0


def model_table(predictions, profile) -> str:
    """The ``--model`` table: per algorithm each part's time in the step (one of it times its count), the step's
    time, compute-only time, exposed communication, speed-up over vanilla and MFU; then the gain, the best
    algorithm of each part, and what is modelled."""
    first = predictions[0]
    model, parts = first.model, [part for part, _ in first.parts]
    w = parts[0].workload
    passes = {"both": "forward + backward", "forward": "forward", "backward": "backward"}[w.passes]
    lines = [model.describe(),
             f"one training step ({passes}) of its tensor-parallel layers: TP {w.tp} with sequence parallelism, "
             f"batch {w.batch} x seq {w.seq} tokens, {w.dtype}, on profile {profile.name} "
             f"({profile.description or profile.source})", ""]
    cols = ("algorithm", *(f"{part.name} x{part.count}" for part in parts), "step ms", "compute-only", "exposed",
            "vs vanilla", "MFU")
    rows = [cols]
    for p in predictions:
        rows.append((p.algorithm, *(f"{1e3 * part.count * q.time:.2f}" for part, q in p.parts), f"{1e3 * p.time:.2f}",
                     f"{1e3 * p.compute_only:.2f}", f"{1e3 * p.exposed:.2f}", f"{p.speedup_vs_vanilla:.3f}x",
                     f"{100 * p.mfu:.1f}%"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    for i, r in enumerate(rows):
        lines.append("  ".join([r[0].ljust(widths[0])] + [c.rjust(wd) for c, wd in zip(r[1:], widths[1:])]))
        if i == 0:
            lines.append("  ".join("-" * wd for wd in widths))
    vanilla = next(p for p in predictions if p.algorithm == "vanilla")
    best = min(predictions, key=lambda p: p.time)
    ms = 1e3
    lines.append("")
    if best is vanilla:
        lines.append(f"gain: none; vanilla is fastest at {ms * vanilla.time:.2f} ms a step")
    else:
        saved = vanilla.time - best.time
        lines.append(f"gain: {best.algorithm} takes {ms * best.time:.2f} ms a step against vanilla's "
                     f"{ms * vanilla.time:.2f} ms: {ms * saved:.2f} ms ({100 * saved / vanilla.time:.1f}%) less, "
                     f"{best.speedup_vs_vanilla:.3f}x; vanilla leaves {ms * vanilla.exposed:.2f} ms of communication "
                     f"exposed, {best.algorithm} {ms * best.exposed:.2f} ms")
    each = []
    step = 0.0
    for i, part in enumerate(parts):
        if part.workload.world_size == 1:
            step += part.count * predictions[0].parts[i][1].time
            each.append(f"{part.name} (no communication)")
            continue
        t, _, a = min((p.parts[i][1].time, k, p.algorithm) for k, p in enumerate(predictions))  # ties: the first
        step += part.count * t
        each.append(f"{part.name} {a}")
    lines.append(f"best of each part: {', '.join(each)}: {ms * step:.2f} ms a step "
                 f"({vanilla.time / step:.3f}x vanilla)")
    lines.append("exposed: the step's time less its compute-only time (the same ops with transfers that take no "
                 "time), as commfuse bench measures it")
    notes = ["modelled: each kind of layer part simulated once and multiplied by its count; left out: the "
             "embedding, norms, residual adds, RoPE, the softmax's and the loss's elementwise work, data-parallel "
             "gradient reduction, pipeline stages and the optimizer"]
    moe = next((part for part in parts if part.workload.name == "moe"), None)
    if moe is not None:
        notes.append(f"moe: the routed experts over ep {moe.workload.ep} ranks, each rank's {moe.workload.tokens} "
                     "tokens (seq / tp) dispatched and combined; the all-to-all has no bidirectional form, so that "
                     "row runs the experts' ring; the shared expert runs on each rank's own tokens, with no "
                     "communication; DeepSeek-V3's multi-token-prediction module is left out")
    lines += notes
    return "\n".join(lines)


def _strands(args: argparse.Namespace, profile, moe: dict) -> int:
    """``--strands``: the block's stages, the searched plan of the second micro-batch's forward beside the
    first's backward, and the step predicted four ways."""
    from commfuse.sim import _strands as strands

    for flag in ("json", "plot", "trace", "explain", "full", "algorithms"):
        if getattr(args, flag):
            raise CommfuseValueError(f"--strands prints its plan and figures only; --{flag} does not apply")
    batch = 1 if args.batch is None else args.batch
    tokens = batch * args.seq
    ffn = args.ffn or 4 * args.hidden
    if args.workload == "moe":
        forward, backward = strands.moe_stages(profile, ep=moe["ep"], tokens=tokens, seq=args.seq,
                                               hidden=args.hidden, ffn=ffn, topk=moe["topk"])
        what = f"MoE block, EP {moe['ep']}, {tokens} tokens per rank, hidden {args.hidden}, expert ffn {ffn}, " \
               f"top-{moe['topk']}"
    elif args.workload in ("attention", "mlp"):
        forward, backward = strands.llama_stages(profile, tp=args.tp, tokens=tokens, seq=args.seq,
                                                 hidden=args.hidden, ffn=ffn)
        what = f"Llama block, TP {args.tp} with SP, {tokens} tokens, hidden {args.hidden}, ffn {ffn}"
    else:
        raise CommfuseValueError(f"--strands simulates a block: -w attention or mlp (the Llama block under --tp) or "
                                 f"-w moe (the MoE block under --ep), not -w {args.workload}")
    step = strands.predict_step(forward, backward, slowdown=profile.contention.compute_slowdown)
    ms = 1e3
    lines = [f"two strands: {what}, {profile.dtype_bytes}-byte elements, on profile {profile.name}; two "
             "micro-batches, forward + backward, the second's forward beside the first's backward",
             "", f"  {'stage':<38} {'compute ms':>10} {'comm ms':>9} {'alone ms':>9}"]
    for stage in step.forward + step.backward:
        lines.append(f"  {stage.name:<38} {ms * stage.compute:10.3f} {ms * stage.comm:9.3f} {ms * stage.alone:9.3f}")
    lines += ["", "searched plan (forward of micro-batch 2 | backward of micro-batch 1):", *step.searched.lines(), "",
              f"  {'schedule':<44} {'step ms':>9} {'vs per-op ring':>15}"]
    rows = [("vanilla (compute, then comm)", step.vanilla), ("per-op ring, micro-batches in turn", step.per_op),
            ("two strands, naive alternation", step.strands(step.naive)),
            ("two strands, searched plan", step.strands(step.searched)),
            ("limit: max(total compute, total comm)", step.limit)]
    for name, seconds in rows:
        lines.append(f"  {name:<44} {ms * seconds:9.3f} {step.per_op / seconds:14.2f}x")
    comm = sum(s.comm for s in step.forward + step.backward)
    compute = sum(s.compute for s in step.forward + step.backward)
    lines.append(f"comm / compute of the block: {comm / compute:.2f}" if compute else "")
    print("\n".join(lines))
    return 0


def _ring_attention(args: argparse.Namespace, profile) -> int:
    """``-w ring_attention``: every algorithm's forward and backward predicted, one row each."""
    from commfuse import sim
    from commfuse.bench import sim_report as _report

    for flag in ("plot", "trace", "explain"):
        if getattr(args, flag):
            raise CommfuseValueError(f"-w ring_attention prints its table (and --json); --{flag} is not supported "
                                     f"for it yet")
    if args.cp is None:
        raise CommfuseValueError("-w ring_attention needs --cp (the context-parallel degree)")
    if args.passes is not None:
        raise CommfuseValueError("-w ring_attention predicts the forward and the backward, each in its own column; "
                                 "--pass does not apply")
    algorithms = ([a for item in args.algorithms for a in item.split(",") if a] if args.algorithms
                  else list(RING_ATTENTION_ALGORITHMS))
    shape = dict(tp=args.tp, dp=args.dp, seq=args.seq, hidden=args.hidden,
                 batch=1 if args.batch is None else args.batch,
                 dtype=args.dtype or profile.compute.dtype, cp=args.cp, heads=args.heads, kv_heads=args.kv_heads,
                 head_dim=args.head_dim, layout=args.layout or "zigzag", kv_replicate=bool(args.kv_replicate))
    symmetric = False if args.full else None
    forward = sim.compare(profile, sim.Workload("ring_attention", passes="forward", **shape), algorithms,
                          symmetric=symmetric, check=args.fingerprint)
    backward = sim.compare(profile, sim.Workload("ring_attention", passes="backward", **shape), algorithms,
                           symmetric=symmetric, check=args.fingerprint)
    text = ring_attention_table(forward, backward, profile)
    out = sys.stderr if args.json == "-" else sys.stdout
    out.write(text + "\n")
    if args.json:
        data = json.dumps(_report.records(forward + backward), indent=2) + "\n"
        if args.json == "-":
            sys.stdout.write(data)
        else:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(data)
            print(f"wrote {len(forward) + len(backward)} records to {args.json}", file=sys.stderr)
    return 0


def ring_attention_table(forward, backward, profile) -> str:
    """The ring_attention table: per algorithm the forward, backward and total time, exposed communication
    (time less compute-only, as a share of the time) and the speed-up over vanilla; then the fastest."""
    w = forward[0].workload
    head = (f"{w.describe().replace('ring_attention forward', 'ring_attention forward + backward')} "
            f"on profile {profile.name} ({profile.description or profile.source})")
    cols = ("algorithm", "forward ms", "exposed", "backward ms", "exposed", "total ms", "exposed", "vs vanilla")
    rows = [cols]
    vanilla = next(f.time + b.time for f, b in zip(forward, backward) if f.algorithm == "vanilla")
    totals = []
    for f, b in zip(forward, backward):
        total = f.time + b.time
        totals.append((total, f.algorithm))
        rows.append((_label(f.algorithm), f"{1e3 * f.time:.3f}", _share(f.exposed, f.time), f"{1e3 * b.time:.3f}",
                     _share(b.exposed, b.time), f"{1e3 * total:.3f}", _share(f.exposed + b.exposed, total),
                     f"{vanilla / total:.3f}x"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = [head, ""]
    for i, r in enumerate(rows):
        lines.append("  ".join([r[0].ljust(widths[0])] + [c.rjust(wd) for c, wd in zip(r[1:], widths[1:])]))
        if i == 0:
            lines.append("  ".join("-" * wd for wd in widths))
    fastest = {name: _fastest([(p.time, p.algorithm) for p in preds])
               for name, preds in (("forward", forward), ("backward", backward))}
    lines += ["", f"fastest: {_fastest(totals)} (forward + backward); forward {fastest['forward']}, "
              f"backward {fastest['backward']}",
              "exposed: communication not hidden (time less the compute-only time), as a share of that time",
              f"links: profile {profile.name} has one link figure ({profile.link.topology}, "
              f"{profile.link.bandwidth / 1e9:g} GB/s per direction): the links inside one server; the 2-D forms' ring "
              "uses it too (no separate inter-node figure)"]
    names = [p.algorithm for p in forward]
    if any(a == "ulysses" or a.startswith("2d:") for a in names):
        u = max((p.workload.cp if a == "ulysses" else int(a.split("x")[1])) for p, a in zip(forward, names)
                if a == "ulysses" or a.startswith("2d:"))
        how = ("each rank attends with whole K/V heads" if w.kv_heads >= u else
               f"each K/V head copied to {u // w.kv_heads} ranks (--kv-replicate)")
        lines.append(f"ulysses: degree {u} with {w.kv_heads} K/V heads: {how}; Ulysses over more ranks than K/V "
                     "heads needs --kv-replicate")
    return "\n".join(lines)


def _fastest(timed: list) -> str:
    """The fastest algorithm's label, or every one tied with it (times within 1e-9 relative) joined by ' = '."""
    best = min(t for t, _ in timed)
    return " = ".join(_label(a) for t, a in timed if t <= best * (1 + 1e-9))


def _label(algorithm: str) -> str:
    if algorithm.startswith("2d:"):
        r, u = algorithm[3:].split("x")
        return f"{algorithm} (ring {r} x ulysses {u})"
    return algorithm


def _share(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole > 0 else "-"


def _moe_arguments(args: argparse.Namespace) -> dict:
    """The moe workload's keyword arguments from its flags and ``--preset`` (which also fills the shared sizes
    that were not given); a moe flag with another workload is an error."""
    if args.preset:
        from commfuse.sim import MOE_PRESETS as presets

        if args.workload not in (None, "moe"):
            raise CommfuseValueError(f"--preset {args.preset} is a moe layer; it cannot be --workload {args.workload}")
        args.workload = "moe"
        for key, value in presets[args.preset].items():
            if getattr(args, key) is None:
                setattr(args, key, value)
    given = [f for f in MOE_FLAGS if getattr(args, f) is not None]
    if args.workload != "moe":
        if given:
            flags = ", ".join("--" + ("moe-grouping" if f == "grouping" else f) for f in given)
            raise CommfuseValueError(f"{flags} apply to --workload moe only, not {args.workload or 'no workload'}")
        return {}
    if args.tp != 1 or args.dp != 1:
        raise CommfuseValueError(f"--workload moe simulates one expert-parallel group: give its size as --ep, not "
                                 f"--tp {args.tp} / --dp {args.dp}")
    return {f: MOE_DEFAULTS[f] if getattr(args, f) is None else getattr(args, f) for f in MOE_FLAGS}


def _comet_lines(predictions) -> str:
    """Beside the moe table: vanilla's all-to-all share and the best speed-up, with Comet's published figures."""
    vanilla = next(p for p in predictions if p.algorithm == "vanilla")
    share = vanilla.exposed / vanilla.time if vanilla.time > 0 else 0.0
    best = max(predictions, key=lambda p: p.speedup_vs_vanilla or 0.0)
    return (f"all-to-all share of vanilla's layer time: {100 * share:.1f}% (vanilla's time less its compute-only "
            f"time; Comet reports up to {100 * COMET_A2A_SHARE:.0f}%)\n"
            f"best: {best.algorithm} at {best.speedup_vs_vanilla:.3f}x vanilla; Comet (ByteDance, MLSys'25) reports "
            f"{COMET_LAYER_SPEEDUP:.2f}x for a single MoE layer and {COMET_E2E_SPEEDUP:.2f}x end to end (averages, "
            f"on its own models and cluster)")


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
    from commfuse.bench import calibrate as _calibrate
    from commfuse.sim import _profile

    rate = args.link_rate
    check_outputs(args, "output", "raw")  # before any work
    if args.install:
        check_output_file("--install", _profile.user_dir() / "gloo.toml")
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
