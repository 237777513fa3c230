"""Errors a user can cause. The CLI prints their message as one line and exits non-zero."""

from __future__ import annotations


class NcfError(Exception):
    """A problem with the user's input, files or machine, explained in one line.

    `exit_code` lets a command say more than "failed" (2 for bad usage, as Click does).
    """

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(" ".join(message.split()))
        self.exit_code = exit_code
