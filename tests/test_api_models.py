"""Model and tensor routes, on the demo, SmolLM2 and broken files."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from gguf import GGMLQuantizationType, GGUFReader, quants

from models.demo import DEMO_TENSORS
from tests.conftest import BROKEN, SMOL_ID


@pytest.fixture
def client(api: httpx.Client) -> httpx.Client:
    """Every test here runs through each deployment (conftest.DEPLOYMENTS)."""
    return api


def test_healthz(client: TestClient) -> None:
    r = client.get("/healthz")
    assert r.status_code == 200
    assert r.json()["status"] == "ok" and r.json()["backend"] == "cpu"


def test_metrics_are_strict_exposition_text(client: TestClient) -> None:
    """/metrics as a strict parser (promtool) takes it, in every deployment: each family's HELP and TYPE once,
    before its samples, which come together and carry its name; the engines' families merged with the fronts'."""
    import re

    assert client.post("/v1/matmul", json={"model": "demo", "tensor": "blk.0.attn_q.weight",
                                           "activations": [[0.5] * 4096]}).status_code == 200
    text = client.get("/metrics").text
    helps, types, done, current = set(), {}, set(), None
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name = line.split()[2]
            assert name not in helps, f"HELP {name} twice"
            helps.add(name)
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            assert name not in types, f"TYPE {name} twice"
            types[name] = kind
            if current is not None:
                done.add(current)
            current = name
        elif line and not line.startswith("#"):
            sample = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0)
            family = next((f for f in (current,) if f and (sample == f or sample.startswith(f + "_"))), None)
            assert family is not None and family not in done, f"{sample} outside its family {current}"
    assert {"qgemm_http_requests_total", "qgemm_http_request_seconds", "qgemm_batch_requests"} <= set(types)


def test_readyz_is_healthz_with_the_status_it_means(client: TestClient) -> None:
    r = client.get("/readyz")
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["version"]


def test_readyz_answers_503_while_degraded_and_healthz_200(in_process: TestClient, monkeypatch) -> None:
    client = in_process
    service = client.app.state.service
    healthy = service.health

    async def degraded() -> dict:
        return {**await healthy(), "status": "degraded"}

    monkeypatch.setattr(service, "health", degraded)
    r = client.get("/readyz")
    assert r.status_code == 503 and r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "not_ready"
    assert client.get("/healthz").status_code == 200  # liveness: the process is up


def test_list_models_has_both_real_models_and_the_broken_ones(client: TestClient) -> None:
    models = {m["id"]: m for m in client.get("/v1/models").json()["models"]}
    assert models["demo"]["status"] == "ok" and models["demo"]["architecture"] == "qgemm-demo"
    assert models["demo"]["tensor_count"] == len(DEMO_TENSORS)
    assert models[SMOL_ID]["status"] == "ok" and models[SMOL_ID]["architecture"] == "llama"
    assert models[SMOL_ID]["tensor_count"] == 272
    for name in [*BROKEN, "truncated.gguf", "contradictory.gguf"]:
        m = models[name[: -len(".gguf")]]
        assert m["status"] == "error" and m["error"], name
        assert m["tensor_count"] == 0
    assert "notes" not in models


def test_broken_file_reasons_are_readable(client: TestClient) -> None:
    models = {m["id"]: m for m in client.get("/v1/models").json()["models"]}
    assert "empty" in models["empty"]["error"]
    assert "not a GGUF" in models["notgguf"]["error"]
    assert "past the end" in models["truncated"]["error"] or "truncat" in models["truncated"]["error"].lower()


def test_model_detail(client: TestClient) -> None:
    d = client.get(f"/v1/models/{SMOL_ID}").json()
    assert d["header"]["version"] == 3 and d["header"]["tensor_count"] == 272
    tokens = d["metadata"]["tokenizer.ggml.tokens"]
    assert tokens["type"] == "ARRAY" and tokens["item_type"] == "STRING" and tokens["length"] == 49152
    assert tokens["first"][0] == "<|endoftext|>" and len(tokens["first"]) == 8
    assert d["metadata"]["llama.embedding_length"] == 576
    assert d["tensor_types"]["Q8_0"] == {"count": 1, "n_bytes": 30081024}
    assert d["tensor_types"]["Q4_1"]["count"] == 210
    held = d["resident"]  # the CPU's prepared weights (other tests' products may have made some)
    assert held["backend"] == "cpu" and held["placements"] == []  # one CPU device: nothing placed
    assert held["n_bytes"] == sum(t["n_bytes"] for t in held["tensors"]) and {t["device"] for t in held["tensors"]} <= {
        "cpu:0"}


def test_broken_model_detail_is_listed_not_crashing(client: TestClient) -> None:
    r = client.get("/v1/models/truncated")
    assert r.status_code == 200 and r.json()["status"] == "error" and r.json()["header"] is None
    r = client.get("/v1/models/truncated/tensors")
    assert r.status_code == 409 and r.json()["error"]["code"] == "model_unreadable"


def test_tensor_list_is_row_major_and_flags_matmul(client: TestClient, models_dir: Path) -> None:
    tensors = {t["name"]: t for t in client.get(f"/v1/models/{SMOL_ID}/tensors").json()["tensors"]}
    emb = tensors["token_embd.weight"]
    assert emb["type"] == "Q8_0" and emb["shape"] == [49152, 576] and emb["matmul"] is True
    assert emb["n_bytes"] == 49152 * 576 // 32 * 34
    assert tensors["blk.0.ffn_down.weight"]["type"] == "Q4_1" and tensors["blk.0.ffn_down.weight"]["matmul"] is True
    assert tensors["blk.0.attn_norm.weight"]["matmul"] is False
    # the offset is where the bytes really are
    reader = GGUFReader(models_dir / "demo.gguf")
    demo = {t["name"]: t for t in client.get("/v1/models/demo/tensors").json()["tensors"]}
    t = demo["tiny.q8_0.weight"]
    raw = (models_dir / "demo.gguf").read_bytes()[t["offset"]: t["offset"] + t["n_bytes"]]
    assert raw == next(x for x in reader.tensors if x.name == "tiny.q8_0.weight").data.tobytes()
    assert demo["blk.0.ffn_down.weight"]["shape"] == [4096, 14336]


def test_tensor_detail_statistics(client: TestClient, models_dir: Path) -> None:
    d = client.get("/v1/models/demo/tensors/small.q4_0.weight").json()
    reader = GGUFReader(models_dir / "demo.gguf")
    raw = next(x for x in reader.tensors if x.name == "small.q4_0.weight").data
    w = quants.dequantize(raw, GGMLQuantizationType.Q4_0).astype(np.float64)
    s = d["stats"]
    assert np.isclose(s["min"], w.min()) and np.isclose(s["max"], w.max())
    assert np.isclose(s["mean"], w.mean()) and np.isclose(s["std"], w.std())
    assert s["zero_block_share"] == 0.0 and s["n_values"] == 257 * 96
    assert d["matmul"] is True and d["matmul_reason"] is None and "nibbles" in d["block_format"]
    norm = client.get("/v1/models/demo/tensors/blk.0.attn_norm.weight").json()
    assert norm["matmul"] is False and "dimension" in norm["matmul_reason"]


def test_unknown_model_and_tensor_are_404(client: TestClient) -> None:
    for path in ("/v1/models/nope", "/v1/models/nope/tensors", "/v1/models/demo/tensors/nope.weight",
                 "/v1/models/..%2F..%2Fetc%2Fpasswd"):
        r = client.get(path)
        assert r.status_code == 404, path
        assert set(r.json()["error"]) == {"code", "message"}


def test_no_path_outside_the_models_dir(client: TestClient) -> None:
    for model in ("../demo", "/etc/passwd", "demo.gguf", "..", "%2e%2e"):
        r = client.post("/v1/matmul", json={"model": model, "tensor": "tiny.q4_0.weight", "activations": [[1.0] * 64]})
        assert r.status_code == 404, model


def test_kernels_lists_auto_and_the_reference(client: TestClient) -> None:
    ks = {k["name"]: k for k in client.get("/v1/kernels").json()["kernels"]}
    assert ks["auto"]["available"] and ks["ref_q8_1"]["available"] and ks["ref_f32"]["available"]
    assert ks["ref_q8_1"]["activation_format"] == "q8_1_mmvq" and ks["ref_mmq"]["activation_format"] == "q8_1_mmq"
    assert ks["ref_f32"]["activation_format"] == "f32"
    for k in ks.values():
        assert set(k) == {"name", "weight_types", "activation_format", "backend", "available", "reason", "description"}
        assert k["available"] or k["reason"]


def test_a_cross_site_page_cannot_change_state_without_a_key(client) -> None:
    """A bodyless POST from another site's page (its browser names that Origin) is refused; this server's own pages
    and clients that send no Origin are served; reading is open."""
    evil = {"Origin": "http://evil.example"}
    r = client.post("/v1/models/demo/unload", headers=evil)
    assert r.status_code == 403 and r.json()["error"]["code"] == "cross_origin"
    r = client.post("/v1/matmul", json={"model": "demo", "tensor": "tiny.q4_0.weight", "activations": [[0.5] * 64]},
                    headers=evil)
    assert r.status_code == 403
    host = client.base_url.netloc.decode()
    assert client.post("/v1/models/demo/unload", headers={"Origin": f"http://{host}"}).status_code == 200
    assert client.post("/v1/models/demo/unload").status_code == 200
    assert client.get("/v1/models", headers=evil).status_code == 200
