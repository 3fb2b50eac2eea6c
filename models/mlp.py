"""The MNIST-style MLP of the TensorFlow tutorials: Flatten → Dense 128 relu → Dropout → Dense."""
from __future__ import annotations

from dataclasses import dataclass, field

import flax.linen as nn
import jax.numpy as jnp

from models.family import Classification, ModelError, ModelFamily
from models.layers import Dropout, dense


@dataclass
class MLPConfig:
    name: str = "mlp"
    hidden_sizes: list[int] = field(default_factory=lambda: [128])  # width of each hidden layer
    dropout_rate: float = 0.2  # dropout after each hidden layer

    def validate(self):
        if not self.hidden_sizes or min(self.hidden_sizes) <= 0:
            raise ModelError(f"model.hidden_sizes={self.hidden_sizes} must be a non-empty list of positive widths")
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ModelError(f"model.dropout_rate={self.dropout_rate} must be in [0, 1)")


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


def build(cfg: MLPConfig, info, dtype, param_dtype, batch_axis_name=None) -> nn.Module:
    return MLP(tuple(cfg.hidden_sizes), info.num_classes, cfg.dropout_rate, dtype, param_dtype)


FAMILY = ModelFamily(MLPConfig, build, Classification(), hparams=("dropout_rate",))
