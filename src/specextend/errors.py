"""Errors that reach the user as one clear line."""


class UserError(Exception):
    """Bad input or settings: the CLI prints one line and exits with status 2."""
