"""The suite as collected by ``commfuse conformance`` (and by ``pytest -p commfuse.testing --pyargs
commfuse.testing.test_conformance_run``)."""

from commfuse.testing.suite import ConformanceSuite


class TestConformance(ConformanceSuite):
    pass
