"""Hostile input, property-based (Hypothesis): .npy bodies, JSON bodies and GGUF headers of every
malformed kind.  Every answer is a JSON 4xx error or a correct product, never a 5xx, and no request
allocates more than its body and file limits allow (traced with tracemalloc).

Examples are drawn from the run's seed (QGEMM_TEST_SEED), so a failure replays; nothing is stored
between runs.
"""

from __future__ import annotations

import io
import itertools
import json
import math
import os
import struct
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from kernels import reference as ref
from models.demo import write_gguf
from models.store import ModelStore
from tests.conftest import RUN_SEED, make_client


@pytest.fixture
def client(api: httpx.Client) -> httpx.Client:
    """Every test here runs through each deployment (conftest.DEPLOYMENTS)."""
    return api

EXAMPLES = int(os.environ.get("QGEMM_HOSTILE_EXAMPLES", "150"))  # per property; more for a deeper search
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
MiB = 1 << 20
OVERHEAD = 24 * MiB  # what one request may allocate beyond its body and file: the app's own working set
K, N = 64, 33  # demo's tiny.q4_0.weight
NPY_QUERY = "/v1/matmul?model=demo&tensor=tiny.q4_0.weight"


@contextmanager
def allocation_bound(limit: int) -> Iterator[None]:
    tracemalloc.start()
    try:
        yield
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < limit, f"a request allocated {peak} bytes at its peak; its limit was {limit}"


def assert_answer(r, check: Callable[[np.ndarray], None] | None = None) -> None:
    """A JSON 4xx error, or a 200 whose product `check` accepts."""
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        body = r.json()
        assert set(body) == {"error"} and body["error"]["code"] and body["error"]["message"]
    elif check is not None:
        check(np.asarray(r.json()["output"], np.float64))


@pytest.fixture(scope="module")
def tiny_weights(real_models_dir: Path) -> ref.BlockWeights:
    t = next(t for t in GGUFReader(real_models_dir / "demo.gguf").tensors if t.name == "tiny.q4_0.weight")
    return ref.prepare_block_weights("Q4_0", t.data)


def product_check(w: ref.BlockWeights, x: np.ndarray) -> Callable[[np.ndarray], None]:
    def check(y: np.ndarray) -> None:
        x32 = np.asarray(x, np.float32)
        a = ref.quantize_q8_1(x32) if x32.shape[0] <= 8 else ref.quantize_q8_1_mmq(x32, "DS4")
        want = (ref.ref_q8_1(w, a) if x32.shape[0] <= 8 else ref.ref_mmq(w, a)).astype(np.float64)
        assert y.shape == want.shape
        assert np.abs(y - want).max() <= 1e-5 * (1 + np.abs(want).max())
    return check


# -- .npy bodies ---------------------------------------------------------------------------------------
DIMS = st.one_of(st.integers(-3, 80), st.sampled_from([K, 1 << 31, 1 << 32, (1 << 63) - 1, 1 << 63, 10**30]))
DESCR = st.sampled_from(["<f4", "<f8", ">f4", "<f2", "<i4", "|u1", "|O", "<c8", "|V8", "<U3", "f4", "bogus"])


def npy_header(descr: str, fortran: bool, shape: tuple[int, ...], version: int) -> bytes:
    d = repr({"descr": descr, "fortran_order": fortran, "shape": shape}).encode()
    head = 12 if version >= 2 else 10
    pad = (-(head + len(d) + 1)) % 64
    d = d + b" " * pad + b"\n"
    length = struct.pack("<I", len(d)) if version >= 2 else struct.pack("<H", len(d))
    return b"\x93NUMPY" + bytes([version, 0]) + length + d


@st.composite
def npy_bodies(draw: st.DrawFn) -> tuple[bytes, np.ndarray | None]:
    """A .npy body (a valid one, one with a lying header, or noise), and the array when it is valid."""
    kind = draw(st.sampled_from(["valid", "header", "noise", "cut"]))
    if kind == "noise":
        return draw(st.binary(max_size=300)), None
    if kind in ("valid", "cut"):
        m = draw(st.integers(1, 12))
        x = np.asarray(draw(st.lists(st.floats(-1e3, 1e3, width=32), min_size=m * K, max_size=m * K)),
                       np.float32).reshape(m, K)
        buf = io.BytesIO()
        np.save(buf, x.astype(draw(st.sampled_from([np.float32, np.float64]))))
        data = buf.getvalue()
        if kind == "valid":
            return data, x
        return data[: draw(st.integers(0, len(data) - 1))], None
    shape = tuple(draw(st.lists(DIMS, max_size=4)))
    header = npy_header(draw(DESCR), draw(st.booleans()), shape, draw(st.sampled_from([1, 2, 3])))
    return header + draw(st.binary(max_size=600)), None


@SETTINGS
@seed(RUN_SEED)
@given(body=npy_bodies())
def test_npy_bodies(client, tiny_weights: ref.BlockWeights, body: tuple[bytes, np.ndarray | None]) -> None:
    data, x = body
    with allocation_bound(OVERHEAD + 8 * len(data)):
        r = client.post(NPY_QUERY, content=data, headers={"Content-Type": "application/x-npy"})
    if x is not None:
        assert r.status_code == 200, r.text
    assert_answer(r, product_check(tiny_weights, x) if x is not None else None)


# -- JSON bodies ---------------------------------------------------------------------------------------
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=30)
ROWS = st.lists(st.lists(st.floats(-1e3, 1e3, width=32), min_size=K, max_size=K), min_size=1, max_size=10)


@st.composite
def json_bodies(draw: st.DrawFn) -> tuple[bytes, np.ndarray | None]:
    """A JSON body: valid, valid with one field replaced by anything, or any JSON value; and X when valid."""
    kind = draw(st.sampled_from(["valid", "field", "any", "text"]))
    req = {"model": "demo", "tensor": "tiny.q4_0.weight", "kernel": "auto", "activations": draw(ROWS)}
    if kind == "valid":
        return json.dumps(req).encode(), np.asarray(req["activations"], np.float32)
    if kind == "field":
        key = draw(st.sampled_from([*req, "extra"]))
        req[key] = draw(JSON_VALUES)
        return json.dumps(req).encode(), None
    if kind == "any":
        return json.dumps(draw(JSON_VALUES)).encode(), None
    return draw(st.text(max_size=200)).encode(), None


@SETTINGS
@seed(RUN_SEED)
@given(body=json_bodies())
def test_json_bodies(client, tiny_weights: ref.BlockWeights, body: tuple[bytes, np.ndarray | None]) -> None:
    data, x = body
    with allocation_bound(OVERHEAD + 64 * len(data)):  # JSON numbers become Python floats, then float64
        r = client.post("/v1/matmul", content=data, headers={"Content-Type": "application/json"})
    if x is not None:
        assert r.status_code == 200, r.text
    assert_answer(r, product_check(tiny_weights, x) if x is not None else None)


# -- GGUF headers ----------------------------------------------------------------------------------------
def base_gguf(tmp: Path) -> tuple[bytes, list[tuple[int, int]]]:
    """A small GGUF with metadata of several kinds and two tensors, and the (offset, size) of every field
    part of its header: counts, string lengths, value types, values, tensor names, dims, types, offsets."""
    rng = np.random.default_rng(0)
    path = write_gguf(tmp / "base.gguf", [("w", GGMLQuantizationType.Q8_0, rng.standard_normal((8, K))),
                                          ("norm", GGMLQuantizationType.F32, rng.standard_normal(K))],
                      arch="qgemm-test", name="hostile", uints={"qgemm.test.n": 7})
    reader = GGUFReader(path)
    parts = []
    for f in itertools.chain(reader.fields.values(), (t.field for t in reader.tensors)):
        off = f.offset
        for p in f.parts:
            parts.append((off, int(p.nbytes)))
            off += int(p.nbytes)
    data = path.read_bytes()
    path.unlink()
    return data, parts


SPECIAL = [0, 1, 2, 3, 7, 8, 31, 32, 255, 256, 1 << 15, 1 << 31, (1 << 32) - 1, 1 << 40, 1 << 62, (1 << 64) - 1]


@st.composite
def gguf_files(draw: st.DrawFn, base: bytes, parts: list[tuple[int, int]]) -> bytes:
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 3))):
        off, size = draw(st.sampled_from(parts))
        if size > 8:  # a string's bytes: any bytes
            data[off:off + size] = draw(st.binary(min_size=size, max_size=size))
            continue
        value = draw(st.sampled_from(SPECIAL) | st.integers(0, (1 << (8 * size)) - 1)) % (1 << (8 * size))
        data[off:off + size] = value.to_bytes(size, "little")
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    return bytes(data)


class GgufCase:
    counter = itertools.count()


def test_gguf_headers(tmp_path_factory: pytest.TempPathFactory, rng: np.random.Generator) -> None:
    tmp = tmp_path_factory.mktemp("hostile-gguf")
    base, parts = base_gguf(tmp)
    models = tmp / "models"
    models.mkdir()
    x = rng.standard_normal((2, K)).astype(np.float32)
    with make_client(models) as c:

        @SETTINGS
        @seed(RUN_SEED)
        @given(data=gguf_files(base, parts))
        def check(data: bytes) -> None:
            name = f"h{next(GgufCase.counter)}"  # a new file each time: never the previous one's table
            for old in models.iterdir():
                old.unlink()
            (models / f"{name}.gguf").write_bytes(data)
            with allocation_bound(OVERHEAD + 8 * len(data)):
                listing = c.get("/v1/models")
                assert listing.status_code == 200
                for path in (f"/v1/models/{name}", f"/v1/models/{name}/tensors", f"/v1/models/{name}/tensors/w"):
                    assert_answer(c.get(path))
                r = c.post("/v1/matmul", json={"model": name, "tensor": "w", "activations": x.tolist()})
            if r.status_code == 200:  # the header still says what the data is: the product of those bytes
                model = ModelStore(models).get(name)
                info = model.tensors["w"]
                w = ref.prepare_block_weights(info.type_name, model.raw("w"))
                want = ref.ref_q8_1(w, ref.quantize_q8_1(x)).astype(np.float64)
                assert_answer(r, lambda y: np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5))
            else:
                assert_answer(r)

        check()


def test_npy_shape_products_that_overflow_int64_are_400(client) -> None:
    """A header whose dims multiply past 2^64 (numpy's prod wraps) names no array the body holds."""
    for shape in ((1 << 32, 1 << 32), (1 << 62, 4, 0), (-1, K)):
        body = npy_header("<f4", False, shape, 1) + b"\0" * 256
        r = client.post(NPY_QUERY, content=body, headers={"Content-Type": "application/x-npy"})
        assert 400 <= r.status_code < 500 and r.json()["error"]["code"] in ("bad_npy", "bad_shape"), r.text
    assert math.prod((1 << 32, 1 << 32)) == 1 << 64
