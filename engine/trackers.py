"""Experiment trackers beside TensorBoard (`log.trackers`): Weights & Biases and MLflow.

Each run (each trial of a sweep, each run of a vectorised group) is one tracker run, made on
process 0 and given the run's config, its train/eval records and its summary. The run's id is
kept in WORKDIR/trackers.json, so a resumed run goes on logging into the same tracker run.

- W&B: offline unless WANDB_MODE says otherwise; its run files go under TRACKING_DIR/wandb,
  where `wandb sync` finds them.
- MLflow: MLFLOW_TRACKING_URI, else a SQLite store TRACKING_DIR/mlflow.db (artifacts beside it
  in TRACKING_DIR/mlruns); read back with `mlflow.search_runs(experiment_names=[log.project])`.

TRACKING_DIR is log.tracking_dir, else the workdir; a sweep gives its trials its own directory
and its name as log.group, so one store holds every trial and each tool groups them."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Protocol

from engine.errors import UsageError
from engine.rundir import read_json, write_json

TRACKERS = ("wandb", "mlflow")
INSTALL = {"wandb": "wandb>=0.19", "mlflow": "mlflow-skinny>=2.19"}  # as pyproject.toml's [trackers]
IDS = "trackers.json"  # WORKDIR/trackers.json: {tracker: its run id}


class Tracker(Protocol):
    def log(self, step: int, split: str, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def check_installed(cfg) -> None:
    """UsageError naming the install command when a tracker of log.trackers is not installed."""
    for name in cfg.log.trackers:
        if importlib.util.find_spec(name) is None:
            raise UsageError(
                f"log.trackers lists {name}, which is not installed: "
                f"pip install '{INSTALL[name]}' (or pip install 'jax-train-engine[trackers]')"
            )


def tracking_dir(cfg) -> Path:
    return Path(cfg.log.tracking_dir or cfg.workdir).resolve()


def open_trackers(cfg) -> list[Tracker]:
    """The run's trackers, each started (or resumed) on its tracker run."""
    if not cfg.log.trackers:
        return []
    check_installed(cfg)
    ids_path = Path(cfg.workdir) / IDS
    ids = read_json(ids_path) or {}  # missing, or damaged (set aside): new tracker runs
    made: list[Tracker] = []
    for name in cfg.log.trackers:
        tracker = _WandB(cfg, ids.get(name)) if name == "wandb" else _MLflow(cfg, ids.get(name))
        ids[name] = tracker.run_id
        made.append(tracker)
    write_json(ids_path, ids)
    return made


def numbers(values: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a record (trackers take numbers; NaN marks nothing there)."""
    return {
        k: float(v)
        for k, v in values.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


def flat_config(cfg) -> dict[str, Any]:
    """The config as dotted keys (MLflow params, W&B's config is the nested dict)."""
    out: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        else:
            out[prefix[:-1]] = node

    walk(dataclasses.asdict(cfg), "")
    return out


def _run_name(cfg) -> str:
    return Path(cfg.workdir).resolve().name


class _WandB:
    def __init__(self, cfg, run_id: str | None):
        import wandb

        directory = tracking_dir(cfg)
        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            mode=os.environ.get("WANDB_MODE", "offline"),  # type: ignore[arg-type]
            dir=str(directory),
            project=cfg.log.project,
            group=cfg.log.group or None,
            name=_run_name(cfg),
            id=run_id,  # None: W&B makes one (a new run)
            resume="allow",
            config=dataclasses.asdict(cfg),
            reinit="create_new",  # a vectorised group holds several runs in one process
            settings=wandb.Settings(silent=True, console="off", disable_git=True, save_code=False),
        )
        self.run_id = self.run.id
        where = f"{directory / 'wandb'} (upload: wandb sync)" if self.run.offline else self.run.url
        print(f"wandb: run {self.run_id} of project {cfg.log.project}: {where}", flush=True)

    def log(self, step: int, split: str, values: dict[str, float]) -> None:
        if split == "summary":
            self.run.summary.update(values)
        else:  # W&B drops a step below its last one: a resumed run's redone steps log nothing twice
            self.run.log({f"{split}/{k}": v for k, v in values.items()}, step=step)

    def close(self) -> None:
        self.run.finish()


class _MLflow:
    def __init__(self, cfg, run_id: str | None):
        self.client = _client(cfg)
        print(f"mlflow: run of experiment {cfg.log.project} in {mlflow_uri(cfg)}", flush=True)
        if run_id is not None:  # resumed: the same run, running again
            self.client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
            return
        experiment = experiment_id(self.client, cfg)
        tags = {"group": cfg.log.group} if cfg.log.group else {}
        self.run_id = self.client.create_run(experiment, run_name=_run_name(cfg), tags=tags).info.run_id
        from mlflow.entities import Param

        # params are the config at the run's start (MLflow refuses a param's second value)
        params = [Param(k, json.dumps(v) if not isinstance(v, str) else v) for k, v in flat_config(cfg).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[start : start + 100])

    def log(self, step: int, split: str, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(f"{split}/{k}", v, now, step) for k, v in values.items()]
        for start in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[start : start + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _client(cfg):
    from mlflow.tracking import MlflowClient

    for name in ("mlflow", "alembic"):  # a new store's "Creating initial MLflow database tables" lines
        logging.getLogger(name).setLevel(logging.WARNING)
    return MlflowClient(tracking_uri=mlflow_uri(cfg))


def mlflow_uri(cfg) -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{tracking_dir(cfg) / 'mlflow.db'}"


def experiment_id(client, cfg) -> str:
    """log.project's experiment, made (with its artifacts beside the store) when new."""
    found = client.get_experiment_by_name(cfg.log.project)
    if found is not None:
        return found.experiment_id
    tracking_dir(cfg).mkdir(parents=True, exist_ok=True)
    return client.create_experiment(cfg.log.project, artifact_location=(tracking_dir(cfg) / "mlruns").as_uri())


def prepare_store(cfg) -> None:
    """Make the MLflow store and experiment once, before a sweep's trials start together (two
    processes making a new SQLite store's tables at once may collide)."""
    if "mlflow" in cfg.log.trackers:
        check_installed(cfg)
        experiment_id(_client(cfg), cfg)
