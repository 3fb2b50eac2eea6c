"""Helpers of tests/**/test_finetune*.py that other test files (or its other tiers) share."""

import jax.numpy as jnp
import numpy as np

from engine.state.train_state import model_variables

DATA = [
    "data.name=synthetic_text",
    "data.vocab_size=256",
    "data.seq_len=12",
    "data.num_examples=64",
    "train.global_batch_size=8",
    "log.progress=false",
    "log.tensorboard=false",
    "train.steps_per_call=1",
]


LORA = ["finetune.lora.rank=4", "finetune.lora.alpha=8", "finetune.lora.targets=[all]", "optimizer.learning_rate=0.02"]


TOKENS = np.random.default_rng(4).integers(0, 256, (2, 12))


def logits(run, state):
    variables = model_variables(state.params, state.model_state)
    return np.asarray(run.model.module.apply(variables, jnp.asarray(TOKENS, jnp.int32), train=False))
