"""The Open Inference Protocol (KServe v2, app/routes/inference.py) through Triton's own Python client
(`tritonclient[http]`), unmodified, against a running `qgemm serve` with fronts and with `--fronts 0`: health,
metadata, the repository index, and infer with JSON and binary tensors, whose Y equals the native route's bit for
bit; errors in the protocol's shape."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

tritonclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

MODEL = "demo/blk.0.attn_q.weight"


@pytest.fixture(scope="module", params=["fronts", "one-process"])
def url(request: pytest.FixtureRequest, models_dir: Path) -> Iterator[str]:
    if request.param == "fronts":
        yield request.getfixturevalue("fronts_url")
        return
    from tests.live import Server

    s = Server(models_dir, fronts=0, QGEMM_BACKEND="cpu").start()
    try:
        yield s.url
    finally:
        s.stop()


@pytest.fixture
def triton(url: str) -> Iterator[object]:
    c = tritonclient.InferenceServerClient(url.removeprefix("http://"), network_timeout=120)
    yield c
    c.close()


def _native(url: str, x: np.ndarray, kernel: str) -> np.ndarray:
    buf = io.BytesIO()
    np.save(buf, x)
    r = httpx.post(f"{url}/v1/matmul", params={"model": "demo", "tensor": "blk.0.attn_q.weight", "kernel": kernel},
                   content=buf.getvalue(), headers={"Content-Type": "application/x-npy", "Accept": "application/x-npy"},
                   timeout=120)
    assert r.status_code == 200, r.text
    return np.load(io.BytesIO(r.content))


def test_health_metadata_and_repository(triton) -> None:
    assert triton.is_server_live() and triton.is_server_ready()
    assert "binary_tensor_data" in triton.get_server_metadata()["extensions"]
    assert triton.is_model_ready(MODEL) and triton.is_model_ready(MODEL, model_version="1")
    assert triton.get_model_metadata(MODEL, model_version="1")["name"] == MODEL
    meta = triton.get_model_metadata(MODEL)
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4096]}]
    assert meta["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [-1, 4096]}]
    names = [m["name"] for m in triton.get_model_repository_index()]
    assert MODEL in names and "demo/blk.0.ffn_down.weight" in names
    with pytest.raises(InferenceServerException):
        triton.get_model_metadata("demo/no-such-tensor")


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("kernel", ["auto", "ref_f32"])
def test_infer_equals_the_native_route(triton, url: str, rng: np.random.Generator, binary: bool, kernel: str) -> None:
    x = rng.standard_normal((3, 4096)).astype(np.float32)
    given = tritonclient.InferInput("x", list(x.shape), "FP32")
    given.set_data_from_numpy(x, binary_data=binary)
    result = triton.infer(MODEL, [given], outputs=[tritonclient.InferRequestedOutput("y", binary_data=binary)],
                          parameters={"kernel": kernel})
    y = result.as_numpy("y")
    params = result.get_response()["parameters"]
    assert y.shape == (3, 4096) and y.dtype == np.float32
    assert params["kernel"] == kernel or kernel == "auto"
    assert params["gemm_ms"] > 0 and params["batch_rows"] >= 3
    assert np.array_equal(y, _native(url, x, params["kernel"]))


def test_infer_without_outputs_answers_binary(triton, url: str, rng: np.random.Generator) -> None:
    x = rng.standard_normal((1, 4096)).astype(np.float32)
    given = tritonclient.InferInput("x", [1, 4096], "FP32")
    given.set_data_from_numpy(x)
    result = triton.infer(MODEL, [given], model_version="1", parameters={"kernel": "auto", "weight_format": "nf4"})
    assert result.get_response()["outputs"][0]["parameters"]["binary_data_size"] == 4096 * 4
    assert result.as_numpy("y").shape == (1, 4096)


def test_errors_in_the_protocols_shape(triton, url: str) -> None:
    wrong_k = tritonclient.InferInput("x", [1, 100], "FP32")
    wrong_k.set_data_from_numpy(np.ones((1, 100), np.float32))
    with pytest.raises(InferenceServerException) as err:
        triton.infer(MODEL, [wrong_k])
    assert "k_mismatch" in str(err.value)
    r = httpx.post(f"{url}/v2/models/{MODEL}/infer", json={"inputs": [{"name": "z", "datatype": "FP32",
                                                                         "shape": [1, 4096], "data": [0] * 4096}]})
    assert r.status_code == 400 and isinstance(r.json()["error"], str)
    r = httpx.post(f"{url}/v2/models/{MODEL}/infer", content=b"{", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and isinstance(r.json()["error"], str)
    assert httpx.get(f"{url}/v2/models/{MODEL}/versions/2").status_code == 404


BAD_BODIES = [
    b"", b"[]", b'{"inputs": 3}', b'{"inputs": [1]}', b'{"inputs": [{"name": "x"}]}',
    b'{"inputs": [{"name": "x", "datatype": "FP64", "shape": [1, 4096], "data": [0]}]}',
    b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, -4096], "data": [0]}]}',
    b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 4096], "data": [[1, 2], [3]]}]}',
    b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4096], "data": ["a"]}]}',
    b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4096], "parameters": {"binary_data_size": 99}}]}',
    b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [0, 4096], "data": []}]}',
    b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4096], "data": [0]}], "parameters": []}',
    b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4096], "data": [0]}], "parameters": '
    b'{"blocksize": "x", "weight_format": "nf4"}}',
    b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4096], "data": [0]}], "outputs": [{"name": "q"}]}',
]


@pytest.mark.parametrize("body", BAD_BODIES, ids=range(len(BAD_BODIES)))
def test_bad_infer_bodies_are_4xx_in_the_protocols_shape(url: str, body: bytes) -> None:
    r = httpx.post(f"{url}/v2/models/{MODEL}/infer", content=body, headers={"Content-Type": "application/json"},
                   timeout=60)
    assert 400 <= r.status_code < 500 and isinstance(r.json()["error"], str), (r.status_code, r.text)
    length = httpx.post(f"{url}/v2/models/{MODEL}/infer", content=b'{"inputs": []}xyz', timeout=60,
                        headers={"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": "999"})
    assert length.status_code == 400
    assert httpx.get(f"{url}/v2/health/ready", timeout=10).status_code == 200
