import jax.numpy as jnp
import pytest
from support.models import TOKENS

from models import REGISTRY
from models.transformer import TransformerConfig


@pytest.mark.nocompile
def test_model_config_validation(make_config):
    with pytest.raises(ValueError, match="model.depth=20 is not one of 18, 34, 50"):  # a declared choice
        make_config("mnist_mlp.yaml", "model.name=resnet", "model.depth=20")
    with pytest.raises(ValueError, match="not divisible by model.num_heads=3"):
        TransformerConfig(d_model=16, num_heads=3).validate()


@pytest.mark.nocompile
def test_loss_chunk_must_divide_the_sequence():
    module_cfg = TransformerConfig(num_layers=1, d_model=16, num_heads=2, mlp_dim=32, loss_chunk=5)
    with pytest.raises(ValueError, match="model.loss_chunk=5 does not divide data.seq_len=12"):
        REGISTRY["transformer"].build(module_cfg, TOKENS, jnp.float32, jnp.float32)
