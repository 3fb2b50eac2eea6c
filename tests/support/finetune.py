"""Helpers of tests/**/test_finetune*.py that other test files (or its other tiers) share."""

import jax.numpy as jnp
import numpy as np

from engine.state.train_state import model_variables
from support.cli import run_cli
from support.llama import TINY, write_hf_checkpoint

DATA = [
    "data.name=synthetic_text",
    "data.vocab_size=256",
    "data.seq_len=12",
    "data.num_examples=64",
    "train.global_batch_size=8",
    "log.progress=false",
    "log.tensorboard=false",
    "train.steps_per_call=1",
]


LORA = ["finetune.lora.rank=4", "finetune.lora.alpha=8", "finetune.lora.targets=[all]", "optimizer.learning_rate=0.02"]


TOKENS = np.random.default_rng(4).integers(0, 256, (2, 12))


def logits(run, state):
    variables = model_variables(state.params, state.model_state)
    return np.asarray(run.model.module.apply(variables, jnp.asarray(TOKENS, jnp.int32), train=False))


_IMPORTED: dict[str, tuple] = {}


def imported_base(tmp_path_factory):
    """(HF dir, engine workdir): a tiny random Llama in Hugging Face's layout, imported with DATA;
    made once a test process for the files that fine-tune it (test_finetune, test_lora_chain). A
    test that changes it (trains the base on, damages it) works on a copy."""
    from models.llama import LlamaConfig

    key = str(tmp_path_factory.getbasetemp())
    if key not in _IMPORTED:
        root = tmp_path_factory.mktemp("imported_base")
        write_hf_checkpoint(root / "hf", LlamaConfig(**TINY), vocab=256)
        proc = run_cli("import-hf", str(root / "hf"), "--workdir", str(root / "base"), *DATA)
        assert proc.returncode == 0, proc.stderr
        _IMPORTED[key] = root / "hf", root / "base"
    return _IMPORTED[key]
