"""Causal attention through JAX's Pallas TPU flash kernel (splash attention): no [seq, seq] scores.

`chosen_attention` is what model.attention=auto runs on a platform: splash, cuDNN or XLA."""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash
from jax.sharding import PartitionSpec

from contract.activations import Constrainer
from models.configs import ModelError

BLOCKS = (512, 256, 128)  # tile sizes tried, largest first; the kernel's tiles are multiples of 128


def block_size(seq: int) -> int:
    """The largest tile of BLOCKS that divides `seq`; a ValueError naming the key if none does."""
    for block in BLOCKS:
        if seq % block == 0:
            return block
    raise ModelError(
        f"model.attention=splash tiles the sequence in blocks of {BLOCKS[-1]}, which do not divide "
        f"the sequence length {seq}; use a data.seq_len that is a multiple of {BLOCKS[-1]}, or model.attention=xla"
    )


def _kernel(heads: int, seq: int, block: int, interpret: bool):
    """The causal kernel for one example: q [heads, seq, dim], k and v [kv_heads, seq, dim] (kv_heads
    divides heads: query head h reads key/value head h // (heads / kv_heads), as XLA's GQA does).
    Made afresh in each trace: its mask tables become arrays of that trace (a cache would leak them)."""
    mask = splash.MultiHeadMask([splash.CausalMask((seq, seq)) for _ in range(heads)])
    sizes = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    return splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


def _local_attention(q, k, v, segment_ids, block: int, interpret: bool):
    """splash_attention on the arrays one device holds (no mesh in sight)."""
    batch, seq, heads, width = q.shape
    kernel = _kernel(heads, seq, block, interpret)
    # the kernel does not scale the logits: 1/sqrt(head_dim) on q, as jax.nn.dot_product_attention does
    q = (q.astype(jnp.float32) * (1.0 / math.sqrt(width))).astype(q.dtype)
    q, k, v = (jnp.swapaxes(t, 1, 2) for t in (q, k, v))  # [batch, heads, seq, dim]
    if segment_ids is None:
        y = jax.vmap(lambda q, k, v: kernel(q, k, v))(q, k, v)
    else:
        y = jax.vmap(lambda q, k, v, s: kernel(q, k, v, splash.SegmentIds(s, s)))(q, k, v, segment_ids)
    return jnp.swapaxes(y, 1, 2)  # [batch, seq, heads, dim]


def splash_attention(
    q,
    k,
    v,
    segment_ids=None,
    *,
    interpret: bool,
    block: int | None = None,
    pipelined: bool = False,
    layout: Optional[Constrainer] = None,
):
    """Causal attention of q [batch, seq, heads, dim] over k, v [batch, seq, kv_heads, dim] →
    [batch, seq, heads, dim]; segment_ids [batch, seq]: a token attends only within its segment.
    Under the mesh of a `layout` it runs per device (jax.shard_map) over the batch and head
    splits, which a `pipelined` layer (a pipeline stage) cannot."""
    seq = q.shape[1]
    block = block or block_size(seq)
    if seq % block:
        raise ModelError(
            f"model.attention=splash: block {block} does not divide the sequence length {seq}; "
            f"use a data.seq_len that is a multiple of {block}, or model.attention=xla"
        )
    if layout is not None:  # the mesh's devices decide: a plan's are a TPU topology's on a CPU host
        interpret = layout.mesh.devices.flat[0].platform != "tpu"
    if layout is None or layout.mesh.size == 1:
        return _local_attention(q, k, v, segment_ids, block, interpret)
    if layout.vmapped or pipelined:
        raise ModelError(
            "model.attention=splash runs per device (jax.shard_map), which a vmapped step (DiLoCo "
            "replicas, vectorised trials) or a pipeline cannot hold; use model.attention=xla there"
        )
    q_spec = layout.spec(q.shape, ("batch", "seq", "heads", "kv"))
    kv_spec = layout.spec(k.shape, ("batch", "seq", "kv_heads", "kv"))
    if kv_spec[2] != q_spec[2]:  # fewer key/value heads than head shards: each device gets its queries' own
        k, v = (jnp.repeat(t, q.shape[2] // k.shape[2], axis=2) for t in (k, v))
        kv_spec = q_spec
    if q_spec[1] is not None:
        raise ModelError("model.attention=splash does not split the sequence (mesh.context); use model.attention=xla")
    seg_spec = PartitionSpec(q_spec[0], None)

    def per_device(q, k, v, segment_ids):
        return _local_attention(q, k, v, segment_ids, block, interpret)

    return jax.shard_map(
        per_device,
        mesh=layout.mesh,
        in_specs=(q_spec, kv_spec, kv_spec, None if segment_ids is None else seg_spec),
        out_specs=q_spec,
        check_vma=False,  # the kernel's outputs (pallas_call) do not say which mesh axes they vary over
    )(q, k, v, segment_ids)


def chosen_attention(name: str, platform: str, dtype, seq_len: int, per_device: bool) -> str:
    """model.attention=auto: splash on TPU where its tiles divide the sequence and it can run per
    device (not in a vmapped step or a pipeline), cuDNN's flash attention on GPU in 16 bits, else XLA."""
    if name != "auto":
        return name
    if platform == "tpu" and per_device and seq_len % BLOCKS[-1] == 0:
        return "splash"
    low_precision = dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return "cudnn" if platform == "gpu" and low_precision else "xla"
