"""The OpenAPI document generates a working client: openapi-python-client writes one from /openapi.json, and it
lists the models and runs products in both of POST /v1/matmul's forms (a JSON body, and X as a file), with the
kernel and weight format it names, in process and through `qgemm serve`'s processes (the `api` fixture)."""

from __future__ import annotations

import importlib
import io
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import httpx
import numpy as np
import pytest

pytest.importorskip("openapi_python_client")
TENSOR = "blk.0.attn_q.weight"


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory, in_process: object) -> ModuleType:
    root = tmp_path_factory.mktemp("generated")
    spec = root / "openapi.json"
    spec.write_text(json.dumps(in_process.app.openapi()))  # type: ignore[attr-defined]
    out = root / "qgemm_generated"
    run = subprocess.run([sys.executable, "-m", "openapi_python_client", "generate", "--path", str(spec), "--meta",
                          "none", "--output-path", str(out)], capture_output=True, text=True, timeout=300)
    assert out.is_dir(), run.stdout + run.stderr
    sys.path.insert(0, str(root))
    try:
        return importlib.import_module("qgemm_generated")
    finally:
        sys.path.remove(str(root))


def _client(generated: ModuleType, api: httpx.Client) -> object:
    c = generated.Client(base_url=str(api.base_url))
    c.set_httpx_client(api)
    return c


def _native(api: httpx.Client, x: np.ndarray, **extra: object) -> list:
    r = api.post("/v1/matmul", json={"model": "demo", "tensor": TENSOR, "activations": x.tolist(), **extra})
    assert r.status_code == 200, r.text
    return r.json()["output"]


def test_the_generated_client_lists_and_multiplies(generated: ModuleType, api: httpx.Client,
                                                   rng: np.random.Generator) -> None:
    list_models = importlib.import_module("qgemm_generated.api.models.list_models")
    matmul = importlib.import_module("qgemm_generated.api.matmul.matmul")
    models = importlib.import_module("qgemm_generated.models")
    types = importlib.import_module("qgemm_generated.types")
    c = _client(generated, api)
    assert "demo" in [m.id for m in list_models.sync(client=c).models]
    x = rng.standard_normal((2, 4096)).astype(np.float32)
    # a JSON body, its kernel named in it
    body = models.MatmulJsonMatmulRequest.from_dict({"model": "demo", "tensor": TENSOR, "activations": x.tolist(),
                                                      "kernel": "ref_f32"})
    got = matmul.sync(client=c, body=body)
    assert got.kernel == "ref_f32" and got.output == _native(api, x, kernel="ref_f32")
    # X as a file (application/octet-stream: the .npy bytes), kernel and weight format as query parameters
    buf = io.BytesIO()
    np.save(buf, x)
    buf.seek(0)
    got = matmul.sync(client=c, body=types.File(payload=buf, file_name="x.npy"), model="demo", tensor=TENSOR,
                      kernel=models.MatmulKernel("ref_f32"), weight_format=models.MatmulWeightFormat("nf4"))
    assert got.kernel == "ref_f32" and got.weight_format.startswith("nf4")
    assert got.output == _native(api, x, kernel="ref_f32", weight_format="nf4")


def test_the_generated_client_is_beside_the_tests(generated: ModuleType) -> None:
    assert Path(generated.__file__).parent.name == "qgemm_generated"
