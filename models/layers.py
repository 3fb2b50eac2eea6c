"""Layers shared by the models (activation layout hints are contract.activations's): parameter
initialisers that carry logical axis names, and a dropout whose mask depends on each
example's position in the global batch, not on how the batch is split over devices,
microbatches or a pmap axis."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from contract.activations import Constrainer, activation_splits


def param_init(init, axes: tuple[Optional[str], ...]):
    """An initialiser whose parameter carries logical axis names (mapped to a mesh by config)."""
    return nn.with_logical_partitioning(init, axes)


def normal_kernel(axes: tuple[Optional[str], ...]):
    """A Normal(0, 0.02) initialiser (Llama's) whose parameter carries these logical axes."""
    return param_init(nn.initializers.normal(0.02), axes)


def dense(features: int, axes: tuple[Optional[str], Optional[str]], dtype, param_dtype, name=None, use_bias=True):
    """nn.Dense with logical names on kernel [in, out] and bias [out]."""
    return nn.Dense(
        features,
        use_bias=use_bias,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=param_init(nn.initializers.lecun_normal(), axes),
        bias_init=param_init(nn.initializers.zeros_init(), (axes[1],)),
        name=name,
    )


class Dropout(nn.Module):
    """Inverted dropout; example i's mask is drawn from fold_in(rng, example_ids[i]).

    `rate` given at call time (a traced scalar from the engine) overrides the configured one,
    so runs that differ only in dropout rate share one compiled step."""

    rate: float

    @nn.compact
    def __call__(self, x, *, train: bool, example_ids: Optional[jax.Array] = None, rate=None):
        rate = self.rate if rate is None else rate
        if not train or (isinstance(rate, float) and rate == 0.0):
            return x
        if example_ids is None:  # a standalone call: ids are the row numbers
            example_ids = jnp.arange(x.shape[0])
        key = self.make_rng("dropout")
        keep = 1.0 - rate

        def row_mask(example_id):
            return jax.random.bernoulli(jax.random.fold_in(key, example_id), keep, x.shape[1:])

        mask = jax.vmap(row_mask)(example_ids)  # [batch, ...]
        return jnp.where(mask, x / keep, 0).astype(x.dtype)


def _logits(x, kernel, dtype):
    """[..., embed] @ [embed, vocab] in the compute dtype, written straight out in float32."""
    return jnp.einsum("...d,dv->...v", x.astype(dtype), kernel.astype(dtype), preferred_element_type=jnp.float32)


def _is_label(logits, targets):
    return jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1) == targets[..., None]


def _piece_forward(x, kernel, targets, dtype):
    """One piece: (cross-entropy, argmax == target, log-normaliser, float32 logits)."""
    logits = _logits(x, kernel, dtype)
    lse = jax.nn.logsumexp(logits, axis=-1)
    # The label's logit by a masked sum, not a gather: it stays one fused reduction, also
    # when the vocabulary is sharded over devices.
    label_logit = jnp.sum(jnp.where(_is_label(logits, targets), logits, 0.0), axis=-1)
    return lse - label_logit, jnp.argmax(logits, axis=-1) == targets, lse, logits


def _piece_backward(x, kernel, targets, dtype, lse, logits, g, shards: int = 1):
    """d loss / d (x, kernel) of one piece, from its float32 logits; the logits' gradient
    (softmax − one-hot) is made in the compute dtype, in one fusion with the softmax. The
    kernel's gradient is [shards, embed, vocab]: the sums over each of `shards` equal parts of
    the batch (its devices' parts under a mesh: summed over the devices only once, by the caller)."""
    probs = jnp.exp(logits - lse[..., None])
    g_logits = ((probs - _is_label(logits, targets)) * g[..., None]).astype(dtype)
    dx = jnp.einsum("...v,dv->...d", g_logits, kernel.astype(dtype), preferred_element_type=jnp.float32)
    x2 = x.astype(dtype).reshape(shards, -1, x.shape[-1])
    g2 = g_logits.reshape(shards, -1, g_logits.shape[-1])
    dk = jnp.einsum("snd,snv->sdv", x2, g2, preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dk


def _chunks(a, chunk):
    """[batch, seq, ...] → [seq / chunk, batch, chunk, ...]: pieces along the sequence."""
    return a.reshape(a.shape[0], a.shape[1] // chunk, chunk, *a.shape[2:]).swapaxes(0, 1)


def _unchunk(a):
    return a.swapaxes(0, 1).reshape(a.shape[1], a.shape[0] * a.shape[2], *a.shape[3:])


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def fused_cross_entropy(x, kernel, targets, dtype, chunk: int, shards: int = 1, gather=None):
    """Next-token cross-entropy of the logits x @ kernel, without keeping float32 logits
    twice: x [batch, seq, embed], kernel [embed, vocab], targets [batch, seq] int →
    (losses float32 [batch, seq], argmax == target [batch, seq]).

    chunk = 0: the logits are made once, in float32, and kept for the backward pass (no
    compute-dtype copy, no second float32 array for the softmax). chunk > 0 (divides seq):
    one piece of `chunk` positions at a time, forward and backward; only the log-normaliser
    is kept and each piece's logits are made again in the backward pass (one more head
    matmul, for [batch, chunk, vocab] of float32 instead of [batch, seq, vocab]). `shards`: the
    kernel's gradient is summed per part of the batch in the pieces' loop (_piece_backward), the
    parts added once after it; `gather`: the kernel in the compute dtype → laid out for the loop
    (whole over the batch axes: gathered once, not in every piece)."""
    return _fused_forward(x, kernel, targets, dtype, chunk, shards, gather)[0]


def _for_pieces(kernel, dtype, gather):
    """The kernel as the pieces' loop reads it: in the compute dtype, laid out by `gather`."""
    return kernel if gather is None else gather(kernel.astype(dtype))


def _fused_forward(x, kernel, targets, dtype, chunk, shards=1, gather=None):
    if not chunk:
        losses, correct, lse, logits = _piece_forward(x, kernel, targets, dtype)
        return (losses, correct), (x, kernel, targets, lse, logits)
    pieces = _for_pieces(kernel, dtype, gather)
    losses, correct, lse = jax.lax.map(
        lambda a: _piece_forward(a[0], pieces, a[1], dtype)[:3], (_chunks(x, chunk), _chunks(targets, chunk))
    )
    return (_unchunk(losses), _unchunk(correct)), (x, kernel, targets, _unchunk(lse), None)


def _fused_backward(dtype, chunk, shards, gather, residuals, cotangents):
    x, kernel, targets, lse, logits = residuals
    g = cotangents[0].astype(jnp.float32)  # the cotangent of `correct` (bool) is float0: nothing
    no_grad = np.zeros(targets.shape, jax.dtypes.float0)
    if not chunk:
        dx, dk = _piece_backward(x, kernel, targets, dtype, lse, logits, g)
        return dx, dk[0].astype(kernel.dtype), no_grad

    pieces = _for_pieces(kernel, dtype, gather)

    def piece(dk, a):
        x_c, t_c, lse_c, g_c = a
        dx_c, dk_c = _piece_backward(x_c, pieces, t_c, dtype, lse_c, _logits(x_c, pieces, dtype), g_c, shards)
        return dk + dk_c, dx_c

    zeros = jnp.zeros((shards, *kernel.shape), jnp.float32)  # each device's partial sums: reduced after the loop
    dk, dx = jax.lax.scan(piece, zeros, tuple(_chunks(a, chunk) for a in (x, targets, lse, g)))
    dk = dk.sum(0) if gather is None else gather.scattered(dk.sum(0))
    return _unchunk(dx), dk.astype(kernel.dtype), no_grad


fused_cross_entropy.defvjp(_fused_forward, _fused_backward)


MIB = 1 << 20
LOSS_TILE = 128  # an automatic loss chunk is a multiple of this where one fits (TPU tiles)


@dataclass(frozen=True)
class LossChunk:
    """How the loss makes its float32 logits: `chunk` positions at a time (0: the whole sequence);
    `auto`: chosen by the budget (model.loss_chunk=0); `logits_bytes`: one device's float32
    logits of the whole sequence; `budget_bytes`: model.logits_budget_mib in bytes (0: no limit)."""

    chunk: int
    auto: bool
    logits_bytes: int
    budget_bytes: int


def _share(size: int, splits: int) -> int:
    """One device's share of an axis split over `splits` devices; whole where they do not divide
    it (the layout leaves such an activation axis unsplit: engine/parallel/sharding.py)."""
    return size // splits if splits > 1 and size % splits == 0 else size


def choose_loss_chunk(
    chunk: int, budget_mib: int, batch: int, seq: int, vocab: int, batch_splits: int = 1, seq_splits: int = 1
) -> LossChunk:
    """model.loss_chunk as the loss runs it, for `batch` sequences of `seq` positions split over
    `batch_splits` and `seq_splits` devices. chunk > 0: as set. 0 (auto): the whole sequence
    unless one device's float32 logits (its share of the batch × its share of the sequence ×
    vocab × 4 bytes) exceed `budget_mib` (0: no limit); then the largest divisor of `seq` whose
    piece fits, the largest multiple of 128 (TPU tiles) where one fits, else the largest
    divisor, at least 1. A piece is counted whole on each device (the loop over the sequence's
    pieces does not keep one split over the context axis), and the vocabulary whole too (a
    tensor-split head holds less): the estimate errs towards smaller pieces."""
    rows = _share(batch, batch_splits)
    whole, budget = rows * _share(seq, seq_splits) * vocab * 4, budget_mib * MIB
    if chunk or not budget or whole <= budget:  # (a chunk of the whole sequence is no chunk: LMHead.loss)
        return LossChunk(chunk if chunk < seq else 0, not chunk, whole, budget)
    fitting = [d for d in range(1, seq) if seq % d == 0 and rows * d * vocab * 4 <= budget]
    tiled = [d for d in fitting if d % LOSS_TILE == 0]
    return LossChunk(max(tiled or fitting or [1]), True, whole, budget)


def config_loss_chunk(cfg, info, batch: int, batch_splits: int = 1, seq_splits: int = 1) -> LossChunk:
    """choose_loss_chunk for a language model's config (loss_chunk, logits_budget_mib and a
    vocab_size, 0 or absent: the data's) and `batch` of the data's sequences (a plan's figure)."""
    vocab = getattr(cfg, "vocab_size", 0) or info.vocab_size
    return choose_loss_chunk(
        cfg.loss_chunk, cfg.logits_budget_mib, batch, info.seq_len, vocab, batch_splits, seq_splits
    )


def traced_loss_chunk(chunk: int, budget_mib: int, targets, vocab: int, layout: Optional[Constrainer]) -> int:
    """The loss chunk of a traced step (choose_loss_chunk) from its targets' shape [batch, seq]
    (global under jit, one trial's under vmap, one micro-batch's under gradient accumulation)
    and how `layout` splits the batch and the sequence (None: one device)."""
    batch, seq = targets.shape[0], targets.shape[1]
    splits = activation_splits(layout, "batch"), activation_splits(layout, "seq")
    return choose_loss_chunk(chunk, budget_mib, batch, seq, vocab, *splits).chunk


class LMHead(nn.Module):
    """The output projection [embed → vocab] of a language model, and its fused loss.

    `__call__` gives the logits (in the compute dtype); `loss` gives the per-token
    cross-entropy and whether the argmax was right (fused_cross_entropy). Chunks run along
    the sequence, so a batch sharded over devices stays where it is."""

    d_model: int
    vocab_size: int
    dtype: jnp.dtype
    param_dtype: jnp.dtype

    def setup(self):
        self.kernel = self.param(
            "kernel",
            param_init(nn.initializers.lecun_normal(), ("embed", "vocab")),
            (self.d_model, self.vocab_size),
            self.param_dtype,
        )

    def __call__(self, x, float32: bool = False):
        """The logits in the compute dtype, or (`float32`) in float32 as the fused loss makes them."""
        if float32:
            return self.float32(x, self.kernel, jnp.dtype(self.dtype))
        return jnp.einsum("...d,dv->...v", x.astype(self.dtype), self.kernel.astype(self.dtype))

    float32 = staticmethod(_logits)  # (x, kernel, dtype) → float32 logits, as the loss makes them

    def loss(self, x, targets, chunk: int = 0, layout: Optional[Constrainer] = None):
        """x [batch, seq, embed], targets [batch, seq] → (losses float32, correct bool), [batch, seq]."""
        return chunked_loss(x, self.kernel, targets, jnp.dtype(self.dtype), chunk, layout)


def chunked_loss(x, kernel, targets, dtype, chunk: int, layout: Optional[Constrainer]):
    """fused_cross_entropy of x @ kernel [embed, vocab], `chunk` positions at a time (0 or the whole
    sequence: at once). Chunked under a mesh, the kernel is gathered whole over the batch axes once
    (kept split over vocab's axis): the pieces' loop would otherwise gather it again for every piece,
    forward and backward, and reduce its gradient piece by piece (llama3_8b on a v6e-64: 644 ms of
    collectives a step against 161 ms with the logits whole); its gradient is then summed in the
    loop on each device and reduced once. `layout` None: in every piece (model.gather_head=false:
    less memory, more collectives)."""
    chunk = 0 if chunk >= targets.shape[1] else chunk
    if not chunk or layout is None:
        return fused_cross_entropy(x, kernel, targets, dtype, chunk)
    shards = activation_splits(layout, "batch")
    return fused_cross_entropy(x, kernel, targets, dtype, chunk, 1 if x.shape[0] % shards else shards, _Whole(layout))


@dataclass(frozen=True)
class _Whole:
    """A kernel [embed, vocab] laid out whole over the batch axes (split over vocab's axis only)."""

    layout: Constrainer

    def __call__(self, kernel):
        return self.layout(kernel, (None, "vocab"))

    def scattered(self, gradient):
        """The kernel's gradient [embed, vocab], summed over the devices into parts of its embedding
        axis (a reduce-scatter, as FSDP keeps the kernel), not into a whole copy on each device."""
        return self.layout(gradient, ("batch", "vocab"))


def scaled_last(x, norm, temperature=None, last_only: bool = False):
    """A language model's last hidden states [batch, seq, embed] as its head takes them: the
    final `norm` of the last position alone where `last_only` (a prompt's next token: sliced
    before the norm, so that it is computed as a decoding step's), divided by `temperature`
    (None: as they are). The head is linear without a bias, so (h / T) W = (h W) / T: logits and
    the fused loss of the temperature-scaled distribution, the loss's chunks and VJP unchanged.
    (With a temperature the models' heads give float32 logits made as the loss makes them:
    sampled log-probabilities then equal the update's in any compute dtype.)"""
    x = norm(x[:, -1:] if last_only else x)
    if temperature is None:
        return x
    return (x.astype(jnp.float32) / temperature).astype(x.dtype)


def kv_cache(module: nn.Module, k, v, segment_ids):
    """A decoding attention layer's key/value cache, in `module`'s `cache` collection: writes
    this call's keys and values into the cache's next slots (the cache keeps its own fill
    level, `cache_index`) → (all cached keys, values, mask [batch, 1, new, slots]). A query
    sees the filled slots up to its own whose segment id is its own: a batch of prompts of
    different lengths, left-padded with segment 0, attends to no padding (positions, given
    apart from slots, start at 0 at each prompt's first token: models/sampling.py)."""
    cached_k = module.variable("cache", "cached_key", jnp.zeros, k.shape, k.dtype)  # sized by the first call
    cached_v = module.variable("cache", "cached_value", jnp.zeros, v.shape, v.dtype)
    cached_segment = module.variable("cache", "cached_segment", jnp.zeros, k.shape[:2], jnp.int32)
    index = module.variable("cache", "cache_index", lambda: jnp.zeros((), jnp.int32))
    if module.is_initializing():
        return k, v, jnp.ones((k.shape[0], 1, k.shape[1], k.shape[1]), bool)
    if segment_ids is None:
        segment_ids = jnp.ones(k.shape[:2], jnp.int32)
    start, new = index.value, k.shape[1]
    cached_k.value = jax.lax.dynamic_update_slice_in_dim(cached_k.value, k, start, axis=1)
    cached_v.value = jax.lax.dynamic_update_slice_in_dim(cached_v.value, v, start, axis=1)
    cached_segment.value = jax.lax.dynamic_update_slice_in_dim(
        cached_segment.value, segment_ids.astype(jnp.int32), start, axis=1
    )
    index.value = start + new
    slots = jnp.arange(cached_k.value.shape[1])
    causal = slots[None, :] <= (start + jnp.arange(new))[:, None]  # [new, slots]: and only what is filled
    same = cached_segment.value[:, None, :] == segment_ids[:, :, None]  # [batch, new, slots]
    return cached_k.value, cached_v.value, (causal[None] & same)[:, None]
