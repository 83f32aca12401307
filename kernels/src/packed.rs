//! Row-interleaved weights for the x86 kernels: groups of 8 rows whose blocks are stored side by
//! side, so that one 256-bit lane per row accumulates that row's dot product and a group of 8
//! outputs needs no horizontal sums.
//!
//! Layout of one group, block after block (`nb = cols / 32` blocks):
//! - Q4_1: 8 scales (f16), 8 minimums (f16), then 4 chunks of 32 bytes; chunk `c` holds bytes
//!   `4c..4c+4` of each row's 16 nibble bytes (row `j` at bytes `4j..4j+4`). The low nibbles of
//!   chunk `c` are elements `4c..4c+4`, the high nibbles elements `16+4c..16+4c+4`.
//! - Q8_0: 8 scales (f16), then 8 chunks of 32 bytes; chunk `c` holds elements `4c..4c+4` of
//!   each row.
//!
//! Each output is `sum_b (d_w * d_x) * isum_b (+ m_w * s_x for Q4_1)`, accumulated block by
//! block in the row's lane: the same operations whatever the number of activation rows, so rows
//! stay bitwise independent of the batch.

use crate::quant::DType;

/// Rows per interleaved group.
pub const GROUP: usize = 8;

/// Bytes of one group's block.
pub fn group_block_bytes(dtype: DType) -> usize {
    match dtype {
        DType::Q4_1 => 32 + 128,
        DType::Q8_0 => 16 + 256,
        _ => 0,
    }
}

/// Whether `dtype` weights of `rows` rows can be interleaved.
pub fn supports(dtype: DType, rows: usize) -> bool {
    matches!(dtype, DType::Q4_1 | DType::Q8_0) && rows % GROUP == 0
}

/// Interleaves `rows` rows of `cols` values stored as `dtype` (GGML block layout).
pub fn pack(dtype: DType, src: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    let nb = cols / 32;
    let (sb, gb) = (dtype.block_bytes(), group_block_bytes(dtype));
    let row_bytes = nb * sb;
    let mut out = vec![0u8; rows / GROUP * nb * gb];
    for g in 0..rows / GROUP {
        for b in 0..nb {
            let dst = &mut out[(g * nb + b) * gb..][..gb];
            for j in 0..GROUP {
                let blk = &src[(g * GROUP + j) * row_bytes + b * sb..][..sb];
                dst[2 * j..2 * j + 2].copy_from_slice(&blk[0..2]);
                match dtype {
                    DType::Q4_1 => {
                        dst[16 + 2 * j..16 + 2 * j + 2].copy_from_slice(&blk[2..4]);
                        for c in 0..4 {
                            dst[32 + 32 * c + 4 * j..][..4]
                                .copy_from_slice(&blk[4 + 4 * c..8 + 4 * c]);
                        }
                    }
                    _ => {
                        for c in 0..8 {
                            dst[16 + 32 * c + 4 * j..][..4]
                                .copy_from_slice(&blk[2 + 4 * c..6 + 4 * c]);
                        }
                    }
                }
            }
        }
    }
    out
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    use super::{group_block_bytes, GROUP};
    use crate::quant::DType;

    /// Activation rows per tile.
    const MR: usize = 4;

    /// Computes output columns `n0..n1` (multiples of 8) for all `m` activation rows.
    ///
    /// # Safety
    /// `w` holds the interleaved groups of a matrix with `nb` blocks per row; `x` holds `m` rows
    /// of `x_row` bytes of Q8_1 (Q4_1 weights) or Q8_0 (Q8_0 weights) blocks; `out` holds
    /// `m * ldo` floats and no other thread writes columns `n0..n1`. AVX2, FMA and F16C present.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn chunk(
        dtype: DType,
        w: *const u8,
        nb: usize,
        x: *const u8,
        x_row: usize,
        m: usize,
        n0: usize,
        n1: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        let gb = group_block_bytes(dtype) * nb;
        let mut mb = 0;
        while mb < m {
            let me = (mb + 64).min(m);
            for g in n0 / GROUP..n1 / GROUP {
                let mut i = mb;
                while i < me {
                    // SAFETY: group g and rows i.. are inside the buffers (caller contract).
                    unsafe {
                        let (wg, xi, o) = (
                            w.add(g * gb),
                            x.add(i * x_row),
                            out.add(i * ldo + g * GROUP),
                        );
                        if me - i >= MR {
                            match dtype {
                                DType::Q4_1 => tile_q4_1::<MR>(wg, nb, xi, x_row, o, ldo),
                                _ => tile_q8_0::<MR>(wg, nb, xi, x_row, o, ldo),
                            }
                            i += MR;
                        } else {
                            match dtype {
                                DType::Q4_1 => tile_q4_1::<1>(wg, nb, xi, x_row, o, ldo),
                                _ => tile_q8_0::<1>(wg, nb, xi, x_row, o, ldo),
                            }
                            i += 1;
                        }
                    }
                }
            }
            mb = me;
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn h(p: *const u8) -> f32 {
        // SAFETY: caller passes two readable bytes.
        let bits = unsafe { (p as *const u16).read_unaligned() };
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    /// The 4-byte chunk `c` of an activation block's quants, in every 32-bit lane.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn xchunk(q: *const u8, c: usize) -> __m256i {
        // SAFETY: caller passes a block's 32 quants.
        _mm256_set1_epi32(unsafe { (q.add(4 * c) as *const i32).read_unaligned() })
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile_q4_1<const M: usize>(
        w: *const u8,
        nb: usize,
        x: *const u8,
        x_row: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        let mut acc = [_mm256_setzero_ps(); M];
        let low = _mm256_set1_epi8(0x0f);
        let ones = _mm256_set1_epi16(1);
        // SAFETY: (whole body) block b of the group and of each activation row is in bounds.
        unsafe {
            for b in 0..nb {
                let p = w.add(b * 160);
                let d = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
                let mn = _mm256_cvtph_ps(_mm_loadu_si128(p.add(16) as *const __m128i));
                let mut v = [_mm256_setzero_si256(); 8];
                for c in 0..4 {
                    let l = _mm256_loadu_si256(p.add(32 + 32 * c) as *const __m256i);
                    v[c] = _mm256_and_si256(l, low);
                    v[c + 4] = _mm256_and_si256(_mm256_srli_epi16(l, 4), low);
                }
                for (i, a) in acc.iter_mut().enumerate() {
                    let xb = x.add(i * x_row + b * 36);
                    let q = xb.add(4);
                    // u4 x i8 pair sums fit in i16 even summed over all 8 chunks (8*2*15*128).
                    let mut s16 = _mm256_maddubs_epi16(v[0], xchunk(q, 0));
                    for (c, vc) in v.iter().enumerate().skip(1) {
                        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(*vc, xchunk(q, c)));
                    }
                    let f = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones));
                    *a = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(h(xb))), f, *a);
                    *a = _mm256_fmadd_ps(mn, _mm256_set1_ps(h(xb.add(2))), *a);
                }
            }
            for (i, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(out.add(i * ldo), *a);
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile_q8_0<const M: usize>(
        w: *const u8,
        nb: usize,
        x: *const u8,
        x_row: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        let mut acc = [_mm256_setzero_ps(); M];
        let ones = _mm256_set1_epi16(1);
        // SAFETY: (whole body) block b of the group and of each activation row is in bounds.
        unsafe {
            for b in 0..nb {
                let p = w.add(b * 272);
                let d = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
                let mut v = [_mm256_setzero_si256(); 8];
                let mut av = [_mm256_setzero_si256(); 8];
                for c in 0..8 {
                    v[c] = _mm256_loadu_si256(p.add(16 + 32 * c) as *const __m256i);
                    av[c] = _mm256_sign_epi8(v[c], v[c]);
                }
                for (i, a) in acc.iter_mut().enumerate() {
                    let xb = x.add(i * x_row + b * 34);
                    let q = xb.add(2);
                    // |w| x sign(x, w): i16 pair sums fit, their sum over chunks may not: widen each.
                    let mut s32 = _mm256_setzero_si256();
                    for c in 0..8 {
                        let pr = _mm256_maddubs_epi16(av[c], _mm256_sign_epi8(xchunk(q, c), v[c]));
                        s32 = _mm256_add_epi32(s32, _mm256_madd_epi16(pr, ones));
                    }
                    let f = _mm256_cvtepi32_ps(s32);
                    *a = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(h(xb))), f, *a);
                }
            }
            for (i, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(out.add(i * ldo), *a);
            }
        }
    }
}
