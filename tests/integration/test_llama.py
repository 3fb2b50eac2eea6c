"""The Llama family: logits equal a plain-numpy implementation of the architecture (and
transformers' where it is installed), scanned = unscanned, generation with a key/value cache
equals step-by-step argmax, and Hugging Face checkpoints round-trip bit for bit."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.configs import QUIET, ROOT
from support.llama import (
    INFO,
    LLAMA,
    TINY,
    greedy_reference,
    ours_from_hf_dir,
    transformers_logits,
    write_hf_checkpoint,
)

from engine.config import load_config
from engine.parallel.sharding import unbox
from engine.run.cost import compiled_flops
from engine.run.setup import build_run
from engine.state.columns import unpack_metrics
from models import REGISTRY, sampling
from models.llama import LlamaConfig


def init(cfg: LlamaConfig, info=INFO, seed=0):
    module = REGISTRY["llama"].build(cfg, info, jnp.float32, jnp.float32)
    tokens = jnp.asarray(np.random.default_rng(seed).integers(0, info.vocab_size, (2, info.seq_len)), jnp.int32)
    params = unbox(module.init(jax.random.key(seed), tokens, train=False))["params"]
    # random norm scales, so that a mix-up of two norms would show
    params = jax.tree_util.tree_map_with_path(
        lambda path, p: (
            p * (1 + 0.3 * jax.random.normal(jax.random.key(7), p.shape))
            if "scale" in jax.tree_util.keystr(path)
            else p
        ),
        params,
    )
    return module, params, tokens


def numpy_llama(cfg: LlamaConfig, params, tokens: np.ndarray, vocab: int) -> np.ndarray:
    """The architecture written out in numpy, layer by layer (scanned parameters, float64)."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    heads, kv_heads, width = cfg.num_heads, cfg.kv_heads, cfg.head_width

    def rms(x, scale):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + cfg.norm_eps) * scale

    inv_freq = np.asarray(jax.device_get(__import__("models.llama", fromlist=["x"]).rope_frequencies(cfg)), np.float64)
    positions = np.arange(tokens.shape[1])
    angles = positions[:, None] * inv_freq[None, :]  # [seq, width / 2]
    cos, sin = np.cos(angles)[None, :, None, :], np.sin(angles)[None, :, None, :]

    def rope(x):  # halves of each head are the rotated pairs
        a, b = x[..., : width // 2], x[..., width // 2 :]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    x = p["embed"]["embedding"][tokens]  # [batch, seq, d]
    seq = tokens.shape[1]
    causal = np.tril(np.ones((seq, seq), bool))
    for layer in range(cfg.num_layers):
        w = jax.tree.map(lambda a: a[layer], p["layers"]["block"])
        y = rms(x, w["attn_norm"]["scale"])
        q = np.einsum("bsd,dhk->bshk", y, w["attn"]["query"]["kernel"])
        k = np.einsum("bsd,dhk->bshk", y, w["attn"]["key"]["kernel"])
        v = np.einsum("bsd,dhk->bshk", y, w["attn"]["value"]["kernel"])
        if cfg.qk_norm:
            q, k = rms(q, w["attn"]["query_norm"]["scale"]), rms(k, w["attn"]["key_norm"]["scale"])
        q, k = rope(q), rope(k)
        k, v = np.repeat(k, heads // kv_heads, axis=2), np.repeat(v, heads // kv_heads, axis=2)  # GQA
        scores = np.einsum("bqhk,bshk->bhqs", q, k) / math.sqrt(width)
        scores = np.where(causal, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("bhqs,bshk->bqhk", probs, v)
        x = x + np.einsum("bqhk,hkd->bqd", attn, w["attn"]["out"]["kernel"])
        y = rms(x, w["mlp_norm"]["scale"])
        gate, up = y @ w["gate"]["kernel"], y @ w["up"]["kernel"]
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w["down"]["kernel"]  # SwiGLU
    x = rms(x, p["final_norm"]["scale"])
    head = p["embed"]["embedding"].T if cfg.tie_embeddings else p["lm_head"]["kernel"]
    return x @ head


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"tie_embeddings": True, "qk_norm": True},
        {"rope_scaling_factor": 8.0, "rope_original_max_len": 4, "num_kv_heads": 1},
    ],
    ids=["gqa", "tied-qknorm", "llama3-scaling-mqa"],
)
@pytest.mark.slow
def test_logits_equal_a_numpy_implementation(extra):
    cfg = LlamaConfig(**{**TINY, **extra})
    cfg.validate()
    module, params, tokens = init(cfg)
    logits = module.apply({"params": params}, tokens, train=False)
    expected = numpy_llama(cfg, params, np.asarray(tokens), INFO.vocab_size)
    np.testing.assert_allclose(np.asarray(logits, np.float64), expected, rtol=2e-4, atol=2e-5)


def test_scanned_and_unscanned_layers_give_the_same_logits():
    cfg = LlamaConfig(**TINY)
    module, params, tokens = init(cfg)
    unscanned = REGISTRY["llama"].build(dataclasses.replace(cfg, scan_layers=False), INFO, jnp.float32, jnp.float32)
    flat = unstacked(params, cfg.num_layers)
    np.testing.assert_allclose(
        unscanned.apply({"params": flat}, tokens, train=False),
        module.apply({"params": params}, tokens, train=False),
        rtol=1e-5,
        atol=1e-6,
    )


def unstacked(params, num_layers):
    """Scanned parameters (layers stacked under `layers/block`) in the unscanned layout."""
    flat = {k: v for k, v in params.items() if k != "layers"}
    flat.update({f"layer_{i}": jax.tree.map(lambda a: a[i], params["layers"]["block"]) for i in range(num_layers)})
    return flat


def train_losses(run, steps, state=None):
    state, losses = run.compiled.to_step_layout(state or run.init_state()), []
    for step in range(steps):
        state, metrics = jax.block_until_ready(
            run.compiled.train_step(state, run.train_block(step // run.inputs.steps_per_block))
        )
        (metrics,) = unpack_metrics(jax.device_get(metrics))
        losses.append(metrics["loss_sum"] / metrics["count"])
    return losses


@pytest.fixture(scope="module")
def one_device(compilation_cache, tmp_path_factory):
    """(the one-device run of LLAMA, scanned layers, as make_config builds it; its first 4 losses
    from its initial state): what three tests compare with, built and trained once."""
    quiet = [*QUIET, f"train.compilation_cache_dir={compilation_cache}", "train.steps_per_call=1"]
    workdir = tmp_path_factory.mktemp("one_device") / "run"
    run = build_run(
        load_config(ROOT / "configs" / "mnist_mlp.yaml", [*quiet, *LLAMA, "mesh.num_devices=1"], str(workdir))
    )
    return run, train_losses(run, 4)


@pytest.mark.slow
def test_scan_changes_compile_work_not_losses(make_config, one_device):
    scanned, scanned_losses = one_device
    unscanned = build_run(make_config("mnist_mlp.yaml", *LLAMA, "mesh.num_devices=1", "model.scan_layers=false"))
    start = scanned.init_state()  # the same weights in both layouts (Adam's moments start at zero in both)
    same_start = unscanned.init_state().replace(params=unstacked(jax.device_get(start.params), 2))
    np.testing.assert_allclose(scanned_losses, train_losses(unscanned, 4, same_start), rtol=1e-5)
    # the scan is a loop XLA's cost analysis counts once: MFU counts the unscanned step
    assert scanned.cost.source == "XLA cost analysis of the same step without scan_layers=True"
    # (a lowered program's count runs a few percent below the compiled one's: BENCHMARKS.md)
    assert scanned.cost.flops_per_device_step == pytest.approx(unscanned.cost.flops_per_device_step, rel=0.06)
    assert compiled_flops(scanned.compiled.program) < 0.75 * scanned.cost.flops_per_device_step  # 1 layer of 2


@pytest.mark.parametrize(
    "layout",
    [["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"], ["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=4"]],
    ids=["data2-fsdp2-tensor2", "fsdp2-tensor4-kv-replicated"],
)
@pytest.mark.slow
def test_mesh_layouts_give_the_one_device_losses(make_config, layout, one_device):
    _, one = one_device
    run = build_run(make_config("mnist_mlp.yaml", *LLAMA, *layout))
    kernel = run.abstract_state.params["layers"]["block"]["attn"]["key"]["kernel"]
    tensor = run.mesh.shape["tensor"]
    assert kernel.sharding.spec[2] == ("tensor" if 2 % tensor == 0 else None)  # 2 KV heads: split where they divide
    np.testing.assert_allclose(train_losses(run, 4), one, rtol=1e-5)


@pytest.mark.slow
def test_greedy_generation_with_the_cache_equals_argmax_without_it():
    cfg = LlamaConfig(**TINY)
    module, params, tokens = init(cfg)
    prompt = [int(t) for t in tokens[0, :5]]
    decoder = REGISTRY["llama"].build(cfg, INFO, jnp.float32, jnp.float32, decode=True)
    cached = sampling.generate(decoder, params, [prompt], 8, temperature=0.0)[0]
    assert cached == greedy_reference(module, params, prompt, 8)
    assert cached == sampling.generate(decoder, params, [prompt], 8, temperature=0.0)[0]
    hot = [sampling.generate(decoder, params, [prompt], 8, temperature=1.5, top_p=0.9, seed=s)[0] for s in (0, 0, 1)]
    assert hot[0] == hot[1] != hot[2]  # a seed gives one text; another seed another


def test_a_tokenizer_without_an_end_of_text_token_is_refused_naming_what_works(tmp_path):
    """The standard library the written config would train on ends each module with an end-of-text
    token; a tokenizer with none is refused at import (nothing written), naming a route that
    works: a corpus tokenized with an end token of the user's choosing, which then imports."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from engine.data.pretokenize import tokenize
    from engine.errors import UsageError
    from engine.hub.hf import import_hf

    words = ["<unk>", "<sep>", *"def return import self if else for in class".split()]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    hf, run = tmp_path / "hf", tmp_path / "run"
    write_hf_checkpoint(hf, LlamaConfig(**TINY), vocab=len(words))
    tokenizer.save(str(hf / "tokenizer.json"))
    with pytest.raises(UsageError) as refused:
        import_hf(str(hf), str(run), overrides=["data.max_bytes=20000", f"data.cache_dir={tmp_path / 'cache'}"])
    message = str(refused.value)
    assert "pass --eod-token" not in message and "\n" not in message, message
    assert f"launch.py tokenize --input TEXT... --out CORPUS --tokenizer {hf / 'tokenizer.json'} --eod-token" in message
    assert "import-hf with data.name=tokens data.path=CORPUS" in message, message
    assert not run.exists()
    (tmp_path / "text").mkdir()
    for i in range(4):
        (tmp_path / "text" / f"{i}.txt").write_text("def f(self): return self if x else None\n" * 20)
    corpus = tmp_path / "corpus"
    tokenize([str(tmp_path / "text")], str(corpus), str(hf / "tokenizer.json"), eod_token="<sep>", progress=False)
    import_hf(str(hf), str(run), overrides=["data.name=tokens", f"data.path={corpus}", "data.seq_len=16"])
    assert (run / "checkpoints" / "0").is_dir()


def test_logits_equal_transformers_llama(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    cfg = LlamaConfig(**{**TINY, "rope_scaling_factor": 8.0, "rope_original_max_len": 4})
    write_hf_checkpoint(tmp_path / "hf", cfg, vocab=61)
    tokens = np.random.default_rng(3).integers(0, 61, (2, 12))
    module, params = ours_from_hf_dir(tmp_path / "hf")
    logits = module.apply({"params": params}, jnp.asarray(tokens, jnp.int32), train=False)
    np.testing.assert_allclose(np.asarray(logits), transformers_logits(tmp_path / "hf", tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize(
    "moe",
    [["model.expert_capacity_factor=1.0"], ["model.moe_dispatch=ragged"]],
    ids=["moe", "moe-ragged"],
)
def test_a_resumed_mixture_of_experts_run_continues_bit_identically(make_config, tmp_path, moe):
    """Exact resume holds for scanned (stacked) parameters and a mixture of experts: a run stopped
    at its checkpoint and started again logs the routing's dropped tokens and load-balancing loss,
    and ends at the parameters, of a run never stopped. (A SIGKILL between saves:
    tests/e2e/test_llama_e2e.py's QLoRA run, whose path does not depend on the model.)"""
    from engine.run.single import fit
    from engine.runtime.rundir import read_records

    def train(workdir, steps):
        overrides = [*LLAMA, "model.num_experts=4", "model.experts_per_token=2", *moe, "mesh.num_devices=1"]
        overrides += [f"train.steps={steps}", "checkpoint.every_steps=2", "log.every_steps=1", "eval.every_steps=0"]
        state = fit(make_config("mnist_mlp.yaml", *overrides, "data.steps_per_transfer=1", workdir=workdir)).state
        records = read_records(workdir / "metrics.jsonl")
        return state, [
            (r["step"], r["loss"], r["moe_aux_loss"], r["moe_dropped_tokens"]) for r in records if r["split"] == "train"
        ]

    straight, expected = train(tmp_path / "straight", 4)
    train(tmp_path / "resumed", 2)
    resumed, got = train(tmp_path / "resumed", 4)
    assert got == expected and [r[0] for r in got] == [1, 2, 3, 4]
    assert all(r[2] > 0 for r in got)  # the load-balancing loss is logged (routing took place)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.params), jax.device_get(straight.params))
