"""Tier (a), no processes: the backend is discovered through its entry point and can run here."""

import commfuse as cf


def test_registered_and_available():
    spec = cf.backends.spec("template")
    assert spec.distribution == "commfuse-template"
    assert cf.backends.availability("template").ok
    assert "template" in cf.backends.available()
    assert not spec.capabilities.capturable  # CPU: no device graphs, so the capture tier skips it


def test_never_chosen_over_gloo_for_cpu_tensors():
    assert cf.backends.spec("template").priority < cf.backends.spec("gloo").priority
