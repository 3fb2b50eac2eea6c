"""A run: the one training loop, the single run and the vectorised group it drives, their outputs,
the pure train step, the train state and the compile backends."""
