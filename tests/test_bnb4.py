"""bitsandbytes' NF4/FP4 on the CPU: the reference's code books, trees, packing and double quantization; the
requantization schemes; `weight_format` over the API and the side-by-side quantization report (route and CLI).
The bit-for-bit check against bitsandbytes itself runs on the GPU machine (tests/test_gpu_bnb4.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from app import cli
from kernels import bnb4
from kernels.requant import Scheme, compare, default_schemes, requantize
from tests.conftest import make_client

SMOL_ID = "SmolLM2-135M-Instruct.Q4_1"


def test_code_books_are_bitsandbytes_tables() -> None:
    assert bnb4.NF4_CODE[0] == -1 and bnb4.NF4_CODE[7] == 0 and bnb4.NF4_CODE[15] == 1
    assert np.all(np.diff(bnb4.NF4_CODE) > 0)
    # FP4: bit-pattern order, E2M1 with bias 2 over its max 12
    np.testing.assert_array_equal(bnb4.FP4_CODE[:8] * np.float32(12), [0, 0.0625, 8, 12, 4, 6, 2, 3])
    np.testing.assert_array_equal(bnb4.FP4_CODE[8:], -bnb4.FP4_CODE[:8])
    assert bnb4.DYNAMIC_CODE.size == 256 and np.all(np.diff(bnb4.DYNAMIC_CODE) >= 0)
    assert bnb4.DYNAMIC_CODE[-1] == 1 and 0 in bnb4.DYNAMIC_CODE


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_trees_round_to_the_nearest_code(rng: np.random.Generator, quant_type: str) -> None:
    """The trees' thresholds sit between neighbouring codes: every scaled value gets a nearest code (ties aside),
    and every code value maps to itself."""
    code = bnb4.CODES[quant_type]
    x = rng.uniform(-1, 1, 20000).astype(np.float32)
    got = code[bnb4.encode(x, quant_type)]
    best = np.min(np.abs(x[:, None] - code[None, :]), axis=1)
    assert np.all(np.abs(got - x) <= best + 1e-4)  # the literals are midpoints to 7 digits
    np.testing.assert_array_equal(code[bnb4.encode(code, quant_type)], code)


def test_packing_order_zero_blocks_and_blocks_over_rows() -> None:
    w = np.zeros((2, 96), np.float32)
    w[0, 0], w[0, 1] = 1.0, -1.0  # first value in the high nibble
    t = bnb4.quantize_4bit(w, "nf4", 64)
    assert t.packed[0] == (15 << 4) | 0
    assert t.absmax.tolist() == [1.0, 0.0, 0.0]  # 192 values: blocks of 64 run across the row boundary
    assert set(t.codes()[64:].tolist()) == {0}  # absmax 0: x * inf = NaN, which exceeds no threshold
    assert not np.any(bnb4.dequantize_4bit(t)[:, 2:])


def test_rcp_approx_is_the_fast_math_reciprocal(rng: np.random.Generator) -> None:
    """bitsandbytes' 1.0f / absmax under --use_fast_math: within an ulp of the rounded reciprocal, scaling with the
    exponent, flushing subnormals; where x / absmax sits on an FP4 threshold, that ulp picks the code."""
    x = rng.uniform(1e-3, 1e3, 100000).astype(np.float32)
    r, rn = bnb4.rcp_approx(x), (np.float32(1) / x).astype(np.float32)
    ulps = r.view(np.int32) - rn.view(np.int32)
    assert set(np.unique(ulps).tolist()) <= {-1, 0, 1} and 0.05 < np.mean(ulps != 0) < 0.2
    np.testing.assert_array_equal(bnb4.rcp_approx(x * np.float32(2.0**20)), r * np.float32(2.0**-20))
    special = bnb4.rcp_approx(np.array([0, -0.0, 1e-40, np.inf, 1e38, 2.0, np.nan], np.float32))
    assert special[:3].tolist() == [np.inf, -np.inf, np.inf] and special[3:6].tolist() == [0, 0, 0.5]
    assert np.isnan(special[6])
    # seen on the H100 against bitsandbytes 0.50.2 (SmolLM2's Q4_1 weights): x / absmax exactly 5/24 and -7/24
    for absmax, value, code in [(0.474609375, 0.098876953125, 0b0111), (0.515625, -0.150390625, 0b1111)]:
        w = np.zeros((1, 64), np.float32)
        w[0, :2] = absmax, value
        assert bnb4.quantize_4bit(w, "fp4", 64).codes()[1] == code


NEAR_THRESHOLDS = Path(__file__).parent / "data" / "bnb4_codes_near_thresholds_h100.npz"


def test_float_literal_rounds_once() -> None:
    """nvcc rounds a float literal's decimal straight to float32; via float64 it lands an ulp off next to a tie."""
    assert bnb4.float_literal("0.8614784181118011") == np.float32(float.fromhex("0x1.b913b2p-1"))
    assert np.float32(0.8614784181118011) == np.float32(float.fromhex("0x1.b913b4p-1"))  # rounded twice
    assert bnb4.float_literal("0.1") == np.float32(0.1) and bnb4.float_literal("-2.5") == np.float32(-2.5)
    # a decimal exactly halfway between two float32 values goes to the even one
    assert bnb4.float_literal("1.000000059604644775390625") == np.float32(1)
    assert bnb4.float_literal("1.000000178813934326171875") == np.float32(1 + 2.0**-22)


def test_codes_next_to_each_threshold_are_bitsandbytes() -> None:
    """Values whose x * (1 / absmax) lies within 4 ulps of an NF4 or FP4 threshold, and bitsandbytes 0.50.2's codes
    for them (an H100, 2026-11-25: 630 M Gaussian values each for NF4 at blocksizes 64 and 256 and FP4 at 64).  With
    the thresholds rounded twice, 39 of the 2,655 NF4 codes missed."""
    captured = np.load(NEAR_THRESHOLDS)
    for tag in ("nf4_64", "nf4_256", "fp4_64"):
        x, absmax, theirs = captured[f"x_{tag}"], captured[f"absmax_{tag}"], captured[f"bnb_{tag}"]
        scaled = bnb4._flush((x * bnb4.rcp_approx(absmax)).astype(np.float32))
        assert len(x) > 1000
        np.testing.assert_array_equal(bnb4.encode(scaled, tag[:3]), theirs, err_msg=tag)


TORCH_MEANS = Path(__file__).parent / "data" / "torch_means_h100.npz"


def test_torch_mean_is_torchs_on_the_h100() -> None:
    """torch_mean_f32 against torch.mean of float32 vectors on an H100 (torch 2.11, 2026-11-25; each array's last
    value is torch's result): 7 to 262,144 values, odd tails, one block, several CTAs.  The exact mean rounded,
    or a plain float32 sum, misses some of them: the order of additions is what is checked."""
    captured = np.load(TORCH_MEANS)
    exact_misses = sequential_misses = 0
    for name in captured.files:
        x, theirs = captured[name][:-1], captured[name][-1:].view(np.uint32)
        assert np.float32(bnb4.torch_mean_f32(x)).reshape(1).view(np.uint32) == theirs, name
        exact = np.float32(x.astype(np.float64).mean())
        sequential = np.float32(np.cumsum(x, dtype=np.float32)[-1] * (np.float32(1) / np.float32(x.size)))
        exact_misses += exact.reshape(1).view(np.uint32)[0] != theirs[0]
        sequential_misses += sequential.reshape(1).view(np.uint32)[0] != theirs[0]
    assert exact_misses >= 2 and sequential_misses >= 4  # the data tells the orders apart


def test_torch_mean_is_torchs_around_the_vector_boundary() -> None:
    """torch_mean_f32 against torch.mean at 1 to 140, 250 to 260 and 500 to 520 values (3 vectors each, an H100,
    2026-11-26), where the thread count and the loads change, and one vector of 128 values from an H200 whose mean
    showed that 128 values already take float4 loads (the two orders gave the same mean on every H100 vector)."""
    d = np.load(Path(__file__).parent / "data" / "torch_means_small.npz")
    starts = np.concatenate([[0], np.cumsum(d["n"])])
    for i, (n, theirs) in enumerate(zip(d["n"], d["mean"], strict=True)):
        x = d["x"][starts[i]:starts[i + 1]]
        where = str(d["devices"][d["device"][i]])
        assert bnb4.torch_mean_f32(x).view(np.uint32) == theirs.view(np.uint32), (int(n), where)


def test_torch_mean_edges() -> None:
    """No value, one value, the unvectorized sizes (below 128), and vectors split over CTAs by the SM count: each
    within a few ulps of the exact mean (their exact order is test_torch_mean_is_torchs_on_the_h100's)."""
    assert bnb4.torch_mean_f32(np.array([3.0], np.float32)) == np.float32(3.0)
    assert np.isnan(bnb4.torch_mean_f32(np.array([], np.float32)))  # as torch.mean of an empty tensor
    x = np.arange(1, 129, dtype=np.float32) / np.float32(7)
    for n in (2, 3, 64, 127, 128, 129, 131):  # float32 sums of up to 131 values: a few ulps of the exact mean
        exact = np.resize(x, n).astype(np.float64).mean()
        assert abs(float(bnb4.torch_mean_f32(np.resize(x, n))) - exact) <= 4 * np.spacing(np.float32(exact)), n
    big = np.random.default_rng(1).uniform(0.01, 1, 5_000_000).astype(np.float32)
    for sm_count in (108, 132):  # past 32,768 values an SM the CTA count follows the SMs: 432 and 528 CTAs here
        exact = big.astype(np.float64).mean()
        assert abs(float(bnb4.torch_mean_f32(big, sm_count)) - exact) <= 4 * np.spacing(np.float32(exact))


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("blocksize", [32, 64, 4096])
def test_round_trip_error_and_double_quantization(rng: np.random.Generator, quant_type: str, blocksize: int) -> None:
    w = (rng.standard_normal((33, 4160)) * rng.uniform(0.01, 2)).astype(np.float32)
    plain = bnb4.quantize_4bit(w, quant_type, blocksize)
    nested = bnb4.quantize_4bit(w, quant_type, blocksize, double_quant=True)
    np.testing.assert_array_equal(plain.packed, nested.packed)  # the codes do not depend on how absmax is stored
    rel = np.abs(nested.scales - plain.absmax) / plain.absmax
    assert rel.max() < 0.02  # 8-bit dynamic codes of absmax - mean
    for t in (plain, nested):
        err = float(((bnb4.dequantize_4bit(t) - w) ** 2).sum() / (w**2).sum())
        assert err < (0.016 if quant_type == "nf4" else 0.03)  # Gaussian values, 137k of them: stable figures
    assert nested.bits_per_weight < plain.bits_per_weight == 4 + 32 * plain.absmax.size / w.size


def test_gemv_reference_semantics(rng: np.random.Generator) -> None:
    w = (rng.standard_normal((40, 512)) * 0.05).astype(np.float32)
    t = bnb4.quantize_4bit(w, "nf4")
    x = rng.standard_normal((3, 512)).astype(np.float32)
    exact = x.astype(np.float64) @ bnb4.dequantize_4bit(t).astype(np.float64).T
    y32 = bnb4.gemv_4bit(x, t)
    assert y32.dtype == np.float32 and np.allclose(y32, exact, rtol=1e-6, atol=1e-6)
    y16 = bnb4.gemv_4bit(x, t, np.float16)
    assert y16.dtype == np.float16
    assert np.max(np.abs(y16.astype(np.float64) - exact)) < 0.05  # half weights and products


def test_quantize_rejects_what_bitsandbytes_rejects() -> None:
    with pytest.raises(ValueError, match="blocksize"):
        bnb4.quantize_4bit(np.ones((2, 64), np.float32), "nf4", 48)
    with pytest.raises(ValueError, match="quant_type"):
        bnb4.quantize_4bit(np.ones((2, 64), np.float32), "int4")


def test_schemes_and_compare(rng: np.random.Generator) -> None:
    with pytest.raises(ValueError):
        Scheme("q4_0", blocksize=128)
    with pytest.raises(ValueError):
        Scheme("nf4", blocksize=100)
    with pytest.raises(ValueError):
        Scheme("q6_k")
    assert Scheme("nf4", 64, True).tag == "nf4-b64-dq" and Scheme("q8_0").type_name == "Q8_0"
    assert Scheme("q4_0").k_reason(48) is not None and Scheme("nf4").k_reason(48) is None
    w = (rng.standard_normal((8, 256)) * 0.1).astype(np.float32)
    rows = {r["tag"]: r for r in compare(w, default_schemes())}
    assert rows["q8_0"]["nmse"] < rows["q5_0"]["nmse"] < rows["q4_0"]["nmse"]
    assert rows["nf4-b64"]["nmse"] < rows["fp4-b64"]["nmse"]
    assert rows["nf4-b64"]["bits_per_weight"] == 4.5 and rows["q4_1"]["bits_per_weight"] == 5.0
    assert requantize(w, Scheme("q4_0")).shape == (8, 144)


def test_matmul_in_nf4_and_fp4_over_the_api(client, rng: np.random.Generator) -> None:
    x = rng.standard_normal((3, 64)).astype(np.float32)
    for wf, extra in [("nf4", {}), ("fp4", {"blocksize": 32, "double_quant": True}), ("q8_0", {})]:
        r = client.post("/v1/matmul", json={"model": "demo", "tensor": "tiny.q4_0.weight", "activations": x.tolist(),
                                            "weight_format": wf, **extra})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["weight_format"].startswith(wf)
        if wf != "q8_0":
            assert body["kernel"] == "ref_f32" and body["activation_format"] == "f32"


@pytest.mark.parametrize("payload,code", [
    ({"weight_format": "nf4", "blocksize": 48}, "bad_weight_format"),
    ({"weight_format": "fp4", "blocksize": 8192}, "bad_weight_format"),
    ({"weight_format": "nf4", "kernel": "gemv"}, "kernel_cannot_run"),
])
def test_matmul_weight_format_errors(client, payload: dict, code: str) -> None:
    r = client.post("/v1/matmul", json={"model": "demo", "tensor": "tiny.q4_0.weight",
                                        "activations": [[0.5] * 64], **payload})
    assert r.status_code == 422 and r.json()["error"]["code"] == code, r.text


def test_blocksize_and_double_quant_are_ignored_outside_nf4_fp4(client) -> None:
    for wf in ("gguf", "q4_0"):
        r = client.post("/v1/matmul", json={"model": "demo", "tensor": "tiny.q4_0.weight", "activations": [[0.5] * 64],
                                            "weight_format": wf, "blocksize": 128, "double_quant": True})
        assert r.status_code == 200 and r.json()["weight_format"] == wf


def test_weight_format_on_npy_bodies(client) -> None:
    import io

    buf = io.BytesIO()
    np.save(buf, np.full((1, 64), 0.25, np.float32))
    r = client.post("/v1/matmul?model=demo&tensor=tiny.q4_0.weight&weight_format=nf4&blocksize=32",
                    content=buf.getvalue(), headers={"content-type": "application/x-npy"})
    assert r.status_code == 200 and r.headers["x-qgemm-kernel"] == "ref_f32"
    r = client.post("/v1/matmul?model=demo&tensor=tiny.q4_0.weight&weight_format=nf4&blocksize=x",
                    content=buf.getvalue(), headers={"content-type": "application/x-npy"})
    assert r.status_code == 422


def test_quantization_report(client) -> None:
    r = client.get(f"/v1/models/{SMOL_ID}/tensors/blk.0.attn_q.weight/quantization")
    assert r.status_code == 200, r.text
    body = r.json()
    rows = {s["tag"]: s for s in body["schemes"]}
    assert rows["Q4_1"]["nmse"] == 0 and rows["q4_1"]["nmse"] == 0  # its own format: nothing lost
    assert 0 < rows["nf4-b64"]["nmse"] < rows["fp4-b64"]["nmse"] and rows["q8_0"]["nmse"] < 1e-4
    assert body["device"] is None and all(s["gemm_us"] is None for s in body["schemes"])  # the CPU backend


def test_quantization_report_of_tensors_that_do_not_multiply(client) -> None:
    """A vector (as one row) and a type no kernel multiplies (IQ2_XXS, which gguf dequantizes) are compared too."""
    for url in (f"/v1/models/{SMOL_ID}/tensors/blk.0.attn_norm.weight/quantization",
                "/v1/models/demo/tensors/small.iq2_xxs.weight/quantization"):
        r = client.get(url)
        assert r.status_code == 200 and all(s["reason"] is None and s["nmse"] >= 0 for s in r.json()["schemes"])


@pytest.mark.parametrize("query,status,code", [
    ("/v1/models/demo/tensors/nope/quantization", 404, "tensor_not_found"),
    ("/v1/models/demo/tensors/tiny.q4_0.weight/quantization?blocksize=7", 422, "bad_weight_format"),
    ("/v1/models/demo/tensors/tiny.q4_0.weight/quantization?m=0", 422, "bad_m"),
    ("/v1/models/demo/tensors/tiny.q4_0.weight/quantization?m=1&m=2&m=3&m=4&m=5", 422, "bad_m"),
])
def test_quantization_report_errors(client, query: str, status: int, code: str) -> None:
    r = client.get(query)
    assert r.status_code == status and r.json()["error"]["code"] == code


def test_quantization_report_bounds_memory(models_dir: Path) -> None:
    with make_client(models_dir, quant_compare_max_values=1000) as c:
        r = c.get(f"/v1/models/{SMOL_ID}/tensors/blk.0.attn_q.weight/quantization")
    assert r.status_code == 422 and r.json()["error"]["code"] == "tensor_too_large"


def test_cli_quant_error(real_models_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    demo = str(real_models_dir / "demo.gguf")
    assert cli.main(["inspect", demo, "--quant-error", "--tensor", "tiny.q4_0.weight", "--double-quant"]) == 0
    out = capsys.readouterr().out
    assert "nf4-b64-dq" in out and "fp4-b64-dq" in out and "NMSE" in out
    assert cli.main(["inspect", demo, "--quant-error", "--tensor", "missing"]) == 2
    assert cli.main(["inspect", demo, "--quant-error", "--tensor", "tiny.q4_0.weight", "--blocksize", "100"]) == 2
