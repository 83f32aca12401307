//! Optimistic admission and preemption on the real models (SmolLM2 and Gemma 3): streams whose
//! KV outgrows the pool as they decode are preempted — their KV swapped to host memory (G2)
//! and loaded back, or given up and computed again — and every stream's tokens are bitwise
//! those of an engine with room for all (greedy and seeded); the path is asserted from the
//! counters (preemptions by kind, tokens found on resume, G2 hits), and no page or ledger entry
//! outlives the streams. `swap_against_recompute` (ignored: a benchmark) measures the goodput
//! of both side by side.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use engine::tiers::TierConfig;
use engine::{Admission, Engine, EngineConfig, Load, Model, RequestId, SamplingParams};
use tandem_tests::{load_gemma3, load_model};

/// Plain token ids (none special), different for each `k`.
fn text(k: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 300 + (k * 7919 + i * 104_729) % 20_000)
        .collect()
}

/// Stream `k`'s parameters: greedy for even `k`, seeded sampling for odd; never stopping
/// early, so every stream grows to its full length.
fn params(k: u32, max_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_tokens: Some(max_tokens),
        ignore_eos: true,
        temperature: if k % 2 == 0 { 0.0 } else { 0.8 },
        top_k: 40,
        seed: 11 + k as u64,
        ..Default::default()
    }
}

/// How an arm's engine admits and what is below its pool.
struct Arm {
    blocks: usize,
    admission: Admission,
    /// G2 bytes (0: none).
    host_bytes: u64,
}

/// Runs `streams` prompts of `prompt` tokens generating `max_tokens` each, all queued at once;
/// returns each stream's tokens, the engine's counters and the seconds it took.
fn run(
    model: &Arc<Model>,
    stops: &[u32],
    arm: &Arm,
    streams: u32,
    (prompt, max_tokens): (usize, usize),
) -> (BTreeMap<RequestId, Vec<u32>>, Load, f64) {
    let config = EngineConfig {
        num_blocks: arm.blocks,
        admission: arm.admission,
        tiers: TierConfig {
            host_bytes: arm.host_bytes,
            ..Default::default()
        },
        ..Default::default()
    };
    let mut e = Engine::new(model.clone(), config, stops.to_vec()).unwrap();
    for k in 0..streams {
        let id = RequestId(k as u64);
        e.add(id, text(k, prompt), params(k, max_tokens)).unwrap();
    }
    let t0 = Instant::now();
    let out = e.run_to_completion().unwrap();
    let seconds = t0.elapsed().as_secs_f64();
    let load = e.load();
    assert_eq!(e.free_blocks(), e.total_blocks(), "every page back");
    let l = load.ledger;
    assert_eq!(
        (l.reserved, l.in_flight, l.committed),
        (0, 0, 0),
        "no ledger entry outlives its stream"
    );
    (out, load, seconds)
}

/// G2 bytes for `pages` pages of every layer group.
fn host_bytes(model: &Model, pages: usize) -> u64 {
    let page = model.kv_page_bytes(EngineConfig::default().block_size);
    (pages * model.kv_pages(1) * page) as u64
}

fn preempted_streams_resume_exactly(model: Arc<Model>, stops: Vec<u32>) {
    let bs = EngineConfig::default().block_size;
    let (streams, shape) = (6, (3 * bs + 5, 40));
    // Each stream grows to 6 pages a group: 36 in all, and the pool holds 22.
    let roomy = Arm {
        blocks: 64,
        admission: Admission::Reserve,
        host_bytes: 0,
    };
    let (want, calm, _) = run(&model, &stops, &roomy, streams, shape);
    assert_eq!(want.len(), streams as usize);
    assert!(want.values().all(|t| t.len() == shape.1));
    assert_eq!(calm.preemptions, Default::default(), "room for all: none");
    let swap = Arm {
        blocks: 22,
        admission: Admission::Optimistic,
        host_bytes: host_bytes(&model, 64),
    };
    let (got, l, _) = run(&model, &stops, &swap, streams, shape);
    assert_eq!(got, want, "swapped to G2 and back: every token the same");
    let p = l.preemptions;
    assert!(p.swapped > 0, "the pool ran out: preempted ({p:?})");
    assert_eq!(p.recomputed, 0);
    assert!(l.tiers.host.hits > 0, "G2 served the resumes");
    // Each resume computes again only the partial block its KV ended in.
    let swapped_computed = p.resumed_tokens - p.resumed_hit_tokens;
    assert!(
        swapped_computed <= p.swapped * (bs as u64 - 1),
        "resumes computed {swapped_computed} tokens again ({p:?})"
    );
    let recompute = Arm {
        host_bytes: 0,
        ..swap
    };
    let (got, l, _) = run(&model, &stops, &recompute, streams, shape);
    assert_eq!(got, want, "recomputed: every token the same");
    let p = l.preemptions;
    assert!(p.recomputed > 0 && p.swapped == 0, "{p:?}");
    assert!(
        p.resumed_tokens - p.resumed_hit_tokens > swapped_computed,
        "without G2 resumes compute more again ({p:?}; swapped: {swapped_computed})"
    );
}

#[test]
fn preempted_streams_resume_exactly_smollm2() {
    let (model, tok) = load_model();
    preempted_streams_resume_exactly(model, tok.stop_ids().to_vec());
}

#[test]
fn preempted_streams_resume_exactly_gemma3() {
    let (model, tok) = load_gemma3();
    preempted_streams_resume_exactly(model, tok.stop_ids().to_vec());
}

/// Decode memory pressure on SmolLM2: 32 streams of 128 prompt tokens and 512 generated, 24 of
/// 512 and 512, then 16 of 1,024 and 512 (long contexts, where a recompute costs most), the pool
/// a quarter of what they grow to (as the tier benchmarks size it); `TANDEM_PREEMPT_SHAPES`
/// picks some (`0,2`; shape 3, 32 of 512 and 1,024 — long generations, preempted late — only
/// when asked: it alone takes ~10 minutes). Preempted streams swapped to G2 against the same engine
/// recomputing them, the same pool reserving each stream's whole length up front (the default:
/// no preemption, fewer streams at once), and an engine with room for all (the limit), tokens
/// checked equal.
/// `cargo test --release -p tandem-tests --test engine_preempt -- --ignored --nocapture`
#[test]
#[ignore = "a benchmark: minutes on a 2-core machine"]
fn swap_against_recompute() {
    let (model, tok) = load_model();
    let stops = tok.stop_ids().to_vec();
    let shapes = [
        (32, (128, 512)),
        (24, (512, 512)),
        (16, (1024, 512)),
        (32, (512, 1024)),
    ];
    let picked = std::env::var("TANDEM_PREEMPT_SHAPES").unwrap_or_else(|_| "0,1,2".into());
    for i in picked
        .split(',')
        .map(|i| i.trim().parse::<usize>().expect("a shape's index"))
    {
        let (streams, shape) = shapes[i];
        pressure(&model, &stops, streams, shape);
    }
}

/// [`swap_against_recompute`] on one shape: `streams` × (`prompt` + `max_tokens`).
fn pressure(model: &Arc<Model>, stops: &[u32], streams: u32, shape: (usize, usize)) {
    let bs = EngineConfig::default().block_size;
    let need = streams as usize * (shape.0 + shape.1).div_ceil(bs);
    let tight = need / 4;
    let arm = |blocks, admission, host_bytes| Arm {
        blocks,
        admission,
        host_bytes,
    };
    let arms = [
        ("room for all", arm(need, Admission::Reserve, 0)),
        (
            "swap to G2",
            arm(tight, Admission::Optimistic, host_bytes(model, need)),
        ),
        ("recompute", arm(tight, Admission::Optimistic, 0)),
        ("reserve", arm(tight, Admission::Reserve, 0)),
    ];
    let mut want = None;
    println!(
        "{streams} streams x ({} + {}) tokens, pool {tight} of {need} pages",
        shape.0, shape.1
    );
    for (name, arm) in &arms {
        let (got, l, s) = run(model, stops, arm, streams, shape);
        let generated: usize = got.values().map(Vec::len).sum();
        let p = l.preemptions;
        println!(
            "{name:>13}: {:.1} tokens/s ({generated} in {s:.1} s); preempted: {} swapped, {} recomputed; resumed {} tokens, {} found; G2 hits {} blocks",
            generated as f64 / s,
            p.swapped,
            p.recomputed,
            p.resumed_tokens,
            p.resumed_hit_tokens,
            l.tiers.host.hits,
        );
        match &want {
            None => want = Some(got),
            Some(w) => assert_eq!(&got, w, "{name}: every token the same"),
        }
    }
}
