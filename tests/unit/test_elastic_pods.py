"""fault.elastic on Kubernetes (`launch.py train --rendezvous DIR`): three supervisors stand in for
three pods on this machine; one pod's death (its supervisor and process SIGKILLed) leaves a job of
two with the unbroken run's losses, and the pod's return grows it back to three. The rendezvous
forms rounds of the live ready members, led by the lowest; the leader's accounting records the
lost processes, refuses to go on past the limits, and ends a job whose every process failed on its own."""

import json

import pytest
from support.elastic import JOB

from engine.config import load_config
from engine.elastic.pods import STOPPED, Supervisor
from engine.elastic.rendezvous import Heartbeat, Rendezvous
from engine.elastic.stores import FileBackend
from engine.errors import UsageError


@pytest.mark.nocompile
def test_the_rendezvous_forms_rounds_of_the_live_ready_members_led_by_the_lowest(tmp_path):
    now = [100.0]
    members = ("pod-1", "pod-2", "pod-10")  # (pod-10 sorts after pod-2)
    beats = {m: Heartbeat(tmp_path, m, "10.0.0.1") for m in members}
    view = {m: Rendezvous(tmp_path, m, "10.0.0.1", 3, fewest=2, clock=lambda: now[0], first=10) for m in members}
    a, b, c = (view[m] for m in members)

    def beat(*alive, seconds=0.0):
        now[0] += seconds
        for member in alive:
            beats[member].beat()

    def form(n, chosen, previous):
        return {"members": chosen, "failures": [], "coordinator": "10.0.0.1:1"}

    beat(*members)
    assert a.live() == list(members) and c.live() == list(members)
    a.ready(0), b.ready(0)
    assert a.propose(0, None) is None  # (a leader's first look: the set has not been stable yet)
    beat(*members, seconds=4)
    assert a.propose(0, None) is None  # stable, but round 0 waits for the full size a while
    c.ready(0)
    assert b.propose(0, None) is None and c.propose(0, None) is None  # only the leader forms it
    assert a.step(0, form) == (0, None) and b.step(0, form)[1]["members"] == list(members)  # full: at once
    zero = a.round(0)
    # pod-10 stops beating: it is left out; the others' round 1 forms once their set was stable for a while
    beat("pod-1", "pod-2", seconds=6)
    assert a.live() == ["pod-1", "pod-2"] and c.live() == ["pod-1", "pod-2"]  # (every reader's own clock)
    a.ready(1), c.ready(1)
    assert a.propose(1, zero) is None
    beat("pod-1", "pod-2", seconds=4)
    assert a.propose(1, zero) is None  # pod-2, alive and in round 0, is not ready yet
    b.ready(1)
    assert a.propose(1, zero) is None
    beat("pod-1", "pod-2", seconds=3)
    assert a.propose(1, zero) == ["pod-1", "pod-2"]
    a.step(1, form)
    # pod-10 comes back late: it waits for round 2, which its leader forms only once round 1 has ended
    beat(*members)
    assert b.live() == list(members)
    assert c.step(1, form) == (2, None) and c.ready_members(2) == ["pod-10"]
    a.ready(2)
    assert a.propose(2, a.round(1)) is None  # pod-2 still runs round 1
    # the leader's pod dies: pod-2 leads; a process of round 1 finished the job: the waiting pod is told
    beat("pod-2", "pod-10", seconds=6)
    assert b.live() == ["pod-2", "pod-10"]
    b.end(1, {"code": 0, "killed": False, "time": 5.0})
    n, end = c.step(2, form)
    assert end is not None and end["code"] == 0 and "the job finished" in end["end"]
    # a round that ends the job (it gave up) ends a supervisor started again after it, too
    a.publish(3, {"members": ["pod-2"], "end": "error: the job cannot go on\n", "code": 1})
    assert c.step(4, form) == (4, a.round(3))


@pytest.mark.nocompile
def test_the_leader_s_accounting_of_a_lost_pod_a_failure_of_the_job_s_own_and_the_limits(tmp_path):
    cfg = load_config(JOB[0], [*JOB[1:], "fault.max_restarts=1"], str(tmp_path / "run"))
    pods = Rendezvous(tmp_path / "rendezvous", "pod-0", "10.0.0.1", 3)
    leader = Supervisor([], cfg, pods, {})
    three = {"round": 0, "members": ["pod-0", "pod-1", "pod-2"], "failures": [], "full_since": 0}

    def ended(n, member, code, killed=False, when=10.0, hung=False, hung_step=None):
        report = {"code": code, "killed": killed, "time": when, "hung": hung}
        report.update({"hung_step": hung_step} if hung_step is not None else {})
        Rendezvous(tmp_path / "rendezvous", member, "", 3).end(n, report)

    ended(0, "pod-0", -9, killed=True), ended(0, "pod-2", -9, killed=True, when=9.5)
    one = leader.form(1, ["pod-0", "pod-2"], three)
    (failure,) = one["failures"]
    assert failure == dict(attempt=0, process=1, how=STOPPED, step=None, time=9.5, processes=3)
    assert one["coordinator"].startswith("10.0.0.1:") and "end" not in one and one["full_since"] == 0
    # a second loss with one restart allowed: the job ends, the message naming both failures
    ended(1, "pod-0", -9, killed=True)
    two = leader.form(2, ["pod-0"], {**one, "round": 1})
    assert two["code"] == 1 and "fault.max_restarts=1 restart(s) used" in two["end"]
    assert f"process 1 of 3 {STOPPED} at step 0" in two["end"]
    assert f"process 1 of 2 {STOPPED} at step 0" in two["end"]
    # every process failed on its own (a NaN stop): not restarted
    for member in three["members"]:
        ended(3, member, 1)
    again = leader.form(4, three["members"], {**three, "round": 3})
    assert again["code"] == 1 and "every one of its 3 processes exited with code 1 on its own" in again["end"]
    # one failed on its own while the others waited (stopped by their supervisors): that one is lost
    ended(5, "pod-0", -9, killed=True), ended(5, "pod-1", 1), ended(5, "pod-2", -9, killed=True)
    (alone,) = leader.form(6, three["members"], {**three, "round": 5})["failures"]
    assert (alone["process"], alone["how"]) == (1, "exited with code 1")
    ended(9, "pod-0", 1), ended(9, "pod-1", 1, hung=True), ended(9, "pod-2", -9, killed=True)  # its watchdog's exit
    (hung,) = leader.form(10, three["members"], {**three, "round": 9})["failures"]
    assert (hung["process"], hung["how"]) == (1, "hung (exited with code 1 by its watchdog)")
    # both watchdogs fired: the process whose loop is behind (step 5) hung; its peer waited for it at step 6
    ended(11, "pod-0", 1, hung=True, hung_step=6), ended(11, "pod-1", 1, hung=True, hung_step=5)
    ended(11, "pod-2", -9, killed=True)
    (behind,) = leader.form(12, three["members"], {**three, "round": 11})["failures"]
    assert (behind["process"], behind["how"]) == (1, "hung (exited with code 1 by its watchdog)")
    # a pod whose process fails again and again while the pod stays up rejoins every round at full
    # size: the restarts still count (from the last growth back), and the second ends the job
    ended(13, "pod-0", -9, killed=True), ended(13, "pod-1", -9), ended(13, "pod-2", -9, killed=True)
    first = leader.form(14, three["members"], {**three, "round": 13})
    assert "end" not in first and len(first["failures"]) == 1 and first["full_since"] == 0
    ended(14, "pod-0", -9, killed=True), ended(14, "pod-1", -9), ended(14, "pod-2", -9, killed=True)
    second = leader.form(15, three["members"], {**first, "round": 14})
    assert second["code"] == 1 and "fault.max_restarts=1 restart(s) used" in second["end"]
    # another pod was preempted (every process saved and exited 143), and came back: no failure
    for member in three["members"]:
        ended(16, member, 143)
    after = leader.form(17, three["members"], {**three, "round": 16})
    assert "end" not in after and after["failures"] == []
    # a job of two that left to grow back: the round of three says what it grew from
    for member in ("pod-0", "pod-2"):
        ended(7, member, 75, when=20.0)
    grown = leader.form(8, three["members"], {**one, "round": 7})
    assert grown["grew"] == {"time": 20.0, "processes": 2, "full": 3} and grown["full_since"] == 8
    assert grown["failures"] == one["failures"]


@pytest.mark.nocompile
def test_a_pod_restarted_under_its_name_breaks_its_round(tmp_path):
    directory = tmp_path / "rendezvous"
    cfg = load_config(JOB[0], JOB[1:], str(tmp_path / "run"))
    beats = {m: Heartbeat(directory, m, "127.0.0.1") for m in ("pod-0", "pod-1")}
    for beat in beats.values():
        beat.beat()
    me = Rendezvous(directory, "pod-0", "127.0.0.1", 2)
    supervisor = Supervisor([], cfg, me, {})
    members = ["pod-0", "pod-1"]
    started = {m: me.incarnation(m) for m in members}
    assert supervisor.broken(0, members, {}, started) == ""
    again = Heartbeat(directory, "pod-1", "127.0.0.1")  # its container restarted: a new supervisor, beating at once
    again.beat()
    assert supervisor.broken(0, members, {}, started) == f"pod-1 (process 1) {STOPPED}"


@pytest.mark.nocompile
def test_the_rendezvous_refuses_another_job_s_rounds_and_any_state_it_did_not_write(tmp_path):
    """Issue 57: a finished job's rounds ended a new job in 0.7 s (exit 0, nothing trained); a round
    without members, code or failures, a huge round number or DIR a file was a traceback."""
    mine, theirs = {"workdir": "/runs/new", "config": "b" * 16}, {"workdir": "/runs/old", "config": "a" * 16}
    old = Rendezvous(tmp_path / "dir", "pod-0", "10.0.0.1", 2, job=theirs)
    old.publish(0, {"members": ["pod-0", "pod-1"], "failures": [], "coordinator": "10.0.0.1:1"})
    old.end(0, {"code": 0, "killed": False, "time": 5.0})

    def form(n, chosen, previous):
        return {"members": chosen, "failures": [], "coordinator": "10.0.0.1:1"}

    with pytest.raises(UsageError, match=r"round 0 is another job's \(workdir /runs/old, config a+; this job"):
        Rendezvous(tmp_path / "dir", "pod-0", "10.0.0.1", 2, job=mine).step(1, form)
    same = Rendezvous(tmp_path / "dir", "pod-1", "10.0.0.1", 2, job=theirs)  # (the job itself, run again: ended)
    assert "the job finished" in same.step(1, form)[1]["end"]

    def refused(name: str, state, match: str):
        backend = FileBackend(tmp_path / name)
        backend.set_state(state if isinstance(state, bytes) else json.dumps(state).encode(), None)
        with pytest.raises(UsageError, match=match):
            view = Rendezvous(backend, "pod-0", "10.0.0.1", 2)
            view.step(view.latest() + 1, form)

    whole = {"round": 0, "members": ["pod-0"], "failures": [], "coordinator": "10.0.0.1:1"}

    def rounds(content) -> dict:
        return {"rounds": {"0": content}}

    refused("members", rounds({k: v for k, v in whole.items() if k != "members"}), r"round 0 has no 'members'")
    refused("failures", rounds({k: v for k, v in whole.items() if k != "failures"}), r"has no 'failures'")
    refused("failure", rounds({**whole, "failures": [{"process": 1}]}), r"has a failure .* without")
    refused("members-kind", rounds({**whole, "members": "pod-0"}), r"has 'members' = 'pod-0', not a list")
    refused("code", rounds({"round": 0, "end": "error: it ended\n"}), r"round 0 has no 'code'")
    refused("text", b"{", r"the state does not read as JSON")
    refused("list", b"[]", r"the state is not a JSON object")
    refused("section", {"rounds": []}, r"the state has 'rounds' that is not an object")
    refused("entry", {"ready": {"0": ["pod-0"]}}, r"the state has 'ready.0' that is not an object")
    refused("huge", {"rounds": {"9" * 200: whole}}, r"beyond 1000000000")
    # a digit Python's str.isdigit() takes and int() does not (a traceback, ValueError): not a round, nor a member
    digits = FileBackend(tmp_path / "digits")
    live = {"\u00b2": {"beat": 1, "time": 1.0}}
    digits.set_state(json.dumps({"rounds": {"\u00b2": whole}, "members": live, "ready": {"0": live}}).encode(), None)
    view = Rendezvous(digits, "pod-0", "10.0.0.1", 2)
    assert (view.latest(), view.live(), view.ready_members(0)) == (-1, ["\u00b2"], ["\u00b2"])
    report = FileBackend(tmp_path / "report")
    Rendezvous(report, "pod-0", "10.0.0.1", 2).publish(0, {k: v for k, v in whole.items() if k != "round"})
    state, token = report.get_state()
    report.set_state(json.dumps({**json.loads(state), "ended": {"0": {"pod-0": {"killed": False}}}}).encode(), token)
    with pytest.raises(UsageError, match=r"the report of pod-0 on round 0 has no 'code'"):
        Rendezvous(report, "pod-0", "10.0.0.1", 2).step(1, form)
    (tmp_path / "file").write_text("not a directory\n")
    with pytest.raises(UsageError, match=r"--rendezvous .*file: not a directory this pod can use"):
        Rendezvous(tmp_path / "file", "pod-0", "10.0.0.1", 2)
    (tmp_path / "folder" / "state.json").mkdir(parents=True)
    with pytest.raises(UsageError, match=r"state.json is a directory"):
        Rendezvous(tmp_path / "folder", "pod-0", "10.0.0.1", 2).latest()


@pytest.mark.nocompile
def test_the_leader_names_a_coordinator_on_its_pod_for_each_smaller_job_s_precompile(tmp_path):
    cfg = load_config(JOB[0], [*JOB[1:], "fault.precompile=true"], str(tmp_path / "run"))
    pods = Rendezvous(tmp_path / "rendezvous", "pod-0", "10.0.0.1", 3)
    leader = Supervisor([], cfg, pods, {1: [], 2: ["mesh.data=2"], 3: []})  # (the shrink plan's sizes)
    first = leader.form(0, ["pod-0", "pod-1", "pod-2"], None)["precompile"]
    assert sorted(first) == ["1", "2"] and all(a.startswith("10.0.0.1:") for a in first.values())
    assert leader.form(1, ["pod-0", "pod-2"], None)["precompile"].keys() == {"1"}
