//! Matrix multiplication `out[m, n] = sum_k x[m, k] * w[n, k]` for quantised and float weights.
//!
//! Quantised weights (Q4_0, Q4_1, Q8_0) are multiplied the way GGML does it: each activation
//! row is quantised to 8-bit blocks (Q8_1 for Q4_1 weights, Q8_0 otherwise) and dotted block by
//! block with integer arithmetic, then scaled. Float weights (F32, F16) use f32 FMAs.
//!
//! Every output element is computed by the same sequence of floating-point operations whatever
//! the number of rows `m` and however the work is tiled or split over threads, so a row's result
//! never depends on what else is in the batch (the engine's batch-invariance guarantee).

use std::sync::Arc;

use crate::quant::{quantize_row_q8, DType, Q8_0_BYTES, Q8_1_BYTES, QK};
use crate::{isa, Isa, KernelError};

/// Bytes that back a weight matrix: an mmapped model file or an owned buffer.
pub type Backing = Arc<dyn AsRef<[u8]> + Send + Sync>;

/// A weight matrix of `rows` output features by `cols` input features, row-major, each row
/// stored in `dtype`'s block format.
#[derive(Clone)]
pub struct Matrix {
    dtype: DType,
    rows: usize,
    cols: usize,
    backing: Backing,
    start: usize,
    /// Row-interleaved copy for the x86 kernels (see [`crate::packed`]).
    packed: Option<crate::mem::SharedBytes>,
}

impl std::fmt::Debug for Matrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Matrix({:?}, {}x{})", self.dtype, self.rows, self.cols)
    }
}

impl Matrix {
    /// Wraps `rows * row_bytes` bytes of `backing` starting at `start`.
    ///
    /// Formats without a kernel of their own are re-laid into an owned copy holding exactly
    /// the same values (see [`relaid`]).
    pub fn new(
        dtype: DType,
        rows: usize,
        cols: usize,
        backing: Backing,
        start: usize,
    ) -> Result<Matrix, KernelError> {
        let row_bytes = dtype.row_bytes(cols).ok_or(KernelError::Shape(format!(
            "{cols} columns is not a whole number of {dtype:?} blocks"
        )))?;
        let len = rows * row_bytes;
        let have = (*backing).as_ref().len();
        if start.checked_add(len).is_none_or(|end| end > have) {
            return Err(KernelError::Shape(format!(
                "{rows}x{cols} {dtype:?} needs {len} bytes at offset {start}, buffer has {have}"
            )));
        }
        if dtype.is_quantized() && cols % QK != 0 {
            return Err(KernelError::Shape(format!(
                "{cols} columns is not a multiple of {QK}"
            )));
        }
        if let Some(to) = relaid(dtype, rows) {
            let src = &(*backing).as_ref()[start..start + len];
            let bytes = match to {
                DType::Q8_0 => crate::kquant::q5_0_to_q8_0(src),
                _ => {
                    let mut wide = vec![0f32; rows * cols];
                    crate::quant::dequantize_row(dtype, src, &mut wide);
                    wide.iter().flat_map(|v| v.to_le_bytes()).collect()
                }
            };
            return Matrix::new(to, rows, cols, Arc::new(bytes), 0);
        }
        let mut m = Matrix {
            dtype,
            rows,
            cols,
            backing,
            start,
            packed: None,
        };
        if isa() == Isa::Avx2 && crate::packed::supports(dtype, rows) {
            let packed = crate::packed::pack(dtype, m.bytes(), rows, cols);
            m.packed = Some(crate::mem::SharedBytes::copy_of(&packed));
        }
        Ok(m)
    }

    /// An owned matrix from f32 values (row-major `rows x cols`), stored as `dtype`.
    pub fn from_f32(
        dtype: DType,
        rows: usize,
        cols: usize,
        values: &[f32],
    ) -> Result<Matrix, KernelError> {
        if values.len() != rows * cols {
            return Err(KernelError::Shape(format!(
                "{} values for {rows}x{cols}",
                values.len()
            )));
        }
        let rb = dtype.row_bytes(cols).ok_or(KernelError::Shape(format!(
            "{cols} columns is not a whole number of {dtype:?} blocks"
        )))?;
        let mut bytes = vec![0u8; rows * rb];
        for (src, dst) in values.chunks_exact(cols).zip(bytes.chunks_exact_mut(rb)) {
            match dtype {
                DType::F32 => dst
                    .iter_mut()
                    .zip(src.iter().flat_map(|v| v.to_le_bytes()))
                    .for_each(|(d, s)| *d = s),
                DType::F16 => dst
                    .iter_mut()
                    .zip(
                        src.iter()
                            .flat_map(|v| half::f16::from_f32(*v).to_bits().to_le_bytes()),
                    )
                    .for_each(|(d, s)| *d = s),
                DType::BF16 => dst
                    .iter_mut()
                    .zip(
                        src.iter()
                            .flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes()),
                    )
                    .for_each(|(d, s)| *d = s),
                DType::Q4_0 => crate::quant::quantize_row_q4_0(src, dst),
                DType::Q4_1 => crate::quant::quantize_row_q4_1(src, dst),
                DType::Q8_0 => crate::quant::quantize_row_q8_0(src, dst),
                other => {
                    return Err(KernelError::Shape(format!(
                        "no quantiser to {other:?} here (weights in it come from GGUF files)"
                    )))
                }
            }
        }
        Matrix::new(dtype, rows, cols, Arc::new(bytes), 0)
    }

    /// Storage type of the rows.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Number of rows (output features).
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Number of columns (input features).
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Bytes per stored row.
    pub fn row_bytes(&self) -> usize {
        self.dtype.row_bytes(self.cols).expect("validated in new")
    }
    /// All stored bytes.
    pub fn bytes(&self) -> &[u8] {
        &(*self.backing).as_ref()[self.start..self.start + self.rows * self.row_bytes()]
    }
    /// Dequantises row `r` into `out` (`cols` values), e.g. for an embedding lookup.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let rb = self.row_bytes();
        crate::quant::dequantize_row(self.dtype, &self.bytes()[r * rb..(r + 1) * rb], out);
    }
}

impl DType {
    /// Whether this is a block-quantised type.
    pub fn is_quantized(self) -> bool {
        self.block_len() > 1
    }
}

/// The format `dtype` weights of `rows` rows are re-laid into at load, when they have no
/// kernel of their own here: Q5_0 as Q8_0 (the same scale, 5-bit quants widened: exact);
/// Q4_K and Q6_K, which have interleaved kernels on AVX2 machines, and BF16, Q5_1 and Q5_K
/// otherwise as F32 (exact, and slow: the portable kernels have no path of their own for them).
fn relaid(dtype: DType, rows: usize) -> Option<DType> {
    let packed = isa() == Isa::Avx2 && crate::packed::supports(dtype, rows);
    match dtype {
        DType::Q5_0 => Some(DType::Q8_0),
        DType::Q4_K | DType::Q6_K if packed => None,
        DType::BF16 | DType::Q5_1 | DType::Q5_K | DType::Q4_K | DType::Q6_K => Some(DType::F32),
        _ => None,
    }
}

/// Rows of `x` handled per tile; weight rows per tile.
const MR: usize = 4;
const NR: usize = 2;
/// Activation rows kept hot in cache while sweeping a chunk of weight rows.
const M_BLOCK: usize = 64;

/// Computes `out[m, n] = sum_k x[m, k] * w[n, k]`, multithreaded over `n`.
pub fn matmul(w: &Matrix, x: &[f32], m: usize, out: &mut [f32]) -> Result<(), KernelError> {
    matmul_many(x, m, &mut [(w, out)])
}

/// The activation layout a weight format dots with: 0 f32, 1 Q8_1, 2 Q8_0, and for the
/// K-quants 3 and 4, Q8_1 and Q8_0 blocks quantised with one scale per 256 values as GGML's
/// Q8_K is (what llama.cpp dots K-quant weights with).
fn act_format(dtype: DType) -> usize {
    match dtype {
        DType::Q4_1 => 1,
        DType::Q4_0 | DType::Q8_0 => 2,
        DType::Q4_K => 3,
        DType::Q6_K => 4,
        _ => 0,
    }
}

/// Several matmuls over the same activations (e.g. Q, K and V): the activations are quantised
/// once per format and all output columns of all matrices are spread over the threads at once.
pub fn matmul_many(
    x: &[f32],
    m: usize,
    outs: &mut [(&Matrix, &mut [f32])],
) -> Result<(), KernelError> {
    let k = outs.first().map_or(0, |(w, _)| w.cols);
    for (w, out) in outs.iter() {
        if w.cols != k || x.len() != m * k || out.len() != m * w.rows {
            return Err(KernelError::Shape(format!(
                "matmul {m}x{} by {}x{}: x has {} values, out has {}",
                x.len() / m.max(1),
                w.rows,
                w.cols,
                x.len(),
                out.len()
            )));
        }
    }
    if m == 0 || outs.is_empty() {
        return Ok(());
    }
    let isa = isa();
    // Activations in each layout some weight needs (see `act_format`).
    let mut acts: [Vec<u8>; 5] = Default::default();
    for f in 1..5 {
        if !outs.iter().any(|(w, _)| act_format(w.dtype) == f) {
            continue;
        }
        let with_sum = f == 1 || f == 3;
        let row = k / QK * if with_sum { Q8_1_BYTES } else { Q8_0_BYTES };
        let mut q = vec![0u8; m * row];
        let quantize = |qr: &mut [u8], xr: &[f32]| match isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `isa` is Avx2 only when the CPU has AVX2, FMA and F16C.
            Isa::Avx2 if f >= 3 => unsafe { crate::x86::quantize_row_q8_k(xr, qr, with_sum) },
            _ if f >= 3 => crate::quant::quantize_row_q8_k(xr, qr, with_sum),
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `isa` is Avx2 only when the CPU has AVX2, FMA and F16C.
            Isa::Avx2 => unsafe { crate::x86::quantize_row_q8(xr, qr, with_sum) },
            _ => quantize_row_q8(xr, qr, with_sum),
        };
        // 16 rows an item.
        crate::pool::for_each_chunk_mut(&mut q, 16 * row, |i, qs| {
            let xs = &x[i * 16 * k..];
            qs.chunks_mut(row)
                .zip(xs.chunks(k))
                .for_each(|(qr, xr)| quantize(qr, xr))
        });
        acts[f] = q;
    }
    // The 512-bit kernels take their activations widened: one copy a matmul, for the one
    // packable dtype of each activation format (the widening reads its blocks).
    #[cfg(target_arch = "x86_64")]
    let wide: [Vec<u8>; 5] = std::array::from_fn(|f| {
        debug_assert!(
            outs.iter()
                .filter(|(w, _)| w.packed.is_some() && act_format(w.dtype) == f)
                .map(|(w, _)| w.dtype)
                .collect::<std::collections::HashSet<_>>()
                .len()
                <= 1,
            "one packable dtype per activation format"
        );
        let packed = outs
            .iter()
            .find(|(w, _)| w.packed.is_some() && act_format(w.dtype) == f);
        match packed {
            Some((w, _)) if crate::avx512() => crate::packed::avx512::widen(w.dtype, &acts[f]),
            _ => Vec::new(),
        }
    });
    // Work items: (matrix, first row, end row), each a whole number of NR-row tiles: a
    // thread's share of the rows, cut where a matrix ends — about one item a thread, each a
    // contiguous run of weights, which the prefetchers (and the kernels' own) follow from start
    // to end. Four items a thread were slower for a single row (batch-1 decode, which streams
    // the weights) and for 5 and 9 rows with the 512-bit kernels (a verify step, a small batch:
    // 6-8% a step), no different at 16 rows or with the 256-bit kernels (BENCHMARKS): each new
    // item starts a new stream and claims a shared counter. (For a single row, items shrinking
    // towards the end were slower too.)
    let total: usize = outs.iter().map(|(w, _)| w.rows).sum();
    let threads = crate::pool::threads();
    // Items are whole pairs of interleaved groups where a matrix allows (the 512-bit kernels
    // take two groups a vector; an odd one left runs at 256 bits).
    let g = 2 * crate::packed::GROUP;
    let mut work = Vec::new();
    if m * total * k < 1 << 16 || threads == 1 {
        for (i, (w, _)) in outs.iter().enumerate() {
            work.push((i, 0, w.rows));
        }
    } else {
        let per_thread = total.div_ceil(threads).div_ceil(g) * g;
        for (i, (w, _)) in outs.iter().enumerate() {
            let mut n0 = 0;
            while n0 < w.rows {
                let n1 = (n0 + per_thread).min(w.rows);
                work.push((i, n0, n1));
                n0 = n1;
            }
        }
    }
    type Job = (
        DType,
        usize,
        usize,
        (usize, usize),
        usize,
        crate::pool::SendPtr<f32>,
        usize,
        usize,
    );
    let jobs: Vec<Job> = outs
        .iter_mut()
        .map(|(w, out)| {
            let packed = w.packed.as_ref().map_or(0, |p| p.as_ptr() as usize);
            let f = act_format(w.dtype);
            let (xp, x_row) = if f == 0 {
                (x.as_ptr() as usize, k * 4)
            } else {
                (acts[f].as_ptr() as usize, acts[f].len() / m)
            };
            #[cfg(target_arch = "x86_64")]
            let xo = wide[f].as_ptr() as usize;
            #[cfg(not(target_arch = "x86_64"))]
            let xo = xp;
            (
                w.dtype,
                w.bytes().as_ptr() as usize,
                w.row_bytes(),
                (xp, xo),
                x_row,
                crate::pool::SendPtr(out.as_mut_ptr()),
                w.rows,
                packed,
            )
        })
        .collect();
    let run = |&(i, n0, n1): &(usize, usize, usize)| {
        let (dtype, wp, w_row, (xp, xo), x_row, o, ldo, packed) = jobs[i];
        #[cfg(target_arch = "x86_64")]
        if packed != 0 {
            let (w, x, o, nb) = (packed as *const u8, xp as *const u8, o.0, k / QK);
            // SAFETY: as below; the packed copy exists only on AVX2 machines (the VNNI kernels
            // run only where `vnni()` found AVX-512 VNNI and VL, the 512-bit ones where
            // `avx512()` found F and BW too, with `xo` the widened copy of `x` made
            // above), its rows are a multiple of 8 and so are n0 and n1 (chunks are
            // whole groups).
            unsafe {
                use crate::packed::{avx2, avx512, vnni};
                if crate::avx512() {
                    avx512::chunk(dtype, w, nb, x, xo as *const u8, x_row, m, n0, n1, o, ldo)
                } else if crate::vnni() {
                    vnni::chunk(dtype, w, nb, x, x_row, m, n0, n1, o, ldo)
                } else {
                    avx2::chunk(dtype, w, nb, x, x_row, m, n0, n1, o, ldo)
                }
            };
            return;
        }
        let _ = (packed, xo);
        // SAFETY: item (i, n0..n1) writes only columns n0..n1 of output i, which no other item
        // touches; weights, activations and outputs were size-checked above.
        unsafe {
            chunk_kernel(
                isa,
                dtype,
                wp as *const u8,
                w_row,
                xp as *const u8,
                x_row,
                k,
                m,
                n0,
                n1,
                o.0,
                ldo,
            )
        };
    };
    if work.len() == 1 {
        run(&work[0]);
    } else {
        crate::pool::for_each(work.len(), |i| run(&work[i]));
    }
    Ok(())
}

/// Computes columns `n0..n1` of `out` for all `m` rows.
///
/// # Safety
/// `w` must hold `n1` rows of `w_row` bytes, `x` `m` rows of `x_row` bytes in the layout `dtype`
/// expects, `out` `m * ldo` floats; no other thread may write columns `n0..n1`.
#[allow(clippy::too_many_arguments)]
unsafe fn chunk_kernel(
    isa: Isa,
    dtype: DType,
    w: *const u8,
    w_row: usize,
    x: *const u8,
    x_row: usize,
    k: usize,
    m: usize,
    n0: usize,
    n1: usize,
    out: *mut f32,
    ldo: usize,
) {
    let tile = tile_fn(isa, dtype);
    let mut mb = 0;
    while mb < m {
        let me = (mb + M_BLOCK).min(m);
        let mut j = n0;
        while j < n1 {
            let nr = if n1 - j >= NR { NR } else { 1 };
            let mut i = mb;
            while i < me {
                let mr = if me - i >= MR { MR } else { 1 };
                // SAFETY: tile (i..i+mr, j..j+nr) lies inside the ranges the caller vouched for.
                unsafe {
                    tile(
                        mr,
                        nr,
                        w.add(j * w_row),
                        w_row,
                        x.add(i * x_row),
                        x_row,
                        k,
                        out.add(i * ldo + j),
                        ldo,
                    )
                };
                i += mr;
            }
            j += nr;
        }
        mb = me;
    }
}

/// A tile kernel: `mr x nr` outputs (mr in {1, MR}, nr in {1, NR}).
type TileFn = unsafe fn(usize, usize, *const u8, usize, *const u8, usize, usize, *mut f32, usize);

fn tile_fn(isa: Isa, dtype: DType) -> TileFn {
    match (isa, dtype) {
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, DType::Q4_0) => avx2::tile::<{ avx2::Q4_0 }>,
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, DType::Q4_1) => avx2::tile::<{ avx2::Q4_1 }>,
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, DType::Q8_0) => avx2::tile::<{ avx2::Q8_0 }>,
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, DType::F16) => avx2::tile::<{ avx2::F16 }>,
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, _) => avx2::tile::<{ avx2::F32 }>,
        (_, DType::Q4_0) => scalar::tile_q::<{ scalar::Q4_0 }>,
        (_, DType::Q4_1) => scalar::tile_q::<{ scalar::Q4_1 }>,
        (_, DType::Q8_0) => scalar::tile_q::<{ scalar::Q8_0 }>,
        (_, DType::F16) => scalar::tile_f::<true>,
        (_, _) => scalar::tile_f::<false>,
    }
}

/// Portable kernels: per element, blocks in order, then the same scalar reduction.
mod scalar {
    use half::f16;

    pub const Q4_0: u8 = 0;
    pub const Q4_1: u8 = 1;
    pub const Q8_0: u8 = 2;

    #[inline(always)]
    unsafe fn h(p: *const u8) -> f32 {
        // SAFETY: caller passes a pointer to two readable bytes.
        f16::from_bits(unsafe { (p as *const u16).read_unaligned() }).to_f32()
    }

    /// # Safety
    /// See `TileFn`: pointers cover `mr` activation rows and `nr` weight rows of `k` values.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn tile_q<const F: u8>(
        mr: usize,
        nr: usize,
        w: *const u8,
        w_row: usize,
        x: *const u8,
        x_row: usize,
        k: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        let nb = k / 32;
        let (wb, xb) = match F {
            Q4_0 => (18, 34),
            Q4_1 => (20, 36),
            _ => (34, 34),
        };
        for i in 0..mr {
            for j in 0..nr {
                let mut acc = 0f32;
                let mut summ = 0f32;
                for b in 0..nb {
                    // SAFETY: block b of row j / row i is within the buffers (caller contract).
                    unsafe {
                        let wp = w.add(j * w_row + b * wb);
                        let xp = x.add(i * x_row + b * xb);
                        let xq = xp.add(if F == Q4_1 { 4 } else { 2 }) as *const i8;
                        let mut sumi = 0i32;
                        match F {
                            Q4_0 | Q4_1 => {
                                let qs = wp.add(if F == Q4_1 { 4 } else { 2 });
                                let off = if F == Q4_0 { 8 } else { 0 };
                                for t in 0..16 {
                                    let v = *qs.add(t);
                                    sumi += ((v & 15) as i32 - off) * *xq.add(t) as i32;
                                    sumi += ((v >> 4) as i32 - off) * *xq.add(t + 16) as i32;
                                }
                            }
                            _ => {
                                let qs = wp.add(2) as *const i8;
                                for t in 0..32 {
                                    sumi += *qs.add(t) as i32 * *xq.add(t) as i32;
                                }
                            }
                        }
                        acc += h(wp) * h(xp) * sumi as f32;
                        if F == Q4_1 {
                            summ += h(wp.add(2)) * h(xp.add(2));
                        }
                    }
                }
                // SAFETY: (i, j) is inside the tile the caller owns.
                unsafe { *out.add(i * ldo + j) = acc + summ };
            }
        }
    }

    /// # Safety
    /// See `TileFn`; `x` points at f32 activations.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn tile_f<const HALF: bool>(
        mr: usize,
        nr: usize,
        w: *const u8,
        w_row: usize,
        x: *const u8,
        x_row: usize,
        k: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        for i in 0..mr {
            for j in 0..nr {
                let mut acc = 0f32;
                for t in 0..k {
                    // SAFETY: element t of row i / row j is within the buffers (caller contract).
                    unsafe {
                        let xv = (x.add(i * x_row) as *const f32).add(t).read_unaligned();
                        let wv = if HALF {
                            h(w.add(j * w_row + 2 * t))
                        } else {
                            (w.add(j * w_row) as *const f32).add(t).read_unaligned()
                        };
                        acc = wv.mul_add(xv, acc);
                    }
                }
                // SAFETY: (i, j) is inside the tile the caller owns.
                unsafe { *out.add(i * ldo + j) = acc };
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    use super::{MR, NR};
    use crate::x86::hsum;

    pub const Q4_0: u8 = 0;
    pub const Q4_1: u8 = 1;
    pub const Q8_0: u8 = 2;
    pub const F16: u8 = 3;
    pub const F32: u8 = 4;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn h(p: *const u8) -> f32 {
        // SAFETY: caller passes a pointer to two readable bytes.
        let bits = unsafe { (p as *const u16).read_unaligned() };
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    /// 32 unsigned nibbles: low nibbles of the 16 bytes, then the high nibbles.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn nibbles(p: *const u8) -> __m256i {
        // SAFETY: caller passes a pointer to 16 readable bytes.
        let t = unsafe { _mm_loadu_si128(p as *const __m128i) };
        let b = _mm256_insertf128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1);
        _mm256_and_si256(b, _mm256_set1_epi8(0x0f))
    }

    /// Sum of products of unsigned bytes `a` with signed bytes `b`, as 8 f32 partial sums.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_us(a: __m256i, b: __m256i) -> __m256 {
        let p = _mm256_maddubs_epi16(a, b);
        _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)))
    }

    /// Sum of products of signed bytes, as 8 f32 partial sums.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn dot_ss(a: __m256i, b: __m256i) -> __m256 {
        dot_us(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a))
    }

    /// # Safety
    /// See `TileFn`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn tile<const F: u8>(
        mr: usize,
        nr: usize,
        w: *const u8,
        w_row: usize,
        x: *const u8,
        x_row: usize,
        k: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        // SAFETY: forwarded caller contract.
        unsafe {
            match (mr, nr) {
                (MR, NR) => tile_n::<F, MR, NR>(w, w_row, x, x_row, k, out, ldo),
                (MR, _) => tile_n::<F, MR, 1>(w, w_row, x, x_row, k, out, ldo),
                (_, NR) => tile_n::<F, 1, NR>(w, w_row, x, x_row, k, out, ldo),
                _ => tile_n::<F, 1, 1>(w, w_row, x, x_row, k, out, ldo),
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile_n<const F: u8, const M: usize, const N: usize>(
        w: *const u8,
        w_row: usize,
        x: *const u8,
        x_row: usize,
        k: usize,
        out: *mut f32,
        ldo: usize,
    ) {
        let mut acc = [[_mm256_setzero_ps(); N]; M];
        let mut summ = [[0f32; N]; M];
        let mut tail = [[0f32; N]; M];
        // SAFETY: (whole block) every load is inside the rows the caller vouched for.
        unsafe {
            if F == F16 || F == F32 {
                let k8 = k / 8 * 8;
                let mut t = 0;
                while t < k8 {
                    let mut wv = [_mm256_setzero_ps(); N];
                    for (j, v) in wv.iter_mut().enumerate() {
                        *v = if F == F16 {
                            _mm256_cvtph_ps(_mm_loadu_si128(
                                w.add(j * w_row + 2 * t) as *const __m128i
                            ))
                        } else {
                            _mm256_loadu_ps((w.add(j * w_row) as *const f32).add(t))
                        };
                    }
                    for i in 0..M {
                        let xv = _mm256_loadu_ps((x.add(i * x_row) as *const f32).add(t));
                        for j in 0..N {
                            acc[i][j] = _mm256_fmadd_ps(wv[j], xv, acc[i][j]);
                        }
                    }
                    t += 8;
                }
                for t in k8..k {
                    for i in 0..M {
                        let xv = (x.add(i * x_row) as *const f32).add(t).read_unaligned();
                        for j in 0..N {
                            let wv = if F == F16 {
                                h(w.add(j * w_row + 2 * t))
                            } else {
                                (w.add(j * w_row) as *const f32).add(t).read_unaligned()
                            };
                            tail[i][j] = wv.mul_add(xv, tail[i][j]);
                        }
                    }
                }
            } else {
                let (wb, xb, xq) = match F {
                    Q4_0 => (18, 34, 2),
                    Q4_1 => (20, 36, 4),
                    _ => (34, 34, 2),
                };
                for b in 0..k / 32 {
                    let mut wq = [_mm256_setzero_si256(); N];
                    let mut wd = [0f32; N];
                    let mut wm = [0f32; N];
                    for j in 0..N {
                        let p = w.add(j * w_row + b * wb);
                        wd[j] = h(p);
                        wq[j] = match F {
                            Q4_0 => _mm256_sub_epi8(nibbles(p.add(2)), _mm256_set1_epi8(8)),
                            Q4_1 => {
                                wm[j] = h(p.add(2));
                                nibbles(p.add(4))
                            }
                            _ => _mm256_loadu_si256(p.add(2) as *const __m256i),
                        };
                    }
                    for i in 0..M {
                        let p = x.add(i * x_row + b * xb);
                        let xd = _mm256_set1_ps(h(p));
                        let xs = if F == Q4_1 { h(p.add(2)) } else { 0.0 };
                        let xv = _mm256_loadu_si256(p.add(xq) as *const __m256i);
                        for j in 0..N {
                            let xy = if F == Q4_1 {
                                dot_us(wq[j], xv)
                            } else {
                                dot_ss(wq[j], xv)
                            };
                            let d = _mm256_mul_ps(_mm256_set1_ps(wd[j]), xd);
                            acc[i][j] = _mm256_fmadd_ps(d, xy, acc[i][j]);
                            if F == Q4_1 {
                                summ[i][j] += wm[j] * xs;
                            }
                        }
                    }
                }
            }
            for i in 0..M {
                for j in 0..N {
                    *out.add(i * ldo + j) = hsum(acc[i][j]) + summ[i][j] + tail[i][j];
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(12345);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    fn reference(w: &Matrix, x: &[f32], m: usize) -> Vec<f32> {
        let (n, k) = (w.rows(), w.cols());
        let mut row = vec![0f32; k];
        let mut out = vec![0f32; m * n];
        for j in 0..n {
            w.dequantize_row(j, &mut row);
            for i in 0..m {
                out[i * n + j] = (0..k)
                    .map(|t| row[t] as f64 * x[i * k + t] as f64)
                    .sum::<f64>() as f32;
            }
        }
        out
    }

    #[test]
    fn matches_dequantised_reference_all_formats() {
        // 37 rows take the generic tiles; 40 rows (whole groups of 8) the interleaved kernels.
        for n in [37, 40] {
            check_formats(n);
        }
    }

    fn check_formats(n: usize) {
        let k = 96;
        let wv = data(n * k, 1);
        for dt in [
            DType::F32,
            DType::F16,
            DType::BF16,
            DType::Q4_0,
            DType::Q4_1,
            DType::Q8_0,
        ] {
            let w = Matrix::from_f32(dt, n, k, &wv).unwrap();
            for m in [1, 3, 9] {
                let x = data(m * k, 7 + m as u32);
                let mut out = vec![0f32; m * n];
                matmul(&w, &x, m, &mut out).unwrap();
                let want = reference(&w, &x, m);
                // Activation quantisation to 8 bits costs up to ~1% of the row's magnitude.
                let tol = if dt.is_quantized() { 0.25 } else { 1e-3 };
                for (a, b) in out.iter().zip(&want) {
                    assert!((a - b).abs() < tol, "{dt:?} m={m}: {a} vs {b}");
                }
            }
        }
    }

    #[test]
    fn rows_are_bitwise_independent_of_batch() {
        for n in [70, 72] {
            check_batch_independence(n);
        }
    }

    fn check_batch_independence(n: usize) {
        let k = 128;
        let wv = data(n * k, 3);
        let x = data(13 * k, 5);
        for dt in [DType::F16, DType::Q4_1, DType::Q8_0, DType::Q4_0] {
            let w = Matrix::from_f32(dt, n, k, &wv).unwrap();
            // Tiles of every size: 2 and 3 rows alone, 4 + 2, 4 + 3, 3 x 4 + 1.
            for m in [2, 3, 6, 7, 13] {
                let mut all = vec![0f32; m * n];
                matmul(&w, &x[..m * k], m, &mut all).unwrap();
                for i in 0..m {
                    let mut one = vec![0f32; n];
                    matmul(&w, &x[i * k..(i + 1) * k], 1, &mut one).unwrap();
                    assert_eq!(one, all[i * n..(i + 1) * n], "{dt:?} row {i} of {m}");
                }
            }
        }
    }

    #[test]
    fn shape_errors_are_reported() {
        let w = Matrix::from_f32(DType::F32, 2, 4, &[0.0; 8]).unwrap();
        let mut out = vec![0f32; 2];
        assert!(matmul(&w, &[0.0; 3], 1, &mut out).is_err());
        assert!(Matrix::from_f32(DType::Q4_1, 1, 40, &[0.0; 40]).is_err());
    }
}
