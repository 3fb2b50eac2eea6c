"""Checkpoints: orbax storage with checksums, damaged steps set aside, tiers, and which checkpoint is kept and read
(a run exported for inference is engine/hub/inference.py's)."""
