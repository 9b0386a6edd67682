"""Tier (a), no processes but the command's own: ``commfuse trace analyze`` over crafted dump files cannot be
fooled. Two jobs' dumps in one folder are never merged (the newest is analysed and the other named as left
out); a file cut short or unreadable is named, and its rank is never blamed for it; every hostile field gets
one line naming the file and the field, in bounded memory, never a traceback; dumps of an older commfuse,
which carry no job identity, are still read and said to lack it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from commfuse.errors import CommfuseValueError
from commfuse.runtime.recorder import FORMAT
from commfuse.traces import analyze, render

LANE = "MainThread"


def _call(seq: int, status: str = "ok", waits_for=None, start: int = 0) -> dict:
    start = start + 1000 * seq
    waiting = None if waits_for is None else {"step": 0, "since_ns": start + 10, "waits_for": waits_for}
    return {"seq": seq, "lane": LANE, "lane_code": 0, "op": "all_gather_consume", "algorithm": "ring",
            "digest": 7, "site": None, "status": status,
            "error": "CommunicationError: the transport gave up" if status == "failed" else None,
            "start_ns": start, "end_ns": start + 500 if status != "in progress" else None, "waiting": waiting,
            "steps": [] if waits_for is None else [{"step": 0, "send_to": [waits_for[0]], "recv_from": waits_for,
                                                    "bytes_sent": 64, "bytes_received": 64, "post_ns": start,
                                                    "wait_ns": start + 10, "done_ns": None}]}


def _dump(rank: int, world_size: int, calls: list[dict], *, job: str | None = "job-b", written: int = 50_000,
          legacy: bool = False) -> dict:
    out = {"format": FORMAT, "group": "0", "rank": rank, "global_rank": rank, "world_size": world_size,
           "job": job, "job_from": "store" if job else None, "host": "h", "pid": 100 + rank,
           "reason": "on demand", "written_ns": written, "kept": 64, "dead": None, "calls": calls}
    if legacy:
        del out["job"], out["job_from"]
    return out


def _write(folder: Path, dump: dict, name: str | None = None) -> Path:
    path = folder / (name or f"commfuse-trace-{dump['group']}-rank{dump['rank']}.json")
    path.write_text(json.dumps(dump, indent=1))
    return path


def _cli(folder: Path, *extra: str, limit_gib: int | None = None) -> subprocess.CompletedProcess:
    def cap():  # the address space of the command: a field that asks for a billion ranks must not get them
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limit_gib << 30, limit_gib << 30))

    return subprocess.run([sys.executable, "-m", "commfuse", "trace", "analyze", str(folder), "--perfetto", "-",
                           *extra], capture_output=True, text=True, timeout=120,
                          preexec_fn=cap if limit_gib else None)


# -- two jobs in one folder ----------------------------------------------------------------------------------------


def _two_jobs(folder: Path, *, legacy: bool = False) -> None:
    """Job a (older) ran five calls on two ranks and dumped on demand; job b (newer) wrote the same file names:
    its rank 0 failed in call #2 waiting for rank 1, which was killed and wrote nothing, so rank 1's file is
    still job a's."""
    _write(folder, _dump(1, 2, [_call(s) for s in range(5)], job=None if legacy else "job-a", written=20_000,
                         legacy=legacy))
    _write(folder, _dump(0, 2, [_call(0, start=100_000), _call(1, start=100_000),
                                _call(2, "failed", [1], start=100_000)], job=None if legacy else "job-b",
                         written=200_000, legacy=legacy))


def test_two_jobs_in_one_folder_are_not_merged_and_the_killed_rank_of_the_newer_is_named(tmp_path):
    # main's analyze merged job a's rank 1 into job b and named no rank
    _two_jobs(tmp_path)
    (group,) = analyze(tmp_path)
    assert set(group.culprits) == {1} and "left no dump" in group.culprits[1], group.verdict
    assert group.stuck == (LANE, 2) and group.folder.job == "job-b"
    text = render([group])
    head = text.split("\n\n")[0]
    assert "job job-b" in head and "holds the dumps of 2 jobs" in head, text
    assert "left out: job job-a" in head and "commfuse-trace-0-rank1.json" in head, text
    assert "rank 1 never posted what rank 0 waited for" in head, text


def test_another_job_is_analysed_when_asked_for_by_its_id(tmp_path):
    _two_jobs(tmp_path)
    (group,) = analyze(tmp_path, job="job-a")
    assert sorted(group.dumps) == [1] and group.missing == [0], group.verdict
    assert any("left out: job job-b" in line for line in group.folder.left_out), group.folder.left_out
    with pytest.raises(CommfuseValueError, match="--job job-c: no dump of that job.*job job-a, job job-b"):
        analyze(tmp_path, job="job-c")


def test_dumps_of_an_older_commfuse_are_read_and_said_to_lack_a_job_identity(tmp_path):
    _two_jobs(tmp_path, legacy=True)
    (group,) = analyze(tmp_path)
    assert group.folder.job is None and sorted(group.dumps) == [0, 1]
    assert sorted(analyze(tmp_path, job="none")[0].dumps) == [0, 1]  # asked for by name
    text = render([group])
    assert "job: unknown (the dumps carry no job identity)" in text, text
    assert "carry no job identity (written by a commfuse that records none)" in text, text
    # without identities, that rank 1's calls all ended before rank 0's began is the hint left
    assert "rank 1's recorded calls all ended 0.1 ms before rank 0's first began" in text, text
    done = _cli(tmp_path, "--json")
    assert done.returncode == 0, done.stderr
    (found,) = json.loads(done.stdout)
    assert found["job"] is None and any("no job identity" in n for n in found["notes"]), found


# -- a file cut short ----------------------------------------------------------------------------------------------


def _killed_with_rank0_cut(folder: Path) -> Path:
    """Three ranks; rank 1 was killed in call #2 and left no dump; rank 2 waited in step 0 for ranks 0 and 1;
    rank 0's dump was cut in half."""
    _write(folder, _dump(2, 3, [_call(0), _call(1), _call(2, "failed", [0, 1])]))
    path = _write(folder, _dump(0, 3, [_call(0), _call(1), _call(2, "failed", [1, 2])]))
    text = path.read_text()
    path.write_text(text[:len(text) // 2])
    return path


def test_a_dump_cut_short_is_named_and_its_rank_is_not_blamed(tmp_path):
    # main's analyze skipped the file in silence and named rank 0 "killed" beside rank 1
    _killed_with_rank0_cut(tmp_path)
    (group,) = analyze(tmp_path)
    assert set(group.culprits) == {1}, group.verdict
    assert 0 in group.unusable and "cut short" in group.unusable[0], group.unusable
    assert group.missing == [1]
    done = _cli(tmp_path)
    assert done.returncode == 0, done.stderr
    head = done.stdout.split("\n\n")[0]
    assert "rank 1 never posted what rank 2 waited for" in head, done.stdout
    assert "rank 0 never" not in head and "ranks 0, 1 never" not in head, done.stdout
    assert "rank 0's dump is unusable (commfuse-trace-0-rank0.json: cut short (truncated)" in head, done.stdout
    assert "unusable from rank 0; none from rank 1" in head, done.stdout


def test_an_unusable_dump_of_the_only_waited_for_rank_names_no_rank(tmp_path):
    # rank 1 waited on rank 0 alone, whose dump is empty: what rank 0 did is unknown, so nobody is named
    _write(tmp_path, _dump(1, 2, [_call(0), _call(1, "failed", [0])]))
    (tmp_path / "commfuse-trace-0-rank0.json").write_text("")
    (group,) = analyze(tmp_path)
    assert group.culprits == {} and group.missing == [], group.verdict
    assert any("whose dump is unusable: no rank is named" in v for v in group.verdict), group.verdict
    assert "empty" in group.unusable[0], group.unusable


def test_a_cut_file_that_still_names_another_job_is_left_out_with_it(tmp_path):
    _two_jobs(tmp_path)
    old = tmp_path / "commfuse-trace-0-rank1.json"
    old.write_text(old.read_text()[:300])  # job a's file, cut: its head still says job a
    (group,) = analyze(tmp_path)
    assert set(group.culprits) == {1} and group.unusable == {}, group.verdict
    assert any("unusable and of job job-a" in line for line in group.folder.left_out), group.folder.left_out


def test_a_folder_of_unusable_files_only_is_one_line_naming_them(tmp_path):
    (tmp_path / "commfuse-trace-0-rank0.json").write_text('{"format": "' + FORMAT + '", "group": "0", "ra')
    done = _cli(tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "no flight recorder dumps" in line and "that could be used" in line, line
    assert "commfuse-trace-0-rank0.json: cut short" in line, line


# -- hostile fields ------------------------------------------------------------------------------------------------


def _without(key):
    def edit(d):
        del d[key]
    return edit


def _set(key, value):
    def edit(d):
        d[key] = value
    return edit


def _in_call(key, value, index=1):
    def edit(d):
        if value is KeyError:
            del d["calls"][index][key]
        else:
            d["calls"][index][key] = value
    return edit


def _in_waiting(key, value):
    def edit(d):
        d["calls"][2]["waiting"][key] = value
    return edit


def _in_step(key, value):
    def edit(d):
        d["calls"][2]["steps"][0][key] = value
    return edit


HOSTILE = {
    "rank missing": (_without("rank"), "field rank is missing"),
    "lane missing": (_in_call("lane", KeyError), "field calls[1].lane is missing"),
    "world size a string": (_set("world_size", "x3"), "field world_size is 'x3', not an integer from 1 to"),
    "world size a billion": (_set("world_size", 10**9), "field world_size is 1000000000, not an integer from 1"),
    "world size zero": (_set("world_size", 0), "field world_size is 0"),
    "rank past the world": (_set("rank", 7), "field rank is 7, not an integer from 0 to 2"),
    "rank a bool": (_set("rank", True), "field rank is True"),
    "group a list": (_set("group", [1]), "field group is [1], not a string"),
    "calls a dict": (_set("calls", {"0": 1}), "field calls is {'0': 1}, not a list"),
    "a call a string": (_in_call("seq", "2"), "field calls[1].seq is '2', not an integer"),
    "a call's status": (_in_call("status", "fine"), "field calls[1].status is 'fine', not one of 'ok'"),
    "a call's lane a list": (_in_call("lane", ["x"]), "field calls[1].lane is ['x'], not a string"),
    "a call's start a float": (_in_call("start_ns", 1.5), "field calls[1].start_ns is 1.5"),
    "a call's start negative": (_in_call("start_ns", -5), "field calls[1].start_ns is -5"),
    "waits for a rank past the world": (_in_waiting("waits_for", [1, 99]),
                                        "field calls[2].waiting.waits_for[1] is 99, not a rank from 0 to 2"),
    "waits for a million ranks": (_in_waiting("waits_for", list(range(10**6))),
                                  "field calls[2].waiting.waits_for is [0, 1, 2, 3, ...], not a list of at most 3"),
    "waiting a number": (_in_call("waiting", 3, index=2), "field calls[2].waiting is 3, not an object"),
    "a step's wait a string": (_in_step("wait_ns", "soon"), "field calls[2].steps[0].wait_ns is 'soon'"),
    "a step's peers a string": (_in_step("recv_from", "1"), "field calls[2].steps[0].recv_from is '1', not a list"),
    "the error's message a number": (_set("error", {"type": "X", "message": 5}), "field error.message is 5"),
    "the job a number": (_set("job", 12), "field job is 12, not a string"),
    "written_ns missing": (_without("written_ns"), "field written_ns is missing"),
}


def _hostile_folder(folder: Path, edit) -> Path:
    """Three ranks as in the killed case, rank 1 killed; rank 0's dump edited to lie."""
    _write(folder, _dump(2, 3, [_call(0), _call(1), _call(2, "failed", [0, 1])]))
    bad = _dump(0, 3, [_call(0), _call(1), _call(2, "failed", [1, 2])])
    edit(bad)
    return _write(folder, bad, "commfuse-trace-0-rank0.json")


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_field_is_one_line_naming_the_file_and_the_field(tmp_path, case):
    # main's analyze raised KeyError: 'rank', KeyError: 'lane', ValueError on "x3", MemoryError on 10**9, ...
    edit, said = HOSTILE[case]
    _hostile_folder(tmp_path, edit)
    (group,) = analyze(tmp_path)
    lines = [line for line in render([group]).splitlines() if "commfuse-trace-0-rank0.json" in line]
    assert lines and any(said in line for line in lines), (said, lines)
    assert 0 not in group.culprits and set(group.culprits) == {1}, group.verdict


@pytest.mark.parametrize("case", ["world size a billion", "waits for a million ranks", "rank missing"])
def test_the_command_gives_no_traceback_and_bounded_memory_on_a_hostile_file(tmp_path, case):
    edit, said = HOSTILE[case]
    _hostile_folder(tmp_path, edit)
    done = _cli(tmp_path, limit_gib=6)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert f"commfuse-trace-0-rank0.json: {said}" in done.stdout, done.stdout
    # the same file alone: one line of error, naming the file and the field
    (tmp_path / "commfuse-trace-0-rank2.json").unlink()
    done = _cli(tmp_path, limit_gib=6)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    (line,) = done.stderr.strip().splitlines()
    assert f"commfuse-trace-0-rank0.json: {said}" in line, line


def test_a_file_too_large_is_named_and_not_read(tmp_path):
    _write(tmp_path, _dump(2, 3, [_call(0), _call(1), _call(2, "failed", [0, 1])]))
    big = _dump(0, 3, [_call(0), _call(1), _call(2, "failed", [1, 2])])
    big["padding"] = "x" * (2 << 20)
    _write(tmp_path, big)
    done = _cli(tmp_path, "--max-mib", "1")
    assert done.returncode == 0, done.stderr
    assert "commfuse-trace-0-rank0.json: 2.0 MiB, larger than the 1 MiB analyze reads (--max-mib)" in done.stdout
    assert "rank 0 never" not in done.stdout.split("\n\n")[0], done.stdout
    assert _cli(tmp_path).stdout.count("unusable") == 0  # read at the default bound: nothing unusable


def test_a_file_nested_past_the_parser_is_named(tmp_path):
    _write(tmp_path, _dump(1, 2, [_call(0), _call(1, "failed", [0])]))
    (tmp_path / "commfuse-trace-0-rank0.json").write_text("[" * 200_000 + "]" * 200_000)
    (group,) = analyze(tmp_path)
    assert 0 in group.unusable and group.culprits == {}, (group.unusable, group.verdict)


def test_other_json_files_in_the_folder_are_not_dumps_and_are_skipped(tmp_path):
    _write(tmp_path, _dump(1, 2, [_call(0)]))
    _write(tmp_path, _dump(0, 2, [_call(0)]))
    (tmp_path / "commfuse-trace.perfetto.json").write_text(json.dumps({"traceEvents": []}))
    (tmp_path / "notes.json").write_text("not json at all")
    (group,) = analyze(tmp_path)
    assert group.unusable == {} and group.culprits == {} and sorted(group.dumps) == [0, 1], group.verdict
    assert "unusable" not in render([group])


def test_the_dumps_of_one_job_that_disagree_on_the_world_size_are_said_to(tmp_path):
    _write(tmp_path, _dump(1, 2, [_call(0)]))
    _write(tmp_path, _dump(0, 3, [_call(0)]))
    (group,) = analyze(tmp_path)
    assert group.world_size == 3 and group.missing == [2]
    assert any("disagree on the group's world size: rank 1 says 2; rank 0 says 3" in v for v in group.verdict), \
        group.verdict


def test_ranks_print_in_runs(tmp_path):
    # a group of a million ranks with two dumps: one line for the rest, not a million
    _write(tmp_path, _dump(0, 1 << 20, [_call(0)]))
    _write(tmp_path, _dump(5, 1 << 20, [_call(0)]))
    (group,) = analyze(tmp_path)
    text = render([group])
    assert "ranks 1-4, 6-1048575 left no dump" in text and len(text) < 4000, text[:4000]
    assert os.path.getsize(tmp_path / "commfuse-trace-0-rank0.json") < 4000
