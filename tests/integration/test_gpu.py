"""What only a GPU runs: cuDNN's fused attention against XLA's, and bfloat16 training through
the CLI with its MFU. Skipped without a GPU; on one: ENGINE_TEST_GPU=1 python -m pytest tests/integration/test_gpu.py"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.data import DataInfo
from engine.parallel.sharding import unbox
from models import REGISTRY
from models.llama import LlamaConfig
from models.transformer import TransformerConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (ENGINE_TEST_GPU=1 on a machine with one)"),
]


INFO = DataInfo("tokens", 8, 8, vocab_size=256, seq_len=128)


CONFIGS = {
    "llama": LlamaConfig(num_layers=2, d_model=128, num_heads=4, num_kv_heads=2, mlp_dim=256, vocab_size=256),
    "transformer": TransformerConfig(num_layers=2, d_model=128, num_heads=4, mlp_dim=256),
}


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_cudnn_attention_equals_xla_in_bfloat16(family):
    """model.attention=auto picks cuDNN on a GPU in bf16: same logits and gradients as XLA's attention."""
    import dataclasses

    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (4, 128)), jnp.int32)
    out = {}
    for attention in ("xla", "cudnn"):
        cfg = dataclasses.replace(CONFIGS[family], attention=attention)
        module = REGISTRY[family].build(cfg, INFO, jnp.bfloat16, jnp.float32)
        params = unbox(module.init({"params": jax.random.key(0)}, tokens, train=False))["params"]

        def loss(p):
            logits = module.apply({"params": p}, tokens, train=False).astype(jnp.float32)
            return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, tokens[..., None], -1)[..., 0])

        value, grads = jax.jit(jax.value_and_grad(loss))(params)
        hlo = jax.jit(loss).lower(params).compile().as_text()
        out[attention] = (float(value), grads, "custom-call" in hlo and "cudnn" in hlo.lower())
    assert out["cudnn"][2] and not out["xla"][2], "cuDNN's fused attention is not in the cudnn program"
    np.testing.assert_allclose(out["cudnn"][0], out["xla"][0], rtol=2e-2)
    for a, b in zip(jax.tree.leaves(out["cudnn"][1]), jax.tree.leaves(out["xla"][1])):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=0.1, atol=2e-3)
