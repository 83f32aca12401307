//! The GPU suite: every CUDA kernel against the CPU kernels on random inputs, with the stated
//! tolerances. Needs a GPU and the `cuda` feature; ignored unless asked for:
//!
//! ```sh
//! TANDEM_GPU=1 cargo test --release -p kernels --features cuda --test cuda -- --ignored
//! ```
#![cfg(feature = "cuda")]

use half::f16;
use kernels::cuda::{AttentionShape, Gpu, KvSpan};
use kernels::{ops, quant, DType, PagedKv, Query, RopeStyle};

struct Rng(u64);

impl Rng {
    fn f(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    fn next(&mut self) -> u64 {
        self.f();
        self.0
    }
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f()).collect()
    }
}

fn gpu() -> Option<Gpu> {
    std::env::var_os("TANDEM_GPU")?;
    Some(Gpu::new(0).expect("TANDEM_GPU is set but no CUDA device opened"))
}

fn close(what: &str, got: &[f32], want: &[f32], abs: f32, rel: f32) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= abs + rel * w.abs(),
            "{what}[{i}]: gpu {g} vs cpu {w} (tolerance {abs} + {rel}·|cpu|)"
        );
    }
}

#[test]
#[ignore = "needs a GPU: TANDEM_GPU=1 ... -- --ignored"]
fn elementwise_kernels_match_the_cpu() {
    let Some(g) = gpu() else { return };
    let mut r = Rng(7);
    let (rows, dim) = (5, 576);
    let (x, w) = (r.vec(rows * dim), r.vec(dim));
    let mut want = vec![0f32; rows * dim];
    for i in 0..rows {
        ops::rms_norm(
            &x[i * dim..(i + 1) * dim],
            &w,
            1e-5,
            &mut want[i * dim..(i + 1) * dim],
        );
    }
    let (dx, dw) = (g.upload(&x).unwrap(), g.upload(&w).unwrap());
    let mut out = g.zeros::<f32>(rows * dim).unwrap();
    g.rms_norm(&dx, &dw, rows, dim, 1e-5, &mut out).unwrap();
    close("rms_norm", &g.download(&out).unwrap(), &want, 1e-5, 1e-5);

    // RoPE, both pair layouts, positions up to 500 (angles by powf on the GPU, by repeated
    // multiplication on the CPU: 2e-3 absolute).
    let (tokens, heads, hd) = (4, 9, 64);
    let pos: Vec<usize> = vec![0, 1, 77, 500];
    for style in [RopeStyle::Interleaved, RopeStyle::Halves] {
        let x = r.vec(tokens * heads * hd);
        let mut want = x.clone();
        ops::rope(&mut want, &pos, heads, hd, 10000.0, style, None);
        let mut dx = g.upload(&x).unwrap();
        let dp = g
            .upload(&pos.iter().map(|&p| p as u32).collect::<Vec<_>>())
            .unwrap();
        g.rope(&mut dx, &dp, tokens, heads, hd, 10000.0, style)
            .unwrap();
        close(
            &format!("rope {style:?}"),
            &g.download(&dx).unwrap(),
            &want,
            2e-3,
            0.0,
        );
    }

    let (gate, up) = (r.vec(1536), r.vec(1536));
    let mut want = gate.clone();
    ops::silu_mul(&mut want, &up);
    let (mut dg, du) = (g.upload(&gate).unwrap(), g.upload(&up).unwrap());
    g.silu_mul(&mut dg, &du, gate.len()).unwrap();
    close("silu_mul", &g.download(&dg).unwrap(), &want, 1e-5, 1e-4);

    // Rows gathered for the LM head, in the order asked, a row twice: exact.
    let x = r.vec(4 * dim);
    let rows = [3u32, 0, 3];
    let mut out = g.zeros::<f32>(rows.len() * dim).unwrap();
    g.gather_rows(
        &g.upload(&x).unwrap(),
        &g.upload(&rows).unwrap(),
        dim,
        &mut out,
    )
    .unwrap();
    let want: Vec<f32> = rows
        .iter()
        .flat_map(|&i| x[i as usize * dim..(i as usize + 1) * dim].to_vec())
        .collect();
    assert_eq!(g.download(&out).unwrap(), want, "gather_rows");
}

#[test]
#[ignore = "needs a GPU: TANDEM_GPU=1 ... -- --ignored"]
fn dequantisation_to_bf16_matches_the_cpu_within_bf16_rounding() {
    let Some(g) = gpu() else { return };
    let mut r = Rng(11);
    // The device's bf16 values of `n` weights in blocks `q` against the CPU's dequantisation.
    let check = |dtype: DType, q: &[u8], n: usize| {
        let mut want = vec![0f32; n];
        quant::dequantize_row(dtype, q, &mut want);
        let dq = g.upload(q).unwrap();
        let blocks = n / dtype.block_len();
        let got = g
            .download(&g.dequantize(dtype, &dq, blocks).unwrap())
            .unwrap();
        let got: Vec<f32> = got
            .iter()
            .map(|&b| half::bf16::from_bits(b).to_f32())
            .collect();
        close(
            &format!("dequant {dtype:?}"),
            &got,
            &want,
            1e-6,
            1.0 / 128.0,
        );
    };
    let x = r.vec(32 * 64);
    for (dtype, block) in [(DType::Q4_0, 18), (DType::Q4_1, 20), (DType::Q8_0, 34)] {
        let mut q = vec![0u8; x.len() / 32 * block];
        match dtype {
            DType::Q4_0 => quant::quantize_row_q4_0(&x, &mut q),
            DType::Q4_1 => quant::quantize_row_q4_1(&x, &mut q),
            _ => quant::quantize_row_q8_0(&x, &mut q),
        }
        check(dtype, &q, x.len());
    }
    // The K-quants: random super-blocks (every scale byte and quant random, f16 fields finite).
    for (dtype, f16_fields) in [(DType::Q4_K, &[0usize, 2][..]), (DType::Q6_K, &[208][..])] {
        let bb = dtype.block_bytes();
        let mut q: Vec<u8> = (0..16 * bb).map(|_| (r.next() >> 56) as u8).collect();
        for b in q.chunks_exact_mut(bb) {
            for &at in f16_fields {
                let v = f16::from_f32(1e-3 + (r.next() % 1000) as f32 * 1e-5);
                b[at..at + 2].copy_from_slice(&v.to_bits().to_le_bytes());
            }
        }
        check(dtype, &q, 16 * 256);
    }
}

#[test]
#[ignore = "needs a GPU: TANDEM_GPU=1 ... -- --ignored"]
fn paged_attention_matches_the_cpu_for_prefill_and_decode_queries() {
    let Some(g) = gpu() else { return };
    let mut r = Rng(3);
    // SmolLM2's GQA: 9 query heads over 3 KV heads of 64.
    let (heads, kvh, hd, bs, blocks) = (9, 3, 64, 16, 12);
    let width = kvh * hd;
    let k: Vec<f16> = r
        .vec(blocks * bs * width)
        .into_iter()
        .map(f16::from_f32)
        .collect();
    let v: Vec<f16> = r
        .vec(blocks * bs * width)
        .into_iter()
        .map(f16::from_f32)
        .collect();
    // Two sequences with scattered blocks; a prefill chunk of 3 queries and a decode query.
    let tables: [Vec<u32>; 2] = [vec![5, 0, 9, 2], vec![7, 3, 11, 1]];
    let qs: Vec<(usize, usize)> = vec![(0, 37), (0, 38), (0, 39), (1, 60)];
    let q = r.vec(qs.len() * heads * hd);
    let queries: Vec<Query<'_>> = qs
        .iter()
        .map(|&(s, pos)| Query {
            pos,
            first: 0,
            block_table: &tables[s],
        })
        .collect();
    let kv = PagedKv {
        k: &k,
        v: &v,
        block_size: bs,
        n_kv_heads: kvh,
        head_dim: hd,
    };
    let scale = 1.0 / (hd as f32).sqrt();
    let mut want = vec![0f32; q.len()];
    kernels::attention::attention(&q, &queries, kv, heads, scale, &mut want);
    let bits = |x: &[f16]| x.iter().map(|h| h.to_bits()).collect::<Vec<u16>>();
    let (dk, dv) = (g.upload(&bits(&k)).unwrap(), g.upload(&bits(&v)).unwrap());
    let flat: Vec<u32> = tables.concat();
    let dt = g.upload(&flat).unwrap();
    let dseq = g
        .upload(&qs.iter().map(|&(s, _)| s as u32).collect::<Vec<_>>())
        .unwrap();
    let dpos = g
        .upload(&qs.iter().map(|&(_, p)| p as u32).collect::<Vec<_>>())
        .unwrap();
    let dq = g.upload(&q).unwrap();
    let mut out = g.zeros::<f32>(q.len()).unwrap();
    let shape = AttentionShape {
        n_heads: heads,
        n_kv_heads: kvh,
        head_dim: hd,
        block_size: bs,
        max_blocks: 4,
        scale,
    };
    g.paged_attention(&dq, &mut out, &dk, &dv, &dt, &dseq, &dpos, qs.len(), shape)
        .unwrap();
    // The CPU rounds queries and probabilities to f16 (as GGML does); the GPU keeps f32.
    close(
        "paged_attention",
        &g.download(&out).unwrap(),
        &want,
        5e-3,
        1e-2,
    );
}

#[test]
#[ignore = "needs a GPU: TANDEM_GPU=1 ... -- --ignored"]
fn kv_pack_unpack_store_and_sampling_are_exact() {
    let Some(g) = gpu() else { return };
    let mut r = Rng(5);
    let (bs, width, blocks, n) = (16, 192, 8, 37);
    let table: Vec<u32> = vec![6, 1, 4];
    let k: Vec<u16> = r
        .vec(blocks * bs * width)
        .into_iter()
        .map(|x| f16::from_f32(x).to_bits())
        .collect();
    let v: Vec<u16> = r
        .vec(blocks * bs * width)
        .into_iter()
        .map(|x| f16::from_f32(x).to_bits())
        .collect();
    let slot = |p: usize| table[p / bs] as usize * bs + p % bs;
    let mut want = Vec::new();
    for src in [&k, &v] {
        for p in 0..n {
            want.extend_from_slice(&src[slot(p) * width..(slot(p) + 1) * width]);
        }
    }
    let (dk, dv, dt) = (
        g.upload(&k).unwrap(),
        g.upload(&v).unwrap(),
        g.upload(&table).unwrap(),
    );
    let mut staging = g.zeros::<u16>(2 * n * width).unwrap();
    let span = KvSpan {
        n,
        width,
        block_size: bs,
    };
    g.pack_kv(&dk, &dv, &dt, &mut staging, span).unwrap();
    assert_eq!(
        g.download(&staging).unwrap(),
        want,
        "pack_kv is the wire layout"
    );
    let (mut k2, mut v2) = (
        g.zeros::<u16>(k.len()).unwrap(),
        g.zeros::<u16>(v.len()).unwrap(),
    );
    g.unpack_kv(&mut k2, &mut v2, &dt, &staging, span).unwrap();
    let (k2, v2) = (g.download(&k2).unwrap(), g.download(&v2).unwrap());
    for p in 0..n {
        let s = slot(p) * width..(slot(p) + 1) * width;
        assert_eq!(k2[s.clone()], k[s.clone()], "unpack keys, token {p}");
        assert_eq!(v2[s.clone()], v[s], "unpack values, token {p}");
    }

    // copy_pages moves whole pages of every segment between two sets of pools, by address.
    let page = bs * width * 2;
    let mut pools = Vec::new();
    for src in [&k, &v] {
        pools.push((g.upload(src).unwrap(), g.zeros::<u16>(src.len()).unwrap()));
    }
    let addr = |d: &cudarc::driver::CudaSlice<u16>| {
        use cudarc::driver::DevicePtr;
        d.device_ptr(g.stream()).0
    };
    let src: Vec<u64> = pools.iter().map(|(s, _)| addr(s)).collect();
    let dst: Vec<u64> = pools.iter().map(|(_, d)| addr(d)).collect();
    let moved = [3u32, 1];
    let (ds, dd, dp) = (
        g.upload(&src).unwrap(),
        g.upload(&dst).unwrap(),
        g.upload(&moved).unwrap(),
    );
    g.copy_pages(&dd, &ds, &dp, page).unwrap();
    for ((s, d), want) in pools.iter().zip([&k, &v]) {
        let (got, _) = (g.download(d).unwrap(), g.download(s).unwrap());
        for b in 0..blocks {
            let r = b * bs * width..(b + 1) * bs * width;
            match moved.contains(&(b as u32)) {
                true => assert_eq!(got[r.clone()], want[r], "page {b} copied"),
                false => assert!(got[r].iter().all(|&x| x == 0), "page {b} untouched"),
            }
        }
    }

    // store_kv rounds f32 rows to f16 like the CPU backend.
    let rows = r.vec(3 * width);
    let slots: Vec<u32> = vec![9, 40, 77];
    let (mut kc, mut vc) = (
        g.zeros::<u16>(k.len()).unwrap(),
        g.zeros::<u16>(v.len()).unwrap(),
    );
    let (ds, dr) = (g.upload(&slots).unwrap(), g.upload(&rows).unwrap());
    g.store_kv(&mut kc, &mut vc, &ds, &dr, &dr, 3, width)
        .unwrap();
    let kc = g.download(&kc).unwrap();
    for (i, &s) in slots.iter().enumerate() {
        for j in 0..width {
            assert_eq!(
                kc[s as usize * width + j],
                f16::from_f32(rows[i * width + j]).to_bits()
            );
        }
    }

    // Sampling: argmax exact (ties to the lower id); top-k 1 is argmax whatever the draw; a
    // draw of 0 picks the most likely of the kept candidates.
    let vocab = 49152;
    let mut logits = r.vec(2 * vocab);
    logits[1234] = 9.0;
    logits[vocab + 777] = 9.0;
    logits[vocab + 778] = 9.0;
    let dl = g.upload(&logits).unwrap();
    assert_eq!(g.argmax(&dl, 2, vocab).unwrap(), vec![1234, 777]);
    let u = g.upload(&[0.99f32, 0.0]).unwrap();
    assert_eq!(
        g.sample(&dl, &u, 2, vocab, 1, 1.0, 1.0).unwrap(),
        vec![1234, 777]
    );
    assert_eq!(g.sample(&dl, &u, 2, vocab, 40, 0.7, 0.9).unwrap()[1], 777);
}

/// The suite above on the CPU CUDA emulator (`kernels/emu`, a test double, not a GPU): every
/// kernel's arithmetic, launch shape and arguments checked on machines without a GPU. On a GPU
/// (`TANDEM_GPU` set) the suite itself runs instead.
#[test]
fn the_gpu_suite_passes_on_the_cuda_emulator() {
    if std::env::var_os("TANDEM_GPU").is_none() {
        let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
        kernels::cuda::emu::run_gpu_tests(dir, "on_the_cuda_emulator", 4)
            .unwrap_or_else(|out| panic!("{out}"));
    }
}
