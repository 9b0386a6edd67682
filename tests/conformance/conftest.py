"""The conformance tests import ``commfuse.testing.suite`` without its pytest plugin: register its marker."""


def pytest_configure(config):
    config.addinivalue_line("markers", "commfuse_tier(name): a conformance test whose cases come from that tier")
