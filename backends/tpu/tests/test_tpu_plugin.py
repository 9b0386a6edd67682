"""Tier (a), no processes, no TPU: the tpu backend's static checks. torch_tpu is never imported: a test double
named torch_tpu that fails when imported stands in for the installed package."""

from __future__ import annotations

import sys
import textwrap

import pytest

from commfuse.plugins import Capabilities
from commfuse_tpu import plugin
from commfuse_tpu.capabilities import CAPABILITIES


@pytest.fixture
def torch_tpu_double(tmp_path, monkeypatch):
    """A package named torch_tpu on sys.path whose import fails the test (and would, in real life, start libtpu)."""
    pkg = tmp_path / "torch_tpu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent('''
        raise AssertionError("torch_tpu was imported: commfuse-tpu must never import it to check availability")
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("torch_tpu", None)
    yield pkg
    assert "torch_tpu" not in sys.modules


def test_the_record_registers_through_the_entry_point():
    from commfuse.plugins import manager

    specs = manager.backend_specs()
    assert "tpu" in specs, f"commfuse-tpu is not installed in this environment (found {list(specs)})"
    spec = specs["tpu"]
    assert spec.capabilities == CAPABILITIES and spec.device_types == ("tpu",)
    assert spec.distribution == "commfuse-tpu"


def test_check_without_the_package_says_how_to_install():
    verdict = plugin.decide(plugin.Facts(installed=False, device_nodes=()))
    assert not verdict.ok and "not installed" in verdict.reason and "TPU VM" in verdict.fix


def test_check_with_the_package_and_no_tpu_never_imports_it(torch_tpu_double, monkeypatch):
    monkeypatch.setattr(plugin, "DEVICE_NODES", (str(torch_tpu_double / "no-such-node*"),))
    facts = plugin.probe()
    assert facts.installed and facts.device_nodes == ()
    verdict = plugin.check()
    assert not verdict.ok and "no TPU device node" in verdict.reason and "network" in verdict.reason


def test_check_with_device_nodes_is_available_and_says_unverified(torch_tpu_double, tmp_path, monkeypatch):
    (tmp_path / "accel0").write_text("")
    monkeypatch.setattr(plugin, "DEVICE_NODES", (str(tmp_path / "accel*"),))
    verdict = plugin.check()
    assert verdict.ok and "UNVERIFIED" in verdict.detail and "1 TPU device node" in verdict.detail


def test_capabilities_claim_nothing_unmeasured():
    assert isinstance(CAPABILITIES, Capabilities)
    assert CAPABILITIES.execution == "eager" and not CAPABILITIES.overlap and not CAPABILITIES.streams
    assert not CAPABILITIES.capturable and CAPABILITIES.native_fused_ops == () and CAPABILITIES.whole_ops == ()


def test_commfuse_backends_lists_it_as_unavailable_here():
    import commfuse.backends

    assert "tpu" not in commfuse.backends.available()
    assert not commfuse.backends.availability("tpu").ok


def test_the_package_imports_no_torch_tpu():
    import importlib

    for name in ("commfuse_tpu", "commfuse_tpu.plugin", "commfuse_tpu.capabilities", "commfuse_tpu.conformance"):
        importlib.import_module(name)
    assert "torch_tpu" not in sys.modules
