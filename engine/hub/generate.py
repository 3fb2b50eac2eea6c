"""`launch.py sample --workdir DIR --prompt TEXT`: text from the newest checkpoint of a run,
by the compiled decode (engine/lm/rollouts.py: one program, the token loop on the device) where it
serves the request, else by the model family's generator (models/sampling.py: a key/value cache,
a jitted step per token and a host sync after each). The compiled decode serves every request of a
family whose generator is models/sampling.py's (llama, transformer) but one with stop strings
(`--stop`: text found on the host after each token); both draw token i of a row with the key
fold_in(key(seed), i) from the same distribution (greedy: the same tokens). Token ids become text
by the run's data: byte-level text sources decode UTF-8 bytes, tokenized corpora their tokenizer."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from engine.checkpoint.store import restore_newest
from engine.data.recorded import recorded_shape
from engine.errors import UsageError
from engine.hub.inference import run_config
from engine.lm import finetune
from engine.lm.rollouts import DecodeSpec, build_decode, left_pad
from engine.lm.tokenizer import (
    TOKENIZER,
    check_data_tokenizer,
    context_length,
    eos_ids,
    load_tokenizer_file,
    run_tokenizer,
)
from engine.run.setup import build_run, device_memory_bytes
from engine.runtime.units import human_bytes
from engine.state.train_state import model_variables
from models import sampling
from models.family import BuildOptions, projections

DEFAULT_TOKENS = 200  # new tokens of a sample when --max-tokens is not given (the context permitting)
# A prompt of more characters than context x this cannot fit the context: text averages 3 to 5
# characters a token, and no tokenizer in use averages 64. Refused before it is tokenized.
CHARS_PER_TOKEN = 64
# Of one device's memory (on CPU: this host's RAM, engine/run/setup.py device_memory_bytes), what
# the run's state, the key/value cache and the prompts' logits may take together; the other half
# is left to the steps' temporaries (the prompt's attention scores) and, on CPU, to the host.
MEMORY_FRACTION = 0.5


def sample(
    workdir: str,
    prompts: Sequence[str],
    max_tokens: Optional[int] = None,
    temperature: float = 0.8,
    top_p: float = 0.95,
    seed: int = 0,
    stop_at_eos: bool = True,
    num_samples: int = 1,
    stop_strings: Sequence[str] = (),
    step: Optional[str] = None,
    compiled: bool = True,
) -> list[str]:
    """`num_samples` texts generated after each of `prompts` (the prompt itself not included),
    prompt by prompt, all drawn together in one batch. Each ends at the tokenizer's end-of-text
    token (not included) unless `stop_at_eos` is off, and before the first of `stop_strings` it
    contains; `max_tokens` None: 200, or fewer where the model's context ends sooner. `step`: the
    checkpoint (best or N; None: the newest). `compiled` False: the family's generator even where
    the compiled decode would serve (benchmarks/sample_paths.py compares them)."""
    work = Path(workdir)
    _check_settings(max_tokens, temperature, top_p, num_samples, stop_strings)
    cfg = run_config(work)
    run = build_run(cfg, compile_train=False, dataset=recorded_shape(cfg))  # (no data read: data.json)
    generate, info = _generator(cfg, run), run.dataset.info
    check_data_tokenizer(work / TOKENIZER, info, f"the run's data (data.name={cfg.data.name})")
    tokenizer, vocab, source, encode, decode = _codec(work, info)
    context, fits = context_length(work, info), _memory_check(cfg, run, num_samples, len(prompts))
    _check_characters(prompts, context)
    fits(1, max_tokens or 1, least=True)  # the least it could take: before tokenizing a long prompts file
    prompt_ids = [encode(prompt) for prompt in prompts]
    max_tokens = _budget([len(ids) for ids in prompt_ids], max_tokens, context)
    fits(max(map(len, prompt_ids)), max_tokens)
    stops = eos_ids(work, tokenizer) if stop_at_eos else []
    restored = restore_newest(work, run.abstract_state, cfg, "sample from", step)
    rows: list[list[int]] = [[] for _ in range(num_samples * len(prompts))]
    tail = 4 * max(map(len, stop_strings), default=0) + 4  # a stop string's tokens: ≤ 4 per character

    def on_step(ids: list[int]) -> Optional[list[bool]]:
        bar.update(1)
        for row, new in zip(rows, ids):
            row.append(new)
        if not stop_strings:
            return None
        return [any(stop in decode([t for t in row[-tail:] if t < vocab]) for stop in stop_strings) for row in rows]

    params = model_variables(restored.state.params, restored.state.model_state)["params"]
    decoder = _decoder(cfg, run, jax.tree.leaves(params)[0].dtype, adapted=True)
    settings = (max_tokens, temperature, top_p, seed)
    if compiled and not stop_strings and generate is sampling.generate:  # (the loop on the device)
        samples = compiled_samples(decoder, params, prompt_ids, *settings, stops, num_samples)
    else:  # (a stop string is found in the text on the host, token by token)
        with _progress(max_tokens) as bar:
            samples = generate(
                decoder, params, prompt_ids, *settings, stop_ids=stops, num_samples=num_samples, on_step=on_step
            )
    _check_ids(samples, vocab, source)
    return [_cut(decode(tokens[:-1] if tokens and tokens[-1] in stops else tokens), stop_strings) for tokens in samples]


def compiled_samples(
    decoder, params, prompts: list[list[int]], max_tokens: int, temperature: float, top_p: float, seed: int,
    stop_ids: Sequence[int], num_samples: int,
) -> list[list[int]]:  # fmt: skip
    """models/sampling.py generate's rows (sample j of prompt i: row i * num_samples + j, each ending
    after its first stop id, kept) by the compiled decode (engine/lm/rollouts.py), for prompts
    left-padded to the longest: greedy (temperature 0) as its top-1, else temperature and top-p
    with generate's keys (token i: fold_in(key(seed), i))."""
    rows = [prompt for prompt in prompts for _ in range(num_samples)]
    greedy = temperature == 0
    spec = DecodeSpec(
        max(map(len, rows)),
        max_tokens,
        1.0 if greedy else temperature,
        1.0 if greedy else top_p,
        1 if greedy else 0,
        tuple(stop_ids),
    )
    tokens, mask = left_pad(rows, spec.max_prompt_tokens)
    program = build_decode(decoder, spec, params, len(rows))
    rollout = jax.device_get(program(params, tokens, mask, jax.random.key(seed)))
    return [row[keep].tolist() for row, keep in zip(rollout.completion_tokens, rollout.completion_mask)]


def _check_settings(max_tokens, temperature, top_p, num_samples, stop_strings) -> None:
    bad_count = (max_tokens is not None and max_tokens < 1) or num_samples < 1 or "" in stop_strings
    if bad_count or not math.isfinite(temperature) or temperature < 0 or not 0 < top_p <= 1:
        raise UsageError(
            f"--max-tokens {max_tokens} and --num-samples {num_samples} must be >= 1, --temperature "
            f"{temperature} a finite number >= 0, --top-p {top_p} in (0, 1] and each --stop non-empty"
        )


def _check_characters(prompts: Sequence[str], context: int) -> None:
    """UsageError for a prompt too long to fit the context by its characters alone (a tokenizer
    given a 1 GB line aborts the process)."""
    limit = context * CHARS_PER_TOKEN
    longest = max(map(len, prompts), default=0)
    if longest > limit:
        number = next(i for i, prompt in enumerate(prompts, 1) if len(prompt) == longest)
        raise UsageError(
            f"prompt {number} has {longest:,} characters: more than the model's context of {context} tokens holds "
            f"at {CHARS_PER_TOKEN} characters a token ({limit:,}); shorten it (prompt and --max-tokens must fit "
            f"{context} tokens)"
        )


def _memory_check(cfg, run, num_samples: int, prompts: int):
    """check(prompt tokens, new tokens): UsageError unless the key/value cache and the prompts'
    logits of every sample of every prompt (one batch), beside the run's state, fit in
    MEMORY_FRACTION of a device's memory; checked from shapes, before anything is allocated."""
    params = jax.tree.leaves(run.abstract_state.params)
    # the generator's decoder on one token of one row: its cache leaves
    # [(layers,) batch, slots, ...] give the bytes a row holds per token
    decoder = _decoder(cfg, run, params[0].dtype)
    logits, variables = jax.eval_shape(
        lambda: decoder.init_with_output(jax.random.key(0), jnp.zeros((1, 1), jnp.int32), train=False)
    )
    per_token = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(variables["cache"]) if leaf.ndim >= 2)
    per_prompt_token = logits.size * logits.dtype.itemsize  # the prefill's logits [rows, prompt, vocab]
    device = device_memory_bytes(run.mesh)
    state = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(run.abstract_state))
    room = int(MEMORY_FRACTION * device) - state
    rows = num_samples * prompts

    def check(prompt: int, new: int, least: bool = False) -> None:
        row = (prompt + new) * per_token + prompt * per_prompt_token
        if rows * row <= room:
            return
        fit = max(room // row, 0)
        raise UsageError(
            f"{rows:,} rows (--num-samples {num_samples} x {prompts:,} prompt(s)) of {prompt} prompt + {new} new "
            f"tokens{' (at least)' if least else ''} need {human_bytes(rows * row)} for the key/value cache and "
            f"the prompts' logits, more than the {human_bytes(max(room, 0))} generation may take here "
            f"({MEMORY_FRACTION:.0%} of a device's {human_bytes(device)}, less the run's state, "
            f"{human_bytes(state)}); {fit:,} rows fit: give fewer --num-samples, fewer prompts per --prompts "
            f"file, or a smaller --max-tokens"
        )

    return check


def _decoder(cfg, run, param_dtype, adapted: bool = False):
    """The run's model with a key/value cache (`decode=True`), with the run's LoRA adapters and
    quantised matmuls where `adapted`."""
    family = run.model.family
    options = BuildOptions(adaptation=finetune.adaptation(cfg, projections(family))) if adapted else BuildOptions()
    return family.build(
        cfg.model, run.dataset.info, jnp.dtype(cfg.train.compute_dtype), param_dtype, options, decode=True
    )


def _generator(cfg, run):
    """The run's family's text generator; UsageError for a model or data that makes no text."""
    language_model = run.model.family.language_model
    generate = language_model.generate if language_model else None
    if generate is None:
        raise UsageError(
            f"model.name={cfg.model.name} does not generate text; train a language model such as model.name=llama"
        )
    if run.dataset.info.text_codec not in ("bytes", "tokenizer"):
        raise UsageError(
            f"data.name={cfg.data.name} gives token ids with no text decoding; sample from a run "
            f"trained on text (data.name=text, python_source or tokens)"
        )
    return generate


def _budget(lengths: list[int], max_tokens: Optional[int], context: int) -> int:
    """New tokens to generate after prompts of `lengths` tokens, within the model's context."""
    if not lengths:
        raise UsageError("no prompt: give --prompt TEXT, or --prompts FILE with one prompt per line")
    if not all(lengths):
        raise UsageError(f"prompt {lengths.index(0) + 1} is empty; give at least one character of text")
    prompt = max(lengths)
    if max_tokens is None:
        return max(1, min(DEFAULT_TOKENS, context - prompt))
    if prompt + max_tokens > context:
        room = context - prompt
        raise UsageError(
            f"--max-tokens {max_tokens}: the {'longest ' if len(lengths) > 1 else ''}prompt's {prompt} tokens "
            f"and {max_tokens} new ones exceed the "
            f"model's context of {context} tokens (what it was trained at); "
            + (f"give --max-tokens {room} or less" if room > 0 else "give a shorter --prompt")
        )
    return max_tokens


def _check_ids(samples: list[list[int]], vocab: int, source: str) -> None:
    """UsageError for generated ids the tokenizer does not have (nothing is printed wrong)."""
    outside = sorted({t for tokens in samples for t in tokens if t >= vocab})
    if outside:
        raise UsageError(
            f"the model generated token ids {outside[:5]} that its tokenizer ({source}, {vocab} ids) does not "
            f"have: the model and the tokenizer do not belong together. Import a model with its tokenizer.json "
            f"in the Hugging Face directory, or train on data tokenized for it"
        )


def _codec(work: Path, info):
    """(tokenizer or None, ids it has, its name, text → ids, ids → text) of the run's model."""
    if info.text_codec != "tokenizer":
        encode = lambda text: list(text.encode("utf-8"))  # noqa: E731
        return None, 256, "UTF-8 bytes", encode, lambda ids: bytes(ids).decode("utf-8", errors="replace")
    path = run_tokenizer(work, info)
    if path is None:
        raise UsageError(
            f"{work} has no tokenizer.json and its corpus's ({info.tokenizer}) is gone; copy the "
            f"corpus's tokenizer.json into {work}"
        )
    tokenizer = load_tokenizer_file(path, f"copy the model's tokenizer.json into {work}")  # (its size checked first)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    return tokenizer, tokenizer.get_vocab_size(), str(path), encode, decode


def _cut(text: str, stop_strings: Sequence[str]) -> str:
    """`text` up to the first of `stop_strings` in it (not included)."""
    ends = [text.find(stop) for stop in stop_strings if stop in text]
    return text[: min(ends)] if ends else text


def _progress(total: int):
    """A progress bar on a terminal's stderr for generations long enough to wait for."""
    from tqdm import tqdm

    return tqdm(
        total=total, unit="tok", desc="sample", file=sys.stderr, leave=False, disable=True if total < 64 else None
    )
