"""The repository root and the tiny model overrides the tests share."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A tiny Llama (GQA: 2 key/value heads for 4 query heads) on synthetic text, as overrides of
# any base config: make_config("mnist_mlp.yaml", *TINY_LLAMA, ...).
TINY_LLAMA = [
    "model.name=llama",
    "data.name=synthetic_text",
    "data.seq_len=16",
    "data.num_examples=256",
    "data.vocab_size=64",
    "model.num_layers=2",
    "model.d_model=32",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.mlp_dim=48",
    "train.global_batch_size=16",
    "optimizer.learning_rate=0.003",
]
# A tiny GPT (models/transformer.py, with dropout) on synthetic text, the same way.
TINY_GPT = [
    "model.name=transformer",
    "data.name=synthetic_text",
    "data.seq_len=16",
    "data.num_examples=512",
    "data.vocab_size=64",
    "model.num_layers=2",
    "model.d_model=32",
    "model.num_heads=4",
    "model.mlp_dim=64",
    "model.dropout_rate=0.1",
    "train.global_batch_size=16",
]
QUIET = ["log.progress=false", "log.tensorboard=false"]  # a launched run's quiet defaults
# the fields of a metrics record that measure speed: two runs of the same training differ only in these
RATES = ("steps_per_sec", "examples_per_sec", "tflops_per_device", "mfu")
