"""`launch.py sweep SWEEP.yaml --devices-per-trial N`: one process splits its devices into
sub-meshes of N and trains a trial on each at once, one thread per sub-mesh.

Each trial is an ordinary run (engine/run/single.py `fit`) built on its sub-mesh's devices:
its own config, mesh layout within the sub-mesh, compiled programs, data pipeline, workdir,
checkpoints and records, so its outputs are those of the same config trained alone on N
devices. The trials form a queue (a grid/zip/random sweep's pending runs, or an Optuna
study's next trials); when a trial finishes, is pruned or fails, its sub-mesh takes the
next one. A failure (a NaN loss, a layout that does not fit the sub-mesh, an exception in
its data or step) ends that trial alone, recorded with its reason in its status.json and
sweep.jsonl; the others train on. With `vectorize` in the sweep file, trials that share a
compiled program are packed: a sub-mesh takes such a group (engine/run/group.py, its trials
side by side on a `trial` axis of the sub-mesh where its size allows) as one queue item, each
trial keeping its own workdir, records, checkpoints and status (a NaN stops it alone), and
the group's console in DIRECTORY/groups/<id>.log as a sweep's vectorised child process has.

In a job of several processes (every process runs the sweep command) each process trains the
sub-meshes that hold its devices: a sub-mesh lies within one process (N divides its devices)
or is the whole job's devices (each trial on every process, SPMD). The queue is the job's:
process 0 publishes the runs still to do in the coordination service's key-value store, a
sub-mesh's lowest process takes the next by the store's counter and tells the sub-mesh's other
processes which. A trial's chief, barriers and checkpoint commits are its own processes'
(engine/runtime/processes.py); the processes wait for each other once, at the sweep's end.

JAX dispatch is thread-safe; what the run path keeps per process is made per thread here:
its console output (each trial's goes to its workdir's run.log: `Routed`), its stop (SIGTERM
to the sweep stops every trial at its next step, which saves: engine.runtime.preemption.
thread_stop) and its judge (a search trial's records go to the pruner on its own thread:
engine.sweep.judge.InProcess). `DIRECTORY/submesh.jsonl` logs each trial's start, its train
and eval records and its end, with times and sub-meshes (the benchmark reads it).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from engine.errors import UsageError
from engine.runtime.judged import InProcess, Judged, judged_here
from engine.runtime.per_thread import given
from engine.runtime.processes import RunProcesses
from engine.runtime.rundir import STATUS, append_line, read_status, write_json
from engine.runtime.watchdog import hang_here
from engine.sweep.local import group_ident
from engine.sweep.progress import Progress, Routed
from engine.sweep.search import BEAT_SECONDS, running_status
from engine.sweep.spec import RunSpec, Sweep
from engine.sweep.trials import KEY, WAIT_MS, Queue

EVENTS = "submesh.jsonl"


def submeshes(devices: list, per_trial: int) -> list[list]:
    """The devices in consecutive groups of `per_trial` (each process's devices are consecutive
    in jax.devices(), so a group lies within a process where the sizes allow)."""
    if per_trial < 1 or len(devices) % per_trial:
        raise UsageError(
            f"--devices-per-trial {per_trial} does not divide the {len(devices)} devices of this job; "
            f"use a divisor of {len(devices)}"
        )
    return [devices[i : i + per_trial] for i in range(0, len(devices), per_trial)]


def check_layout(per_trial: int, per_process: int, processes: int, sweep: Optional[Sweep] = None) -> None:
    """UsageError unless each sub-mesh of `per_trial` devices lies within one process or spans whole
    processes, and (`sweep`) what it trains may span processes: a search's trials are judged on one
    process, a vectorised group trains within one."""
    if processes == 1:
        return
    if not (per_process % per_trial == 0 if per_trial <= per_process else per_trial % per_process == 0):
        within = [n for n in range(1, per_process + 1) if per_process % n == 0]
        spanning = [per_process * n for n in range(2, processes + 1) if processes % n == 0]
        raise UsageError(
            f"--devices-per-trial {per_trial} in a job of {processes} processes x {per_process} devices: a sub-mesh "
            f"lies within one process or spans whole processes; use --devices-per-trial {', '.join(map(str, within))} "
            f"(trials within one process) or {', '.join(map(str, spanning))} (each trial on whole processes)"
        )
    if sweep is not None and sweep.search and per_trial > per_process:
        raise UsageError(
            f"a search sweep's trials span no processes (their pruning is judged on one): use --devices-per-trial "
            f"{per_process} or fewer, or make it a grid or random sweep"
        )
    if sweep is not None and sweep.vectorize and per_trial > per_process:
        raise UsageError(
            f"a vectorised group trains within one process: use --devices-per-trial {per_process} or fewer to pack "
            f"trials that share a program on sub-meshes, or remove vectorize from the sweep file (each trial then "
            f"spans {per_trial // per_process} processes alone)"
        )


def job_client():
    """The coordination service's client of a multi-process job (None for a process alone)."""
    from jax._src import distributed

    return distributed.global_state.client


class Scheduler:
    """One worker thread per sub-mesh of this process (`mine`: their indices in `meshes`, the
    job's), each training the queue's next trial until none is left."""

    def __init__(self, sweep: Sweep, meshes: list[list], queue: Queue, progress: Progress, mine: list[int]):
        self.sweep, self.meshes, self.queue, self.progress, self.mine = sweep, meshes, queue, progress, mine
        self.stopping = threading.Event()
        self.stops: dict[int, threading.Event] = {}  # sub-mesh → its trial's stop
        self.hung: dict[int, str] = {}  # slot → why its trial was failed as hung (its sub-mesh given up)
        self.running: dict[Path, dict] = {}  # workdir → the status of a run this process trains (beat())
        self.status_lock = threading.Lock()
        self.events_lock, self.config_lock = threading.Lock(), threading.Lock()
        self.stdout, self.stderr = Routed(sys.stdout), Routed(sys.stderr)

    def event(self, kind: str, mesh: int, run: str, **fields) -> None:
        line = json.dumps({"time": time.time(), "event": kind, "submesh": mesh, "run": run, **fields})
        with self.events_lock:
            append_line(self.sweep.directory / EVENTS, line + "\n")

    def stop(self) -> None:
        """Every trial saves at its next step and stops (interrupted: a re-run resumes it)."""
        self.stopping.set()
        for event in list(self.stops.values()):
            event.set()

    def work(self, slot: int) -> None:
        index = self.mine[slot]
        devices, processes = self.meshes[index], RunProcesses.of(self.meshes[index])
        for turn in itertools.count():
            taken = self.next(index, processes, turn)
            if taken is None:
                self.progress.idle(slot)
                return
            runs, trial = taken
            hung = functools.partial(self.abandon, slot, index, runs, trial)  # (its watchdog's, on a hang)
            with hang_here(hung) if processes.count == 1 else contextlib.nullcontext():
                if len(runs) == 1:
                    ended = [(runs[0], self.train(index, slot, devices, runs[0], trial))]
                else:
                    ended = self.train_group(index, slot, devices, runs)
            if slot in self.hung:  # (its thread moved again after its trial was failed: the sub-mesh stays given up)
                return
            for run, status in ended:
                self.progress.ended(slot, run.name, status)
            if processes.chief:  # (once per queue item)
                self.queue.index()

    def next(self, index: int, processes: RunProcesses, turn: int) -> Optional[tuple[list[RunSpec], Any]]:
        """The sub-mesh's next trial: its lowest process takes it from the queue and tells the others."""
        if processes.count == 1:
            return self.queue.take(self.stopping)
        key, client = f"{KEY}/submesh{index}/{turn}", self.queue.client
        assert client is not None, "a sub-mesh of several processes trains a grid, zip or random sweep"
        if processes.chief:
            taken = self.queue.take(self.stopping)
            assert taken is None or len(taken[0]) == 1, "no vectorised group spans processes (run_submeshes)"
            client.key_value_set(key, taken[0][0].name if taken else "")
            return taken
        name = client.blocking_key_value_get(key, WAIT_MS)
        return ([self.queue.run(name)], None) if name else None

    def train(self, index: int, slot: int, devices: list, run: RunSpec, trial) -> dict:
        """Trains (or resumes) one run on `devices` on this thread; its status, as recorded (by the
        run's chief: the lowest of its processes; the others log to run.process<P>.log)."""
        from engine.run.single import fit
        from engine.runtime.preemption import thread_stop
        from engine.runtime.rundir import final_metrics

        workdir = self.sweep.workdir(run)
        workdir.mkdir(parents=True, exist_ok=True)
        started, chief = time.time(), RunProcesses.of(devices).chief
        if chief:
            self.set_status(workdir, running_status(submesh=index))
        stop = self.trial_stop(index)
        verdict = self.queue.verdict(trial)
        pruned: list[bool] = []

        def judge(record: dict) -> bool:
            self.progress.record(slot, record)
            self.event(record["split"], index, run.name, step=record["step"])
            go = verdict(record)
            if not go:
                pruned.append(True)
            return go

        self.progress.started(slot, run.name, devices)
        if chief:
            self.event("start", index, run.name, devices=[d.id for d in devices])
        with open(workdir / log_name(chief), "a") as log, judged_here(InProcess(judge, stop)), thread_stop(stop):
            with self.config_lock:  # (the sweep's cache of loaded configs)
                cfg = self.sweep.config(run)
            record = self.outcome(log, lambda: fit(cfg, started=started, devices=devices), pruned)
        record.update(submesh=index, seconds=round(time.time() - started, 2))
        record["exit_code"] = 0 if record["status"] == "finished" else 1
        if trial is not None:
            record["trial"] = trial.number
        final = final_metrics(workdir)
        if chief and slot not in self.hung:  # (the study told first: queue.tell)
            self.queue.tell(trial, record["status"], final.get(self.sweep.metric))
            self.set_status(workdir, record)
            self.event("end", index, run.name, status=record["status"], error=record.get("error"))
        return {**record, "final": final}

    def train_group(self, index: int, slot: int, devices: list, runs: list[RunSpec]) -> list[tuple[RunSpec, dict]]:
        """Trains (or resumes) runs that share a compiled program as one vectorised group on
        `devices` (a sub-mesh within this process) on this thread; each run's status, as recorded.
        A run whose loss becomes non-finite fails alone; anything else that ends the group ends
        each of its runs the same way."""
        from engine.run.group import fit_group
        from engine.runtime.preemption import thread_stop
        from engine.runtime.rundir import final_metrics

        started, ident = time.time(), group_ident(runs)
        (self.sweep.directory / "groups").mkdir(parents=True, exist_ok=True)
        workdirs = {run.name: self.sweep.workdir(run) for run in runs}
        for workdir in workdirs.values():
            workdir.mkdir(parents=True, exist_ok=True)
            self.set_status(workdir, running_status(submesh=index, group=ident))
        stop, stopped = self.trial_stop(index), {}  # (workdir → why its run stopped alone)

        def judge_of(run: RunSpec) -> InProcess:  # (a grid's runs: nothing is pruned; records shown and logged)
            def judge(record: dict) -> bool:
                self.progress.record(slot, {**record, "run": run.name})
                self.event(record["split"], index, run.name, step=record["step"])
                return True

            return InProcess(judge, stop)

        self.progress.started(slot, f"{runs[0].name} (+{len(runs) - 1} in one program)", devices)
        for run in runs:
            self.event("start", index, run.name, devices=[d.id for d in devices], group=ident)
        judges: dict[str, Judged] = {str(workdirs[run.name]): judge_of(run) for run in runs}
        log_path = self.sweep.directory / "groups" / f"{ident}.log"
        with open(log_path, "a") as log, judged_here(judges), thread_stop(stop):
            with self.config_lock:
                cfgs = [self.sweep.config(run) for run in runs]

            def on_stop(cfg, why: str) -> None:
                stopped[str(Path(cfg.workdir))] = why

            group = self.outcome(log, lambda: fit_group(cfgs, started, on_stop=on_stop, devices=devices), [])
        ended: list[tuple[RunSpec, dict]] = []
        for run in runs if slot not in self.hung else ():
            workdir = workdirs[run.name]
            record = dict(group, submesh=index, group=ident, seconds=round(time.time() - started, 2))
            if str(workdir) in stopped:
                record.update(status="failed", error=f"error: training stopped: {stopped[str(workdir)]}")
            record["exit_code"] = 0 if record["status"] == "finished" else 1
            self.set_status(workdir, record)
            self.event("end", index, run.name, status=record["status"], error=record.get("error"))
            ended.append((run, {**record, "final": final_metrics(workdir)}))
        return ended

    def abandon(self, slot: int, index: int, runs: list[RunSpec], trial, why: str) -> None:
        """A trial's watchdog fired (on its own thread; the trial's thread stays where it hung): its
        runs fail with the reason, and its sub-mesh is given up (a hung collective may hold its
        devices) while the other sub-meshes train on."""
        self.hung[slot] = why
        self.stops[index].set()  # (should it move again: it saves and stops, recording nothing)
        self.queue.tell(trial, "failed", None)
        for run in runs:
            record = {"status": "failed", "submesh": index, "error": f"error: hung: {why}", "exit_code": 1}
            self.set_status(self.sweep.workdir(run), record)
            self.event("end", index, run.name, status="failed", error=record["error"])
            self.progress.ended(slot, run.name, record)
        self.queue.index()
        print(f"sub-mesh {index} is given up: {runs[0].name} hung", file=sys.__stderr__, flush=True)

    def set_status(self, workdir: Path, record: dict) -> None:
        """Writes a run's status.json; a running one's is written again by beat() while it runs."""
        with self.status_lock:
            write_json(workdir / STATUS, record)
            if record["status"] == "running":
                self.running[workdir] = record
            else:
                self.running.pop(workdir, None)

    def beat(self) -> None:
        """Each running trial's status, its `beat` renewed: a sweep process on another host (which
        cannot see this one's pid) takes a trial whose status stopped beating for abandoned."""
        with self.status_lock:
            for workdir, record in self.running.items():
                record["beat"] = time.time()
                write_json(workdir / STATUS, record)

    def trial_stop(self, index: int) -> threading.Event:
        """A new stop for sub-mesh `index`'s next trial (set at once if the sweep is stopping)."""
        stop = self.stops[index] = threading.Event()
        if self.stopping.is_set():
            stop.set()
        return stop

    def outcome(self, log, train: Callable[[], Any], pruned: list) -> dict[str, Any]:
        """Runs `train` with this thread's console going to `log`: how it ended ({"status"}, and an
        "error" if it failed: a NaN loss, a layout its sub-mesh cannot hold, an exception in its
        data or step, which ends this trial while the others train on)."""
        from engine.run.single import NonFiniteLoss, Preempted

        record = {"status": "failed"}
        try:
            with given(self.stdout.files, log), given(self.stderr.files, log):
                train()
            record["status"] = "finished"
        except Preempted:
            record["status"] = "pruned" if pruned else "interrupted"
        except NonFiniteLoss as e:
            record["error"] = f"error: training stopped: {e}"
        except UsageError as e:
            record["error"] = f"error: {e}"
        except Exception as e:
            traceback.print_exc(file=log)
            record["error"] = f"error: {type(e).__name__}: {e}"
        if "error" in record:
            print(record["error"], file=log, flush=True)
        return record

    @contextlib.contextmanager
    def stopped_by_signals(self) -> Iterator[None]:
        """While inside, SIGTERM and SIGINT stop the sweep (stop()) instead of ending the process: a
        process whose trials have ended waits for the job's others (process 0 holds the job's
        coordination service: if it went first, the others' trials could not save)."""
        previous = {
            sig: signal.signal(sig, lambda signum, frame: self.stop()) for sig in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def run(self) -> None:
        old = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = self.stdout, self.stderr
        threads = [  # (daemons: a hung trial's thread may never end)
            threading.Thread(target=self.work, args=(s,), name=f"submesh-{i}", daemon=True)
            for s, i in enumerate(self.mine)
        ]
        try:
            for thread in threads:
                thread.start()
            beaten = time.monotonic()
            while any(thread.is_alive() and slot not in self.hung for slot, thread in enumerate(threads)):
                if time.monotonic() - beaten > BEAT_SECONDS:
                    self.beat()
                    beaten = time.monotonic()
                self.progress.refresh()
                for thread in threads:
                    thread.join(timeout=0.5 / len(threads))
        finally:
            sys.stdout, sys.stderr = old
            self.progress.close()
            _given_up.extend(thread for slot, thread in enumerate(threads) if slot in self.hung)


_given_up: list[threading.Thread] = []  # the threads of hung trials, given up


def stuck() -> bool:
    """Whether a hung trial's thread is still where it hung (the process must then end with
    os._exit: an interpreter's exit would wait for, or abort in, that thread)."""
    return any(thread.is_alive() for thread in _given_up)


def run_submeshes(sweep: Sweep, per_trial: int, retry_failed: bool) -> int:
    """Trains the sweep's pending runs (or its search's trials) on sub-meshes of `per_trial`
    devices of this process; 0 if every run finished (a search: if none is left to start),
    143 if stopped, else 1."""
    import jax

    from engine.checkpoint.store import serial_saves

    meshes, client = submeshes(jax.devices(), per_trial), job_client()
    check_layout(per_trial, jax.local_device_count(), jax.process_count(), sweep)
    mine = [i for i, mesh in enumerate(meshes) if jax.process_index() in RunProcesses.of(mesh).ids]
    if jax.process_count() > 1 and len(mine) < len(meshes):  # each sub-mesh's processes number their saves apart
        from engine.checkpoint.among import own_operation_ids

        own_operation_ids(RunProcesses.of(meshes[mine[0]]).ids[0])
    serial_saves()  # (orbax's saves share one process-wide operation id)
    queue = Queue(sweep, retry_failed, client)
    total = sweep.search["trials"] if sweep.search else len(sweep.runs)
    print(
        f"sweep {sweep.path.name}: {total} runs on {len(meshes)} sub-meshes of {per_trial} device(s) "
        f"({jax.device_count()} {jax.devices()[0].platform} devices; this process's: {mine}) in {sweep.directory}",
        flush=True,
    )
    progress = Progress(len(mine), sweep.metric, sys.stderr, labels=mine)
    scheduler = Scheduler(sweep, meshes, queue, progress, mine)
    with scheduler.stopped_by_signals():
        scheduler.run()
        if client is not None:  # every process's trials have ended (or saved, stopped) before any reads how
            client.wait_at_barrier(f"{KEY}/end", WAIT_MS)
    if jax.process_index() == 0:
        queue.index()
    if scheduler.stopping.is_set():
        return 143
    statuses = [read_status(sweep.workdir(run)).get("status") for run in sweep.runs]
    if sweep.search:
        return 0
    return 0 if all(s == "finished" for s in statuses) else 1


def log_name(chief: bool) -> str:
    """A trial's log file on this process: its chief's run.log, the others' run.process<P>.log."""
    import jax

    return "run.log" if chief else f"run.process{jax.process_index()}.log"


def writes_report() -> bool:
    """Whether this process writes the sweep's report (process 0 of a job's)."""
    import jax

    return jax.process_index() == 0


def events(directory: Path) -> list[dict]:
    """The records of DIRECTORY/submesh.jsonl, in the order they were written."""
    path = Path(directory) / EVENTS
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
