//! The interleaved kernels at 512 bits: two groups (16 output rows) a vector, their 256-bit
//! halves side by side, with AVX-512 VNNI's dot product. Each lane does the operations it does
//! in the 256-bit kernels, in the same order — the same exact integer sum of a block, then the
//! same float multiplies and fused adds — so the outputs are bitwise theirs, whatever the
//! number of activation rows. Where a range has an odd number of groups, the last one runs the
//! 256-bit VNNI kernel.
//!
//! Three changes of form, not of value:
//! - 8-bit weights: `vpdpbusd` multiplies unsigned by signed bytes, so where the 256-bit kernels
//!   move the weights' signs onto the activations (`|w| x sign(x, w)`, a sign instruction per
//!   chunk and row) these take the activations offset by 128 (`x + 128`, unsigned) against the
//!   signed weights and start each sum at `-128 x sum(w)`. Both are the exact sum of `x w` for
//!   activations in -127..=127, the only ones the Q8 quantisers make.
//! - A group's scales and quants are read from each of the two groups and joined.
//! - The activations come widened ([`widen`], once a matmul): each block's f16 scale (and its
//!   sum term) as f32, so a row's block costs one broadcast load for each where the 256-bit
//!   kernels convert it on every tile. The conversions are exact and the sum term is the same
//!   f32 product, so the values are theirs.

use std::arch::x86_64::*;

use super::{group_block_bytes, GROUP};
use crate::quant::DType;

/// Activation rows per tile (the tiles below are written out for 1 to 9: a tile's
/// accumulators and a block's unpacked weights fit the 32 vector registers). Nine, not eight:
/// a speculative verify step of 8 drafts has 9 rows, which one tile then takes where two
/// unpacked each block twice (a 9-row step 4-8% faster here, prefill and 16 rows unchanged).
const MR: usize = 9;
const _: () = assert!(MR == 9);

/// Computes output columns `n0..n1` (multiples of 8) for all `m` activation rows, bitwise as
/// [`super::vnni::chunk`] does. `xw` is `x` through [`widen`] for `dtype` (made once a matmul,
/// not once a work item): `m` rows of `nb` blocks of [`WIDE`] bytes.
///
/// # Safety
/// As [`super::vnni::chunk`], `xw` as said, and the CPU has AVX-512 F, BW, VL and VNNI.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn chunk(
    dtype: DType,
    w: *const u8,
    nb: usize,
    x: *const u8,
    xw: *const u8,
    x_row: usize,
    m: usize,
    n0: usize,
    n1: usize,
    out: *mut f32,
    ldo: usize,
) {
    let gb = group_block_bytes(dtype) * nb;
    let xw_row = nb * WIDE;
    let pf = crate::prefetch_weights();
    let (g0, g1) = (n0 / GROUP, n1 / GROUP);
    let pairs_end = g0 + (g1 - g0) / 2 * 2;
    let mut mb = 0;
    while mb < m {
        // Seven tiles of rows at a time (63), their activations kept in cache across the groups.
        let me = (mb + 7 * MR).min(m);
        for g in (g0..pairs_end).step_by(2) {
            let mut i = mb;
            while i < me {
                let rows = (me - i).min(MR);
                // SAFETY: groups g and g + 1 and rows i..i + rows are inside the buffers.
                unsafe {
                    let (wg, xi, o) = (
                        w.add(g * gb),
                        xw.add(i * xw_row),
                        out.add(i * ldo + g * GROUP),
                    );
                    macro_rules! tile {
                        ($m:literal) => {
                            match dtype {
                                DType::Q4_1 => {
                                    tile_q4::<$m, false>(wg, gb, nb, xi, xw_row, o, ldo, pf)
                                }
                                DType::Q4_K => {
                                    tile_q4::<$m, true>(wg, gb, nb, xi, xw_row, o, ldo, pf)
                                }
                                DType::Q6_K => {
                                    tile_q8::<$m, true>(wg, gb, nb, xi, xw_row, o, ldo, pf)
                                }
                                _ => tile_q8::<$m, false>(wg, gb, nb, xi, xw_row, o, ldo, pf),
                            }
                        };
                    }
                    match rows {
                        9 => tile!(9),
                        8 => tile!(8),
                        7 => tile!(7),
                        6 => tile!(6),
                        5 => tile!(5),
                        4 => tile!(4),
                        3 => tile!(3),
                        2 => tile!(2),
                        _ => tile!(1),
                    }
                }
                i += rows;
            }
        }
        mb = me;
    }
    if pairs_end < g1 {
        let n = pairs_end * GROUP;
        // SAFETY: the caller's contract, for the last group (with the caller's activations).
        unsafe { super::vnni::chunk(dtype, w, nb, x, x_row, m, n, n1, out, ldo) };
    }
}

/// Whether the kernels take `dtype`'s activations offset by 128 (its weights are 8-bit).
pub fn offset_weights(dtype: DType) -> bool {
    matches!(dtype, DType::Q8_0 | DType::Q6_K)
}

/// Bytes of a widened activation block: its scale and its sum term as f32, then 32 quants.
pub const WIDE: usize = 40;

/// The activation rows `x` for `dtype`'s weights, widened for these kernels: each block (an f16
/// scale, for 4-bit weights a sum term, 32 quants) as [`WIDE`] bytes — the scale as f32, the
/// sum term as the f32 the 256-bit kernels compute from it (Q8_1's f16 sum; for Q4_K the scale
/// times the integer sum), the quants, offset by 128 for 8-bit weights (`x + 128` as an
/// unsigned byte; see the module doc).
pub fn widen(dtype: DType, x: &[u8]) -> Vec<u8> {
    let f16 = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).to_f32();
    let (block, quants) = if offset_weights(dtype) {
        (34, 2)
    } else {
        (36, 4)
    };
    let mut v = Vec::with_capacity(x.len() / block * WIDE);
    for b in x.chunks_exact(block) {
        let d = f16(b);
        let sum = match dtype {
            DType::Q4_1 => f16(&b[2..]),
            DType::Q4_K => d * i16::from_le_bytes([b[2], b[3]]) as f32,
            _ => 0.0,
        };
        v.extend_from_slice(&d.to_le_bytes());
        v.extend_from_slice(&sum.to_le_bytes());
        let q = &b[quants..];
        match offset_weights(dtype) {
            true => v.extend(q.iter().map(|q| q ^ 0x80)),
            false => v.extend_from_slice(q),
        }
    }
    v
}

/// Prefetches the block at `p` of the next pair of groups (`2 * apart` on: the next tile's,
/// where the rows fit one tile),
/// `bytes` long for each group (0 where [`crate::prefetch_weights`] is off). The hardware's
/// prefetchers alone left a step waiting on its weights: with this, on a 2-vCPU Xeon, batch-1
/// decode ran 1.4-1.8x faster and a 5-row step 1.5x (BENCHMARKS, "what made it fast").
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn ahead(p: *const u8, apart: usize, bytes: usize) {
    for g in 2..4 {
        let mut at = 0;
        while at < bytes {
            // A prefetch never faults, wherever it points.
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(g * apart + at) as *const i8);
            at += 64;
        }
    }
}

/// An f32 at `p`, in every lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn f32s(p: *const u8) -> __m512 {
    // SAFETY: caller passes 4 readable bytes.
    _mm512_set1_ps(unsafe { (p as *const f32).read_unaligned() })
}

/// The 4-byte chunk `c` of an activation block's quants, in every 32-bit lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn xchunk(q: *const u8, c: usize) -> __m512i {
    // SAFETY: caller passes a block's 32 quants.
    _mm512_set1_epi32(unsafe { (q.add(4 * c) as *const i32).read_unaligned() })
}

/// 32 bytes at `p` (the first group) and at `p + apart` (the second), joined.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn join(p: *const u8, apart: usize) -> __m512i {
    // SAFETY: caller passes 32 readable bytes at both.
    unsafe {
        let lo = _mm256_loadu_si256(p as *const __m256i);
        let hi = _mm256_loadu_si256(p.add(apart) as *const __m256i);
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
    }
}

/// The two groups' 8 scales each at `p` and `p + apart`: f32 (`F32S`) or f16.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn scales<const F32S: bool>(p: *const u8, apart: usize) -> __m512 {
    // SAFETY: caller passes 32 (f32) or 16 (f16) readable bytes at both.
    unsafe {
        if F32S {
            _mm512_castsi512_ps(join(p, apart))
        } else {
            let lo = _mm_loadu_si128(p as *const __m128i);
            let hi = _mm_loadu_si128(p.add(apart) as *const __m128i);
            _mm512_cvtph_ps(_mm256_inserti128_si256::<1>(_mm256_castsi128_si256(lo), hi))
        }
    }
}

/// 4-bit affine weights, as the 256-bit `tile_q4` (Q4_1 against Q8_1; Q4_K sub-blocks, `F32S`,
/// against Q8_K-style blocks with integer sums), for groups at `w` and `w + apart`, against
/// widened activations.
#[inline]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn tile_q4<const M: usize, const F32S: bool>(
    w: *const u8,
    apart: usize,
    nb: usize,
    x: *const u8,
    x_row: usize,
    out: *mut f32,
    ldo: usize,
    pf: bool,
) {
    let mut acc = [_mm512_setzero_ps(); M];
    let low = _mm512_set1_epi8(0x0f);
    let (sb, gb) = if F32S { (32, 192) } else { (16, 160) };
    // SAFETY: (whole body) block b of both groups and of each activation row is in bounds.
    unsafe {
        for b in 0..nb {
            let p = w.add(b * gb);
            ahead(p, apart, if pf { gb } else { 0 });
            let d = scales::<F32S>(p, apart);
            let mn = scales::<F32S>(p.add(sb), apart);
            let mut v = [_mm512_setzero_si512(); 8];
            for c in 0..4 {
                let l = join(p.add(2 * sb + 32 * c), apart);
                v[c] = _mm512_and_si512(l, low);
                v[c + 4] = _mm512_and_si512(_mm512_srli_epi16::<4>(l), low);
            }
            for (i, a) in acc.iter_mut().enumerate() {
                let xb = x.add(i * x_row + b * WIDE);
                let q = xb.add(8);
                let mut s32 = _mm512_setzero_si512();
                for (c, vc) in v.iter().enumerate() {
                    s32 = _mm512_dpbusd_epi32(s32, *vc, xchunk(q, c));
                }
                let f = _mm512_cvtepi32_ps(s32);
                *a = _mm512_fmadd_ps(_mm512_mul_ps(d, f32s(xb)), f, *a);
                *a = _mm512_fmadd_ps(mn, f32s(xb.add(4)), *a);
            }
        }
        for (i, a) in acc.iter().enumerate() {
            _mm512_storeu_ps(out.add(i * ldo), *a);
        }
    }
}

/// 8-bit symmetric weights, as the 256-bit `tile_q8` (Q8_0; Q6_K sub-blocks with a scale for
/// each half, `SPLIT`), for groups at `w` and `w + apart`, against activations offset by 128.
#[inline]
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn tile_q8<const M: usize, const SPLIT: bool>(
    w: *const u8,
    apart: usize,
    nb: usize,
    x: *const u8,
    x_row: usize,
    out: *mut f32,
    ldo: usize,
    pf: bool,
) {
    let mut acc = [_mm512_setzero_ps(); M];
    let ones = _mm512_set1_epi8(1);
    let (qs, gb) = if SPLIT { (64, 320) } else { (16, 272) };
    // SAFETY: (whole body) block b of both groups and of each activation row is in bounds.
    unsafe {
        for b in 0..nb {
            let p = w.add(b * gb);
            ahead(p, apart, if pf { gb } else { 0 });
            let (d, d_hi) = if SPLIT {
                (scales::<true>(p, apart), scales::<true>(p.add(32), apart))
            } else {
                let d = scales::<false>(p, apart);
                (d, d)
            };
            let mut v = [_mm512_setzero_si512(); 8];
            // -128 x the sum of each lane's weights over chunks 0..4 and 4..8.
            let mut base = [_mm512_setzero_si512(); 2];
            for c in 0..8 {
                v[c] = join(p.add(qs + 32 * c), apart);
                base[c / 4] = _mm512_dpbusd_epi32(base[c / 4], ones, v[c]);
            }
            let base =
                base.map(|s| _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32::<7>(s)));
            for (i, a) in acc.iter_mut().enumerate() {
                let xb = x.add(i * x_row + b * WIDE);
                let q = xb.add(8);
                // Chunks 0..4 hold values 0..16, chunks 4..8 values 16..32.
                let (mut lo, mut hi) = (base[0], base[1]);
                for c in 0..4 {
                    lo = _mm512_dpbusd_epi32(lo, xchunk(q, c), v[c]);
                    hi = _mm512_dpbusd_epi32(hi, xchunk(q, c + 4), v[c + 4]);
                }
                let dx = f32s(xb);
                if SPLIT {
                    let (lo, hi) = (_mm512_cvtepi32_ps(lo), _mm512_cvtepi32_ps(hi));
                    *a = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), lo, *a);
                    *a = _mm512_fmadd_ps(_mm512_mul_ps(d_hi, dx), hi, *a);
                } else {
                    let f = _mm512_cvtepi32_ps(_mm512_add_epi32(lo, hi));
                    *a = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), f, *a);
                }
            }
        }
        for (i, a) in acc.iter().enumerate() {
            _mm512_storeu_ps(out.add(i * ldo), *a);
        }
    }
}
