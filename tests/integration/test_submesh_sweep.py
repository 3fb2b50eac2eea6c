"""`launch.py sweep --devices-per-trial N` (engine/sweep/submesh.py), in this test process's 8 CPU
devices: trials of different widths train at once on sub-meshes, each with the losses of the
same config trained alone on N devices; a failed or pruned trial's sub-mesh takes the next
trial, the failure recorded with its reason, the others finishing."""

import json

import pytest
import yaml
from support.configs import ROOT

from engine.config import load_config
from engine.runtime.rundir import read_records
from engine.sweep import load_sweep
from engine.sweep import main as sweep_main
from engine.sweep.submesh import events

COMMON = {
    "train.steps": 120,
    "train.steps_per_call": 1,
    "train.global_batch_size": 32,
    "eval.every_steps": 40,
    "log.every_steps": 5,
    "checkpoint.every_steps": 40,
    "log.tensorboard": False,
    "model.dropout_rate": 0.0,
}


def write_sweep(tmp_path, name="s", **sections):
    spec = {
        "base": str(ROOT / "configs" / "mnist_mlp.yaml"),
        "overrides": COMMON,
        "metric": "eval/loss",
        "mode": "min",
        "directory": str(tmp_path / name),
        **sections,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def losses(workdir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_records(workdir / "metrics.jsonl") if r["split"] == "train"}


def index(directory) -> dict[str, dict]:
    return {r["name"]: r for r in map(json.loads, (directory / "sweep.jsonl").read_text().splitlines())}


@pytest.mark.slow
def test_four_widths_train_at_once_on_sub_meshes_with_their_solo_losses(tmp_path):
    path = write_sweep(tmp_path, grid={"model.hidden_sizes": [[8], [16], [24], [32]]})
    assert sweep_main(str(path), 1, "local", False, devices_per_trial=2) == 0
    sweep, directory = load_sweep(path), tmp_path / "s"
    assert {r["status"] for r in index(directory).values()} == {"finished"}
    log = events(directory)
    starts = {e["run"]: e for e in log if e["event"] == "start"}
    assert sorted(tuple(e["devices"]) for e in starts.values()) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    # their step records interleave: one after another, the runs' records would change hands 3 times
    train = [e["run"] for e in sorted(log, key=lambda e: e["time"]) if e["event"] == "train"]
    changes = sum(a != b for a, b in zip(train, train[1:]))
    assert changes > 6, train
    for run in sweep.runs:  # the same config alone on a 2-device mesh
        values = {**COMMON, **run.overrides, "mesh.num_devices": 2}
        overrides = [f"{k}={json.dumps(v)}" for k, v in values.items()] + ["log.progress=false"]
        from engine.run.single import fit

        alone = tmp_path / "alone" / run.name
        fit(load_config(ROOT / "configs" / "mnist_mlp.yaml", overrides, str(alone)))
        mine, theirs = losses(directory / run.name), losses(alone)
        assert sorted(mine) == sorted(theirs) == list(range(5, 121, 5))
        for step in mine:
            assert mine[step] == pytest.approx(theirs[step], rel=1e-6, abs=1e-6), (run.name, step)


@pytest.mark.slow
def test_a_failed_trials_sub_mesh_takes_the_next_and_the_others_finish(tmp_path):
    # on sub-meshes of 4: a layout needing 8 devices, a NaN loss, and two that train
    path = write_sweep(
        tmp_path,
        zip={
            "model.hidden_sizes": [[8], [16], [8], [16], [24]],
            "mesh.data": [-1, 8, -1, -1, -1],
            "optimizer.learning_rate": [0.001, 0.001, 1.0e30, 0.001, 0.001],
            "optimizer.name": ["adam", "adam", "sgd", "adam", "adam"],
        },
    )
    assert sweep_main(str(path), 1, "local", False, devices_per_trial=4) == 1  # (not every run finished)
    directory = tmp_path / "s"
    runs = list(index(directory).values())
    assert [r["status"] for r in runs] == ["finished", "failed", "failed", "finished", "finished"]
    assert "mesh" in runs[1]["error"] and "8 devices" in runs[1]["error"], runs[1]["error"]
    assert "nan" in runs[2]["error"], runs[2]["error"]
    log = events(directory)
    order = {e["run"]: i for i, e in enumerate(log)}
    ends = {e["run"]: e for e in log if e["event"] == "end"}
    starts = {e["run"]: e for e in log if e["event"] == "start"}
    assert {e["submesh"] for e in starts.values()} == {0, 1}
    for failed in (runs[1]["name"], runs[2]["name"]):  # its sub-mesh trained another run after it
        mesh = ends[failed]["submesh"]
        later = [r for r, e in starts.items() if e["submesh"] == mesh and order[r] > order[failed]]
        assert later, (failed, log)
    assert "failed" in (directory / runs[1]["name"] / "run.log").read_text() or runs[1]["error"]


@pytest.mark.slow
def test_a_search_prunes_on_sub_meshes_and_a_pruned_trials_sub_mesh_goes_on(tmp_path):
    params = {"optimizer.learning_rate": {"log_uniform": [1.0e-6, 1.0e-1]}}
    path = write_sweep(
        tmp_path,
        search={"sampler": "random", "trials": 6, "seed": 3, "params": params},
        pruner={"kind": "median", "startup_trials": 1, "warmup_steps": 0},
    )
    assert sweep_main(str(path), 1, "local", False, devices_per_trial=4) == 0
    directory = tmp_path / "s"
    runs = index(directory)
    assert sorted(runs) == [f"trial-{i:04d}" for i in range(6)]
    statuses = [r["status"] for r in runs.values()]
    assert "pruned" in statuses and "finished" in statuses, statuses
    import optuna

    study = optuna.load_study(study_name="sweep", storage=f"sqlite:///{directory / 'study.db'}")
    judged = {f"trial-{t.number:04d}": max(t.intermediate_values) for t in study.trials}
    log = events(directory)
    order = {e["run"]: i for i, e in enumerate(log) if e["event"] == "start"}
    for name, run in runs.items():
        steps = sorted(losses(directory / name))
        if run["status"] == "pruned":  # stopped at exactly the eval the pruner judged
            assert steps[-1] == judged[name], (name, steps, judged[name])
        else:
            assert steps[-1] == 120
    assert len(order) == 6 and {e["submesh"] for e in log} == {0, 1}


@pytest.mark.slow
def test_plan_compiles_each_trial_for_its_sub_mesh_of_a_tpu_target(tmp_path, capsys):
    pytest.importorskip("libtpu")
    from engine.errors import UsageError
    from engine.plan.sweeps import plan_submeshes

    sweep = load_sweep(write_sweep(tmp_path, grid={"model.hidden_sizes": [[16], [32], [16]]}))
    assert plan_submeshes(sweep, "v5e-8", 4) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines[:3]] == [run.name for run in sweep.runs]
    assert all("fits:" in line and "per device" in line for line in lines[:3]), lines
    assert (
        lines[-1].startswith("plan: 3 runs on 2 sub-meshes of 4 devices (v5e:2x2) of v5e-8")
        and "2 distinct" in lines[-1]
    )
    with pytest.raises(UsageError, match="does not cut"):
        plan_submeshes(sweep, "v5e-8", 3)


@pytest.mark.slow
def test_trials_that_share_a_program_train_as_one_group_per_sub_mesh_with_their_solo_losses(tmp_path):
    # two programs (widths) of two learning rates each; one trial's loss becomes NaN
    overrides = {**COMMON, "train.steps": 40, "eval.every_steps": 20, "optimizer.name": "sgd"}
    path = write_sweep(
        tmp_path,
        overrides=overrides,
        zip={"model.hidden_sizes": [[8], [8], [16], [16]], "optimizer.learning_rate": [0.05, 1.0e30, 0.05, 0.1]},
        vectorize="auto",
    )
    assert sweep_main(str(path), 1, "local", False, devices_per_trial=4) == 1  # (one run failed)
    sweep, directory = load_sweep(path), tmp_path / "s"
    runs = index(directory)
    names = [run.name for run in sweep.runs]
    assert [runs[name]["status"] for name in names] == ["finished", "failed", "finished", "finished"]
    assert "nan" in runs[names[1]]["error"], runs[names[1]]
    log = events(directory)
    starts = {e["run"]: e for e in log if e["event"] == "start"}
    # each program's pair on one sub-mesh as one group, the two groups on the two sub-meshes at once
    assert (
        starts[names[0]]["group"] == starts[names[1]]["group"] != starts[names[2]]["group"] == starts[names[3]]["group"]
    )
    assert {starts[names[0]]["submesh"], starts[names[2]]["submesh"]} == {0, 1}
    spans = {  # each group's time on its sub-mesh, from its first start to its last end
        mesh: (min(e["time"] for e in log if e["submesh"] == mesh), max(e["time"] for e in log if e["submesh"] == mesh))
        for mesh in (0, 1)
    }
    assert spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1], spans  # (the two at once)
    from engine.run.single import fit

    for run in (sweep.runs[0], sweep.runs[2], sweep.runs[3]):  # each as the same config alone on 4 devices
        values = {**overrides, **run.overrides, "mesh.num_devices": 4}
        alone = tmp_path / "alone" / run.name
        fit(
            load_config(
                ROOT / "configs" / "mnist_mlp.yaml", [f"{k}={json.dumps(v)}" for k, v in values.items()], str(alone)
            )
        )
        mine, theirs = losses(directory / run.name), losses(alone)
        assert sorted(mine) == sorted(theirs) == list(range(5, 41, 5))
        for step in mine:
            assert mine[step] == pytest.approx(theirs[step], rel=1e-5, abs=1e-6), (run.name, step)


@pytest.mark.slow
def test_a_hung_trial_fails_alone_and_its_sub_mesh_is_given_up_while_the_others_finish(tmp_path, monkeypatch):
    import threading

    import engine.run.single

    release, build_run = threading.Event(), engine.run.single.build_run

    def stuck_reader(cfg, **options):  # (a data reader that never returns, until the test lets it fail)
        if "compile=2" in str(cfg.workdir):
            release.wait(600)
            raise OSError("the reader gave up")
        return build_run(cfg, **options)

    monkeypatch.setattr(engine.run.single, "build_run", stuck_reader)
    path = write_sweep(
        tmp_path,
        overrides={**COMMON, "train.steps": 20, "eval.every_steps": 20},
        zip={"model.hidden_sizes": [[8], [16], [24]], "watchdog.compile": [7200, 2, 7200]},
    )
    try:
        assert sweep_main(str(path), 1, "local", False, devices_per_trial=4) == 1
        runs, log = list(index(tmp_path / "s").values()), events(tmp_path / "s")
    finally:
        release.set()
    assert [r["status"] for r in runs] == ["finished", "failed", "finished"]
    assert "hung: no progress for" in runs[1]["error"] and "watchdog.compile=2" in runs[1]["error"], runs[1]
    assert list((tmp_path / "s" / runs[1]["name"]).glob("hang-*.txt"))  # its stacks
    starts = {e["run"]: e["submesh"] for e in log if e["event"] == "start"}
    assert starts[runs[2]["name"]] == starts[runs[0]["name"]] != starts[runs[1]["name"]]  # (the hung one's given up)
    for thread in threading.enumerate():  # the hung trial's thread, let go, records nothing more
        if thread.name.startswith("submesh-"):
            thread.join(30)
    assert "error: hung" in json.loads((tmp_path / "s" / runs[1]["name"] / "status.json").read_text())["error"]
