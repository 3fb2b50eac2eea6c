"""The backstops of a chat template's render for what its budget's checks cannot see
(engine/lm/chat.py): a wall-clock alarm in the main thread, and a limit on the process's
address space."""

from __future__ import annotations

import contextlib
import signal
import threading
from pathlib import Path
from typing import Any, Iterator

ALARM_SLACK_SECONDS = 1.0  # then SIGALRM stops a render that runs where no check does (main thread only)
MEMORY_BYTES = 1 << 30  # address space a render may add to the process (RLIMIT_AS, where the OS has it)


class Alarm(BaseException):
    """The wall-clock backstop rang: a BaseException, so that no `except Exception` in the
    template's runtime can swallow it (render_chats turns it into the UsageError)."""


@contextlib.contextmanager
def backstops(seconds: float, message: str) -> Iterator[None]:
    """Two backstops for what a budget's checks cannot see: an alarm ringing `seconds` (and
    ALARM_SLACK_SECONDS) from now with `message`, in the main thread where no other timer runs,
    and a limit on the process's address space."""
    with contextlib.ExitStack() as undo:
        undo.enter_context(address_space(MEMORY_BYTES))  # first: restored after the alarm is off, never by it
        main = threading.current_thread() is threading.main_thread()
        if main and hasattr(signal, "setitimer") and signal.getitimer(signal.ITIMER_REAL)[0] == 0:
            undo.enter_context(alarm(seconds + ALARM_SLACK_SECONDS, message))
        yield


@contextlib.contextmanager
def alarm(seconds: float, message: str) -> Iterator[None]:
    """Alarm(`message`) raised in the main thread after `seconds`: a render spending its time where
    no budget check runs (one long operation inside a loop's step) is still stopped."""
    ringing = [True]

    def ring(signum: int, frame: Any) -> None:
        if ringing[0]:
            raise Alarm(message)

    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        ringing[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)


@contextlib.contextmanager
def address_space(extra: int) -> Iterator[None]:
    """RLIMIT_AS at the process's present size + `extra`, restored afterwards (the limit is the
    whole process's: commands render before they start JAX's threads): one huge allocation
    by a template ('x'.ljust(10 ** 10)) fails with MemoryError instead of taking the machine's
    memory. Nothing where the OS has no such limit or no /proc."""
    try:
        import resource

        size = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
    except (ImportError, OSError, ValueError):  # no such limit here, or no /proc to measure the process by
        size = -1
    if size < 0:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = size + extra if hard == resource.RLIM_INFINITY else min(size + extra, hard)
    if soft != resource.RLIM_INFINITY and soft <= limit:  # already as tight
        yield
        return
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
