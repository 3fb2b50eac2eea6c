"""Rollouts for reinforcement learning (train.objective=grpo): completions of a batch of prompts
drawn by one program compiled once, and the log-probabilities the update recomputes for them.

The API (stable; docs/design/grpo.md section 3):

- `DecodeSpec(max_prompt_tokens P, max_completion_tokens C, temperature, top_p, top_k, stop_ids,
  pad_id)`: the static shapes and the sampling of one decode program.
- `build_decode(module, spec, params, batch, data_sharding=None) -> Decode`: lowers and compiles
  `decode_rollout` once, for `batch` rows and the shardings `params` carry (arrays, or
  ShapeDtypeStructs with `.sharding`); `decode(params, prompt_tokens, prompt_mask, key) ->
  Rollout` never compiles again (other shapes or shardings raise). `module` is the family's model
  built with `decode=True` (a key/value cache), with the run's LoRA adaptation where it has one;
  `params` its flax params: under LoRA the frozen base and the current adapters in one tree
  (engine/run/step.py `model_variables(state.params, state.model_state)["params"]`: the arrays
  themselves, nothing copied). `Decode.compiled.memory_analysis()` is the program's memory.
- `Rollout(completion_tokens int32[B, C], logprobs float32[B, C], completion_mask bool[B, C],
  stopped bool[B])`: a row ends after its first stop id (kept, and in the mask); after it the
  tokens are `pad_id`, masked, with log-probability 0; `stopped` False: it ran to C tokens
  (TRL's `completions/clipped_ratio`). `logprobs`: float32 log_softmax(logits / temperature) of
  the drawn token, recorded as it is drawn, of the temperature-scaled distribution before top-k
  and top-p filtering (TRL's `_get_per_token_logps_and_entropies`).
- `completion_logprobs(module, params, prompt_tokens, prompt_mask, completion_tokens,
  completion_mask, temperature) -> float32[B, C]`: the same log-probabilities from one forward pass
  of the (non-decoding) module over prompt + completion, differentiable (the fused loss and its
  VJP); 0 outside the mask. `update_inputs` gives that pass's inputs for a caller that applies the
  module itself (other collections, dropout), `logprobs_of` reads its losses.
- `left_pad(prompts, width, pad_id)`: token lists → (prompt_tokens, prompt_mask) at width P.
- `rollout_key(rng, step)`: the decode's key from the state's key data and the step.

Layout (MaxText #4016: pads leaking into attention corrupted log-probs): prompts are left-padded
to P; the mask, never the pad id, says what is a pad: pads are segment 0 (no real token attends
to them), prompt and completion tokens segment 1, positions count from each row's first real
token. Every row needs at least one prompt token. The decode loop runs on the device
(`lax.while_loop` until every row has stopped or C tokens: no host sync per token); the key of
completion token i is fold_in(key, i), so the key given is everything: same key, same tokens."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from models.sampling import nucleus

ROLLOUT = 0x524C  # rollout_key's stream, apart from dropout's fold_in(rng, step)


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """The static shapes and the sampling of one decode program."""

    max_prompt_tokens: int  # P: prompts are left-padded to it
    max_completion_tokens: int  # C: tokens drawn at most per row
    temperature: float = 1.0  # > 0: tokens are drawn from softmax(logits / temperature)
    top_p: float = 1.0  # in (0, 1]: the nucleus drawn from (1: all)
    top_k: int = 0  # the k most likely drawn from (0: all)
    stop_ids: tuple[int, ...] = ()  # a row ends after emitting one (end-of-turn, end-of-text)
    pad_id: int = 0  # the token after a row's end, and the prompts' padding

    def __post_init__(self) -> None:
        problems = [
            f"{name}={value} must be {rule}"
            for name, value, rule, ok in (
                ("max_prompt_tokens", self.max_prompt_tokens, ">= 1", self.max_prompt_tokens >= 1),
                ("max_completion_tokens", self.max_completion_tokens, ">= 1", self.max_completion_tokens >= 1),
                (
                    "temperature",
                    self.temperature,
                    "a finite number > 0",
                    math.isfinite(self.temperature) and self.temperature > 0,
                ),
                ("top_p", self.top_p, "in (0, 1]", 0 < self.top_p <= 1),
                ("top_k", self.top_k, ">= 0", self.top_k >= 0),
            )
            if not ok
        ]
        if problems:
            raise ValueError(f"decode settings: {problems[0]}")
        object.__setattr__(self, "stop_ids", tuple(int(t) for t in self.stop_ids))


class Rollout(NamedTuple):
    completion_tokens: jax.Array  # int32 [B, C]
    logprobs: jax.Array  # float32 [B, C]
    completion_mask: jax.Array  # bool [B, C]
    stopped: jax.Array  # bool [B]: ended at a stop id (else it ran to C tokens)


def _prompt_layout(prompt_mask):
    """(segment ids [B, P], positions [B, P], real tokens [B]) of left-padded prompts."""
    segments = prompt_mask.astype(jnp.int32)
    positions = jnp.maximum(jnp.cumsum(segments, axis=1) - 1, 0)
    return segments, positions, segments.sum(axis=1)


def filtered(logits, top_k: int, top_p: float):
    """logits [B, V] with -inf outside the top_k most likely (0: all), then outside the top_p
    nucleus (Hugging Face's order: temperature, top-k, top-p)."""
    if 0 < top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return nucleus(logits, top_p)


def _cache(module, rows: int, width: int):
    """The decoding module's key/value cache for `rows` × `width` slots, empty."""
    shapes = jax.eval_shape(lambda: module.init(jax.random.key(0), jnp.zeros((rows, width), jnp.int32), train=False))
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["cache"])


def decode_rollout(module, spec: DecodeSpec, params, prompt_tokens, prompt_mask, key) -> Rollout:
    """The rollout of left-padded prompts (traceable: build_decode compiles it)."""
    rows, width = prompt_tokens.shape
    steps, temperature = spec.max_completion_tokens, spec.temperature
    segments, positions, lengths = _prompt_layout(prompt_mask)
    stops = jnp.asarray(spec.stop_ids or (-1,), jnp.int32)

    def forward(cache, tokens, positions, segments, last_only):
        logits, updated = module.apply(
            {"params": params, "cache": cache},
            tokens,
            train=False,
            positions=positions,
            segment_ids=segments,
            temperature=temperature,
            last_only=last_only,
            mutable=["cache"],
        )
        return logits[..., -1, :].astype(jnp.float32), updated["cache"]

    def draw(i, logits, done, out):
        tokens, logps, mask = out
        token = jax.random.categorical(jax.random.fold_in(key, i), filtered(logits, spec.top_k, spec.top_p), axis=-1)
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), token[:, None], axis=-1)[..., 0]
        active = ~done
        token = jnp.where(active, token.astype(jnp.int32), spec.pad_id)
        out = (tokens.at[:, i].set(token), logps.at[:, i].set(jnp.where(active, logp, 0.0)), mask.at[:, i].set(active))
        return token, done | (active & jnp.isin(token, stops)), out

    cache = _cache(module, rows, width + steps)
    logits, cache = forward(cache, prompt_tokens.astype(jnp.int32), positions, segments, True)
    empty = (jnp.full((rows, steps), spec.pad_id, jnp.int32), jnp.zeros((rows, steps), jnp.float32))
    token, done, out = draw(0, logits, jnp.zeros((rows,), bool), (*empty, jnp.zeros((rows, steps), bool)))

    def more(carry):
        i, _, _, done, _ = carry
        return (i < steps) & ~jnp.all(done)

    def step(carry):
        i, token, cache, done, out = carry
        at = (lengths + i - 1)[:, None]  # the previous token's position
        logits, cache = forward(cache, token[:, None], at, jnp.ones((rows, 1), jnp.int32), False)
        token, done, out = draw(i, logits, done, out)
        return i + 1, token, cache, done, out

    _, _, _, done, (tokens, logps, mask) = jax.lax.while_loop(more, step, (jnp.int32(1), token, cache, done, out))
    return Rollout(tokens, logps, mask, done)


class Decode:
    """build_decode's program: decode(params, prompt_tokens, prompt_mask, key) → Rollout."""

    def __init__(self, compiled, spec: DecodeSpec, batch: int, seconds: float):
        self.compiled, self.spec, self.batch, self.compile_seconds = compiled, spec, batch, seconds

    def __call__(self, params, prompt_tokens, prompt_mask, key) -> Rollout:
        return self.compiled(params, prompt_tokens, prompt_mask, key)


def _abstract(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))


def build_decode(module, spec: DecodeSpec, params, batch: int, data_sharding=None) -> Decode:
    """decode_rollout compiled once for `batch` prompts of spec's widths and the shardings of
    `params` (arrays or ShapeDtypeStructs); `data_sharding` (e.g. engine/parallel/sharding.py
    batch_sharding): the prompts' and the rollout's (None: as XLA places them); the key replicated."""
    started = time.perf_counter()
    context = getattr(module, "max_len", None)  # a learned position table (models/transformer.py)
    if context is not None and spec.max_prompt_tokens + spec.max_completion_tokens > context:
        raise ValueError(
            f"max_prompt_tokens + max_completion_tokens = {spec.max_prompt_tokens + spec.max_completion_tokens} "
            f"exceed the model's {context} positions; shorten them"
        )
    shape = (batch, spec.max_prompt_tokens)
    key = jax.eval_shape(lambda: jax.random.key(0))
    mesh = getattr(data_sharding, "mesh", None)
    if mesh is not None:
        whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=whole)
    program = jax.jit(
        lambda p, t, m, k: decode_rollout(module, spec, p, t, m, k),
        out_shardings=None if data_sharding is None else Rollout(*(data_sharding,) * 4),
    )
    compiled = program.lower(
        jax.tree.map(_abstract, params),
        jax.ShapeDtypeStruct(shape, jnp.int32, sharding=data_sharding),
        jax.ShapeDtypeStruct(shape, jnp.bool_, sharding=data_sharding),
        key,
    ).compile()
    return Decode(compiled, spec, batch, time.perf_counter() - started)


def update_inputs(prompt_tokens, prompt_mask, completion_tokens, pad_id: int = 0) -> tuple[Any, dict]:
    """(tokens [B, P + C], the module's keyword arguments: targets, positions, segment_ids) of the
    update's forward pass over left-padded prompts and their completions: the target of position
    j is token j + 1 (the last position's a pad: P + C positions, a width the loss's chunks divide
    as the configured sequences'); the completion's positions follow its prompt's."""
    rows, width = prompt_tokens.shape
    steps = completion_tokens.shape[1]
    segments, positions, lengths = _prompt_layout(prompt_mask)
    tokens = jnp.concatenate([prompt_tokens, completion_tokens], axis=1).astype(jnp.int32)
    targets = jnp.concatenate([tokens[..., 1:], jnp.full((rows, 1), pad_id, jnp.int32)], axis=1)
    segments = jnp.concatenate([segments, jnp.ones((rows, steps), jnp.int32)], axis=1)
    positions = jnp.concatenate([positions, lengths[:, None] + jnp.arange(steps, dtype=jnp.int32)], axis=1)
    return tokens, {"targets": targets, "positions": positions, "segment_ids": segments}


def logprobs_of(losses, prompt_width: int, completion_mask):
    """The completion's log-probabilities [B, C] from the update pass's per-target losses [B, P + C]."""
    steps = completion_mask.shape[1]
    logps = -jax.lax.dynamic_slice_in_dim(losses, prompt_width - 1, steps, axis=1)
    return jnp.where(completion_mask, logps, 0.0)


def completion_logprobs(module, params, prompt_tokens, prompt_mask, completion_tokens, completion_mask, temperature):
    """float32 [B, C]: log_softmax(logits / temperature)[token] of each completion token, by one
    forward pass of `module` (not decoding) over prompt + completion; differentiable in params."""
    tokens, extra = update_inputs(prompt_tokens, prompt_mask, completion_tokens)
    losses, _ = module.apply({"params": params}, tokens, train=False, temperature=temperature, **extra)
    return logprobs_of(losses, prompt_tokens.shape[1], completion_mask)


def left_pad(prompts: Sequence[Sequence[int]], width: int, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(prompt_tokens int32 [B, width], prompt_mask bool [B, width]) of token lists padded on the
    left; ValueError for an empty prompt or one longer than `width`."""
    for i, prompt in enumerate(prompts):
        if not 0 < len(prompt) <= width:
            raise ValueError(f"prompt {i} has {len(prompt)} tokens: give 1 to {width} (max_prompt_tokens)")
    tokens = np.full((len(prompts), width), pad_id, np.int32)
    mask = np.zeros((len(prompts), width), bool)
    for i, prompt in enumerate(prompts):
        tokens[i, width - len(prompt) :] = prompt
        mask[i, width - len(prompt) :] = True
    return tokens, mask


def rollout_key(rng, step, generation: Optional[int] = None):
    """The decode's key at a step from the state's key data (`rng`, a uint32 array as
    TrainState.rng, or a typed key): fold_in(fold_in(key, ROLLOUT), step), then `generation`
    where given; a function of (seed, step) alone, so a resumed run draws the same tokens."""
    key = rng if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key) else jax.random.wrap_key_data(rng)
    key = jax.random.fold_in(jax.random.fold_in(key, ROLLOUT), step)
    return key if generation is None else jax.random.fold_in(key, generation)
