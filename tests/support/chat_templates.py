"""Helpers of tests/**/test_chat_templates*.py that other test files (or its other tiers) share."""

import json

from models.llama import LlamaConfig
from support.llama import TINY, write_hf_checkpoint

GOOD = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


NESTED = "{% for i in range(100000) %}{% for j in range(100000) %}{{ i }}{% endfor %}{% endfor %}"


def _workdir(tmp_path, config=None, jinja: bytes | None = None):
    work = tmp_path / "work"
    work.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (work / "tokenizer_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if jinja is not None:
        (work / "chat_template.jinja").write_bytes(jinja)
    return work


def _hf_dir(path, template_config=None, jinja: str | None = None):
    """A tiny Llama in Hugging Face's layout with a word-level tokenizer.json and (optionally) a
    chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "</s>", *"def return import self if else for in class None True False".split()]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    write_hf_checkpoint(path, LlamaConfig(**TINY), vocab=tokenizer.get_vocab_size())
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", **(template_config or {})}))
    if jinja is not None:
        (path / "chat_template.jinja").write_text(jinja)
    return path


QUICK = ["data.max_bytes=20000", "data.seq_len=16", "train.global_batch_size=8", "log.tensorboard=false"]
