"""Tokenized corpora: the tokenize command (formats, resume, bad input), the Grain-backed
`tokens` source (packing, mixtures), and training on it (exact resume after SIGKILL)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support import tokens as tokens_helpers
from support.tokens import LLAMA_TOKENS, tokenized_corpus

from engine.run.setup import build_run
from engine.runtime.rundir import read_records

two_corpora = tokens_helpers.two_corpora  # the fixture


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "transformer"])
def test_no_token_attends_across_a_document_boundary(model):
    """Changing one document leaves the losses of the other documents in its window unchanged."""
    from engine.data.sources import DataInfo
    from models import REGISTRY

    family = REGISTRY[model]
    fields = {
        "llama": dict(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, mlp_dim=64),
        "transformer": dict(num_layers=2, d_model=32, num_heads=4, mlp_dim=64),
    }[model]
    cfg = family.config_cls(name=model, **fields)
    info = DataInfo("tokens", 1, 1, vocab_size=64, seq_len=16)
    module = family.build(cfg, info, jnp.float32, jnp.float32)
    segments = np.array([[1] * 5 + [2] * 6 + [3] * 4 + [0] * 2])  # 17 = seq_len + 1 tokens: 3 documents, padding
    positions = np.concatenate([np.arange(5), np.arange(6), np.arange(4), [0, 0]])[None]
    tokens = np.random.default_rng(0).integers(1, 64, (1, 17))
    batch = {"segments": jnp.asarray(segments), "positions": jnp.asarray(positions)}
    inputs, targets, extra = family.task.model_inputs({"tokens": jnp.asarray(tokens), **batch})
    params = module.init(jax.random.key(0), inputs, train=False)

    def losses(tokens, masked=True):
        inputs, targets, extra = family.task.model_inputs({"tokens": jnp.asarray(tokens), **batch})
        if not masked:
            extra = {"targets": targets}
        return np.asarray(module.apply(params, inputs, train=False, **extra)[0][0])

    changed = tokens.copy()
    changed[0, 6:10] = (changed[0, 6:10] + 7) % 63 + 1  # inside document 2
    before, after = losses(tokens), losses(changed)
    others = np.r_[0:4, 11:14]  # targets within documents 1 and 3
    np.testing.assert_allclose(after[others], before[others], rtol=1e-6, atol=1e-6)
    assert not np.allclose(after[5:10], before[5:10])  # document 2's own losses did change
    unmasked_before, unmasked_after = losses(tokens, masked=False), losses(changed, masked=False)
    assert not np.allclose(unmasked_after[11:14], unmasked_before[11:14])  # the check can fail without the mask
    weights = np.asarray(family.task.target_weights({"segments": jnp.asarray(segments)})[0])
    np.testing.assert_array_equal(weights, [1] * 4 + [0] + [1] * 5 + [0] + [1] * 3 + [0, 0])


@pytest.mark.slow
def test_gradient_accumulation_of_packed_mixtures_equals_one_big_batch(make_config, tmp_path, two_corpora):
    """Microbatches count different numbers of targets when documents are packed: the
    accumulated gradient is still the whole batch's."""
    from engine.run.single import fit

    a, b = two_corpora
    results = []
    for accum in (1, 4):
        cfg = make_config(
            "llama_tiny",
            *LLAMA_TOKENS,
            f"data.sources=[{{path: {a}, weight: 3}}, {{path: {b}}}]",
            "train.steps=4",
            "log.every_steps=2",
            "eval.every_steps=0",
            "checkpoint.every_steps=0",
            f"train.grad_accum_steps={accum}",
            "mesh.num_devices=1",
            workdir=tmp_path / str(accum),
        )
        fit(cfg)
        results.append([r for r in read_records(tmp_path / str(accum) / "metrics.jsonl") if r["split"] == "train"])
    for one, accumulated in zip(*results):
        np.testing.assert_allclose(
            [accumulated[k] for k in ("loss", "grad_norm", "share_a")],
            [one[k] for k in ("loss", "grad_norm", "share_a")],
            rtol=2e-5,
        )


def test_language_model_eval_gives_perplexity_and_bits_per_byte(tmp_path, make_config):
    import math

    from engine.run.evaluator import evaluate

    corpus = tokenized_corpus(tmp_path, seed=3, documents=30)
    manifest = json.loads((corpus / "manifest.json").read_text())
    text_bytes = sum(len(p.read_text().encode()) for p in (tmp_path / "text").iterdir())
    assert manifest["splits"]["train"]["bytes"] + manifest["splits"]["eval"]["bytes"] == text_bytes
    cfg = make_config("llama_tiny", "data.name=tokens", f"data.path={corpus}", "data.seq_len=16", "mesh.num_devices=1")
    run = build_run(cfg, compile_train=False)
    metrics = evaluate(run, run.init_state())
    assert metrics["perplexity"] == pytest.approx(math.exp(metrics["loss"]))
    per_token = manifest["splits"]["eval"]["bytes"] / manifest["splits"]["eval"]["tokens"]
    assert metrics["bits_per_byte"] == pytest.approx(metrics["loss"] / math.log(2) / per_token)
