"""ResNet-18/34/50 with batch norm. Batch statistics live in the `batch_stats` collection,
which the engine carries beside the parameters (updated in training, read in eval)."""

from __future__ import annotations

from functools import partial
from typing import Optional

import flax.linen as nn
import jax.numpy as jnp

from models.cnn import conv
from models.configs import STAGES, ResNetConfig
from models.family import NO_OPTIONS, BuildOptions, Classification, Family
from models.layers import dense, param_init


class Block(nn.Module):
    width: int
    strides: int
    bottleneck: bool
    norm: partial
    conv: partial

    @nn.compact
    def __call__(self, x, train: bool):
        out_width = self.width * 4 if self.bottleneck else self.width
        residual = x
        if self.bottleneck:
            y = nn.relu(self.norm()(self.conv(self.width, 1)(x), use_running_average=not train))
            y = nn.relu(self.norm()(self.conv(self.width, 3, strides=self.strides)(y), use_running_average=not train))
            y = self.norm(scale_init=param_init(nn.initializers.zeros_init(), ("conv_out",)))(
                self.conv(out_width, 1)(y), use_running_average=not train
            )
        else:
            y = nn.relu(self.norm()(self.conv(self.width, 3, strides=self.strides)(x), use_running_average=not train))
            y = self.norm(scale_init=param_init(nn.initializers.zeros_init(), ("conv_out",)))(
                self.conv(self.width, 3)(y), use_running_average=not train
            )
        if residual.shape != y.shape:
            residual = self.norm()(
                self.conv(out_width, 1, strides=self.strides)(residual), use_running_average=not train
            )
        return nn.relu(residual + y)


class ResNet(nn.Module):
    depth: int
    width: int
    num_classes: int
    cifar_stem: bool
    bn_momentum: float = 0.9
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    batch_axis_name: Optional[str] = None  # pmap axis over which batch statistics are averaged

    @nn.compact
    def __call__(self, x, *, train: bool, example_ids=None):  # no dropout layers
        kind, stages = STAGES[self.depth]
        norm = partial(
            nn.BatchNorm,
            momentum=self.bn_momentum,
            epsilon=1e-5,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            axis_name=self.batch_axis_name if train else None,
            scale_init=param_init(nn.initializers.ones_init(), ("conv_out",)),
            bias_init=param_init(nn.initializers.zeros_init(), ("conv_out",)),
        )
        conv_layer = partial(conv, dtype=self.dtype, param_dtype=self.param_dtype, use_bias=False)
        x = x.astype(self.dtype)  # [batch, height, width, channels]
        if self.cifar_stem:
            x = conv_layer(self.width, 3, name="stem")(x)
        else:
            x = conv_layer(self.width, 7, strides=2, name="stem")(x)
        x = nn.relu(norm(name="stem_norm")(x, use_running_average=not train))
        if not self.cifar_stem:
            x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for stage, blocks in enumerate(stages):
            for block in range(blocks):
                strides = 2 if stage > 0 and block == 0 else 1
                x = Block(
                    self.width * 2**stage,
                    strides,
                    kind == "bottleneck",
                    norm,
                    conv_layer,
                    name=f"stage{stage}_block{block}",
                )(x, train)
        x = jnp.mean(x, axis=(1, 2))  # global average pool: [batch, channels]
        return dense(self.num_classes, ("embed", "classes"), self.dtype, self.param_dtype, name="logits")(x)


def build(cfg: ResNetConfig, info, dtype, param_dtype, options: BuildOptions = NO_OPTIONS) -> nn.Module:
    cifar_stem = cfg.stem == "cifar" or (cfg.stem == "auto" and info.input_shape[0] <= 64)
    return ResNet(
        cfg.depth, cfg.width, info.num_classes, cifar_stem, cfg.bn_momentum, dtype, param_dtype, options.batch_axis
    )


class ResNetFamily(Family):
    config_cls = ResNetConfig
    task = Classification()
    build = staticmethod(build)

    def loops_fast_on_cpu(self) -> bool:  # XLA:CPU runs its convolutions several times slower in a loop
        return False


FAMILY = ResNetFamily()
