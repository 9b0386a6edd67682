"""Tier (a), no processes: the old import paths of the split modules reach the one object in its home.

``planning.pipelined`` only re-exports the pipelined primitives, and ``runtime.groups`` and
``runtime.programs`` re-export the fingerprint words of ``runtime.fingerprints``: a re-export is the same
object (a registry re-exported is the registry), never a copy that a caller would change or clear alone.
"""

import importlib

import pytest

from commfuse.planning import pipelined

MOVED = sorted({*pipelined.__all__, "_handed_over"})


@pytest.mark.parametrize("name", MOVED)
def test_a_name_of_pipelined_is_the_object_in_its_home(name):
    obj = getattr(pipelined, name)
    home = importlib.import_module(getattr(obj, "__module__", None) or type(obj).__module__)
    assert home is not pipelined, f"{name} is still defined in commfuse.planning.pipelined"
    assert getattr(home, obj.__name__ if hasattr(obj, "__name__") else name) is obj


def test_the_fingerprint_words_have_one_registry():
    from commfuse.runtime import fingerprints, groups, programs

    for name in ("register_format", "describe_fingerprint", "format_code"):
        assert getattr(groups, name) is getattr(fingerprints, name), name
    for name in ("config_words", "config_values", "describe_config", "dtype_code", "register_described"):
        assert getattr(programs, name) is getattr(fingerprints, name), name
    groups.register_format("test_module_homes.op", lambda v: f"{v[0]} things")
    code = fingerprints.format_code("test_module_homes.op")
    try:
        text = fingerprints.describe_fingerprint([fingerprints.FINGERPRINT_MAGIC, 5, code, 0, 0, 1, 1, 1, 7])
        assert text.startswith("call #5 test_module_homes.op (") and text.endswith("): 7 things"), text
    finally:
        del fingerprints._FORMATS[code]
