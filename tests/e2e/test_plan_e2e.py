"""`launch.py plan`: runs compiled for TPU pods by the TPU compiler (libtpu) on this CPU host.
The figures come from the compiled programs; the tests check them against what the sharded
state must hold, against the compiler's own refusal, and against the HLO's collectives."""

import os

import numpy as np
import pytest
from support.cli import run_cli
from support.configs import ROOT, TINY_LLAMA
from support.plan import TINY

from engine.plan.layouts import search
from engine.plan.tpu import parse_target

pytest.importorskip("libtpu", reason="the TPU compiler (libtpu) is not installed")


@pytest.mark.slow
def test_llama_1b_pure_data_parallel_does_not_fit_a_v5e_4_and_names_the_fix(tmp_path):
    """Every chip would hold the whole model and its Adam state: the compiler refuses it; the
    exit code is 1 after the table, and the line names fsdp over the four chips."""
    proc = run_cli(
        "plan",
        "--config",
        "configs/llama_1b.yaml",
        "--target",
        "v5e-4",
        "mesh.data=4",
        "mesh.fsdp=1",
        "train.global_batch_size=8",
        timeout=900,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "does not fit" in proc.stdout and "mesh.fsdp=4" in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_search_ranks_a_fitting_layout_whose_overrides_train_with_the_default_losses(make_config, tmp_path):
    """The runs train in processes of their own, compiled as a user's would be: this process's
    unoptimised XLA:CPU code (tests/conftest.py) can starve one of 8 device threads past
    XLA:CPU's 40 s collective rendezvous timeout on 2 cores. (The tiny Llama on synthetic text:
    what the search ranks and the runs compare does not depend on the model's size.)"""
    import json

    cfg = make_config("mnist_mlp.yaml", *TINY, *TINY_LLAMA)
    ranked = search(cfg, parse_target("v5e-8"), compiles=2, say=lambda text: None)
    assert ranked and ranked[0].planned.fits
    best = ranked[0].overrides()
    runs = {"default": [], "best": best}
    losses = {}
    for name, overrides in runs.items():
        proc = run_cli(
            "--config",
            "configs/mnist_mlp.yaml",
            "--workdir",
            str(tmp_path / name),
            *TINY,
            *TINY_LLAMA,
            "train.steps=3",
            "log.every_steps=1",
            "eval.every_steps=0",
            "eval.max_batches=1",
            "log.progress=false",
            *overrides,
            env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"},
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [r["loss"] for r in records if r["split"] == "train"]
    assert len(losses["default"]) == 3
    np.testing.assert_allclose(losses["best"], losses["default"], rtol=1e-5)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--target", "v9-8"], "is not a TPU target"),
        (["--target", "v5p-12"], "6 chips is not a power of two"),
        (["--target", "v5e-4", "--slices", "2"], "--slices 2 but the mesh puts 1 slice(s) side by side"),
        (["--target", "v5e-4", "mesh.data=3"], "uses 3 devices but 4 are in use"),
    ],
    ids=["bad-name", "not-a-slice", "slices-without-dcn", "mesh-not-the-chips"],
)
def test_bad_targets_and_meshes_are_one_line_and_exit_2(args, message):
    proc = run_cli("plan", "--config", str(ROOT / "configs" / "mnist_mlp.yaml"), *args, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.slow
def test_a_sweep_plans_each_distinct_program_its_vectorised_groups_included(tmp_path):
    """Four runs, two compiled programs (the layer count differs), vectorised two at a time:
    two plans, each of a group of two trials."""
    sweep = tmp_path / "sweep.yaml"
    grid = ("optimizer.learning_rate", "model.num_layers")
    model = ", ".join(o.replace("=", ": ") for o in TINY_LLAMA if o.split("=")[0] not in grid)  # (the tiny Llama)
    sweep.write_text(
        f"base: {ROOT / 'configs' / 'mnist_mlp.yaml'}\ndirectory: {tmp_path / 'out'}\n"
        f"overrides: {{train.steps_per_call: 1, mesh.data: 1, mesh.fsdp: 4, {model}}}\n"
        "grid: {optimizer.learning_rate: [0.001, 0.003], model.num_layers: [2, 4]}\nvectorize: 2\n"
    )
    proc = run_cli("sweep", str(sweep), "--plan", "--target", "v5e-4", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("(+1 vectorised): fits") == 2, proc.stdout
    assert "plan: 2 distinct program(s) of 4 runs" in proc.stdout
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # nothing trained


def test_without_the_tpu_compiler_plan_says_how_to_install_it():
    import subprocess
    import sys

    script = (
        "import sys; sys.modules['libtpu'] = None\n"  # as if libtpu were not installed
        "from engine.cli import main; sys.exit(main(['plan', '--config', 'mnist_mlp', '--target', 'v5e-4']))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TPU_LIBRARY_PATH"}  # (set by jax once libtpu loaded)
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 2, done.stderr
    assert 'install it: pip install -e ".[tpu]"' in done.stderr and "Traceback" not in done.stderr
