"""`launch.py ... --local-processes N`: a multi-process job on this host, for trying and
testing multi-host code on CPU. Each process gets M simulated CPU devices; they meet at a
coordinator bound to 127.0.0.1 only. Output lines are prefixed with the process id. If one
process fails, the others are stopped and the launcher exits non-zero naming it (a usage error,
exit 2: with its reason once on stderr)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from engine.runtime.settings import with_cpu_devices

ROOT = Path(__file__).resolve().parent.parent
# this program, for the processes it starts (local processes, a sweep's runs): the checkout's
# launch.py where there is one, else the installed package
SELF = (
    [sys.executable, str(ROOT / "launch.py")]
    if (ROOT / "launch.py").is_file()
    else [sys.executable, "-m", "engine.cli"]
)
GRACE_SECONDS = 10  # after SIGTERM, how long a process may take to exit before SIGKILL
# after a process's SIGABRT (a peer's abort once the coordination service or a collective lost a
# process), how long the launcher waits for the exit of the process that caused it before stopping
# the others: a SIGKILLed process's exit may be seen after its peers' aborts (a large process takes
# a moment to tear down), and the stop would hide it (issue 57: the wrong process was blamed)
ABORT_SETTLE_SECONDS = 1.5
GROW_EXIT = 75  # every process's exit code after stopping to grow back (EX_TEMPFAIL; engine/elastic/grow.py)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _relay(index: int, stream, sink, said: Optional[dict[int, str]] = None) -> None:
    """A process's output lines to `sink`, prefixed by its index, less gloo's connection lines (one per
    peer and start: ~40 a start of 4 processes); `said` keeps the last line of each that is an error's."""
    for line in stream:
        if line.startswith("[Gloo] Rank ") and " is connected to " in line:
            continue
        if said is not None and line.startswith("error: "):
            said[index] = line
        sink.write(f"[{index}] {line}")
        sink.flush()


def stop_with(launcher: int, niceness: int = 0, sig: int = signal.SIGTERM):
    """A preexec_fn: the child gets `sig` when the launcher dies, even by SIGKILL (Linux's
    PR_SET_PDEATHSIG): SIGTERM, so it saves and stops instead of training on unattended (a pod's
    supervisor: SIGKILL, as the pod's death would); `niceness` lowers its CPU priority (a
    background job's)."""

    def arrange() -> None:
        if niceness:
            os.nice(niceness)
        if sys.platform.startswith("linux"):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))  # PR_SET_PDEATHSIG
            if os.getppid() != launcher:  # it died before the request took effect
                os.kill(os.getpid(), sig)

    return arrange


def _killed(code: int) -> bool:
    """Whether a return code is a kill's: a signal other than SIGABRT (a peer's abort) and SIGTERM (a stop)."""
    return code < 0 and -code not in (signal.SIGABRT, signal.SIGTERM)


def _describe(code: int) -> str:
    return f"was killed by signal {-code} ({signal.Signals(-code).name})" if code < 0 else f"exited with code {code}"


def run_local_job(
    args: list[str],
    processes: int,
    devices_per_process: int,
    env: Optional[dict[str, str]] = None,
    failed: Optional[list[tuple[int, int, float]]] = None,
    grace: float = GRACE_SECONDS,
    settle: float = 0,
) -> int:
    """Runs `launch.py args` as `processes` processes (with `env` added to their environment);
    returns the job's exit code. `failed` receives (process, return code, time.time()) of the failures
    seen before the others were stopped (a preemption's exits are not failures). After a failure the
    others get SIGTERM and `grace` seconds before SIGKILL (0: SIGKILL at once; engine/elastic/accounting.py
    says why it may); when no process of the first failures was killed by a signal, the others first
    get `settle` seconds to end on their own (accounting.py: a failure every process meets is not a lost one)."""
    said: dict[int, str] = {}  # each process's last error line
    children, relays = _start(args, processes, devices_per_process, env or {}, said=said)
    preempted: list[int] = []
    seen = failed if failed is not None else []

    def forward_sigterm(signum, frame):  # preemption of the launcher (or Ctrl-C) preempts every process
        preempted.append(signum)
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)  # JAX's preemption sync point: all save at one step

    previous = {sig: signal.signal(sig, forward_sigterm) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = _wait(children, preempted, seen, grace, settle)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _stop(children, grace)
        for relay in relays:  # the children's last lines (an error message, say) are still in the pipes
            relay.join(timeout=5)
    if code == 2:  # a usage error: its reason once, on stderr (each process's line is in its output)
        first = seen[0][0] if seen else 0
        sys.stderr.write(said.get(first) or f"error: process {first} exited with code 2 (its output says why)\n")
    return code


def start_background(args: list[str], processes: int, devices_per_process: int, log) -> list[subprocess.Popen]:
    """`launch.py args` as `processes` processes at the lowest CPU priority (nice 19), their output
    to the open file `log`; each is its own process group (stop it with os.killpg)."""
    return _start(args, processes, devices_per_process, {}, log)[0]


def _start(args: list[str], processes: int, devices_per_process: int, extra: dict[str, str], log=None, said=None):
    """The processes, each with a thread relaying its output lines prefixed by its index (or, in
    the background, writing them to the open file `log` at nice 19)."""
    port = free_port()
    env = dict(
        os.environ,
        **extra,
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",
        XLA_FLAGS=with_cpu_devices(os.environ.get("XLA_FLAGS", ""), devices_per_process),
    )
    children, relays = [], []
    for index in range(processes):
        command = [
            *SELF,
            *args,
            *distributed_args(f"127.0.0.1:{port}", processes, index),
        ]
        child = subprocess.Popen(
            command,
            env=env,
            stdout=log or subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            preexec_fn=stop_with(os.getpid(), 19 if log else 0),
        )
        children.append(child)
        if log:
            continue
        relay = threading.Thread(target=_relay, args=(index, child.stdout, sys.stdout, said), daemon=True)
        relay.start()
        relays.append(relay)
    return children, relays


def _wait(
    children: list[subprocess.Popen],
    preempted: list[int],
    seen: list[tuple[int, int, float]],
    grace: float,
    settle: float = 0,
) -> int:
    """The job's exit code: 0 when all succeed; the first failure stops the others (`seen` gets
    the failures found until then: those of that moment, and those of the `settle` seconds after it)."""
    while True:
        codes = [child.poll() for child in children]
        if preempted:  # every process is saving its part of the checkpoint: let them finish
            codes = [child.wait() for child in children]
            if all(code in (143, GROW_EXIT) for code in codes):  # (a stop to grow back saved too)
                return 128 + int(preempted[0])  # 143, or 130 for Ctrl-C
            return _exit_status(max((code for code in codes if code is not None), key=abs))
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed and all(c == GROW_EXIT for _, c in failed):
            grown = _grown(children)  # every process saved and leaves to grow back (engine/elastic/grow.py)
            if grown or preempted:
                return 128 + int(preempted[0]) if preempted else GROW_EXIT
            codes = [child.poll() for child in children]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0, GROW_EXIT)]
        if failed:
            # of the failures of one poll, a process killed by a signal (not a peer's SIGABRT or a stop's
            # SIGTERM) first: its peers' collectives broke with it, and they exit at once (cli.entry)
            failed.sort(key=lambda failure: (not _killed(failure[1]), failure[0]))
            seen.extend((index, code, time.time()) for index, code in failed)
            index, code = failed[0]
            if code != 2:  # (a usage error's reason is said once the processes' output is read)
                sys.stderr.write(f"error: process {index} {_describe(code)}; stopping the other processes\n")
            failed += _settle(children, seen, settle)
            _stop(children, grace)
            if all(c == 2 for _, c in failed):  # a usage error (every process meets it, or one alone did)
                return 2
            if code == 2:
                sys.stderr.write(f"error: process {index} {_describe(code)}; the other processes were stopped\n")
            return code if code == 143 and all(c == 143 for _, c in failed) else 1
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.2)


def _grown(children: list[subprocess.Popen]) -> bool:
    """Once processes left to grow back: whether the job did (each leaves once the checkpoint is
    complete, so the others follow within moments). A process still running after GRACE_SECONDS
    is stopped: the checkpoint it would have waited for is complete (its peers waited for it), so
    the job grows back all the same. False when a process failed instead."""
    deadline = time.monotonic() + GRACE_SECONDS
    for child in children:
        try:
            child.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            pass
    if any(child.poll() not in (None, 0, GROW_EXIT) for child in children):
        return False
    _stop(children, 0)
    return True


def _settle(children: list[subprocess.Popen], seen: list[tuple[int, int, float]], settle: float) -> list:
    """While no failure seen was a signal's, up to `settle` seconds for the other processes to end on
    their own; while the only signals seen are SIGABRTs (peers' aborts), up to ABORT_SETTLE_SECONDS
    for the exit of the process they came from; (process, return code) of those that fail meanwhile
    (also added to `seen`)."""
    began = time.monotonic()
    more: list[tuple[int, int]] = []
    known = {index for index, _, _ in seen}
    while True:
        waited = time.monotonic() - began
        own = all(code > 0 for _, code, _ in seen) and waited < settle
        codes = [code for _, code, _ in seen]
        aborted = -signal.SIGABRT in codes and all(code > 0 or code == -signal.SIGABRT for code in codes)
        aborts = aborted and waited < ABORT_SETTLE_SECONDS
        if not (own or aborts):
            return more
        polled = [child.poll() for child in children]
        new = [(i, c) for i, c in enumerate(polled) if c not in (None, 0, GROW_EXIT) and i not in known]
        seen.extend((index, code, time.time()) for index, code in new)
        known.update(index for index, _ in new)
        more += new
        if all(code is not None for code in polled):
            return more
        time.sleep(0.05)


def _exit_status(code: int) -> int:
    """A child's return code as a shell exit status (killed by signal n → 128 + n)."""
    return 128 - code if code < 0 else code


def _stop(children: list[subprocess.Popen], grace: float = GRACE_SECONDS) -> None:
    """SIGTERM to the processes still running, SIGKILL to their process groups after `grace` seconds."""
    for child in children:
        if child.poll() is None and grace > 0:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for child in children:
        try:
            child.wait(timeout=max(deadline - time.monotonic(), 0.1) if grace > 0 else 0)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)  # its whole process group
            child.wait()


def distributed_args(coordinator: str, processes: int, rank: int) -> list[str]:
    """The overrides that make a process `rank` of a job of `processes` at `coordinator`."""
    args = [
        f"distributed.coordinator_address={coordinator}",
        f"distributed.num_processes={processes}",
        f"distributed.process_id={rank}",
    ]
    if coordinator.startswith("127.0.0.1:"):  # (a test's pods on one machine)
        args.append(f"distributed.coordinator_bind_address={coordinator}")
    return args
