"""qgemm on Ray Serve (app/ray_serve.py), on a local Ray cluster with the CPU backend: two replicas both
serve; requests naming a model in `serve_multiplexed_model_id` go to the replica that holds it; a replica
stopped gracefully (scaled down) loses no request; a killed replica fails only what was in flight on it, and
never hangs; Serve brings it back.  Skipped where Ray is not installed (`pip install -e '.[ray]'`); `.ci/run`
installs it and sets QGEMM_TEST_REQUIRE_RAY=1."""

from __future__ import annotations

import concurrent.futures
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

try:
    import ray
    from ray import serve
except ImportError:
    if os.environ.get("QGEMM_TEST_REQUIRE_RAY"):
        raise
    pytest.skip("Ray is not installed (pip install -e '.[ray]')", allow_module_level=True)

SMOL, TENSOR = "SmolLM2-135M-Instruct.Q4_1", "blk.0.attn_q.weight"


def _deploy(models_dir: Path, replicas: int) -> None:
    from app.ray_serve import app

    serve.run(app(num_gpus=0, num_cpus=0.5, num_replicas=replicas,
                  env={"QGEMM_BACKEND": "cpu", "QGEMM_MODELS_DIR": str(models_dir)}), name="qgemm", route_prefix="/")


# Serve kills a proxy that is not ready 5 s after it was started (RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S), and then
# serve.start fails with the proxy's ActorDiedError ("killed by ray.kill ... never ran").  A proxy is a new Python
# process importing Serve and uvicorn: on a loaded 2-core CI host (pytest -n 4) that took longer, and every test
# of the module erred in its fixture.  The cluster's processes inherit these from the driver's environment.
SERVE_TIMEOUTS = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30"}


@pytest.fixture(scope="module")
def cluster(models_dir: Path) -> Iterator[str]:
    saved = {name: os.environ.get(name) for name in SERVE_TIMEOUTS}
    os.environ.update(SERVE_TIMEOUTS)  # before ray.init starts the local cluster's processes
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).parents[1]), **SERVE_TIMEOUTS}})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        _deploy(models_dir, 2)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _post(base: str, x: np.ndarray, model_header: bool = False, timeout: float = 60) -> httpx.Response:
    headers = {"serve_multiplexed_model_id": SMOL} if model_header else {}
    return httpx.post(f"{base}/v1/matmul", json={"model": SMOL, "tensor": TENSOR, "kernel": "ref_q8_1",
                                                  "activations": x.tolist()}, headers=headers, timeout=timeout)


def test_two_replicas_both_serve_the_same_numbers(cluster: str, rng: np.random.Generator) -> None:
    x = rng.standard_normal((2, 576)).astype(np.float32)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: _post(cluster, x), range(40)))
    assert all(r.status_code == 200 for r in answers)
    assert len({r.headers["x-qgemm-replica"] for r in answers}) == 2
    outputs = {tuple(np.asarray(r.json()["output"], np.float32).ravel()) for r in answers}
    assert len(outputs) == 1  # either replica: the same product, bit for bit
    health = httpx.get(f"{cluster}/healthz").json()
    assert health["backend"] == "cpu" and health["devices"][0]["device"] == "cpu:0"


def test_requests_for_a_model_go_to_the_replica_that_holds_it(cluster: str, rng: np.random.Generator) -> None:
    x = rng.standard_normal((1, 576)).astype(np.float32)
    first = _post(cluster, x, model_header=True)
    assert first.status_code == 200
    time.sleep(3)  # the replica reports the models it holds to Serve's routers
    later = [_post(cluster, x, model_header=True) for _ in range(12)]
    assert {r.headers["x-qgemm-replica"] for r in later} == {first.headers["x-qgemm-replica"]}
    missing = httpx.get(f"{cluster}/v1/models/nope", headers={"serve_multiplexed_model_id": "nope"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def _under_load(base: str, x: np.ndarray, action: Callable[[], None], streams: int = 4) -> dict[int | str, int]:
    """Run `action` while `streams` clients post products back to back; the statuses they got, counted (an
    exception's name for a request that never got one: a timeout is a hang)."""
    stop, statuses = threading.Event(), []

    def stream() -> None:
        while not stop.is_set():
            try:
                statuses.append(_post(base, x, timeout=30).status_code)
            except httpx.HTTPError as exc:
                statuses.append(type(exc).__name__)

    threads = [threading.Thread(target=stream) for _ in range(streams)]
    for t in threads:
        t.start()
    try:
        time.sleep(1)
        action()
    finally:
        stop.set()
        for t in threads:
            t.join()
    return {s: statuses.count(s) for s in set(statuses)}


def test_a_replica_stopped_gracefully_loses_no_request(cluster: str, models_dir: Path,
                                                       rng: np.random.Generator) -> None:
    x = rng.standard_normal((1, 576)).astype(np.float32)

    def scale_down() -> None:
        _deploy(models_dir, 1)  # Serve drains the replica it stops
        time.sleep(2)

    counts = _under_load(cluster, x, scale_down)
    print("statuses while a replica was stopped gracefully:", counts)
    assert counts and set(counts) == {200}, counts
    replicas = {_post(cluster, x).headers["x-qgemm-replica"] for _ in range(8)}
    assert len(replicas) == 1
    _deploy(models_dir, 2)  # back to two for what follows


def test_a_killed_replica_fails_cleanly_and_the_service_recovers(cluster: str, rng: np.random.Generator) -> None:
    x = rng.standard_normal((1, 576)).astype(np.float32)

    def kill_one() -> None:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].startswith("SERVE_REPLICA::qgemm")]
        ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
        time.sleep(3)

    counts = _under_load(cluster, x, kill_one)
    print("statuses while a replica was killed:", counts)
    # Serve marks the dead replica and routes around it; only what was in flight on it (at most one request per
    # stream) fails, with the proxy's own 500 (it maps a RayActorError to 500; a 503 would need our own proxy).
    # Never a timeout or a reset.
    assert set(counts) <= {200, 500, 503}, counts
    assert sum(counts.values()) - counts.get(200, 0) <= 4, counts
    deadline = time.time() + 60  # Serve replaces the replica: both answer again
    while time.time() < deadline:
        if len({_post(cluster, x).headers["x-qgemm-replica"] for _ in range(10)}) == 2:
            break
        time.sleep(1)
    else:
        pytest.fail("Serve did not bring the killed replica back in 60 s")


def test_the_shipped_serve_config_is_valid() -> None:
    """app/ray_serve.yaml (for `serve run`) passes Serve's own schema and builds the application it names."""
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from app.ray_serve import app

    config = yaml.safe_load((Path(__file__).parents[1] / "app" / "ray_serve.yaml").read_text())
    schema = ServeDeploySchema.model_validate(config) if hasattr(ServeDeploySchema, "model_validate") \
        else ServeDeploySchema.parse_obj(config)
    entry = schema.applications[0]
    assert entry.import_path == "app.ray_serve:app" and entry.deployments[0].name == "Qgemm"
    assert app(entry.args) is not None
    with pytest.raises(ValueError, match="unknown options"):
        app({"replicas": 2})
