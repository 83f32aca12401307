//! Weight and activation storage formats, laid out exactly as GGML stores them.
//!
//! A quantised row of `k` values is `k / 32` blocks (`k / 256` super-blocks for the K-quants,
//! see [`crate::kquant`]); each block carries its scale (and for the affine formats its
//! minimum) followed by the packed values.

use half::f16;

/// Number of values in one quantisation block (the 32-value formats; K-quant super-blocks hold
/// 256 as 8 sub-blocks of 32).
pub const QK: usize = 32;

/// A tensor element type, numbered as in GGML's `ggml_type`.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE f32.
    F32,
    /// IEEE f16.
    F16,
    /// bfloat16.
    BF16,
    /// 4-bit symmetric blocks: `{ f16 d; u8 qs[16] }`, value = (q - 8) * d.
    Q4_0,
    /// 4-bit affine blocks: `{ f16 d; f16 m; u8 qs[16] }`, value = q * d + m.
    Q4_1,
    /// 8-bit symmetric blocks: `{ f16 d; i8 qs[32] }`, value = q * d.
    Q8_0,
    /// 5-bit symmetric blocks: `{ f16 d; u8 qh[4]; u8 qs[16] }`, value = (q - 16) * d.
    Q5_0,
    /// 5-bit affine blocks: `{ f16 d; f16 m; u8 qh[4]; u8 qs[16] }`, value = q * d + m.
    Q5_1,
    /// 4-bit K-quant: 256-value super-blocks of 8 affine sub-blocks with 6-bit scales.
    Q4_K,
    /// 5-bit K-quant: as Q4_K with a fifth bit per value.
    Q5_K,
    /// 6-bit K-quant: 256-value super-blocks of 16 symmetric 16-value groups, 8-bit scales.
    Q6_K,
}

impl DType {
    /// The GGML type id of this type.
    pub fn ggml_id(self) -> u32 {
        match self {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::Q4_0 => 2,
            DType::Q4_1 => 3,
            DType::Q8_0 => 8,
            DType::Q5_0 => 6,
            DType::Q5_1 => 7,
            DType::Q4_K => 12,
            DType::Q5_K => 13,
            DType::Q6_K => 14,
            DType::BF16 => 30,
        }
    }

    /// Maps a GGML type id to a supported type; `None` for types tandem cannot run.
    pub fn from_ggml_id(id: u32) -> Option<DType> {
        Some(match id {
            0 => DType::F32,
            1 => DType::F16,
            2 => DType::Q4_0,
            3 => DType::Q4_1,
            6 => DType::Q5_0,
            7 => DType::Q5_1,
            8 => DType::Q8_0,
            12 => DType::Q4_K,
            13 => DType::Q5_K,
            14 => DType::Q6_K,
            30 => DType::BF16,
            _ => return None,
        })
    }

    /// Human-readable name of a GGML type id, including types tandem does not support.
    pub fn ggml_name(id: u32) -> &'static str {
        const NAMES: [&str; 31] = [
            "F32", "F16", "Q4_0", "Q4_1", "Q4_2", "Q4_3", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K",
            "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S",
            "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "I8", "I16", "I32", "I64", "F64", "IQ1_M",
            "BF16",
        ];
        NAMES.get(id as usize).copied().unwrap_or("unknown")
    }

    /// Values per block (1 for plain float types).
    pub fn block_len(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => 1,
            DType::Q4_0 | DType::Q4_1 | DType::Q8_0 | DType::Q5_0 | DType::Q5_1 => QK,
            DType::Q4_K | DType::Q5_K | DType::Q6_K => crate::kquant::QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
            DType::Q8_0 => 34,
            DType::Q5_0 => crate::kquant::Q5_0_BYTES,
            DType::Q5_1 => crate::kquant::Q5_1_BYTES,
            DType::Q4_K => crate::kquant::Q4_K_BYTES,
            DType::Q5_K => crate::kquant::Q5_K_BYTES,
            DType::Q6_K => crate::kquant::Q6_K_BYTES,
        }
    }

    /// Bytes needed for a row of `n` values, or `None` if `n` is not a whole number of blocks.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        (n % self.block_len() == 0).then(|| n / self.block_len() * self.block_bytes())
    }
}

/// Bytes of one Q8_0 activation block (`{ f16 d; i8 qs[32] }`).
pub const Q8_0_BYTES: usize = 34;
/// Bytes of one Q8_1 activation block (`{ f16 d; f16 s; i8 qs[32] }`, s = d * sum(qs)).
pub const Q8_1_BYTES: usize = 36;

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// Dequantises one row of `out.len()` values stored as `dtype` in `src`.
///
/// # Panics
/// If `src` is shorter than the row (callers validate sizes at load time).
pub fn dequantize_row(dtype: DType, src: &[u8], out: &mut [f32]) {
    match dtype {
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        DType::BF16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
            }
        }
        DType::Q4_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(src.chunks_exact(18)) {
                let d = f16_at(b, 0);
                for j in 0..16 {
                    o[j] = ((b[2 + j] & 0x0f) as i32 - 8) as f32 * d;
                    o[j + 16] = ((b[2 + j] >> 4) as i32 - 8) as f32 * d;
                }
            }
        }
        DType::Q4_1 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(src.chunks_exact(20)) {
                let (d, m) = (f16_at(b, 0), f16_at(b, 2));
                for j in 0..16 {
                    o[j] = (b[4 + j] & 0x0f) as f32 * d + m;
                    o[j + 16] = (b[4 + j] >> 4) as f32 * d + m;
                }
            }
        }
        DType::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(src.chunks_exact(34)) {
                let d = f16_at(b, 0);
                for j in 0..QK {
                    o[j] = (b[2 + j] as i8) as f32 * d;
                }
            }
        }
        DType::Q5_0 => crate::kquant::dequantize_q5_0(src, out),
        DType::Q5_1 => crate::kquant::dequantize_q5_1(src, out),
        DType::Q4_K => crate::kquant::dequantize_k4(src, out, false),
        DType::Q5_K => crate::kquant::dequantize_k4(src, out, true),
        DType::Q6_K => crate::kquant::dequantize_q6_k(src, out),
    }
}

/// Quantises an activation row to Q8_0 (or Q8_1 when `with_sum`), GGML's layout.
///
/// Rounding is to nearest, ties to even, as GGML's SIMD quantiser does.
/// `x.len()` must be a multiple of 32; `out` receives `x.len() / 32` blocks.
pub fn quantize_row_q8(x: &[f32], out: &mut [u8], with_sum: bool) {
    let bb = if with_sum { Q8_1_BYTES } else { Q8_0_BYTES };
    let qoff = if with_sum { 4 } else { 2 };
    for (xb, ob) in x.chunks_exact(QK).zip(out.chunks_exact_mut(bb)) {
        let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for j in 0..QK {
            let q = (xb[j] * id).round_ties_even() as i32;
            sum += q;
            ob[qoff + j] = q as i8 as u8;
        }
        ob[0..2].copy_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
        if with_sum {
            let s = f16::from_f32(d * sum as f32);
            ob[2..4].copy_from_slice(&s.to_bits().to_le_bytes());
        }
    }
}

/// Quantises an f32 row as GGML's Q8_K does — one scale per 256 values, `q = min(127,
/// round(-127 x / max))` where `max` is the value of largest magnitude, scale `-max / 127` —
/// and writes it as Q8_1 (`with_sum`) or Q8_0 blocks of 32, each carrying its 256-block's
/// scale (in f16, as those blocks store it). With the sum, a block holds its quants' exact
/// integer sum (i16) where Q8_1 holds `d * sum` in f16: the K-quants' minimum multiplies it, as
/// GGML's Q8_K block sums are multiplied. A row whose length is not a multiple of 256 ends
/// with a shorter block.
pub fn quantize_row_q8_k(x: &[f32], out: &mut [u8], with_sum: bool) {
    let bb = if with_sum { Q8_1_BYTES } else { Q8_0_BYTES };
    let qoff = if with_sum { 4 } else { 2 };
    for (xs, os) in x.chunks(256).zip(out.chunks_mut(bb * 8)) {
        let (mut amax, mut max) = (0f32, 0f32);
        for &v in xs {
            if v.abs() > amax {
                (amax, max) = (v.abs(), v);
            }
        }
        let iscale = if amax != 0.0 { -127.0 / max } else { 0.0 };
        let d = if amax != 0.0 { 1.0 / iscale } else { 0.0 };
        for (xb, ob) in xs.chunks_exact(QK).zip(os.chunks_exact_mut(bb)) {
            let mut sum = 0i32;
            for (j, v) in xb.iter().enumerate() {
                let q = ((v * iscale).round_ties_even() as i32).min(127);
                sum += q;
                ob[qoff + j] = q as i8 as u8;
            }
            ob[0..2].copy_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
            if with_sum {
                ob[2..4].copy_from_slice(&(sum as i16).to_le_bytes());
            }
        }
    }
}

/// Quantises an f32 row to Q8_0 blocks (used to build test weights).
pub fn quantize_row_q8_0(x: &[f32], out: &mut [u8]) {
    quantize_row_q8(x, out, false);
}

/// Quantises an f32 row to Q4_0 blocks, GGML's reference algorithm (used to build test weights).
pub fn quantize_row_q4_0(x: &[f32], out: &mut [u8]) {
    for (xb, ob) in x.chunks_exact(QK).zip(out.chunks_exact_mut(18)) {
        let (mut amax, mut max) = (0f32, 0f32);
        for &v in xb {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        let d = max / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        ob[0..2].copy_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
        for j in 0..16 {
            let q0 = ((xb[j] * id + 8.5) as i32).min(15) as u8;
            let q1 = ((xb[j + 16] * id + 8.5) as i32).min(15) as u8;
            ob[2 + j] = q0 | (q1 << 4);
        }
    }
}

/// Quantises an f32 row to Q4_1 blocks, GGML's reference algorithm (used to build test weights).
pub fn quantize_row_q4_1(x: &[f32], out: &mut [u8]) {
    for (xb, ob) in x.chunks_exact(QK).zip(out.chunks_exact_mut(20)) {
        let min = xb.iter().copied().fold(f32::INFINITY, f32::min);
        let max = xb.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        ob[0..2].copy_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
        ob[2..4].copy_from_slice(&f16::from_f32(min).to_bits().to_le_bytes());
        for j in 0..16 {
            let q0 = (((xb[j] - min) * id + 0.5) as i32).min(15) as u8;
            let q1 = (((xb[j + 16] - min) * id + 0.5) as i32).min(15) as u8;
            ob[4 + j] = q0 | (q1 << 4);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ramp(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
            .collect()
    }

    #[test]
    fn q4_roundtrip_is_close() {
        let x = ramp(64);
        for (dt, q) in [
            (DType::Q4_0, quantize_row_q4_0 as fn(&[f32], &mut [u8])),
            (DType::Q4_1, quantize_row_q4_1),
            (DType::Q8_0, quantize_row_q8_0),
        ] {
            let mut b = vec![0u8; dt.row_bytes(64).unwrap()];
            q(&x, &mut b);
            let mut y = vec![0f32; 64];
            dequantize_row(dt, &b, &mut y);
            let tol = if dt == DType::Q8_0 { 0.03 } else { 0.45 };
            for (a, b) in x.iter().zip(&y) {
                assert!((a - b).abs() <= tol, "{dt:?}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn row_bytes_rejects_partial_blocks() {
        assert_eq!(DType::Q4_1.row_bytes(576), Some(360));
        assert_eq!(DType::Q4_1.row_bytes(33), None);
        assert_eq!(DType::F16.row_bytes(33), Some(66));
    }
}
