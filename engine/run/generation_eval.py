"""`eval.generate`: a language model's generation-based eval. At each evaluation the first
eval.generate.num_prompts records of the eval split (data.name=chat or preferences) have their
prompts completed by the model's key/value-cache sampler (models/sampling.py, as `sample` draws),
in one batch, and the completions are scored: exact match against a field of each record
(`generate/exact_match`) and reward functions with TRL's signature (engine/lm/rewards.py:
`generate/reward`, the mean of their sum over the completions, and `generate/rewards/<name>`).
`generate/mean_length` (new tokens) and `generate/clipped_ratio` (the share that reached
max_tokens without ending) show a model that no longer stops.

Prompts are rendered as the data source renders them (the chat template ready for the
assistant's reply, or TRL's standard format's plain text), tokenized with the model's tokenizer.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from engine.data.chat_data import MODEL_TEXT_SOURCES, held_out, model_text
from engine.data.conversations import as_messages, json_records
from engine.errors import UsageError
from engine.lm import finetune
from engine.lm.rewards import RESERVED, RewardFunction, call_reward, load_rewards
from engine.lm.template_clock import rendering_at
from engine.lm.tokenizer import context_length, eos_ids
from engine.runtime.processes import current
from engine.state.train_state import model_variables
from models.family import BuildOptions, projections

KEY = "eval.generate"
COMPLETION = "completion"  # answer_field: a messages record's last assistant message (a prompt/completion's own)


@dataclass(frozen=True)
class Prompt:
    """One eval record's prompt (as the record gives it), its answer (answer_field's) and its other fields."""

    where: str
    prompt: Any  # a string, or a list of messages
    answer: Optional[str]
    fields: dict


def metric_names(cfg) -> set[str]:
    """The names eval.generate adds to a run's eval records (none when it is off); the reward
    functions are loaded (a bad name is refused here, before the run starts)."""
    section = cfg.eval.generate
    if not section.num_prompts:
        return set()
    check(cfg)
    names = {"generate/mean_length", "generate/clipped_ratio"}
    if section.answer_field:
        names.add("generate/exact_match")
    rewards = load_rewards(section.rewards, f"{KEY}.rewards")
    if rewards:
        names |= {"generate/reward", *(f"generate/rewards/{reward.name}" for reward in rewards)}
    return names


def check(cfg) -> None:
    """UsageError for an eval.generate the run cannot do."""
    section = cfg.eval.generate
    if cfg.data.name not in MODEL_TEXT_SOURCES:
        raise UsageError(
            f"{KEY}.num_prompts={section.num_prompts}: generation-based eval completes the prompts of "
            f"data.name=chat or preferences records, not data.name={cfg.data.name}; set {KEY}.num_prompts=0"
        )
    if not section.answer_field and not section.rewards:
        raise UsageError(
            f"{KEY}.num_prompts={section.num_prompts} scores nothing: set {KEY}.answer_field (exact match, e.g. "
            f"completion or chosen) or {KEY}.rewards (module:function or path/to/file.py:function)"
        )
    if section.top_p > 1:
        raise UsageError(f"{KEY}.top_p={section.top_p} must be in (0, 1]")
    if current().count > 1:  # (the sampler reads each step's tokens on the host: one process's devices)
        raise UsageError(
            f"{KEY}.num_prompts={section.num_prompts}: generation-based eval runs on one process's devices, this "
            f"run's are on {current().count} processes; set {KEY}.num_prompts=0 and score a checkpoint with "
            f"`launch.py eval --workdir DIR {KEY}.num_prompts=N` in one process"
        )


def read_prompts(cfg) -> list[Prompt]:
    """The first num_prompts eval records' prompts, answers and fields (data.eval_path, or the records
    of data.path the source holds out); UsageError naming the file and line of a record without
    answer_field."""
    data, count = cfg.data, cfg.eval.generate.num_prompts
    path = data.eval_path or data.path
    records = list(json_records(Path(path).expanduser(), "JSON Lines records"))
    if not data.eval_path:
        _, records = held_out(records, data.eval_fraction, data.path, "record")
    return [_prompt(where, record, cfg.eval.generate.answer_field) for where, record in records[:count]]


def _prompt(where: str, record: Any, answer_field: str) -> Prompt:
    if not isinstance(record, dict):
        raise UsageError(f"{where}: a JSON {type(record).__name__}, not an object")
    fields = {k: v for k, v in record.items() if k not in ("prompt", "messages", *RESERVED)}
    if "messages" in record:
        messages = as_messages(record["messages"], "messages", "user", where)
        last = messages[-1]["role"] == "assistant" if messages else False
        prompt, given = (messages[:-1], messages[-1]) if last else (messages, None)
        fields[COMPLETION] = [given] if given else None
    elif "prompt" in record:
        prompt = record["prompt"]
    else:
        raise UsageError(f'{where}: no "messages" or "prompt" field to complete (it has {sorted(record)})')
    answer = None
    if answer_field:
        value = fields.get(answer_field)
        if isinstance(value, list) and value and isinstance(value[-1], dict):
            value = value[-1].get("content")  # a list of messages: the last one's content
        if not isinstance(value, str):
            raise UsageError(
                f"{where}: {KEY}.answer_field={answer_field}: the record has no such string (or messages) field "
                f"(it has {sorted(record)}); name one, e.g. completion (a messages record's last assistant message)"
            )
        answer = value
    return Prompt(where, prompt, answer, fields)


class GenerationEval:
    """eval.generate of one run: its prompts rendered and tokenized, its reward functions loaded,
    the decoder built once; called with a state, the metrics."""

    def __init__(self, run):
        cfg = self.cfg = run.cfg
        section = self.section = cfg.eval.generate
        check(cfg)
        self.rewards: list[RewardFunction] = load_rewards(section.rewards, f"{KEY}.rewards")
        self.prompts = read_prompts(cfg)
        _, self.tokenizer, render = model_text(cfg.data)
        special = bool(getattr(render, "special_tokens", False))
        self.ids = []
        with rendering_at(run.dataset.info.template_time):  # the run's recorded date, as its data's (data_record)
            for prompt in self.prompts:
                text = render(as_messages(prompt.prompt, "prompt", "user", prompt.where), True, prompt.where)
                self.ids.append(self.tokenizer.encode(text or "", add_special_tokens=special).ids)
        longest, context = max(map(len, self.ids)), context_length(Path(cfg.workdir), run.dataset.info)
        if longest + section.max_tokens > context:
            raise UsageError(
                f"{KEY}.max_tokens={section.max_tokens}: with the longest of the {len(self.ids)} prompts "
                f"({longest} tokens) it exceeds the model's context of {context} tokens (data.seq_len, or an "
                f"import's max_position_embeddings); "
                f"give {KEY}.max_tokens={max(context - longest, 1)} or less, or fewer {KEY}.num_prompts"
            )
        family = run.model.family
        self.generate = family.language_model.generate
        options = BuildOptions(adaptation=finetune.adaptation(cfg, projections(family)))
        dtype = jax.tree.leaves(run.abstract_state.params)[0].dtype
        compute = jnp.dtype(cfg.train.compute_dtype)
        self.decoder = family.build(cfg.model, run.dataset.info, compute, dtype, options, decode=True)
        self.stops = eos_ids(Path(cfg.workdir), self.tokenizer)
        self.from_step_layout = run.compiled.from_step_layout

    def __call__(self, state) -> dict[str, float]:
        """The completions of the state's model, scored."""
        state = self.from_step_layout(state)
        params = model_variables(state.params, state.model_state)["params"]
        section = self.section
        samples = self.generate(
            self.decoder, params, self.ids, section.max_tokens, section.temperature, section.top_p, self.cfg.seed,
            stop_ids=self.stops,
        )  # fmt: skip
        ended = [bool(tokens) and tokens[-1] in self.stops for tokens in samples]
        ids = [tokens[:-1] if end else tokens for tokens, end in zip(samples, ended)]
        texts = [self.tokenizer.decode(tokens, skip_special_tokens=False) for tokens in ids]
        metrics = {
            "generate/mean_length": float(np.mean([len(tokens) for tokens in samples])),
            "generate/clipped_ratio": float(np.mean([not end for end in ended])),
        }
        if section.answer_field:
            hits = [text.strip() == prompt.answer.strip() for text, prompt in zip(texts, self.prompts)]
            metrics["generate/exact_match"] = float(np.mean(hits))
        if self.rewards:
            metrics.update(self.rewarded(texts, ids))
        return metrics

    def rewarded(self, texts: list[str], ids: list[list[int]]) -> dict[str, float]:
        """generate/reward (each completion's rewards summed, TRL's reward; a None left out) and each
        function's mean, generate/rewards/<name>."""
        conversational = [not isinstance(prompt.prompt, str) for prompt in self.prompts]
        prompts = [prompt.prompt for prompt in self.prompts]
        completions = [[{"role": "assistant", "content": t}] if c else t for t, c in zip(texts, conversational)]
        names = sorted({name for prompt in self.prompts for name in prompt.fields})
        fields = {name: [prompt.fields.get(name) for prompt in self.prompts] for name in names}
        table = np.full((len(texts), len(self.rewards)), np.nan)
        metrics = {}
        for column, reward in enumerate(self.rewards):
            values = call_reward(reward, prompts, completions, ids, fields, f"{KEY}.rewards")
            table[:, column] = [np.nan if v is None else v for v in values]
            applied = table[:, column][~np.isnan(table[:, column])]
            metrics[f"generate/rewards/{reward.name}"] = float(applied.mean()) if applied.size else float("nan")
        metrics["generate/reward"] = float(np.nansum(table, axis=1).mean())
        return metrics


_BUILT: dict[int, tuple[Any, GenerationEval]] = {}  # id(run) → (a weak reference to it, its eval)


def generated_metrics(run, state) -> dict[str, float]:
    """eval.generate's metrics of `state` (a run's step layout), built once per run ({} when off)."""
    if not run.cfg.eval.generate.num_prompts:
        return {}
    built = _BUILT.get(id(run))
    if built is None or built[0]() is not run:
        built = (weakref.ref(run), GenerationEval(run))
        _BUILT[id(run)] = built
    return built[1](state)
