"""finetune.base naming a LoRA run (engine/lm/finetune.py BaseWeights.chain): that run's adapters
merged into its own base in memory, so a LoRA run on a LoRA run (SFT, then DPO) is two commands;
the new run starts at the first run's adapted logits, records the chain, and refuses a changed one."""

import pytest

from engine.config import load_config
from engine.errors import UsageError


@pytest.mark.nocompile
def test_a_base_whose_config_does_not_read_as_a_run_s_is_a_usage_error(tmp_path):
    """finetune.base's config.yaml hand-edited (a section that is not a mapping) was an
    AttributeError or TypeError traceback."""
    from support.configs import ROOT

    from engine.lm.finetune import BaseWeights

    (tmp_path / "lora" / "checkpoints").mkdir(parents=True)
    overrides = [f"finetune.base={tmp_path / 'lora'}", "finetune.lora.rank=2"]
    cfg = load_config(ROOT / "configs" / "mnist_mlp.yaml", overrides, str(tmp_path / "run"))
    for text in ("finetune: {base: /x, lora: {rank: 4}}\nmodel: 3\n", "finetune: nope\n", "finetune: {lora: [1]}\n"):
        (tmp_path / "lora" / "config.yaml").write_text(text)
        with pytest.raises(UsageError, match=r"config.yaml does not read as a run's config"):
            assert BaseWeights(cfg, {}).chain is None
    (tmp_path / "lora" / "config.yaml").write_text("finetune: {base: ''}\nmodel: {name: mlp}\n")  # (not a LoRA run)
    assert BaseWeights(cfg, {}).chain is None
