"""`model.name` → ModelFamily: the families, which import flax and jax."""

from __future__ import annotations

from models import cnn, llama, mlp, resnet, tabular, transformer
from models.family import ModelFamily

REGISTRY: dict[str, ModelFamily] = {
    "mlp": mlp.FAMILY,
    "cnn": cnn.FAMILY,
    "resnet": resnet.FAMILY,
    "transformer": transformer.FAMILY,
    "llama": llama.FAMILY,
    "tabular": tabular.FAMILY,
}
