"""The elastic launchers' refusals, each one line and exit 2 before anything starts, from the command
line in this process (engine/cli: as launch.py runs it; the e2e tests keep one refusal of each
launcher through launch.py in a subprocess): a local job's usage errors, one whose layout cannot
shrink or whose grow request is a directory, a pod's supervisor without what it needs, the SLURM
driver outside an allocation or without fault.elastic."""

import pytest
from support.elastic import JOB

from engine.cli import main

SLURM = ["--config", "configs/mnist_mlp.yaml", "train.steps=8", "train.global_batch_size=32", "fault.elastic=true"]


def refused(capsys, *argv) -> str:
    """The error line of `launch.py ARGV`, which must exit 2."""
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2, err
    return err


def local(tmp_path, *overrides, processes, devices=2):
    flags = ["--local-processes", str(processes), "--devices-per-process", str(devices)]
    return ["--config", JOB[0], "--workdir", str(tmp_path / "run"), *flags, *JOB[1:], *overrides]


def test_a_local_job_whose_layout_cannot_shrink_or_whose_grow_request_is_a_directory(tmp_path, capsys):
    err = refused(capsys, *local(tmp_path, "train.global_batch_size=64", processes=4))
    assert "cannot go on with 3 processes (6 devices)" in err
    assert "make train.global_batch_size (and eval.batch_size) a multiple of 24" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no process was started
    (tmp_path / "run" / "grow-request.json").mkdir(parents=True)
    err = refused(capsys, *local(tmp_path, processes=2, devices=1))
    assert err.count("\n") == 1 and err.startswith("error: ") and "grow-request.json is not a regular file" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_pod_s_supervisor_is_refused_without_what_it_needs(tmp_path, capsys):
    flags = ["train", "--rendezvous", str(tmp_path / "rendezvous"), "--member", "pod-0", "--workdir", str(tmp_path)]
    assert "needs fault.elastic=true; add fault.elastic=true" in refused(
        capsys, *flags, "--processes", "3", "--config", *JOB[:-1]
    )
    assert "--rendezvous needs --processes N" in refused(capsys, *flags, "--config", *JOB)
    local = refused(capsys, *flags, "--processes", "3", "--local-processes", "3", "--config", *JOB)
    assert "drop --rendezvous or the other flag" in local
    odd = [*flags[:3], "--member", "pod/0", "--workdir", str(tmp_path), "--processes", "3", "--config", *JOB]
    assert "--member 'pod/0': a member id is letters" in refused(capsys, *odd)
    shrink = [*flags, "--processes", "4", "--devices-per-process", "2", "--config", *JOB, "train.global_batch_size=64"]
    assert "cannot go on with 3 processes (6 devices)" in refused(capsys, *shrink)
    assert not (tmp_path / "rendezvous" / "state.json").exists()  # (refused before joining)


def test_the_slurm_driver_is_refused_without_fault_elastic_or_outside_an_allocation(tmp_path, capsys, monkeypatch):
    workdir = str(tmp_path / "run")

    def driver(*args, config=SLURM, **env):
        for name in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_NTASKS"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        return refused(capsys, "train", "--elastic", *args, "--workdir", workdir, *config)

    assert "needs fault.elastic=true; add fault.elastic=true" in driver(config=SLURM[:-1], SLURM_JOB_ID="7")
    assert "runs inside a SLURM allocation (an sbatch script" in driver()
    assert "not under srun" in driver(SLURM_JOB_ID="7", SLURM_STEP_ID="0")
    assert "the allocation has 1 task; ask for several" in driver(SLURM_JOB_ID="7", SLURM_NTASKS="1")
    assert "drop --elastic" in driver("--local-processes", "2")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (["fault.max_restarts=-1"], "fault.max_restarts=-1 must be 0 or more"),
        (["checkpoint.local_dir=relative/x", "checkpoint.local_every_steps=2"], "must be an absolute path"),
        (["checkpoint.local_dir=/proc/nope/x", "checkpoint.local_every_steps=2"], "cannot be created"),
        (["--local-processes", "100000"], "--local-processes 100000: this host holds at most"),
    ],
    ids=["fault-value", "relative-local-dir", "local-dir-uncreatable", "too-many"],
)
def test_a_local_job_s_usage_error_is_one_line_and_exit_2_before_any_process_starts(
    tmp_path, capsys, overrides, reason
):
    """(A batch that does not divide, through launch.py: tests/e2e/test_multiprocess.py.)"""
    args = ["--config", "configs/mnist_mlp.yaml", "--workdir", str(tmp_path / "run"), "--local-processes", "2"]
    err = refused(capsys, *args, *overrides)
    assert err.count("\n") == 1 and err.startswith("error: ") and reason in err, err
    assert not (tmp_path / "run").exists()  # no process started, nothing written
