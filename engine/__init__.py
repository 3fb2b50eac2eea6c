"""The training engine: config → mesh → sharded state → one compiled step, driven by one loop
(see docs/extending.md for the map of its modules)."""
