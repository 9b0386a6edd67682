"""The fused blocks, each implemented once and whole in its module (planner, plan, forward, backward and
autograd Function), and the blocks the layers and styles are shells over:

- :mod:`commfuse.fused.all_gather_matmul`: the all-gather + GEMM (``commfuse.all_gather_matmul``,
  ``torch.ops.commfuse.all_gather_matmul``), its per-signature plan and its backward (a GEMM +
  reduce-scatter ring);
- :mod:`commfuse.fused.matmul_reduce_scatter`: the GEMM + reduce-scatter (``commfuse.matmul_reduce_scatter``,
  ``torch.ops.commfuse.matmul_reduce_scatter``), its plan and its backward (an all-gather + GEMM ring);
- :mod:`commfuse.fused.matmul`: what those two share: the argument checks every op uses, a
  backend's native kernel, the plan of an op a backend runs whole, deferred weight gradients;
- :mod:`commfuse.fused.once`: a signature planned once (``plan_once``: the op hands its planner and
  arguments down, the plan is kept in the planning table, and a rank whose planning fails still numbers the
  call, ``note_failed``);
- :mod:`commfuse.fused.produce_reduce_scatter`: the autograd of ``commfuse.produce_reduce_scatter`` (whose op
  is in ``commfuse.ops``), which the attention block runs too;
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
(``commfuse.ops``), and above planning; ``commfuse.autograd`` re-exports the Functions' public names from
here. Both front doors, eager and compiled, run the same code from here.
"""
