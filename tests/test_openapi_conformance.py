"""Schemathesis against the app: every operation of /openapi.json, all checks, stateful links too.

The app runs on the CPU backend over the test models directory (demo, SmolLM2 and the broken files),
once without and once with an API key, in process; and once through `qgemm serve` with a front and engine
processes, over HTTP, so that a difference between the deployments fails here too.  Schemathesis draws from
this run's seed (QGEMM_TEST_SEED, printed in the summary), so a failure replays.  QGEMM_SCHEMATHESIS_EXAMPLES
sets the examples per operation (default 25), QGEMM_SCHEMATHESIS_STEPS the stateful run's steps.  The settings
are the repository's schemathesis.toml, so `st run http://127.0.0.1:8000/openapi.json --checks all` against a
live server runs the same (docs/api.md, "API conformance"); tests/schemathesis_hooks.py says what its hooks
supply and why.
"""

from __future__ import annotations

import os
import tempfile
import tomllib
from pathlib import Path

import hypothesis
import pytest

schemathesis = pytest.importorskip("schemathesis")  # a test extra: skipped where only the GPU tests' packages are

from app.main import create_app  # noqa: E402
from app.settings import Settings  # noqa: E402
from tests import schemathesis_hooks  # noqa: E402
from tests.conftest import RUN_DIR, RUN_SEED, find_real_models_dir, populate_models_dir  # noqa: E402
from tests.live import Server  # noqa: E402

EXAMPLES = int(os.environ.get("QGEMM_SCHEMATHESIS_EXAMPLES", "25"))
STEPS = int(os.environ.get("QGEMM_SCHEMATHESIS_STEPS", "40"))
API_KEY = "schemathesis-key"
SETTINGS = tomllib.loads((Path(__file__).parent.parent / "schemathesis.toml").read_text())

# made at import, where the schemas below need it (not a fixture), in the run's scratch directory: each copy holds
# a truncated demo model, hundreds of MB
MODELS_DIR = populate_models_dir(Path(tempfile.mkdtemp(prefix="schemathesis-models-", dir=RUN_DIR)),
                                 find_real_models_dir())
schemathesis_hooks.use_models_dir(MODELS_DIR)


def run_config(api_key: str | None, examples: int) -> schemathesis.Config:
    return schemathesis.Config.from_dict({
        **SETTINGS,
        **({"auth": {"openapi": {"bearer": {"bearer": api_key}}}} if api_key else {}),
        "seed": RUN_SEED,
        "generation": {"max-examples": examples, "database": "none"},
        "phases": {"stateful": {"max-steps": STEPS}},
    })


def api_schema(api_key: str | None, examples: int) -> schemathesis.BaseSchema:
    """Built at import, as schemathesis' pytest plugin wants (its lazy fixture loader fails under pytest 9)."""
    app = create_app(Settings(models_dir=MODELS_DIR, backend="cpu", api_key=api_key))
    return schemathesis.openapi.from_asgi("/openapi.json", app, config=run_config(api_key, examples))


schema = api_schema(None, EXAMPLES)
keyed_schema = api_schema(API_KEY, max(EXAMPLES // 3, 5))


@schema.parametrize()
def test_every_operation_conforms(case: schemathesis.Case) -> None:
    case.call_and_validate()


@keyed_schema.parametrize()
def test_every_operation_conforms_with_an_api_key(case: schemathesis.Case) -> None:
    """QGEMM_API_KEY set: the document adds the bearer scheme and a 401 to every /v1 route, and
    schemathesis' ignored_auth check sends requests without the key."""
    case.call_and_validate()


def test_stateful_links() -> None:
    schema.as_state_machine().run()


def test_every_operation_conforms_through_the_fronts() -> None:
    """The same checks, drawn across every operation, against `qgemm serve` with a front and an engine process
    over the same models (the hooks' names hold there too), then its stateful links.  One CPU device, as in
    process: with two, `load` prepares every tensor of a model on each engine, seconds on a CPU (the API tests
    walk two engines)."""
    server = Server(MODELS_DIR, fronts=1, QGEMM_BACKEND="cpu").start()
    try:
        live = schemathesis.openapi.from_url(f"{server.url}/openapi.json", config=run_config(None, EXAMPLES))

        @hypothesis.seed(RUN_SEED)
        @hypothesis.settings(max_examples=EXAMPLES * 6, deadline=None, database=None,
                             suppress_health_check=list(hypothesis.HealthCheck),
                             phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate])  # report, not shrink
        @hypothesis.given(case=live.as_strategy())
        def conforms(case: schemathesis.Case) -> None:
            case.call_and_validate()

        conforms()
        live.as_state_machine().run()
    finally:
        server.stop()


def _document(api_key: str | None) -> dict:
    from fastapi.testclient import TestClient

    with TestClient(create_app(Settings(models_dir=MODELS_DIR, backend="cpu", api_key=api_key))) as c:
        return c.get("/openapi.json").json()


def test_every_error_entry_is_the_error_model_and_fastapis_422_is_gone() -> None:
    doc = _document(None)
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            statuses = set(op["responses"])
            assert {"200", "400", "413"} <= statuses, (method, path)
            assert "401" not in statuses and "security" not in op
            for status, entry in op["responses"].items():
                if status != "200":
                    ref = entry["content"]["application/json"]["schema"]["$ref"]
                    assert ref.endswith("/ErrorResponse") and entry["description"], (method, path, status)
    matmul = doc["paths"]["/v1/matmul"]["post"]
    assert {"404", "415", "422", "503"} <= set(matmul["responses"])
    assert set(matmul["requestBody"]["content"]) == {"application/json", "application/x-npy",
                                                     "application/octet-stream"}
    assert {p["name"]: p["schema"].get("examples") for p in matmul["parameters"]}["tensor"] == ["tiny.q4_0.weight"]


def test_a_key_adds_the_bearer_scheme_and_401_to_every_v1_route() -> None:
    doc = _document(API_KEY)
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    for path, ops in doc["paths"].items():
        for op in ops.values():
            assert ("401" in op["responses"]) == path.startswith("/v1/")
            assert ("security" in op) == path.startswith("/v1/")
