"""The DPO objective (engine/objectives/dpo_part.py, engine/config/dpo_objective.py): TRL's losses,
the reference under LoRA and full fine-tuning, response-only sequence log-probabilities, the
metrics' flow, and its config checks."""

import dataclasses

import pytest
from support.configs import TINY_LLAMA

from engine.config.objective import check_objective
from engine.errors import UsageError


@pytest.mark.nocompile
def test_config_checks(make_config):
    cfg = make_config("mnist_mlp.yaml", *TINY_LLAMA)
    dpo_run = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, objective="dpo"))
    with pytest.raises(UsageError, match="data.name=preferences"):
        check_objective(dpo_run)
    preferences = dataclasses.replace(dpo_run, data=dataclasses.replace(cfg.data, name="preferences"))
    check_objective(preferences)
    with pytest.raises(UsageError, match="train.objective=dpo"):
        check_objective(dataclasses.replace(preferences, train=cfg.train))
    with pytest.raises(UsageError, match=r"dpo.beta=0.5 set with train.objective=lm.*set train.objective=dpo"):
        make_config("mnist_mlp.yaml", *TINY_LLAMA, "dpo.beta=0.5")
    for dpo, message in (
        ({"loss": "ipo", "label_smoothing": 0.1}, "dpo.loss=ipo takes no label smoothing"),
        ({"loss": "hinge", "label_smoothing": 0.1}, "dpo.loss=hinge takes no label smoothing"),
        ({"label_smoothing": 0.5}, r"must be in \[0, 0.5\)"),
    ):
        with pytest.raises(UsageError, match=message):
            check_objective(dataclasses.replace(preferences, dpo=dataclasses.replace(cfg.dpo, **dpo)))
    lora = dataclasses.replace(cfg.finetune.lora, dropout=0.1)  # DPO scores without dropout (TRL's disable_dropout)
    with pytest.raises(UsageError, match=r"finetune.lora.dropout=0.1 has no effect.*set finetune.lora.dropout=0"):
        check_objective(dataclasses.replace(preferences, finetune=dataclasses.replace(cfg.finetune, lora=lora)))
    check_objective(dataclasses.replace(preferences, dpo=dataclasses.replace(cfg.dpo, precompute_reference=True)))
    check_objective(dataclasses.replace(preferences, dpo=dataclasses.replace(cfg.dpo, label_smoothing=0.2)))
