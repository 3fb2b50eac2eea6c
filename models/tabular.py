"""Wide & deep models of tables (TensorFlow's DNNLinearCombinedClassifier / Regressor).

The inputs are what engine/data/preprocess.py makes of a row: `numeric` float32 [batch, k]
and `ids` int32 [batch, slots] (-1: an unused slot of a multi-valued cell), laid out by the
run's preprocessing spec (DataInfo.preprocessing_data: which slots hold which feature, the
size of each feature's id space):
- the wide part is linear: one weight per class for every id of an indicator or crossed
  feature (a multi-hot sum), plus a bias;
- the deep part is an MLP over the numeric features and the embeddings (mean, sum or sqrtn
  of a cell's values);
- the head adds the two: logits of the classes, or one number (regression).
Id tables carry the logical axis `vocab` (rows padded to a multiple of 8), so large tables
shard over the mesh like a language model's embeddings.
"""

from __future__ import annotations

import json
import math
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import optax

from models.configs import ModelError, TabularConfig
from models.family import NO_OPTIONS, BuildOptions, Family
from models.layers import Dropout, dense, param_init

ROWS_MULTIPLE = 8  # table rows padded so that a table splits evenly over up to 8 devices


class Table:
    """A table's rows: `numeric` and `ids` in, one label (class index or number) per row out;
    an optional per-row `weight` scales its loss."""

    data_kind = "table"

    def sample_input(self, info):
        numeric, slots = info.input_shape
        return {"numeric": jnp.zeros((1, numeric), jnp.float32), "ids": jnp.zeros((1, slots), jnp.int32)}

    def export_input(self, info) -> dict[str, tuple[tuple[int | str, ...], str, tuple[str, ...]]]:
        numeric, slots = info.input_shape
        return {"numeric": ((int(numeric),), "float32", ()), "ids": ((int(slots),), "int32", ())}

    def tokens_per_example(self, info) -> int:
        return 0

    def model_inputs(self, batch) -> tuple[Any, Any, dict]:
        return {"numeric": batch["numeric"], "ids": batch["ids"]}, batch["label"], {}

    def target_weights(self, batch):
        return batch.get("weight")

    def losses(self, out, targets):
        """Classification: softmax cross-entropy, hit = argmax is the class. Regression (one
        output): squared error, hit = within 0.5 of the target (the rounded prediction is right)."""
        out = out.astype(jnp.float32)
        if out.shape[-1] > 1:
            return optax.softmax_cross_entropy_with_integer_labels(out, targets), jnp.argmax(out, -1) == targets
        error = out[..., 0] - targets.astype(jnp.float32)
        return jnp.square(error), jnp.abs(error) <= 0.5

    def eval_metrics(self, loss: float, info) -> dict[str, float]:
        return {} if info.num_classes else {"rmse": math.sqrt(max(loss, 0.0))}


def _rows(size: int) -> int:
    return -(-size // ROWS_MULTIPLE) * ROWS_MULTIPLE


def _lookup(table, ids):
    """Rows of `table` for ids [batch, slots] → ([batch, slots, width], mask [batch, slots, 1])."""
    mask = (ids >= 0)[..., None]
    return jnp.take(table, jnp.maximum(ids, 0), axis=0) * mask, mask


class WideDeep(nn.Module):
    spec: dict  # the run's preprocessing spec (engine/data/preprocess.py)
    outputs: int
    hidden_sizes: tuple[int, ...]
    dropout_rate: float = 0.0
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def _slots(self, ids, name: str):
        feature = next(f for f in self.spec["ids"] if f["name"] == name)
        return ids[:, feature["offset"] : feature["offset"] + feature["slots"]], feature["size"]

    @nn.compact
    def __call__(self, inputs, *, train: bool, example_ids=None, dropout_rate=None):
        ids, numeric = inputs["ids"].astype(jnp.int32), inputs["numeric"].astype(self.dtype)
        out = jnp.zeros((ids.shape[0], self.outputs), jnp.float32)
        for feature in self.spec["wide"]:
            slots, size = self._slots(ids, feature["ids"])
            init = param_init(nn.initializers.zeros_init(), ("vocab", "classes"))
            table = self.param(f"wide_{feature['name']}", init, (_rows(size), self.outputs), self.param_dtype)
            rows, _ = _lookup(table.astype(jnp.float32), slots)
            out = out + jnp.sum(rows, axis=1)
        deep = [numeric] if self.spec["numeric"] else []
        for feature in self.spec["deep"]:
            slots, size = self._slots(ids, feature["ids"])
            init = param_init(nn.initializers.normal(1.0 / math.sqrt(feature["dimension"])), ("vocab", "embed"))
            table = self.param(
                f"embedding_{feature['name']}", init, (_rows(size), feature["dimension"]), self.param_dtype
            )
            rows, mask = _lookup(table.astype(self.dtype), slots)
            count = jnp.sum(mask, axis=1).astype(self.dtype)
            combined = jnp.sum(rows, axis=1)
            if feature["combiner"] == "mean":
                combined = combined / jnp.maximum(count, 1.0)
            elif feature["combiner"] == "sqrtn":
                combined = combined / jnp.sqrt(jnp.maximum(count, 1.0))
            deep.append(combined)
        if deep:
            x, in_axis = jnp.concatenate(deep, axis=-1), "embed"
            for i, width in enumerate(self.hidden_sizes):
                x = nn.relu(dense(width, (in_axis, "mlp"), self.dtype, self.param_dtype, name=f"hidden_{i}")(x))
                x = Dropout(self.dropout_rate)(x, train=train, example_ids=example_ids, rate=dropout_rate)
                in_axis = "mlp"
            out = out + dense(self.outputs, (in_axis, "classes"), self.dtype, self.param_dtype, name="deep_out")(x)
        bias = self.param("bias", param_init(nn.initializers.zeros_init(), ("classes",)), (self.outputs,))
        return out + bias


def build(cfg: TabularConfig, info, dtype, param_dtype, options: BuildOptions = NO_OPTIONS) -> nn.Module:
    if not info.preprocessing_data:
        raise ModelError("model.name=tabular reads a table: set data.name=table with data.features")
    spec = json.loads(info.preprocessing_data)
    if spec["wide"] and not cfg.wide:
        names = ", ".join(f["name"] for f in spec["wide"])
        raise ModelError(f"model.wide=false, but indicator and crossed features ({names}) feed the wide part")
    if (spec["deep"] or spec["numeric"]) and not cfg.deep:
        raise ModelError("model.deep=false, but numeric and embedding features feed the deep part")
    outputs = info.num_classes or 1
    return WideDeep(spec, outputs, tuple(cfg.hidden_sizes), cfg.dropout_rate, dtype, param_dtype)


class TabularFamily(Family):
    config_cls = TabularConfig
    task = Table()
    build = staticmethod(build)


FAMILY = TabularFamily()
