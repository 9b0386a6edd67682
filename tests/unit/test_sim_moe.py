"""Tier (a), no processes: the simulator's moe workload (expert-parallel dispatch and combine fused with the expert
GEMMs) is costed as the layer runs, its overlap obeys the bounds every schedule must, and ``commfuse simulate`` takes
its flags, refuses bad combinations by name and runs both presets end to end."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from commfuse import sim
from commfuse.cli import main
from commfuse.errors import CommfuseValueError
from commfuse.bench import simulate as sim_command
from commfuse.sim._model import all_to_all_spread, collective_time
from commfuse.sim._planner import candidates, choose, op_times

H100 = sim.load_profile("h100-sxm")
#: H100 compute with a slow switch: makes a small layer's all-to-all comparable to its expert GEMMs.
SLOW_LINK = H100.replace(**{"link.bandwidth": 100e9})


def moe(**kw) -> sim.Workload:
    sizes = dict(tp=1, seq=4096, hidden=2048, ffn=4096, ep=4, experts=8, topk=2, passes="both")
    sizes.update(kw)
    return sim.Workload("moe", **sizes)


def times(profile, workload, algorithms=("vanilla", "sliced:4", "ring")):
    return {p.algorithm: p for p in sim.compare(profile, workload, algorithms)}


def comm_over_compute(p: sim.Prediction) -> float:
    return p.comm / (p.compute_only - p.outside)


def test_ring_beats_vanilla_and_sliced_when_comm_is_comparable_to_compute():
    w = moe()
    got = times(SLOW_LINK, w)
    ratio = comm_over_compute(got["vanilla"])
    assert 0.3 < ratio < 1.5, ratio  # the premise: comm comparable to compute
    assert got["ring"].speedup_vs_vanilla > 1.2
    assert got["ring"].time < got["sliced:4"].time < got["vanilla"].time
    assert got["ring"].hidden_fraction > 0.8


def test_vanilla_is_the_sum_of_its_comm_and_its_compute():
    no_host = {"host.call_overhead": 0.0, "host.step_overhead": 0.0}  # which both runs would count
    for profile in (H100, SLOW_LINK, sim.load_profile("ascend-910b")):
        v = times(profile.replace(**no_host), moe(), ("vanilla",))["vanilla"]
        # nothing overlaps: the layer is its compute plus every all-to-all
        assert v.time == pytest.approx(v.compute_only + v.comm, rel=1e-6)
        assert v.hidden_fraction == pytest.approx(0.0, abs=1e-6)
        with_host = times(profile, moe(), ("vanilla",))["vanilla"]
        assert with_host.time == pytest.approx(v.compute_only + v.comm, rel=0.05)


@pytest.mark.parametrize("profile", ["h100-sxm", "ascend-910b", "a100-sxm", "tpu-v5p"])
@pytest.mark.parametrize("shape", [dict(), dict(hidden=1024, ffn=512, topk=4), dict(seq=512, experts=32, ep=8)])
def test_overlap_is_never_predicted_faster_than_its_comm_or_its_compute(profile, shape):
    w = moe(**shape)
    for p in sim.compare(profile, w, ("vanilla", "sliced:2", "sliced:4", "ring", "ring:2")):
        floor = max(p.compute_only, p.comm_only)
        assert p.time >= floor * (1 - 1e-9), (p.algorithm, p.time, p.compute_only, p.comm_only)
        assert p.time <= p.compute_only + p.comm * 1.05 + 1e-4  # and never worse than doing them one after another


def test_flops_are_the_expert_gemms():
    t, k, h, f = 4096, 2, 2048, 4096
    got = times(H100, moe(passes="forward"), ("vanilla",))["vanilla"]
    gemms = 2 * t * k * h * 2 * f + 2 * t * k * f * h  # gate/up, then down, over every routed row
    # what else is counted: SwiGLU (6 flops per element), the router (2 * t * h * experts) and the gate-weighted sum
    extra = 6 * t * k * f + 2 * t * h * 8 + 2 * t * k * h
    assert got.flops == pytest.approx(gemms + extra)
    both = times(H100, moe(), ("vanilla",))["vanilla"]
    assert both.flops > 2.9 * gemms  # the backward: dgrad and wgrad of both GEMMs


def test_forward_and_backward_alone_add_up_to_both():
    for algorithm in ("vanilla", "ring"):
        parts = [sim.predict(SLOW_LINK, moe(passes=x), algorithm).time for x in ("forward", "backward", "both")]
        assert parts[0] + parts[1] == pytest.approx(parts[2], rel=0.01)
        assert parts[1] > parts[0]  # twice the GEMMs


def test_the_symmetric_and_full_engines_agree():
    w = moe(seq=1000)  # 2000 rows per source over 4 ranks: 500 per block, each cut unevenly by sliced:3
    for algorithm in ("vanilla", "sliced:3", "ring", "ring:3"):
        a = sim.predict(SLOW_LINK, w, algorithm).time
        b = sim.predict(SLOW_LINK, w, algorithm, symmetric=False).time
        assert a == pytest.approx(b, rel=1e-9)


def test_skewed_routing_runs_every_rank_and_costs_more():
    balanced = sim.predict(SLOW_LINK, moe(), "vanilla")
    skewed = sim.predict(SLOW_LINK, moe(skew=2.0), "vanilla")
    assert skewed.time > 1.3 * balanced.time  # rank 0 takes half of every rank's rows: its GEMMs and links pace all
    rows = moe(skew=2.0).routed_rows()
    assert rows[1] == [4096, 1366, 1365, 1365] and sum(rows[2]) == 4096 * 2
    assert sim.predict(SLOW_LINK, moe(skew=2.0), "ring").time < skewed.time


def test_grouping_by_source_takes_the_overlap_out_of_sliced():
    # commfuse.nn.MoE as of this writing calls one grouped GEMM per source's whole block: sliced:c then chunks the
    # messages but computes a block only once all its chunks are there (dispatch) / makes it whole first (combine)
    step = times(SLOW_LINK, moe(), ("vanilla", "sliced:4", "ring"))
    source = times(SLOW_LINK, moe(grouping="source"), ("vanilla", "sliced:4", "ring"))
    assert step["sliced:4"].speedup_vs_vanilla > 1.1
    assert source["sliced:4"].speedup_vs_vanilla < 1.02
    assert source["ring"].time == pytest.approx(step["ring"].time, rel=1e-9)  # one source per step: the same calls


def test_many_small_expert_calls_cost_weight_reads():
    # 32 local experts, 64 rows per expert per source block: per-source calls re-read every expert's weights
    w = moe(hidden=4096, ffn=1024, experts=128, ep=4, topk=4, seq=256)
    got = times(H100, w, ("vanilla", "ring"))
    assert got["ring"].compute_only > 1.5 * got["vanilla"].compute_only


def test_bad_moe_shapes_are_named():
    with pytest.raises(CommfuseValueError, match="10 experts do not divide over ep=4"):
        moe(experts=10)
    with pytest.raises(CommfuseValueError, match="topk=9 is more than the 8 experts"):
        moe(topk=9)
    with pytest.raises(CommfuseValueError, match="skew must be a number from 1"):
        moe(skew=5.0)
    with pytest.raises(CommfuseValueError, match="give its size as ep, not tp=2"):
        moe(tp=2)
    with pytest.raises(CommfuseValueError, match="ep=2 applies to the moe workload only"):
        sim.Workload("mlp", tp=2, seq=8, hidden=8, ep=2)
    with pytest.raises(CommfuseValueError, match="no bidirectional form"):
        sim.predict(H100, moe(), "bidirectional")


def test_whole_all_to_alls_use_every_link_of_a_full_mesh():
    ascend = sim.load_profile("ascend-910b")
    assert all_to_all_spread(H100, 8) == 1.0  # one NVSwitch port carries all seven pieces
    assert all_to_all_spread(ascend, 8) == pytest.approx(1 / 7)  # seven HCCS links, one piece each
    piece = 64e6
    mesh = collective_time(ascend, 8, piece, "all_to_all")
    assert mesh == pytest.approx(7 * ascend.collective_latency + piece / ascend.link.rate)
    assert collective_time(ascend, 8, piece, "all_gather") > 6 * (mesh - 7 * ascend.collective_latency)


def test_the_planner_knows_the_produce_side():
    assert candidates("produce_all_to_all") == candidates("all_to_all") == ("vanilla", "ring")
    for nbytes, flops in ((1 << 22, 1e9), (1 << 26, 1e12), (1 << 12, 1e6)):
        t = op_times("produce_all_to_all", 4, slice_bytes=nbytes, flops=flops, profile=H100)
        name, why = choose("produce_all_to_all", 4, slice_bytes=nbytes, flops=flops, profile=H100)
        assert t[name] == min(t.values()) and name in why
    # a big block made behind the one before: ring; a tiny one: the hops' latency loses to one collective
    assert choose("produce_all_to_all", 4, slice_bytes=1 << 26, flops=1e12, profile=H100)[0] == "ring"
    assert choose("produce_all_to_all", 4, slice_bytes=1 << 12, flops=1e6, profile=H100)[0] == "vanilla"


# -- the CLI -------------------------------------------------------------------------------------------------------

MOE = ["simulate", "--profile", "h100-sxm", "--workload", "moe", "--ep", "4", "--experts", "8", "--topk", "2",
       "--seq", "2048", "--hidden", "1024", "--ffn", "2048"]


def rows(out: str) -> list[str]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("---------")) + 1
    return [line.split()[0] for line in lines[start:] if line.strip() and not line.startswith(("all-to-all", "best"))]


@pytest.mark.parametrize("preset", sim_command.MOE_PRESETS)
@pytest.mark.parametrize("profile", ["h100-sxm", "ascend-910b"])
def test_presets_run_end_to_end(preset, profile, capsys):
    assert main(["simulate", "--profile", profile, "--preset", preset]) == 0
    out = capsys.readouterr().out
    assert out.startswith("moe both, ep 8") and "8192 tokens per rank" in out
    assert rows(out) == ["vanilla", "sliced:2", "sliced:4", "ring", "ring:2"]
    assert "all-to-all share of vanilla's layer time" in out and "up to 47%" in out
    assert "Comet (ByteDance, MLSys'25) reports 1.96x for a single MoE layer and 1.71x end to end" in out


def test_preset_names_match_the_simulators():
    assert set(sim_command.MOE_PRESETS) == set(sim.MOE_PRESETS)
    assert sim.MOE_PRESETS["deepseek-v3"]["experts"] == 256 and sim.MOE_PRESETS["mixtral-8x7b"]["ffn"] == 14336


def test_flags_override_the_preset_and_json_has_the_moe_shape(capsys):
    assert main(["simulate", "-p", "h100-sxm", "--preset", "mixtral-8x7b", "--seq", "1024", "--pass", "forward",
                 "-a", "ring", "sliced:2", "--json"]) == 0
    captured = capsys.readouterr()
    records = json.loads(captured.out)
    assert [r["algorithm"] for r in records] == ["vanilla", "ring", "sliced:2"]
    shape = records[0]["shape"]
    assert (shape["seq"], shape["ep"], shape["experts"], shape["topk"], shape["passes"]) == (1024, 8, 8, 2, "forward")
    assert records[0]["world_size"] == 8 and "moe forward" in captured.err


def test_moe_defaults_and_the_other_workloads_default_pass(capsys):
    assert main(MOE) == 0
    out = capsys.readouterr().out
    assert out.startswith("moe both, ep 4, 8 experts (2 per rank), top-2, 2048 tokens per rank")
    assert main(["simulate", "-p", "h100-sxm", "-w", "mlp", "--tp", "2", "--seq", "64", "--hidden", "64"]) == 0
    assert capsys.readouterr().out.startswith("mlp forward, tp 2")


def test_skew_and_grouping_flags(capsys):
    assert main([*MOE, "--skew", "1.5", "--moe-grouping", "source", "-a", "ring"]) == 0
    out = capsys.readouterr().out
    assert "skew 1.5" in out and "one GEMM call per source" in out and "each simulated" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([*MOE[:8], "6", *MOE[9:]], "6 experts do not divide over ep=4"),
        ([*MOE[:10], "9", *MOE[11:]], "topk=9 is more than the 8 experts"),
        ([*MOE, "--skew", "0.5"], "skew must be a number from 1"),
        ([*MOE, "--tp", "2"], "give its size as --ep, not --tp 2"),
        ([*MOE, "-a", "bidirectional"], "no bidirectional form"),
        (["simulate", "-p", "h100-sxm", "-w", "mlp", "--tp", "2", "--seq", "8", "--hidden", "8", "--ep", "2",
          "--topk", "1"], "--ep, --topk apply to --workload moe only, not mlp"),
        (["simulate", "-p", "h100-sxm", "--preset", "deepseek-v3", "-w", "mlp"], "cannot be --workload mlp"),
        (["simulate", "-p", "h100-sxm", "-w", "moe", "--ep", "2", "--hidden", "8"], "needs --seq"),
    ],
)
def test_bad_moe_combinations_exit_2_naming_them(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_explain_covers_both_fused_ops(capsys):
    assert main([*MOE, "--explain"]) == 0
    out = capsys.readouterr().out
    assert "moe.dispatch (all_to_all)" in out and "moe.combine (produce_all_to_all)" in out
    assert "bidirectional" not in out.split("fastest:")[1]


def test_workload_replace_keeps_moe_fields():
    w = replace(moe(), seq=128)
    assert (w.ep, w.experts, w.topk, w.world_size, w.tokens) == (4, 8, 2, 4, 128)
