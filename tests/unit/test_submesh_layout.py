"""Which sub-meshes a multi-process sub-mesh sweep builds (engine/sweep/submesh.py check_layout):
within one process, or the whole job; one spanning some of the processes is refused naming the fix."""

import pytest

from engine.errors import UsageError
from engine.sweep.submesh import check_layout


def test_sub_meshes_lie_within_a_process_or_span_the_whole_job():
    for per_trial in (1, 2, 4, 8):  # 2 processes x 4 devices: within one process, or all 8
        check_layout(per_trial, 4, 2)
    check_layout(3, 6, 1)  # one process: any divisor of its devices (submeshes() checks)


def test_a_sub_mesh_spanning_some_processes_is_refused_naming_the_fix():
    with pytest.raises(UsageError) as error:
        check_layout(2, 1, 4)
    assert str(error.value) == (
        "--devices-per-trial 2 in a job of 4 processes x 1 devices: a sub-mesh spanning some of the processes is "
        "not built; use --devices-per-trial 1 (trials within one process) or 4 (each trial on every process)"
    )
    with pytest.raises(UsageError, match="use --devices-per-trial 1, 2, 4 .* or 16"):
        check_layout(8, 4, 4)
    with pytest.raises(UsageError, match="use --devices-per-trial 1, 3 "):
        check_layout(2, 3, 2)  # (2 does not divide a process's 3 devices)
