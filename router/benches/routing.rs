//! The cost of one routing decision under the `kv` policy (issue 12, acceptance 6): naming an
//! 8,000-token prompt's blocks and finding each worker's cached overlap in a KV index of 1 M
//! blocks over 64 workers, then choosing among the 64. A benchmark, not a test:
//! `cargo bench -p router --bench routing`.

use std::time::Instant;
use types::WorkerId;

use proto::grpc::KvEvents;
use router::kv_index::KvIndex;
use router::routing::{self, Candidate, Policy};

const WORKERS: u64 = 64;
const BLOCKS: usize = 1 << 20;
const BLOCK: usize = 16;
const PROMPT: usize = 8_000;

fn main() {
    let seed = 0x5eed;
    // Each worker caches 16 Ki blocks: 1 Mi in all. Worker w holds 1,365 conversations of 16
    // blocks each, whose first 4 blocks (a system prompt) are the same everywhere.
    let system: Vec<u32> = (0..4 * BLOCK as u32).collect();
    let mut index = KvIndex::default();
    let t0 = Instant::now();
    for w in 0..WORKERS {
        let mut hashes = Vec::with_capacity(BLOCKS / WORKERS as usize);
        for conv in 0..1_365u32 {
            let tokens: Vec<u32> = system
                .iter()
                .copied()
                .chain(
                    (0..12 * BLOCK as u32)
                        .map(|i| 10_000 + w as u32 * 10_000_000 + conv * 1_000 + i),
                )
                .collect();
            let names =
                engine::block_hash::prompt_hashes(seed, engine::block_hash::ROOT, BLOCK, &tokens);
            hashes.extend(names.iter().map(|b| b.0));
        }
        hashes.sort_unstable();
        hashes.dedup();
        let snapshot = KvEvents {
            first: 0,
            next: 0,
            hashes,
            stored: Vec::new(),
            snapshot: true,
            tiers: Vec::new(),
        };
        index.apply(WorkerId(w), &snapshot, usize::MAX);
    }
    println!(
        "index: {} block entries over {WORKERS} workers, built in {:?}",
        index.len(),
        t0.elapsed()
    );
    // An 8,000-token prompt: worker 7's conversation 3 (16 blocks), then new tokens.
    let prompt: Vec<u32> = system
        .iter()
        .copied()
        .chain((0..12 * BLOCK as u32).map(|i| 10_000 + 70_000_000 + 3_000 + i))
        .chain((0..(PROMPT - 16 * BLOCK) as u32).map(|i| 900_000_000 + i))
        .collect();
    let mut best = f64::MAX;
    let mut total = 0.0;
    let runs = 2_000;
    let mut chosen = 0;
    for _ in 0..runs {
        let t = Instant::now();
        let blocks =
            engine::block_hash::prompt_hashes(seed, engine::block_hash::ROOT, BLOCK, &prompt);
        let overlap = index.overlap(&blocks);
        let cands: Vec<Candidate> = (0..WORKERS)
            .map(|w| Candidate {
                load: (w % 5) as usize,
                cached: overlap.get(&WorkerId(w)).copied().unwrap_or(0) * BLOCK,
                queued_tokens: 0,
                rate: 1000.0,
            })
            .collect();
        chosen = routing::decode(Policy::Kv, &cands, 0).unwrap();
        let us = t.elapsed().as_secs_f64() * 1e6;
        best = best.min(us);
        total += us;
    }
    assert_eq!(chosen, 7, "the worker caching 16 of the prompt's blocks");
    println!(
        "one decision for an {PROMPT}-token prompt ({} blocks): best {best:.1} us, mean {:.1} us over {runs} (the target: 50 us)",
        PROMPT / BLOCK,
        total / runs as f64
    );
}
