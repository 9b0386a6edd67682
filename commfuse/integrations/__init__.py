"""commfuse inside other frameworks' models, each an optional dependency imported only by its own module.

``commfuse.integrations.torchtitan``: plain-tensor fused modules for torchtitan's tensor-parallel seam.
"""
