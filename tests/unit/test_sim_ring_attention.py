"""Tier (a), no processes: the ring_attention workload's model (bytes per step, zigzag's equal steps against contiguous's imbalance, the tail-free backward ring, Ulysses' K/V-head limit, the 2-D form's step counts) and its ``commfuse simulate`` table."""

from __future__ import annotations

import pytest

from commfuse import sim
from commfuse.cli import main
from commfuse.errors import CommfuseValueError
from commfuse.sim import _ring_attention as ra
from commfuse.sim._predict import segments

# the layer: Llama-70B-like attention, 128k tokens, CP 8
LLAMA = dict(seq=131072, hidden=8192, heads=64, kv_heads=8, head_dim=128)


def workload(passes="forward", cp=8, **kw):
    shape = {**dict(seq=4096, hidden=1024, heads=8, kv_heads=2, head_dim=128), **kw}
    return sim.Workload("ring_attention", tp=1, cp=cp, passes=passes, **shape)


def profile(topology="switch", *, bandwidth=50e9, slowdown=0.0):
    return sim.Profile(
        name="test",
        compute=sim.ComputeSpec(peak_flops=100e12, memory_bandwidth=1e12, efficiency=0.8,
                                half_efficiency_flops=1e6, dtype="bfloat16"),
        link=sim.LinkSpec(bandwidth=bandwidth, latency=5e-6, topology=topology, duplex="full", efficiency=1.0),
        collective=sim.CollectiveSpec(efficiency=1.0),
        host=sim.HostSpec(step_overhead=1e-6, call_overhead=1e-6),
        contention=sim.ContentionSpec(compute_slowdown=slowdown),
    )


def phase(w, algorithm, name):
    return next(p for p in w.phases(algorithm) if p.name == name)


def step_flops(p, rank):
    return [sum(k.flops for k in p.cost.compute(rank, s)) for s in p.schedule.steps(rank)]


# -- bytes --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 3])
def test_kv_block_bytes_are_two_times_tokens_kv_heads_head_dim_dtype(batch):
    w = sim.Workload("ring_attention", tp=1, cp=8, passes="both", batch=batch, **LLAMA)
    kv = 2 * (131072 // 8) * 8 * 128 * 2 * batch  # K and V, s/cp tokens, only the 8 K/V heads, bf16
    assert kv == 64 * 2**20 * batch
    fwd = phase(w, "ring", "attention")
    sends = [t for s in fwd.schedule.steps(0) for t in s.sends]
    assert len(sends) == 7 and {fwd.cost.transfer_bytes(0, t) for t in sends} == {kv}
    bwd = phase(w, "ring", "attention.backward")
    by_channel = {}
    for s in bwd.schedule.steps(0):
        for t in s.sends:
            by_channel.setdefault(t.channel, set()).add(bwd.cost.transfer_bytes(0, t))
    # the K/V pass again (bf16) and the dK/dV running sums in float32
    assert by_channel == {ra.KV_CHANNEL: {kv}, 0: {kv * ra.GRAD_PARTIAL_BYTES // 2}}
    bi = phase(w, "bidirectional", "attention")
    assert {bi.cost.transfer_bytes(0, t) for s in bi.schedule.steps(0) for t in s.sends} == {kv / 2}


# -- causal layouts ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_zigzag_gives_every_step_of_every_rank_the_same_work(n):
    w = workload(cp=n, seq=2 * n * 64)
    p = phase(w, "ring", "attention")
    flops = {f for r in range(n) for f in step_flops(p, r)}
    assert len(flops) == 1
    # half of a whole (s/n x s/n) block: the causal half, skipped blocks and all
    assert flops.pop() == pytest.approx(0.5 * p.cost.unit_flops)
    assert sum(ra.block_fraction("zigzag", n, 0, j) for j in range(n)) == pytest.approx(n / 2)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_contiguous_causal_is_unbalanced_by_2n_minus_1(n):
    w = workload(cp=n, seq=n * 64, layout="contiguous")
    p = phase(w, "ring", "attention")
    per_rank = [sum(step_flops(p, r)) for r in range(n)]
    assert max(per_rank) / min(per_rank) == pytest.approx(2 * n - 1)  # rank n-1: n - 1/2 blocks; rank 0: 1/2
    last = [step_flops(p, r)[-1] for r in range(n)]
    assert last[n - 1] == pytest.approx(p.cost.unit_flops)  # only the last rank has an unmasked block left
    assert all(f == 0 for f in last[:-1])  # fully masked blocks are skipped


def test_zigzag_ring_beats_contiguous_by_about_the_imbalance():
    n = 8
    zig = sim.predict(profile(), workload(cp=n, seq=8192), "ring")
    con = sim.predict(profile(), workload(cp=n, seq=8192, layout="contiguous"), "ring")
    # the ring waits for the slowest rank every step: (n - 1/2) blocks against zigzag's n/2
    assert con.time / zig.time == pytest.approx((n - 0.5) / (n / 2), rel=0.1)


def test_flops_are_the_causal_half_and_backward_is_2_5x():
    w = sim.Workload("ring_attention", tp=1, cp=8, passes="forward", **LLAMA)
    causal = 4 * 131072**2 * 64 * 128 / 2
    assert sum(p.cost.flops(0) for p in w.phases("ring")) * 8 == pytest.approx(causal)
    wb = sim.Workload("ring_attention", tp=1, cp=8, passes="backward", **LLAMA)
    for a in ("ring", "vanilla", "ulysses", "2d:2x4"):
        assert sum(p.cost.flops(0) for p in wb.phases(a)) * 8 == pytest.approx(2.5 * causal), a


# -- the backward ring ------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("algorithm", ["ring", "bidirectional"])
def test_backward_ring_has_no_tail_and_every_block_arrives_in_time(n, algorithm):
    s = ra.backward_schedule(n, algorithm)  # raises if a block is computed before it arrives
    assert s.num_steps == n
    steps = s.steps(0)
    # no step after the last compute: the last sum flies behind the rank's own block, then one add remains
    assert steps[-1].compute and steps[-1].accumulate == steps[-1].compute if n > 1 else True
    assert not [t for t in steps[-1].sends if t.channel >= ra.KV_CHANNEL]
    halves = 2 if algorithm == "bidirectional" else 1
    kv = [t for st in steps for t in st.sends if t.channel >= ra.KV_CHANNEL]
    sums = [t for st in steps for t in st.sends if t.channel < ra.KV_CHANNEL]
    assert len(kv) == halves * max(n - 2, 0)  # own block and the forward's last block need no hop
    assert len(sums) == halves * (n - 1)
    if n > 1:  # the sums go the other way round from the forward's K/V
        fwd = sim.Workload("ring_attention", tp=1, cp=n, seq=2 * n * 8, hidden=256, heads=2).phases("ring")[0]
        assert fwd.schedule.steps(0)[0].sends[0].peer == 1 % n
        assert steps[1].sends[0].peer == (n - 1) % n
        # and the backward starts on the block the forward ended on
        assert fwd.schedule.steps(0)[-1].compute[0].shard == steps[0].compute[0].shard


@pytest.mark.parametrize("topology", ["switch", "direct", "bus"])
@pytest.mark.parametrize("algorithm", ["ring", "bidirectional", "vanilla", "ulysses", "2d:2x2"])
def test_symmetric_engine_equals_the_full_one(topology, algorithm):
    w = workload("both", cp=4, seq=1024, kv_heads=4)
    pr = profile(topology, slowdown=0.1)
    a = sim.predict(pr, w, algorithm)
    b = sim.predict(pr, w, algorithm, symmetric=False)
    assert a.time == pytest.approx(b.time, rel=1e-9, abs=1e-15)
    assert a.compute_only == pytest.approx(b.compute_only, rel=1e-9, abs=1e-15)


# -- ring against vanilla ----------------------------------------------------------------------------------


@pytest.mark.parametrize("passes", ["forward", "backward"])
def test_ring_exposes_less_than_vanilla_when_comm_is_under_compute(passes):
    w = workload(passes, cp=8, seq=16384)
    pr = profile(bandwidth=50e9)
    ring, vanilla = sim.predict(pr, w, "ring"), sim.predict(pr, w, "vanilla")
    hop = w.phases("ring")[0].cost.block_bytes / 50e9
    step = w.phases("ring")[0].cost.unit_flops * 0.5 / (100e12 * 0.8)
    assert hop < step  # the regime of the claim
    assert ring.exposed < 0.1 * vanilla.exposed
    assert ring.time < vanilla.time
    # and where the links are far too slow, the ring cannot hide it either: it pays about the comm
    slow = profile(bandwidth=1e8)
    assert sim.predict(slow, w, "ring").exposed > 0.5 * sim.predict(slow, w, "vanilla").exposed


def test_bidirectional_halves_the_exposed_hops_only_on_direct_links():
    w = workload("forward", cp=8, seq=16384)
    slow = dict(bandwidth=2e9)
    for topology, ratio in (("direct", 0.5), ("switch", 1.0)):
        pr = profile(topology, **slow)
        ring, bi = sim.predict(pr, w, "ring"), sim.predict(pr, w, "bidirectional")
        assert bi.comm_only / ring.comm_only == pytest.approx(ratio, rel=0.05), topology


# -- Ulysses and the 2-D form -----------------------------------------------------------------------------


def test_ulysses_refuses_more_ranks_than_kv_heads_unless_they_replicate():
    w = workload("forward", cp=8, seq=8192, kv_heads=2)
    with pytest.raises(CommfuseValueError, match="needs at least 8 K/V heads.*kv_replicate"):
        w.phases("ulysses")
    with pytest.raises(CommfuseValueError, match="needs at least"):
        sim.compare(profile(), w, ["ulysses"])
    w.phases("2d:4x2")  # 2 Ulysses ranks: one K/V head each
    rep = workload("forward", cp=8, seq=8192, kv_heads=2, kv_replicate=True)
    a2a = phase(rep, "ulysses", "qkv.all_to_all")
    local, d = 8192 // 8, 128
    # Q: one query head per rank; K/V: the one (copied) K/V head each rank needs
    assert a2a.cost.piece == local * 1 * d * 2 + 2 * local * 1 * d * 2
    w8 = sim.Workload("ring_attention", tp=1, cp=8, **LLAMA)  # 8 K/V heads at CP 8: works, one head each
    assert phase(w8, "ulysses", "qkv.all_to_all").cost.piece == 16384 * 8 * 128 * 2 + 2 * 16384 * 1 * 128 * 2


@pytest.mark.parametrize(("r", "u"), [(2, 4), (4, 2), (8, 1), (1, 8)])
def test_two_d_form_step_counts(r, u):
    w = workload("both", cp=8, seq=8192, heads=8, kv_heads=8)
    phases = w.phases(f"2d:{r}x{u}")
    fwd, bwd = phase(w, f"2d:{r}x{u}", "attention"), phase(w, f"2d:{r}x{u}", "attention.backward")
    assert fwd.schedule.world_size == r
    if r > 1:
        assert fwd.schedule.num_steps == r
        assert sum(len(s.sends) for s in fwd.schedule.steps(0)) == r - 1
        assert bwd.schedule.num_steps == r
    a2a = [p for p in phases if p.name.endswith("all_to_all")]
    assert len(a2a) == (4 if u > 1 else 0) and all(p.schedule.world_size == u for p in a2a)
    # the ring's K/V block weighs what the pure ring's does: s/r tokens of Hkv/u heads
    pure = phase(w, "ring", "attention").cost.block_bytes
    assert fwd.cost.block_bytes == pytest.approx(pure)
    assert [n for n, _ in segments(phases)] == ([u, r, u, r, u] if u > 1 else [r])  # out + dout a2a: one run


def test_two_d_must_multiply_to_cp():
    with pytest.raises(CommfuseValueError, match="R x U = 8"):
        workload(cp=8, seq=8192).check_algorithm("2d:2x2")
    with pytest.raises(CommfuseValueError, match="unknown algorithm 'sliced:2'"):
        workload(cp=8, seq=8192).check_algorithm("sliced:2")


# -- the command ------------------------------------------------------------------------------------------

CMD = ["simulate", "--profile", "h100-sxm", "-w", "ring_attention", "--cp", "8", "--seq", "131072", "--hidden",
       "8192", "--heads", "64", "--kv-heads", "8", "--head-dim", "128"]


def test_the_command_prints_forward_backward_exposed_and_fastest(capsys):
    assert main([*CMD, "-a", "vanilla", "ring", "ulysses", "2d:2x4"]) == 0
    out = capsys.readouterr().out
    assert "forward ms" in out and "backward ms" in out and "exposed" in out
    rows = [line.split()[0] for line in out.splitlines()[4:] if line.strip() and not line.startswith(
        ("fastest", "exposed", "links", "ulysses:"))]
    assert rows == ["vanilla", "ring", "ulysses", "2d:2x4"]
    assert "fastest: ring" in out
    assert "one link figure" in out and "8 K/V heads" in out


@pytest.mark.parametrize(("extra", "message"), [(["--cp", "16"], "needs at least 16 K/V heads"),
                                                (["--pass", "forward"], "--pass does not apply"),
                                                (["--seq", "1000"], "must divide into 16 equal chunks")])
def test_the_command_refuses_naming_why(extra, message, capsys):
    assert main([*CMD, *extra] if extra[0] != "--cp" else [*CMD, *extra, "-a", "ulysses"]) == 2
    assert message in capsys.readouterr().err


def test_json_has_a_forward_and_a_backward_record_per_algorithm(capsys):
    import json

    assert main([*CMD, "-a", "vanilla", "ring", "--json"]) == 0
    captured = capsys.readouterr()
    records = json.loads(captured.out)
    assert "forward ms" in captured.err  # the table moves to stderr
    assert [(r["algorithm"], r["shape"]["passes"]) for r in records] == [
        ("vanilla", "forward"), ("ring", "forward"), ("vanilla", "backward"), ("ring", "backward")]
    assert {r["shape"]["cp"] for r in records} == {8} and {r["shape"]["kv_heads"] for r in records} == {8}
    assert all(r["predicted"] and r["world_size"] == 8 for r in records)


def test_plot_is_refused_not_ignored(tmp_path, capsys):
    assert main([*CMD, "--plot", str(tmp_path / "g.svg")]) == 2
    assert "--plot is not supported" in capsys.readouterr().err


def test_its_flags_are_refused_with_another_workload(capsys):
    argv = ["simulate", "--profile", "h100-sxm", "-w", "mlp", "--tp", "2", "--seq", "64", "--hidden", "64"]
    assert main([*argv, "--cp", "2", "--kv-heads", "1"]) == 2
    assert ("--cp applies to --workload ring_attention only; --kv-heads applies to --workload attention or "
            "ring_attention only, not mlp") in capsys.readouterr().err
