"""Helpers of tests/**/test_data_record*.py that other test files (or its other tiers) share."""

import json

from support.chat_data import RECORDS, TEMPLATE, write_model_dir

DATED = "{{ bos_token }}<|im_start|>system\nToday Date: {{ strftime_now('%d %b %Y') }}<|im_end|>\n" + TEMPLATE[15:]


CONVERSATIONS = [RECORDS[0], RECORDS[1], RECORDS[2]] * 4


def dated_model_dir(directory):
    """A model directory whose chat template writes the date (as Llama 3's do)."""
    write_model_dir(directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": DATED}))
    return directory
