"""Launch geometry shared by the CUDA kernels and their sources (kernels/cuda/launch.py), on any machine: the
figures it mirrors from the mmq and gemv sources, and the skinny kernel's split of K and its shared memory."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from kernels.cuda import launch as L
from kernels.formats import QK

SOURCES = ("mma.cuh", "mmq.cuh", "mmq.cu", "mmq_wgmma.cu", "gemv.cu")
FAST = "\n".join((Path(L.__file__).parent / name).read_text() for name in SOURCES)  # mmq and gemv


def test_the_mirrored_constants_are_the_sources() -> None:
    common = (Path(L.__file__).parent / "common.cuh").read_text()
    assert int(re.search(r"#define CHUNK_BLOCKS (\d+)", common).group(1)) == L.CHUNK_BLOCKS
    assert re.search(r"#define SKINNY_KB (\w+)", FAST).group(1) == "CHUNK_BLOCKS" and L.SKINNY_KB == L.CHUNK_BLOCKS
    assert (int(re.search(r"#define SKINNY_WARPS (\d+)", FAST).group(1)) + 1) * 32 == L.SKINNY_THREADS
    assert int(re.search(r"#define MMQ_BM (\d+)", FAST).group(1)) == L.MMQ_BM
    assert int(re.search(r"#define MMQ_BN (\d+)", FAST).group(1)) == L.MMQ_BN
    splits = {int(s) for s in re.findall(r"GEMV1_GROUPS\(t, T, (\d+)[,)]", FAST)}  # the instances gemv.cu makes
    assert {L.groups_split(t) for t in L.GROUPS_SPLIT} | {1} <= splits and all(8 % s == 0 for s in splits)


def test_the_skinny_grouped_formats_are_gemv_cus() -> None:
    """The grouped formats the gemv launch sends to the skinny MMA at M = 2..8 (groups.py `skinny`) are the ones
    groups.cuh instantiates it for: the code books (SkinnyCodes) and the K-quants with value runs (SkinnyGroups),
    whose run bytes a super-block are groups.cuh's QS_BYTES and HI_BYTES."""
    from kernels.groups import GROUPED

    cuh = (Path(L.__file__).parent / "groups.cuh").read_text()

    def listed(macro: str) -> set[str]:
        return set(re.findall(r"MACRO\(\w+, (\w+)\)", re.search(rf"#define {macro}\(MACRO\)(.*)", cuh).group(1)))

    codes, kquants = listed("QGEMM_FOR_CODEBOOK_TYPES"), listed("QGEMM_FOR_SKINNY_K_TYPES")
    assert codes | kquants == {t for t, f in GROUPED.items() if f.skinny}
    assert kquants == {t for t, f in GROUPED.items() if f.skinny_runs}
    for t in kquants:
        struct = "QK_45" if t in ("Q4_K", "Q5_K") else t
        body = cuh[cuh.index(f"struct {struct} {{"):]
        qs, hi = (int(v) for v in re.search(r"QS_BYTES = (\d+), HI_BYTES = (?:FIFTH \? )?(\d+)", body).groups())
        want = GROUPED[t].skinny_run_bytes()
        assert want[0] == qs and (want[1:] == ((hi,) if t != "Q4_K" else ())), (t, want, qs, hi)
        scales = re.search(r"scale_bytes\(int p\) \{ return ([^;]*);", body).group(1)  # a chain of `cond ? n :`

        def plane_bytes(p: int, chain: str = scales) -> int:
            for part in chain.split(" : "):
                cond, _, value = part.rpartition(" ? ")
                if not cond or eval(cond.replace("||", "or"), {"p": p}):
                    return int(value)
            raise AssertionError(chain)

        assert GROUPED[t].skinny_scale_bytes() == sum(plane_bytes(p) for p in range(5)), (t, scales)
    assert "QGEMM_FOR_CODEBOOK_TYPES(SKINNY_CODES)" in FAST and "QGEMM_FOR_SKINNY_K_TYPES(SKINNY_K)" in FAST


@pytest.mark.parametrize("bias", [4, 32])
def test_bytes_minus_is_a_bytewise_subtraction(bias: int) -> None:
    """common.cuh's bytes_minus<B> (Q3_K's -4, Q6_K's -32) on every byte value the decoders give it, in every byte
    of a word beside every other: (v + (128 - B) * 0x01010101) ^ 0x80808080 is each byte minus B, as int8."""
    x = np.arange(128 + bias, dtype=np.uint32)
    a, b = np.meshgrid(x, x)  # bytes 0 and 2 take one value, bytes 1 and 3 the other: every pair side by side
    words = (a | (b << 8) | (a << 16) | (b << 24)).reshape(-1)
    got = ((words + np.uint32((128 - bias) * 0x01010101)) ^ np.uint32(0x80808080)).astype("<u4")
    want = words.astype("<u4").view(np.uint8).reshape(-1, 4).astype(np.int64) - bias
    np.testing.assert_array_equal(got.view(np.int8).reshape(-1, 4).astype(np.int64), want)


@pytest.mark.parametrize("n", [1, 17, 130, 2111, 2112, 4096, 14336])
@pytest.mark.parametrize("k", [32, 96, 1056, 4096, 14336])
def test_skinny_splits_cover_k_once(n: int, k: int) -> None:
    """Every split has at least one chunk, the splits together cover K's chunks, and K is split only while the
    16-row blocks leave SMs idle."""
    per, splits = L.skinny_chunks(132, n, k)
    chunks = L.cdiv(k // QK, L.SKINNY_KB)
    assert per >= 1 and (splits - 1) * per < chunks <= splits * per
    if L.cdiv(n, L.SKINNY_ROWS) >= 132:
        assert splits == 1


def _k_quant_stages() -> list[dict]:
    from kernels.groups import GROUPED

    return [{"run_bytes": f.skinny_run_bytes(), "field_bytes": f.skinny_scale_bytes()}
            for f in GROUPED.values() if f.skinny_runs]


@pytest.mark.parametrize("weights", [{"block_bytes": b} for b in (18, 20, 22, 24, 34)] +
                         [{"scale_bytes": b} for b in (1, 2)] + _k_quant_stages())
def test_skinny_stages_fit_two_blocks_an_sm(weights: dict) -> None:
    """Every legacy block size (chunked rows), code-book scale size and K-quant's runs and scale fields, at every
    row count."""
    for m in range(2, 9):
        stage = L.skinny_stage(L.skinny_weights(**weights), m)
        stages = L.skinny_stages(stage)
        assert stage % 16 == 0 and 2 <= stages <= 4 and stages * stage <= L.SKINNY_SMEM, (weights, m, stage, stages)
        assert 2 * (stages * stage + 4096 + 1024) <= 228 * 1024  # two blocks: buffers, the warps' sums, 1 KiB each


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
@pytest.mark.parametrize("k", [32, 2048, 4128, 6144 + 96])
def test_chunked_rows_hold_every_block_where_gemv_reads_it(rng: np.random.Generator, type_name: str, k: int) -> None:
    """layouts.chunked_rows against common.cuh's ChunkedRows offsets (written out here): block j of chunk c of a row
    has its quants at c * CHUNK + j * qs_bytes, its fifth bits after the chunk's nb quants, its scale after those;
    rows of chunked_row_bytes, whole chunks and a last one of K / 32 % 64 blocks, each part aligned for its loads."""
    from gguf import GGMLQuantizationType, quants

    from kernels.cuda.layouts import chunked_rows
    from kernels.reference import block_fields

    n = 3
    raw = quants.quantize(rng.standard_normal((n, k)).astype(np.float32), GGMLQuantizationType[type_name])
    head, qh, qs = block_fields(type_name, raw)
    rows = chunked_rows(type_name, raw)
    kb, block = k // QK, raw.shape[1] // (k // QK)
    assert rows.shape == (n, L.chunked_row_bytes(block, kb)) and rows.shape[1] % 16 == 0
    qh_bytes, qs_bytes = (4 if qh is not None else 0), qs.shape[-1]
    for b in range(kb):
        c, j = divmod(b, L.CHUNK_BLOCKS)
        nb = min(L.CHUNK_BLOCKS, kb - c * L.CHUNK_BLOCKS)
        chunk = c * L.CHUNK_BLOCKS * block
        at_qh, at_d = chunk + nb * qs_bytes, chunk + nb * (qs_bytes + qh_bytes)
        assert chunk % 16 == 0 and at_qh % 16 == 0 and at_d % 4 == 0
        np.testing.assert_array_equal(rows[:, chunk + j * qs_bytes:][:, :qs_bytes], qs[:, b])
        if qh is not None:
            np.testing.assert_array_equal(rows[:, at_qh + 4 * j:][:, :4], qh[:, b])
        hb = head.shape[-1] * 2
        np.testing.assert_array_equal(rows[:, at_d + hb * j:][:, :hb], head[:, b].view(np.uint8).reshape(n, -1))


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("k", [256, 2048, 4096 + 256, 14336])
def test_k_quant_rows_hold_every_sub_block_where_gemv_k_reads_it(rng: np.random.Generator, type_name: str,
                                                                 k: int) -> None:
    """layouts.k_quant_rows read back at common.cuh's ChunkedRows<Q4_KR / Q5_KR / Q6_KR> offsets and decoded as
    groups.cuh's words() and sum() do (written out here): sub-block j of chunk c has 16 nibble bytes at
    c * CHUNK + 16 j, then after the chunk's nb quants its high bits (Q5_K 4 bytes, Q6_K 8), after those its two
    scale bytes, and after the nb scales its super-block's fields at SUPER (j / 8); the values so read are gguf's
    dequantization."""
    from gguf import GGMLQuantizationType, quants

    from kernels.cuda.layouts import KQuantRows, k_quant_rows
    from kernels.groups import random_blocks

    n = 3
    raw = random_blocks(type_name, n, k, rng)  # every nibble, high-bit and scale byte uniform
    rows = k_quant_rows(type_name, raw)
    kb, (per, sup) = k // QK, KQuantRows.GEOMETRY[type_name]
    hb = per - 18
    full = L.chunk_bytes(per, L.CHUNK_BLOCKS, sup)
    assert rows.shape == (n, L.chunked_row_bytes(per, kb, sup)) and full % 16 == 0 and rows.shape[1] % 16 == 0
    got = np.empty((n, k), np.float64)
    for b in range(kb):
        c, j = divmod(b, L.CHUNK_BLOCKS)
        nb = min(L.CHUNK_BLOCKS, kb - c * L.CHUNK_BLOCKS)
        chunk = c * full
        at_hi, at_sc, at_sup = chunk + 16 * nb, chunk + (16 + hb) * nb, chunk + per * nb
        assert at_hi % 16 == 0 and at_sc % 2 == 0 and at_sup % sup == 0
        qs = rows[:, chunk + 16 * j:][:, :16]
        q = np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.int64)
        if hb:
            words = np.ascontiguousarray(rows[:, at_hi + hb * j:][:, :hb]).view("<u4").astype(np.int64)
            v = np.arange(32)
            if type_name == "Q5_K":  # bit l: value l's fifth
                q |= ((words[:, :1] >> v) & 1) << 4
            else:  # value 16 h + 4 i + c: bits 8 c + 2 i of word h
                i, cc = (v % 16) // 4, v % 4
                q |= ((words[:, v // 16] >> (8 * cc + 2 * i)) & 3) << 4
        sf = np.ascontiguousarray(rows[:, at_sup + sup * (j // 8):][:, :sup]).view(np.float16).astype(np.float64)
        if type_name == "Q6_K":
            sc = rows[:, at_sc + 2 * j:][:, :2].view(np.int8).astype(np.float64)
            value = sf[:, :1] * np.repeat(sc, 16, axis=1) * (q - 32)
        else:
            sc, m = rows[:, at_sc + 2 * j], rows[:, at_sc + 2 * j + 1]
            value = sf[:, :1] * sc[:, None] * q - sf[:, 1:] * m[:, None]
        got[:, QK * b:QK * (b + 1)] = value
    want = quants.dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("k", [256, 2048, 4096 + 256, 14336])
def test_iq4_xs_rows_hold_every_sub_block_where_gemv_k_reads_it(rng: np.random.Generator, k: int) -> None:
    """layouts.k_quant_rows of IQ4_XS read back at common.cuh's ChunkedRows<IQ4_XSR> offsets and looked up as
    groups.cuh's IQ4_XSR does (written out here): sub-block j of chunk c has 16 code bytes at c * CHUNK + 16 j, in
    lookup16x8's order (nibbles 0-3 of word i values 4i.., nibbles 4-7 values 16 + 4i..), after the chunk's nb
    code runs its int8 scale minus 32, and after the nb scales its super-block's d at 2 (j / 8); the values so read
    are gguf's dequantization."""
    from gguf import GGMLQuantizationType, quants

    from kernels.cuda.layouts import KQuantRows, k_quant_rows
    from kernels.groups import KVALUES_IQ4NL, random_blocks

    n = 3
    raw = random_blocks("IQ4_XS", n, k, rng)  # every code and scale bit uniform
    rows = k_quant_rows("IQ4_XS", raw)
    kb, (per, sup) = k // QK, KQuantRows.GEOMETRY["IQ4_XS"]
    full = L.chunk_bytes(per, L.CHUNK_BLOCKS, sup)
    assert rows.shape == (n, L.chunked_row_bytes(per, kb, sup)) and full % 16 == 0 and rows.shape[1] % 16 == 0
    m = np.arange(8)
    got = np.empty((n, k), np.float64)
    for b in range(kb):
        c, j = divmod(b, L.CHUNK_BLOCKS)
        nb = min(L.CHUNK_BLOCKS, kb - c * L.CHUNK_BLOCKS)
        chunk = c * full
        at_sc, at_sup = chunk + 16 * nb, chunk + per * nb
        assert at_sup % sup == 0
        qs = rows[:, chunk + 16 * j:][:, :16].astype(np.int64)
        codes = np.empty((n, 32), np.int64)
        for i in range(4):  # nibble m of word i: byte 4 i + m / 2, low half first
            nib = (qs[:, 4 * i + m // 2] >> (4 * (m % 2))) & 0xF
            codes[:, 4 * i:4 * i + 4], codes[:, 16 + 4 * i:16 + 4 * i + 4] = nib[:, :4], nib[:, 4:]
        sc = rows[:, at_sc + j].view(np.int8).astype(np.float64)
        d = np.ascontiguousarray(rows[:, at_sup + sup * (j // 8):][:, :sup]).view(np.float16).astype(np.float64)
        got[:, QK * b:QK * (b + 1)] = d * sc[:, None] * KVALUES_IQ4NL[codes]
    want = quants.dequantize(raw, GGMLQuantizationType.IQ4_XS).astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
