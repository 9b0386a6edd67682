"""From the ranks' times to records, the table and the targets. Imports no torch.

Per algorithm, over the repeats (each repeat's figure is the slowest rank's):

- ``median_ms`` (with ``p25_ms``/``p75_ms``, ``min_ms``/``max_ms``): the normal run;
- ``compute_only_ms``: the same schedule and per-shard compute with the
  transfers removed; ``comm_only_ms``: the same transfers with the compute
  removed (:func:`commfuse.runtime.measure`); both medians;
- ``outside_ms``: time spent outside the fused ops (activations, attention
  cores, weight gradients of the layer workloads; argument checks and
  allocations of the bare ops), which all three runs contain; ``null`` where
  host spans do not show device time (accelerators);
- ``exposed_ms = median_ms - compute_only_ms``: the communication the
  algorithm did not hide (what it adds on top of computing alone);
- ``hidden_fraction``: the time hidden over the most that could be hidden,
  :func:`hidden_fraction` of the median, the pure compute
  (``compute_only - outside``) and the pure communication
  (``comm = comm_only - outside``): 1 means overlap as perfect as the
  shorter side allows, 0 that the run took as long as computing and
  communicating one after the other (docs/benchmarks.md, "The hidden
  fraction"; the conformance suite's overlap tier judges the same figure);
- ``exposed_fraction = exposed / comm``, not clipped above;
- ``speedup_vs_vanilla``: vanilla's median over this one;
- ``collective_effect`` and ``overlap_effect``: the workload's ring speed-up
  over vanilla taken apart with ``serial`` (the ring's hops and compute with
  no overlap): ``collective_effect = vanilla / serial`` (the same compute,
  the ring's hops instead of the library's collective, neither overlapped)
  and ``overlap_effect = serial / ring`` (the same hops, overlapped or not);
  their product is ring's ``speedup_vs_vanilla``. Figures of the workload,
  the same on each of its records; ``null`` unless vanilla, serial and ring
  all ran;
- ``correct``: the first (checked) run's result equals vanilla's within the
  dtype's tolerance on every rank (``max_rel_error`` says by how much); for
  ``moe`` every algorithm's, vanilla's included, equals the one-process
  ``moe_reference``'s;
- ``routing`` (``moe`` only, else null): per source rank, the token rows
  (top-k slots) its tokens send to each rank's experts.
"""

from __future__ import annotations

import math
import statistics

from commfuse.schedule import hidden_fraction  # noqa: F401 - the bench's figure, defined once there
from commfuse.schedule import parse_algorithm
from commfuse.bench.config import STRAND_ROWS, BenchConfig, describe_rate

SCHEMA_KEYS = (
    "workload", "algorithm", "taken", "world_size", "backend", "device", "dtype", "shape", "link_rate", "repeats",
    "median_ms", "p25_ms", "p75_ms", "min_ms", "max_ms", "compute_only_ms", "comm_only_ms", "outside_ms",
    "exposed_ms", "exposed_fraction", "speedup_vs_vanilla", "collective_effect", "overlap_effect",
    "hidden_fraction", "correct", "max_rel_error", "unmeasured", "load", "cpus", "routing",
)


def _quartiles(xs: list[float]) -> tuple[float, float]:
    if len(xs) < 2:
        return xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[2]


def _r(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def _median_ms(xs) -> float | None:
    """Median in ms of the finite values (a mode a workload could not run in is NaN), or None."""
    finite = [1e3 * x for x in xs if x == x]
    return statistics.median(finite) if finite else None


def records(run: dict, config: BenchConfig) -> list[dict]:
    """One record per (workload, algorithm) from the result of rank 0."""
    out = []
    n = run["world_size"]
    for res in run["results"]:
        if res.get("kind") in ("strands", "ring_attention"):  # rows of their own: strands_records, ring_attention_records
            continue
        wall = res["wall_s"]  # [repeat][algorithm][mode]
        algs = res["algorithms"]
        single_op = res["workload"] in ("ag_matmul", "matmul_rs")
        rows = []
        for i, alg in enumerate(algs):
            total = [1e3 * r[i][0] for r in wall]
            comp = _median_ms(r[i][1] for r in wall)
            comm_only = _median_ms(r[i][2] for r in wall)
            outside = None
            if res["outside_s"] is not None:
                outside = _median_ms(r[i] for r in res["outside_s"])
            elif single_op:
                outside = 0.0
            med = statistics.median(total)
            p25, p75 = _quartiles(total)
            exposed = None if comp is None else med - comp
            hidden = None
            comm = None if outside is None or comm_only is None else comm_only - outside
            if comm is not None and comp is not None:
                hidden = hidden_fraction(med - outside, comp - outside, comm)
            rows.append({
                "workload": res["workload"],
                "algorithm": alg,
                "taken": res["taken"][i],
                "world_size": n,
                "backend": run["backend"],
                "device": run["device"],
                "dtype": config.dtype,
                "shape": {"batch": config.shape.batch, "seq": config.shape.seq, "hidden": config.shape.hidden,
                          "ffn": config.shape.ffn, "heads": config.shape.heads, "kv_heads": config.shape.kv_heads,
                          **({"experts": config.experts, "topk": config.topk} if res["workload"] == "moe" else {})},
                "link_rate": config.link_rate,
                "repeats": len(total),
                "median_ms": _r(med),
                "p25_ms": _r(p25),
                "p75_ms": _r(p75),
                "min_ms": _r(min(total)),
                "max_ms": _r(max(total)),
                "compute_only_ms": _r(comp),
                "comm_only_ms": _r(comm_only),
                "outside_ms": _r(outside),
                "exposed_ms": _r(exposed),
                "exposed_fraction": _r(max(0.0, exposed) / comm, 4) if comm and comm > 0 and exposed is not None
                else None,
                "speedup_vs_vanilla": None,
                "collective_effect": None,
                "overlap_effect": None,
                "hidden_fraction": _r(hidden, 4),
                "correct": bool(res["correct"][i]),
                "max_rel_error": float(f"{res['max_rel_error'][i]:.3g}"),
                "unmeasured": dict(res.get("unusable_modes", {})),
                "load": run.get("load"),
                "cpus": run.get("cpus"),
                "routing": res.get("routing"),
            })
        vanilla = next(r["median_ms"] for r in rows if r["algorithm"] == "vanilla")
        for r in rows:
            r["speedup_vs_vanilla"] = _r(vanilla / r["median_ms"], 4) if r["median_ms"] > 0 else None
        collective, overlap = effects(rows)
        for r in rows:
            r["collective_effect"], r["overlap_effect"] = _r(collective, 4), _r(overlap, 4)
        out += rows
    return out


def effects(rows: list[dict]) -> tuple[float | None, float | None]:
    """(vanilla / serial, serial / ring) of one workload's records: ring's speed-up over vanilla, taken apart.

    ``serial`` runs the ring's very hops and per-shard compute, each step
    waiting for its transfers before computing. So vanilla / serial is what
    replacing the library's collective by the ring's hops changes, with no
    overlap on either side (on gloo, whose reduce_scatter moves about twice a
    ring's bytes, this alone is large), and serial / ring what overlapping
    those same hops with the compute buys. (None, None) unless all three ran.
    """
    by = {r["algorithm"]: r["median_ms"] for r in rows}
    van, ser, ring = by.get("vanilla"), by.get("serial"), by.get("ring")
    if not (van and ser and ring):
        return None, None
    return van / ser, ser / ring


def effects_line(rows: list[dict]) -> str | None:
    """One line saying how ring's speed-up over vanilla splits into the collective and the overlap effects."""
    collective, overlap = effects(rows)
    if collective is None:
        return None
    by = {r["algorithm"]: r for r in rows}
    van, ser = by["vanilla"], by["serial"]
    comm = ""
    if van["comm_only_ms"] is not None and ser["comm_only_ms"] is not None:
        comm = f"; comm-only: vanilla {van['comm_only_ms']:.2f} ms, serial {ser['comm_only_ms']:.2f} ms"
    return (f"ring vs vanilla {collective * overlap:.2f}x = collective {collective:.2f}x (vanilla / serial) "
            f"x overlap {overlap:.2f}x (serial / ring){comm}")


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def run_load(recs: list[dict]) -> str:
    load = recs[0].get("load") if recs else None
    if not load or None in load:
        return ""
    return (f"load average (1 min) {load[0]:.2f} at the start, {load[1]:.2f} at the end, on {recs[0]['cpus']} CPUs "
            "(the benchmark's own ranks count): above the rank count, other work shared the cores")


def aligned(header, body) -> list[str]:
    """A text table's lines: the first column left-aligned, the others right-aligned, a rule under the header."""
    widths = [max(len(row[c]) for row in [header, *body]) for c in range(len(header))]
    lines = []
    for j, row in enumerate([header, *body]):
        cells = [row[0].ljust(widths[0])] + [cell.rjust(w) for cell, w in zip(row[1:], widths[1:])]
        lines.append("  " + "  ".join(cells).rstrip())
        if j == 0:
            lines.append("  " + "  ".join("-" * w for w in widths))
    return lines


def _grouped(recs: list[dict], key: str = "workload") -> dict[str, list[dict]]:
    """The records grouped by ``key`` (a workload, a strands block), in the order its values first appear."""
    by: dict[str, list[dict]] = {}
    for r in recs:
        by.setdefault(r[key], []).append(r)
    return by


def table(recs: list[dict], config: BenchConfig) -> str:
    """The human-readable table, one block per workload."""
    lines = []
    for workload, rows in _grouped(recs).items():
        r0 = rows[0]
        what = config.shape.text()
        if workload == "moe":
            what = (f"b={config.shape.batch} s={config.shape.seq} h={config.shape.hidden} expert ffn="
                    f"{config.shape.ffn} experts={config.experts} top-{config.topk}")
        lines.append(
            f"{workload}: {what}, {r0['world_size']} ranks, {r0['backend']} on {r0['device']}, "
            f"{r0['dtype']}, {describe_rate(config.link_rate)}; {r0['repeats']} interleaved repeats, each the "
            "slowest rank's time"
        )
        header = ("algorithm", "median ms (p25-p75)", "compute-only", "comm-only", "exposed", "hidden",
                  "vs vanilla", "result")
        body = []
        for r in rows:
            alg = r["algorithm"] + (f" ({r['taken']})" if r["algorithm"] == "auto" and r["taken"] else "")
            body.append((
                alg,
                f"{r['median_ms']:.2f} ({r['p25_ms']:.2f}-{r['p75_ms']:.2f})",
                _fmt(r["compute_only_ms"]),
                _fmt(r["comm_only_ms"]),
                _fmt(r["exposed_ms"]),
                _fmt(r["hidden_fraction"], ".2f"),
                _fmt(r["speedup_vs_vanilla"], ".2f") + "x",
                ("ok" if r["correct"] else "WRONG") + (" (ref)" if r["algorithm"] == "vanilla" else ""),
            ))
        lines.extend(aligned(header, body))
        if r0.get("routing"):
            sent = "; ".join(f"rank {q}: {', '.join(str(v) for v in row)}" for q, row in enumerate(r0["routing"]))
            lines.append(f"  results checked against moe_reference (one process, every expert), vanilla's too; "
                         f"token rows routed to ranks 0..{len(r0['routing']) - 1}, by source: {sent}")
        split = effects_line(rows)
        if split:
            lines.append("  " + split)
        if r0["outside_ms"] and r0["workload"] not in ("ag_matmul", "matmul_rs"):
            lines.append(f"  (outside the fused ops: {r0['outside_ms']:.2f} ms per iteration, in all three runs)")
        for mode, why in r0["unmeasured"].items():
            lines.append(f"  ({mode} could not be measured, this workload fails in it: {why})")
        lines.append("")
    load = run_load(recs)
    if load:
        lines.append(load)
    lines.append("ms: milliseconds per iteration. compute-only: transfers removed; comm-only: compute removed; "
                 "exposed = median - compute-only;")
    lines.append("hidden: the time overlap saved over the most it could save, the shorter of compute and comm; "
                 "1 - exposed / comm where comm <= compute.")
    if any(r["collective_effect"] is not None for r in recs):
        lines.append("serial: the ring's hops and compute, each step waiting for its transfers; collective = "
                     "vanilla / serial (the ring's hops vs the")
        lines.append("library's collective, no overlap in either), overlap = serial / ring (the same hops, "
                     "overlapped or not) (docs/benchmarks.md).")
    else:
        lines.append("(docs/benchmarks.md)")
    return "\n".join(lines)


#: The project's design targets for the overlap (docs/benchmarks.md, "Targets"). Each assumes a regime, and
#: :func:`targets` judges it only where that regime holds: communication about half of the compute (the regime of
#: tensor parallelism on an accelerator, which ``--link-rate`` gives a CPU), at sizes that are not a smoke test.
EXPOSED_AT_MOST = 0.10  # ring exposes at most this share of its comm-only time
VS_VANILLA_AT_LEAST = 1.3  # ring's speed-up over vanilla
VS_SLICED_AT_LEAST = 1.05  # ring's speed-up over sliced:4 (data slicing's exposed chunk, the tail)
AUTO_TINY_AT_MOST = 0.05  # auto at most this much slower than vanilla at tiny sizes (--preset tiny)
#: Below this comm-only / compute-only the exposed share of the communication is within the compute's run-to-run
#: spread (10% of it is under 2% of the run), so the exposure target is not judged.
MIN_RATIO = 0.2
#: the side-by-side workloads: what their vanilla is, and the speed-up commfuse's ring must reach against it
#: (None: no target), judged where ring's comm-only / compute-only is within STOCK_REGIME_WITHIN of 0.5
STOCK_PLANS = {"llama_block": ("torch's styles", None), "torchtitan": ("torchtitan's stock TP", 1.25)}
STOCK_REGIME_WITHIN = 0.15
#: The preset of the auto target, and the one smoke-test preset: hops of a few KiB are latency-bound, not the
#: bandwidth-bound hops the overlap targets are set for.
TINY_PRESET = "tiny"


def _ratio(r: dict | None) -> float | None:
    """comm-only / compute-only of a record, or None where one was not measured."""
    if r is None or not r["compute_only_ms"] or r["comm_only_ms"] is None:
        return None
    return r["comm_only_ms"] / r["compute_only_ms"]


def _verdict(ok: bool, why_not_judged: str | None) -> str:
    return f"not judged: {why_not_judged}" if why_not_judged else ("met" if ok else "MISSED")


def targets(recs: list[dict], config: BenchConfig | None = None) -> list[str]:
    """The project's design targets against this run's figures: printed, never asserted. Only those whose
    algorithms ran; each judged (met / MISSED) only where the regime it assumes holds, and otherwise one line that
    says why not. ``config`` gives the preset (without it, not the smoke-test preset)."""
    preset = config.preset if config is not None else None
    smoke = f"--preset {TINY_PRESET} is a smoke test (latency-bound hops)" if preset == TINY_PRESET else None
    lines = [("the project's design targets (printed, never asserted), each judged only where the regime it "
              "assumes holds (docs/benchmarks.md, \"Targets\"):")]
    by = {(r["workload"], r["algorithm"]): r for r in recs}
    for workload in dict.fromkeys(r["workload"] for r in recs):
        van, ring = by.get((workload, "vanilla")), by.get((workload, "ring"))
        if workload in STOCK_PLANS:  # vanilla is another library's plan here: a comparison of plans
            theirs, target = STOCK_PLANS[workload]
            rho = _ratio(ring)
            regime = "" if rho is None else f"; ring's comm-only / compute-only {rho:.2f}"
            lines.append(f"{workload}: commfuse's modules against {theirs} (vanilla), forward + backward, side by side"
                         f"{regime}{'' if target else ' (no target set)'}:")
            for r in recs:
                if r["workload"] == workload and r["algorithm"] != "vanilla" and r["speedup_vs_vanilla"]:
                    lines.append(f"  {r['algorithm']}{' (' + r['taken'] + ')' if r['algorithm'] == 'auto' else ''}:"
                                 f" {r['speedup_vs_vanilla']:.2f}x the speed of {theirs}")
            if target and ring is not None and ring["speedup_vs_vanilla"]:
                s = ring["speedup_vs_vanilla"]
                why = smoke
                if why is None and (rho is None or abs(rho - 0.5) > STOCK_REGIME_WITHIN):
                    why = ("the target is for comm about half of compute (ring's comm-only / compute-only "
                           f"0.5 +- {STOCK_REGIME_WITHIN}), here {'not measured' if rho is None else f'{rho:.2f}'}: "
                           "set --link-rate")
                if why is None and ring["world_size"] != 2:
                    why = "the target is for 2 ranks"
                lines.append(f"  ring vs {theirs} {s:.2f}x (target >= {target}x): {_verdict(s >= target, why)}")
            continue
        sliced, auto = by.get((workload, "sliced:4")), by.get((workload, "auto"))
        ratios = [f"{r['algorithm']} {_ratio(r):.2f}" for r in (van, ring) if _ratio(r) is not None]
        lines.append(f"{workload}: comm-only / compute-only {', '.join(ratios)} (the overlap targets assume about "
                     "0.3-0.5, an accelerator's ratio; --link-rate gives it on a CPU)" if ratios else f"{workload}:")
        n = (van or ring or recs[0])["world_size"]
        hides = (n - 1) / n  # a ring of n ranks hides its hops behind at most this share of the compute
        rho_v = _ratio(van)
        # the pairwise ring and its sliced forms (ring:m), each against the same targets
        rings = [r for r in recs if r["workload"] == workload and
                 parse_algorithm(r["algorithm"]).name == "ring"]
        for r in rings:
            name, rho = r["algorithm"], _ratio(r)
            # what the ring must leave exposed at best: the comm beyond what (n-1)/n of the compute hides
            excess = max(0.0, rho - hides) if rho is not None else 0.0
            if r["exposed_fraction"] is not None:
                x = r["exposed_fraction"]
                why = smoke
                if why is None and rho is not None and rho < MIN_RATIO:
                    why = (f"comm-only is {rho:.2f} of compute-only, under {MIN_RATIO}: too little communication for "
                           "its exposed share to stand above the compute's noise")
                elif why is None and rho is not None and excess / rho > EXPOSED_AT_MOST:
                    why = (f"with {n} ranks a ring hides behind at most {n - 1}/{n} of the compute, so at "
                           f"comm-only / compute-only {rho:.2f} it exposes at least {100 * excess / rho:.0f}%")
                lines.append(f"  {name} exposes {100 * x:.1f}% of its comm-only time "
                             f"(target <= {100 * EXPOSED_AT_MOST:.0f}%): {_verdict(x <= EXPOSED_AT_MOST, why)}")
            if van:
                s = r["speedup_vs_vanilla"]
                why = smoke
                if why is None and rho_v is not None:
                    bound = (1 + rho_v) / (1 + excess)  # vanilla's compute + comm over the ring's best
                    if bound < VS_VANILLA_AT_LEAST:
                        why = (f"vanilla's comm-only is {rho_v:.2f} of its compute-only, so hiding all of it gains "
                               f"at most about {bound:.2f}x")
                lines.append(f"  {name} vs vanilla {s:.2f}x (target >= {VS_VANILLA_AT_LEAST}x): "
                             f"{_verdict(s >= VS_VANILLA_AT_LEAST, why)}")
                if r["collective_effect"] is not None and name == "ring":
                    lines.append(f"    of which collective {r['collective_effect']:.2f}x (vanilla / serial) and "
                                 f"overlap {r['overlap_effect']:.2f}x (serial / ring)")
            if sliced:
                s = sliced["median_ms"] / r["median_ms"]
                why, rho_s = smoke, _ratio(sliced)
                if why is None and rho_s is not None:
                    bound = (1 + rho_s / 4) / (1 + excess)  # sliced:4's best leaves one chunk's collective exposed
                    if bound < VS_SLICED_AT_LEAST:
                        why = (f"sliced:4's one exposed chunk is about {100 * rho_s / 4:.0f}% of the compute here, "
                               f"too little for a ring to be {VS_SLICED_AT_LEAST}x faster")
                lines.append(f"  {name} vs sliced:4 {s:.2f}x (target >= {VS_SLICED_AT_LEAST}x): "
                             f"{_verdict(s >= VS_SLICED_AT_LEAST, why)}")
        if auto and van:
            slower = auto["median_ms"] / van["median_ms"] - 1
            why = None if preset == TINY_PRESET else (f"the target is for tiny sizes (--preset {TINY_PRESET}), where "
                                                      "vanilla's one collective can beat a ring's hops")
            lines.append(f"  auto ({auto['taken']}) vs vanilla: {100 * slower:+.1f}% time (target <= "
                         f"+{100 * AUTO_TINY_AT_MOST:.0f}% at tiny sizes): {_verdict(slower <= AUTO_TINY_AT_MOST, why)}")
    return lines


# -- --compile: eager against torch.compile ------------------------------------------------------------------------

#: What each workload compiles under ``--compile``, in the table's words.
_COMPILED_WHAT = {"ag_matmul": "all_gather_matmul in a compiled function", "matmul_rs":
                  "matmul_reduce_scatter in a compiled function"}


def _finite_ms(xs) -> list[float]:
    return [1e3 * x for x in xs if x is not None and math.isfinite(x)]


def compile_records(run: dict, config: BenchConfig) -> list[dict]:
    """One record per (workload, algorithm) of a ``--compile`` run (rank 0's result): eager and compiled step
    times side by side, their ratio and the first compiled step (the compile)."""
    from commfuse.bench.config import WORKLOADS

    out = []
    for res in run["results"]:
        name = res["workload"]
        info = WORKLOADS[name]
        layer = info.backward and config.backward
        for i, alg in enumerate(res["algorithms"]):
            eager = _finite_ms(r[i][0] for r in res["wall_s"])
            comp = _finite_ms(r[i][1] for r in res["wall_s"])
            e_med = statistics.median(eager) if eager else None
            c_med = statistics.median(comp) if comp else None
            e_q = _quartiles(eager) if eager else (None, None)
            c_q = _quartiles(comp) if comp else (None, None)
            first = res["first_compiled_s"][i]
            error = res["compile_error"][i]
            out.append({
                "mode": "compile",
                "workload": name,
                "compiled": info.layer or _COMPILED_WHAT.get(name, name),
                "algorithm": alg,
                "compile_backend": run["compile_backend"],
                "torch": run.get("torch"),
                "world_size": run["world_size"],
                "backend": run["backend"],
                "device": run["device"],
                "dtype": config.dtype,
                "shape": {"batch": config.shape.batch, "seq": config.shape.seq, "hidden": config.shape.hidden,
                          "ffn": config.shape.ffn, "heads": config.shape.heads, "kv_heads": config.shape.kv_heads,
                          **({"experts": config.experts, "topk": config.topk} if res["workload"] == "moe" else {})},
                "link_rate": config.link_rate,
                "backward": bool(layer),
                "repeats": len(eager),
                "eager_ms": _r(e_med),
                "eager_p25_ms": _r(e_q[0]),
                "eager_p75_ms": _r(e_q[1]),
                "compiled_ms": _r(c_med),
                "compiled_p25_ms": _r(c_q[0]),
                "compiled_p75_ms": _r(c_q[1]),
                "compiled_vs_eager": _r(c_med / e_med, 4) if c_med and e_med else None,
                "speedup": _r(e_med / c_med, 4) if c_med and e_med else None,
                "first_compiled_step_s": None if error or first is None or not math.isfinite(first) else _r(first, 3),
                "correct": bool(res["correct"][i]) and not error,
                "max_rel_error": None if error else float(f"{res['max_rel_error'][i]:.3g}"),
                "compile_error": error or None,
                "load": run.get("load"),
                "cpus": run.get("cpus"),
            })
    return out


def compile_table(recs: list[dict], config: BenchConfig) -> str:
    """The ``--compile`` table, one block per workload."""
    lines = []
    for workload, rows in _grouped(recs).items():
        r0 = rows[0]
        step = "forward + backward" if r0["backward"] else "forward"
        lines.append(
            f"{workload} ({r0['compiled']}, {step}): {config.shape.text()}, {r0['world_size']} ranks, "
            f"{r0['backend']} on {r0['device']}, {r0['dtype']}, {describe_rate(config.link_rate)}; "
            f"torch.compile(fullgraph=True, backend={r0['compile_backend']!r}), torch {r0['torch']}; "
            f"{r0['repeats']} interleaved repeats, each the slowest rank's time"
        )
        header = ("algorithm", "eager ms (p25-p75)", "compiled ms (p25-p75)", "compiled / eager",
                  "speed-up", "first compiled step s", "result")
        body = []
        for r in rows:
            if r["compile_error"]:
                body.append((r["algorithm"], f"{r['eager_ms']:.2f} ({r['eager_p25_ms']:.2f}-{r['eager_p75_ms']:.2f})",
                             "-", "-", "-", "-", "did not compile"))
                continue
            body.append((
                r["algorithm"],
                f"{r['eager_ms']:.2f} ({r['eager_p25_ms']:.2f}-{r['eager_p75_ms']:.2f})",
                f"{r['compiled_ms']:.2f} ({r['compiled_p25_ms']:.2f}-{r['compiled_p75_ms']:.2f})",
                _fmt(r["compiled_vs_eager"], ".3f") + "x",
                _fmt(r["speedup"], ".2f") + "x",
                _fmt(r["first_compiled_step_s"], ".2f"),
                "ok" if r["correct"] else "WRONG",
            ))
        lines.extend(aligned(header, body))
        for r in rows:
            if r["compile_error"]:
                lines.append(f"  ({r['algorithm']} did not compile: {r['compile_error']})")
        lines.append("")
    load = run_load(recs)
    if load:
        lines.append(load)
    lines.append("ms: milliseconds per step, eager and compiled interleaved in every repeat (same group, module, "
                 "inputs). compiled / eager: below 1.00x the")
    lines.append("compiled step is faster; speed-up = eager / compiled. first compiled step: its wall time, "
                 "compile included (trace, AOTAutograd,")
    lines.append("the backend's compile of forward and backward; a fresh inductor cache), never in the step times. "
                 "result: compiled equals eager within the")
    lines.append("dtype's tolerance (docs/benchmarks.md).")
    return "\n".join(lines)



# -- -w strands: two micro-batches as two strands ------------------------------------------------------------------

#: The strands targets (printed, never asserted), each judged where ring's transfers / compute-only of the whole
#: step is within STRANDS_REGIME_WITHIN (a share of it) of its regime: at about 1.5, strands searched at least this much faster
#: than ring and within this factor of the limit max(compute, comm); at about 0.5, no slower than ring; and at any
#: ratio, each strands row's peak memory at most this many times ring's.
STRANDS_HIGH, STRANDS_LOW, STRANDS_REGIME_WITHIN = 1.5, 0.5, 0.2
STRANDS_VS_RING_AT_LEAST = 1.2
STRANDS_VS_LIMIT_AT_MOST = 1.1
STRANDS_LOW_VS_RING_AT_LEAST = 1.0
STRANDS_MEMORY_AT_MOST = 1.15


def strands_records(run: dict, config: BenchConfig) -> list[dict]:
    """One record per (block, row) of the ``strands`` workload (rank 0's result); a block that did not run: one
    record with ``skipped`` saying why."""
    out = []
    for res in run["results"]:
        if res.get("kind") != "strands":
            continue
        base = {"mode": "strands", "workload": "strands", "block": res["block"], "what": res["what"],
                "world_size": run["world_size"], "backend": run["backend"], "device": run["device"],
                "dtype": config.dtype, "link_rate": config.link_rate, "load": run.get("load"),
                "cpus": run.get("cpus")}
        if res.get("skipped"):
            out.append({**base, "row": None, "skipped": res["skipped"], "correct": True})
            continue
        items = [tuple(item) for item in res["items"]]

        def times(row: str, mode: str | None = None) -> list[float]:
            k = items.index((row, mode))
            return _finite_ms(rep[k] for rep in res["wall_s"])

        compute, comm_only = statistics.median(times("ring", "compute_only")), statistics.median(times("ring", "comm_only"))
        # comm-only runs the code around the ops too (the attention core, norms, weight-gradient GEMMs):
        # outside-only times that alone, and the transfers are what is left (records without it: comm-only)
        outside = statistics.median(times("ring", "outside_only")) if ("ring", "outside_only") in items else 0.0
        comm = max(comm_only - outside, 0.0)
        limit = max(compute, comm)
        predicted = res["predicted_s"]
        ring_ms = statistics.median(times("ring"))
        ring_peak = res["peak_bytes"][res["rows"].index("ring")]
        for k, row in enumerate(res["rows"]):
            ms = times(row)
            med = statistics.median(ms)
            p25, p75 = _quartiles(ms)
            peak = res["peak_bytes"][k]
            algorithm, plan = STRAND_ROWS[row]
            out.append({
                **base,
                "row": row,
                "algorithm": algorithm,
                "plan": plan,
                "repeats": len(ms),
                "median_ms": _r(med),
                "p25_ms": _r(p25),
                "p75_ms": _r(p75),
                "speedup_vs_ring": _r(ring_ms / med, 4) if med > 0 else None,
                "vs_limit": _r(med / limit, 4) if limit > 0 else None,
                "predicted_ms": _r(1e3 * predicted[row]),
                "peak_mib": None if peak is None else _r(peak / 2 ** 20, 2),
                "peak_vs_ring": _r(peak / ring_peak, 4) if peak is not None and ring_peak else None,
                "peak_how": res["peak_how"],
                "correct": bool(res["correct"][k]),
                "max_rel_error": float(f"{res['max_rel_error'][k]:.3g}"),
                "ring_compute_only_ms": _r(compute),
                "ring_comm_only_ms": _r(comm_only),
                "ring_outside_only_ms": _r(outside),
                "ring_comm_ms": _r(comm),
                "comm_vs_compute": _r(comm / compute, 4) if compute > 0 else None,
                "limit_ms": _r(limit),
                "predicted_limit_ms": _r(1e3 * predicted["limit"]),
                "figures_ms": {name: [_r(1e3 * c), _r(1e3 * m)] for name, (c, m) in res["figures"].items()},
                "searched_plan": res["searched_plan"],
                "searched_order": res["searched_order"],
            })
    return out


def strands_table(recs: list[dict], config: BenchConfig) -> str:
    """The ``strands`` table, one part per block."""
    lines = []
    for block, rows in _grouped(recs, "block").items():
        r0 = rows[0]
        if r0.get("skipped"):
            lines += [f"strands, {block}: not run: {r0['skipped']}", ""]
            continue
        lines.append(f"strands, {block}: {r0['what']}, {r0['world_size']} ranks, {r0['backend']} on {r0['device']}, "
                     f"{r0['dtype']}, {describe_rate(config.link_rate)}; two micro-batches forward + backward; "
                     f"{r0['repeats']} interleaved repeats, each the slowest rank's time")
        lines.append("  stage figures (forward, measured on the group, rank 0's; compute-only / comm-only ms): "
                     + ", ".join(f"{name} {c:.2f}/{m:.2f}" for name, (c, m) in r0["figures_ms"].items()))
        header = ("row", "median ms (p25-p75)", "predicted ms", "vs ring", "vs limit", "peak memory", "vs ring",
                  "result")
        body = []
        for r in rows:
            body.append((
                r["row"],
                f"{r['median_ms']:.2f} ({r['p25_ms']:.2f}-{r['p75_ms']:.2f})",
                _fmt(r["predicted_ms"]),
                _fmt(r["speedup_vs_ring"], ".2f") + "x",
                _fmt(r["vs_limit"], ".2f") + "x",
                "n/a" if r["peak_mib"] is None else f"{r['peak_mib']:.1f} MiB",
                "n/a" if r["peak_vs_ring"] is None else f"{r['peak_vs_ring']:.2f}x",
                ("ok" if r["correct"] else "WRONG") + (" (ref)" if r["row"] == "ring" else ""),
            ))
        lines.extend(aligned(header, body))
        lines.append(f"  regime: ring's transfers {r0['ring_comm_ms']:.2f} ms (comm-only {r0['ring_comm_only_ms']:.2f} "
                     f"less outside-only {r0['ring_outside_only_ms']:.2f}) / compute-only "
                     f"{r0['ring_compute_only_ms']:.2f} ms = {_fmt(r0['comm_vs_compute'])}; limit max(compute, comm) "
                     f"{r0['limit_ms']:.2f} ms (predicted {r0['predicted_limit_ms']:.2f} ms)")
        lines.append("  searched plan (second micro-batch's forward | first one's backward, predicted):")
        lines.extend("  " + line for line in r0["searched_plan"])
        lines.append("")
    load = run_load(recs)
    if load:
        lines.append(load)
    lines.append("vanilla, ring: one micro-batch after the other (each op its library collective, or commfuse's ring); "
                 "strands: the second")
    lines.append("micro-batch's forward stages beside the first's backward stages, paired stage by stage (naive) or "
                 "by the plan search over the")
    lines.append("measured figures (searched). vs ring: ring's median / this one; vs limit: this median / max(ring's "
                 "compute-only, transfers).")
    lines.append("predicted: the simulator's plan over the stages' forward figures (backward: twice the compute, the "
                 "same comm). peak memory:")
    how = next((r["peak_how"] for r in recs if r.get("peak_how")), "n/a")
    lines.append(f"above what was resident before the run, the largest over the ranks ({how}); "
                 "result: losses and every gradient equal ring's")
    lines.append("within the dtype's tolerance (docs/strands.md).")
    return "\n".join(lines)


def strands_targets(recs: list[dict], config: BenchConfig | None = None) -> list[str]:
    """The strands targets against this run's figures: printed, never asserted; each judged only where the regime
    it assumes holds."""
    preset = config.preset if config is not None else None
    smoke = f"--preset {TINY_PRESET} is a smoke test (latency-bound hops)" if preset == TINY_PRESET else None
    lines = ["the strands targets (printed, never asserted), each judged only where ring's transfers / compute-only "
             "is about what it assumes:"]
    for block, rows in _grouped(recs, "block").items():
        by = {r["row"]: r for r in rows}
        if None in by:
            continue
        searched, rho = by["strands searched"], by["ring"]["comm_vs_compute"]
        lines.append(f"strands, {block}: ring's transfers / compute-only {_fmt(rho)}")

        def outside(centre: float) -> str | None:
            if smoke:
                return smoke
            if rho is None or abs(rho - centre) > STRANDS_REGIME_WITHIN * centre:
                return (f"the target is for transfers / compute-only {centre} +- {STRANDS_REGIME_WITHIN * centre:.1f}, "
                        f"here {_fmt(rho)}: set --link-rate")
            return None

        s, x = searched["speedup_vs_ring"], searched["vs_limit"]
        high, low = outside(STRANDS_HIGH), outside(STRANDS_LOW)
        lines.append(f"  at about {STRANDS_HIGH}: strands searched vs ring {_fmt(s)}x (target >= "
                     f"{STRANDS_VS_RING_AT_LEAST}x): {_verdict(s is not None and s >= STRANDS_VS_RING_AT_LEAST, high)}")
        lines.append(f"  at about {STRANDS_HIGH}: strands searched vs the limit {_fmt(x)}x (target <= "
                     f"{STRANDS_VS_LIMIT_AT_MOST}x): {_verdict(x is not None and x <= STRANDS_VS_LIMIT_AT_MOST, high)}")
        lines.append(f"  at about {STRANDS_LOW}: strands searched vs ring {_fmt(s)}x (target >= "
                     f"{STRANDS_LOW_VS_RING_AT_LEAST:.2f}x, no slower): "
                     f"{_verdict(s is not None and s >= STRANDS_LOW_VS_RING_AT_LEAST, low)}")
        for row in ("strands naive", "strands searched"):
            m = by[row]["peak_vs_ring"]
            why = smoke or ("peak memory was not measured here" if m is None else None)
            lines.append(f"  {row} peak memory {_fmt(m)}x ring's (target <= {STRANDS_MEMORY_AT_MOST}x): "
                         f"{_verdict(m is not None and m <= STRANDS_MEMORY_AT_MOST, why)}")
    return lines



# -- -w ring_attention: attention under context parallelism, side by side ------------------------------------------

#: The ring attention targets (printed, never asserted). The exposure and the speed-up over torch's
#: context_parallel are judged where ring's transfers / compute-only is within RA_REGIME_WITHIN (a share) of
#: RA_REGIME, communication about as long as compute; the zigzag layout's load balance (the slowest rank's
#: compute-only time over the fastest's) at any regime.
RA_REGIME, RA_REGIME_WITHIN = 1.0, 0.3
RA_EXPOSED_AT_MOST = 0.10
RA_VS_TORCH_AT_LEAST = 1.2
RA_BALANCE_AT_MOST = 1.1
#: the rows the targets judge: ring (zigzag), and the contiguous ring the balance is shown against
RA_RING, RA_CONTIGUOUS = "ring", "ring contiguous"


def ring_attention_records(run: dict, config: BenchConfig) -> list[dict]:
    """One record per row of the ``ring_attention`` workload (rank 0's result). A row that did not run: a record
    with ``not_run`` saying why (and ``correct`` True: nothing was wrong).

    Per row, over the repeats, a repeat's figure the slowest rank's: ``median_ms`` (``p25_ms``-``p75_ms``) of the
    normal run; for rows on commfuse's ops ``compute_only_ms``, ``comm_only_ms`` and ``outside_only_ms`` (medians
    of the measure modes), ``comm_ms = comm_only - outside_only`` (the transfers alone), ``exposed_ms = median -
    compute_only`` and ``exposed_fraction = exposed / comm``; ``rank_compute_only_ms`` (each rank's own
    compute-only median) and ``compute_balance`` (their largest over their smallest); ``speedup_vs_torch``, the
    faster torch row's median over this one; ``peak_mib``, the largest over the ranks."""
    from commfuse.bench.config import RING_ATTENTION_ROWS

    out = []
    for res in run["results"]:
        if res.get("kind") != "ring_attention":
            continue
        s = config.shape
        base = {"mode": "ring_attention", "workload": "ring_attention", "world_size": run["world_size"],
                "backend": run["backend"], "device": run["device"], "dtype": config.dtype,
                "shape": {"batch": s.batch, "seq": s.seq, "heads": s.heads, "kv_heads": s.kv_heads or s.heads,
                          "head_dim": s.hidden // s.heads},
                "link_rate": config.link_rate, "load": run.get("load"), "cpus": run.get("cpus"),
                "stock_context_parallel": res["stock_context_parallel"]}
        items = [tuple(item) for item in res["items"]]
        walls = res["wall_s"]  # [rank][repeat][item]

        def slowest(row: str, mode: str | None = None) -> list[float]:
            if (row, mode) not in items:
                return []
            k = items.index((row, mode))
            return _finite_ms(max(rank[rep][k] for rank in walls) for rep in range(len(walls[0])))

        def per_rank(row: str, mode: str) -> list[float] | None:
            if (row, mode) not in items:
                return None
            k = items.index((row, mode))
            return [statistics.median(_finite_ms(rep[k] for rep in rank)) for rank in walls]

        medians = {row: statistics.median(slowest(row)) for row in res["rows"] if slowest(row)}
        torch_rows = [row for row in medians if RING_ATTENTION_ROWS[row][0] == "torch"]
        best_torch = min((medians[row] for row in torch_rows), default=None)
        for row in res["rows"]:
            who, how, layout = RING_ATTENTION_ROWS[row]
            rec = {**base, "row": row, "who": who, "algorithm": how, "layout": layout}
            if row in res["missing"]:
                out.append({**rec, "not_run": res["missing"][row], "correct": True})
                continue
            ms = slowest(row)
            med = statistics.median(ms)
            p25, p75 = _quartiles(ms)
            comp = statistics.median(slowest(row, "compute_only")) if slowest(row, "compute_only") else None
            comm_only = statistics.median(slowest(row, "comm_only")) if slowest(row, "comm_only") else None
            outside = statistics.median(slowest(row, "outside_only")) if slowest(row, "outside_only") else None
            comm = None if comm_only is None or outside is None else max(comm_only - outside, 0.0)
            exposed = None if comp is None else med - comp
            ranks = per_rank(row, "compute_only")
            peak = res["peak_bytes"][row]
            out.append({
                **rec,
                "not_run": None,
                "repeats": len(ms),
                "median_ms": _r(med),
                "p25_ms": _r(p25),
                "p75_ms": _r(p75),
                "compute_only_ms": _r(comp),
                "comm_only_ms": _r(comm_only),
                "outside_only_ms": _r(outside),
                "comm_ms": _r(comm),
                "exposed_ms": _r(exposed),
                "exposed_fraction": _r(max(0.0, exposed) / comm, 4) if comm and exposed is not None else None,
                "comm_vs_compute": _r(comm / comp, 4) if comm is not None and comp else None,
                "rank_compute_only_ms": None if ranks is None else [_r(t) for t in ranks],
                "compute_balance": _r(max(ranks) / min(ranks), 4) if ranks and min(ranks) > 0 else None,
                "speedup_vs_torch": _r(best_torch / med, 4) if best_torch and med > 0 else None,
                "peak_mib": None if peak is None else _r(peak / 2 ** 20, 2),
                "peak_how": res["peak_how"],
                "correct": bool(res["correct"][row]),
                "max_rel_error": float(f"{res['max_rel_error'][row]:.3g}"),
                "unmeasured": dict(res.get("unmeasured", {}).get(row, {})),
            })
    return out


def ring_attention_table(recs: list[dict], config: BenchConfig) -> str:
    """The ``ring_attention`` table: one line per row, what did not run, and how to read it."""
    if not recs:
        return ""
    r0 = recs[0]
    sh = r0["shape"]
    ran = [r for r in recs if not r["not_run"]]
    lines = [f"ring_attention: causal attention b={sh['batch']} s={sh['seq']} heads={sh['heads']} "
             f"kv_heads={sh['kv_heads']} head_dim={sh['head_dim']}, forward + backward, sequence sharded over "
             f"{r0['world_size']} ranks, {r0['backend']} on {r0['device']}, {r0['dtype']}, "
             f"{describe_rate(config.link_rate)}; {ran[0]['repeats'] if ran else 0} interleaved repeats, each the "
             "slowest rank's time"]
    header = ("row", "layout", "median ms (p25-p75)", "compute-only", "comm", "exposed (of comm)", "vs torch cp",
              "rank compute max/min", "peak memory", "result")
    body = []
    for r in ran:
        exposed = "-" if r["exposed_ms"] is None else (
            f"{r['exposed_ms']:.2f} ({100 * r['exposed_fraction']:.0f}%)" if r["exposed_fraction"] is not None
            else f"{r['exposed_ms']:.2f}")
        body.append((
            r["row"],
            r["layout"],
            f"{r['median_ms']:.2f} ({r['p25_ms']:.2f}-{r['p75_ms']:.2f})",
            _fmt(r["compute_only_ms"]),
            _fmt(r["comm_ms"]),
            exposed,
            _fmt(r["speedup_vs_torch"], ".2f") + ("x" if r["speedup_vs_torch"] is not None else ""),
            _fmt(r["compute_balance"], ".2f") + ("x" if r["compute_balance"] is not None else ""),
            "n/a" if r["peak_mib"] is None else f"{r['peak_mib']:.1f} MiB",
            "ok" if r["correct"] else f"WRONG ({r['max_rel_error']:.2g})",
        ))
    if body:
        lines.extend(aligned(header, body))
    for r in recs:
        if r["not_run"]:
            lines.append(f"  {r['row']}: not run: {r['not_run']}")
        for mode, why in (r.get("unmeasured") or {}).items():
            lines.append(f"  {r['row']}: {mode} could not be measured, the row fails in it: {why}")
    ring = next((r for r in ran if r["row"] == RA_RING), None)
    if ring is not None and ring["comm_ms"] is not None:
        lines.append(f"  regime: ring's transfers {ring['comm_ms']:.2f} ms (comm-only {ring['comm_only_ms']:.2f} less "
                     f"outside-only {ring['outside_only_ms']:.2f}) / compute-only {ring['compute_only_ms']:.2f} ms = "
                     f"{_fmt(ring['comm_vs_compute'])}")
    for r in ran:
        if r["rank_compute_only_ms"] and r["row"] in (RA_RING, RA_CONTIGUOUS):
            lines.append(f"  {r['row']} ({r['layout']}): compute-only per rank "
                         + ", ".join(f"rank {q} {t:.2f} ms" for q, t in enumerate(r["rank_compute_only_ms"])))
    if any(r["who"] == "torch" for r in recs):
        stock = r0["stock_context_parallel"]
        lines.append("  torch cp rows: torch's context_parallel ring (_templated_ring_attention and its backward, "
                     "head-tail load balance, the rotate method")
        lines.append("  named) with SDPA's CPU flash kernel passed in; the public context_parallel "
                     + ("ran here too." if not stock else f"does not run here: {stock}"))
    lines.append("")
    load = run_load(recs)
    if load:
        lines.append(load)
    lines.append("ms: milliseconds per forward + backward. compute-only: transfers removed; comm: comm-only less "
                 "outside-only, the transfers alone;")
    lines.append("exposed = median - compute-only, and its share of comm (rows on commfuse's ops only: torch's "
                 "collectives cannot be removed).")
    lines.append("vs torch cp: the faster torch cp row's median / this one. rank compute max/min: the ranks' "
                 "compute-only medians, slowest / fastest.")
    how = next((r["peak_how"] for r in ran if r.get("peak_how")), "n/a")
    lines.append(f"peak memory: above what was resident before the run, the largest over the ranks ({how}). "
                 "result: output, dq, dk, dv equal the")
    lines.append("unsharded attention of the whole sequence within the dtype's tolerance (docs/benchmarks.md).")
    return "\n".join(lines)


def ring_attention_targets(recs: list[dict], config: BenchConfig | None = None) -> list[str]:
    """The ring attention targets against this run's figures: printed, never asserted; each judged only where the
    regime it assumes holds."""
    if not recs:
        return []
    preset = config.preset if config is not None else None
    smoke = f"--preset {TINY_PRESET} is a smoke test (latency-bound hops)" if preset == TINY_PRESET else None
    by = {r["row"]: r for r in recs if not r["not_run"]}
    ring = by.get(RA_RING)
    lines = ["the ring attention targets (printed, never asserted), each judged only where the regime it assumes "
             "holds:"]
    if ring is None:
        why = next((r["not_run"] for r in recs if r["row"] == RA_RING), "it did not run")
        return lines + [f"  ring did not run ({why}): nothing judged"]
    rho = ring["comm_vs_compute"]
    regime = smoke
    if regime is None and (rho is None or abs(rho - RA_REGIME) > RA_REGIME_WITHIN * RA_REGIME):
        regime = (f"the target is for ring's transfers / compute-only {RA_REGIME} +- {RA_REGIME_WITHIN * RA_REGIME:.1f}, "
                  f"here {_fmt(rho)}: set --link-rate")
    x = ring["exposed_fraction"]
    lines.append(f"  ring (zigzag) exposes {_fmt(None if x is None else 100 * x, '.1f')}% of its communication "
                 f"(target <= {100 * RA_EXPOSED_AT_MOST:.0f}%): {_verdict(x is not None and x <= RA_EXPOSED_AT_MOST, regime)}")
    for row, rec in by.items():  # ring:m beside it: judged at its own regime (its compute is not ring's)
        if row.startswith(RA_RING + ":") and rec["exposed_fraction"] is not None and rec["compute_only_ms"]:
            own = rec["comm_ms"] / rec["compute_only_ms"] if rec["comm_ms"] else None
            lines.append(f"    {row}: {100 * rec['exposed_fraction']:.1f}% of its communication exposed, its own "
                         f"transfers / compute-only {_fmt(own)} (each slice attended to as it arrives), "
                         f"{_fmt(rec['median_ms'])} ms against ring's {_fmt(ring['median_ms'])} ms")
    s = ring["speedup_vs_torch"]
    why = regime or (None if s is not None else "no torch cp row ran")
    torch_note = " (torch's ring with the CPU kernel passed in)" if ring["stock_context_parallel"] else ""
    lines.append(f"  ring vs torch's context_parallel{torch_note}, the faster rotate method: {_fmt(s)}x (target >= "
                 f"{RA_VS_TORCH_AT_LEAST}x): {_verdict(s is not None and s >= RA_VS_TORCH_AT_LEAST, why)}")
    b = ring["compute_balance"]
    contiguous = by.get(RA_CONTIGUOUS)
    beside = "" if contiguous is None or contiguous["compute_balance"] is None else (
        f"; contiguous: {contiguous['compute_balance']:.2f}x")
    lines.append(f"  zigzag: slowest rank's compute / fastest's {_fmt(b)}x (target <= {RA_BALANCE_AT_MOST}x){beside}: "
                 f"{_verdict(b is not None and b <= RA_BALANCE_AT_MOST, smoke)}")
    return lines
