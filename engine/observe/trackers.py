"""Experiment trackers beside TensorBoard (`log.trackers`): Weights & Biases and MLflow.

Each run (each trial of a sweep, each run of a vectorised group) is one tracker run, made on
process 0 and given the run's config, its train/eval records and its summary. The run's id is
kept in WORKDIR/trackers.json, so a resumed run goes on logging into the same tracker run (a
damaged trackers.json stops the run at start, exit 2; an MLflow id its store does not hold is
a warning and a new run).

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
import re
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from engine.errors import UsageError
from engine.runtime.rundir import write_json

TRACKERS = ("wandb", "mlflow")
INSTALL = {"wandb": "wandb>=0.19", "mlflow": "mlflow-skinny>=2.19"}  # as pyproject.toml's [trackers]
IDS = "trackers.json"  # WORKDIR/trackers.json: {tracker: its run id}
RUN_ID = {  # the run ids each tracker takes (W&B's settings and MLflow's validation refuse others)
    "wandb": re.compile(r"[^\s:;,#?/'](?:[^:;,#?/']*[^\s:;,#?/'])?"),
    "mlflow": re.compile(r"[a-zA-Z0-9][\w\-]{0,255}"),
}


class Tracker(Protocol):
    def log(self, step: int, split: str, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def check_installed(cfg) -> None:
    """UsageError, before anything is written, when log.trackers cannot start: a tracker that is
    not installed (naming the install command), a log.tracking_dir that cannot be a directory, or
    a damaged WORKDIR/trackers.json."""
    for name in cfg.log.trackers:
        if importlib.util.find_spec(name) is None:
            raise UsageError(
                f"log.trackers lists {name}, which is not installed: "
                f"pip install '{INSTALL[name]}' (or pip install 'jax-train-engine[trackers]')"
            )
    if cfg.log.trackers:
        _check_tracking_dir(cfg)
        read_ids(Path(cfg.workdir) / IDS)


def tracking_dir(cfg) -> Path:
    return Path(cfg.log.tracking_dir or cfg.workdir).resolve()


def _check_tracking_dir(cfg) -> None:
    """UsageError when TRACKING_DIR is not a directory and cannot be made one (nothing is made here:
    a run refused later leaves no directory behind)."""
    path = existing = tracking_dir(cfg)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.is_dir() and os.access(existing, os.W_OK | os.X_OK):
        return
    why = "not writable" if existing.is_dir() else "a file"
    where = "it is" if existing == path else f"{existing} is"
    key = f"log.tracking_dir={cfg.log.tracking_dir}" if cfg.log.tracking_dir else f"the workdir {cfg.workdir}"
    raise UsageError(
        f"{key} cannot be a directory for log.trackers: {where} {why}; give log.tracking_dir a directory "
        "you can write to (or leave it unset: the workdir)"
    )


def read_ids(path: Path) -> dict:
    """trackers.json's {tracker: run id} ({} when there is none); UsageError when it is damaged:
    not a JSON object, or an id that is not one its tracker could have made."""
    try:
        ids = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _damaged(path, f"not JSON: {e}") from None
    if not isinstance(ids, dict):
        raise _damaged(path, f"it holds a {type(ids).__name__}, not an object")
    for name in TRACKERS:
        if name in ids and not (isinstance(ids[name], str) and RUN_ID[name].fullmatch(ids[name])):
            raise _damaged(path, f"its {name} run id is {json.dumps(ids[name])[:40]}, not a valid {name} run id")
    return ids


def _damaged(path: Path, why: str) -> UsageError:
    return UsageError(
        f"{path} is damaged ({why}); delete it to log into new tracker runs, or write back the ids of the "
        'runs to go on with, e.g. {"wandb": "2x7kq9ab", "mlflow": "<32 hex digits>"}'
    )


def open_trackers(cfg) -> list[Tracker]:
    """The run's trackers, each started (or resumed) on its tracker run."""
    if not cfg.log.trackers:
        return []
    check_installed(cfg)
    try:
        tracking_dir(cfg).mkdir(parents=True, exist_ok=True)
    except OSError as e:  # made a file, or unwritable, since the run was checked
        raise UsageError(f"log.trackers: cannot make the tracking directory {tracking_dir(cfg)} ({e})") from None
    ids_path = Path(cfg.workdir) / IDS
    ids = read_ids(ids_path)
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
        if run_id is not None and _in_store(self.client, run_id, cfg):  # resumed: the same run, running again
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


def _in_store(client, run_id: str, cfg) -> bool:
    """Whether the store holds run `run_id` (not deleted). A run it does not hold (another store
    since: MLFLOW_TRACKING_URI or log.tracking_dir changed, or the run was deleted) is one
    warning line and a new run, not a stop: the file is sound, and metrics.jsonl keeps every step."""
    from mlflow.exceptions import MlflowException

    try:
        found = client.get_run(run_id).info.lifecycle_stage != "deleted"
    except MlflowException as e:
        if e.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        found = False
    if not found:
        sys.stderr.write(
            f"warning: mlflow: run {run_id} (from {Path(cfg.workdir) / IDS}) is not in {mlflow_uri(cfg)} or was "
            "deleted; logging into a new run from this step on\n"
        )
    return found


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
