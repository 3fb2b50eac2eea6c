"""A sub-mesh sweep (`launch.py sweep --devices-per-trial N`, engine/sweep/submesh.py) in a job of
several processes: sub-meshes within one process (2 processes x 2 devices, N=2) and sub-meshes
each spanning two processes of four (4 x 1, N=2). The first job is killed with SIGKILL (every
process), the second stopped with SIGTERM (its trials save and exit 143), and each is run again:
the finished run is not trained again, the interrupted one resumes from its
checkpoint with the losses of the same config trained alone on N devices, the one not yet begun
starts. An Optuna search whose processes share its study; and trials that share a program packed
into one vectorised group on each process's sub-mesh."""

import json
import os
import signal
from pathlib import Path

import pytest
import yaml
from support.cli import start_cli, wait_until
from support.configs import ROOT

from engine.config import load_config
from engine.runtime.rundir import read_records, read_status

COMMON = {
    "train.steps_per_call": 1,
    "train.global_batch_size": 32,
    "eval.every_steps": 100,
    "log.every_steps": 10,
    "checkpoint.every_steps": 20,
    "log.tensorboard": False,
    "model.dropout_rate": 0.0,
}
JOB = ["--local-processes", "2", "--devices-per-process", "2"]
SPANNING = ["--local-processes", "4", "--devices-per-process", "1"]


def swept(tmp_path, spec: dict) -> tuple[list[dict], list[dict]]:
    """Runs the sweep `spec` (its directory: tmp_path/s) to its end as a job of 2 processes x 2
    devices on sub-meshes of 2; (its sweep.jsonl records, its submesh.jsonl events)."""
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({**spec, "directory": str(tmp_path / "s")}))
    done = start_cli("sweep", str(path), "--devices-per-trial", "2", *JOB)
    out, err = done.communicate(timeout=600)
    assert done.returncode == 0, out + err
    read = [[json.loads(line) for line in (tmp_path / "s" / name).read_text().splitlines()] for name in FILES]
    return read[0], read[1]


FILES = ("sweep.jsonl", "submesh.jsonl")


def losses(workdir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_records(workdir / "metrics.jsonl") if r["split"] == "train"}


def kill_job(proc) -> None:
    """SIGKILL to every process of the job (each its own session), then to its launcher."""
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    for pid in children:
        os.killpg(int(pid), signal.SIGKILL)
    proc.kill()
    proc.wait()


def killed_and_resumed(
    tmp_path, runs: dict, unstarted: bool, job: list[str], stop: str = "kill"
) -> tuple[Path, list[Path], str]:
    """Runs the sweep, kills it (`stop`: "kill", SIGKILL to every process; "term", SIGTERM to the
    launcher, which every trial must answer by saving the step it reached and exiting 143) once its
    first run finished and its second saved (the last not begun, when `unstarted`), runs it again to
    the end; (its directory, the runs' workdirs, the first's records)."""
    spec = {
        "base": str(ROOT / "configs" / "mnist_mlp.yaml"),
        "overrides": COMMON,
        "zip": runs,
        "metric": "eval/loss",
        "directory": str(tmp_path / "s"),
    }
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(spec))
    names = [f"hidden_sizes={w[0]},steps={s}" for w, s in zip(runs["model.hidden_sizes"], runs["train.steps"])]
    workdirs = [tmp_path / "s" / name for name in names]
    command = ["sweep", str(path), "--devices-per-trial", "2", *job]
    proc = start_cli(*command)

    def killable() -> bool:
        saved = [p for p in (workdirs[1] / "checkpoints").glob("*") if p.name.isdigit()]
        begun = unstarted and workdirs[-1].exists()
        return read_status(workdirs[0]).get("status") == "finished" and bool(saved) and not begun

    wait_until(killable, proc, seconds=300)
    if stop == "kill":
        kill_job(proc)
        assert read_status(workdirs[1]).get("status") == "running"
    else:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 143, out + err  # (a process that did not stop: SIGKILLed after the grace)
        assert read_status(workdirs[1]).get("status") == "interrupted", out + err
    finished = (workdirs[0] / "metrics.jsonl").read_text()
    done = start_cli(*command)
    out, err = done.communicate(timeout=600)
    assert done.returncode == 0, out + err
    index = [json.loads(line) for line in (tmp_path / "s" / "sweep.jsonl").read_text().splitlines()]
    assert [r["status"] for r in index] == ["finished"] * len(names)
    starts = [json.loads(line) for line in (tmp_path / "s" / "submesh.jsonl").read_text().splitlines()]
    assert [e["run"] for e in starts if e["event"] == "start"].count(names[0]) == 1  # not trained again
    return tmp_path / "s", workdirs, finished


def alone(tmp_path, workdir: Path, devices: int) -> dict[int, float]:
    """The losses of the run in `workdir` trained alone on `devices` devices of this process."""
    from engine.run.single import fit

    cfg = yaml.safe_load((workdir / "config.yaml").read_text())
    values = {
        **COMMON,
        "model.hidden_sizes": cfg["model"]["hidden_sizes"],
        "train.steps": cfg["train"]["steps"],
        "optimizer.learning_rate": cfg["optimizer"]["learning_rate"],
        "mesh.num_devices": devices,
    }
    overrides = [f"{k}={json.dumps(v)}" for k, v in values.items()] + ["log.progress=false"]
    fit(load_config(ROOT / "configs" / "mnist_mlp.yaml", overrides, str(tmp_path / "alone" / workdir.name)))
    return losses(tmp_path / "alone" / workdir.name)


def check_resumed(tmp_path, workdir: Path, devices: int, steps: int) -> None:
    assert "resuming from step" in (workdir / "run.log").read_text()
    resumed, uninterrupted = losses(workdir), alone(tmp_path, workdir, devices)
    assert sorted(resumed) == sorted(uninterrupted) == list(range(10, steps + 1, 10))
    for step, loss in resumed.items():
        assert loss == pytest.approx(uninterrupted[step], rel=1e-6, abs=1e-6), step


@pytest.mark.slow
def test_sub_meshes_within_each_process_of_a_killed_job_resume(tmp_path):
    runs = {"model.hidden_sizes": [[8], [16], [24], [32]], "train.steps": [20, 200, 200, 40]}
    directory, (first, long, _, unstarted), finished = killed_and_resumed(tmp_path, runs, True, JOB)
    assert (first / "metrics.jsonl").read_text() == finished
    starts = [json.loads(line) for line in (directory / "submesh.jsonl").read_text().splitlines()]
    devices = {tuple(e["devices"]) for e in starts if e["event"] == "start"}
    assert len(devices) == 2 and all(len({d // 2048 for d in mesh}) == 1 for mesh in devices)  # one process's each
    check_resumed(tmp_path, long, 2, 200)
    assert sorted(losses(unstarted)) == list(range(10, 41, 10))


@pytest.mark.slow
def test_sub_meshes_spanning_two_processes_each_of_a_stopped_job_resume(tmp_path):
    # SIGTERM: the processes of the spanning trial agree on the step to stop at (through the store)
    runs = {"model.hidden_sizes": [[8], [16]], "train.steps": [20, 200]}
    directory, (first, long), finished = killed_and_resumed(tmp_path, runs, False, SPANNING, stop="term")
    assert (first / "metrics.jsonl").read_text() == finished
    starts = [json.loads(line) for line in (directory / "submesh.jsonl").read_text().splitlines()]
    devices = {tuple(e["devices"]) for e in starts if e["event"] == "start"}
    assert len(devices) == 2 and all(len({d // 2048 for d in mesh}) == 2 for mesh in devices)  # two processes' each
    # its sub-mesh's other process trained it too (the re-run may give it the other sub-mesh: each start's)
    others = {max({d // 2048 for d in e["devices"]}) for e in starts if e["event"] == "start" and e["run"] == long.name}
    assert {p.name for p in long.glob("run.process*.log")} == {f"run.process{k}.log" for k in others}, others
    check_resumed(tmp_path, long, 2, 200)


@pytest.mark.slow
def test_an_optuna_search_shares_its_study_between_the_processes_sub_meshes(tmp_path):
    spec = {
        "base": str(ROOT / "configs" / "mnist_mlp.yaml"),
        "overrides": {**COMMON, "train.steps": 10, "eval.every_steps": 10},
        "metric": "eval/loss",
        "search": {"trials": 3, "seed": 0, "params": {"optimizer.learning_rate": {"log_uniform": [1e-4, 1e-1]}}},
    }
    index, starts = swept(tmp_path, spec)
    assert [(r["name"], r["status"]) for r in index] == [(f"trial-000{n}", "finished") for n in range(3)]
    assert sorted(e["run"] for e in starts if e["event"] == "start") == [f"trial-000{n}" for n in range(3)]  # once each


@pytest.mark.slow
def test_trials_that_share_a_program_train_as_a_group_on_each_process_s_sub_mesh(tmp_path):
    spec = {
        "base": str(ROOT / "configs" / "mnist_mlp.yaml"),
        "overrides": {**COMMON, "train.steps": 20},
        "zip": {"model.hidden_sizes": [[8], [16], [8], [16]], "optimizer.learning_rate": [0.001, 0.001, 0.003, 0.003]},
        "metric": "eval/loss",
        "vectorize": "auto",
    }
    index, events = swept(tmp_path, spec)
    assert [r["status"] for r in index] == ["finished"] * 4
    starts = {e["run"]: e for e in events if e["event"] == "start"}
    groups = {}
    for run in index:  # each width's pair one group, on one process's sub-mesh; the two groups on both processes
        event = starts[run["name"]]
        groups.setdefault(event["group"], set()).add((run["name"].split(",")[0], tuple(event["devices"])))
    assert sorted(len(members) for members in groups.values()) == [1, 1], groups
    assert {devices[0] // 2048 for ((_, devices),) in groups.values()} == {0, 1}, groups
    workdir = tmp_path / "s" / index[2]["name"]
    mine, theirs = losses(workdir), alone(tmp_path, workdir, 2)
    assert sorted(mine) == sorted(theirs) == [10, 20]
    for step, loss in mine.items():
        assert loss == pytest.approx(theirs[step], rel=1e-5, abs=1e-6), step


LOGGED = """import os

import jax


def even_ids_logged(prompts, completions, completion_ids, **fields):
    with open(os.path.join(os.path.dirname(__file__), "calls.txt"), "a") as calls:
        calls.write(f"{jax.process_index()}\\n")
    return [sum(i % 2 == 0 for i in ids) / max(len(ids), 1) for ids in completion_ids]
"""


@pytest.mark.slow
def test_grpo_trials_within_each_process_sample_and_score_on_their_own_process(tmp_path):
    """A GRPO trial on a sub-mesh of process 1 scores its rollouts there (its run's chief), not on
    the job's process 0, and trains as the same config alone on 2 devices does."""
    from support.grpo import overrides, write_files

    from engine.run.single import fit

    files = write_files(tmp_path)
    (tmp_path / "logged.py").write_text(LOGGED)
    given = dict(item.split("=", 1) for item in overrides(files, 2) if not item.startswith("mesh."))
    given.update({"grpo.rewards": f"[{tmp_path / 'logged.py'}:even_ids_logged]", "log.tensorboard": "false"})
    spec = {
        "base": str(ROOT / "configs" / "mnist_mlp.yaml"),
        "overrides": {key: yaml.safe_load(value) for key, value in given.items()},
        "zip": {"optimizer.learning_rate": [0.03, 0.01]},
        "metric": "train/loss",
    }
    swept(tmp_path, spec)
    # a call a step and one for the final eval, each trial on its own process
    assert sorted((tmp_path / "calls.txt").read_text().split()) == ["0"] * 3 + ["1"] * 3
    workdir = tmp_path / "s" / "learning_rate=0.01"
    alone = tmp_path / "alone"
    fit(
        load_config(
            ROOT / "configs" / "mnist_mlp.yaml",
            [
                *overrides(files, 2),
                "mesh.num_devices=2",
                "optimizer.learning_rate=0.01",
                "log.progress=false",
                f"grpo.rewards=[{files[3]}:even_ids]",
            ],
            str(alone),
        )
    )
    # (GRPO's loss is ~0 at every step whatever the parameters: the update shows in the gradient's
    # norm and the next step's rewards)
    names = ("loss", "grad_norm", "reward", "reward_std")
    mine, theirs = ([r for r in read_records(w / "metrics.jsonl") if r["split"] == "train"] for w in (workdir, alone))
    assert [r["step"] for r in mine] == [r["step"] for r in theirs] == [1, 2]
    for a, b in zip(mine, theirs):
        assert [a[n] for n in names] == pytest.approx([b[n] for n in names], rel=1e-5, abs=1e-6), (a, b)
