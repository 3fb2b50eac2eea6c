"""Checkpointing and fault tolerance: exact resume after SIGKILL, SIGTERM, damaged
checkpoints, incompatible models, restore onto other meshes, the evaluator, export."""

import jax
import numpy as np
import pytest
from support.checkpoint import saved_arrays, train_briefly

from engine.checkpoint.store import Checkpointer
from engine.errors import UsageError
from engine.run.setup import build_run
from engine.run.single import fit


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
