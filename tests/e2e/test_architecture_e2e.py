"""The shape of the code that later work stands on: the engine knows no model, models know
no engine, imports run one way, and the loop and setup stay small enough to read."""

import subprocess
import sys

from support.configs import ROOT


def test_a_sweep_plans_its_runs_without_jax(tmp_path):
    """A sweep's own process reads and checks every run's config and groups the runs by
    compiled program; it never builds a model, so it never imports jax, flax or optax (their
    import was most of every sweep's start, and their memory stayed for the sweep's life)."""
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(
        f"base: {ROOT / 'configs' / 'mnist_mlp.yaml'}\ndirectory: {tmp_path / 'out'}\n"
        "grid: {optimizer.learning_rate: [0.001, 0.01], model.hidden_sizes: [[32], [64]]}\n"
        "vectorize: auto\n"
    )
    # `launch.py sweep FILE` up to where its runs would start, in place of starting them
    script = (
        "import sys\n"
        "import launch, engine.cli, engine.sweep\n"
        "from engine.sweep.local import units\n"
        "def planned(sweep, parallel, retry_failed):\n"
        "    print(len(units(sweep, sweep.runs)), 'units')\n"
        "    print('loaded:', sorted(m for m in ('jax', 'flax', 'optax', 'orbax') if m in sys.modules))\n"
        "    return 0\n"
        "engine.sweep.run_pending, engine.sweep.report = planned, lambda *args, **kwargs: None\n"
        f"sys.exit(engine.cli.main(['sweep', {str(sweep)!r}]))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "2 units" in done.stdout  # two hidden sizes: two compiled programs, each with two learning rates
    assert "loaded: []" in done.stdout, done.stdout
