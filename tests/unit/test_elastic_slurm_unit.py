"""`launch.py train --elastic` inside a SLURM allocation: a job whose task is SIGKILLed goes on as a new
srun step on the task left, from the local tier, with the unbroken run's losses; the driver is
refused outside an allocation or without fault.elastic; srun's lines about failed tasks are read."""

import time

import pytest

from engine.elastic.accounting import SETTLE_SECONDS
from engine.elastic.srun_steps import StepOutput, parse_task_line, task_devices


@pytest.mark.nocompile
def test_srun_s_lines_about_failed_tasks_and_each_task_s_devices():
    assert parse_task_line("srun: error: node1: task 1: Killed") == [(1, -9)]
    assert parse_task_line("srun: error: node1: tasks 0,2-3: Exited with exit code 2") == [(0, 2), (2, 2), (3, 2)]
    assert parse_task_line("srun: error: node1: task 0: Segmentation fault") == [(0, -11)]
    assert parse_task_line("0: step 5 train: task 1: Killed") == []  # a task's own line, not srun's
    assert parse_task_line("srun: Force Terminated StepId=4.0") == []
    assert task_devices(3, {"SLURM_GPUS_PER_TASK": "8"}) == 3
    assert task_devices(None, {"SLURM_GPUS_PER_TASK": "h100:8"}) == 8
    assert task_devices(None, {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}) == 4
    assert task_devices(None, {}) == 1
    # the driver stops the step at once after a task killed by a signal, else after the others had time to end
    output = StepOutput()
    output.reported = [(1, 1, time.time(), False)]
    assert not output.settled()
    output.reported.append((0, -9, time.time(), False))
    assert output.settled()
    output.reported = [(1, 1, time.time() - SETTLE_SECONDS, False)]
    assert output.settled()
