"""`launch.py sample --workdir DIR --prompt TEXT`: text from the newest checkpoint of a run,
by the model family's generator (a key/value cache, jitted). Token ids become text by the
run's data: byte-level text sources decode UTF-8 bytes, tokenized corpora their tokenizer."""

from __future__ import annotations

import math
from pathlib import Path

import jax.numpy as jnp

from engine.checkpoint import restore_newest
from engine.errors import UsageError
from engine.export import run_config, run_tokenizer
from engine.setup import build_run


def sample(
    workdir: str, prompt: str, max_tokens: int = 200, temperature: float = 0.8, top_p: float = 0.95, seed: int = 0
) -> str:
    """The text generated after `prompt` (the prompt itself not included)."""
    work = Path(workdir)
    if max_tokens < 1 or not math.isfinite(temperature) or temperature < 0 or not 0 < top_p <= 1:
        raise UsageError(
            f"--max-tokens {max_tokens} must be >= 1, --temperature {temperature} a finite number >= 0 and "
            f"--top-p {top_p} in (0, 1]"
        )
    cfg = run_config(work)
    run = build_run(cfg, compile_train=False)
    family, info = run.model.family, run.dataset.info
    generate = family.generator()
    if generate is None:
        raise UsageError(
            f"model.name={cfg.model.name} does not generate text; train a language model such as model.name=llama"
        )
    if info.text_codec not in ("bytes", "tokenizer"):
        raise UsageError(
            f"data.name={cfg.data.name} gives token ids with no text decoding; sample from a run "
            f"trained on text (data.name=text, python_source or tokens)"
        )
    if info.text_codec == "tokenizer":
        from tokenizers import Tokenizer

        path = run_tokenizer(work, info)
        if path is None:
            raise UsageError(
                f"{work} has no tokenizer.json and its corpus's ({info.tokenizer}) is gone; copy the "
                f"corpus's tokenizer.json into {work}"
            )
        tokenizer = Tokenizer.from_file(str(path))
        encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
        decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    else:
        encode = lambda text: list(text.encode("utf-8"))  # noqa: E731
        decode = lambda ids: bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")  # noqa: E731
    restored = restore_newest(work, run.abstract_state, cfg, "sample from")
    tokens = generate(
        cfg.model,
        info,
        restored.state.params,
        encode(prompt),
        max_tokens,
        temperature,
        top_p,
        seed,
        jnp.dtype(cfg.train.compute_dtype),
    )
    return decode(tokens)
