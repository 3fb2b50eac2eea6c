"""The `pipeline` mesh axis on 8 simulated devices: a Llama's scanned layers split into stages
(GPipe and circular schedules, alone and beside data, fsdp and tensor parallelism) give the
one-device losses and weights; checkpoints move between pipeline layouts; a killed run resumes
exactly; a stage holds its share of the layers; wrong settings exit 2 by name."""

import pytest
from support.cli import run_cli, start_cli
from support.pipeline import DEEP, losses_of


@pytest.mark.slow
def test_a_killed_pipelined_run_resumes_bit_identically(tmp_path):
    args = [
        "--config",
        "configs/llama_tiny.yaml",
        *DEEP,
        "mesh.data=2",
        "mesh.pipeline=4",
        "pipeline.schedule=circular",
        "model.num_layers=8",
        "train.steps=12",
        "checkpoint.every_steps=4",
        "log.every_steps=1",
        "log.progress=false",
        "eval.every_steps=0",
        "train.steps_per_call=1",
    ]
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    reference = run_cli(*args, "--workdir", str(tmp_path / "reference"), env=env, timeout=600)
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert "pipeline: 4 stages (circular, 2 repeats)" in reference.stdout, reference.stdout[:2000]
    import subprocess
    import time

    proc = start_cli(*args, "--workdir", str(tmp_path / "killed"), env=env, stdout=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and max(losses_of(tmp_path / "killed") or [0]) < 9:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    resumed = run_cli(*args, "--workdir", str(tmp_path / "killed"), env=env, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert losses_of(tmp_path / "killed") == losses_of(tmp_path / "reference")  # bit-identical


def test_a_family_without_a_layer_stack_is_refused_at_the_command_line(tmp_path):
    proc = run_cli(
        "--config",
        "configs/gpt_small.yaml",
        "--workdir",
        str(tmp_path / "w"),
        "mesh.pipeline=2",
        "mesh.data=4",
        "data.name=synthetic_text",
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
    )
    assert proc.returncode == 2 and "mesh.pipeline=2 needs a layer stack" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
