"""The one exception type that means "the user's input is wrong" (exit code 2)."""


class UsageError(ValueError):
    """Bad config, bad command line or bad input files: reported in one line, exit 2."""
