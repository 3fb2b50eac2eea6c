"""A finished run closes what it started: no thread it started outlives it. (A daemon thread
still inside JAX's C++ when the interpreter exits is cancelled there, and the process aborts
after its last line: `terminate called ...`/`FATAL: exception not rethrown`, exit -6.)"""

import signal
import threading

from support.configs import ROOT

from engine.cli import main

# a run that stops early (the prefetcher is ahead of the loop when it ends), with evaluations,
# checkpoints and the watchdog, as tests/e2e/test_early_stop_e2e.py runs
EARLY = [
    "mesh.num_devices=1",
    "train.steps=200",
    "eval.every_steps=10",
    "checkpoint.every_steps=10",
    "train.early_stop.metric=eval/loss",
    "train.early_stop.min_delta=10",
    "train.early_stop.patience=1",
]


def test_a_finished_run_leaves_no_thread_it_started_alive(tmp_path, compilation_cache):
    before = set(threading.enumerate())
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        config, workdir = str(ROOT / "configs" / "mnist_mlp.yaml"), str(tmp_path / "run")
        cache = f"train.compilation_cache_dir={compilation_cache}"
        code = main(["--config", config, "--workdir", workdir, *EARLY, "log.progress=false", cache])
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert code == 0
    left = [thread.name for thread in threading.enumerate() if thread not in before]
    assert not left, f"threads the run started are still alive after it returned: {left}"
