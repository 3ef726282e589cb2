"""A Python client of a qgemm server's native API (httpx and numpy only: it imports nothing of the server).

    from qgemm import Client

    with Client("http://127.0.0.1:8000") as c:
        y = c.matmul("demo", "blk.0.attn_q.weight", x)            # numpy [M, N] float32
        r = c.product("demo", "blk.0.attn_q.weight", x, kernel="mmq")
        r.y, r.kernel, r.timing_ms["gemm"], r.batch

X goes as `.npy` and Y comes back as `.npy` (no JSON numbers either way).  An error answer raises the QgemmError
subclass of its status, carrying the API's code, message and request id; a 503 with Retry-After (a full queue, an
engine restarting, shared memory held) is retried after the time it names, `retries` times.  `AsyncClient` is the
same over httpx.AsyncClient.  Either takes an `http` client of your own: FastAPI's TestClient (an httpx.Client)
runs the calls in process.
"""

from __future__ import annotations

import asyncio
import io
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

NPY = "application/x-npy"
RETRY_AFTER_MAX_S = 30.0


class QgemmError(Exception):
    """An error answer: `status`, the API's `code` (e.g. k_mismatch), `message` and the server's `request_id`."""

    def __init__(self, status: int, code: str, message: str, request_id: str | None = None,
                 retry_after: float | None = None):
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message, self.request_id = status, code, message, request_id
        self.retry_after = retry_after


class BadRequest(QgemmError):
    """400: a body or parameter that is not what the API takes."""


class Unauthorized(QgemmError):
    """401: a missing or wrong API key."""


class Forbidden(QgemmError):
    """403: refused from another site's page."""


class NotFound(QgemmError):
    """404: no such model or tensor."""


class Conflict(QgemmError):
    """409: the server's state refuses it (a model that cannot be read, or changed while read; no GPU to load on)."""


class TooLarge(QgemmError):
    """413: the body is over the server's limit."""


class InvalidRequest(QgemmError):
    """422: well formed but not computable here (shape, values, kernel, weight format)."""


class Unavailable(QgemmError):
    """503: busy or out of memory, after the retries; `retry_after` says when to come back."""


class Timeout(QgemmError):
    """504: the product took longer than the server's deadline."""


BY_STATUS: dict[int, type[QgemmError]] = {400: BadRequest, 401: Unauthorized, 403: Forbidden, 404: NotFound,
                                          409: Conflict, 413: TooLarge, 422: InvalidRequest, 503: Unavailable,
                                          504: Timeout}


@dataclass
class Product:
    """A product's answer: Y and what the server says of it."""

    y: np.ndarray  # float32 [M, N]
    kernel: str  # the kernel that ran (auto resolved)
    backend: str  # cpu or cuda
    activation_format: str
    timing_ms: dict[str, float] = field(default_factory=dict)  # upload, quantize, gemm, download, total, queue, ...
    batch: tuple[int, int] = (1, 0)  # (requests, rows) of the batch it ran in
    devices: list[str] = field(default_factory=list)


def _npy(x: Any) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(x, dtype=np.float32), allow_pickle=False)
    return buf.getvalue()


def _params(model: str, tensor: str, kernel: str, weight_format: str | None, blocksize: int | None,
            double_quant: bool | None) -> dict[str, str]:
    params = {"model": model, "tensor": tensor, "kernel": kernel}
    if weight_format is not None:
        params["weight_format"] = weight_format
    if blocksize is not None:
        params["blocksize"] = str(blocksize)
    if double_quant is not None:
        params["double_quant"] = "true" if double_quant else "false"
    return params


def _error(r: httpx.Response) -> QgemmError:
    try:
        err = r.json()["error"]
        code, message, rid = err.get("code", "error"), err.get("message", r.text), err.get("request_id")
    except (ValueError, KeyError, TypeError):
        code, message, rid = "error", r.text[:500], None
    retry = r.headers.get("retry-after")
    cls = BY_STATUS.get(r.status_code, QgemmError)
    return cls(r.status_code, code, message, rid or r.headers.get("x-request-id"),
               float(retry) if retry and retry.replace(".", "", 1).isdigit() else None)


def _product(r: httpx.Response) -> Product:
    y = np.load(io.BytesIO(r.content), allow_pickle=False)
    timing = {}
    for part in r.headers.get("server-timing", "").split(","):
        name, _, rest = part.strip().partition(";dur=")
        if rest:
            timing[name] = float(rest)
    requests, _, rows = r.headers.get("x-qgemm-batch", "1,0").partition(",")
    devices = [d for d in r.headers.get("x-qgemm-devices", "").split(",") if d]
    return Product(y, r.headers.get("x-qgemm-kernel", ""), r.headers.get("x-qgemm-backend", ""),
                   r.headers.get("x-qgemm-activation-format", ""), timing, (int(requests), int(rows or 0)), devices)


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class Client:
    """The native API, synchronously.  `url`: the server; `http`: an httpx.Client of your own instead (a TestClient
    included), used as it is."""

    def __init__(self, url: str = "http://127.0.0.1:8000", api_key: str | None = None, timeout: float = 120.0,
                 retries: int = 3, http: httpx.Client | None = None):
        self.retries = retries
        self._own = http is None
        self.http = http if http is not None else httpx.Client(base_url=url.rstrip("/"), timeout=timeout)
        self._headers = _headers(api_key)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._own:
            self.http.close()

    def _call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        headers = {**self._headers, **kw.pop("headers", {})}
        for attempt in range(self.retries + 1):
            r = self.http.request(method, path, headers=headers, **kw)
            if r.status_code < 400:
                return r
            err = _error(r)
            if r.status_code != 503 or err.retry_after is None or attempt == self.retries:
                raise err
            time.sleep(min(err.retry_after, RETRY_AFTER_MAX_S))
        raise AssertionError("unreachable")

    def health(self) -> dict[str, Any]:
        return self._call("GET", "/healthz").json()

    def models(self) -> list[dict[str, Any]]:
        """Every model of the server's models directory: id, file, size, status, architecture, ..."""
        return self._call("GET", "/v1/models").json()["models"]

    def tensors(self, model: str) -> list[dict[str, Any]]:
        """A model's tensors: name, type, shape, bytes, and whether it can be multiplied."""
        return self._call("GET", f"/v1/models/{model}/tensors").json()["tensors"]

    def product(self, model: str, tensor: str, x: Any, kernel: str = "auto", weight_format: str | None = None,
                blocksize: int | None = None, double_quant: bool | None = None) -> Product:
        """Y = X · Wᵀ for X [M, K] (anything numpy makes float32 of), with the kernel, timing and batch."""
        r = self._call("POST", "/v1/matmul", params=_params(model, tensor, kernel, weight_format, blocksize,
                                                             double_quant),
                       content=_npy(x), headers={"Content-Type": NPY, "Accept": NPY})
        return _product(r)

    def matmul(self, model: str, tensor: str, x: Any, kernel: str = "auto", weight_format: str | None = None,
               blocksize: int | None = None, double_quant: bool | None = None) -> np.ndarray:
        """Y [M, N] float32 alone (`product` for the rest of the answer)."""
        return self.product(model, tensor, x, kernel, weight_format, blocksize, double_quant).y


class AsyncClient:
    """The native API over httpx.AsyncClient: the same methods, awaited."""

    def __init__(self, url: str = "http://127.0.0.1:8000", api_key: str | None = None, timeout: float = 120.0,
                 retries: int = 3, http: httpx.AsyncClient | None = None):
        self.retries = retries
        self._own = http is None
        self.http = http if http is not None else httpx.AsyncClient(base_url=url.rstrip("/"), timeout=timeout)
        self._headers = _headers(api_key)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own:
            await self.http.aclose()

    async def _call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        headers = {**self._headers, **kw.pop("headers", {})}
        for attempt in range(self.retries + 1):
            r = await self.http.request(method, path, headers=headers, **kw)
            if r.status_code < 400:
                return r
            err = _error(r)
            if r.status_code != 503 or err.retry_after is None or attempt == self.retries:
                raise err
            await asyncio.sleep(min(err.retry_after, RETRY_AFTER_MAX_S))
        raise AssertionError("unreachable")

    async def health(self) -> dict[str, Any]:
        return (await self._call("GET", "/healthz")).json()

    async def models(self) -> list[dict[str, Any]]:
        return (await self._call("GET", "/v1/models")).json()["models"]

    async def tensors(self, model: str) -> list[dict[str, Any]]:
        return (await self._call("GET", f"/v1/models/{model}/tensors")).json()["tensors"]

    async def product(self, model: str, tensor: str, x: Any, kernel: str = "auto", weight_format: str | None = None,
                      blocksize: int | None = None, double_quant: bool | None = None) -> Product:
        r = await self._call("POST", "/v1/matmul", params=_params(model, tensor, kernel, weight_format, blocksize,
                                                                   double_quant),
                             content=_npy(x), headers={"Content-Type": NPY, "Accept": NPY})
        return _product(r)

    async def matmul(self, model: str, tensor: str, x: Any, kernel: str = "auto", weight_format: str | None = None,
                     blocksize: int | None = None, double_quant: bool | None = None) -> np.ndarray:
        return (await self.product(model, tensor, x, kernel, weight_format, blocksize, double_quant)).y
