"""Fine-tuning published weights (engine/lm/finetune.py): LoRA adapters on a frozen base start at
the base's logits and are all that trains and is checkpointed; QLoRA bases (int8, nf4) stay
close to the float base in a quarter and an eighth of its memory; the merged export loads in
transformers and the adapter directory in peft with the engine's logits; layouts over 8
devices give the one-device losses; resume is exact; bad settings exit 2 naming the key."""

import json
import shlex
import shutil

import jax
import numpy as np
import pytest
from flax.traverse_util import flatten_dict
from support.cli import child_env, run_cli
from support.configs import ROOT
from support.finetune import DATA, LORA, TOKENS, imported_base, logits
from support.fuzz_cli import run_in_one_process
from support.llama import TINY, transformers_logits, write_hf_checkpoint
from support.one_process import run_steps
from support.parallel import train_losses

from engine.checkpoint import store as checkpoint
from engine.checkpoint.store import load_base, restore_newest
from engine.config import load_config
from engine.lm.finetune import base_weights, with_frozen
from engine.run.setup import build_run
from engine.runtime.rundir import read_records
from engine.state.train_state import FROZEN
from models.llama import PROJECTIONS, LlamaConfig


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(HF dir, engine workdir): a tiny random Llama in Hugging Face's layout, imported (read only)."""
    return imported_base(tmp_path_factory)


def config(base_dir, workdir, *overrides):
    return load_config(base_dir / "config.yaml", [*DATA, f"finetune.base={base_dir}", *LORA, *overrides], str(workdir))


@pytest.fixture(scope="module")
def lora_run(base, tmp_path_factory):
    """(workdir, its CompletedProcess): 4 steps of LoRA (dropout 0.1) on the base, saved at 2 and 4."""
    work = tmp_path_factory.mktemp("lora") / "lora"
    proc = run_cli("--config", str(base[1] / "config.yaml"), "--workdir", str(work), *config_args(base[1]), *STRAIGHT)
    assert proc.returncode == 0, proc.stderr
    return work, proc


STRAIGHT = ["finetune.lora.dropout=0.1", "log.every_steps=1", "checkpoint.every_steps=2", "train.steps=4"]


def test_lora_starts_at_the_base_and_only_the_adapters_train_and_are_saved(base, lora_run, tmp_path, monkeypatch):
    _, base_dir = base
    plain_cfg = load_config(base_dir / "config.yaml", DATA, str(base_dir))
    plain = build_run(plain_cfg, compile_train=False)
    base_state = restore_newest(base_dir, plain.abstract_state, plain_cfg, "read").state
    cfg = config(base_dir, tmp_path / "lora")
    run = build_run(cfg, compile_train=False)
    frozen = load_base(base_weights(cfg), run.abstract_state.model_state[FROZEN])
    start = with_frozen(run.init_state(), frozen)
    np.testing.assert_array_equal(logits(run, start), logits(plain, base_state))  # B = 0: the base's forward

    work, proc = lora_run
    assert f"fine-tuning LoRA adapters on the frozen base {base_dir}" in proc.stdout
    assert f"fine-tuning: base {base_dir} frozen in float32" in proc.stdout and "LoRA rank 4 on all" in proc.stdout
    trained = restore_newest(work, run.abstract_state, cfg, "read")
    base_leaves = flatten_dict(base_state.params)
    for path, value in flatten_dict(trained.state.model_state[FROZEN]).items():  # the base, bit for bit
        np.testing.assert_array_equal(np.asarray(value), np.asarray(base_leaves[path]), err_msg=str(path))
    adapters = flatten_dict(trained.state.params)
    assert {p[-1] for p in adapters} == {"lora_a", "lora_b"}
    assert {p[-2] for p in adapters} == set(PROJECTIONS)  # targets=[all]
    assert all(np.abs(np.asarray(v)).max() > 0 for p, v in adapters.items() if p[-1] == "lora_b")  # trained
    assert not np.allclose(logits(run, trained.state), logits(plain, base_state))
    # the optimizer's state is the adapters' (Adam: two moments each), nothing of the base
    moments = [leaf for leaf in jax.tree.leaves(trained.state.opt_state) if np.ndim(leaf) > 0]
    assert sorted(m.shape for m in moments) == sorted(2 * [v.shape for v in adapters.values()])
    # the checkpoint holds the adapters and the base's identity, not the base
    step_dir = work / "checkpoints" / "4"
    saved = json.loads((step_dir / "meta" / "metadata").read_text())
    assert saved["base"]["path"] == str(base_dir) and len(saved["base"]["sha256"]) == 64
    state_tree = json.loads((step_dir / "state" / "_METADATA").read_text())["tree_metadata"]
    assert not any("frozen" in key for key in state_tree)
    assert any("lora_b" in key for key in state_tree)
    # a reader of the run's checkpoints (the evaluator, export) reads the base once for all of them
    reads = []
    monkeypatch.setattr(checkpoint, "load_base", lambda *a: reads.append(a) or load_base(*a))
    reader = checkpoint.Checkpointer(work / "checkpoints", 3, read_only=True, base=base_weights(cfg))
    again = [reader.restore(run.abstract_state, step=s).state for s in (2, 4)]
    assert len(reads) == 1 and np.allclose(logits(run, again[1]), logits(run, trained.state))


def test_a_run_from_another_runs_weights_carries_that_models_files(base, tmp_path):
    """A LoRA run on finetune.base, and a run from checkpoint.restore_from's parameters, write the
    base's model files (hf_config.json: context, eos ids; tokenizer companions) into their workdir."""
    from engine.data import load_dataset
    from engine.run.outputs import write_run_files

    base_dir = tmp_path / "base"
    shutil.copytree(base[1], base_dir)
    recorded = (base_dir / "hf_config.json").read_bytes()
    params = [f"checkpoint.restore_from={base_dir / 'checkpoints'}", "checkpoint.restore_mode=params"]
    for name, overrides in (("lora", [f"finetune.base={base_dir}", *LORA]), ("params", params)):
        cfg = load_config(base_dir / "config.yaml", [*DATA, *overrides], str(tmp_path / name))
        (tmp_path / name).mkdir()
        write_run_files(cfg, load_dataset(cfg.data), tmp_path / name)
        assert (tmp_path / name / "hf_config.json").read_bytes() == recorded, name
    (base_dir / "hf_config.json").write_text("{}")  # the base's files change after the run started
    write_run_files(cfg, load_dataset(cfg.data), tmp_path / "params")  # (as a resume starts)
    cfg = load_config(base_dir / "config.yaml", [*DATA, f"finetune.base={base_dir}", *LORA], str(tmp_path / "lora"))
    write_run_files(cfg, load_dataset(cfg.data), tmp_path / "lora")
    assert (tmp_path / "lora" / "hf_config.json").read_bytes() == recorded  # what the run recorded at its start
    assert (tmp_path / "params" / "hf_config.json").read_bytes() == recorded


def config_args(base_dir):
    return [*DATA, f"finetune.base={base_dir}", *LORA]


def test_merged_export_loads_in_transformers_and_the_adapters_in_peft(base, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    hf, base_dir = base
    work = tmp_path / "lora"
    proc = run_cli(
        "--config", str(base_dir / "config.yaml"), "--workdir", str(work), *config_args(base_dir), "train.steps=3"
    )
    assert proc.returncode == 0, proc.stderr
    cfg = config(base_dir, work)
    run = build_run(cfg, compile_train=False)
    ours = logits(run, restore_newest(work, run.abstract_state, cfg, "read").state)
    proc = run_cli("export", "--workdir", str(work), "--format", "hf", "--merge", "--out", str(tmp_path / "merged"))
    assert proc.returncode == 0, proc.stderr
    np.testing.assert_allclose(transformers_logits(tmp_path / "merged", TOKENS), ours, rtol=1e-4, atol=1e-4)
    proc = run_cli("export", "--workdir", str(work), "--format", "hf", "--out", str(tmp_path / "adapter"))
    assert proc.returncode == 0, proc.stderr
    adapter = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and adapter["lora_alpha"] == 8 and "q_proj" in adapter["target_modules"]
    peft = pytest.importorskip("peft")
    import torch
    from transformers import AutoModelForCausalLM

    model = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(hf, torch_dtype=torch.float32), tmp_path / "adapter"
    )
    with torch.no_grad():
        theirs = model(torch.as_tensor(TOKENS)).logits.numpy()
    np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=1e-4)


def test_lora_over_fsdp_and_tensor_gives_the_one_device_losses(base, make_config):
    _, base_dir = base
    args = [f"finetune.base={base_dir}", *LORA, "finetune.base_dtype=int8", "train.matmul_dtype=int8"]
    common = [f"model.{k}={v}" for k, v in TINY.items()] + ["model.name=llama", *DATA, *args]
    one, _ = train_losses(_fine_tune_run(make_config, common, "mesh.num_devices=1"), 4)
    eight, _ = train_losses(_fine_tune_run(make_config, common, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"), 4)
    assert np.ptp(one) > 1e-3  # the adapters train (the loss moves)
    np.testing.assert_allclose(eight, one, rtol=2e-5)


def _fine_tune_run(make_config, common, *layout):
    cfg = make_config("llama_tiny.yaml", *common, *layout)
    run = build_run(cfg)
    frozen = load_base(base_weights(cfg), run.abstract_state.model_state[FROZEN])
    init = run.init_state
    run.init_state = lambda *a: with_frozen(init(*a), frozen)  # (what the trainer does at a fresh start)
    return run


def test_a_resumed_fine_tuning_continues_exactly_and_refuses_a_changed_base(base, lora_run, tmp_path):
    """Stopped at 2 and resumed, a LoRA run (dropout 0.1) logs the losses of lora_run, never stopped
    (on the base's copy: the same bytes at another path). (The four command lines through the CLI's
    main in one process: tests/support/one_process.py.)"""
    _, imported = base
    base_dir = tmp_path / "base"
    shutil.copytree(imported, base_dir)
    common = ["--config", str(base_dir / "config.yaml"), *config_args(base_dir), *STRAIGHT[:-1]]
    resumed = ["--workdir", str(tmp_path / "resumed")]
    # the base trains one more step: a new checkpoint, another checksum; the adapters' run refuses it
    more = ["--config", str(base_dir / "config.yaml"), "--workdir", str(base_dir), *DATA, "train.steps=1"]
    stopped, proc, more, refused = run_steps(
        tmp_path,
        [
            {"argv": [*common, *resumed, "train.steps=2"]},
            {"argv": [*common, *resumed, "train.steps=4"]},
            {"argv": more},
            {"argv": [*common, *resumed, "train.steps=6"]},
        ],
        env=child_env({"HOME": str(tmp_path)}),
    )
    for result in (stopped, proc, more):
        assert result["code"] == 0 and not result["escaped"], result["escaped"] or result["stderr"][-3000:]
    assert "resuming from step 2" in proc["stdout"]

    def losses(work):
        return [(r["step"], r["loss"]) for r in read_records(work / "metrics.jsonl") if r["split"] == "train"]

    assert len(losses(lora_run[0])) == 4
    assert losses(tmp_path / "resumed") == losses(lora_run[0])  # (and the refused run trained nothing)
    assert refused["code"] == 2 and not refused["escaped"] and "Traceback" not in refused["stderr"], refused
    assert f"finetune.base={base_dir}: the base changed since" in refused["stderr"], refused["stderr"]


def _flip(path, count=64):
    data = bytearray(path.read_bytes())
    for i in range(min(count, len(data))):
        data[len(data) // 2 + i - min(count, len(data)) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["data", "_sharding"])
def test_a_damaged_base_is_refused_naming_finetune_base(base, tmp_path, damage):
    """A base checkpoint whose files changed on disk: the adapters' run (and sample, export,
    eval, which read the base the same way) exit 2 naming finetune.base, never train on it."""
    _, imported = base
    base_dir = tmp_path / "base"
    shutil.copytree(imported, base_dir)
    (step,) = [p for p in (base_dir / "checkpoints").iterdir() if p.name.isdigit()]
    files = [p for p in (step / "state").rglob("*") if p.is_file()]
    target = (
        next(p for p in files if p.name == "_sharding")
        if damage == "_sharding"
        else max(files, key=lambda p: p.stat().st_size)
    )
    _flip(target)
    cfg = config(base_dir, tmp_path / "lora")
    run = build_run(cfg, compile_train=False)
    with pytest.raises(checkpoint.UsageError, match=f"finetune.base={base_dir}: checkpoint .* is damaged"):
        load_base(base_weights(cfg), run.abstract_state.model_state[FROZEN])


def test_lora_in_the_imports_own_workdir_says_in_one_line_to_use_a_new_one(base, tmp_path):
    _, imported = base
    base_dir = tmp_path / "base"
    shutil.copytree(imported, base_dir)
    proc = run_cli("--config", str(base_dir / "config.yaml"), "--workdir", str(base_dir), *DATA, *LORA, "train.steps=1")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert f"fine-tune in a new workdir with finetune.base={base_dir}" in proc.stderr, proc.stderr


SETTINGS = [  # (overrides, what the refusal names)
    (["finetune.lora.targets=[qkv]"], "finetune.lora.targets: 'qkv' matches no projection"),
    (["finetune.lora.rank=-1"], "finetune.lora.rank"),
    (["finetune.lora.rank=0", "finetune.base_dtype=nf4"], "finetune.base_dtype=nf4 freezes the base"),
    (["model.name=mlp", "data.name=digits"], "finetune.lora.rank: model.name=mlp has no named projections"),
    (["finetune.base=/nonexistent/run"], "finetune.base=/nonexistent/run"),
    (["finetune.lora.rank=1000000000"], "the train state needs"),
]


def test_fine_tuning_settings_it_cannot_do_exit_2_naming_the_key(tmp_path):
    """Each refused naming the key, before anything is written (no config.yaml, tokenizer.json,
    checkpoints/): the first through launch.py, the rest through the CLI's main in one process."""

    def argv(i, overrides):
        args = ["--config", str(ROOT / "configs" / "llama_tiny.yaml"), "--workdir", str(tmp_path / f"run{i}"), *DATA]
        return [*args, "finetune.lora.rank=4", *overrides, "train.steps=1"]

    (first, named), *rest = SETTINGS
    proc = run_cli(*argv(0, first))
    assert proc.returncode == 2, proc.stderr
    assert named in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    results = run_in_one_process(tmp_path, [{"argv": argv(i, o)} for i, (o, _) in enumerate(rest, 1)])
    assert len(results) == len(rest) == 5
    for result, (_, named) in zip(results, rest):  # (some after a warning: warmup_steps > train.steps)
        where = (result["argv"], result["escaped"] or result["stderr"])
        assert result["code"] == 2 and not result["escaped"] and "Traceback" not in result["stderr"], where
        assert named in result["stderr"], where
    assert not list(tmp_path.glob("run*"))  # nothing left behind


def test_the_readme_recipe_runs_on_a_tiny_model(tmp_path):
    """The fine-tuning recipe's lines (docs/language-models.md), as written, on a tiny random
    Llama with a BPE tokenizer (only paths replaced, and quick settings added: a short run on
    little text; the sample a chat past the run's seq_len). The import tokenizes nothing; the
    LoRA run's sample and exports have the base's context, special ids, chat template and
    generation settings; its adapter directory names the base's Hugging Face directory."""
    from support.tokens import tokenized_corpus
    from tokenizers import Tokenizer

    corpus = tokenized_corpus(tmp_path / "own", seed=0)
    hf = tmp_path / "hf"
    write_hf_checkpoint(
        hf, LlamaConfig(**TINY), vocab=Tokenizer.from_file(str(corpus / "tokenizer.json")).get_vocab_size()
    )
    shutil.copyfile(corpus / "tokenizer.json", hf / "tokenizer.json")
    eos = _with_model_facts(hf, context=512)
    readme = (ROOT / "docs" / "language-models.md").read_text()
    block = readme.split("<!-- fine-tuning recipe:")[1].split("```bash\n")[1].split("```")[0]
    cache = [f"data.cache_dir={tmp_path / 'cache'}"]
    quick = {
        "import-hf": QUICK_TEXT + cache,
        "--config": [*QUICK_TEXT[1:], "train.steps=2"],  # (data.max_bytes is python_source's: the run reads tokens)
        "sample": ["--chat", "--max-tokens", "300"],  # (> seq_len 32, through the base's chat template)
    }
    steps = []  # (each line's command line through the CLI's main, all in one process: tests/support/one_process.py)
    for line in block.strip().splitlines():
        line = line.replace("HF_DIR", str(hf)).replace("TEXT_DIR", str(tmp_path / "own" / "text"))
        assert shlex.split(line)[:2] == ["python", "launch.py"], line
        args = [a.replace("runs/", f"{tmp_path}/runs/") for a in shlex.split(line)[2:]]
        steps.append({"line": line, "argv": [*args, *quick.get(args[0], [])]})
    named = ["--format", "hf", "--base-model", "org/tiny-llama", "--out", str(tmp_path / "named")]
    lora = tmp_path / "runs" / "lora"
    steps.append({"line": "export --base-model", "argv": ["export", "--workdir", str(lora), *named]})
    for result in run_steps(tmp_path, steps, env=child_env({"HOME": str(tmp_path)})):
        assert result["code"] == 0 and not result["escaped"], (result["line"], result["escaped"] or result["stderr"])
    merged = tmp_path / "runs" / "lora_merged"
    assert (merged / "model.safetensors").is_file()
    assert not (tmp_path / "cache").exists()  # the import tokenized nothing (the LoRA run reads its own corpus)
    # the base's model facts reach the LoRA run's export and sample: context, special ids, template
    config = json.loads((merged / "config.json").read_text())
    assert (config["max_position_embeddings"], config["bos_token_id"], config["eos_token_id"]) == (512, eos, eos)
    for name in ("tokenizer_config.json", "generation_config.json"):
        assert (merged / name).read_bytes() == (hf / name).read_bytes(), name
    # the adapter directory names the Hugging Face directory the base was imported from, or --base-model
    from engine.hub.hf import export_hf

    export_hf(str(lora), str(tmp_path / "adapter"))
    adapter = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(hf) and (tmp_path / "adapter" / "tokenizer_config.json").is_file()
    with pytest.raises(checkpoint.UsageError, match="--base-model names the base of a LoRA run's adapter"):
        export_hf(str(lora), str(tmp_path / "merged-named"), merge=True, base_model="org/tiny-llama")
    assert json.loads((tmp_path / "named" / "adapter_config.json").read_text())["base_model_name_or_path"] == (
        "org/tiny-llama"
    )


def _with_model_facts(hf, context: int) -> int:
    """What a published model's directory has besides weights and tokenizer: a context length and
    special token ids in config.json, a chat template and generation settings; → the eos id."""
    from tokenizers import Tokenizer

    eos = Tokenizer.from_file(str(hf / "tokenizer.json")).token_to_id("<|endoftext|>")
    assert eos is not None
    config = json.loads((hf / "config.json").read_text())
    facts = {"max_position_embeddings": context, "bos_token_id": eos, "eos_token_id": eos}
    (hf / "config.json").write_text(json.dumps({**config, **facts}))
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "chat_template": template}))
    (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "max_new_tokens": 64}))
    return eos


QUICK_TEXT = ["data.max_bytes=60000", "data.seq_len=32", "train.global_batch_size=4", "log.tensorboard=false"]


def test_a_model_transformers_saved_imports_whole_and_its_lora_exports_load_back(tmp_path):
    """A directory as transformers 5 writes it (save_pretrained of a tiny Llama and a tokenizer
    with a chat template: chat_template.jinja, generation_config.json) imports whole; a LoRA run
    on it keeps the base's context, special tokens and template; the merged export loads in
    AutoModelForCausalLM and AutoTokenizer, the adapter directory in AutoPeftModelForCausalLM."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", *[f"w{i}" for i in range(61)]]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", chat_template=template
    )
    config = transformers.LlamaConfig(
        vocab_size=len(words), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = tmp_path / "hf"
    transformers.LlamaForCausalLM(config).save_pretrained(hf)
    tokenizer.save_pretrained(hf)
    assert (hf / "chat_template.jinja").is_file() or "chat_template" in json.loads(
        (hf / "tokenizer_config.json").read_text()
    )
    text = tmp_path / "text"
    text.mkdir()
    rng = np.random.default_rng(0)
    for i in range(8):
        (text / f"{i}.txt").write_text(" ".join(f"w{n}" for n in rng.integers(0, 61, 300)))
    corpus = tmp_path / "corpus"
    proc = run_cli("tokenize", "--input", str(text), "--out", str(corpus), "--tokenizer", str(hf / "tokenizer.json"))
    assert proc.returncode == 0, proc.stderr
    data = ["data.name=tokens", f"data.path={corpus}", "data.seq_len=16", *DATA[4:]]
    proc = run_cli("import-hf", str(hf), "--workdir", str(tmp_path / "base"), *data)
    assert proc.returncode == 0, proc.stderr
    lora = [*data, f"finetune.base={tmp_path / 'base'}", *LORA, "train.steps=2"]
    work = tmp_path / "lora"
    proc = run_cli("--config", str(tmp_path / "base" / "config.yaml"), "--workdir", str(work), *lora)
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("sample", "--workdir", str(work), "--prompt", "w1 w2", "--chat", "--max-tokens", "300")
    assert proc.returncode == 0, proc.stderr  # the base's template, and its context of 512 (not seq_len 16)

    proc = run_cli("export", "--workdir", str(work), "--format", "hf", "--merge", "--out", str(tmp_path / "merged"))
    assert proc.returncode == 0, proc.stderr
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert merged.config.max_position_embeddings == 512 and merged.config.eos_token_id == 2
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "merged")
    assert loaded.eos_token == "</s>" and loaded.chat_template == template
    proc = run_cli("export", "--workdir", str(work), "--format", "hf", "--out", str(tmp_path / "adapter"))
    assert proc.returncode == 0, proc.stderr
    adapted = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter")
    with torch.no_grad():
        ids = torch.as_tensor([[1, 5, 6, 7]])
        np.testing.assert_allclose(
            adapted(ids).logits.numpy(), merged(ids).logits.numpy(), rtol=1e-4, atol=1e-4
        )  # base + adapters = the merged model
