"""Experiment trackers (log.trackers): W&B offline run files and an MLflow store, each read back
with the tool's own reader, across a resume and a sweep; a missing tracker is a usage error."""

import json

import pytest

wandb = pytest.importorskip("wandb")


mlflow = pytest.importorskip("mlflow")


def test_an_mlflow_run_id_the_store_does_not_hold_is_a_warning_and_a_new_run(
    tmp_path, make_config, capsys, monkeypatch
):
    from engine.observe.trackers import open_trackers

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    workdir = tmp_path / "run"
    workdir.mkdir()
    unknown = "0" * 31 + "1"
    (workdir / "trackers.json").write_text(json.dumps({"mlflow": unknown}))
    cfg = make_config("mnist_mlp.yaml", "log.trackers=[mlflow]")
    (tracker,) = open_trackers(cfg)
    tracker.log(1, "train", {"loss": 0.5})
    tracker.close()
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: mlflow")]
    assert warnings == [
        f"warning: mlflow: run {unknown} (from {workdir / 'trackers.json'}) is not in "
        f"sqlite:///{workdir / 'mlflow.db'} or was deleted; logging into a new run from this step on"
    ]
    new_id = json.loads((workdir / "trackers.json").read_text())["mlflow"]
    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")
    assert new_id != unknown and client.get_run(new_id).data.metrics == {"train/loss": 0.5}
