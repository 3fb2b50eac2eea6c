"""What every layer above shares of a run's state: TrainState, its variable collections, and the
columns of the metrics a step packs."""
