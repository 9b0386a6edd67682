"""Tier (a), no processes: the simulator's model presets and the attention workload they are built from. The
presets' shapes give the published parameter counts; each part's flops are the hand counts; causal attention costs
about half the score flops of full attention, a backward about twice its forward, and grouped-query heads shrink
the K/V the attention reads and the QKV projection, not what travels; ``commfuse simulate --model`` answers "what
do I gain" in one command, and its errors name the command's flags."""

from __future__ import annotations

import json
import re

import pytest

from commfuse import sim
from commfuse.bench import simulate as simulate_command
from commfuse.cli import main
from commfuse.errors import CommfuseValueError
from commfuse.sim import MLA

T = 8192  # tokens of one TP group: batch 1 x seq 8192, Llama 3's pretraining context


def _flops(workload: sim.Workload, algorithm: str = "vanilla", *, named: str | None = None) -> float:
    """Rank 0's flops of ``workload``'s phases (those whose name starts with ``named``), as the engine costs them."""
    total = 0.0
    for phase in workload.phases(algorithm):
        if named is not None and not phase.name.startswith(named):
            continue
        steps = phase.schedule.steps(0) if phase.schedule is not None else (None,)
        total += sum(k.flops for st in steps for k in phase.cost.compute(0, st) if not k.name.endswith("cat"))
    return total


def _bytes(workload: sim.Workload, name: str, algorithm: str = "vanilla") -> float:
    phase = next(p for p in workload.phases(algorithm) if p.name == name)
    steps = phase.schedule.steps(0) if phase.schedule is not None else (None,)
    return sum(k.bytes for st in steps for k in phase.cost.compute(0, st) if not k.name.endswith("cat"))


# -- the presets' shapes --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "total", "per_token"), [
    ("llama3-8b", 8_030_261_248, None),  # the released checkpoints' parameter counts
    ("llama3-70b", 70_553_706_496, None),
    ("llama3-405b", 405_853_388_800, None),
    ("deepseek-v3", 671e9, 37e9),  # the technical report: 671B, 37B activated per token (MTP module aside)
])
def test_the_presets_shapes_give_the_published_parameter_counts(name, total, per_token):
    all_of_it, used = sim.MODELS[name].parameters()
    assert all_of_it == pytest.approx(total, rel=2e-3)
    assert used == pytest.approx(per_token or total, rel=2e-2)


def test_the_commands_model_names_are_the_simulators():
    assert simulate_command.MODELS == tuple(sim.MODELS)


def test_deepseek_v3_is_dense_then_moe_with_a_shared_expert():
    parts = {p.name: p for p in sim.model_parts("deepseek-v3", tp=8)}
    assert {n: p.count for n, p in parts.items()} == {"attention": 61, "dense mlp": 3, "moe": 58, "shared expert": 58,
                                                       "lm head": 1}
    moe = parts["moe"].workload
    assert (moe.experts, moe.topk, moe.ffn, moe.ep, moe.hidden) == (256, 8, 2048, 8, 7168)
    assert moe.tokens == 4096 // 8  # each rank's own tokens after the attention's reduce-scatter
    assert parts["dense mlp"].workload.ffn == 18432 and parts["dense mlp"].workload.gated
    shared = parts["shared expert"].workload
    assert (shared.ffn, shared.tp, shared.tokens, shared.gated) == (2048, 1, 512, True)
    assert parts["attention"].workload.mla == MLA(q_lora=1536, kv_lora=512, nope=128, rope=64, v=128)
    assert parts["lm head"].workload.ffn == 129280


# -- flops against hand counts --------------------------------------------------------------------------------------


def test_llama3_70b_parts_cost_the_hand_counted_flops():
    """Rank 0 of TP 8, 8192 tokens, forward: 8 query heads and one K/V head of 128 per rank."""
    parts = {p.name: p.workload for p in sim.model_parts("llama3-70b", tp=8, passes="forward")}
    h, f, v, n = 8192, 28672, 128256, 8
    q, kv = 8 * 128, 1 * 128  # this rank's query and K/V widths
    keys = T * (T + 1) // 2  # causal: query position p attends to p + 1 keys
    attention = 2 * T * h * (q + 2 * kv) + 4 * q * keys + 2 * T * q * h  # QKV, QK^T and PV, out-projection
    assert _flops(parts["attention"]) == pytest.approx(attention, rel=1e-12)
    mlp = 2 * T * h * (2 * f // n) + 6 * T * (f // n) + 2 * T * (f // n) * h  # gate/up, SwiGLU, down
    assert _flops(parts["mlp"]) == pytest.approx(mlp, rel=1e-12)
    assert _flops(parts["lm head"]) == pytest.approx(2 * T * h * v // n, rel=1e-12)
    # every algorithm moves the same work around
    for algorithm in ("ring", "ring:2", "bidirectional", "sliced:4"):
        assert _flops(parts["attention"], algorithm) == pytest.approx(attention, rel=1e-12)


def test_a_models_gemm_flops_are_two_per_weight_per_token():
    """Forward, the step's flops less the attention scores and SwiGLU are 2 x (weights in the TP layers) x tokens
    / tp: the presets' parts hold every weight once (the embedding aside, which multiplies nothing)."""
    for name in ("llama3-8b", "llama3-70b", "llama3-405b"):
        m = sim.MODELS[name]
        n = 8
        predictions = sim.compare_model("h100-sxm", m, ["vanilla"], tp=n, passes="forward")
        flops = predictions[0].flops
        q = m.heads // n * m.head_dim
        scores = m.layers * 4 * q * T * (T + 1) // 2
        swiglu = m.layers * 6 * T * (m.ffn // n)
        total, _ = m.parameters()
        norms = m.hidden * (2 * m.layers + 1)
        weights = total - m.vocab * m.hidden - norms  # all but the embedding and the norms
        assert flops - scores - swiglu == pytest.approx(2 * weights * T / n, rel=1e-12), name


def test_mla_parts_cost_the_hand_counted_flops():
    """DeepSeek-V3's attention at TP 8: the latents whole on every rank, 16 heads' up-projections and scores."""
    w = next(p.workload for p in sim.model_parts("deepseek-v3", tp=8, passes="forward") if p.name == "attention")
    s, h, heads = 4096, 7168, 16
    down = 2 * s * h * (1536 + 512 + 64)
    up = 2 * s * (1536 * heads * (128 + 64) + 512 * heads * (128 + 128))
    scores = (2 * heads * (128 + 64) + 2 * heads * 128) * s * (s + 1) // 2
    out = 2 * s * heads * 128 * h
    assert _flops(w) == pytest.approx(down + up + scores + out, rel=1e-12)
    assert _flops(w, named="mla.up") == pytest.approx(up, rel=1e-12)


# -- causal, backward, grouped-query --------------------------------------------------------------------------------


def _attention(**kw) -> sim.Workload:
    shape = dict(tp=8, seq=T, hidden=8192, heads=64, kv_heads=8, passes="forward")
    shape.update(kw)
    return sim.Workload("attention", **shape)


def test_causal_attention_costs_about_half_the_score_flops():
    def scores(w):  # the attention+out op less its out-projection
        out = 2 * w.tokens * (w.heads // w.tp * w.head_dim) * w.hidden
        return _flops(w, named="attention+out") - out

    causal, full = scores(_attention()), scores(_attention(causal=False))
    assert causal / full == pytest.approx((T + 1) / (2 * T), rel=1e-12)
    assert sim.predict("h100-sxm", _attention(), "vanilla").compute_only < \
        sim.predict("h100-sxm", _attention(causal=False), "vanilla").compute_only


def test_causal_attention_makes_the_ring_steps_unequal_across_ranks():
    """Query-split attention: at step k rank r computes query shard r - 1 - k, so with causal masking the ranks
    compute different amounts at the same step (the engine simulates them all); without, they are alike."""
    phase = next(p for p in _attention().phases("ring") if p.name == "attention+out")
    work = [[sum(k.flops for k in phase.cost.compute(r, st)) for st in phase.schedule.steps(r)] for r in range(8)]
    assert len({row[0] for row in work}) == 8  # step 0: eight different shards, eight different costs
    assert all(sum(row) == pytest.approx(sum(work[0]), rel=1e-12) for row in work)  # the same work in all
    assert not phase.cost.uniform
    full = next(p for p in _attention(causal=False).phases("ring") if p.name == "attention+out")
    assert full.cost.uniform


def test_a_backward_costs_about_twice_its_forward():
    both = _attention(passes="both")
    forward, backward = _flops(_attention()), _flops(_attention(passes="backward"))
    assert _flops(both) == pytest.approx(forward + backward, rel=1e-12)
    assert 2.0 < backward / forward < 2.5
    # the attention core 2.5x (flash attention's five GEMMs to two), the projections exactly 2x
    w = _attention()
    q = w.heads // w.tp * w.head_dim
    core = 4 * q * T * (T + 1) // 2
    projections = _flops(w) - core
    assert backward == pytest.approx(2.5 * core + 2 * projections, rel=1e-12)
    for name in ("mlp", "ag_matmul", "matmul_rs"):
        shape = dict(tp=8, seq=4096, hidden=4096, ffn=14336, gated=True) if name == "mlp" else \
            dict(tp=8, seq=4096, hidden=4096)
        f = _flops(sim.Workload(name, passes="forward", **shape))
        b = _flops(sim.Workload(name, passes="backward", **shape))
        assert b == pytest.approx(2 * f, rel=1e-12), name


def test_grouped_query_heads_shrink_the_kv_read_and_the_qkv_projection_not_the_wire():
    gqa, mha = _attention(kv_heads=8), _attention(kv_heads=64)
    a, b = sim.attention_widths(gqa), sim.attention_widths(mha)
    assert (a.kv, b.kv) == (2 * 128, 2 * 8 * 128)  # K and V elements read per key: one K/V head against eight
    assert (a.proj, b.proj) == ((8 + 2) * 128, (8 + 16) * 128)
    assert _bytes(gqa, "attention+out") < _bytes(mha, "attention+out")
    # vanilla's one kernel reads the K/V of all T keys once, in bfloat16
    assert _bytes(mha, "attention+out") - _bytes(gqa, "attention+out") == T * (b.kv - a.kv) * 2
    assert _flops(gqa, named="qkv") < _flops(mha, named="qkv")
    # what travels is X (the all-gather) and the partials (the reduce-scatter): hidden wide, whatever the heads
    for w in (gqa, mha):
        for phase in w.phases("ring"):
            hop = next(st for st in phase.schedule.steps(0) if st.sends)
            assert phase.cost.transfer_bytes(0, hop.sends[0]) == T // 8 * 8192 * 2
    # fewer K/V heads than ranks: each rank holds a copy of one
    assert sim.attention_widths(_attention(tp=16, heads=64, kv_heads=8)).kv == 2 * 128


def test_attention_refuses_heads_that_do_not_split():
    with pytest.raises(CommfuseValueError, match="3 K/V heads neither split over tp 8"):
        _attention(heads=24, kv_heads=3)
    with pytest.raises(CommfuseValueError, match="60 query heads do not split over tp 8"):
        _attention(heads=60, kv_heads=4)
    with pytest.raises(CommfuseValueError, match="kv_heads needs heads"):
        sim.Workload("attention", tp=8, seq=T, hidden=8192, kv_heads=8)
    with pytest.raises(CommfuseValueError, match="causal applies to the attention workload only"):
        sim.Workload("mlp", tp=8, seq=T, hidden=8192, causal=True)


def test_non_causal_attention_of_equal_shards_runs_on_the_one_rank_engine_with_the_same_figures():
    w = _attention(causal=False, passes="both")
    for algorithm in ("vanilla", "ring", "ring:2", "bidirectional"):
        one = sim.predict("h100-sxm", w, algorithm, symmetric=True)
        full = sim.predict("h100-sxm", w, algorithm, symmetric=False)
        assert one.time == pytest.approx(full.time, rel=1e-9), algorithm


# -- the command ----------------------------------------------------------------------------------------------------

LLAMA_70B = ["simulate", "--profile", "h100-sxm", "--model", "llama3-70b", "--tp", "8"]


def test_llama_70b_at_tp_8_on_h100s_is_one_command(capsys):
    assert main(LLAMA_70B) == 0
    out = capsys.readouterr().out
    assert out.startswith("llama3-70b: hidden 8192, 80 layers, 64 query heads, 8 K/V heads")
    assert "TP 8 with sequence parallelism, batch 1 x seq 8192 tokens" in out
    header = next(line for line in out.splitlines() if line.startswith("algorithm"))
    assert re.split(r"\s{2,}", header)[:4] == ["algorithm", "attention x80", "mlp x80", "lm head x1"]
    rows = {line.split()[0]: line.split() for line in out.splitlines()[5:10]}
    assert list(rows) == ["vanilla", "sliced:2", "sliced:4", "ring", "bidirectional"]
    assert float(rows["ring"][4]) < float(rows["vanilla"][4])  # the step: ring hides what vanilla exposes
    assert "gain: ring takes" in out and "best of each part:" in out and "left out: the embedding" in out


def test_the_models_json_records_each_part(capsys):
    assert main([*LLAMA_70B, "--pass", "forward", "--seq", "4096", "-a", "ring", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [r["algorithm"] for r in records] == ["vanilla", "ring"]
    for r in records:
        assert (r["model"], r["tp"], r["seq"], r["passes"]) == ("llama3-70b", 8, 4096, "forward")
        assert {n: p["count"] for n, p in r["parts"].items()} == {"attention": 80, "mlp": 80, "lm head": 1}
        assert r["step_ms"] == pytest.approx(sum(p["ms"] for p in r["parts"].values()), abs=1e-4)
    assert records[0]["speedup_vs_vanilla"] == 1.0


def test_deepseek_v3_runs_its_experts_ring_in_the_bidirectional_row(capsys):
    assert main(["simulate", "--profile", "h100-sxm", "--model", "deepseek-v3", "--tp", "8", "-a", "ring",
                 "bidirectional", "--json"]) == 0
    records = {r["algorithm"]: r for r in json.loads(capsys.readouterr().out)}
    assert records["bidirectional"]["parts"]["moe"]["algorithm"] == "ring"
    assert records["bidirectional"]["parts"]["moe"]["ms"] == records["ring"]["parts"]["moe"]["ms"]
    assert records["ring"]["parts"]["shared expert"]["algorithm"] == "vanilla"  # one rank: nothing to overlap


BASE = ["simulate", "--profile", "h100-sxm", "--tp", "8", "--seq", "1024", "--hidden", "1024"]


@pytest.mark.parametrize(("argv", "message"), [
    (LLAMA_70B[:-2], "--model llama3-70b needs --tp"),
    ([*LLAMA_70B, "--hidden", "4096"], "--hidden does not apply"),
    ([*LLAMA_70B, "--heads", "8", "-w", "mlp"], "--workload, --heads do not apply"),
    ([*LLAMA_70B, "--ep", "8"], "--ep applies to a mixture-of-experts model (deepseek-v3), not llama3-70b"),
    ([*LLAMA_70B, "--plot", "g.svg"], "--plot is not supported"),
    ([*BASE, "-w", "attention", "--kv-heads", "8"], "--kv-heads needs --heads"),
    ([*BASE, "-w", "mlp", "--no-causal"], "--no-causal applies to --workload attention only, not mlp"),
    ([*BASE, "-w", "attention", "--swiglu"], "--swiglu applies to --workload mlp only, not attention"),
    (["simulate", "--profile", "h100-sxm", "-w", "ring_attention", "--cp", "8", "--seq", "1024", "--hidden", "1024",
      "--no-causal"], "its --layout: --layout none"),
    (["simulate", "--profile", "h100-sxm", "-w", "ring_attention", "--cp", "8", "--seq", "1024", "--hidden", "1024",
      "--pass", "both"], "--pass does not apply"),
])
def test_the_commands_errors_name_its_flags(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "passes=" not in err and "kv_heads" not in err  # the Python API's keywords are not the command's


def test_every_pass_of_the_tp_workloads_is_predicted(capsys):
    """--pass both was refused for attention, ag_matmul and matmul_rs, naming the Python keyword passes='forward'."""
    for workload in ("attention", "ag_matmul", "matmul_rs"):
        assert main([*BASE, "-w", workload, "--pass", "both"]) == 0, workload
        out = capsys.readouterr().out
        assert out.startswith(f"{workload} both, tp 8"), out
