"""The optimizer and its learning-rate schedules, built from the config (below the run that steps them)."""
