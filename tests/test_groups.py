"""The grouped formats (issue #23) on the CPU: decoding against gguf's dequantizer on random and extreme
blocks, llama.cpp's two formulas against their plain definitions, Q2_K's D2S6 quantizer, and the real K-quant
file (Gemma 3 270M Q4_K_M) inspected and multiplied over the API."""

from __future__ import annotations

import os

import numpy as np
import pytest
from fastapi.testclient import TestClient
from gguf import GGMLQuantizationType, GGUFReader, quants

from kernels import accuracy, groups
from kernels import reference as ref
from kernels.formats import GROUPED_TYPES, mmq_ds_layout
from tests.conftest import GEMMA_ID
from tests.test_formats import check_tensor


def extreme(type_name: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks whose quant and sub-scale bytes are, block by block, as drawn, all 0x00 or all 0xFF."""
    b = groups.blocks_of(type_name, groups.random_blocks(type_name, n, k, rng))
    for field in b.dtype.names:
        if b.dtype[field].shape:
            v = b[field].view(np.uint8)
            pick = rng.integers(0, 3, v.shape[:2])
            v[pick == 1], v[pick == 2] = 0x00, 0xFF
    return np.ascontiguousarray(b).view(np.uint8).reshape(n, -1)


@pytest.mark.parametrize("type_name", GROUPED_TYPES)
def test_decode_is_ggufs(rng: np.random.Generator, type_name: str) -> None:
    for raw in (groups.random_blocks(type_name, 9, 512, rng), extreme(type_name, 9, 512, rng)):
        want = quants.dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float64)
        assert np.array_equal(groups.dequantize(groups.decode(type_name, raw)), want)


def prmt(a: np.ndarray, b: np.ndarray, sel: np.ndarray) -> np.ndarray:
    """PTX prmt.b32 (default mode) on uint32 arrays: result byte i is byte (sel nibble i & 7) of b:a, or that
    byte's sign bit replicated where the nibble's bit 3 is set."""
    a, b = np.broadcast_to(a, sel.shape), np.broadcast_to(b, sel.shape)
    pool = np.stack([(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)])
    out = np.zeros(sel.shape, np.uint32)
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = np.take_along_axis(pool, (nib & 7)[None].astype(np.int64), 0)[0]
        byte = np.where(nib & 8, np.where(byte & 0x80, 0xFF, 0), byte)
        out |= byte.astype(np.uint32) << np.uint32(8 * i)
    return out


@pytest.mark.parametrize("type_name", ["IQ4_NL", "IQ4_XS", "MXFP4"])
def test_code_book_plane_is_looked_up_in_value_order(rng: np.random.Generator, type_name: str) -> None:
    """groups.cuh's lookup16x8, step for step, on the paired nibbles of the gemv plane (field_planes): word i of a
    block gives values 4i..4i+3 (x) and 16+4i..16+4i+3 (y), the int8 code-book values decode() gives."""
    raw = extreme(type_name, 7, 512, rng)
    fmt = groups.grouped(type_name)
    plane = groups.field_planes(type_name, raw)[fmt.planes.index(fmt.code_plane)]
    table = groups.KVALUES_IQ4NL if type_name != "MXFP4" else groups.KVALUES_MXFP4  # int8, 4 a word
    t = table.view("<u4").astype(np.uint32)
    q = plane.view("<u4").astype(np.uint32)
    idx, pick = q & 0x77777777, 0x32103210 | ((q >> 1) & 0x44444444)
    hi = idx >> 16
    x = prmt(prmt(t[0], t[1], idx), prmt(t[2], t[3], idx), pick)
    y = prmt(prmt(t[0], t[1], hi), prmt(t[2], t[3], hi), pick >> 16)
    words = np.stack([x.reshape(-1, 4), y.reshape(-1, 4)], axis=1)  # [block, (x, y), word i]: values 16h + 4i + byte
    got = np.ascontiguousarray(words.astype("<u4")).view(np.int8).reshape(-1, 32)
    want = groups.decode(type_name, raw).q.reshape(-1, 32)
    assert np.array_equal(got, want)


def test_mxfp4_from_ggufs_quantizer(rng: np.random.Generator) -> None:
    raw = quants.quantize(rng.standard_normal((5, 256)).astype(np.float32), GGMLQuantizationType.MXFP4)
    want = quants.dequantize(raw, GGMLQuantizationType.MXFP4).astype(np.float64)
    assert np.array_equal(groups.dequantize(groups.decode("MXFP4", raw)), want)


def test_random_blocks_use_every_code(rng: np.random.Generator) -> None:
    sizes = {"Q2_K": 4, "Q3_K": 8, "Q4_K": 16, "Q5_K": 32, "Q6_K": 64, "IQ4_NL": 16, "IQ4_XS": 16, "MXFP4": 15}
    for t, codes in sizes.items():  # MXFP4: +0 and -0 are one value
        w = groups.decode(t, groups.random_blocks(t, 16, 512, rng))
        assert len(np.unique(w.q)) == codes and np.isfinite(w.scale).all(), t


@pytest.mark.parametrize("type_name", GROUPED_TYPES)
def test_mmvq_formula_is_the_product_of_its_parts(rng: np.random.Generator, type_name: str) -> None:
    """MMVQ's per-group formula adds up to the exact product of the dequantized Q8_1 activations and weights."""
    raw = extreme(type_name, 33, 768, rng)
    a = ref.quantize_q8_1(rng.standard_normal((5, 768)).astype(np.float32))
    w = ref.prepare_block_weights(type_name, raw)
    exact = ref.dequantize_q8_1(a).astype(np.float64) @ groups.dequantize(w).T
    cmp = accuracy.compare(ref.ref_q8_1(w, a), exact, ref.ref_q8_1_terms(w, a))
    assert cmp.ok, cmp


@pytest.mark.parametrize("type_name", GROUPED_TYPES)
def test_mmq_formula_per_group(rng: np.random.Generator, type_name: str) -> None:
    """MMQ's formula spelled out group by group in float64: the half-rounded scales and minima of Q2_K / Q4_K /
    Q5_K, s_a (DS4) or D2S6's sums of 16 and, for the last 32 of every 128, d_a times the integer sums."""
    m, n, k = 4, 9, 512
    raw = groups.random_blocks(type_name, n, k, rng)
    x = rng.standard_normal((m, k)).astype(np.float32)
    a = ref.quantize_q8_1_mmq(x, mmq_ds_layout(type_name))
    w = groups.decode(type_name, raw)
    g = w.group
    qa = a.q.reshape(m, k // g, g).astype(np.int64)
    sumi = np.einsum("mgi,ngi->mng", qa, w.q.reshape(n, k // g, g).astype(np.int64)).astype(np.float64)
    da = np.repeat(a.d.astype(np.float64), (k // a.d.shape[1]) // g, axis=1)[:, None, :]
    y = (da * w.mmq_scale[None] * sumi).sum(-1)
    if w.mmq_min is not None:
        if mmq_ds_layout(type_name) == "D2S6":
            s = a.s.astype(np.float64).reshape(m, -1, 8)
            s[..., 6:] = (da[:, 0, :] * qa.sum(-1)).reshape(m, -1, 8)[..., 6:]
            s = s.reshape(m, -1)
        else:
            s = a.s.astype(np.float64)
        y += (w.mmq_min[None] * s[:, None, :]).sum(-1)
    cmp = accuracy.compare(ref.ref_mmq(w, a), y, ref.ref_mmq_terms(w, a))
    assert cmp.ok, cmp


@pytest.mark.parametrize("type_name", GROUPED_TYPES)
def test_mmq_tiles_fold_integer_scales(rng: np.random.Generator, type_name: str) -> None:
    """mmq's tiles (groups.mmq_weights): Q3_K's integer scales folded into int8 values with -d a block; Q6_K's,
    in mmq_d2's tiles of two digits, into int16 values with d a block; the same weights exactly.  Every other
    format, and Q6_K in mmq's one-digit tiles, as decoded, with one scale a block unless a scale per 16 stays."""
    n, k = 5, 512
    raw = groups.random_blocks(type_name, n, k, rng)
    w = groups.decode(type_name, raw)
    assert groups.MMQ_D2_TYPES == ("Q6_K",)
    for digits in (1, 2):
        tiles = groups.mmq_weights(type_name, raw, digits)
        folds = groups.mmq_weights_fold(type_name, digits)
        assert folds == (type_name == "Q3_K" or (type_name == "Q6_K" and digits == 2))
        wide = type_name == "Q6_K" and digits == 2
        assert tiles.q.dtype == (np.int16 if wide else np.int8) and tiles.q.shape == (n, k)
        scaled = tiles.q.reshape(n, -1, tiles.group) * tiles.mmq_scale[..., None]
        want = w.q.reshape(n, -1, w.group) * w.mmq_scale[..., None]
        assert np.array_equal(scaled.reshape(n, k), want.reshape(n, k))
        assert groups.mmq_scales_a_block(type_name, digits) == (2 if w.group == 16 and not folds else 1)
    b = groups.blocks_of(type_name, raw)
    if type_name == "Q3_K":  # every (q, sc) pair, the extremes -4 * -32 = 128 and -4 * 31 included, fits
        b["scales"] = 0  # all scales -32
        q = groups.mmq_weights(type_name, b.view(np.uint8).reshape(n, -1)).q
        assert q.min() == -128 and q.max() == 96
    if type_name == "Q6_K":  # the extremes -32 * -128 = 4096 and -32 * 127 as two digits, within mmq.cuh's biases
        b["scales"][0, 0, 0], b["scales"][0, 0, 1], b["ql"][0], b["qh"][0] = -128, 127, 0, 0  # q = -32
        q = groups.mmq_weights(type_name, b.view(np.uint8).reshape(n, -1), 2).q
        assert q[0, 0] == 4096 and q[0, 16] == -4064
        lo, hi = groups.int8_digits(q)
        assert np.array_equal(128 * hi.astype(np.int32) + lo, q)
        assert -64 <= lo.min() and lo.max() <= 63 and -32 <= hi.min() and hi.max() <= 32  # |Σ a hi| < 2^18 - 2^11


def test_int8_digits() -> None:
    q = np.arange(-128 * 128 - 64, 128 * 127 + 64)
    lo, hi = groups.int8_digits(q)
    assert np.array_equal(128 * hi.astype(np.int32) + lo, q) and lo.min() == -64 and lo.max() == 63
    with pytest.raises(ValueError):
        groups.int8_digits(np.array([128 * 127 + 64]))


def test_d2s6_quantizer(rng: np.random.Generator) -> None:
    x = (rng.standard_normal((3, 512)) * 3).astype(np.float32)
    a = ref.quantize_q8_1_d2s6(x)
    assert a.d.shape == (3, 8) and a.s.shape == (3, 32)
    amax = np.abs(x.reshape(3, 8, 64)).max(-1)
    assert np.abs(a.q).max() == 127 and np.allclose(a.d.astype(np.float64), amax / 127, rtol=1e-3)
    s = a.s.reshape(3, 4, 8)
    assert (s[..., 6:] == 0).all()
    assert np.allclose(s[..., :6].astype(np.float64), x.reshape(3, 4, 8, 16)[:, :, :6].sum(-1), rtol=2e-3, atol=1e-2)
    with pytest.raises(ValueError):
        ref.quantize_q8_1_d2s6(x[:, :96])


def gemma_path(real_models_dir):
    p = real_models_dir / f"{GEMMA_ID}.gguf"
    if not p.is_file():
        if os.environ.get("QGEMM_TEST_REQUIRE_MODELS") == "1":
            pytest.fail(f"{p.name} is not in {real_models_dir}: run `qgemm fetch`")
        pytest.skip(f"{p.name} not fetched")
    return p


def test_gemma_q4_k_m_is_inspected_as_its_mix(client: TestClient, real_models_dir) -> None:
    gemma_path(real_models_dir)
    body = client.get(f"/v1/models/{GEMMA_ID}").json()
    mix = body["quant_mix"]
    assert mix["file_type"] == "MOSTLY_Q4_K_M" and mix["summary"].startswith("Q4_K_M-like: ")
    assert {"Q4_K", "Q6_K"} <= set(mix["by_bytes"]) and abs(sum(mix["by_bytes"].values()) - 1) < 1e-3


def test_gemma_k_quant_matrices_multiply_end_to_end(client: TestClient, real_models_dir,
                                                    rng: np.random.Generator) -> None:
    """Block 0's Q4_K and Q6_K matrices (and a Q5_0 one) through the API at M = 1, 2 and 11, against the
    reference of the formula llama.cpp computes there."""
    path = gemma_path(real_models_dir)
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    for name in ("blk.0.attn_output.weight", "blk.0.ffn_down.weight", "blk.0.attn_q.weight"):
        check_tensor(client, path, GEMMA_ID, tensors[name], rng)
