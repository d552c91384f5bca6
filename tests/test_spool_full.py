"""A full spool file system is backpressure, not failure (issue 23 item 1).

Real processes (tests/spool_outage.py): the spool on a 1 MiB tmpfs while the
default byte budget is 64 GiB, the store down for at least 10 s and until the
full spool has been watched past its settle time (tests/spool_outage.py: 4 s,
load-scaled, then 6 s), 48 samples (18 batches of 512 tokens; a few fill the
spool). Before the fix every write met ENOSPC, counted against its batch and
dead-lettered it after three.
"""

from __future__ import annotations

import errno

import pytest

from hsx.runspec import spool
from tests.spool_outage import CannotMount, mount_tmpfs, run_outage, umount


def test_tier_budget_is_capped_by_the_file_system(tmp_path):
    root = tmp_path / "fs"
    try:
        mount_tmpfs(root, 1 << 20)
    except CannotMount as exc:
        pytest.skip(str(exc))
    try:
        tiers = spool.SpoolTiers.of(root / "disk", 64 * 2**30)
        room = spool.free_room(root)
        assert 0 < room < 1 << 20
        assert tiers.choose(room).name == "disk" and tiers.choose(room + 1) is None  # not the 64 GiB flag
        assert not tiers.full(room) and tiers.full(room + 1)
        (root / "disk" / "r").mkdir(parents=True)
        with pytest.raises(OSError) as info:
            (root / "disk" / "r" / "filler").write_bytes(b"x" * (2 << 20))
        assert spool.is_disk_full(info.value) and info.value.errno == errno.ENOSPC
        assert spool.free_room(root) == 0 and tiers.full() and tiers.choose(1) is None
    finally:
        umount(root)


@pytest.mark.slow
def test_store_outage_with_spool_on_a_small_file_system(tmp_path, tiny_model, s3_server, s3_bucket):
    try:
        report = run_outage(tmp_path, tiny_model, s3_server, s3_bucket, outage_seconds=10, samples=48)
    except CannotMount as exc:
        pytest.skip(str(exc))
    print("\n".join(report.lines()))
    assert report.failures == 0 and report.dead_letters == 0, report.worker_log[-3000:]
    assert report.seconds_observed_full >= 5, ("the spool was never full past the settle time: the test did not "
                                               f"test a full file system: {report.lines()}")
    assert report.jobs_taken_while_full == 0, report.lines()   # once full, the worker takes no job
    assert report.peak_spool_bytes <= report.spool_fs_bytes
    assert "No space left" not in report.worker_log or "not a failure" in report.worker_log
