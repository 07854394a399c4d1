"""The one exception type the CLI turns into a one-line message and exit code 2."""


class UserError(Exception):
    """Bad input from the user: the message names the problem and the fix."""
