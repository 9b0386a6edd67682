"""Rank bodies: torchtitan 0.3's own Llama 3, its stock tensor-parallel plan against the same model built
with commfuse's modules through ``commfuse.integrations.torchtitan``, trained side by side.

Each rank builds both models from torchtitan's config classes (``llama3_configs["debugmodel"]``, two
layers, grouped-query attention with the fused ``wqkv`` every llama3 config uses), shards them with
torchtitan's own ``Module.parallelize`` on its ``ParallelDims`` mesh under ``spmd_types`` (plain local
tensors, sequence parallelism on), copies the stock model's weights into commfuse's through the state
dict, and runs five AdamW steps with gradient clipping on both, under torchtitan's mesh context and with
its vocab-parallel cross-entropy. What must match at every step: the loss, the clipped gradient norm,
every parameter's gradient; and every parameter at the end. commfuse's fused ops are counted, so a module
that silently ran the stock projection fails.

What the harness does itself, because torchtitan 0.3 leaves it to a torch this machine does not have
(its parallelize path hands plain parameters to ``fully_shard(dp_mesh_dims=...)``, which torch 2.13
refuses: "all parameters must be DTensors"), the same for both models:

* the TP reduction of the gradients of TP-replicated parameters (the norms' weights: each rank's
  sequence shard gives a partial sum), read from torchtitan's own sharding configs;
* FSDP2 over the data-parallel mesh (torch's ``fully_shard`` on the TP-local parameters);
* the gradient norm over both meshes, and the clipping.
"""

from __future__ import annotations

import copy
import functools
import types

import torch
import torch.distributed as dist

from _harness import prepare

STEPS = 5
BATCH, SEQ = 2, 32
MAX_NORM = 0.3


def _fail(results: dict, name: str, problems: list[str]) -> None:
    results[name] = "; ".join(problems[:6]) + (f" (and {len(problems) - 6} more)" if len(problems) > 6 else "")


class _Counted:
    """commfuse's fused ops, counted as the modules call them (the real ops run): commfuse.ops' two and the
    query-split attention (``commfuse.fused.attention.attention_reduce_scatter``)."""

    def __init__(self):
        import commfuse.ops as ops
        from commfuse.fused import attention

        self.where = {"all_gather_matmul": ops, "matmul_reduce_scatter": ops, "attention_reduce_scatter": attention}
        self.calls = dict.fromkeys(self.where, 0)
        self.real = {name: getattr(module, name) for name, module in self.where.items()}

    def __enter__(self):
        for name, real in self.real.items():
            def counted(*args, _name=name, _real=real, **kwargs):
                self.calls[_name] += 1
                return _real(*args, **kwargs)
            setattr(self.where[name], name, counted)
        return self

    def __exit__(self, *exc):
        for name, real in self.real.items():
            setattr(self.where[name], name, real)


_LINEAR_INIT = {"weight": functools.partial(torch.nn.init.trunc_normal_, std=0.02)}


def _config(separate_qkv: bool, core: str = "sdpa"):
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_gqa_config
    from torchtitan.models.llama3 import llama3_configs

    config = llama3_configs["debugmodel"](attn_backend="flex")
    config.layers = config.layers[:2]
    for layer in config.layers:
        stock = layer.attention
        # grouped-query attention (4 query heads per kv head), as in Llama 3's own sizes; SDPA as the core
        # (FlexAttention compiles with inductor's CPU compiler: one case, with packed documents' masks)
        inner = FlexAttention.Config() if core == "flex" else ScaledDotProductAttention.Config()
        layer.attention = make_gqa_config(dim=config.dim, n_heads=16, n_kv_heads=4, head_dim=None,
                                          wqkv_param_init=_LINEAR_INIT, wo_param_init=stock.wo.param_init,
                                          inner_attention=inner,
                                          fuse_qkv=not separate_qkv, rope=stock.rope)
    return config


def _build(config, parallel_dims, parallelism):
    config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    with torch.device("meta"):
        model = config.build()
    model.parallelize(parallel_dims)
    model.to_empty(device="cpu")
    return model


def _placements(model) -> dict:
    """Each parameter's and buffer's placement on the TP mesh (``Shard(dim)`` or ``Replicate()``), by its
    state-dict name, read from torchtitan's sharding configs (the fused ``wqkv``'s also under the ``wq``, ``wk``
    and ``wv`` it saves as)."""
    import spmd_types as spmd
    from torch.distributed.tensor import Replicate, Shard
    from torchtitan.distributed.parallel_dims import MeshAxisName

    placements = {}
    for prefix, module in model.named_modules():
        config = getattr(module, "_sharding_config", None)
        for param, layout in ({} if config is None else config.state_shardings).items():
            if getattr(module, param, None) is None:
                continue
            kind = layout.per_axis_spmd_types().get(MeshAxisName.TP)
            name = f"{prefix}.{param}" if prefix else param
            if isinstance(kind, spmd.types.Shard):
                placement = Shard(kind.dim)
            elif kind is spmd.R:
                placement = Replicate()
            else:
                raise AssertionError(f"{name}: TP layout {kind!r} is neither Shard nor Replicate")
            placements[name] = placement
            if name.endswith(".wqkv.weight"):  # the fused wqkv saves as this rank's rows of wq, wk and wv
                for part in ("wq", "wk", "wv"):
                    placements[name.replace(".wqkv.", f".{part}.")] = placement
    return placements


def _tp_replicated(model) -> set[str]:
    """FQNs of what torchtitan's sharding configs place Replicate on the TP axis."""
    return {name for name, placement in _placements(model).items() if placement.is_replicate()}


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _step_grads(model, tp_group, replicated: set[str]):
    """After backward: sum the TP-replicated parameters' partial gradients over TP, and return the squared
    gradient norm of this rank's part of the model (sharded parameters once per TP rank, replicated ones
    once in all)."""
    sharded_sq = torch.zeros((), dtype=torch.float64)
    replicated_sq = torch.zeros((), dtype=torch.float64)
    for name, p in model.named_parameters():
        g = _local(p.grad)
        if name in replicated:
            dist.all_reduce(g, group=tp_group)
            replicated_sq += g.double().pow(2).sum()
        else:
            sharded_sq += g.double().pow(2).sum()
    dist.all_reduce(sharded_sq, group=tp_group)
    return sharded_sq + replicated_sq


def _clip(model, sq: torch.Tensor, dp_group) -> float:
    if dp_group is not None:  # FSDP's gradient shards are disjoint over the data-parallel ranks
        dist.all_reduce(sq, group=dp_group)
    norm = float(sq.sqrt())
    coef = min(1.0, MAX_NORM / (norm + 1e-6))
    for p in model.parameters():
        _local(p.grad).mul_(coef)
    return norm


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: _local(p.grad).detach().clone() for name, p in model.named_parameters()}


def _compare(what: str, got: dict, want: dict, problems: list[str], rtol=1e-4, atol=1e-5) -> None:
    if got.keys() != want.keys():
        problems.append(f"{what}: names differ: {sorted(got.keys() ^ want.keys())[:4]}")
        return
    for name, w in want.items():
        g = got[name]
        if g.shape != w.shape or not torch.allclose(g, w, rtol=rtol, atol=atol):
            err = (g - w).abs().max().item() if g.shape == w.shape else f"shape {tuple(g.shape)} vs {tuple(w.shape)}"
            problems.append(f"{what} {name}: max |diff| {err}")


def _positions(g: torch.Generator) -> torch.Tensor:
    """(BATCH, SEQ) positions of packed documents, restarting at 0 where a document starts (torchtitan's
    decoder builds its causal same-document masks from these): each row cut at two random places."""
    rows = []
    for _ in range(BATCH):
        cuts = sorted(torch.randperm(SEQ - 2, generator=g)[:2].add(1).tolist())
        rows.append(torch.cat([torch.arange(b - a) for a, b in zip([0, *cuts], [*cuts, SEQ])]))
    return torch.stack(rows)


def _checkpointing(ac: str):
    """torchtitan's own activation checkpointing: ``full`` (``FullAC``: every block recomputed whole),
    ``selective`` (``SelectiveAC``: its per-op policy with its default save list, which names none of commfuse's
    ops, so each fused op is recomputed), ``selective+commfuse`` (the same with commfuse's
    ``library.CHECKPOINT_SAVE`` added to the save list, as a user subclasses ``SelectiveAC`` to tune it)."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    import commfuse.library

    if ac == "full":
        return FullAC(FullAC.Config())
    if ac == "selective":
        return SelectiveAC(SelectiveAC.Config())
    if ac == "selective+commfuse":
        class WithCommfuse(SelectiveAC):
            def get_save_ops(self) -> set:
                return super().get_save_ops() | set(commfuse.library.CHECKPOINT_SAVE)

        return WithCommfuse(SelectiveAC.Config())
    raise ValueError(f"ac={ac!r}")


def training(rank: int, n: int, dp: int, separate_qkv: bool, algorithm: str, query_split: bool = True,
             core: str = "sdpa", ac: str = "none") -> dict:
    torch.set_num_threads(1)
    prepare()
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    from commfuse.integrations import torchtitan as cf_titan

    results: dict = {}
    name = (f"{'dp%dx' % dp if dp > 1 else ''}tp{n // dp}-{'separate' if separate_qkv else 'fused'}-{algorithm}"
            f"{'' if query_split else '-projections only'}-{core}{'' if ac == 'none' else '-ac ' + ac}")
    problems: list[str] = []
    tp = n // dp
    parallelism = ParallelismConfig(tensor_parallel_degree=tp, data_parallel_shard_degree=dp,
                                    enable_sequence_parallel=True, spmd_backend="spmd_types")
    parallel_dims = ParallelDims(dp_replicate=1, dp_shard=dp, cp=1, tp=tp, pp=1, ep=1, world_size=n,
                                 spmd_backend="spmd_types")
    stock_config = _config(separate_qkv, core)
    fused_config = copy.deepcopy(stock_config)
    swapped = cf_titan.use_commfuse(fused_config, algorithm=algorithm, query_split=query_split)
    fused_modules = ("attention.qkv_linear", "attention.wo", "feed_forward") + (("attention",) if query_split else ())
    want_swapped = [f"layers.{i}.{m}" for i in range(2) for m in fused_modules]
    if sorted(swapped) != sorted(want_swapped):
        problems.append(f"use_commfuse swapped {swapped}, expected {want_swapped}")
    stock = _build(stock_config, parallel_dims, parallelism)
    fused = _build(fused_config, parallel_dims, parallelism)
    context = dist_utils.get_spmd_context(parallel_dims=parallel_dims)
    torch.manual_seed(0)
    with torch.no_grad(), context():  # the fused wqkv's initialisation reads the TP mesh from the context
        stock.init_weights(buffer_device=torch.device("cpu"))
        fused.init_weights(buffer_device=torch.device("cpu"))  # buffers (RoPE's cache); weights come next
    missing = fused.load_state_dict(stock.state_dict(), strict=True)
    if missing.missing_keys or missing.unexpected_keys:
        problems.append(f"state dict keys differ: {missing}")
    modules = [type(m).__name__ for m in fused.modules() if isinstance(m, cf_titan._Fused)]
    if len(modules) != len(want_swapped):
        problems.append(f"commfuse modules in the built model: {modules}")
    if any(isinstance(m, cf_titan._Fused) for m in stock.modules()):
        problems.append("the stock model holds commfuse modules")

    if ac != "none":  # torchtitan's order: tensor parallelism, then activation checkpointing, then FSDP
        policy = _checkpointing(ac)
        for model in (stock, fused):
            policy.apply(model)
    tp_group = parallel_dims.get_mesh("tp").get_group()
    dp_group = None
    if dp > 1:
        dp_mesh = parallel_dims.get_mesh("dp_shard")
        dp_group = dp_mesh.get_group()
        for model in (stock, fused):
            for block in model.layers.values():
                fully_shard(block, mesh=dp_mesh)
            fully_shard(model, mesh=dp_mesh)
    replicated = _tp_replicated(stock)
    if replicated != _tp_replicated(fused) or not replicated:
        problems.append(f"TP-replicated parameters differ or none: {sorted(replicated)[:4]}")
    optimizers = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1) for m in (stock, fused)}
    vocab = stock_config.vocab_size
    dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
    clipped = 0
    with _Counted() as counted:
        for step in range(STEPS):
            g = torch.Generator().manual_seed(100 * step + dp_rank)
            tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
            labels = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
            positions = _positions(g) if core == "flex" else None
            seen = {}
            if core == "flex":  # torch 2.13's FlexAttention has no backward on CPU: the two forwards, compared
                for label, model in (("stock", stock), ("commfuse", fused)):
                    with context(), torch.no_grad():
                        pred = model(tokens, positions, model.get_attention_masks(positions))
                        seen[label] = cross_entropy_loss(pred, labels, global_vocab_size=vocab).item()
                if abs(seen["stock"] - seen["commfuse"]) > 1e-5 * max(1.0, abs(seen["stock"])):
                    problems.append(f"batch {step}: loss {seen['commfuse']} vs stock {seen['stock']}")
                clipped += 1
                continue
            for label, model in (("stock", stock), ("commfuse", fused)):
                with context():
                    masks = None if positions is None else model.get_attention_masks(positions)
                    pred = model(tokens, positions, masks)
                    loss = cross_entropy_loss(pred, labels, global_vocab_size=vocab) / (BATCH * SEQ * dp)
                    loss.backward()
                loss = loss.detach()
                if dp_group is not None:
                    dist.all_reduce(loss, group=dp_group)
                sq = _step_grads(model, tp_group, replicated)
                grads = _grads(model)
                norm = _clip(model, sq, dp_group)
                optimizers[id(model)].step()
                optimizers[id(model)].zero_grad()
                seen[label] = (loss.item(), norm, grads)
            (l0, n0, g0), (l1, n1, g1) = seen["stock"], seen["commfuse"]
            if abs(l0 - l1) > 1e-5 * max(1.0, abs(l0)):
                problems.append(f"step {step}: loss {l1} vs stock {l0}")
            if abs(n0 - n1) > 1e-4 * max(1.0, n0):
                problems.append(f"step {step}: gradient norm {n1} vs stock {n0}")
            clipped += n0 > MAX_NORM
            _compare(f"step {step} gradient of", g1, g0, problems)
    _compare("final", {k: _local(v).detach() for k, v in fused.state_dict().items()},
             {k: _local(v).detach() for k, v in stock.state_dict().items()}, problems, atol=2e-5)
    # each block: the Q/K/V gather and the w1/w3 gather; w2's scatter, and wo's (the query-split attention's ring
    # with query_split, else matmul_reduce_scatter)
    # under checkpointing each block's forward runs again in the backward, and with it each module's call of a
    # fused op (a saved op's result is then taken from the forward, not computed again)
    per_step = len(stock_config.layers) * STEPS * (1 if ac == "none" else 2)
    want_calls = {"all_gather_matmul": 2 * per_step, "matmul_reduce_scatter": (1 if query_split else 2) * per_step,
                  "attention_reduce_scatter": per_step if query_split else 0}
    if counted.calls != want_calls:
        problems.append(f"fused op calls {counted.calls}, expected {want_calls} (a silent fallback to the stock "
                        "projection?)")
    if not clipped:
        problems.append(f"no step clipped (max_norm {MAX_NORM}): the clipping path went untested")
    if problems:
        _fail(results, name, problems)
    else:
        results[name] = None
    return results
