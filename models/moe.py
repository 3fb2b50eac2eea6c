"""Mixture-of-experts layers of the Llama family: top-k routing, then one of two dispatches
(model.moe_dispatch). onehot: a capacity per expert, one-hot einsums (GShard); with the experts
split over the expert mesh axis the dispatch and the return are all-to-alls. ragged: tokens
sorted by expert through grouped matmuls, nothing dropped (models/moe_ragged.py). An optional
shared expert every token goes through."""

from __future__ import annotations

import math
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from contract.activations import Constrainer, constrain
from models.configs import LlamaConfig
from models.layers import normal_kernel
from models.moe_ragged import ragged_experts


class SharedExpert(nn.Module):
    """A SwiGLU every token goes through beside its routed experts."""

    width: int
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    layout: Optional[Constrainer] = None  # pins activations to the mesh (contract/activations.py)

    @nn.compact
    def __call__(self, y):
        dense = {"dtype": self.dtype, "param_dtype": self.param_dtype, "use_bias": False}
        gate = nn.Dense(self.width, kernel_init=normal_kernel(("embed", "mlp")), name="gate", **dense)(y)
        up = nn.Dense(self.width, kernel_init=normal_kernel(("embed", "mlp")), name="up", **dense)(y)
        h = constrain(self.layout, nn.silu(gate) * up, ("batch", "seq", "mlp"))
        return nn.Dense(y.shape[-1], kernel_init=normal_kernel(("mlp", "embed")), name="down", **dense)(h)


def expert_capacity(cfg: LlamaConfig, seq_len: int) -> int:
    """Tokens each expert takes from one sequence (all of them when dropless)."""
    if not cfg.expert_capacity_factor:
        return seq_len
    wanted = cfg.expert_capacity_factor * seq_len * cfg.experts_per_token / cfg.num_experts
    return max(1, min(seq_len, math.ceil(wanted)))


def gate(cfg: LlamaConfig, logits):
    """Top-k routing of each token, shared by both dispatches → (gates [b, s, k], chosen experts
    [b, s, k] int32, load-balancing loss)."""
    experts, k = logits.shape[-1], cfg.experts_per_token
    probs = jax.nn.softmax(logits, axis=-1) if cfg.router == "softmax" else jax.nn.sigmoid(logits)
    gates, chosen = jax.lax.top_k(probs, k)  # [b, s, k]
    if k > 1:  # the chosen experts' gates sum to 1 (Mixtral, DeepSeek-V3)
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    # Switch Transformer's loss, per sequence: experts * sum_e (share of assignments to e) * (mean gate of e)
    share = jnp.mean(jnp.sum(jax.nn.one_hot(chosen, experts), axis=2), axis=1) / k  # [b, e]
    mean_prob = jnp.mean(probs / jnp.sum(probs, axis=-1, keepdims=True), axis=1)  # [b, e]
    balance = experts * jnp.mean(jnp.sum(share * mean_prob, axis=-1))
    return gates, chosen, balance


def slots(gates, chosen, experts: int, capacity: int):
    """The one-hot dispatch of top-k choices → (dispatch [b, s, experts, capacity] 0/1, combine
    [b, s, experts, capacity] gate weights, assignments dropped). Expert slots are filled in
    token order (a token's choices in the order of its gates): whether a token keeps an expert
    depends on earlier tokens only, as a causal model needs (filling all first choices first, as
    encoders do, would let later tokens push earlier ones out)."""
    batch, seq, k = chosen.shape
    choice = jax.nn.one_hot(chosen, experts, dtype=jnp.int32)  # [b, s, k, e]
    in_order = choice.reshape(batch, seq * k, experts)  # token 0's choices, token 1's, ...
    slot = (jnp.cumsum(in_order, axis=1) - 1).reshape(batch, seq, k, experts)
    slot = jnp.sum(slot * choice, axis=-1)  # [b, s, k]: this assignment's place in its expert's queue
    kept = slot < capacity
    placed = jax.nn.one_hot(jnp.where(kept, slot, capacity), capacity, dtype=jnp.float32)  # [b, s, k, c] (0 if dropped)
    dispatch = jnp.einsum("bske,bskc->bsec", choice.astype(jnp.float32), placed)
    combine = jnp.einsum("bske,bskc,bsk->bsec", choice.astype(jnp.float32), placed, gates)
    return dispatch, combine, jnp.sum(1 - kept)


class MoE(nn.Module):
    """Routed SwiGLU experts (and an optional shared one) in place of the MLP."""

    cfg: LlamaConfig
    dtype: jnp.dtype
    param_dtype: jnp.dtype
    decode: bool = False
    layout: Optional[Constrainer] = None  # pins activations to the mesh (contract/activations.py)

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        batch, seq, width = x.shape
        hidden, experts = cfg.moe_mlp_dim or cfg.mlp_dim, cfg.num_experts
        router = self.param("router", normal_kernel(("embed", None)), (width, experts), self.param_dtype)
        logits = jnp.einsum("bsd,de->bse", x.astype(jnp.float32), router.astype(jnp.float32))
        gates, chosen, balance = gate(cfg, logits)
        weight = {
            name: self.param(name, normal_kernel(axes), shape, self.param_dtype).astype(self.dtype)
            for name, axes, shape in (
                ("gate", ("expert", "embed", "mlp"), (experts, width, hidden)),
                ("up", ("expert", "embed", "mlp"), (experts, width, hidden)),
                ("down", ("expert", "mlp", "embed"), (experts, hidden, width)),
            )
        }
        if cfg.moe_dispatch == "ragged":
            y, dropped = ragged_experts(
                x.astype(self.dtype), chosen, gates, weight, cfg.expert_buffer_factor, self.layout
            )
        else:  # generating (a cache, calls of one token): no token is dropped
            capacity = seq if self.decode else expert_capacity(cfg, seq)
            y, dropped = onehot_experts(x.astype(self.dtype), chosen, gates, weight, capacity, self.layout)
        self.sow("aux", "aux_loss", cfg.router_aux_loss_coef * balance)
        self.sow("aux", "routed", jnp.asarray(batch * seq * cfg.experts_per_token, jnp.float32))
        self.sow("aux", "dropped", jnp.asarray(dropped, jnp.float32))
        if cfg.shared_expert:
            y = y + SharedExpert(hidden, self.dtype, self.param_dtype, self.layout, name="shared")(x)
        return y


def onehot_experts(x, chosen, gates, weight: dict, capacity: int, layout: Optional[Constrainer] = None):
    """x [b, s, d] through the experts `weight` (gate, up, down: [e, ...]) by one-hot einsums →
    (y [b, s, d], assignments dropped); with the experts split over mesh.expert the dispatch and
    the return are all-to-alls."""
    experts = weight["gate"].shape[0]
    dispatch, combine, dropped = slots(gates, chosen, experts, capacity)
    routed = jnp.einsum("bsec,bsd->becd", dispatch.astype(x.dtype), x)
    routed = constrain(layout, routed, ("expert_batch", "expert", None, None))
    h = nn.silu(jnp.einsum("becd,edf->becf", routed, weight["gate"])) * jnp.einsum(
        "becd,edf->becf", routed, weight["up"]
    )
    h = constrain(layout, h, ("expert_batch", "expert", None, "mlp"))
    out = constrain(layout, jnp.einsum("becf,efd->becd", h, weight["down"]), ("expert_batch", "expert", None, None))
    out = constrain(layout, out, ("batch", None, None, None))  # and back (an all-to-all)
    return jnp.einsum("becd,bsec->bsd", out, combine.astype(x.dtype)), dropped
