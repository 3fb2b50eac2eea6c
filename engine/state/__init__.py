"""The train state every layer above shares: TrainState and its variable collections."""
