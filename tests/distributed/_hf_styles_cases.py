"""Rank-side bodies of the block styles on HuggingFace transformers modules: small models built from configs
(random weights, no hub), their attention and MLP modules parallelized with commfuse.tp's block styles and
called as the model calls them, against the unsharded modules; and the refusals, by name, of what the styles do
not compute."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from commfuse import tp
from commfuse.errors import CommfuseError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tp_cases import _run, expect  # noqa: E402  (the shared checks of the DTensor tests)

TOL = dict(rtol=1e-4, atol=1e-5)  # fp32, summed in another order
BATCH, SEQ = 2, 12  # the sequence divides over 2 and 3 ranks and is longer than the sliding windows (4)

#: per family: the config's keywords (small: 12 query heads of 8 over 6 key/value heads, unless said), the
#: attention function, the modules the styles take (Mixtral's MLP is a mixture of experts), and the attention
#: style's arguments (none: read from the module)
FAMILIES = {
    "llama": (dict(), "sdpa", ("self_attn", "mlp"), {}),
    "llama-eager": (dict(), "eager", ("self_attn", "mlp"), {}),
    "mistral": (dict(sliding_window=4), "sdpa", ("self_attn", "mlp"), {}),
    "mixtral": (dict(num_local_experts=2, num_experts_per_tok=1), "sdpa", ("self_attn",), {}),
    "qwen2": (dict(), "sdpa", ("self_attn", "mlp"), {}),  # q/k/v biases
    "qwen3": (dict(), "sdpa", ("self_attn", "mlp"), {}),  # QK-norm
    # soft-capped logits, the scale from query_pre_attn_scalar, a sliding layer and a full one, GELU-tanh
    "gemma2": (dict(sliding_window=4, attn_logit_softcapping=2.0, query_pre_attn_scalar=5), "eager",
               ("self_attn", "mlp"), {}),
    "gemma3_text": (dict(sliding_window=4, query_pre_attn_scalar=5, sliding_window_pattern=2,
                         layer_types=["sliding_attention", "full_attention"]), "sdpa", ("self_attn", "mlp"),
                    {}),  # QK-norm, GELU-tanh
    # one qkv_proj [q; k; v] and one gate_up_proj [gate; up], with as many key/value heads as query heads and not
    "phi3": (dict(num_attention_heads=6, num_key_value_heads=6, hidden_size=48), "sdpa", ("self_attn", "mlp"), {}),
    "phi3-gqa": (dict(), "sdpa", ("self_attn", "mlp"), {}),
    # Phi-2's plain MLP (fc1, GELU-tanh, fc2, biases); its attention rotates half of each head itself (refused)
    "phi": (dict(), "sdpa", ("mlp",), {}),
}


def config_of(family: str, **more):
    import transformers

    kwargs, implementation, _, _ = FAMILIES[family]
    name = family.removesuffix("-eager").removesuffix("-gqa")
    base = dict(vocab_size=64, hidden_size=96, intermediate_size=120, num_hidden_layers=2, num_attention_heads=12,
                num_key_value_heads=6, head_dim=8, max_position_embeddings=64, attention_dropout=0.0,
                pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if name == "qwen2":
        base["attention_bias"] = True
    config = transformers.CONFIG_MAPPING[name](**{**base, **kwargs, **more})
    config._attn_implementation = implementation
    return config


def model_of(family: str, seed: int = 0, **more):
    import transformers

    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config_of(family, **more)).float()


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _close(got, want, what):
    got, want = _full(got).detach(), _full(want).detach()
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {list(got.shape)} != {list(want.shape)}")
    if not torch.allclose(got, want, **TOL):
        scale = want.abs().max().item()
        raise AssertionError(f"{what}: max diff {(got - want).abs().max().item():.3g} (max |value| {scale:.3g})")


def captured_calls(model) -> dict:
    """What the model hands each layer's self_attn and mlp, (args, kwargs) by (layer, name), from one forward
    of the unsharded model (use_cache=False, as training runs)."""
    seen = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        for which in ("self_attn", "mlp"):
            def hook(module, args, kwargs, key=(i, which)):
                seen[key] = (tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args), dict(kwargs))
            hooks.append(getattr(layer, which).register_forward_pre_hook(hook, with_kwargs=True))
    ids = torch.randint(3, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()
    return seen


def _with_input(args, kwargs, x):
    if args:
        return (x, *args[1:]), kwargs
    return (), {**kwargs, "hidden_states": x}


def _input_of(args, kwargs):
    return args[0] if args else kwargs["hidden_states"]


def compare_family(rank: int, n: int, family: str) -> dict:
    """The family's attention and MLP modules, both layers, parallelized with AttentionParallel() and
    SwiGLUParallel() through one plan over the model (no arguments: read from the modules), against the
    unsharded modules: output, input gradient, every parameter's gradient; the state dict's whole tensors."""
    results = {}
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    base = model_of(family)
    ours = copy.deepcopy(base)
    calls = captured_calls(base)
    _, _, modules, attention = FAMILIES[family]
    plan = {}
    if "self_attn" in modules:
        plan["model.layers.*.self_attn"] = tp.AttentionParallel(algorithm="ring", **attention)
    if "mlp" in modules:
        plan["model.layers.*.mlp"] = tp.SwiGLUParallel(algorithm="ring")
    parallelize_module(ours, mesh, plan)

    def one(i, which):
        want_module = getattr(base.model.layers[i], which)
        got_module = getattr(ours.model.layers[i], which)
        args, kwargs = calls[(i, which)]
        x = _input_of(args, kwargs)
        g = torch.randn(x.shape, generator=torch.Generator().manual_seed(11 + i))
        xf = x.clone().requires_grad_()
        a, k = _with_input(args, kwargs, xf)
        yf = want_module(*a, **k)
        yf = yf[0] if isinstance(yf, tuple) else yf
        (yf * g).sum().backward()
        xl = x.tensor_split(n, dim=1)[rank].clone().requires_grad_()
        a, k = _with_input(args, kwargs, xl)
        yl = got_module(*a, **k)
        if which == "self_attn":
            if not (isinstance(yl, tuple) and len(yl) == 2 and yl[1] is None):
                raise AssertionError(f"the attention returned {type(yl).__name__}, not (output, None) as its own "
                                     "forward's (output, weights)")
            yl = yl[0]
        (yl * g.tensor_split(n, dim=1)[rank]).sum().backward()
        _close(yl, yf.tensor_split(n, dim=1)[rank], f"layer {i} {which} output")
        _close(xl.grad, xf.grad.tensor_split(n, dim=1)[rank], f"layer {i} {which} input grad")
        for (name, pw), (_, pg) in zip(want_module.named_parameters(), got_module.named_parameters()):
            if pg.grad is None:
                raise AssertionError(f"layer {i} {which}.{name}: no gradient")
            _close(pg.grad, pw.grad, f"layer {i} {which}.{name} grad")

    for i in range(len(base.model.layers)):
        for which in modules:
            _run(results, f"{family} layer {i} {which}", lambda: one(i, which))

    def state_dict():
        # every tensor of the state dict is the block's own whole tensor (a fused projection's rows as the block
        # holds them: its placement states each rank's rows truthfully)
        want = base.state_dict()
        for key, value in ours.state_dict().items():
            if not torch.equal(_full(value), want[key]):
                raise AssertionError(f"state dict {key}: the whole tensor is not the block's own")

    _run(results, f"{family} state dict", state_dict)
    return results


def phi3_checkpoint(rank: int, n: int, path: str) -> dict:
    """Phi-3's fused qkv_proj and gate_up_proj (grouped-query): a distributed checkpoint saved from the
    parallelized model and loaded into a parallelized model of other weights holds the block's own rows, loaded
    into an unsharded model gives its weights back, and one saved from an unsharded model loads into a
    parallelized one as it was (torch 2.13's DCP would load a _StridedShard parameter's rows from the wrong
    offsets)."""
    import torch.distributed.checkpoint as dcp

    results = {}
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))

    def plan():
        return {"model.layers.*.self_attn": tp.AttentionParallel(), "model.layers.*.mlp": tp.SwiGLUParallel()}

    def round_trip():
        base = model_of("phi3-gqa", seed=0)
        want = {k: v.clone() for k, v in base.state_dict().items()}
        parallelize_module(base, mesh, plan())
        dcp.save(base.state_dict(), checkpoint_id=path)
        other = parallelize_module(model_of("phi3-gqa", seed=1), mesh, plan())
        state = other.state_dict()
        dcp.load(state, checkpoint_id=path)
        other.load_state_dict(state)
        for key, value in other.state_dict().items():
            if not torch.equal(_full(value), want[key]):
                raise AssertionError(f"{key}: loaded from the checkpoint, the whole tensor is not the saved one")
        plain = model_of("phi3-gqa", seed=2)
        state = plain.state_dict()
        dcp.load(state, checkpoint_id=path)
        for key, value in state.items():
            if not torch.equal(value, want[key]):
                raise AssertionError(f"{key}: loaded into the unsharded model, not the saved weights")
        # and the other way: saved unsharded, loaded into the parallelized model
        dcp.save(model_of("phi3-gqa", seed=3).state_dict(), checkpoint_id=path + "-plain")
        want = model_of("phi3-gqa", seed=3).state_dict()
        again = parallelize_module(model_of("phi3-gqa", seed=4), mesh, plan())
        state = again.state_dict()
        dcp.load(state, checkpoint_id=path + "-plain")
        again.load_state_dict(state)
        for key, value in again.state_dict().items():
            if not torch.equal(_full(value), want[key]):
                raise AssertionError(f"{key}: an unsharded checkpoint loaded into the parallelized model is not it")

    _run(results, "phi3 checkpoint", round_trip)
    return results


def refusals(rank: int, n: int) -> dict:
    """What the styles do not compute, refused by name before any value is computed: the error's words, and
    the group usable after it (the call numbers of the ranks still agree)."""
    import transformers

    from commfuse.errors import CommfuseTypeError, CommfuseValueError

    results = {}
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    error, kind_error = CommfuseValueError, CommfuseTypeError

    def olmo2():
        # OLMo 2's QK-norm normalizes all heads' features at once: no rank holds them all
        model = model_of("llama")
        config = transformers.CONFIG_MAPPING["olmo2"](**{k: getattr(model.config, k) for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings")}, head_dim=8)
        olmo = transformers.AutoModelForCausalLM.from_config(config)
        expect(lambda: parallelize_module(olmo, mesh, {"model.layers.*.self_attn": tp.AttentionParallel()}),
               error, "'model.layers.0.self_attn' (Olmo2Attention)", "query norm 'q_norm'", "[96]",
               "ColwiseParallel", "RowwiseParallel")

    def quick_gelu():
        model = model_of("llama", hidden_act="quick_gelu")
        expect(lambda: parallelize_module(model, mesh, {"model.layers.*.mlp": tp.SwiGLUParallel()}), error,
               "'model.layers.0.mlp' (LlamaMLP)", "'act_fn' (QuickGELUActivation)", "none of the activations",
               "'gate_proj': ColwiseParallel()")

    def phi_partial_rotary():
        # Phi-2's attention rotates the first half of each head by slicing it itself: refused when applied
        model = model_of("phi")
        expect(lambda: parallelize_module(model, mesh, {"model.layers.*.self_attn": tp.AttentionParallel(
            wo="dense")}), error, "'model.layers.0.self_attn' (PhiAttention)", "rotary embeddings of width 4",
            "heads of 8", "'dense': RowwiseParallel()")
        # and without the name of its output projection, that is what is missing
        expect(lambda: parallelize_module(model_of("phi"), mesh, {"model.layers.*.self_attn": tp.AttentionParallel()}),
               error, "PhiAttention has no submodule 'o_proj'", "wo= argument")

    def phi3_grouped():
        # 3 key/value heads cannot be whole on each of 2 ranks
        model = model_of("phi3", num_attention_heads=6, num_key_value_heads=3, hidden_size=48)
        expect(lambda: parallelize_module(model, mesh, {"model.layers.*.self_attn": tp.AttentionParallel()}),
               error, "'model.layers.0.self_attn' (Phi3Attention)", "'qkv_proj'",
               "stacks 6 query heads over 3 key/value heads", "whole key/value heads",
               "'qkv_proj': ColwiseParallel(output_layouts=Replicate())",
               "'o_proj': RowwiseParallel(input_layouts=Replicate())")

    def cache_and_the_group_after():
        # every rank is handed a KV cache: refused on each before anything is sent, and the group goes on
        model = model_of("llama")
        calls = captured_calls(model)
        parallelize_module(model, mesh, {"model.layers.*.self_attn": tp.AttentionParallel()})
        attn = model.model.layers[0].self_attn
        args, kwargs = calls[(0, "self_attn")]
        x = _input_of(args, kwargs).tensor_split(n, dim=1)[rank]
        cache = transformers.DynamicCache(config=model.config)
        message = expect(lambda: attn(**{**kwargs, "hidden_states": x, "past_key_values": cache}), error,
                         "KV cache", "past_key_values=", "DynamicCache", "use_cache=False")
        if "rope hook" in message:
            raise AssertionError(f"the cache's refusal suggests a rope hook, which would drop it: {message}")
        if cache.get_seq_length() != 0:
            raise AssertionError("the refused call wrote into the cache")
        y, _ = attn(**{**kwargs, "hidden_states": x})  # the ranks' call numbers still agree
        if not torch.isfinite(y).all():
            raise AssertionError("the call after the refusal gave non-finite values")

    def window_without_mask():
        model = model_of("gemma2")
        calls = captured_calls(model)
        parallelize_module(model, mesh, {"model.layers.*.self_attn": tp.AttentionParallel()})
        args, kwargs = calls[(0, "self_attn")]  # layer 0 slides
        x = _input_of(args, kwargs).tensor_split(n, dim=1)[rank]
        expect(lambda: model.model.layers[0].self_attn(**{**kwargs, "hidden_states": x, "attention_mask": None}),
               error, "sliding_window=4", "without an attention_mask", f"over {SEQ} positions")

    def dropout_in_training():
        model = model_of("llama", attention_dropout=0.1)
        calls = captured_calls(model)
        parallelize_module(model, mesh, {"model.layers.*.self_attn": tp.AttentionParallel()})
        attn = model.model.layers[0].self_attn
        args, kwargs = calls[(0, "self_attn")]
        x = _input_of(args, kwargs).tensor_split(n, dim=1)[rank]
        attn.train()
        expect(lambda: attn(**{**kwargs, "hidden_states": x}), error, "attention_dropout 0.1", "training mode")
        attn.eval()
        attn(**{**kwargs, "hidden_states": x})

    def other_arguments():
        model = model_of("llama")
        calls = captured_calls(model)
        parallelize_module(model, mesh, {"model.layers.*.self_attn": tp.AttentionParallel()})
        attn = model.model.layers[0].self_attn
        args, kwargs = calls[(0, "self_attn")]
        x = _input_of(args, kwargs).tensor_split(n, dim=1)[rank]
        expect(lambda: attn(**{**kwargs, "hidden_states": x, "output_attentions": True}), error,
               "output_attentions=True")
        expect(lambda: attn(**{**kwargs, "hidden_states": x, "is_causal": False}), kind_error, "is_causal=")
        expect(lambda: attn(**{**kwargs, "hidden_states": x, "position_embeddings": None}), kind_error,
               "position_embeddings=(cos, sin)")

    def hand_made_cache():
        # a block of the explicit form whose forward takes a kv_cache: None passes, a cache is refused by name,
        # and the message does not suggest a rope hook (which would drop the cache)
        from commfuse.models import llama

        class Cached(llama.Attention):
            def forward(self, x, cache, kv_cache=None):
                return super().forward(x, cache)

        torch.manual_seed(3)
        block = Cached(8 * n, n, n)
        parallelize_module(block, mesh, tp.AttentionParallel(head_dim=8, rope=llama.apply_rope))
        rope = llama.rope_cache(8, 4 * n)
        x = torch.randn(2, 4, 8 * n)
        message = expect(lambda: block(x, rope, kv_cache=torch.zeros(2, 4 * n, n, 8)), error, "KV cache",
                         "kv_cache=", "would neither read the cache")
        if "rope hook" in message:
            raise AssertionError(f"the cache's refusal suggests a rope hook: {message}")
        block(x, rope, kv_cache=None).sum().backward()

    for name, fn in (("olmo2 norm over all heads", olmo2), ("quick_gelu activation", quick_gelu),
                     ("phi3 kv heads not whole per rank", phi3_grouped),
                     ("phi partial rotary", phi_partial_rotary), ("kv cache", cache_and_the_group_after),
                     ("window without a mask", window_without_mask), ("dropout in training", dropout_in_training),
                     ("other arguments", other_arguments), ("hand-made kv_cache", hand_made_cache)):
        _run(results, name, fn)
    return results


def one_rank_cache(rank: int, n: int, warm: bool) -> tuple[str, str, float]:
    """The last rank alone is handed a KV cache, on the forward's very first call or after one on every rank
    (``warm``: the call's signature checked): it refuses before sending anything, and every other rank, waiting
    in the forward's first call, fails naming it and its reason, at once (not at the timeout). Returns (error
    class, message, seconds)."""
    import time

    import transformers

    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    model = model_of("llama")
    calls = captured_calls(model)
    parallelize_module(model, mesh, {"model.layers.*.self_attn": tp.AttentionParallel()})
    attn = model.model.layers[0].self_attn
    args, kwargs = calls[(0, "self_attn")]
    x = _input_of(args, kwargs).tensor_split(n, dim=1)[rank]
    if warm:
        attn(**{**kwargs, "hidden_states": x})
    extra = {"past_key_values": transformers.DynamicCache(config=model.config)} if rank == n - 1 else {}
    start = time.perf_counter()
    try:
        attn(**{**kwargs, "hidden_states": x, **extra})
    except CommfuseError as e:
        return type(e).__name__, str(e), time.perf_counter() - start
    return "ok", "", time.perf_counter() - start
