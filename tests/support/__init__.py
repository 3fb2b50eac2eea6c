"""Helpers the tests share (tests/unit, tests/integration, tests/e2e import them as `support.X`;
pyproject.toml's pytest `pythonpath` puts tests/ on sys.path)."""
