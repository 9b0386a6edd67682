"""What a plugin's backend object builds on: the Backend protocol and the torch.distributed (c10d) backend
that vendor backends subclass. Importing this module imports torch (the rest of ``commfuse.plugins`` does
not), so a plugin imports it where it makes its backend object."""

from commfuse.runtime.protocol import Backend, Handle
from commfuse.runtime.c10d import C10dBackend

__all__ = ["Backend", "C10dBackend", "Handle"]
