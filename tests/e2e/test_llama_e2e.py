"""The Llama family: logits equal a plain-numpy implementation of the architecture (and
transformers' where it is installed), scanned = unscanned, generation with a key/value cache
equals step-by-step argmax, and Hugging Face checkpoints round-trip bit for bit."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.cli import child_env, run_cli, start_cli, wait_until
from support.llama import LLAMA, TINY, ours_from_hf_dir, transformers_logits, write_hf_checkpoint
from support.one_process import run_steps

from engine.data import DataInfo
from models.llama import LlamaConfig


@pytest.mark.slow
@pytest.mark.parametrize("shards", [1, 3])
def test_hugging_face_import_then_export_is_bit_exact(tmp_path, shards):
    cfg = LlamaConfig(**{**TINY, "qk_norm": shards == 3})
    original = write_hf_checkpoint(tmp_path / "hf", cfg, vocab=256, shards=shards)
    common = [
        "data.name=synthetic_text",
        "data.vocab_size=256",
        "data.seq_len=12",
        "data.num_examples=64",
        "train.global_batch_size=8",
        "log.progress=false",
        "log.tensorboard=false",
    ]
    proc = run_cli(
        "import-hf",
        str(tmp_path / "hf"),
        "--workdir",
        str(tmp_path / "run"),
        *common,
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"},
    )
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("export", "--workdir", str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    from engine.hub.hf import _Reader, _tensor_files

    read = _Reader(_tensor_files(tmp_path / "out"))
    assert sorted(read.files) == sorted(original)
    for name, value in original.items():
        np.testing.assert_array_equal(read(name), value, err_msg=name)
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["num_key_value_heads"] == 2 and exported["num_hidden_layers"] == 3


def test_unsupported_hugging_face_settings_are_refused_by_name(tmp_path):
    write_hf_checkpoint(tmp_path / "hf", LlamaConfig(**TINY), vocab=256)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    proc = run_cli("import-hf", str(tmp_path / "hf"), "--workdir", str(tmp_path / "run"))
    assert proc.returncode == 2 and "attention_bias=True" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
def test_import_train_export_loads_in_transformers(tmp_path, qk_norm):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    write_hf_checkpoint(tmp_path / "hf", LlamaConfig(**{**TINY, "qk_norm": qk_norm}), vocab=256)
    run = tmp_path / "run"
    common = [
        "data.name=synthetic_text",
        "data.vocab_size=256",
        "data.seq_len=12",
        "data.num_examples=64",
        "train.global_batch_size=8",
        "log.progress=false",
        "log.tensorboard=false",
    ]
    assert run_cli("import-hf", str(tmp_path / "hf"), "--workdir", str(run), *common).returncode == 0
    trained = run_cli("--config", str(run / "config.yaml"), "--workdir", str(run), "train.steps=3")
    assert trained.returncode == 0, trained.stderr  # fine-tunes from the imported step 0
    proc = run_cli("export", "--workdir", str(run), "--format", "hf", "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    tokens = np.random.default_rng(4).integers(0, 256, (2, 12))
    module, params = ours_from_hf_dir(tmp_path / "out", DataInfo("tokens", 8, 8, vocab_size=256, seq_len=12))
    ours = module.apply({"params": params}, jnp.asarray(tokens, jnp.int32), train=False)
    theirs = transformers_logits(tmp_path / "out", tokens)
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-4, atol=1e-4)
    imported, imported_params = ours_from_hf_dir(tmp_path / "hf", DataInfo("tokens", 8, 8, vocab_size=256, seq_len=12))
    before = imported.apply({"params": imported_params}, jnp.asarray(tokens, jnp.int32), train=False)
    assert not np.allclose(before, ours)  # the three steps of training changed the model


QLORA = ["finetune.lora.rank=4", "finetune.lora.dropout=0.1", "finetune.base_dtype=nf4", "train.matmul_dtype=int8"]


@pytest.mark.slow
def test_sigkill_then_rerun_is_bit_identical(tmp_path):
    """A QLoRA run (a frozen nf4 base, LoRA dropout, int8 matmuls) SIGKILLed between saves re-runs
    to the metrics and adapters of a run never killed. (Exact resume of scanned and MoE parameters,
    their routing, dropped tokens and load-balancing metrics included: tests/integration/test_llama.py
    test_a_resumed_mixture_of_experts_run_continues_bit_identically, in-process.)"""
    from engine.runtime.rundir import read_records

    args = [
        *LLAMA,
        *QLORA,
        "train.steps=12",
        "checkpoint.every_steps=3",
        "log.every_steps=1",
        "log.progress=false",
        "log.tensorboard=false",
        "eval.every_steps=0",
        "data.steps_per_transfer=1",
    ]

    def start(workdir):
        return start_cli("--config", "configs/mnist_mlp.yaml", "--workdir", str(workdir), *args)

    def train_records(workdir):
        return [(r["step"], r["loss"]) for r in read_records(workdir / "metrics.jsonl") if r["split"] == "train"]

    reference, killed = tmp_path / "reference", tmp_path / "killed"
    proc = start(killed)
    wait_until(lambda: train_records(killed) and train_records(killed)[-1][0] >= 7, proc, 240, poll=0.05)
    proc.kill()
    proc.wait()
    assert train_records(killed)[-1][0] < 12
    # the same command again, then the run never killed: both through the CLI's main in one process
    # (tests/support/one_process.py)
    command = ["--config", "configs/mnist_mlp.yaml", *args]
    steps = [{"argv": ["--workdir", str(workdir), *command]} for workdir in (killed, reference)]
    for result in run_steps(tmp_path, steps, env=child_env({"HOME": str(tmp_path)})):
        assert result["code"] == 0 and not result["escaped"], result["escaped"] or result["stderr"][-3000:]
    assert train_records(killed) == train_records(reference)
    import orbax.checkpoint as ocp

    saved = [
        ocp.PyTreeCheckpointer().restore(path / "checkpoints" / "12" / "state")["params"]
        for path in (killed, reference)
    ]
    jax.tree.map(np.testing.assert_array_equal, *saved)
