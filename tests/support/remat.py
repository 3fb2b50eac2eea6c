"""Helpers of tests/**/test_remat*.py that other test files (or its other tiers) share."""

import jax
import jax.numpy as jnp
import numpy as np

from contract.activations import ONE_STAGE, StagePlan
from engine.data import DataInfo
from engine.parallel.sharding import unbox
from models import REGISTRY
from models.family import BuildOptions

INFO = DataInfo("tokens", 8, 8, vocab_size=32, seq_len=8)


BATCH, SEQ, WIDTH, LAYERS = 2, 8, 16, 2


LLAMA = {"num_layers": LAYERS, "d_model": WIDTH, "num_heads": 4, "num_kv_heads": 2, "mlp_dim": 24}


MODELS = {
    "llama-scanned": ("llama", LLAMA),
    "llama-unscanned": ("llama", {**LLAMA, "scan_layers": False}),
    "gpt": (
        "transformer",
        {"num_layers": LAYERS, "d_model": WIDTH, "num_heads": 2, "mlp_dim": 32, "dropout_rate": 0.0},
    ),
}


TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, INFO.vocab_size, (BATCH, SEQ + 1)), jnp.int32)


def loss_of(model: str, remat: str, stages: StagePlan = ONE_STAGE):
    """(the mean next-token loss as a function of the parameters, abstract parameters)."""
    name, overrides = MODELS[model]
    family = REGISTRY[name]
    module = family.build(family.config_cls(**overrides, remat=remat), INFO, jnp.float32, jnp.float32)
    params = jax.eval_shape(lambda: unbox(module.init({"params": jax.random.key(0)}, TOKENS[:, :-1], train=False)))
    if stages.stages > 1:  # the same parameters, run as a pipeline
        options = BuildOptions(stages=stages)
        module = family.build(family.config_cls(**overrides, remat=remat), INFO, jnp.float32, jnp.float32, options)

    def loss(p):
        losses, _ = module.apply({"params": p}, TOKENS[:, :-1], train=True, targets=TOKENS[:, 1:])
        return losses.mean()

    return loss, params["params"]
