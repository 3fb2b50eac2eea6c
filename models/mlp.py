"""The MNIST-style MLP of the TensorFlow tutorials: Flatten → Dense 128 relu → Dropout → Dense."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from models.configs import MLPConfig
from models.family import NO_OPTIONS, BuildOptions, Classification, Family
from models.layers import Dropout, dense


class MLP(nn.Module):
    hidden_sizes: tuple[int, ...]
    num_classes: int
    dropout_rate: float = 0.0
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, *, train: bool, example_ids=None, dropout_rate=None):
        x = x.reshape(x.shape[0], -1).astype(self.dtype)  # [batch, features]
        in_axis = "embed"
        for i, width in enumerate(self.hidden_sizes):
            x = dense(width, (in_axis, "mlp"), self.dtype, self.param_dtype, name=f"hidden_{i}")(x)
            x = nn.relu(x)
            x = Dropout(self.dropout_rate)(x, train=train, example_ids=example_ids, rate=dropout_rate)
            in_axis = "mlp"
        return dense(self.num_classes, (in_axis, "classes"), self.dtype, self.param_dtype, name="logits")(x)


def build(cfg: MLPConfig, info, dtype, param_dtype, options: BuildOptions = NO_OPTIONS) -> nn.Module:
    return MLP(tuple(cfg.hidden_sizes), info.num_classes, cfg.dropout_rate, dtype, param_dtype)


class MLPFamily(Family):
    config_cls = MLPConfig
    task = Classification()
    build = staticmethod(build)


FAMILY = MLPFamily()
