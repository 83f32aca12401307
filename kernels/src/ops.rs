//! Element-wise and per-row operations of the Llama block: RMSNorm, RoPE, SiLU·mul, exp.
//!
//! Each works row by row with a fixed operation order, so results do not depend on batching.

pub use crate::{Activation, RopeStyle};

/// `out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight` for each row of `weight.len()` values.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    let body = |(xr, or): (&[f32], &mut [f32])| {
        let ss: f64 = xr.iter().map(|v| (v * v) as f64).sum();
        let scale = 1.0 / ((ss / d as f64) as f32 + eps).sqrt();
        for ((o, v), w) in or.iter_mut().zip(xr).zip(weight) {
            *o = (v * scale) * w;
        }
    };
    if x.len() >= 64 * d {
        crate::pool::for_each_chunk_mut(out, 16 * d, |i, o| {
            let xs = &x[i * 16 * d..][..o.len()];
            xs.chunks(d).zip(o.chunks_mut(d)).for_each(body)
        });
    } else {
        x.chunks(d).zip(out.chunks_mut(d)).for_each(body);
    }
}

/// Rotary position embedding, in place, on rows of `n_heads * head_dim` values.
///
/// Row `t` is at position `positions[t]`; pair `i` turns by `pos * base^(-2i / head_dim)`,
/// the power taken by repeated f32 multiplication as in GGML, and divided by `factors[i]` where
/// given (Llama 3's frequency scaling, as GGML applies `rope_freqs`).
pub fn rope(
    x: &mut [f32],
    positions: &[usize],
    n_heads: usize,
    head_dim: usize,
    base: f32,
    style: RopeStyle,
    factors: Option<&[f32]>,
) {
    let half = head_dim / 2;
    let step = base.powf(-2.0 / head_dim as f32);
    let mut cs = vec![(0f32, 0f32); half];
    for (row, &pos) in x.chunks_mut(n_heads * head_dim).zip(positions) {
        // Angles by repeated multiplication in f32, as GGML computes them: the reference
        // implementations agree to the last bit on the angles, which keeps logits comparable.
        let mut theta = pos as f32;
        for (i, c) in cs.iter_mut().enumerate() {
            let t = factors.map_or(theta, |f| theta / f[i]);
            *c = (t.cos(), t.sin());
            theta *= step;
        }
        for head in row.chunks_mut(head_dim) {
            for (i, &(c, s)) in cs.iter().enumerate() {
                let (a, b) = match style {
                    RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                    RopeStyle::Halves => (i, i + half),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * c - x1 * s;
                head[b] = x0 * s + x1 * c;
            }
        }
    }
}

/// `gate[i] = silu(gate[i]) * up[i]`, where `silu(v) = v / (1 + exp(-v))`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    glu(gate, up, Activation::Silu)
}

/// `gate[i] = act(gate[i]) * up[i]`: the gated feed-forward unit (SwiGLU with SiLU, GeGLU with
/// the tanh GELU). Each element is computed the same way wherever it sits in the slice.
pub fn glu(gate: &mut [f32], up: &[f32], act: Activation) {
    let isa = crate::isa();
    let body = |(g, u): (&mut [f32], &[f32])| match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa` is Avx2 only when the CPU has AVX2, FMA and F16C.
        crate::Isa::Avx2 => unsafe { crate::x86::glu(g, u, act) },
        _ => {
            for (gv, uv) in g.iter_mut().zip(u) {
                *gv = act.apply(*gv) * uv;
            }
        }
    };
    if gate.len() >= 1 << 15 {
        crate::pool::for_each_chunk_mut(gate, 4096, |i, g| {
            let n = g.len();
            body((g, &up[i * 4096..][..n]))
        });
    } else {
        body((gate, up));
    }
}

/// GELU's tanh approximation, `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`, taken as GGML's
/// CPU path takes it: `x` rounded to f16, the result looked up in a table of f16 values (so
/// tandem and llama.cpp agree on Gemma's feed-forward to the bit), 0 below -10 and `x` above 10.
pub fn gelu(x: f32) -> f32 {
    if x <= -10.0 {
        0.0
    } else if x >= 10.0 {
        x
    } else {
        gelu_table()[half::f16::from_f32(x).to_bits() as usize]
    }
}

/// `gelu` of every f16 value, rounded to f16 and widened back to f32, indexed by the f16's bits.
pub(crate) fn gelu_table() -> &'static [f32; 1 << 16] {
    static TABLE: std::sync::OnceLock<Box<[f32; 1 << 16]>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        // GGML's constants and order of operations, in f32.
        let sqrt_2_over_pi = (2.0 / std::f64::consts::PI).sqrt() as f32;
        let mut t = Box::new([0f32; 1 << 16]);
        for (bits, v) in t.iter_mut().enumerate() {
            let x = half::f16::from_bits(bits as u16).to_f32();
            let g = 0.5 * x * (1.0 + (sqrt_2_over_pi * x * (1.0 + 0.044_715 * x * x)).tanh());
            *v = half::f16::from_f32(g).to_f32();
        }
        t
    })
}

impl Activation {
    /// The activation of one value (the portable path; the AVX2 path computes the same bits
    /// eight at a time).
    #[inline]
    pub fn apply(self, v: f32) -> f32 {
        match self {
            Activation::Silu => v / (1.0 + exp(-v)),
            Activation::GeluTanh => gelu(v),
        }
    }
}

/// `a[i] += b[i]`.
pub fn add_assign(a: &mut [f32], b: &[f32]) {
    for (x, y) in a.iter_mut().zip(b) {
        *x += y;
    }
}

/// e^x, accurate to about 1 ulp over the f32 range (Cephes-style range reduction and a degree-6
/// polynomial); written with explicit FMAs so the SIMD version in `attention` gives the same bits.
#[inline]
pub fn exp(x: f32) -> f32 {
    let x = x.clamp(-87.3, 88.7);
    let n = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = n.mul_add(-0.693_359_4, x);
    let r = n.mul_add(2.121_944_4e-4, r);
    let mut p = 1.987_569_1e-4f32;
    p = p.mul_add(r, 1.398_199_9e-3);
    p = p.mul_add(r, 8.333_452e-3);
    p = p.mul_add(r, 4.166_579_6e-2);
    p = p.mul_add(r, 1.666_666_6e-1);
    p = p.mul_add(r, 0.5);
    p = p.mul_add(r * r, r) + 1.0;
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_accurate() {
        let mut x = -80.0f32;
        while x < 80.0 {
            let (a, b) = (exp(x), x.exp());
            assert!(((a - b) / b).abs() < 4e-7, "exp({x}) = {a}, std {b}");
            x += 0.173;
        }
        assert_eq!(exp(-1000.0) < 1e-37, true);
    }

    #[test]
    fn rope_styles_agree_up_to_permutation() {
        let hd = 8;
        let x: Vec<f32> = (0..hd).map(|i| i as f32 + 1.0).collect();
        // Interleaved layout of the same pairs as the halves layout.
        let perm: Vec<usize> = (0..hd / 2).flat_map(|i| [i, i + hd / 2]).collect();
        let mut a: Vec<f32> = perm.iter().map(|&p| x[p]).collect();
        let mut b = x.clone();
        rope(&mut a, &[5], 1, hd, 10000.0, RopeStyle::Interleaved, None);
        rope(&mut b, &[5], 1, hd, 10000.0, RopeStyle::Halves, None);
        for (i, &p) in perm.iter().enumerate() {
            assert_eq!(a[i], b[p]);
        }
        // Position 0 is the identity.
        let mut c = x.clone();
        rope(&mut c, &[0], 1, hd, 10000.0, RopeStyle::Halves, None);
        assert_eq!(c, x);
    }

    #[test]
    fn gelu_matches_the_tanh_formula_and_simd_matches_portable() {
        let x: Vec<f32> = (0..1003).map(|i| (i as f32 - 501.0) * 0.027).collect();
        for (i, &v) in x.iter().enumerate() {
            // The formula at x rounded to f16, to f16's precision (half an ulp: 2^-11 relative;
            // GGML's f32 formula loses the far negative tail, 1 + tanh cancelling).
            let h = half::f16::from_f32(v).to_f64();
            let want = 0.5
                * h
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (h + 0.044715 * h.powi(3))).tanh());
            let got = Activation::GeluTanh.apply(v) as f64;
            assert!(
                (got - want).abs() <= 5e-4 * want.abs() + 1e-6,
                "x[{i}] = {v}: {got} vs {want}"
            );
        }
        for act in [Activation::Silu, Activation::GeluTanh] {
            let up: Vec<f32> = x.iter().map(|v| v.cos()).collect();
            let mut g = x.clone();
            glu(&mut g, &up, act);
            // Every element equals itself computed alone (as the last element of a short slice).
            for i in (0..x.len()).step_by(7) {
                let mut one = vec![x[i]];
                glu(&mut one, &up[i..i + 1], act);
                assert_eq!(one[0].to_bits(), g[i].to_bits(), "{act:?} x[{i}]");
            }
        }
    }

    #[test]
    fn rms_norm_normalises() {
        let x = [3.0f32, 4.0];
        let mut out = [0f32; 2];
        rms_norm(&x, &[1.0, 2.0], 0.0, &mut out);
        let s = (12.5f32).sqrt();
        assert!((out[0] - 3.0 / s).abs() < 1e-6 && (out[1] - 8.0 / s).abs() < 1e-6);
    }
}
