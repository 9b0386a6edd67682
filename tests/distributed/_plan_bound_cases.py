"""Rank-side bodies of the planning table's bound tests: many call signatures through commfuse.tp's styles and the
fused ops on gloo ranks, each result against torch's own styles or a reference every rank computes itself, while
the table evicts; and the live tensor bytes the process holds, counted by the garbage collector, against the
bound."""

from __future__ import annotations

import gc
import threading
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise
from torch.distributed.tensor.parallel import parallelize_module

import commfuse as cf
from commfuse import backends, tp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tp_cases import _run  # noqa: E402  (the shared checks of the DTensor tests)

TOL = dict(rtol=1e-4, atol=1e-5)  # fp32, summed in another order


def _close(got, want, what):
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {list(got.shape)} != {list(want.shape)}")
    if not torch.allclose(got, want, **TOL):
        raise AssertionError(f"{what}: max diff {(got - want).abs().max().item():.3g}")


def live_tensor_bytes() -> int:
    """The bytes of every tensor storage the garbage collector sees alive in this process, each counted once."""
    gc.collect()
    seen, total = set(), 0
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor):
            try:
                storage = o.untyped_storage()
                ptr = storage.data_ptr()
            except (RuntimeError, NotImplementedError):  # a tensor without storage (fake, meta, a view of one)
                continue
            if ptr and ptr not in seen:
                seen.add(ptr)
                total += storage.nbytes()
    return total


def _mlp(hidden: int, ffn: int) -> nn.Module:
    return nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))


def _pair(mesh, hidden: int, ffn: int, algorithm: str = "ring"):
    """A tensor- and sequence-parallel MLP twice from the same weights: with torch's styles, with commfuse's."""
    torch.manual_seed(3)
    theirs, ours = _mlp(hidden, ffn), _mlp(hidden, ffn)
    ours.load_state_dict(theirs.state_dict())
    theirs = parallelize_module(theirs, mesh, {"0": TorchColwise(input_layouts=Shard(1)),
                                               "2": TorchRowwise(output_layouts=Shard(1))})
    ours = parallelize_module(ours, mesh, {"0": tp.ColwiseParallel(input_layouts=Shard(1), algorithm=algorithm),
                                           "2": tp.RowwiseParallel(output_layouts=Shard(1), algorithm=algorithm)})
    return theirs, ours


def bound_holds(rank, n, bound, shapes):
    """``shapes`` distinct (batch, sequence) shapes through a sequence-parallel MLP with commfuse's styles (each
    output against torch's styles), the bound given by ``COMMFUSE_PLAN_BYTES``: every 10 shapes, the live
    tensor bytes the process holds beyond what it held after the first shape stay within the bound."""
    results = {}
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))

    def body():
        theirs, ours = _pair(mesh, 32, 64)
        g = torch.Generator().manual_seed(5 + rank)
        base, grown = None, []
        with torch.no_grad():
            for i in range(shapes):
                x = torch.randn(1 + i % 3, 1 + i // 3, 32, generator=g)  # this rank's shard of the sequence
                _close(ours(x), theirs(x), f"shape {i} {list(x.shape)}")
                del x
                if i == 0:
                    base = live_tensor_bytes()
                elif i % 10 == 9:
                    grown.append(live_tensor_bytes() - base)
        if max(grown) > bound:
            raise AssertionError(f"the process holds up to {max(grown)} more bytes of tensors than after the first "
                                 f"shape (every 10 shapes: {grown}), over the bound of {bound}")
        used = backends.plan_usage()
        if used["bound"] != bound or not used["buffers"] <= used["reserved"] <= used["bytes"] <= bound:
            raise AssertionError(f"the table's figures break the bound of {bound}: {used}")
        if used["evictions"] == 0:
            raise AssertionError(f"nothing was evicted: the bound of {bound} was never reached ({used})")
        results["grown"] = grown

    _run(results, "bound-holds", body)
    return results


def ranks_evict_differently(rank, n):
    """Every rank with its own bound (rank 0 keeps nothing, rank 1 a little, any other the default), so the ranks
    evict different entries at different times: shapes that come back, gradients through autograd graphs made
    before a burst of evictions, and uneven shards of the functional op (each rank's buffers of its own size)
    all give torch's results, and nothing hangs."""
    results = {}
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    bounds = {0: 0, 1: 48 * 1024}
    if rank in bounds:
        backends.plan_bytes(bounds[rank])

    def styles():
        theirs, ours = _pair(mesh, 16, 8 * n)
        g = torch.Generator().manual_seed(9)
        shapes = [(b, s) for s in (1, 2, 5, 3) for b in (1, 2)]
        for turn in range(3):  # the same shapes come back: planned again where they were evicted
            for b, s in shapes:
                x = torch.randn(b, s * n, 16, generator=g).tensor_split(n, dim=1)[rank]
                with torch.no_grad():
                    _close(ours(x), theirs(x), f"turn {turn} shape {(b, s)}")
        # graphs made first, then more signatures than any small bound keeps, then every backward
        kept = []
        for s in (2, 3, 4):
            x = torch.randn(2, s * n, 16, generator=g).tensor_split(n, dim=1)[rank]
            xt, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
            kept.append((s, xt, xo, theirs(xt), ours(xo)))
        with torch.no_grad():
            for s in range(5, 25):
                x = torch.randn(1, s, 16, generator=g)
                _close(ours(x), theirs(x), f"burst shape {s}")
        for s, xt, xo, yt, yo in reversed(kept):
            _close(yo, yt, f"kept output of sequence {s}")
            yt.square().sum().backward()
            yo.square().sum().backward()
            _close(xo.grad, xt.grad, f"input grad of sequence {s}, after the burst")
        for (name, pt), (_, po) in zip(theirs.named_parameters(), ours.named_parameters()):
            _close(po.grad.full_tensor(), pt.grad.full_tensor(), f"{name} grad")

    def uneven_op():
        w = torch.randn(8, 6, generator=torch.Generator().manual_seed(4))
        for turn in range(2):
            for total in (2 * n + 1, 3 * n + 2, 5 * n + 1, n + 1):  # shards of tensor_split sizes: not all equal
                whole = torch.arange(total * 8, dtype=torch.float32).reshape(total, 8) % 7  # integers: exact
                a = whole.tensor_split(n)[rank]
                got = cf.all_gather_matmul(a, w, gathered_size=total, algorithm="ring")
                _close(got, whole @ w, f"turn {turn} uneven all_gather_matmul of {total} rows")
                out = cf.matmul_reduce_scatter(whole, w, algorithm="ring")
                _close(out, ((whole @ w) * n).tensor_split(n)[rank], f"turn {turn} matmul_reduce_scatter of {total}")

    _run(results, "styles", styles)
    _run(results, "uneven-op", uneven_op)
    used = backends.plan_usage()
    if used["bytes"] > used["bound"]:
        results["styles"] = (results["styles"] or "") + f"\nthe table holds more than its bound: {used}"
    results["usage"] = used
    return results


def thread_in_flight(rank, n):
    """Two threads, each on its own group: one calls one signature over and over, each result exact, while the
    other plans a new signature per call under a bound that keeps almost nothing, so the first thread's entries
    are evicted, and its pool's shapes dropped, while its calls are in flight."""
    results = {}
    first, second = dist.new_group(list(range(n))), dist.new_group(list(range(n)))
    w = (torch.arange(16 * 8, dtype=torch.float32).reshape(16, 8) % 5) - 2
    backends.plan_bytes(24 * 1024)  # one signature's entries and a little more
    errors: dict[str, str] = {}

    def shard(rows: int, step: int, q: int) -> torch.Tensor:  # rank q's shard, the same on every rank: exact
        return ((torch.arange(rows * 16, dtype=torch.float32).reshape(rows, 16) + 3 * q + step) % 11) - 5

    def same_signature():
        try:
            for step in range(60):
                got = cf.all_gather_matmul(shard(4, step, rank), w, group=first, algorithm="ring")
                want = torch.cat([shard(4, step, q) for q in range(n)]) @ w
                if not torch.equal(got, want):
                    raise AssertionError(f"call {step}: max diff {(got - want).abs().max().item()}")
        except Exception as e:
            errors["same"] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"

    def new_signatures():
        try:
            for step in range(60):
                rows = 1 + step
                got = cf.all_gather_matmul(shard(rows, step, rank), w, group=second, algorithm="ring")
                want = torch.cat([shard(rows, step, q) for q in range(n)]) @ w
                if not torch.equal(got, want):
                    raise AssertionError(f"call {step}: max diff {(got - want).abs().max().item()}")
        except Exception as e:
            errors["new"] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"

    threads = [threading.Thread(target=same_signature, name="same"),
               threading.Thread(target=new_signatures, name="new")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    if any(t.is_alive() for t in threads):
        errors["join"] = "a thread still runs after 240 s"
    used = backends.plan_usage()
    if used["evictions"] < 50:
        errors["evictions"] = f"the bound evicted too little to test anything: {used}"
    results["threads"] = "\n".join(f"{k}: {v}" for k, v in errors.items()) or None
    return results
