"""The local checkpoint tier (checkpoint.local_dir): frequent saves of each process's shards to
node-local storage and a peer's, restored when newer than the persistent tier, bit-identically;
a lost host's shards from its peer's copy, on the same process count or resharded onto another
(local_reshard.py); an owner whose copies are all lost falls back to the persistent tier."""

import json
import shutil

import pytest
from support.cli import run_cli, start_cli, wait_until
from support.configs import QUIET
from support.in_process import train_here
from support.local_tier import local_steps

from engine.checkpoint.local_tier import run_directory
from engine.checkpoint.peers import HOST_VARIABLE
from engine.runtime.rundir import read_records


def losses(workdir):
    return [(r["step"], r["loss"]) for r in read_records(workdir / "metrics.jsonl") if r["split"] == "train"]


RUN = [
    *QUIET,
    "--config",
    "configs/mnist_mlp.yaml",
    "log.every_steps=1",
    "eval.every_steps=0",
    "train.steps_per_call=1",
]


@pytest.mark.slow
def test_sigkilled_run_resumes_from_the_newer_local_step(tmp_path, capsys):
    """The run never stopped is this test's own (support/in_process.py); the others are launched."""
    local_dir = tmp_path / "shm"
    tier = [f"checkpoint.local_dir={local_dir}", "checkpoint.local_every_steps=3"]
    config = RUN[RUN.index("--config") + 1]
    here = [arg for arg in RUN if arg not in ("--config", config)]
    code, said = train_here(capsys, tmp_path / "ref", config, *here, "train.steps=100", devices=1, common=False)
    assert code == 0, said[-3000:]
    workdir = tmp_path / "killed"
    first = run_cli(*RUN, "--workdir", str(workdir), "train.steps=20", *tier)  # the persistent tier: step 20
    assert first.returncode == 0, first.stderr
    proc = start_cli(*RUN, "--workdir", str(workdir), "train.steps=1000000", *tier)  # persistent saves at the end only
    wait_until(lambda: len([s for s in local_steps(local_dir, workdir) if s >= 26]) == 2, proc, poll=0.01)
    proc.kill()
    proc.wait()
    kept = local_steps(local_dir, workdir)
    # local_keep=2, pruned after each save: a kill between a save and its pruning leaves three
    assert len(kept) in (2, 3) and all(b - a == 3 for a, b in zip(kept, kept[1:])) and 20 < kept[0] < kept[-1] < 100
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == [20]
    again = run_cli(*RUN, "--workdir", str(workdir), "train.steps=100", *tier)
    assert again.returncode == 0, again.stderr
    assert f"resuming from step {kept[-1]} (the local tier, checkpoint.local_dir={local_dir})" in again.stdout
    assert losses(workdir) == losses(tmp_path / "ref")  # bit-identical: JSON floats round-trip exactly


def _run(workdir, local_dir, processes, fsdp, env=None):
    return run_cli(
        "--config",
        "configs/mnist_mlp.yaml",
        "--workdir",
        str(workdir),
        "--local-processes",
        str(processes),
        "--devices-per-process",
        "2",
        f"mesh.fsdp={fsdp}",  # with 2 processes, each holds its own half of every parameter
        "train.global_batch_size=32",
        "train.steps=8",
        "checkpoint.every_steps=2",
        f"checkpoint.local_dir={local_dir}",
        "checkpoint.local_every_steps=2",
        *QUIET,
        "log.every_steps=1",
        "eval.every_steps=0",
        env=env,
        timeout=400,
    )


def records(workdir):
    """(step, loss, gradient norm) of each train record: the norm shows a change in a parameter's last bit."""
    return [
        (r["step"], r["loss"], r["grad_norm"]) for r in read_records(workdir / "metrics.jsonl") if r["split"] == "train"
    ]


ONE_HOST = "note: every process of this job runs on one host: the local tier's peer copies guard against a lost"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_lost_host_s_shards_come_from_its_peer_on_two_processes_or_resharded_onto_one_else_the_persistent_tier(
    tmp_path,
):
    """Two processes save local steps 2..8 (each its half of every parameter, its peer a copy of it;
    the copies exchanged in the background) and persistent steps 2..8; the persistent step 8 is
    then removed, so the local tier's step 6 is as new as the persistent tier's newest."""
    workdir, local_dir, kept = tmp_path / "run", tmp_path / "shm", tmp_path / "kept"
    first = _run(workdir, local_dir, 2, 4, env={HOST_VARIABLE: "host{process}"})  # two hosts, as it seems
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert ONE_HOST not in first.stdout
    reference = records(workdir)
    assert [s for s, _, _ in reference] == list(range(1, 9))
    run_dir = run_directory(str(local_dir), workdir / "checkpoints")
    halves = [json.loads((run_dir / "process_0" / f"owner_{o}" / "6" / "index.json").read_text()) for o in (0, 1)]
    assert halves[0]["shards"] != halves[1]["shards"]  # process 1's shards exist only at process 1 and its peer
    assert json.loads((run_dir / "process_0" / "owner_1" / "6" / "tier.json").read_text())["processes"] == 2
    for name in ("run", "shm"):
        shutil.copytree(tmp_path / name, kept / name)

    def lost(*folders):
        """The kept run, with the persistent step 8 and `folders` of the local tier gone."""
        for name in ("run", "shm"):
            shutil.rmtree(tmp_path / name)
            shutil.copytree(kept / name, tmp_path / name)
        shutil.rmtree(workdir / "checkpoints" / "8")
        for folder in folders:
            shutil.rmtree(run_dir / folder)

    # process 1's host lost its local storage: two processes restore, process 1's shards from its peer
    lost("process_1")
    second = _run(workdir, local_dir, 2, 4)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert ONE_HOST in second.stdout  # (both processes on this host)
    assert "resuming from step 6 (the local tier" in second.stdout
    assert "the shards of process(es) 1 from a peer's copy" in second.stdout
    assert records(workdir) == reference  # bit-identical
    # the job goes on with one process: the two processes' shards resharded onto it
    lost("process_1")
    third = _run(workdir, local_dir, 1, 2)
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    assert (
        f"resuming from step 6 (the local tier, checkpoint.local_dir={local_dir}; saved by 2 process(es), "
        "resharded onto 1; the shards of process(es) 1 from a peer's copy)" in third.stdout
    )
    resumed = records(workdir)[-2:]
    # both copies of process 1's shards lost: the persistent tier's step 6, read by orbax onto one process
    lost("process_1", "process_0/owner_1")
    fourth = _run(workdir, local_dir, 1, 2)
    assert fourth.returncode == 0, fourth.stdout[-3000:] + fourth.stderr[-3000:]
    assert "resuming from step 6 (checkpoint " in fourth.stdout
    assert "the persistent tier: the local tier holds no complete step of this run" in fourth.stdout
    assert [s for s, _, _ in resumed] == [7, 8] and records(workdir)[-2:] == resumed  # bit-identical parameters
