class UserError(Exception):
    """Something the user can fix (a bad path, config or input). The CLI prints the message, no traceback."""
