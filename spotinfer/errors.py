"""Errors a user of the CLI sees as one readable line instead of a traceback."""


class UserError(Exception):
    """Bad operator input or an unusable environment; the message is shown as is."""
