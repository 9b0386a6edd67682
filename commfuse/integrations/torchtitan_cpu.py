"""What a CPU-only process needs before it imports torchtitan 0.3's model code: :func:`prepare`.

Import and call this before anything from torchtitan (CI's torchtitan stage and ``commfuse bench -w
torchtitan`` do). torchtitan 0.3 targets CUDA (and a nightly torch). Two things stand between its model
code and a CPU rank, and both are torchtitan's, not commfuse's (docs/torchtitan.md lists them):

* ``torchtitan.tools.utils.device_type`` falls back to ``"cuda"`` when torch finds no accelerator, so
  meshes and FSDP would be built for CUDA: it is set to ``"cpu"`` before any torchtitan module that
  copies it is imported;
* ``torchtitan.distributed.minimal_async_ep.kernels`` imports triton at module level (GPU kernels for
  one of its MoE token dispatchers, which these tests never select): a stand-in module with the same
  names is registered instead, each raising if it is ever called.
"""

from __future__ import annotations

import sys
import types

import torch

_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
_KERNEL_NAMES = ("copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel", "expand_topk_grad_kernel",
                 "fill_combine_metadata_kernel", "fill_dispatch_metadata_kernel", "invert_flat_indices_kernel",
                 "reduce_topk_slots_kernel", "topk_scores_grad_kernel")


def _stand_in(name: str):
    def kernel(*args, **kwargs):
        raise RuntimeError(f"{_KERNELS}.{name} is a triton GPU kernel, stood in on this CPU process by "
                           "commfuse.integrations.torchtitan_cpu.prepare(); the minimal_async_ep token dispatcher "
                           "that calls it needs a GPU")
    kernel.__name__ = name
    return kernel


def prepare() -> None:
    """Make torchtitan's model code importable and runnable on this CPU process, under its ``spmd_types``
    backend (idempotent). Does nothing to the device where torch sees CUDA, nor to the kernels where triton is
    installed."""
    if _KERNELS not in sys.modules:
        try:
            import triton  # noqa: F401  (a machine with triton needs no stand-in)
        except ImportError:
            module = types.ModuleType(_KERNELS)
            for name in _KERNEL_NAMES:
                setattr(module, name, _stand_in(name))
            sys.modules[_KERNELS] = module
    import torchtitan.tools.utils as utils

    if not torch.cuda.is_available():
        utils.device_type, utils.device_module = "cpu", torch.cpu
    from torchtitan.distributed import utils as dist_utils

    dist_utils.set_spmd_backend("spmd_types")
