"""4-bit dequantizing GEMM: ``out = x @ dequant(weight).T + bias`` with GPTQ-packed weights.

The weight ([N out, K in]) is an ``Int4Weight`` in the engine's one 4-bit layout (GPTQ's packing;
AWQ checkpoints are repacked to it at load, ``engine.models.quantized``):

| tensor | shape | holds |
| --- | --- | --- |
| qweight | int32 [K / 8, N] | nibble ``i`` (bits ``4i .. 4i+3``) of word ``[p, n]`` is ``q[8p + i, n]`` in 0..15 |
| scales, zeros | [G, N], x's dtype | per group and column: ``w[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n]`` |
| g_idx | int32 [K] or None | the group of row k (GPTQ act-order); None: ``k // group_size`` |
| perm | int32 [K] or None | the column of x that row k multiplies (act-order rows sorted by group); None: k |

Program ``(m, n, s)`` owns rows ``[m * BLOCK_M, ...)`` of x, the ``BLOCK_N`` output columns from
``n * BLOCK_N`` and the ``s``-th of ``SPLIT_K`` chunks of K, walked in ``BLOCK_K``-row tiles: it reads
each packed word once (``[BLOCK_K / 8, BLOCK_N]`` int32, coalesced along N; the first tile before the PDL
wait, see ``_pdl``) and takes its eight nibbles one at a time (nibble j of every word: weight rows
``8p + j``, against x's columns ``8p + j``; no reshape of the tile, which would move it through shared
memory):

- decode, one row (``BLOCK_M = 1``): FMA products kept per word row in a ``[BLOCK_N / SUB_N, ROWS, SUB_N]``
  accumulator and reduced over its rows once at the end. Inside one group each nibble is masked in place and
  read as a denormal float (``_nibble_denormal``) against x scaled by the power of two that makes up for its
  bit position: a logic op and an FMA a nibble, exact (``_row_tile``). A bfloat16 x is read as int32 pairs
  (``X_PAIRS``), which the compiler pipelines with the weights (two-byte loads it does not). The shapes steer
  the compiler's layout (sm_90 SASS of Triton 3.6, compiled offline): the [2, 16, 32] tile of 64 columns gives a
  thread two word rows of four columns (16-byte loads), and x's work (a load, a scale and a sum a value) serves
  four columns: 312 instructions a loop step of 64 nibbles a thread. ``Int4Config.rows`` splits a tile's
  ``BLOCK_K / 8`` word rows into loads of ROWS rows whose products add into the same registers; with the zero
  and scale read in the words' full shape (eight bfloat16 a 16-byte load), a thread holds eight columns of
  one row a load: 256 columns in four loads of 4 rows take 859 instructions a step of 256 nibbles (3.4 a
  nibble, against 4.9). Fewer instructions are not always faster: ``_config`` has the times;
- several rows: eight ``tl.dot`` a tile (x padded to 16 rows for small batches; prefill in 32- or 64-row
  tiles). A bfloat16 x with a group a tile (``BF16_NIBBLES``) multiplies bfloat16 ``128 + q``
  (``_offset_nibbles``: on the GPU one PTX block turns two words into eight registers of nibble pairs, about one
  instruction a nibble, no conversion; the offset joins the zero); other tiles turn each nibble into float32
  by a mantissa trick (``_nibbles``: a mask, an or and a subtraction; no int-to-float conversion);
- ``Int4Config.expand`` (several rows; not a default until a GPU sweep says so, ``bench.quant_gemm_bench``
  times it): one dot a tile instead of eight; each weight row reads its word (``k // 8``, eight rows to a
  word, the repeats from the cache) and shifts out its nibble, a [BLOCK_K, BLOCK_N] tile with no reshape;
- a tile inside one group (``GROUP_PER_TILE``: no g_idx, BLOCK_K dividing the group) multiplies the raw
  values and applies the group's zero and scale to the product, ``(x @ q - sum(x) * z) * s``; other
  tiles gather each row's group and dequantize first;
- one bfloat16 row of a wide or deep weight (``Int4Config.idot``, ``_config``; gate_up and down of Llama-2-7B), or
  two rows of any weight from 4,096 x 4,096: integer dot products. A launch of its own (``_x_bytes_kernel``, a
  program per row and two tiles) rounds x to integers per tile of 128 columns,
  ``x * 2^(13 - e)`` with e the exponent of the tile's largest magnitude (|.| < 2^14: x's error at most 2^-14 of
  that magnitude), and writes each word row's low and high bytes of its even and odd columns; the walk
  (``_int4_row_idot_kernel``) takes a word's even nibbles in place (``w & 0x0F0F0F0F``) and its odd ones times 16
  (``w & 0xF0F0F0F0``) against them in four dp4a (``_IDOT_PTX``; two logic ops and four integer dot products
  for eight nibbles, where the FMA walk spends at least two instructions a nibble; a second row of x reuses the
  taken-apart word: four more dp4a), sums a tile in int32 and folds it once with the group's scale and x's scale;
  zeros as above;
- decode splits K so that the SMs get about two programs each (``_config``).

Several splits store float32 partials that ``skinny_gemm``'s reduce kernel sums in split order (no
atomics: bit-reproducible). Summing them in each tile's last program instead (an acq_rel counter per
tile, bit-equal) was slower on one H200 (stop 62: random GPTQ Llama-2-7B, ``bench.profile_step``, GPU
step at batch 1 2.40 -> 2.51 ms, at batch 8 5.47-5.48 -> 6.03-6.04). ``int4_gemm_ref`` dequantizes to
float32 and multiplies.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._checks import (check_bias, check_last_dim_contiguous, check_same_dtype, check_shape, check_tensor,
                      upcast_dots)
from ._pdl import allow_next_kernel, launch_options, wait_for_prior_kernel
from ._rounding import round_to
from .skinny_gemm import MAX_SPLIT_K, device_sms, reduce_split_k, split_k_partials, split_layout

PACK = 8
DENORMAL_SHIFT: tl.constexpr = tl.constexpr(64)   # S of _row_tile: x_j q_j 2^-S summed (|x| < 2^43 stays finite)


@dataclass
class Int4Weight:
    """A 4-bit linear weight [N, K] (see the module's table)."""
    qweight: torch.Tensor             # int32 [K / 8, N]
    scales: torch.Tensor              # [G, N]
    zeros: torch.Tensor               # [G, N]
    g_idx: torch.Tensor | None        # int32 [K], or None: row k is in group k // group_size
    group_size: int                   # rows per group when g_idx is None
    perm: torch.Tensor | None = None  # int32 [K]: row k multiplies x[:, perm[k]]; None: x[:, k]

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[1], self.qweight.shape[0] * PACK


class Int4Config(NamedTuple):
    block_m: int      # 1: the FMA path; >= 16: the dot path
    block_n: int
    block_k: int      # a multiple of 8; the dot path: of 128 (eight dots of BLOCK_K / 8 >= 16 rows), expanded: >= 16
    split_k: int
    num_warps: int
    num_stages: int
    expand: bool = False   # the dot path with one [BLOCK_K, BLOCK_N] tile a step (each word read for 8 rows)
    sub_n: int = 0         # one row: [block_n / sub_n, rows, sub_n] loads (0: sub_n = block_n), see the module
    rows: int = 0          # one row: word rows a load, block_k / (8 rows) loads a tile (0: block_k / 8, one load)
    idot: bool = False     # 1-2 bfloat16 rows by integer dot products (block_m: x's rows; block_k 128; rows: word
                           # rows a load, 0: 16)


@triton.jit
def _nibbles(packed, J: tl.constexpr):
    """q[8p + J, n] (0..15) of packed words ``packed`` [BLOCK_K / 8, BLOCK_N] as float32, with no int-to-float
    conversion: nibble i of a 16-bit half (J = 4h + i) is masked into a float's mantissa whose exponent makes its
    last bit worth 1 (``2^(23 - 4i) + q``) and the leading power of two taken away, both exact: one logic op and
    one subtraction a nibble. The upper half is shifted down first, once a word (the compiler shares the shift
    between its four nibbles); its sign bits are masked away."""
    half = packed >> (16 * (J // 4))
    i: tl.constexpr = J % 4
    return ((half & (15 << (4 * i))) | ((150 - 4 * i) << 23)).to(tl.float32, bitcast=True) - (1 << (23 - 4 * i))


NIBBLE_OFFSET: tl.constexpr = tl.constexpr(128)   # bfloat16 0x4300 | q is 128 + q: the value _offset_nibbles gives


def _nibble_pairs_ptx() -> str:
    """PTX of _offset_nibbles: two words w0, w1 ($8, $9) give eight registers ($0..$7), register j holding nibble j
    of w0 (low half) and of w1 (high half) as bfloat16 128 + q: the words' low halves paired (prmt), then the high
    halves, each shifted by 0/4/8/12 bits and masked and or-ed with 0x4300 in one lop3 ((a & b) | c)."""
    lines = [".reg .b32 lo, hi, t;", "prmt.b32 lo, $8, $9, 0x5410;", "prmt.b32 hi, $8, $9, 0x7632;"]
    for j in range(8):
        half = "lo" if j < 4 else "hi"
        if j % 4:
            lines.append(f"shr.u32 t, {half}, {4 * (j % 4)};")
        lines.append(f"lop3.b32 ${j}, {'t' if j % 4 else half}, 0x000f000f, 0x43004300, 0xea;")
    return "{\n" + "\n".join(lines) + "\n}"


_NIBBLE_PAIRS_PTX: tl.constexpr = tl.constexpr(_nibble_pairs_ptx())   # 16 instructions for 16 nibbles


@triton.jit
def _offset_nibbles(packed, HW_ASM: tl.constexpr):
    """The eight nibbles of the words ``packed`` [BLOCK_K / 8, BLOCK_N] as eight bfloat16 tiles of the same shape,
    tile j holding ``128 + q[8p + j, n]`` (exact: 8 significant bits), ready for a bfloat16 dot. On the GPU one
    inline PTX block takes two words a time and writes each pair of values into one register, a bfloat16 pair
    (16 instructions for 16 nibbles: ``_NIBBLE_PAIRS_PTX``); the interpreter shifts and masks the same values."""
    if HW_ASM:
        return tl.inline_asm_elementwise(
            _NIBBLE_PAIRS_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [packed],
            dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16,
                   tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16), is_pure=True, pack=2)
    else:
        return (_offset_nibble(packed, 0), _offset_nibble(packed, 1), _offset_nibble(packed, 2),
                _offset_nibble(packed, 3), _offset_nibble(packed, 4), _offset_nibble(packed, 5),
                _offset_nibble(packed, 6), _offset_nibble(packed, 7))


@triton.jit
def _offset_nibble(packed, J: tl.constexpr):
    """128 + nibble J of the words as bfloat16 (the interpreter's int-to-bfloat16 cast keeps bits: via float32)."""
    return (((packed >> (4 * J)) & 15) + NIBBLE_OFFSET).to(tl.float32).to(tl.bfloat16)


@triton.jit
def _x_columns(x_row, perm_ptr, k0, words, j: tl.constexpr, K, HAS_PERM: tl.constexpr, EVEN_K: tl.constexpr,
               X_PAIRS: tl.constexpr):
    """One row of x at weight rows ``k0 + 8 * words + j`` as float32 (shaped as ``words``). EVEN_K (every
    row < K) without perm: no masks, one pointer a word row and j an immediate offset; X_PAIRS (bfloat16 x,
    EVEN_K, no perm): the int32 holding columns j and j + 1 (even j), read once for both, its half shifted or
    masked into a float32 (bfloat16 is float32's upper half). Four-byte loads are pipelined with the weight
    tiles, two-byte ones are not."""
    k = k0 + words * 8 + j
    if X_PAIRS:
        pairs = x_row.to(tl.pointer_type(tl.int32), bitcast=True) + k0 // 2 + words.to(tl.int64) * 4
        v = tl.load(pairs + j // 2)
        x = (v << 16) if j % 2 == 0 else (v & -65536)
        x = x.to(tl.float32, bitcast=True)
    elif EVEN_K:
        if HAS_PERM:
            x = tl.load(x_row + tl.load(perm_ptr + k))
        else:
            x = tl.load(x_row + k0 + words.to(tl.int64) * 8 + j)
    else:
        mask = k < K
        if HAS_PERM:
            k = tl.load(perm_ptr + k, mask=mask, other=0)
        x = tl.load(x_row + k, mask=mask, other=0.0)
    return x.to(tl.float32)


@triton.jit
def _x_rows(x_rows, perm_ptr, m_mask, k, K, HAS_PERM: tl.constexpr):
    """x [BLOCK_M, BLOCK_K / 8] at weight rows ``k``: columns k, or perm[k] (act-order rows sorted by group)."""
    mask = m_mask[:, None] & (k < K)[None, :]
    if HAS_PERM:
        k = tl.load(perm_ptr + k, mask=k < K, other=0)
    return tl.load(x_rows + k[None, :], mask=mask, other=0.0)


@triton.jit
def _dequantized(q, scales_ptr, zeros_ptr, g_idx_ptr, k, K, N, group_size, col_offsets, HAS_G_IDX: tl.constexpr):
    """(q - zeros[g]) * scales[g] of weight rows ``k``, each with its own group g (float32); ``k`` is shaped as the
    tile's row axis and ``col_offsets`` as its column axis ([BLOCK_K or BLOCK_K / 8, 1] and [1, BLOCK_N], or one-row
    [1, ROWS, 1] and [BLOCK_N / SUB_N, 1, SUB_N])."""
    if HAS_G_IDX:
        group = tl.load(g_idx_ptr + k, mask=k < K, other=0)
    else:
        group = tl.minimum(k, K - 1) // group_size
    offsets = group.to(tl.int64) * N + col_offsets
    return (q - tl.load(zeros_ptr + offsets).to(tl.float32)) * tl.load(scales_ptr + offsets).to(tl.float32)


@triton.jit
def _group_of_tile(scales_ptr, zeros_ptr, k0, N, group_size, col_offsets):
    """The zero and scale (float32, shaped as ``col_offsets``) of the one group a tile lies in."""
    group = k0 // group_size
    z = tl.load(zeros_ptr + group * N + col_offsets).to(tl.float32)
    s = tl.load(scales_ptr + group * N + col_offsets).to(tl.float32)
    return z, s


@triton.jit
def _power_of_two(e: tl.constexpr):
    """2^e as a float32 scalar (a normal float: -126 <= e <= 127), built from its bits."""
    return tl.full([], (127 + e) << 23, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _nibble_bit(J: tl.constexpr):
    """The lowest bit of nibble J in the word ``_nibble_denormal`` masks: 4J; nibbles 5-7 (bits 20-31, which
    would reach a float's exponent) from the word shifted down by 12 bits."""
    return 4 * J if J < 5 else 4 * J - 12


@triton.jit
def _nibble_denormal(packed, J: tl.constexpr):
    """Nibble J of the words ``packed`` in place, as float32 bits: ``q * 2^(b - 149)`` exactly, b its
    ``_nibble_bit`` (a denormal, or 0): one logic op a nibble, and one shift a word for nibbles 5-7
    (``_row_tile`` scales x to make up the power of two)."""
    word = packed if J < 5 else packed >> 12
    return (word & (15 << _nibble_bit(J))).to(tl.float32, bitcast=True)


@triton.jit
def _row_tile(acc, x_row, perm_ptr, packed, qw_ptr, scales_ptr, zeros_ptr, g_idx_ptr, k0, N, K, group_size,
              col_offsets, HAS_G_IDX: tl.constexpr, HAS_PERM: tl.constexpr, GROUP_PER_TILE: tl.constexpr,
              BLOCK_K: tl.constexpr, ROWS: tl.constexpr, EVEN_K: tl.constexpr, X_PAIRS: tl.constexpr):
    """One row of x (decode at batch 1): FMA products into ``acc`` [BLOCK_N / SUB_N, ROWS, SUB_N], reduced over its
    rows once after the loop. The tile's word rows come in ``BLOCK_K / (8 ROWS)`` loads of ROWS rows (``packed``:
    the first, read by the caller), each load's products added into the same ``t``, so a thread's rows of one group
    share its fold. Inside one group: ``acc += (sum_j x_j q_j - sum_j x_j * z) * s`` per column, with each nibble
    taken in place as a denormal (``_nibble_denormal``: q * 2^(b - 149)) against x_j * 2^(149 - b - S): the products
    are x_j q_j 2^-S exactly, so the sum rounds as the sum of x_j q_j would (powers of two commute with rounding
    while every value stays normal: |x| < 2^(S - 21), |x q| >= 2^(S - 126)); the fold takes the 2^S into the scale
    and 2^-S into x's sum (the same roundings). Two operations a nibble (a logic op and an FMA) instead of four.
    Other tiles dequantize each nibble (``_nibbles``) with its own group."""
    rows = tl.arange(0, ROWS)
    t = tl.zeros(acc.shape, dtype=tl.float32)
    x_sum = tl.zeros([1, ROWS, 1], dtype=tl.float32)
    for r in tl.static_range(BLOCK_K // (8 * ROWS)):
        words = r * ROWS + rows
        if r > 0:
            packed = _load_words(qw_ptr, (k0 // 8 + words)[None, :, None], N, K, col_offsets, EVEN_K)
        for j in tl.static_range(8):
            x = _x_columns(x_row, perm_ptr, k0, words, j, K, HAS_PERM, EVEN_K, X_PAIRS)[None, :, None]
            if GROUP_PER_TILE:
                x_sum += x
                t += (x * _power_of_two(149 - _nibble_bit(j) - DENORMAL_SHIFT)) * _nibble_denormal(packed, j)
            else:
                q = _dequantized(_nibbles(packed, j), scales_ptr, zeros_ptr, g_idx_ptr,
                                 (k0 + words * 8 + j)[None, :, None], K, N, group_size, col_offsets, HAS_G_IDX)
                t += x * q
    if GROUP_PER_TILE:
        if ROWS < BLOCK_K // 8:   # several loads: the zero and scale read in the words' full shape (see _config)
            z, s = _group_of_tile(scales_ptr, zeros_ptr, k0, N, group_size, col_offsets + rows[None, :, None] * 0)
        else:
            z, s = _group_of_tile(scales_ptr, zeros_ptr, k0, N, group_size, col_offsets)
        t = (t - x_sum * _power_of_two(-DENORMAL_SHIFT) * z) * (s * _power_of_two(DENORMAL_SHIFT))
    return acc + t


@triton.jit
def _dot(x, w, UPCAST: tl.constexpr):
    if UPCAST:  # IEEE fp32 dots (the interpreter's half-precision dot is not exact)
        return tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    return tl.dot(x, w.to(x.dtype))


@triton.jit
def _rows_tile(acc, x_rows, perm_ptr, m_mask, packed, scales_ptr, zeros_ptr, g_idx_ptr, k0, N, K, group_size,
               col_offsets,
               HAS_G_IDX: tl.constexpr, HAS_PERM: tl.constexpr, GROUP_PER_TILE: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, BF16_NIBBLES: tl.constexpr,
               HW_ASM: tl.constexpr):
    """Several rows of x: eight dots a tile, one per nibble j (x's columns 8p + j against nibble j of every
    word), into ``acc`` [BLOCK_M, BLOCK_N]; inside one group ``(x @ q - sum(x) * z) * s`` as above. BF16_NIBBLES
    (bfloat16 x, a group a tile): the dots take ``_offset_nibbles``' bfloat16 128 + q, and the offset joins the
    zero, ``(x @ (q + 128) - sum(x) * (z + 128)) * s``; else each nibble is made float32 (``_nibbles``)."""
    words = tl.arange(0, BLOCK_K // 8)
    t = tl.zeros(acc.shape, dtype=tl.float32)
    x_sum = tl.zeros([BLOCK_M, 1], dtype=tl.float32)
    if BF16_NIBBLES:
        qs = _offset_nibbles(packed, HW_ASM)
    for j in tl.static_range(8):
        k = k0 + words * 8 + j
        x = _x_rows(x_rows, perm_ptr, m_mask, k, K, HAS_PERM)
        if BF16_NIBBLES:
            q = qs[j]
        else:
            q = _nibbles(packed, j)
        if GROUP_PER_TILE:
            x_sum += tl.sum(x.to(tl.float32), axis=1)[:, None]
        else:
            q = _dequantized(q, scales_ptr, zeros_ptr, g_idx_ptr, k[:, None], K, N, group_size, col_offsets,
                             HAS_G_IDX)
        t += _dot(x, q, UPCAST)
    if GROUP_PER_TILE:
        z, s = _group_of_tile(scales_ptr, zeros_ptr, k0, N, group_size, col_offsets)
        if BF16_NIBBLES:
            z += NIBBLE_OFFSET
        t = (t - x_sum * z) * s
    return acc + t


@triton.jit
def _expanded_tile(acc, packed, x_rows, perm_ptr, m_mask, scales_ptr, zeros_ptr, g_idx_ptr, k0, N, K, group_size,
                   col_offsets, HAS_G_IDX: tl.constexpr, HAS_PERM: tl.constexpr, GROUP_PER_TILE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """Several rows of x, one dot a tile: weight row k holds its word ``k // 8`` (``_load_packed`` with EXPAND)
    and shifts out its own nibble, so the tile is [BLOCK_K, BLOCK_N] with no reshape; inside one group
    ``(x @ q - sum(x) * z) * s`` as above."""
    k = k0 + tl.arange(0, BLOCK_K)
    q = (((packed >> ((k % 8) * 4)[:, None]) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    x = _x_rows(x_rows, perm_ptr, m_mask, k, K, HAS_PERM)
    if GROUP_PER_TILE:
        z, s = _group_of_tile(scales_ptr, zeros_ptr, k0, N, group_size, col_offsets)
        x_sum = tl.sum(x.to(tl.float32), axis=1)[:, None]
        acc += (_dot(x, q, UPCAST) - x_sum * z) * s
    else:
        acc += _dot(x, _dequantized(q, scales_ptr, zeros_ptr, g_idx_ptr, k[:, None], K, N, group_size, col_offsets,
                                    HAS_G_IDX), UPCAST)
    return acc


@triton.jit
def _load_words(qw_ptr, words, N, K, col_offsets, EVEN_K: tl.constexpr):
    """The packed words at word rows ``words`` (shaped as the tile's row axis) and ``col_offsets`` (rows past K:
    0). Weights only (no kernel writes them), so the first tile may be read before the PDL wait."""
    offsets = words.to(tl.int64) * N + col_offsets
    if EVEN_K:
        return tl.load(qw_ptr + offsets, eviction_policy="evict_first")
    return tl.load(qw_ptr + offsets, mask=words < K // 8, other=0, eviction_policy="evict_first")


@triton.jit
def _load_packed(qw_ptr, k0, N, K, col_offsets, BLOCK_K: tl.constexpr, EXPAND: tl.constexpr, EVEN_K: tl.constexpr,
                 ROWS: tl.constexpr):
    """The K tile from ``k0``'s packed words: [BLOCK_K / 8, BLOCK_N], each word once; with EXPAND [BLOCK_K,
    BLOCK_N], row k holding word ``k // 8`` (the 8 rows of a word: one load from memory, the rest from the cache);
    one row (ROWS > 0): its first ROWS word rows, [BLOCK_N / SUB_N, ROWS, SUB_N] (``_row_tile`` reads the rest)."""
    if EXPAND:
        k = k0 + tl.arange(0, BLOCK_K)
        packed = tl.load(qw_ptr + (k // 8)[:, None].to(tl.int64) * N + col_offsets, mask=(k < K)[:, None],
                         other=0, eviction_policy="evict_first")
    elif ROWS > 0:
        packed = _load_words(qw_ptr, (k0 // 8 + tl.arange(0, ROWS))[None, :, None], N, K, col_offsets, EVEN_K)
    else:
        packed = _load_words(qw_ptr, (k0 // 8 + tl.arange(0, BLOCK_K // 8))[:, None], N, K, col_offsets, EVEN_K)
    return packed


@triton.jit
def _tile(acc, packed, x_rows, perm_ptr, m_mask, qw_ptr, scales_ptr, zeros_ptr, g_idx_ptr, k0, N, K, group_size,
          col_offsets, HAS_G_IDX: tl.constexpr, HAS_PERM: tl.constexpr, GROUP_PER_TILE: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, EXPAND: tl.constexpr,
          EVEN_K: tl.constexpr, X_PAIRS: tl.constexpr, BF16_NIBBLES: tl.constexpr, HW_ASM: tl.constexpr,
          ROWS: tl.constexpr):
    """``acc`` plus the product of the K tile from ``k0`` (its words ``packed``, from ``_load_packed``): the
    one-row or several-row product, or with EXPAND the one-dot tile of ``_expanded_tile``."""
    if EXPAND:  # (one return after the branches: Triton compiles the code after a constexpr if's return)
        acc = _expanded_tile(acc, packed, x_rows, perm_ptr, m_mask, scales_ptr, zeros_ptr, g_idx_ptr, k0, N, K,
                             group_size, col_offsets, HAS_G_IDX, HAS_PERM, GROUP_PER_TILE, BLOCK_M, BLOCK_K, UPCAST)
    elif BLOCK_M == 1:
        acc = _row_tile(acc, x_rows, perm_ptr, packed, qw_ptr, scales_ptr, zeros_ptr, g_idx_ptr, k0, N, K,
                        group_size, col_offsets, HAS_G_IDX, HAS_PERM, GROUP_PER_TILE, BLOCK_K, ROWS, EVEN_K, X_PAIRS)
    else:
        acc = _rows_tile(acc, x_rows, perm_ptr, m_mask, packed, scales_ptr, zeros_ptr, g_idx_ptr, k0, N, K,
                         group_size, col_offsets, HAS_G_IDX, HAS_PERM, GROUP_PER_TILE, BLOCK_M, BLOCK_K, UPCAST,
                         BF16_NIBBLES, HW_ASM)
    return acc


@triton.jit(do_not_specialize=["M"])
def _int4_gemm_kernel(
    x_ptr, qw_ptr, scales_ptr, zeros_ptr, g_idx_ptr, perm_ptr, bias_ptr, out_ptr,
    M, N, K, k_per_split, stride_xm, stride_om, stride_split, group_size: tl.constexpr,
    HAS_G_IDX: tl.constexpr, HAS_PERM: tl.constexpr, GROUP_PER_TILE: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
    EVEN_K: tl.constexpr, X_PAIRS: tl.constexpr, EXPAND: tl.constexpr, BF16_NIBBLES: tl.constexpr,
    HW_ASM: tl.constexpr, SUB_N: tl.constexpr, ROWS: tl.constexpr, NUM_STAGES: tl.constexpr, WHILE_LOOP: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    # past-the-end columns re-read valid ones (no N mask on the weight loads)
    if BLOCK_M == 1:  # one row: its pointer, products kept per load row until the end, sub-tiles of SUB_N columns
        x_rows = x_ptr + pid_m.to(tl.int64) * stride_xm
        sub = tl.arange(0, BLOCK_N // SUB_N)[:, None] * SUB_N + tl.arange(0, SUB_N)[None, :]
        col_offsets = ((pid_n * BLOCK_N + sub) % N)[:, None, :]
        acc = tl.zeros([BLOCK_N // SUB_N, ROWS, SUB_N], dtype=tl.float32)
    else:
        x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
        col_offsets = (offs_n % N)[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # The first tile's words are read before waiting for the previous kernel (weights are never written), so with
    # PDL their load overlaps that kernel's tail; every split has at least one tile (split_layout).
    packed = _load_packed(qw_ptr, k_begin, N, K, col_offsets, BLOCK_K, EXPAND, EVEN_K, ROWS)
    wait_for_prior_kernel(PDL)
    allow_next_kernel(PDL)
    acc = _tile(acc, packed, x_rows, perm_ptr, m_mask, qw_ptr, scales_ptr, zeros_ptr, g_idx_ptr, k_begin, N, K,
                group_size, col_offsets, HAS_G_IDX, HAS_PERM, GROUP_PER_TILE, BLOCK_M, BLOCK_K, UPCAST, EXPAND,
                EVEN_K, X_PAIRS, BF16_NIBBLES, HW_ASM, ROWS)
    if WHILE_LOOP:  # the CPU interpreter cannot take runtime `range` bounds
        k0 = k_begin + BLOCK_K
        while k0 < k_end:
            packed = _load_packed(qw_ptr, k0, N, K, col_offsets, BLOCK_K, EXPAND, EVEN_K, ROWS)
            acc = _tile(acc, packed, x_rows, perm_ptr, m_mask, qw_ptr, scales_ptr, zeros_ptr, g_idx_ptr, k0, N, K,
                        group_size, col_offsets, HAS_G_IDX, HAS_PERM, GROUP_PER_TILE, BLOCK_M, BLOCK_K, UPCAST,
                        EXPAND, EVEN_K, X_PAIRS, BF16_NIBBLES, HW_ASM, ROWS)
            k0 += BLOCK_K
    else:           # pipelined weight loads on the GPU
        for k0 in tl.range(k_begin + BLOCK_K, k_end, BLOCK_K, num_stages=NUM_STAGES):
            packed = _load_packed(qw_ptr, k0, N, K, col_offsets, BLOCK_K, EXPAND, EVEN_K, ROWS)
            acc = _tile(acc, packed, x_rows, perm_ptr, m_mask, qw_ptr, scales_ptr, zeros_ptr, g_idx_ptr, k0, N, K,
                        group_size, col_offsets, HAS_G_IDX, HAS_PERM, GROUP_PER_TILE, BLOCK_M, BLOCK_K, UPCAST,
                        EXPAND, EVEN_K, X_PAIRS, BF16_NIBBLES, HW_ASM, ROWS)
    if BLOCK_M == 1:
        acc = tl.reshape(tl.sum(acc, axis=1), [1, BLOCK_N])
    store_tile(acc, out_ptr, bias_ptr, offs_m, offs_n, m_mask, n_mask, pid_k, stride_om, stride_split,
               HAS_BIAS, SPLIT)


@triton.jit
def store_tile(acc, out_ptr, bias_ptr, offs_m, offs_n, m_mask, n_mask, pid_k, stride_om, stride_split,
               HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
    """A program's float32 [BLOCK_M, BLOCK_N] result: with SPLIT, its K chunk's partial into slice ``pid_k`` (the
    reduce kernel adds the bias); else with the bias, rounded to out's dtype. Shared with ``fp8_gemm``."""
    out_offs = offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT:
        tl.store(out_ptr + pid_k * stride_split + out_offs, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + out_offs, round_to(acc, out_ptr.dtype.element_ty), mask=out_mask)


# ---- one or two bfloat16 rows by integer dot products (``Int4Config.idot``) ----------------------------------------

IDOT_TILE = 128        # x's quantization tile and the walk's K tile (inside one group)
IDOT_BLOCK_N = 256     # the walk's columns a program (N a multiple of it)
IDOT_X_TILES = 2       # x tiles a program of _x_bytes_kernel (1 warp)
IDOT_MIN_N, IDOT_MIN_K = 16384, 8192    # _config takes the walk from here (measured: see _config)
IDOT_DEEP_MIN_N = 4096                  # ... a deep weight from this N on (narrower ones not measured)
IDOT_MAX_ROWS = 2      # rows of x the walk takes (one program holds them all)
IDOT_PAIR_MIN_K = 4096                  # two rows take the walk from this K on (with N >= IDOT_DEEP_MIN_N)
_X_MAGIC: tl.constexpr = tl.constexpr(12582912.0)     # 1.5 * 2^23: v + it rounds v to an integer in its low bits
_X_MAGIC_BITS: tl.constexpr = tl.constexpr(1262485504)


def _idot_ptx(split: bool) -> str:
    """PTX of ``_idot``: a word's even nibbles (w & 0x0F0F0F0F) and its odd ones times 16 (w & 0xF0F0F0F0), each
    against x's low (unsigned) and high (signed) bytes of the same rows: two logic ops and four dp4a a word; with
    ``split`` the even and odd nibbles come taken apart ($8, $9) and only the dp4a are here."""
    even, odd, x = ("$8", "$9", 10) if split else ("e", "o", 9)
    return "\n".join(["{"] + ([] if split else [".reg .b32 e, o;", "and.b32 e, $8, 0x0F0F0F0F;",
                                                "and.b32 o, $8, 0xF0F0F0F0;"]) +
                     [f"dp4a.u32.u32 $0, {even}, ${x}, $4;", f"dp4a.u32.s32 $1, {even}, ${x + 1}, $5;",
                      f"dp4a.u32.u32 $2, {odd}, ${x + 2}, $6;", f"dp4a.u32.s32 $3, {odd}, ${x + 3}, $7;", "}"])


_IDOT_PTX: tl.constexpr = tl.constexpr(_idot_ptx(False))
_IDOT_SPLIT_PTX: tl.constexpr = tl.constexpr(_idot_ptx(True))


@triton.jit
def _dp4a(a, b, c, B_SIGNED: tl.constexpr):
    """c + the dot product of a's four unsigned bytes with b's (signed or not): dp4a for the interpreter."""
    for i in tl.static_range(4):
        if B_SIGNED:
            b_byte = (b << (24 - 8 * i)) >> 24
        else:
            b_byte = (b >> (8 * i)) & 255
        c += ((a >> (8 * i)) & 255) * b_byte
    return c


@triton.jit
def _idot(w, x_el, x_eh, x_ol, x_oh, a_el, a_eh, a_ol, a_oh, HW_ASM: tl.constexpr, SPLIT_W: tl.constexpr):
    """The four integer sums a word adds to: even nibbles x low bytes, even x high, odd (times 16) x low, odd x
    high (``_IDOT_PTX`` on the GPU). ``SPLIT_W`` (several rows of x: w [1, ROWS, BLOCK_N] against their bytes [M,
    ROWS, 1]): the nibbles are taken apart once, outside the PTX, for all the rows. One row keeps them inside it:
    taking them apart outside made one H200's batch-1 GPTQ Llama-2-7B step 2.18 -> 2.39 ms (stop 70, with [1, ROWS,
    BLOCK_N] tiles for one row)."""
    if HW_ASM and not SPLIT_W:
        a_el, a_eh, a_ol, a_oh = tl.inline_asm_elementwise(
            _IDOT_PTX, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r", [a_el, a_eh, a_ol, a_oh, w, x_el, x_eh, x_ol, x_oh],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
        return a_el, a_eh, a_ol, a_oh
    even = w & 0x0F0F0F0F
    odd = w & -252645136       # 0xF0F0F0F0
    if HW_ASM:
        a_el, a_eh, a_ol, a_oh = tl.inline_asm_elementwise(
            _IDOT_SPLIT_PTX, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r",
            [a_el, a_eh, a_ol, a_oh, even, odd, x_el, x_eh, x_ol, x_oh],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        a_el = _dp4a(even, x_el, a_el, False)
        a_eh = _dp4a(even, x_eh, a_eh, True)
        a_ol = _dp4a(odd, x_ol, a_ol, False)
        a_oh = _dp4a(odd, x_oh, a_oh, True)
    return a_el, a_eh, a_ol, a_oh


@triton.jit
def _byte(v, SHIFT: tl.constexpr, I: tl.constexpr):
    """Byte SHIFT / 8 of v, moved to byte I."""
    return ((v >> SHIFT) & 255) << (8 * I)


@triton.jit
def _non_finite(pair):
    """1 where either bfloat16 of an int32 pair has an exponent of all ones (inf or NaN), else 0."""
    return (((pair & 0x7F80) == 0x7F80) | ((pair & 0x7F800000) == 0x7F800000)).to(tl.int32)


@triton.jit
def _x_bytes(x_ptr, xq_ptr, xt_ptr, k_begin, n_tiles, tile0, TILES: tl.constexpr):
    """x's tiles ``tile0 ..`` (``n_tiles`` of them, from column ``k_begin``) as integers: each tile's values times
    2^(13 - e), e the exponent of its largest magnitude, rounded (|v| < 2^14); per word row p (columns 8p..8p+7) four
    int32 of bytes, ``xq[tile, p]``: the low bytes of columns 8p, +2, +4, +6, their high bytes, then the same of the
    odd columns; per tile ``xt[tile]``: 2^(e - 13) / 16 and the sum of its rounded values times 2^(e - 13). The
    rounding adds 1.5 * 2^23, whose float32 bits then hold the integer in two's complement in their low bytes.
    A tile holding an inf or NaN (a bfloat16 exponent of all ones) gets a NaN unit, so every output the walk sums
    from it is NaN, as the float walks' products make theirs inf or NaN; its bytes are then never read as numbers."""
    t = tl.arange(0, TILES)[:, None]
    p = tl.arange(0, 16)[None, :]
    t_mask = t < n_tiles
    pairs = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + k_begin // 2 + t * 64 + p * 4
    v0 = tl.load(pairs, mask=t_mask, other=0)
    v1 = tl.load(pairs + 1, mask=t_mask, other=0)
    v2 = tl.load(pairs + 2, mask=t_mask, other=0)
    v3 = tl.load(pairs + 3, mask=t_mask, other=0)
    e0, o0 = (v0 << 16).to(tl.float32, bitcast=True), (v0 & -65536).to(tl.float32, bitcast=True)
    e1, o1 = (v1 << 16).to(tl.float32, bitcast=True), (v1 & -65536).to(tl.float32, bitcast=True)
    e2, o2 = (v2 << 16).to(tl.float32, bitcast=True), (v2 & -65536).to(tl.float32, bitcast=True)
    e3, o3 = (v3 << 16).to(tl.float32, bitcast=True), (v3 & -65536).to(tl.float32, bitcast=True)
    largest = tl.maximum(tl.maximum(tl.maximum(tl.abs(e0), tl.abs(o0)), tl.maximum(tl.abs(e1), tl.abs(o1))),
                         tl.maximum(tl.maximum(tl.abs(e2), tl.abs(o2)), tl.maximum(tl.abs(e3), tl.abs(o3))))
    e = tl.maximum((tl.max(largest, axis=1).to(tl.int32, bitcast=True) >> 23) - 127, -100)   # [TILES]
    lift = ((127 + 13 - e) << 23).to(tl.float32, bitcast=True)
    f = lift[:, None]
    b0, c0 = (e0 * f + _X_MAGIC).to(tl.int32, bitcast=True), (o0 * f + _X_MAGIC).to(tl.int32, bitcast=True)
    b1, c1 = (e1 * f + _X_MAGIC).to(tl.int32, bitcast=True), (o1 * f + _X_MAGIC).to(tl.int32, bitcast=True)
    b2, c2 = (e2 * f + _X_MAGIC).to(tl.int32, bitcast=True), (o2 * f + _X_MAGIC).to(tl.int32, bitcast=True)
    b3, c3 = (e3 * f + _X_MAGIC).to(tl.int32, bitcast=True), (o3 * f + _X_MAGIC).to(tl.int32, bitcast=True)
    m = _X_MAGIC_BITS
    ints = ((b0 - m) + (c0 - m)) + ((b1 - m) + (c1 - m)) + ((b2 - m) + (c2 - m)) + ((b3 - m) + (c3 - m))
    words = xq_ptr + (tile0 + t) * 64 + p * 4
    tl.store(words, _byte(b0, 0, 0) | _byte(b1, 0, 1) | _byte(b2, 0, 2) | _byte(b3, 0, 3), mask=t_mask)
    tl.store(words + 1, _byte(b0, 8, 0) | _byte(b1, 8, 1) | _byte(b2, 8, 2) | _byte(b3, 8, 3), mask=t_mask)
    tl.store(words + 2, _byte(c0, 0, 0) | _byte(c1, 0, 1) | _byte(c2, 0, 2) | _byte(c3, 0, 3), mask=t_mask)
    tl.store(words + 3, _byte(c0, 8, 0) | _byte(c1, 8, 1) | _byte(c2, 8, 2) | _byte(c3, 8, 3), mask=t_mask)
    tiles = tl.arange(0, TILES)
    unit = tl.where(tl.max(_non_finite(v0) | _non_finite(v1) | _non_finite(v2) | _non_finite(v3), axis=1) != 0,
                    float("nan"), 1.0 / lift)
    tl.store(xt_ptr + (tile0 + tiles) * 2, unit / 16, mask=tiles < n_tiles)
    tl.store(xt_ptr + (tile0 + tiles) * 2 + 1, tl.sum(ints, axis=1).to(tl.float32) * unit, mask=tiles < n_tiles)


@triton.jit
def _x_bytes_kernel(x_ptr, xq_ptr, xt_ptr, K, stride_xm, stride_q, stride_t, TILES: tl.constexpr, M: tl.constexpr,
                    PDL: tl.constexpr):
    """``_x_bytes`` of TILES tiles of row m a program (t, m) (K a multiple of IDOT_TILE). One row (M 1) takes no
    row offsets: the code its batch-1 step was measured with."""
    pid = tl.program_id(0)
    wait_for_prior_kernel(PDL)
    allow_next_kernel(PDL)
    k_begin = pid * TILES * 128
    if M > 1:
        m = tl.program_id(1)
        x_ptr += m * stride_xm
        xq_ptr += m * stride_q
        xt_ptr += m * stride_t
    _x_bytes(x_ptr, xq_ptr, xt_ptr, k_begin, tl.minimum(TILES, (K - k_begin) // 128), pid * TILES, TILES)


@triton.jit
def _idot_tile(acc, acc_zero, w_ptrs, tile, scales_ptr, zeros_ptr, xq_ptr, xt_ptr, N, cols, rows, ms, stride_q,
               stride_t, group_size: tl.constexpr, M: tl.constexpr, ROWS: tl.constexpr, HW_ASM: tl.constexpr):
    """One tile's 16 word rows in loads of ROWS rows into four int32 sums ([ROWS, BLOCK_N] for one row of x, [M,
    ROWS, BLOCK_N] for its rows ``ms``), folded once: ``acc += (16 (256 EH + EL) + 256 OH + OL) * unit / 16 * s``
    and ``acc_zero += z * s * sum(x)``."""
    a_el = tl.zeros(acc.shape, dtype=tl.int32)
    a_eh = a_el
    a_ol = a_el
    a_oh = a_el
    for r in tl.static_range(16 // ROWS):
        w = tl.load(w_ptrs + r * ROWS * N, eviction_policy="evict_first")
        if M == 1:
            x_words = xq_ptr + tile * 64 + (r * ROWS + rows)[:, None] * 4
        else:
            w = w[None, :, :]
            x_words = xq_ptr + ms[:, None, None] * stride_q + tile * 64 + (r * ROWS + rows)[None, :, None] * 4
        a_el, a_eh, a_ol, a_oh = _idot(w, tl.load(x_words), tl.load(x_words + 1), tl.load(x_words + 2),
                                       tl.load(x_words + 3), a_el, a_eh, a_ol, a_oh, HW_ASM, M > 1)
    sums = a_eh * 4096 + a_el * 16 + a_oh * 256 + a_ol      # 16 x (the tile's integer products): |.| < 2^31
    group = tile * 128 // group_size
    s = tl.load(scales_ptr + group * N + cols).to(tl.float32)
    z = tl.load(zeros_ptr + group * N + cols).to(tl.float32)
    if M == 1:
        acc += sums.to(tl.float32) * (s[None, :] * tl.load(xt_ptr + tile * 2))
        acc_zero += z[None, :] * s[None, :] * tl.load(xt_ptr + tile * 2 + 1)
    else:
        units = xt_ptr + ms * stride_t + tile * 2
        acc += sums.to(tl.float32) * (s[None, None, :] * tl.load(units)[:, None, None])
        acc_zero += z[None, None, :] * s[None, None, :] * tl.load(units + 1)[:, None, None]
    return acc, acc_zero


@triton.jit
def _int4_row_idot_kernel(qw_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr, xq_ptr, xt_ptr, N, K, k_per_split,
                          stride_split, stride_om, stride_q, stride_t, group_size: tl.constexpr, M: tl.constexpr,
                          HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                          HW_ASM: tl.constexpr, NUM_STAGES: tl.constexpr, WHILE_LOOP: tl.constexpr,
                          PDL: tl.constexpr):
    """Program (n, s): BLOCK_N columns of x's M rows over the s-th chunk of K, from their bytes
    (``_x_bytes_kernel``): each word is loaded and taken apart once for the M rows."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    k_begin = pid_k * k_per_split
    n_tiles = (tl.minimum(k_begin + k_per_split, K) - k_begin) // 128
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, ROWS)
    ms = tl.arange(0, M)
    w_ptrs = qw_ptr + (k_begin // 8 + rows)[:, None].to(tl.int64) * N + cols[None, :]
    wait_for_prior_kernel(PDL)
    allow_next_kernel(PDL)
    if M == 1:      # 2-D tiles: one row was measured with these (see _idot)
        acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        acc_zero = tl.zeros([1, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([M, ROWS, BLOCK_N], dtype=tl.float32)
        acc_zero = tl.zeros([M, 1, BLOCK_N], dtype=tl.float32)
    tile0 = k_begin // 128
    if WHILE_LOOP:  # the CPU interpreter cannot take runtime `range` bounds
        t = 0
        while t < n_tiles:
            acc, acc_zero = _idot_tile(acc, acc_zero, w_ptrs, tile0 + t, scales_ptr, zeros_ptr, xq_ptr, xt_ptr, N,
                                       cols, rows, ms, stride_q, stride_t, group_size, M, ROWS, HW_ASM)
            w_ptrs += 16 * N
            t += 1
    else:
        for t in tl.range(0, n_tiles, num_stages=NUM_STAGES):
            acc, acc_zero = _idot_tile(acc, acc_zero, w_ptrs, tile0 + t, scales_ptr, zeros_ptr, xq_ptr, xt_ptr, N,
                                       cols, rows, ms, stride_q, stride_t, group_size, M, ROWS, HW_ASM)
            w_ptrs += 16 * N
    if M == 1:
        result = tl.reshape(tl.sum(acc, axis=0) - tl.sum(acc_zero, axis=0), [1, BLOCK_N])
    else:
        result = tl.sum(acc, axis=1) - tl.sum(acc_zero, axis=1)       # [M, BLOCK_N]
    store_tile(result, out_ptr, bias_ptr, ms, cols, ms < M, cols < N, pid_k, stride_om, stride_split, HAS_BIAS,
               SPLIT)


def idot_fits(x: torch.Tensor, weight: Int4Weight, group_size: int, block_n: int | None = IDOT_BLOCK_N) -> bool:
    """Whether the integer walk takes this product: 1 to IDOT_MAX_ROWS bfloat16 rows (their columns paired in int32
    loads), no act-order, K in whole tiles of 128 inside groups, N in whole blocks of ``block_n`` (None: any N)."""
    n, k = weight.shape
    return (1 <= x.shape[0] <= IDOT_MAX_ROWS and x.dtype == torch.bfloat16 and weight.g_idx is None
            and weight.perm is None and k % IDOT_TILE == 0 and group_size % IDOT_TILE == 0
            and (block_n is None or n % block_n == 0) and x.data_ptr() % 4 == 0
            and (x.shape[0] == 1 or x.stride(0) % 2 == 0))


def _int4_row_idot(x, weight: Int4Weight, bias, out, cfg: Int4Config, group_size: int) -> None:
    """``int4_gemm`` by the integer walk."""
    M, K = x.shape
    N = weight.shape[0]
    if cfg.block_m != M or cfg.expand or cfg.sub_n:
        raise ValueError(f"config {tuple(cfg)}: the integer walk takes all of x's rows in a program (block_m {M}), "
                         f"with no expand or sub_n")
    if not idot_fits(x, weight, group_size, None) or cfg.block_k != IDOT_TILE:
        raise ValueError(f"config {tuple(cfg)}: the integer walk takes 1 to {IDOT_MAX_ROWS} bfloat16 rows, each "
                         f"starting 4-byte aligned, no act-order, K and the group in whole tiles of {IDOT_TILE} "
                         f"(block_k {IDOT_TILE})")
    if cfg.block_n < 1 or cfg.block_n & (cfg.block_n - 1) or N % cfg.block_n:
        raise ValueError(f"config {tuple(cfg)}: the integer walk takes a power-of-two block_n dividing N ({N})")
    rows = cfg.rows or 16
    if rows & (rows - 1) or rows > 16:
        raise ValueError(f"config {tuple(cfg)}: rows must be a power of two dividing 16 (the word rows of one load)")
    tiles = K // IDOT_TILE
    xq = torch.empty((M, tiles * 64), dtype=torch.int32, device=x.device)
    xt = torch.empty((M, tiles * 2), dtype=torch.float32, device=x.device)
    pdl = launch_options(x)
    _x_bytes_kernel[(triton.cdiv(tiles, IDOT_X_TILES), M)](x, xq, xt, K, x.stride(0), xq.stride(0), xt.stride(0),
                                                           TILES=IDOT_X_TILES, M=M, num_warps=1, **pdl)
    splits, k_per_split = split_layout(K, cfg)
    partial = split_k_partials(out, splits)
    _int4_row_idot_kernel[(N // cfg.block_n, splits)](
        weight.qweight, weight.scales, weight.zeros, bias if bias is not None else out, partial, xq, xt, N, K,
        k_per_split, partial.stride(0) if splits > 1 else 0, partial.stride(-2), xq.stride(0), xt.stride(0),
        group_size, M=M, HAS_BIAS=bias is not None, SPLIT=splits > 1, BLOCK_N=cfg.block_n, ROWS=rows,
        HW_ASM=x.is_cuda, NUM_STAGES=cfg.num_stages, WHILE_LOOP=not x.is_cuda, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl)
    reduce_split_k(partial, bias, out, pdl)


def fill_split_k(tiles: int, K: int, block_k: int, programs_per_sm: int, num_sms: int) -> int:
    """Splits of K that give each SM about ``programs_per_sm`` programs (of ``tiles`` output tiles), each
    split keeping at least 4 K tiles."""
    k_tiles = triton.cdiv(K, block_k)
    split = 1
    while tiles * split < programs_per_sm * num_sms and split * 2 <= MAX_SPLIT_K and k_tiles // (split * 2) >= 4:
        split *= 2
    return split


def _config(M: int, N: int, K: int, num_sms: int, dtype: torch.dtype = torch.bfloat16,
            group_per_tile: bool = True, idot: bool = False) -> Int4Config:
    """One row: FMA on [128, 64] tiles (a group of 128 a tile) as two sub-tiles of 32 columns, 4 warps, 3 stages,
    K split for about two programs an SM: the best of a sweep on one H100 for every Llama-2-7B shape
    (bench.quant_gemm_bench: 2.02 ms of linear layers a step; K tiles of 256 or 512 leave a group's fold and lose,
    as do 32 or 128 columns and 8 warps), then the sub-tiles from a sweep on one H200 (128 or 256 columns in
    sub-tiles of 64 lost). A bfloat16 row on a weight wide enough that 256-column blocks fill half the SMs (N >
    16,640 on 132 SMs: Llama-2-7B's gate_up) takes 256 columns in four loads of 4 word rows a tile, split to
    about two programs an SM: one H200, gate_up 23.85 -> 20.58 us a launch (.diag/s59 probe); the same tile lost
    on qkv (15.4 against 14.1), o_proj (9.3 against 7.1) and down (15.2 against 14.4), whose programs are shorter.
    Only for weights with a group a tile (``group_per_tile``): with g_idx each nibble reads its group's zero and
    scale, and 256 columns of those loads, staged for 3 pipeline stages, outgrow the shared memory.
    2-16 rows of bfloat16: 16-row dots on 128 columns, split for about two programs an SM.
    One H200, a random GPTQ Llama-2-7B's piped decode step (bench.profile_step) at 1 / 4 / 16 rows: 2.56 / 5.54 /
    9.27 ms before (one 2-D tile; 64 columns, four programs an SM), 2.52 / 4.59 / 6.98 ms with these. Other dtypes
    keep the 64 columns (not measured wider; float32 dots on 128 columns need 296 KB of shared memory, past the
    H200's 227 KB). More rows: 32- or 64-row tiles of 128 columns, K in 128s, split while the tiles leave SMs
    idle.
    ``idot`` (``idot_fits``: the integer walk can take the product): wide or deep weights (N >= IDOT_MIN_N, or K >=
    IDOT_MIN_K with N >= IDOT_DEEP_MIN_N) take it, 256 columns in loads of 4 word rows, about two programs an SM
    with at least 4 tiles a split. One H200, launches with
    their split reduce and x's byte launch, 8 weights in turn (stop 69's prototype bench), us: Llama-2-7B's
    gate_up 22.17 -> 18.61, down 14.27 -> 12.69; qkv 13.89 -> 13.63 and o_proj 7.36 -> 8.55 keep the FMA walk.
    Its x bytes made inside each program instead of in a launch of their own: gate_up 30.1, qkv 19.6 (each
    program redoes its chunk's, behind a barrier).
    Two rows (batch-2 decode) take it on every weight from N and K of 4,096 on, in loads of one word row (each
    word taken apart once for both rows), split alike. One H200, stop 70's prototype (a byte launch a row, where
    ``_x_bytes_kernel`` now takes both in one) against the 16-row dot path, us: qkv 25.78 -> 22.77, o_proj 13.68
    -> 12.54, gate_up 47.46 -> 35.58, down 24.27 -> 20.16. Four and eight rows lost on every weight (qkv 27.25 ->
    33.44 and 34.65 -> 51.91: the integer sums grow with the rows, the dot path's tiles do not). A random GPTQ
    Llama-2-7B's decode step (bench.profile_step, one H200, HEAD and this two runs each in one call): batch 2 4.164
    -> 3.150 ms, batch 1 2.177 -> 2.192; one row's byte launch then lost its row offsets, and its sm_90 SASS is now
    that of the version measured at 2.181 against 2.181 (the walk's is HEAD's). Rerun so (stop 71, one H200, two
    runs each in one call): batch 2 4.188 / 4.181 -> 3.156 / 3.157 ms, batch 1 2.185 / 2.183 -> 2.193 / 2.194: the
    0.4% batch-1 loss is not in that launch's code."""
    if idot and ((M == 1 and (N >= IDOT_MIN_N or (K >= IDOT_MIN_K and N >= IDOT_DEEP_MIN_N)))
                 or (M == 2 and N >= IDOT_DEEP_MIN_N and K >= IDOT_PAIR_MIN_K)):
        splits = max(1, min(K // IDOT_TILE // 4, round(2 * num_sms / (N // IDOT_BLOCK_N))))   # 4+ tiles a split
        return Int4Config(M, IDOT_BLOCK_N, IDOT_TILE, splits, 4, 3, rows=4 if M == 1 else 1, idot=True)
    if M == 1:
        wide_blocks = triton.cdiv(N, 256)
        if dtype == torch.bfloat16 and group_per_tile and 2 * wide_blocks >= num_sms:
            return Int4Config(1, 256, 128, max(1, round(1.9 * num_sms / wide_blocks)), 4, 3, sub_n=128, rows=4)
        return Int4Config(1, 64, 128, fill_split_k(triton.cdiv(N, 64), K, 128, 1.9, num_sms), 4, 3, sub_n=32)
    if M <= 16:
        block_m, block_n, per_sm = (16, 128, 2) if dtype == torch.bfloat16 else (16, 64, 4)
    else:
        block_m, block_n, per_sm = (32 if M <= 64 else 64), 128, 1
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    return Int4Config(block_m, block_n, 128, fill_split_k(tiles, K, 128, per_sm, num_sms), 4, 3)


def _check(x, weight: Int4Weight, bias) -> None:
    check_tensor("x", x, 2)
    check_last_dim_contiguous("x", x)
    n, k = weight.shape
    check_shape("x", x, (None, k))
    check_tensor("qweight", weight.qweight, 2, dtypes=(torch.int32,), device=x.device)
    for name in ("scales", "zeros"):
        t = getattr(weight, name)
        check_tensor(name, t, 2, device=x.device)
        check_same_dtype(name, t, x.dtype)
        check_shape(name, t, (None, n))
    for name in ("g_idx", "perm"):
        if getattr(weight, name) is not None:
            check_tensor(name, getattr(weight, name), 1, dtypes=(torch.int32,), device=x.device)
            check_shape(name, getattr(weight, name), (k,))
    if weight.g_idx is None and weight.scales.shape[0] * weight.group_size < k:
        raise ValueError(f"{weight.scales.shape[0]} groups of {weight.group_size} rows do not cover K = {k}")
    check_bias(bias, n, x.device)


def int4_gemm(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None = None,
              config: Int4Config | tuple | None = None) -> torch.Tensor:
    """x [M, K] @ dequant(weight).T (+ bias [N]) -> new [M, N] in x's dtype, accumulated in float32."""
    _check(x, weight, bias)
    M, K = x.shape
    N = weight.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    group_size = weight.group_size if weight.g_idx is None else K
    cfg = (Int4Config(*config) if config is not None
           else _config(M, N, K, device_sms(x.device), x.dtype, _group_per_tile(weight, group_size, K, 128),
                        idot_fits(x, weight, group_size)))   # _config's tiles: 128 rows
    if cfg.expand and (cfg.block_m < 16 or cfg.block_k < 16):
        raise ValueError(f"config {tuple(cfg)}: the expanded dot path takes block_m and block_k of at least 16")
    sub_n = cfg.sub_n or cfg.block_n
    if sub_n <= 0 or cfg.block_n % sub_n or (sub_n != cfg.block_n and cfg.block_m != 1):
        raise ValueError(f"config {tuple(cfg)}: sub_n must be positive and divide block_n, and sub-tiles are the "
                         f"one-row path's (block_m 1)")
    if cfg.idot:
        _int4_row_idot(x, weight, bias, out, cfg, group_size)
        return out
    rows = cfg.rows or cfg.block_k // 8
    if cfg.block_m == 1 and (rows < 1 or rows & (rows - 1) or (cfg.block_k // 8) % rows):
        raise ValueError(f"config {tuple(cfg)}: rows must be a power of two dividing block_k / 8 (the word rows "
                         f"of one load)")
    if cfg.rows and cfg.block_m != 1:
        raise ValueError(f"config {tuple(cfg)}: rows is the one-row path's (block_m 1)")
    if cfg.block_m > 1 and not cfg.expand and cfg.block_k % 128:
        raise ValueError(f"config {tuple(cfg)}: the dot path (block_m > 1) takes block_k in multiples of 128 "
                         f"(eight dots of block_k / 8 rows, at least 16 each)")
    splits, k_per_split = split_layout(K, cfg)
    partial = split_k_partials(out, splits)
    bias_arg = bias if bias is not None else out
    grid = (triton.cdiv(M, cfg.block_m), triton.cdiv(N, cfg.block_n), splits)
    pdl = launch_options(x)
    group_per_tile = _group_per_tile(weight, group_size, K, cfg.block_k)
    _int4_gemm_kernel[grid](
        x, weight.qweight, weight.scales, weight.zeros, _or(weight.g_idx, weight.qweight),
        _or(weight.perm, weight.qweight), bias_arg, partial, M, N, K, k_per_split, x.stride(0),
        partial.stride(-2), partial.stride(0) if splits > 1 else 0, group_size,
        HAS_G_IDX=weight.g_idx is not None, HAS_PERM=weight.perm is not None, GROUP_PER_TILE=group_per_tile,
        HAS_BIAS=bias is not None, SPLIT=splits > 1, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, UPCAST=upcast_dots(x), EVEN_K=K % cfg.block_k == 0,
        X_PAIRS=_pairs_fit(x, K, cfg.block_k, weight),
        EXPAND=cfg.expand, HW_ASM=x.is_cuda, SUB_N=sub_n, ROWS=rows if cfg.block_m == 1 else 0,
        BF16_NIBBLES=group_per_tile and x.dtype == torch.bfloat16 and cfg.block_m > 1 and not cfg.expand,
        NUM_STAGES=cfg.num_stages,
        WHILE_LOOP=not x.is_cuda,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl)
    reduce_split_k(partial, bias, out, pdl)
    return out


FUSED_ROWS = 16  # up to here int4_linear runs the fused GEMM; more rows: dequantize, then cuBLAS (H100 runs below)


def int4_linear(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` on a 4-bit weight. Decode rows (up to FUSED_ROWS) and CPU runs take the fused GEMM, which
    reads the packed weight once; more rows on the GPU dequantize the weight to x's dtype ([K, N], one
    Triton pass) and multiply with cuBLAS. One H100, Llama-2-7B's linear layers a step (bench.quant_gemm_bench
    --no-sweep): fused 2.00 ms at 1 row (3.09 before the one-row path's PDL, denormal nibbles and paired x
    loads), and before those changes 5.08 / 7.59 / 24.2 / 151.9 ms at 4 / 16 / 64 / 512 rows, dequantized
    and cuBLAS 11.2 ms up to 64 rows and 15.7 at 512; bfloat16 4.7-5.1 and 9.1."""
    if x.shape[0] <= FUSED_ROWS or not x.is_cuda:
        return int4_gemm(x, weight, bias)
    return dequantized_linear(x, weight, bias)


def dequantized_linear(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """int4_linear's many-row route: the weight dequantized to x's dtype by one Triton pass, then x (its
    columns in the weight's row order) @ it with torch (cuBLAS on the GPU)."""
    _check(x, weight, bias)
    if weight.perm is not None:
        x = x.index_select(1, weight.perm)
    w = int4_dequantize_kn(weight, x.dtype)
    return torch.addmm(bias, x, w) if bias is not None else x @ w


@triton.jit
def _dequantize_kernel(qw_ptr, scales_ptr, zeros_ptr, g_idx_ptr, out_ptr, N, K, group_size,
                       HAS_G_IDX: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows ``[pid_k * BLOCK_K, ...)`` and columns ``[pid_n * BLOCK_N, ...)`` of the weight, [K, N] in out's
    dtype: each packed word read once, nibble j written to rows 8p + j (coalesced along N both ways)."""
    pid_k, pid_n = tl.program_id(0), tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    words = pid_k * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    mask = (words < K // 8)[:, None] & (cols < N)[None, :]
    packed = tl.load(qw_ptr + words[:, None].to(tl.int64) * N + cols[None, :], mask=mask, other=0)
    for j in tl.static_range(8):
        k = words * 8 + j
        w = _dequantized(_nibbles(packed, j), scales_ptr, zeros_ptr, g_idx_ptr, k[:, None], K, N, group_size,
                         (cols % N)[None, :], HAS_G_IDX)
        tl.store(out_ptr + k[:, None].to(tl.int64) * N + cols[None, :], round_to(w, out_ptr.dtype.element_ty),
                 mask=mask)


def int4_dequantize_kn(weight: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
    """The weight as ``dtype`` [K, N] in its stored row order (the Triton twin of ``int4_dequantize``, transposed)."""
    n, k = weight.shape
    out = torch.empty((k, n), dtype=dtype, device=weight.qweight.device)
    block_k, block_n = 64, 128
    group_size = weight.group_size if weight.g_idx is None else k
    _dequantize_kernel[(triton.cdiv(k, block_k), triton.cdiv(n, block_n))](
        weight.qweight, weight.scales, weight.zeros, _or(weight.g_idx, weight.qweight), out, n, k, group_size,
        HAS_G_IDX=weight.g_idx is not None, BLOCK_K=block_k, BLOCK_N=block_n, num_warps=4)
    return out


def _group_per_tile(weight: Int4Weight, group_size: int, K: int, block_k: int) -> bool:
    """Whether every K tile of ``block_k`` rows lies inside one group (no g_idx; the group a multiple of the tile,
    or all of K): the tiles that fold the group's zero and scale once (``GROUP_PER_TILE``)."""
    return weight.g_idx is None and (group_size % block_k == 0 or group_size >= K)


def _pairs_fit(x: torch.Tensor, K: int, block_k: int, weight: Int4Weight) -> bool:
    """Whether the one-row path may read x as int32 pairs (``X_PAIRS``): bfloat16, whole K tiles, no act-order
    perm, and every row's start 4-byte aligned (a view may start at an odd column)."""
    return (x.dtype == torch.bfloat16 and K % block_k == 0 and weight.perm is None and x.stride(0) % 2 == 0
            and x.data_ptr() % 4 == 0)


def _or(tensor: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    """The tensor, or a placeholder pointer for a kernel argument its flag says is not read."""
    return tensor if tensor is not None else placeholder


def int4_dequantize(weight: Int4Weight) -> torch.Tensor:
    """The float32 weight [N, K] in its stored row order (rows of ``perm``'s order when it is set)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=weight.qweight.device)
    q = ((weight.qweight.unsqueeze(1) >> shifts[None, :, None]) & 0xF).reshape(-1, weight.qweight.shape[1])
    k = q.shape[0]
    group = (weight.g_idx.long() if weight.g_idx is not None
             else torch.arange(k, device=q.device) // weight.group_size)
    return ((q.float() - weight.zeros.float()[group]) * weight.scales.float()[group]).T


def int4_gemm_ref(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None = None,
                  config: Int4Config | tuple | None = None) -> torch.Tensor:
    if weight.perm is not None:
        x = x[:, weight.perm.long()]
    out = x.float() @ int4_dequantize(weight).T
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)
