"""Runs of a sweep as local processes, K at a time, each recording its status in its workdir;
the sweep's index (sweep.jsonl) is made from those statuses."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from engine.config import check_vectorizable, program_settings, shape_differences
from engine.errors import UsageError
from engine.observe.ranking import preload
from engine.runtime.launcher import SELF
from engine.runtime.rundir import STATUS, final_metrics, lock_holder, read_status, write_atomic, write_json
from engine.runtime.settings import DEVICE_COUNT_FLAG, with_cpu_devices
from engine.sweep.spec import RunSpec, Sweep


def write_index(sweep: Sweep) -> None:
    """sweep.jsonl: one line per run (name, overrides, status, final metrics, error)."""
    lines = []
    for run in sweep.runs:
        status = read_status(sweep.workdir(run))
        lines.append(
            json.dumps(
                {
                    "name": run.name,
                    "overrides": run.overrides,
                    "workdir": str(sweep.workdir(run)),
                    "status": status.get("status", "pending"),
                    "error": status.get("error"),
                    "seconds": status.get("seconds"),
                    "final": final_metrics(sweep.workdir(run)),
                }
            )
        )
    write_atomic(sweep.directory / "sweep.jsonl", "".join(line + "\n" for line in lines))
    write_json(
        sweep.directory / "sweep.json",
        {
            "sweep_file": str(sweep.path),
            "metric": sweep.metric,
            "mode": sweep.mode,
            "runs": [r.name for r in sweep.runs],
        },
    )


def run_one(sweep: Sweep, run: RunSpec, env: dict | None = None) -> int:
    """Trains one run in a child process, recording its status; returns its exit code."""
    workdir = sweep.workdir(run)
    workdir.mkdir(parents=True, exist_ok=True)
    write_json(workdir / STATUS, {"status": "running", "pid": os.getpid()})
    start = time.time()
    code = _child([*SELF, *sweep.argv(run)], workdir / "run.log", env)
    write_json(workdir / STATUS, _ended(code, workdir / "run.log", start))
    return code


def run_unit(sweep: Sweep, unit: list[RunSpec], env: dict, parallel: int = 1) -> int:
    """Trains one of units(): a run alone, or a vectorised group (whose process gets one CPU
    device per core of this slot's share of the host, `parallel` slots sharing it)."""
    if len(unit) == 1:
        return run_one(sweep, unit[0], env)
    return run_group(sweep, unit, cpu_devices_env(env, len(unit), parallel))


def run_group(sweep: Sweep, runs: list[RunSpec], env: dict | None = None) -> int:
    """Trains runs that share a compiled program as one vectorised child process (its output
    in the sweep directory's group-<id>.log); each run's status is its own: the child marks
    a run whose loss diverged failed, the others follow its exit code."""
    names, ident = [run.name for run in runs], group_ident(runs)
    groups = sweep.directory / "groups"
    groups.mkdir(exist_ok=True)
    write_atomic(groups / f"{ident}.json", json.dumps(names))
    for run in runs:
        sweep.workdir(run).mkdir(parents=True, exist_ok=True)
        write_json(sweep.workdir(run) / STATUS, {"status": "running", "pid": os.getpid(), "group": ident})
    start, log = time.time(), groups / f"{ident}.log"
    code = _child([*SELF, "sweep", str(sweep.path), "--run-group", str(groups / f"{ident}.json")], log, env)
    for run in runs:
        if read_status(sweep.workdir(run)).get("status") == "running":
            write_json(sweep.workdir(run) / STATUS, {**_ended(code, log, start), "group": ident})
    return code


def group_ident(runs: list[RunSpec]) -> str:
    """A vectorised group's name in the sweep directory's groups/ (its runs' names hashed)."""
    return hashlib.sha1("\n".join(run.name for run in runs).encode()).hexdigest()[:10]


def _child(argv: list[str], log_path: Path, env: dict | None) -> int:
    with open(log_path, "a") as log:
        child = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env or dict(os.environ), start_new_session=True
        )
        return _wait(child)


def _ended(code: int, log: Path, start: float) -> dict:
    """A run's status once its process has exited with `code`."""
    # stopped by a signal (saved, 143/130), or ended while this sweep was being stopped (a run
    # still starting has no handler yet): interrupted, resumed on the next run of the sweep
    status = "finished" if code == 0 else "interrupted" if code in (143, 130) or STOPPING.is_set() else "failed"
    record = {"status": status, "exit_code": code, "seconds": round(time.time() - start, 2)}
    if status == "failed":
        record["error"] = _last_error(log)
    return record


_children: list[subprocess.Popen] = []
_preloading: list = []  # report.preload's thread, once started
_preload_lock = threading.Lock()
REPORTS = threading.Event()  # set when this process draws the sweep's report once its runs end
STOPPING = threading.Event()  # set when this sweep process is told to stop (SIGTERM, SIGINT)


def preload_report() -> None:
    """In the process that draws the sweep's report: its plotting library starts loading (once)
    while the first child runs."""
    with _preload_lock:  # (parallel runs' threads each wait on a child)
        if REPORTS.is_set() and not _preloading:
            _preloading.append(preload())


def _wait(child: subprocess.Popen) -> int:
    _children.append(child)
    preload_report()
    if STOPPING.is_set():  # the stop came while this child was starting: it gets the signal too
        child.send_signal(signal.SIGTERM)
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
        return [dict(base, CUDA_VISIBLE_DEVICES=",".join(gpus[i * share : (i + 1) * share])) for i in range(parallel)]
    flags = os.environ.get("XLA_FLAGS", "")
    if DEVICE_COUNT_FLAG in flags:  # simulated CPU devices: give each slot its share
        count = int(flags.split(DEVICE_COUNT_FLAG, 1)[1].split()[0])
        share = max(count // parallel, 1)
        return [dict(base, XLA_FLAGS=with_cpu_devices(flags, share)) for _ in range(parallel)]
    return [base] * parallel


def cpu_devices_env(env: dict, trials: int, parallel: int) -> dict:
    """A vectorised group's environment: where its devices are the host's CPU, one CPU device
    per core of its slot (the most that divide the trials), so the trial axis runs on every
    core (XLA runs a small step on one core per device). Simulated devices already set stay;
    on a GPU or TPU host the flag only shapes the CPU platform, which the group does not use."""
    flags = env.get("XLA_FLAGS", "")
    if DEVICE_COUNT_FLAG in flags:
        return env
    cores = max(len(os.sched_getaffinity(0)) // parallel, 1)
    devices = max(d for d in range(1, cores + 1) if trials % d == 0)
    return dict(env, XLA_FLAGS=with_cpu_devices(flags, devices)) if devices > 1 else env


def _nvidia_gpus() -> list[str]:
    path = Path("/proc/driver/nvidia/gpus")
    return [str(i) for i in range(len(list(path.iterdir())))] if path.is_dir() else []


def _next_free(sweep: Sweep, queue: list[list[RunSpec]], waiting: set[str]):
    """The first queued unit (one run, or a vectorised group) whose workdirs no trainer holds.
    A trainer left running by an earlier sweep process (killed, its trainer orphaned) keeps
    its lock: its run waits for it to end, then starts and resumes (or finds it finished),
    instead of training twice at once."""
    for unit in queue:
        held = [(run, lock_holder(sweep.workdir(run))) for run in unit]
        held = [(run, holder) for run, holder in held if holder is not None]
        if not held:
            return unit
        for run, holder in held:
            if run.name not in waiting:
                waiting.add(run.name)
                print(f"waiting for {run.name}: a trainer still runs in its workdir ({holder})", flush=True)
    return None


def units(sweep: Sweep, todo: list[RunSpec]) -> list[list[RunSpec]]:
    """What runs as one process: each run alone, or (vectorize) runs that share a compiled
    program and resume from one step, up to sweep.vectorize per group; says how it grouped."""
    if not sweep.vectorize:
        return [[run] for run in todo]
    groups: dict[tuple, list[RunSpec]] = {}
    configs, alone = {}, []
    for run in todo:
        configs[run.name] = cfg = sweep.config(run)
        try:  # (the check a group's process would refuse the run with)
            check_vectorizable(cfg, f"run '{run.name}'")
        except UsageError as e:
            if not sweep.vectorize_auto:  # a number of runs per program was asked for: refused
                raise
            print(f"vectorize: {run.name} trains alone: {e}", flush=True)
            alone.append([run])
            continue
        key = (json.dumps(program_settings(cfg), sort_keys=True, default=str), _resume_step(sweep.workdir(run)))
        groups.setdefault(key, []).append(run)
    chunks = [runs[i : i + sweep.vectorize] for runs in groups.values() for i in range(0, len(runs), sweep.vectorize)]
    if chunks:
        print(
            f"vectorize: {sum(map(len, chunks))} runs as {len(chunks)} program(s) of "
            + ", ".join(str(len(c)) for c in chunks),
            flush=True,
        )
    listed = list(groups.items())
    for i, (key, runs) in enumerate(listed[1:], 1):
        same = [(k, r) for k, r in listed[:i] if k[0] == key[0]]  # one program, another resume step
        other_key, others = same[0] if same else listed[0]
        differs = shape_differences(configs[others[0].name], configs[runs[0].name])
        why = (
            f"{', '.join(differs)} change the compiled program"
            if differs
            else f"they resume from step {key[1]}, it from step {other_key[1]}"
        )
        print(f"  {runs[0].name} (+{len(runs) - 1}) apart from {others[0].name}: {why}", flush=True)
    return chunks + alone


def _ended_line(name: str, status: dict) -> str:
    """A run's line once its process ended: its status, and a failed run's reason (its last error line)."""
    line = f"{status.get('status', '?'):>11} {name}"
    return f"{line}: {status['error']}" if status.get("status") == "failed" and status.get("error") else line


def _resume_step(workdir: Path) -> int:
    """The newest complete checkpoint step in a workdir (0: none)."""
    steps = [int(p.name) for p in (workdir / "checkpoints").glob("*") if p.name.isdigit() and p.is_dir()]
    return max(steps, default=0)


def run_pending(sweep: Sweep, parallel: int, retry_failed: bool) -> int:
    """Runs what is pending, `parallel` at a time; 0 if every run finished, else 1 (143 if stopped)."""
    STOPPING.clear()  # a new sweep in this process has not been told to stop
    todo = pending_runs(sweep, retry_failed)
    statuses = [read_status(sweep.workdir(run)).get("status") for run in sweep.runs]
    failed = "" if retry_failed else f", {statuses.count('failed')} failed (--retry-failed runs them again)"
    resuming = sum(any(step.name.isdigit() for step in (sweep.workdir(run) / "checkpoints").glob("*")) for run in todo)
    print(
        f"sweep {sweep.path.name}: {len(sweep.runs)} runs, {statuses.count('finished')} finished{failed}, "
        f"{len(todo)} to run ({resuming} resuming from a checkpoint; {parallel} at a time) in {sweep.directory}",
        flush=True,
    )
    stopping = []

    def stop(signum, frame):  # pass the preemption on: each child saves and exits 143
        STOPPING.set()
        stopping.append(signum)
        for child in list(_children):
            child.send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        envs = device_envs(parallel)
        slots: dict[int, tuple[list[RunSpec], threading.Thread]] = {}
        queue, waiting = units(sweep, todo), set[str]()
        while (queue and not stopping) or slots:
            for slot in range(parallel):
                unit = slot not in slots and not stopping and _next_free(sweep, queue, waiting)
                if unit:
                    queue.remove(unit)
                    print(f"start {', '.join(run.name for run in unit)}", flush=True)
                    thread = threading.Thread(target=run_unit, args=(sweep, unit, envs[slot], parallel), daemon=True)
                    thread.start()
                    slots[slot] = (unit, thread)
            for slot, (unit, thread) in list(slots.items()):
                if not thread.is_alive():
                    del slots[slot]
                    for run in unit:
                        print(_ended_line(run.name, read_status(sweep.workdir(run))), flush=True)
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
