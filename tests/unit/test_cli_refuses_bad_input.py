"""Tier (a), no processes: the ``commfuse`` command and the inputs it reads refuse bad input by name, before any
work: world sizes, backends, sizes, timeouts, output paths, hardware profiles, absurd simulations, schedules too
big to render, and malformed algorithm counts. Each refusal is one named error (argparse's, or a
``CommfuseError`` printed as ``commfuse: error: ...`` with exit code 2), never a traceback or a quiet default."""

from __future__ import annotations

import argparse
import math
import os
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import commfuse.schedule
from commfuse import sim
from commfuse.cli import main, parser
from commfuse.errors import CommfuseError, CommfuseValueError
from commfuse.schedule import ALGORITHM_NAMES, parse_algorithm

# the command imports the conformance suite, whose marks only its pytest plugin registers
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnknownMarkWarning")

SIM = ["simulate", "--profile", "h100-sxm", "--workload", "mlp", "--tp", "4", "--seq", "1024", "--hidden", "1024"]


def _refused_by_argparse(argv: list[str], capsys) -> str:
    """argparse's message for ``argv``, which must exit 2 while the arguments are parsed."""
    with pytest.raises(SystemExit) as e:
        parser().parse_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("commfuse: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


@pytest.fixture
def no_work(monkeypatch):
    """Make every way a command starts its work fail the test: the conformance suite's pytest run, the bench's
    launch, the simulator's workloads and runs, a schedule's build."""
    import pytest as pytest_module

    from commfuse.bench import command as bench_command
    from commfuse.sim import _predict, _workloads

    def started(*args, **kwargs):
        raise AssertionError("the work started before the bad input was refused")

    monkeypatch.setattr(pytest_module, "main", started)
    monkeypatch.setattr(bench_command, "execute_config", started)
    monkeypatch.setattr(bench_command, "execute_torchrun", started)
    monkeypatch.setattr(_predict, "simulate_phases", started)
    monkeypatch.setattr(_workloads.Workload, "phases", started)
    monkeypatch.setattr(_workloads, "build", started)
    monkeypatch.setattr(commfuse.schedule, "build", started)


# -- 1 and 2: conformance -------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", ["0", "1", "-2", "65"])
def test_conformance_refuses_a_world_it_cannot_test(n, no_work, capsys):
    """One rank sends nothing and zero ranks launch nothing: every test would pass on no transfer."""
    with pytest.raises(SystemExit) as e:
        main(["conformance", "--backend", "gloo", "-n", n])
    assert e.value.code == 2
    assert f"argument --world-size/-n: expected an integer from 2 to 64, got '{n}'" in capsys.readouterr().err


def test_the_pytest_plugin_refuses_a_world_below_two():
    import commfuse.testing as plugin

    class Config:
        def addinivalue_line(self, *args):
            pass

        def getoption(self, name, default=None):
            return 1

    with pytest.raises(pytest.UsageError, match="--commfuse-world-size 1: the conformance suite needs at least 2"):
        plugin.pytest_configure(Config())


@pytest.mark.parametrize(("backend", "named"), [
    ("nosuch", r"--backend nosuch: no commfuse backend named 'nosuch' is installed \(installed: .*gloo"),
    ("os:nosuch", "--backend 'os:nosuch': module 'os' has no callable 'nosuch'"),
    ("nosuch_module_x:factory", "--backend 'nosuch_module_x:factory': module 'nosuch_module_x' does not import"),
])
def test_conformance_refuses_a_backend_that_is_not_there(backend, named, no_work, capsys):
    assert main(["conformance", "--backend", backend]) == 2
    assert re.search(named, _one_error_line(capsys))


def test_conformance_refuses_an_installed_backend_that_cannot_run_here(no_work, capsys):
    from commfuse import backends

    if backends.availability("accelerator").ok:
        pytest.skip("an accelerator is visible here")
    assert main(["conformance", "--backend", "accelerator"]) == 2
    err = _one_error_line(capsys)
    assert "--backend accelerator: installed, but it cannot run here" in err and "backends that can: gloo" in err


# -- 3: sizes -------------------------------------------------------------------------------------------------


SIZES = {
    "simulate": ["--batch", "-b", "--seq", "-s", "--hidden", "--ffn", "--tp", "--dp", "--ep", "--experts", "--topk",
                 "--cp", "--heads", "--kv-heads", "--head-dim"],
    "bench": ["--batch", "-b", "--seq", "-s", "--tokens", "--hidden", "--ffn", "--heads", "--kv-heads", "--experts",
              "--topk", "--world-size", "-n", "--threads", "--repeats", "-r", "--scale", "--fake-pg", "--calls"],
}


@pytest.mark.parametrize("value", ["0", "-3", "x", "٢"])
@pytest.mark.parametrize(("cmd", "option"), [(c, o) for c, opts in SIZES.items() for o in opts])
def test_every_size_option_refuses_zero_and_negatives_by_name(cmd, option, value, capsys):
    err = _refused_by_argparse([cmd, option, value], capsys)
    assert re.search(rf"argument [-/a-z]*{option}\b[-/a-z]*: expected an integer (>= 1|from 1 to \d+), "
                     rf"got '{value}'", err), err


def test_warmup_may_be_zero_but_not_negative(capsys):
    assert parser().parse_args(["bench", "--warmup", "0"]).warmup == 0
    assert "argument --warmup: expected an integer >= 0, got '-1'" in _refused_by_argparse(
        ["bench", "--warmup", "-1"], capsys)


def test_calibrate_repeats_refuses_zero(capsys):
    assert "argument --repeats: expected an integer >= 1, got '0'" in _refused_by_argparse(
        ["simulate", "calibrate", "--repeats", "0"], capsys)


def test_simulate_batch_is_what_was_given():
    assert parser().parse_args(SIM).batch is None  # the default, 1, is the workload's
    assert parser().parse_args([*SIM, "--batch", "3"]).batch == 3


# -- 4: hardware profiles ---------------------------------------------------------------------------------------


def _profile_text(**changes: str) -> str:
    text = (sim._profile.PROFILE_DIR / "h100-sxm.toml").read_text()
    for field, value in changes.items():
        text, n = re.subn(rf"(?m)^{field} = .*$", f"{field} = {value}", text, count=1)
        assert n == 1, field
    return text


def _bad_profiles() -> dict:
    """Profile files that must be refused: name -> (what the file holds, what the error names)."""
    return {
        "latency-1e308": (_profile_text(latency="1e308"), "[link].latency must be <= 10 s"),
        "peak-denormal": (_profile_text(peak_flops="5e-324"), "[compute].peak_flops must be >= 1e+06"),
        "efficiency-denormal": (_profile_text(efficiency="5e-324"), "[compute].efficiency must be >= 0.001"),
        "bandwidth-huge": (_profile_text(bandwidth="1e300"), "[link].bandwidth must be <= 1e+14"),
        "memory-tiny": (_profile_text(memory_bandwidth="1e-300"), "[compute].memory_bandwidth must be >= 1e+06"),
        "overhead-huge": (_profile_text(step_overhead="1e200"), "[host].step_overhead must be <= 10 s"),
        "integer-past-float": (_profile_text(peak_flops="1" + "0" * 400),
                               "[compute].peak_flops must be a number a float"),
        "integer-past-int": (_profile_text(peak_flops="1" + "0" * 5000), "is not valid TOML"),
        "binary": (bytes(range(256)) * 4, "is not UTF-8 text"),
        "latin-1": ("name = 'caf\xe9'\n".encode("latin-1"), "is not UTF-8 text"),
        "deeply-nested": ("name = 'x'\na = " + "[" * 100_000 + "]" * 100_000 + "\n",
                          "nests arrays or tables too deeply"),
        "oversized": ("# " + "x" * (2 << 20) + "\n", "bytes; a profile is a few KB of TOML"),
    }


BAD_PROFILES = ["latency-1e308", "peak-denormal", "efficiency-denormal", "bandwidth-huge", "memory-tiny",
                "overhead-huge", "integer-past-float", "integer-past-int", "binary", "latin-1", "deeply-nested",
                "oversized"]


def _write(path: Path, content) -> Path:
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


@pytest.mark.parametrize("case", BAD_PROFILES)
def test_a_bad_profile_file_is_one_named_error(case, tmp_path):
    content, named = _bad_profiles()[case]
    path = _write(tmp_path / f"{case}.toml", content)
    with pytest.raises(sim.ProfileError) as e:
        sim.load_profile(str(path))
    assert isinstance(e.value, CommfuseValueError)
    assert named in str(e.value) and str(path) in str(e.value)


@pytest.mark.parametrize("case", ["latency-1e308", "peak-denormal", "binary", "deeply-nested"])
def test_the_command_prints_a_bad_profile_as_one_line_and_exits_2(case, tmp_path, capsys):
    content, named = _bad_profiles()[case]
    path = _write(tmp_path / f"{case}.toml", content)
    assert main([SIM[0], "--profile", str(path), *SIM[3:]]) == 2
    err = _one_error_line(capsys)
    assert named in err and str(path) in err


def test_a_folder_or_a_device_is_not_a_profile(tmp_path):
    (tmp_path / "dir.toml").mkdir()
    with pytest.raises(sim.ProfileError, match="is not a regular file"):
        sim.load_profile(str(tmp_path / "dir.toml"))
    with pytest.raises(sim.ProfileError, match="does not exist"):
        sim.load_profile(str(tmp_path / "nope.toml"))


def test_set_cannot_make_a_profile_that_breaks_the_model(capsys):
    assert main([*SIM, "--set", "link.latency=1e308"]) == 2
    assert "[link].latency must be <= 10 s, got 1e+308" in _one_error_line(capsys)


@pytest.mark.parametrize("case", ["latency-1e308", "peak-denormal", "binary", "deeply-nested", "integer-past-float"])
def test_auto_reading_a_bad_profile_through_the_environment_raises_the_named_error(case, tmp_path, monkeypatch):
    from commfuse import ops
    from commfuse.schedule import Collective

    content, named = _bad_profiles()[case]
    path = _write(tmp_path / f"{case}.toml", content)
    monkeypatch.setenv("COMMFUSE_PROFILE", str(path))
    with pytest.raises(CommfuseValueError) as e:
        ops.choose_algorithm(Collective.ALL_GATHER, 4, 1 << 20, None, flops=1e9)
    assert isinstance(e.value, sim.ProfileError)
    assert f"COMMFUSE_PROFILE={str(path)!r}" in str(e.value) and named in str(e.value)


def test_an_installed_profile_that_is_broken_is_named(tmp_path, monkeypatch, capsys):
    """Installed profiles are listed with what is wrong with them, and ``auto`` names the one it was given."""
    monkeypatch.setenv("COMMFUSE_PROFILE_DIR", str(tmp_path))
    monkeypatch.delenv("COMMFUSE_PROFILE", raising=False)
    _write(tmp_path / "gloo.toml", bytes(range(256)))
    assert main(["simulate", "profiles"]) == 0
    assert f"BROKEN: profile file {tmp_path / 'gloo.toml'} is not UTF-8 text" in capsys.readouterr().out
    backend = type("Backend", (), {"name": "gloo", "device": None})()
    with pytest.raises(sim.ProfileError, match="the profile installed for backend 'gloo': .* is not UTF-8 text"):
        sim.plan("all_gather", 4, 1 << 20, 1e9, backend)


def _corner(fast: bool) -> sim.Profile:
    """A profile at one corner of the bounds: every rate at its highest and every cost at its lowest, or the
    opposite."""
    p = sim._profile
    rate = 1 if fast else 0
    return sim.Profile(
        name="fast" if fast else "slow",
        compute=sim.ComputeSpec(peak_flops=p.PEAK_FLOPS_RANGE[rate], memory_bandwidth=p.MEMORY_BANDWIDTH_RANGE[rate],
                                efficiency=1.0 if fast else p.MIN_EFFICIENCY,
                                half_efficiency_flops=0.0 if fast else p.MAX_HALF_EFFICIENCY_FLOPS),
        link=sim.LinkSpec(bandwidth=p.LINK_BANDWIDTH_RANGE[rate], latency=0.0 if fast else p.MAX_LATENCY_S,
                          efficiency=1.0 if fast else p.MIN_EFFICIENCY, burst=0.0 if fast else p.MAX_BURST_BYTES),
        collective=sim.CollectiveSpec(latency=None if fast else p.MAX_LATENCY_S,
                                      efficiency=4.0 if fast else p.MIN_EFFICIENCY),
        host=sim.HostSpec(step_overhead=0.0 if fast else p.MAX_LATENCY_S,
                          call_overhead=0.0 if fast else p.MAX_LATENCY_S),
        contention=sim.ContentionSpec(compute_slowdown=0.0 if fast else 10.0),
    )


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("name", ["mlp", "attention", "moe", "ring_attention"])
def test_every_prediction_is_finite_at_the_corners_of_the_bounds(fast, name):
    """The bounds on profiles and on sizes are what keep the model's arithmetic finite: at their corners, with
    every size at its largest, every figure is a finite number."""
    big = sim._workloads.MAX_DIM
    if name == "moe":
        w = sim.Workload("moe", tp=1, seq=big, hidden=big, batch=big, ffn=big, ep=2, experts=big, topk=big,
                         passes="both")
        algorithms = ["vanilla", "sliced:2", "ring", "ring:2"]
    elif name == "ring_attention":
        w = sim.Workload(name, tp=1, cp=2, seq=big, hidden=big, batch=big, ffn=big, heads=big, kv_heads=big,
                         head_dim=big, passes="both")
        algorithms = ["vanilla", "ring", "bidirectional", "ulysses", "2d:1x2"]
    else:
        w = sim.Workload(name, tp=2, seq=big, hidden=big, batch=big, ffn=big)
        algorithms = ["vanilla", "sliced:2", "ring", "ring:2", "bidirectional"]
    for p in sim.compare(_corner(fast), w, algorithms):
        figures = (p.time, p.compute_only, p.comm_only, p.outside, p.flops, p.exposed, p.speedup_vs_vanilla)
        assert all(math.isfinite(x) for x in figures), (p.algorithm, figures)


# -- 5: output paths --------------------------------------------------------------------------------------------


def _unwritable(tmp_path: Path) -> Path:
    """A folder this user cannot create a file in (as root, permissions do not stop it: /sys does)."""
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        return locked
    if not os.path.isdir("/sys"):
        pytest.skip("running as root without /sys: no folder here refuses a new file")
    return Path("/sys")


def _bad_file_paths(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Output file paths that cannot be written, each with what the error must say about it."""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    return {
        "a folder": (tmp_path, "is a folder"),
        "under a file": (a_file / "out.json", f"{a_file} is a file, not a folder"),
        "deep under a file": (a_file / "sub" / "out.json", f"{a_file} is a file, not a folder"),
        "unwritable": (_unwritable(tmp_path) / "new" / "out.json", "cannot be written"),
    }


@pytest.mark.parametrize("option", ["--json", "--trace", "--plot"])
@pytest.mark.parametrize("case", ["a folder", "under a file", "deep under a file", "unwritable"])
def test_bench_refuses_an_output_path_before_it_launches(option, case, tmp_path, no_work, capsys):
    path, said = _bad_file_paths(tmp_path)[case]
    assert main(["bench", option, str(path), "--no-progress"]) == 2
    err = _one_error_line(capsys)
    assert f"{option} {path}: " in err and said in err


def test_bench_fake_group_refuses_its_json_path_before_it_runs(tmp_path, monkeypatch, capsys):
    from commfuse.bench import command as bench_command
    from commfuse.bench import fakepg

    def started(*args, **kwargs):
        raise AssertionError("the work started before the bad input was refused")

    monkeypatch.setattr(bench_command, "fake_config", lambda args: (None, 1))
    monkeypatch.setattr(fakepg, "run", started)
    assert main(["bench", "--fake-pg", "2", "--json", str(tmp_path)]) == 2
    assert f"--json {tmp_path}: is a folder" in _one_error_line(capsys)


@pytest.mark.parametrize("option", ["--json", "--trace", "--plot"])
@pytest.mark.parametrize("case", ["a folder", "under a file", "unwritable"])
def test_simulate_refuses_an_output_path_before_it_simulates(option, case, tmp_path, no_work, capsys):
    path, said = _bad_file_paths(tmp_path)[case]
    assert main([*SIM, option, str(path)]) == 2
    err = _one_error_line(capsys)
    assert f"{option} {path}: " in err and said in err


@pytest.mark.parametrize("option", ["--output", "--raw"])
def test_calibrate_refuses_an_output_path_before_it_measures(option, tmp_path, monkeypatch, capsys):
    from commfuse.bench import calibrate as _calibrate

    def started(*args, **kwargs):
        raise AssertionError("the work started before the bad input was refused")

    monkeypatch.setattr(_calibrate, "calibrate", started)
    monkeypatch.setattr(_calibrate, "in_namespace", started)
    assert main(["simulate", "calibrate", option, str(tmp_path)]) == 2
    assert f"{option} {tmp_path}: is a folder" in _one_error_line(capsys)


@pytest.mark.parametrize("case", ["a file", "under a file", "unwritable"])
def test_schedule_dump_refuses_a_folder_it_cannot_write(case, tmp_path, capsys):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    path, said = {"a file": (a_file, "is a file, not a folder"),
                  "under a file": (a_file / "catalog", f"{a_file} is a file, not a folder"),
                  "unwritable": (_unwritable(tmp_path) / "catalog", "cannot be written")}[case]
    assert main(["schedule", "dump", "--dir", str(path)]) == 2
    err = _one_error_line(capsys)
    assert f"--dir {path}: " in err and said in err
    assert a_file.read_text() == "x"


def test_schedule_dump_refuses_a_catalog_whose_files_are_folders(tmp_path, capsys):
    (tmp_path / "all_gather" / "ring.w2.txt").mkdir(parents=True)
    assert main(["schedule", "dump", "--dir", str(tmp_path)]) == 2
    assert "ring.w2.txt is a folder where the catalog needs a file" in _one_error_line(capsys)
    assert sorted(p.name for p in (tmp_path / "all_gather").iterdir()) == ["ring.w2.txt"]  # nothing written


def test_a_check_that_passes_leaves_nothing_behind(tmp_path):
    from commfuse.cli import check_output_dir, check_output_file

    check_output_file("--json", tmp_path / "a" / "b" / "out.json")
    check_output_dir("--dir", tmp_path / "c" / "d")
    existing = tmp_path / "kept.json"
    existing.write_text("old")
    check_output_file("--json", existing)
    check_output_dir("--dir", tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.json"]
    assert existing.read_text() == "old"


# -- 6: --timeout -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["nan", "0", "-1", "inf", "1e7", "soon"])
def test_bench_timeout_is_refused_outside_the_librarys_bounds(value, capsys):
    from commfuse.runtime.groups import MAX_TIMEOUT_S, MIN_TIMEOUT_S

    err = _refused_by_argparse(["bench", "--timeout", value], capsys)
    assert f"argument --timeout: expected seconds from {MIN_TIMEOUT_S:g} to {MAX_TIMEOUT_S:g}, got '{value}'" in err


def test_bench_timeout_within_the_bounds_is_taken():
    assert parser().parse_args(["bench", "--timeout", "2.5"]).timeout == 2.5


# -- 7: simulations too big to run -----------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "limit", "guard"), [
    (["--workload", "moe", "--tp", "1", "--ep", "100000", "--experts", "100000"], "MAX_ROUTED_PIECES", "routing"),
    (["--workload", "moe", "--tp", "1", "--ep", "1024", "--experts", "1024", "-a", "ring:8"], "MAX_ROUTED_PIECES",
     "engine"),
    (["--chunks", "100000"], "MAX_SCHEDULE_STEPS", "build"),
    (["-a", "ring:100000"], "MAX_SCHEDULE_STEPS", "build"),
    (["--tp", "100000", "--ffn", "100000"], "MAX_SCHEDULE_STEPS", "build"),
    (["--workload", "fsdp_linear", "--tp", "1", "--dp", "4096", "--full"], "MAX_SIMULATED_ACTIONS", "engine"),
    (["--hidden", str(10 ** 200)], "MAX_DIM", "engine"),
])
def test_a_simulation_too_big_to_run_is_refused_up_front_naming_the_limit(argv, limit, guard, monkeypatch, capsys):
    """``--ep 100000`` was a MemoryError after a minute; the others ran for minutes or overflowed."""
    from commfuse.sim import _predict, _workloads

    def started(*args, **kwargs):
        raise AssertionError("the simulation started before the bad input was refused")

    monkeypatch.setattr(_predict, "simulate_phases", started)  # no engine run before the refusal
    if guard == "routing":  # building the routing table is what ran out of memory
        monkeypatch.setattr(_workloads.Workload, "routed_rows", started)
    if guard == "build":  # building these schedules is what took minutes
        real = _workloads.build

        def build(collective, n, *, parts=1, chunks=1, **kw):
            return started() if max(n, parts, chunks) > 64 else real(collective, n, parts=parts, chunks=chunks, **kw)

        monkeypatch.setattr(_workloads, "build", build)
    assert main([*SIM, *argv]) == 2  # the later of two values of an option wins
    err = _one_error_line(capsys)
    assert "commfuse.sim._" in err and limit in err


# -- 8: schedule show -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "said"), [
    (["-n", "100000"], ("argument --world-size/-n: expected an integer from 1 to 64 (bigger: "
                        "commfuse.schedule.build in Python), got '100000'")),
    (["-n", "0"], "argument --world-size/-n: expected an integer from 1 to 64, got '0'"),
    (["-n", "4", "--parts", "0"], "argument --parts: expected an integer from 1 to 16, got '0'"),
    (["-n", "4", "--parts", "17"], "argument --parts: expected an integer from 1 to 16"),
    (["-n", "4", "--chunks", "0"], "argument --chunks: expected an integer from 1 to 64, got '0'"),
    (["-n", "4", "--chunks", "100000"], "argument --chunks: expected an integer from 1 to 64"),
])
def test_schedule_show_caps_what_it_renders(argv, said, no_work, capsys):
    with pytest.raises(SystemExit) as e:
        main(["schedule", "show", "all_gather", *argv])
    assert e.value.code == 2
    assert said in capsys.readouterr().err


# -- 10: the algorithm grammar ------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["ring:", "sliced:", "bidirectional:", "ring:٢", "sliced:٤", "ring:²", "ring:-1",
                                  "ring: 2", "ring:2 ", "ring:0", "ring:" + "9" * 5000])
def test_a_count_that_is_not_ascii_digits_from_1_is_refused_naming_the_text(text):
    with pytest.raises(CommfuseValueError) as e:
        parse_algorithm(text)
    assert repr(text)[:40] in str(e.value)


WELL_FORMED = re.compile(rf"(?:{'|'.join(ALGORITHM_NAMES)})(?::[0-9]+)?")

counts = st.one_of(st.text(alphabet="0123456789٢٤²³ -+_", max_size=5), st.integers(0, 10 ** 6).map(str))
texts = st.one_of(
    st.text(max_size=12),
    st.builds(lambda name, colon, count: name + colon + count,
              st.sampled_from([*ALGORITHM_NAMES, "", "Ring", "rings"]), st.sampled_from(["", ":", "::"]), counts),
)


@given(texts)
def test_every_string_the_parser_accepts_is_the_grammar_and_round_trips_through_shown(text):
    try:
        spec = parse_algorithm(text)
    except CommfuseError:
        return
    assert WELL_FORMED.fullmatch(text), f"accepted {text!r}, which is not name[:N] in ASCII digits"
    assert parse_algorithm(spec.shown) == spec
    assert parse_algorithm(spec.shown).shown == spec.shown


def test_the_argparse_types_name_their_bounds():
    from commfuse.cli import integer, seconds

    with pytest.raises(argparse.ArgumentTypeError, match=r"expected an integer from 1 to 4 \(why\), got '5'"):
        integer(1, 4, why=" (why)")("5")
    assert integer(0)("0") == 0 and integer(1)(" 7 ") == 7
    with pytest.raises(argparse.ArgumentTypeError, match="expected seconds from 1 to 2, got 'nan'"):
        seconds(1, 2)("nan")
