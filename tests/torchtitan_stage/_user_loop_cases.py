"""Rank bodies: torchtitan 0.3's Llama 3 with commfuse's modules in the loops its users run, each against
the stock model in the same loop: bf16 autocast, each block compiled as torchtitan's ``apply_compile``
compiles it, a distributed-checkpoint round trip between the stock and the fused model, and a failure on
one rank (its attention built otherwise, or its mask refused) that every rank must be told of by name.

The models are ``_llama_cases``' (two layers, GQA 16/4, fused ``wqkv``, attention split by query), on 2
gloo ranks (tp2, sequence parallel, ``spmd_types``)."""

from __future__ import annotations

import copy
import os
import tempfile
import time

import torch
import torch.distributed as dist

from _harness import prepare
from _llama_cases import BATCH, SEQ, _build, _config, _placements, _positions

#: every op's timeout in the failure bodies (``COMMFUSE_TIMEOUT_S``, set before the ranks start): a rank told
#: through the board raises long before it
TIMEOUT = 60.0


def _models(n: int, *, core: str = "sdpa", algorithm: str = "ring"):
    """(stock, fused, context, vocab): both built and sharded by torchtitan over tp ``n``, the fused one
    loaded from the stock one's state dict."""
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    from commfuse.integrations import torchtitan as cf_titan

    parallelism = ParallelismConfig(tensor_parallel_degree=n, enable_sequence_parallel=True,
                                    spmd_backend="spmd_types")
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=n, pp=1, ep=1, world_size=n, spmd_backend="spmd_types")
    stock_config = _config(False, core)
    fused_config = copy.deepcopy(stock_config)
    cf_titan.use_commfuse(fused_config, algorithm=algorithm)
    stock, fused = _build(stock_config, dims, parallelism), _build(fused_config, dims, parallelism)
    context = dist_utils.get_spmd_context(parallel_dims=dims)
    torch.manual_seed(0)
    with torch.no_grad(), context():
        stock.init_weights(buffer_device=torch.device("cpu"))
        fused.init_weights(buffer_device=torch.device("cpu"))
    fused.load_state_dict(stock.state_dict(), strict=True)
    return stock, fused, context, stock_config.vocab_size


def _batch(vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (BATCH, SEQ), generator=g), torch.randint(0, vocab, (BATCH, SEQ), generator=g)


def _step(model, context, tokens, labels, vocab):
    """One forward and backward (the mean token loss); the loss and every parameter's gradient."""
    from torchtitan.components.loss import cross_entropy_loss

    model.zero_grad(set_to_none=True)
    with context():
        loss = cross_entropy_loss(model(tokens), labels, global_vocab_size=vocab) / (BATCH * SEQ)
        loss.backward()
    return loss.detach().float(), {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def _compare(label: str, got, want, tolerance: float, problems: list[str]) -> None:
    (l1, g1), (l0, g0) = got, want
    if abs(l1.item() - l0.item()) > tolerance * max(1.0, abs(l0.item())):
        problems.append(f"{label}: loss {l1.item()} vs stock {l0.item()}")
    for name, w in g0.items():
        err = _relative(g1[name], w)
        if not err <= tolerance:
            problems.append(f"{label}: gradient of {name}: relative error {err:.2e} > {tolerance:g}")


def autocast(rank: int, n: int) -> list[str]:
    """bf16 autocast: the stock and the fused model in the same autocast region, the fused projections'
    outputs in bf16 as the stock ones are; losses and gradients within bf16's rounding."""
    torch.set_num_threads(1)
    prepare()
    stock, fused, context, vocab = _models(n)
    dtypes: dict[str, list] = {"stock": [], "commfuse": []}
    for label, model in (("stock", stock), ("commfuse", fused)):
        for module in (model.layers["0"].attention.qkv_linear, model.layers["0"].feed_forward):
            def seen(m, args, out, label=label) -> None:  # under autocast: (which module, its output's dtype)
                if torch.is_autocast_enabled("cpu"):
                    dtypes[label].append((isinstance(out, torch.Tensor), (out if isinstance(out, torch.Tensor)
                                                                          else out[0]).dtype))
            module.register_forward_hook(seen)
    problems: list[str] = []
    for seed in range(2):
        tokens, labels = _batch(vocab, seed)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = _step(stock, context, tokens, labels, vocab)
            got = _step(fused, context, tokens, labels, vocab)
        _compare(f"bf16 batch {seed}", got, want, 3e-2, problems)
        fp32 = _step(fused, context, tokens, labels, vocab)  # not the bf16 result: autocast reached the fused GEMMs
        if _relative(fp32[1]["layers.0.attention.qkv_linear.wqkv.weight"],
                     got[1]["layers.0.attention.qkv_linear.wqkv.weight"]) < 1e-6:
            problems.append("the bf16 gradient equals the fp32 one: autocast did not reach the fused GEMMs")
    if dtypes["commfuse"] != dtypes["stock"] or (False, torch.bfloat16) not in dtypes["stock"]:
        problems.append(f"output dtypes under autocast: commfuse {dtypes['commfuse']}, stock {dtypes['stock']}")
    return problems


def compiled(rank: int, n: int) -> list[str]:
    """Each transformer block compiled as torchtitan's ``apply_compile`` does (``block.compile(fullgraph=
    True)``; aot_eager here: inductor's CPU compile of a 2-layer block per rank would take minutes on this
    machine), both models: the fused ops in the graphs as commfuse's custom ops, and the losses and
    gradients those of the eager stock model."""
    torch.set_num_threads(1)
    prepare()
    stock, fused, context, vocab = _models(n)
    tokens, labels = _batch(vocab, 7)
    want = _step(stock, context, tokens, labels, vocab)
    seen: set[str] = set()

    def backend(gm, inputs):
        from torch._dynamo.backends.registry import lookup_backend

        seen.update(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return lookup_backend("aot_eager")(gm, inputs)

    for model in (stock, fused):
        for block in model.layers.values():
            block.compile(backend=backend, fullgraph=True)
    problems: list[str] = []
    for label, model in (("stock compiled", stock), ("commfuse compiled", fused)):
        for step in range(2):  # the second step runs the compiled graphs without compiling
            _compare(f"{label} step {step}", _step(model, context, tokens, labels, vocab), want, 1e-5, problems)
    fused_ops = sorted(t for t in seen if t.startswith("commfuse."))
    want_ops = ["commfuse.all_gather_matmul", "commfuse.attention_reduce_scatter", "commfuse.matmul_reduce_scatter"]
    if not set(want_ops) <= set(fused_ops):
        problems.append(f"commfuse's ops in the compiled graphs: {fused_ops}, expected {want_ops}")
    return problems


def _as_dtensors(model, tp_mesh) -> dict:
    """``model``'s state dict with each plain local tensor wrapped as the DTensor torchtitan's sharding configs
    say it is on the TP mesh: what a distributed checkpoint needs to save each rank's shard rather than one
    rank's copy. (torchtitan 0.3 under ``spmd_types`` hands DCP the plain local tensors, which it takes for
    replicated copies and keeps once: TP shards are lost, for the stock model as for this one; see
    docs/torchtitan.md.)"""
    from torch.distributed.tensor import DTensor

    placements = _placements(model)
    state = {}
    for name, t in model.state_dict().items():
        if name not in placements:
            raise AssertionError(f"{name} has no sharding config: its TP layout is unknown")
        state[name] = DTensor.from_local(t, tp_mesh, [placements[name]], run_check=False)
    return state


def checkpoint(rank: int, n: int) -> list[str]:
    """A distributed checkpoint (``torch.distributed.checkpoint``, what torchtitan's checkpointer calls) of
    the stock model loaded into a fused model set otherwise, and one of the fused model (after a training
    step) loaded into the stock one: every parameter on every rank comes back, the fused ``wqkv`` included
    (which saves as ``wq``/``wk``/``wv``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    prepare()
    stock, fused, context, vocab = _models(n)
    tp_mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    problems: list[str] = []
    path = [tempfile.mkdtemp(prefix="commfuse-dcp-") if rank == 0 else None]
    dist.broadcast_object_list(path)

    def move(source, target, what: str) -> None:
        where = os.path.join(path[0], what)
        dcp.save(_as_dtensors(source, tp_mesh), checkpoint_id=where)
        state = _as_dtensors(target, tp_mesh)
        dcp.load(state, checkpoint_id=where)
        target.load_state_dict({k: v.to_local() for k, v in state.items()})
        for (name, p), (_, w) in zip(target.named_parameters(), source.named_parameters()):
            if not torch.equal(p, w):
                problems.append(f"{what}: {name} differs after the load ({tuple(p.shape)})")

    with torch.no_grad():
        for p in fused.parameters():  # something else than stock's, so that a key left unloaded shows
            p.add_(1.0)
    move(stock, fused, "stock -> commfuse")
    tokens, labels = _batch(vocab, 3)
    _step(fused, context, tokens, labels, vocab)
    placements = _placements(fused)
    with torch.no_grad():
        for name, p in fused.named_parameters():
            if placements[name].is_replicate():  # each rank's sequence shard gave a partial gradient
                dist.all_reduce(p.grad)
            p.add_(p.grad, alpha=-0.1)
    move(fused, stock, "commfuse -> stock")
    return problems


def one_rank(rank: int, n: int, fault: str) -> tuple:
    """A fault on rank 1 only: ``"causal"``, its attention built non-causal; ``"mask"``, its attention
    given a mask for another sequence length (FlexAttention core, forward). Every rank's (error type,
    message, seconds)."""
    torch.set_num_threads(1)
    prepare()
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.common.attention import get_causal_mask_mod

    _, fused, context, vocab = _models(n, core="flex" if fault == "mask" else "sdpa")
    tokens, labels = _batch(vocab, 11)
    positions = _positions(torch.Generator().manual_seed(5))
    masks = None
    if fault == "causal" and rank == 1:
        fused.layers["0"].attention.causal = False
    if fault == "mask":
        seq = SEQ * 2 if rank == 1 else SEQ
        masks = create_block_mask(get_causal_mask_mod(), BATCH, None, seq, seq, device="cpu")
    t0 = time.monotonic()
    try:
        with context(), torch.no_grad():
            fused(tokens, positions if masks is not None else None, masks)
    except Exception as e:  # noqa: BLE001 - reported by name
        return type(e).__name__, str(e), time.monotonic() - t0
    return "ok", "", time.monotonic() - t0
