"""A decoder-only language model of the Llama-3 / Qwen / Mistral shape: RMSNorm, rotary
position embeddings (with Llama-3's long-context frequency scaling), grouped-query
attention, a SwiGLU MLP, no biases, tied or untied embeddings, optional QK-norm.

Layers run under `nn.scan` by default (`scan_layers`): one layer is traced and compiled, its
parameters stacked on a leading `layers` axis, so compile time stays flat in depth. The
parameter names and layouts follow Hugging Face's `LlamaForCausalLM` closely enough that
models/hf.py maps one onto the other tensor by tensor (RoPE rotates the two halves of each
head, as Hugging Face's checkpoints expect).

Context parallelism (`mesh.context`): activations are split along the sequence; each
attention layer all-gathers the keys and values of the whole sequence (small under
grouped-query attention) while every device keeps its own queries, so each device computes
an equal share of the masked score matrix. Mixture of experts (`num_experts`): top-k routed
SwiGLU experts, dispatched by one-hot einsums with a capacity per expert (GShard), or
(`moe_dispatch=ragged`) sorted by expert through grouped matmuls, dropless: with the experts
split over `mesh.expert` the dispatch and return are all-to-alls (models/moe.py).

`decode=True` runs with a key/value cache (the `cache` collection): a prompt fills it, then
each call appends one position (see models/sampling.py).
"""

from __future__ import annotations

import math
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from contract.activations import ONE_STAGE, Constrainer, StagePlan, activation_splits, constrain
from contract.adapters import NO_ADAPTATION, Adaptation
from models import llama_hf, sampling
from models.configs import LlamaConfig, ModelError
from models.family import (
    NO_OPTIONS,
    BuildOptions,
    Experts,
    Family,
    FlopsAccounting,
    LanguageModel,
    LayerStack,
    NextToken,
)
from models.layers import LMHead, chunked_loss, config_loss_chunk, kv_cache, param_init, scaled_last, traced_loss_chunk
from models.moe import MoE
from models.pipeline import run_pipeline
from models.projection import Projection
from models.remat import ATTENTION_OUT, KEY, LAYER_INPUT, MLP_OUT, QUERY, VALUE, policy
from models.splash import block_size, chosen_attention, splash_attention


def rope_frequencies(cfg: LlamaConfig) -> jnp.ndarray:
    """Inverse frequencies [head_width / 2] of the rotary embedding, Llama-3 scaled if asked."""
    width = cfg.head_width
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, width, 2, dtype=jnp.float32) / width))
    if not cfg.rope_scaling_factor:
        return inv_freq
    factor, original = cfg.rope_scaling_factor, cfg.rope_original_max_len
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = original / cfg.rope_low_freq_factor
    high_freq_wavelen = original / cfg.rope_high_freq_factor
    scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)  # long wavelengths: slower
    smooth = (original / wavelen - cfg.rope_low_freq_factor) / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return jnp.where(medium, smoothed, scaled)


def apply_rope(x, positions, inv_freq):
    """x [batch, seq, heads, width] rotated by positions [batch, seq]: the first and second
    halves of each head are the two coordinates of each rotated pair (Hugging Face's layout)."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [batch, seq, width / 2]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)


class RMSNorm(nn.Module):
    eps: float
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    axis_name: str = "embed"

    @nn.compact
    def __call__(self, x):
        scale = self.param(
            "scale", param_init(nn.initializers.ones_init(), (self.axis_name,)), (x.shape[-1],), self.param_dtype
        )
        x32 = x.astype(jnp.float32)  # the statistics in float32, as Hugging Face computes them
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale.astype(self.dtype) * normed.astype(self.dtype)


class Attention(nn.Module):
    cfg: LlamaConfig
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    implementation: str
    decode: bool = False
    adapt: Adaptation = NO_ADAPTATION
    pipelined: bool = False  # a stage of a pipeline (models/pipeline.py)
    layout: Optional[Constrainer] = None  # pins activations to the mesh (contract/activations.py)

    @nn.compact
    def __call__(self, x, positions, segment_ids=None):
        cfg, width = self.cfg, self.cfg.head_width
        dense = {"dtype": self.dtype, "param_dtype": self.param_dtype, "adapt": self.adapt}
        q = Projection((cfg.num_heads, width), ("embed", "heads", "kv"), name="query", **dense)(
            x
        )  # [batch, seq, heads, kv]
        k, v = (
            Projection((cfg.kv_heads, width), ("embed", "kv_heads", "kv"), name=name, **dense)(x)
            for name in ("key", "value")
        )  # [batch, seq, kv_heads, kv]
        q, k, v = (checkpoint_name(t, name) for t, name in zip((q, k, v), (QUERY, KEY, VALUE)))  # models/remat.py
        if cfg.qk_norm:
            q = RMSNorm(cfg.norm_eps, self.dtype, self.param_dtype, "kv", name="query_norm")(q)
            k = RMSNorm(cfg.norm_eps, self.dtype, self.param_dtype, "kv", name="key_norm")(k)
        inv_freq = rope_frequencies(cfg)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        q = constrain(self.layout, q, ("batch", "seq", "heads", "kv"))
        k, v = (constrain(self.layout, t, ("batch", "seq", "kv_heads", "kv")) for t in (k, v))
        context = activation_splits(self.layout, "seq") > 1
        if context:  # context parallelism: all keys and values on every device (an all-gather); queries stay split
            k, v = (constrain(self.layout, t, ("batch", None, "kv_heads", "kv")) for t in (k, v))
        if self.decode:
            k, v, mask = kv_cache(self, k, v, segment_ids)
            y = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
        elif self.implementation == "splash" and not context:  # Pallas flash kernel: no [seq, seq] scores
            y = splash_attention(
                q,
                k,
                v,
                segment_ids,
                interpret=jax.default_backend() != "tpu",
                pipelined=self.pipelined,
                layout=self.layout,
            )
        elif segment_ids is not None:  # packed documents: causal and within the query's document
            length = x.shape[1]
            causal = jnp.tril(jnp.ones((length, length), bool))
            mask = (segment_ids[:, :, None] == segment_ids[:, None, :]) & causal  # [batch, query, key]
            mask = constrain(self.layout, mask, ("batch", "seq", None))
            y = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], implementation="xla")
        else:  # cuDNN's kernel takes the whole sequence: XLA's under context parallelism
            y = jax.nn.dot_product_attention(
                q, k, v, is_causal=True, implementation="xla" if context else self.implementation
            )
        y = constrain(self.layout, y, ("batch", "seq", "heads", "kv"))
        y = Projection((x.shape[-1],), ("heads", "kv", "embed"), inputs=2, name="out", **dense)(y)
        return checkpoint_name(y, ATTENTION_OUT)


class Block(nn.Module):
    cfg: LlamaConfig
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    implementation: str
    decode: bool = False
    moe: bool = False  # a mixture-of-experts layer (else a dense MLP)
    adapt: Adaptation = NO_ADAPTATION
    pipelined: bool = False  # a stage of a pipeline (models/pipeline.py)
    layout: Optional[Constrainer] = None  # pins activations to the mesh (contract/activations.py)

    @nn.compact
    def __call__(self, x, positions, segment_ids=None):
        cfg, x = self.cfg, checkpoint_name(x, LAYER_INPUT)  # (what a remat policy may keep: models/remat.py)
        y = RMSNorm(cfg.norm_eps, self.dtype, self.param_dtype, name="attn_norm")(x)
        x = constrain(
            self.layout,
            x
            + Attention(
                cfg,
                self.dtype,
                self.param_dtype,
                self.implementation,
                self.decode,
                self.adapt,
                self.pipelined,
                self.layout,
                name="attn",
            )(y, positions, segment_ids),
            ("batch", "seq", None),
        )
        y = RMSNorm(cfg.norm_eps, self.dtype, self.param_dtype, name="mlp_norm")(x)
        if self.moe:
            y = MoE(cfg, self.dtype, self.param_dtype, self.decode, self.layout, name="moe")(y)
        else:  # SwiGLU
            dense = {"dtype": self.dtype, "param_dtype": self.param_dtype, "adapt": self.adapt}
            gate = Projection((cfg.mlp_dim,), ("embed", "mlp"), name="gate", **dense)(y)
            up = Projection((cfg.mlp_dim,), ("embed", "mlp"), name="up", **dense)(y)
            y = constrain(self.layout, nn.silu(gate) * up, ("batch", "seq", "mlp"))  # [batch, seq, mlp]
            y = Projection((x.shape[-1],), ("mlp", "embed"), name="down", **dense)(y)
        return constrain(self.layout, x + checkpoint_name(y, MLP_OUT), ("batch", "seq", None))


class ScannedBlock(nn.Module):
    """A Block in the (carry, input) → (carry, output) form nn.scan runs."""

    cfg: LlamaConfig
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    implementation: str
    decode: bool = False
    adapt: Adaptation = NO_ADAPTATION
    layout: Optional[Constrainer] = None  # pins activations to the mesh (contract/activations.py)

    @nn.compact
    def __call__(self, x, positions, segment_ids=None):
        block = Block if self.cfg.remat == "none" else nn.remat(Block, policy=policy(self.cfg.remat))
        return block(
            self.cfg,
            self.dtype,
            self.param_dtype,
            self.implementation,
            self.decode,
            self.cfg.is_moe(0),
            self.adapt,
            layout=self.layout,
            name="block",
        )(x, positions, segment_ids), None


class Llama(nn.Module):
    cfg: LlamaConfig
    vocab_size: int
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    attention: str = "xla"  # jax.nn.dot_product_attention's implementation
    decode: bool = False  # use and fill the key/value cache (generation)
    adapt: Adaptation = NO_ADAPTATION  # LoRA adapters, quantised matmuls (models/projection.py)
    stages: StagePlan = ONE_STAGE  # the scanned layers as a pipeline (models/pipeline.py)
    layout: Optional[Constrainer] = None  # pins activations to the mesh (contract/activations.py)

    @nn.compact
    def __call__(
        self,
        tokens,
        *,
        train: bool,
        example_ids=None,
        targets=None,
        positions=None,
        segment_ids=None,
        temperature=None,
        last_only: bool = False,
    ):
        """tokens [batch, seq] int32 → logits [batch, seq, vocab] (compute dtype); with targets:
        (per-token float32 cross-entropy, argmax == target). positions [batch, seq] default to
        0, 1, …; with decode they are RoPE positions only (the cache keeps its own fill level).
        segment_ids [batch, seq] (packed documents; with decode, 0 marks a prompt's left padding):
        a token attends only to earlier tokens of its segment. `temperature` (a scalar): the
        logits (and the loss's) are those of logits / temperature, made as (h / T) W (sampling
        and its log-probabilities, engine/lm/rollouts.py); `last_only`: the last position's alone."""
        cfg = self.cfg
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        embed = nn.Embed(
            self.vocab_size,
            cfg.d_model,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="embed",
            embedding_init=param_init(nn.initializers.normal(0.02), ("vocab", "embed")),
        )
        x = constrain(self.layout, embed(tokens), ("batch", "seq", None))  # [batch, seq, embed]
        if cfg.scan_layers and self.stages.stages > 1 and not self.is_initializing() and not self.decode:
            x = self._pipelined(x, positions, segment_ids)
        elif cfg.scan_layers:
            layers = nn.scan(
                ScannedBlock,
                variable_axes={"params": 0, "cache": 0, "aux": 0},
                split_rngs={"params": True, "dropout": True},
                in_axes=(nn.broadcast, nn.broadcast),
                length=cfg.num_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            x, _ = layers(
                cfg, self.dtype, self.param_dtype, self.attention, self.decode, self.adapt, self.layout, name="layers"
            )(x, positions, segment_ids)
        else:
            block = Block if cfg.remat == "none" else nn.remat(Block, policy=policy(cfg.remat))
            for i in range(cfg.num_layers):
                x = block(
                    cfg,
                    self.dtype,
                    self.param_dtype,
                    self.attention,
                    self.decode,
                    cfg.is_moe(i),
                    self.adapt,
                    layout=self.layout,
                    name=f"layer_{i}",
                )(x, positions, segment_ids)
        norm = RMSNorm(cfg.norm_eps, self.dtype, self.param_dtype, name="final_norm")
        x = scaled_last(x, norm, temperature, last_only)
        if cfg.tie_embeddings:  # the embedding table [vocab, embed] is the output projection, transposed
            head: _TiedHead | LMHead = _TiedHead(embed, self.dtype)
        else:
            head = LMHead(cfg.d_model, self.vocab_size, self.dtype, self.param_dtype, name="lm_head")
        if targets is None:
            return head(x, float32=temperature is not None)
        chunk = traced_loss_chunk(cfg.loss_chunk, cfg.logits_budget_mib, targets, self.vocab_size, self.layout)
        return head.loss(x, targets, chunk, self.layout if cfg.gather_head else None)

    def _pipelined(self, x, positions, segment_ids):
        """The scanned layers (their stacked parameters, as nn.scan made them) as a pipeline."""
        cfg = self.cfg
        block = Block(
            cfg,
            self.dtype,
            self.param_dtype,
            self.attention,
            False,
            False,
            self.adapt,
            pipelined=True,
            layout=self.layout,
        )

        def layer(params, h, pos, seg):
            return block.apply({"params": params}, h, pos, seg)

        if cfg.remat != "none":
            layer = jax.checkpoint(layer, policy=policy(cfg.remat))  # the policies of the scanned layers
        params = self.variables["params"]["layers"]["block"]
        return run_pipeline(layer, params, x, positions, segment_ids, self.stages, self.layout)


class _TiedHead:
    """LMHead's interface over the input embedding's table."""

    def __init__(self, embed: nn.Embed, dtype):
        self.embed, self.dtype = embed, dtype

    def __call__(self, x, float32: bool = False):
        if float32:  # as the loss makes them
            return LMHead.float32(x, self.embed.embedding.T, jnp.dtype(self.dtype))
        return self.embed.attend(x.astype(self.dtype))

    def loss(self, x, targets, chunk: int = 0, layout: Optional[Constrainer] = None):
        return chunked_loss(x, self.embed.embedding.T, targets, jnp.dtype(self.dtype), chunk, layout)


def build(
    cfg: LlamaConfig, info, dtype, param_dtype, options: BuildOptions = NO_OPTIONS, decode: bool = False
) -> nn.Module:
    """The module; `decode`: with a key/value cache, for generation (models/sampling.py)."""
    layout = options.layout  # (its mesh's devices are a plan's TPU topology on a CPU host)
    attention = chosen_attention(
        cfg.attention,
        layout.mesh.devices.flat[0].platform if layout is not None else jax.default_backend(),
        jnp.dtype(dtype),
        info.seq_len,
        per_device=not (layout is not None and layout.vmapped)
        and options.stages.stages == 1
        and activation_splits(layout, "seq") == 1,  # (under mesh.context Attention runs XLA's)
    )
    if attention == "splash":
        block_size(info.seq_len)  # the kernel's tiles divide the sequence (else a ModelError naming the fix)
    if cfg.loss_chunk and info.seq_len % cfg.loss_chunk:
        raise ModelError(
            f"model.loss_chunk={cfg.loss_chunk} does not divide data.seq_len={info.seq_len}; "
            f"choose a divisor of {info.seq_len}, or 0 to choose by model.logits_budget_mib"
        )
    vocab = cfg.vocab_size or info.vocab_size
    if vocab < info.vocab_size:
        raise ModelError(
            f"model.vocab_size={cfg.vocab_size} is smaller than the data's vocabulary "
            f"({info.vocab_size} token ids); set model.vocab_size >= {info.vocab_size} or 0"
        )
    return Llama(cfg, vocab, dtype, param_dtype, attention, decode, options.adaptation, options.stages, options.layout)


def flops_per_example(cfg: LlamaConfig, info, num_params: int) -> float:
    """Training FLOPs of one sequence: 6·N per token over the parameters used in matmuls (the
    input embedding is a lookup, unless tied to the output; of a mixture of experts, the
    experts_per_token experts a token goes to) plus causal attention's
    6·L·(heads·head_width)·T per token (QKᵀ and AV, forward and backward, the masked half not counted)."""
    vocab = cfg.vocab_size or info.vocab_size
    matmul_params = num_params - (0 if cfg.tie_embeddings else vocab * cfg.d_model)
    if cfg.num_experts:  # only the experts a token is routed to do work for it
        moe_layers = sum(cfg.is_moe(i) for i in range(cfg.num_layers))
        expert = 3 * cfg.d_model * (cfg.moe_mlp_dim or cfg.mlp_dim)
        matmul_params -= moe_layers * expert * (cfg.num_experts - cfg.experts_per_token)
    tokens = info.seq_len
    return (6.0 * matmul_params + 6.0 * cfg.num_layers * cfg.num_heads * cfg.head_width * tokens) * tokens


# the projections fine-tuning adapts (contract/adapters.py names them): (input axes, output axes)
PROJECTIONS = {
    "query": (1, 2),
    "key": (1, 2),
    "value": (1, 2),
    "out": (2, 1),
    "gate": (1, 1),
    "up": (1, 1),
    "down": (1, 1),
}


def _formula_only(cfg: LlamaConfig) -> str:
    # XLA would count every expert's capacity slots and the dispatch einsums (one-hot), or
    # every expert's product with every routed row (ragged: XLA:CPU's dense lowering)
    return "a mixture of experts counts its active experts only" if cfg.num_experts else ""


def _stacked_layers(cfg: LlamaConfig) -> int:
    return cfg.num_layers if cfg.scan_layers else 0


def _num_experts(cfg: LlamaConfig) -> int:
    return cfg.num_experts


class LlamaFamily(Family):
    config_cls = LlamaConfig
    task = NextToken()
    build = staticmethod(build)
    flops = FlopsAccounting(
        formula="6*N_matmul*tokens + 6*layers*heads*head_dim*seq_len*tokens (causal)",
        per_example=flops_per_example,
        # remat recomputes; a scan, or a chunked loss, is a loop XLA's cost analysis counts once;
        # fused (cuDNN) attention is a custom call it cannot count: MFU is measured without them
        work_settings={"scan_layers": False, "remat": "none", "loss_chunk": 0, "attention": "xla"},
        reference_settings={"logits_budget_mib": 0},
        formula_only=_formula_only,
    )
    language_model = LanguageModel(
        packed_documents=True,
        splits_sequence=True,
        generate=sampling.generate,
        hf_layout=llama_hf,
        projections=PROJECTIONS,
        loss_chunk=config_loss_chunk,
    )
    layer_stack = LayerStack(_stacked_layers)
    experts = Experts(_num_experts)

    def remat(self, cfg) -> str:
        return cfg.remat


FAMILY = LlamaFamily()
