"""The planning layer: between the public API (``commfuse.ops``, the ``torch.library`` ops, ``nn``,
``tp``, MoE) and the runtime.

For each call signature it decides, once, everything a call needs: the backend, the algorithm
(``auto``'s policy and its hardware-model lookup), the timeout and check settings, the schedule and
its compiled form for this rank, the buffer layout and pool, and the step walk. All of it is held in
one table (:mod:`commfuse.planning.table`), bounded in bytes (``COMMFUSE_PLAN_BYTES``), with one way to
forget it. The runtime below executes what it is handed.
"""
