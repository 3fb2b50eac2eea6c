"""Model-based search with pruning (engine/sweep/search.py) on the digits MLP: an Optuna study
in the sweep directory's SQLite database, pruned trials stopped early, a killed sweep
resuming its study, two sweep processes sharing one study without running a trial twice.
And `launch.py plan --search`'s candidates (engine/plan/layouts.py): the attention, remat and
loss-chunk variants a family supports, their overrides, and the order they are compiled in."""

import re

import pytest
import yaml
from support.configs import ROOT, TINY_GPT, TINY_LLAMA
from support.search import plan_config, sweep_file

from engine.config import load_config
from engine.errors import UsageError
from engine.plan import layouts
from engine.plan.tpu import parse_target
from engine.sweep import load_sweep


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
