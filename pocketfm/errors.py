"""The one exception type for bad user input.

Every check on a file, tensor, metadata key, flag or prompt raises ``InputError`` with a single-line
message that names the offending thing and what was expected. The CLI prints it and exits with
status 2 (no traceback); library users catch it like any ``ValueError``.
"""


class InputError(ValueError):
    """Bad user input: a one-line message naming what was wrong and what was expected."""
