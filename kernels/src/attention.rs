//! Causal attention over a paged KV cache.
//!
//! The cache of one layer holds `num_blocks` blocks of `block_size` token slots; each slot holds
//! `n_kv_heads * head_dim` f16 keys (and values). A sequence's tokens live in the blocks its
//! block table lists, in order: token `j` is in block `table[j / block_size]`, slot
//! `j % block_size`. Query heads share KV heads in groups (GQA).

use half::f16;

#[cfg(target_arch = "x86_64")]
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
    pub(crate) fn offset(&self, table: &[u32], j: usize, g: usize) -> usize {
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
    #[cfg(target_arch = "x86_64")]
    if isa() == Isa::Avx2 && hd % 8 == 0 && hd <= 256 {
        return tiled(q, queries, kv, n_heads, scale, out);
    }
    // Four (query, head) rows an item.
    crate::pool::for_each_chunk_mut(out, 4 * hd, |i, rows| {
        let mut scores = Vec::new();
        for (r, o) in rows.chunks_mut(hd).enumerate() {
            let th = 4 * i + r;
            let (t, h) = (th / n_heads, th % n_heads);
            let qh = &q[th * hd..(th + 1) * hd];
            head(qh, queries[t], kv, h / group, scale, &mut scores, o);
        }
    });
}

/// Queries of one sequence handled together by the tiled kernel.
#[cfg(target_arch = "x86_64")]
const TILE: usize = 16;

/// The AVX2 kernel over tiles of up to [`TILE`] consecutive queries of one sequence, per KV
/// group (see [`crate::attention_avx2`]).
#[cfg(target_arch = "x86_64")]
fn tiled(
    q: &[f32],
    queries: &[Query<'_>],
    kv: PagedKv<'_>,
    n_heads: usize,
    scale: f32,
    out: &mut [f32],
) {
    use crate::attention_avx2::{tile, Scratch, Tile};
    let (hd, heads) = (kv.head_dim, n_heads / kv.n_kv_heads);
    let same = |a: &Query<'_>, b: &Query<'_>| std::ptr::eq(a.block_table, b.block_table);
    let mut tiles = Vec::new();
    let mut t0 = 0;
    while t0 < queries.len() {
        let mut t1 = t0 + 1;
        while t1 < queries.len() && t1 - t0 < TILE && same(&queries[t1], &queries[t0]) {
            t1 += 1;
        }
        for g in 0..kv.n_kv_heads {
            tiles.push(Tile {
                t0,
                queries: &queries[t0..t1],
                g,
                group: heads,
                h0: 0,
                heads,
            });
        }
        t0 = t1;
    }
    // Too few tiles to keep every thread busy (a small decode batch): pairs of heads instead
    // of whole groups (each still shares a load of the keys between its two heads).
    if heads > 2 && tiles.len() < 2 * crate::threads() {
        tiles = tiles
            .iter()
            .flat_map(|t| {
                (0..heads).step_by(2).map(move |h0| Tile {
                    h0,
                    heads: 2.min(heads - h0),
                    queries: t.queries,
                    ..*t
                })
            })
            .collect();
    }
    // Each tile's rows in its own slice of one buffer, then put in place.
    let mut buf = vec![0f32; out.len()];
    let mut parts = Vec::with_capacity(tiles.len());
    let mut rest = &mut buf[..];
    for t in &tiles {
        let (part, r) = rest.split_at_mut(t.queries.len() * t.heads * hd);
        parts.push(part);
        rest = r;
    }
    thread_local! {
        static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::default();
    }
    let parts: Vec<_> = parts
        .into_iter()
        .map(|p| crate::pool::SendPtr(p as *mut [f32]))
        .collect();
    crate::pool::for_each(tiles.len(), |i| {
        SCRATCH.with_borrow_mut(|scratch| {
            // SAFETY: part i is tile i's own slice of `buf`, borrowed for this call and touched
            // by this item alone.
            let o = unsafe { &mut *parts[i].get() };
            // SAFETY: the CPU has AVX2/FMA/F16C (checked by the caller); hd is a multiple of 8
            // up to 256; every query's block table covers its position (checked by the model).
            unsafe { tile(q, &tiles[i], kv, n_heads, scale, scratch, o) };
        })
    });
    let mut rows = buf.chunks_exact(hd);
    for t in &tiles {
        for r in 0..t.queries.len() * t.heads {
            let head = t.g * heads + t.h0 + r % t.heads;
            let row = rows.next().expect("one row per tile row");
            out[((t.t0 + r / t.heads) * n_heads + head) * hd..][..hd].copy_from_slice(row);
        }
    }
}

/// The portable kernel, one (query, head) row: scores summed over dimensions in order, the
/// softmax, values accumulated key by key.
fn head(
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
    // Summed in eight lanes and combined as the AVX2 kernel's horizontal sum: both kernels give
    // the same bits.
    let mut lanes = [0f32; 8];
    for (i, v) in s.iter_mut().enumerate() {
        *v = crate::ops::exp(*v - max);
        lanes[i % 8] += *v;
    }
    let l = lanes;
    let inv = 1.0 / (((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7])));
    out.fill(0.0);
    for (j, &e) in s.iter().enumerate() {
        let p = f16::from_f32(e * inv).to_f32();
        let v = &kv.v[kv.offset(query.block_table, query.first + j, g)..][..hd];
        for (o, x) in out.iter_mut().zip(v) {
            *o = p.mul_add(x.to_f32(), *o);
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

    /// The tiled AVX2 kernel equals the portable one bit for bit: GQA groups of 3 and 4, head
    /// sizes 32/64/256, a prefill chunk over several tiles, windows, and decode rows (a query
    /// alone in its tile).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn tiled_avx2_equals_the_portable_kernel_bitwise() {
        if crate::isa() != crate::Isa::Avx2 {
            return;
        }
        for (hd, nkv, nh) in [(64, 3, 9), (256, 1, 4), (32, 2, 2)] {
            let (bs, blocks) = (16, 30);
            let cache = |m: usize| -> Vec<f16> {
                (0..blocks * bs * nkv * hd)
                    .map(|i| f16::from_f32(((i * m) % 1009) as f32 / 1009.0 - 0.5))
                    .collect()
            };
            let (k, v) = (cache(7919), cache(104_729));
            let kv = PagedKv {
                k: &k,
                v: &v,
                block_size: bs,
                n_kv_heads: nkv,
                head_dim: hd,
            };
            let a: Vec<u32> = (0..19).map(|b| (b * 7 % 30) as u32).collect();
            let b: Vec<u32> = vec![29, 3, 11, 20, 1, 9, 17];
            let c: Vec<u32> = (0..13).map(|b| (b * 11 % 30) as u32).collect();
            let d: Vec<u32> = (0..13).map(|b| (29 - b * 2) as u32).collect();
            let mut qs = Vec::new();
            for pos in 0..=40 {
                qs.push(Query {
                    pos,
                    first: 0,
                    block_table: &a,
                });
            }
            qs.push(Query {
                pos: 299,
                first: Query::first_in_window(299, Some(64)),
                block_table: &a,
            });
            for pos in 60..80 {
                qs.push(Query {
                    pos,
                    first: Query::first_in_window(pos, Some(16)),
                    block_table: &b,
                });
            }
            qs.push(Query {
                pos: 99,
                first: 0,
                block_table: &b,
            });
            // Decode rows: one query of a sequence alone in its tile, full and windowed.
            for (pos, window, table) in [(150, None, &c), (200, Some(64), &d), (3, None, &c)] {
                let first = Query::first_in_window(pos, window);
                qs.push(Query {
                    pos,
                    first,
                    block_table: table,
                });
            }
            let q: Vec<f32> = (0..qs.len() * nh * hd)
                .map(|i| (i as f32 * 0.37).sin())
                .collect();
            let mut out = vec![0f32; q.len()];
            attention(&q, &qs, kv, nh, 0.125, &mut out);
            for (t, query) in qs.iter().enumerate() {
                for h in 0..nh {
                    let row = (t * nh + h) * hd;
                    let mut want = vec![0f32; hd];
                    head(
                        &q[row..row + hd],
                        *query,
                        kv,
                        h / (nh / nkv),
                        0.125,
                        &mut Vec::new(),
                        &mut want,
                    );
                    let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&out[row..row + hd]),
                        bits(&want),
                        "hd {hd}, query {t}, head {h}"
                    );
                }
            }
            // Each query alone (a batch-1 decode: too few KV groups to keep the threads busy,
            // so its heads are split in pairs): the same bits as in the batch above.
            for (t, query) in qs.iter().enumerate() {
                let row = &q[t * nh * hd..(t + 1) * nh * hd];
                let mut alone = vec![0f32; nh * hd];
                attention(row, &[*query], kv, nh, 0.125, &mut alone);
                let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&alone),
                    bits(&out[t * nh * hd..(t + 1) * nh * hd]),
                    "hd {hd}, query {t} alone"
                );
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
