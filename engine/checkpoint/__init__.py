"""Checkpoints: orbax storage with checksums, damaged steps set aside, and a trained run exported for inference."""
