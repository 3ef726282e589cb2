"""qgemm on Ray Serve: the same app, one replica per GPU across a Ray cluster.

Ray Serve does the cluster work: it places replicas (one GPU each: Ray sets CUDA_VISIBLE_DEVICES, so a
replica's engine sees its one device), routes HTTP requests to them, scales them between
`min_replicas` and `max_replicas` by ongoing requests, drains a replica it stops.  Requests for a
model go to replicas that already hold its weights through Serve's model multiplexing: a client sends
the model id in the `serve_multiplexed_model_id` header; the replica's multiplexed loader puts that
model's matrices on its GPU (the same preload as POST /v1/models/{id}/load) and Serve routes later
requests with that id to replicas that report it loaded; the least recently used model of a replica
beyond QGEMM_RAY_MODELS_PER_REPLICA is unloaded.

Run it with `qgemm serve --ray` (starts or joins a Ray cluster), or with Serve's own CLI and the config
shipped beside this module: `serve run app/ray_serve.yaml` (docs/serving.md: several GPUs and Ray Serve).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
from ray import serve
from ray.serve import Application
from starlette.types import ASGIApp, Receive, Scope, Send

from app.main import create_app
from app.settings import Settings

log = logging.getLogger("qgemm")
MODELS_PER_REPLICA = int(os.environ.get("QGEMM_RAY_MODELS_PER_REPLICA", "4"))
_app: FastAPI | None = None  # this replica's app (each replica is its own process)


class Held:
    """A model a replica holds for Serve's multiplexing; dropping it (LRU) frees its GPU weights."""

    def __init__(self, app: FastAPI, model_id: str):
        self.app, self.model_id = app, model_id

    def __del__(self) -> None:
        try:
            store, engine = self.app.state.store, self.app.state.engine
            model = next((m for m in store.scan() if m.id == self.model_id and m.status == "ok"), None)
            if model is not None:
                engine.unload(model, None)
        except Exception:  # shutting down, or the model went: nothing left to free
            pass


@serve.multiplexed(max_num_models_per_replica=MODELS_PER_REPLICA)
async def hold(model_id: str) -> Held:
    """Put a model's matrices on this replica's GPU (nothing to do on the CPU backend).  A model that is
    missing or broken is held as it is: the request itself then gets the API's 404 or 409."""
    assert _app is not None
    engine = _app.state.engine
    if engine.gpu is not None:
        model = next((m for m in _app.state.store.scan() if m.id == model_id and m.status == "ok"), None)
        if model is not None:
            infos = [t for t in model.tensors.values() if t.matmul]
            try:
                await run_in_threadpool(engine.preload, model, infos, None)
            except Exception as exc:  # over the GPU budget: the requests upload what they use
                log.warning("replica could not preload %s: %s", model_id, exc)
    return Held(_app, model_id)


class Multiplexed:
    """ASGI middleware: a request naming a model in `serve_multiplexed_model_id` has it held first, and every
    answer says which replica gave it (X-Qgemm-Replica)."""

    def __init__(self, app: ASGIApp):
        self.app = app
        self.replica = serve.get_replica_context().replica_id.unique_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        model_id = serve.get_multiplexed_model_id()
        if model_id:
            await hold(model_id)
        replica = self.replica.encode()

        async def tagged(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-qgemm-replica", replica)]
            await send(message)

        await self.app(scope, receive, tagged)


def build_asgi() -> FastAPI:
    """Built on each replica (Serve calls it there): the app from the replica's QGEMM_* environment."""
    global _app
    _app = create_app(Settings.from_env())
    build = _app.build_middleware_stack  # Multiplexed outside everything, POST /v1/matmul's short way in too
    _app.build_middleware_stack = lambda: Multiplexed(build())  # type: ignore[method-assign]
    return _app


@serve.deployment(
    ray_actor_options={"num_gpus": 1},  # one GPU per replica; `app(num_gpus=0)` for the CPU backend
    autoscaling_config={"min_replicas": 1, "max_replicas": 8, "target_ongoing_requests": 32},
    max_ongoing_requests=256,  # the replica's own batching queues the rest: let them reach it
    graceful_shutdown_wait_loop_s=0.5, graceful_shutdown_timeout_s=30,
    health_check_period_s=5,
)
@serve.ingress(build_asgi)
class Qgemm:
    """A replica: the qgemm app (engine, batching, weights) of one GPU."""

    async def check_health(self) -> None:
        """Serve's health check: the engine answers (a replica whose GPU worker died is replaced).  Serve asks
        once before the app's start-up has built the engine: nothing to check yet."""
        engine = getattr(_app.state, "engine", None) if _app is not None else None
        for worker in engine.workers if engine is not None else []:
            worker.memory()


def app(args: dict[str, Any] | None = None, **options: Any) -> Application:
    """The application, for `serve run app.ray_serve:app` (args from the config) or serve.run; `options`
    (or args) override the deployment's: num_replicas, num_gpus, autoscaling_config, env (QGEMM_* for the
    replicas)."""
    opts = {**(args or {}), **options}
    deployment_opts: dict[str, Any] = {}
    actor = {"num_gpus": float(opts.pop("num_gpus", 1))}
    if "num_cpus" in opts:
        actor["num_cpus"] = float(opts.pop("num_cpus"))
    env = {k: str(v) for k, v in (opts.pop("env", None) or {}).items()}
    if env:
        actor["runtime_env"] = {"env_vars": env}
    deployment_opts["ray_actor_options"] = actor
    if "num_replicas" in opts:
        deployment_opts["num_replicas"] = int(opts.pop("num_replicas"))
        deployment_opts["autoscaling_config"] = None
    if "autoscaling_config" in opts:
        deployment_opts["autoscaling_config"] = opts.pop("autoscaling_config")
    if opts:
        raise ValueError(f"unknown options: {', '.join(opts)}")
    return Qgemm.options(**deployment_opts).bind()
