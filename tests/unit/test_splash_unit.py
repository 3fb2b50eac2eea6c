"""model.attention=splash: the Pallas flash kernel (interpreted on CPU) gives XLA's causal
attention, values and gradients, with grouped-query heads and packed documents; a sequence the
tiles do not divide is refused; a Llama run trains to XLA's losses and weights, on one device and
sharded, with packed documents."""

import jax.numpy as jnp
import pytest

from engine.errors import UsageError


@pytest.mark.nocompile
def test_auto_attention_is_splash_on_tpu_where_it_can_run_and_cudnn_or_xla_elsewhere():
    from models.llama import chosen_attention

    bf16, f32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
    assert chosen_attention("auto", "tpu", bf16, 8192, per_device=True) == "splash"
    assert chosen_attention("auto", "tpu", f32, 1024, per_device=True) == "splash"
    assert chosen_attention("auto", "tpu", bf16, 1000, per_device=True) == "xla"  # 128 does not divide 1000
    assert chosen_attention("auto", "tpu", bf16, 8192, per_device=False) == "xla"  # vmapped or pipelined
    assert chosen_attention("auto", "gpu", bf16, 8192, per_device=True) == "cudnn"
    assert chosen_attention("auto", "gpu", f32, 8192, per_device=True) == "xla"
    assert chosen_attention("auto", "cpu", bf16, 8192, per_device=True) == "xla"
    assert chosen_attention("xla", "tpu", bf16, 8192, per_device=True) == "xla"  # named: as named


@pytest.mark.nocompile
def test_cudnn_attention_off_a_gpu_is_one_line_naming_what_runs_there(make_config):
    from engine.run.setup import trace_run
    from models.configs import LlamaConfig, ModelError, TransformerConfig, check_attention

    with pytest.raises(ModelError, match="GPU kernel.*TPU target.*auto or splash or xla"):
        check_attention(LlamaConfig(attention="cudnn"), "tpu")
    with pytest.raises(ModelError, match="cpu devices; set model.attention=auto or xla"):
        check_attention(TransformerConfig(attention="cudnn"), "cpu")
    check_attention(LlamaConfig(attention="cudnn"), "gpu")  # a GPU's: JAX's to run
    # a run on CPU is refused before its data is read (not JAX's "cuDNN is not detected" when traced)
    cfg = make_config("llama_tiny.yaml", "data.name=tokens", "data.path=/nonexistent", "model.attention=cudnn")
    with pytest.raises(UsageError, match="model.attention=cudnn is cuDNN's flash attention"):
        trace_run(cfg)
