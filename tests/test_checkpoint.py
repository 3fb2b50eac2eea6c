"""Checkpointing and fault tolerance: exact resume after SIGKILL, SIGTERM, damaged
checkpoints, incompatible models, restore onto other meshes, the evaluator, export."""

import json
import signal
import time

import jax
import numpy as np
import pytest

from conftest import run_cli, start_cli
from engine.checkpoint.store import Checkpointer
from engine.errors import UsageError
from engine.run.setup import build_run
from engine.run.single import fit
from engine.runtime.rundir import read_records

# dropout on, a warm-up + cosine schedule, a log line per step: every step's loss is compared
RUN = [
    "train.steps=120",
    "checkpoint.every_steps=10",
    "checkpoint.keep=20",
    "log.every_steps=1",
    "log.progress=false",
    "eval.every_steps=0",
    "optimizer.schedule=warmup_cosine",
    "optimizer.warmup_steps=10",
]


def losses(workdir):
    records = read_records(workdir / "metrics.jsonl")  # a line still being written is not read
    return [(r["step"], r["loss"]) for r in records if r["split"] == "train"]


def saved_arrays(workdir, step):
    import orbax.checkpoint as ocp

    path = workdir / "checkpoints" / str(step) / "state"
    restored = ocp.PyTreeCheckpointer().restore(path)  # a dict keyed by TrainState's fields
    return [
        leaf
        for name in ("step", "params", "model_state", "opt_state", "rng")
        for leaf in jax.tree.leaves(restored.get(name, {}))
    ]


def start_training(workdir, *extra):
    return start_cli("--config", "configs/mnist_mlp.yaml", "--workdir", str(workdir), *RUN, *extra)


def wait_for_step(workdir, step, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (workdir / "metrics.jsonl").exists() and losses(workdir) and losses(workdir)[-1][0] >= step:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("uninterrupted")
    proc = start_training(workdir)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return workdir


def assert_same_run(workdir, reference):
    assert losses(workdir) == losses(reference)  # bit-identical: JSON floats round-trip exactly
    for a, b in zip(saved_arrays(workdir, 120), saved_arrays(reference, 120)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("kill_at, staging", [(67, "device")])  # host staging: the seeded random-moments test
def test_sigkill_then_rerun_is_bit_identical(tmp_path, uninterrupted, kill_at, staging):
    """Also with checkpoint.staging=device: the background save writes the state of its step."""
    workdir = tmp_path / "killed"
    proc = start_training(workdir, f"checkpoint.staging={staging}")
    wait_for_step(workdir, kill_at, proc)
    proc.kill()
    proc.wait()
    assert losses(workdir)[-1][0] < 120  # it really was cut short
    proc = start_training(workdir, f"checkpoint.staging={staging}")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert_same_run(workdir, uninterrupted)


@pytest.mark.slow
def test_sigterm_saves_exits_143_and_resumes_without_losing_a_step(tmp_path, uninterrupted):
    workdir = tmp_path / "preempted"
    proc = start_training(workdir, "checkpoint.every_steps=1000")  # only the preemption save
    wait_for_step(workdir, 30, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "preempted by SIGTERM: saved a checkpoint at step" in err
    saved = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    assert saved and saved[-1] == losses(workdir)[-1][0]  # the save is at the last step run
    proc = start_training(workdir, "checkpoint.every_steps=1000")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert_same_run(workdir, uninterrupted)


def train_briefly(make_config, workdir, *extra):
    cfg = make_config(
        "mnist_mlp.yaml",
        "mesh.num_devices=1",
        "train.steps=30",
        "checkpoint.every_steps=10",
        "checkpoint.keep=5",
        "log.every_steps=10",
        *extra,
        workdir=workdir,
    )
    fit(cfg)
    return cfg


def test_checkpoint_truncated_mid_write_is_skipped(make_config, tmp_path, capfd):
    workdir = tmp_path / "run"
    cfg = train_briefly(make_config, workdir)
    newest = workdir / "checkpoints" / "30" / "state"
    biggest = max((p for p in newest.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
    # a save cut off before orbax finalised it: a temporary directory, never listed
    (workdir / "checkpoints" / "40.orbax-checkpoint-tmp-123").mkdir()
    run = build_run(cfg)
    state, meta, step = Checkpointer(workdir / "checkpoints", 5).restore(run.abstract_state)
    assert step == 20 and int(state.step) == 20 and meta["data"]["next_step"] == 20
    assert "checkpoints/30 is unreadable" in capfd.readouterr().err


@pytest.mark.slow
def test_all_checkpoints_corrupt_is_exit_2_and_nothing_deleted(tmp_path):
    workdir = tmp_path / "run"
    args = [
        "--config",
        "configs/mnist_mlp.yaml",
        "--workdir",
        str(workdir),
        "train.steps=20",
        "checkpoint.every_steps=10",
        "log.progress=false",
    ]
    assert run_cli(*args).returncode == 0
    files = sorted(p for p in (workdir / "checkpoints").rglob("*") if p.is_file())
    for path in files:
        if path.parent.name in ("d", "ocdbt.process_0") or path.name == "manifest.ocdbt":
            path.write_bytes(b"garbage")
    before = sorted(p for p in (workdir / "checkpoints").rglob("*"))
    proc = run_cli(*args[:4], "train.steps=30", "log.progress=false")
    assert proc.returncode == 2, proc.stderr
    assert f"every checkpoint in {workdir / 'checkpoints'} is unreadable" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p for p in (workdir / "checkpoints").rglob("*")) == before


def test_incompatible_model_lists_mismatched_parameters(make_config, tmp_path):
    workdir = tmp_path / "run"
    train_briefly(make_config, workdir)
    with pytest.raises(UsageError, match=r"hidden_0/kernel: saved \(64, 128\), expected \(64, 32\)"):
        train_briefly(make_config, workdir, "model.hidden_sizes=[32]", "train.steps=40")


def test_a_checkpoint_from_before_the_clipping_norm_was_a_state_number_resumes(make_config, tmp_path):
    """Runs with optimizer.grad_clip_norm saved their optimizer without the norm among its
    numbers: such a checkpoint resumes, and the norm comes from the config."""
    cfg = make_config(
        "mnist_mlp.yaml",
        "mesh.num_devices=1",
        "optimizer.grad_clip_norm=0.5",
        "train.steps=4",
        workdir=tmp_path / "run",
    )
    run = build_run(cfg)
    state = run.init_state()
    hyperparams = dict(state.opt_state.hyperparams)
    del hyperparams["grad_clip_norm"]  # the layout such a run saved
    checkpointer = Checkpointer(tmp_path / "run" / "checkpoints", keep=2)
    checkpointer.save(2, state.replace(opt_state=state.opt_state._replace(hyperparams=hyperparams)), {"step": 2})
    checkpointer.close()
    result = fit(cfg, run)
    assert sorted(result.losses) == [3, 4]  # resumed at step 2
    assert float(result.state.opt_state.hyperparams["grad_clip_norm"]) == 0.5


FSDP8 = [
    "mesh.data=1",
    "mesh.fsdp=8",
    "model.dropout_rate=0.2",
    "checkpoint.keep=5",
    "log.every_steps=1",
    "eval.every_steps=0",
]


@pytest.mark.slow
def test_restore_onto_other_meshes_continues_the_same_run(make_config, tmp_path):
    reference = fit(make_config("mnist_mlp.yaml", *FSDP8, "train.steps=20", workdir=tmp_path / "ref")).losses
    saved = tmp_path / "saved"
    fit(make_config("mnist_mlp.yaml", *FSDP8, "train.steps=10", workdir=saved))
    saved_values = saved_arrays(saved, 10)
    for name, layout in {
        "data2_tensor4": ["mesh.data=2", "mesh.fsdp=1", "mesh.tensor=4"],
        "one_device": ["mesh.num_devices=1", "mesh.fsdp=1"],
    }.items():
        workdir = tmp_path / name
        cfg = make_config(
            "mnist_mlp.yaml",
            *FSDP8,
            *layout,
            "train.steps=20",
            f"checkpoint.restore_from={saved}/checkpoints",
            "checkpoint.restore_mode=all",
            workdir=workdir,
        )
        run = build_run(cfg)
        state, _, step = Checkpointer(saved / "checkpoints", 5, read_only=True).restore(run.abstract_state)
        for array, target, value in zip(jax.tree.leaves(state), jax.tree.leaves(run.abstract_state), saved_values):
            assert array.sharding.is_equivalent_to(target.sharding, array.ndim)  # the new layout, not the saved one
            np.testing.assert_array_equal(np.asarray(array), value)
        kernel = state.params["hidden_0"]["kernel"]
        expected_shard = (64, 32) if name == "data2_tensor4" else (64, 128)
        assert kernel.addressable_shards[0].data.shape == expected_shard
        continued = fit(cfg, run).losses
        assert sorted(continued) == list(range(11, 21))
        np.testing.assert_allclose(
            [continued[s] for s in range(11, 21)], [reference[s] for s in range(11, 21)], rtol=1e-5, err_msg=name
        )


def test_restore_from_params_only_starts_at_step_zero(make_config, tmp_path, capsys):
    source = tmp_path / "source"
    train_briefly(make_config, source)
    cfg = make_config(
        "mnist_mlp.yaml",
        "mesh.num_devices=1",
        "train.steps=5",
        "optimizer.name=sgd",
        f"checkpoint.restore_from={source}/checkpoints",
        workdir=tmp_path / "finetune",
    )
    run = build_run(cfg)
    from engine.run.single import initial_state

    state, step, _ = initial_state(run, Checkpointer(tmp_path / "finetune" / "checkpoints", 3))
    assert step == 0 and int(state.step) == 0
    assert f"starting from the parameters in {source}/checkpoints at step 0" in capsys.readouterr().out
    params, _ = Checkpointer(source / "checkpoints", 5, read_only=True).restore_params(run.abstract_state.params)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_evaluator_evaluates_each_checkpoint_of_a_live_run_once(tmp_path):
    workdir = tmp_path / "live"
    evaluator = start_cli("eval", "--config", "configs/mnist_mlp.yaml", "--workdir", str(workdir), "--watch", *RUN)
    trainer = start_training(workdir)
    _, err = trainer.communicate(timeout=300)
    assert trainer.returncode == 0, err
    _, err = evaluator.communicate(timeout=300)
    assert evaluator.returncode == 0, err
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r["step"] for r in records if r.get("source") == "evaluator"]
    assert sorted(evaluated) == list(range(10, 121, 10))  # every checkpoint, each once
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in records if r.get("source") == "evaluator")
    assert list((workdir / "evaluator").glob("events.out.tfevents.*"))
    # without --watch: the newest checkpoint once
    proc = run_cli("eval", "--config", "configs/mnist_mlp.yaml", "--workdir", str(workdir), *RUN)
    assert proc.returncode == 0, proc.stderr


def test_export_reloads_and_reproduces_outputs(make_config, tmp_path):
    workdir = tmp_path / "run"
    cfg = train_briefly(make_config, workdir)
    out = tmp_path / "export"
    proc = run_cli("export", "--workdir", str(workdir), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    import orbax.checkpoint as ocp

    exported = jax.export.deserialize(bytearray((out / "forward.stablehlo").read_bytes()))
    variables = ocp.StandardCheckpointer().restore(out / "variables")
    run = build_run(cfg)
    state = Checkpointer(workdir / "checkpoints", 5).restore(run.abstract_state).state
    images = run.dataset.eval["image"][:7]
    expected = run.model.module.apply({"params": state.params}, images, train=False)
    np.testing.assert_allclose(exported.call(variables, images), expected, rtol=1e-6)
    assert run_cli("export", "--workdir", str(workdir), "--out", str(out)).returncode == 2  # never overwrites
    from engine.runtime.rundir import check_sums

    assert check_sums(out) is None and "variables/" in (out / "SHA256SUMS").read_text()
    data = max((p for p in (out / "variables").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1  # one flipped bit in the variables: named
    data.write_bytes(bytes(raw))
    assert (
        check_sums(out)
        == f"{data.relative_to(out)} does not match its checksum in SHA256SUMS (the file changed on disk)"
    )


def test_host_staging_saves_a_pinned_host_copy_in_the_background(tmp_path):
    """checkpoint.staging=host: save() returns once a copy into pinned host memory is
    dispatched, orbax runs on the background thread, and the checkpoint holds the state as
    it was at save() although the caller's next step donates (overwrites) those buffers."""
    import threading

    import orbax.checkpoint as ocp

    mesh = jax.make_mesh((8,), ("data",))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    state = {"w": jax.device_put(np.arange(64, dtype=np.float32), sharded), "b": jax.numpy.ones((3, 4))}
    expected = jax.device_get(state)
    checkpointer = Checkpointer(tmp_path / "ckpt", keep=3)  # the default staging
    assert checkpointer.staging == "host"
    threads, orbax_save = [], checkpointer.manager.save
    checkpointer.manager.save = lambda *a, **k: threads.append(threading.current_thread().name) or orbax_save(*a, **k)
    step = jax.jit(lambda s: jax.tree.map(lambda x: x * 0 - 1, s), donate_argnums=0)
    step(jax.tree.map(jax.numpy.copy, state))  # compiled before the save: it runs at once after it
    checkpointer.save(1, state, {"step": 1})
    saved_w = state["w"]
    state = step(state)  # the next "step", while orbax is still starting on its thread
    assert saved_w.is_deleted()  # its buffers now hold the next state
    checkpointer.wait()
    checkpointer.close()
    assert threads == ["checkpoint-save"]
    restored = ocp.PyTreeCheckpointer().restore(tmp_path / "ckpt" / "1" / "state")
    for name in ("w", "b"):
        np.testing.assert_array_equal(np.asarray(restored[name]), expected[name])
    assert (jax.device_get(state["w"]) == -1).all()  # (the donated buffers were overwritten)


def test_device_staged_save_errors_reach_the_training_thread(tmp_path):
    """With checkpoint.staging=device orbax runs on a background thread; what fails there is
    raised by the next save or wait, not lost."""
    checkpointer = Checkpointer(tmp_path / "ckpt", keep=3, staging="device")
    state = {"w": jax.numpy.arange(4.0)}
    checkpointer.save(5, state, {"step": 5})
    checkpointer.wait()
    checkpointer.save(5, state, {"step": 5})  # the same step again: orbax refuses, in the background
    with pytest.raises(Exception, match="step 5 already exists"):
        checkpointer.wait()
    checkpointer.close()
    assert checkpointer.steps() == [5]


@pytest.mark.slow
def test_sigkill_at_seeded_random_moments_and_inside_a_save_is_bit_identical(tmp_path, uninterrupted):
    """Killed with a save half written (its newest step put back as orbax leaves one mid-write:
    under its temporary name, a file cut short), then at seeded random moments of the re-runs
    (start-up, restore, training, saves): the last re-run ends bit-identical to a run never
    stopped, and the half-written save is never read as whole."""
    import random
    import shutil

    rng = random.Random(1123)
    workdir = tmp_path / "killed"
    proc = start_training(workdir)
    wait_for_step(workdir, 40, proc)
    proc.kill()
    proc.wait()
    checkpoints = workdir / "checkpoints"
    newest = max(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
    partial = checkpoints / f"{newest}.orbax-checkpoint-tmp-1795500000000000"
    shutil.move(checkpoints / str(newest), partial)
    largest = max((f for f in partial.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 2])
    for moment in [rng.uniform(0.5, 8.0) for _ in range(3)]:
        proc = start_training(workdir)
        time.sleep(moment)
        proc.kill()
        proc.wait()
    proc = start_training(workdir)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert (checkpoints / str(newest)).is_dir()  # that step was saved again, whole
    assert_same_run(workdir, uninterrupted)
