"""fault.elastic's recoveries by tier and by kind: a lost host's local tier (the peer's copy, then the
persistent tier) with the losses of a run resumed by hand, and a hung process ended by its watchdog,
with its smaller job precompiled in the background (fault.precompile)."""

import pytest
from support.elastic import JOB

from engine.config import load_config
from engine.elastic.precompile import drop_local_tier


@pytest.mark.nocompile
def test_the_test_s_lost_local_tier_in_every_form_of_the_kill_variable(tmp_path, monkeypatch):
    local = [f"checkpoint.local_dir={tmp_path / 'shm'}", "checkpoint.local_every_steps=2"]
    cfg = load_config(JOB[0], [*JOB[1:], *local], str(tmp_path / "run"))
    run = tmp_path / "shm" / "run-0123456789"

    def left(kill, attempt=0):
        for process, owner in [(0, 0), (0, 1), (1, 1), (1, 0)]:
            (run / f"process_{process}" / f"owner_{owner}").mkdir(parents=True, exist_ok=True)
        monkeypatch.setenv("ENGINE_TEST_KILL_AT", kill)
        drop_local_tier(cfg, attempt)
        return sorted(str(f.relative_to(run)) for f in run.glob("process_*/owner_*"))

    everything = ["process_0/owner_0", "process_0/owner_1", "process_1/owner_0", "process_1/owner_1"]
    for kept in ("1:7", "1:7:0", "1", "1:7:1:own", "2:7,1:7:0"):  # (no local field, or another start)
        assert left(kept) == everything, kept
    assert left("1:7:1:own", attempt=1) == ["process_0/owner_0", "process_0/owner_1"]
    assert left("0:3,1:7:0:all") == ["process_0/owner_0"]
