"""GRPO's decode program (engine/lm/rollouts.py) of llama3_8b with LoRA rank 16 on every
projection, compiled for a v6e-8 by the TPU compiler on this host (no chip, no weights): the
program's memory per chip, as `launch.py plan` reports a train step's.

The decode reads the train state where it is (the frozen base and the adapters, FSDP over the
chips: engine/run/setup.py trace_run's shardings); the rows (prompts x generations) are split over
the batch axes; Llama 3's end-of-text and end-of-turn ids stop a row.

    python benchmarks/grpo_decode_plan.py ROWS PROMPT_TOKENS COMPLETION_TOKENS   # e.g. 64 256 512
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GIB = 1 << 30


def main() -> None:
    import jax
    import jax.numpy as jnp

    from engine.config import load_config
    from engine.lm import finetune, rollouts
    from engine.parallel.sharding import ActivationLayout, batch_sharding
    from engine.plan.compiled import _no_persistent_cache
    from engine.plan.tpu import parse_target
    from engine.run.setup import trace_run
    from engine.state.train_state import model_variables
    from models.family import BuildOptions, projections

    rows, prompt, completion = (int(a) for a in sys.argv[1:4])
    overrides = ["finetune.lora.rank=16", "finetune.lora.targets=[all]", "train.param_dtype=bfloat16"]
    overrides += [f"train.global_batch_size={rows}", f"data.seq_len={prompt + completion}"]
    cfg = load_config(str(ROOT / "configs" / "llama3_8b.yaml"), overrides)
    started = time.perf_counter()
    plan = trace_run(cfg, devices=parse_target("v6e-8").devices)
    state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), plan.state.abstract, plan.state.shardings
    )
    params = model_variables(state.params, state.model_state)["params"]  # the base and the adapters
    options = BuildOptions(
        adaptation=finetune.adaptation(cfg, projections(plan.family)), layout=ActivationLayout(plan.mesh)
    )
    param_dtype = jnp.dtype(cfg.train.param_dtype)
    decoder = plan.family.build(cfg.model, plan.dataset.info, jnp.bfloat16, param_dtype, options, decode=True)
    spec = rollouts.DecodeSpec(prompt, completion, temperature=1.0, stop_ids=(128001, 128009))
    with _no_persistent_cache():  # (a TPU program cannot be loaded back on this host, as plan's)
        decode = rollouts.build_decode(decoder, spec, params, rows, batch_sharding(plan.mesh))
    m = decode.compiled.memory_analysis()
    print(
        f"mesh {dict(plan.mesh.shape)}; rows {rows}, prompt {prompt}, completion {completion}; compiled in "
        f"{decode.compile_seconds:.0f} s ({time.perf_counter() - started:.0f} s with the setup)"
    )
    print(
        f"per chip: arguments {m.argument_size_in_bytes / GIB:.2f} GiB, outputs {m.output_size_in_bytes / GIB:.3f} "
        f"GiB, temporaries {m.temp_size_in_bytes / GIB:.2f} GiB, code {m.generated_code_size_in_bytes / GIB:.3f} GiB"
    )


if __name__ == "__main__":
    main()
