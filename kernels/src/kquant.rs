//! The 5-bit and K-quant formats most downloaded GGUF files use (GGML's layouts, byte for byte):
//! Q5_0 and Q5_1 (32-value blocks), Q4_K, Q5_K and Q6_K (256-value super-blocks whose 32- or
//! 16-value sub-blocks carry their own scales).
//!
//! Each format is read here into sub-blocks of plain integers and f32 scales — the one decoding
//! both the dequantiser and the load-time re-layout for the kernels ([`crate::packed`]) use, so
//! they cannot disagree. Scales are products computed in f32, as GGML computes them.

use half::f16;

/// Values in a K-quant super-block.
pub const QK_K: usize = 256;

/// Bytes of one block: Q5_0, Q5_1, Q4_K, Q5_K, Q6_K.
pub const Q5_0_BYTES: usize = 22;
/// Bytes of one Q5_1 block.
pub const Q5_1_BYTES: usize = 24;
/// Bytes of one Q4_K super-block: `{ f16 d; f16 dmin; u8 scales[12]; u8 qs[128] }`.
pub const Q4_K_BYTES: usize = 144;
/// Bytes of one Q5_K super-block: `{ f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128] }`.
pub const Q5_K_BYTES: usize = 176;
/// Bytes of one Q6_K super-block: `{ u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d }`.
pub const Q6_K_BYTES: usize = 210;

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// A 32-value sub-block of an affine format: value `i` is `d * q[i] - m`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Affine {
    /// Scale.
    pub d: f32,
    /// Subtracted minimum.
    pub m: f32,
    /// Quants (0..=15 for Q4_K, 0..=31 for Q5_K and Q5_1).
    pub q: [u8; 32],
}

/// A 32-value sub-block of Q6_K: value `i` is `d[i / 16] * q[i]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Split {
    /// The scales of values 0..16 and 16..32.
    pub d: [f32; 2],
    /// Quants, -32..=31.
    pub q: [i8; 32],
}

/// The 6-bit scale and minimum of sub-block `j` (0..8) of a Q4_K/Q5_K super-block.
fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Q5_0's 32 values as signed integers (-16..=15) and its scale: value = `d * q`.
pub fn q5_0_block(b: &[u8]) -> (f32, [i8; 32]) {
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let mut q = [0i8; 32];
    for j in 0..16 {
        let lo = (b[6 + j] & 0x0f) | ((((qh >> j) << 4) & 0x10) as u8);
        let hi = (b[6 + j] >> 4) | (((qh >> (j + 12)) & 0x10) as u8);
        q[j] = lo as i8 - 16;
        q[j + 16] = hi as i8 - 16;
    }
    (f16_at(b, 0), q)
}

/// Q5_1's 32 values: value = `d * q + m` (returned as an [`Affine`] with `m` negated).
pub fn q5_1_block(b: &[u8]) -> Affine {
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let mut q = [0u8; 32];
    for j in 0..16 {
        q[j] = (b[8 + j] & 0x0f) | ((((qh >> j) << 4) & 0x10) as u8);
        q[j + 16] = (b[8 + j] >> 4) | (((qh >> (j + 12)) & 0x10) as u8);
    }
    Affine {
        d: f16_at(b, 0),
        m: -f16_at(b, 2),
        q,
    }
}

/// The 8 sub-blocks of a Q4_K (`five == false`) or Q5_K super-block.
pub fn k4_sub_blocks(b: &[u8], five: bool) -> [Affine; 8] {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let (qh, qs) = if five {
        (&b[16..48], &b[48..176])
    } else {
        (&b[0..0], &b[16..144])
    };
    let mut out = [Affine {
        d: 0.0,
        m: 0.0,
        q: [0; 32],
    }; 8];
    for (j, sub) in out.iter_mut().enumerate() {
        let (sc, m) = scale_min_k4(j, scales);
        sub.d = d * sc as f32;
        sub.m = dmin * m as f32;
        // Sub-blocks 2k and 2k+1 share 32 bytes: low nibbles, then high nibbles.
        let bytes = &qs[32 * (j / 2)..32 * (j / 2) + 32];
        for l in 0..32 {
            let nib = if j % 2 == 0 {
                bytes[l] & 0x0f
            } else {
                bytes[l] >> 4
            };
            let high = five && qh[l] & (1 << j) != 0;
            sub.q[l] = nib | if high { 16 } else { 0 };
        }
    }
    out
}

/// The 8 sub-blocks of a Q6_K super-block.
pub fn q6_k_sub_blocks(b: &[u8]) -> [Split; 8] {
    let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    let mut v = [0i8; QK_K];
    for n in 0..2 {
        let (ql, qh, y) = (&ql[64 * n..], &qh[32 * n..], &mut v[128 * n..]);
        for l in 0..32 {
            let six = |lo: u8, shift: u32| (lo | (((qh[l] >> shift) & 3) << 4)) as i8 - 32;
            y[l] = six(ql[l] & 0x0f, 0);
            y[l + 32] = six(ql[l + 32] & 0x0f, 2);
            y[l + 64] = six(ql[l] >> 4, 4);
            y[l + 96] = six(ql[l + 32] >> 4, 6);
        }
    }
    let mut out = [Split {
        d: [0.0; 2],
        q: [0; 32],
    }; 8];
    for (k, sub) in out.iter_mut().enumerate() {
        sub.d = [
            d * (sc[2 * k] as i8) as f32,
            d * (sc[2 * k + 1] as i8) as f32,
        ];
        sub.q.copy_from_slice(&v[32 * k..32 * k + 32]);
    }
    out
}

/// Writes the values of `subs` (affine sub-blocks) to `out`, 32 each.
fn affine_values(subs: &[Affine], out: &mut [f32]) {
    for (o, s) in out.chunks_exact_mut(32).zip(subs) {
        for (v, &q) in o.iter_mut().zip(&s.q) {
            *v = s.d * q as f32 - s.m;
        }
    }
}

/// Dequantises a row stored as Q5_0.
pub fn dequantize_q5_0(src: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_exact_mut(32).zip(src.chunks_exact(Q5_0_BYTES)) {
        let (d, q) = q5_0_block(b);
        for (v, &q) in o.iter_mut().zip(&q) {
            *v = q as f32 * d;
        }
    }
}

/// Dequantises a row stored as Q5_1.
pub fn dequantize_q5_1(src: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_exact_mut(32).zip(src.chunks_exact(Q5_1_BYTES)) {
        affine_values(&[q5_1_block(b)], o);
    }
}

/// Dequantises a row stored as Q4_K (`five == false`) or Q5_K.
pub fn dequantize_k4(src: &[u8], out: &mut [f32], five: bool) {
    let bytes = if five { Q5_K_BYTES } else { Q4_K_BYTES };
    for (o, b) in out.chunks_exact_mut(QK_K).zip(src.chunks_exact(bytes)) {
        affine_values(&k4_sub_blocks(b, five), o);
    }
}

/// Dequantises a row stored as Q6_K.
pub fn dequantize_q6_k(src: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_exact_mut(QK_K).zip(src.chunks_exact(Q6_K_BYTES)) {
        for (o, s) in o.chunks_exact_mut(32).zip(q6_k_sub_blocks(b)) {
            for (i, (v, &q)) in o.iter_mut().zip(&s.q).enumerate() {
                *v = s.d[i / 16] * q as f32;
            }
        }
    }
}

/// A Q5_0 row as Q8_0 blocks holding exactly the same values (the same f16 scale; 5-bit
/// quants widened to 8).
pub fn q5_0_to_q8_0(src: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(src.len() / Q5_0_BYTES * crate::quant::Q8_0_BYTES);
    for b in src.chunks_exact(Q5_0_BYTES) {
        let (_, q) = q5_0_block(b);
        out.extend_from_slice(&b[0..2]);
        out.extend(q.iter().map(|&q| q as u8));
    }
    out
}
