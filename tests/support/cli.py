"""launch.py in a subprocess: run_cli, start_cli, wait_until."""

import os
import subprocess
import sys
import time

from engine.runtime.settings import DEVICE_COUNT_FLAG
from support.configs import ROOT


def child_env(env=None):
    """A launched process's environment: this one's, updated with env, where XLA_FLAGS keeps the
    tests' compile-speed flags (tests/conftest.py: both sides of a comparison compile alike) but
    not their 8 devices: 1 CPU device unless env's XLA_FLAGS sets a count."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    own = [flag for flag in os.environ.get("XLA_FLAGS", "").split() if not flag.startswith(DEVICE_COUNT_FLAG)]
    given = (env or {}).get("XLA_FLAGS", "").split()
    names = {flag.split("=", 1)[0] for flag in given}
    full_env["XLA_FLAGS"] = " ".join([*given, *(flag for flag in own if flag.split("=", 1)[0] not in names)])
    return full_env


def run_cli(*args, env=None, timeout=300, cwd=ROOT):
    """Runs launch.py in a subprocess to its end (1 CPU device unless env says otherwise):
    a CompletedProcess with its stdout and stderr as text."""
    return subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(env),
        cwd=cwd,
    )


def start_cli(*args, env=None, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen):
    """Starts launch.py in a subprocess and returns its Popen (text output, piped unless
    stdout/stderr say otherwise; popen: more Popen arguments, e.g. start_new_session=True)."""
    return subprocess.Popen(
        [sys.executable, str(ROOT / "launch.py"), *args],
        cwd=cwd,
        env=child_env(env),
        stdout=stdout,
        stderr=stderr,
        text=True,
        **popen,
    )


def wait_until(ready, proc, seconds=120, poll=0.1):
    """Polls `ready()` while `proc` runs; fails with its output if it ends or time runs out
    first (killing it then, so that its output can be read)."""
    deadline = time.time() + seconds
    while not ready():
        assert proc.poll() is None, proc.communicate()
        if time.time() >= deadline:
            proc.kill()
            raise AssertionError(f"not ready within {seconds} s: {proc.communicate()}")
        time.sleep(poll)


def wrote_metrics(workdir) -> bool:
    """Whether a run in workdir has logged its first record."""
    return (workdir / "metrics.jsonl").exists() and bool((workdir / "metrics.jsonl").read_text())
