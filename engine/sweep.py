"""Config sweeps: a grid, zipped lists and/or a seeded random search over any dotted keys,
each run a `launch.py` training process in its own workdir under the sweep's directory.

    base: configs/mnist_mlp.yaml         # relative to the sweep file
    overrides: {train.steps: 300}        # fixed for every run
    grid: {optimizer.learning_rate: [1e-3, 3e-3], train.global_batch_size: [32, 64]}
    zip: {optimizer.warmup_steps: [0, 50], optimizer.schedule: [constant, warmup_cosine]}
    random: {samples: 8, seed: 0, params: {optimizer.learning_rate: {log_uniform: [1e-4, 1e-2]}}}
    metric: eval/accuracy                # split/name from metrics.jsonl, to rank by
    mode: max                            # or min
    directory: runs/my_sweep             # default runs/<sweep file name>
    slurm: {partition: gpu, time: "01:00:00", cpus_per_task: 4, gres: "gpu:1"}

Runs are the product of the grid's axes, the zip group (one axis) and the random samples.
Each run's status lives in its workdir (`status.json`); `sweep.jsonl` is the index made from them.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from engine.config import load_config, read_yaml_mapping
from engine.errors import UsageError
from engine.metrics import read_records

LAUNCH = Path(__file__).resolve().parent.parent / "launch.py"
SWEEP_KEYS = {"base", "overrides", "grid", "zip", "random", "metric", "mode", "directory", "slurm"}
DISTRIBUTIONS = ("log_uniform", "uniform", "int_uniform", "choice")


@dataclass(frozen=True)
class RunSpec:
    name: str  # stable, from the overrides that vary, e.g. learning_rate=0.001,global_batch_size=32
    overrides: dict  # dotted key → value for this run (the varying ones)


@dataclass
class Sweep:
    path: Path
    base: Path
    overrides: dict
    runs: list[RunSpec]
    metric: str
    mode: str
    directory: Path
    slurm: dict = field(default_factory=dict)

    def workdir(self, run: RunSpec) -> Path:
        return self.directory / run.name

    def argv(self, run: RunSpec) -> list[str]:
        """launch.py arguments that train this run."""
        values = {**self.overrides, **run.overrides}
        return ["--config", str(self.base), "--workdir", str(self.workdir(run)), "log.progress=false",
                *(f"{key}={format_value(value)}" for key, value in values.items())]


def format_value(value) -> str:
    """A value as the YAML an override parses back to the same value."""
    if isinstance(value, float):
        return repr(value)
    return yaml.safe_dump(value, default_flow_style=True, width=1 << 20).strip().removesuffix("...").strip()


def _short(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return format_value(value).replace(" ", "").replace("/", "_")


def _run_names(combos: list[dict]) -> list[str]:
    keys = list(combos[0]) if combos else []
    tails = [key.rsplit(".", 1)[-1] for key in keys]
    labels = [tail if tails.count(tail) == 1 else key for key, tail in zip(keys, tails)]
    names = [",".join(f"{label}={_short(combo[key])}" for key, label in zip(keys, labels)) or "run"
             for combo in combos]
    if len(set(names)) != len(names):  # e.g. random draws that print alike: number them
        names = [f"{i:03d}_{name}" for i, name in enumerate(names)]
    return names


def _sample(spec: dict, rng: np.random.Generator):
    """One draw from a validated distribution spec such as {log_uniform: [1e-4, 1e-2]}."""
    ((kind, args),) = spec.items()
    if kind == "choice":
        return args[int(rng.integers(len(args)))]
    lo, hi = args
    if kind == "log_uniform":
        return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))
    if kind == "uniform":
        return float(rng.uniform(lo, hi))
    return int(rng.integers(lo, hi + 1))  # int_uniform, both ends included


def _check_random(random: dict, where: str) -> None:
    if not isinstance(random, dict) or not isinstance(random.get("params"), dict):
        raise UsageError(f"{where}: random needs 'samples' (a count), 'params' (key: distribution) and optionally "
                         "'seed'")
    if not isinstance(random.get("samples"), int) or random["samples"] < 1:
        raise UsageError(f"{where}: random.samples must be a positive integer")
    for key, spec in random["params"].items():
        ok = isinstance(spec, dict) and len(spec) == 1 and next(iter(spec)) in DISTRIBUTIONS
        args = next(iter(spec.values())) if ok else None
        if not ok or not isinstance(args, list) or (next(iter(spec)) != "choice" and len(args) != 2):
            raise UsageError(f"{where}: random.params.{key} must be one of {{log_uniform: [lo, hi]}}, "
                             "{uniform: [lo, hi]}, {int_uniform: [lo, hi]} or {choice: [a, b, ...]}")
        if next(iter(spec)) == "log_uniform" and min(args) <= 0:
            raise UsageError(f"{where}: random.params.{key}: log_uniform bounds must be positive")


def load_sweep(path: str | os.PathLike) -> Sweep:
    path = Path(path).absolute()
    if not path.is_file():
        raise UsageError(f"sweep file {path} does not exist")
    spec = read_yaml_mapping(path, "sweep file")
    unknown = set(spec) - SWEEP_KEYS
    if unknown:
        raise UsageError(f"sweep file {path}: unknown key(s) {sorted(unknown)}; valid keys: {sorted(SWEEP_KEYS)}")
    if "base" not in spec:
        raise UsageError(f"sweep file {path} needs 'base: <config file>'")
    base = (path.parent / spec["base"]).resolve()
    overrides = spec.get("overrides") or {}
    if isinstance(overrides, list):  # also accept ["a.b=1", ...]
        overrides = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in overrides)}
    grid, zipped = spec.get("grid") or {}, spec.get("zip") or {}
    for section, axes in (("grid", grid), ("zip", zipped)):
        if not isinstance(axes, dict) or not all(isinstance(v, list) and v for v in axes.values()):
            raise UsageError(f"sweep file {path}: {section} must map dotted keys to non-empty lists of values")
    if len({len(v) for v in zipped.values()}) > 1:
        raise UsageError(f"sweep file {path}: the zip lists must have equal lengths, got "
                         + ", ".join(f"{k}: {len(v)}" for k, v in zipped.items()))
    axes = [[{key: value} for value in values] for key, values in grid.items()]
    if zipped:
        axes.append([dict(zip(zipped, row)) for row in zip(*zipped.values())])
    random = spec.get("random")
    if random is not None:
        _check_random(random, f"sweep file {path}")
        rng = np.random.default_rng(random.get("seed", 0))
        samples = [{key: _sample(dist, rng) for key, dist in random["params"].items()}
                   for _ in range(random["samples"])]
        axes.append(samples)
    combos = [{k: v for part in parts for k, v in part.items()} for parts in itertools.product(*axes)]
    mode = spec.get("mode", "min")
    if mode not in ("min", "max"):
        raise UsageError(f"sweep file {path}: mode={mode!r} must be min or max")
    metric = spec.get("metric", "eval/loss")
    if not isinstance(metric, str) or metric.count("/") != 1:
        raise UsageError(f"sweep file {path}: metric={metric!r} must be split/name, e.g. eval/accuracy")
    directory = Path(spec.get("directory") or Path("runs") / path.stem)
    if not directory.is_absolute():
        directory = Path.cwd() / directory
    runs = [RunSpec(name, combo) for name, combo in zip(_run_names(combos), combos)]
    return Sweep(path, base, overrides, runs, metric, mode, directory, spec.get("slurm") or {})


def validate_runs(sweep: Sweep) -> None:
    """Loads every run's config before any run starts; the first bad one stops the sweep."""
    for run in sweep.runs:
        args = sweep.argv(run)
        try:
            load_config(sweep.base, args[4:], args[3])
        except UsageError as e:
            raise UsageError(f"run '{run.name}': {e}") from None


# ---------------------------------------------------------------------------------------------
# status and index


def read_status(workdir: Path) -> dict:
    path = workdir / "status.json"
    return json.loads(path.read_text()) if path.exists() else {}


def write_json(path: Path, record: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # SLURM array tasks may write at once
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, path)


def final_metrics(workdir: Path) -> dict[str, float]:
    """The last value of each split/name in a run's metrics.jsonl."""
    final: dict[str, float] = {}
    for record in read_records(workdir / "metrics.jsonl"):
        for name, value in record.items():
            if name not in ("step", "split", "source") and isinstance(value, (int, float)):
                final[f"{record['split']}/{name}"] = value
    return final


def write_index(sweep: Sweep) -> None:
    """sweep.jsonl: one line per run (name, overrides, status, final metrics, error)."""
    lines = []
    for run in sweep.runs:
        status = read_status(sweep.workdir(run))
        lines.append(json.dumps({"name": run.name, "overrides": run.overrides, "workdir": str(sweep.workdir(run)),
                                 "status": status.get("status", "pending"), "error": status.get("error"),
                                 "seconds": status.get("seconds"), "final": final_metrics(sweep.workdir(run))}))
    tmp = sweep.directory / f".sweep.jsonl.{os.getpid()}.tmp"
    tmp.write_text("".join(line + "\n" for line in lines))
    os.replace(tmp, sweep.directory / "sweep.jsonl")
    write_json(sweep.directory / "sweep.json", {"sweep_file": str(sweep.path), "metric": sweep.metric,
                                                "mode": sweep.mode, "runs": [r.name for r in sweep.runs]})


# ---------------------------------------------------------------------------------------------
# running


def run_one(sweep: Sweep, run: RunSpec, env: dict | None = None) -> int:
    """Trains one run in a child process, recording its status; returns its exit code."""
    workdir = sweep.workdir(run)
    workdir.mkdir(parents=True, exist_ok=True)
    write_json(workdir / "status.json", {"status": "running", "pid": os.getpid()})
    start = time.time()
    with open(workdir / "run.log", "a") as log:
        child = subprocess.Popen([sys.executable, str(LAUNCH), *sweep.argv(run)], stdout=log,
                                 stderr=subprocess.STDOUT, env=env or dict(os.environ), start_new_session=True)
        code = _wait(child)
    status = {0: "finished", 143: "interrupted"}.get(code, "failed")
    record = {"status": status, "exit_code": code, "seconds": round(time.time() - start, 2)}
    if status == "failed":
        record["error"] = _last_error(workdir / "run.log")
    write_json(workdir / "status.json", record)
    return code


_children: list[subprocess.Popen] = []


def _wait(child: subprocess.Popen) -> int:
    _children.append(child)
    try:
        return child.wait()
    finally:
        _children.remove(child)


def _last_error(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or ["no output"])[-1][:1000]


def pending_runs(sweep: Sweep, retry_failed: bool) -> list[RunSpec]:
    """Runs still to do: not finished, and failed ones only with retry_failed."""
    todo = []
    for run in sweep.runs:
        status = read_status(sweep.workdir(run)).get("status")
        if status == "finished" or (status == "failed" and not retry_failed):
            continue
        todo.append(run)
    return todo


def device_envs(parallel: int) -> list[dict]:
    """One environment per parallel slot, splitting this host's devices between them."""
    base = dict(os.environ)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else _nvidia_gpus()
    if gpus and len(gpus) >= parallel:
        share = len(gpus) // parallel
        return [dict(base, CUDA_VISIBLE_DEVICES=",".join(gpus[i * share:(i + 1) * share])) for i in range(parallel)]
    flags = os.environ.get("XLA_FLAGS", "")
    marker = "--xla_force_host_platform_device_count="
    if marker in flags:  # simulated CPU devices: give each slot its share
        count = int(flags.split(marker, 1)[1].split()[0])
        share = max(count // parallel, 1)
        rest = " ".join(f for f in flags.split() if not f.startswith(marker))
        return [dict(base, XLA_FLAGS=f"{rest} {marker}{share}".strip()) for _ in range(parallel)]
    return [base] * parallel


def _nvidia_gpus() -> list[str]:
    path = Path("/proc/driver/nvidia/gpus")
    return [str(i) for i in range(len(list(path.iterdir())))] if path.is_dir() else []


def run_local(sweep: Sweep, parallel: int, retry_failed: bool) -> int:
    """Runs what is pending, `parallel` at a time; 0 if every run finished, else 1 (143 if stopped)."""
    todo = pending_runs(sweep, retry_failed)
    skipped = len(sweep.runs) - len(todo)
    print(f"sweep {sweep.path.name}: {len(sweep.runs)} runs, {skipped} already done or failed, {len(todo)} to run "
          f"({parallel} at a time) in {sweep.directory}", flush=True)
    stopping = []

    def stop(signum, frame):  # pass the preemption on: each child saves and exits 143
        stopping.append(signum)
        for child in list(_children):
            child.send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        envs = device_envs(parallel)
        slots: dict[int, tuple[RunSpec, threading.Thread]] = {}
        queue = list(todo)
        while (queue and not stopping) or slots:
            for slot in range(parallel):
                if slot not in slots and queue and not stopping:
                    run = queue.pop(0)
                    print(f"start {run.name}", flush=True)
                    thread = threading.Thread(target=run_one, args=(sweep, run, envs[slot]), daemon=True)
                    thread.start()
                    slots[slot] = (run, thread)
            for slot, (run, thread) in list(slots.items()):
                if not thread.is_alive():
                    del slots[slot]
                    print(f"{read_status(sweep.workdir(run)).get('status', '?'):>11} {run.name}", flush=True)
                    write_index(sweep)
            time.sleep(0.1)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        write_index(sweep)
    if stopping:
        return 143
    statuses = [read_status(sweep.workdir(run)).get("status") for run in sweep.runs]
    return 0 if all(s == "finished" for s in statuses) else 1


# ---------------------------------------------------------------------------------------------
# SLURM job arrays


def sbatch_script(sweep: Sweep, runs: list[RunSpec]) -> str:
    """An sbatch script with one array task per run; each task trains its run by index."""
    resources = {"partition": None, "time": None, "cpus_per_task": None, "gres": None, "mem": None,
                 "nodes": None, "ntasks": None, "account": None, "qos": None}
    resources.update(sweep.slurm)
    lines = ["#!/bin/bash", f"#SBATCH --job-name=sweep-{sweep.path.stem}", f"#SBATCH --array=0-{len(runs) - 1}",
             f"#SBATCH --output={sweep.directory}/slurm-%A_%a.out"]
    for key, value in resources.items():
        if value is not None:
            lines.append(f"#SBATCH --{key.replace('_', '-')}={value}")
    names = " ".join(run.name for run in runs)
    lines += [f"cd {Path.cwd()}",
              f"exec {sys.executable} {LAUNCH} sweep {sweep.path} --run-task \"$SLURM_ARRAY_TASK_ID\" "
              f"--task-runs '{names}'"]
    return "\n".join(lines) + "\n"


def submit_slurm(sweep: Sweep, retry_failed: bool) -> int:
    todo = pending_runs(sweep, retry_failed)
    if not todo:
        print("nothing to submit: every run is finished")
        return 0
    script = sweep.directory / "sweep.sbatch"
    script.write_text(sbatch_script(sweep, todo))
    for run in todo:
        sweep.workdir(run).mkdir(parents=True, exist_ok=True)
        write_json(sweep.workdir(run) / "status.json", {"status": "submitted"})
    write_index(sweep)
    result = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    if result.returncode != 0:
        raise UsageError(f"sbatch refused {script}: {result.stderr.strip()}")
    print(f"submitted job array {result.stdout.strip()} ({len(todo)} runs): {script}")
    return 0


def run_task(sweep: Sweep, index: int, names: list[str]) -> int:
    """Inside a SLURM array task: train run `names[index]`."""
    by_name = {run.name: run for run in sweep.runs}
    code = run_one(sweep, by_name[names[index]])
    write_index(sweep)
    return 0 if code == 0 else 1


def main(sweep_file: str, parallel: int, backend: str, retry_failed: bool, task: int | None = None,
         task_runs: str | None = None) -> int:
    sweep = load_sweep(sweep_file)
    if task is not None:
        return run_task(sweep, task, (task_runs or "").split())
    validate_runs(sweep)  # one bad value stops the sweep before anything runs
    sweep.directory.mkdir(parents=True, exist_ok=True)
    write_index(sweep)
    if backend == "slurm":
        return submit_slurm(sweep, retry_failed)
    code = run_local(sweep, parallel, retry_failed)
    from engine.report import report

    report([sweep.directory], metric=sweep.metric, mode=sweep.mode, out=sweep.directory)
    return code
