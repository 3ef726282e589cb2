"""A front process of `qgemm serve` (spawned by app/serving/supervisor.py): uvicorn serving the HTTP app, whose
service is the engine processes (app/serving/front.py)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from app.serving.lifetime import die_with_parent
from app.serving.supervisor import listen
from app.settings import Settings


def run_front(env: dict[str, str], index: int, run_dir: str, instance: str, engine_sockets: list[str],
              listener: socket.socket | None = None) -> None:
    """A front process's main (spawned): this front's settings from `env`, its app's service the engines;
    `listener`: the supervisor's listening socket (a lone front), else one of its own on the shared port."""
    die_with_parent()
    os.environ.update(env)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(Path(run_dir) / "metrics")  # before prometheus_client loads
    import uvicorn

    from app import logs
    from app.edge import bounded_http
    from app.main import create_app
    from app.serving.front import RemoteService

    settings = Settings.from_env()
    service = RemoteService(engine_sockets, Path(run_dir), instance, settings.front_arena_bytes,
                            settings.front_inflight_bytes)
    app = create_app(settings, service=service)
    config = uvicorn.Config(app, loop="uvloop", http=bounded_http(settings.max_request_head_bytes,
                                                                  settings.request_read_timeout_s,
                                                                  settings.max_connections,
                                                                  settings.max_body_bytes, service.body_buffer),
                            log_config=logs.config(settings.log_level, settings.log_format),
                            access_log=settings.access_log, timeout_graceful_shutdown=25)
    uvicorn.Server(config).run(sockets=[listener if listener is not None else listen(settings.host, settings.port)])
