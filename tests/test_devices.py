"""Several devices on one host, on the CPU: the placement arithmetic (app/placement.py), and the whole service
with QGEMM_CPU_DEVICES=2 "fake devices" (two CPU workers, each its own thread, cache budget and batching):
tensors placed at first use on the device with the most free budget, or split across both when none holds
them; POST .../load replicating or splitting; requests routed to a device that holds their tensor; a split
product equal to the unsplit one; per-device state in /healthz, /v1/models/{id} and /metrics."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from app.placement import Part, Placement, Placements, first_use, requested, split_rows
from kernels.cpu import CpuBackend
from kernels.devices import parse_devices
from kernels.registry import KERNELS
from kernels.types import Weights
from models.store import ModelStore
from tests.conftest import make_client

SMOL = "SmolLM2-135M-Instruct.Q4_1"


# -- the arithmetic --------------------------------------------------------------------------------------------
def test_split_rows_cuts_on_tiles_in_proportion() -> None:
    assert split_rows(4096, [0, 1]) == (Part(0, 0, 2048), Part(1, 2048, 4096))
    assert split_rows(28672, [0, 1], [3, 1]) == (Part(0, 0, 21504), Part(1, 21504, 28672))
    parts = split_rows(1000, [2, 0, 1])  # any order of devices; cuts on multiples of 128
    assert [p.device for p in parts] == [2, 0, 1] and [p.start for p in parts] == [0, 384, 640]
    assert parts[-1].stop == 1000 and all(p.rows > 0 for p in parts)
    assert split_rows(100, [0, 1]) == (Part(1, 0, 100),)  # too few rows for two tiles: one block
    with pytest.raises(ValueError):
        split_rows(10, [])


def test_first_use_takes_the_most_free_device_and_splits_what_fits_none() -> None:
    assert first_use(512, 100, [1000, 1000], [900, 950]).replicas == [(Part(1, 0, 512),)]
    assert first_use(512, 100, [1000, 1000], [950, 950]).replicas == [(Part(0, 0, 512),)]  # equals: lowest
    too_big = first_use(4096, 1500, [1000, 1000], [1000, 1000])
    assert too_big.split and too_big.replicas == [(Part(0, 0, 2048), Part(1, 2048, 4096))]
    assert first_use(512, 10**9, [1000], [1000]).replicas == [(Part(0, 0, 512),)]  # one device: it tries
    assert requested(512, [1, 0], "replicate").replicas == [(Part(1, 0, 512),), (Part(0, 0, 512),)]
    assert requested(512, [1], "split").how == "single"


def test_routing_takes_the_least_loaded_replica_in_turn() -> None:
    table = Placements()
    both = Placement([(Part(0, 0, 8),), (Part(1, 0, 8),)], "replicate", 8)
    load = {0: 3, 1: 0}
    assert {table.pick(both, load.get)[0].device for _ in range(6)} == {1}
    load = {0: 0, 1: 0}
    assert {table.pick(both, load.get)[0].device for _ in range(6)} == {0, 1}  # equals: in turn


def test_qgemm_devices_names_ordinals() -> None:
    assert parse_devices(None, 2) == [0, 1] and parse_devices("all", 3) == [0, 1, 2]
    assert parse_devices(" 1, 0 ", 2) == [1, 0]
    for bad in ("2", "0,0", "x", ","):
        with pytest.raises(RuntimeError, match="QGEMM_DEVICES"):
            parse_devices(bad, 2)


# -- the service on two fake devices ---------------------------------------------------------------------------
def _product(c: TestClient, tensor: str, x: np.ndarray, kernel: str = "ref_q8_1", **extra: object) -> dict:
    r = c.post("/v1/matmul", json={"model": SMOL, "tensor": tensor, "kernel": kernel, "activations": x.tolist(),
                                   **extra})
    assert r.status_code == 200, r.text
    return r.json()


@cache
def _whole(models_dir: Path, tensor: str) -> tuple[CpuBackend, Weights]:
    model = next(m for m in ModelStore(models_dir).scan() if m.id == SMOL)
    info = model.tensors[tensor]
    return CpuBackend(1 << 30), Weights((model.version_key, tensor), info.type_name, *info.shape,
                                        lambda: model.raw(tensor))


def _alone(models_dir: Path, tensor: str, x: np.ndarray, kernel: str) -> np.ndarray:
    """The product on the whole tensor by the CPU backend itself (no service, no devices)."""
    cpu, w = _whole(models_dir, tensor)
    return cpu.run(KERNELS[kernel], w, x).output


@pytest.fixture(scope="module")
def two(models_dir: Path) -> Iterator[TestClient]:
    """The service on two fake devices; each test uses tensors of its own (placements are per tensor)."""
    with make_client(models_dir, cpu_devices=2) as c:
        yield c


def test_two_devices_place_route_and_report(models_dir: Path, rng: np.random.Generator) -> None:
    with make_client(models_dir, cpu_devices=2) as c:  # its own: it counts every product
        health = c.get("/healthz").json()
        assert [d["device"] for d in health["devices"]] == ["cpu:0", "cpu:1"]
        x = rng.standard_normal((3, 576)).astype(np.float32)
        a = _product(c, "blk.0.attn_q.weight", x)
        b = _product(c, "blk.0.attn_k.weight", x)
        assert a["devices"] == ["cpu:0"] and b["devices"] == ["cpu:1"]  # the second goes where more is free
        assert _product(c, "blk.0.attn_q.weight", x)["devices"] == ["cpu:0"]  # and stays where it was put
        resident = c.get(f"/v1/models/{SMOL}").json()["resident"]
        where = {p["tensor"]: p for p in resident["placements"]}
        assert where["blk.0.attn_k.weight"]["how"] == "first use"
        assert where["blk.0.attn_k.weight"]["replicas"] == [[{"device": "cpu:1", "rows": [0, 192]}]]
        assert {(t["tensor"], t["device"]) for t in resident["tensors"]} == {
            ("blk.0.attn_q.weight", "cpu:0"), ("blk.0.attn_k.weight", "cpu:1")}
        states = {d["device"]: d for d in c.get("/healthz").json()["devices"]}
        assert states["cpu:0"]["products"] == 2 and states["cpu:1"]["products"] == 1
        assert states["cpu:1"]["resident_bytes"] > 0
        metrics = c.get("/metrics").text
        assert 'qgemm_device_products_total{device="cpu:1"} 1.0' in metrics
        assert 'qgemm_device_queue_depth{device="cpu:0"} 0.0' in metrics


def test_a_split_tensor_equals_the_unsplit_product(two: TestClient, models_dir: Path,
                                                   rng: np.random.Generator) -> None:
    name, x = "blk.3.ffn_down.weight", rng.standard_normal((5, 1536)).astype(np.float32)
    c = two
    r = c.post(f"/v1/models/{SMOL}/load", json={"tensors": [name], "devices": [0, 1], "placement": "split",
                                                 "kernel": "ref_q8_1"})
    assert r.status_code == 200, r.text
    loaded = r.json()["loaded"]
    assert [(t["device"], t["layout"].split("@")[1]) for t in loaded] == [("cpu:0", "rows0-256"),
                                                                          ("cpu:1", "rows256-576")]
    for kernel in ("ref_q8_1", "ref_mmq", "ref_f32", "auto"):
        got = _product(c, name, x, kernel)
        assert got["devices"] == ["cpu:0", "cpu:1"] and got["shape"] == [5, 576]
        ran = got["kernel"]
        np.testing.assert_array_equal(np.asarray(got["output"], np.float32), _alone(models_dir, name, x, ran))
    assert _product(c, name, x, weight_format="q4_0")["devices"] == ["cpu:0"]  # each format has its own place
    r = c.post(f"/v1/models/{SMOL}/load", json={"tensors": [name], "devices": [1, 0], "placement": "split",
                                                 "weight_format": "q4_0"})
    assert r.status_code == 200
    assert _product(c, name, x, weight_format="q4_0")["devices"] == ["cpu:1", "cpu:0"]


def test_a_tensor_no_budget_holds_is_split_at_first_use(models_dir: Path, rng: np.random.Generator) -> None:
    name, x = "blk.0.ffn_gate.weight", rng.standard_normal((2, 576)).astype(np.float32)  # [1536, 576] Q4_1
    with make_client(models_dir, cpu_devices=2, cpu_cache_bytes=400_000) as c:  # 540 KiB on neither
        got = _product(c, name, x)
        assert got["devices"] == ["cpu:0", "cpu:1"]
        np.testing.assert_array_equal(np.asarray(got["output"], np.float32), _alone(models_dir, name, x, "ref_q8_1"))
        placed = c.get(f"/v1/models/{SMOL}").json()["resident"]["placements"]
        assert placed[0]["replicas"] == [[{"device": "cpu:0", "rows": [0, 768]}, {"device": "cpu:1",
                                                                                  "rows": [768, 1536]}]]


def test_a_replicated_tensor_is_served_by_both(two: TestClient, models_dir: Path,
                                               rng: np.random.Generator) -> None:
    name = "blk.1.attn_output.weight"
    c = two
    r = c.post(f"/v1/models/{SMOL}/load", json={"tensors": [name], "devices": [1, 0]})
    assert r.status_code == 200 and {t["device"] for t in r.json()["loaded"]} == {"cpu:0", "cpu:1"}
    xs = [rng.standard_normal((1 + i % 3, 576)).astype(np.float32) for i in range(12)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda x: _product(c, name, x), xs))
    assert {a["devices"][0] for a in answers} == {"cpu:0", "cpu:1"}
    for x, a in zip(xs, answers, strict=True):  # either copy gives the same numbers
        np.testing.assert_array_equal(np.asarray(a["output"], np.float32), _alone(models_dir, name, x, "ref_q8_1"))
    freed = c.post(f"/v1/models/{SMOL}/unload", json={"tensors": [name]}).json()
    assert freed["freed_bytes"] > 0 and name not in {p["tensor"] for p in freed["resident"]["placements"]}


@pytest.mark.parametrize("body,status,code", [
    ({"devices": [2]}, 422, "bad_device"),
    ({"devices": [0, 0]}, 422, "bad_device"),
    ({"devices": [0, 1], "placement": "split", "weight_format": "nf4", "double_quant": True}, 422, "cannot_split"),
    ({"devices": [0, 1], "placement": "split", "weight_format": "nf4", "blocksize": 4096}, 422, "cannot_split"),
    ({"devices": [0, 1], "placement": "scatter"}, 400, "bad_request"),
    ({"devices": [-1]}, 400, "bad_request"),
])
def test_load_errors(two: TestClient, body: dict, status: int, code: str) -> None:
    c = two
    r = c.post(f"/v1/models/{SMOL}/load", json={"tensors": ["blk.0.attn_q.weight"], **body})
    assert r.status_code == status and r.json()["error"]["code"] == code, r.text
    assert c.get("/healthz").status_code == 200


def test_one_cpu_device_has_nothing_to_load(client: TestClient) -> None:
    r = client.post(f"/v1/models/{SMOL}/load")
    assert r.status_code == 409 and r.json()["error"]["code"] == "no_gpu"
