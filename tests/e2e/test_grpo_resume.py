"""train.objective=grpo as a process (launch.py): a run killed with SIGKILL and run again writes the
same records as one never interrupted (the rollouts' keys are a function of (seed, step)); a reward
function that raises stops the run with exit 2 naming the function and the prompt, the checkpoint
before it intact (the run resumes from it); `sample` and `export` of the LoRA result."""

import time

import pytest
from support.cli import child_env, start_cli
from support.grpo import overrides, write_files
from support.one_process import run_steps

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
    workdir = tmp_path / "killed"
    proc = start_cli(*args(files, workdir))
    deadline = time.time() + 240
    while not ((workdir / "metrics.jsonl").exists() and len(train_records(workdir)) >= 6):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    assert len(train_records(workdir)) < STEPS  # it really was cut short
    # the same command again, then a run never killed: both through the CLI's main in one process
    steps = [{"argv": args(files, workdir)}, {"argv": args(files, tmp_path / "whole")}]
    for result in run_steps(tmp_path, steps, env=child_env({"HOME": str(tmp_path)})):
        assert result["code"] == 0 and not result["escaped"], result["escaped"] or result["stderr"][-3000:]
    expected = train_records(tmp_path / "whole")
    assert [r["step"] for r in expected] == list(range(1, STEPS + 1))
    assert train_records(workdir) == expected


def test_a_raising_reward_exits_2_naming_it_and_the_checkpoint_before_stays(tmp_path, files):
    """Its five command lines through the CLI's main in one process (tests/support/one_process.py)."""
    workdir, broken = tmp_path / "run", files[3].parent / "break"
    first, failed, resumed, sampled, exported = run_steps(
        tmp_path,
        [
            {"argv": args(files, workdir, steps=4, reward="broken_later")},
            {"argv": args(files, workdir, steps=8, reward="broken_later"), "create": str(broken)},
            {"argv": args(files, workdir, steps=8, reward="broken_later"), "remove": str(broken)},
            {"argv": ["sample", "--workdir", str(workdir), "--chat", "--prompt", "hello there", "--max-tokens", "4"]},
            {"argv": ["export", "--workdir", str(workdir), "--out", str(tmp_path / "export")]},
        ],
        env=child_env({"HOME": str(tmp_path)}),
    )
    assert first["code"] == 0 and not first["escaped"], first["escaped"] or first["stderr"]
    assert failed["code"] == 2 and not failed["escaped"], failed["escaped"] or failed["stderr"]
    assert "broken_later raised ValueError: no answer field" in failed["stderr"]
    assert "prompt" in failed["stderr"] and "Traceback" not in failed["stderr"]
    assert resumed["code"] == 0 and not resumed["escaped"], resumed["escaped"] or resumed["stderr"]
    assert "resuming from step 4" in resumed["stdout"] + resumed["stderr"]
    assert [r["step"] for r in train_records(workdir)] == list(range(1, 9))
    assert sampled["code"] == 0 and sampled["stdout"].strip(), sampled["stderr"]  # (the LoRA result's own sampler)
    assert exported["code"] == 0 and (tmp_path / "export" / "export.json").is_file(), exported["stderr"]
