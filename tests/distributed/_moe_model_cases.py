"""Rank-side bodies of test_moe_model_gloo.py (run inside ``commfuse.launch`` processes): MoE layers inside
whole models. A model of dense and MoE layers on a dp x ep mesh under commfuse.ep's FSDP2 and DDP recipes
against one process holding every parameter; transformers' Mixtral under torch's tensor-parallel plan with
sequence parallelism, its sparse blocks replaced by commfuse's layer; and the refusals, named on every rank."""

from __future__ import annotations

import torch
from torch import nn

from commfuse import ep
from commfuse.errors import CommfuseError
from commfuse.nn import MoE, moe_reference
from commfuse.nn._common import local

HIDDEN, FFN, INPUTS, OUTPUTS, EXPERTS = 8, 12, 6, 5, 4


# -- a model of dense and MoE layers -------------------------------------------------------------------------------


class ReferenceMoE(nn.Module):
    """Every expert in one process: ``moe_reference`` on parameters of its own."""

    def __init__(self, router: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> None:
        super().__init__()
        self.router, self.w13, self.w2 = (nn.Parameter(t.clone()) for t in (router, w13, w2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return moe_reference(x, self.router, self.w13, self.w2, 2)


class Block(nn.Module):
    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(HIDDEN)
        self.dense = nn.Linear(HIDDEN, HIDDEN)
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.dense(self.norm(x))
        return h + self.moe(h)


class Model(nn.Module):
    """An input projection, blocks of a dense layer (with a norm) and an MoE layer, a head."""

    def __init__(self, moes: list[nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Linear(INPUTS, HIDDEN)
        self.blocks = nn.ModuleList(Block(m) for m in moes)
        self.head = nn.Linear(HIDDEN, OUTPUTS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _experts(seed: int):
    """A whole MoE layer's (router, w13, w2), the same on every rank, every expert different."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(EXPERTS, HIDDEN, generator=g) / HIDDEN ** 0.5,
            torch.randn(EXPERTS, HIDDEN, 2 * FFN, generator=g) / HIDDEN ** 0.5,
            torch.randn(EXPERTS, FFN, HIDDEN, generator=g) / FFN ** 0.5)


def _tokens(ranks: int, step: int, rows: int = 6) -> list[torch.Tensor]:
    """Every rank's tokens at ``step`` (global rank q's are ``[q]``), the same list on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(rows, INPUTS, generator=g) for _ in range(ranks)]


def _loss(q: int, y: torch.Tensor) -> torch.Tensor:
    """Rank q's own loss of its output (a weighted sum over its tokens, divided by their count)."""
    return (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape) * (q + 1)).sum() / y.shape[0]


def _whole(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _differs(got: torch.Tensor, want: torch.Tensor, tol: float) -> str | None:
    """None when ``got`` equals ``want`` within ``tol`` of the latter's magnitude (and has its shape)."""
    if got.shape != want.shape:
        return f"shape {list(got.shape)} where {list(want.shape)} was expected"
    err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    scale = max(want.abs().max().item(), 1.0) if want.numel() else 1.0
    return None if err <= tol * scale else f"max diff {err:.3g} (tolerance {tol * scale:.3g})"


def _dp_by_ep_model(n: int):
    """The 2 x (n/2) (dp, ep) mesh; the reference (every expert in one process) and the model with commfuse's
    MoE layers on the ep axis, both from the same weights."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("dp", "ep"))
    weights = [_experts(3 + i) for i in range(2)]
    torch.manual_seed(0)
    reference = Model([ReferenceMoE(*w) for w in weights])
    model = Model([MoE(HIDDEN, FFN, EXPERTS, 2, group=mesh["ep"], algorithm="ring").load_experts(*w)
                   for w in weights])
    dense = {k: v for k, v in reference.state_dict().items() if ".moe." not in k}
    model.load_state_dict(dense, strict=False)
    return mesh, reference, model


def dp_by_ep(rank: int, n: int, wrapper: str, clip: float, steps: int = 3) -> list[str]:
    """A model of dense and MoE layers on a 2 x 2 (dp, ep) mesh, wrapped by ``commfuse.ep.fully_shard`` (each
    block, then the root) or ``commfuse.ep.ddp``, trained ``steps`` AdamW steps on each rank's own tokens, the
    gradients clipped to ``clip`` by ``commfuse.ep.clip_grad_norm_``; against one process that holds every
    parameter, trains on the mean of the ranks' losses and clips with torch's ``clip_grad_norm_``. Step 1
    accumulates two micro-batches, the first without synchronising (DDP's ``no_sync``, commfuse.fsdp's
    ``no_sync`` for FSDP2). Losses, the gradient norm, every gradient (the whole of each) after clipping and
    every parameter after the steps must equal the reference's."""
    from commfuse import fsdp

    problems: list[str] = []
    mesh, reference, model = _dp_by_ep_model(n)
    run = _wrapped(model, mesh, wrapper)
    no_sync = run.no_sync if wrapper == "ddp" else (lambda: fsdp.no_sync(model))
    names = [name for name, _ in model.named_parameters()]
    params = list(model.parameters())
    wanted = dict(reference.named_parameters())
    opt = torch.optim.AdamW(params, lr=1e-2)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(steps):
        micro = [_tokens(n, step)] if step != 1 else [_tokens(n, step), _tokens(n, 100 + step)]
        for i, xs in enumerate(micro):
            if i < len(micro) - 1:
                with no_sync():
                    loss = _loss(rank, run(xs[rank]))
                    loss.backward()
            else:
                loss = _loss(rank, run(xs[rank]))
                loss.backward()
            ref_losses = [_loss(q, reference(x)) for q, x in enumerate(xs)]
            (sum(ref_losses) / n).backward()
            if (err := _differs(loss.detach(), ref_losses[rank].detach(), 1e-5)) is not None:
                problems.append(f"step {step}, micro-batch {i}: loss {err}")
        norm = ep.clip_grad_norm_(params, clip)
        want_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        if want_norm <= clip:
            problems.append(f"step {step}: the norm {want_norm.item():.3g} is below {clip}: nothing was clipped")
        if type(norm) is not torch.Tensor or (err := _differs(norm, want_norm, 1e-5)) is not None:
            problems.append(f"step {step}: gradient norm {norm!r} where {want_norm.item():.6g} was expected")
        for name, p in zip(names, params):
            if (err := _differs(_whole(p.grad), wanted[name].grad, 2e-5)) is not None:
                problems.append(f"step {step}: {name}'s clipped gradient: {err}")
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    for name, p in zip(names, params):
        if (err := _differs(_whole(p.detach()), wanted[name].detach(), 2e-5)) is not None:
            problems.append(f"after {steps} AdamW steps: {name} {err}")
    return problems


def _wrapped(model: Model, mesh, wrapper: str) -> nn.Module:
    """``model`` under commfuse.ep's recipe: what to call (the DDP module, or the model FSDP2 sharded)."""
    if wrapper == "ddp":
        return ep.ddp(model, mesh)
    for block in model.blocks:
        ep.fully_shard(block, mesh)
    return ep.fully_shard(model, mesh)


def dcp_round_trip(rank: int, n: int, path: str) -> list[str]:
    """Under each recipe: a step, then model and AdamW state saved with torch.distributed.checkpoint and loaded
    into a fresh wrapped model (another init): every parameter (the whole of each) is back bit-exactly, and
    both compute the same output on the next tokens."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    problems: list[str] = []
    for wrapper in ("fully_shard", "ddp"):
        mesh, _, model = _dp_by_ep_model(n)
        run = _wrapped(model, mesh, wrapper)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _loss(rank, run(_tokens(n, 0)[rank])).backward()
        opt.step()
        saved = {name: _whole(p.detach()).clone() for name, p in model.named_parameters()}
        model_state, optim_state = get_state_dict(model, opt)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=f"{path}/{wrapper}")
        torch.manual_seed(12345)
        fresh = Model([MoE(HIDDEN, FFN, EXPERTS, 2, group=mesh["ep"], algorithm="ring") for _ in range(2)])
        fresh_run = _wrapped(fresh, mesh, wrapper)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        # a list, not a generator: making each whole is a collective that every rank makes, for every parameter
        if any([torch.equal(_whole(p.detach()), saved[name]) for name, p in fresh.named_parameters()]):
            problems.append(f"{wrapper}: the fresh model starts with some saved parameters: the test proves less")
        model_state, optim_state = get_state_dict(fresh, fresh_opt)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=f"{path}/{wrapper}")
        set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        for name, p in fresh.named_parameters():
            if not torch.equal(_whole(p.detach()), saved[name]):
                problems.append(f"{wrapper}: {name} is not what was saved")
        x = _tokens(n, 1)[rank]
        if not torch.equal(run(x), fresh_run(x)):
            problems.append(f"{wrapper}: the loaded model computes other outputs than the saved one")
    return problems


def torch_clip_on_dp_by_ep(rank: int, n: int, wrapper: str) -> str:
    """torch's own clip_grad_norm_ on the same model: what it says (it cannot stack the norms of several
    meshes, or of DTensors beside plain tensors)."""
    mesh, _, model = _dp_by_ep_model(n)
    run = _wrapped(model, mesh, wrapper)
    _loss(rank, run(_tokens(n, 0)[rank])).backward()
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    except Exception as e:  # noqa: BLE001 - torch's own refusal, reported
        return f"{type(e).__name__}: {e}"[:300]
    return "ran"


RECIPE_REFUSALS = ("group on dp", "shared loss", "no ep axis", "ddp given a process group",
                   "rank 3's layer differs", "rank 3 has one layer more")


def recipe_refusals(rank: int, n: int) -> dict[str, str]:
    """``commfuse.ep``'s refusals on a 2 x 2 (dp, ep) mesh, one after the other on the same ranks (each a
    fresh model): an MoE layer on the dp axis, one with loss='shared', a mesh without an ep axis, DDP given a
    process group, a rank (3) whose layer differs, a rank (3) with one layer more; what each rank raised."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("dp", "ep"))
    said = {}
    for what in RECIPE_REFUSALS:
        group, loss, ffn, layers = mesh["ep"], "per_rank", FFN, 2
        if what == "group on dp":
            group = mesh["dp"]
        if what == "shared loss":
            loss = "shared"
        if what == "rank 3's layer differs" and rank == 3:
            ffn = FFN + 4
        if what == "rank 3 has one layer more" and rank == 3:
            layers = 3
        torch.manual_seed(0)
        model = Model([MoE(HIDDEN, ffn, EXPERTS, 2, group=group, loss=loss) for _ in range(layers)])
        try:
            if what == "no ep axis":
                ep.fully_shard(model, init_device_mesh("cpu", (n,), mesh_dim_names=("dp",)))
            elif what == "ddp given a process group":
                ep.ddp(model, mesh, process_group=mesh["dp"].get_group())
            else:
                ep.fully_shard(model, mesh)
        except CommfuseError as e:
            said[what] = f"{type(e).__name__}: {e}"
        else:
            said[what] = "no error"
    return said


# -- transformers' Mixtral under tensor parallelism with sequence parallelism -------------------------------------


def mixtral_config():
    from transformers import MixtralConfig

    return MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                         max_position_embeddings=64, tie_word_embeddings=False, attn_implementation="eager")


def moe_from_sparse_block(block, normalize: bool = True, **kwargs) -> MoE:
    """commfuse's MoE with the weights of transformers' sparse MoE block (Mixtral's, Qwen3-MoE's): the router's
    ``gate.weight`` (experts, hidden), the experts' ``gate_up_proj`` (experts, 2 * ffn, hidden: the gate
    rows, then the up rows) and ``down_proj`` (experts, hidden, ffn), transposed into w13 and w2."""
    experts = block.experts
    moe = MoE(experts.hidden_dim, experts.intermediate_dim, experts.num_experts, block.gate.top_k,
              normalize=normalize, **kwargs)
    return moe.load_experts(block.gate.weight.detach(), experts.gate_up_proj.detach().transpose(1, 2),
                            experts.down_proj.detach().transpose(1, 2))


def _mixtral_tp(tp, how: str, loss: str):
    """Mixtral under torch's tensor-parallel plan with sequence parallelism over ``tp``, every sparse block
    replaced by commfuse's MoE on ``tp`` (``loss``), handed the post-attention norm's output as torch's
    SequenceParallel gives it (``how="dtensor"``: a DTensor placed Shard(1)) or its local tensor
    (``"local"``: PrepareModuleInputOutput around the layer)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                                   RowwiseParallel, SequenceParallel, parallelize_module)
    from transformers import MixtralForCausalLM

    torch.manual_seed(0)
    model = MixtralForCausalLM(mixtral_config())
    for layer in model.model.layers:
        layer.mlp = moe_from_sparse_block(layer.mlp, group=tp, loss=loss, algorithm="ring")
    parallelize_module(model, tp, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                              use_local_output=False),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for layer in model.model.layers:
        plan = {
            "input_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            "post_attention_layernorm": SequenceParallel(),
        }
        if how == "local":
            plan["mlp"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_input=True,
                output_layouts=(Shard(1),), desired_output_layouts=(Shard(1),), use_local_output=False)
        parallelize_module(layer, tp, plan)
    return model


def mixtral_sequence_parallel(rank: int, n: int, how: str, steps: int = 2) -> list[str]:
    """Mixtral at TP ``n`` with sequence parallelism, its sparse blocks commfuse's MoE on the TP ranks with
    loss='shared' (every rank computes the one loss of the whole batch): the loss, every gradient (the
    router's and the experts' of each layer too, against the sparse block's), the norm
    ``commfuse.ep.clip_grad_norm_`` clips to and the parameters after AdamW steps equal transformers' model in
    one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import MixtralForCausalLM

    problems: list[str] = []
    tp = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    model = _mixtral_tp(tp, how, "shared")
    torch.manual_seed(0)
    reference = MixtralForCausalLM(mixtral_config())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-2)

    def expert_part(name: str, moe: MoE, block, grads: bool) -> torch.Tensor:
        """The sparse block's tensor (or its gradient) that ``moe``'s parameter ``name`` holds on this rank."""
        pick = (lambda t: t.grad) if grads else (lambda t: t.detach())
        what = name.rsplit(".", 1)[1]
        if what == "router":
            return pick(block.gate.weight)
        whole = pick(block.experts.gate_up_proj if what == "w13" else block.experts.down_proj)
        return whole[slice(*moe.expert_range)].transpose(1, 2)

    def compare(step: int, grads: bool) -> None:
        ref_params = dict(reference.named_parameters())
        for name, p in model.named_parameters():
            if ".mlp." in name:
                i = int(name.split(".")[2])
                got = local(p.grad if grads else p.detach())
                want = expert_part(name, model.model.layers[i].mlp, reference.model.layers[i].mlp, grads)
            else:
                got = _whole(p.grad if grads else p.detach())
                want = ref_params[name].grad if grads else ref_params[name].detach()
            if (err := _differs(got, want, 1e-5)) is not None:
                problems.append(f"step {step}: {name}{' gradient' if grads else ''}: {err}")

    for step in range(steps):
        g = torch.Generator().manual_seed(5 + step)
        ids = torch.randint(0, 64, (2, 8), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        want = reference(input_ids=ids, labels=ids).loss
        loss.backward()
        want.backward()
        if (err := _differs(_whole(loss).detach(), want.detach(), 1e-5)) is not None:
            problems.append(f"step {step}: loss {err}")
        norm = ep.clip_grad_norm_(model.parameters(), 0.5)
        want_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        if want_norm <= 0.5:
            problems.append(f"step {step}: the norm {want_norm.item():.3g} is below 0.5: nothing was clipped")
        if (err := _differs(norm, want_norm, 1e-5)) is not None:
            problems.append(f"step {step}: gradient norm {err}")
        compare(step, grads=True)
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    compare(steps, grads=False)
    return problems


SHARDED_INPUT_REFUSALS = ("DTensor into a per_rank layer", "replicated DTensor", "DTensor sharded along its features",
                          "DTensor over other ranks", "convention differs on rank 1")


def sharded_input_refusals(rank: int, n: int) -> dict[str, str]:
    """DTensor inputs the layer cannot take, and ranks whose conventions differ, one after the other on the same
    ranks (a 1-D mesh over all of them; a 2 x n/2 (dp, ep) one for the DTensor over other ranks): what each rank
    raised, and, after a refusal, whether a plain call on the layer's group still ran (it raises if not)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    flat = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    two = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("dp", "ep"))
    said = {}
    for what in SHARDED_INPUT_REFUSALS:
        width = HIDDEN // n if what == "DTensor sharded along its features" else HIDDEN  # the whole: HIDDEN
        x = torch.randn(2, 4, width, generator=torch.Generator().manual_seed(rank))
        loss = {"DTensor into a per_rank layer": "per_rank",
                "convention differs on rank 1": "shared" if rank == 1 else "per_rank"}.get(what, "shared")
        group, mesh, placement = flat, flat, Shard(1)
        if what == "DTensor over other ranks":
            group, mesh = two["ep"], two["dp"]
        placement = {"replicated DTensor": Replicate(), "DTensor sharded along its features": Shard(2)}.get(
            what, Shard(1))
        moe = MoE(HIDDEN, FFN, 2 * group.size(), 2, group=group, loss=loss, algorithm="ring")
        if what != "convention differs on rank 1":
            x = DTensor.from_local(x, mesh, [placement], run_check=False)
        try:
            moe(x)
        except CommfuseError as e:
            said[what] = f"{type(e).__name__}: {e}"
        else:
            said[what] = "no error"
        if what == "convention differs on rank 1":
            continue  # (the last) a mismatch declares the group dead: no call runs on it afterwards
        y = MoE(HIDDEN, FFN, 2 * group.size(), 2, group=group, algorithm="ring")(torch.randn(3, HIDDEN))
        if y.shape != (3, HIDDEN):
            said[what] += f" (and the next call gave {list(y.shape)})"
    return said


def per_rank_gives_the_mean(rank: int, n: int) -> list[str]:
    """The one MoE layer, given the same tokens and the same per-rank losses twice: with loss='per_rank' its
    gradients are 1/n of those with loss='shared' (the mean of the ranks' losses against their sum), the
    output the same."""
    problems: list[str] = []
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(rank))
    grads, outs = {}, {}
    for loss in ("per_rank", "shared"):
        moe = MoE(HIDDEN, FFN, EXPERTS, 2, loss=loss, algorithm="ring").load_experts(*_experts(3))
        y = moe(x)
        (y * (rank + 1)).sum().backward()
        outs[loss], grads[loss] = y.detach(), [local(p.grad) for p in moe.parameters()]
    if not torch.equal(outs["per_rank"], outs["shared"]):
        problems.append("the output depends on loss=")
    for name, a, b in zip(("router", "w13", "w2"), grads["per_rank"], grads["shared"]):
        if (err := _differs(a * n, b, 1e-6)) is not None:
            problems.append(f"{name}: per_rank's gradient times {n} is not shared's: {err}")
    return problems


# -- Qwen3-MoE: dense and sparse decoder layers on a dp x ep mesh -------------------------------------------------


def qwen3_moe_config():
    from transformers import Qwen3MoeConfig

    # decoder_sparse_step=2: layer 0 has a dense MLP, layer 1 a sparse block
    return Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=24, moe_intermediate_size=12,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                          num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2, max_position_embeddings=64,
                          tie_word_embeddings=False, attn_implementation="eager")


def qwen3_moe_dp_by_ep(rank: int, n: int, wrapper: str, steps: int = 3) -> list[str]:
    """transformers' Qwen3-MoE (a dense decoder layer, then a sparse one) on a 2 x 2 (dp, ep) mesh, its sparse
    block replaced by commfuse's MoE on the ep axis, wrapped by commfuse.ep (FSDP2 per decoder layer and the
    root, or DDP), each rank on its own token ids: losses, clipped gradients' norm and the parameters after
    AdamW steps equal transformers' model in one process on the mean of the ranks' losses."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen3MoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    problems: list[str] = []
    mesh = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("dp", "ep"))
    torch.manual_seed(0)
    reference = Qwen3MoeForCausalLM(qwen3_moe_config())
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(qwen3_moe_config())
    sparse = [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, Qwen3MoeSparseMoeBlock)]
    if sparse != [1]:
        problems.append(f"the config gave sparse blocks in layers {sparse}, not in layer 1 only")
    for i in sparse:
        block = model.model.layers[i].mlp
        model.model.layers[i].mlp = moe_from_sparse_block(block, normalize=block.gate.norm_topk_prob,
                                                          group=mesh["ep"], algorithm="ring")
    if wrapper == "fully_shard":
        for layer in model.model.layers:
            ep.fully_shard(layer, mesh)
        ep.fully_shard(model, mesh)
        run = model
    else:
        run = ep.ddp(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(steps):
        g = torch.Generator().manual_seed(7 + step)
        ids = [torch.randint(0, 64, (1, 8), generator=g) for _ in range(n)]
        loss = run(input_ids=ids[rank], labels=ids[rank]).loss
        loss.backward()
        ref_losses = [reference(input_ids=t, labels=t).loss for t in ids]
        (sum(ref_losses) / n).backward()
        if (err := _differs(loss.detach(), ref_losses[rank].detach(), 1e-5)) is not None:
            problems.append(f"step {step}: loss {err}")
        norm = ep.clip_grad_norm_(model.parameters(), 0.5)
        want_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        if (err := _differs(norm, want_norm, 1e-5)) is not None:
            problems.append(f"step {step}: gradient norm {err}")
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        got = _whole(p.detach())
        if ".mlp." in name and name.split(".")[-1] in ("router", "w13", "w2"):
            block = reference.model.layers[int(name.split(".")[2])].mlp
            want = {"router": block.gate.weight, "w13": block.experts.gate_up_proj.transpose(1, 2),
                    "w2": block.experts.down_proj.transpose(1, 2)}[name.split(".")[-1]].detach()
        else:
            want = ref_params[name].detach()
        if (err := _differs(got, want, 2e-5)) is not None:
            problems.append(f"after {steps} AdamW steps: {name} {err}")
    return problems
