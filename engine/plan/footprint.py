"""A rough estimate of a decoder's activation memory per device in its train step, from its
parameters' shapes: what `plan --search` (layouts.py) orders its candidates by before it compiles any.

A layer's widths per token are read from the logical axes of its parameters (the attention's
output projection [layers,] heads × kv → embed counts the layers; the projections into heads
or kv_heads give the queries', keys' and values' widths; those into mlp the MLP's): each split
over mesh.tensor but the residual stream. The estimate is what the remat policy keeps of every
layer (models/remat.py), plus the larger of two peaks: one layer's backward pass (the layer
recomputed whole, with XLA attention's float32 scores [heads, seq, seq] per example) and the
loss's float32 logits with their gradient (as the family's loss chunks them). It is a screen,
not a measurement: the compiled program's figures are what `plan` reports."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from engine.config import Config
from engine.parallel.axes import BATCH_AXES
from engine.parallel.sharding import ParamLayout
from models.family import ModelFamily

UNIT_BYTES = {"bfloat16": 2, "float16": 2}  # of train.compute_dtype (else 4)
SCORE_BYTES = 8  # per attention score: the float32 logits and probabilities XLA's attention holds
PROJECTIONS = (("embed", "heads", "kv"), ("embed", "kv_heads", "kv"))  # into queries, keys, values


@dataclass(frozen=True)
class Widths:
    """A decoder's sizes, read from its parameters' logical axes (per layer: summed over layers, divided)."""

    layers: int
    embed: int  # the residual stream
    heads: int  # query heads
    queries: int  # heads × head width
    projected: float  # the queries', keys' and values' widths together
    mlp_in: float  # what the MLP's input projections make (SwiGLU: gate and up)
    vocab: int

    @staticmethod
    def of(layouts: Sequence[ParamLayout]) -> Optional[Widths]:
        """None for a model without an attention output projection (heads, kv → embed)."""
        outs = [p for p in layouts if p.logical[-3:] == ("heads", "kv", "embed")]
        if not outs:
            return None

        def stacked(p: ParamLayout) -> int:  # a scanned stack's parameter holds every layer's
            return dict(zip(p.logical, p.shape)).get("layers", 1)

        def total(logical_tail: tuple, width) -> float:
            return sum(stacked(p) * width(p) for p in layouts if p.logical[-len(logical_tail) :] == logical_tail)

        layers = sum(stacked(p) for p in outs)
        heads, kv, embed = outs[0].shape[-3:]
        projected = sum(total(tail, lambda p: p.shape[-2] * p.shape[-1]) for tail in PROJECTIONS)
        vocab = max((dict(zip(p.logical, p.shape))["vocab"] for p in layouts if "vocab" in p.logical), default=0)
        mlp_in = total(("embed", "mlp"), lambda p: p.shape[-1])
        return Widths(layers, embed, heads, heads * kv, projected / layers, mlp_in / layers, vocab)


def saved_per_token(d: float, qkv: float, a: float, mlp_in: float) -> dict[str, float]:
    """The elements of one layer's activations per token that each model.remat policy keeps for
    the backward pass (d: the residual stream, qkv: the query, key and value projections, a: the
    attention's output, mlp_in: the MLP's input projections): a remat block keeps its input (d)."""
    whole = 6 * d + 2 * qkv + a + 2 * mlp_in  # norms, residuals, projections, RoPE'd q and k, the MLP's activations
    return {
        "none": whole,
        "dots": 3 * d + qkv + mlp_in,  # every matmul's output without batch dimensions
        "minimal": 2 * d + qkv,  # the query, key, value and attention-output projections
        "save_qkv_proj": d + qkv,
        "save_out_proj": 2 * d,
        "full": d,
        "offload": 0.0,  # the layer's input goes to host memory
    }


def activation_bytes(
    cfg: Config, family: ModelFamily, info: Any, widths: Optional[Widths], mesh: dict[str, int], kernel: str
) -> int:
    """The activations one device holds at the train step's peak, roughly (see the module's
    docstring); `kernel`: the attention the target runs (xla holds its scores). 0 without widths."""
    seq = getattr(info, "seq_len", 0)
    if widths is None or not seq:
        return 0
    tensor, context = mesh.get("tensor", 1), mesh.get("context", 1)
    micro = cfg.train.global_batch_size // cfg.train.grad_accum_steps
    shards = math.prod(mesh.get(axis, 1) for axis in BATCH_AXES)
    examples = micro / shards  # per device
    tokens, unit = examples * seq / context, UNIT_BYTES.get(cfg.train.compute_dtype, 4)
    saved = saved_per_token(widths.embed, widths.projected / tensor, widths.queries / tensor, widths.mlp_in / tensor)
    remat = family.remat(cfg.model) or "none"
    kept = widths.layers * tokens * saved.get(remat, saved["none"]) * unit
    scores = examples * max(widths.heads // tensor, 1) * (seq / context) * seq * SCORE_BYTES if kernel == "xla" else 0.0
    if remat == "none":  # no recomputation: every layer's scores are kept too
        kept, layer = kept + widths.layers * scores, 0.0
    else:  # the layer whose backward pass runs is recomputed whole
        layer = tokens * saved["none"] * unit + scores
    lm = family.language_model
    chunk = lm.loss_chunk(cfg.model, info, micro, shards, context).chunk if lm and lm.loss_chunk else 0
    logits = 2 * examples * (chunk or seq / context) * widths.vocab / tensor * 4  # float32, and their gradient
    return int(kept + max(layer, logits))
