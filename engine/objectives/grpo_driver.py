"""train.objective=grpo inside the run (docs/design/grpo.md section 7): the decode program compiled
once beside the update, for the rollout batch's rows (train.global_batch_size prompts x
grpo.num_generations), from the state's parameters (under LoRA the frozen base and the current
adapters, `model_variables`: nothing copied); each rollout's key is rollouts.rollout_key(state.rng,
step), a function of (seed, step), so a run resumed after SIGKILL samples the same completions.

`Rollouts.sample(state, prompts, step)` gives the update's batch (host arrays, one row a
completion) and the host's metrics (TRL's rewards/<function>/mean and completions/..., seconds
sampling); `Rollouts.evaluate(state, prompts, step)` the mean reward of sampled completions to
the eval prompts (eval/reward). In a job of several processes each samples its rows of a batch on
the run's mesh and process 0 alone calls the reward functions (engine/objectives/grpo_rollout.py)."""

from __future__ import annotations

import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from engine.data import process_rows
from engine.data.prompts import fit_prompts
from engine.errors import UsageError
from engine.lm import finetune
from engine.lm.rewards import load_rewards
from engine.lm.rollouts import DecodeSpec, build_decode, rollout_key
from engine.lm.tokenizer import eos_ids, load_tokenizer_file
from engine.objectives.grpo_rollout import rollout_batch
from engine.runtime.processes import current
from engine.state.train_state import model_variables
from models.family import BuildOptions, projections

LAYOUTS = ("data", "fsdp", "tensor")  # the mesh axes a GRPO run may split (the others refused)
EVAL_STEP = 1 << 30  # eval keys: rollout_key(rng, EVAL_STEP + step), apart from every train step's


def check_layout(cfg, mesh_shape: dict) -> None:
    """UsageError for a GRPO run on a layout the rollouts do not run on (pipeline stages, context,
    experts, pmap, eager)."""
    others = {axis: size for axis, size in mesh_shape.items() if axis not in LAYOUTS and size > 1}
    if cfg.train.steps_per_call != 1:
        raise UsageError(
            f"train.steps_per_call={cfg.train.steps_per_call}: a GRPO step samples on the host between updates; "
            "set train.steps_per_call=1"
        )
    if others or cfg.mesh.backend == "pmap" or cfg.train.eager:
        what = ", ".join(f"mesh.{a}={s}" for a, s in others.items()) or (
            "mesh.backend=pmap" if cfg.mesh.backend == "pmap" else "train.eager=true"
        )
        raise UsageError(
            f"train.objective=grpo runs on the data, fsdp and tensor layouts (jit), not with {what}; set it to 1 "
            "(or the default) and split the model over mesh.data, mesh.fsdp or mesh.tensor"
        )


def fitted(cfg, dataset, mesh_shape: dict):
    """The prompts padded to the decode's widths (data.prompts fit_prompts), the layout checked."""
    check_layout(cfg, mesh_shape)
    if dataset.records is None:  # a recorded run's stand-in (sample, export): its DataInfo is the fitted one
        return dataset
    return fit_prompts(dataset, cfg.grpo.max_prompt_tokens, cfg.grpo.max_completion_tokens)


def rollout_spec(cfg) -> dict:
    """The update batch's arrays (grpo.py ROLLOUT_ARRAYS with rewards, zero_std, truncated) as
    zero-length stand-ins, data.pipeline example_spec's form."""
    width, steps = cfg.grpo.max_prompt_tokens, cfg.grpo.max_completion_tokens
    spec = {
        "prompt_tokens": ((width,), np.int32),
        "prompt_mask": ((width,), np.bool_),
        "completion_tokens": ((steps,), np.int32),
        "completion_mask": ((steps,), np.bool_),
        "old_logps": ((steps,), np.float32),
        "advantages": ((), np.float32),
        "rewards": ((), np.float32),
        "zero_std": ((), np.float32),
        "truncated": ((), np.float32),
    }
    return {name: np.zeros((0, *shape), dtype) for name, (shape, dtype) in spec.items()}  # (example_spec's form)


class Rollouts:
    """The run's decode program, reward functions and detokenizer (see the module's docstring)."""

    def __init__(self, cfg, family, dataset, abstract_state, data_sharding=None):
        grpo = cfg.grpo
        self.cfg, self.grpo, self.records, self.sharding = cfg, grpo, dataset.records, data_sharding
        info = dataset.info
        options = BuildOptions(adaptation=finetune.adaptation(cfg, projections(family)))
        dtype = jax.tree.leaves(abstract_state.params)[0].dtype
        decoder = family.build(cfg.model, info, jnp.dtype(cfg.train.compute_dtype), dtype, options, decode=True)
        self.tokenizer = None
        if info.tokenizer:
            self.tokenizer = load_tokenizer_file(Path(info.tokenizer), "give data.tokenizer a model's tokenizer.json")
        stops = tuple(eos_ids(Path(cfg.workdir), self.tokenizer)) if self.tokenizer is not None else ()
        spec = DecodeSpec(
            grpo.max_prompt_tokens, grpo.max_completion_tokens, grpo.temperature, grpo.top_p, grpo.top_k, stops, 0
        )
        self.rows = cfg.train.global_batch_size * grpo.num_generations
        params = model_variables(abstract_state.params, abstract_state.model_state)["params"]
        try:
            self.decode = build_decode(decoder, spec, params, self.rows, data_sharding)
        except ValueError as e:
            raise UsageError(f"grpo: {e} (grpo.max_prompt_tokens, grpo.max_completion_tokens)") from None
        self.rewards = load_rewards(grpo.rewards, "grpo.rewards")

    def detokenize(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def sample(self, state, prompts: dict, step: int, split: int = 0) -> tuple[dict, dict]:
        """(the update's batch of host arrays, the whole batch's; host metrics) of the prompts'
        rollouts at `step`; `prompts`: this process's rows of the batch (in a job of several
        processes process 0 scores them all: grpo_rollout.py)."""
        began = time.perf_counter()
        params = model_variables(state.params, state.model_state)["params"]
        key = rollout_key(state.rng, step)
        batch, host = rollout_batch(
            self.decode, params, prompts, key, self.records[split], self.rewards, self.detokenize, self.grpo,
            self.sharding,
        )  # fmt: skip
        host["seconds/sampling"] = time.perf_counter() - began
        return batch, host

    def evaluate(self, state, prompts: dict, step: int) -> dict[str, float]:
        """eval/reward: the mean reward of sampled completions to the eval split's prompts (batches of
        train.global_batch_size, the last one's missing prompts filled by repeating the first)."""
        count = len(prompts["record_index"])
        size = self.cfg.train.global_batch_size
        total, seen = 0.0, 0
        for begin in range(0, count, size):
            index = (np.arange(begin, begin + size) % count)[self.local_rows(size)]
            part = {name: np.asarray(array)[index] for name, array in prompts.items()}
            batch, _ = self.sample(state, part, EVAL_STEP + step + begin, split=1)
            real = min(size, count - begin) * self.grpo.num_generations
            total += float(np.sum(batch["rewards"][:real]))
            seen += real
        return {"reward": total / max(seen, 1)}

    def local_rows(self, size: int) -> np.ndarray:
        """The rows of a batch of `size` prompts this process gives the decode (data.process_rows;
        one process: all)."""
        if current().count == 1 or self.sharding is None:
            return np.arange(size)
        return process_rows(self.sharding, size)
