//! The 5-bit and K-quant formats (issue 14, acceptance 2): dequantisation of random blocks
//! against gguf-py's (llama.cpp's own Python package, an independent implementation: `pip install
//! gguf`), and the matmul kernels — the interleaved AVX2 ones for Q4_K and Q6_K, the re-layouts
//! for the others — against a dequantise-then-f32 reference, bitwise independent of the batch.

use std::process::Command;

use half::f16;
use kernels::matmul::{matmul, Matrix};
use kernels::quant::{dequantize_row, quantize_row_q8, quantize_row_q8_k};
use kernels::DType;

const FORMATS: [DType; 5] = [
    DType::Q5_0,
    DType::Q5_1,
    DType::Q4_K,
    DType::Q5_K,
    DType::Q6_K,
];

/// xorshift64*.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A small finite f16 (what a real scale looks like), as bytes.
    fn scale(&mut self) -> [u8; 2] {
        let v = (self.next() % 2000) as f32 / 1e5 + 1e-4;
        f16::from_f32(v).to_bits().to_le_bytes()
    }
}

/// `n` random blocks of `dt`: random quants and scale bytes, the f16 fields finite.
fn random_blocks(dt: DType, n: usize, seed: u64) -> Vec<u8> {
    let mut r = Rng(seed | 1);
    let bb = dt.block_bytes();
    let mut out: Vec<u8> = (0..n * bb).map(|_| r.next() as u8).collect();
    for b in out.chunks_exact_mut(bb) {
        let f16_fields: &[usize] = match dt {
            DType::Q5_0 => &[0],
            DType::Q5_1 | DType::Q4_K | DType::Q5_K => &[0, 2],
            DType::Q6_K => &[208],
            _ => unreachable!(),
        };
        for &at in f16_fields {
            let s = r.scale();
            b[at..at + 2].copy_from_slice(&s);
        }
    }
    out
}

fn ggml_name(dt: DType) -> &'static str {
    DType::ggml_name(dt.ggml_id())
}

#[test]
fn dequantisation_matches_gguf_py_on_random_blocks() {
    let dir = std::env::temp_dir().join(format!("tandem-kquant-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (i, dt) in FORMATS.into_iter().enumerate() {
        let blocks = random_blocks(dt, 64, 7 + i as u64);
        let n = 64 * dt.block_len();
        let (src, dst) = (dir.join("blocks"), dir.join("values"));
        std::fs::write(&src, &blocks).unwrap();
        let script = "import sys, numpy as np\n\
            from gguf.quants import dequantize\n\
            from gguf.constants import GGMLQuantizationType as T\n\
            data = np.fromfile(sys.argv[1], dtype=np.uint8)\n\
            dequantize(data, T[sys.argv[3]]).astype(np.float32).tofile(sys.argv[2])\n";
        let out = Command::new("python3")
            .args(["-c", script])
            .arg(&src)
            .arg(&dst)
            .arg(ggml_name(dt))
            .output()
            .expect("python3 with gguf and numpy (pip install gguf numpy)");
        assert!(
            out.status.success(),
            "{dt:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let want: Vec<f32> = std::fs::read(&dst)
            .unwrap()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let mut got = vec![0f32; n];
        dequantize_row(dt, &blocks, &mut got);
        assert_eq!(want.len(), n, "{dt:?}");
        for (j, (a, b)) in got.iter().zip(&want).enumerate() {
            // The same f32 products; numpy may round one multiply differently.
            let tol = 1e-6 * b.abs().max(1e-3);
            assert!((a - b).abs() <= tol, "{dt:?} value {j}: {a} vs gguf-py {b}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `m` activation rows of `k` values in -1..1.
fn activations(m: usize, k: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng(seed | 1);
    (0..m * k)
        .map(|_| (r.next() % 2001) as f32 / 1000.0 - 1.0)
        .collect()
}

/// The kernel's own arithmetic, in f64: weights dequantised, activations quantised to 8 bits
/// (Q8_0 blocks; Q8_1 for the affine formats, whose minimum multiplies the block's sum; one
/// scale per 256 values, as GGML's Q8_K, for the K-quants) and dequantised again.
fn reference(dt: DType, w: &[u8], n: usize, k: usize, x: &[f32], m: usize) -> Vec<f32> {
    let with_sum = matches!(dt, DType::Q4_K);
    let k_quant = matches!(dt, DType::Q4_K | DType::Q6_K);
    let bb = if with_sum { 36 } else { 34 };
    let (qo, row_bytes) = (if with_sum { 4 } else { 2 }, dt.row_bytes(k).unwrap());
    let mut wrow = vec![0f32; k];
    let mut xq = vec![0u8; k / 32 * bb];
    let mut out = vec![0f32; m * n];
    for i in 0..m {
        if k_quant {
            quantize_row_q8_k(&x[i * k..(i + 1) * k], &mut xq, with_sum);
        } else {
            quantize_row_q8(&x[i * k..(i + 1) * k], &mut xq, with_sum);
        }
        let xd: Vec<f64> = xq
            .chunks_exact(bb)
            .flat_map(|b| {
                let d = f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f64();
                b[qo..qo + 32].iter().map(move |&q| q as i8 as f64 * d)
            })
            .collect();
        for j in 0..n {
            dequantize_row(dt, &w[j * row_bytes..(j + 1) * row_bytes], &mut wrow);
            let dot: f64 = wrow.iter().zip(&xd).map(|(&a, b)| a as f64 * b).sum();
            out[i * n + j] = dot as f32;
        }
    }
    out
}

#[test]
fn every_format_multiplies_as_its_dequantised_values_do_and_rows_ignore_the_batch() {
    // 40 rows: whole groups of 8, the interleaved kernels (on AVX2); 37: the re-laid copies.
    let k = 512;
    for (i, dt) in FORMATS.into_iter().enumerate() {
        for n in [40, 37] {
            let bytes = random_blocks(dt, n * k / dt.block_len(), 100 + i as u64);
            let w = Matrix::new(dt, n, k, std::sync::Arc::new(bytes.clone()), 0).unwrap();
            #[cfg(target_arch = "x86_64")]
            if n % 8 == 0
                && matches!(dt, DType::Q4_K | DType::Q6_K)
                && is_x86_feature_detected!("avx2")
            {
                assert_eq!(w.dtype(), dt, "kept for its interleaved kernel");
            }
            let x = activations(9, k, 5 + n as u64);
            let mut all = vec![0f32; 9 * n];
            matmul(&w, &x, 9, &mut all).unwrap();
            let want = reference(dt, &bytes, n, k, &x, 9);
            let scale = want.iter().fold(0f32, |a, v| a.max(v.abs())).max(1e-3);
            for (j, (a, b)) in all.iter().zip(&want).enumerate() {
                // Formats re-laid as f32 take f32 activations: up to the 8-bit rounding apart.
                let tol = match (w.dtype(), dt) {
                    (DType::F32, _) => 2e-2,
                    _ => 1e-4,
                } * scale;
                assert!((a - b).abs() <= tol, "{dt:?} n={n} out {j}: {a} vs {b}");
            }
            for r in [0, 4, 8] {
                let mut one = vec![0f32; n];
                matmul(&w, &x[r * k..(r + 1) * k], 1, &mut one).unwrap();
                assert_eq!(one, all[r * n..(r + 1) * n], "{dt:?} n={n} row {r}");
            }
        }
    }
}
