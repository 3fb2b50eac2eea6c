"""Tests run on 8 simulated CPU devices; these variables must be set before jax is imported.
On a machine with a GPU, `ENGINE_TEST_GPU=1 python -m pytest tests/test_gpu.py` runs the GPU's
own tests (JAX's default backend is then the GPU; the CPU devices stay for the rest)."""

import os
import sys
from pathlib import Path

# The tests compile far more than they run: XLA:CPU's code generation without LLVM's
# optimisation passes compiles ~2.4x faster (BENCHMARKS.md "Test suite"); every in-process test
# uses it, so both sides of each comparison are compiled alike.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    " --xla_cpu_enable_concurrency_optimized_scheduler=false"  # (engine/runtime/settings.py: CPU_SCHEDULER_FLAG)
).strip()
os.environ["JAX_PLATFORMS"] = "cuda,cpu" if os.environ.get("ENGINE_TEST_GPU") == "1" else "cpu"

import jax  # noqa: E402
import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.config import load_config  # noqa: E402
from engine.runtime import settings as process  # noqa: E402

process.install()  # as launch.py does: compile-cache counting, orbax noise filters


@pytest.hookimpl(optionalhook=True)  # (a pytest without pytest-xdist has no such hook)
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject.toml's addopts): two test processes, which take a 2-core machine's
    suite from ~21 to ~14 minutes (compiles are single-threaded and subprocess tests wait);
    one process for the GPU tests (each process would claim most of the GPU's memory).
    PYTEST_XDIST_AUTO_NUM_WORKERS=N sets another number, `-n 0` runs in this process."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    return 0 if os.environ.get("ENGINE_TEST_GPU") == "1" else min(2, os.cpu_count() or 1)


@pytest.fixture(scope="session")
def compilation_cache(tmp_path_factory):
    """A persistent compilation cache of this test session's own (set once per process)."""
    return tmp_path_factory.mktemp("xla_cache")


@pytest.fixture
def make_config(tmp_path, compilation_cache):
    """load_config with quiet, fast defaults for tests: make_config("mnist_mlp.yaml", "train.steps=3").
    One step per call unless a test asks for more (tests drive train_step a step at a time)."""

    def make(config="mnist_mlp.yaml", *overrides, workdir=None):
        quiet = [
            "log.progress=false",
            "log.tensorboard=false",
            f"train.compilation_cache_dir={compilation_cache}",
            "train.steps_per_call=1",
        ]
        return load_config(ROOT / "configs" / config, quiet + list(overrides), str(workdir or tmp_path / "run"))

    return make


@pytest.fixture
def mesh2x4():
    return jax.make_mesh((2, 4), ("data", "fsdp"))


def run_cli(*args, env=None, timeout=300, cwd=ROOT):
    """Runs launch.py in a subprocess (1 CPU device unless env says otherwise)."""
    import subprocess

    full_env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=cwd,
    )
