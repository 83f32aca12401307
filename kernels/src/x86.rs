//! Shared AVX2/FMA/F16C building blocks for the x86-64 kernels.

use std::arch::x86_64::*;

/// Sum of the 8 lanes, in a fixed order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn hsum(x: __m256) -> f32 {
    let r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    let r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    let r = _mm_add_ss(r, _mm_movehdup_ps(r));
    _mm_cvtss_f32(r)
}

/// e^x per lane: the same range reduction and polynomial as [`crate::ops::exp`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn exp8(x: __m256) -> __m256 {
    let x = _mm256_min_ps(
        _mm256_max_ps(x, _mm256_set1_ps(-87.3)),
        _mm256_set1_ps(88.7),
    );
    let n = _mm256_round_ps(
        _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
    );
    let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693_359_4), x);
    let r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.121_944_4e-4), r);
    let mut p = _mm256_set1_ps(1.987_569_1e-4);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.398_199_9e-3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.333_452e-3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.166_579_6e-2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.666_666_6e-1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5));
    p = _mm256_add_ps(
        _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r),
        _mm256_set1_ps(1.0),
    );
    let e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
        23,
    );
    _mm256_mul_ps(p, _mm256_castsi256_ps(e))
}

/// Loads up to 8 floats, filling missing lanes with `fill`.
///
/// # Safety
/// `p` must point at `n.min(8)` readable floats.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn load_partial(p: *const f32, n: usize, fill: f32) -> __m256 {
    let mut buf = [fill; 8];
    // SAFETY: caller guarantees n.min(8) readable floats.
    unsafe { std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), n.min(8)) };
    // SAFETY: buf holds 8 floats.
    unsafe { _mm256_loadu_ps(buf.as_ptr()) }
}

/// `gate[i] = act(gate[i]) * up[i]`, the same operations as [`crate::Activation::apply`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn glu(gate: &mut [f32], up: &[f32], act: crate::Activation) {
    let n = gate.len().min(up.len());
    let one = _mm256_set1_ps(1.0);
    let table = crate::ops::gelu_table();
    let mut i = 0;
    while i < n {
        let c = (n - i).min(8);
        // SAFETY: c floats are readable at offset i of both slices.
        let (g, u) = unsafe {
            (
                load_partial(gate.as_ptr().add(i), c, 0.0),
                load_partial(up.as_ptr().add(i), c, 0.0),
            )
        };
        let a = match act {
            crate::Activation::Silu => {
                let e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
                _mm256_div_ps(g, _mm256_add_ps(one, e))
            }
            crate::Activation::GeluTanh => {
                // The table entry of g rounded to f16, as `ops::gelu`; 0 at or below -10 and g
                // at or above 10.
                let bits = _mm256_cvtepu16_epi32(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(g));
                // SAFETY: every index is a u16, within the 65,536-entry table.
                let looked = unsafe { _mm256_i32gather_ps::<4>(table.as_ptr(), bits) };
                let low = _mm256_cmp_ps::<_CMP_LE_OQ>(g, _mm256_set1_ps(-10.0));
                let high = _mm256_cmp_ps::<_CMP_GE_OQ>(g, _mm256_set1_ps(10.0));
                _mm256_blendv_ps(_mm256_andnot_ps(low, looked), g, high)
            }
        };
        let r = _mm256_mul_ps(a, u);
        let mut out = [0f32; 8];
        // SAFETY: out holds 8 floats.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), r) };
        gate[i..i + c].copy_from_slice(&out[..c]);
        i += 8;
    }
}

/// Writes 32 quants (four registers of eight i32 within -127..=127) as bytes in order and
/// returns their sum.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn store_quants(q: [__m256i; 4], out: &mut [u8]) -> i32 {
    let sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    let mut lanes = [0i32; 8];
    // SAFETY: lanes holds 8 i32.
    unsafe { _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, sum) };
    let p01 = _mm256_packs_epi32(q[0], q[1]);
    let p23 = _mm256_packs_epi32(q[2], q[3]);
    let bytes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(p01, p23),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7),
    );
    assert!(out.len() >= 32);
    // SAFETY: out has 32 bytes (checked).
    unsafe { _mm256_storeu_si256(out.as_mut_ptr() as *mut __m256i, bytes) };
    lanes.iter().sum()
}

/// Quantises a row as [`crate::quant::quantize_row_q8_k`] does, to the bit: one scale per 256
/// values (from the first value of largest magnitude), Q8_0/Q8_1-shaped blocks of 32.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn quantize_row_q8_k(x: &[f32], out: &mut [u8], with_sum: bool) {
    let (bb, qoff) = if with_sum {
        (crate::quant::Q8_1_BYTES, 4)
    } else {
        (crate::quant::Q8_0_BYTES, 2)
    };
    let sign = _mm256_set1_ps(-0.0);
    for (xs, os) in x.chunks(256).zip(out.chunks_mut(bb * 8)) {
        if xs.len() % 32 != 0 {
            return crate::quant::quantize_row_q8_k(x, out, with_sum);
        }
        let mut m = _mm256_setzero_ps();
        for c in xs.chunks_exact(8) {
            // SAFETY: c has 8 floats.
            m = _mm256_max_ps(
                m,
                _mm256_andnot_ps(sign, unsafe { _mm256_loadu_ps(c.as_ptr()) }),
            );
        }
        let m4 = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
        let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        let max = xs.iter().copied().find(|v| v.abs() == amax).unwrap_or(0.0);
        let iscale = if amax != 0.0 { -127.0 / max } else { 0.0 };
        let d = if amax != 0.0 { 1.0 / iscale } else { 0.0 };
        let (iv, top) = (_mm256_set1_ps(iscale), _mm256_set1_epi32(127));
        for (xb, ob) in xs.chunks_exact(32).zip(os.chunks_exact_mut(bb)) {
            // SAFETY: xb has 32 floats.
            let v = unsafe { [0, 8, 16, 24].map(|o| _mm256_loadu_ps(xb.as_ptr().add(o))) };
            let q = v.map(|vi| {
                let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                    _mm256_mul_ps(vi, iv),
                );
                _mm256_min_epi32(_mm256_cvtps_epi32(r), top)
            });
            let sum = store_quants(q, &mut ob[qoff..qoff + 32]);
            ob[0..2].copy_from_slice(&half::f16::from_f32(d).to_bits().to_le_bytes());
            if with_sum {
                ob[2..4].copy_from_slice(&(sum as i16).to_le_bytes());
            }
        }
    }
}

/// Quantises a row to Q8_0/Q8_1 blocks exactly as [`crate::quant::quantize_row_q8`] does.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn quantize_row_q8(x: &[f32], out: &mut [u8], with_sum: bool) {
    let (bb, qoff) = if with_sum {
        (crate::quant::Q8_1_BYTES, 4)
    } else {
        (crate::quant::Q8_0_BYTES, 2)
    };
    let sign = _mm256_set1_ps(-0.0);
    for (xb, ob) in x.chunks_exact(32).zip(out.chunks_exact_mut(bb)) {
        // SAFETY: xb has 32 floats.
        let v = unsafe { [0, 8, 16, 24].map(|o| _mm256_loadu_ps(xb.as_ptr().add(o))) };
        let mut m = _mm256_andnot_ps(sign, v[0]);
        for vi in &v[1..] {
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, *vi));
        }
        let m4 = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
        let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        let d = amax / 127.0;
        let id = _mm256_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
        let q = v.map(|vi| {
            _mm256_cvtps_epi32(_mm256_round_ps(
                _mm256_mul_ps(vi, id),
                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
            ))
        });
        let sum = store_quants(q, &mut ob[qoff..qoff + 32]);
        ob[0..2].copy_from_slice(&half::f16::from_f32(d).to_bits().to_le_bytes());
        if with_sum {
            let s = d * sum as f32;
            ob[2..4].copy_from_slice(&half::f16::from_f32(s).to_bits().to_le_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    /// The AVX2 quantisers write the scalar ones' bytes: Q8_0/Q8_1 and the Q8_K-style blocks,
    /// on rows with exact halves (ties), zero blocks, and a negative extreme.
    #[test]
    fn avx2_quantisers_equal_the_scalar_ones() {
        if crate::isa() != crate::Isa::Avx2 {
            return;
        }
        let mut x: Vec<f32> = (0..1024)
            .map(|i| ((i * 7919) % 2001) as f32 / 400.0 - 2.5)
            .collect();
        x[300] = -9.0;
        x[512..768].fill(0.0);
        for with_sum in [false, true] {
            let bb = if with_sum {
                crate::quant::Q8_1_BYTES
            } else {
                crate::quant::Q8_0_BYTES
            };
            let (mut a, mut b) = (vec![0u8; 32 * bb], vec![0u8; 32 * bb]);
            crate::quant::quantize_row_q8_k(&x, &mut a, with_sum);
            // SAFETY: the CPU has AVX2 (checked above).
            unsafe { super::quantize_row_q8_k(&x, &mut b, with_sum) };
            assert_eq!(a, b, "Q8_K-style, with_sum {with_sum}");
            crate::quant::quantize_row_q8(&x, &mut a, with_sum);
            // SAFETY: as above.
            unsafe { super::quantize_row_q8(&x, &mut b, with_sum) };
            assert_eq!(a, b, "Q8_0/Q8_1, with_sum {with_sum}");
        }
    }
}
