"""Tests run on 8 simulated CPU devices; these variables must be set before jax is imported.
On a machine with a GPU, `ENGINE_TEST_GPU=1 python -m pytest tests/integration/test_gpu.py
tests/e2e/test_gpu_e2e.py` runs the GPU's own tests (JAX's default backend is then the GPU; the CPU
devices stay for the rest).

Shared here: the make_config fixture and the `nocompile` guard (a test marked nocompile fails if
JAX compiled anything while it ran); every test in tests/unit is marked nocompile. The helpers
the tests share (launch.py in a subprocess, the tiny model overrides, ...) are in tests/support."""

import os
import sys
import tempfile
from pathlib import Path

# The tests compile far more than they run: XLA:CPU's code generation without LLVM's
# optimisation passes compiles ~2.4x faster (BENCHMARKS.md "Test suite"); every in-process test
# and every process a test launches (tests/support/cli.py child_env) uses these flags, so both
# sides of each comparison are compiled alike.
# XLA:CPU's older loop emitters in place of its fusion emitters compile the tests' programs in ~0.57x
# the CPU time (tests/integration/test_parallel.py + test_step.py: 106 -> 61 CPU-s; BENCHMARKS.md).
_LEGACY_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    " --xla_cpu_enable_concurrency_optimized_scheduler=false"  # (engine/runtime/settings.py: CPU_SCHEDULER_FLAG)
).strip()
if "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
    from engine.runtime.settings import xla_knows  # (an unknown flag would abort every process; imports no jax)

    if xla_knows(_LEGACY_EMITTERS):
        os.environ["XLA_FLAGS"] += " " + _LEGACY_EMITTERS
os.environ["JAX_PLATFORMS"] = "cuda,cpu" if os.environ.get("ENGINE_TEST_GPU") == "1" else "cpu"
# The engine's caches (tokenized corpora, tables' features, XLA programs: engine/runtime/caches.py) in a
# folder of this test process's own, for it and every process it launches: a test passes or fails
# alike on a machine that never ran the engine and on one whose ~/.cache/jax-engine is full.
_CACHE = tempfile.TemporaryDirectory(prefix="jax-engine-cache-")
os.environ["JAX_ENGINE_CACHE"] = _CACHE.name

import jax  # noqa: E402
import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # `import support` from every tier

from support.configs import QUIET  # noqa: E402

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


# --- the nocompile tier: tests that must not compile (config, schema, planning, parsing) ---

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # each XLA compile (or persistent-cache load)
compiled: list[str] = []  # the functions XLA compiled in this process, in order
_COMPILED_BEFORE = pytest.StashKey[int]()  # len(compiled) as a test's setup began


def _count_compile(event: str, duration: float, **kwargs) -> None:
    if event == COMPILE_EVENT:
        compiled.append(str(kwargs.get("fun_name", "?")))


jax.monitoring.register_event_duration_secs_listener(_count_compile)


UNIT = Path(__file__).resolve().parent / "unit"


def pytest_collection_modifyitems(config, items):
    """tests/unit compiles nothing: each of its tests is marked nocompile (and fails if it compiles)."""
    for item in items:
        if UNIT in item.path.parents:
            item.add_marker(pytest.mark.nocompile)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    item.stash[_COMPILED_BEFORE] = len(compiled)
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A test marked nocompile that compiled anything (in its fixtures or its body) fails,
    naming what was compiled. (JAX caches compiled functions in memory: run the tier alone,
    `pytest -m nocompile`, to see every compile a test needs.)"""
    result = yield
    if item.get_closest_marker("nocompile") is not None:
        new = compiled[item.stash.get(_COMPILED_BEFORE, len(compiled)) :]
        if new:
            pytest.fail(f"a nocompile test compiled {len(new)} function(s) with XLA: {', '.join(new[:10])}")
    return result


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
            *QUIET,
            f"train.compilation_cache_dir={compilation_cache}",
            "train.steps_per_call=1",
        ]
        return load_config(ROOT / "configs" / config, quiet + list(overrides), str(workdir or tmp_path / "run"))

    return make


@pytest.fixture
def mesh2x4():
    return jax.make_mesh((2, 4), ("data", "fsdp"))
