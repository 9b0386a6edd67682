"""The ``jax`` backend's plugin record: cheap to import (no jax, no torchax, no torch).

``check`` says whether jax and torchax can be found here, without importing
them; ``factory`` makes a :class:`~commfuse_jax.backend.JaxBackend` for a mesh
axis (the ``group``: an axis name, a tuple of them, or None for the one axis
the enclosing ``shard_map`` binds).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

from commfuse.plugins import Availability, BackendSpec, hookimpl
from commfuse_jax.capabilities import CAPABILITIES

#: The versions this project verifies together (ci/setup_jax.sh): jax 0.10.2 is the newest for Python 3.11;
#: torchax 0.0.13 fails to import on torch 2.13 (torch removed aten.prod.dim_Dimname).
VERIFIED_JAX = "0.10.2"
VERIFIED_TORCHAX = "0.0.14.dev20261026"

INSTALL = (
    f"pip install 'jax[cpu]=={VERIFIED_JAX}' torchax=={VERIFIED_TORCHAX} (on a TPU VM 'jax[tpu]' instead of "
    "'jax[cpu]'); from a commfuse checkout, bash ci/setup_jax.sh builds an environment with both"
)


def check() -> Availability:
    """Whether jax and torchax are importable here (looked up, not imported: importing jax is not free)."""
    missing = [name for name in ("jax", "torchax") if importlib.util.find_spec(name) is None]
    if missing:
        return Availability.no(f"{' and '.join(missing)} not importable in this environment", INSTALL)
    return Availability.yes(
        "jax and torchax: ops called on torchax tensors inside jax.shard_map run on the mesh axis given as group "
        "(or the one axis in scope)"
    )


def factory(group=None, device=None):
    from commfuse_jax.backend import JaxBackend

    return JaxBackend(group)


@hookimpl
def commfuse_backends() -> Iterator[BackendSpec]:
    yield BackendSpec(
        name="jax",
        device_types=("jax",),
        capabilities=CAPABILITIES,
        check=check,
        factory=factory,
        description="JAX through torchax: every ring hop a ppermute on a mesh axis, the rank its axis_index",
        install_hint="pip install -e backends/jax (needs jax and torchax, not installed by it: " + INSTALL + ")",
    )
