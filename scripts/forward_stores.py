"""Where the fused forward's time goes: its output stores against the rest.

    PYTHONPATH=. python scripts/forward_stores.py [--algorithms fused_tf32 fused]
        [--variants kernel "no y stores" ...] [--repeats 2] [--widths | --seams]

The no-grad forward (no mask) of the seed shape (conv 8->64 3x3 on
128x8x128x128 float32, NCHW), timed by CUDA events at the GPU's own clocks
(``wgrad_probe.py``'s child: the median of 7 timings of 10 back-to-back
calls), for this version and for copies of it with one part of the
warpgroup-MMA kernel (sm_90a) changed or taken out. Timing only: most copies
compute wrong outputs.

  kernel             cuda/conv2d.cu as it is (on an H100 with the row seams,
                     _conv.seams_pay; on an H200 without)
  no seams           the row seams off (_conv.FORWARD_SEAMS): each tile stores
                     the lines its row shares with the rows before and after
                     itself, a tile apart from their other parts
  seams              the row seams on, on any device (the variants below that
                     study them take them too)
  seams, no flush    the seam lines' parts go to their buffer, but the lines
                     are never stored (wrong outputs: the time without them)
  flush in MMA shadow  the seam lines stored while the next tile's first
                     MMAs run (not after its first barrier), and a block
                     barrier before its epilogue (whose seam parts go to the
                     set being stored)
  bulk flush         the seam lines after each tile's first barrier by the
                     copy engine (one cp.async.bulk store per line, the
                     issuing threads waiting for their reads before the
                     tile's second barrier): tried, not kept (H100: 330
                     us against the register stores' 289)
  seam checks only   the seam warps' stores checked as with the seams, none
                     routed, no seam line stored: the checks' cost
  seam buffer unused the seam buffer allotted (the block's shared memory as
                     with the seams) but never used: the seams off
  region cut         the one-pass NCHW region cut to the patch, mask words
                     and bias plus 1200 words for the tensor copy's box (no
                     room for the unused epilogue tile), kernel and host
  region cut, no seams  the same without the seams
  no y stores        the epilogue's values all formed (XORed into a word the
                     compiler must keep), none stored
  stores to L2       every tile stores as before, but into image 0's first 8
                     + 1 output rows: the same store instructions and
                     alignment, a footprint the L2 holds (no DRAM writes)
  aligned, to L2     the same, but rows 128 elements apart and channels 16
                     rows apart: every warp's 128-byte run of a channel one
                     whole line (for one-row tiles, C = 128: the seed shape)
  8-byte stores      each lane's 16-byte stores as two 8-byte ones
  streaming stores   the 16-byte stores with the evict-first hint (st.global.cs)
  no ring copy       the ring's new rows not moved from the staging area into
                     the patch (the tensor copies still come)
  no MMA             the MMA loop skipped (the epilogue stores zeros' results)
  addresses per store  each store's address from the lane's first channel's
                     (a product per store) instead of stepped along
  odd warps reversed   the same, odd warps storing their channels in reverse
                     order: neighbouring warps, whose runs share lines, no
                     longer write the same channel at the same time
  formed first      float32: the epilogue's 64 values all formed before its
                     first store (the kernel forms each store's 4 just
                     before it)
  formed by halves   the same, 32 at a time (the first 4 channel steps'
                     before their stores, then the rest's)
  not in step        without the epilogue's barrier of the block's 4 warps
                     after each store instruction (warps_in_step: the two
                     halves of a line shared by neighbouring warps leave
                     together)
  in step every 2    that barrier after every 2 store instructions (8
                     channels)
  in step every 4    after every 4 (16 channels)
  in step every 8    after every 8 (32 channels)
  no row-end lines   lanes whose positions touch the line a row shares with
                     the row before or after it (its first and last,
                     unless the row starts or ends on a line) store
                     nothing: a bound on what writing those lines whole
                     (tiles of two rows) could save
  no second line     the same for the row's next line after its first (one
                     its own row's warps share): the control, about as
                     many bytes left out
  one tile per block the launch's grid one block per tile (no persistent
                     runs, no ring of rows): blocks running at the same time
                     hold neighbouring rows, so the line two rows share
                     fills at once; each block loads its weights and whole
                     patch
  bulk stores        one-pass kernels only (skipped for "fused" float32): the
                     tile's values go to a 32 KB buffer in shared memory, then
                     one bulk copy per channel row (cp.async.bulk, 16-byte
                     multiples: a row's odd 8 bytes and the 8-byte shift of
                     every other 126-wide row are ignored); the region cut
                     to what it holds, so that with the buffer after the
                     weights the launch keeps three blocks per SM

The copies whose stores go elsewhere or not at all ("no y stores", "stores
to L2", "aligned, to L2", "addresses per store", "odd warps reversed", "no
row-end lines", "no second line", "bulk stores") or differ in how they store
("8-byte stores", "streaming stores": global stores only) run without the
seams.

Rows repeat ``--repeats`` times, variants interleaved; the minimum and every
repeat are printed.

--widths instead times this version alone (in this process: CUDA events, the
GPU kept busy while the host queues, ``testing.median_ms``) at input widths
126, 128 and 130 (output rows of 124, 126 and 128 float32: 496 bytes, whole
16-byte units; 504, every other row 8 bytes into one; 512, whole 128-byte
lines), per call and per output element, the widths interleaved.

--seams instead times this version's "fused_tf32" forward with the row
seams forced on and off (``_conv.FORWARD_SEAMS`` True and False, in this
process as ``--widths``) at conv_bench's shapes the kernel can take them at
(ref, stem, 5x5) and at the seed's channels and kernel with other output
widths, interleaved: the measurements behind ``_conv.seams_pay``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import wgrad_probe  # scripts/wgrad_probe.py, next to this script

_FILES = ("cuda/conv2d.cu", "cupy_act/_conv.py")

_C_OK = "const bool c_ok = kAllChannels || 8 * j + s < c_left;"
_NEVER = " && p.n > (1 << 30)"  # false for every real launch, unknown to the compiler
_PUT = "  if (ok) *reinterpret_cast<V*>(dst) = v;\n"  # put_unit: each float32 vector
_DISPATCH = """  if (__any_sync(0xffffffffu, how.rest))
    stores(Flag<false>(), Flag<false>());
  else if (sizeof(T) == 4 && __any_sync(0xffffffffu, seam_on))
    stores(Flag<true>(), Flag<sizeof(T) == 4>());
  else
    stores(Flag<true>(), Flag<false>());
"""
_CHUNK = "        wgmma_chunk<kPasses>(wacc, a_wg, koff, b_desc, p.kc_pad, t);"
# The seam lines never stored (put_seams), and the seam units never routed
_NO_FLUSH = (
    "    if (into != 0 && c0 + kApart * i < chans)\n",
    f"    if (into != 0 && c0 + kApart * i < chans{_NEVER})\n",
)
_NO_ROUTE = (
    "      r[0] = seam_on && (a ^ key) < 128u;\n      r[1] = seam_on && ((a + 8u) ^ key) < 128u;",
    f"      r[0] = seam_on && (a ^ key) < 128u{_NEVER};\n"
    f"      r[1] = seam_on && ((a + 8u) ^ key) < 128u{_NEVER};",
)
# The seam lines stored while the next tile's first MMAs run (a hook in
# wgmma_chunk after its first step), with a block barrier before that
# tile's epilogue, whose seam parts go to the set being stored
_SHADOW = [
    (
        "    wgmma_step<kPasses>(acc, a0, b0 + 2 * k0);\n",
        "    wgmma_step<kPasses>(acc, a0, b0 + 2 * k0);\n    if (k0 == 0) shadow();\n",
    ),
    (
        "                                            const int* koff, u64 b0, int kc_pad, int t) {",
        "                                            const int* koff, u64 b0, int kc_pad, int t,\n"
        "                                            const Shadow& shadow) {",
    ),
    (
        "template <int kPasses>\n__device__ __forceinline__ void wgmma_chunk(",
        "template <int kPasses, typename Shadow>\n__device__ __forceinline__ void wgmma_chunk(",
    ),
    (
        "        if (seam_flush)\n          put_seams(seam + ((at.oh0 - 1) & 1) * kBN * "
        "kSeamStride, reinterpret_cast<float*>(y), p,\n                    at, tile_n, tid);\n",
        "        done = at;\n",
    ),
    (
        "  TileAt at = tile_at(p, tile_first);",
        "  TileAt done{};\n  TileAt at = tile_at(p, tile_first);",
    ),
    (
        _CHUNK,
        "        const bool flush = seam_flush && c0 == 0;\n"
        "        wgmma_chunk<kPasses>(wacc, a_wg, koff, b_desc, p.kc_pad, t, [&] {\n"
        "          if (flush)\n"
        "            put_seams(seam + ((done.oh0 - 1) & 1) * kBN * kSeamStride,\n"
        "                      reinterpret_cast<float*>(y), p, done, tile_n, tid);\n"
        "        });",
    ),
    (
        "        seam_flush = head != nullptr;\n",
        "        if (seam_flush) __syncthreads();\n        seam_flush = head != nullptr;\n",
    ),
]
# The seam lines after each tile's first barrier by the copy engine: thread c
# issues channel c's line as one bulk store (no shared load, no register
# store), the seam parts' writers fence them for the copy engine, and the
# issuing threads wait for their lines' reads before the tile's second
# barrier (its epilogue writes the set again)
_BULK_FLUSH = [
    (
        "// NHWC: a position's channels are consecutive",
        r"""__device__ __forceinline__ void put_seams_bulk(const float* lines, float* y,
                                               const ConvParams& p, TileAt at, int tile_n, int c) {
  if (c >= min(kBN, p.cout - tile_n)) return;
  const long long out_plane = (long long)p.oh * p.ow;
  float* row = y + ((long long)at.n * p.cout + tile_n + c) * out_plane + (long long)at.oh0 * p.ow;
  const int into = (int)((u64)row & 127) >> 2;
  if (into != 0)
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], 128;\n"
                 " cp.async.bulk.commit_group;"
                 :: "l"(row - into), "r"((u32)__cvta_generic_to_shared(lines + c * kSeamStride))
                 : "memory");
}

// NHWC: a position's channels are consecutive""",
    ),
    (
        "        if (seam_flush)\n          put_seams(seam + ((at.oh0 - 1) & 1) * kBN * "
        "kSeamStride, reinterpret_cast<float*>(y), p,\n                    at, tile_n, tid);\n",
        "        if (seam_flush && tid < kBN)\n"
        "          put_seams_bulk(seam + ((at.oh0 - 1) & 1) * kBN * kSeamStride,\n"
        "                         reinterpret_cast<float*>(y), p, at, tile_n, tid);\n",
    ),
    (
        "load_weights<T, kPasses>(bs, p, w, tile_n, c0, tid);\n      __syncthreads();\n",
        "load_weights<T, kPasses>(bs, p, w, tile_n, c0, tid);\n"
        "      if (seam_flush && c0 == 0 && tile > tile_first && tid < kBN)\n"
        '        asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");\n'
        "      __syncthreads();\n",
    ),
    (
        _DISPATCH,
        _DISPATCH.replace(
            "    stores(Flag<true>(), Flag<sizeof(T) == 4>());\n  else",
            "  {\n    stores(Flag<true>(), Flag<sizeof(T) == 4>());\n"
            '    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");\n  } else',
        ),
    ),
]
# Without the row seams (copies whose stores go elsewhere or not at all: the
# seam lines would still be stored whole from their buffer)
_NO_SEAMS = ("FORWARD_SEAMS: bool | None = None\n", "FORWARD_SEAMS: bool | None = False\n")
# The seams wherever the kernel takes them (not only where _conv.seams_pay):
# the copies that study them do so on any sm_90 device
_SEAMS = ("FORWARD_SEAMS: bool | None = None\n", "FORWARD_SEAMS: bool | None = True\n")
_SEAM_SMEM = (
    "    smem = tl.smem + seam_bytes(g, tl, n_passes, dtype, sm, channels_last, "
    "_device_name(device))"
)
_TILE_BARRIER = (
    "      __syncthreads();  // the previous MMAs and epilogue are done with shared memory"
)
_SHIFTED = "        if (decltype(vectors)::value && shifted)\n"
_STEP = "constexpr int kStoreStep = 1;"  # the epilogue's warps meet after every store
# The epilogue's store loop, each store's values formed just before it
_LOOP = (
    "    for (int j = 0; j < 8; ++j) {\n#pragma unroll\n      for (int s = 0; s < 2; ++s) {\n"
    "        form(j, s);\n"
)


def _formed_first(steps: int) -> list[tuple[str, str]]:
    """float32: the values of ``steps`` channel steps formed before the
    first of their stores (8: the whole tile's)."""
    return [
        (
            _LOOP,
            "    for (int j = 0; j < 8; ++j) {\n"
            f"      if (sizeof(T) == 4 && j % {steps} == 0)\n"
            f"#pragma unroll\n        for (int i = j; i < j + {steps}; ++i)\n"
            "#pragma unroll\n          for (int s = 0; s < 2; ++s) form(i, s);\n"
            "#pragma unroll\n      for (int s = 0; s < 2; ++s) {\n"
            "        if (sizeof(T) != 4) form(j, s);\n",
        )
    ]


_LAST_MASK = "  if ((nchw_mask || seam_flush) && tile_first < tile_end) {\n"
_REGION = (
    "  const int region_alloc = ((region > kEpilogueFloats ? region : kEpilogueFloats) + 3) & ~3;"
)
# the buffer's share of the region's tail: the tensor copy's box, its barrier
# and their alignment fit in 1200 words after the patch, mask words and bias
_SPARE = 1200
_BULK_EPILOGUE = r"""  if (false) stores(Flag<true>(), Flag<false>());
  {
    extern __shared__ __align__(16) float smem_all[];
    u32 dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    T* buf = reinterpret_cast<T*>(reinterpret_cast<char*>(smem_all) + dyn - 32768);
    const int tid = 32 * warp + 4 * g + t;
    T* row0 = y + ((long long)at.n * p.cout + tile_n) * out_plane +
              (long long)at.oh0 * p.ow + at.ow0;
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        const T b = bias_s<T>(tw)[2 * t + 8 * j + s];
        T v[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          bool bit;
          v[q] = epilogue_value(acc[q >> 1][4 * j + 2 * (q & 1) + s], op, has_bias, b, alpha, bit);
        }
        const Words4<T> o = words4(v);
        T* dst = buf + (2 * t + 8 * j + s) * 128 + 32 * warp + 4 * g;
        if (sizeof(T) == 4)
          *reinterpret_cast<uint4*>(dst) = make_uint4(o.w[0], o.w[1], o.w[2], o.w[3]);
        else
          *reinterpret_cast<uint2*>(dst) = make_uint2(o.w[0], o.w[1]);
      }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    if (tid < kBN && tile_n + tid < p.cout && at.oh0 < p.oh) {
      const u64 to = (u64)(row0 + (long long)tid * out_plane) & ~15ull;
      const u32 from = (u32)__cvta_generic_to_shared(buf + tid * 128);
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                   ::"l"(to), "r"(from), "r"((u32)(p.ow * sizeof(T)) & ~15u) : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    }
  }
"""
_LAUNCH = """        _allow_smem(k, smem)  # (before the occupancy query)
        per_block = math.ceil(n_tiles / max(1, _blocks(device, k, smem) // col_tiles))
        grid = (math.ceil(n_tiles / per_block), col_tiles)
        return _prepared(k, grid, smem, _params(g, tl, 0, 0, 0, per_block, 0))"""
_BULK_LAUNCH = f"""        smem = tl.smem
        if n_passes == 1:  # the region cut to what it holds, the weights, 32 KB
            patch = (tl.cc + 1) * tl.patch_h * tl.patch_w + AFTER_PATCH_WORDS + {_SPARE}
            smem = 4 * (tl.kc_pad + -(-patch // 4) * 4 + tl.kc_pad * WEIGHT_STRIDE) + 32768
        _allow_smem(k, smem)
        per_block = math.ceil(n_tiles / max(1, _blocks(device, k, smem) // col_tiles))
        grid = (math.ceil(n_tiles / per_block), col_tiles)
        return _prepared(k, grid, smem, _params(g, tl, 0, 0, 0, per_block, 0))"""

# Each store's address from the tile's first channel (not stepped along), and
# the channel loop in either order (a second lambda argument)
_PER_STORE = [
    _NO_SEAMS,
    (
        "auto channels = [&](auto vectors, auto seam, auto with_mask) {",
        "auto channels = [&](auto vectors, auto seam, auto with_mask, auto rev) {",
    ),
    (
        "auto stores = [&](auto vectors, auto seam) {",
        "auto stores = [&](auto vectors, auto seam, auto rev) {",
    ),
    ("channels(vectors, seam, Flag<true>());", "channels(vectors, seam, Flag<true>(), rev);"),
    ("channels(vectors, seam, Flag<false>());", "channels(vectors, seam, Flag<false>(), rev);"),
    (
        _LOOP,
        _LOOP.replace(
            "    for (int j = 0; j < 8; ++j) {\n",
            "    for (int jj = 0; jj < 8; ++jj) {\n"
            "      const int j = decltype(rev)::value ? 7 - jj : jj;\n",
        ),
    ),
    (
        "        const bool c_ok",
        "        T* ycj = yc + (long long)(8 * j + s) * out_plane;\n        const bool c_ok",
    ),
    ("T* u0 = kSeam ? unit[s][0] : yc;", "T* u0 = kSeam ? unit[s][0] : ycj;"),
    ("T* u8 = kSeam ? unit[s][1] : yc + 2;", "T* u8 = kSeam ? unit[s][1] : ycj + 2;"),
    ("store_n(yc, v[j][s],", "store_n(ycj, v[j][s],"),
    ("          yc += s == 0 ? out_plane : 7 * out_plane;\n", ""),
]


def _order(odd_reversed: bool) -> list[tuple[str, str]]:
    """_PER_STORE, odd warps walking the channels backwards where asked."""
    rev = "Flag<true>()" if odd_reversed else "Flag<false>()"
    return [
        *_PER_STORE,
        (
            _DISPATCH,
            "  if (__any_sync(0xffffffffu, how.rest))\n"
            "    stores(Flag<false>(), Flag<false>(), Flag<false>());\n"
            f"  else if (warp & 1)\n    stores(Flag<true>(), Flag<false>(), {rev});\n"
            "  else\n    stores(Flag<true>(), Flag<false>(), Flag<false>());\n",
        ),
    ]


# The seam buffer allotted but never used
_SEAMS_UNUSED = ("      seam = buf;\n", "      seam = p.n > (1 << 30) ? buf : nullptr;\n")
# The one-pass NCHW region cut to the patch, the mask words and the bias,
# plus 1200 words for the tensor copy's box (no epilogue tile: the warpgroup
# epilogue stores from registers), on the host as in the kernel
_CUT = [
    (
        _REGION,
        "  const int region_alloc = kWgmma && kPasses == 1 && !kChannelsLast\n"
        "      ? (region + 1200 + 3) & ~3\n"
        "      : ((region > kEpilogueFloats ? region : kEpilogueFloats) + 3) & ~3;",
    ),
    (
        f"{_SEAM_SMEM}\n",
        f"{_SEAM_SMEM}\n"
        "    if n_passes == 1 and sm == 90 and not channels_last:\n"
        "        cut = (tl.cc + 1) * tl.patch_h * tl.patch_w + AFTER_PATCH_WORDS + 1200\n"
        "        old = max(cut - 1200, EPILOGUE_FLOATS)\n"
        "        smem += 4 * (-(-cut // 4) * 4) - 4 * (-(-old // 4) * 4)\n",
    ),
]


def _skip_lines(which: str) -> list[tuple[str, str]]:
    """Lanes whose 4 positions (pos .. pos + 3 of the row) touch the lines
    ``which`` names store nothing: "head" is the number of the row's elements
    in the line its first element opens (0 where the row starts on a line),
    "tail" the position where the line of its last element begins (the row's
    width where it ends on a line)."""
    helper = (
        "template <typename T>\n"
        "__device__ __forceinline__ bool skip_lines(const T* yc, int pos, int ow) {\n"
        "  const u64 rs = (u64)yc - (u64)pos * sizeof(T), re = rs + (u64)ow * sizeof(T);\n"
        "  const int head = (int)(((128 - (rs & 127)) & 127) / sizeof(T));\n"
        "  const int tail = (re & 127) ? (int)(((re & ~127ull) - rs) / sizeof(T)) : ow;\n"
        f"  return {which};\n"
        "}\n\n"
    )
    return [
        _NO_SEAMS,
        (_STEP, helper + _STEP),
        (
            _C_OK,
            "const bool c_ok = (kAllChannels || 8 * j + s < c_left) && !skip_lines(yc, col, p.ow);",
        ),
    ]


VARIANTS: dict[str, list[tuple[str, str]]] = {
    "kernel": [],
    "no seams": [_NO_SEAMS],
    "seams": [_SEAMS],
    "seams, no flush": [_SEAMS, _NO_FLUSH],
    "flush in MMA shadow": [_SEAMS, *_SHADOW],
    "bulk flush": [_SEAMS, *_BULK_FLUSH],
    "seam buffer unused": [_SEAMS, _SEAMS_UNUSED],
    "region cut": [_SEAMS, *_CUT],
    "region cut, no seams": [*_CUT, _NO_SEAMS],
    "seam checks only": [_SEAMS, _NO_FLUSH, _NO_ROUTE],
    "no y stores": [
        _NO_SEAMS,
        (_C_OK, "const bool c_ok = (kAllChannels || 8 * j + s < c_left)" + _NEVER + ";"),
        ("  u32 word[2] = {0u, 0u};\n", "  u32 word[2] = {0u, 0u};\n  u32 sink = 0;\n"),
        (
            _SHIFTED,
            "        sink ^= words4(v[j][s]).w[0] ^ words4(v[j][s]).w[sizeof(T) - 1];\n" + _SHIFTED,
        ),
        (_DISPATCH, _DISPATCH + "  if (p.n > (1 << 30)) tw[0] = sink;\n"),
    ],
    "stores to L2": [
        _NO_SEAMS,
        (
            "T* yc = y + ((long long)at.n * p.cout + tile_n + 2 * t) * out_plane +\n"
            "          (long long)(at.oh0 + row) * p.ow",
            "T* yc = y + ((long long)0 * p.cout + tile_n + 2 * t) * out_plane +\n"
            "          (long long)((at.oh0 & 7) + row) * p.ow",
        ),
    ],
    "aligned, to L2": [
        _NO_SEAMS,
        (
            "  const long long out_plane = (long long)p.oh * p.ow;\n"
            "  // channel 2 t + 8 j + s exists",
            "  const long long out_plane = 2048;  // (16 rows of 128 per channel)\n"
            "  // channel 2 t + 8 j + s exists",
        ),
        (
            "T* yc = y + ((long long)at.n * p.cout + tile_n + 2 * t) * out_plane +\n"
            "          (long long)(at.oh0 + row) * p.ow",
            "T* yc = y + ((long long)0 * p.cout + tile_n + 2 * t) * out_plane +\n"
            "          (long long)((at.oh0 & 7) + row) * 128",
        ),
    ],
    "8-byte stores": [
        _NO_SEAMS,
        (
            _PUT,
            "  if (!ok) return;\n"
            "  if constexpr (sizeof(V) == 16) {\n"
            "    const uint4 u = reinterpret_cast<const uint4&>(v);\n"
            "    *reinterpret_cast<uint2*>(dst) = make_uint2(u.x, u.y);\n"
            "    *reinterpret_cast<uint2*>(dst + 2) = make_uint2(u.z, u.w);\n"
            "  } else {\n"
            "    *reinterpret_cast<V*>(dst) = v;\n"
            "  }\n",
        ),
    ],
    "streaming stores": [_NO_SEAMS, (_PUT, "  if (ok) __stcs(reinterpret_cast<V*>(dst), v);\n")],
    "no ring copy": [
        (
            "      if (staged)\n        unstage_rows<T, kPasses>(",
            f"      if (staged{_NEVER})\n        unstage_rows<T, kPasses>(",
        ),
        (
            "      else\n        load_patch<T, kPasses, kChannelsLast>(patch, p, xn,",
            "      else if (!staged)\n        load_patch<T, kPasses, kChannelsLast>(patch, p, xn,",
        ),
    ],
    "no MMA": [(_CHUNK, "        if (p.n > (1 << 30))\n  " + _CHUNK)],
    "addresses per store": _order(False),
    "odd warps reversed": _order(True),
    "formed first": _formed_first(8),
    "formed by halves": _formed_first(4),
    "not in step": [(_STEP, "constexpr int kStoreStep = 32;")],
    "in step every 2": [(_STEP, "constexpr int kStoreStep = 2;")],
    "in step every 4": [(_STEP, "constexpr int kStoreStep = 4;")],
    "in step every 8": [(_STEP, "constexpr int kStoreStep = 8;")],
    "no row-end lines": _skip_lines("pos < head || pos + 3 >= tail"),
    "no second line": _skip_lines("pos + 3 >= head && pos < head + 32"),
    "one tile per block": [
        (
            "per_block = math.ceil(n_tiles / max(1, _blocks(device, k, smem) // col_tiles))",
            "per_block = 1",
        )
    ],
    "bulk stores": [
        _NO_SEAMS,
        (  # (nor the seams' code: no register store left)
            "  if constexpr (kWgmma && kPasses == 1 && !kChannelsLast && sizeof(T) == 4) {",
            "  if constexpr (false) {",
        ),
        (_DISPATCH, _BULK_EPILOGUE),
        (_LAST_MASK, '  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");\n' + _LAST_MASK),
        (
            _TILE_BARRIER,
            '      if (tid < kBN) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");\n'
            + _TILE_BARRIER,
        ),
        (
            _REGION,
            f"  const int region_alloc = kWgmma && kPasses == 1 && !kChannelsLast\n"
            f"      ? (region + {_SPARE} + 3) & ~3\n"
            "      : ((region > kEpilogueFloats ? region : kEpilogueFloats) + 3) & ~3;",
        ),
        (_LAUNCH, _BULK_LAUNCH),
    ],
}


def copies(names: list[str], tmp: Path) -> dict[str, Path]:
    """The variants' copies of cupy_act/ and cuda/ under ``tmp``."""
    return {
        n: wgrad_probe.make_copy(VARIANTS[n], tmp / str(i), _FILES) for i, n in enumerate(names)
    }


def widths(algorithms: list[str], rounds: int) -> None:
    """``--widths``: the forward at output widths 124, 126 and 128."""
    import torch

    import cupy_act.torch as ct
    from cupy_act import testing

    calls = {}
    for ow in (124, 126, 128):
        torch.manual_seed(0)
        x = torch.randn(128, 8, 128, ow + 2, device="cuda")
        w = torch.randn(64, 8, 3, 3, device="cuda") * 0.1
        b = torch.randn(64, device="cuda")
        calls[ow] = (x, w, b)
    for alg in algorithms:
        times: dict[int, list[float]] = {ow: [] for ow in calls}
        for _ in range(rounds):
            for ow, (x, w, b) in calls.items():

                def call(x=x, w=w, b=b):
                    ct.conv2d_div_leaky_relu(x, w, b, 2.0, 0.01, algorithm=alg)

                with torch.no_grad():
                    call()
                    times[ow].append(1000 * testing.median_ms(call, iters=20, queued_ms=4))
        print(f"forward, no grad, float32 {alg}, 128x8x128x(ow + 2) -> 64 channels")
        for ow, t in times.items():
            per = min(t) * 1e6 / (128 * 64 * 126 * ow)
            each = " ".join(f"{v:.1f}" for v in t)
            print(f"  ow {ow}: rows of {4 * ow} bytes  {min(t):7.1f} us  {per:.3f} ps/elem  {each}")


# --seams: (name, x shape, weight shape, stride, padding); conv_bench's shapes
# whose one-pass forward takes the seams, then the seed at other widths
_SEAM_SHAPES = [
    ("ref", (128, 8, 128, 128), (64, 8, 3, 3), 1, 0),
    ("stem", (32, 3, 224, 224), (64, 3, 7, 7), 2, 3),
    ("5x5", (64, 8, 128, 128), (64, 8, 5, 5), 1, 0),
    *[(f"ow {w - 2}", (128 * 126 // (w - 2), 8, 128, w), (64, 8, 3, 3), 1, 0)
      for w in (68, 82, 100, 108, 112, 114, 120, 126)],
    ("ref cin 24", (128, 24, 128, 128), (64, 24, 3, 3), 1, 0),
    ("5x5 cin 2", (64, 2, 128, 128), (64, 2, 5, 5), 1, 0),
]  # fmt: skip


def seams(rounds: int) -> None:
    """``--seams``: the "fused_tf32" no-grad forward with the row seams on
    and off (_conv.FORWARD_SEAMS True and False, whatever seams_pay says),
    interleaved, at the shapes above."""
    import torch

    import cupy_act.torch as ct
    from cupy_act import _conv, testing

    print("forward, no grad, float32 fused_tf32, seams on / off (us; min of each, ratio, repeats)")
    for name, xs, ws, stride, pad in _SEAM_SHAPES:
        torch.manual_seed(0)
        x = torch.randn(*xs, device="cuda")
        w = torch.randn(*ws, device="cuda") * 0.1
        b = torch.randn(ws[0], device="cuda")
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(rounds):
            for on in (True, False):
                _conv.FORWARD_SEAMS = on

                def call():
                    alg = "fused_tf32"
                    ct.conv2d_div_leaky_relu(x, w, b, 2.0, 0.01, stride, pad, algorithm=alg)

                with torch.no_grad():
                    call()
                    times[on].append(1000 * testing.median_ms(call, iters=20, queued_ms=4))
        _conv.FORWARD_SEAMS = None
        on, off = min(times[True]), min(times[False])
        each = " ".join(f"{a:.1f}/{b:.1f}" for a, b in zip(times[True], times[False]))
        print(f"  {name:8s} {on:7.1f} {off:7.1f}  {on / off:.3f}   {each}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algorithms", nargs="+", default=["fused_tf32", "fused"],
                    choices=["fused", "fused_tf32"])  # fmt: skip
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--widths", action="store_true", help="this version at three output widths")
    ap.add_argument("--seams", action="store_true", help="the row seams on and off, several shapes")
    args = ap.parse_args()
    if args.widths:
        widths(args.algorithms, args.repeats)
        return
    if args.seams:
        seams(args.repeats)
        return
    with tempfile.TemporaryDirectory() as tmp:
        dirs = copies(args.variants, Path(tmp))
        for alg in args.algorithms:
            # "bulk stores" sizes its buffer for the one-pass kernels only
            names = [n for n in dirs if not (n == "bulk stores" and alg == "fused")]
            times: dict[str, list[float]] = {n: [] for n in names}
            for _ in range(args.repeats):
                for n in names:
                    cargs = ["float32", "nchw", alg, "forward-nograd", "0"]
                    times[n].append(wgrad_probe.events_us(dirs[n], cargs))
            print(f"forward, no grad, float32 {alg} (us; min, then every repeat)")
            for n, t in times.items():
                print(f"  {n:18s} {min(t):7.1f}   " + " ".join(f"{v:.1f}" for v in t), flush=True)


if __name__ == "__main__":
    sys.exit(main())
