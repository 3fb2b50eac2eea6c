"""Config sweeps: expansion, validation, running (sequential, parallel, resumed), the report."""

import json
import re

import pytest
from support.sweep import write_sweep

from engine.errors import UsageError
from engine.sweep import load_sweep


@pytest.mark.nocompile
def test_grid_zip_and_random_expansion(tmp_path):
    sweep = load_sweep(
        write_sweep(
            tmp_path / "s.yaml",
            grid={"optimizer.learning_rate": [0.001, 0.01], "model.hidden_sizes": [[32], [64, 32]]},
            zip={"optimizer.warmup_steps": [0, 5], "optimizer.schedule": ["constant", "warmup_cosine"]},
        )
    )
    assert len(sweep.runs) == 8
    assert sweep.runs[0].name == "learning_rate=0.001,hidden_sizes=32,warmup_steps=0,schedule=constant"
    assert sweep.runs[2].name == "learning_rate=0.001,hidden_sizes=64-32,warmup_steps=0,schedule=constant"
    assert all(re.fullmatch(r"[A-Za-z0-9._+=,-]+", run.name) for run in sweep.runs)  # no quoting needed
    assert len({r.name for r in sweep.runs}) == 8
    spec = {
        "random": {
            "samples": 5,
            "seed": 7,
            "params": {
                "optimizer.learning_rate": {"log_uniform": [1e-4, 1e-2]},
                "model.dropout_rate": {"uniform": [0.0, 0.5]},
                "train.global_batch_size": {"choice": [16, 32]},
            },
        }
    }
    first = load_sweep(write_sweep(tmp_path / "r.yaml", **spec))
    second = load_sweep(write_sweep(tmp_path / "r2.yaml", **spec))
    assert [r.overrides for r in first.runs] == [r.overrides for r in second.runs]  # same seed, same configs
    assert all(1e-4 <= r.overrides["optimizer.learning_rate"] <= 1e-2 for r in first.runs)
    assert len({r.overrides["optimizer.learning_rate"] for r in first.runs}) == 5
    other = load_sweep(write_sweep(tmp_path / "r3.yaml", random={**spec["random"], "seed": 8}))
    assert [r.overrides for r in other.runs] != [r.overrides for r in first.runs]


@pytest.mark.nocompile
def test_malformed_sweep_files_are_refused(tmp_path):
    with pytest.raises(UsageError, match="zip lists must have equal lengths"):
        load_sweep(write_sweep(tmp_path / "a.yaml", zip={"a.b": [1, 2], "c.d": [1]}))
    with pytest.raises(UsageError, match=r"unknown key\(s\) \['gird'\]"):
        load_sweep(write_sweep(tmp_path / "b.yaml", gird={"a.b": [1]}))
    with pytest.raises(UsageError, match="log_uniform"):
        load_sweep(write_sweep(tmp_path / "c.yaml", random={"samples": 2, "params": {"x.y": {"normal": [0, 1]}}}))


@pytest.mark.nocompile
def test_the_plot_grows_to_hold_a_large_sweeps_legend(tmp_path):
    """64 runs (vectorize's largest group): every name in the legend, under the panels."""
    from matplotlib.image import imread

    from engine.observe.ranking import _plot

    def curves(count):
        return [
            (
                f"learning_rate={i},weight_decay=0.1",
                {"train": ([100, 200], [2.0, 1.0 + i / 64]), "eval": ([200], [0.5]), "eval/accuracy": ([200], [0.9])},
            )
            for i in range(count)
        ]

    for count in (1, 64):
        _plot(curves(count), tmp_path / f"{count}.png", "eval/accuracy", "learning_rate=0,weight_decay=0.1")
    small, large = imread(tmp_path / "1.png"), imread(tmp_path / "64.png")
    assert (
        small.shape[1] == large.shape[1] and large.shape[0] > small.shape[0] + 21 * 0.17 * 110 * 0.9
    )  # 21 more rows of names


@pytest.mark.nocompile
def test_long_run_names_are_cut_and_stay_distinct(tmp_path):
    values = ["x" * 300 + str(i) for i in range(2)]
    sweep = load_sweep(write_sweep(tmp_path / "long.yaml", grid={"data.path": values}))
    names = [run.name for run in sweep.runs]
    assert len(set(names)) == 2 and all(len(name.encode()) <= 200 for name in names)


@pytest.mark.nocompile
def test_a_failed_runs_reason_is_said_and_a_report_of_no_metrics_says_so(tmp_path):
    from engine.observe.ranking import report
    from engine.sweep.local import _ended_line

    failed = {"status": "failed", "error": "error: run 'a': finetune.base is not vectorised"}
    assert _ended_line("a", failed) == "     failed a: error: run 'a': finetune.base is not vectorised"
    assert _ended_line("b", {"status": "finished"}) == "   finished b"
    (tmp_path / "sweep.json").write_text(json.dumps({"metric": "eval/loss", "mode": "min", "runs": ["a"]}))
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "status.json").write_text(json.dumps(failed))
    with pytest.raises(UsageError, match=r"no run has logged a metric yet .*sweep.jsonl"):
        report([tmp_path])


@pytest.mark.nocompile
def test_a_metric_whose_name_holds_a_slash_is_taken_as_report_takes_it(tmp_path):
    sweep = load_sweep(write_sweep(tmp_path / "m.yaml", metric="eval/rewards/accuracies", mode="max"))
    assert sweep.metric == "eval/rewards/accuracies"
    for bad in ("accuracy", "eval/", "/accuracy"):
        with pytest.raises(UsageError, match="must be split/name"):
            load_sweep(write_sweep(tmp_path / "bad.yaml", metric=bad))
