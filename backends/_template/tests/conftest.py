"""The fixtures file: plugs the conformance suite in and names the backend under test."""

import pytest

pytest_plugins = ["commfuse.testing"]


@pytest.fixture(scope="session")
def commfuse_backend_name() -> str:
    return "template"  # the name registered in commfuse_template/plugin.py


@pytest.fixture(scope="session")
def commfuse_capabilities():
    from commfuse_template.conformance import Capabilities

    return Capabilities()
