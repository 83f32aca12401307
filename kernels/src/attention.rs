//! Causal attention over a paged KV cache.
//!
//! The cache of one layer holds `num_blocks` blocks of `block_size` token slots; each slot holds
//! `n_kv_heads * head_dim` f16 keys (and values). A sequence's tokens live in the blocks its
//! block table lists, in order: token `j` is in block `table[j / block_size]`, slot
//! `j % block_size`. Query heads share KV heads in groups (GQA).

use half::f16;
use rayon::prelude::*;

use crate::{isa, Isa};

/// One layer's paged key and value storage.
#[derive(Clone, Copy)]
pub struct PagedKv<'a> {
    /// Keys, `[num_blocks, block_size, n_kv_heads, head_dim]`.
    pub k: &'a [f16],
    /// Values, same layout as `k`.
    pub v: &'a [f16],
    /// Token slots per block.
    pub block_size: usize,
    /// Number of KV heads.
    pub n_kv_heads: usize,
    /// Values per head.
    pub head_dim: usize,
}

/// A query token: it attends to its sequence's tokens `first..=pos`.
#[derive(Clone, Copy, Debug)]
pub struct Query<'a> {
    /// Position of the token in its sequence.
    pub pos: usize,
    /// The first position it attends to: 0 for full causal attention, `pos + 1 - window` (at
    /// least 0) on a sliding-window layer.
    pub first: usize,
    /// The sequence's block table (must cover `pos`).
    pub block_table: &'a [u32],
}

impl Query<'_> {
    /// The first position a query at `pos` sees through a sliding window of `window` tokens
    /// (itself included), or 0 without a window.
    pub fn first_in_window(pos: usize, window: Option<usize>) -> usize {
        window.map_or(0, |w| (pos + 1).saturating_sub(w))
    }
}

impl PagedKv<'_> {
    #[inline]
    fn offset(&self, table: &[u32], j: usize, g: usize) -> usize {
        let b = table[j / self.block_size] as usize;
        ((b * self.block_size + j % self.block_size) * self.n_kv_heads + g) * self.head_dim
    }
}

/// `out[t, h] = softmax(q[t, h] . K[first..=pos] * scale) . V[first..=pos]` for every token
/// and head.
///
/// `q` and `out` are `[queries.len(), n_heads * head_dim]`. Like GGML's CPU path, queries are
/// rounded to f16 before the dot products with the f16 keys, and the normalised probabilities are
/// rounded to f16 before they weight the f16 values; sums are in f32.
pub fn attention(
    q: &[f32],
    queries: &[Query<'_>],
    kv: PagedKv<'_>,
    n_heads: usize,
    scale: f32,
    out: &mut [f32],
) {
    let hd = kv.head_dim;
    let group = n_heads / kv.n_kv_heads;
    let isa = isa();
    out.par_chunks_mut(hd)
        .enumerate()
        .with_min_len(4)
        .for_each_init(Vec::new, |scores, (th, o)| {
            let (t, h) = (th / n_heads, th % n_heads);
            let qh = &q[th * hd..(th + 1) * hd];
            head(isa, qh, queries[t], kv, h / group, scale, scores, o);
        });
}

#[allow(clippy::too_many_arguments)]
fn head(
    isa: Isa,
    q: &[f32],
    query: Query<'_>,
    kv: PagedKv<'_>,
    g: usize,
    scale: f32,
    s: &mut Vec<f32>,
    out: &mut [f32],
) {
    let n = query.pos + 1 - query.first.min(query.pos);
    let hd = kv.head_dim;
    s.clear();
    s.resize(n, 0.0);
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 && hd % 8 == 0 && hd <= 256 {
        // SAFETY: the CPU has AVX2/FMA/F16C (checked by `isa`); offsets come from the block table.
        unsafe { avx2::head(q, query, kv, g, scale, s, out) };
        return;
    }
    let _ = isa;
    let q16: Vec<f32> = q.iter().map(|v| f16::from_f32(*v).to_f32()).collect();
    for (j, sj) in s.iter_mut().enumerate() {
        let k = &kv.k[kv.offset(query.block_table, query.first + j, g)..][..hd];
        *sj = q16
            .iter()
            .zip(k)
            .fold(0f32, |a, (x, y)| x.mul_add(y.to_f32(), a))
            * scale;
    }
    let max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for v in s.iter_mut() {
        *v = crate::ops::exp(*v - max);
        sum += *v;
    }
    let inv = 1.0 / sum;
    out.fill(0.0);
    for (j, &e) in s.iter().enumerate() {
        let p = f16::from_f32(e * inv).to_f32();
        let v = &kv.v[kv.offset(query.block_table, query.first + j, g)..][..hd];
        for (o, x) in out.iter_mut().zip(v) {
            *o = p.mul_add(x.to_f32(), *o);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use half::f16;

    use super::{PagedKv, Query};
    use crate::x86::{exp8, hsum, load_partial};

    /// # Safety
    /// AVX2, FMA and F16C must be available; `query.block_table` must cover `query.pos`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn head(
        q: &[f32],
        query: Query<'_>,
        kv: PagedKv<'_>,
        g: usize,
        scale: f32,
        s: &mut [f32],
        out: &mut [f32],
    ) {
        let hd = kv.head_dim;
        let lanes = hd / 8;
        debug_assert!(lanes <= 32);
        let mut qv = [_mm256_setzero_ps(); 32];
        // SAFETY: (whole body) q, out have hd values; cache offsets index whole heads in bounds.
        unsafe {
            for (l, v) in qv.iter_mut().enumerate().take(lanes) {
                let x = _mm256_loadu_ps(q.as_ptr().add(8 * l));
                *v = _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x));
            }
            for (j, sj) in s.iter_mut().enumerate() {
                let k =
                    kv.k.as_ptr()
                        .add(kv.offset(query.block_table, query.first + j, g))
                        as *const __m128i;
                let mut acc = _mm256_setzero_ps();
                for (l, v) in qv.iter().enumerate().take(lanes) {
                    acc = _mm256_fmadd_ps(*v, _mm256_cvtph_ps(_mm_loadu_si128(k.add(l))), acc);
                }
                *sj = hsum(acc) * scale;
            }
            // Softmax over all scores, 8 at a time; a partial last group is padded with -inf
            // for the max and its padding lanes are dropped after the exponential.
            let n = s.len();
            let mut mx = _mm256_set1_ps(f32::NEG_INFINITY);
            for c in (0..n).step_by(8) {
                mx = _mm256_max_ps(
                    mx,
                    load_partial(s.as_ptr().add(c), n - c, f32::NEG_INFINITY),
                );
            }
            let m4 = _mm_max_ps(_mm256_extractf128_ps(mx, 1), _mm256_castps256_ps128(mx));
            let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let mv = _mm256_set1_ps(_mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))));
            let mut sv = _mm256_setzero_ps();
            let mut e8 = [0f32; 8];
            for c in (0..n).step_by(8) {
                let len = (n - c).min(8);
                let e = exp8(_mm256_sub_ps(load_partial(s.as_ptr().add(c), len, 0.0), mv));
                _mm256_storeu_ps(e8.as_mut_ptr(), e);
                e8[len..].fill(0.0);
                s[c..c + len].copy_from_slice(&e8[..len]);
                sv = _mm256_add_ps(sv, _mm256_loadu_ps(e8.as_ptr()));
            }
            let sum = hsum(sv);
            let inv = 1.0 / sum;
            let mut acc = [_mm256_setzero_ps(); 32];
            for (j, &e) in s.iter().enumerate() {
                let v =
                    kv.v.as_ptr()
                        .add(kv.offset(query.block_table, query.first + j, g))
                        as *const __m128i;
                let p = f16::from_f32(e * inv).to_f32();
                let pv = _mm256_set1_ps(p);
                for (l, a) in acc.iter_mut().enumerate().take(lanes) {
                    *a = _mm256_fmadd_ps(pv, _mm256_cvtph_ps(_mm_loadu_si128(v.add(l))), *a);
                }
            }
            for (l, a) in acc.iter().enumerate().take(lanes) {
                _mm256_storeu_ps(out.as_mut_ptr().add(8 * l), *a);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Full causal attention and sliding windows (the query itself only, and 4 tokens)
    /// against an f64 reference over the same paged cache.
    #[test]
    fn paged_matches_contiguous_reference() {
        let (bs, nkv, hd, nh) = (4, 2, 16, 4);
        let blocks = 6;
        let mut k = vec![f16::ZERO; blocks * bs * nkv * hd];
        let mut v = k.clone();
        for (i, (a, b)) in k.iter_mut().zip(v.iter_mut()).enumerate() {
            *a = f16::from_f32(((i * 7919) % 113) as f32 / 113.0 - 0.5);
            *b = f16::from_f32(((i * 104729) % 97) as f32 / 97.0 - 0.5);
        }
        let table = [5u32, 2, 0];
        let kv = PagedKv {
            k: &k,
            v: &v,
            block_size: bs,
            n_kv_heads: nkv,
            head_dim: hd,
        };
        let pos = 9;
        let q: Vec<f32> = (0..nh * hd).map(|i| (i as f32 * 0.37).sin()).collect();
        for window in [None, Some(1), Some(4)] {
            let first = Query::first_in_window(pos, window);
            let mut out = vec![0f32; nh * hd];
            let query = Query {
                pos,
                first,
                block_table: &table,
            };
            attention(&q, &[query], kv, nh, 0.25, &mut out);
            let want = reference(&q, &k, &v, kv, &table, first..=pos, nh, 0.25);
            for (d, (o, w)) in out.iter().zip(&want).enumerate() {
                assert!((*o as f64 - w).abs() < 1e-5, "window {window:?} value {d}");
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn reference(
        q: &[f32],
        k: &[f16],
        v: &[f16],
        kv: PagedKv<'_>,
        table: &[u32],
        keys: std::ops::RangeInclusive<usize>,
        nh: usize,
        scale: f64,
    ) -> Vec<f64> {
        let (hd, nkv) = (kv.head_dim, kv.n_kv_heads);
        let mut out = vec![0f64; nh * hd];
        for h in 0..nh {
            let g = h / (nh / nkv);
            let mut s: Vec<f64> = keys
                .clone()
                .map(|j| {
                    let o = kv.offset(table, j, g);
                    (0..hd)
                        .map(|d| f16::from_f32(q[h * hd + d]).to_f64() * k[o + d].to_f64())
                        .sum::<f64>()
                        * scale
                })
                .collect();
            let m = s.iter().copied().fold(f64::MIN, f64::max);
            s.iter_mut().for_each(|x| *x = (*x - m).exp());
            let z: f64 = s.iter().sum();
            for d in 0..hd {
                // Queries and probabilities are rounded to f16, as in GGML.
                out[h * hd + d] = keys
                    .clone()
                    .zip(&s)
                    .map(|(j, e)| {
                        f16::from_f64(e / z).to_f64() * v[kv.offset(table, j, g) + d].to_f64()
                    })
                    .sum();
            }
        }
        out
    }
}
