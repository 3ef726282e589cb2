"""A child of the supervisor ends with it: a front or engine process asks the kernel for SIGKILL at its parent's
death, so that nothing serves (or holds the port) after the supervisor is gone."""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask the kernel to end this process when the supervisor dies (even by kill -9): nothing outlives it.  SIGKILL,
    not SIGTERM: with no supervisor there is no orderly stop to make, and a front's graceful exit waits for its
    background header reads (seconds); what a killed family leaves in /dev/shm and the run directory, the next
    start removes."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: nothing watches
        pass
    if os.getppid() == 1:  # the supervisor was already gone before the call
        os.kill(os.getpid(), signal.SIGKILL)
