"""A sub-mesh sweep (`launch.py sweep --devices-per-trial N`, engine/sweep/submesh.py) killed with
SIGKILL and run again: the finished run is not trained again, the interrupted one resumes from
its checkpoint with the losses of an uninterrupted run, the one not yet begun starts."""

import json
import os
import signal

import pytest
import yaml
from support.cli import start_cli, wait_until
from support.configs import ROOT

from engine.config import load_config
from engine.runtime.rundir import read_records, read_status

EIGHT = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
COMMON = {
    "train.steps_per_call": 1,
    "train.global_batch_size": 32,
    "eval.every_steps": 100,
    "log.every_steps": 10,
    "checkpoint.every_steps": 20,
    "log.tensorboard": False,
    "model.dropout_rate": 0.0,
}
RUNS = {"model.hidden_sizes": [[8], [16], [24], [32]], "train.steps": [20, 400, 400, 40]}


def losses(workdir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_records(workdir / "metrics.jsonl") if r["split"] == "train"}


@pytest.mark.slow
def test_a_killed_sub_mesh_sweep_resumes_its_unfinished_runs_and_skips_the_finished(tmp_path):
    spec = {
        "base": str(ROOT / "configs" / "mnist_mlp.yaml"),
        "overrides": COMMON,
        "zip": RUNS,
        "metric": "eval/loss",
        "directory": str(tmp_path / "s"),
    }
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(spec))
    names = [f"hidden_sizes={w[0]},steps={s}" for w, s in zip(RUNS["model.hidden_sizes"], RUNS["train.steps"])]
    first, long, _, unstarted = (tmp_path / "s" / name for name in names)
    proc = start_cli("sweep", str(path), "--devices-per-trial", "4", env=EIGHT, start_new_session=True)

    def killable() -> bool:  # the short run finished, the long one saved, the last not begun
        saved = [p for p in (long / "checkpoints").glob("*") if p.name.isdigit()]
        return read_status(first).get("status") == "finished" and bool(saved) and not unstarted.exists()

    wait_until(killable, proc, seconds=300)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    finished_records = (first / "metrics.jsonl").read_text()
    done = start_cli("sweep", str(path), "--devices-per-trial", "4", env=EIGHT)
    out, err = done.communicate(timeout=600)
    assert done.returncode == 0, out + err
    index = [json.loads(line) for line in (tmp_path / "s" / "sweep.jsonl").read_text().splitlines()]
    assert [r["status"] for r in index] == ["finished"] * 4
    assert (first / "metrics.jsonl").read_text() == finished_records  # not trained again
    starts = [json.loads(line) for line in (tmp_path / "s" / "submesh.jsonl").read_text().splitlines()]
    assert [e["run"] for e in starts if e["event"] == "start"].count(names[0]) == 1
    assert "resuming from step" in (long / "run.log").read_text()
    values = {**COMMON, "model.hidden_sizes": [16], "train.steps": 400, "mesh.num_devices": 4}
    from engine.run.single import fit

    alone = tmp_path / "alone"
    overrides = [f"{k}={json.dumps(v)}" for k, v in values.items()] + ["log.progress=false"]
    fit(load_config(ROOT / "configs" / "mnist_mlp.yaml", overrides, str(alone)))
    resumed, uninterrupted = losses(long), losses(alone)
    assert sorted(resumed) == sorted(uninterrupted) == list(range(10, 401, 10))
    for step, loss in resumed.items():
        assert loss == pytest.approx(uninterrupted[step], rel=1e-6, abs=1e-6), step
    assert sorted(losses(unstarted)) == list(range(10, 41, 10))
