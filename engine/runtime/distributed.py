"""jax.distributed initialisation, from (in order): explicit settings, a cluster environment
JAX detects (SLURM, Open MPI, TPU pods), a tf.distribute TF_CONFIG, or none (one process).
On Kubernetes pass the explicit settings (see docs/multihost.md). Also the timed barriers that say
which process did not arrive."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import jax

from engine.errors import DistributedError, UsageError, exit_now
from engine.runtime.preemption import release_signals


@dataclass(frozen=True)
class TFConfigTask:
    """What a TF_CONFIG says this process is."""

    kind: str  # "trainer" or "evaluator"
    coordinator_address: Optional[str] = None
    num_processes: int = 1
    process_id: int = 0


def parse_tf_config(text: str) -> TFConfigTask:
    """tf.distribute's TF_CONFIG → coordinator address and process id.

    chief (if any) then workers, in order, are processes 0..N-1; the first of them hosts the
    coordinator at its address. An `evaluator` task runs the sidecar evaluator; `ps` tasks
    have no counterpart: parameter servers are replaced by sharding over the fsdp axis.
    """
    example = '{"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", "index": 0}}'
    try:
        spec = json.loads(text)
        cluster, task = spec["cluster"], spec["task"]
        kind, index = task["type"], task["index"]
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(f"TF_CONFIG is not valid: {e!s}; expected {example}") from None
    if not isinstance(cluster, dict) or not all(isinstance(v, list) for v in cluster.values()):
        raise UsageError(
            f"TF_CONFIG's cluster must map task types to lists of addresses, got {cluster!r}; expected {example}"
        )
    if isinstance(index, str) and index.isdigit():
        index = int(index)
    if not isinstance(kind, str) or not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise UsageError(f"TF_CONFIG's task must name a type and a whole index, got {task!r}; expected {example}")
    for role, addresses in cluster.items():
        for address in addresses:
            check_address(address, f"TF_CONFIG cluster.{role}")
    if kind == "ps":
        raise UsageError(
            "TF_CONFIG task type 'ps': parameter servers are not used here; parameters and optimizer "
            "state are sharded over the mesh's fsdp axis instead (mesh.fsdp=N). Start only chief and "
            "worker tasks (and optionally an evaluator)"
        )
    if kind == "evaluator":
        return TFConfigTask("evaluator")
    trainers = [(role, i, address) for role in ("chief", "worker") for i, address in enumerate(cluster.get(role, []))]
    if not trainers:
        raise UsageError("TF_CONFIG has no chief or worker addresses in 'cluster'")
    ids = {(role, i): n for n, (role, i, _) in enumerate(trainers)}
    if (kind, index) not in ids:
        raise UsageError(f"TF_CONFIG task {kind}:{index} is not in its cluster ({len(trainers)} chief/worker tasks)")
    return TFConfigTask("trainer", trainers[0][2], len(trainers), ids[(kind, index)])


def detected_cluster() -> Optional[str]:
    """The cluster environment JAX can initialise from by itself, if it holds several processes."""
    env = os.environ
    if "SLURM_JOB_ID" in env and int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1"))) > 1:
        return "SLURM"
    if int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return "Open MPI"
    if "," in env.get("TPU_WORKER_HOSTNAMES", "") or int(env.get("MEGASCALE_NUM_SLICES", "1")) > 1:
        return "TPU pod"
    return None


def initialize(cfg) -> str:
    """Starts jax.distributed when the job has several processes; returns how they were found.
    `cfg`: the config's `distributed` section (engine/config/schema.py's DistributedConfig)."""
    found = _job(cfg)
    if found is None:
        return "single process" if not os.environ.get("TF_CONFIG") else "TF_CONFIG (single process)"
    source, kwargs = found
    if cfg.coordinator_bind_address:
        kwargs["coordinator_bind_address"] = cfg.coordinator_bind_address
    # CPU collectives between processes go through gloo (a no-op setting on GPU and TPU).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if "coordinator_address" in kwargs:
        # JAX aborts the whole process (no Python error) when the others do not join in time;
        # say first what is being waited for, and fail cleanly if the coordinator never answers.
        print(
            f"process {kwargs['process_id']} of {kwargs['num_processes']}: joining the job at "
            f"{kwargs['coordinator_address']} ({source}; timeout {cfg.initialization_timeout}s)",
            file=sys.stderr,
            flush=True,
        )
        if kwargs["process_id"] != 0:
            wait_for_coordinator(kwargs["coordinator_address"], cfg.initialization_timeout, kwargs["process_id"])
    release_signals()  # several processes: JAX's own SIGTERM notifier feeds the preemption sync point
    deadline = _join_deadline(
        cfg.initialization_timeout, kwargs.get("process_id", "?"), kwargs.get("num_processes", "?"), source
    )
    try:
        jax.distributed.initialize(
            initialization_timeout=cfg.initialization_timeout, heartbeat_timeout_seconds=cfg.heartbeat_timeout, **kwargs
        )
    except (RuntimeError, ValueError) as e:  # jaxlib's errors derive from RuntimeError
        where = kwargs.get("coordinator_address", f"the {source} coordinator")
        raise DistributedError(
            f"process {kwargs.get('process_id', '?')} could not join the job at {where} within "
            f"{cfg.initialization_timeout}s ({source}): {first_line(e)}. Check that every process was started "
            f"with the same coordinator and process count, and that the coordinator's port is reachable"
        ) from None
    finally:
        deadline.cancel()
    print(
        f"process {jax.process_index()} of {jax.process_count()}: joined the job ({source}); "
        f"{jax.device_count()} devices in all, {jax.local_device_count()} here",
        file=sys.stderr,
        flush=True,
    )
    return source


def _job(cfg) -> Optional[tuple[str, dict[str, Any]]]:
    """(how the processes were found, jax.distributed.initialize's arguments), or None for a job
    of one process: explicit settings, else a cluster JAX detects, else TF_CONFIG."""
    if cfg.coordinator_address or cfg.num_processes > 1:
        if not cfg.coordinator_address or cfg.num_processes < 1 or cfg.process_id < 0:
            raise UsageError(
                "set all of distributed.coordinator_address (host:port), distributed.num_processes "
                "and distributed.process_id (or --coordinator-address, --num-processes, --process-id)"
            )
        check_address(cfg.coordinator_address, "distributed.coordinator_address")
        if cfg.process_id >= cfg.num_processes:
            raise UsageError(
                f"distributed.process_id={cfg.process_id} must be below distributed.num_processes={cfg.num_processes}"
            )
        return "explicit settings", dict(
            coordinator_address=cfg.coordinator_address, num_processes=cfg.num_processes, process_id=cfg.process_id
        )
    cluster = detected_cluster()
    if cluster:
        return cluster, {}
    tf_config = os.environ.get("TF_CONFIG")
    if not tf_config:
        return None
    task = parse_tf_config(tf_config)
    if task.kind == "evaluator" or task.num_processes == 1:
        return None
    return "TF_CONFIG", dict(
        coordinator_address=task.coordinator_address, num_processes=task.num_processes, process_id=task.process_id
    )


def _join_deadline(timeout_seconds: int, process_id, num_processes, source: str) -> threading.Timer:
    """A process whose job never assembles (a peer never started, or failed at start) would be
    aborted by jaxlib at the initialization timeout with a C++ stack: this ends it a moment
    before, with one line and exit 1."""

    def give_up():
        who = f"process {process_id} of {num_processes}" if process_id != "?" else "this process"
        exit_now(
            f"error: {who}: the job did not assemble within {timeout_seconds}s (distributed."
            f"initialization_timeout, {source}): a process was never started, failed at start, or was given "
            f"another coordinator or process count; see the other processes' output",
            1,
        )

    timer = threading.Timer(max(timeout_seconds - 2, 1), give_up)
    timer.daemon = True
    timer.start()
    return timer


def check_address(address, where: str) -> None:
    """`host:port` with a port number: UsageError naming `where` otherwise."""
    host, _, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(
            f"{where}: {address!r} is not an address host:port (a port from 1 to 65535), e.g. 10.0.0.1:12345"
        )


def wait_for_coordinator(address: str, timeout_seconds: int, process_id: int) -> None:
    """Retries a TCP connection to the coordinator until it answers or the timeout passes."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_seconds
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
                return
        except OSError as e:
            if time.monotonic() > deadline:
                raise DistributedError(
                    f"process {process_id} could not reach the coordinator (process 0) at "
                    f"{address} within {timeout_seconds}s: {e}. Is process 0 running, and is "
                    f"that address reachable from here?"
                ) from None
            time.sleep(0.5)


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:500]


def barrier(name: str, timeout_seconds: int, among: Any = None) -> None:
    """Waits until every process (or every one of `among`'s: a RunProcesses of some of them, engine/
    runtime/processes.py) reaches `name`; DistributedError naming the ones that did not."""
    if jax.process_count() == 1:
        return
    from jax._src import distributed as jax_distributed  # the coordination-service client

    client = jax_distributed.global_state.client
    assert client is not None, "jax.distributed is initialised when there are several processes"
    try:
        if among is None:
            client.wait_at_barrier(name, timeout_seconds * 1000)
        else:
            client.wait_at_barrier(f"{name}@{among.name}", timeout_seconds * 1000, process_ids=list(among.ids))
    except Exception as e:  # the client raises jaxlib's own error type, which names the missing tasks
        missing = missing_processes(first_line(e))
        who = f"process(es) {missing}" if missing else "some process"
        raise DistributedError(
            f"{who} did not reach '{name}' within {timeout_seconds}s (distributed.barrier_timeout): {first_line(e)}"
        ) from None


def missing_processes(message: str) -> str:
    """Task numbers that the coordination service reports in a barrier error, e.g. '/task:1'."""
    import re

    tasks = sorted({int(t) for t in re.findall(r"task:(\d+)", message)})
    return ", ".join(map(str, tasks))
