"""What the engine and the model families agree on, importable by both (neither imports the
other's internals through it): activation layout hints and the form of a config field."""
