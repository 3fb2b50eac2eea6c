"""A small CIFAR-10 style conv net: two conv/pool stages, then Dense → Dropout → Dense."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from models.configs import CNNConfig
from models.family import NO_OPTIONS, BuildOptions, Classification, Family
from models.layers import Dropout, dense, param_init


def conv(features: int, kernel: int, dtype, param_dtype, strides: int = 1, name=None, use_bias=True):
    """nn.Conv with logical names on kernel [h, w, in, out]."""
    return nn.Conv(
        features,
        (kernel, kernel),
        strides=(strides, strides),
        padding="SAME",
        use_bias=use_bias,
        dtype=dtype,
        param_dtype=param_dtype,
        name=name,
        kernel_init=param_init(nn.initializers.he_normal(), (None, None, "conv_in", "conv_out")),
        bias_init=param_init(nn.initializers.zeros_init(), ("conv_out",)),
    )


class CNN(nn.Module):
    channels: tuple[int, ...]
    dense_size: int
    num_classes: int
    dropout_rate: float = 0.0
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, *, train: bool, example_ids=None, dropout_rate=None):
        x = x.astype(self.dtype)  # [batch, height, width, channels]
        for i, width in enumerate(self.channels):
            x = nn.relu(conv(width, 3, self.dtype, self.param_dtype, name=f"conv_{i}")(x))
            x = nn.max_pool(x, (2, 2), strides=(2, 2), padding="SAME")
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(dense(self.dense_size, ("embed", "mlp"), self.dtype, self.param_dtype, name="hidden")(x))
        x = Dropout(self.dropout_rate)(x, train=train, example_ids=example_ids, rate=dropout_rate)
        return dense(self.num_classes, ("mlp", "classes"), self.dtype, self.param_dtype, name="logits")(x)


def build(cfg: CNNConfig, info, dtype, param_dtype, options: BuildOptions = NO_OPTIONS) -> nn.Module:
    return CNN(tuple(cfg.channels), cfg.dense_size, info.num_classes, cfg.dropout_rate, dtype, param_dtype)


class CNNFamily(Family):
    config_cls = CNNConfig
    task = Classification()
    build = staticmethod(build)

    def loops_fast_on_cpu(self) -> bool:  # XLA:CPU runs its convolutions several times slower in a loop
        return False


FAMILY = CNNFamily()
