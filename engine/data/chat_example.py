"""`python -m engine.data.chat_example DIR`: the post-training example's model files and data, made offline.

A rule a tiny model can learn from scratch: the user gives a list of 3 to 6 digits and asks to
reverse it or to sort it (`reverse: 3 1 4 1 5`, `sort: 3 1 4 1 5`); the assistant answers with the
list reversed or sorted ascending (`5 1 4 1 3`, `1 1 3 4 5`). DIR receives

- `tokenizer.json`: a word-level Hugging Face `tokenizers` tokenizer whose vocabulary is the
  words of the generated text (sorted, so the file is the same bytes for the same text), with
  the chat template's special tokens; `chat_template.jinja` (ChatML, as engine/lm/chat.py reads
  it) and `tokenizer_config.json` (its special tokens);
- `chat_train.jsonl`, `chat_eval.jsonl`: conversations `{"messages": [...]}` for data.name=chat;
- `preferences_train.jsonl`, `preferences_eval.jsonl`: pairs `{"prompt", "chosen", "rejected"}`
  for data.name=preferences, the rejected answer a plausible wrong one (the list unchanged, or
  the right answer with two neighbouring items swapped);
- `prompts_train.jsonl`, `prompts_eval.jsonl`: the conversations' prompts with their answers,
  `{"prompt", "answer"}`, for data.name=prompts (GRPO, rewarded by engine.lm.rewards:exact_match).

Every held-out list (eval) is one that no training record holds, so answering it needs the rule.
The same --seed writes the same bytes (configs/chat_sft.yaml, configs/dpo.yaml train on them).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Iterator, Optional

OPERATIONS = ("reverse", "sort")
DIGITS = "0123456789"
LENGTHS = (3, 6)  # the shortest and longest list
START, END, UNKNOWN = "<|im_start|>", "<|im_end|>", "<unk>"
TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DRAWN = ("chat_train.jsonl", "chat_eval.jsonl", "preferences_train.jsonl", "preferences_eval.jsonl")
PROMPTS = {"prompts_train.jsonl": "chat_train.jsonl", "prompts_eval.jsonl": "chat_eval.jsonl"}  # ← the chats'
FILES = (*DRAWN, *PROMPTS)


def answer(operation: str, items: list[str]) -> list[str]:
    """The rule: the list reversed, or sorted ascending."""
    return items[::-1] if operation == "reverse" else sorted(items)


def prompt(operation: str, items: list[str]) -> str:
    return f"{operation}: {' '.join(items)}"


def rejected(operation: str, items: list[str], rng: random.Random) -> Optional[list[str]]:
    """A plausible wrong answer: the list as given, or the right answer with two neighbouring
    (different) items swapped; None where the list admits neither (all its items alike)."""
    right = answer(operation, items)
    swaps = [k for k in range(len(right) - 1) if right[k] != right[k + 1]]
    wrong = []
    if items != right:
        wrong.append(list(items))
    if swaps:
        k = rng.choice(swaps)
        wrong.append([*right[:k], right[k + 1], right[k], *right[k + 2 :]])
    return rng.choice(wrong) if wrong else None


def _tasks(rng: random.Random, seen: set[tuple]) -> Iterator[tuple[str, list[str]]]:
    """(operation, list) drawn at random, each new (not in `seen`, which it grows), each with a
    wrong answer to reject."""
    while True:
        operation = rng.choice(OPERATIONS)
        items = [rng.choice(DIGITS) for _ in range(rng.randint(*LENGTHS))]
        key = (operation, tuple(items))
        if key in seen or rejected(operation, items, random.Random(0)) is None:
            continue
        seen.add(key)
        yield operation, items


def records(seed: int, train: int, held_out: int) -> dict[str, list[dict]]:
    """The files' records: conversations and preference pairs, train and held out, every (operation,
    list) used once over all of them; and the conversations' prompts with their answers."""
    rng = random.Random(seed)
    tasks = _tasks(rng, set())
    out: dict[str, list[dict]] = {}
    for name, count in zip(DRAWN, (train, held_out, train, held_out)):
        rows: list[dict] = []
        for operation, items in (next(tasks) for _ in range(count)):
            question, right = prompt(operation, items), " ".join(answer(operation, items))
            if name.startswith("chat"):
                messages = [{"role": "user", "content": question}, {"role": "assistant", "content": right}]
                rows.append({"messages": messages})
            else:
                wrong = rejected(operation, items, rng)
                assert wrong is not None  # (_tasks keeps only lists that have one)
                rows.append({"prompt": question, "chosen": right, "rejected": " ".join(wrong)})
        out[name] = rows
    for name, chats in PROMPTS.items():
        out[name] = [
            {"prompt": user["content"], "answer": reply["content"]}
            for user, reply in (r["messages"] for r in out[chats])
        ]
    return out


def tokenizer_json(texts: list[str]) -> str:
    """A word-level tokenizer of the words in `texts` (split on whitespace and punctuation, as
    its pre-tokenizer splits), sorted, after the template's special tokens."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    splitter = pre_tokenizers.Whitespace()
    words = sorted({word for text in texts for word, _ in splitter.pre_tokenize_str(text)})
    vocab = {token: k for k, token in enumerate([START, END, UNKNOWN, *words])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNKNOWN))
    tokenizer.pre_tokenizer = splitter
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in (START, END, UNKNOWN)])
    return tokenizer.to_str(pretty=True)


def write(directory: Path, seed: int = 0, train: int = 4000, held_out: int = 200) -> list[Path]:
    """The example's files written into `directory` (made if missing); the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    data = records(seed, train, held_out)
    texts = ["system user assistant"]  # (the template's roles)
    texts += [m["content"] for rows in data.values() for r in rows for m in r.get("messages", [])]
    texts += [r[key] for name in DRAWN for r in data[name] for key in ("prompt", "chosen", "rejected") if key in r]
    config = {"eos_token": END, "pad_token": END, "unk_token": UNKNOWN, "tokenizer_class": "PreTrainedTokenizerFast"}
    contents = {
        "tokenizer.json": tokenizer_json(texts),
        "chat_template.jinja": TEMPLATE,
        "tokenizer_config.json": json.dumps(config, indent=2) + "\n",
    }
    for name, rows in data.items():
        contents[name] = "".join(json.dumps(row) + "\n" for row in rows)
    for name, text in contents.items():
        (directory / name).write_text(text, encoding="utf-8")
    return [directory / name for name in contents]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.data.chat_example", description=__doc__.split("\n")[0])
    parser.add_argument("directory", type=Path, help="where to write the tokenizer, template and data")
    parser.add_argument("--seed", type=int, default=0, help="the same seed writes the same bytes (default 0)")
    parser.add_argument("--train", type=int, default=4000, help="training conversations, and pairs (default 4000)")
    parser.add_argument("--eval", type=int, default=200, help="held-out conversations, and pairs (default 200)")
    args = parser.parse_args(argv)
    paths = write(args.directory, args.seed, args.train, args.eval)
    print(f"wrote {', '.join(p.name for p in paths)} into {args.directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
