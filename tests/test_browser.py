"""The pages in a real browser: Playwright driving Debian's Chromium (headless) against `qgemm serve` on
loopback.  Each page loads without console errors, the tensor table filters, a product run from the page equals
the API's, a broken model shows its error.  Skipped, with the reason, where Playwright or Chromium is missing;
`.ci/run` installs both.  QGEMM_SCREENSHOTS=DIR also saves a screenshot of each page there (docs/web/)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

CHROMIUM = os.environ.get("QGEMM_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
REQUIRED = bool(os.environ.get("QGEMM_TEST_REQUIRE_BROWSER"))  # .ci/run: a missing browser fails, not skips
try:
    from playwright import sync_api
except ImportError:
    sync_api = None
_missing = ("Playwright is not installed (pip install playwright)" if sync_api is None else
            f"no Chromium at {CHROMIUM} (Debian: apt-get install chromium)" if not Path(CHROMIUM).is_file() else "")
if _missing:
    if REQUIRED:
        raise RuntimeError(f"QGEMM_TEST_REQUIRE_BROWSER is set: {_missing}")
    pytest.skip(_missing, allow_module_level=True)

SMOL = "SmolLM2-135M-Instruct.Q4_1"
SHOTS = os.environ.get("QGEMM_SCREENSHOTS")


@pytest.fixture(scope="module")
def server(models_dir: Path) -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "QGEMM_MODELS_DIR": str(models_dir), "QGEMM_BACKEND": "cpu"}
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            pytest.fail("qgemm serve did not come up in 30 s")
        yield base
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser: object) -> Iterator[object]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = context.new_page()
    pg.problems = []  # console errors and uncaught exceptions: every test ends with none
    pg.on("console", lambda m: pg.problems.append(m.text) if m.type == "error" else None)
    pg.on("pageerror", lambda e: pg.problems.append(str(e)))
    yield pg
    context.close()


def shot(pg: object, name: str) -> None:
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        pg.screenshot(path=str(Path(SHOTS) / f"{name}.png"))  # the first screen, as a person sees it on opening


def test_models_page_lists_every_model_and_broken_ones(server: str, page: object) -> None:
    page.goto(f"{server}/")
    page.wait_for_selector(f'#models tr[data-model="{SMOL}"] .mix:not(:empty)')
    assert page.locator('#models tr[data-model="demo"]').count() == 1
    broken = page.locator('#models tr[data-model="truncated"]')
    assert "error" in broken.inner_text()
    assert page.locator("#backend").inner_text().startswith("backend cpu")
    shot(page, "models")
    assert not page.problems, page.problems


def test_model_page_filters_and_sorts_the_tensor_table(server: str, page: object) -> None:
    page.goto(f"{server}/ui/models/{SMOL}")
    page.wait_for_selector("#tensors tbody tr")
    total = page.locator("#tensors tbody tr").count()
    assert total == 272 and page.locator("#by-format svg").count() == 1 and page.locator("#by-layer svg").count() == 1
    page.fill("#filter", "attn_q")
    assert page.locator("#tensors tbody tr").count() == 30  # one per block
    page.fill("#filter", "q8_0")
    assert page.locator("#tensors tbody tr").count() == 1
    page.fill("#filter", "")
    page.click('#tensors th button[data-key="n_bytes"]')
    page.click('#tensors th button[data-key="n_bytes"]')  # descending: the largest first
    assert "token_embd.weight" in page.locator("#tensors tbody tr").first.inner_text()
    assert page.locator("#metadata details").count() >= 3  # the tokenizer's arrays, summarised
    shot(page, "model")
    assert not page.problems, page.problems


def test_tensor_page_draws_its_histograms(server: str, page: object) -> None:
    page.goto(f"{server}/ui/models/{SMOL}/tensors/blk.0.attn_q.weight")
    page.wait_for_selector("#values svg")
    page.wait_for_selector("#scales svg")
    assert "Q4_1" in page.locator("#facts").inner_text()
    shot(page, "tensor")
    assert not page.problems, page.problems


def test_matmul_from_the_page_equals_the_api(server: str, page: object) -> None:
    page.goto(f"{server}/ui/matmul?model={SMOL}&tensor=blk.0.attn_q.weight")
    page.wait_for_selector('#mm-kernels input[value="ref_q8_1"]')
    for box in page.locator("#mm-kernels input").all():
        box.set_checked(box.get_attribute("value") in ("ref_q8_1", "ref_mmq"))
    page.fill("#mm-m", "2")
    page.fill("#mm-seed", "7")
    with page.expect_response(lambda r: r.url.endswith("/v1/matmul") and
                              (r.request.post_data_json or {}).get("kernel") == "ref_mmq") as answer:
        page.click("#mm-run")
    sent, got = answer.value.request.post_data_json, answer.value.json()
    page.wait_for_selector('#mm-results tr[data-kernel="ref_mmq"]')
    assert len(sent["activations"]) == 2 and len(sent["activations"][0]) == 576
    direct = httpx.post(f"{server}/v1/matmul", json=sent, timeout=30).json()
    assert direct["output"] == got["output"]  # the page shows what the API computes, bit for bit
    rows = page.locator("#mm-results tbody tr")
    assert rows.count() == 3  # the reference and the two kernels
    nmse = float(page.locator('#mm-results tr[data-kernel="ref_mmq"] .nmse').inner_text())
    assert 0 < nmse < 1e-3  # Q8_1 activations against the float reference
    shot(page, "matmul")
    assert not page.problems, page.problems


def test_kernel_catalog(server: str, page: object) -> None:
    page.goto(f"{server}/ui/kernels")
    page.wait_for_selector("#kernels tbody tr")
    text = page.locator("#kernels").inner_text()
    assert "ref_q8_1" in text and "mmq" in text
    shot(page, "kernels")
    assert not page.problems, page.problems
