"""The one exception type for a user's mistake.

Anything raised as `UserError` reaches the user as a single sentence and a non-zero exit (see cli.py);
every other exception is a bug in ushard and keeps its traceback.
"""


class UserError(Exception):
    """Bad input from the user: a config value, a mesh that doesn't fit, a missing file."""
