"""Which sub-meshes a multi-process sub-mesh sweep builds (engine/sweep/submesh.py check_layout):
within one process, or spanning whole processes; one cutting a process in parts is refused naming
the fix."""

import pytest

from engine.errors import UsageError
from engine.sweep.submesh import check_layout


def test_sub_meshes_lie_within_a_process_or_span_whole_processes():
    for per_trial in (1, 2, 4, 8, 16):  # 4 processes x 4 devices: within one process, or 2 or 4 whole ones
        check_layout(per_trial, 4, 4)
    check_layout(3, 6, 1)  # one process: any divisor of its devices (submeshes() checks)


def test_a_sub_mesh_cutting_a_process_in_parts_is_refused_naming_the_fix():
    with pytest.raises(UsageError) as error:
        check_layout(6, 4, 4)  # (one process's 4 devices and half of another's)
    assert str(error.value) == (
        "--devices-per-trial 6 in a job of 4 processes x 4 devices: a sub-mesh lies within one process or spans "
        "whole processes; use --devices-per-trial 1, 2, 4 (trials within one process) or 8, 16 (each trial on "
        "whole processes)"
    )
    with pytest.raises(UsageError, match="use --devices-per-trial 1, 3 .* or 6 "):
        check_layout(2, 3, 2)  # (2 does not divide a process's 3 devices)


def test_a_search_or_a_vectorised_sweep_spanning_processes_is_refused_naming_the_fix():
    from types import SimpleNamespace

    grid, search, packed = (
        SimpleNamespace(search=s, vectorize=v) for s, v in ((None, 0), ({"trials": 4}, 0), (None, 8))
    )
    check_layout(8, 4, 2, grid)  # a grid's trials may span processes
    check_layout(4, 4, 2, packed)  # groups within each process
    spans = r"search sweep's trials span no processes \(.*\): use --devices-per-trial 4 or fewer"
    with pytest.raises(UsageError, match=spans):
        check_layout(8, 4, 2, search)
    with pytest.raises(UsageError, match="vectorised group trains within one process: use --devices-per-trial 4 or"):
        check_layout(8, 4, 2, packed)
    check_layout(8, 8, 1, packed)  # (a process alone: every sub-mesh is within it)
