"""The ``cuda`` backend's plugin record and availability check (imports torch only when checking).

The check gathers facts (:func:`probe`) and a pure function turns them into a
verdict (:func:`decide`), so every reason a user can see is unit-tested on a
machine without a GPU, and the probe itself runs for real wherever the check does.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from commfuse.plugins import Availability, BackendSpec, hookimpl
from commfuse_cuda.capabilities import CAPABILITIES


CUDA_TORCH_FIX = (
    "install a CUDA build of torch that your NVIDIA driver supports in place of the CPU build "
    "(on Linux x86_64, `pip install torch==<version>` from PyPI is the CUDA build)"
)


@dataclass(frozen=True)
class Facts:
    """What the availability check looks at."""

    torch_version: str
    torch_cuda: str | None  # torch.version.cuda: None on a CPU build
    distributed: bool  # torch.distributed.is_available()
    nccl: bool  # torch.distributed.is_nccl_available()
    device_count: int  # torch.cuda.device_count()
    device_name: str = ""  # of device 0, when there is one
    nccl_version: str = ""


def probe() -> Facts:
    """The facts of this process (initialises nothing: device_count reads NVML/the driver lazily)."""
    import torch
    import torch.distributed as dist

    distributed = dist.is_available()
    nccl = distributed and dist.is_nccl_available()
    count = torch.cuda.device_count() if torch.version.cuda else 0
    name = torch.cuda.get_device_name(0) if count else ""
    version = ""
    if nccl and count:
        try:
            version = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - informational only
            version = ""
    return Facts(torch.__version__, torch.version.cuda, distributed, nccl, count, name, version)


def decide(f: Facts) -> Availability:
    """Whether the cuda backend can run, from the facts; every 'no' says why and what to do."""
    if not f.torch_cuda:
        return Availability.no(
            f"torch {f.torch_version} is a CPU-only build (torch.version.cuda is None)", CUDA_TORCH_FIX
        )
    if not f.distributed:
        return Availability.no(
            f"torch {f.torch_version} was built without torch.distributed", CUDA_TORCH_FIX
        )
    if not f.nccl:
        return Availability.no(
            f"torch {f.torch_version} (CUDA {f.torch_cuda}) has no NCCL backend (torch.distributed.is_nccl_available() "
            "is False)",
            "install torch's Linux CUDA wheel, which ships NCCL (Windows and macOS builds have none)",
        )
    if f.device_count < 1:
        return Availability.no(
            f"no CUDA device is visible (torch {f.torch_version} built for CUDA {f.torch_cuda}, "
            "torch.cuda.device_count() is 0)",
            "check the NVIDIA driver with nvidia-smi, and that CUDA_VISIBLE_DEVICES does not hide the GPUs",
        )
    nccl = f"NCCL {f.nccl_version}" if f.nccl_version else "NCCL"
    return Availability.yes(f"{f.device_count} CUDA device(s) ({f.device_name}) with {nccl}, CUDA {f.torch_cuda}")


def check() -> Availability:
    return decide(probe())


def factory(group=None, device=None):
    from commfuse_cuda.backend import CudaBackend

    return CudaBackend(group=group, device=device)


@hookimpl
def commfuse_backends() -> Iterator[BackendSpec]:
    yield BackendSpec(
        name="cuda",
        device_types=("cuda",),
        capabilities=CAPABILITIES,
        check=check,
        factory=factory,
        description="NCCL on a dedicated high-priority stream; torch symmetric-memory fused ops where shapes qualify",
        # Wins over the generic 'accelerator' path (priority -10) for cuda tensors.
        priority=10,
        install_hint="pip install -e backends/cuda (needs a CUDA build of torch, not installed by it)",
    )
