"""Tier (a), no processes: backends come through the pluggy hook, broken plugins are skipped, errors say what to fix."""

from __future__ import annotations

import datetime
import json
import socket
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import commfuse.plugins.builtin
from commfuse import backends
from commfuse.cli import main
from commfuse.errors import (
    BackendUnavailableError,
    CommfuseError,
    CommfuseTypeError,
    CommfuseValueError,
    CommfuseWarning,
    PluginError,
)
from commfuse.plugins import GROUP, Availability, BackendSpec, Capabilities, get_plugin_manager, refresh

ACCELERATOR_REASON = "no accelerator is visible to torch (torch.accelerator.is_available() is False)"
HAS_ACCELERATOR = torch.accelerator.is_available()


# -- real plugin distributions ----------------------------------------------


class Site:
    """A folder on sys.path: each ``install`` writes a real distribution (dist-info + module) into it."""

    def __init__(self, root: Path):
        self.root = root

    def install(self, distribution: str, source: str) -> str:
        """Install ``distribution`` whose ``commfuse.backends`` entry point is a module with ``source``.

        Returns the entry point as the warnings print it ("name = module").
        """
        module = "cftest_" + distribution.replace("-", "_")
        info = self.root / f"{distribution.replace('-', '_')}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[{GROUP}]\n{module} = {module}\n")
        (self.root / f"{module}.py").write_text(textwrap.dedent(source))
        return f"{module} = {module}"


@pytest.fixture
def site(tmp_path):
    modules = set(sys.modules)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(tmp_path))
        yield Site(tmp_path)
    # sys.path is restored: forget the test's plugin modules and rediscover, so later tests see the normal state.
    for name in set(sys.modules) - modules:
        if name.startswith("cftest_"):
            del sys.modules[name]
    refresh()


def plugin(*specs: str) -> str:
    """Source of a plugin module yielding one BackendSpec per entry of ``specs`` (keyword arguments as text)."""
    records = "\n".join(
        f"    yield BackendSpec(capabilities=Capabilities(), description='test backend', {s})"
        for s in specs
    )
    return (
        "from commfuse.plugins import Availability, BackendSpec, Capabilities, hookimpl\n\n"
        "class Backend:\n"
        "    def __init__(self, name, group, device):\n"
        "        self.name, self.group, self.device = name, group, device\n\n"
        "def make(name):\n"
        "    return lambda group=None, device=None: Backend(name, group, device)\n\n"
        "@hookimpl\n"
        "def commfuse_backends():\n" + records + "\n"
    )


def cpu_backend(name: str, priority: int = 0, check: str = "Availability.yes") -> str:
    return f"name={name!r}, device_types=('cpu',), priority={priority}, check={check}, factory=make({name!r})"


@pytest.fixture
def gloo_group():
    """A real 1-rank gloo process group on a free loopback port (retried if the port is taken meanwhile)."""
    for attempt in range(5):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            dist.init_process_group(
                "gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}",
                timeout=datetime.timedelta(seconds=30),
            )
            break
        except (RuntimeError, dist.DistNetworkError):
            if attempt == 4:
                raise
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


# -- built-ins ---------------------------------------------------------------


def test_builtins_register_through_the_hook_not_entry_points():
    assert {"gloo", "accelerator"} <= {s.name for s in backends.specs()}
    assert [s.name for s in backends.specs()] == sorted(s.name for s in backends.specs())
    pm = get_plugin_manager()
    assert pm.get_plugin("commfuse.builtin") is commfuse.plugins.builtin
    assert commfuse.plugins.builtin in [impl.plugin for impl in pm.hook.commfuse_backends.get_hookimpls()]
    assert not any(ep.value.startswith("commfuse.plugins") for ep in entry_points(group=GROUP))
    assert backends.spec("gloo").distribution == backends.spec("accelerator").distribution == "commfuse"


def test_builtin_capabilities_and_priorities():
    gloo, accelerator = backends.spec("gloo"), backends.spec("accelerator")
    assert gloo.device_types == ("cpu",) and gloo.matches("cpu") and not gloo.matches("cuda")
    assert gloo.capabilities == Capabilities(bidirectional_links=True, execution="eager", streams=False, overlap=True,
                                             auto_min_slice_bytes=0)
    assert accelerator.device_types == ("accelerator",) and not accelerator.matches("cpu")
    assert accelerator.priority < gloo.priority == 0
    assert accelerator.capabilities.streams and accelerator.capabilities.overlap
    assert accelerator.capabilities.collectives == ("all_gather", "reduce_scatter", "all_to_all")


def test_gloo_is_available_and_accelerator_says_why_not():
    assert backends.availability("gloo").ok
    assert "gloo" in backends.available()
    accelerator = backends.availability("accelerator")
    if HAS_ACCELERATOR:
        device_type = torch.accelerator.current_accelerator().type
        assert accelerator.ok and device_type in accelerator.detail
        assert backends.spec("accelerator").matches(device_type)
    else:
        assert not accelerator.ok
        assert accelerator.reason == ACCELERATOR_REASON
        assert "torch" in accelerator.fix and "driver" in accelerator.fix
        assert "accelerator" not in backends.available()
        with pytest.raises(BackendUnavailableError, match=r"'accelerator'.*cannot run here.*is_available\(\) is False"):
            backends.get("accelerator")


def test_gloo_factory_makes_a_c10d_backend_in_a_one_rank_group(gloo_group):
    assert callable(backends.spec("gloo").factory)
    by_name = backends.get("gloo")
    by_device = backends.get(device="cpu")
    by_tensor = backends.get(device=torch.zeros(2))
    default = backends.get(group=gloo_group)
    assert [b.name for b in (by_name, by_device, by_tensor, default)] == ["gloo"] * 4
    assert by_tensor.device == torch.device("cpu")
    with pytest.raises(BackendUnavailableError, match=r"'gloo' runs on device types \('cpu',\), not on 'cuda'"):
        backends.get("gloo", device="cuda:0")


# -- errors when asking for a backend -----------------------------------------


@pytest.mark.parametrize("name", ["cuda", "npu", "xla"])
def test_known_but_missing_vendor_backend_says_how_to_install(name):
    installed = [s.name for s in backends.specs()]
    if name in installed and backends.availability(name).ok:
        assert backends.get(name).name  # a machine with the vendor's runtime: it simply works
        return
    with pytest.raises(BackendUnavailableError) as e:
        backends.get(name)
    message = str(e.value)
    if name in installed:  # its distribution is here (e.g. pip install -e backends/<name>), its runtime is not
        assert f"backend {name!r} (from 'commfuse-{name}') is installed but cannot run here" in message
        assert backends.availability(name).reason in message
    else:
        assert f"pip install commfuse-{name} (or pip install -e backends/{name} from a checkout)" in message
        assert "installed: " + ", ".join(installed) in message
    assert isinstance(e.value, CommfuseError) and isinstance(e.value, RuntimeError)


def test_unknown_backend_suggests_a_close_name():
    with pytest.raises(BackendUnavailableError, match=r"no commfuse backend named 'glo'.*did you mean 'gloo'"):
        backends.spec("glo")
    with pytest.raises(CommfuseTypeError, match="backend name must be a string, got int 3"):
        backends.get(3)


def test_no_backend_for_the_device_lists_what_was_considered():
    with pytest.raises(BackendUnavailableError) as e:
        backends.get(device="npu:0")
    message = str(e.value)
    assert "device type 'npu'" in message
    assert "gloo (from 'commfuse'): handles device types cpu, not 'npu'" in message
    assert "accelerator (from 'commfuse')" in message
    if not HAS_ACCELERATOR:
        assert ACCELERATOR_REASON in message
    if "npu" in [s.name for s in backends.specs()]:
        assert "npu (from 'commfuse-npu')" in message and backends.availability("npu").reason in message
    else:
        assert "pip install commfuse-npu" in message
    with pytest.raises(CommfuseTypeError, match="device must be a torch.device.*got int 7"):
        backends.get(device=7)


# -- third-party plugins -------------------------------------------------------


def test_installed_plugin_is_found_after_refresh_with_its_distribution(site):
    odd = "name='odd', device_types=('nonsense',), check=Availability.yes, factory=make('odd')"
    refresh()  # what this process's sys.path holds now, whatever earlier tests cached
    before = set(backends.available())
    site.install("commfuse-test-extra", plugin(cpu_backend("extra"), odd))
    assert "extra" not in [s.name for s in backends.specs()]  # discovery is cached
    refresh()
    extra = backends.spec("extra")
    assert extra.distribution == "commfuse-test-extra"
    assert backends.available() == sorted(before | {"extra", "odd"})
    made = backends.get("extra", device="cpu", group="g")
    assert (made.name, made.group, made.device) == ("extra", "g", torch.device("cpu"))
    with pytest.raises(CommfuseValueError, match="device 'nonsense:0' is not a device torch knows"):
        backends.get(device="nonsense:0")


def test_higher_priority_plugin_wins_the_device_and_unavailable_ones_are_passed_over(site):
    site.install(
        "commfuse-test-fast",
        plugin(
            cpu_backend("fastest", priority=9, check="lambda: Availability.no('no fast link here', 'buy one')"),
            cpu_backend("fast", priority=5),
        ),
    )
    refresh()
    assert backends.get(device="cpu").name == "fast"
    assert backends.get().name == "fast"
    assert backends.get(device=torch.ones(3)).name == "fast"
    assert backends.get(device=torch.device("cpu")).name == "fast"
    with pytest.raises(BackendUnavailableError, match=r"'fastest'.*no fast link here; to fix: buy one"):
        backends.get("fastest")


BROKEN = {
    "import_error": (
        "raise ImportError('no module named vendor_sdk')\n",
        "failed to load: ImportError: no module named vendor_sdk",
    ),
    "hook_raises": (
        "from commfuse.plugins import hookimpl\n\n"
        "@hookimpl\ndef commfuse_backends():\n    raise RuntimeError('probe failed')\n",
        "commfuse_backends hook failed: RuntimeError: probe failed",
    ),
    "yields_non_spec": (
        # One good record, then a dict: the whole plugin is dropped.
        plugin(cpu_backend("half")) + "    yield {'name': 'dict'}\n",
        "not a commfuse.plugins.BackendSpec",
    ),
    "invalid_spec": (
        plugin("name='Bad Name', device_types=('cpu',), check=Availability.yes, factory=Backend"),
        "BackendSpec.name",
    ),
    "no_hookimpl": ("def commfuse_backends():\n    return []\n", "implements no commfuse hook"),
}


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_broken_plugin_is_warned_about_and_skipped_while_others_load(site, kind):
    source, fragment = BROKEN[kind]
    entry_point = site.install("commfuse-test-broken", source)
    site.install("commfuse-test-good", plugin(cpu_backend("good")))
    with pytest.warns(CommfuseWarning) as record:
        refresh()
    messages = [str(w.message) for w in record if issubclass(w.category, CommfuseWarning)]
    assert len(messages) == 1, messages
    assert f"entry point {entry_point!r} of distribution 'commfuse-test-broken'" in messages[0]
    assert fragment in messages[0]
    names = {s.name for s in backends.specs()}
    assert {"good", "gloo", "accelerator"} <= names
    assert not names & {"half", "dict"}  # a plugin is taken whole or not at all


@pytest.mark.parametrize("name", ["twin", "gloo"])
def test_two_backends_with_one_name_name_both_distributions(site, name):
    site.install("commfuse-test-left", plugin(cpu_backend(name)))
    if name != "gloo":
        site.install("commfuse-test-right", plugin(cpu_backend(name)))
    with pytest.raises(PluginError) as e:
        refresh()
    message = str(e.value)
    assert f"two backends are named {name!r}" in message
    distributions = ["commfuse-test-left", "commfuse" if name == "gloo" else "commfuse-test-right"]
    assert all(f"distribution {d!r}" in message for d in distributions)


def test_a_check_that_raises_makes_the_backend_unavailable_naming_the_exception(site):
    site.install(
        "commfuse-test-flaky",
        "def explode():\n    raise RuntimeError('driver exploded')\n\n"
        + plugin(cpu_backend("flaky", priority=3, check="explode"), cpu_backend("sloppy", check="lambda: True")),
    )
    refresh()
    flaky = backends.availability("flaky")
    assert not flaky.ok
    assert flaky.reason == "its availability check raised RuntimeError: driver exploded"
    assert "commfuse-test-flaky" in flaky.fix
    assert "not an Availability" in backends.availability("sloppy").reason
    assert not {"flaky", "sloppy"} & set(backends.available())
    with pytest.raises(BackendUnavailableError, match="driver exploded"):
        backends.get("flaky")


# -- the records ---------------------------------------------------------------


def spec_fields(**overrides):
    fields = dict(
        name="mine",
        device_types=("cpu",),
        capabilities=Capabilities(),
        check=Availability.yes,
        factory=object,
        description="a backend",
    )
    return {**fields, **overrides}


@pytest.mark.parametrize(
    ("make", "error", "fragment"),
    [
        (lambda: BackendSpec(**spec_fields(name="My-Backend")), PluginError, "BackendSpec.name .* got 'My-Backend'"),
        (lambda: BackendSpec(**spec_fields(name=3)), CommfuseTypeError, "BackendSpec.name must be a string, got int 3"),
        (lambda: BackendSpec(**spec_fields(device_types=())), PluginError, "device_types of backend 'mine'"),
        (lambda: BackendSpec(**spec_fields(device_types="cpu")), CommfuseTypeError, r"device_types .*\('cpu',\)"),
        (lambda: BackendSpec(**spec_fields(device_types=("CUDA",))), PluginError, "device_types .* got 'CUDA'"),
        (lambda: BackendSpec(**spec_fields(check=None)), CommfuseTypeError, "BackendSpec.check must be callable"),
        (lambda: BackendSpec(**spec_fields(priority=True)), CommfuseTypeError, "BackendSpec.priority must be an int"),
        (lambda: BackendSpec(**spec_fields(description=" ")), PluginError, "BackendSpec.description"),
        (lambda: Capabilities(execution="lazy"), PluginError, "Capabilities.execution .* got 'lazy'"),
        (lambda: Capabilities(overlap="yes"), CommfuseTypeError, "Capabilities.overlap must be a bool, got str 'yes'"),
        (lambda: Capabilities(collectives=("all_reduce",)), PluginError, "Capabilities.collectives .*'all_reduce'"),
        (lambda: Capabilities(auto_min_slice_bytes=-1), PluginError, "auto_min_slice_bytes must be an int >= 0 .* -1"),
        (lambda: Capabilities(auto_min_slice_bytes=1.5), CommfuseTypeError, "auto_min_slice_bytes must be an int"),
        (lambda: Availability(False), PluginError, "Availability.reason must say why"),
        (lambda: Availability(True, reason="but"), PluginError, "Availability.reason and .fix must be empty"),
    ],
)
def test_invalid_records_name_the_field_and_value(make, error, fragment):
    with pytest.raises(error, match=fragment):
        make()


def test_records_are_frozen_and_normalise_sequences():
    caps = Capabilities(native_fused_ops=["all_gather_matmul"], collectives=["all_gather"])
    assert caps.native_fused_ops == ("all_gather_matmul",) and caps.collectives == ("all_gather",)
    spec = BackendSpec(**spec_fields(device_types=["cpu", "meta"], capabilities=caps))
    assert spec.device_types == ("cpu", "meta") and spec.matches("meta")
    hash(spec)
    with pytest.raises(AttributeError):
        spec.name = "other"
    assert Availability.no("why", "fix") == Availability(False, "why", "fix")
    assert Availability.yes().ok and not Availability.yes().reason


# -- the command line ------------------------------------------------------------


def test_cli_lists_backends_with_availability_and_reasons(capsys, site):
    site.install("commfuse-test-cli", plugin(cpu_backend("clitest")))
    refresh()
    assert main(["backends"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert lines["NAME"].split() == ["NAME", "DISTRIBUTION", "DEVICES", "AVAILABLE", "DETAILS"]
    assert lines["gloo"].split()[:4] == ["gloo", "commfuse", "cpu", "yes"]
    assert lines["clitest"].split()[:4] == ["clitest", "commfuse-test-cli", "cpu", "yes"]
    if not HAS_ACCELERATOR:
        assert lines["accelerator"].split()[:4] == ["accelerator", "commfuse", "accelerator", "no"]
        assert ACCELERATOR_REASON in lines["accelerator"] and "(fix: " in lines["accelerator"]

    assert main(["backends", "--json"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert set(rows) >= {"gloo", "accelerator", "clitest"}
    assert rows["gloo"]["available"] is True and rows["gloo"]["device_types"] == ["cpu"]
    assert rows["gloo"]["capabilities"]["overlap"] is True
    assert rows["accelerator"]["available"] is HAS_ACCELERATOR
    if not HAS_ACCELERATOR:
        assert rows["accelerator"]["reason"] == ACCELERATOR_REASON


def test_importing_backends_and_plugins_does_not_import_torch():
    code = "import sys, commfuse.backends, commfuse.plugins; print(sorted(m for m in sys.modules if m[:5] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
