"""Injected into the processes of a test's job (PYTHONPATH=tests/support/inject, faults.INJECT):
SIGUSR2 hangs the process's main thread for ever (its handler runs there and never returns)
while its other threads, the watchdog's among them, go on: the hung process of the elastic tests,
made from outside the trainer by faults.FaultAt(..., sig=faults.HANG)."""

import signal
import time


def _hang(signum, frame):
    while True:
        time.sleep(3600)


signal.signal(signal.SIGUSR2, _hang)
