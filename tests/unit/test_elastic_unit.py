"""fault.elastic on the local launcher: a SIGKILLed process's job goes on with the processes left, from
the local tier, with the unbroken run's losses; its failures recorded; a job that cannot go on ends
with exit 1 naming them; a failure every process meets (a NaN stop) is not restarted; a layout that
cannot shrink is refused at start."""

import json
import os
import time
from pathlib import Path

import pytest
from support.elastic import JOB

from engine.config import load_config
from engine.elastic.accounting import JOB as JOB_VARIABLE
from engine.elastic.accounting import lost
from engine.elastic.shrink import shrink_plan
from engine.observe.perf import Goodput
from engine.runtime.restart_protocol import job_so_far
from engine.runtime.rundir import drop_records_after, read_records


@pytest.mark.nocompile
def test_the_shrink_plan_and_the_accounting(tmp_path):
    def plan(*overrides, processes=4):
        return shrink_plan(load_config(JOB[0], [*JOB[1:], *overrides]), processes, 2)

    assert plan() == {1: [], 2: [], 3: []}  # mesh.data=-1 takes the devices left
    assert plan("mesh.data=8", "fault.min_processes=3") == {3: ["mesh.data=6"]}
    assert plan("mesh.data=-1", "mesh.fsdp=2", "mesh.dcn_data=4", "fault.min_processes=2") == {
        2: ["mesh.dcn_data=2"],
        3: ["mesh.dcn_data=3"],
    }
    with pytest.raises(ValueError, match="mesh.fsdp=-1 would take the devices"):
        plan("mesh.data=1", "mesh.fsdp=-1")
    with pytest.raises(ValueError, match="fault.min_processes=4 leaves no smaller job"):
        plan("fault.min_processes=4")
    # a resume keeps the failures' records, and a restarted job's lost time is badput
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": s, "split": "train", "loss": 1.0} for s in (1, 2, 3)] + [{"step": 3, "split": "recovery"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert drop_records_after(path, 1) == 2
    assert [r["split"] for r in read_records(path)] == ["train", "recovery"]
    summary = Goodput(started=100.0, recovery_seconds=5.0, loop_seconds=10.0, steps_run=10).summary(115.0)
    assert summary["wall_seconds"] == 20.0 and summary["badput_recovery"] == 0.25 and summary["goodput"] == 0.5


@pytest.mark.nocompile
def test_an_elastic_job_s_summary_covers_all_its_starts(monkeypatch):
    """Issue 53: the summary of a job that restarted and grew back covered only its last start."""
    monkeypatch.setenv(JOB_VARIABLE, json.dumps({"started": 100.0, "recovery": 6.0}))
    recovery, earlier = job_so_far(150.0, 4.0)  # this start at 150 s, 4 s after its failure; 6 s of gaps before
    assert (recovery, earlier) == (10.0, 40.0)
    goodput = Goodput(started=150.0, recovery_seconds=recovery, earlier_seconds=earlier, loop_seconds=20, steps_run=10)
    summary = goodput.summary(200.0)
    assert summary["wall_seconds"] == 100.0 and summary["badput_recovery"] == 0.1
    assert summary["badput_earlier_starts"] == 0.4 and summary["goodput"] == 0.2
    monkeypatch.delenv(JOB_VARIABLE)  # a job of one start
    assert job_so_far(150.0, 4.0) == (4.0, 0.0)


@pytest.mark.nocompile
def test_only_a_lost_process_restarts_the_job():
    # (process, return code, time) of the failures seen before the others were stopped, of 3 processes
    killed = [(1, -9, 5.0)]
    assert lost(killed, 3, hung=[]) == (killed, "")
    assert lost([(0, 1, 5.0), (2, -11, 5.1)], 3, hung=[]) == ([(2, -11, 5.1)], "")  # the signal's, not the first
    # process 0 killed: its coordination service went with it and its peers abort at once
    assert lost([(0, -9, 5.0), (1, -6, 5.0), (2, -6, 5.1)], 3, hung=[]) == ([(0, -9, 5.0)], "")
    assert lost([(1, -6, 5.0), (2, -6, 5.1)], 3, hung=[]) == ([(1, -6, 5.0)], "")  # (aborts alone: the first)
    assert lost([(2, 1, 5.0)], 3, hung=[]) == ([(2, 1, 5.0)], "")  # alone: the others waited until stopped
    assert lost([(1, 1, 5.0), (0, 1, 5.2)], 3, hung=[]) == ([(1, 1, 5.0)], "")  # a strict subset
    assert lost([(1, 1, 5.0), (0, 1, 5.0)], 2, hung=[1]) == ([(1, 1, 5.0)], "")  # its watchdog's exit
    # the hung process's peer died of SIGABRT first (the coordination service missed it): the hang is blamed
    assert lost([(0, -6, 5.0), (1, 1, 5.1)], 2, hung=[1]) == ([(1, 1, 5.1)], "")
    assert lost([(0, -6, 5.0)], 2, hung=[1]) == ([(1, 1, 5.0)], "")  # (stopped before its watchdog's exit)
    # every process failed on its own (a NaN stop, a traceback, a bad input): the job's failure, not restarted
    gone, why = lost([(0, 1, 5.0), (1, 1, 5.1), (2, 1, 5.1)], 3, hung=[])
    assert gone == [] and "every one of its 3 processes exited with code 1 on its own" in why
    assert "not restarted" in why
    assert lost([(0, 1, 5.0), (1, -15, 5.1)], 2, hung=[])[0] == []  # (a SIGTERM is a stop's, not a loss)
    # a peer's SIGABRT seconds after a process failed alone (its coordination service missed it): a consequence
    assert lost([(0, 1, 5.0), (1, -6, 7.0)], 2, hung=[]) == ([(0, 1, 5.0)], "")
    assert lost([(0, 1, 5.0), (1, -6, 7.0)], 2, hung=[0]) == ([(0, 1, 5.0)], "")  # the watchdog's, not the abort
    # process 1 SIGKILLed, its exit seen after process 0's abort (the coordination service missed it): 1 is lost
    assert lost([(0, -6, 5.0), (1, -9, 5.9)], 2, hung=[]) == ([(1, -9, 5.9)], "")
    assert lost([(0, -6, 5.0), (2, -6, 5.0), (1, -9, 6.2)], 3, hung=[]) == ([(1, -9, 6.2)], "")
    # process 2 failed on its own (a traceback; it exits at once now), process 0 aborted a moment later
    assert lost([(2, 1, 5.0), (0, -6, 5.2)], 4, hung=[]) == ([(2, 1, 5.0)], "")


@pytest.mark.nocompile
def test_the_hung_process_is_the_one_behind_its_peers(tmp_path):
    from engine.elastic.accounting import hung_processes
    from engine.runtime.watchdog import REACHED

    def hang(name: str, process: int, step, when: float) -> Path:
        path = tmp_path / name
        reached = f"; {REACHED} {step}" if step is not None else ""
        path.write_text(f"no progress for 5s while training (watchdog.step=4); process {process}, pid 7{reached}\n\n")
        os.utime(path, (when, when))
        return path

    ahead = hang("hang-1-process2.txt", 2, 6, 99.0)  # its peers went on to step 6 and wait there for process 1
    behind = hang("hang-2-process1.txt", 1, 5, 101.0)
    early = hang("hang-0.txt", 0, 6, 98.0)
    hang("hang-evaluator-0.txt", 0, 1, 97.0)
    assert hung_processes([ahead, behind, early, tmp_path / "hang-evaluator-0.txt"]) == [
        (1, behind),
        (0, early),
        (2, ahead),
    ]
    starting = hang("hang-3-process3.txt", 3, None, 90.0)  # (hung before its first step: after those that began)
    assert hung_processes([starting, early]) == [(0, early), (3, starting)]


@pytest.mark.nocompile
def test_a_firing_watchdog_s_census_names_the_peer_behind_it(tmp_path):
    """Process 0's watchdog fires first (it waits for process 1 in a collective) and would take
    process 1 down with it: its census gets process 1's state first, and process 1 is blamed."""
    import time

    from engine.elastic.accounting import hung_processes
    from engine.runtime.watchdog import CENSUS_SECONDS, Watchdog

    asker = Watchdog({}, tmp_path, process_index=0, processes=2)
    peer = Watchdog({"step": 600}, tmp_path, process_index=1, processes=2)  # (its main thread: stuck)
    try:
        asker.beat(5)
        peer.beat(4)  # its loop began step 4 and went no further
        stuck = tmp_path / "hang-1.txt"
        stuck.write_text(asker._state("step", 4.0, 4) + "\n\n")
        began = time.monotonic()
        asker._census()  # answered by the peer's watchdog thread, which polls once a second
        assert time.monotonic() - began < CENSUS_SECONDS
        (answer,) = tmp_path.glob("hang-status-*-process1.txt")
        assert "process 1, pid" in answer.read_text() and "its loop last began step 4" in answer.read_text()
        assert [process for process, _ in hung_processes([stuck, answer])] == [1, 0]
        asker._census()  # a second census (a later hang) is answered too; the first is not answered twice
        assert len(peer.answered) == 2 and len(list(tmp_path.glob("hang-status-*-process1.txt"))) >= 1
    finally:
        asker.close()
        peer.close()


@pytest.mark.nocompile
def test_max_restarts_counts_the_restarts_since_the_job_last_ran_at_its_full_size():
    from types import SimpleNamespace

    from engine.elastic.accounting import restart_limit, restarts

    fault = SimpleNamespace(max_restarts=2, min_processes=1)
    failures = [{"attempt": a} for a in (0, 1, 3, 5)]  # failed starts 0 and 1; start 2 grew back; 3 failed; ...
    assert restarts(failures, 0) == 4 and restarts(failures, 2) == 2 and restarts(failures, 4) == 1
    assert restart_limit(fault, restarts(failures, 0) - 1, 3) == "fault.max_restarts=2 restart(s) used"
    assert restart_limit(fault, restarts(failures, 4) - 1, 3) == ""  # since the growth at start 4: one restart
    assert "fewer than fault.min_processes=1" in restart_limit(fault, 0, 0)


@pytest.mark.nocompile
def test_after_a_peer_s_abort_the_launcher_waits_for_the_exit_of_the_process_that_caused_it():
    """Issue 57.16: process 0 aborted (SIGABRT: the coordination service lost process 1), and process
    1's own SIGKILL is seen 0.3 s later; the launcher waits for it (ABORT_SETTLE_SECONDS) before it
    stops the others, so that lost() blames process 1. An exit code alone is not waited for."""
    from engine.runtime.launcher import _settle

    class Child:
        def __init__(self, code, after):
            self.code, self.at = code, time.monotonic() + after

        def poll(self):
            return self.code if time.monotonic() >= self.at else None

    seen = [(0, -6, time.time())]
    more = _settle([Child(-6, 0), Child(-9, 0.3), Child(None, 0)], seen, settle=0)
    assert more == [(1, -9)] and [index for index, *_ in seen] == [0, 1]
    assert lost(seen, 3, hung=[])[0] == [seen[1]]
    started = time.monotonic()  # (a process's exit code, no abort: the others are stopped at once)
    assert _settle([Child(1, 0), Child(-9, 0.3), Child(None, 0)], [(0, 1, time.time())], settle=0) == []
    assert time.monotonic() - started < 0.2
