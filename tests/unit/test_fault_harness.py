"""tests/support/faults.py: the faults the elastic tests inject from outside the trainer reach the
process they name, once its start has logged the step, and no sooner."""

import json
import signal
import subprocess
import sys
import time

from support.faults import FaultAt, training_process


def _log(metrics, step):
    with open(metrics, "a") as f:
        f.write(json.dumps({"step": step, "split": "train", "loss": 1.0}) + "\n")


def test_a_fault_reaches_the_named_process_once_its_start_logged_the_step(tmp_path):
    workdir, metrics = tmp_path / "run", tmp_path / "run" / "metrics.jsonl"
    workdir.mkdir()
    _log(metrics, 9)  # an earlier start's record: not this start's step
    fault = FaultAt(workdir, process=1, step=4, attempt=1)
    sleep = [sys.executable, "-c", "import time; time.sleep(60)", "--workdir", str(workdir)]
    other = subprocess.Popen([*sleep, "distributed.process_id=0"], env={"ENGINE_ELASTIC_ATTEMPT": "1"})
    earlier = subprocess.Popen([*sleep, "distributed.process_id=1"], env={"ENGINE_ELASTIC_ATTEMPT": "0"})
    target = subprocess.Popen([*sleep, "distributed.process_id=1"], env={"ENGINE_ELASTIC_ATTEMPT": "1"})
    try:
        deadline = time.time() + 10  # (a child just forked still shows pytest's cmdline until it execs)
        while training_process(workdir, 1, attempt=1) is None and time.time() < deadline:
            time.sleep(0.05)
        assert training_process(workdir, 1, attempt=1) == target.pid
        deadline = time.time() + 10
        while fault.pid is None:
            assert time.time() < deadline
            time.sleep(0.05)
        for step in (1, 2, 3):
            _log(metrics, step)
        time.sleep(0.5)
        assert target.poll() is None and not fault.done.is_set()
        _log(metrics, 4)
        assert fault.done.wait(5) and target.wait(5) == -signal.SIGKILL
        assert other.poll() is None and earlier.poll() is None  # (only the named process of that start)
    finally:
        fault.stop()
        for p in (other, earlier, target):
            p.kill()
            p.wait()
