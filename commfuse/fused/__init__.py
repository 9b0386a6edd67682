"""The fused blocks, each implemented once: the fused matmul ops' per-signature plans
(:mod:`commfuse.fused.matmul`) and the blocks the layers and styles are shells over:

- :mod:`commfuse.fused.attention`: query-split attention fused with the out-projection's reduce-scatter,
  its masks and the slice-size rule ``auto`` decides on (``commfuse.nn.ParallelAttention``,
  ``commfuse.tp.AttentionParallel``, ``torch.ops.commfuse.attention_reduce_scatter``);
- :mod:`commfuse.fused.ring_attention`: ring attention (context parallelism), K/V consumed block by block
  from an all-gather ring and dK/dV produced into a reduce-scatter ring (``commfuse.ring_attention``,
  ``commfuse.nn.RingAttention``);
- :mod:`commfuse.fused.ulysses`: Ulysses' head <-> sequence exchange, plain (ring attention's 2-D form) and
  fused with the attention (``commfuse.nn.UlyssesAttention``, ``commfuse.nn.ulysses_attention``);
- :mod:`commfuse.fused.moe`: the expert-parallel MoE block, its dispatch and combine fused with the experts'
  GEMMs, forward and backward (``commfuse.nn.MoE``, ``commfuse.nn.moe.dispatch_experts`` / ``experts_combine``);
- :mod:`commfuse.fused.sharded_linear`: the sharded (ZeRO-3 / FSDP) linear, its weight gathered and its
  gradients reduce-scattered in rings fused with the GEMMs (``commfuse.nn.ShardedLinear``,
  ``torch.ops.commfuse.sharded_linear``).

This layer sits below the ``torch.library`` ops (``commfuse.library``) and the public functional API
(``commfuse.ops``), and above autograd and planning: both front doors, eager and compiled, run the same
code from here. Each block's autograd Functions sit beside it, in its module.
"""
