"""The torchtitan stage's shared set-up: torchtitan's model code readied for a CPU rank
(``commfuse.integrations.torchtitan_cpu.prepare``) and the releases this stage is run with."""

from commfuse.integrations.torchtitan_cpu import prepare  # noqa: F401

#: The torchtitan releases CI's torchtitan stage runs; ``commfuse.integrations.torchtitan.TESTED`` must agree.
TESTED = ("0.3.0",)
