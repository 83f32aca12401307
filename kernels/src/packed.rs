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
//! - Q4_K, per 32-value sub-block: 8 scales (f32), 8 minimums (f32, negated: value = q·d + m),
//!   then the nibbles as for Q4_1 — the sub-block is a Q4_1 block with exact f32 scales.
//! - Q6_K, per 32-value sub-block: 8 scales of values 0..16 (f32), 8 of values 16..32, then
//!   the quants (-32..=31) as for Q8_0.
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
        DType::Q4_K => 64 + 128,
        DType::Q6_K => 64 + 256,
        _ => 0,
    }
}

/// Whether `dtype` weights of `rows` rows can be interleaved.
pub fn supports(dtype: DType, rows: usize) -> bool {
    matches!(dtype, DType::Q4_1 | DType::Q8_0 | DType::Q4_K | DType::Q6_K) && rows % GROUP == 0
}

/// Interleaves `rows` rows of `cols` values stored as `dtype` (GGML block layout).
pub fn pack(dtype: DType, src: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    match dtype {
        DType::Q4_K | DType::Q6_K => return pack_k(dtype, src, rows, cols),
        _ => {}
    }
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

/// [`pack`] for the K-quants: each row's super-blocks read into 32-value sub-blocks
/// ([`crate::kquant`]), laid out per group as the module doc says.
fn pack_k(dtype: DType, src: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    use crate::kquant::{k4_sub_blocks, q6_k_sub_blocks};
    let nb = cols / 32;
    let (row_bytes, gb) = (dtype.row_bytes(cols).unwrap_or(0), group_block_bytes(dtype));
    let mut out = vec![0u8; rows / GROUP * nb * gb];
    let put = |dst: &mut [u8], at: usize, v: f32| dst[at..at + 4].copy_from_slice(&v.to_le_bytes());
    for r in 0..rows {
        let (g, j) = (r / GROUP, r % GROUP);
        let row = &src[r * row_bytes..(r + 1) * row_bytes];
        for (s, sb) in row.chunks_exact(dtype.block_bytes()).enumerate() {
            let at = |k: usize| (g * nb + s * 8 + k) * gb;
            if dtype == DType::Q4_K {
                for (k, sub) in k4_sub_blocks(sb, false).iter().enumerate() {
                    let dst = &mut out[at(k)..][..gb];
                    put(dst, 4 * j, sub.d);
                    put(dst, 32 + 4 * j, -sub.m);
                    for i in 0..16 {
                        let byte = sub.q[i] | (sub.q[i + 16] << 4);
                        dst[64 + 32 * (i / 4) + 4 * j + i % 4] = byte;
                    }
                }
            } else {
                for (k, sub) in q6_k_sub_blocks(sb).iter().enumerate() {
                    let dst = &mut out[at(k)..][..gb];
                    put(dst, 4 * j, sub.d[0]);
                    put(dst, 32 + 4 * j, sub.d[1]);
                    for i in 0..32 {
                        dst[64 + 32 * (i / 4) + 4 * j + i % 4] = sub.q[i] as u8;
                    }
                }
            }
        }
    }
    out
}

/// The x86 kernels, written once and compiled twice: for AVX2 (with FMA and F16C), and with
/// the AVX-512 VNNI dot-product instruction at 256 bits (`vpdpbusd`, with AVX-512 VL), which
/// makes the same exact integer sums in one instruction where AVX2 needs three — the float
/// arithmetic is the same, so both give bitwise the same outputs.
#[cfg(target_arch = "x86_64")]
macro_rules! x86_kernels {
    ($features:literal, $vnni:literal) => {
        use std::arch::x86_64::*;

        use super::{group_block_bytes, GROUP};
        use crate::quant::DType;

        /// Activation rows per tile (the tiles below are written out for 1 to 4).
        const MR: usize = 4;
        const _: () = assert!(MR == 4);

        /// Computes output columns `n0..n1` (multiples of 8) for all `m` activation rows.
        ///
        /// # Safety
        /// `w` holds the interleaved groups of a matrix with `nb` blocks per row; `x` holds `m` rows
        /// of `x_row` bytes of Q8_1 (Q4_1 weights) or Q8_0 (Q8_0 weights) blocks; `out` holds
        /// `m * ldo` floats and no other thread writes columns `n0..n1`. The CPU has this module's
        /// features (AVX2, FMA and F16C; for `vnni` also AVX-512 VNNI and VL).
        #[allow(clippy::too_many_arguments)]
        #[target_feature(enable = $features)]
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
            let pf = crate::prefetch_weights();
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
                            // The rows left in tiles of MR, then one tile of the 1-3 left
                            // (each row's arithmetic is the same in a tile of any size: the
                            // group's weights are unpacked once for all its rows).
                            macro_rules! tile {
                                ($m:literal) => {
                                    match dtype {
                                        DType::Q4_1 => {
                                            tile_q4::<$m, false>(wg, nb, xi, x_row, o, ldo, pf)
                                        }
                                        DType::Q4_K => {
                                            tile_q4::<$m, true>(wg, nb, xi, x_row, o, ldo, pf)
                                        }
                                        DType::Q6_K => {
                                            tile_q8::<$m, true>(wg, nb, xi, x_row, o, ldo, pf)
                                        }
                                        _ => tile_q8::<$m, false>(wg, nb, xi, x_row, o, ldo, pf),
                                    }
                                };
                            }
                            let rows = (me - i).min(MR);
                            match rows {
                                4 => tile!(4),
                                3 => tile!(3),
                                2 => tile!(2),
                                _ => tile!(1),
                            }
                            i += rows;
                        }
                    }
                }
                mb = me;
            }
        }

        /// The f16 at `p` as f32.
        #[inline]
        #[target_feature(enable = $features)]
        pub(crate) unsafe fn h(p: *const u8) -> f32 {
            // SAFETY: caller passes two readable bytes.
            let bits = unsafe { (p as *const u16).read_unaligned() };
            _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
        }

        /// The 4-byte chunk `c` of an activation block's quants, in every 32-bit lane.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn xchunk(q: *const u8, c: usize) -> __m256i {
            // SAFETY: caller passes a block's 32 quants.
            _mm256_set1_epi32(unsafe { (q.add(4 * c) as *const i32).read_unaligned() })
        }

        /// A group's 8 scales at `p`: f32 (`F32S`) or f16.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn scales<const F32S: bool>(p: *const u8) -> __m256 {
            // SAFETY: caller passes 32 (f32) or 16 (f16) readable bytes.
            unsafe {
                if F32S {
                    _mm256_loadu_ps(p as *const f32)
                } else {
                    _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
                }
            }
        }

        /// Prefetches `bytes` at `p` (a block of the next group, the next tile's): the
        /// hardware's prefetchers alone leave a step waiting on its weights (see the 512-bit
        /// kernels' `ahead`).
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn ahead(p: *const u8, bytes: usize) {
            let mut at = 0;
            while at < bytes {
                // A prefetch never faults, wherever it points.
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(at) as *const i8);
                at += 64;
            }
        }

        /// 4-bit affine weights (Q4_1 with f16 scales, against Q8_1 activations; Q4_K sub-blocks
        /// with f32 ones, `F32S`, against Q8_K-style blocks with integer sums).
        #[allow(unused_unsafe, clippy::too_many_arguments)]
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn tile_q4<const M: usize, const F32S: bool>(
            w: *const u8,
            nb: usize,
            x: *const u8,
            x_row: usize,
            out: *mut f32,
            ldo: usize,
            pf: bool,
        ) {
            let mut acc = [_mm256_setzero_ps(); M];
            let low = _mm256_set1_epi8(0x0f);
            let ones = _mm256_set1_epi16(1);
            let (sb, gb) = if F32S { (32, 192) } else { (16, 160) };
            // SAFETY: (whole body) block b of the group and of each activation row is in bounds.
            unsafe {
                for b in 0..nb {
                    let p = w.add(b * gb);
                    ahead(p.wrapping_add(nb * gb), if pf { gb } else { 0 });
                    let d = scales::<F32S>(p);
                    let mn = scales::<F32S>(p.add(sb));
                    let mut v = [_mm256_setzero_si256(); 8];
                    for c in 0..4 {
                        let l = _mm256_loadu_si256(p.add(2 * sb + 32 * c) as *const __m256i);
                        v[c] = _mm256_and_si256(l, low);
                        v[c + 4] = _mm256_and_si256(_mm256_srli_epi16(l, 4), low);
                    }
                    for (i, a) in acc.iter_mut().enumerate() {
                        let xb = x.add(i * x_row + b * 36);
                        let q = xb.add(4);
                        let f = _mm256_cvtepi32_ps(if $vnni {
                            let mut s32 = _mm256_setzero_si256();
                            for (c, vc) in v.iter().enumerate() {
                                // SAFETY: compiled in only where the module has VNNI.
                                s32 = unsafe { _mm256_dpbusd_epi32(s32, *vc, xchunk(q, c)) };
                            }
                            s32
                        } else {
                            // u4 x i8 pair sums fit in i16 even summed over all 8 chunks
                            // (8*2*15*128), so the sum is the exact one VNNI makes.
                            let mut s16 = _mm256_maddubs_epi16(v[0], xchunk(q, 0));
                            for (c, vc) in v.iter().enumerate().skip(1) {
                                s16 =
                                    _mm256_add_epi16(s16, _mm256_maddubs_epi16(*vc, xchunk(q, c)));
                            }
                            _mm256_madd_epi16(s16, ones)
                        });
                        *a = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(h(xb))), f, *a);
                        // Q8_1 carries d * sum in f16; the Q8_K-style blocks the K-quants take,
                        // the integer sum.
                        let sum = if F32S {
                            h(xb) * (xb.add(2) as *const i16).read_unaligned() as f32
                        } else {
                            h(xb.add(2))
                        };
                        *a = _mm256_fmadd_ps(mn, _mm256_set1_ps(sum), *a);
                    }
                }
                for (i, a) in acc.iter().enumerate() {
                    _mm256_storeu_ps(out.add(i * ldo), *a);
                }
            }
        }

        /// The i32 dot products, per row lane, of 8-bit weight chunks `c0..c0 + 4` (`v`, and their
        /// absolute values `av`) with the activation block's quants `q`: |w| x sign(x, w), whose
        /// i16 pair sums fit but whose sum over chunks may not, so each is widened.
        #[allow(unused_unsafe)]
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn half_dot(
            v: &[__m256i; 8],
            av: &[__m256i; 8],
            q: *const u8,
            c0: usize,
            ones: __m256i,
        ) -> __m256i {
            let mut s32 = _mm256_setzero_si256();
            for c in c0..c0 + 4 {
                // SAFETY: caller passes an activation block's 32 quants.
                let xs = _mm256_sign_epi8(unsafe { xchunk(q, c) }, v[c]);
                s32 = if $vnni {
                    // SAFETY: compiled in only where the module has VNNI (needs `unsafe` elsewhere).
                    unsafe { _mm256_dpbusd_epi32(s32, av[c], xs) }
                } else {
                    let pr = _mm256_maddubs_epi16(av[c], xs);
                    _mm256_add_epi32(s32, _mm256_madd_epi16(pr, ones))
                };
            }
            s32
        }

        /// 8-bit symmetric weights (Q8_0 with one f16 scale a block; Q6_K sub-blocks with an f32
        /// scale for each half, `SPLIT`) against Q8_0 activations.
        #[inline]
        #[allow(clippy::too_many_arguments)]
        #[target_feature(enable = $features)]
        unsafe fn tile_q8<const M: usize, const SPLIT: bool>(
            w: *const u8,
            nb: usize,
            x: *const u8,
            x_row: usize,
            out: *mut f32,
            ldo: usize,
            pf: bool,
        ) {
            let mut acc = [_mm256_setzero_ps(); M];
            let ones = _mm256_set1_epi16(1);
            let (qs, gb) = if SPLIT { (64, 320) } else { (16, 272) };
            // SAFETY: (whole body) block b of the group and of each activation row is in bounds.
            unsafe {
                for b in 0..nb {
                    let p = w.add(b * gb);
                    ahead(p.wrapping_add(nb * gb), if pf { gb } else { 0 });
                    let (d, d_hi) = if SPLIT {
                        (scales::<true>(p), scales::<true>(p.add(32)))
                    } else {
                        let d = scales::<false>(p);
                        (d, d)
                    };
                    let mut v = [_mm256_setzero_si256(); 8];
                    let mut av = [_mm256_setzero_si256(); 8];
                    for c in 0..8 {
                        v[c] = _mm256_loadu_si256(p.add(qs + 32 * c) as *const __m256i);
                        av[c] = _mm256_sign_epi8(v[c], v[c]);
                    }
                    for (i, a) in acc.iter_mut().enumerate() {
                        let xb = x.add(i * x_row + b * 34);
                        let q = xb.add(2);
                        // Chunks 0..4 hold values 0..16, chunks 4..8 values 16..32.
                        let (lo, hi) =
                            (half_dot(&v, &av, q, 0, ones), half_dot(&v, &av, q, 4, ones));
                        let dx = _mm256_set1_ps(h(xb));
                        if SPLIT {
                            let (lo, hi) = (_mm256_cvtepi32_ps(lo), _mm256_cvtepi32_ps(hi));
                            *a = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), lo, *a);
                            *a = _mm256_fmadd_ps(_mm256_mul_ps(d_hi, dx), hi, *a);
                        } else {
                            let f = _mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi));
                            *a = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), f, *a);
                        }
                    }
                }
                for (i, a) in acc.iter().enumerate() {
                    _mm256_storeu_ps(out.add(i * ldo), *a);
                }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    x86_kernels!("avx2,fma,f16c", false);
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod vnni {
    x86_kernels!("avx2,fma,f16c,avx512vnni,avx512vl", true);
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::{avx2, avx512, pack, vnni};
    use crate::quant::{quantize_row_q8, quantize_row_q8_k, DType, Q8_0_BYTES, Q8_1_BYTES};

    /// `n` random bytes from a xorshift64* stream.
    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s >> 12;
                s ^= s << 25;
                s ^= s >> 27;
                (s.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8
            })
            .collect()
    }

    /// The VNNI kernels, at 256 and at 512 bits, give bitwise the AVX2 kernels' outputs, for
    /// every interleaved format, for a batch of one (decode) and for tiles of four (256 bits) or
    /// nine (512 bits) rows, whole and with some left over, and (70 rows) over more than one
    /// 512-bit pass of 63 rows; the 512-bit ones over ranges of an even and an odd number of
    /// groups (the last of an odd one runs at 256 bits).
    #[test]
    fn vnni_kernels_equal_the_avx2_ones_bitwise() {
        if !(crate::isa() == crate::Isa::Avx2
            && is_x86_feature_detected!("avx512vnni")
            && is_x86_feature_detected!("avx512vl"))
        {
            eprintln!("not run: this CPU has no AVX-512 VNNI (the VNNI kernels are never used)");
            return;
        }
        let (rows, cols) = (24, 512);
        let f16s = |v: f32| half::f16::from_f32(v).to_le_bytes();
        for (dt, fields) in [
            (DType::Q4_1, &[0usize, 2][..]),
            (DType::Q8_0, &[0][..]),
            (DType::Q4_K, &[0, 2][..]),
            (DType::Q6_K, &[208][..]),
        ] {
            let bb = dt.block_bytes();
            let mut w = bytes(rows * dt.row_bytes(cols).unwrap(), 7);
            for (i, b) in w.chunks_exact_mut(bb).enumerate() {
                for &at in fields {
                    b[at..at + 2].copy_from_slice(&f16s(0.001 + (i % 13) as f32 * 1e-4));
                }
            }
            let packed = pack(dt, &w, rows, cols);
            let with_sum = matches!(dt, DType::Q4_1 | DType::Q4_K);
            let x_row = cols / 32 * if with_sum { Q8_1_BYTES } else { Q8_0_BYTES };
            for m in [1, 2, 3, 5, 6, 7, 8, 9, 10, 13, 19, 70] {
                let xf: Vec<f32> = bytes(m * cols, m as u64 + 3)
                    .iter()
                    .map(|&b| b as f32 / 64.0 - 2.0)
                    .collect();
                let mut x = vec![0u8; m * x_row];
                for (xr, qr) in xf.chunks(cols).zip(x.chunks_mut(x_row)) {
                    match dt {
                        DType::Q4_K | DType::Q6_K => quantize_row_q8_k(xr, qr, with_sum),
                        _ => quantize_row_q8(xr, qr, with_sum),
                    }
                }
                let xo = avx512::widen(dt, &x);
                let run = |kernel: usize, (n0, n1): (usize, usize)| {
                    let mut out = vec![0f32; m * rows];
                    // SAFETY: the CPU has AVX2/FMA/F16C (isa) and AVX-512 VNNI/VL (checked
                    // above), and F/BW where the 512-bit kernel runs; the buffers hold `rows`
                    // packed rows, `m` activation rows (and their widened copy) and `m * rows`
                    // outputs.
                    let (wp, xp, op) = (packed.as_ptr(), x.as_ptr(), out.as_mut_ptr());
                    let nb = cols / 32;
                    unsafe {
                        match kernel {
                            0 => avx2::chunk(dt, wp, nb, xp, x_row, m, n0, n1, op, rows),
                            1 => vnni::chunk(dt, wp, nb, xp, x_row, m, n0, n1, op, rows),
                            _ => avx512::chunk(
                                dt,
                                wp,
                                nb,
                                xp,
                                xo.as_ptr(),
                                x_row,
                                m,
                                n0,
                                n1,
                                op,
                                rows,
                            ),
                        }
                    };
                    out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                };
                assert_eq!(
                    run(1, (0, rows)),
                    run(0, (0, rows)),
                    "{dt:?}, {m} activation rows"
                );
                if !crate::avx512() {
                    continue;
                }
                for range in [(0, rows), (8, rows), (0, 16)] {
                    let at = format!("{dt:?}, {m} activation rows, outputs {range:?}");
                    assert_eq!(run(2, range), run(0, range), "512 bits, {at}");
                }
            }
        }
    }
}
