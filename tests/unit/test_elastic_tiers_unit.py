"""The elastic tests' lost local tier (tests/support/faults.py drop_local_tier, injected from
outside the trainer after a SIGKILL): a lost host's own folder, or every copy of its shards."""

from support.faults import drop_local_tier


def test_the_test_s_lost_local_tier_in_both_forms(tmp_path):
    run = tmp_path / "shm" / "run-0123456789"

    def left(process, which):
        for holder, owner in [(0, 0), (0, 1), (1, 1), (1, 0)]:
            (run / f"process_{holder}" / f"owner_{owner}").mkdir(parents=True, exist_ok=True)
        drop_local_tier(tmp_path / "shm", process, which)
        return sorted(str(f.relative_to(run)) for f in run.glob("process_*/owner_*"))

    assert left(1, "own") == ["process_0/owner_0", "process_0/owner_1"]
    assert left(1, "all") == ["process_0/owner_0"]
    assert left(0, "own") == ["process_1/owner_0", "process_1/owner_1"]
