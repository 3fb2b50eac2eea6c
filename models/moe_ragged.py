"""The ragged dispatch of a mixture of experts (model.moe_dispatch=ragged): each token's top-k
assignments sorted by expert, the token rows gathered in that order, the three expert weights
applied as grouped matmuls (jax.lax.ragged_dot: each expert multiplies its own rows only), the
results weighted by their gates and added back onto their tokens. Nothing is dropped.

Under a mesh the layer runs per device (jax.shard_map): each device takes its own tokens. With
the experts split over mesh.expert (S devices, E / S experts each), a device sorts its A
assignments by the device holding their expert into S buffers of ceil(factor * A / S) rows
(model.expert_buffer_factor; at most A), one all-to-all sends each buffer to its device, which
runs its own experts on what it received, and a second all-to-all brings the results back.
Assignments beyond a buffer's rows skip their expert (the token keeps its residual) and are
counted as dropped. With the step vmapped over devices (a sweep's vectorised trials, DiLoCo's
replicas) the layer runs as one global computation that XLA partitions.

(XLA:CPU lowers ragged_dot to a masked dense product over every expert: E times the work of
the rows; GPUs and TPUs have grouped kernels.)"""

from __future__ import annotations

import math
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from contract.activations import Constrainer


def grouped_swiglu(rows, group_sizes, weight: dict):
    """rows [m, d] sorted by expert (group_sizes [e] rows each; rows past their sum give 0)
    through each expert's SwiGLU (weight: gate, up [e, d, f], down [e, f, d]) → [m, d]."""
    h = nn.silu(jax.lax.ragged_dot(rows, weight["gate"], group_sizes)) * jax.lax.ragged_dot(
        rows, weight["up"], group_sizes
    )
    return jax.lax.ragged_dot(h, weight["down"], group_sizes)


def local_experts(x, chosen, gates, weight: dict):
    """Every assignment of tokens x [t, d] (chosen, gates [t, k]) through its expert, on one
    device → y [t, d]."""
    tokens, k = chosen.shape
    experts = weight["gate"].shape[0]
    ids = chosen.reshape(-1)
    order = jnp.argsort(ids, stable=True)  # assignments by expert, in token order within one
    source = order // k  # the token of each sorted assignment
    sizes = jnp.bincount(ids, length=experts).astype(jnp.int32)
    out = grouped_swiglu(x[source], sizes, weight) * gates.reshape(-1)[order][:, None].astype(x.dtype)
    return jnp.zeros_like(x).at[source].add(out)


def buffer_rows(assignments: int, shards: int, factor: float) -> int:
    """Rows of each buffer a device sends to one expert shard (see the module docstring)."""
    if not factor:
        return assignments
    return max(1, min(assignments, math.ceil(factor * assignments / shards)))


def exchanged_experts(x, chosen, gates, weight: dict, axis: str, shards: int, rows: int):
    """One device's tokens x [t, d] (chosen, gates [t, k]) through experts split over mesh
    axis `axis` (this device holds weight's [E / shards] experts) → (y [t, d], assignments that
    overflowed their buffer of `rows`)."""
    k = chosen.shape[1]
    held = weight["gate"].shape[0]  # experts on each device
    ids = chosen.reshape(-1)
    order = jnp.argsort(ids, stable=True)
    ids, source = ids[order], order // k
    dest = ids // held  # the device holding each sorted assignment's expert
    counts = jnp.bincount(dest, length=shards)
    place = jnp.arange(ids.shape[0]) - (jnp.cumsum(counts) - counts)[dest]  # within its destination's buffer
    kept = place < rows
    slot = jnp.where(kept, dest * rows + place, shards * rows)  # overflow: a spare row, not sent
    send = jnp.zeros((shards * rows + 1, x.shape[1]), x.dtype).at[slot].set(x[source])
    send_ids = jnp.full((shards * rows + 1,), held, jnp.int32).at[slot].set(ids % held)  # held: an empty row
    got = jax.lax.all_to_all(send[:-1].reshape(shards, rows, -1), axis, 0, 0).reshape(shards * rows, -1)
    got_ids = jax.lax.all_to_all(send_ids[:-1].reshape(shards, rows), axis, 0, 0).reshape(-1)
    mine = jnp.argsort(got_ids, stable=True)  # what arrived, by this device's expert; empty rows last
    sizes = jnp.bincount(got_ids, length=held + 1)[:held].astype(jnp.int32)
    out = grouped_swiglu(got[mine], sizes, weight)
    out = jnp.where((got_ids[mine] < held)[:, None], out, 0)
    out = jnp.zeros_like(out).at[mine].set(out).reshape(shards, rows, -1)
    back = jax.lax.all_to_all(out, axis, 0, 0).reshape(shards * rows, -1)
    back = jnp.concatenate([back, jnp.zeros_like(back[:1])])[slot]  # overflowed assignments: 0
    y = jnp.zeros_like(x).at[source].add(back * gates.reshape(-1)[order][:, None].astype(x.dtype))
    return y, jnp.sum(~kept)


def ragged_experts(x, chosen, gates, weight: dict, buffer_factor: float, layout: Optional[Constrainer] = None):
    """x [b, s, d] through the experts `weight` (gate, up, down: [e, ...]) by sorted tokens and
    grouped matmuls → (y [b, s, d], assignments dropped: only buffer overflows under mesh.expert);
    per device under the mesh of a `layout`."""
    batch, seq, width = x.shape
    k = chosen.shape[-1]
    if layout is None or layout.vmapped or layout.mesh.size == 1:
        y = local_experts(x.reshape(batch * seq, width), chosen.reshape(-1, k), gates.reshape(-1, k), weight)
        return y.reshape(batch, seq, width), jnp.zeros((), jnp.int32)
    token_spec = layout.spec(x.shape, ("batch", "seq", None))
    weight_specs = {
        name: layout.spec(w.shape, ("expert", "mlp", None) if name == "down" else ("expert", None, "mlp"))
        for name, w in weight.items()
    }
    expert_axis, tensor_axis = weight_specs["gate"][0], weight_specs["gate"][2]
    token_axes = tuple(a for part in token_spec if part for a in (part if isinstance(part, tuple) else (part,)))
    shards = layout.mesh.shape[expert_axis] if expert_axis else 1
    local_tokens = x.size // width // math.prod(layout.mesh.shape[a] for a in token_axes)
    rows = buffer_rows(local_tokens * k, shards, buffer_factor)

    def per_device(x, chosen, gates, weight):
        b, s, d = x.shape
        flat = (x.reshape(b * s, d), chosen.reshape(b * s, k), gates.reshape(b * s, k), weight)
        if shards > 1:
            y, dropped = exchanged_experts(*flat, expert_axis, shards, rows)
        else:
            y, dropped = local_experts(*flat), jnp.zeros((), jnp.int32)
        if tensor_axis:  # each device's share of the hidden width: partial sums
            y = jax.lax.psum(y, tensor_axis)
        return y.reshape(b, s, d), jax.lax.psum(dropped, token_axes) if token_axes else dropped

    gate_spec = PartitionSpec(*token_spec[:2], None)
    return jax.shard_map(
        per_device,
        mesh=layout.mesh,
        in_specs=(token_spec, gate_spec, gate_spec, weight_specs),
        out_specs=(token_spec, PartitionSpec()),
    )(x, chosen, gates, weight)
