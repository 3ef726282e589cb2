"""The soak (tools/soak.py), CI-sized: a real server under concurrent products, loads and unloads while
its model file is rewritten in place, renamed over, truncated and deleted every two seconds.  It must
end with 0 5xx, 0 reset connections, 0 wrong products and flat memory.  QGEMM_SOAK_SECONDS sets the
length (60 s by default); the 10-minute GPU run is `qgemm soak --backend cuda --clients 32 --seconds 600`
(docs/operations.md)."""

from __future__ import annotations

import os

import pytest

from tools.soak import SoakPlan, passed, soak

SECONDS = float(os.environ.get("QGEMM_SOAK_SECONDS", "60"))


def _soak(backend: str, clients: int) -> None:
    report = soak(SoakPlan(backend=backend, clients=clients, seconds=SECONDS, rewrite_every_s=2.0))
    assert passed(report) == [], report
    assert sum(report["rewrites"].values()) >= min(4, int(SECONDS / 2) - 1), report["rewrites"]
    assert report["answers"].get("matmul 200", 0) > 100, report["answers"]


def test_soak_cpu() -> None:
    _soak("cpu", clients=8)


@pytest.mark.gpu
def test_soak_cuda() -> None:
    _soak("cuda", clients=32)
