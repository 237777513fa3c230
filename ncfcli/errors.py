"""Errors a user can cause. The CLI prints their message as one line and exits non-zero."""

from __future__ import annotations

INTERRUPTED = 130  # the exit code of a Ctrl-C (the shell's for SIGINT), in every command


def first_line(e: BaseException, width: int = 300) -> str:
    """The first line of `e`'s message (at most `width` characters), or its type's name: what
    an error from a library (torch, CuPy, a socket) adds to ncf's own line."""
    text = str(e).strip()
    return text.splitlines()[0][:width] if text else type(e).__name__


class NcfError(Exception):
    """A problem with the user's input, files or machine, explained in one line.

    `exit_code` lets a command say more than "failed" (2 for bad usage, as Click does).
    """

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(" ".join(message.split()))
        self.exit_code = exit_code


# RMM (when installed it serves cuDF, CuPy and torch) throws C++ rmm::out_of_memory, whose text
# is "std::bad_alloc: out_of_memory: CUDA error (failed to allocate N bytes) at: ...:
# cudaErrorMemoryAllocation out of memory" (rmm cpp/src/error.cpp, cpp/include/rmm/detail/
# error.hpp); Cython turns any std::bad_alloc into a plain MemoryError with that text, so only
# the text tells it from the host running out.
_DEVICE_OOM_TEXT = ("out_of_memory", "cudaerrormemoryallocation", "cuda out of memory")


def is_device_oom(e: BaseException) -> bool:
    """Whether `e` says a GPU ran out of memory (not the host).

    torch's and CuPy's errors are both named OutOfMemoryError (CuPy's is a MemoryError too);
    RMM's is a MemoryError or, raised through torch's allocator, a RuntimeError, told by its text.
    """
    if type(e).__name__ == "OutOfMemoryError":
        return True
    if not isinstance(e, MemoryError | RuntimeError):
        return False
    text = str(e).lower()
    if isinstance(e, MemoryError) and "cuda error" in text:
        return True  # rmm::bad_alloc: a CUDA allocation that failed for another CUDA reason
    return any(word in text for word in _DEVICE_OOM_TEXT)
