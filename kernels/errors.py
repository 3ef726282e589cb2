"""The errors of the matmul domain: what a request cannot be, and what a device cannot hold.

They name the failure with the code the API reports (`code`); app/errors.py maps each class to an
HTTP status once, at the edge.  Nothing here imports CuPy or the web framework.
"""

from __future__ import annotations


class QgemmError(Exception):
    """A failure the service reports to its client, with a stable code."""

    code = "error"

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class InvalidRequest(QgemmError):
    """The request cannot be computed as asked: its shape, values, kernel, tensor or weight format (422)."""


class Conflict(QgemmError):
    """The request is well formed but the server's state refuses it (409): nothing to load on a CPU backend."""


class Overloaded(QgemmError):
    """More work waits for the device than it can start soon: the request is refused rather than queued (503)."""

    code = "overloaded"


class DeviceOutOfMemory(QgemmError):
    """The GPU could not hold what a request needs, even after evicting cached weights (503)."""

    code = "gpu_out_of_memory"
