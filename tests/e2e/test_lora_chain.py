"""finetune.base naming a LoRA run (engine/lm/finetune.py BaseWeights.chain): that run's adapters
merged into its own base in memory, so a LoRA run on a LoRA run (SFT, then DPO) is two commands;
the new run starts at the first run's adapted logits, records the chain, and refuses a changed one."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.cli import child_env, run_cli
from support.finetune import DATA, LORA, imported_base, logits
from support.one_process import run_steps

from engine.checkpoint.store import load_base, restore_newest
from engine.config import load_config
from engine.errors import UsageError
from engine.lm.finetune import base_weights, with_frozen
from engine.run.setup import build_run
from engine.state.train_state import FROZEN


def test_a_lora_run_on_a_lora_run_starts_at_its_adapted_logits_trains_and_refuses_a_changed_chain(
    tmp_path, tmp_path_factory
):
    base_dir, sft_dir = tmp_path / "base", tmp_path / "sft"
    shutil.copytree(imported_base(tmp_path_factory)[1], base_dir)  # (a copy: its base trains on below)
    common = ["--config", str(base_dir / "config.yaml"), *DATA, f"finetune.base={base_dir}", *LORA]
    proc = run_cli(*common, "--workdir", str(sft_dir), "train.steps=2")  # the first LoRA run (SFT)
    assert proc.returncode == 0, proc.stderr

    sft_cfg = load_config(sft_dir / "config.yaml", [], str(sft_dir))
    sft = build_run(sft_cfg, compile_train=False)
    trained = restore_newest(sft_dir, sft.abstract_state, sft_cfg, "read").state
    adapted = logits(sft, trained)
    unadapted = logits(sft, trained.replace(params=jax.tree.map(jnp.zeros_like, trained.params)))
    assert np.abs(adapted - unadapted).max() > 1e-3  # (the first run's adapters moved its logits)
    overrides = [*DATA, f"finetune.base={sft_dir}", *LORA, "finetune.lora.rank=2", "train.steps=2"]
    cfg = load_config(base_dir / "config.yaml", overrides, str(tmp_path / "dpo"))
    run = build_run(cfg, compile_train=False)
    start = with_frozen(run.init_state(), load_base(base_weights(cfg), run.abstract_state.model_state[FROZEN]))
    np.testing.assert_allclose(logits(run, start), adapted, rtol=1e-5, atol=1e-5)  # B = 0: the merged first run

    # the second LoRA run; then the first run's base trains on (both through the CLI's main in one
    # process: tests/support/one_process.py)
    more_args = ["--config", str(base_dir / "config.yaml"), "--workdir", str(base_dir), *DATA, "train.steps=1"]
    second, more = run_steps(
        tmp_path,
        [
            {"argv": ["--config", str(base_dir / "config.yaml"), "--workdir", str(tmp_path / "dpo"), *overrides]},
            {"argv": more_args},
        ],
        env=child_env({"HOME": str(tmp_path)}),
    )
    assert second["code"] == 0 and not second["escaped"], second["escaped"] or second["stderr"][-3000:]
    meta = json.loads((tmp_path / "dpo" / "checkpoints" / "2" / "meta" / "metadata").read_text())
    recorded = meta["base"]  # the adapter run's step and checksum, and its own base's
    assert recorded["path"] == str(sft_dir) and recorded["step"] == 2 and len(recorded["adapters_sha256"]) == 64
    assert recorded["base"]["path"] == str(base_dir) and recorded["sha256"] != recorded["adapters_sha256"]

    # the first run's base trained on: the chain changed, and a resume of the second run exits 2
    assert more["code"] == 0 and not more["escaped"], more["escaped"] or more["stderr"][-3000:]
    assert base_weights(cfg).identity["sha256"] != recorded["sha256"]
    with pytest.raises(UsageError, match=f"finetune.base={sft_dir}: finetune.base=.*the base changed since"):
        load_base(base_weights(cfg), run.abstract_state.model_state[FROZEN])
    with pytest.raises(UsageError, match=f"finetune.base={sft_dir}: the base changed since"):
        restore_newest(tmp_path / "dpo", run.abstract_state, cfg, "read")
