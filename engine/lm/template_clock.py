"""The time a chat template's strftime_now() formats (Llama 3's templates write "Today Date: ..."
into the system header): the clock's, or, while a run's training data is rendered, the run's
recorded start (engine/run/data_record.py), so that a resumed run renders the text it started with."""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

TIME_FORMAT = "%Y-%m-%dT%H:%M:%S"  # how a run records its templates' time (template_time.json, DataInfo)
_fixed: list[time.struct_time] = []  # the times fixed_template_time holds, innermost last


@contextlib.contextmanager
def fixed_template_time(when: time.struct_time) -> Iterator[None]:
    """Renders inside give strftime_now() the local time `when`, not the clock's."""
    _fixed.append(when)
    try:
        yield
    finally:
        _fixed.pop()


def rendering_at(when: str) -> contextlib.AbstractContextManager[None]:
    """fixed_template_time at `when` (TIME_FORMAT, a run's recorded time); the clock's where "" ."""
    return fixed_template_time(time.strptime(when, TIME_FORMAT)) if when else contextlib.nullcontext()


def strftime_now(format: str) -> str:
    """A template's strftime_now(format): the fixed time's, else now's."""
    return time.strftime(format, _fixed[-1]) if _fixed else time.strftime(format)
