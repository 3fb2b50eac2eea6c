"""The `model.*` config of every family: one dataclass each, with `validate()`.

This module imports neither jax nor flax, so the config can be read and checked (by a sweep's
process, which only plans and watches runs) without loading them; the families' modules
(`models/mlp.py`, …) hold the flax modules and their `ModelFamily` declarations.

A config dataclass's first field is `name`; every field has a default and a short comment.
`hparams` (a ClassVar) names the shape-independent fields the compiled step takes as float32
inputs and passes to the module call by name, so runs that differ only in them share one
compiled program.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar


class ModelError(ValueError):
    """A model setting is wrong; the message names the `model.` key and the fix."""


REMAT_NAMES = ("none", "full", "dots")  # models.transformer.REMAT_POLICIES maps them to jax policies


@dataclass
class MLPConfig:
    hparams: ClassVar[tuple[str, ...]] = ("dropout_rate",)
    name: str = "mlp"
    hidden_sizes: list[int] = field(default_factory=lambda: [128])  # width of each hidden layer
    dropout_rate: float = 0.2  # dropout after each hidden layer

    def validate(self):
        if not self.hidden_sizes or min(self.hidden_sizes) <= 0:
            raise ModelError(f"model.hidden_sizes={self.hidden_sizes} must be a non-empty list of positive widths")
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ModelError(f"model.dropout_rate={self.dropout_rate} must be in [0, 1)")


@dataclass
class CNNConfig:
    hparams: ClassVar[tuple[str, ...]] = ("dropout_rate",)
    name: str = "cnn"
    channels: list[int] = field(default_factory=lambda: [32, 64])  # conv widths, one 2x2 pool after each
    dense_size: int = 128  # width of the hidden dense layer
    dropout_rate: float = 0.0

    def validate(self):
        if not self.channels or min(self.channels) <= 0 or self.dense_size <= 0:
            raise ModelError(f"model.channels={self.channels} and model.dense_size must be positive")
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ModelError(f"model.dropout_rate={self.dropout_rate} must be in [0, 1)")


STAGES = {18: ("basic", (2, 2, 2, 2)), 34: ("basic", (3, 4, 6, 3)), 50: ("bottleneck", (3, 4, 6, 3))}


@dataclass
class ResNetConfig:
    hparams: ClassVar[tuple[str, ...]] = ()
    name: str = "resnet"
    depth: int = 18  # 18 | 34 | 50
    width: int = 64  # channels of the first stage (doubles each stage)
    stem: str = "auto"  # cifar (3x3 conv, no pool) | imagenet (7x7/2 conv + pool) | auto (by image size)
    bn_momentum: float = 0.9  # decay of the running batch statistics

    def validate(self):
        if self.depth not in STAGES:
            raise ModelError(f"model.depth={self.depth} is not one of {', '.join(map(str, STAGES))}")
        if self.stem not in ("auto", "cifar", "imagenet"):
            raise ModelError(f"model.stem={self.stem!r} is not one of auto, cifar, imagenet")
        if self.width <= 0:
            raise ModelError(f"model.width={self.width} must be positive")


def validate_work_settings(cfg) -> None:
    """model.attention, remat and loss_chunk, as the decoder families share them."""
    if cfg.attention not in ("auto", "xla", "cudnn"):
        raise ModelError(f"model.attention={cfg.attention!r} is not one of auto, xla, cudnn")
    if cfg.remat not in REMAT_NAMES:
        raise ModelError(f"model.remat={cfg.remat!r} is not one of {', '.join(REMAT_NAMES)}")
    if cfg.loss_chunk < 0:
        raise ModelError(f"model.loss_chunk={cfg.loss_chunk} must be 0 (whole sequence) or positive")


@dataclass
class TransformerConfig:
    hparams: ClassVar[tuple[str, ...]] = ("dropout_rate",)
    name: str = "transformer"
    num_layers: int = 4
    d_model: int = 256  # width of the residual stream
    num_heads: int = 4
    mlp_dim: int = 1024  # hidden width of each block's MLP
    dropout_rate: float = 0.1
    remat: str = "none"  # none | full | dots: activation rematerialisation per block
    attention: str = "auto"  # auto (cuDNN flash attention on GPU in bf16/fp16, else XLA) | xla | cudnn
    loss_chunk: int = 0  # >0: the loss makes float32 logits for this many positions at a time (divides seq_len)

    def validate(self):
        if min(self.num_layers, self.d_model, self.num_heads, self.mlp_dim) <= 0:
            raise ModelError("model.num_layers, d_model, num_heads and mlp_dim must be positive")
        if self.d_model % self.num_heads:
            raise ModelError(f"model.d_model={self.d_model} is not divisible by model.num_heads={self.num_heads}")
        validate_work_settings(self)
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ModelError(f"model.dropout_rate={self.dropout_rate} must be in [0, 1)")


@dataclass
class LlamaConfig:
    hparams: ClassVar[tuple[str, ...]] = ()
    name: str = "llama"
    num_layers: int = 4
    d_model: int = 256  # width of the residual stream (hidden_size)
    num_heads: int = 4  # query heads
    num_kv_heads: int = 0  # key/value heads (grouped-query attention; 0 = num_heads); divides num_heads
    head_dim: int = 0  # width of one head (0 = d_model / num_heads)
    mlp_dim: int = 688  # hidden width of the SwiGLU MLP (intermediate_size)
    vocab_size: int = 0  # output classes (0 = the data's vocabulary); >= every token id
    rope_theta: float = 500000.0  # base of the rotary frequencies
    rope_scaling_factor: float = 0.0  # Llama-3 long-context scaling of the frequencies (0 = off; 8 for 3.1)
    rope_low_freq_factor: float = 1.0  # Llama-3 scaling: wavelengths above original_len / this are divided
    rope_high_freq_factor: float = 4.0  # Llama-3 scaling: wavelengths below original_len / this are kept
    rope_original_max_len: int = 8192  # Llama-3 scaling: the context length the model was trained at
    norm_eps: float = 1e-5  # RMSNorm epsilon
    tie_embeddings: bool = False  # the output projection is the input embedding, transposed
    qk_norm: bool = False  # RMSNorm of each query and key head before RoPE (Qwen3, OLMo-2)
    scan_layers: bool = True  # layers under nn.scan: one compiled layer, parameters stacked on `layers`
    remat: str = "none"  # none | full | dots: activation rematerialisation per layer
    attention: str = "auto"  # auto (cuDNN flash attention on GPU in bf16/fp16, else XLA) | xla | cudnn
    loss_chunk: int = 0  # >0: the loss makes float32 logits for this many positions at a time (divides seq_len)
    # mixture of experts (0 experts = a dense SwiGLU MLP in every layer)
    num_experts: int = 0  # routed experts per MoE layer
    experts_per_token: int = 2  # top-k: experts each token is sent to
    moe_interval: int = 1  # every k-th layer is MoE (layers k-1, 2k-1, ...); > 1 needs scan_layers=false
    moe_mlp_dim: int = 0  # hidden width of each expert (0 = mlp_dim)
    router: str = "softmax"  # softmax (Mixtral, Qwen-MoE) | sigmoid (DeepSeek-V3): the gate of each expert
    shared_expert: bool = False  # a dense SwiGLU expert every token also goes through (DeepSeek, Qwen-MoE)
    # tokens each expert takes per sequence = factor * seq_len * experts_per_token / num_experts;
    # the tokens beyond it skip the expert (counted in metrics.jsonl); 0 = dropless (room for
    # every token: the one-hot dispatch then grows with seq_len^2 * num_experts). Generation
    # (sample) never drops.
    expert_capacity_factor: float = 1.25
    router_aux_loss_coef: float = 0.01  # weight of the load-balancing loss (Switch Transformer's) in the objective

    def validate(self):
        if min(self.num_layers, self.d_model, self.num_heads, self.mlp_dim) <= 0:
            raise ModelError("model.num_layers, d_model, num_heads and mlp_dim must be positive")
        if self.num_kv_heads < 0 or self.head_dim < 0 or self.vocab_size < 0:
            raise ModelError("model.num_kv_heads, head_dim and vocab_size must be 0 (automatic) or positive")
        if self.num_heads % self.kv_heads:
            raise ModelError(f"model.num_kv_heads={self.num_kv_heads} does not divide model.num_heads="
                             f"{self.num_heads}; grouped-query attention shares each key/value head among an "
                             f"equal number of query heads")
        if not self.head_dim and self.d_model % self.num_heads:
            raise ModelError(f"model.d_model={self.d_model} is not divisible by model.num_heads={self.num_heads}; "
                             f"set model.head_dim or change one of them")
        if self.head_width % 2:
            raise ModelError(f"the head width {self.head_width} must be even for rotary embeddings")
        if self.rope_theta <= 0 or self.norm_eps <= 0 or self.rope_scaling_factor < 0:
            raise ModelError("model.rope_theta and model.norm_eps must be positive, rope_scaling_factor >= 0")
        if self.rope_scaling_factor and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ModelError("model.rope_high_freq_factor must exceed model.rope_low_freq_factor")
        validate_work_settings(self)
        self._validate_moe()

    def _validate_moe(self):
        if self.num_experts < 0:
            raise ModelError(f"model.num_experts={self.num_experts} must be 0 (a dense MLP) or positive")
        if not self.num_experts:
            return
        if not 0 < self.experts_per_token <= self.num_experts:
            raise ModelError(f"model.experts_per_token={self.experts_per_token} must be between 1 and "
                             f"model.num_experts={self.num_experts}")
        if self.router not in ("softmax", "sigmoid"):
            raise ModelError(f"model.router={self.router!r} is not one of softmax, sigmoid")
        if self.moe_interval < 1 or self.moe_mlp_dim < 0:
            raise ModelError("model.moe_interval must be 1 or more and model.moe_mlp_dim 0 or more")
        if self.moe_interval > 1 and self.scan_layers:
            raise ModelError(f"model.moe_interval={self.moe_interval} mixes dense and MoE layers, which one scanned "
                             f"layer cannot; set model.scan_layers=false")
        if self.expert_capacity_factor < 0 or self.router_aux_loss_coef < 0:
            raise ModelError("model.expert_capacity_factor and model.router_aux_loss_coef must be 0 or more")

    def is_moe(self, layer: int) -> bool:
        return self.num_experts > 0 and (layer + 1) % self.moe_interval == 0

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_width(self) -> int:
        return self.head_dim or self.d_model // self.num_heads


CONFIGS: dict[str, type] = {
    "mlp": MLPConfig,
    "cnn": CNNConfig,
    "resnet": ResNetConfig,
    "transformer": TransformerConfig,
    "llama": LlamaConfig,
}
