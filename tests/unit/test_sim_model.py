"""Tier (a), no processes: the cost model keeps its invariants (ring never beats its compute-only time, sliced(1) is vanilla, more bandwidth is never slower, sliced's tail is its last chunk's collective) and the one-rank symmetric engine equals the full one on every topology."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from commfuse import sim
from commfuse.sim._model import class_resources, collective_time, kernel_time, resources, ring_step_rate
from commfuse.sim._workloads import schedule_for

TOPOLOGIES = [("switch", "full"), ("switch", "half"), ("direct", "full"), ("direct", "half"), ("bus", "half")]


def profile(topology=("switch", "full"), *, bandwidth=50e9, latency=10e-6, slowdown=0.0, burst=0.0, half=1e8,
            step=2e-6, call=5e-6, coll_eff=1.0):
    """A small made-up accelerator whose comm and compute are of the same order for the shapes below."""
    return sim.Profile(
        name="test",
        compute=sim.ComputeSpec(peak_flops=100e12, memory_bandwidth=1e12, efficiency=0.8,
                                half_efficiency_flops=half, dtype="bfloat16"),
        link=sim.LinkSpec(bandwidth=bandwidth, latency=latency, topology=topology[0], duplex=topology[1],
                          efficiency=0.9, burst=burst),
        collective=sim.CollectiveSpec(efficiency=coll_eff),
        host=sim.HostSpec(step_overhead=step, call_overhead=call),
        contention=sim.ContentionSpec(compute_slowdown=slowdown),
    )


profiles = st.builds(
    lambda topo, bw, lat, slow, burst: profile(topo, bandwidth=bw, latency=lat, slowdown=slow, burst=burst),
    st.sampled_from(TOPOLOGIES),
    st.sampled_from([5e9, 50e9, 400e9]),
    st.sampled_from([0.0, 5e-6, 50e-6]),
    st.sampled_from([0.0, 0.1, 0.5]),
    st.sampled_from([0.0, 1e6]),
)
#: The TP workloads and their variants: causal attention (the default) and full, a SwiGLU MLP.
VARIANTS = {"ag_matmul": {}, "matmul_rs": {}, "mlp": {}, "mlp swiglu": {"gated": True}, "attention": {},
            "attention not causal": {"causal": False}}
workloads = st.builds(
    lambda name, tp, seq, hidden, batch, passes: sim.Workload(name.split()[0], tp=tp, seq=seq, hidden=hidden,
                                                              batch=batch, passes=passes, **VARIANTS[name]),
    st.sampled_from(sorted(VARIANTS)),
    st.sampled_from([2, 3, 4, 8]),
    st.sampled_from([96, 256, 1000, 2048]),
    st.sampled_from([384, 768, 1536]),
    st.sampled_from([1, 2]),
    st.sampled_from(["forward", "both"]),
)
RINGS = ["ring", "ring:2", "bidirectional"]


@settings(max_examples=30)
@given(w=workloads)
def test_every_algorithm_computes_the_same_flops_on_every_rank(w):
    """Algorithms move the same computation around; none may lose or repeat a slice's flops."""
    def flops(algorithm, rank):
        total = 0.0
        for phase in w.phases(algorithm):
            steps = phase.schedule.steps(rank) if phase.schedule is not None else (None,)
            total += sum(k.flops for st in steps for k in phase.cost.compute(rank, st) if not k.name.endswith("cat"))
        return total

    for rank in range(w.world_size):
        ref = flops("vanilla", rank)
        assert ref == pytest.approx(sim.predict(profile(), w, "vanilla").flops, rel=1e-12)
        for algorithm in ("sliced:2", "sliced:3", *RINGS):
            assert flops(algorithm, rank) == pytest.approx(ref, rel=1e-12), (algorithm, rank)


def test_kernel_time_is_a_roofline_with_a_falling_efficiency():
    p = profile(half=1e9)
    c = p.compute
    big = sim.Kernel(flops=1e13, bytes=1e6)
    assert kernel_time(p, big) == pytest.approx((1e13 + 1e9) / (c.peak_flops * c.efficiency))
    # a kernel of half_efficiency_flops runs at half the efficiency
    assert sim.efficiency(p, 1e9) == pytest.approx(c.efficiency / 2)
    assert sim.efficiency(p, 1e12) > sim.efficiency(p, 1e10) > sim.efficiency(p, 1e8)
    # memory-bound: bytes over bandwidth wins
    streaming = sim.Kernel(flops=1e6, bytes=1e10)
    assert kernel_time(p, streaming) == pytest.approx(1e10 / c.memory_bandwidth)
    assert kernel_time(p, sim.Kernel()) == 0.0


def test_collective_time_is_the_standard_ring_cost():
    p = profile(("switch", "full"), latency=7e-6)
    assert collective_time(p, 1, 1e9) == 0.0
    rate = p.link.rate
    assert collective_time(p, 8, 1e6) == pytest.approx(7 * (7e-6 + 1e6 / rate))
    bus = profile(("bus", "half"), latency=0.0)
    assert ring_step_rate(bus, 4) == pytest.approx(bus.link.rate / 4)
    half = profile(("direct", "half"))
    assert ring_step_rate(half, 2) == pytest.approx(half.link.rate / 2)  # the pair's one link, both ways
    assert ring_step_rate(half, 5) == pytest.approx(half.link.rate)


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("n", [2, 3, 4, 6])
def test_message_classes_load_rank_0_as_the_whole_world_does(topology, n):
    """The symmetric engine's weights: per class of messages, what rank 0's resources carry in the full world."""
    p = profile(topology)
    for shifts in ([1], [1, n - 1], [1, 2] if n > 2 else [1]):
        full: Counter = Counter()
        for s in shifts:
            for r in range(n):
                for key, w in resources(p, r, (r + s) % n):
                    full[key] += w
        quotient: Counter = Counter()
        for s in shifts:
            for key, w in class_resources(p, n, s):
                quotient[key] += w
        # every resource of rank 0 in the full world carries what the class weights say
        for key, w in class_resources(p, n, shifts[0]):
            mine = {
                ("out",): ("out", 0), ("in",): ("in", 0), ("port",): ("port", 0), ("bus",): ("bus",),
            }.get(key)
            if mine is None:  # direct links: ("link", s) is the link 0 -> s, or the pair's link {0, s} when half duplex
                mine = ("link", 0, key[1])
            assert full[mine] == quotient[key], (topology, n, shifts, key)


@settings(max_examples=40)
@given(p=profiles, w=workloads, algorithm=st.sampled_from(["vanilla", "sliced:2", "sliced:3", *RINGS]))
def test_symmetric_engine_equals_the_full_engine(p, w, algorithm):
    assume(all(phase.cost.uniform for phase in w.phases(algorithm)))  # ranks alike: what the shortcut needs
    full = sim.predict(p, w, algorithm, symmetric=False)
    one = sim.predict(p, w, algorithm, symmetric=True)
    assert one.time == pytest.approx(full.time, rel=1e-9)
    assert one.compute_only == pytest.approx(full.compute_only, rel=1e-9)
    assert one.comm_only == pytest.approx(full.comm_only, rel=1e-9)


@settings(max_examples=40)
@given(p=profiles, w=workloads, algorithm=st.sampled_from(RINGS))
def test_ring_is_never_faster_than_its_compute_only_time(p, w, algorithm):
    pred = sim.predict(p, w, algorithm)
    assert pred.time >= pred.compute_only * (1 - 1e-12)
    assert pred.exposed >= -1e-15
    assert pred.hidden_fraction is None or 0.0 <= pred.hidden_fraction <= 1.0


@settings(max_examples=30)
@given(p=profiles, w=workloads)
def test_sliced_with_one_chunk_is_vanilla(p, w):
    assert sim.predict(p, w, "sliced:1").time == sim.predict(p, w, "vanilla").time


@settings(max_examples=30)
@given(p=profiles, w=workloads, algorithm=st.sampled_from(["vanilla", "sliced:2", *RINGS]),
       factor=st.sampled_from([1.5, 2.0, 10.0]))
def test_more_bandwidth_is_never_slower(p, w, algorithm, factor):
    slow = sim.predict(p, w, algorithm).time
    fast = sim.predict(p.replace(**{"link.bandwidth": p.link.bandwidth * factor}), w, algorithm).time
    assert fast <= slow * (1 + 1e-12)


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_the_tail_of_sliced_reduce_scatter_is_its_last_chunks_collective(topology, chunks):
    p = profile(topology, slowdown=0.3)
    w = sim.Workload("matmul_rs", tp=4, seq=4096, hidden=1024, batch=2)
    pred = sim.predict(p, w, f"sliced:{chunks}", record=True)
    last = pred.timeline.records_of(0)[-1]
    assert last.step == chunks and last.computed == last.post  # the last step computes nothing
    cost = w.phases(f"sliced:{chunks}")[0].cost
    piece = max(rows[chunks - 1] for rows in cost.piece_rows) * cost.row_bytes
    assert last.end - last.post == pytest.approx(collective_time(p, 4, piece, "reduce_scatter"), rel=1e-12)
    assert pred.time == pytest.approx(last.end, rel=1e-12)


def test_the_head_of_sliced_all_gather_is_its_first_chunks_collective():
    p = profile()
    w = sim.Workload("ag_matmul", tp=4, seq=4096, hidden=1024, batch=2)
    first = sim.predict(p, w, "sliced:4", record=True).timeline.records_of(0)[0]
    cost = w.phases("sliced:4")[0].cost
    piece = cost.piece_rows[0][0] * cost.row_bytes
    assert first.computed == first.post  # nothing to compute before the first chunk arrives
    assert first.end - first.post == pytest.approx(collective_time(p, 4, piece), rel=1e-12)


def test_each_step_posts_then_computes_then_waits():
    """The step contract: compute starts when the step's transfers are posted, the step ends after both."""
    p = profile(latency=1e-3, step=3e-6)  # transfers slower than compute
    w = sim.Workload("ag_matmul", tp=4, seq=1024, hidden=512)
    recs = sim.predict(p, w, "ring", record=True).timeline.records_of(0)
    assert len(recs) == 4
    for rec in recs[:-1]:
        assert rec.post == pytest.approx(rec.start + 3e-6)
        assert rec.comm is not None and rec.comm[0] == pytest.approx(rec.post)  # posted at the step's start
        assert rec.computed < rec.comm[1] <= rec.end  # the wait covers the transfer
    assert recs[-1].comm is None  # the last hop only computes


def test_contention_slows_only_the_overlapped_compute():
    w = sim.Workload("ag_matmul", tp=4, seq=4096, hidden=1024)
    calm, busy = profile(slowdown=0.0, bandwidth=400e9), profile(slowdown=0.5, bandwidth=400e9)
    assert sim.predict(calm, w, "ring").compute_only > sim.predict(calm, w, "ring").comm_only  # compute-bound
    assert sim.predict(busy, w, "ring").time > sim.predict(calm, w, "ring").time
    assert sim.predict(busy, w, "ring").compute_only == sim.predict(calm, w, "ring").compute_only
    # vanilla never computes while communicating
    assert sim.predict(busy, w, "vanilla").time == pytest.approx(sim.predict(calm, w, "vanilla").time)


def test_bidirectional_pays_off_only_where_directions_do_not_share():
    w = sim.Workload("ag_matmul", tp=8, seq=8192, hidden=1024)
    times = {}
    for topo in TOPOLOGIES:
        p = profile(topo, bandwidth=5e9, latency=0.0)
        times[topo] = sim.predict(p, w, "bidirectional").comm_only / sim.predict(p, w, "ring").comm_only
    assert times[("direct", "full")] == pytest.approx(0.5, rel=0.05)
    for topo in (("switch", "full"), ("switch", "half"), ("direct", "half"), ("bus", "half")):
        assert times[topo] == pytest.approx(1.0, rel=0.05), topo


def test_a_token_bucket_lets_a_pause_through_for_free():
    w = sim.Workload("ag_matmul", tp=2, seq=1024, hidden=1024)
    plain = profile(("bus", "half"), bandwidth=1e8, latency=0.0)
    bucket = plain.replace(**{"link.burst": 1e5})
    dt = sim.predict(plain, w, "vanilla").comm_only - sim.predict(bucket, w, "vanilla").comm_only
    assert dt == pytest.approx(1e5 / (plain.link.rate * plain.collective.efficiency), rel=1e-6)


def test_unequal_shards_run_every_rank_and_refuse_the_symmetric_engine():
    p = profile()
    w = sim.Workload("ag_matmul", tp=3, seq=1000, hidden=384)  # 1000 tokens over 3 ranks: 334, 333, 333
    assert not w.phases("ring")[0].cost.uniform
    pred = sim.predict(p, w, "ring", record=True)
    assert not pred.timeline.symmetric
    finish = pred.timeline.finish
    assert len(finish) == 3 and max(finish) == pred.time
    with pytest.raises(ValueError, match="unequal shards"):
        sim.predict(p, w, "ring", symmetric=True)


def test_fingerprint_check_adds_its_round_trip():
    p = profile(latency=1e-4)
    w = sim.Workload("mlp", tp=4, seq=1024, hidden=512)
    plain, checked = sim.predict(p, w, "ring"), sim.predict(p, w, "ring", check=True)
    assert checked.time > plain.time
    assert checked.compute_only == plain.compute_only  # measure modes skip the check, as the executor does


def test_mfu_and_flops_of_the_mlp():
    p = profile(half=0.0)
    w = sim.Workload("mlp", tp=4, seq=2048, hidden=1024, batch=2)
    pred = sim.predict(p, w, "vanilla")
    t, h, f = 4096, 1024, 4096
    gemms = 2 * (2.0 * t * h * f / 4)
    assert pred.flops == pytest.approx(gemms + sim._workloads.ACTIVATION_FLOPS * t * f / 4)
    assert pred.mfu == pytest.approx(pred.flops / (pred.time * p.compute.peak_flops))
    assert 0 < pred.mfu < p.compute.efficiency


def test_world_size_one_is_the_compute_alone():
    p = profile()
    w = sim.Workload("mlp", tp=1, seq=512, hidden=256)
    for a in ("vanilla", "ring", "sliced:2"):
        pred = sim.predict(p, w, a)
        assert pred.comm_only == pytest.approx(pred.outside + 2 * p.host.call_overhead + p.host.step_overhead * (
            len(schedule_for("all_gather", 1, a).template) + len(schedule_for("reduce_scatter", 1, a).template)))


def test_scale_runs_one_rank_for_thousands():
    w = sim.Workload("fsdp_linear", tp=1, dp=2048, seq=1024, hidden=4096, ffn=16384)
    pred = sim.predict("h100-sxm", w, "ring", record=True)
    assert pred.timeline.symmetric and len(pred.timeline.finish) == 1
    assert len(pred.timeline.records_of(1234)) == 2048
    assert math.isfinite(pred.time) and pred.time > pred.compute_only
