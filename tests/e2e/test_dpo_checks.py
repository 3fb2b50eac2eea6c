"""DPO's checks and its pmap step: checkpoint.keep_best and train.early_stop.metric take the DPO
eval record's names (TRL's) at the start of a run, a full fine-tuning DPO run refuses to restore
an SFT state whole (checkpoint.restore_mode=all), and under mesh.backend=pmap the step averages
only the trained collections over the replicas (not DPO's reference)."""

from support.cli import child_env
from support.dpo_reference import cli_args
from support.early_stop import meta, saved_steps
from support.one_process import run_steps

from engine.runtime.rundir import read_records


def _ok(result):
    assert result["code"] == 0 and not result["escaped"], result["escaped"] or result["stderr"][-3000:]
    return result


def test_keep_best_takes_the_dpo_names_and_refuses_the_lm_ones(tmp_path):
    """keep_best=eval/rewards/accuracies keeps its best checkpoint beside the newest; eval/accuracy
    (an lm run's name, never in a DPO eval record) is refused before the run trains (exit 2).
    (Both command lines through the CLI's main in one process: tests/support/one_process.py.)"""
    workdir, refused = tmp_path / "best", tmp_path / "refused"
    keys = ["train.steps=6", "checkpoint.keep=1", "checkpoint.keep_best=eval/rewards/accuracies"]
    trained, proc = run_steps(
        tmp_path,
        [
            {"argv": cli_args(tmp_path, workdir, *keys, "checkpoint.best_mode=max")},
            {"argv": cli_args(tmp_path, refused, "train.steps=2", "checkpoint.keep_best=eval/accuracy")},
        ],
        env=child_env({"HOME": str(tmp_path)}),
    )
    _ok(trained)
    evals = [
        (r["step"], r["rewards/accuracies"]) for r in read_records(workdir / "metrics.jsonl") if r["split"] == "eval"
    ]
    assert [step for step, _ in evals] == [2, 4, 6]
    best = max(evals, key=lambda e: (e[1], -e[0]))[0]  # the first step at the highest accuracy
    assert meta(workdir, 6)["keep_best"]["step"] == best and saved_steps(workdir) == sorted({best, 6})
    assert proc["code"] == 2 and not proc["escaped"], proc["escaped"] or proc["stderr"][-3000:]
    assert "checkpoint.keep_best=eval/accuracy is not an eval metric of this run" in proc["stderr"]
    assert "eval/rewards/accuracies" in proc["stderr"] and not (refused / "metrics.jsonl").exists()


def test_full_fine_tuning_dpo_refuses_an_sft_state_whole(tmp_path):
    """checkpoint.restore_mode=all from an lm run's workdir: no reference in it → exit 2 naming
    checkpoint.restore_mode=params, which starts DPO from its parameters. (The three command lines
    through the CLI's main in one process: tests/support/one_process.py.)"""
    lm = [a for a in cli_args(tmp_path, tmp_path / "sft", "train.steps=2") if not a.startswith("data.")]
    lm = [a for a in lm if a != "train.objective=dpo"]
    source = f"checkpoint.restore_from={tmp_path / 'sft' / 'checkpoints'}"
    sft, refused, started = run_steps(
        tmp_path,
        [
            {"argv": [*lm, "data.name=synthetic_text", "data.vocab_size=300", "data.seq_len=24"]},
            {"argv": cli_args(tmp_path, tmp_path / "dpo", "train.steps=2", source, "checkpoint.restore_mode=all")},
            {"argv": cli_args(tmp_path, tmp_path / "dpo", "train.steps=2", source, "checkpoint.restore_mode=params")},
        ],
        env=child_env({"HOME": str(tmp_path)}),
    )
    _ok(sft)
    assert refused["code"] == 2 and not refused["escaped"], refused["escaped"] or refused["stderr"][-3000:]
    assert "Traceback" not in refused["stderr"]
    assert "holds no DPO reference model" in refused["stderr"] and "checkpoint.restore_mode=params" in refused["stderr"]
    assert "starting from the parameters in" in _ok(started)["stdout"]
