"""Shared test settings: a bounded hypothesis profile so the suite stays quick on 2 cores."""

from importlib.metadata import PackageNotFoundError, version

from hypothesis import HealthCheck, settings

settings.register_profile(
    "commfuse", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("commfuse")



def _installed(distribution: str) -> bool:
    try:
        version(distribution)  # the installed distribution, not a folder of the same name on sys.path
        return True
    except PackageNotFoundError:
        return False


# tests/torchtitan_stage run in their own environment, where torchtitan is installed (ci/test_torchtitan.sh); the
# main suite's environment has no torchtitan, and commfuse does not require it
collect_ignore = [] if _installed("torchtitan") else ["torchtitan_stage"]
