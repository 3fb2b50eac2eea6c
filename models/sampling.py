"""Text generation with a key/value cache: a jitted prefill of the prompt, then one jitted
step per new token. Greedy at temperature 0; otherwise temperature and nucleus (top-p)
sampling, with the key of token i drawn from fold_in(key(seed), i): deterministic for a seed.

Works with any module that takes `decode=True`-style caching through the `cache`
collection and `positions=` (models/llama.py); `generate` is what a family's LanguageModel
names as its generator (models/family.py)."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np


def next_token(logits, key, temperature: float, top_p: float):
    """logits [batch, vocab] (float32) → token ids [batch]."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, nucleus(logits / temperature, top_p), axis=-1).astype(jnp.int32)


def nucleus(logits, top_p: float):
    """logits [batch, vocab] with -inf outside the smallest set of most likely tokens whose
    probability mass reaches top_p (top-p 1: as they are)."""
    if top_p >= 1.0:
        return logits
    order = jnp.argsort(-logits, axis=-1)
    sorted_probs = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), order, axis=-1)
    before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs  # mass of the tokens ranked above
    drop_sorted = before >= top_p
    drop = jnp.zeros_like(drop_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(drop_sorted)
    return jnp.where(drop, -jnp.inf, logits)


def generate(
    module,
    params,
    prompts: list[list[int]],
    max_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_ids: Sequence[int] = (),
    num_samples: int = 1,
    on_step: Optional[Callable[[list[int]], Optional[Sequence[bool]]]] = None,
) -> list[list[int]]:
    """`num_samples` continuations of each of `prompts`, drawn together (one batch, one jitted
    step per token), prompt by prompt: sample j of prompt i is row i * num_samples + j; a
    prompt gives what it gives alone (left_padded). A sample ends after an id in `stop_ids`
    (kept), or where `on_step`, given each step's ids, answers True for it (a stop string)."""
    if not prompts or not all(prompts):
        raise ValueError("a prompt is empty: give at least one token (a character of text)")
    rows = [prompt for prompt in prompts for _ in range(num_samples)]
    tokens, positions, segments = left_padded(rows)
    width = tokens.shape[1]
    shapes = jax.eval_shape(
        lambda: module.init(jax.random.key(0), jnp.zeros((len(rows), width + max_tokens), jnp.int32), train=False)
    )
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["cache"])
    base_key = jax.random.key(seed)

    @jax.jit
    def step(params, cache, tokens, positions, segments, index):
        logits, updated = module.apply(
            {"params": params, "cache": cache},
            tokens,
            train=False,
            positions=positions,
            segment_ids=segments,
            mutable=["cache"],
        )
        token = next_token(logits[:, -1].astype(jnp.float32), jax.random.fold_in(base_key, index), temperature, top_p)
        return token, updated["cache"]

    # prefill: every prompt at once
    token, cache = step(params, cache, tokens, positions, segments, jnp.int32(0))
    lengths, ones = jnp.asarray([len(row) for row in rows], jnp.int32)[:, None], jnp.ones((len(rows), 1), jnp.int32)
    stop = set(stop_ids)
    out: list[list[int]] = [[] for _ in rows]
    ended = [False] * len(rows)
    for i in range(1, max_tokens + 1):
        ids = [int(t) for t in jax.device_get(token)]
        for row, new in enumerate(ids):
            if not ended[row]:
                out[row].append(new)
                ended[row] = new in stop
        told = on_step(ids) if on_step is not None else None
        ended = [e or bool(t) for e, t in zip(ended, told or [False] * len(rows))]
        if all(ended) or i == max_tokens:
            break
        token, cache = step(params, cache, token[:, None], lengths + i - 1, ones, jnp.int32(i))
    return out


def left_padded(rows: list[list[int]]):
    """(tokens, positions, segment ids) [rows, longest] of prompts padded on the left: the
    padding is segment 0 at position 0, each prompt segment 1 with positions from 0."""
    width = max(map(len, rows))
    pads = np.asarray([width - len(row) for row in rows], np.int32)[:, None]
    tokens = np.asarray([[0] * int(pad) + row for pad, row in zip(pads[:, 0], rows)], np.int32)
    segments = (np.arange(width)[None, :] >= pads).astype(np.int32)
    positions = np.maximum(np.arange(width)[None, :] - pads, 0).astype(np.int32)
    return jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segments)


def greedy_without_cache(module, params, prompt: list[int], max_tokens: int) -> list[int]:
    """The reference: the whole sequence through the model again for every new token (argmax)."""
    sequence = list(prompt)
    for _ in range(max_tokens):
        logits = module.apply({"params": params}, jnp.asarray([sequence], jnp.int32), train=False)
        sequence.append(int(np.argmax(np.asarray(logits[0, -1], np.float32))))
    return sequence[len(prompt) :]
