"""launch.py in a subprocess: run_cli, start_cli, wait_until."""

import os
import subprocess
import sys
import time

from support.configs import ROOT


def child_env(env=None):
    """A launched process's environment: this one's without the tests' XLA_FLAGS (so 1 CPU
    device and XLA's default optimisation), updated with env."""
    full_env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    full_env.update(env or {})
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
