"""The package's Python client (qgemm/client.py) against the server, in process and through `qgemm serve`'s
processes (the `api` fixture): the same products as the native JSON route, the kernel and weight format it names,
typed errors with the API's codes, Retry-After honoured."""

from __future__ import annotations

import asyncio
import io

import httpx
import numpy as np
import pytest

from qgemm import AsyncClient, Client, InvalidRequest, NotFound, Unavailable

TENSOR = "blk.0.attn_q.weight"


@pytest.fixture
def client(api: httpx.Client) -> Client:
    return Client(http=api)


def _json_route(api: httpx.Client, x: np.ndarray, **extra: object) -> np.ndarray:
    r = api.post("/v1/matmul", json={"model": "demo", "tensor": TENSOR, "activations": x.tolist(), **extra})
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["output"], dtype=np.float32)


def test_lists_models_and_tensors(client: Client) -> None:
    assert "demo" in [m["id"] for m in client.models()]
    assert TENSOR in [t["name"] for t in client.tensors("demo")]


@pytest.mark.parametrize("kernel", ["auto", "ref_f32", "ref_q8_1"])
def test_products_equal_the_json_routes(client: Client, api: httpx.Client, rng: np.random.Generator,
                                        kernel: str) -> None:
    x = rng.standard_normal((3, 4096)).astype(np.float32)
    got = client.product("demo", TENSOR, x, kernel=kernel)
    assert got.y.dtype == np.float32 and got.y.shape == (3, 4096)
    assert got.kernel == (kernel if kernel != "auto" else got.kernel) and got.kernel
    assert got.timing_ms["request"] > 0 and got.batch[1] >= 3
    assert np.array_equal(got.y, _json_route(api, x, kernel=got.kernel))


def test_a_weight_format_reaches_the_server(client: Client, api: httpx.Client, rng: np.random.Generator) -> None:
    x = rng.standard_normal((2, 4096)).astype(np.float32)
    y = client.matmul("demo", TENSOR, x, weight_format="nf4", blocksize=64, double_quant=True)
    want = _json_route(api, x, weight_format="nf4", blocksize=64, double_quant=True)
    assert np.array_equal(y, want) and not np.array_equal(y, _json_route(api, x))


def test_errors_are_typed_with_the_apis_codes(client: Client) -> None:
    with pytest.raises(InvalidRequest) as bad:
        client.matmul("demo", TENSOR, np.ones((1, 100), np.float32))
    assert bad.value.status == 422 and bad.value.code == "k_mismatch"
    with pytest.raises(NotFound):
        client.matmul("no-such-model", TENSOR, np.ones((1, 4096), np.float32))


def _npy(y: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, y)
    return buf.getvalue()


def test_a_503_with_retry_after_is_retried_then_raised() -> None:
    calls = []

    def answer(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) <= 2:
            return httpx.Response(503, headers={"Retry-After": "0"},
                                  json={"error": {"code": "overloaded", "message": "full"}})
        return httpx.Response(200, content=_npy(np.ones((1, 8), np.float32)),
                              headers={"X-Qgemm-Kernel": "gemv", "Server-Timing": "gemm;dur=0.010"})

    with Client(http=httpx.Client(transport=httpx.MockTransport(answer), base_url="http://q")) as c:
        got = c.product("m", "t", np.ones((1, 4)))
        assert len(calls) == 3 and got.kernel == "gemv"
        assert got.timing_ms == {"gemm": 0.01}
    calls.clear()
    with Client(retries=1, http=httpx.Client(transport=httpx.MockTransport(
            lambda r: httpx.Response(503, headers={"Retry-After": "0"},
                                     json={"error": {"code": "overloaded", "message": "full"}})),
            base_url="http://q")) as c, pytest.raises(Unavailable) as err:
        c.matmul("m", "t", np.ones((1, 4)))
    assert err.value.code == "overloaded" and err.value.retry_after == 0


def test_the_async_client(fronts_url: str, rng: np.random.Generator) -> None:
    x = rng.standard_normal((2, 4096)).astype(np.float32)

    async def run() -> list[np.ndarray]:
        async with AsyncClient(fronts_url) as c:
            assert "demo" in [m["id"] for m in await c.models()]
            return await asyncio.gather(*(c.matmul("demo", TENSOR, x, kernel="ref_f32") for _ in range(4)))

    ys = asyncio.run(run())
    with Client(fronts_url) as c:
        want = c.matmul("demo", TENSOR, x, kernel="ref_f32")
    assert all(np.array_equal(y, want) for y in ys)
