"""An imported model keeps its tokenizer: `import-hf` brings tokenizer.json into the workdir,
training on ids of another tokenizer (or bytes) is refused, and `sample` decodes with the
model's tokenizer, stops at its end-of-text token, stays within its context and refuses ids
the tokenizer does not have."""

import jax.numpy as jnp
import numpy as np
import pytest
from support.llama import TINY, greedy_reference

from engine.data import DataInfo
from models import REGISTRY, sampling
from models.llama import LlamaConfig


def test_generation_ends_after_a_stop_id():
    info = DataInfo("tokens", 8, 8, vocab_size=61, seq_len=12)
    family = REGISTRY["llama"]
    cfg = LlamaConfig(**TINY)
    module = family.build(cfg, info, jnp.float32, jnp.float32)
    import jax

    params = module.init(jax.random.key(0), jnp.zeros((1, 12), jnp.int32), train=False)["params"]
    decoder = family.build(cfg, info, jnp.float32, jnp.float32, decode=True)
    (full,) = sampling.generate(decoder, params, [[1, 2, 3]], 8)
    seen = []
    (stopped,) = sampling.generate(
        decoder, params, [[1, 2, 3]], 8, stop_ids=[full[2]], on_step=lambda ids: seen.append(ids[0])
    )
    assert stopped == full[: full.index(full[2]) + 1] == seen
    assert len(full) == 8 and np.all(np.asarray(full) < 61)


@pytest.mark.parametrize("name", ["llama", "transformer"])
def test_prompts_of_different_lengths_in_one_batch_each_give_what_they_give_alone(name):
    from models.configs import TransformerConfig

    info = DataInfo("tokens", 8, 8, vocab_size=61, seq_len=24)
    family = REGISTRY[name]
    cfg = LlamaConfig(**TINY) if name == "llama" else TransformerConfig(num_layers=2, d_model=32, mlp_dim=64)
    module = family.build(cfg, info, jnp.float32, jnp.float32)
    import jax

    params = module.init(jax.random.key(1), jnp.zeros((1, 24), jnp.int32), train=False)["params"]
    decoder = family.build(cfg, info, jnp.float32, jnp.float32, decode=True)
    prompts = [[5, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9], [40, 41, 42, 43, 44]]
    together = sampling.generate(decoder, params, prompts, 8, num_samples=2)
    alone = [greedy_reference(module, params, prompt, 8, length=24) for prompt in prompts]
    assert together == [alone[0], alone[0], alone[1], alone[1], alone[2], alone[2]]
    assert len({tuple(a) for a in alone}) == 3  # three different continuations
