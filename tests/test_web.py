"""The web pages (app/web): served by the same app, shells whose data comes from the public /v1 API; the
histogram endpoint they draw from.  The same pages in a real browser: tests/test_browser.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from kernels.reference import dequantize_weights
from models.store import ModelStore
from tests.conftest import make_client

PAGES = ["/", "/ui/models/demo", "/ui/models/demo/tensors/blk.0.attn_q.weight", "/ui/matmul", "/ui/kernels"]


@pytest.mark.parametrize("path", PAGES)
def test_pages_render_offline(client: TestClient, path: str) -> None:
    r = client.get(path)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    html = r.text
    assert '<html lang="en">' in html and "/static/qgemm.js" in html
    assert "http://" not in html and "https://" not in html  # no CDN: everything from this server


def test_tensor_page_offers_bitsandbytes_blocksizes(client: TestClient) -> None:
    html = client.get("/ui/models/demo/tensors/blk.0.attn_q.weight").text
    assert "<option selected>64</option>" in html and "<option>4096</option>" in html  # the API's default is chosen


def test_static_files_and_escaping(client: TestClient) -> None:
    for path, kind in [("/static/qgemm.js", "javascript"), ("/static/qgemm.css", "text/css")]:
        r = client.get(path)
        assert r.status_code == 200 and kind in r.headers["content-type"]
    assert "innerHTML" not in client.get("/static/qgemm.js").text  # data goes in as text nodes only
    r = client.get("/ui/models/%3Cscript%3Ex")  # a name is page data, escaped by Jinja2
    assert r.status_code == 200 and "<script>x" not in r.text and "&lt;script&gt;x" in r.text
    assert client.get("/static/nope.js").status_code == 404


def test_pages_ask_for_the_key_and_never_carry_it(models_dir: Path) -> None:
    with make_client(models_dir, api_key="s3cret-key-for-pages") as c:
        page = c.get("/ui/models/demo")
        assert page.status_code == 200 and 'data-needs-key="yes"' in page.text
        assert "s3cret-key-for-pages" not in page.text
        assert c.get("/v1/models").status_code == 401  # the data stays behind the key
    with make_client(models_dir) as c:
        assert 'data-needs-key="no"' in c.get("/").text


def test_histograms_count_every_value(client: TestClient, real_models_dir: Path) -> None:
    r = client.get("/v1/models/demo/tensors/blk.0.attn_q.weight/histogram", params={"bins": 16})
    assert r.status_code == 200
    h = r.json()
    model = next(m for m in ModelStore(real_models_dir).scan() if m.id == "demo")
    w = dequantize_weights("Q4_0", model.raw("blk.0.attn_q.weight"))
    edges = np.array(h["values"]["edges"])
    assert len(edges) == 17 and edges[0] == w.min() and edges[-1] == w.max()
    np.testing.assert_array_equal(h["values"]["counts"], np.histogram(w, bins=edges)[0])
    assert sum(h["block_scales"]["counts"]) == w.size // 32  # one d per 32-value block
    vec = client.get("/v1/models/SmolLM2-135M-Instruct.Q4_1/tensors/output_norm.weight/histogram").json()
    assert vec["type"] == "F32" and vec["block_scales"] is None and sum(vec["values"]["counts"]) == 576


@pytest.mark.parametrize("path,status,code", [
    ("/v1/models/demo/tensors/nope/histogram", 404, "tensor_not_found"),
    ("/v1/models/nope/tensors/x/histogram", 404, "model_not_found"),
    ("/v1/models/demo/tensors/blk.0.attn_q.weight/histogram?bins=2", 400, "bad_request"),
    ("/v1/models/demo/tensors/blk.0.attn_q.weight/histogram?bins=100000", 400, "bad_request"),
])
def test_histogram_errors(client: TestClient, path: str, status: int, code: str) -> None:
    r = client.get(path)
    assert r.status_code == status and r.json()["error"]["code"] == code
