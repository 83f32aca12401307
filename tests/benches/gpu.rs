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
    tiers(&gpu, emu);
}

/// KV tiers on the GPU: a prompt's cached pages read back from G2 (host memory) into the
/// device pool — the time a G2 hit adds over a pool hit of the same prompt, both computing its
/// last token only — beside what bounds it, measured in the same run: a host memcpy of the same
/// bytes and a copy from page-locked host memory to the device.
#[cfg(feature = "cuda")]
fn tiers(gpu: &std::sync::Arc<kernels::cuda::Gpu>, emu: bool) {
    use std::sync::Arc;
    use std::time::Instant;

    use engine::tiers::TierConfig;
    use engine::{Engine, EngineConfig, SamplingParams};

    let (m, t) = engine::load(
        &tandem_tests::model_path(),
        kernels::Device::parse("cuda:0").unwrap(),
    )
    .unwrap();
    let model = Arc::new(m);
    let (bs, pages) = (16usize, if emu { 4usize } else { 240 });
    let page = model.kv_page_bytes(bs);
    // Only blocks hit twice go down: the other prompt's pages, evicted to make room for the
    // loads, are not copied off the device, so a G2 hit below costs its loads alone.
    let config = EngineConfig {
        block_size: bs,
        num_blocks: pages + 2,
        tiers: TierConfig {
            host_bytes: ((pages + 16) * page) as u64,
            write_policy: engine::tiers::WritePolicy::HitTwice,
            ..Default::default()
        },
        ..EngineConfig::default()
    };
    let mut e = Engine::new(model, config, t.stop_ids().to_vec()).unwrap();
    let text = |k: u32| -> Vec<u32> {
        (0..(pages * bs + 1) as u32)
            .map(|i| 300 + (k * 7919 + i * 104_729) % 20_000)
            .collect()
    };
    let (a, b) = (text(1), text(2));
    let mut id = 0;
    let mut timed = |e: &mut Engine, p: &[u32]| {
        id += 1;
        let t0 = Instant::now();
        tandem_tests::generate(e, id, p, &SamplingParams::greedy(1));
        t0.elapsed().as_secs_f64()
    };
    for _ in 0..3 {
        timed(&mut e, &a); // computed, then hit twice in the pool
    }
    let (mut pool, mut g2) = (Vec::new(), Vec::new());
    let reps = if emu { 1 } else { 7 };
    for _ in 0..reps {
        timed(&mut e, &b); // evicts a's pages to G2
        g2.push(timed(&mut e, &a));
        pool.push(timed(&mut e, &a));
    }
    let host = e.load().tiers.host;
    let loaded = host.hits / reps as u64;
    assert!(
        loaded + 2 >= pages as u64,
        "a's pages came from G2: {host:?}"
    );
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let bytes = (loaded as usize * page) as f64;
    let load = median(&mut g2) - median(&mut pool);
    let copy = host.load_seconds / reps as f64;
    // The limits: a host memcpy of the same bytes, and page-locked host memory to the device.
    let src = vec![1u8; pages * page];
    let mut dst = vec![0u8; pages * page];
    let mut memcpy = Vec::new();
    for _ in 0..5 {
        let t0 = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        memcpy.push(t0.elapsed().as_secs_f64());
    }
    std::hint::black_box(&dst);
    // SAFETY: written by the copy below before anything reads it.
    let mut pinned = unsafe { gpu.context().alloc_pinned::<u8>(pages * page) }.unwrap();
    pinned.as_mut_slice().unwrap().fill(1);
    let mut dev = gpu.zeros::<u8>(pages * page).unwrap();
    let mut h2d = Vec::new();
    for _ in 0..5 {
        let t0 = Instant::now();
        gpu.stream().memcpy_htod(&pinned, &mut dev).unwrap();
        gpu.stream().synchronize().unwrap();
        h2d.push(t0.elapsed().as_secs_f64());
    }
    let gbs = |s: f64| bytes / s / 1e9;
    println!(
        "| KV tiers: {loaded} pages ({:.0} MB) from G2 into the device pool | {:.1} GB/s ({:.2} ms over a pool hit; by G2's own load time {:.1} GB/s) | host memcpy {:.1} GB/s; page-locked host to device {:.1} GB/s |",
        bytes / 1e6,
        gbs(load),
        load * 1e3,
        gbs(copy),
        gbs(median(&mut memcpy)),
        gbs(median(&mut h2d)),
    );
}
