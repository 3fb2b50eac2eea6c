"""The `model.*` config of every family: one dataclass each, with `validate()`.

This module imports neither jax nor flax, so the config can be read and checked (by a sweep's
process, which only plans and watches runs) without loading them; the families' modules
(`models/mlp.py`, …) hold the flax modules and their `ModelFamily` declarations.

A config dataclass's first field is `name`; every field is declared with `option(default,
meaning, choices=..., at_least=...)` (the engine checks choices and bounds, and generates
docs/configuration.md from the meanings); `validate()` checks what relates fields.
`hparams` (a ClassVar) names the shape-independent fields the compiled step takes as float32
inputs and passes to the module call by name, so runs that differ only in them share one
compiled program.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from contract.fields import choices_of, option
from models.remat import DESCRIPTION as REMAT_DESCRIPTION
from models.remat import REMAT_NAMES


class ModelError(ValueError):
    """A model setting is wrong; the message names the `model.` key and the fix."""


ATTENTION_NAMES = ("auto", "xla", "cudnn")  # jax.nn.dot_product_attention's implementations (auto: by device)
LLAMA_ATTENTION_NAMES = (*ATTENTION_NAMES, "splash")  # splash: the Pallas TPU flash kernel (models/splash.py)


def check_attention(model_cfg, platform: str) -> None:
    """ModelError for model.attention=cudnn on devices other than GPUs (`platform`: the run's or
    plan's target's): cuDNN's flash attention is a GPU kernel, which JAX fails to trace elsewhere
    ("cuDNN is not detected"). The message names the settings that run there."""
    if getattr(model_cfg, "attention", None) != "cudnn" or platform == "gpu":
        return
    field = {f.name: f for f in dataclasses.fields(model_cfg)}["attention"]
    choices = choices_of(field) or ATTENTION_NAMES
    tpu = platform == "tpu" and "splash" in choices
    others = ["auto", *(["splash"] if tpu else []), "xla"]
    auto = "splash where the sequence tiles, else XLA" if tpu else "XLA here"
    there = "a TPU target" if platform == "tpu" else f"{platform} devices"
    raise ModelError(
        f"model.attention=cudnn is cuDNN's flash attention, a GPU kernel, and this run is on {there}; "
        f"set model.attention={' or '.join(others)} (auto: {auto})"
    )


LOSS_CHUNK_DESCRIPTION = (
    ">0: the loss makes float32 logits for this many positions at a time (divides data.seq_len); "
    "0: auto, the whole sequence at once unless one device's float32 logits exceed "
    "model.logits_budget_mib, then the largest divisor of data.seq_len whose piece fits (a multiple "
    "of 128 where one fits); the backward pass makes each piece's logits again"
)
GATHER_HEAD_DESCRIPTION = (
    "a loss in pieces (model.loss_chunk) under a mesh: gather the output projection once for the pieces' "
    "loop and reduce its gradient once (fewer collectives; one more output-projection-sized float32 gradient "
    "and a gathered copy per device), instead of in every piece, forward and backward"
)
LOGITS_BUDGET_DESCRIPTION = (
    "MiB of float32 logits one device may hold at once before model.loss_chunk=0 splits the loss "
    "(its share of the batch x its share of the sequence x vocabulary x 4 bytes); 0 = no limit, "
    "never split automatically"
)


@dataclass(frozen=True)
class MLPConfig:
    hparams: ClassVar[tuple[str, ...]] = ("dropout_rate",)
    name: str = option("mlp", "the model family")
    hidden_sizes: list[int] = option([128], "width of each hidden layer")
    dropout_rate: float = option(0.2, "dropout after each hidden layer")

    def validate(self):
        if not self.hidden_sizes or min(self.hidden_sizes) <= 0:
            raise ModelError(f"model.hidden_sizes={self.hidden_sizes} must be a non-empty list of positive widths")
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ModelError(f"model.dropout_rate={self.dropout_rate} must be in [0, 1)")


@dataclass(frozen=True)
class CNNConfig:
    hparams: ClassVar[tuple[str, ...]] = ("dropout_rate",)
    name: str = option("cnn", "the model family")
    channels: list[int] = option([32, 64], "conv widths, one 2x2 pool after each")
    dense_size: int = option(128, "width of the hidden dense layer")
    dropout_rate: float = option(0.0, "dropout rate")

    def validate(self):
        if not self.channels or min(self.channels) <= 0 or self.dense_size <= 0:
            raise ModelError(f"model.channels={self.channels} and model.dense_size must be positive")
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ModelError(f"model.dropout_rate={self.dropout_rate} must be in [0, 1)")


STAGES = {18: ("basic", (2, 2, 2, 2)), 34: ("basic", (3, 4, 6, 3)), 50: ("bottleneck", (3, 4, 6, 3))}


@dataclass(frozen=True)
class ResNetConfig:
    hparams: ClassVar[tuple[str, ...]] = ()
    name: str = option("resnet", "the model family")
    depth: int = option(18, "layers: 18 and 34 (basic blocks) or 50 (bottlenecks)", choices=(18, 34, 50))
    width: int = option(64, "channels of the first stage (doubles each stage)")
    stem: str = option(
        "auto",
        "cifar (3x3 conv, no pool), imagenet (7x7/2 conv + pool), or auto (by image size)",
        choices=("auto", "cifar", "imagenet"),
    )
    bn_momentum: float = option(0.9, "decay of the running batch statistics")

    def validate(self):
        if self.width <= 0:
            raise ModelError(f"model.width={self.width} must be positive")


@dataclass(frozen=True)
class TransformerConfig:
    hparams: ClassVar[tuple[str, ...]] = ("dropout_rate",)
    name: str = option("transformer", "the model family")
    num_layers: int = option(4, "layers")
    d_model: int = option(256, "width of the residual stream")
    num_heads: int = option(4, "attention heads")
    mlp_dim: int = option(1024, "hidden width of each block's MLP")
    dropout_rate: float = option(0.1, "dropout rate")
    remat: str = option("none", f"activation rematerialisation per block: {REMAT_DESCRIPTION}", choices=REMAT_NAMES)
    attention: str = option(
        "auto", "auto (cuDNN flash attention on GPU in bf16/fp16, else XLA), xla or cudnn", choices=ATTENTION_NAMES
    )
    loss_chunk: int = option(0, LOSS_CHUNK_DESCRIPTION, at_least=0)
    logits_budget_mib: int = option(2048, LOGITS_BUDGET_DESCRIPTION, at_least=0)
    gather_head: bool = option(True, GATHER_HEAD_DESCRIPTION)

    def validate(self):
        if min(self.num_layers, self.d_model, self.num_heads, self.mlp_dim) <= 0:
            raise ModelError("model.num_layers, d_model, num_heads and mlp_dim must be positive")
        if self.d_model % self.num_heads:
            raise ModelError(f"model.d_model={self.d_model} is not divisible by model.num_heads={self.num_heads}")
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ModelError(f"model.dropout_rate={self.dropout_rate} must be in [0, 1)")


@dataclass(frozen=True)
class LlamaConfig:
    hparams: ClassVar[tuple[str, ...]] = ()
    name: str = option("llama", "the model family")
    num_layers: int = option(4, "layers")
    d_model: int = option(256, "width of the residual stream (hidden_size)")
    num_heads: int = option(4, "query heads")
    num_kv_heads: int = option(0, "key/value heads (grouped-query attention; 0 = num_heads); divides num_heads")
    head_dim: int = option(0, "width of one head (0 = d_model / num_heads)")
    mlp_dim: int = option(688, "hidden width of the SwiGLU MLP (intermediate_size)")
    vocab_size: int = option(0, "output classes (0 = the data's vocabulary); >= every token id")
    rope_theta: float = option(500000.0, "base of the rotary frequencies")
    rope_scaling_factor: float = option(0.0, "Llama-3 long-context scaling of the frequencies (0 = off; 8 for 3.1)")
    rope_low_freq_factor: float = option(1.0, "Llama-3 scaling: wavelengths above original_len / this are divided")
    rope_high_freq_factor: float = option(4.0, "Llama-3 scaling: wavelengths below original_len / this are kept")
    rope_original_max_len: int = option(8192, "Llama-3 scaling: the context length the model was trained at")
    norm_eps: float = option(1e-5, "RMSNorm epsilon")
    tie_embeddings: bool = option(False, "the output projection is the input embedding, transposed")
    qk_norm: bool = option(False, "RMSNorm of each query and key head before RoPE (Qwen3, OLMo-2)")
    scan_layers: bool = option(True, "layers under nn.scan: one compiled layer, parameters stacked on `layers`")
    remat: str = option("none", f"activation rematerialisation per layer: {REMAT_DESCRIPTION}", choices=REMAT_NAMES)
    attention: str = option(
        "auto",
        "auto (splash on TPU devices, plan's TPU targets included, where the sequence tiles and the step "
        "is not vmapped or pipelined; cuDNN flash attention on GPU in bf16/fp16; else XLA), xla, cudnn or "
        "splash (the Pallas "
        "TPU flash kernel, compiled for TPU devices and plan's TPU targets, interpreted on CPU and GPU; "
        "data.seq_len a multiple of 128; training and eval only: "
        "generation's key/value cache and mesh.context > 1 stay on XLA)",
        choices=LLAMA_ATTENTION_NAMES,
    )
    loss_chunk: int = option(0, LOSS_CHUNK_DESCRIPTION, at_least=0)
    logits_budget_mib: int = option(2048, LOGITS_BUDGET_DESCRIPTION, at_least=0)
    gather_head: bool = option(True, GATHER_HEAD_DESCRIPTION)
    num_experts: int = option(
        0, "routed experts per mixture-of-experts layer (0 = a dense SwiGLU MLP in every layer)", at_least=0
    )
    experts_per_token: int = option(2, "top-k: experts each token is sent to")
    moe_interval: int = option(1, "every k-th layer is MoE (layers k-1, 2k-1, ...); > 1 needs scan_layers=false")
    moe_mlp_dim: int = option(0, "hidden width of each expert (0 = mlp_dim)")
    router: str = option(
        "softmax",
        "the gate of each expert: softmax (Mixtral, Qwen-MoE) or sigmoid (DeepSeek-V3)",
        choices=("softmax", "sigmoid"),
    )
    shared_expert: bool = option(False, "a dense SwiGLU expert every token also goes through (DeepSeek, Qwen-MoE)")
    expert_capacity_factor: float = option(
        1.25,
        "tokens each expert takes per sequence = factor * seq_len * "
        "experts_per_token / num_experts; the tokens beyond it skip the "
        "expert (counted in metrics.jsonl); 0 = dropless. Generation "
        "never drops",
        at_least=0,
    )
    moe_dispatch: str = option(
        "onehot",
        "how routed tokens reach their experts: onehot (GShard's einsums over capacity slots) or "
        "ragged (tokens sorted by expert, grouped matmuls: jax.lax.ragged_dot; dropless unless "
        "expert_buffer_factor bounds the buffers under mesh.expert > 1)",
        choices=("onehot", "ragged"),
    )
    expert_buffer_factor: float = option(
        0.0,
        "ragged dispatch over mesh.expert = S devices: 0 (the default) or >= S never drops (buffers "
        "of all A token-to-expert assignments); a factor in (0, S) bounds each device's buffer per "
        "expert shard to ceil(factor * A / S) assignments (A = its tokens x experts_per_token; a "
        "balanced routing needs factor 1), saving memory: the rest skip the expert (counted in "
        "metrics.jsonl, warned on the console)",
        at_least=0,
    )
    router_aux_loss_coef: float = option(
        0.01, "weight of the load-balancing loss (Switch Transformer's) in the objective", at_least=0
    )

    def validate(self):
        if min(self.num_layers, self.d_model, self.num_heads, self.mlp_dim) <= 0:
            raise ModelError("model.num_layers, d_model, num_heads and mlp_dim must be positive")
        if self.num_kv_heads < 0 or self.head_dim < 0 or self.vocab_size < 0:
            raise ModelError("model.num_kv_heads, head_dim and vocab_size must be 0 (automatic) or positive")
        if self.num_heads % self.kv_heads:
            raise ModelError(
                f"model.num_kv_heads={self.num_kv_heads} does not divide model.num_heads="
                f"{self.num_heads}; grouped-query attention shares each key/value head among an "
                f"equal number of query heads"
            )
        if not self.head_dim and self.d_model % self.num_heads:
            raise ModelError(
                f"model.d_model={self.d_model} is not divisible by model.num_heads={self.num_heads}; "
                f"set model.head_dim or change one of them"
            )
        if self.head_width % 2:
            raise ModelError(f"the head width {self.head_width} must be even for rotary embeddings")
        if self.rope_theta <= 0 or self.norm_eps <= 0 or self.rope_scaling_factor < 0:
            raise ModelError("model.rope_theta and model.norm_eps must be positive, rope_scaling_factor >= 0")
        if self.rope_scaling_factor and self.rope_high_freq_factor <= self.rope_low_freq_factor:
            raise ModelError("model.rope_high_freq_factor must exceed model.rope_low_freq_factor")
        self._validate_moe()

    def _validate_moe(self):
        if not self.num_experts:
            return
        if not 0 < self.experts_per_token <= self.num_experts:
            raise ModelError(
                f"model.experts_per_token={self.experts_per_token} must be between 1 and "
                f"model.num_experts={self.num_experts}"
            )
        if self.moe_interval < 1 or self.moe_mlp_dim < 0:
            raise ModelError("model.moe_interval must be 1 or more and model.moe_mlp_dim 0 or more")
        if self.moe_interval > 1 and self.scan_layers:
            raise ModelError(
                f"model.moe_interval={self.moe_interval} mixes dense and MoE layers, which one scanned "
                f"layer cannot; set model.scan_layers=false"
            )

    def is_moe(self, layer: int) -> bool:
        return self.num_experts > 0 and (layer + 1) % self.moe_interval == 0

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_width(self) -> int:
        return self.head_dim or self.d_model // self.num_heads


@dataclass(frozen=True)
class TabularConfig:
    hparams: ClassVar[tuple[str, ...]] = ("dropout_rate",)
    name: str = option("tabular", "the model family")
    hidden_sizes: list[int] = option([64, 32], "deep part: width of each hidden layer of the MLP")
    dropout_rate: float = option(0.0, "deep part: dropout after each hidden layer")
    wide: bool = option(True, "a linear part over the indicator and crossed features (wide & deep)")
    deep: bool = option(True, "an MLP over the numeric and embedding features")

    def validate(self):
        if min(self.hidden_sizes, default=1) <= 0:
            raise ModelError(f"model.hidden_sizes={self.hidden_sizes} must be positive widths")
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ModelError(f"model.dropout_rate={self.dropout_rate} must be in [0, 1)")
        if not (self.wide or self.deep):
            raise ModelError("model.wide and model.deep are both false: the model would read nothing; set one")


CONFIGS: dict[str, type] = {
    "mlp": MLPConfig,
    "cnn": CNNConfig,
    "resnet": ResNetConfig,
    "transformer": TransformerConfig,
    "llama": LlamaConfig,
    "tabular": TabularConfig,
}
