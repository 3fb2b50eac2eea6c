"""DPO's checks and its pmap step: checkpoint.keep_best and train.early_stop.metric take the DPO
eval record's names (TRL's) at the start of a run, a full fine-tuning DPO run refuses to restore
an SFT state whole (checkpoint.restore_mode=all), and under mesh.backend=pmap the step averages
only the trained collections over the replicas (not DPO's reference)."""

import re

import jax
import numpy as np
from support.dpo import hand_batch, nbytes, setup

from engine.objectives.dpo_part import make_dpo_loss_fn
from engine.run.step import make_train_step
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
