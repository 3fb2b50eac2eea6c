"""Faults and abuse, storage: damaged checkpoints and metrics files, changed parameter dtypes
and optimizers on resume, a full disk and a read-only one. Each test reproduces one way real
runs break on disk and checks that the run names it, keeps what it had and resumes exactly."""

import json
import os
import subprocess
from pathlib import Path

import pytest
from support.cli import run_cli
from support.configs import RATES


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_is_set_aside_and_saved_again(tmp_path):
    """Before: resumed from the step before, then failed on every re-run with orbax's
    StepAlreadyExistsError when training reached the damaged step again."""
    workdir = tmp_path / "run"
    args = [
        "--config",
        "configs/mnist_mlp.yaml",
        "--workdir",
        str(workdir),
        "train.steps=20",
        "checkpoint.every_steps=10",
        "log.progress=false",
        "log.tensorboard=false",
        "log.every_steps=10",
    ]
    assert run_cli(*args).returncode == 0
    state = workdir / "checkpoints" / "20" / "state"
    biggest = max((p for p in state.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    os.truncate(biggest, 1000)
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "moved the unreadable checkpoint" in proc.stderr
    (aside,) = [p for p in (workdir / "checkpoints" / "damaged").iterdir() if p.is_dir()]
    assert aside.name.startswith("20-") and (aside.parent / f"{aside.name}.reason.txt").read_text().strip()
    assert (workdir / "checkpoints" / "20").is_dir()  # saved again
    again = run_cli(*args)
    assert again.returncode == 0 and "already finished" in again.stdout + again.stderr, again.stderr


def test_a_flipped_bit_in_a_checkpoint_is_caught_by_its_checksums(make_config, tmp_path, capsys):
    """Before: one flipped byte in a data file restored without a word (an optimizer moment
    changed). Each complete step now has a SHA256SUMS; a mismatch sets the step aside and the
    run resumes from the step before."""
    from engine.run.single import fit

    workdir = tmp_path / "run"
    args = ["mesh.num_devices=1", "log.every_steps=10", "checkpoint.every_steps=10", "eval.every_steps=0"]
    fit(make_config("mnist_mlp.yaml", *args, "train.steps=20", workdir=workdir))
    step20 = workdir / "checkpoints" / "20"
    sums = (step20 / "SHA256SUMS").read_text().splitlines()
    assert len(sums) == sum(1 for p in step20.rglob("*") if p.is_file()) - 1  # every file but itself
    subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=step20, check=True)  # the standard format
    data = max((p for p in (step20 / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    capsys.readouterr()
    resumed = fit(make_config("mnist_mlp.yaml", *args, "train.steps=30", workdir=workdir))
    err = capsys.readouterr().err
    assert "does not match its checksum in SHA256SUMS" in err and "moved the unreadable checkpoint" in err, err
    assert min(resumed.losses) == 11  # from step 10: the damaged step 20 was not used
    (aside,) = [p for p in (workdir / "checkpoints" / "damaged").iterdir() if p.is_dir()]
    assert aside.name.startswith("20-") and (aside / "SHA256SUMS").is_file()
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == [10, 20, 30]


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs (root may mount one here; elsewhere the test is skipped), unmounted after."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("mounting a tmpfs needs root")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def _fill(disk, leave: int) -> Path:
    filler = disk / "filler"
    filler.write_bytes(b"\0" * max(os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize - leave, 0))
    return filler


@pytest.mark.slow
def test_a_full_disk_is_one_error_and_the_run_resumes_exactly_once_space_is_freed(make_config, tmp_path, small_disk):
    """Before: 54 tracebacks, and a re-run while still full left a 0-byte metrics.tmp."""
    from engine.run.single import fit
    from engine.runtime.rundir import StorageError, read_records

    args = ["mesh.num_devices=1", "log.every_steps=10", "checkpoint.every_steps=10", "eval.every_steps=0"]
    workdir = small_disk / "run"
    fit(make_config("mnist_mlp.yaml", *args, "train.steps=20", workdir=workdir))
    filler = _fill(small_disk, leave=60_000)  # room for the records, not for the next checkpoint
    with pytest.raises(
        StorageError,
        match=r"cannot write to .*/run while saving a checkpoint: no space left; "
        r"[\d.]+ KiB free of 3.0 MiB; free some space",
    ):
        fit(make_config("mnist_mlp.yaml", *args, "train.steps=60", workdir=workdir))
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["10", "20"]  # no partial save left
    assert not [p for p in workdir.iterdir() if p.name.endswith(".tmp")]
    assert (workdir / "metrics.jsonl").read_text().endswith("\n")  # no half-written record
    filler.unlink()
    resumed = fit(make_config("mnist_mlp.yaml", *args, "train.steps=60", workdir=workdir))
    reference = fit(make_config("mnist_mlp.yaml", *args, "train.steps=60", workdir=tmp_path / "reference"))
    assert resumed.losses == {step: reference.losses[step] for step in range(21, 61)}

    def strip(records):
        return [{k: v for k, v in r.items() if k not in RATES} for r in records if r["split"] == "train"]

    assert strip(read_records(workdir / "metrics.jsonl")) == strip(
        read_records(tmp_path / "reference" / "metrics.jsonl")
    )


@pytest.mark.slow
def test_a_full_disk_stops_a_vectorised_group_with_one_error(make_config, small_disk):
    from engine.run.group import fit_group
    from engine.runtime.rundir import StorageError

    args = ["mesh.num_devices=1", "log.every_steps=10", "checkpoint.every_steps=10", "eval.every_steps=0"]

    def configs(steps):
        return [
            make_config(
                "mnist_mlp.yaml",
                *args,
                f"train.steps={steps}",
                f"optimizer.learning_rate={lr}",
                workdir=small_disk / f"run{i}",
            )
            for i, lr in enumerate((1e-3, 2e-3))
        ]

    fit_group(configs(20))
    _fill(small_disk, leave=60_000)
    with pytest.raises(StorageError, match=r"cannot write to .*/disk while .*: no space left; .* free some space"):
        fit_group(configs(60))
    for i in range(2):  # each run keeps its newest complete checkpoint, no partial save
        assert sorted(p.name for p in (small_disk / f"run{i}" / "checkpoints").iterdir()) == ["10", "20"]


def test_a_read_only_workdir_is_refused_before_compiling(small_disk):
    """Before: an OSError traceback from the lock file."""
    (small_disk / "run").mkdir()
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    for workdir in (small_disk / "run", small_disk / "new"):
        proc = run_cli("--config", "configs/mnist_mlp.yaml", "--workdir", str(workdir), "train.steps=5")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert f"cannot write to {workdir} while claiming the workdir: read-only file system" in proc.stderr
        assert "give a --workdir you can write to" in proc.stderr and "compile" not in proc.stdout + proc.stderr


@pytest.mark.nocompile
def test_a_record_that_meets_a_full_disk_is_not_left_half_written(small_disk):
    """A text-mode append flushes into the full disk before it can truncate: the file would
    end mid-line, and the next record, once space is freed, would be glued to it."""
    from engine.runtime.rundir import append_line, read_records

    path = small_disk / "metrics.jsonl"
    filler = _fill(small_disk, leave=4096)
    with pytest.raises(OSError):
        for step in range(1, 10):  # records of 3 kB until the disk is full
            append_line(path, json.dumps({"step": step, "split": "train", "pad": "x" * 3000}) + "\n")
    assert path.read_bytes().endswith(b"\n")  # whole records only
    filler.unlink()
    append_line(path, json.dumps({"step": 99, "split": "train", "loss": 0.5}) + "\n")
    steps = [r["step"] for r in read_records(path)]
    assert steps[-1] == 99 and steps == list(range(1, len(steps))) + [99]
