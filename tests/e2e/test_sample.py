"""An imported model keeps its tokenizer: `import-hf` brings tokenizer.json into the workdir,
training on ids of another tokenizer (or bytes) is refused, and `sample` decodes with the
model's tokenizer, stops at its end-of-text token, stays within its context and refuses ids
the tokenizer does not have."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from support.cli import run_cli
from support.llama import TINY, greedy_reference, ours_from_hf_dir, write_hf_checkpoint
from support.tokens import tokenized_corpus

from engine.config import load_config
from engine.data import DataInfo
from engine.lm.rollouts import build_decode
from models import REGISTRY
from models.llama import LlamaConfig

QUICK = ["data.max_bytes=60000", "data.seq_len=32", "train.global_batch_size=4", "log.tensorboard=false"]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A tiny random Llama in Hugging Face's layout with a BPE tokenizer.json, imported without
    --config; → (HF dir, workdir, tokenizer, base dir)."""
    from tokenizers import Tokenizer

    base = tmp_path_factory.mktemp("imported")
    corpus = tokenized_corpus(base / "own", seed=0)
    tokenizer = Tokenizer.from_file(str(corpus / "tokenizer.json"))
    hf = base / "hf"
    write_hf_checkpoint(hf, LlamaConfig(**TINY), vocab=tokenizer.get_vocab_size())
    shutil.copyfile(corpus / "tokenizer.json", hf / "tokenizer.json")
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    work = base / "run"
    proc = run_cli("import-hf", str(hf), "--workdir", str(work), *QUICK)
    assert proc.returncode == 0, proc.stderr
    return hf, work, tokenizer, base


def _greedy(hf, prompt_ids, max_tokens, vocab):
    module, params = ours_from_hf_dir(hf, DataInfo("tokens", 8, 8, vocab_size=vocab, seq_len=32))
    return greedy_reference(module, params, prompt_ids, max_tokens, length=32)  # (one program for every call)


def test_import_keeps_the_tokenizer_and_sample_decodes_with_it(imported, tmp_path):
    hf, work, tokenizer, _ = imported
    assert (work / "tokenizer.json").is_file() and (work / "tokenizer_config.json").is_file()
    assert (work / "config.yaml").read_text().count(str(work / "tokenizer.json")) == 1  # data reads the model's
    saved = load_config(work / "config.yaml").checkpoint.every_steps  # a kill of its training loses a tenth at most
    assert saved == load_config(work / "config.yaml").train.steps // 10 == 100
    prompt = "alpha beta gamma"
    cache = tmp_path / "cache"  # empty: sampling reads no training data, tokenizes and caches nothing
    proc = run_cli(
        "sample", "--workdir", str(work), "--prompt", prompt, "--temperature", "0", "--max-tokens", "6",
        env={"JAX_ENGINE_CACHE": str(cache)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert not (cache / "tokens").exists(), list(cache.rglob("*"))
    ids = _greedy(hf, tokenizer.encode(prompt, add_special_tokens=False).ids, 6, tokenizer.get_vocab_size())
    eos = tokenizer.token_to_id("<|endoftext|>")
    if eos in ids:  # the sample ends at the end-of-text token, which is not printed
        ids = ids[: ids.index(eos)]
    assert proc.stdout.rstrip("\n") == tokenizer.decode(ids, skip_special_tokens=False)


def test_data_of_another_tokenizer_or_bytes_is_refused(imported):
    _, work, _, base = imported
    other = tokenized_corpus(base / "other", seed=1)  # a BPE trained on other text: other ids
    common = ["--config", str(work / "config.yaml"), "--workdir", str(work), "train.steps=2"]
    proc = run_cli(*common, "data.name=tokens", f"data.path={other}")
    assert proc.returncode == 2 and "not the model's tokenizer" in proc.stderr, proc.stderr
    proc = run_cli(*common, "data.tokenizer=bytes")
    assert proc.returncode == 2 and "byte-level token ids" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (work / "checkpoints" / "2").exists()


def test_a_corpus_tokenized_with_the_models_tokenizer_fine_tunes(imported, tmp_path):
    _, work, _, base = imported
    run = tmp_path / "run"
    shutil.copytree(work, run)
    corpus = tmp_path / "corpus"
    text, tokenizer = str(base / "own" / "text"), str(run / "tokenizer.json")
    proc = run_cli("tokenize", "--input", text, "--out", str(corpus), "--tokenizer", tokenizer, "--eval-fraction=0.2")
    assert proc.returncode == 0, proc.stderr
    proc = run_cli(
        "--config", str(run / "config.yaml"), "--workdir", str(run), "data.name=tokens", f"data.path={corpus}",
        "train.steps=2", "log.progress=false",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert f"resuming from step 0 (checkpoint {run / 'checkpoints' / '0'})" in proc.stdout, proc.stdout


def test_sample_stays_within_the_context_and_refuses_ids_outside_the_tokenizer(imported, tmp_path):
    hf, work, tokenizer, _ = imported
    proc = run_cli("sample", "--workdir", str(work), "--prompt", "alpha", "--max-tokens", "100000")
    assert proc.returncode == 2 and "context of" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    # a model whose vocabulary is larger than its tokenizer's, made to prefer an id past the tokenizer's end
    vocab = tokenizer.get_vocab_size()
    bigger = tmp_path / "hf"
    write_hf_checkpoint(bigger, LlamaConfig(**TINY), vocab=vocab + 8)
    shutil.copyfile(hf / "tokenizer.json", bigger / "tokenizer.json")
    prompt_ids = tokenizer.encode("alpha", add_special_tokens=False).ids
    first = _greedy(bigger, prompt_ids, 1, vocab + 8)[0]
    weights = load_file(str(bigger / "model.safetensors"))
    weights["lm_head.weight"][vocab + 3] = 4 * weights["lm_head.weight"][first]
    save_file(weights, str(bigger / "model.safetensors"))
    assert _greedy(bigger, prompt_ids, 1, vocab + 8) == [vocab + 3]
    run = tmp_path / "run"
    assert run_cli("import-hf", str(bigger), "--workdir", str(run), *QUICK).returncode == 0
    proc = run_cli("sample", "--workdir", str(run), "--prompt", "alpha", "--temperature", "0", "--max-tokens", "3")
    assert proc.returncode == 2 and f"[{vocab + 3}" in proc.stderr and "do not belong together" in proc.stderr


def test_hostile_sizes_exit_2_with_one_line_before_anything_large_is_allocated(imported, tmp_path):
    """Samples x prompts x tokens beyond what the key/value cache may take, a prompts file past
    16 MiB (of short lines, or one line) and a line longer than the context could hold are each
    refused from their sizes: a million samples used to grow for minutes, a 1 GB line abort."""
    _, work, _, _ = imported
    (tmp_path / "short-lines.txt").write_bytes(b"ab\n" * (7 * 2**20))  # 21 MiB
    (tmp_path / "one-line.txt").write_bytes(b"x" * (20 * 2**20))
    (tmp_path / "long-line.txt").write_bytes(b"alpha\n" + b"x" * 2**20 + b"\n")  # within 16 MiB
    (tmp_path / "many.txt").write_bytes(b"alpha\n" * 100_000)
    huge = "need", "for the key/value cache and the prompts' logits", "rows fit: give fewer --num-samples"
    cases = [
        (
            ["--prompt", "alpha", "--num-samples", "1000000000"],
            ("1,000,000,000 rows (--num-samples 1000000000 x 1 prompt(s))", *huge),
        ),
        (
            ["--prompts", str(tmp_path / "many.txt"), "--num-samples", "10000"],
            ("(--num-samples 10000 x 100,000 prompt(s))", *huge),
        ),
        (["--prompts", str(tmp_path / "short-lines.txt")], ("holds 22,020,096 bytes: more than 16,777,216",)),
        (["--prompts", str(tmp_path / "one-line.txt")], ("holds 20,971,520 bytes: more than 16,777,216",)),
        (["--prompts", str(tmp_path / "long-line.txt")], ("prompt 2 has 1,048,576 characters", "of 32 tokens")),
    ]
    for args, messages in cases:  # (run_cli's timeout bounds a refusal that would come too late)
        proc = run_cli("sample", "--workdir", str(work), *args, timeout=120)
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        assert all(m in proc.stderr for m in messages) and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_language_models_serving_export_takes_any_length_and_carries_the_tokenizer(imported, tmp_path):
    import jax
    import orbax.checkpoint as ocp

    hf, work, tokenizer, _ = imported
    out = tmp_path / "served"
    proc = run_cli("export", "--workdir", str(work), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert (out / "tokenizer.json").read_bytes() == (work / "tokenizer.json").read_bytes()
    meta = json.loads((out / "export.json").read_text())
    assert meta["input_shape"] == ["batch", "seq"] and meta["input_constraints"] == ["seq <= 32"]
    forward = jax.export.deserialize((out / "forward.stablehlo").read_bytes())
    with ocp.StandardCheckpointer() as reader:
        variables = reader.restore(out / "variables")
    module, params = ours_from_hf_dir(hf, DataInfo("tokens", 8, 8, vocab_size=tokenizer.get_vocab_size(), seq_len=32))
    for batch, length in ((1, 5), (2, 32)):
        tokens = np.random.default_rng(length).integers(0, tokenizer.get_vocab_size(), (batch, length))
        served = forward.call(variables, jnp.asarray(tokens, jnp.int32))
        ours = module.apply({"params": params}, jnp.asarray(tokens, jnp.int32), train=False)
        np.testing.assert_allclose(np.asarray(served), np.asarray(ours), rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="refining shapes"):  # past the context the model was trained at
        forward.call(variables, jnp.zeros((1, 33), jnp.int32))


def test_several_samples_in_one_batch_and_stop_strings(imported):
    hf, work, tokenizer, _ = imported
    prompt = "alpha beta gamma"
    ids = _greedy(hf, tokenizer.encode(prompt, add_special_tokens=False).ids, 12, tokenizer.get_vocab_size())
    eos = tokenizer.token_to_id("<|endoftext|>")
    greedy = tokenizer.decode(ids[: ids.index(eos)] if eos in ids else ids, skip_special_tokens=False)
    common = ["sample", "--workdir", str(work), "--prompt", prompt, "--max-tokens", "12"]
    proc = run_cli(*common, "--temperature", "0", "--num-samples", "2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"=== sample 1 ===\n{greedy}\n=== sample 2 ===\n{greedy}\n"  # greedy: equal samples
    stop = greedy[len(greedy) // 2 : len(greedy) // 2 + 2]
    assert len(stop) == 2, greedy
    proc = run_cli(*common, "--temperature", "0", "--stop", stop)
    assert proc.returncode == 0 and proc.stdout == greedy[: greedy.find(stop)] + "\n", (proc.stdout, greedy, stop)
    proc = run_cli(*common, "--temperature", "1.5", "--top-p", "1", "--num-samples", "3", "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    drawn = [part.split(" ===\n", 1)[1] for part in proc.stdout.split("=== sample ")[1:]]
    assert len(drawn) == 3 and len(set(drawn)) > 1, drawn  # drawn apart, in one batch


def test_sample_prompts_file_and_chat_template(imported, tmp_path):
    hf, work, tokenizer, _ = imported
    prompts = ["alpha beta gamma", "delta", "omega psi chi phi upsilon tau"]
    (tmp_path / "prompts.txt").write_text(prompts[0] + "\n\n" + "\n".join(prompts[1:]) + "\n")
    common = ["sample", "--workdir", str(work), "--max-tokens", "6", "--temperature", "0", "--ignore-eos"]
    proc = run_cli(*common, "--prompts", str(tmp_path / "prompts.txt"))
    assert proc.returncode == 0, proc.stderr
    vocab = tokenizer.get_vocab_size()
    want = [
        tokenizer.decode(_greedy(hf, tokenizer.encode(p).ids, 6, vocab), skip_special_tokens=False) for p in prompts
    ]
    assert proc.stdout == "".join(f"=== prompt {i} ===\n{text}\n" for i, text in enumerate(want, 1))

    chat = tmp_path / "chat"  # the imported run, its tokenizer now with a chat template
    shutil.copytree(work, chat)
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}a:{% endif %}"
    )
    (chat / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "bos_token": {"content": "alpha"}, "chat_template": template})
    )
    rendered = "alphas:be brief<|endoftext|>u:delta<|endoftext|>a:"
    common = ["sample", "--workdir", str(chat), "--max-tokens", "6", "--temperature", "0", "--ignore-eos"]
    by_hand = run_cli(*common, "--prompt", rendered)
    proc = run_cli(*common, "--prompt", "delta", "--chat", "--system", "be brief")
    assert by_hand.returncode == 0 and proc.returncode == 0, proc.stderr
    assert proc.stdout == by_hand.stdout
    plain = run_cli("sample", "--workdir", str(work), "--prompt", "delta", "--chat")
    assert plain.returncode == 2 and "has no chat template" in plain.stderr and "Traceback" not in plain.stderr


def test_a_gpt_run_samples(tmp_path):
    work = tmp_path / "gpt"
    quick = ["data.name=python_source", "data.tokenizer=bytes", "data.max_bytes=40000", "train.steps=3"]
    tiny = ["model.num_layers=1", "model.d_model=32", "model.mlp_dim=64", "log.tensorboard=false"]
    assert run_cli("--config", "gpt_small", "--workdir", str(work), *quick, *tiny).returncode == 0
    common = ["sample", "--workdir", str(work), "--prompt", "def ", "--max-tokens", "5", "--temperature", "0"]
    proc = run_cli(*common, "--num-samples", "2")
    assert proc.returncode == 0, proc.stderr
    first, second = (part.split(" ===\n", 1)[1] for part in proc.stdout.split("=== sample ")[1:])
    assert first == second and len(first.encode()) >= 1


def test_a_gpt_run_exports_in_gpt2_layout_that_transformers_loads(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from engine.checkpoint.store import restore_newest
    from engine.hub.inference import run_config
    from engine.run.setup import build_run

    work = tmp_path / "gpt"
    quick = ["data.name=python_source", "data.tokenizer=bytes", "data.max_bytes=40000", "data.seq_len=16"]
    tiny = ["model.num_layers=2", "model.d_model=32", "model.mlp_dim=64", "log.tensorboard=false", "train.steps=3"]
    assert run_cli("--config", "gpt_small", "--workdir", str(work), *quick, *tiny).returncode == 0
    proc = run_cli("export", "--workdir", str(work), "--format", "hf", "--out", str(tmp_path / "hf"))
    assert proc.returncode == 0, proc.stderr
    cfg = run_config(work)
    run = build_run(cfg, compile_train=False)
    params = restore_newest(work, run.abstract_state, cfg, "test").state.params
    tokens = np.random.default_rng(5).integers(0, 256, (2, 16))
    module = REGISTRY["transformer"].build(cfg.model, run.dataset.info, jnp.float32, jnp.float32)
    ours = np.asarray(module.apply({"params": params}, jnp.asarray(tokens, jnp.int32), train=False))
    reference = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32)
    with torch.no_grad():
        theirs = reference(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)
    again = run_cli("import-hf", str(tmp_path / "hf"), "--workdir", str(tmp_path / "back"))
    assert again.returncode == 2 and "exported, not imported" in again.stderr


def test_the_compiled_decode_serves_sample_and_gives_the_stepwise_generators_greedy_tokens(imported, monkeypatch):
    """Without stop strings `sample` runs the compiled decode (engine/lm/rollouts.py: one program, the
    token loop on the device); its greedy texts of prompts of different lengths, two samples each,
    are the family's stepwise generator's (models/sampling.py), and with a stop string that
    generator serves."""
    from engine.hub import generate

    hf, work, tokenizer, _ = imported
    built = []
    monkeypatch.setattr(generate, "build_decode", lambda *a, **k: built.append(1) or build_decode(*a, **k))
    prompts = ["alpha beta gamma", "delta"]
    common = dict(max_tokens=10, temperature=0.0, num_samples=2)
    compiled = generate.sample(str(work), prompts, **common)
    assert len(built) == 1
    stepwise = generate.sample(str(work), prompts, **common, compiled=False)
    assert len(built) == 1 and len(compiled) == 4 and any(compiled)
    assert compiled == stepwise
    generate.sample(str(work), prompts, **common, stop_strings=["\x00"])
    assert len(built) == 1
