"""The web pages: server-rendered shells (Jinja2) whose data comes from the public /v1 API through a small
script (static/qgemm.js), so that everything a page shows a user can also script.  No build step, no CDN:
the template, the script and the style sheet ship in the package."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from kernels.bnb4 import BLOCKSIZES, DEFAULT_BLOCKSIZE

HERE = Path(__file__).parent
# the committed bench figure, in a source checkout
BENCH_PICTURE = HERE.parents[1] / "docs" / "perf" / "benchmarks.png"
templates = Jinja2Templates(directory=HERE / "templates")
router = APIRouter(include_in_schema=False)


def _page(request: Request, name: str, title: str, **context: Any) -> HTMLResponse:
    return templates.TemplateResponse(request, name, {
        "title": title, "needs_key": request.app.state.settings.api_key is not None, **context})


@router.get("/", response_class=HTMLResponse)
def index(request: Request) -> HTMLResponse:
    return _page(request, "index.html", "Models")


@router.get("/ui/models/{model_id}", response_class=HTMLResponse)
def model_page(request: Request, model_id: str) -> HTMLResponse:
    return _page(request, "model.html", model_id, model_id=model_id)


@router.get("/ui/models/{model_id}/tensors/{name}", response_class=HTMLResponse)
def tensor_page(request: Request, model_id: str, name: str) -> HTMLResponse:
    return _page(request, "tensor.html", name, model_id=model_id, tensor=name, blocksizes=BLOCKSIZES,
                 default_blocksize=DEFAULT_BLOCKSIZE)


@router.get("/ui/matmul", response_class=HTMLResponse)
def matmul_page(request: Request) -> HTMLResponse:
    return _page(request, "matmul.html", "Matmul")


@router.get("/ui/kernels", response_class=HTMLResponse)
def kernels_page(request: Request) -> HTMLResponse:
    return _page(request, "kernels.html", "Kernels", has_bench=BENCH_PICTURE.is_file())


@router.get("/ui/bench.png")
def bench_picture() -> Response:
    if not BENCH_PICTURE.is_file():
        return Response(status_code=404)
    return FileResponse(BENCH_PICTURE, media_type="image/png")


def install(app: FastAPI) -> None:
    app.include_router(router)
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")
