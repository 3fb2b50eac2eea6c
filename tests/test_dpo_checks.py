"""DPO's checks and its pmap step: checkpoint.keep_best and train.early_stop.metric take the DPO
eval record's names (TRL's) at the start of a run, a full fine-tuning DPO run refuses to restore
an SFT state whole (checkpoint.restore_mode=all), and under mesh.backend=pmap the step averages
only the trained collections over the replicas (not DPO's reference)."""

import re

import jax
import numpy as np
from test_dpo import hand_batch, nbytes, setup
from test_dpo_reference import cli_args
from test_early_stop import meta, saved_steps

from conftest import run_cli
from engine.objectives.dpo_part import make_dpo_loss_fn
from engine.run.step import make_train_step
from engine.runtime.rundir import read_records
from engine.state.train_state import REFERENCE

TYPE = re.compile(r"tensor<((?:\d+x)*)(f32|i32|bf16)>")


def all_reduced_bytes(hlo: str) -> int:
    """The bytes of the results of every all-reduce in a lowered program's StableHLO text (each
    op's region ends in a line `}) : (operand types) -> result types`)."""
    total, inside = 0, False
    for line in hlo.splitlines():
        inside = inside or '"stablehlo.all_reduce"' in line
        if inside and line.strip().startswith("}) :"):
            for dims, dtype in TYPE.findall(line.split("->")[-1]):
                size = int(np.prod([int(d) for d in dims.split("x") if d]))
                total += size * (2 if dtype == "bf16" else 4)
            inside = False
    return total


def test_pmap_step_all_reduces_the_gradients_not_the_reference(make_config):
    cfg, family, module, state, tx, _ = setup(make_config)
    assert REFERENCE in state.model_state
    batch = hand_batch()[0]
    step = make_train_step(make_dpo_loss_fn(module, family.task, cfg.dpo), tx, cfg.optimizer.schedule, axis_name="d")
    two = jax.tree.map(lambda x: jax.ShapeDtypeStruct((2, *x.shape), x.dtype), (state, batch))
    hlo = jax.pmap(step, axis_name="d", devices=jax.devices()[:2]).lower(*two).as_text()
    params = nbytes(state.params)
    reduced = all_reduced_bytes(hlo)
    assert params <= reduced < params + 4096, (reduced, params)  # the gradients and the metrics, once


def test_keep_best_takes_the_dpo_names_and_refuses_the_lm_ones(tmp_path):
    """keep_best=eval/rewards/accuracies keeps its best checkpoint beside the newest; eval/accuracy
    (an lm run's name, never in a DPO eval record) is refused before the run trains (exit 2)."""
    workdir = tmp_path / "best"
    keys = ["train.steps=6", "checkpoint.keep=1", "checkpoint.keep_best=eval/rewards/accuracies"]
    proc = run_cli(*cli_args(tmp_path, workdir, *keys, "checkpoint.best_mode=max"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [
        (r["step"], r["rewards/accuracies"]) for r in read_records(workdir / "metrics.jsonl") if r["split"] == "eval"
    ]
    assert [step for step, _ in evals] == [2, 4, 6]
    best = max(evals, key=lambda e: (e[1], -e[0]))[0]  # the first step at the highest accuracy
    assert meta(workdir, 6)["keep_best"]["step"] == best and saved_steps(workdir) == sorted({best, 6})
    refused = tmp_path / "refused"
    proc = run_cli(*cli_args(tmp_path, refused, "train.steps=2", "checkpoint.keep_best=eval/accuracy"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "checkpoint.keep_best=eval/accuracy is not an eval metric of this run" in proc.stderr
    assert "eval/rewards/accuracies" in proc.stderr and not (refused / "metrics.jsonl").exists()


def test_full_fine_tuning_dpo_refuses_an_sft_state_whole(tmp_path):
    """checkpoint.restore_mode=all from an lm run's workdir: no reference in it → exit 2 naming
    checkpoint.restore_mode=params, which starts DPO from its parameters."""
    lm = [a for a in cli_args(tmp_path, tmp_path / "sft", "train.steps=2") if not a.startswith("data.")]
    lm = [a for a in lm if a != "train.objective=dpo"]
    proc = run_cli(*lm, "data.name=synthetic_text", "data.vocab_size=300", "data.seq_len=24")
    assert proc.returncode == 0, proc.stderr[-3000:]
    source = f"checkpoint.restore_from={tmp_path / 'sft' / 'checkpoints'}"
    proc = run_cli(*cli_args(tmp_path, tmp_path / "dpo", "train.steps=2", source, "checkpoint.restore_mode=all"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "holds no DPO reference model" in proc.stderr and "checkpoint.restore_mode=params" in proc.stderr
    proc = run_cli(*cli_args(tmp_path, tmp_path / "dpo", "train.steps=2", source, "checkpoint.restore_mode=params"))
    assert proc.returncode == 0 and "starting from the parameters in" in proc.stdout, proc.stderr[-3000:]
