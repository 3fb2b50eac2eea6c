"""A GPT-style decoder-only language model: token + learned position embeddings, pre-norm
blocks of causal self-attention (jax.nn.dot_product_attention) and an MLP, optional remat.
`decode=True` runs with a key/value cache for generation (models/sampling.py)."""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from contract.activations import Constrainer, constrain
from models import gpt2_hf, sampling
from models.configs import ModelError, TransformerConfig
from models.family import NO_OPTIONS, BuildOptions, Family, FlopsAccounting, LanguageModel, NextToken
from models.layers import (
    Dropout,
    LMHead,
    config_loss_chunk,
    dense,
    kv_cache,
    param_init,
    scaled_last,
    traced_loss_chunk,
)
from models.remat import ATTENTION_OUT, KEY, LAYER_INPUT, MLP_OUT, QUERY, VALUE, policy


def layer_norm(dtype, param_dtype, name=None):
    return nn.LayerNorm(
        dtype=dtype,
        param_dtype=param_dtype,
        name=name,
        scale_init=param_init(nn.initializers.ones_init(), ("embed",)),
        bias_init=param_init(nn.initializers.zeros_init(), ("embed",)),
    )


class Block(nn.Module):
    num_heads: int
    mlp_dim: int
    dropout_rate: float
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    attention: str = "xla"  # jax.nn.dot_product_attention's implementation
    decode: bool = False  # use and fill the key/value cache (generation)
    layout: Optional[Constrainer] = None  # pins activations to the mesh (contract/activations.py)

    @nn.compact
    def __call__(self, x, example_ids, train: bool, dropout_rate=None, segment_ids=None):
        x = checkpoint_name(x, LAYER_INPUT)  # (the names: what a remat policy may keep, models/remat.py)
        d_model = x.shape[-1]
        head_dim = d_model // self.num_heads
        qkv_init = param_init(nn.initializers.lecun_normal(), ("embed", "heads", "kv"))
        y = layer_norm(self.dtype, self.param_dtype, "attn_norm")(x)
        q, k, v = (
            nn.DenseGeneral(
                (self.num_heads, head_dim),
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                kernel_init=qkv_init,
                use_bias=False,
                name=name,
            )(y)  # [batch, seq, heads, kv]
            for name in ("query", "key", "value")
        )
        q, k, v = (checkpoint_name(t, name) for t, name in zip((q, k, v), (QUERY, KEY, VALUE)))
        q, k, v = (constrain(self.layout, t, ("batch", "seq", "heads", "kv")) for t in (q, k, v))
        if self.decode:
            k, v, mask = kv_cache(self, k, v, segment_ids)
            y = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
        elif segment_ids is None:
            y = jax.nn.dot_product_attention(  # [b, s, h, kv]
                q,
                k,
                v,
                is_causal=True,
                implementation=self.attention,  # type: ignore[call-overload]
            )
        else:  # packed documents: causal and within the query's document
            causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
            mask = (segment_ids[:, :, None] == segment_ids[:, None, :]) & causal
            y = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], implementation="xla")
        y = nn.DenseGeneral(
            d_model,
            axis=(-2, -1),
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            use_bias=False,
            kernel_init=param_init(nn.initializers.lecun_normal(), ("heads", "kv", "embed")),
            name="attn_out",
        )(y)
        y = checkpoint_name(y, ATTENTION_OUT)
        x = constrain(
            self.layout,
            x + Dropout(self.dropout_rate)(y, train=train, example_ids=example_ids, rate=dropout_rate),
            ("batch", "seq", None),
        )
        y = layer_norm(self.dtype, self.param_dtype, "mlp_norm")(x)
        y = nn.gelu(dense(self.mlp_dim, ("embed", "mlp"), self.dtype, self.param_dtype, name="mlp_in")(y))
        y = constrain(self.layout, y, ("batch", "seq", "mlp"))  # [batch, seq, mlp]
        y = checkpoint_name(dense(d_model, ("mlp", "embed"), self.dtype, self.param_dtype, name="mlp_out")(y), MLP_OUT)
        return constrain(
            self.layout,
            x + Dropout(self.dropout_rate)(y, train=train, example_ids=example_ids, rate=dropout_rate),
            ("batch", "seq", None),
        )


class Transformer(nn.Module):
    vocab_size: int
    max_len: int
    num_layers: int
    d_model: int
    num_heads: int
    mlp_dim: int
    dropout_rate: float = 0.0
    remat: str = "none"
    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    attention: str = "xla"
    loss_chunk: int = 0
    decode: bool = False
    layout: Optional[Constrainer] = None  # pins activations to the mesh (contract/activations.py)
    logits_budget_mib: int = 2048  # loss_chunk=0: split the loss above this (models/layers.py choose_loss_chunk)
    gather_head: bool = True  # a chunked loss under a mesh: the head gathered once (models/layers.py chunked_loss)

    @nn.compact
    def __call__(
        self,
        tokens,
        *,
        train: bool,
        example_ids=None,
        dropout_rate=None,
        targets=None,
        positions=None,
        segment_ids=None,
        temperature=None,
        last_only: bool = False,
    ):
        """tokens [batch, seq] int32 → logits [batch, seq, vocab]; with targets [batch, seq]:
        (per-token cross-entropy, argmax == target), from the fused loss of LMHead. Packed
        documents give positions [batch, seq] (< max_len) and segment_ids [batch, seq]; with
        decode, segment 0 marks a prompt's left padding (models/layers.py kv_cache).
        `temperature`, `last_only`: as models/llama.py's (models/layers.py scaled_last)."""
        seq = tokens.shape[1]
        embed = nn.Embed(
            self.vocab_size,
            self.d_model,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            name="embed",
            embedding_init=param_init(nn.initializers.normal(0.02), ("vocab", "embed")),
        )
        table = self.param(
            "positions",
            param_init(nn.initializers.normal(0.01), (None, "embed")),
            (self.max_len, self.d_model),
            self.param_dtype,
        )
        where = table[:seq] if positions is None else jnp.take(table, positions, axis=0)
        x = embed(tokens) + where.astype(self.dtype)  # [batch, seq, embed]
        x = constrain(self.layout, x, ("batch", "seq", None))
        block_cls = Block
        if self.remat != "none":
            block_cls = nn.remat(Block, policy=policy(self.remat), static_argnums=(3,))
        for i in range(self.num_layers):
            x = block_cls(
                self.num_heads,
                self.mlp_dim,
                self.dropout_rate,
                self.dtype,
                self.param_dtype,
                self.attention,
                self.decode,
                self.layout,
                name=f"block_{i}",
            )(x, example_ids, train, dropout_rate, segment_ids)
        x = scaled_last(x, layer_norm(self.dtype, self.param_dtype, "final_norm"), temperature, last_only)
        head = LMHead(self.d_model, self.vocab_size, self.dtype, self.param_dtype, name="lm_head")
        if targets is None:
            return head(x, float32=temperature is not None)
        chunk = traced_loss_chunk(self.loss_chunk, self.logits_budget_mib, targets, self.vocab_size, self.layout)
        return head.loss(x, targets, chunk, self.layout if self.gather_head else None)


def build(
    cfg: TransformerConfig, info, dtype, param_dtype, options: BuildOptions = NO_OPTIONS, decode: bool = False
) -> nn.Module:
    """The module; `decode`: with a key/value cache, for generation (models/sampling.py)."""
    attention = cfg.attention
    if attention == "auto":  # cuDNN's flash attention wants a GPU and 16-bit inputs
        low_precision = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        attention = "cudnn" if jax.default_backend() == "gpu" and low_precision else "xla"
    if cfg.loss_chunk and info.seq_len % cfg.loss_chunk:
        raise ModelError(
            f"model.loss_chunk={cfg.loss_chunk} does not divide data.seq_len={info.seq_len}; "
            f"choose a divisor of {info.seq_len}, or 0 to choose by model.logits_budget_mib"
        )
    return Transformer(
        info.vocab_size,
        info.seq_len,
        cfg.num_layers,
        cfg.d_model,
        cfg.num_heads,
        cfg.mlp_dim,
        cfg.dropout_rate,
        cfg.remat,
        dtype,
        param_dtype,
        attention,
        cfg.loss_chunk,
        decode,
        options.layout,
        cfg.logits_budget_mib,
        cfg.gather_head,
    )


def flops_per_example(cfg: TransformerConfig, info, num_params: int) -> float:
    """Training FLOPs of one sequence: 6·N per token (forward + backward) plus attention's
    12·L·d·T per token (QKᵀ and AV, forward and backward, without causal savings)."""
    tokens = info.seq_len
    return 6.0 * num_params * tokens + 12.0 * cfg.num_layers * cfg.d_model * info.seq_len * tokens


class TransformerFamily(Family):
    config_cls = TransformerConfig
    task = NextToken()
    build = staticmethod(build)
    flops = FlopsAccounting(
        formula="6*N*tokens + 12*layers*d_model*seq_len*tokens",
        per_example=flops_per_example,
        # remat recomputes; a chunked loss is a loop XLA's cost analysis counts once; fused
        # (cuDNN) attention is a custom call it cannot count: MFU is measured without them
        work_settings={"remat": "none", "loss_chunk": 0, "attention": "xla"},
        reference_settings={"logits_budget_mib": 0},
    )
    language_model = LanguageModel(
        packed_documents=True, generate=sampling.generate, hf_layout=gpt2_hf, loss_chunk=config_loss_chunk
    )

    def remat(self, cfg) -> str:
        return cfg.remat


FAMILY = TransformerFamily()
