"""Faults and abuse, processes: a second job on the same workdir, Ctrl-C and SIGTERM at any
moment (while compiling, inside a log window), a data reader that hangs, a peer that never
starts. Each test checks the engine's answer: one line, the documented exit code, and a run
that resumes as if it had never stopped."""

import pytest
from support.configs import RATES


def test_a_stop_inside_a_log_window_resumes_with_the_metrics_of_an_unbroken_run(make_config, tmp_path, monkeypatch):
    """Before: SIGTERM in the middle of a log window saved and exited 143, but that window's
    steps were never logged, so metrics.jsonl differed from an uninterrupted run. The window's
    per-step metrics now travel in the checkpoint's meta and the resumed run logs them."""
    import signal

    from engine.run import loop
    from engine.run import single as trainer
    from engine.runtime.preemption import Preempted
    from engine.runtime.rundir import read_records

    args = [
        "mesh.num_devices=1",
        "train.steps=100",
        "log.every_steps=25",
        "eval.every_steps=50",
        "checkpoint.every_steps=0",
    ]
    real, calls = loop._dispatch, []

    def dispatch(*a):
        calls.append(1)
        if len(calls) == 37:  # SIGTERM arrives during step 37: the window of steps 26..50 is cut at 37
            signal.raise_signal(signal.SIGTERM)
        return real(*a)

    monkeypatch.setattr(loop, "_dispatch", dispatch)
    with pytest.raises(Preempted, match="saved a checkpoint at step 37") as stopped:
        trainer.fit(make_config("mnist_mlp.yaml", *args, workdir=tmp_path / "run"))
    assert stopped.value.exit_code == 143
    monkeypatch.setattr(loop, "_dispatch", real)
    resumed = trainer.fit(make_config("mnist_mlp.yaml", *args, workdir=tmp_path / "run"))
    reference = trainer.fit(make_config("mnist_mlp.yaml", *args, workdir=tmp_path / "reference"))
    assert resumed.losses == {step: loss for step, loss in reference.losses.items() if step > 37}

    def records(workdir):
        return [
            {k: v for k, v in r.items() if k not in RATES}
            for r in read_records(workdir / "metrics.jsonl")
            if r["split"] in ("train", "eval")
        ]

    assert records(tmp_path / "run") == records(tmp_path / "reference")
