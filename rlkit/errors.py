"""Errors whose one-line message is for the user (the CLI prints it and exits 2)."""


class UserError(Exception):
    """Any error the user can fix; its message is one line naming the file, key or path."""
