"""Tier (b), real gloo ranks: a process group destroyed with torch's ``destroy_process_group`` and never
``commfuse.backends.release()``d gives back what it held: after hundreds of groups made, called once and
destroyed, each rank holds the same file descriptors, threads (Python's and native ones) and about the same
memory as before them, while a group that stays is called correctly throughout, and the whole world destroyed
and made again holds no more either."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # the rank-side bodies must import in spawned ranks too
import _group_release_cases as cases  # noqa: E402

from commfuse.launch import launch  # noqa: E402

#: Cycles measured (after 10 of warm-up): a group kept 5 descriptors and 3 native threads before, so one
#: descriptor a group would show as 200 here. ``benchmarks/group_churn.py`` runs 1,000.
CYCLES = 200
#: The resident memory the cycles may add, in bytes: 20 KiB a group, ten times what was measured over 150 groups
#: (0.2 to 0.3 MiB in all), under the 54 KiB a group that a destroyed group kept before.
RSS_SLACK = CYCLES * 20 * 1024


def test_groups_destroyed_without_release_give_back_descriptors_threads_and_memory():
    for rank, out in enumerate(launch(cases.cycles, 2, CYCLES, timeout=600)):
        before, after, again = out["before"], out["after"], out["again"]
        assert out["ok"], (rank, "a result differs from its reference")
        for what in ("fds", "threads", "tasks"):
            assert after[what] == before[what], (rank, what, before, after)
            # the world made again holds no more than the first did; it may hold fewer descriptors: the first
            # world's group kept across the cycles is gone, and how many sockets a gloo group holds (its listener,
            # its pairs) depends on when its peers connected, which moves with the machine's load
            assert again[what] <= before[what], (rank, what, "the world made again", before, again)
        assert after["rss"] - before["rss"] < RSS_SLACK, (rank, before, after)
