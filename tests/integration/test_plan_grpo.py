"""`launch.py plan` of a GRPO run (train.objective=grpo): both of its programs compiled for a TPU
target by the TPU compiler on this CPU host, the update (its train step, on the rollout batch) and
the rollouts' decode (engine/lm/rollouts.py, at the grpo section's static shapes), each with its
memory per chip in the plan's table."""

import dataclasses

import pytest
from support.grpo import overrides, write_files

from engine.plan.compiled import Planned, Program, plan
from engine.plan.tpu import parse_target
from engine.plan.verdict import render, verdict

pytest.importorskip("libtpu", reason="the TPU compiler (libtpu) is not installed")


@pytest.mark.slow
def test_a_grpo_plan_compiles_the_update_and_the_decode_and_reports_each_memory(make_config, tmp_path):
    """A tiny Llama with LoRA, 4 prompts x 4 completions of 4 tokens after 16-token prompts, fsdp over
    a v5e-4: the update and the decode both compiled for the TPU (no eval program: GRPO evaluates by
    sampling), each row holding the whole train state, its own input and the compiler's temporaries."""
    keys = [k for k in overrides(write_files(tmp_path), 1) if not k.startswith("mesh.")]
    cfg = make_config("llama_tiny.yaml", *keys, "mesh.data=1", "mesh.fsdp=4")
    planned = plan(cfg, parse_target("v5e-4"))
    update, decode = planned.programs
    assert (update.name, decode.name) == ("update", "decode")
    assert update.compile_seconds > 0 and decode.compile_seconds > 0
    # the train state is on the chips through both programs; each reads its own input
    state = (update.params, update.optimizer, update.other_state)
    assert (decode.params, decode.optimizer, decode.other_state) == state
    assert decode.batch == 16 * 16 * (4 + 1) // 4  # 16 rows of 16 int32 prompt tokens and their bool mask, over 4 chips
    for program in (update, decode):
        state = program.params + program.optimizer + program.other_state
        assert program.temporaries > 0 and program.total > state + program.batch + program.temporaries
    assert planned.fits and planned.peak == max(update.total, decode.total)
    text = render(planned)
    assert "batch: 4 prompts a step x 4 completions (grpo.num_generations) = 16 rows of 16 prompt + 4" in text
    assert [line.split()[0] for line in text.splitlines() if line.startswith(("update ", "decode ", "eval "))] == [
        "update",
        "decode",
    ]
    assert "compile: update " in text and ", decode " in text
    assert verdict(planned).startswith("fits:")


def test_a_decode_that_does_not_fit_is_named_with_what_shrinks_it(make_config, tmp_path):
    """The verdict of a GRPO plan whose decode is over the chip's HBM, or refused by the compiler:
    it names the decode program and its own fixes (fewer rows, shorter rollouts), not the update's
    gradient accumulation (figures given: nothing compiled)."""
    keys = [k for k in overrides(write_files(tmp_path), 1) if not k.startswith("mesh.")]
    cfg = make_config("llama_tiny.yaml", *keys, "mesh.data=1", "mesh.fsdp=4")
    planned = Planned(cfg, parse_target("v5e-4"), {"data": 1, "fsdp": 4}, {"data": 1, "fsdp": 1}, 16 << 30)
    update = Program("update", 1 << 20, 2 << 20, 1 << 10, 1 << 10, 1 << 20, 5 << 20, 1.0)
    planned.programs = [update, Program("decode", 1 << 20, 2 << 20, 1 << 10, 1 << 10, 17 << 30, 18 << 30, 1.0)]
    said = verdict(planned)
    assert said.startswith("does not fit: the decode program needs 18")
    assert "train.global_batch_size=2 prompts" in said and "grpo.max_completion_tokens=2" in said
    assert "grad_accum" not in said
    refused = dataclasses.replace(
        planned, refused="RESOURCE_EXHAUSTED", refused_program="decode", programs=[update, Program("decode", *[-1] * 7)]
    )
    assert "the TPU compiler refused the decode program: RESOURCE_EXHAUSTED" in render(refused)
    assert "refused the decode program" in verdict(refused) and "grpo.num_generations=2" in verdict(refused)
