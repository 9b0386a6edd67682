"""Tier (a), no processes: the planner picks what the model predicts fastest, finds exact crossovers, and finds the profile that applies to a backend."""

from __future__ import annotations

import datetime

import pytest

from commfuse import sim
from commfuse.sim import _planner
from commfuse.sim._planner import choose, crossovers, op_times, plan, profile_for


def test_world_size_one_is_vanilla():
    assert choose("all_gather", 1, slice_bytes=1 << 20, flops=1e9, profile="h100-sxm")[0] == "vanilla"


def test_tiny_slices_take_vanilla_and_big_ones_overlap():
    name, reason = choose("all_gather", 8, slice_bytes=4096, flops=1e6, profile="h100-sxm")
    assert name == "vanilla"
    assert "h100-sxm" in reason and "vanilla" in reason and "ms" in reason
    name, _ = choose("reduce_scatter", 8, slice_bytes=64 << 20, flops=2e12, profile="h100-sxm")
    assert name == "ring"  # NVSwitch: the bidirectional ring buys no bandwidth


def test_bidirectional_wins_on_full_duplex_direct_links_when_comm_bound():
    name, reason = choose("all_gather", 8, slice_bytes=256 << 20, flops=1e11, profile="tpu-v5p")
    assert name == "bidirectional" and "both link directions" in reason


def test_choose_takes_the_fastest_of_op_times():
    for args in [("all_gather", 4, 1 << 16, 1e8), ("reduce_scatter", 16, 8 << 20, 5e10), ("all_to_all", 4, 1 << 22, 1e9)]:
        coll, n, nbytes, flops = args
        times = op_times(coll, n, slice_bytes=nbytes, flops=flops, profile=sim.load_profile("a100-sxm"))
        name, _ = choose(coll, n, slice_bytes=nbytes, flops=flops, profile="a100-sxm")
        assert times[name] == min(times.values())
    assert "bidirectional" not in op_times("all_to_all", 4, slice_bytes=1, flops=1, profile=sim.load_profile("tpu-v5p"))


def test_choose_refuses_bad_numbers():
    with pytest.raises(ValueError, match="world_size must be an integer >= 1"):
        choose("all_gather", 0, slice_bytes=1, flops=1, profile="h100-sxm")
    with pytest.raises(ValueError, match="slice_bytes must be a number >= 0"):
        choose("all_gather", 2, slice_bytes=-1, flops=1, profile="h100-sxm")
    with pytest.raises(ValueError, match="all_scatter"):
        choose("all_scatter", 2, slice_bytes=1, flops=1, profile="h100-sxm")


def test_crossovers_are_exact():
    w = sim.Workload("mlp", tp=8, seq=4096, hidden=8192, batch=4)
    cross = crossovers("h100-sxm", w)
    assert cross[0] == (8, "vanilla")  # short sequences: the hops cost more than they hide
    assert len(cross) >= 2
    for (start, winner), (nxt, _) in zip(cross, cross[1:]):
        # at the boundary the winner changes, one step before it does not
        before = {a: sim.predict("h100-sxm", sim.Workload("mlp", tp=8, seq=nxt - 8, hidden=8192, batch=4), a).time
                  for a in ("vanilla", "ring", "bidirectional")}
        assert min(before, key=before.get) == winner
    explained = _planner.explain("h100-sxm", w)
    assert f"vanilla wins for seq < {cross[1][0]}" in explained


def test_profile_for_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("COMMFUSE_PROFILE_DIR", str(tmp_path))
    monkeypatch.setenv("COMMFUSE_PROFILE", "tpu-v5p")
    assert profile_for().name == "tpu-v5p"
    monkeypatch.setenv("COMMFUSE_PROFILE", "off")
    assert profile_for() is None
    assert plan("all_gather", 4, 1 << 20, 1e9) is None  # no profile: the ops keep their own rule
    monkeypatch.delenv("COMMFUSE_PROFILE")
    assert profile_for() is None


def test_profile_for_a_real_gloo_backend_uses_the_installed_profile(monkeypatch, tmp_path):
    """A world-size-1 gloo group in this process: the backend ``auto`` would see, no other process needed."""
    import torch.distributed as dist

    from commfuse import backends

    monkeypatch.delenv("COMMFUSE_PROFILE", raising=False)
    monkeypatch.setenv("COMMFUSE_PROFILE_DIR", str(tmp_path))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        backend = backends.get("gloo")
        assert profile_for(backend) is None  # nothing installed, and a CPU matches no shipped profile
        mine = sim.load_profile("h100-sxm").replace(name="calibrated-here")
        (tmp_path / f"{backend.name}.toml").write_text(mine.to_toml())
        assert profile_for(backend) == mine
        got = plan("all_gather", 8, 64 << 20, 1e12, backend)
        assert got is not None and "calibrated-here" in got[1]
        assert plan("all_gather", 8, 64 << 20, None, backend) is None  # compute unknown: no plan
    finally:
        dist.destroy_process_group()
