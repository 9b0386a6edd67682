"""Tier (a), no processes: profiles load, cite their sources, reject bad fields by name, reproduce what they were fit to, and calibration recovers the machine that made its measurements."""

from __future__ import annotations

import json
import math
try:
    import tomllib
except ImportError:  # Python 3.10: the same parser, as the package's tomli dependency
    import tomli as tomllib

import pytest

from commfuse import sim
from commfuse.bench import calibrate as _calibrate
from commfuse.sim._profile import PROFILE_DIR, ProfileError, from_dict

GOOD = {
    "name": "t",
    "compute": {"peak_flops": 1e12, "memory_bandwidth": 1e11},
    "link": {"bandwidth": 1e10, "latency": 1e-6},
}


def _with(section: str | None, key: str, value) -> dict:
    data = json.loads(json.dumps(GOOD))
    if section is None:
        data[key] = value
    else:
        data.setdefault(section, {})[key] = value
    return data


@pytest.mark.parametrize("name", sim.shipped())
def test_every_shipped_profile_loads_and_cites_its_sources(name):
    p = sim.load_profile(name)
    assert p.name == name and p.description
    text = (PROFILE_DIR / f"{name}.toml").read_text()
    comments = [line for line in text.splitlines() if line.startswith("#")]
    assert len(comments) >= 5, f"{name}.toml must say where its numbers come from"
    assert any(word in text for word in ("Sources", "How it was fit")), name
    assert p.compute.peak_flops > 1e12 and p.link.bandwidth > 1e9  # accelerators, not this CPU


def test_the_four_accelerators_of_the_issue_are_shipped():
    assert {"h100-sxm", "a100-sxm", "ascend-910b", "tpu-v5p", "paper-table1"} <= set(sim.shipped())


@pytest.mark.parametrize(
    ("section", "key", "value", "named"),
    [
        ("link", "bandwidth", -1.0, "[link].bandwidth"),
        ("link", "bandwidth", "fast", "[link].bandwidth must be a number"),
        ("link", "latency", -1e-6, "[link].latency"),
        ("link", "topology", "mesh", "[link].topology must be one of 'switch', 'direct', 'bus'"),
        ("link", "duplex", "simplex", "[link].duplex"),
        ("link", "efficiency", 1.5, "[link].efficiency must be <= 1"),
        ("link", "burst", -5, "[link].burst"),
        ("link", "speed", 1.0, "[link] has unknown field(s) 'speed'"),
        ("compute", "peak_flops", 0, "[compute].peak_flops must be > 0"),
        ("compute", "efficiency", 0.0, "[compute].efficiency"),
        ("compute", "half_efficiency_flops", -1, "[compute].half_efficiency_flops"),
        ("compute", "dtype", "float13", "[compute].dtype"),
        ("compute", "peak_flops", True, "[compute].peak_flops must be a number"),
        ("compute", "peak_flops", math.inf, "[compute].peak_flops must be finite"),
        ("collective", "efficiency", 0, "[collective].efficiency"),
        ("collective", "reduce_scatter_efficiency", -1, "[collective].reduce_scatter_efficiency"),
        ("host", "step_overhead", -1, "[host].step_overhead"),
        ("contention", "compute_slowdown", -0.1, "[contention].compute_slowdown"),
        (None, "colour", "red", "unknown key(s) 'colour'"),
        (None, "match", {"device_names": "H100"}, "[match].device_names must be a list"),
        (None, "link", 5, "[link] must be a table"),
    ],
)
def test_a_bad_field_is_named_in_the_error(section, key, value, named):
    with pytest.raises(ProfileError) as e:
        from_dict(_with(section, key, value), source="bad.toml")
    assert named in str(e.value)
    assert "bad.toml" in str(e.value) or "'t'" in str(e.value)


@pytest.mark.parametrize("missing", ["name", "compute", "link"])
def test_a_missing_part_is_named(missing):
    data = json.loads(json.dumps(GOOD))
    del data[missing]
    with pytest.raises(ProfileError, match=f"missing .*{missing}"):
        from_dict(data)


def test_a_missing_field_is_named():
    data = json.loads(json.dumps(GOOD))
    del data["link"]["latency"]
    with pytest.raises(ProfileError, match=r"\[link\] is missing latency"):
        from_dict(data)


def test_files_and_names(tmp_path, monkeypatch):
    monkeypatch.setenv("COMMFUSE_PROFILE_DIR", str(tmp_path / "installed"))
    with pytest.raises(ProfileError, match="no profile named 'h200'.*shipped: .*h100-sxm"):
        sim.load_profile("h200")
    with pytest.raises(ProfileError, match="does not exist"):
        sim.load_profile(str(tmp_path / "nope.toml"))
    broken = tmp_path / "broken.toml"
    broken.write_text("name = 'x'\n[compute\n")
    with pytest.raises(ProfileError, match="not valid TOML"):
        sim.load_profile(str(broken))
    # an installed profile is found by name
    (tmp_path / "installed").mkdir()
    p = sim.load_profile("tpu-v5p").replace(name="mine")
    (tmp_path / "installed" / "mine.toml").write_text(p.to_toml())
    assert sim.load_profile("mine") == p


@pytest.mark.parametrize("name", sim.shipped())
def test_to_toml_round_trips(name):
    p = sim.load_profile(name)
    text = p.to_toml({"link.bandwidth": "a note"}, header="line one\nline two")
    assert text.startswith("# line one\n# line two\n")
    assert from_dict(tomllib.loads(text)) == p


def test_replace_names_what_it_cannot_set():
    p = sim.load_profile("h100-sxm")
    assert p.replace(**{"link.bandwidth": 1e9}).link.bandwidth == 1e9
    with pytest.raises(ProfileError, match="unknown section 'wire'"):
        p.replace(**{"wire.bandwidth": 1})
    with pytest.raises(ProfileError, match=r"\[link\] has no field 'speed'"):
        p.replace(**{"link.speed": 1})
    with pytest.raises(ProfileError, match=r"\[link\].bandwidth must be > 0"):
        p.replace(**{"link.bandwidth": 0})


def test_a_workload_in_another_dtype_is_refused_naming_both():
    w = sim.Workload("mlp", tp=2, seq=64, hidden=64, dtype="float32")
    with pytest.raises(ProfileError, match="h100-sxm.*bfloat16.*float32"):
        sim.predict("h100-sxm", w)


def test_paper_table1_reproduces_the_row_it_was_fit_to():
    w = sim.Workload("mlp", tp=4, seq=4096, hidden=4096, batch=32)
    vanilla = sim.predict("paper-table1", w, "vanilla")
    assert 1e3 * vanilla.time == pytest.approx(122.3, abs=0.05)
    assert 1e3 * vanilla.exposed == pytest.approx(43.8, abs=0.05)


def _synthetic_raw(truth: sim.Profile, n: int = 2) -> dict:
    """What :func:`_calibrate.measure` would report on a machine that behaves exactly like ``truth``."""
    from commfuse.sim._model import Kernel, collective_time, kernel_time

    def two(t):  # two ranks, three repeats each, all alike
        return [[t] * 3, [t] * 3]

    raw: dict = {"world_size": n, "burst": truth.link.burst}
    raw["gemm"] = {f"{m},{k},{c}": two(kernel_time(truth, Kernel(2.0 * m * k * c, 0.0)))
                   for m, k, c in _calibrate.GEMMS}
    raw["add"] = {str(s): two(3 * s / truth.compute.memory_bandwidth) for s in (4 << 20, 16 << 20)}
    h, call = truth.host.step_overhead, truth.host.call_overhead
    tiny = kernel_time(truth, Kernel(2.0 * 4 * 4 * 4, 3 * 4 * 4 * 4.0))
    raw["steps"] = {str(p): two(call + n * p * (h + tiny)) for p in _calibrate.PARTS}
    raw["tiny_gemm"] = two(tiny)
    rate = truth.link.rate
    raw["hop"], raw["allgather"], raw["reducescatter"], raw["exchange"], raw["oneway"] = {}, {}, {}, {}, {}
    for s in _calibrate.SIZES:
        moved = max(0.0, n * s - truth.link.burst)
        raw["hop"][str(s)] = two(call + n * h + truth.link.latency + moved / rate)
        ag = collective_time(truth, n, s, "all_gather", min(truth.link.burst / n, s / 0.9))
        rs = collective_time(truth, n, s, "reduce_scatter", min(truth.link.burst / n, s / 0.5))
        raw["allgather"][str(s)] = two(call + 2 * h + ag)
        raw["reducescatter"][str(s)] = two(call + 2 * h + rs)
        raw["exchange"][str(s)] = two(truth.link.latency + 2 * s / rate)
        raw["oneway"][str(s)] = two(truth.link.latency + s / rate)
    raw["contention"] = {"alone": two(0.02), "busy": two(0.02 * (1 + truth.contention.compute_slowdown))}
    return raw


def test_calibration_fit_recovers_the_machine_that_made_the_measurements():
    truth = sim.Profile(
        name="truth",
        compute=sim.ComputeSpec(peak_flops=5e10, memory_bandwidth=2e10, half_efficiency_flops=2e5, dtype="float32"),
        link=sim.LinkSpec(bandwidth=1e8, latency=2e-4, topology="bus", duplex="half", burst=4e5),
        collective=sim.CollectiveSpec(latency=3e-4, efficiency=0.9, reduce_scatter_efficiency=0.5),
        host=sim.HostSpec(step_overhead=2e-5, call_overhead=1.5e-4),
        contention=sim.ContentionSpec(compute_slowdown=0.25),
    )
    got, comments = _calibrate.fit(_synthetic_raw(truth), name="fitted", link_rate="800mbit")
    assert got.compute.peak_flops == pytest.approx(5e10, rel=1e-3)
    assert got.compute.half_efficiency_flops == pytest.approx(2e5, rel=1e-3)
    assert got.compute.memory_bandwidth == pytest.approx(2e10, rel=1e-3)
    assert got.host.step_overhead == pytest.approx(2e-5, rel=1e-3)
    assert got.host.call_overhead == pytest.approx(1.5e-4, rel=1e-3)
    assert (got.link.topology, got.link.duplex, got.link.burst) == ("bus", "half", 4e5)
    assert got.link.bandwidth == pytest.approx(1e8, rel=1e-3)
    assert got.link.latency == pytest.approx(2e-4, rel=1e-3)
    assert got.collective.efficiency == pytest.approx(0.9, rel=1e-3)
    assert got.collective.reduce_scatter_efficiency == pytest.approx(0.5, rel=1e-3)
    assert got.collective.latency == pytest.approx(3e-4, rel=1e-3)
    assert got.contention.compute_slowdown == pytest.approx(0.25, rel=1e-3)
    assert set(comments) >= {"compute.peak_flops", "link.bandwidth", "contention.compute_slowdown"}
    # and what it writes loads back
    assert from_dict(tomllib.loads(got.to_toml(comments))) == got
