"""The pages in a real browser: Playwright driving Debian's Chromium (headless) against `qgemm serve` on
loopback.  Each page loads without console errors, the tensor table filters, folds by layer and sorts, a product
run from the page equals the API's, a broken model shows its error; every page fits a phone's width; a person with
only a keyboard gets from the model list to a product; with QGEMM_API_KEY set the page asks for the key and it
never shows up in a URL or the server's log.  Skipped, with the reason, where Playwright or Chromium is missing;
`.ci/run` installs both.  QGEMM_SCREENSHOTS=DIR also saves a screenshot of each page there (docs/web/)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def serving(models_dir: Path, log: Path, **env: str) -> Iterator[str]:
    """`qgemm serve` on a free loopback port, its output in `log`; yields the base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "QGEMM_MODELS_DIR": str(models_dir), "QGEMM_BACKEND": "cpu", **env}
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):  # ready: /readyz answers 200 (503 while the engine process starts)
            try:
                if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        else:
            pytest.fail(f"qgemm serve did not come up in 30 s: {log.read_text()[-2000:]}")
        yield base
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module")
def server(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serving(models_dir, tmp_path_factory.mktemp("serve") / "log") as base:
        yield base


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


def open_page(browser: object, **context_options: object) -> object:
    pg = browser.new_context(**context_options).new_page()
    pg.problems = []  # console errors and uncaught exceptions: every test ends with none
    pg.on("console", lambda m: pg.problems.append(m.text) if m.type == "error" else None)
    pg.on("pageerror", lambda e: pg.problems.append(str(e)))
    return pg


@pytest.fixture
def page(browser: object) -> Iterator[object]:
    pg = open_page(browser, viewport={"width": 1280, "height": 900})
    yield pg
    pg.context.close()


def tab_to(pg: object, selector: str, limit: int = 80) -> None:
    """Press Tab until the focused element matches `selector`, as a person with only a keyboard would."""
    for _ in range(limit):
        pg.keyboard.press("Tab")
        if pg.evaluate("(s) => document.activeElement && document.activeElement.matches(s)", selector):
            return
    pytest.fail(f"{limit} Tabs never reached {selector}")


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


def test_model_page_filters_groups_and_sorts_the_tensor_table(server: str, page: object) -> None:
    page.goto(f"{server}/ui/models/{SMOL}")
    page.wait_for_selector("#tensors tbody tr.t")
    tensors, groups = page.locator("#tensors tbody tr.t"), page.locator("#tensors tbody tr.group")
    # 30 blocks and the tensors outside them; so many layers open folded, all but token_embd and output_norm
    assert groups.count() == 31 and tensors.count() == 2
    assert page.get_attribute('button[data-layer="0"]', "aria-expanded") == "false"
    assert page.locator("#by-format svg").count() == 1 and page.locator("#by-layer svg").count() == 1
    assert "parameters at" in page.locator("#summary").inner_text()  # the parameter count and bits per weight
    page.click('#tensors tr.group button[data-layer="0"]')  # unfold blk.0
    assert tensors.count() == 11 and page.get_attribute('button[data-layer="0"]', "aria-expanded") == "true"
    page.click('#tensors tr.group button[data-layer="0"]')
    assert tensors.count() == 2
    page.click("#fold-all")  # unfold all
    assert tensors.count() == 272
    assert "ne: [576, 576]" in page.get_attribute('tr:has(a[href$="/blk.0.attn_q.weight"]) td:nth-child(4)', "title")
    page.fill("#filter", "attn_q")
    assert tensors.count() == 30 and groups.count() == 30  # one per block; the empty group is gone
    page.fill("#filter", "q8_0")
    assert tensors.count() == 1
    page.fill("#filter", "")
    page.select_option("#min-bytes", "1048576")
    assert tensors.count() == 1  # only token_embd (28.7 MiB) has a MiB or more
    page.select_option("#min-bytes", "0")
    page.uncheck("#grouped")
    assert groups.count() == 0 and tensors.count() == 272
    page.click('#tensors th button[data-key="name"]')
    names = [a.inner_text() for a in page.locator("#tensors tbody tr.t td:nth-child(2) a").all()]
    assert names.index("blk.2.attn_k.weight") < names.index("blk.10.attn_k.weight")  # natural order
    page.click('#tensors th button[data-key="n_bytes"]')
    page.click('#tensors th button[data-key="n_bytes"]')  # descending: the largest first
    assert "token_embd.weight" in tensors.first.inner_text()
    assert page.get_attribute('#tensors th:has(button[data-key="n_bytes"])', "aria-sort") == "descending"
    assert page.locator("#metadata details").count() >= 3  # the tokenizer's arrays, summarised
    page.check("#grouped")
    shot(page, "model")
    assert not page.problems, page.problems


def test_tensor_page_draws_its_histograms_and_compares_schemes(server: str, page: object) -> None:
    base = f"{SMOL}/tensors/blk.0.attn_q.weight"
    page.goto(f"{server}/ui/models/{base}")
    page.wait_for_selector("#values svg")
    page.wait_for_selector("#scales svg")
    assert "Q4_1" in page.locator("#facts").inner_text()
    page.wait_for_selector('#q-table tr[data-scheme="nf4-b64"]')  # small enough to compare without asking
    report = httpx.get(f"{server}/v1/models/{base}/quantization").json()
    shown = page.locator("#q-table tbody tr")
    assert shown.count() == len(report["schemes"]) == 7
    for q in report["schemes"]:
        nmse = page.locator(f'#q-table tr[data-scheme="{q["tag"]}"] .nmse').inner_text()
        assert float(nmse) == pytest.approx(q["nmse"], rel=1e-2, abs=0)
    page.select_option("#q-blocksize", "256")
    page.check("#q-dq")
    page.click("#q-run")
    page.wait_for_selector('#q-table tr[data-scheme="nf4-b256-dq"]')
    assert "no GPU here" in page.locator("#q-status").inner_text()
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


@pytest.mark.parametrize("path", ["/", f"/ui/models/{SMOL}", f"/ui/models/{SMOL}/tensors/blk.0.attn_q.weight",
                                  f"/ui/matmul?model={SMOL}&tensor=blk.0.attn_q.weight", "/ui/kernels"])
def test_every_page_fits_a_phone(server: str, browser: object, path: str) -> None:
    pg = open_page(browser, viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True,
                   device_scale_factor=2)
    try:
        pg.goto(f"{server}{path}")
        pg.wait_for_load_state("networkidle")
        # wide tables scroll inside their own box; the page itself never scrolls sideways
        assert pg.evaluate("document.documentElement.scrollWidth") <= 390
        assert pg.evaluate("[...document.querySelectorAll('main > *, section > *')]"
                           ".every((e) => e.getBoundingClientRect().right <= 390.5)")
        if path.startswith("/ui/models/") and "/tensors/" not in path:
            shot(pg, "model-phone")
        assert not pg.problems, pg.problems
    finally:
        pg.context.close()


def test_keyboard_alone_gets_from_the_model_list_to_a_product(server: str, page: object) -> None:
    page.goto(f"{server}/")
    page.wait_for_selector(f'#models tr[data-model="{SMOL}"]')
    tab_to(page, f'a[href="/ui/models/{SMOL}"]')
    page.keyboard.press("Enter")
    page.wait_for_url(f"**/ui/models/{SMOL}")
    page.wait_for_selector("#tensors tbody tr.t")
    tab_to(page, "#filter")
    page.keyboard.type("attn_v")
    assert page.locator("#tensors tbody tr.t").count() == 30
    tab_to(page, 'button[data-key="name"]')
    page.keyboard.press("Enter")
    assert page.get_attribute('#tensors th:has(button[data-key="name"])', "aria-sort") == "ascending"
    tab_to(page, 'tr.group button[data-layer="1"]')
    page.keyboard.press("Space")  # fold blk.1 from the keyboard; the focus stays on the table
    assert page.locator("#tensors tbody tr.t").count() == 29
    tab_to(page, 'a[href$="/tensors/blk.2.attn_v.weight"]')
    page.keyboard.press("Enter")
    page.wait_for_url("**/tensors/blk.2.attn_v.weight")
    page.wait_for_selector("#values svg")
    tab_to(page, "#try")
    page.keyboard.press("Enter")
    page.wait_for_url("**/ui/matmul?*")
    page.wait_for_selector("#mm-kernels input:checked")
    tab_to(page, "#mm-run")
    page.keyboard.press("Enter")
    page.wait_for_selector("#mm-results tbody tr >> nth=2")  # the reference and the two kernels ticked first
    assert "blk.2.attn_v.weight" in page.locator("#mm-status").inner_text()
    assert not page.problems, page.problems


def test_the_page_asks_for_the_key_and_never_leaks_it(models_dir: Path, browser: object, tmp_path: Path) -> None:
    key, log = "page-key-9f3c2a7d1b", tmp_path / "serve.log"
    with serving(models_dir, log, QGEMM_API_KEY=key, QGEMM_ACCESS_LOG="true") as base:
        pg = open_page(browser, viewport={"width": 1280, "height": 900})
        urls: list[str] = []
        pg.on("request", lambda r: urls.append(r.url))
        try:
            pg.goto(f"{base}/")
            pg.wait_for_selector("#key-form:not([hidden])")
            pg.fill("#api-key", "wrong-key")
            with pg.expect_response(lambda r: "/v1/" in r.url and r.status == 401):
                pg.keyboard.press("Enter")
            pg.wait_for_selector("#key-form:not([hidden])")  # asked again: the wrong key was dropped
            pg.fill("#api-key", key)
            pg.keyboard.press("Enter")
            pg.wait_for_selector(f'#models tr[data-model="{SMOL}"] .mix:not(:empty)')
            assert pg.input_value("#api-key") == ""  # not left in the form either
            pg.click(f'a[href="/ui/models/{SMOL}"]')  # the next page of the same tab has it already
            pg.wait_for_selector("#tensors tbody tr.t")
            assert pg.locator("#key-form").is_hidden()
        finally:
            pg.context.close()
    assert urls and not [u for u in urls if key in u]
    text = log.read_text()
    assert "GET /v1/models" in text and key not in text  # the access log has the requests, not the key
