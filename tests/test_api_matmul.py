"""POST /v1/matmul over JSON and .npy: correct products on the real tensors, and every error."""

from __future__ import annotations

import io
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from gguf import GGMLQuantizationType, GGUFReader

from kernels import reference as ref
from tests.conftest import SMOL_ID
from tests.oracles import assert_matches, prepare, reference_product


@pytest.fixture
def client(api: httpx.Client) -> httpx.Client:
    """Every test here runs through each deployment (conftest.DEPLOYMENTS)."""
    return api

LARGE = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.ffn_down.weight", "blk.1.ffn_down.weight"]


class Oracle:
    """The reference products of a models directory's tensors, with their weights prepared once."""

    def __init__(self, models_dir: Path):
        self.readers = {"demo": GGUFReader(models_dir / "demo.gguf"),
                        SMOL_ID: GGUFReader(models_dir / f"{SMOL_ID}.gguf")}
        self.prepared: dict[tuple[str, str, str], ref.BlockWeights | np.ndarray] = {}

    def check(self, y: np.ndarray, model: str, name: str, x: np.ndarray, activation_format: str) -> None:
        """y is what the API answered for x: llama.cpp's formula for q8_1 kernels, else the FP64 product."""
        t = next(t for t in self.readers[model].tensors if t.name == name)
        type_name = GGMLQuantizationType(int(t.tensor_type)).name
        key = (model, name, activation_format)
        if key not in self.prepared:
            self.prepared[key] = prepare(type_name, t.data, activation_format)
        want, terms = reference_product(type_name, t.data, x, activation_format, prepared=self.prepared[key])
        assert_matches(y, want, terms, f"{model}/{name} {activation_format}", same_q8_1=False)


@pytest.fixture(scope="module")
def oracle(models_dir: Path) -> Oracle:
    return Oracle(models_dir)


def npy(x: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, x)
    return buf.getvalue()


def test_a_large_npy_answer_is_sent_from_the_output_itself(client: TestClient, rng: np.random.Generator) -> None:
    """An answer of 1 MiB and more goes out as the .npy header then the array's bytes (no joined body): the
    same values as the JSON answer, a loadable file, and a Content-Length that counts both."""
    x = rng.standard_normal((1100, 96)).astype(np.float32)  # 1100 x 257 floats out: 1.1 MB
    q = "?model=demo&tensor=small.q4_0.weight&kernel=ref_q8_1"
    r = client.post(f"/v1/matmul{q}", content=npy(x), headers={"Content-Type": "application/x-npy",
                                                              "Accept": "application/x-npy"})
    assert r.status_code == 200, r.text
    assert int(r.headers["content-length"]) == len(r.content) > 1100 * 257 * 4
    y = np.load(io.BytesIO(r.content), allow_pickle=False)
    as_json = client.post(f"/v1/matmul{q}", content=npy(x), headers={"Content-Type": "application/x-npy"})
    assert np.array_equal(y, np.asarray(as_json.json()["output"], np.float32))


@pytest.mark.parametrize("name", LARGE)
@pytest.mark.parametrize("kernel", ["auto", "ref_q8_1", "ref_mmq", "ref_f32"])
def test_json_products_are_correct(client: TestClient, oracle: Oracle, rng: np.random.Generator,
                                   name: str, kernel: str) -> None:
    k = 14336 if "ffn_down" in name else 4096
    x = rng.standard_normal((3, k)).astype(np.float32)
    r = client.post("/v1/matmul", json={"model": "demo", "tensor": name, "kernel": kernel, "activations": x.tolist()})
    assert r.status_code == 200, r.text
    body = r.json()
    y = np.array(body["output"], dtype=np.float32)
    assert body["shape"] == [3, 4096] and y.shape == (3, 4096)
    assert body["activation_format"] == {"ref_f32": "f32", "ref_mmq": "q8_1_mmq"}.get(kernel, "q8_1_mmvq")
    assert body["kernel"] == ("ref_q8_1" if kernel == "auto" else kernel) and body["backend"] == "cpu"
    oracle.check(y, "demo", name, x, body["activation_format"])
    assert {"quantize", "gemm", "total"} <= set(body["timing_ms"])
    assert "gemm;dur=" in r.headers["server-timing"]


@pytest.mark.parametrize("name", LARGE)
def test_npy_products_are_correct(client: TestClient, oracle: Oracle, rng: np.random.Generator, name: str) -> None:
    k = 14336 if "ffn_down" in name else 4096
    x = rng.standard_normal((5, k))  # float64 is accepted too
    r = client.post(f"/v1/matmul?model=demo&tensor={name}", content=npy(x),
                    headers={"Content-Type": "application/x-npy", "Accept": "application/x-npy"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/x-npy"
    y = np.load(io.BytesIO(r.content), allow_pickle=False)
    assert y.dtype == np.float32 and y.shape == (5, 4096)
    oracle.check(y, "demo", name, x.astype(np.float32), "q8_1_mmvq")
    assert r.headers["x-qgemm-kernel"] == "ref_q8_1" and "total;dur=" in r.headers["server-timing"]


def test_a_long_query_string_answers_and_is_not_kept(client: TestClient, rng: np.random.Generator) -> None:
    """The route keeps what it parsed of a query string (and of a .npy header) only for short ones: distinct long
    ones from a hostile client would otherwise hold 4,096 times their length.  The answer is the same either way."""
    from app.routes import matmul

    x = rng.standard_normal((1, 4096)).astype(np.float32)
    short = "model=demo&tensor=blk.0.attn_q.weight"
    long = f"{short}&pad={'x' * (2 * matmul.KEPT_BYTES)}"
    answers = [client.post(f"/v1/matmul?{q}", content=npy(x), headers={"Content-Type": "application/x-npy",
                                                                        "Accept": "application/x-npy"})
               for q in (short, long)]
    assert [r.status_code for r in answers] == [200, 200]
    assert answers[0].content == answers[1].content
    assert matmul._query(long.encode()) == matmul._query(short.encode())
    assert long.encode() not in matmul.QUERIES_READ and short.encode() in matmul.QUERIES_READ
    header = io.BytesIO()
    np.lib.format.write_array_header_2_0(header, np.lib.format.header_data_from_array_1_0(x))
    raw = header.getvalue()
    spaced = raw[:-1] + b" " * (2 * matmul.KEPT_BYTES) + b"\n"  # the header padded with spaces, as the format allows
    spaced = spaced[:8] + (len(spaced) - 12).to_bytes(4, "little") + spaced[12:]
    assert matmul.parse_npy(spaced + x.tobytes()).shape == (1, 4096) and spaced not in matmul.NPY_HEADERS_READ


@pytest.mark.parametrize(("m", "formula"), [(1, "f16_mmvf"), (16, "f16"), (17, "f16_h")])
def test_f16_answers_name_ggml_s_formula_by_rows(client: TestClient, oracle: Oracle, rng: np.random.Generator,
                                                 m: int, formula: str) -> None:
    """An F16 matrix (64 x 64: mul_mat_f's shape) through `auto`: ggml's mul_mat_vec_f at one row, mul_mat_f's fp32
    sums to 16, its cuBLAS call's half sums above; the answer names the formula and is that formula's product."""
    x = rng.standard_normal((m, 64)).astype(np.float32)
    r = client.post("/v1/matmul", json={"model": "demo", "tensor": "small.f16.weight", "activations": x.tolist()})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["activation_format"] == formula and body["kernel"] == f"ref_{formula}"
    oracle.check(np.array(body["output"], np.float32), "demo", "small.f16.weight", x, formula)
    r = client.post("/v1/matmul?model=demo&tensor=small.f16.weight", content=npy(x),
                    headers={"Content-Type": "application/x-npy", "Accept": "application/x-npy"})
    assert r.status_code == 200 and r.headers["x-qgemm-activation-format"] == formula, r.text


def test_smollm2_token_embd_end_to_end(client: TestClient, oracle: Oracle, rng: np.random.Generator) -> None:
    x = rng.standard_normal((2, 576)).astype(np.float32)
    r = client.post("/v1/matmul", json={"model": SMOL_ID, "tensor": "token_embd.weight", "activations": x.tolist()})
    assert r.status_code == 200, r.text
    oracle.check(np.array(r.json()["output"]), SMOL_ID, "token_embd.weight", x, "q8_1_mmvq")
    r = client.post(f"/v1/matmul?model={SMOL_ID}&tensor=token_embd.weight&kernel=ref_f32",
                    content=npy(x.astype(np.float32)), headers={"Content-Type": "application/x-npy",
                                                                "Accept": "application/x-npy"})
    assert r.status_code == 200, r.text
    oracle.check(np.load(io.BytesIO(r.content)), SMOL_ID, "token_embd.weight", x, "f32")


def test_json_answer_to_npy_request_and_back(client: TestClient, rng: np.random.Generator) -> None:
    x = rng.standard_normal((2, 64)).astype(np.float32)
    r = client.post("/v1/matmul?model=demo&tensor=tiny.q8_0.weight", content=npy(x),
                    headers={"Content-Type": "application/x-npy"})
    assert r.status_code == 200 and r.json()["shape"] == [2, 33]
    r2 = client.post("/v1/matmul", json={"model": "demo", "tensor": "tiny.q8_0.weight", "activations": x.tolist()},
                     headers={"Accept": "application/x-npy"})
    assert r2.status_code == 200
    assert np.array_equal(np.load(io.BytesIO(r2.content)), np.array(r.json()["output"], dtype=np.float32))


def test_single_row_and_odd_sizes(client: TestClient, oracle: Oracle, rng: np.random.Generator) -> None:
    for name, k in (("small.q4_0.weight", 96), ("small.q8_0.weight", 96), ("tiny.q4_0.weight", 64)):
        for m in (1, 17):
            x = rng.standard_normal((m, k)).astype(np.float32)
            r = client.post("/v1/matmul", json={"model": "demo", "tensor": name, "activations": x.tolist()})
            assert r.status_code == 200
            body = r.json()  # auto: llama.cpp's MMVQ formula up to 8 rows, MMQ's above
            assert (body["kernel"], body["activation_format"]) == \
                (("ref_q8_1", "q8_1_mmvq") if m <= 8 else ("ref_mmq", "q8_1_mmq"))
            oracle.check(np.array(body["output"]), "demo", name, x, body["activation_format"])


def _post(client: TestClient, **body: object) -> tuple[int, dict]:
    payload = {"model": "demo", "tensor": "tiny.q4_0.weight", "activations": [[0.5] * 64]} | body
    r = client.post("/v1/matmul", json=payload)
    return r.status_code, r.json()


def _raw(client: TestClient, content: bytes, ctype: str = "application/json", query: str = "") -> tuple[int, dict]:
    r = client.post(f"/v1/matmul{query}", content=content, headers={"Content-Type": ctype})
    return r.status_code, r.json()


@pytest.mark.parametrize("content", [b"{", b"[1, 2]", b"null", b'{"model": "demo"}', b"",
                                     b'{"model": "demo", "tensor": "tiny.q4_0.weight", "activations": "abc"}',
                                     b'{"model": "demo", "tensor": "tiny.q4_0.weight", "activations": [["1"]]}',
                                     b'{"model": "demo", "tensor": "tiny.q4_0.weight", "activations": [[true]]}',
                                     b'{"model": 3, "tensor": "tiny.q4_0.weight", "activations": [[1]]}',
                                     b'{"model": "demo", "tensor": "t", "activations": [[1]], "extra": 1}',
                                     b'{"model": "demo", "tensor": "tiny.q4_0.weight", "activations": []}',
                                     b'{"model": "demo", "tensor": "tiny.q4_0.weight", "activations": [[]]}'])
def test_malformed_json_is_400(client: TestClient, content: bytes) -> None:
    status, body = _raw(client, content)
    assert status == 400, body
    assert body["error"]["message"]


def test_bad_npy_is_400(client: TestClient) -> None:
    q = "?model=demo&tensor=tiny.q4_0.weight"
    for content in (b"", b"\x93NUMPY garbage", npy(np.ones((2, 64)))[:60]):
        status, body = _raw(client, content, "application/x-npy", q)
        assert status == 400 and body["error"]["code"] == "bad_npy"
    obj = io.BytesIO()
    np.save(obj, np.array([{"a": 1}], dtype=object), allow_pickle=True)  # pickles must never load
    status, body = _raw(client, obj.getvalue(), "application/x-npy", q)
    assert status == 400 and body["error"]["code"] == "bad_npy"
    status, body = _raw(client, npy(np.ones((1, 64))), "application/x-npy", "?model=demo")
    assert status == 400


def test_npy_of_wrong_dtype_is_422(client: TestClient) -> None:
    status, body = _raw(client, npy(np.ones((1, 64), dtype=np.int32)), "application/x-npy",
                        "?model=demo&tensor=tiny.q4_0.weight")
    assert status == 422 and body["error"]["code"] == "bad_dtype"


def test_unsupported_content_type_is_415(client: TestClient) -> None:
    for ctype in ("text/plain", "application/xml", ""):
        status, body = _raw(client, b"abc", ctype)
        assert status == 415 and body["error"]["code"] == "unsupported_media_type"


def test_octet_stream_takes_the_npy_bytes(client: TestClient, rng: np.random.Generator) -> None:
    """`application/octet-stream` (how generated clients send a file) is the same .npy body; not .npy: 400."""
    x = rng.standard_normal((2, 4096)).astype(np.float32)
    q = {"model": "demo", "tensor": "blk.0.attn_q.weight", "kernel": "ref_f32"}
    got = [client.post("/v1/matmul", params=q, content=npy(x), headers={"Content-Type": ctype}).json()
           for ctype in ("application/octet-stream", "application/x-npy")]
    assert got[0]["output"] == got[1]["output"] and got[0]["kernel"] == "ref_f32"
    status, body = _raw(client, b"abc", "application/octet-stream", "?model=demo&tensor=tiny.q4_0.weight")
    assert status == 400 and body["error"]["code"] == "bad_npy"


def test_unknown_model_or_tensor_is_404(client: TestClient) -> None:
    assert _post(client, model="nope")[0] == 404
    assert _post(client, tensor="nope.weight")[0] == 404
    status, body = _post(client, model="truncated")  # there, but unreadable: what every route says of it
    assert status == 409 and body["error"]["code"] == "model_unreadable"
    assert client.get("/v1/models/truncated/tensors").status_code == 409


@pytest.mark.parametrize("acts,code", [
    ([[0.5] * 63], "k_mismatch"),
    ([[0.5] * 64, [0.5] * 32], "bad_shape"),
    ([[float("nan")] + [0.5] * 63], "non_finite"),
    ([[0.5] * 63 + [float("inf")]], "non_finite"),
    ([[1e39] + [0.5] * 63], "non_finite"),
])
def test_shape_and_value_errors_are_422(client: TestClient, acts: list, code: str) -> None:
    import json

    body = json.dumps({"model": "demo", "tensor": "tiny.q4_0.weight", "activations": acts})
    r = client.post("/v1/matmul", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == code


@pytest.mark.parametrize("tensor,x,quantity", [
    ("tiny.q4_0.weight", np.r_[np.full(63, 0.5), 9e6], "scale"),   # max|x|/127 passes half's 65504
    ("tiny.q8_0.weight", np.r_[np.full(63, 0.5), 9e6], "scale"),
    ("tiny.q4_0.weight", np.r_[np.full(40, 0.5), np.full(24, 3000.0)], "sum"),  # block 1 sums to 72000
])
def test_activations_out_of_q8_1_range_are_422(client: TestClient, tensor: str, x: np.ndarray, quantity: str) -> None:
    """Finite activations whose Q8_1 block would hold an infinite half: refused before any product,
    naming the row, the block and the limit (JSON and .npy alike)."""
    x2 = np.stack([np.full(64, 0.25), x])
    for status, body in (_post(client, tensor=tensor, activations=x2.tolist()),
                         _raw(client, npy(x2), "application/x-npy", f"?model=demo&tensor={tensor}")):
        assert status == 422 and body["error"]["code"] == "activation_out_of_range", body
        msg = body["error"]["message"]
        assert "row 1, block 1" in msg and quantity in msg and "half precision" in msg


def test_block_sums_over_half_are_fine_where_the_format_ignores_them(client: TestClient) -> None:
    """Q8_0's dot product never reads s_a, so a block summing past 65504 multiplies (and f32 kernels take any x)."""
    x = [[0.5] * 40 + [3000.0] * 24]
    assert _post(client, tensor="tiny.q8_0.weight", activations=x)[0] == 200
    assert _post(client, tensor="tiny.q4_0.weight", kernel="ref_f32", activations=x)[0] == 200


def test_a_product_that_overflows_float32_is_422(client: TestClient, models_dir: Path) -> None:
    """Finite activations, aligned with the signs of a row of W, whose product passes float32's 3.4e38."""
    t = next(t for t in GGUFReader(models_dir / "demo.gguf").tensors if t.name == "tiny.q4_0.weight")
    w = ref.dequantize_weights("Q4_0", t.data)
    row = int(np.abs(w).sum(axis=1).argmax())
    assert np.abs(w[row]).sum() > 1.1  # so the product reaches 3.3e38 * 1.1
    x = 3.3e38 * np.sign(w[row])
    status, body = _post(client, tensor="tiny.q4_0.weight", kernel="ref_f32", activations=[x.tolist()])
    assert status == 422 and body["error"]["code"] == "product_out_of_range", body
    assert f"row 0, column {row}" in body["error"]["message"]


def test_npy_shape_errors_are_422(client: TestClient) -> None:
    q = "?model=demo&tensor=tiny.q4_0.weight"
    for x in (np.ones(64), np.ones((1, 1, 64)), np.ones((2, 65)), np.full((1, 64), np.nan)):
        assert _raw(client, npy(x), "application/x-npy", q)[0] == 422


def test_too_many_rows_is_422(models_dir: Path) -> None:
    from tests.conftest import make_client

    with make_client(models_dir, max_rows=4) as c:
        r = c.post("/v1/matmul", json={"model": "demo", "tensor": "tiny.q4_0.weight", "activations": [[0.5] * 64] * 5})
        assert r.status_code == 422 and "QGEMM_MAX_ROWS" in r.json()["error"]["message"]


def test_tensor_that_is_not_a_supported_matrix_is_422(client: TestClient) -> None:
    s, b = _post(client, tensor="blk.0.attn_norm.weight", activations=[[0.5] * 4096])
    assert s == 422 and b["error"]["code"] == "unsupported_tensor"
    s, b = _post(client, tensor="small.iq2_xxs.weight", activations=[[0.5] * 256])
    assert s == 422 and "IQ2_XXS" in b["error"]["message"] and "Q4_K" in b["error"]["message"]


def test_unknown_kernel_lists_the_known(client: TestClient) -> None:
    s, b = _post(client, kernel="fastest")
    assert s == 422 and b["error"]["code"] == "unknown_kernel"
    assert "ref_q8_1" in b["error"]["message"] and "auto" in b["error"]["message"]


def test_kernel_that_cannot_run_says_why_and_which_can(client: TestClient) -> None:
    ks = {k["name"]: k for k in client.get("/v1/kernels").json()["kernels"]}
    gpu = [n for n, k in ks.items() if not k["available"]]
    if not gpu:
        pytest.skip("every kernel runs here")
    s, b = _post(client, kernel=gpu[0])
    assert s == 422 and b["error"]["code"] == "kernel_cannot_run"
    assert "ref_q8_1" in b["error"]["message"]


def test_server_keeps_serving_after_errors(client: TestClient) -> None:
    for _ in range(3):
        _raw(client, b"{nope")
        _raw(client, b'{"model": "demo", "tensor": "tiny.q4_0.weight", "activations": [[NaN]]}')
    assert client.get("/healthz").status_code == 200
    assert _post(client)[0] == 200


def test_a_json_body_over_its_limit_is_413_before_it_is_parsed(client) -> None:
    """JSON numbers take tens of times their text while parsed: past QGEMM_MAX_JSON_BODY_BYTES (8 MiB) the answer
    says to send .npy, whatever the body holds (here 9 MiB of a wrong K, which would parse first otherwise)."""
    row = "[" + ",".join(["0.123456789"] * 4095) + "]"
    body = ('{"model": "demo", "tensor": "blk.0.attn_q.weight", "activations": [' +
            ",".join([row] * (9 * (1 << 20) // len(row) + 1)) + "]}").encode()
    r = client.post("/v1/matmul", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large" and ".npy" in r.json()["error"][
        "message"]
    assert client.post("/v1/matmul", json={"model": "demo", "tensor": "tiny.q4_0.weight",
                                           "activations": [[0.5] * 64]}).status_code == 200
