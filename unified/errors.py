class UserError(Exception):
    """Something the user can fix (a bad path, config or input). The CLI prints the message, no traceback."""


class InvalidRequest(UserError, ValueError):
    """A request the engine refuses (or a conversation no chat template can render); it affects that request only."""
