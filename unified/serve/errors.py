"""Errors a client can cause, answered in the OpenAI error shape: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
