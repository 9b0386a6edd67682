"""Shared test settings: a bounded hypothesis profile so the suite stays quick on 2 cores."""

from hypothesis import HealthCheck, settings

settings.register_profile(
    "commfuse", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("commfuse")
