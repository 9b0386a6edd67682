"""The ``tpu`` backend's plugin record and availability check. Never imports ``torch_tpu``.

Importing ``torch_tpu``, or starting its device, on a machine without a TPU
makes libtpu query a cloud metadata server over the network. So the check
gathers facts without importing it (:func:`probe`: is the package there, are
there TPU device nodes) and a pure function turns them into a verdict
(:func:`decide`), unit-tested everywhere.
"""

from __future__ import annotations

import glob
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass

from commfuse.plugins import Availability, BackendSpec, hookimpl
from commfuse_tpu.capabilities import CAPABILITIES

INSTALL = (
    "on a TPU VM: pip install torch-tpu (TorchTPU, for torch 2.11 to 2.15 and Python 3.11 or newer, with libtpu); "
    "never install it where there is no TPU"
)

#: Where a TPU VM exposes its chips: /dev/accel* (v2 to v5e), /dev/vfio/<n> (v5p, v6e).
DEVICE_NODES = ("/dev/accel*", "/dev/vfio/[0-9]*")


@dataclass(frozen=True)
class Facts:
    installed: bool  # importlib.util.find_spec("torch_tpu") finds it (not imported)
    device_nodes: tuple[str, ...]  # TPU device nodes on this machine


def probe() -> Facts:
    """The facts, without importing torch_tpu or touching libtpu."""
    nodes = tuple(sorted(p for pattern in DEVICE_NODES for p in glob.glob(pattern)))
    return Facts(importlib.util.find_spec("torch_tpu") is not None, nodes)


def decide(f: Facts) -> Availability:
    if not f.installed:
        return Availability.no("torch_tpu (TorchTPU) is not installed in this environment", INSTALL)
    if not f.device_nodes:
        return Availability.no(
            "torch_tpu is installed but this machine has no TPU device node (/dev/accel*, /dev/vfio/<n>); commfuse "
            "does not import it here, since starting its device without a TPU makes libtpu query the network",
            "run on a TPU VM",
        )
    return Availability.yes(
        f"TorchTPU's 'tpu' c10d backend on {len(f.device_nodes)} TPU device node(s) (UNVERIFIED by this project: "
        "no TPU was lent to it)"
    )


def check() -> Availability:
    return decide(probe())


def factory(group=None, device=None):
    from commfuse_tpu.backend import TpuBackend

    return TpuBackend(group=group, device=device)


@hookimpl
def commfuse_backends() -> Iterator[BackendSpec]:
    yield BackendSpec(
        name="tpu",
        device_types=("tpu",),
        capabilities=CAPABILITIES,
        check=check,
        factory=factory,
        description="TorchTPU's 'tpu' c10d backend running commfuse's eager ring (UNVERIFIED without a TPU)",
        priority=10,
        install_hint="pip install -e backends/tpu (needs torch-tpu on a TPU VM, not installed by it: " + INSTALL + ")",
    )
