"""The backends that ship with commfuse, registered through the same hook as any plugin.

- ``gloo``: torch.distributed on CPU; what CI, the benchmark default and the
  conformance reference run on.
- ``accelerator``: the generic torch.distributed path for whatever device
  ``torch.accelerator`` reports (CUDA with NCCL, NPU with HCCL, XPU ...). Its
  priority is low, so a vendor plugin for the same device type wins.

Both are the c10d backend under two names; the checks and factories import
torch only when called. What reads each capability field is documented on
:class:`~commfuse.plugins.types.Capabilities`; neither declares native fused
kernels (the c10d backend has no ``native_op``).
"""

from __future__ import annotations

from collections.abc import Iterator

from commfuse.plugins.hookspec import hookimpl
from commfuse.plugins.types import ACCELERATOR, Availability, BackendSpec, Capabilities

_NO_DISTRIBUTED = "torch was built without torch.distributed (torch.distributed.is_available() is False)"
_TORCH_FIX = "install a torch build with distributed support, e.g. `pip install torch==2.13.0` (CPU wheel)"
_ACCELERATOR_FIX = (
    "install the torch build for your device and its drivers (a CUDA wheel of torch with the NVIDIA driver; "
    "torch-npu with Ascend CANN; a torch XPU wheel with Intel's GPU driver), or use the 'gloo' backend on CPU"
)


def _gloo_check() -> Availability:
    import torch.distributed as dist

    if not dist.is_available():
        return Availability.no(_NO_DISTRIBUTED, _TORCH_FIX)
    if not dist.is_gloo_available():
        return Availability.no(
            "torch.distributed has no gloo backend (torch.distributed.is_gloo_available() is False)", _TORCH_FIX
        )
    return Availability.yes("cpu tensors with torch.distributed backend 'gloo'")


def _accelerator_check() -> Availability:
    import torch

    if not hasattr(torch, "accelerator"):
        return Availability.no(
            f"torch {torch.__version__} has no torch.accelerator (it appeared in torch 2.6)",
            "upgrade to torch 2.9 or newer (the oldest commfuse is tested on), built for your device",
        )
    if not torch.accelerator.is_available():
        return Availability.no(
            "no accelerator is visible to torch (torch.accelerator.is_available() is False)", _ACCELERATOR_FIX
        )
    device_type = torch.accelerator.current_accelerator().type
    import torch.distributed as dist

    if not dist.is_available():
        return Availability.no(_NO_DISTRIBUTED, _TORCH_FIX)
    try:
        backend = dist.get_default_backend_for_device(device_type)
    except (ValueError, RuntimeError) as e:
        return Availability.no(
            f"torch.distributed has no default backend for {device_type!r} devices ({e})",
            f"install the torch extension that registers a communication backend for {device_type!r} devices",
        )
    return Availability.yes(f"{device_type} tensors with torch.distributed backend {backend!r}")


def _c10d_factory(name: str):
    def factory(group=None, device=None):
        from commfuse.runtime.c10d import C10dBackend

        return C10dBackend(group=group, device=device, name=name)

    factory.__qualname__ = factory.__name__ = f"{name}_factory"
    return factory


@hookimpl
def commfuse_backends() -> Iterator[BackendSpec]:
    yield BackendSpec(
        name="gloo",
        device_types=("cpu",),
        capabilities=Capabilities(
            # TCP connections carry both directions at once.
            bidirectional_links=True,
            execution="eager",
            # The host waits: Work.wait(timeout) on gloo blocks until the bytes are there.
            streams=False,
            # gloo's isend/irecv progress in background threads while the host computes.
            overlap=True,
            # Ring hops beat gloo's own collectives on loopback even for 2 KiB hops, at 2-4 ranks: all_gather
            # 1.0-1.6x, reduce_scatter 2.5-5x (gloo's reduce_scatter costs about an all-reduce here);
            # docs/benchmarks.md, "Tiny sizes". So auto takes the ring at every size.
            auto_min_slice_bytes=0,
            # CPU tensors: there is no device graph to capture into.
            capturable=False,
        ),
        check=_gloo_check,
        factory=_c10d_factory("gloo"),
        description="torch.distributed with gloo on CPU (the reference backend)",
        install_hint="built into commfuse; needs a torch build with torch.distributed",
    )
    yield BackendSpec(
        name="accelerator",
        device_types=(ACCELERATOR,),
        capabilities=Capabilities(
            # NVLink, HCCS, PCIe and InfiniBand links carry both directions at once.
            bidirectional_links=True,
            execution="eager",
            # batch_isend_irecv is stream-ordered on NCCL/HCCL: C10dBackend's waits do not block the host.
            streams=True,
            overlap=True,
            # Not declared: this generic path serves devices (XPU, ...) whose graph capture of commfuse calls has
            # not been run; commfuse-cuda declares it for CUDA, commfuse-npu for Ascend NPUs.
            capturable=False,
        ),
        check=_accelerator_check,
        factory=_c10d_factory("accelerator"),
        description="generic torch.distributed for the device torch.accelerator reports (NCCL, HCCL, XCCL ...)",
        # Vendor plugins for the same device type win over this generic path.
        priority=-10,
        install_hint="built into commfuse; needs the torch build for your device",
    )
