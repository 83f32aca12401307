//! GPU benchmark (issue 6): prefill tokens/s and decode step time at batch 1, 16 and 64 of
//! the GPU forward, beside the card's memory-bandwidth limit (bf16 weights + KV read per step ÷
//! the measured device copy bandwidth). Needs `--features cuda` and a GPU:
//!
//! ```sh
//! cargo bench -p tandem-tests --features cuda --bench gpu
//! ```
//!
//! Each step also copies the logits of the rows that sample back to the host (a prompt's last
//! token; every sequence of a decode step), as the engine needs them; the timings include it.

#[cfg(not(feature = "cuda"))]
fn main() {
    println!("built without `--features cuda`: nothing to measure");
}

#[cfg(feature = "cuda")]
fn main() {
    use std::sync::Arc;
    use std::time::Instant;

    use kernels::cuda::llama::GpuBatch;
    use kernels::cuda::Gpu;

    let gpu = match Gpu::new(0) {
        Ok(g) => Arc::new(g),
        Err(e) => {
            println!("no GPU: {e}");
            return;
        }
    };
    let (model, _) = tandem_tests::load_model();
    let c = &model.config;
    // On the CUDA emulator (scripts/gpu-check.sh rehearse) a token costs the CPU a GEMM and
    // thousands of fiber switches: a small run that proves the benchmark, not a GPU.
    let emu = std::env::var_os("TANDEM_CUDA_EMU").is_some();
    if emu {
        println!(
            "CUDA emulator (a test double on the CPU): the numbers below say nothing about a GPU"
        );
    }
    let (prompt_len, batches, n) = if emu {
        (32u32, &[1usize][..], 1usize << 20)
    } else {
        (512u32, &[1usize, 16, 64][..], 1usize << 29)
    };
    // Device copy bandwidth: n u16s (1 GiB on a GPU) copied 5 times (each byte read and written once).
    let src = gpu.zeros::<u16>(n).unwrap();
    let mut dst = gpu.zeros::<u16>(n).unwrap();
    gpu.stream().memcpy_dtod(&src, &mut dst).unwrap();
    gpu.stream().synchronize().unwrap();
    let t0 = Instant::now();
    for _ in 0..5 {
        gpu.stream().memcpy_dtod(&src, &mut dst).unwrap();
    }
    gpu.stream().synchronize().unwrap();
    let bw = 5.0 * 2.0 * (n * 2) as f64 / t0.elapsed().as_secs_f64();
    drop((src, dst));
    let kvw = c.n_kv_heads * c.head_dim;
    let per_layer = c.dim * (c.n_heads * c.head_dim) * 2 + 2 * c.dim * kvw + 3 * c.dim * c.ffn_dim;
    let weight_bytes = ((per_layer * c.n_layers + c.vocab_size * c.dim) * 2) as f64;
    println!(
        "device: {} — copy bandwidth {:.0} GB/s; bf16 weights {:.0} MB",
        gpu.arch(),
        bw / 1e9,
        weight_bytes / 1e6
    );
    println!("| measurement | value | memory-bandwidth limit |\n|---|---:|---:|");

    let (bs, ctx) = (16usize, 128usize);
    // Prefill: one prompt of 512 tokens (32 on the emulator).
    let pl = prompt_len as usize;
    let blocks = 64usize;
    let mut gm = engine::gpu::gpu_llama(&model, &gpu, bs, blocks).unwrap();
    let prompt: Vec<u32> = (0..prompt_len).map(|i| 300 + i * 7 % 20000).collect();
    let pos: Vec<u32> = (0..prompt_len).collect();
    let table: Vec<u32> = (0..blocks as u32).collect();
    let batch = GpuBatch {
        tokens: &prompt,
        positions: &pos,
        slots: &pos,
        seq: &vec![0; pl],
        block_tables: &table,
        max_blocks: blocks,
        logit_rows: &[prompt_len - 1],
    };
    gm.forward(&batch).unwrap();
    let t0 = Instant::now();
    for _ in 0..3 {
        gm.forward(&batch).unwrap();
    }
    let secs = t0.elapsed().as_secs_f64() / 3.0;
    println!(
        "| prefill, {pl} tokens | {:.0} tokens/s | — (compute-bound) |",
        pl as f64 / secs
    );
    drop(gm);

    for &b in batches {
        let per_seq = (ctx + 16).div_ceil(bs);
        let mut gm = engine::gpu::gpu_llama(&model, &gpu, bs, b * per_seq).unwrap();
        let tables: Vec<u32> = (0..(b * per_seq) as u32).collect();
        // Fill each sequence's first `ctx` tokens.
        for s in 0..b {
            let toks: Vec<u32> = (0..ctx as u32)
                .map(|i| 300 + (i + s as u32) % 20000)
                .collect();
            let pos: Vec<u32> = (0..ctx as u32).collect();
            let slots: Vec<u32> = pos
                .iter()
                .map(|&p| (s * per_seq) as u32 * bs as u32 + p)
                .collect();
            gm.forward(&GpuBatch {
                tokens: &toks,
                positions: &pos,
                slots: &slots,
                seq: &vec![s as u32; ctx],
                block_tables: &tables,
                max_blocks: per_seq,
                logit_rows: &[],
            })
            .unwrap();
        }
        let mut step_ms = Vec::new();
        for i in 0..10u32 {
            let p = ctx as u32 + i;
            let toks = vec![300 + i; b];
            let pos = vec![p; b];
            let slots: Vec<u32> = (0..b).map(|s| (s * per_seq * bs) as u32 + p).collect();
            let seq: Vec<u32> = (0..b as u32).collect();
            let t0 = Instant::now();
            gm.forward(&GpuBatch {
                tokens: &toks,
                positions: &pos,
                slots: &slots,
                seq: &seq,
                block_tables: &tables,
                max_blocks: per_seq,
                logit_rows: &seq, // one token a sequence: row i is sequence i
            })
            .unwrap();
            step_ms.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        step_ms.sort_by(f64::total_cmp);
        let kv_bytes = (b * (ctx + 5) * c.n_layers * kvw * 2 * 2) as f64;
        let limit_ms = (weight_bytes + kv_bytes) / bw * 1e3;
        println!(
            "| decode step, batch {b} | {:.3} ms (median of 10) | {:.3} ms |",
            step_ms[5], limit_ms
        );
    }
}
