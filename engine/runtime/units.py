"""Quantities written for people: byte counts in KiB/MiB/GiB/TiB (plans, memory checks,
workdir limits, DiLoCo's replica bytes)."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} TiB"
