"""Model-based search with pruning (engine/sweep/search.py) on the digits MLP: an Optuna study
in the sweep directory's SQLite database, pruned trials stopped early, a killed sweep
resuming its study, two sweep processes sharing one study without running a trial twice.
And `launch.py plan --search`'s candidates (engine/plan/layouts.py): the attention, remat and
loss-chunk variants a family supports, their overrides, and the order they are compiled in."""

import json
import re
import subprocess
import time

import pytest
import yaml

from conftest import QUIET, ROOT, TINY_GPT, TINY_LLAMA, start_cli
from engine.config import load_config
from engine.errors import UsageError
from engine.plan import layouts
from engine.plan.tpu import parse_target
from engine.runtime.rundir import read_records
from engine.sweep import load_sweep

OVERRIDES = {
    "train.steps": 40,
    "eval.every_steps": 10,
    "log.every_steps": 10,
    "checkpoint.every_steps": 10,
    "log.tensorboard": False,
    "mesh.num_devices": 1,
}
PARAMS = {"optimizer.learning_rate": {"log_uniform": [1.0e-5, 1.0e-1]}, "model.hidden_sizes": {"choice": [[16], [64]]}}


def sweep_file(tmp_path, trials, pruner=None, **search):
    spec = {
        "base": str(ROOT / "configs" / "mnist_mlp.yaml"),
        "overrides": OVERRIDES,
        "metric": "eval/loss",
        "mode": "min",
        "directory": str(tmp_path / "sweep"),
        "search": {"sampler": "tpe", "trials": trials, "seed": 0, "params": PARAMS, **search},
    }
    if pruner:
        spec["pruner"] = pruner
    path = tmp_path / "search.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def start_sweep(path):
    return start_cli("sweep", str(path), stderr=subprocess.STDOUT, start_new_session=True)


def index(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "sweep" / "sweep.jsonl").read_text().splitlines()]


def train_steps(workdir) -> list[int]:
    return [r["step"] for r in read_records(workdir / "metrics.jsonl") if r["split"] == "train"]


@pytest.mark.slow
def test_tpe_with_the_median_pruner_stops_bad_trials_early_and_reports_importances(tmp_path):
    proc = start_sweep(sweep_file(tmp_path, 5, {"kind": "median", "startup_trials": 2, "warmup_steps": 10}))
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    runs = {r["name"]: r for r in index(tmp_path)}
    assert sorted(runs) == [f"trial-{i:04d}" for i in range(5)]
    statuses = [r["status"] for r in runs.values()]
    assert statuses.count("pruned") >= 1 and statuses.count("finished") >= 2, statuses
    import optuna

    study = optuna.load_study(study_name="sweep", storage=f"sqlite:///{tmp_path / 'sweep' / 'study.db'}")
    judged = {f"trial-{t.number:04d}": max(t.intermediate_values) for t in study.trials}
    for name, run in runs.items():
        steps = train_steps(tmp_path / "sweep" / name)
        if run["status"] == "pruned":  # stopped at exactly the eval the pruner judged, never later
            assert steps and steps[-1] == judged[name], (name, steps, judged[name])
        else:
            assert steps[-1] == 40
    assert min(judged[name] for name, run in runs.items() if run["status"] == "pruned") < 40
    assert [t.state.name for t in study.trials].count("PRUNED") == statuses.count("pruned")
    importances = json.loads((tmp_path / "sweep" / "importances.json").read_text())
    assert set(importances) == set(PARAMS)
    assert (tmp_path / "sweep" / "slice.png").stat().st_size > 0
    assert "pruned" in (tmp_path / "sweep" / "report.md").read_text()


@pytest.mark.slow
def test_a_killed_search_resumes_its_study_and_two_processes_share_it(tmp_path):
    """Two sweep processes on one study: one is SIGKILLed during a trial (its trainer, in a
    session of its own, trains on); the other waits for that trainer and resumes the trial
    (the trainer finds it finished, or resumes it from its checkpoint) and finishes the
    study. Every trial is asked for once; the study ends with exactly `trials` trials."""
    path = sweep_file(tmp_path, 4)
    first, second = start_sweep(path), start_sweep(path)
    deadline = time.time() + 300
    while not any(train_steps(d) for d in (tmp_path / "sweep").glob("trial-*")):
        assert time.time() < deadline and first.poll() is None, "no trial started"
        time.sleep(0.2)
    first.kill()  # the sweep process alone
    out_first, _ = first.communicate()
    out_second, _ = second.communicate(timeout=600)
    third = start_sweep(path)  # finds the study done
    out_third, _ = third.communicate(timeout=600)
    assert second.returncode == 0 and third.returncode == 0, out_second + out_third
    started = [
        line.split()[1]
        for out in (out_first, out_second, out_third)
        for line in out.splitlines()
        if line.startswith("start ")
    ]
    assert len(started) == len(set(started)) == 4, started  # no trial asked for twice
    runs = {r["name"]: r["status"] for r in index(tmp_path)}
    assert sorted(runs) == [f"trial-{i:04d}" for i in range(4)] and set(runs.values()) == {"finished"}, runs
    assert "resume trial-" in out_second  # the killed process's trial, finished by the other
    for name in runs:
        assert train_steps(tmp_path / "sweep" / name)[-1] == 40


@pytest.mark.nocompile
@pytest.mark.parametrize(
    "search, extra, message",
    [
        ({"sampler": "cmaes"}, {}, "search.sampler='cmaes' is not one of tpe, random, grid"),
        ({"trials": 0}, {}, "search.trials=0 must be a whole number"),
        ({"sampler": "grid"}, {}, "search.sampler=grid needs choice lists; search.params.optimizer.learning_rate"),
        ({"params": {"optimizer.learning_rate": {"log_uniform": [0.1, 0.01]}}}, {}, "must be \\[low, high\\]"),
        ({}, {"pruner": {"kind": "median", "patience": 3}}, "pruner median takes startup_trials, warmup_steps"),
        ({}, {"grid": {"seed": [0, 1]}}, "a search replaces grid, zip and random"),
    ],
)
def test_malformed_search_fields_are_refused_by_name(tmp_path, search, extra, message):
    path = sweep_file(tmp_path, 3)
    spec = yaml.safe_load(path.read_text())
    spec["search"].update(search)
    spec.update(extra)
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(UsageError, match=message):
        load_sweep(path)


@pytest.mark.slow
def test_a_damaged_study_is_set_aside_and_rebuilt_from_the_trials_on_disk(tmp_path):
    """Before: study.db cut to 3 kB ended every re-run in a SQLAlchemy traceback (exit 1)."""
    import optuna

    first = start_sweep(sweep_file(tmp_path, 2))
    out, _ = first.communicate(timeout=600)
    assert first.returncode == 0, out
    before = {r["name"]: r["final"]["eval/loss"] for r in index(tmp_path)}
    study = tmp_path / "sweep" / "study.db"
    study.write_bytes(study.read_bytes()[:3000])
    again = start_sweep(sweep_file(tmp_path, 3))
    out, _ = again.communicate(timeout=600)
    assert again.returncode == 0, out
    assert "Traceback" not in out and "is damaged" in out and "rebuilt the study: 2 trials" in out
    assert (tmp_path / "sweep" / "study.db.damaged").stat().st_size == 3000  # kept, not deleted
    assert [line.split()[1] for line in out.splitlines() if line.startswith("start ")] == ["trial-0002"]
    rebuilt = optuna.load_study(study_name="sweep", storage=f"sqlite:///{study}")
    assert [t.state.name for t in rebuilt.trials] == ["COMPLETE"] * 3
    assert {f"trial-{t.number:04d}": t.value for t in rebuilt.trials[:2]} == before


@pytest.mark.nocompile
def test_choices_are_stored_natively_and_seeds_do_not_shift():
    """Optuna's own API reads a study's values as they are (a list choice, which optuna cannot
    store, as its JSON text), and seed 1's trials are not seed 0's shifted by one."""
    import optuna

    from engine.sweep.search import _suggest, trial_run, trial_seed

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    trial = study.ask()
    assert _suggest(trial, "train.global_batch_size", {"choice": [32, 64]}) in (32, 64)
    assert _suggest(trial, "model.activation", {"choice": ["relu", "gelu"]}) in ("relu", "gelu")
    assert _suggest(trial, "model.hidden_sizes", {"choice": [[16], [64, 64]]}) in ([16], [64, 64])
    stored = study.trials[0].params
    assert isinstance(stored["train.global_batch_size"], int) and stored["model.activation"] in ("relu", "gelu")
    assert stored["model.hidden_sizes"] in ("[16]", "[64, 64]")
    overrides = trial_run(trial).overrides
    assert overrides["model.hidden_sizes"] in ([16], [64, 64]) and isinstance(overrides["train.global_batch_size"], int)
    seeds = {(seed, n): trial_seed(seed, n) for seed in (0, 1) for n in range(5)}
    assert len(set(seeds.values())) == 10 and seeds[(1, 0)] != seeds[(0, 1)]


# --- plan --search: the candidates (engine/plan/layouts.py) ---


def plan_config(tmp_path, base, *overrides):
    """The config and the override list it was loaded from (a candidate's overrides go after them)."""
    listed = [*QUIET, "data.steps_per_transfer=1", "train.steps_per_call=1", *overrides]
    return load_config(ROOT / "configs" / base, listed, str(tmp_path / "run")), listed


def variants(found) -> dict[str, set]:
    return {
        "remat": {c.remat for c in found},
        "attention": {(c.attention, c.kernel) for c in found},
        "loss_chunk": {c.loss_chunk for c in found},
    }


@pytest.mark.nocompile
def test_search_candidates_vary_attention_remat_and_loss_chunk_only_where_the_family_has_them(tmp_path):
    from models.remat import RECOMPUTE

    v5e_4 = parse_target("v5e-4")
    llama, _ = plan_config(tmp_path, "mnist_mlp.yaml", *TINY_LLAMA, "data.seq_len=1024")
    found = layouts.candidates(llama, v5e_4)
    assert variants(found) == {
        "remat": set(RECOMPUTE),
        "attention": {("auto", "splash"), ("xla", "xla"), (None, "xla")},  # (None: under mesh.context > 1)
        "loss_chunk": {0, 512},  # auto, and the largest of 1024 and 512 below the sequence that divides it
    }
    assert all(c.attention is None for c in found if c.mesh["context"] > 1)
    assert {c.attention for c in found if c.mesh["context"] == 1} == {"auto", "xla"}
    untiled, _ = plan_config(tmp_path, "mnist_mlp.yaml", *TINY_LLAMA, "data.seq_len=96")  # splash tiles by 128
    assert variants(layouts.candidates(untiled, v5e_4))["attention"] == {(None, "xla")}
    gpt, _ = plan_config(tmp_path, "mnist_mlp.yaml", *TINY_GPT, "data.seq_len=2048")  # no splash in this family
    assert variants(layouts.candidates(gpt, v5e_4)) == {
        "remat": set(RECOMPUTE),
        "attention": {(None, "xla")},
        "loss_chunk": {0, 1024},
    }
    table, _ = plan_config(tmp_path, "penguins_wide_deep.yaml")  # no remat, attention or loss chunk
    found = layouts.candidates(table, v5e_4)
    assert found and variants(found) == {"remat": {None}, "attention": {(None, "-")}, "loss_chunk": {None}}
    assert not [o for c in found for o in c.overrides() if o.startswith("model.")]


@pytest.mark.nocompile
def test_a_search_candidates_overrides_load_as_the_config_it_plans(tmp_path):
    cfg, listed = plan_config(tmp_path, "mnist_mlp.yaml", *TINY_LLAMA, "data.seq_len=1024")
    found = layouts.candidates(cfg, parse_target("v5e-4"))
    picked = {}  # one candidate of each remat, attention, loss chunk, micro-batch count and context split
    for c in found:
        for value in (c.remat, c.attention, c.loss_chunk, c.accum, c.mesh["context"]):
            picked.setdefault((type(value), value), c)
    for candidate in {id(c): c for c in picked.values()}.values():
        expected = layouts.configured(cfg, candidate)
        loaded = load_config(ROOT / "configs" / "mnist_mlp.yaml", [*listed, *candidate.overrides()], str(tmp_path))
        assert loaded.model == expected.model and loaded.mesh == expected.mesh, candidate.overrides()
        assert loaded.train.grad_accum_steps == candidate.accum
        assert (loaded.model.remat, loaded.model.loss_chunk) == (candidate.remat, candidate.loss_chunk)
        assert loaded.model.attention == (candidate.attention or cfg.model.attention)


def twins(screened, key: str) -> list[tuple[int, ...]]:
    """Pairs of positions in `screened` whose candidates differ only in `key` (attention or loss_chunk)."""
    groups: dict[tuple, list[int]] = {}
    for i, c in enumerate(screened):
        rest = {"mesh": tuple(c.mesh.items()), "remat": c.remat, "accum": c.accum}
        rest |= {"attention": c.attention, "loss_chunk": c.loss_chunk}
        del rest[key]
        groups.setdefault(tuple(rest.values()), []).append(i)
    return [tuple(group) for group in groups.values() if len(group) == 2]


def test_the_screen_orders_splash_and_the_auto_loss_chunk_first_and_xla_without_remat_after_what_fits(tmp_path):
    """At seq 8192 on v5e chips (16 GiB), XLA attention's scores of 8 sequences per chip are
    ~17 GB: remat none with XLA attention and one micro-batch is estimated past the chip and
    ordered after every candidate estimated to fit; splash and the auto loss chunk go first.
    (Shapes only: no model is compiled; the data and state plans jit a few tiny CPU helpers.)"""
    pytest.importorskip("libtpu", reason="the TPU compiler (libtpu) describes the target's devices")
    cfg, _ = plan_config(
        tmp_path,
        "mnist_mlp.yaml",
        *TINY_LLAMA,
        "data.seq_len=8192",
        "data.num_examples=64",
        "train.global_batch_size=32",
    )
    found, screened = layouts.screen(cfg, parse_target("v5e-4"))
    assert screened and len(found) == len(screened)  # (every layout's state fits a chip)
    first = screened[0]
    assert (first.kernel, first.remat, first.loss_chunk, first.accum) == ("splash", "none", 0, 1)
    limit = layouts.ESTIMATE_MARGIN * 16 * 2**30
    fitting = [i for i, c in enumerate(screened) if c.state_bytes + c.activation_bytes <= limit]
    assert fitting == list(range(len(fitting))) and len(fitting) < len(screened)  # the estimated fits first
    kernels = [c.kernel for c in screened[: len(fitting)]]
    assert kernels.index("xla") > len(kernels) - 1 - kernels[::-1].index("splash")  # splash, then XLA
    for key in ("attention", "loss_chunk"):  # where both twins fit by the estimate: auto (splash), then the other
        pairs = [pair for pair in twins(screened, key) if max(pair) < len(fitting)]
        assert pairs and all(getattr(screened[a], key) in ("auto", 0) for a, _ in pairs), key
    slowest = [c for c in screened if (c.kernel, c.remat, c.accum) == ("xla", "none", 1) and c.mesh["context"] == 1]
    assert slowest and all(c.activation_bytes > 16 * 2**30 and screened.index(c) >= len(fitting) for c in slowest)
    assert max(c.activation_bytes for c in screened if c.kernel == "splash" and c.accum == 1) < 2**30


@pytest.mark.nocompile
def test_the_search_table_shows_each_candidates_attention_and_loss_chunk(tmp_path):
    from engine.plan.compiled import Planned

    cfg, _ = plan_config(tmp_path, "mnist_mlp.yaml", *TINY_LLAMA)
    target = parse_target("v5e-4")
    mesh = {"data": 4}
    rows = [
        layouts.Candidate(mesh, "dots", 1, "auto", 0, "splash"),
        layouts.Candidate(mesh, "full", 2, "xla", 1024, "xla"),
        layouts.Candidate(mesh, None, 1),
    ]
    for row in rows:
        row.planned = Planned(cfg=cfg, target=target, mesh=mesh, dcn={}, hbm=16 * 2**30)
    header, *lines = [re.split(r"\s{2,}", line.strip()) for line in layouts.render(rows, cfg).splitlines()]
    assert header[-3:] == ["attention", "loss chunk", "overrides"]
    assert [line[-3:-1] for line in lines] == [["splash", "auto"], ["xla", "1024"], ["-", "-"]]
    # (the config's own: mesh.data=-1, remat none, attention auto, loss chunk 0, one micro-batch)
    assert [line[-1] for line in lines] == [
        "mesh.data=4 model.remat=dots",
        "mesh.data=4 model.remat=full model.attention=xla model.loss_chunk=1024 train.grad_accum_steps=2",
        "mesh.data=4",
    ]
    assert rows[0].overrides() == [
        "mesh.data=4",
        "model.remat=dots",
        "model.attention=auto",
        "model.loss_chunk=0",
        "train.grad_accum_steps=1",
    ]  # (best: every one)


@pytest.mark.nocompile
def test_the_search_tables_overrides_turn_the_searched_config_into_each_candidate(tmp_path):
    """Only the overrides equal to the config's own values are left out of the table: with
    mesh.tensor=2 and remat full configured, a candidate's tensor=1 and remat none are shown."""
    from engine.plan.compiled import Planned

    cfg, listed = plan_config(tmp_path, "mnist_mlp.yaml", *TINY_LLAMA, "mesh.tensor=2", "model.remat=full")
    target = parse_target("v5e-4")
    picked = {}  # one candidate of each tensor split, remat, attention, loss chunk and micro-batch count
    for c in layouts.candidates(cfg, target):
        for key in (("tensor", c.mesh["tensor"]), c.remat, c.attention, ("chunk", c.loss_chunk), ("accum", c.accum)):
            picked.setdefault(key, c)
    rows = list({id(c): c for c in picked.values()}.values())
    for row in rows:
        row.planned = Planned(cfg=cfg, target=target, mesh=row.mesh, dcn={}, hbm=16 * 2**30)
    _, *lines = [re.split(r"\s{2,}", line.strip()) for line in layouts.render(rows, cfg).splitlines()]
    for row, line in zip(rows, lines, strict=True):
        shown = [] if line[-1] == "(as configured)" else line[-1].split()
        loaded = load_config(ROOT / "configs" / "mnist_mlp.yaml", [*listed, *shown], str(tmp_path))
        expected = layouts.configured(cfg, row)
        assert (loaded.model, loaded.mesh, loaded.train) == (expected.model, expected.mesh, expected.train), shown
    typed = [line[-1] for row, line in zip(rows, lines) if row.mesh["tensor"] == 1 and row.remat == "none"]
    assert typed and all({"mesh.tensor=1", "model.remat=none"} <= set(t.split()) for t in typed)
    assert not [line for line in lines if "model.remat=full" in line[-1] or "mesh.tensor=2" in line[-1]]
    assert layouts.Candidate({"tensor": 2}, "full", 1, "auto", 0).overrides(cfg) == []  # the config itself


@pytest.mark.nocompile
def test_the_activation_estimate_reads_a_decoders_widths_and_knows_every_remat_policy():
    from jax.sharding import PartitionSpec

    from engine.parallel.sharding import ParamLayout
    from engine.plan.footprint import Widths, saved_per_token
    from models.remat import RECOMPUTE

    def layout(logical, shape):
        return ParamLayout("p", shape, "float32", logical, PartitionSpec())

    stacked = [  # a scanned Llama stack of 3 layers: 8 query heads, 2 key/value heads of width 16, SwiGLU of 96
        layout(("vocab", "embed"), (1000, 128)),
        layout(("layers", "embed", "heads", "kv"), (3, 128, 8, 16)),
        layout(("layers", "embed", "kv_heads", "kv"), (3, 128, 2, 16)),
        layout(("layers", "embed", "kv_heads", "kv"), (3, 128, 2, 16)),
        layout(("layers", "heads", "kv", "embed"), (3, 8, 16, 128)),
        layout(("layers", "embed", "mlp"), (3, 128, 96)),
        layout(("layers", "embed", "mlp"), (3, 128, 96)),
        layout(("layers", "mlp", "embed"), (3, 96, 128)),
    ]
    assert Widths.of(stacked) == Widths(3, 128, 8, 128, 128 + 2 * 32, 2 * 96, 1000)
    unstacked = [layout(p.logical[1:], p.shape[1:]) for p in stacked[1:] for _ in range(3)]  # layer_0, layer_1, ...
    assert Widths.of([stacked[0], *unstacked]) == Widths.of(stacked)
    assert Widths.of([stacked[0], layout(("embed", "mlp"), (128, 96))]) is None  # no attention: no estimate
    saved = saved_per_token(128, 192, 128, 192)
    assert set(saved) == set(RECOMPUTE) and max(saved, key=saved.__getitem__) == "none" and saved["offload"] == 0
    assert saved["full"] < saved["save_out_proj"] < saved["save_qkv_proj"] < saved["minimal"] < saved["dots"]
