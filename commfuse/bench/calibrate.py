"""``commfuse simulate calibrate``: measure this machine and write a profile.

Two gloo ranks on this machine (``commfuse.launch``, one thread each, as the
benchmark runs them) measure; each figure is the fastest of several repeats
of the slower rank's time (other work on the machine only slows runs down):

* compute: ``torch.matmul`` over a grid of GEMM shapes, both ranks at once
  (as they compute in a real run), fitted to ``t = a + F / R``: the sustained
  rate ``R`` is the profile's ``peak_flops`` (with ``efficiency`` 1) and
  ``a * R`` its ``half_efficiency_flops``; an in-place add gives the memory
  bandwidth;
* the executor: a ring op on tiny tensors with its transfers removed
  (``runtime.measure("compute_only")``) at several ``ring:m``; the slope over
  the number of steps, less the tiny matmul, is ``host.step_overhead``, the
  intercept ``host.call_overhead``;
* the link: the same op with its compute removed (``"comm_only"``) at
  several sizes: one hop of ``S`` bytes each way, ``latency + S / rate``
  after the host's share. Sending one way and both ways at once
  (``batch_isend_irecv``) tells whether the two directions share the link
  (a shaped loopback does: ``topology = "bus"``);
* whole collectives: ``vanilla`` all-gather and reduce-scatter with the
  compute removed, fitted to ``latency + S / (efficiency * rate)``;
* contention: a matmul timed alone and while both ranks exchange a large
  message in the background.

``--link-rate RATE`` runs all of it in a private network namespace whose
loopback a token bucket limits to RATE (``commfuse.bench.netns``), as
``commfuse bench --link-rate`` does, so the profile describes the link the
benchmark measures on. Imports no torch at module level.
"""

from __future__ import annotations

import os
import platform
import statistics
import time

from commfuse.errors import CommfuseError
from commfuse.sim import (
    CollectiveSpec,
    ComputeSpec,
    ContentionSpec,
    HostSpec,
    LinkSpec,
    Profile,
)

#: GEMM shapes (M, K, N) the compute fit runs over: slice-sized kernels of the benchmark's presets.
GEMMS = [(m, k, n) for m in (64, 256, 1024) for k, n in ((512, 1024), (1024, 512), (768, 1536), (1024, 2048))]
GEMMS_QUICK = [(64, 512, 1024), (256, 1024, 512), (1024, 768, 1536), (1024, 1024, 2048)]
#: Bytes per hop of the link and collective fits (float32 elements).
SIZES = (512 << 10, 1 << 20, 2 << 20, 4 << 20)
#: Steps per call of the host-overhead fit (ring:m over 2 ranks has 2m steps).
PARTS = (1, 4, 16)


class CalibrationError(CommfuseError, RuntimeError):
    """A measurement could not be made or made no sense."""


def _fastest(samples: list[list[float]]) -> float:
    """Per repeat the slower rank's time, then the fastest repeat.

    Other work on the machine only ever slows a measurement down, so the
    fastest of several repeats is the figure least disturbed by it: what the
    hardware does, which is what a profile describes.
    """
    return min(max(col) for col in zip(*samples))


def _rank(rank: int, world_size: int, repeats: int, quick: bool, pause: float, gemms) -> dict:
    """What each rank measures; every figure is a list of per-repeat seconds on this rank."""
    import torch
    import torch.distributed as dist

    import commfuse as cf
    from commfuse.runtime import measure

    torch.manual_seed(rank)
    clock = time.perf_counter
    out: dict = {"gemm": {}, "add": {}, "steps": {}, "hop": {}, "allgather": {}, "reducescatter": {},
                 "oneway": {}, "exchange": {}}
    peer = (rank + 1) % world_size

    def timed(fn, reps=repeats, warm=1, rest=0.0):
        ts = []
        for i in range(warm + reps):
            dist.barrier()
            if rest:
                time.sleep(rest)  # a shaped link's token bucket refills: every repeat starts alike
            t0 = clock()
            fn()
            t = clock() - t0
            if i >= warm:
                ts.append(t)
        return ts

    for m, k, n in gemms:
        a, b = torch.randn(m, k), torch.randn(k, n)
        out["gemm"][f"{m},{k},{n}"] = timed(lambda: torch.matmul(a, b))
    for size in (4 << 20, 16 << 20):
        x, y = torch.randn(size // 4), torch.randn(size // 4)
        out["add"][str(size)] = timed(lambda: x.add_(y))

    tiny, w = torch.randn(4, 4), torch.randn(4, 4)
    for parts in PARTS:
        def call(parts=parts):
            cf.all_gather_matmul(tiny, w, algorithm=f"ring:{parts}", check=False)
        with measure("compute_only"):
            out["steps"][str(parts)] = timed(call, reps=max(repeats, 20), warm=3)
    out["tiny_gemm"] = timed(lambda: torch.matmul(tiny, w), reps=50)

    for size in SIZES:
        rows = size // (4 * 256)
        shard, wt = torch.randn(rows, 256), torch.randn(256, 8)
        with measure("comm_only"):
            out["hop"][str(size)] = timed(lambda: cf.all_gather_matmul(shard, wt, algorithm="ring", check=False),
                                          rest=pause)
            out["allgather"][str(size)] = timed(
                lambda: cf.all_gather_matmul(shard, wt, algorithm="vanilla", check=False), rest=pause)
            a_rs, w_rs = torch.randn(rows * world_size, 8), torch.randn(8, 256)
            out["reducescatter"][str(size)] = timed(
                lambda: cf.matmul_reduce_scatter(a_rs, w_rs, algorithm="vanilla", check=False), rest=pause)
        buf, got = torch.randn(size // 4), torch.empty(size // 4)

        def exchange():
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, buf, peer), dist.P2POp(dist.irecv, got,
                                                                                           (rank - 1) % world_size)])
            for wk in works:
                wk.wait()

        def oneway():
            if rank == 0:
                dist.send(buf, 1)
            elif rank == 1:
                dist.recv(got, 0)

        out["exchange"][str(size)] = timed(exchange, rest=pause)
        out["oneway"][str(size)] = timed(oneway, rest=pause)

    # contention: a matmul of ~20 ms timed alone, and while a large exchange (~0.4 s at the rate just
    # measured) moves in gloo's background threads
    a, b = torch.randn(256, 1024), torch.randn(1024, 1024)
    while True:
        dist.barrier()
        t0 = clock()
        torch.matmul(a, b)
        long_enough = torch.tensor([1.0 if clock() - t0 > 0.02 else 0.0])
        dist.all_reduce(long_enough, op=dist.ReduceOp.MIN)
        if long_enough.item() or a.shape[0] >= 8192:
            break
        a = torch.cat([a, a])
    ex_rate = max(1e6, (4 << 20) / statistics.median(out["exchange"][str(4 << 20)]))
    agreed = torch.tensor([min(256 << 20, max(8 << 20, ex_rate * 0.4))], dtype=torch.float64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)  # both ranks must post the same size
    big = int(agreed.item()) // 4
    buf, got = torch.randn(big), torch.empty(big)
    alone, busy = [], []
    for _ in range(max(3, repeats // 2)):
        dist.barrier()
        t0 = clock()
        torch.matmul(a, b)
        alone.append(clock() - t0)
        dist.barrier()
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, buf, peer),
                                        dist.P2POp(dist.irecv, got, (rank - 1) % world_size)])
        time.sleep(0.002)  # let the transfer get going
        t0 = clock()
        torch.matmul(a, b)
        busy.append(clock() - t0)
        for wk in works:
            wk.wait()
    out["contention"] = {"alone": alone, "busy": busy}
    return out


def measure(*, world_size: int = 2, repeats: int = 7, quick: bool = False, burst: float = 0.0,
            rate: float | None = None, gemms=None, timeout: float = 900.0) -> dict:
    """Launch the ranks and return, per figure, the per-rank lists of seconds (see :func:`_rank`).

    ``burst`` and ``rate``: the token bucket of a shaped link, so that transfers are timed with it full.
    ``gemms``: the (M, K, N) shapes of the compute fit (default :data:`GEMMS`).
    """
    from commfuse.launch import launch

    pause = 3 * burst / rate + 0.002 if burst and rate else 0.0
    gemms = [tuple(g) for g in (gemms or (GEMMS_QUICK if quick else GEMMS))]
    per_rank = launch(_rank, world_size, repeats, quick, pause, gemms, timeout=timeout, threads=1)
    merged: dict = {}
    for key in per_rank[0]:
        v0 = per_rank[0][key]
        if isinstance(v0, dict):
            merged[key] = {k: [r[key][k] for r in per_rank] for k in v0}
        else:
            merged[key] = [r[key] for r in per_rank]
    merged["world_size"] = world_size
    merged["burst"] = burst
    return merged


def _fit_line(xs: list[float], ys: list[float], relative: bool = True) -> tuple[float, float]:
    """Least squares ``y = a + b x``, weighting each point by 1/y² when ``relative`` (fits relative error)."""
    w = [1.0 / (y * y) if relative and y > 0 else 1.0 for y in ys]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, xs)) / sw
    my = sum(wi * y for wi, y in zip(w, ys)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs))
    if sxx <= 0:
        raise CalibrationError(f"cannot fit a line through points at a single x = {xs[0]}")
    b = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, xs, ys)) / sxx
    return my - b * mx, b


def _sig(x: float, digits: int = 4) -> float:
    """``x`` to ``digits`` significant digits: what a noisy measurement supports, and a readable file."""
    return float(f"{x:.{digits}g}")


def fit(raw: dict, *, name: str = "", link_rate: str | None = None) -> tuple[Profile, dict[str, str]]:
    """A profile from :func:`measure`'s figures, and a comment per field saying how it was measured."""
    from commfuse.sim import Kernel, kernel_time

    n = raw["world_size"]
    burst = float(raw.get("burst", 0.0))
    med = _fastest
    # compute: t = a + F / R with a >= 0
    xs, ys = [], []
    for key, samples in raw["gemm"].items():
        m, k, c = map(int, key.split(","))
        xs.append(2.0 * m * k * c)
        ys.append(med(samples))
    a, slope = _fit_line(xs, ys)
    if a < 0:  # through the origin instead: no fixed cost per call
        w = [1.0 / (y * y) for y in ys]
        a, slope = 0.0, sum(wi * x * y for wi, x, y in zip(w, xs, ys)) / sum(wi * x * x for wi, x in zip(w, xs))
    if slope <= 0:
        raise CalibrationError(f"matmul time does not grow with flops (slope {slope:g} s/flop): the machine is "
                               "too noisy to calibrate; try again on an idle machine")
    rate = 1.0 / slope
    half = a * rate
    mem = statistics.median(3 * int(s) / med(v) for s, v in raw["add"].items())
    compute = ComputeSpec(peak_flops=_sig(rate), memory_bandwidth=_sig(mem), efficiency=1.0,
                          half_efficiency_flops=_sig(half), dtype="float32")
    # host: compute_only ring:m on 4x4 tensors; per step, less what the model gives the tiny matmul
    probe = Profile("probe", compute, LinkSpec(bandwidth=1e9, latency=0.0))  # its link is not asked
    steps_x = [n * int(p) for p in raw["steps"]]
    steps_y = [med(v) for v in raw["steps"].values()]
    call, per_step = _fit_line(steps_x, steps_y, relative=False)
    tiny = kernel_time(probe, Kernel(2.0 * 4 * 4 * 4, 3 * 4 * 4 * 4.0))
    step_overhead = max(0.0, per_step - tiny)
    call = max(0.0, call)
    # duplex: one way vs both ways at once, on the largest size
    big = str(max(int(s) for s in raw["exchange"]))
    one, both = med(raw["oneway"][big]), med(raw["exchange"][big])
    shared = both > 1.5 * one
    topology = "bus" if shared else "switch"
    # the most loaded resource of a ring step carries `weight` messages (see _model.class_resources)
    weight = n if shared else 1
    # link: comm_only ring all-gather = call + n steps + (n - 1) hops of latency + (weight S - burst) / rate
    sizes = sorted(int(s) for s in raw["hop"])
    xs = [max(0.0, weight * s - burst) for s in sizes]
    hop_y = [(med(raw["hop"][str(s)]) - call - n * step_overhead) / (n - 1) for s in sizes]
    latency, per_byte = _fit_line(xs, hop_y, relative=False)  # absolute: the large messages matter
    if per_byte <= 0:
        raise CalibrationError(f"transfer time does not grow with size ({per_byte:g} s/byte)")
    bandwidth = 1.0 / per_byte
    latency = max(latency, 0.0)
    # collectives, each kind on its own: t = latency + (weight S / efficiency - burst) / rate per ring step,
    # linear in weight S where the message outgrows the bucket (sizes at least 1.5 buckets)
    coll = {}
    for kind in ("allgather", "reducescatter"):
        use = [s for s in sizes if weight * s >= 1.5 * burst] or sizes
        cx = [weight * s for s in use]
        cy = [(med(raw[kind][str(s)]) - call - 2 * step_overhead) / (n - 1) for s in use]
        c_intercept, c_per_byte = _fit_line(cx, cy, relative=False)
        eff = 1.0 / (c_per_byte * bandwidth) if c_per_byte > 0 else 1.0
        coll[kind] = (max(0.0, c_intercept + burst / bandwidth), min(4.0, max(0.05, eff)))
    # contention
    con = raw["contention"]
    alone = _fastest(con["alone"])
    busy = _fastest(con["busy"])
    slowdown = max(0.0, busy / alone - 1.0)
    host = platform.node() or "this machine"
    name = name or f"local-{host}" + (f"-{link_rate}" if link_rate else "")
    profile = Profile(
        name=name,
        description=f"{host}, {n} gloo ranks x 1 thread, " + (f"loopback shaped to {link_rate}" if link_rate
                                                               else "plain loopback") + ", float32",
        compute=compute,
        link=LinkSpec(bandwidth=_sig(bandwidth), latency=_sig(latency), topology=topology,
                      duplex="half" if shared else "full", efficiency=1.0, burst=burst),
        collective=CollectiveSpec(latency=_sig((coll["allgather"][0] + coll["reducescatter"][0]) / 2),
                                  efficiency=_sig(coll["allgather"][1]),
                                  reduce_scatter_efficiency=_sig(coll["reducescatter"][1])),
        host=HostSpec(step_overhead=_sig(step_overhead), call_overhead=_sig(call)),
        contention=ContentionSpec(compute_slowdown=_sig(slowdown, 3)),
    )
    comments = {
        "compute.peak_flops": f"sustained 1-thread matmul rate, both ranks at once; fit t = a + F/R over {len(ys)} "
                              "GEMM shapes",
        "compute.half_efficiency_flops": f"a * R: a = {1e6 * a:.1f} us per matmul call",
        "compute.memory_bandwidth": "in-place add of 4 and 16 MB float32 tensors, 3 bytes moved per byte",
        "host.step_overhead": f"compute_only ring:m on 4x4 tensors: slope over steps ({1e6 * per_step:.1f} us) "
                              f"less the model's tiny matmul ({1e6 * tiny:.1f} us)",
        "host.call_overhead": "intercept of the same fit",
        "link.topology": (f"sending both ways took {both / one:.2f}x one way ({int(big) >> 20} MB): the directions "
                          "share one medium" if shared else
                          f"sending both ways took {both / one:.2f}x one way: separate directions"),
        "link.bandwidth": f"comm_only ring all-gather, one hop each way, {sizes[0] >> 10}-{sizes[-1] >> 10} KB",
        "link.latency": "intercept of the same fit, per hop",
        "link.burst": ("the token bucket `commfuse bench --link-rate` gives tc (commfuse.bench.netns.burst_bytes)"
                       if burst else "no shaping: no token bucket"),
        "collective.latency": "comm_only vanilla all-gather and reduce-scatter: mean intercept per ring step",
        "collective.efficiency": "all-gather's rate over the link's",
        "collective.reduce_scatter_efficiency": "reduce-scatter's rate over the link's",
        "contention.compute_slowdown": f"matmul alone {1e3 * alone:.1f} ms, during an exchange {1e3 * busy:.1f} ms",
    }
    return profile, comments


def calibrate(link_rate: str | None = None, *, repeats: int = 7, quick: bool = False, gemms=None,
              name: str = "") -> tuple[Profile, dict[str, str], dict]:
    """Measure and fit, in this process's network namespace (shaped to ``link_rate`` by the caller, if given)."""
    burst = rate = 0.0
    if link_rate:
        from commfuse.bench import netns

        rate = netns.parse_rate(link_rate)
        burst = float(netns.burst_bytes(rate))
    raw = measure(repeats=repeats, quick=quick, burst=burst, rate=rate or None, gemms=gemms)
    profile, comments = fit(raw, name=name, link_rate=link_rate)
    return profile, comments, raw


def header(profile: Profile, link_rate: str | None) -> str:
    return (
        f"Written by `commfuse simulate calibrate{' --link-rate ' + link_rate if link_rate else ''}` on "
        f"{time.strftime('%Y-%m-%d %H:%M')}\n"
        f"on {platform.node()} ({platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}).\n"
        "Each value was measured there; the comment beside it says how (commfuse/bench/calibrate.py)."
    )


# -- the shaped namespace -----------------------------------------------------


def in_namespace(argv: list[str], rate: str) -> int:
    """Run ``python -m commfuse.sim ARGV`` in a new network namespace whose loopback is shaped to ``rate``: the
    benchmark's own re-execution (:func:`commfuse.bench.netns.reexec`), so the child can tell it is inside
    (it checks its parent's pid and namespace) and a child that cannot tell refuses to nest another."""
    from commfuse.bench import netns

    try:
        return netns.reexec(argv, rate, module="commfuse.sim")
    except netns.LinkRateError as e:
        raise CalibrationError(str(e)) from e


def shape_here(rate: str) -> str:
    """Inside the re-executed process: limit this namespace's loopback to ``rate`` (the benchmark's way)."""
    from commfuse.bench import netns

    return netns.shape_loopback(rate)


def inside(rate: str | None) -> bool:
    """Whether this process already runs in a namespace shaped to ``rate``."""
    from commfuse.bench import netns

    return rate is not None and netns.inside() == rate
