"""``APIError``: what the server answers when something is wrong, as OpenAI's error body.

Apart from the pydantic request bodies (``protocol.py``) so that the decoding thread (``engine.py``) runs where
only torch and transformers are installed (the device check runs the engine in-process on a GPU image without
the serving extras).
"""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error the client caused (4xx) or the server met (5xx), as OpenAI's error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
