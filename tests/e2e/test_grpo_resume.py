"""train.objective=grpo as a process (launch.py): a run killed with SIGKILL and run again writes the
same records as one never interrupted (the rollouts' keys are a function of (seed, step)); a reward
function that raises stops the run with exit 2 naming the function and the prompt, the checkpoint
before it intact (the run resumes from it); `sample` and `export` of the LoRA result."""

import time

import pytest
from support.cli import run_cli, start_cli
from support.grpo import overrides, write_files

from engine.runtime.rundir import read_records

STEPS = 12
RUN = ["checkpoint.every_steps=4", "checkpoint.keep=10", "log.progress=false", "log.tensorboard=false"]
TIMING = ("per_sec", "mfu", "tflops", "seconds", "eta")  # what differs between two runs of the same training


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_files(tmp_path_factory.mktemp("grpo_files"))


def args(files, workdir, steps=STEPS, reward="even_ids"):
    return ["--config", "configs/mnist_mlp.yaml", "--workdir", str(workdir), *overrides(files, steps, reward), *RUN]


def train_records(workdir):
    records = [r for r in read_records(workdir / "metrics.jsonl") if r["split"] == "train"]
    return [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in records]


def test_sigkill_then_rerun_writes_the_same_records(tmp_path, files):
    whole = run_cli(*args(files, tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr
    workdir = tmp_path / "killed"
    proc = start_cli(*args(files, workdir))
    deadline = time.time() + 240
    while not ((workdir / "metrics.jsonl").exists() and len(train_records(workdir)) >= 6):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    assert len(train_records(workdir)) < STEPS  # it really was cut short
    again = run_cli(*args(files, workdir))
    assert again.returncode == 0, again.stderr
    expected = train_records(tmp_path / "whole")
    assert [r["step"] for r in expected] == list(range(1, STEPS + 1))
    assert train_records(workdir) == expected


def test_a_raising_reward_exits_2_naming_it_and_the_checkpoint_before_stays(tmp_path, files):
    workdir = tmp_path / "run"
    first = run_cli(*args(files, workdir, steps=4, reward="broken_later"))
    assert first.returncode == 0, first.stderr
    (files[3].parent / "break").write_text("")
    try:
        failed = run_cli(*args(files, workdir, steps=8, reward="broken_later"))
    finally:
        (files[3].parent / "break").unlink()
    assert failed.returncode == 2, failed.stderr
    assert "broken_later raised ValueError: no answer field" in failed.stderr
    assert "prompt" in failed.stderr and "Traceback" not in failed.stderr
    resumed = run_cli(*args(files, workdir, steps=8, reward="broken_later"))
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from step 4" in resumed.stdout + resumed.stderr
    assert [r["step"] for r in train_records(workdir)] == list(range(1, 9))
    sampled = run_cli("sample", "--workdir", str(workdir), "--chat", "--prompt", "hello there", "--max-tokens", "4")
    assert sampled.returncode == 0 and sampled.stdout.strip(), sampled.stderr  # (the LoRA result's own sampler)
    exported = run_cli("export", "--workdir", str(workdir), "--out", str(tmp_path / "export"))
    assert exported.returncode == 0 and (tmp_path / "export" / "export.json").is_file(), exported.stderr
