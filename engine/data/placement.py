"""Where a run's train split lives (data.placement): on every device, gathered inside the
compiled step, or on the host, gathered there into batches."""

from __future__ import annotations

from typing import Callable

import numpy as np

from engine.data.base import Dataset
from engine.errors import UsageError


def resident_bytes(cfg, dataset: Dataset, device_bytes: Callable[[], int]) -> int:
    """Bytes of the train split each device holds when it lives on the devices (data.placement
    device, or auto and it fits in data.device_memory_fraction of a device's `device_bytes()`),
    else 0."""
    placement = cfg.data.placement
    if placement == "host":
        return 0
    why_not = (
        "its source reads examples from disk by index"
        if not isinstance(dataset.train, dict)
        else "mesh.backend=pmap takes host batches"
        if cfg.mesh.backend == "pmap"
        else "train.eager=true runs without jit"
        if cfg.train.eager
        else ""
    )
    if why_not:
        if placement == "device":
            raise UsageError(
                f"data.placement=device: data.name={cfg.data.name} cannot live on the devices here "
                f"({why_not}); use data.placement=auto or host"
            )
        return 0
    size = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in dataset.train.values())
    if placement == "auto" and size > cfg.data.device_memory_fraction * device_bytes():
        return 0
    return max(size, 1)
