//! The AVX2 attention kernel, tiled: a work item is a tile of queries of one sequence and the
//! query heads of one KV group, and each block of keys and values is read from the cache and
//! widened to f32 once per tile, into a buffer that stays in L1, instead of once per (query,
//! head). Keys are widened transposed, so that eight scores come out of one register with no
//! horizontal sum: each lane sums its key's products dimension by dimension, as the portable
//! kernel does. Every (query, head) row does exactly the portable kernel's arithmetic, in the
//! same order (scores summed over dimensions in order, the softmax sum in eight lanes, values
//! accumulated key by key), so the result is bitwise the portable kernel's whatever the tile
//! holds — and whatever the CPU.

use std::arch::x86_64::*;

use half::f16;

use crate::attention::{PagedKv, Query};
use crate::x86::{exp8, hsum, load_partial};

/// Floats of keys (or values) widened per block: 16 KiB, in L1 beside the rows' state.
const BLOCK_FLOATS: usize = 4096;

/// One work item: `queries` (one sequence's, consecutive in the batch, starting at batch index
/// `t0`) against KV group `g`, for `heads` of the `group` query heads of that group, from its
/// head `h0` on.
pub(crate) struct Tile<'a> {
    pub t0: usize,
    pub queries: &'a [Query<'a>],
    pub g: usize,
    pub group: usize,
    pub h0: usize,
    pub heads: usize,
}

/// A thread's buffers, kept from tile to tile.
#[derive(Default)]
pub(crate) struct Scratch {
    scores: Vec<f32>,
    block: Vec<f32>,
    qv: Vec<f32>,
}

/// The rows of a tile: `[query][head][head_dim]`, written to `out` (same layout).
///
/// # Safety
/// AVX2, FMA and F16C must be available; every query's block table must cover its position;
/// `head_dim` must be a multiple of 8, at most 256.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn tile(
    q: &[f32],
    tile: &Tile<'_>,
    kv: PagedKv<'_>,
    n_heads: usize,
    scale: f32,
    scratch: &mut Scratch,
    out: &mut [f32],
) {
    let Scratch { scores, block, qv } = scratch;
    let hd = kv.head_dim;
    let rows = tile.queries.len() * tile.heads;
    let lo = tile
        .queries
        .iter()
        .map(|q| q.first.min(q.pos))
        .min()
        .unwrap_or(0);
    let hi = tile.queries.iter().map(|q| q.pos).max().unwrap_or(0);
    // Each row's scores at [r * span + (j - lo)] for its keys j.
    let span = hi + 1 - lo;
    scores.clear();
    scores.resize(rows * span, 0.0);
    let row_q = |r: usize| {
        let (t, h) = (r / tile.heads, r % tile.heads);
        let head = tile.g * tile.group + tile.h0 + h;
        &q[((tile.t0 + t) * n_heads + head) * hd..][..hd]
    };
    let range = |r: usize| {
        let query = tile.queries[r / tile.heads];
        (query.first.min(query.pos), query.pos)
    };
    // Key blocks start at multiples of 8 (whole 8-key groups); keys past `hi` are zeros.
    let kb = ((BLOCK_FLOATS / hd).max(8) / 8 * 8).min((hi + 1 - lo / 8 * 8).div_ceil(8) * 8);
    block.resize(kb * hd, 0.0);
    qv.resize(2 * hd, 0.0);
    // SAFETY: (whole body) offsets come from block tables covering every key read; q rows and
    // out rows have hd values.
    unsafe {
        for b0 in (lo / 8 * 8..=hi).step_by(kb) {
            let b1 = (b0 + kb - 1).min(hi);
            widen_transposed(kv.k, kv, tile, (b0, b1, hi), lo / 8 * 8, kb, block);
            // Two heads of a query at a time (they attend to the same keys) share each load of
            // the keys.
            let mut r = 0;
            while r < rows {
                let (first, pos) = range(r);
                let n = if r + 1 < rows && (r + 1) / tile.heads == r / tile.heads {
                    2
                } else {
                    1
                };
                if pos >= b0 && first <= b1 {
                    for i in 0..n {
                        qv[i * hd..(i + 1) * hd].copy_from_slice(row_q(r + i));
                    }
                    let qn = &mut qv[..n * hd];
                    probabilities(qn, 1.0);
                    let s = &mut scores[r * span..(r + n) * span];
                    let groups = (b0.max(first) / 8 * 8, b1.min(pos));
                    let keys = (lo, first, pos);
                    if n == 2 {
                        scores8::<2>(qn, block, kb, b0, groups, keys, scale, s);
                    } else {
                        scores8::<1>(qn, block, kb, b0, groups, keys, scale, s);
                    }
                }
                r += n;
            }
        }
        // Each row's probabilities, rounded to f16 as they weight the f16 values.
        for r in 0..rows {
            let (first, pos) = range(r);
            let p = &mut scores[r * span + first - lo..r * span + pos + 1 - lo];
            let inv = softmax(p);
            probabilities(p, inv);
        }
        out.fill(0.0);
        for b0 in (lo..=hi).step_by(kb) {
            let b1 = (b0 + kb - 1).min(hi);
            widen(kv.v, kv, tile, (b0, b1, hi), block);
            for (r, o) in out.chunks_exact_mut(hd).enumerate() {
                let (first, pos) = range(r);
                let (j0, j1) = (b0.max(first), b1.min(pos));
                if j0 > j1 {
                    continue;
                }
                let p = &scores[r * span + j0 - lo..=r * span + j1 - lo];
                let v = &block[(j0 - b0) * hd..(j1 + 1 - b0) * hd];
                // 64 values (8 registers of accumulators) at a time, in passes over a head.
                if hd % 64 == 0 {
                    for (c, oc) in o.chunks_exact_mut(64).enumerate() {
                        weigh::<8>(p, &v[64 * c..], hd, oc);
                    }
                } else {
                    for (c, oc) in o.chunks_exact_mut(8).enumerate() {
                        weigh::<1>(p, &v[8 * c..], hd, oc);
                    }
                }
            }
        }
    }
}

/// `o += sum_j p[j] * v[j]`, key by key, over `8 L` values (`L` registers of accumulators);
/// `v`'s rows are `stride` apart.
///
/// # Safety
/// AVX2/FMA; `o` has `8 L` values, `v` holds `p.len()` rows of `stride >= 8 L`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn weigh<const L: usize>(p: &[f32], v: &[f32], stride: usize, o: &mut [f32]) {
    let mut acc = [_mm256_setzero_ps(); L];
    // SAFETY: (whole body) as the caller promises.
    unsafe {
        for (l, a) in acc.iter_mut().enumerate() {
            *a = _mm256_loadu_ps(o.as_ptr().add(8 * l));
        }
        for (j, &pj) in p.iter().enumerate() {
            let pv = _mm256_set1_ps(pj);
            let vj = v.as_ptr().add(j * stride);
            for (l, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vj.add(8 * l)), *a);
            }
        }
        for (l, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(o.as_mut_ptr().add(8 * l), *a);
        }
    }
}

/// `p[j] = f16(p[j] * inv)` widened back, eight at a time.
#[target_feature(enable = "avx2,fma,f16c")]
fn probabilities(p: &mut [f32], inv: f32) {
    let iv = _mm256_set1_ps(inv);
    let round = |x: __m256| {
        _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_mul_ps(
            x, iv,
        )))
    };
    let mut chunks = p.chunks_exact_mut(8);
    for c in &mut chunks {
        // SAFETY: c holds 8 floats.
        unsafe { _mm256_storeu_ps(c.as_mut_ptr(), round(_mm256_loadu_ps(c.as_ptr()))) };
    }
    let tail = chunks.into_remainder();
    if !tail.is_empty() {
        let mut buf = [0f32; 8];
        buf[..tail.len()].copy_from_slice(tail);
        // SAFETY: buf holds 8 floats.
        unsafe { _mm256_storeu_ps(buf.as_mut_ptr(), round(_mm256_loadu_ps(buf.as_ptr()))) };
        let n = tail.len();
        tail.copy_from_slice(&buf[..n]);
    }
}

/// Scores of the 8-key groups from `g0` (a multiple of 8 within the block that starts at `b0`)
/// through key `g1`, for `R` f16-rounded query heads `q` (`R` rows of a head) attending to the
/// same keys `first..=pos`, four groups at a time, into `s` (`R` rows of scores, indexed by
/// key - `lo`).
///
/// # Safety
/// AVX2/FMA; `kt` is the block's transposed keys, `kb` per dimension.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores8<const R: usize>(
    q: &[f32],
    kt: &[f32],
    kb: usize,
    b0: usize,
    (g0, g1): (usize, usize),
    (lo, first, pos): (usize, usize, usize),
    scale: f32,
    s: &mut [f32],
) {
    let sc = _mm256_set1_ps(scale);
    let span = s.len() / R;
    let mut g = g0;
    while g <= g1 {
        let n = ((g1 - g) / 8 + 1).min(4);
        // SAFETY: every group read lies within the block (g + 8n <= b0 + kb).
        let acc = unsafe {
            match n {
                4 => dots::<4, R>(q, kt, kb, g - b0),
                3 => dots::<3, R>(q, kt, kb, g - b0),
                2 => dots::<2, R>(q, kt, kb, g - b0),
                _ => dots::<1, R>(q, kt, kb, g - b0),
            }
        };
        for (row, acc) in acc.iter().enumerate() {
            let s = &mut s[row * span..(row + 1) * span];
            for (i, a) in acc.iter().enumerate().take(n) {
                let (k0, v) = (g + 8 * i, _mm256_mul_ps(*a, sc));
                if k0 >= first && k0 + 7 <= pos {
                    // SAFETY: keys k0..k0 + 8 are within the row's scores.
                    unsafe { _mm256_storeu_ps(s.as_mut_ptr().add(k0 - lo), v) };
                } else {
                    let mut lanes = [0f32; 8];
                    // SAFETY: lanes holds 8 floats.
                    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), v) };
                    for (l, x) in lanes.iter().enumerate() {
                        if (first..=pos).contains(&(k0 + l)) {
                            s[k0 + l - lo] = *x;
                        }
                    }
                }
            }
        }
        g += 8 * n;
    }
}

/// For each of the `R` heads in `q` (`R` rows), `N` registers of 8 dot products: key group `i`
/// (8 keys at `kt[at + 8 i..]` of each dimension's row) against the head, summed dimension by
/// dimension; each load of keys serves every head.
///
/// # Safety
/// AVX2/FMA; `kt` holds `q.len() / R` rows of `kb` floats, `at + 8 N <= kb`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dots<const N: usize, const R: usize>(
    q: &[f32],
    kt: &[f32],
    kb: usize,
    at: usize,
) -> [[__m256; 4]; R] {
    let hd = q.len() / R;
    let mut acc = [[_mm256_setzero_ps(); 4]; R];
    // SAFETY: as the caller promises.
    unsafe {
        let base = kt.as_ptr().add(at);
        for d in 0..hd {
            let qb: [__m256; R] = std::array::from_fn(|r| _mm256_set1_ps(q[r * hd + d]));
            let row = base.add(d * kb);
            for i in 0..N {
                let k = _mm256_loadu_ps(row.add(8 * i));
                for (a, qb) in acc.iter_mut().zip(&qb) {
                    a[i] = _mm256_fmadd_ps(*qb, k, a[i]);
                }
            }
        }
    }
    acc
}

/// Keys `b0..b0 + kb` of the tile's KV group widened to f32 and transposed, 8 keys by 8
/// dimensions at a time: dimension `d` of key `j` at `[d * kb + j - b0]`; keys past `b1` are
/// zeros. Keys and values [`AHEAD`] keys on (up to the tile's last key `hi`) are prefetched,
/// and from the tile's first block (`b0 == lo8`) its first keys and values.
///
/// # Safety
/// AVX2/F16C; the tile's block table covers `hi`; `block` holds `kb * head_dim` floats, `kb`
/// a multiple of 8.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen_transposed(
    cache: &[f16],
    kv: PagedKv<'_>,
    tile: &Tile<'_>,
    (b0, b1, hi): (usize, usize, usize),
    lo8: usize,
    kb: usize,
    block: &mut [f32],
) {
    let hd = kv.head_dim;
    let table = tile.queries[0].block_table;
    if b0 == lo8 {
        // The first keys (and values), before the loop's prefetches reach past them.
        for j in b0..(b0 + AHEAD).min(hi + 1) {
            // SAFETY: as below.
            unsafe {
                prefetch_row(cache, kv, table, j, tile.g);
                prefetch_row(kv.v, kv, table, j, tile.g);
            }
        }
    }
    for j0 in (b0..b0 + kb).step_by(8) {
        for j in j0 + AHEAD..(j0 + AHEAD + 8).min(hi + 1) {
            // SAFETY: the block table covers every key up to hi. The values too: they are read
            // after all the keys, by when they are in cache.
            unsafe {
                prefetch_row(cache, kv, table, j, tile.g);
                prefetch_row(kv.v, kv, table, j, tile.g);
            }
        }
        let srcs: [Option<*const __m128i>; 8] = std::array::from_fn(|i| {
            // SAFETY: the block table covers every key up to b1.
            (j0 + i <= b1).then(
                || unsafe { cache.as_ptr().add(kv.offset(table, j0 + i, tile.g)) }
                    as *const __m128i,
            )
        });
        for l in 0..hd / 8 {
            // SAFETY: each key has hd values; the block holds dimension 8l + 7's row.
            unsafe {
                let rows = srcs.map(|p| {
                    p.map_or(_mm256_setzero_ps(), |p| {
                        _mm256_cvtph_ps(_mm_loadu_si128(p.add(l)))
                    })
                });
                let t = transpose8(rows);
                for (i, v) in t.iter().enumerate() {
                    _mm256_storeu_ps(block.as_mut_ptr().add((8 * l + i) * kb + j0 - b0), *v);
                }
            }
        }
    }
}

/// How many keys ahead of the one widened its row is prefetched: a decode tile's keys are rows
/// of `2 head_dim` bytes `n_kv_heads` rows apart, a stride the hardware prefetchers do not
/// follow, so without it each 8 keys wait for memory in turn.
const AHEAD: usize = 32;

/// Asks for key (or value) `j`'s row of KV group `g` to be brought into cache.
///
/// # Safety
/// `table` covers `j`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn prefetch_row(cache: &[f16], kv: PagedKv<'_>, table: &[u32], j: usize, g: usize) {
    // SAFETY: the row lies within the cache (the table covers j); prefetches never fault.
    unsafe {
        let row = cache.as_ptr().add(kv.offset(table, j, g)) as *const i8;
        for b in (0..2 * kv.head_dim).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>(row.add(b));
        }
    }
}

/// The transpose of an 8 x 8 block of floats held in 8 registers.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
    let t0 = _mm256_unpacklo_ps(r[0], r[1]);
    let t1 = _mm256_unpackhi_ps(r[0], r[1]);
    let t2 = _mm256_unpacklo_ps(r[2], r[3]);
    let t3 = _mm256_unpackhi_ps(r[2], r[3]);
    let t4 = _mm256_unpacklo_ps(r[4], r[5]);
    let t5 = _mm256_unpackhi_ps(r[4], r[5]);
    let t6 = _mm256_unpacklo_ps(r[6], r[7]);
    let t7 = _mm256_unpackhi_ps(r[6], r[7]);
    let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let s1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
    let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let s3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
    let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let s5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
    let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let s7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
    [
        _mm256_permute2f128_ps::<0x20>(s0, s4),
        _mm256_permute2f128_ps::<0x20>(s1, s5),
        _mm256_permute2f128_ps::<0x20>(s2, s6),
        _mm256_permute2f128_ps::<0x20>(s3, s7),
        _mm256_permute2f128_ps::<0x31>(s0, s4),
        _mm256_permute2f128_ps::<0x31>(s1, s5),
        _mm256_permute2f128_ps::<0x31>(s2, s6),
        _mm256_permute2f128_ps::<0x31>(s3, s7),
    ]
}

/// Keys or values `b0..=b1` of the tile's KV group (`cache` is `kv.k` or `kv.v`), widened to
/// f32, `head_dim` each.
///
/// # Safety
/// AVX2/F16C; the tile's block table covers `b1`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen(
    cache: &[f16],
    kv: PagedKv<'_>,
    tile: &Tile<'_>,
    (b0, b1, hi): (usize, usize, usize),
    block: &mut [f32],
) {
    let hd = kv.head_dim;
    let table = tile.queries[0].block_table;
    for j in b0..=b1 {
        if j + AHEAD <= hi {
            // SAFETY: the block table covers every key up to hi.
            unsafe { prefetch_row(cache, kv, table, j + AHEAD, tile.g) };
        }
        // SAFETY: the block table covers j (<= the tile's last position); block has room for
        // (b1 - b0 + 1) * hd floats.
        unsafe {
            let src = cache.as_ptr().add(kv.offset(table, j, tile.g)) as *const __m128i;
            let dst = block.as_mut_ptr().add((j - b0) * hd);
            for l in 0..hd / 8 {
                _mm256_storeu_ps(dst.add(8 * l), _mm256_cvtph_ps(_mm_loadu_si128(src.add(l))));
            }
        }
    }
}

/// Softmax numerators in place, 8 at a time (a partial last group padded with -inf for the
/// max, its padding dropped after the exponential); returns 1 / their sum.
#[target_feature(enable = "avx2,fma,f16c")]
fn softmax(s: &mut [f32]) -> f32 {
    let n = s.len();
    let full = n / 8 * 8;
    // SAFETY: (whole body) every load and store lies within s (the last, partial group through
    // a padded copy).
    unsafe {
        let mut mx = _mm256_set1_ps(f32::NEG_INFINITY);
        for c in (0..full).step_by(8) {
            mx = _mm256_max_ps(mx, _mm256_loadu_ps(s.as_ptr().add(c)));
        }
        if full < n {
            mx = _mm256_max_ps(
                mx,
                load_partial(s.as_ptr().add(full), n - full, f32::NEG_INFINITY),
            );
        }
        let m4 = _mm_max_ps(_mm256_extractf128_ps(mx, 1), _mm256_castps256_ps128(mx));
        let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let mv = _mm256_set1_ps(_mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))));
        let mut sv = _mm256_setzero_ps();
        for c in (0..full).step_by(8) {
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s.as_ptr().add(c)), mv));
            _mm256_storeu_ps(s.as_mut_ptr().add(c), e);
            sv = _mm256_add_ps(sv, e);
        }
        if full < n {
            let len = n - full;
            let mut e8 = [0f32; 8];
            let e = exp8(_mm256_sub_ps(
                load_partial(s.as_ptr().add(full), len, 0.0),
                mv,
            ));
            _mm256_storeu_ps(e8.as_mut_ptr(), e);
            e8[len..].fill(0.0);
            s[full..].copy_from_slice(&e8[..len]);
            sv = _mm256_add_ps(sv, _mm256_loadu_ps(e8.as_ptr()));
        }
        1.0 / hsum(sv)
    }
}
