"""The training engine: config → mesh → sharded state → one compiled step, driven by one loop
(docs/architecture.md maps its modules)."""
