"""How much memory one device of a mesh has: what the runtime says, a TPU chip's published HBM
for a topology's devices (a plan), else this host's memory shared by its devices (CPU)."""

from __future__ import annotations

import os

import jax
from jax.sharding import Mesh

from engine.runtime.tpu_chips import chip_of


def device_memory_bytes(mesh: Mesh) -> int:
    """One device's memory: what the runtime says (accelerators); for a TPU topology's devices
    (a plan: no runtime) the chip's published HBM; else this host's memory shared by its
    devices (CPU)."""
    device = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())  # one of this process's
    chip = chip_of(device)
    if chip is not None and not device.client.local_device_count():  # a topology's description: no chip here
        return chip.hbm_bytes // chip.devices_per_chip
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(jax.local_device_count(), 1)
