"""`launch.py plan`: runs compiled for TPU pods by the TPU compiler (libtpu) on this CPU host.
The figures come from the compiled programs; the tests check them against what the sharded
state must hold, against the compiler's own refusal, and against the HLO's collectives."""

import dataclasses
import math
import os

import numpy as np
import pytest

from conftest import ROOT, run_cli
from engine.config import load_config
from engine.errors import UsageError
from engine.plan.compiled import model_choices, plan
from engine.plan.layouts import search
from engine.plan.tpu import Target, parse_target
from engine.plan.verdict import render, verdict

pytest.importorskip("libtpu", reason="the TPU compiler (libtpu) is not installed")

TINY = ["train.steps_per_call=1", "data.steps_per_transfer=1"]


def tiny(make_config, *overrides, **kwargs):
    return make_config("llama_tiny.yaml", *TINY, *overrides, **kwargs)


def sharded_bytes(program, layouts, mesh) -> int:
    """What one chip holds of the parameters, from their PartitionSpecs alone."""
    total = 0
    for layout in layouts:
        axes = [a for part in layout.spec for a in ((part,) if isinstance(part, str) else (part or ()))]
        total += layout.nbytes // math.prod(mesh[a] for a in axes)
    return total


def assert_state_bytes_are_the_sharded_state(make_config, planned, *overrides):
    """The plan fits, and each chip's parameter and optimizer bytes are those its PartitionSpecs
    give (Adam: two moments of every parameter, in float32, beside a few scalars)."""
    from engine.run.setup import plan_run

    assert planned.fits
    train = planned.programs[0]
    shapes = plan_run(tiny(make_config, *overrides), devices=planned.target.devices)
    expected = sharded_bytes(train, shapes.state.param_layouts, planned.mesh)
    assert train.params == expected
    assert 2 * expected <= train.optimizer <= 2 * expected + 1024
    assert train.temporaries > 0 and train.total > train.params + train.optimizer
    assert "fsdp=4 (ICI)" in render(planned)


@pytest.mark.slow
def test_llama_tiny_compiles_for_a_v5e_slice_and_its_state_bytes_are_the_sharded_state(make_config):
    """One slice of v5e-4, fsdp over its chips (two slices: the test below, on the same plan)."""
    planned = plan(tiny(make_config, "mesh.data=1", "mesh.fsdp=4"), parse_target("v5e-4"))
    assert planned.target.chips == 4
    assert_state_bytes_are_the_sharded_state(make_config, planned, "mesh.data=1", "mesh.fsdp=4")


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
def test_llama_1b_with_fsdp_over_four_v5e_chips_fits(make_config):
    """(With remat=dots the saved attention scores of XLA's attention take 13 GiB and it does not.)"""
    cfg = make_config("llama_1b.yaml", "mesh.data=1", "mesh.fsdp=4", "train.global_batch_size=8", "model.remat=full")
    planned = plan(cfg, parse_target("v5e-4"))
    assert planned.fits, verdict(planned)
    assert planned.peak > 1.24e9 * 12 / 4  # more than the state alone: 1.24B parameters x 12 bytes / 4 chips
    assert verdict(planned).startswith("fits:")


def dcn_ops(planned) -> set[str]:
    return {c.op for c in planned.collectives if c.dcn}


@pytest.mark.slow
def test_across_two_slices_only_the_data_gradient_reduction_crosses_the_slower_network(make_config):
    """Data across 2 slices, fsdp inside each: every collective whose devices sit in more than
    one slice is a reduction (the gradients over data); the ICI collectives each stay inside a
    slice. Putting fsdp across the slices instead sends parameter all-gathers over DCN. Both
    compile for the 8 chips, and each chip's state bytes are those of its PartitionSpecs."""
    layout = ("mesh.data=2", "mesh.fsdp=4", "mesh.dcn_data=2")
    inside = plan(tiny(make_config, *layout), parse_target("v5e-4", 2))
    assert inside.target.chips == 8 and "data=2 (DCN x2, ICI x1)" in render(inside)
    assert_state_bytes_are_the_sharded_state(make_config, inside, *layout)
    assert dcn_ops(inside) == {"all-reduce"}
    slice_of = [d.slice_index for d in inside.target.devices]
    for collective in inside.collectives:
        if not collective.dcn and collective.groups:
            assert all(len({slice_of[d] for d in group}) == 1 for group in collective.groups)
    across = plan(tiny(make_config, "mesh.data=2", "mesh.fsdp=4", "mesh.dcn_fsdp=2"), parse_target("v5e-4", 2))
    assert dcn_ops(across) - {"all-reduce"}, "fsdp across slices gathers parameters over DCN"
    assert across.per_step(dcn=True) > inside.per_step(dcn=True)


@pytest.mark.slow
def test_search_ranks_a_fitting_layout_whose_overrides_train_with_the_default_losses(make_config, tmp_path):
    """The runs train in processes of their own, compiled as a user's would be: this process's
    unoptimised XLA:CPU code (tests/conftest.py) can starve one of 8 device threads past
    XLA:CPU's 40 s collective rendezvous timeout on 2 cores."""
    import json

    ranked = search(tiny(make_config), parse_target("v5e-8"), compiles=2, say=lambda text: None)
    assert ranked and ranked[0].planned.fits
    best = ranked[0].overrides()
    runs = {"default": [], "best": best}
    losses = {}
    for name, overrides in runs.items():
        proc = run_cli(
            "--config",
            "configs/llama_tiny.yaml",
            "--workdir",
            str(tmp_path / name),
            *TINY,
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


@pytest.fixture
def no_topology(monkeypatch):
    """Fails a test whose command has libtpu describe its target (the step before any mesh or compile)."""

    def described(target):
        raise AssertionError(f"{target.topology_name} was described")

    monkeypatch.setattr(Target, "devices", property(described))


def plan_in_process(capsys, *args) -> tuple[int, str]:
    """(exit code, stderr) of `launch.py plan --config llama_tiny ARGS` in this process."""
    from engine.cli import main

    code = main(["plan", "--config", "llama_tiny", *args])
    return code, capsys.readouterr().err


@pytest.mark.nocompile
@pytest.mark.parametrize(
    "args, message",
    [
        (["--target", "v5p:512x512x512"], "134,217,728 chips in one slice, but the largest v5p slice is 8,960"),
        (["--target", "v5p:1024x1024x1024"], "1,073,741,824 chips in one slice"),
        (["--target", "v5e:1024x1024"], "the largest v5e slice is 256 chips (a whole pod); give at most that"),
        (["--target", "v4-16384"], "8,192 chips in one slice, but the largest v4 slice is 4,096"),
        (["--target", "v5p-" + "9" * 5000], "a number of 5000 digits is far more chips than any TPU slice"),
        (["--target", "v5e-256", "--slices", "300"], "76,800 chips, more than the 65,536 a plan takes"),
        (["--target", "v5e-256"], "global_batch_size=16 is not divisible by data*fsdp*expert=256*1*1=256"),
        (["--target", "v5e-8", "train.grad_accum_steps=4"], "(a micro-batch of 4 with train.grad_accum_steps=4)"),
        (
            ["--target", "v5e-8", "--slices", "2", "mesh.data=1"],
            "e.g. mesh.dcn_data=2 mesh.data=2",
        ),  # a hint that works
    ],
    ids=[
        "512-cubed",
        "1024-cubed",
        "v5e-1024-squared",
        "v4-past-its-pod",
        "digits",
        "slices",
        "batch",
        "micro",
        "hint",
    ],
)
def test_targets_past_the_largest_pod_or_the_batch_exit_2_before_the_topology(no_topology, capsys, args, message):
    """Refused from the numbers alone, at once: a topology of a billion chips took 21 GB and minutes."""
    code, err = plan_in_process(capsys, *args)
    assert code == 2, err
    assert message in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.nocompile
def test_a_json_path_that_cannot_be_written_exits_2_before_the_compile(no_topology, capsys, tmp_path):
    (tmp_path / "a-file").write_text("")
    cases = {
        str(tmp_path): "is a directory; give a file name",
        str(tmp_path / "missing" / "plan.json"): "missing is not an existing directory",
        str(tmp_path / "a-file" / "plan.json"): "a-file is not an existing directory",
    }
    for path, message in cases.items():
        code, err = plan_in_process(capsys, "--target", "v5e-8", "--json", path)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(AssertionError, match="v5e:2x4 was described"):  # what passes the checks goes on
        plan_in_process(capsys, "--target", "v5e-8", "--json", str(tmp_path / "plan.json"))


@pytest.mark.nocompile
def test_pod_names_count_cores_for_v4_and_v5p_and_chips_for_v5e_and_v6e():
    assert parse_target("v5p-128").topology_name == "v5p:4x4x4"
    assert parse_target("v4-32").topology_name == "v4:2x2x4"
    assert parse_target("v5e-256").topology_name == "v5e:16x16"
    assert parse_target("v6e-64").topology_name == "v6e:8x8"
    assert parse_target("v5p:4x4x8", 2).chips == 256
    with pytest.raises(UsageError, match="2 dimensions"):
        parse_target("v5e:2x2x2")


@pytest.mark.nocompile
def test_the_mfu_table_is_the_analytic_flops_at_the_chips_peak(make_config):
    cfg = load_config(ROOT / "configs" / "llama_tiny.yaml", TINY, "/tmp/unused")
    from engine.plan.compiled import Planned

    planned = Planned(cfg, parse_target("v5p-8"), {}, {}, 0, flops_per_chip=459e12, tokens_per_step=4096)
    assert planned.step_seconds(0.5) == pytest.approx(2.0)  # 459 TFLOP at half of 459 TFLOP/s


@pytest.mark.slow
def test_a_sweep_plans_each_distinct_program_its_vectorised_groups_included(tmp_path):
    """Four runs, two compiled programs (the layer count differs), vectorised two at a time:
    two plans, each of a group of two trials."""
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(
        f"base: {ROOT / 'configs' / 'llama_tiny.yaml'}\ndirectory: {tmp_path / 'out'}\n"
        "overrides: {train.steps_per_call: 1, mesh.data: 1, mesh.fsdp: 4}\n"
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


def test_a_step_whose_collectives_outlast_its_compute_is_called_communication_bound(make_config):
    """FSDP's all-gathers do not shrink with the batch: at 1 sequence per chip the weights' traffic
    outlasts the compute at 50% MFU, and the verdict says so and names a larger batch first."""
    from engine.plan.compiled import Planned, Program
    from engine.plan.hlo import Collective

    target = parse_target("v6e-64")
    cfg = tiny(make_config)
    mesh = {"data": 1, "fsdp": 64, "tensor": 1, "expert": 1, "context": 1, "pipeline": 1}
    ici = target.chip.ici_bytes_per_second
    gather = Collective("all-gather", int(ici * 0.2 * 64 / 63), group=64)  # 0.2 s at the chip's ICI bandwidth

    def planned(flops: float) -> Planned:
        program = Program("train", 0, 0, 0, 0, 2**30, 2**30, 0.0)
        return Planned(
            cfg,
            target,
            mesh,
            dict.fromkeys(mesh, 1),
            target.program_hbm_bytes,
            programs=[program],
            collectives=[gather],
            flops_per_chip=flops,
            tokens_per_step=64 * 8192,
            flops_formula="6*N*tokens",
        )

    waits = planned(flops=0.5 * 0.1 * target.chip.peak_bf16)  # 0.1 s of compute at 50% MFU
    assert waits.collective_seconds() == pytest.approx(0.2)
    assert waits.communication_bound()
    said = verdict(waits)
    assert (
        said.startswith("fits:") and "communication-bound at 50% MFU (200.0 ms of collectives against 100.0 ms" in said
    )
    assert "train.global_batch_size=" in said and "mesh.tensor=2" in said, said
    text = render(waits)
    assert f"FLOPs per token: {waits.flops_per_chip / 8192:.4g} (6*N*tokens;" in text, text
    assert "against 100.0 ms of compute at 50% MFU: communication-bound" in text, text
    busy = planned(flops=0.5 * 0.4 * target.chip.peak_bf16)  # 0.4 s of compute hides 0.2 s of collectives
    assert not busy.communication_bound() and "communication-bound" not in verdict(busy)


def test_headroom_is_against_the_compilers_own_limit_and_under_5_percent_is_warned(make_config):
    """The TPU compiler gives a v5e program 15.75 of its 16 GiB (what it says refusing one too
    large); a plan within 5% of that limit fits with a warning."""
    from engine.plan.compiled import Planned, Program

    target = parse_target("v5e-8")
    assert target.program_hbm_bytes == int(15.75 * 2**30)
    cfg = tiny(make_config)
    mesh = {"data": 8, "fsdp": 1, "tensor": 1, "expert": 1, "context": 1, "pipeline": 1}

    def verdict_at(total: int) -> str:
        program = Program("train", 0, 0, 0, 0, total, total, 0.0)
        return verdict(Planned(cfg, target, mesh, {}, target.program_hbm_bytes, programs=[program]))

    assert verdict_at(14 * 2**30).startswith("fits: 14.0 GiB per device of the 15.8 GiB the TPU compiler gives")
    assert "warning" not in verdict_at(14 * 2**30)
    assert "(2% headroom); warning: under 5% headroom" in verdict_at(int(15.4 * 2**30))
    assert verdict_at(int(15.9 * 2**30)).startswith("does not fit")  # under the chip's 16 GiB, over the limit


@pytest.mark.slow
def test_splash_attention_compiles_for_tpu_and_keeps_no_score_matrix(make_config):
    """On a TPU target the Pallas kernel is compiled by the TPU compiler as a Mosaic custom call
    (not interpreted, as on this host's CPU): at seq 512 its train step's temporaries are far
    below XLA attention's, which holds [batch, heads, seq, seq] scores (40% of them at 512, 36%
    at 1024; at 256 the compiler reports no temporaries for either)."""
    from engine.run.setup import compile_plan, plan_run

    target = parse_target("v5e-8")
    xla = plan(tiny(make_config, "data.seq_len=512", "model.attention=xla"), target, compile_eval=False)
    cfg = tiny(make_config, "data.seq_len=512", "model.attention=auto")  # (auto: splash for TPU devices)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compilation_cache_dir=""))
    program = plan_run(cfg, devices=target.devices)
    compiled = compile_plan(cfg, program)
    assert "tpu_custom_call" in compiled.program.as_text()  # the kernel, for the chip
    assert compiled.memory.temp_size_in_bytes < xla.programs[0].temporaries / 2
    assert (xla.attention, model_choices(program)[0]) == ("xla", "splash")  # what the plan's text names


def test_the_suggested_accumulation_fits_and_remat_s_step_time_counts_the_recomputation(make_config):
    """A program 2.25x too big (its temporaries the excess): the suggested grad_accum_steps is the
    fewest that fit by the estimate (4, not 2); remat=full's step time includes the recomputed
    forward; the plan says the batch and sequence it planned (issue 53.11)."""
    from engine.plan.compiled import BOUND_AT, Planned, Program
    from engine.plan.verdict import _time_lines, render

    target = parse_target("v5e-8")
    hbm = target.program_hbm_bytes
    cfg = tiny(make_config, "train.global_batch_size=64", "model.remat=none")
    mesh = {"data": 8, "fsdp": 1, "tensor": 1, "expert": 1, "context": 1, "pipeline": 1}
    state, temporaries = hbm // 4, 2 * hbm  # 2.25x the HBM: a half needs 1.25x, a quarter 0.75x
    program = Program("train", state, 0, 0, 0, temporaries, state + temporaries, 0.0)
    dcn = {axis: 1 for axis in mesh}
    planned = Planned(cfg, target, mesh, dcn, hbm, programs=[program], flops_per_chip=1e12, tokens_per_step=4096)
    said = verdict(planned)
    assert "train.grad_accum_steps=4 (a micro-batch of 16: an estimated" in said, said
    full, at = planned.step_seconds(BOUND_AT) * 8 / 6 * 1e3, f"{BOUND_AT:.0%} MFU"
    assert f"model.remat=full (recompute activations: {full:,.1f} ms a step at {at}" in said, said
    planned.remat = "full"
    assert any(f"a step at {at} takes {full:,.1f} ms" in line for line in _time_lines(planned))
    planned.programs, planned.refused = [], "out of memory"
    assert f"\nbatch: 64 examples a step of {cfg.data.seq_len:,} tokens" in render(planned)
