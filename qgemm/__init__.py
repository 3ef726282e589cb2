"""qgemm's Python client (`from qgemm import Client`): the native API of a running server, X and Y as numpy."""

from qgemm.client import (
    AsyncClient,
    BadRequest,
    Client,
    Conflict,
    Forbidden,
    InvalidRequest,
    NotFound,
    Product,
    QgemmError,
    Timeout,
    TooLarge,
    Unauthorized,
    Unavailable,
)

__all__ = ["AsyncClient", "BadRequest", "Client", "Conflict", "Forbidden", "InvalidRequest", "NotFound", "Product",
           "QgemmError", "Timeout", "TooLarge", "Unauthorized", "Unavailable"]
