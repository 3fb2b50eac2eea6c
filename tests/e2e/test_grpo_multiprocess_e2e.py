"""train.objective=grpo in a job of several processes (gloo collectives on CPU): each process samples
its rows of the batch on the run's mesh, process 0 alone calls the reward functions and broadcasts
their numbers, so 2 processes x 1 device write the records 1 process x 2 devices writes; a reward
function's error on process 0 reaches every process (no process waits for rewards that never come)."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from support.cli import child_env, run_cli
from support.configs import ROOT
from support.grpo import overrides, write_files

from engine.runtime.launcher import free_port
from engine.runtime.rundir import read_records

pytestmark = pytest.mark.multiprocess

STEPS = 2
TIMING = ("per_sec", "mfu", "tflops", "seconds", "eta")  # what differs between two runs of the same training
LOGGED = """import os

import jax


def even_ids_logged(prompts, completions, completion_ids, **fields):
    with open(os.path.join(os.path.dirname(__file__), "calls.txt"), "a") as calls:
        calls.write(f"{jax.process_index()}\\n")
    return [sum(i % 2 == 0 for i in ids) / max(len(ids), 1) for ids in completion_ids]
"""


def train_records(workdir):
    records = [r for r in read_records(workdir / "metrics.jsonl") if r["split"] == "train"]
    return [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in records]


def test_two_processes_sample_and_train_as_one_and_score_on_process_0(tmp_path):
    files = write_files(tmp_path)
    rewards = tmp_path / "logged.py"
    rewards.write_text(LOGGED)
    args = [
        "--config",
        "configs/mnist_mlp.yaml",
        *overrides(files, STEPS),
        f"grpo.rewards=[{rewards}:even_ids_logged]",
        "mesh.num_devices=2",
        "mesh.data=2",
        "log.progress=false",
        "log.tensorboard=false",
    ]
    two = run_cli(*args, "--workdir", str(tmp_path / "two"), "--local-processes", "2", timeout=400)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    calls = (tmp_path / "calls.txt").read_text().split()
    assert calls == ["0"] * (STEPS + 1)  # one call a step and one for the final eval, on process 0 alone
    one = run_cli(
        *args, "--workdir", str(tmp_path / "one"), env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    )
    assert one.returncode == 0, one.stderr[-3000:]
    a, b = train_records(tmp_path / "two"), train_records(tmp_path / "one")
    assert [r["step"] for r in a] == list(range(1, STEPS + 1)) and [r["step"] for r in b] == [r["step"] for r in a]
    for name in ("loss", "reward", "reward_std", "completions/mean_length", "rewards/even_ids_logged/mean"):
        np.testing.assert_allclose([r[name] for r in a], [r[name] for r in b], rtol=1e-5, err_msg=name)
    assert len({r["reward"] for r in a}) > 1  # (rewards that differ: the comparison says something)
    (evaluated,) = [r for r in read_records(tmp_path / "two" / "metrics.jsonl") if r["split"] == "eval"]
    (alone,) = [r for r in read_records(tmp_path / "one" / "metrics.jsonl") if r["split"] == "eval"]
    assert evaluated["reward"] == pytest.approx(alone["reward"], rel=1e-6)


SCORING = """
import sys

import jax
import numpy as np

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
from engine.errors import UsageError
from engine.objectives.grpo_rollout import scored_on_process_0


def score():
    if jax.process_index() != 0:
        raise AssertionError("scored on process 1")
    return np.array([[0.1, np.nan], [1.0 / 3.0, -2.0]])


def broken():
    if jax.process_index() != 0:
        raise AssertionError("scored on process 1")
    raise UsageError("grpo.rewards: reward function rewards.py:broken raised ValueError: no answer (prompt 'hi')")


print(repr(scored_on_process_0(score, (2, 2)).tolist()), flush=True)
try:
    scored_on_process_0(broken, (2, 2))
except UsageError as e:
    print(f"UsageError: {e}", flush=True)
    sys.exit(2)
"""


def test_process_0_scores_alone_and_its_error_reaches_the_others():
    """scored_on_process_0 between two bare processes: process 0's numbers reach process 1 bit for
    bit (float64, NaN kept); then process 0's UsageError ends process 1 too, with the same message."""
    address = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(SCORING), address, str(index)],
            cwd=ROOT,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for index in range(2)
    ]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    lines = [
        [line for line in out.splitlines() if not line.startswith("[Gloo]")] + [err[-2000:]] for out, err in outputs
    ]
    assert [proc.returncode for proc in procs] == [2, 2], lines
    assert all(said[0] == repr([[0.1, float("nan")], [1.0 / 3.0, -2.0]]) for said in lines), lines
    assert all("rewards.py:broken raised ValueError" in said[1] and "prompt 'hi'" in said[1] for said in lines), lines
