"""Tier (a), no processes: the distributions' metadata agree with the code: every backend accepts this commfuse
version (and no later minor series), licenses are SPDX strings naming files that exist, py.typed ships,
tomli is required where tomllib is missing, and the torch floor is the torch CI tests on."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

import commfuse

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the backport commfuse itself depends on there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = sorted(p.parent for p in (ROOT / "backends").glob("*/pyproject.toml"))


def _project(folder: Path) -> dict:
    return tomllib.loads((folder / "pyproject.toml").read_text())


def test_every_backend_distribution_is_found():
    assert {p.name for p in BACKENDS} == {"cuda", "npu", "xla", "jax", "tpu", "_template"}


@pytest.mark.parametrize("folder", BACKENDS, ids=lambda p: p.name)
def test_backend_pins_a_commfuse_range_around_this_version(folder):
    deps = [Requirement(d) for d in _project(folder)["project"]["dependencies"]]
    (core,) = [r for r in deps if r.name == "commfuse"]
    version = Version(commfuse.__version__)
    assert core.specifier.contains(version), f"{folder.name} requires {core}, which excludes commfuse {version}"
    following = Version(f"{version.major}.{version.minor + 1}")
    assert not core.specifier.contains(following), f"{folder.name} requires {core}: give it an upper bound"


@pytest.mark.parametrize("folder", [ROOT, *BACKENDS], ids=lambda p: p.name if p != ROOT else "commfuse")
def test_license_is_an_spdx_string_naming_files_that_exist(folder):
    data = _project(folder)
    project = data["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"], f"{folder.name}: license-files is empty"
    for name in project["license-files"]:
        assert (folder / name).is_file(), f"{folder.name}: license file {name} is missing"
    assert (folder / "LICENSE").read_bytes() == (ROOT / "LICENSE").read_bytes(), f"{folder.name}: LICENSE differs"
    assert not any(c.startswith("License ::") for c in project.get("classifiers", ())), "PEP 639: no classifier"
    (setuptools,) = [Requirement(r) for r in data["build-system"]["requires"] if r.startswith("setuptools")]
    assert not setuptools.specifier.contains("76.9"), f"{folder.name}: setuptools < 77 cannot read PEP 639 fields"


def test_py_typed_ships_with_the_package():
    assert (ROOT / "commfuse" / "py.typed").is_file()
    assert "py.typed" in _project(ROOT)["tool"]["setuptools"]["package-data"]["commfuse"]


def test_tomli_is_required_where_the_code_needs_it():
    uses_tomllib = any("import tomllib" in p.read_text() for p in (ROOT / "commfuse").rglob("*.py"))
    deps = [Requirement(d) for d in _project(ROOT)["project"]["dependencies"]]
    tomli = [r for r in deps if r.name == "tomli"]
    assert uses_tomllib == bool(tomli)
    for r in tomli:
        assert r.marker is not None and r.marker.evaluate({"python_version": "3.10"})
        assert not r.marker.evaluate({"python_version": "3.11"})


def test_torch_floor_is_the_oldest_torch_ci_tests_on():
    """pyproject's lowest torch is the one ci/setup_floor.sh pins, which ci/test_torch_floor.sh (run by
    ci/test.sh) runs the unit, gloo and conformance tests on: no older torch is admitted untested."""
    (torch_req,) = [r for r in map(Requirement, _project(ROOT)["project"]["dependencies"]) if r.name == "torch"]
    pinned = re.search(r'^torch_version="([^"]+)"$', (ROOT / "ci" / "setup_floor.sh").read_text(), re.M)
    assert pinned, "ci/setup_floor.sh no longer pins torch_version"
    floor = Version(pinned.group(1))
    lower = [Version(s.version) for s in torch_req.specifier if s.operator == ">="]
    assert lower == [floor], f"pyproject requires {torch_req}; CI's oldest torch is {floor}"
    floor_stage = (ROOT / "ci" / "test_torch_floor.sh").read_text()
    assert "ci/setup_floor.sh" in floor_stage and "tests/distributed" in floor_stage
    assert "bash ci/test_torch_floor.sh" in (ROOT / "ci" / "test.sh").read_text()
