"""Tier (a), no processes (one on torch's ``fake`` process group, one a child interpreter for ``import commfuse``):
every ``COMMFUSE_*`` variable is read through ``commfuse.runtime.env`` with one grammar, each variable's reader
takes the values it documents, and a value it does not take is refused by a ``CommfuseValueError`` that names
the variable and the value; ``commfuse.errors.first_line`` is the one summary of an error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from commfuse.errors import CommfuseValueError, first_line
from commfuse.runtime import env

ON = ["1", "true", "yes", "on", " ON ", "True"]
OFF = ["0", "false", "no", "off", " OFF ", "False"]


def _refused(monkeypatch, name: str, value: str, read) -> str:
    """The message of the error ``read()`` raises with ``name`` set to ``value``; it names both."""
    monkeypatch.setenv(name, value)
    with pytest.raises(CommfuseValueError) as info:
        read()
    message = str(info.value)
    assert name in message and value.strip() in message, message
    return message


def test_flag_reads_one_grammar_and_refuses_any_other_word(monkeypatch):
    name = "COMMFUSE_TEST_SWITCH"
    monkeypatch.delenv(name, raising=False)
    assert env.flag(name, True) is True and env.flag(name, False) is False
    for blank in ("", "  "):
        monkeypatch.setenv(name, blank)
        assert env.flag(name, True) is True and env.flag(name, False) is False
    for word in ON:
        monkeypatch.setenv(name, word)
        assert env.flag(name, False) is True, word
    for word in OFF:
        monkeypatch.setenv(name, word)
        assert env.flag(name, True) is False, word
    message = _refused(monkeypatch, name, "enabled", lambda: env.flag(name, False))
    assert all(repr(w) in message for w in ("1", "true", "yes", "on", "0", "false", "no", "off")), message


def test_choice_and_text_read_their_words(monkeypatch):
    name = "COMMFUSE_TEST_WORD"
    monkeypatch.delenv(name, raising=False)
    assert env.choice(name, "a", ("a", "b")) == "a" and env.text(name, "x") == "x"
    monkeypatch.setenv(name, " B ")
    assert env.choice(name, "a", ("a", "b")) == "b" and env.choice(name, 0, {"b": 2}) == 2
    assert env.text(name, "x") == "B"
    monkeypatch.setenv(name, " ")
    assert env.choice(name, "a", ("a", "b")) == "a" and env.text(name, "x") == "x"
    assert env.text(name, None, empty="off") == "off"
    message = _refused(monkeypatch, name, "c", lambda: env.choice(name, "a", ("a", "b")))
    assert "'a' or 'b'" in message


def test_check_mode_reads_commfuse_check(monkeypatch):
    from commfuse.runtime.groups import check_mode

    monkeypatch.delenv("COMMFUSE_CHECK", raising=False)
    assert check_mode(None) == "once"
    for word, mode in [*((w, "off") for w in OFF), *((w, "once") for w in ON), ("once", "once"), ("", "once"),
                       ("always", "always"), (" Always ", "always")]:
        monkeypatch.setenv("COMMFUSE_CHECK", word)
        assert check_mode(None) == mode, word
    # an unknown word used to mean "once"
    assert "'always'" in _refused(monkeypatch, "COMMFUSE_CHECK", "sometimes", lambda: check_mode(None))


def test_timeout_reads_commfuse_timeout_s(monkeypatch):
    from commfuse.runtime.groups import DEFAULT_TIMEOUT_S, resolve_timeout

    for blank in ("", "  "):  # a blank value used to be refused as not a number; it is unset now
        monkeypatch.setenv("COMMFUSE_TIMEOUT_S", blank)
        assert resolve_timeout(None) == DEFAULT_TIMEOUT_S
    monkeypatch.setenv("COMMFUSE_TIMEOUT_S", " 7.5 ")
    assert resolve_timeout(None) == 7.5
    for bad in ("soon", "-1", "0", "nan", "inf", "2e6"):
        _refused(monkeypatch, "COMMFUSE_TIMEOUT_S", bad, lambda: resolve_timeout(None))


def test_trace_reads_commfuse_trace(monkeypatch):
    from commfuse.runtime.observe import trace_enabled

    monkeypatch.delenv("COMMFUSE_TRACE", raising=False)
    assert trace_enabled() is False
    for word in ON:
        monkeypatch.setenv("COMMFUSE_TRACE", word)
        assert trace_enabled() is True, word
    for word in OFF:  # "false" and "off" used to turn it on: any value but empty or 0 did
        monkeypatch.setenv("COMMFUSE_TRACE", word)
        assert trace_enabled() is False, word
    _refused(monkeypatch, "COMMFUSE_TRACE", "steps", trace_enabled)


def test_recorder_reads_device_timing_trace_dir_and_trace_signals(monkeypatch, tmp_path):
    from commfuse.runtime import recorder

    monkeypatch.delenv("COMMFUSE_DEVICE_TIMING", raising=False)
    assert recorder.device_timing() is False
    monkeypatch.setenv("COMMFUSE_DEVICE_TIMING", "Yes")
    assert recorder.device_timing() is True
    monkeypatch.setenv("COMMFUSE_DEVICE_TIMING", "OFF")
    assert recorder.device_timing() is False
    _refused(monkeypatch, "COMMFUSE_DEVICE_TIMING", "cuda", recorder.device_timing)
    monkeypatch.setenv("COMMFUSE_TRACE_DIR", f" {tmp_path} ")
    assert recorder.trace_dir() == str(tmp_path)
    monkeypatch.setenv("COMMFUSE_TRACE_DIR", "")
    assert recorder.trace_dir() == recorder.DEFAULT_DIR
    # refused before any handler is installed (an unknown word used to install them)
    _refused(monkeypatch, "COMMFUSE_TRACE_SIGNALS", "sigterm", recorder.install_signal_handlers)


def test_watchdog_reads_exit_and_poll_interval(monkeypatch):
    from commfuse.runtime.watchdog import POLL_S, Watchdog

    monkeypatch.delenv("COMMFUSE_WATCHDOG_EXIT", raising=False)
    monkeypatch.delenv("COMMFUSE_WATCHDOG_POLL_S", raising=False)
    dog = Watchdog()
    assert dog.exit is True and dog.poll_s == POLL_S == 0.05
    monkeypatch.setenv("COMMFUSE_WATCHDOG_EXIT", "FALSE")  # read case-sensitively before: it kept exiting
    monkeypatch.setenv("COMMFUSE_WATCHDOG_POLL_S", "0.2")
    dog = Watchdog()
    assert dog.exit is False and dog.poll_s == 0.2
    monkeypatch.delenv("COMMFUSE_WATCHDOG_POLL_S")
    _refused(monkeypatch, "COMMFUSE_WATCHDOG_EXIT", "later", Watchdog)
    monkeypatch.delenv("COMMFUSE_WATCHDOG_EXIT")
    for bad in ("fast", "0", "-1", "3600"):  # "fast" used to raise a bare ValueError, the rest to be taken
        _refused(monkeypatch, "COMMFUSE_WATCHDOG_POLL_S", bad, Watchdog)


def test_launch_reads_its_start_method_and_one_gpu_switch(monkeypatch):
    from commfuse import launch

    monkeypatch.setenv("COMMFUSE_LAUNCH_START", " Spawn ")
    assert launch._context().get_start_method() == "spawn"
    assert "'spawn' or 'forkserver'" in _refused(monkeypatch, "COMMFUSE_LAUNCH_START", "fork", launch._context)
    monkeypatch.delenv("COMMFUSE_NCCL_HOST_PER_RANK", raising=False)
    assert launch.rank_environment(1) == {}
    monkeypatch.setenv("COMMFUSE_NCCL_HOST_PER_RANK", "true")  # only "1" turned it on before
    assert launch.rank_environment(1)["NCCL_HOSTID"] == "commfuse-rank-1"
    monkeypatch.setenv("COMMFUSE_NCCL_HOST_PER_RANK", "0")
    assert launch.rank_environment(1) == {}
    _refused(monkeypatch, "COMMFUSE_NCCL_HOST_PER_RANK", "2", lambda: launch.rank_environment(1))


def test_profile_and_profile_dir_are_read_as_text(monkeypatch, tmp_path):
    from commfuse.sim._planner import profile_for
    from commfuse.sim._profile import user_dir

    for off in ("", "  ", "off", "None", "FALSE", "0"):  # "FALSE" used to be looked up as a profile's name
        monkeypatch.setenv("COMMFUSE_PROFILE", off)
        assert profile_for(None) is None, off
    monkeypatch.setenv("COMMFUSE_PROFILE", " h100-sxm ")
    assert profile_for(None).name == "h100-sxm"
    monkeypatch.setenv("COMMFUSE_PROFILE_DIR", f" {tmp_path} ")  # taken with its blanks before
    assert user_dir() == Path(tmp_path)


def test_pairwise_all_to_all_is_a_switch(monkeypatch):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from commfuse.runtime.c10d import C10dBackend
    from commfuse.runtime.groups import group_state
    from commfuse.schedule import Collective

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        group = dist.new_group([0, 1])
        monkeypatch.setenv("COMMFUSE_PAIRWISE_ALL_TO_ALL", "false")  # any value but empty or 0 was on
        assert Collective.ALL_TO_ALL not in group_state(C10dBackend(group)).lacking
        monkeypatch.setenv("COMMFUSE_PAIRWISE_ALL_TO_ALL", "Yes")
        assert Collective.ALL_TO_ALL in group_state(C10dBackend(group)).lacking
        _refused(monkeypatch, "COMMFUSE_PAIRWISE_ALL_TO_ALL", "pairwise", lambda: C10dBackend(group))
    finally:
        dist.destroy_process_group()


def _import_commfuse(log: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "COMMFUSE_LOG": log}
    return subprocess.run([sys.executable, "-c", "import sys, commfuse; print('torch' in sys.modules)"],
                          env=environ, capture_output=True, text=True, timeout=120)


def test_import_commfuse_reads_commfuse_log_without_torch():
    quiet = _import_commfuse("Warning")
    assert quiet.returncode == 0 and quiet.stdout.strip() == "False", quiet.stderr
    refused = _import_commfuse("verbose")  # an unknown word used to add no handler, silently
    assert refused.returncode != 0
    assert "CommfuseValueError: COMMFUSE_LOG='verbose'" in refused.stderr and "'debug'" in refused.stderr


def test_first_line_is_the_one_summary_of_an_error():
    error = RuntimeError("  rank 1 failed\nTraceback follows\n")
    assert first_line(error) == "rank 1 failed"
    assert first_line(error, 4) == "rank"
    assert first_line(error, named=True) == "RuntimeError: rank 1 failed"
    assert first_line(RuntimeError(), named=True) == "RuntimeError" and first_line(RuntimeError()) == ""
    assert first_line("x" * 600) == "x" * 500 and first_line("x" * 600, None) == "x" * 600
    assert first_line("\n  last words of rank 2\n more") == "last words of rank 2"
