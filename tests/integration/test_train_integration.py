"""End to end through launch.py: the default job, its outputs, and failure exits."""

import pytest


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["mesh.data=2", "mesh.fsdp=4", "train.grad_accum_steps=2", "train.steps_per_call=2", "model.dropout_rate=0.2"],
    ],
    ids=["one-device", "data2-fsdp4-accum-scan"],
)
@pytest.mark.slow
def test_data_on_the_devices_trains_exactly_as_host_batches(make_config, tmp_path, overrides):
    """data.placement=device gathers each batch inside the step: the same batches, the same losses."""
    from engine.run.setup import build_run
    from engine.run.single import fit

    losses = {}
    for placement in ("host", "device"):
        cfg = make_config(
            "mnist_mlp.yaml",
            f"data.placement={placement}",
            "train.steps=12",
            "log.every_steps=4",
            "eval.every_steps=12",
            "checkpoint.every_steps=0",
            *overrides,
            workdir=tmp_path / placement,
        )
        run = build_run(cfg)
        assert (run.inputs.resident_bytes > 0) == (placement == "device")
        result = fit(cfg, run)
        losses[placement] = (result.losses, result.eval_metrics)
    assert losses["device"] == losses["host"] and len(losses["host"][0]) == 12


def test_profile_steps_write_a_trace_and_the_summary_says_where_the_loop_went(make_config, tmp_path):
    from engine.errors import UsageError
    from engine.run.single import fit

    cfg = make_config(
        "mnist_mlp.yaml",
        "train.steps=12",
        "log.every_steps=4",
        "eval.every_steps=0",
        "log.profile_steps=[2,6]",
        workdir=tmp_path / "run",
    )
    summary = fit(cfg).summary
    traces = list((tmp_path / "run" / "profile" / "process_0").rglob("*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    assert summary["profile_dir"] == str(tmp_path / "run" / "profile" / "process_0")
    shares = [summary[k] for k in ("loop_dispatch", "loop_data_wait", "loop_device_wait")]
    assert all(0 <= s <= 1 for s in shares) and 0 < sum(shares) <= 1 and summary["loop_dispatch"] > 0
    with pytest.raises(UsageError, match=r"log.profile_steps=\[6, 2\] must be"):
        make_config("mnist_mlp.yaml", "log.profile_steps=[6,2]")


def test_the_profile_window_is_traced_from_the_call_that_holds_its_first_step(tmp_path):
    """--profile traces steps 5..15; with 10 steps per call, the calls 0..10 and 10..20 hold them."""
    import jax.numpy as jnp

    from engine.observe.perf import StepTrace

    trace = StepTrace([5, 15], 0, tmp_path, steps_per_call=10)
    for step in (0, 10, 20, 30):
        trace.before(step)
        trace.after(step + 10, jnp.ones(3) * step)
    trace.close()
    assert trace.traced == (0, 20)
