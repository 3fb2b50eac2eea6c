"""A named projection (nn.DenseGeneral's product, no bias) with what fine-tuning adds:

- a LoRA adapter (`lora_a` [inputs…, rank], `lora_b` [rank, outputs…] beside `kernel`):
  y = x·W + (alpha / rank)·(dropout(x)·A)·B, B zero at the start, so the first forward is the
  base model's;
- a kernel given quantised (a qwix QArray: the frozen base of QLoRA, engine/lm/finetune.py) is
  dequantised here, one layer's kernel at a time;
- `matmul_dtype` fp8 or int8: the product runs on quantised operands (qwix's dot_general_qt:
  per-channel absmax scales, straight-through gradients; fp8 also quantises the incoming
  gradients, as e5m2), the LoRA path in the compute dtype.

The kernel keeps its name and layout, so checkpoints and Hugging Face mappings are those of
the same model without adapters.
"""

from __future__ import annotations

from typing import Optional

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import qwix
from qwix._src.core import dot_general_qt as qt  # qwix's public quantize_model wraps this per call

from contract.adapters import NO_ADAPTATION, Adaptation
from models.layers import normal_kernel, param_init

MATMUL_QTYPES = {"fp8": ("float8_e4m3fn", "float8_e5m2"), "int8": ("int8", None)}  # (operands, gradients)
BASE_QTYPES = {"int8": "int8", "nf4": "nf4", "fp8": "float8_e4m3fn"}  # finetune.base_dtype → qwix's qtype
NF4_BLOCK = 64  # QLoRA's block of weights per scale, along the contracted axis


@flax.struct.dataclass
class PackedNF4:
    """An nf4 kernel with two 4-bit codes per byte along its last axis (XLA:CPU keeps uint4
    arrays a byte per code, so qwix's uint4 qvalue would take 1/4 of float32, not 1/8)."""

    codes: jax.Array  # uint8 [..., last / 2]: the first half of the last axis low, the second high
    scale: jax.Array  # qwix's per-block scales

    @property
    def shape(self) -> tuple[int, ...]:  # the kernel's (a scan's slice of the stack: one layer's)
        return (*self.codes.shape[:-1], 2 * self.codes.shape[-1])

    def unpack(self) -> qwix.QArray:
        # halves joined along the last axis: no trailing axis of 2, which TPU tiling pads 64-fold
        codes = jnp.concatenate([self.codes & 15, self.codes >> 4], axis=-1)
        return qwix.QArray(codes.astype(jnp.uint4), self.scale, qtype="nf4")


def quantize_kernel(w, inputs: int, outputs: int, base_dtype: str):
    """A kernel [layers?, inputs…, outputs…] quantised: int8 and fp8 with one absmax scale per
    output channel (and layer), nf4 per block of NF4_BLOCK inputs (packed two codes a byte)."""
    first = w.ndim - inputs - outputs  # a stacked layers axis before them
    contracted = list(range(first, first + inputs))
    channelwise = [a for a in range(w.ndim) if a not in contracted]
    if base_dtype != "nf4":
        return qwix.quantize(w, BASE_QTYPES[base_dtype], channelwise_axes=channelwise)
    last = contracted[-1]
    tiled = {**{a: 1 for a in contracted[:-1]}, last: NF4_BLOCK if w.shape[last] % NF4_BLOCK == 0 else w.shape[last]}
    q = qwix.quantize(w, "nf4", channelwise_axes=channelwise, tiled_axes=tiled)
    if w.shape[-1] % 2:
        return q  # (an odd last axis: a byte per code)
    codes = q.qvalue.astype(jnp.uint8)
    half = w.shape[-1] // 2
    return PackedNF4(codes[..., :half] | (codes[..., half:] << 4), q.scale)


def is_quantised(value) -> bool:
    return isinstance(value, (PackedNF4, qwix.QArray))


def dequantized(kernel):
    """A stored kernel as an array (a frozen base's may be quantised)."""
    if isinstance(kernel, PackedNF4):
        kernel = kernel.unpack()
    return qwix.dequantize(kernel) if isinstance(kernel, qwix.QArray) else kernel


def quantised_dot(x, kernel, dims, matmul_dtype: str):
    """lax.dot_general(x, kernel, dims), its operands quantised as `matmul_dtype` says."""
    if matmul_dtype == "none":
        return jax.lax.dot_general(x, kernel, dims)
    operands, grads = MATMUL_QTYPES[matmul_dtype]
    config = qt.DotGeneralQtConfig(lhs_qtype=operands, rhs_qtype=operands, dlhs_grad_qtype=grads, drhs_grad_qtype=grads)
    return qt.dot_general_qt(x, kernel, dims, config).astype(x.dtype)


class Projection(nn.Module):
    features: tuple[int, ...]
    kernel_axes: tuple[Optional[str], ...]  # logical axes: the contracted inputs', then the outputs'
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    inputs: int = 1  # how many trailing axes of x are contracted
    adapt: Adaptation = NO_ADAPTATION

    @nn.compact
    def __call__(self, x):
        contracted = tuple(range(x.ndim - self.inputs, x.ndim))
        in_shape = tuple(x.shape[a] for a in contracted)
        stored = self.get_variable("params", "kernel") if self.has_variable("params", "kernel") else None
        if isinstance(stored, (PackedNF4, qwix.QArray)):  # a quantised frozen base (of another shape: packed)
            kernel = dequantized(stored)
        else:
            kernel = self.param("kernel", normal_kernel(self.kernel_axes), in_shape + self.features, self.param_dtype)
        x = x.astype(self.dtype)
        dims = ((contracted, tuple(range(self.inputs))), ((), ()))
        y = quantised_dot(x, kernel.astype(self.dtype), dims, self.adapt.matmul_dtype)
        if self.adapt.lora_on(self.name or ""):
            y = y + self._lora(x, in_shape, dims)
        return y

    def _lora(self, x, in_shape, dims):
        adapt, rank = self.adapt, self.adapt.lora_rank
        in_axes, out_axes = self.kernel_axes[: self.inputs], self.kernel_axes[self.inputs :]
        if adapt.lora_init == "gaussian":  # PEFT's init_lora_weights="gaussian"
            a_init = nn.initializers.normal(1.0 / rank)
        else:  # PEFT's default: Kaiming-uniform (a = sqrt(5)), over the contracted inputs
            a_init = nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform", in_axis=tuple(range(self.inputs)))
        a = self.param("lora_a", param_init(a_init, (*in_axes, "lora")), (*in_shape, rank), self.param_dtype)
        b = self.param(
            "lora_b",
            param_init(nn.initializers.zeros_init(), ("lora", *out_axes)),
            (rank, *self.features),
            self.param_dtype,
        )
        if adapt.lora_dropout > 0 and self.has_rng("dropout"):  # training (eval and sampling pass no rng)
            x = nn.Dropout(adapt.lora_dropout, deterministic=False)(x, rng=self.make_rng("dropout"))
        low = jax.lax.dot_general(x, a.astype(self.dtype), dims)  # [..., rank]
        delta = jax.lax.dot_general(low, b.astype(self.dtype), (((low.ndim - 1,), (0,)), ((), ())))
        return delta * jnp.asarray(adapt.lora_alpha / rank, self.dtype)
