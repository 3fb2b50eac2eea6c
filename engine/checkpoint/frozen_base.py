"""A fine-tuning run's frozen base in its checkpoints: stripped from each save, rejoined on restore.

A LoRA run's checkpoint holds the adapters and the base's identity (finetune.base's checkpoint
and its checksum), not the base: a restore checks that identity and reads the base from its own
checkpoint (store.load_base), into the train state's shardings and quantisation.
"""

from __future__ import annotations

from typing import Any, Callable

from engine.lm.finetune import BaseWeights, with_frozen, without_frozen
from engine.state.train_state import FROZEN


class FrozenBase:
    """The base of the run whose checkpoints these are. A read-only reader (eval, export,
    sample) keeps the base it read for every later restore; a trainer keeps nothing (its state
    is donated to its step: nothing may keep its arrays)."""

    def __init__(self, base: BaseWeights, read_only: bool):
        self.base, self.read_only = base, read_only
        self._frozen: Any = None

    def strip(self, state, meta: dict) -> tuple[Any, dict]:
        """What a save writes: the state without the base, the meta with the base's identity."""
        return without_frozen(state), {**meta, "base": self.base.identity}

    @staticmethod
    def saved_part(abstract_state):
        """The part of `abstract_state` that a checkpoint holds (all but the base)."""
        return without_frozen(abstract_state)

    def rejoin(self, state, meta: dict, where: str, abstract_state, load: Callable[[BaseWeights, Any], Any]):
        """`state`, restored from the checkpoint at `where` (its `meta`), with the base rejoined:
        UsageError if that checkpoint was trained on another base. `load(base, abstract_frozen)`
        reads the base into the shardings of `abstract_state`'s."""
        self.base.check(meta.get("base"), where)
        frozen = self._frozen if self._frozen is not None else load(self.base, abstract_state.model_state[FROZEN])
        if self.read_only:
            self._frozen = frozen
        return with_frozen(state, frozen)
