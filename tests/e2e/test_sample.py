"""An imported model keeps its tokenizer: `import-hf` brings tokenizer.json into the workdir,
training on ids of another tokenizer (or bytes) is refused, and `sample` decodes with the
model's tokenizer, stops at its end-of-text token, stays within its context and refuses ids
the tokenizer does not have.

The command lines of these tests run through the CLI's main in two processes (module fixture
`ran`, tests/support/fuzz_cli.py): one for the commands that train, tokenize, import or export,
one, with an empty engine cache, for every `sample`; each test reads its commands' results."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from support.cli import child_env, run_cli
from support.fuzz_cli import run_in_one_process
from support.llama import TINY, greedy_reference, ours_from_hf_dir, write_hf_checkpoint
from support.tokens import tokenized_corpus

from engine.config import load_config
from engine.data import DataInfo
from engine.lm.rollouts import build_decode
from models import REGISTRY
from models.llama import LlamaConfig

QUICK = ["data.max_bytes=60000", "data.seq_len=32", "train.global_batch_size=4", "log.tensorboard=false"]
PROMPT = "alpha beta gamma"
PROMPTS = ["alpha beta gamma", "delta", "omega psi chi phi upsilon tau"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)
HUGE = "need", "for the key/value cache and the prompts' logits", "rows fit: give fewer --num-samples"


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


def _bigger(imported, at):
    """A model whose vocabulary is larger than its tokenizer's, made to prefer id vocab + 3, past
    the tokenizer's end, after "alpha"; → its HF dir."""
    hf, _, tokenizer, _ = imported
    vocab = tokenizer.get_vocab_size()
    write_hf_checkpoint(at, LlamaConfig(**TINY), vocab=vocab + 8)
    shutil.copyfile(hf / "tokenizer.json", at / "tokenizer.json")
    prompt_ids = tokenizer.encode("alpha", add_special_tokens=False).ids
    first = _greedy(at, prompt_ids, 1, vocab + 8)[0]
    weights = load_file(str(at / "model.safetensors"))
    weights["lm_head.weight"][vocab + 3] = 4 * weights["lm_head.weight"][first]
    save_file(weights, str(at / "model.safetensors"))
    assert _greedy(at, prompt_ids, 1, vocab + 8) == [vocab + 3]
    return at


@pytest.fixture(scope="module")
def ran(imported, tmp_path_factory):
    """Every command line of the tests on the imported run → {name: result} (fuzz_cli's results:
    code, stdout, stderr, escaped); the files they read and wrote under "dir"."""
    _, work, _, base = imported
    tmp = tmp_path_factory.mktemp("ran")
    other = tokenized_corpus(base / "other", seed=1)  # a BPE trained on other text: other ids
    bigger = _bigger(imported, tmp / "bigger-hf")
    shutil.copytree(work, tmp / "copy")  # fine-tuned on a corpus of the model's tokenizer
    chat = tmp / "chat"  # the imported run, its tokenizer now with a chat template
    shutil.copytree(work, chat)
    (chat / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "bos_token": {"content": "alpha"}, "chat_template": CHAT_TEMPLATE})
    )
    (tmp / "short-lines.txt").write_bytes(b"ab\n" * (7 * 2**20))  # 21 MiB
    (tmp / "one-line.txt").write_bytes(b"x" * (20 * 2**20))
    (tmp / "long-line.txt").write_bytes(b"alpha\n" + b"x" * 2**20 + b"\n")  # within 16 MiB
    (tmp / "many.txt").write_bytes(b"alpha\n" * 100_000)
    (tmp / "prompts.txt").write_text(PROMPTS[0] + "\n\n" + "\n".join(PROMPTS[1:]) + "\n")
    train = ["--config", str(work / "config.yaml"), "--workdir", str(work), "train.steps=2"]
    copy = tmp / "copy"
    others = {
        "other tokenizer": [*train, "data.name=tokens", f"data.path={other}"],
        "bytes": [*train, "data.tokenizer=bytes"],
        "tokenize": [
            "tokenize", "--input", str(base / "own" / "text"), "--out", str(tmp / "corpus"),
            "--tokenizer", str(copy / "tokenizer.json"), "--eval-fraction=0.2",
        ],
        "fine-tune": [
            "--config", str(copy / "config.yaml"), "--workdir", str(copy), "data.name=tokens",
            f"data.path={tmp / 'corpus'}", "train.steps=2", "log.progress=false",
        ],
        "import bigger": ["import-hf", str(bigger), "--workdir", str(tmp / "bigger"), *QUICK],
        "export": ["export", "--workdir", str(work), "--out", str(tmp / "served")],
    }  # fmt: skip
    sample = ["sample", "--workdir", str(work)]
    stop = _stop_string(imported)  # two characters from the middle of the greedy text
    greedy = [*sample, "--prompt", PROMPT, "--max-tokens", "12", "--temperature", "0"]
    chatted = ["sample", "--workdir", str(chat), "--max-tokens", "6", "--temperature", "0", "--ignore-eos"]
    samples = {
        "decodes": [*sample, "--prompt", PROMPT, "--temperature", "0", "--max-tokens", "6"],
        "past the context": [*sample, "--prompt", "alpha", "--max-tokens", "100000"],
        "ids outside": ["sample", "--workdir", str(tmp / "bigger"), "--prompt", "alpha", "--temperature", "0",
                        "--max-tokens", "3"],
        "a billion samples": [*sample, "--prompt", "alpha", "--num-samples", "1000000000"],
        "many prompts": [*sample, "--prompts", str(tmp / "many.txt"), "--num-samples", "10000"],
        "short lines": [*sample, "--prompts", str(tmp / "short-lines.txt")],
        "one line": [*sample, "--prompts", str(tmp / "one-line.txt")],
        "long line": [*sample, "--prompts", str(tmp / "long-line.txt")],
        "two greedy": [*greedy, "--num-samples", "2"],
        "stopped": [*greedy, "--stop", stop],
        "drawn": [*sample, "--prompt", PROMPT, "--max-tokens", "12", "--temperature", "1.5", "--top-p", "1",
                  "--num-samples", "3", "--ignore-eos"],
        "prompts file": [*sample, "--max-tokens", "6", "--temperature", "0", "--ignore-eos", "--prompts",
                         str(tmp / "prompts.txt")],
        "chat by hand": [*chatted, "--prompt", "alphas:be brief<|endoftext|>u:delta<|endoftext|>a:"],
        "chat": [*chatted, "--prompt", "delta", "--chat", "--system", "be brief"],
        "no template": [*sample, "--prompt", "delta", "--chat"],
    }  # fmt: skip
    results = _run(tmp, "others", others, child_env({"HOME": str(tmp)}))
    cache = tmp / "cache"  # empty: sampling reads no training data, tokenizes and caches nothing
    results |= _run(tmp, "samples", samples, child_env({"HOME": str(tmp), "JAX_ENGINE_CACHE": str(cache)}))
    return {**results, "dir": tmp, "stop": stop}


def _run(tmp, name, commands, env):
    (tmp / name).mkdir()
    cases = [{"name": key, "argv": argv} for key, argv in commands.items()]
    return {result["name"]: result for result in run_in_one_process(tmp / name, cases, env=env)}


def _greedy_text(imported, prompt, max_tokens):
    """The text greedy decoding of `prompt` gives, ended at the end-of-text token (not printed)."""
    hf, _, tokenizer, _ = imported
    ids = _greedy(hf, tokenizer.encode(prompt, add_special_tokens=False).ids, max_tokens, tokenizer.get_vocab_size())
    eos = tokenizer.token_to_id("<|endoftext|>")
    return tokenizer.decode(ids[: ids.index(eos)] if eos in ids else ids, skip_special_tokens=False)


def _stop_string(imported):
    greedy = _greedy_text(imported, PROMPT, 12)
    stop = greedy[len(greedy) // 2 : len(greedy) // 2 + 2]
    assert len(stop) == 2, greedy
    return stop


def _ok(result):
    assert result["code"] == 0 and not result["escaped"], result["escaped"] or result["stderr"]
    return result["stdout"]


def _refused(result, *words):
    """Exit 2, no traceback, stderr naming each of words."""
    where = result["escaped"] or result["stderr"]
    assert result["code"] == 2 and not result["escaped"] and "Traceback" not in result["stderr"], where
    assert all(word in result["stderr"] for word in words), (words, where)


def test_import_keeps_the_tokenizer_and_sample_decodes_with_it(imported, ran):
    _, work, _, _ = imported
    assert (work / "tokenizer.json").is_file() and (work / "tokenizer_config.json").is_file()
    assert (work / "config.yaml").read_text().count(str(work / "tokenizer.json")) == 1  # data reads the model's
    saved = load_config(work / "config.yaml").checkpoint.every_steps  # a kill of its training loses a tenth at most
    assert saved == load_config(work / "config.yaml").train.steps // 10 == 100
    cache = ran["dir"] / "cache"  # every sample ran with this cache: none tokenized or cached data
    assert cache.is_dir() and not (cache / "tokens").exists(), list(cache.rglob("*"))
    assert _ok(ran["decodes"]).rstrip("\n") == _greedy_text(imported, PROMPT, 6)


def test_data_of_another_tokenizer_or_bytes_is_refused(imported, ran):
    _, work, _, _ = imported
    _refused(ran["other tokenizer"], "not the model's tokenizer")
    _refused(ran["bytes"], "byte-level token ids")
    assert not (work / "checkpoints" / "2").exists()


def test_a_corpus_tokenized_with_the_models_tokenizer_fine_tunes(ran):
    _ok(ran["tokenize"])
    run = ran["dir"] / "copy"
    assert f"resuming from step 0 (checkpoint {run / 'checkpoints' / '0'})" in _ok(ran["fine-tune"])
    assert (run / "checkpoints" / "2").is_dir()


def test_sample_stays_within_the_context_and_refuses_ids_outside_the_tokenizer(imported, ran):
    _, _, tokenizer, _ = imported
    _refused(ran["past the context"], "context of")
    _ok(ran["import bigger"])
    _refused(ran["ids outside"], f"[{tokenizer.get_vocab_size() + 3}", "do not belong together")


def test_hostile_sizes_exit_2_with_one_line_before_anything_large_is_allocated(ran):
    """Samples x prompts x tokens beyond what the key/value cache may take, a prompts file past
    16 MiB (of short lines, or one line) and a line longer than the context could hold are each
    refused from their sizes: a million samples used to grow for minutes, a 1 GB line abort
    (run_in_one_process's timeout bounds a refusal that would come too late)."""
    cases = {
        "a billion samples": ("1,000,000,000 rows (--num-samples 1000000000 x 1 prompt(s))", *HUGE),
        "many prompts": ("(--num-samples 10000 x 100,000 prompt(s))", *HUGE),
        "short lines": ("holds 22,020,096 bytes: more than 16,777,216",),
        "one line": ("holds 20,971,520 bytes: more than 16,777,216",),
        "long line": ("prompt 2 has 1,048,576 characters", "of 32 tokens"),
    }
    for name, messages in cases.items():
        _refused(ran[name], *messages)
        assert len(ran[name]["stderr"].strip().splitlines()) == 1, ran[name]["stderr"]


def test_a_language_models_serving_export_takes_any_length_and_carries_the_tokenizer(imported, ran):
    import jax
    import orbax.checkpoint as ocp

    hf, work, tokenizer, _ = imported
    _ok(ran["export"])
    out = ran["dir"] / "served"
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


def test_several_samples_in_one_batch_and_stop_strings(imported, ran):
    greedy, stop = _greedy_text(imported, PROMPT, 12), ran["stop"]
    assert _ok(ran["two greedy"]) == f"=== sample 1 ===\n{greedy}\n=== sample 2 ===\n{greedy}\n"  # greedy: equal
    assert _ok(ran["stopped"]) == greedy[: greedy.find(stop)] + "\n", (ran["stopped"]["stdout"], greedy, stop)
    drawn = [part.split(" ===\n", 1)[1] for part in _ok(ran["drawn"]).split("=== sample ")[1:]]
    assert len(drawn) == 3 and len(set(drawn)) > 1, drawn  # drawn apart, in one batch


def test_sample_prompts_file_and_chat_template(imported, ran):
    hf, _, tokenizer, _ = imported
    vocab = tokenizer.get_vocab_size()
    want = [
        tokenizer.decode(_greedy(hf, tokenizer.encode(p).ids, 6, vocab), skip_special_tokens=False) for p in PROMPTS
    ]
    assert _ok(ran["prompts file"]) == "".join(f"=== prompt {i} ===\n{text}\n" for i, text in enumerate(want, 1))
    assert _ok(ran["chat"]) == _ok(ran["chat by hand"])
    _refused(ran["no template"], "has no chat template")


def test_a_gpt_run_samples(tmp_path):
    work = tmp_path / "gpt"
    quick = ["data.name=python_source", "data.tokenizer=bytes", "data.max_bytes=40000", "train.steps=3"]
    tiny = ["model.num_layers=1", "model.d_model=32", "model.mlp_dim=64", "log.tensorboard=false"]
    sample = ["sample", "--workdir", str(work), "--prompt", "def ", "--max-tokens", "5", "--temperature", "0"]
    cases = [
        {"argv": ["--config", "gpt_small", "--workdir", str(work), *quick, *tiny]},
        {"argv": [*sample, "--num-samples", "2"]},
    ]
    trained, sampled = run_in_one_process(tmp_path, cases, env=child_env({"HOME": str(tmp_path)}))
    _ok(trained)
    first, second = (part.split(" ===\n", 1)[1] for part in _ok(sampled).split("=== sample ")[1:])
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
