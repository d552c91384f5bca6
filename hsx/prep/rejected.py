"""A row hsx cannot use: the one error every reader of rows raises (its reason a stable code, counted per run)."""

from __future__ import annotations


class RowRejected(ValueError):
    """This row cannot be used. ``reason`` is a short stable code (for counting); the message says why."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason

    @property
    def reason_code(self) -> str:
        return self.reason
