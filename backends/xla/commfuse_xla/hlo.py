"""The HLO parser the XLA checks use; it lives in :mod:`commfuse.testing.hlo`, shared with the JAX lowering."""

from commfuse.testing.hlo import (  # noqa: F401
    Computation,
    HloParseError,
    Instruction,
    Module,
    parse,
)
