"""Process-wide settings of the command-line program, in one place, installed once by
`launch.py` at start-up (torchtitan's `init_logger()` in `train.py` is the model). Library
code (the Checkpointer, the trainer, a notebook importing the engine) changes none of this.

- JAX's compilation-cache events are counted (`compile_cache_events`) for the run summary.
- Orbax's restore of a damaged checkpoint leaves sibling read tasks, coroutines and
  tensorstore callbacks that print tracebacks (a closed event loop, exceptions never
  retrieved); the checkpointer reports the failure once in one line, so that noise is
  dropped from stderr, the asyncio log and the unraisable-exception hook.
- A save that meets a full disk logs its error from several orbax threads with tracebacks;
  the trainer reports it in one line, so those logs are dropped.
- Orbax logs "directory is read only" at every read of an evaluator's or export's
  checkpoints: silenced for the commands that only read.
- The TPU compiler (libtpu, installed for `launch.py plan`) is not started on a host without
  TPU chips: JAX would try it first and print libtpu's start-up errors. `plan` loads it
  through the topology API, which does not need the TPU backend.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import warnings
from collections import Counter

# Persistent compilation cache hits and misses in this process, from JAX's monitoring events
# (counted once `install()` has run; build_run reports the difference over its compiles).
compile_cache_events: Counter = Counter()

_installed = False


def install(reader: bool = False) -> None:
    """Installs the settings above (idempotent). reader: a command that only reads checkpoints
    (eval, export, sample), whose orbax read-only warnings are silenced."""
    global _installed
    if _installed:
        return
    _installed = True
    _xla_cpu_flags()
    import jax

    _skip_absent_tpu()
    jax.monitoring.register_event_listener(_count_cache_event)
    logging.getLogger("asyncio").addFilter(_DropOrphanedTaskErrors())
    logging.getLogger("absl").addFilter(_DropStorageFaultLogs())
    logging.getLogger("absl").addFilter(_DropReadOnlyNotice())
    if reader:
        logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's per-read "read only" warnings
    if not isinstance(sys.stderr, _WithoutClosedLoopTracebacks):
        sys.stderr = _WithoutClosedLoopTracebacks(sys.stderr)
    sys.unraisablehook = _drop_orphaned_reads(sys.unraisablehook)
    # and the writes of a save cut short by a full disk, never started
    warnings.filterwarnings(
        "ignore", message=r"coroutine 'async_serialize_from_host.*' was never awaited", category=RuntimeWarning
    )


# XLA:CPU's concurrency-optimised scheduler can order one program's collectives differently
# on different devices: 8 device threads on 2 cores then wait at two collectives for each other
# until the 40 s rendezvous timeout aborts the process (seen with an fsdp=8 llama step, 1 run
# in 2). Off, the collectives run in program order on every device. (A CPU flag: other
# backends ignore it. Set before any backend starts; an explicit setting in XLA_FLAGS wins.)
CPU_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count="


def with_cpu_devices(flags: str, devices: int) -> str:
    """XLA_FLAGS `flags` with the simulated CPU device count set to `devices` (replacing one already
    there) and every other flag kept: a launched process gets its share of devices and the user's
    own XLA settings (optimisation level, dumps, ...), as the launching process had them."""
    rest = [flag for flag in flags.split() if not flag.startswith(DEVICE_COUNT_FLAG)]
    return " ".join([*rest, f"{DEVICE_COUNT_FLAG}{devices}"])


def cpu_devices_in(flags: str) -> int | None:
    """The simulated CPU device count XLA_FLAGS `flags` sets, or None where it sets none."""
    counts = [flag.removeprefix(DEVICE_COUNT_FLAG) for flag in flags.split() if flag.startswith(DEVICE_COUNT_FLAG)]
    return int(counts[-1]) if counts and counts[-1].isdigit() else None


def _xla_cpu_flags() -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_enable_concurrency_optimized_scheduler" not in flags and xla_knows(CPU_SCHEDULER_FLAG):
        os.environ["XLA_FLAGS"] = f"{flags} {CPU_SCHEDULER_FLAG}".strip()


def xla_knows(flag: str) -> bool:
    """Whether this jaxlib's XLA defines the flag (an unknown flag in XLA_FLAGS aborts the process)."""
    import importlib.util
    import mmap
    from pathlib import Path

    spec = importlib.util.find_spec("jaxlib")
    name = flag.lstrip("-").split("=")[0].encode()
    for library in Path(spec.origin).parent.glob("*.so") if spec and spec.origin else ():
        with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data.find(name) >= 0:
                return True
    return False


def _skip_absent_tpu() -> None:
    """No TPU client where the host has no TPU chips and JAX_PLATFORMS leaves the choice to JAX
    (called before JAX starts its backends; jax's own chip count reads sysfs, not libtpu). The
    TPU platform stays registered: its lowerings are what `plan` compiles with."""
    if os.environ.get("JAX_PLATFORMS") or os.environ.get("JAX_FORCE_TPU_INIT"):
        return
    from jax._src import hardware_utils, xla_bridge

    registration = xla_bridge._backend_factories.get("tpu")
    if registration is not None and hardware_utils.num_available_tpu_chips_and_device_id()[0] == 0:
        xla_bridge._backend_factories["tpu"] = dataclasses.replace(
            registration, factory=_no_tpu_chips, fail_quietly=True
        )


def _no_tpu_chips():
    raise RuntimeError("this host has no TPU chips")


def has_distributed_client_barriers() -> bool:
    """Whether this orbax has the switch use_distributed_client_barriers turns on."""
    import importlib

    from absl import flags

    importlib.import_module("orbax.checkpoint")  # defines orbax's absl flags
    return "experimental_orbax_use_distributed_barrier" in flags.FLAGS


def use_distributed_client_barriers() -> None:
    """Orbax's barriers between processes are device collectives by default. Issued from a
    background save thread (either checkpoint.staging) they could interleave with the
    training step's collectives in a different order on each process; the JAX distributed
    client's barriers cannot. Orbax's own switch is an absl flag (this program parses no
    other absl flags). UsageError where this orbax has no such switch."""
    from absl import flags

    from engine.errors import UsageError

    if not has_distributed_client_barriers():
        raise UsageError(
            "checkpoint.staging=device with several processes needs an orbax-checkpoint with "
            "distributed-client barriers (0.12.8 has them); upgrade it or use checkpoint.staging=host"
        )
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    flags.FLAGS.experimental_orbax_use_distributed_barrier = True  # type: ignore[assignment]


def distributed_client_barriers_on() -> bool:
    from absl import flags

    return (
        "experimental_orbax_use_distributed_barrier" in flags.FLAGS
        and flags.FLAGS.is_parsed()
        and bool(flags.FLAGS.experimental_orbax_use_distributed_barrier)
    )


def _count_cache_event(event: str, **kwargs) -> None:
    if event in ("/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"):
        compile_cache_events[event.rsplit("_", 1)[-1]] += 1  # "hits" / "misses"


def _drop_orphaned_reads(default):
    """The same noise by another road: an orphaned orbax read coroutine that the garbage
    collector finishes prints 'Exception ignored in: <coroutine …>' and a traceback."""

    def hook(unraisable):
        if "orbax" in getattr(getattr(unraisable.object, "cr_code", None), "co_filename", ""):
            return
        default(unraisable)

    return hook


class _DropOrphanedTaskErrors(logging.Filter):
    """A failed restore leaves orbax's sibling read tasks holding the same error; asyncio would
    print each with a traceback. The error itself is raised to the caller and reported once."""

    def filter(self, record: logging.LogRecord) -> bool:
        from engine.runtime.rundir import STORAGE_TEXTS

        message = record.getMessage()
        if message.startswith("Task exception was never retrieved"):
            return False
        # a save that failed on a full disk leaves orbax's other writes holding the same error
        return not (
            "exception was never retrieved" in message.split("\n", 1)[0]
            and ("orbax" in message or any(fault in message for fault in STORAGE_TEXTS))
        )


class _DropStorageFaultLogs(logging.Filter):
    """A save that meets a full or read-only disk fails in several orbax threads, and each
    logs the error with a traceback; the trainer reports it once, in one line (engine.runtime.rundir
    storage_error), so those logs are dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        from engine.runtime.rundir import STORAGE_TEXTS

        if "orbax" not in record.pathname or record.levelno < logging.ERROR:
            return True
        text = record.getMessage() + (str(record.exc_info[1]) if record.exc_info else "")
        return not any(fault in text for fault in STORAGE_TEXTS)


class _DropReadOnlyNotice(logging.Filter):
    """Orbax warns "Given directory is read only" whenever checkpoints are opened to be read (a
    run starting from checkpoint.restore_from, an evaluator): nothing is wrong, so it is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Given directory is read only")


class _WithoutClosedLoopTracebacks:
    """sys.stderr, less one kind of noise. After a failed restore, tensorstore's other pending
    reads complete into orbax's closed event loop, and each callback thread prints a
    'RuntimeError: Event loop is closed' traceback (some seconds later) that says nothing the
    one-line warning does not. Writes from other threads are held per thread until their
    traceback ends, then dropped if it is that one; everything else passes through."""

    def __init__(self, stream):
        self.stream = stream
        self.held: dict[int, str] = {}
        self.lock = threading.Lock()

    def write(self, text: str) -> int:
        if threading.current_thread() is threading.main_thread():
            return self.stream.write(text)
        with self.lock:
            held = self.held.pop(threading.get_ident(), "") + text
            if not held.startswith("Traceback"):
                return self.stream.write(held)
            last = held.rstrip("\n").rsplit("\n", 1)[-1]
            if not held.endswith("\n") or last.startswith((" ", "Traceback")):
                self.held[threading.get_ident()] = held  # the traceback is still being written
            elif "Event loop is closed" not in last:
                self.stream.write(held)
        return len(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)
