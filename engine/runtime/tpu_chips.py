"""The TPU chip kinds' published per-chip figures (HBM, peak FLOP/s, ICI and DCN bandwidths, the
largest slice): one table, read by the planner (engine/plan/tpu.py, its targets) and by a run's
memory figure (engine/runtime/memory.py). Imports no jax."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

GiB = 2**30


@dataclass(frozen=True)
class Chip:
    """One chip kind's published figures (Google Cloud TPU documentation, per chip)."""

    name: str  # how users write it: v5p
    topology: str  # the prefix libtpu's topology names take: "v5p" in v5p:2x2x2
    kind: str  # jax's device_kind, e.g. "TPU v5" (what a device of it says)
    hbm_bytes: int
    peak_bf16: float  # FLOP/s
    ici_bytes_per_second: float  # one direction, per chip (half the published bidirectional figure)
    dcn_bytes_per_second: float  # per chip, across slices
    dims: int  # the torus: 2 (v5e, v6e) or 3
    largest_slice: int  # chips in the largest slice Google Cloud offers (its whole pod; see CHIPS)
    cores_per_chip: int = 1  # TensorCores a pod name counts per chip (v4-32 and v5p-32 are 16 chips)
    devices_per_chip: int = 1  # JAX devices per chip
    chip_config: str = "default"  # libtpu's chip configuration (megacore: one device per chip of two cores)
    sources: str = ""  # where the figures come from


CHIPS: dict[str, Chip] = {
    chip.name: chip
    for chip in (
        # v4: ICI 2,400 Gbps per chip (bidirectional); DCN not published per chip: v5p's 50 Gbps assumed
        Chip(
            "v4",
            "v4",
            "TPU v4",
            32 * GiB,
            275e12,
            150e9,
            6.25e9,
            3,
            largest_slice=4096,  # a v4 pod: 4,096 chips (v4-8192)
            cores_per_chip=2,
            chip_config="megacore",
            sources="cloud.google.com/tpu/docs/v4 (DCN assumed as v5p)",
        ),
        Chip(
            "v5e",
            "v5e",
            "TPU v5 lite",
            16 * GiB,
            197e12,
            200e9,
            3.125e9,
            2,
            largest_slice=256,  # v5litepod-256 (16x16): a slice is at most one pod
            sources="cloud.google.com/tpu/docs/v5e: 400 GBps ICI, 2 x 100 Gbps NIC per 8 chips",
        ),
        Chip(
            "v5p",
            "v5p",
            "TPU v5",
            95 * GiB,
            459e12,
            600e9,
            6.25e9,
            3,
            largest_slice=8960,  # a v5p pod: 8,960 chips, 16x20x28 (v5p-17920)
            cores_per_chip=2,
            chip_config="megacore",
            sources="cloud.google.com/tpu/docs/v5p: 1,200 GBps ICI, 50 Gbps DCN per chip",
        ),
        Chip(
            "v6e",
            "v6e",
            "TPU v6 lite",
            32 * GiB,
            918e12,
            400e9,
            12.5e9,
            2,
            largest_slice=256,  # v6e-256 (16x16): a slice is at most one pod
            sources="cloud.google.com/tpu/docs/v6e: 800 GBps ICI, 4 x 200 Gbps NIC per 8 chips",
        ),
        # Ironwood: two TensorCores per chip, each a JAX device; DCN assumed as v6e
        Chip(
            "tpu7x",
            "tpu7x",
            "TPU7x",
            192 * GiB,
            2307e12,
            600e9,
            12.5e9,
            3,
            largest_slice=9216,  # an Ironwood pod: 9,216 chips
            cores_per_chip=2,
            devices_per_chip=2,
            sources="Google's Ironwood announcement: 4,614 TFLOP/s fp8 (bf16 half), 192 GB HBM (DCN assumed)",
        ),
    )
}
ALIASES = {"v5litepod": "v5e", "v6": "v6e", "v7x": "tpu7x", "ironwood": "tpu7x", "trillium": "v6e"}


def chip_of(device) -> Optional[Chip]:
    """The table's chip for a device (by its device_kind), or None."""
    return next((chip for chip in CHIPS.values() if chip.kind == device.device_kind), None)
