"""Helpers of tests/**/test_tokens*.py that other test files (or its other tiers) share."""

import numpy as np
import pytest

from engine.data.pretokenize import tokenize

WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
    "upsilon phi chi psi omega"
).split()


def _text(rng, words: int) -> str:
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), words)) + "."


def tokenized_corpus(base, seed: int, documents: int = 60):
    """A small corpus of `documents` files under base/text, tokenized with a 300-token BPE into
    base/tokens (10% held out); returns that directory."""
    from engine.data.pretokenize import tokenize

    tokenize(
        [str(_corpus_files(base / "text", documents, seed=seed))],
        str(base / "tokens"),
        "bpe:300",
        eval_fraction=0.1,
        progress=False,
    )
    return base / "tokens"


def _corpus_files(directory, documents=40, seed=0):
    """A directory of text documents of varied lengths (one per file)."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(documents):
        (directory / f"doc{i:03d}.txt").write_text(_text(rng, int(rng.integers(5, 120))))
    return directory


@pytest.fixture(scope="module")
def two_corpora(tmp_path_factory):
    base = tmp_path_factory.mktemp("corpora")
    tokenize(
        [str(_corpus_files(base / "a_text", 80, seed=1))], str(base / "a"), "bpe:300", eval_fraction=0.1, progress=False
    )
    tokenizer = str(base / "a" / "tokenizer.json")  # one tokenizer for both: a mixture shares it
    tokenize(
        [str(_corpus_files(base / "b_text", 80, seed=2))], str(base / "b"), tokenizer, eval_fraction=0.1, progress=False
    )
    return base / "a", base / "b"


LLAMA_TOKENS = [
    "model.num_layers=2",
    "model.d_model=32",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.mlp_dim=64",
    "data.name=tokens",
    "data.seq_len=16",
    "train.global_batch_size=8",
    "optimizer.warmup_steps=2",
    "log.every_steps=1",
    "log.progress=false",
    "log.tensorboard=false",
    "eval.every_steps=0",
    "data.steps_per_transfer=1",
]
