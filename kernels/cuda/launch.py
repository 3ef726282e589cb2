"""Launch geometry shared by the CUDA kernels (kernels/cuda/kernels.py) and their layouts (layouts.py): grid
arithmetic, mmq's tile sizes as mmq.cuh declares them, and the choice of mmq-layout quantizer.  No CuPy here."""

from __future__ import annotations

import numpy as np

from kernels.formats import QK
from kernels.groups import GROUPED

I32, I64 = np.int32, np.int64


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


MMQ_BM, MMQ_BN, MMQ_BKB, MMQ_STAGES, MMQ_THREADS = 64, 128, 4, 2, 128  # as mmq.cuh
MMQ_STAGE = (MMQ_BM + MMQ_BN) * MMQ_BKB * QK + MMQ_BKB * MMQ_BM * 8 + MMQ_BKB * MMQ_BN * 4
MMQ_SMEM = MMQ_STAGES * (MMQ_STAGE + 8)  # MmqSmem::BYTES: the stage buffers and their mbarriers


def mmq_min_bytes(h: int) -> int:
    """Bytes of a row's s_a (and of its m_w) a stage (MmqSmem::SA_BYTES / 64, WM_BYTES / 128): 4 halves (H = 1),
    or Q2_K's 8 halves and 2 floats (H = 2)."""
    return 8 if h == 1 else 24


MMQ_SMEM_MIN = MMQ_STAGES * (MMQ_STAGE + (MMQ_BM + MMQ_BN) * mmq_min_bytes(1) + 8)  # MmqSmem<true>
MMQ_WGMMA_SMEM = cdiv(MMQ_SMEM, 128) * 128 + 2048  # MmqWgSmem::BYTES: then the 2 KiB tile of -128s
# MmqSmem<MIN, 2> (mmq16, mmq16_min): two weight scales a block, and two minima and sums
MMQ16_SMEM = MMQ_STAGES * (MMQ_STAGE + MMQ_BKB * MMQ_BN * 4 + 8)
MMQ16_SMEM_MIN = MMQ_STAGES * (MMQ_STAGE + MMQ_BKB * MMQ_BN * 4 + (MMQ_BM + MMQ_BN) * mmq_min_bytes(2) + 8)
# MmqSmem<false, 1, 2> (mmq_d2): a weight piece of two int8 digits
MMQ_D2_SMEM = MMQ_STAGES * (MMQ_STAGE + MMQ_BN * MMQ_BKB * QK + 8)
# the variants' __launch_bounds__ minimum (mmq itself takes 3), and how often their shared memory fits an SM
MMQ_BLOCKS_PER_SM = 2


def mmq_tiles(rows: int, k: int, tile: int) -> tuple[int, int]:
    """(row tiles, stages of MMQ_BKB quant blocks) of an mmq-layout operand."""
    return cdiv(rows, tile), cdiv(k // QK, MMQ_BKB)


def mmq_splits(sm_count: int, m: int, n: int, k: int) -> int:
    """Split K when the output tiles alone would leave SMs idle: as many splits as keep the grid within one
    wave (rounding up would start a second, mostly empty wave)."""
    tiles = cdiv(n, MMQ_BN) * cdiv(m, MMQ_BM)
    stages = cdiv(k // QK, MMQ_BKB)
    return max(1, min(stages, (MMQ_BLOCKS_PER_SM * sm_count) // tiles)) if tiles < sm_count else 1


# gemv's M = 1 kernel for the grouped formats (gemv.cu gemv1_<type>_s<S>): warps a weight row's K is split over,
# the fastest on the H100 (docs/performance.md: kernels at the limit); 1 for the others
GROUPS_SPLIT = {"Q2_K": 2, "Q5_K": 2}


def groups_split(type_name: str) -> int:
    """S of gemv1_<type>_s<S>: a 256-thread block takes 8 / S weight rows."""
    return GROUPS_SPLIT.get(type_name, 1)


CHUNK_BLOCKS = 64  # common.cuh: K's chunk in gemv's layouts, and the skinny kernel's stage
SKINNY_KB, SKINNY_ROWS, SKINNY_THREADS = CHUNK_BLOCKS, 16, 288  # as gemv.cu: quant blocks a stage, weight rows, threads
FUSED_ROWS = 16  # gemv.cu's FUSED_ROWS: the weight rows (a warp each) of a block of gemv1_fused


def takes_skinny(type_name: str, m: int) -> bool:
    """Whether gemv runs a grouped format's product of m activation rows (2..8) on the skinny MMA: from its groups.py
    `skinny_min_m` rows (0: never).  The skinny kernel's cost hardly moves with M, gemv_groups' grows by a weight
    pass a row, so each format has a row count where they cross (measured; kernels-at-the-limit.md)."""
    fmt = GROUPED.get(type_name)
    return fmt is not None and 0 < fmt.skinny_min_m <= m


SKINNY_SMEM = 110_000  # a block's stage buffers at most: two blocks an SM (228 KiB, with their 4 KiB sums and 1 KiB)


def chunk_bytes(block_bytes: int, blocks: int, super_bytes: int = 0) -> int:
    """common.cuh ChunkedRows::chunk_bytes: a chunk of `blocks` legacy blocks (quants, fifth bits, scales), and
    `super_bytes` a super-block of 8 of them (Q4_KR), padded to 16 bytes."""
    return cdiv(blocks * block_bytes + blocks // 8 * super_bytes, 16) * 16


def chunked_row_bytes(block_bytes: int, kb: int, super_bytes: int = 0) -> int:
    """ChunkedRows::row_bytes: a weight row of kb blocks as chunks."""
    full = kb // CHUNK_BLOCKS * chunk_bytes(block_bytes, CHUNK_BLOCKS, super_bytes)
    return full + chunk_bytes(block_bytes, kb % CHUNK_BLOCKS, super_bytes)


def skinny_weights(block_bytes: int | None = None, scale_bytes: int | None = None,
                   run_bytes: tuple[int, ...] = (), field_bytes: int = 0) -> int:
    """A stage's 16 weight rows in the skinny kernel's shared memory (gemv.cu F::WEIGHTS): a legacy format's chunks
    (`block_bytes`), a code-book format's quants and scales (`scale_bytes` a block), or a K-quant's value runs
    (`run_bytes` a super-block each, groups.py skinny_run_bytes), each row padded, and its scale fields
    (`field_bytes` a super-block, unpadded)."""
    if block_bytes is not None:
        return SKINNY_ROWS * (CHUNK_BLOCKS * block_bytes + 16)
    if run_bytes:
        runs = sum(CHUNK_BLOCKS // 8 * b + 16 for b in run_bytes)
        return SKINNY_ROWS * (runs + CHUNK_BLOCKS // 8 * field_bytes)
    return SKINNY_ROWS * ((CHUNK_BLOCKS * 16 + 16) + (CHUNK_BLOCKS * scale_bytes + 48))


ACT_ROW, ACT_DS_ROW = CHUNK_BLOCKS * QK + 16, CHUNK_BLOCKS + 4  # common.cuh: a padded row part of activations


def skinny_stage(weights: int, m: int) -> int:
    """SkinnySmem<F>::stage(M): the weights, then the chunk's M padded row parts of int8 activations and M of
    (d, s)."""
    return weights + m * (ACT_ROW + 4 * ACT_DS_ROW)


def skinny_stages(stage: int) -> int:
    """Stage buffers of the skinny kernel: as many as SKINNY_SMEM holds, 2 to 4."""
    return max(2, min(4, SKINNY_SMEM // stage))


def skinny_chunks(sm_count: int, n: int, k: int) -> tuple[int, int]:
    """(chunks of SKINNY_KB quant blocks a split, splits) of the skinny kernel: K split over as many blocks as keep
    two an SM busy when the row blocks alone leave SMs idle."""
    blocks, chunks = cdiv(n, SKINNY_ROWS), cdiv(k // QK, SKINNY_KB)
    splits = max(1, min(chunks, (2 * sm_count) // blocks)) if blocks < sm_count else 1
    per = cdiv(chunks, splits)
    return per, cdiv(chunks, per)


# The mmq-layout quantizers (q8_1.cu): (rows, quant blocks) a warp takes
QUANTIZE_MMQ_WARP = {"quantize_q8_1_mmq": (4, 1), "quantize_q8_1_mmq2": (4, 2), "quantize_q8_1_mmq4": (4, 4),
                     "quantize_q8_1_mmq_pair": (8, 2)}


def quantize_mmq_warps(name: str, m: int, k: int) -> int:
    rows, blocks = QUANTIZE_MMQ_WARP[name]
    return cdiv(m, rows) * cdiv(k // QK, blocks)


def quantize_mmq_kernel(sm_count: int, m: int, k: int, sums: bool = False) -> str:
    """The mmq-layout quantizer for this size.  `quantize_q8_1_mmq_pair` (2 lanes a block, a quarter of the
    instructions) once it has ~16 warps an SM; below that the 8-lane kernels' 4x more threads hide latency
    better (H100, alone: M=128 K=4096 2.3 against 2.6 us; M=128 K=14336 4.3 against 3.8), taking 1 block a
    warp while that fits in about one wave (64 warps an SM), more when there are waves to spare, so that
    each thread has several loads in flight.  `sums` (formats with a minimum): the pair kernel writes none."""
    if not sums and quantize_mmq_warps("quantize_q8_1_mmq_pair", m, k) >= 16 * sm_count:
        return "quantize_q8_1_mmq_pair"
    warps, wave = quantize_mmq_warps("quantize_q8_1_mmq", m, k), 64 * sm_count
    return "quantize_q8_1_mmq" if warps <= wave else "quantize_q8_1_mmq2" if warps <= 4 * wave else "quantize_q8_1_mmq4"
