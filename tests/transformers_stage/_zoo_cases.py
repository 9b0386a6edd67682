"""Rank-side bodies of the transformers stage: whole HuggingFace decoder models, built from small configs
(random weights, no hub) in float64, trained for two AdamW steps under a tensor-parallel plan with sequence
parallelism and compared, loss and every gradient, with the same model in one process.

Each model is run four ways on the TP ranks:

- ``torch``: torch's styles as one writes them for a Llama-style decoder (``plan``: the embedding's output and
  the residual stream sharded on the sequence, ``SequenceParallel`` norms, ``PrepareModuleInput`` gathering
  the attention's and the MLP's input, column-parallel q/k/v and gate/up, row-parallel o_proj and down_proj
  reduce-scattering, the head gathering its logits);
- ``per-linear``: that plan with commfuse's ``ColwiseParallel`` / ``RowwiseParallel`` in place of torch's;
- ``per-linear, gather fused``: commfuse's per-linear styles given the sequence-sharded input itself
  (``input_layouts=Shard(1)``, no ``PrepareModuleInput``), so that each column-parallel GEMM runs with its
  all-gather;
- ``block``: ``AttentionParallel()`` on each self-attention module and ``SwiGLUParallel()`` on each MLP
  (commfuse's ``MoE(loss="shared")`` in place of a sparse MoE block).

A family's plan is keyed by its modules' names (``Family``): its norms, where its per-head QK-norm sees the
heads, whether its projections are stacked. What commfuse refuses is refused when the plan is applied, before
any value is computed, and its message must name the module's path and the words expected of it
(``Family.refused``); the run then goes on with what the message says to use instead (commfuse's per-linear
styles on that module), and that must match.
"""

from __future__ import annotations

import dataclasses
import traceback

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from commfuse import tp
from commfuse.errors import CommfuseValueError

BATCH, SEQ, VOCAB = 2, 16, 64
RUNS = ("torch", "per-linear", "per-linear, gather fused", "block")


@dataclasses.dataclass(frozen=True)
class Family:
    """How one transformers decoder family is built small and parallelized.

    ``config``: the config's keywords beyond the common small ones. ``attention``: its attention function.
    ``norms``: the decoder layer's norm modules (all ``SequenceParallel``). ``qk_norm``: None, ``("heads",
    dim)`` for a norm over one head's features that sees the heads on ``dim`` (``SequenceParallel(sequence_dim
    =dim)`` makes its gradient the sum over the ranks' heads), or ``"all"`` for a norm over all heads' features
    (OLMo 2: gathered around it); ``qk_names`` their names. ``qkv``: the attention's projections, ``("q_proj",
    "k_proj", "v_proj")`` or one stacked ``("qkv_proj",)`` (Phi-3: no rank's rows of it are its heads' q, k and
    v, so the per-linear plan gathers its output whole, as commfuse's refusal of a sharded one says). ``mlp``:
    the MLP's (gate, up, down) projections; gate and up in one stacked projection where ``stacked_mlp`` (up is
    then None), or a plain MLP ``(fc, None, proj)``. ``block_attention``, ``block_mlp``: the arguments
    ``AttentionParallel`` and ``SwiGLUParallel`` are given. ``moe``: the sparse blocks' class name.
    ``refused``: what commfuse refuses, ``{(run, module path): words}``: the message names the path and every
    one of the words. ``tolerance``: the largest relative difference allowed (float64, the same sums in
    another order; families that compute parts in float32 whatever the parameters' dtype are allowed
    float32's).
    """

    model_type: str
    config: dict = dataclasses.field(default_factory=dict)
    attention: str = "sdpa"
    norms: tuple = ("input_layernorm", "post_attention_layernorm")
    qk_norm: object = None
    qk_names: tuple = ("q_norm", "k_norm")
    qkv: tuple = ("q_proj", "k_proj", "v_proj")
    mlp: tuple = ("gate_proj", "up_proj", "down_proj")
    stacked_mlp: bool = False
    block_attention: dict = dataclasses.field(default_factory=dict)
    block_mlp: dict = dataclasses.field(default_factory=dict)
    moe: str | None = None
    refused: dict = dataclasses.field(default_factory=dict)
    tolerance: float = 1e-10


GEMMA_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
               "post_feedforward_layernorm")
#: Gemma's and Cohere's norms compute in float32 whatever the parameters' dtype, as does transformers' eager
#: softmax (Gemma 2's attention), in the model in one process too
FLOAT32_INSIDE = 1e-4


def _attention_refused(layers, *words) -> dict:
    return {("block", f"model.layers.{i}.self_attn"): words for i in layers}


FAMILIES = {
    "llama": Family("llama"),
    "mistral": Family("mistral", dict(sliding_window=6)),  # a window shorter than the sequence
    "qwen2": Family("qwen2", dict(attention_bias=True)),  # q/k/v biases
    "qwen3": Family("qwen3", qk_norm=("heads", 2)),  # QK-norm on (batch, seq, heads, head_dim)
    # soft-capped scores and logits, the scale from query_pre_attn_scalar, a sliding and a full layer,
    # GELU-tanh, four norms a layer, tied embeddings, the embedding scaled
    "gemma2": Family("gemma2", dict(sliding_window=6, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                                    query_pre_attn_scalar=6, tie_word_embeddings=True), attention="eager",
                     norms=GEMMA_NORMS, tolerance=FLOAT32_INSIDE),
    "gemma3": Family("gemma3_text", dict(sliding_window=6, query_pre_attn_scalar=6, tie_word_embeddings=True,
                                         layer_types=["sliding_attention", "full_attention"]),
                     norms=GEMMA_NORMS, qk_norm=("heads", 1),  # QK-norm on (batch, heads, seq, head_dim)
                     tolerance=FLOAT32_INSIDE),
    "phi3": Family("phi3", qkv=("qkv_proj",), mlp=("gate_up_proj", None, "down_proj"), stacked_mlp=True),
    # a norm over all heads' features, and post-norms only
    "olmo2": Family("olmo2", norms=("post_attention_layernorm", "post_feedforward_layernorm"), qk_norm="all",
                    refused=_attention_refused((0, 1), "(Olmo2Attention)", "query norm 'q_norm'")),
    # a dense decoder layer, then a sparse one; QK-norm as Qwen3's
    "qwen3_moe": Family("qwen3_moe", dict(moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                                          decoder_sparse_step=2), qk_norm=("heads", 2),
                        moe="Qwen3MoeSparseMoeBlock"),
    "mixtral": Family("mixtral", dict(num_local_experts=4, num_experts_per_tok=2), moe="MixtralSparseMoeBlock"),
    # multipliers on the embedding, the residual branches, the attention's scale and the logits
    "granite": Family("granite", dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2,
                                      logits_scaling=4.0)),
    # one norm feeding the attention and the MLP side by side, interleaved rotary halves, logits scaled; its
    # LayerNorm computes in float32
    "cohere": Family("cohere", dict(logit_scale=0.5), norms=("input_layernorm",), tolerance=FLOAT32_INSIDE),
    # LayerNorms with biases, biases on every projection, a plain GELU-tanh MLP (c_fc, c_proj)
    "starcoder2": Family("starcoder2", dict(use_bias=True), mlp=("c_fc", None, "c_proj"),
                         block_mlp=dict(w1="c_fc", w2="c_proj", gated=False)),
    # layer 1 without rotary embeddings (NoPE): the style's check runs the module's own forward and refuses it
    "smollm3": Family("smollm3", dict(no_rope_layer_interval=2),
                      refused=_attention_refused((1,), "(SmolLM3Attention)'s own forward differs")),
    # q/k/v biases, half of each head rotated (interleaved), gate and up stacked, four norms a layer
    "glm4": Family("glm4", dict(attention_bias=True, partial_rotary_factor=0.5),
                   norms=("input_layernorm", "post_attention_layernorm", "post_self_attn_layernorm",
                          "post_mlp_layernorm"), mlp=("gate_up_proj", None, "down_proj"), stacked_mlp=True),
    # a per-head QK-norm after the rotary embedding, named as the style's refusal of its unknown parts says: its
    # check runs the module's own forward and refuses it
    "hunyuan": Family("hunyuan_v1_dense", qk_norm=("heads", 1), qk_names=("query_layernorm", "key_layernorm"),
                      block_attention=dict(q_norm="query_layernorm", k_norm="key_layernorm"),
                      refused=_attention_refused((0, 1), "(HunYuanDenseV1Attention)'s own forward differs")),
    "exaone4": Family("exaone4", dict(sliding_window=6, sliding_window_pattern=2,
                                      layer_types=["sliding_attention", "full_attention"]),
                      norms=("post_attention_layernorm", "post_feedforward_layernorm"), qk_norm=("heads", 1),
                      # the full-attention layer has no rotary embedding (NoPE): refused as SmolLM3's
                      refused=_attention_refused((1,), "(Exaone4Attention)'s own forward differs")),
}


def config_of(name: str):
    import transformers

    family = FAMILIES[name]
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=4, head_dim=8, max_position_embeddings=2 * SEQ,
                attention_dropout=0.0, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config = transformers.CONFIG_MAPPING[family.model_type](**{**base, **family.config})
    config._attn_implementation = family.attention
    config._experts_implementation = "eager"  # a loop over the experts: torch's grouped_mm takes no float64
    return config


def model_of(name: str):
    import transformers

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config_of(name)).double()


# -- the plans ------------------------------------------------------------------------------------------------


def _torch_styles():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return ColwiseParallel, RowwiseParallel


def _commfuse_styles():
    return (lambda **kw: tp.ColwiseParallel(algorithm="ring", **kw),
            lambda **kw: tp.RowwiseParallel(algorithm="ring", **kw))


def _is_sparse(family: Family, module) -> bool:
    return family.moe is not None and type(module).__name__ == family.moe


def _attention_plan(family: Family, col, row, gather_fused: bool, prefix: str) -> dict:
    """The per-linear entries of one self-attention module (``prefix`` its path)."""
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleInputOutput, SequenceParallel

    seq = dict(input_layouts=Shard(1)) if gather_fused else {}
    plan = {}
    if not gather_fused:
        plan[prefix] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                          desired_input_kwarg_layouts={"hidden_states": Replicate()})
    if len(family.qkv) == 1:
        # the stacked projection computed whole on every rank, o_proj's input taken as every rank's rows
        plan[f"{prefix}.{family.qkv[0]}"] = col(output_layouts=Replicate(), **seq)
        plan[f"{prefix}.o_proj"] = row(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)
        return plan
    q, k, v = family.qkv
    if family.qk_norm == "all":
        # a norm over all heads' features: q and k handed on sharded on their features, gathered around the norm
        for which, norm in zip((q, k), family.qk_names):
            plan[f"{prefix}.{which}"] = col(use_local_output=False, **seq)
            plan[f"{prefix}.{norm}"] = PrepareModuleInputOutput(
                input_layouts=(Shard(2),), desired_input_layouts=(Replicate(),), use_local_input=True,
                output_layouts=(Replicate(),), desired_output_layouts=(Shard(2),), use_local_output=True)
        plan[f"{prefix}.{v}"] = col(**seq)
    else:
        for which in (q, k, v):
            plan[f"{prefix}.{which}"] = col(**seq)
        if family.qk_norm is not None:
            _, dim = family.qk_norm
            for norm in family.qk_names:
                plan[f"{prefix}.{norm}"] = SequenceParallel(sequence_dim=dim, use_local_output=True)
    plan[f"{prefix}.o_proj"] = row(output_layouts=Shard(1), use_local_output=False)
    return plan


def _mlp_plan(family: Family, module, col, row, gather_fused: bool, prefix: str) -> dict:
    """The entries of one MLP: per-linear for a dense one; a sparse block left whole on every rank, its input
    gathered and its output handed back sharded (its experts' gradients are then whole on every rank)."""
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleInputOutput

    if _is_sparse(family, module):
        return {prefix: PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=False)}
    seq = dict(input_layouts=Shard(1)) if gather_fused else {}
    plan = {} if gather_fused else {prefix: PrepareModuleInput(input_layouts=(Shard(1),),
                                                               desired_input_layouts=(Replicate(),))}
    gate, up, down = family.mlp
    if family.stacked_mlp:
        plan[f"{prefix}.{gate}"] = col(output_layouts=Replicate(), **seq)
        plan[f"{prefix}.{down}"] = row(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)
        return plan
    for which in (gate, up):
        if which is not None:
            plan[f"{prefix}.{which}"] = col(**seq)
    plan[f"{prefix}.{down}"] = row(output_layouts=Shard(1), use_local_output=False)
    return plan


def plan(model, name: str, run: str, fall_back: frozenset = frozenset()) -> dict:
    """The whole model's plan for ``run`` (one of :data:`RUNS`), by module path. ``fall_back``: the paths of
    the modules the block run gives commfuse's per-linear styles instead of a block style, as a refusal of
    the block style says to."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    family = FAMILIES[name]
    col, row = _torch_styles() if run == "torch" else _commfuse_styles()
    gather_fused = run in ("per-linear, gather fused", "block")
    whole = {
        # the embedding: torch's style in every run (commfuse has no embedding style)
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1),
                                              use_local_output=False),
        "model.norm": SequenceParallel(),
        "lm_head": col(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}"
        for norm in family.norms:
            whole[f"{prefix}.{norm}"] = SequenceParallel()
        attention, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
        if run == "block" and attention not in fall_back:
            whole[attention] = tp.AttentionParallel(algorithm="ring", use_local_output=False,
                                                      **family.block_attention)
        else:
            whole.update(_attention_plan(family, col, row, gather_fused, attention))
        if run == "block" and _is_sparse(family, layer.mlp):
            continue  # replaced by commfuse's MoE (moe_layers)
        if run == "block" and mlp not in fall_back:
            whole[mlp] = tp.SwiGLUParallel(algorithm="ring", use_local_output=False, **family.block_mlp)
        else:
            whole.update(_mlp_plan(family, layer.mlp, col, row, gather_fused, mlp))
    return whole


def moe_layers(model, name: str, mesh) -> None:
    """Every sparse MoE block of ``model`` replaced by commfuse's MoE with its weights, on the TP ranks, every
    rank holding a shard of the one batch (``loss="shared"``)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))
    from _moe_model_cases import moe_from_sparse_block

    family = FAMILIES[name]
    for layer in model.model.layers:
        if _is_sparse(family, layer.mlp):
            block = layer.mlp
            layer.mlp = moe_from_sparse_block(block, normalize=getattr(block.gate, "norm_topk_prob", True),
                                              group=mesh, loss="shared", algorithm="ring").double()


def parallelized(name: str, run: str, mesh, fall_back: frozenset = frozenset()):
    """A fresh model of the family, parallelized for ``run``; tied embeddings tied again (each style gave its
    module a parameter of its own, both placed ``Shard(0)``)."""
    from torch.distributed.tensor.parallel import parallelize_module

    model = model_of(name)
    whole = plan(model, name, run, fall_back)
    if run == "block":
        moe_layers(model, name, mesh)
    parallelize_module(model, mesh, whole)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


# -- the comparison -------------------------------------------------------------------------------------------


def _whole(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _relative(got: torch.Tensor, want: torch.Tensor, what: str) -> tuple[float, str]:
    """The largest difference of ``got`` from ``want`` over the largest magnitude of ``want``, with ``what``."""
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {list(got.shape)}, the model's {list(want.shape)}")
    scale = want.detach().double().abs().max().item()
    diff = (got.detach().double() - want.detach().double()).abs().max().item()
    return diff / max(scale, 1e-30), what


def _counterparts(model, reference, name: str) -> dict:
    """Each parameter of ``model`` by name -> (the reference's parameter it stands for, a function giving that
    parameter's tensor (or gradient) as ``model``'s whole parameter holds it: itself, or, for commfuse's MoE
    in place of a sparse block, the block's router or its experts' weights transposed)."""
    ref = dict(reference.named_parameters())
    out = {}
    for key, _ in model.named_parameters():
        path, part = key.rsplit(".", 1)
        if part in ("router", "w13", "w2") and f"{path}.gate.weight" in ref:
            source = {"router": f"{path}.gate.weight", "w13": f"{path}.experts.gate_up_proj",
                      "w2": f"{path}.experts.down_proj"}[part]
            out[key] = (ref[source], (lambda t: t) if part == "router" else (lambda t: t.transpose(1, 2)))
        else:
            out[key] = (ref[key], lambda t: t)
    return out


def train_and_compare(model, reference, name: str, steps: int = 2) -> tuple[float, str]:
    """Two AdamW steps of ``model`` and the one-process ``reference`` on the same batches: the largest
    relative difference of the loss, every gradient (each step) and every parameter (after the last), and
    what it is of."""
    pairs = _counterparts(model, reference, name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    worst = (0.0, "nothing")
    for step in range(steps):
        ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(100 + step))
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        want = reference(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        want.backward()
        worst = max(worst, _relative(_whole(loss), want, f"step {step}: loss"))
        for key, p in model.named_parameters():
            source, view = pairs[key]
            if p.grad is None:
                raise AssertionError(f"step {step}: {key} has no gradient")
            worst = max(worst, _relative(_whole(p.grad), view(source.grad), f"step {step}: {key} gradient"))
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    return worst


def fused(model) -> tuple[list[str], list[str]]:
    """What ``commfuse.explain`` says of the model's commfuse sites after its forwards: the paths of those that
    ran a fused op, and of those that ran none (a column-parallel linear given a replicated input has nothing
    to fuse)."""
    import commfuse

    report = commfuse.explain(model)
    return [s.path for s in report if s.taken], [s.path for s in report if not s.taken]


def _refused_path(name: str, run: str, refusal: CommfuseValueError, so_far: frozenset) -> str:
    """The module path a refusal in ``run`` is of, checked against the family's expected refusals: the message
    names the path and every expected word; an unexpected refusal is raised again."""
    for (want_run, path), words in FAMILIES[name].refused.items():
        if want_run == run and path not in so_far and f"'{path}'" in str(refusal):
            missing = [w for w in words if w not in str(refusal)]
            if missing:
                raise AssertionError(f"the refusal of {path} does not say {missing}: {refusal}") from refusal
            return path
    raise refusal


def compare(rank: int, n: int, name: str) -> dict:
    """Every run of the family on ``n`` TP ranks against the model in one process: per run, ``(worst relative
    difference and what it is of, or None; the refusals as (path, message); the error, or None; :func:`fused`
    after the run)``. A refusal
    is expected (``Family.refused``) and comes when the plan is applied; the run is then applied again with
    commfuse's per-linear styles on that module, as the refusal says, and compared."""
    from torch.distributed.device_mesh import init_device_mesh

    family = FAMILIES[name]
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    results = {}
    for run in RUNS:
        refusals, fall_back = [], frozenset()
        try:
            while True:
                try:
                    model = parallelized(name, run, mesh, fall_back)
                    break
                except CommfuseValueError as refusal:
                    path = _refused_path(name, run, refusal, fall_back)
                    refusals.append((path, str(refusal)))
                    fall_back |= {path}
            expected = {path for (r, path) in family.refused if r == run}
            if expected != fall_back:
                raise AssertionError(f"expected refusals of {sorted(expected)}, got {sorted(fall_back)}")
            worst, what = train_and_compare(model, model_of(name), name)
            if worst > family.tolerance:
                raise AssertionError(f"{what}: a relative difference of {worst:.3g}, above {family.tolerance}")
            results[run] = ((worst, what), refusals, None, fused(model))
        except Exception as e:  # noqa: BLE001 - handed to the pytest side, with its traceback
            results[run] = (None, refusals, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=12)}", None)
    return results


def zoo(rank: int, n: int, names: tuple) -> dict:
    """:func:`compare` for each family in ``names``, in one launch (transformers and its modeling files are
    imported once per rank), with the seconds each took."""
    import time

    out = {}
    for name in names:
        start = time.perf_counter()
        out[name] = (compare(rank, n, name), time.perf_counter() - start)
    return out
