"""The ``xla`` backend's plugin record: cheap to import (no torch, no torch_xla).

``check`` imports torch_xla only when asked whether the backend can run, and
says why not in the words a user can act on; ``factory`` makes an
:class:`~commfuse_xla.backend.XlaBackend` for the runtime's ranks.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

from commfuse.plugins import Availability, BackendSpec, hookimpl
from commfuse_xla.capabilities import CAPABILITIES

#: torch-xla pins one torch release; this is the pair the project verifies (ci/setup_xla.sh).
VERIFIED_TORCH_XLA = "2.9.0"


INSTALL = (
    f"install torch-xla with the torch release it pins, in an environment of its own: "
    f"pip install torch=={VERIFIED_TORCH_XLA} torch-xla=={VERIFIED_TORCH_XLA} (add the [tpu] extra on TPU VMs); "
    "from a commfuse checkout, bash ci/setup_xla.sh builds one; then set PJRT_DEVICE=TPU, CUDA or CPU"
)


def check() -> Availability:
    """Whether torch_xla imports here, and which PJRT device it would use."""
    if importlib.util.find_spec("torch_xla") is None:
        return Availability.no("torch_xla is not importable in this environment (no module named 'torch_xla')", INSTALL)
    try:
        import torch
        import torch_xla
    except Exception as e:  # noqa: BLE001 - a torch/torch_xla mismatch fails here with an ImportError or OSError
        import torch

        return Availability.no(
            f"torch_xla is installed but fails to import with torch {torch.__version__}: {type(e).__name__}: {e}",
            f"torch-xla must match torch exactly; {INSTALL}",
        )
    version = getattr(torch_xla, "__version__", "?")
    if version.split("+")[0].rsplit(".", 1)[0] != torch.__version__.split("+")[0].rsplit(".", 1)[0]:
        return Availability.no(
            f"torch_xla {version} was built for another torch release than the installed torch {torch.__version__}",
            f"torch-xla must match torch exactly; {INSTALL}",
        )
    device = os.environ.get("PJRT_DEVICE", "")
    where = f"PJRT_DEVICE={device}" if device else "PJRT_DEVICE unset: torch_xla picks TPU if one is present, else CPU"
    note = ""
    if device.upper() == "CPU":
        note = "; XLA:CPU executes world size 1 only, larger worlds are checked as HLO without running"
    return Availability.yes(f"xla devices through PJRT ({where}), torch_xla {version}{note}")


def factory(group=None, device=None):
    from commfuse_xla.backend import XlaBackend

    return XlaBackend.from_group(group=group, device=device)


@hookimpl
def commfuse_backends() -> Iterator[BackendSpec]:
    yield BackendSpec(
        name="xla",
        device_types=("xla",),
        capabilities=CAPABILITIES,
        check=check,
        factory=factory,
        description="torch_xla: ring steps lowered to collective-permutes that XLA's scheduler overlaps with the dots",
        install_hint="pip install -e backends/xla (needs torch-xla, not installed by it: " + INSTALL + ")",
    )
