"""Tests run on 8 simulated CPU devices; these variables must be set before jax is imported.
On a machine with a GPU, `ENGINE_TEST_GPU=1 python -m pytest tests/test_gpu.py` runs the GPU's
own tests (JAX's default backend is then the GPU; the CPU devices stay for the rest).

Shared here: the launch.py subprocess helpers (run_cli, start_cli, wait_until), the tiny
model overrides (TINY_LLAMA, TINY_GPT), the make_config fixture, and the `nocompile` tier's
guard (a test marked nocompile fails if JAX compiled anything while it ran)."""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# The tests compile far more than they run: XLA:CPU's code generation without LLVM's
# optimisation passes compiles ~2.4x faster (BENCHMARKS.md "Test suite"); every in-process test
# uses it, so both sides of each comparison are compiled alike.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    " --xla_cpu_enable_concurrency_optimized_scheduler=false"  # (engine/runtime/settings.py: CPU_SCHEDULER_FLAG)
).strip()
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

from engine.config import load_config  # noqa: E402
from engine.runtime import settings as process  # noqa: E402

process.install()  # as launch.py does: compile-cache counting, orbax noise filters

# A tiny Llama (GQA: 2 key/value heads for 4 query heads) on synthetic text, as overrides of
# any base config: make_config("mnist_mlp.yaml", *TINY_LLAMA, ...).
TINY_LLAMA = [
    "model.name=llama",
    "data.name=synthetic_text",
    "data.seq_len=16",
    "data.num_examples=256",
    "data.vocab_size=64",
    "model.num_layers=2",
    "model.d_model=32",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.mlp_dim=48",
    "train.global_batch_size=16",
    "optimizer.learning_rate=0.003",
]
# A tiny GPT (models/transformer.py, with dropout) on synthetic text, the same way.
TINY_GPT = [
    "model.name=transformer",
    "data.name=synthetic_text",
    "data.seq_len=16",
    "data.num_examples=512",
    "data.vocab_size=64",
    "model.num_layers=2",
    "model.d_model=32",
    "model.num_heads=4",
    "model.mlp_dim=64",
    "model.dropout_rate=0.1",
    "train.global_batch_size=16",
]
QUIET = ["log.progress=false", "log.tensorboard=false"]  # a launched run's quiet defaults
# the fields of a metrics record that measure speed: two runs of the same training differ only in these
RATES = ("steps_per_sec", "examples_per_sec", "tflops_per_device", "mfu")


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


# --- launch.py in a subprocess ---


def child_env(env=None):
    """A launched process's environment: this one's without the tests' XLA_FLAGS (so 1 CPU
    device and XLA's default optimisation), updated with env."""
    full_env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    full_env.update(env or {})
    return full_env


def run_cli(*args, env=None, timeout=300, cwd=ROOT):
    """Runs launch.py in a subprocess to its end (1 CPU device unless env says otherwise):
    a CompletedProcess with its stdout and stderr as text."""
    return subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(env),
        cwd=cwd,
    )


def start_cli(*args, env=None, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen):
    """Starts launch.py in a subprocess and returns its Popen (text output, piped unless
    stdout/stderr say otherwise; popen: more Popen arguments, e.g. start_new_session=True)."""
    return subprocess.Popen(
        [sys.executable, str(ROOT / "launch.py"), *args],
        cwd=cwd,
        env=child_env(env),
        stdout=stdout,
        stderr=stderr,
        text=True,
        **popen,
    )


def wait_until(ready, proc, seconds=120, poll=0.1):
    """Polls `ready()` while `proc` runs; fails with its output if it ends or time runs out
    first (killing it then, so that its output can be read)."""
    deadline = time.time() + seconds
    while not ready():
        assert proc.poll() is None, proc.communicate()
        if time.time() >= deadline:
            proc.kill()
            raise AssertionError(f"not ready within {seconds} s: {proc.communicate()}")
        time.sleep(poll)


def wrote_metrics(workdir) -> bool:
    """Whether a run in workdir has logged its first record."""
    return (workdir / "metrics.jsonl").exists() and bool((workdir / "metrics.jsonl").read_text())
