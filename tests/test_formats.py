"""Every legacy and float GGUF format (issue #21): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 against Q8_1 by both of
llama.cpp's formulas, and F32/F16/BF16 matrices as float products; the decode against gguf's, the formulas
spelled out block by block, the distance from the FP64 product bounded output by output by what the
formula itself loses, blocks at their extremes, and every matrix of the real SmolLM2 file through the API."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from gguf import GGMLQuantizationType, GGUFReader, quants

from kernels import accuracy
from kernels import reference as ref
from kernels.formats import FLOAT_TYPES, FORMATS, LEGACY_TYPES, QUANT_TYPES, mmq_ds_layout
from kernels.registry import llama_formula
from models.demo import DEMO_TENSORS
from tests.conftest import SMOL_ID
from tests.oracles import assert_matches, reference_product
from tests.test_reference import oracle


def fmt(type_name: str):
    return FORMATS[GGMLQuantizationType[type_name]]


def random_weights(rng: np.random.Generator, type_name: str, n: int, k: int) -> np.ndarray:
    """Gaussian weights with a per-row shift, so that formats with a minimum have m well away from 0."""
    w = (rng.standard_normal((n, k)) * 0.02 + rng.standard_normal((n, 1)) * 0.01).astype(np.float32)
    return quants.quantize(w, GGMLQuantizationType[type_name])


def block_formula(type_name: str, formula: str, qw: np.ndarray, dw: np.ndarray, mw: np.ndarray | None,
                  a: ref.Q8_1) -> np.ndarray:
    """The formula, block by block in float64 from the unpacked integers (the device's half roundings kept)."""
    f = fmt(type_name)
    m, k = a.shape
    n = qw.shape[0]
    qa = a.q.reshape(m, k // 32, 32).astype(np.int64)
    q = qw.reshape(n, k // 32, 32).astype(np.int64)
    if formula == "q8_1_mmq" and mw is None:
        q = q - f.offset
    sumi = np.einsum("mbi,nbi->mnb", qa, q).astype(np.float64)
    da, sa = a.d.astype(np.float64)[:, None, :], a.s.astype(np.float64)[:, None, :]
    d = dw.astype(np.float64)[None]
    if mw is None:
        if formula == "q8_1_mmvq" and f.offset:
            return (d * (da * sumi - f.offset * sa)).sum(-1)
        return (d * da * sumi).sum(-1)
    mm = mw.astype(np.float64)[None]
    if formula == "q8_1_mmvq" and f.mmvq_half_products:
        h = lambda u, v: (u * v).astype(np.float16).astype(np.float64)  # noqa: E731  (exact product, then half)
        return (sumi * h(d, da) + h(mm, sa)).sum(-1)
    return (sumi * d * da + mm * sa).sum(-1)


def quantized(x: np.ndarray, type_name: str, formula: str) -> ref.Q8_1:
    return ref.quantize_q8_1(x) if formula == "q8_1_mmvq" else ref.quantize_q8_1_mmq(x, mmq_ds_layout(type_name))


def run_formula(w: ref.BlockWeights, a: ref.Q8_1, formula: str) -> tuple[np.ndarray, ref.Terms]:
    if formula == "q8_1_mmvq":
        return ref.ref_q8_1(w, a), ref.ref_q8_1_terms(w, a)
    return ref.ref_mmq(w, a), ref.ref_mmq_terms(w, a)


FORMULAS = ["q8_1_mmvq", "q8_1_mmq"]


@pytest.mark.parametrize("type_name", LEGACY_TYPES)
def test_decode_is_ggufs(rng: np.random.Generator, type_name: str) -> None:
    raw = random_weights(rng, type_name, 7, 160)
    q, d, m = ref.unpack_blocks(type_name, raw)
    f = fmt(type_name)
    assert (m is not None) == f.has_min
    values = (q.astype(np.float32).reshape(7, 5, 32) - f.offset) * d.astype(np.float32)[..., None]
    if m is not None:
        values = values + m.astype(np.float32)[..., None]
    assert np.array_equal(values.reshape(7, 160), ref.dequantize_weights(type_name, raw))


@pytest.mark.parametrize("type_name", LEGACY_TYPES)
@pytest.mark.parametrize("formula", FORMULAS)
def test_each_formula_is_its_per_block_form(rng: np.random.Generator, type_name: str, formula: str) -> None:
    n, k, m = 9, 96, 4
    raw = random_weights(rng, type_name, n, k)
    a = quantized(rng.standard_normal((m, k)).astype(np.float32), type_name, formula)
    w = ref.prepare_block_weights(type_name, raw)
    y, terms = run_formula(w, a, formula)
    cmp = accuracy.compare(y, block_formula(type_name, formula, *ref.unpack_blocks(type_name, raw), a), terms)
    assert cmp.ok, cmp


def formula_error_bound(type_name: str, formula: str, raw: np.ndarray, x: np.ndarray, a: ref.Q8_1) -> np.ndarray:
    """What the formula can lose against the exact product of the dequantized weights, output by output:
    Σ_blocks |d_w| Σ |q_w'| |q_a d_a - x| (q_w' the integers the formula multiplies), the sum term's
    |coef| |s_a - Σx|, and MMVQ's half roundings of d_w*d_a and m_w*s_a where the format has them."""
    f = fmt(type_name)
    qw, dw, mw = ref.unpack_blocks(type_name, raw)
    (m, k), n = x.shape, raw.shape[0]
    x64 = x.astype(np.float64).reshape(m, k // 32, 32)
    lost = np.abs(a.q.reshape(m, k // 32, 32) * a.d.astype(np.float64)[..., None] - x64)
    q = qw.astype(np.float64)
    if formula == "q8_1_mmq" and not f.has_min:
        q = q - f.offset
    qb = np.abs(q).reshape(n, k // 32, 32)
    d = np.abs(dw.astype(np.float64))
    bound = np.einsum("mbi,nbi,nb->mn", lost, qb, d)
    s_lost = np.abs(a.s.astype(np.float64) - x64.sum(-1))  # [M, KB]
    if f.has_min:
        bound += s_lost @ np.abs(mw.astype(np.float64)).T
        if formula == "q8_1_mmvq" and f.mmvq_half_products:
            da, sa = a.d.astype(np.float64)[:, None, :], a.s.astype(np.float64)[:, None, :]
            dd, mm = dw.astype(np.float64)[None], mw.astype(np.float64)[None]
            sumi = np.abs(np.einsum("mbi,nbi->mnb", a.q.reshape(m, k // 32, 32).astype(np.int64),
                                    qw.reshape(n, k // 32, 32).astype(np.int64)))
            half = lambda v: v.astype(np.float16).astype(np.float64)  # noqa: E731
            bound += (sumi * np.abs(half(dd * da) - dd * da) + np.abs(half(mm * sa) - mm * sa)).sum(-1)
    elif formula == "q8_1_mmvq" and f.offset:
        bound += f.offset * s_lost @ d.T
    return bound


@pytest.mark.parametrize("type_name", LEGACY_TYPES)
@pytest.mark.parametrize("formula", FORMULAS)
@pytest.mark.parametrize("m,n,k", [(1, 1, 32), (3, 33, 96), (17, 257, 160), (40, 64, 4096)])
def test_error_against_fp64_is_the_formulas(rng: np.random.Generator, type_name: str, formula: str,
                                            m: int, n: int, k: int) -> None:
    raw = random_weights(rng, type_name, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    a = quantized(x, type_name, formula)
    y, terms = run_formula(ref.prepare_block_weights(type_name, raw), a, formula)
    assert y.dtype == np.float32 and y.shape == (m, n)
    slack = accuracy.tolerance(terms.count) * terms.magnitude + formula_error_bound(type_name, formula, raw, x, a)
    err = np.abs(y - oracle(type_name, raw, x))
    assert np.all(err <= slack), f"worst {np.max(err / slack):.3g}x its bound"


def one_block(type_name: str, d: float, m: float | None, q: np.ndarray) -> np.ndarray:
    """A block's bytes by hand, from its 32 integer values (llama.cpp's struct layout)."""
    head = np.float16([d] if m is None else [d, m]).tobytes()
    q = q.astype(np.uint8)
    if type_name == "Q8_0":
        body = q.astype(np.int8).tobytes()
    else:
        nib = (q[:16] & 0x0F) | ((q[16:] & 0x0F) << 4)
        body = nib.tobytes()
        if type_name in ("Q5_0", "Q5_1"):
            qh = np.packbits(((q >> 4) & 1).astype(np.uint8), bitorder="little").tobytes()
            body = qh + body
    return np.frombuffer(head + body, np.uint8)


@pytest.mark.parametrize("type_name", ["Q4_1", "Q5_0", "Q5_1"])
def test_blocks_at_their_extremes(type_name: str) -> None:
    """Quants all at 0, all at the top, alternating, and every value once; against activation blocks of one
    value (q = +-127) and a ramp: the decode is gguf's, and each formula is its block form."""
    top = 31 if type_name.startswith("Q5") else 15
    has_min = fmt(type_name).has_min
    rows = [np.zeros(32), np.full(32, top), np.tile([0, top], 16), np.arange(32) % (top + 1)]
    raw = np.stack([np.concatenate([one_block(type_name, dv, -0.75 if has_min else None, q)
                                    for dv in (0.03125, 1.5)]) for q in rows])
    q, d, mins = ref.unpack_blocks(type_name, raw)
    assert [list(r) for r in q[:, :32]] == [list(r.astype(int)) for r in rows]
    values = (q.astype(np.float64).reshape(4, 2, 32) - fmt(type_name).offset) * d.astype(np.float64)[..., None]
    if mins is not None:
        values += mins.astype(np.float64)[..., None]
    assert np.array_equal(values.reshape(4, 64), quants.dequantize(raw, GGMLQuantizationType[type_name]))
    x = np.concatenate([np.full(32, 2.0), np.linspace(-3, 3, 32)]).astype(np.float32)[None]
    w = ref.prepare_block_weights(type_name, raw)
    for formula in FORMULAS:
        a = quantized(x, type_name, formula)
        y, terms = run_formula(w, a, formula)
        cmp = accuracy.compare(y, block_formula(type_name, formula, q, d, mins, a), terms)
        assert cmp.ok, (formula, cmp)


@pytest.mark.parametrize("type_name", FLOAT_TYPES)
def test_float_matrices_multiply_in_fp32(rng: np.random.Generator, type_name: str) -> None:
    """F32/F16/BF16 matrices: the stored values, FP32 activations, fp32 accumulation."""
    w = (rng.standard_normal((33, 96)) * 0.02).astype(np.float32)
    raw = w if type_name == "F32" else w.astype(np.float16) if type_name == "F16" else \
        quants.quantize(w, GGMLQuantizationType.BF16)
    x = rng.standard_normal((5, 96)).astype(np.float32)
    wf = ref.dequantize_weights(type_name, raw)
    assert wf.dtype == np.float32 and wf.shape == (33, 96)
    assert np.array_equal(wf, quants.dequantize(np.asarray(raw), GGMLQuantizationType[type_name]))
    cmp = accuracy.compare(ref.ref_f32(wf, x), x.astype(np.float64) @ wf.astype(np.float64).T, ref.ref_f32_terms(wf, x))
    assert cmp.ok, cmp


def test_bf16_rounding_is_to_nearest_even() -> None:
    """ref_bf16's activations: as gguf's bf16 quantizer rounds (to nearest, ties to even)."""
    x = np.array([1.0, 1.00390625, 1.01171875, -3.3e-39, 3.4e38, 1e-45, -0.0, 65504.0], np.float32)
    x = np.concatenate([x, np.random.default_rng(3).standard_normal(1000).astype(np.float32)])
    want = quants.dequantize(quants.quantize(x, GGMLQuantizationType.BF16), GGMLQuantizationType.BF16)
    assert np.array_equal(ref.round_bf16(x), want)


# -- through the API (CPU backend) ------------------------------------------------------------------
def post_npy(client: TestClient, model: str, tensor: str, x: np.ndarray) -> tuple[np.ndarray, str]:
    buf = io.BytesIO()
    np.save(buf, x)
    r = client.post(f"/v1/matmul?model={model}&tensor={tensor}", content=buf.getvalue(),
                    headers={"Content-Type": "application/x-npy", "Accept": "application/x-npy"})
    assert r.status_code == 200, (tensor, r.text)
    return np.load(io.BytesIO(r.content)), r.headers["x-qgemm-activation-format"]


def post_json(client: TestClient, model: str, tensor: str, x: np.ndarray) -> tuple[np.ndarray, str]:
    r = client.post("/v1/matmul", json={"model": model, "tensor": tensor, "activations": x.tolist()})
    assert r.status_code == 200, (tensor, r.text)
    body = r.json()
    return np.asarray(body["output"], np.float32), body["activation_format"]


def check_tensor(client: TestClient, path: Path, model: str, t, rng: np.random.Generator) -> None:
    type_name = GGMLQuantizationType(int(t.tensor_type)).name
    n, k = (int(s) for s in reversed([int(v) for v in t.shape]))
    for post, m in ((post_json, 1), (post_json, 2), (post_npy, 11)):  # a vector (F16's mmvf), MMVQ's M, MMQ's
        x = rng.standard_normal((m, k)).astype(np.float32)
        y, formula = post(client, model, t.name, x)
        assert formula == llama_formula(m, type_name, n, k)
        want, terms = reference_product(type_name, t.data, x, formula)
        assert_matches(y, want, terms, f"{model} {t.name} ({type_name}) M={m}")


def test_every_demo_format_multiplies(client: TestClient, real_models_dir: Path, rng: np.random.Generator) -> None:
    path = real_models_dir / "demo.gguf"
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    seen = set()
    for name, qtype, shape in DEMO_TENSORS:
        if len(shape) == 2 and qtype.name in (*QUANT_TYPES, *FLOAT_TYPES) and shape[0] * shape[1] < 1 << 20:
            check_tensor(client, path, "demo", tensors[name], rng)
            seen.add(qtype.name)
    assert seen == {*QUANT_TYPES, *FLOAT_TYPES}


def test_every_matrix_of_smollm2_multiplies(client: TestClient, real_models_dir: Path,
                                            rng: np.random.Generator) -> None:
    """A client that knows only the API multiplies every 2-D tensor of the real file (JSON and .npy)."""
    path = real_models_dir / f"{SMOL_ID}.gguf"
    listed = client.get(f"/v1/models/{SMOL_ID}/tensors").json()["tensors"]
    matrices = [t for t in listed if len(t["shape"]) == 2]
    assert len(matrices) == 211 and all(t["matmul"] for t in matrices)
    reader = {t.name: t for t in GGUFReader(path).tensors}
    for t in matrices:
        check_tensor(client, path, SMOL_ID, reader[t["name"]], rng)
