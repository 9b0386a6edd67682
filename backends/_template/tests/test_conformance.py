"""Tier (b), real gloo ranks: the whole conformance suite against this backend."""

from commfuse.testing.suite import ConformanceSuite


class TestConformance(ConformanceSuite):
    pass
