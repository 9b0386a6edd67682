"""What commfuse keeps per call signature, over many shapes: a serving-like TP forward against torch's styles.

Tier: benchmark (prints figures, asserts nothing). Two gloo ranks run a
tensor- and sequence-parallel MLP (hidden ``--hidden``, 4x wider inside;
``ColwiseParallel(input_layouts=Shard(1))`` then
``RowwiseParallel(output_layouts=Shard(1))``) forward under ``no_grad`` on
``--shapes`` distinct (batch, sequence) shapes, as serving does at every
prefill length and batch size: first with torch's own styles, then with
commfuse's (``commfuse.tp``), in the same processes. Every ``--every``
shapes, rank 0 prints for each side the live tensor bytes the process holds
beyond what it held after the first shape of that side (every storage the
garbage collector sees, counted once) and the resident memory
(``/proc/self/statm``), raw and after glibc's ``malloc_trim`` (ever larger
shapes leave freed blocks that malloc keeps, which the raw figure counts);
for commfuse also the planning table's figures
(``commfuse.backends.plan_usage()``): the bytes it counts against its bound,
of which the receive buffers it reserves and those it holds now, its
entries and evictions. The last lines say whether commfuse's live bytes
stayed within the bound.

    python benchmarks/plan_memory.py [--shapes 2000] [--hidden 64] [--every 100] [--bound 64MiB]

``--bound`` sets ``COMMFUSE_PLAN_BYTES`` for the ranks (default: as the
environment says, else the library's default, 1 GiB).
"""

from __future__ import annotations

import argparse
import gc
import os

MIB = 2**20


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / MIB


def _trimmed_rss_mib() -> float:
    """The resident memory once glibc's malloc has given back the free memory it keeps (``malloc_trim``): tensors
    of ever larger shapes leave freed blocks the allocator holds on to, which the raw figure counts. The raw
    figure where there is no glibc."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return _rss_mib()


def _live_bytes() -> int:
    import torch

    gc.collect()
    seen, total = set(), 0
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor):
            try:
                storage = o.untyped_storage()
                ptr = storage.data_ptr()
            except (RuntimeError, NotImplementedError):
                continue
            if ptr and ptr not in seen:
                seen.add(ptr)
                total += storage.nbytes()
    return total


def _shape(i: int) -> tuple[int, int]:
    """The i-th (batch, sequence rows of this rank) shape: batch 1 to 4, then the next sequence length."""
    return 1 + i % 4, 1 + i // 4


def _side(model, shapes: int, every: int, hidden: int, usage=None) -> list[tuple]:
    import torch

    rows, base, rss0, trimmed0 = [], None, None, None
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for i in range(shapes):
            b, s = _shape(i)
            y = model(torch.randn(b, s, hidden, generator=g))
            del y
            if i == 0:
                base, rss0 = _live_bytes(), _rss_mib()
                trimmed0 = _trimmed_rss_mib()
            if (i + 1) % every == 0:
                rss = _rss_mib()  # read before the census allocates its own lists
                live = (_live_bytes() - base) / MIB
                rows.append((i + 1, live, rss - rss0, _trimmed_rss_mib() - trimmed0, usage() if usage else None))
    return rows


def _ranks(rank, n, shapes, every, hidden):
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from commfuse import backends, tp

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    torch.manual_seed(1)
    ffn = 4 * hidden
    theirs = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
    ours = nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))
    ours.load_state_dict(theirs.state_dict())
    theirs = parallelize_module(theirs, mesh, {"0": ColwiseParallel(input_layouts=Shard(1)),
                                               "2": RowwiseParallel(output_layouts=Shard(1))})
    ours = parallelize_module(ours, mesh, {"0": tp.ColwiseParallel(input_layouts=Shard(1), algorithm="ring"),
                                           "2": tp.RowwiseParallel(output_layouts=Shard(1), algorithm="ring")})
    torch_rows = _side(theirs, shapes, every, hidden)
    ours_rows = _side(ours, shapes, every, hidden, backends.plan_usage)
    return torch_rows, ours_rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", type=int, default=2000)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--bound", default=None, help="COMMFUSE_PLAN_BYTES for the ranks (bytes, or with KiB/MiB/GiB)")
    p.add_argument("--world-size", type=int, default=2)
    args = p.parse_args(argv)
    from commfuse.launch import launch

    env = {} if args.bound is None else {"COMMFUSE_PLAN_BYTES": args.bound}
    out = launch(_ranks, args.world_size, args.shapes, args.every, args.hidden, timeout=7200, env=env)
    torch_rows, ours_rows = out[0]
    bound = ours_rows[-1][4]["bound"]
    last = _shape(args.shapes - 1)
    print(f"plan memory: {args.shapes} distinct shapes (batch 1-4, up to {last[1]} sequence rows a rank) through a "
          f"TP+SP MLP, hidden {args.hidden} (x4 inside), {args.world_size} gloo ranks, no_grad; rank 0; bound "
          f"{bound / MIB:.2f} MiB")
    print("live: tensor storages alive beyond the side's first shape; RSS: resident memory beyond it, raw and once "
          "malloc gave back its free memory (trimmed); table, reserved, held: commfuse.backends.plan_usage()")
    print(f"{'':>6} | {'torch styles':^28} | {'commfuse.tp styles':^101}")
    print(f"{'shapes':>6} | {'live MiB':>8} {'RSS MiB':>9} {'trimmed':>9} | {'live MiB':>8} {'RSS MiB':>9} "
          f"{'trimmed':>9} {'table MiB':>10} {'reserved MiB':>12} {'held MiB':>9} {'entries':>8} {'evictions':>10} "
          f"{'replanned':>10}")
    for (i, live_t, rss_t, trim_t, _), (_, live_o, rss_o, trim_o, used) in zip(torch_rows, ours_rows):
        print(f"{i:>6} | {live_t:>8.2f} {rss_t:>+9.1f} {trim_t:>+9.1f} | {live_o:>8.2f} {rss_o:>+9.1f} "
              f"{trim_o:>+9.1f} {used['bytes'] / MIB:>10.2f} {used['reserved'] / MIB:>12.2f} "
              f"{used['buffers'] / MIB:>9.2f} {used['entries']:>8} {used['evictions']:>10} {used['replanned']:>10}")
    most = max(row[1] for row in ours_rows)
    most_table = max(row[4]["bytes"] for row in ours_rows)
    print(f"commfuse: live tensor bytes at most {most:.2f} MiB beyond the first shape, the table at most "
          f"{most_table / MIB:.2f} MiB, against the bound of {bound / MIB:.2f} MiB: "
          f"{'within it' if most * MIB <= bound and most_table <= bound else 'OVER IT'}")
    print(f"torch's styles: live tensor bytes at most {max(row[1] for row in torch_rows):.2f} MiB beyond the first "
          "shape")


if __name__ == "__main__":
    main()
