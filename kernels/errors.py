"""Errors a backend raises that the service turns into HTTP answers (no CuPy import here)."""


class DeviceOutOfMemory(RuntimeError):
    """The GPU could not hold what a request needs, even after evicting cached weights (503)."""
