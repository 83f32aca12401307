//! Batch invariance and continuous batching on the real model: a sequence's logits are bitwise
//! identical whatever else is in the batch and however its prompt is chunked, and the scheduler
//! returns every request's single-request output and all its KV blocks.

use engine::RequestId;
use std::collections::BTreeMap;

use engine::{BlockTable, Engine, EngineConfig, KvCache, Model, SamplingParams, SeqChunk};
use tandem_tests::load_model;

const DECODE_STEPS: usize = 3;

fn prompts(vocab: u32) -> Vec<Vec<u32>> {
    (0..16u32)
        .map(|s| {
            (0..(3 + s * 7 % 41))
                .map(|i| (s * 1009 + i * 7919 + 17) % vocab)
                .collect()
        })
        .collect()
}

/// Logits after the prompt and after each of `DECODE_STEPS` greedy decode steps, for several
/// sequences run together; prompts are fed in chunks of at most `chunk` tokens per step.
fn run(model: &Model, kv: &mut KvCache, seqs: &[Vec<u32>], chunk: usize) -> Vec<Vec<Vec<f32>>> {
    let mut tables: Vec<BlockTable> = seqs
        .iter()
        .map(|p| {
            let mut t = BlockTable::default();
            kv.reserve(&mut t, p.len() + DECODE_STEPS + 1).unwrap();
            t
        })
        .collect();
    let mut toks: Vec<Vec<u32>> = seqs.to_vec();
    let mut done = vec![0usize; seqs.len()];
    let mut out = vec![Vec::new(); seqs.len()];
    while out.iter().any(|o| o.len() < DECODE_STEPS + 1) {
        let mut plan = Vec::new();
        let mut budget = chunk * 2;
        for i in 0..seqs.len() {
            if out[i].len() > DECODE_STEPS || budget == 0 {
                continue;
            }
            let n = (toks[i].len() - done[i]).min(chunk).min(budget);
            budget -= n;
            plan.push((i, done[i], n));
        }
        let chunks: Vec<SeqChunk<'_>> = plan
            .iter()
            .map(|&(i, s, n)| SeqChunk {
                tokens: &toks[i][s..s + n],
                start_pos: s,
                block_table: &tables[i],
                logits: if s + n == toks[i].len() {
                    engine::Logits::Last
                } else {
                    engine::Logits::None
                },
            })
            .collect();
        let logits = model.forward(kv, &chunks).unwrap();
        for (&(i, _, n), l) in plan.iter().zip(logits) {
            done[i] += n;
            if let Some(l) = l {
                toks[i].push(engine::sampler::argmax(&l));
                out[i].push(l);
            }
        }
    }
    tables.drain(..).for_each(|t| kv.release(t));
    out
}

#[test]
fn logits_are_bitwise_identical_across_batch_sizes_and_chunking() {
    let (model, _) = load_model();
    let ps = prompts(model.config.vocab_size as u32);
    let mut kv = model.new_kv_cache(16, 16 * 8).unwrap();
    let alone: Vec<_> = ps
        .iter()
        .map(|p| run(&model, &mut kv, std::slice::from_ref(p), usize::MAX / 4).remove(0))
        .collect();
    for (batch, chunk) in [(2, 5), (3, 64), (5, 1), (8, 9), (16, 16), (16, 1000)] {
        let together = run(&model, &mut kv, &ps[..batch], chunk);
        for (i, got) in together.iter().enumerate() {
            for (step, (a, b)) in alone[i].iter().zip(got).enumerate() {
                let same = a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "sequence {i} (prompt {} tokens), step {step}: batch {batch} chunk {chunk} changed its logits", ps[i].len());
            }
        }
    }
    assert_eq!(kv.free_blocks(), kv.total_blocks());
}

#[test]
fn scheduler_serves_16_requests_like_one() {
    let (model, tok) = load_model();
    let ps = prompts(model.config.vocab_size as u32);
    let params = |i: usize| SamplingParams {
        max_tokens: Some(6 + i % 5),
        temperature: if i % 2 == 0 { 0.0 } else { 0.8 },
        top_p: 0.9,
        seed: i as u64,
        ..Default::default()
    };
    let alone: BTreeMap<RequestId, Vec<u32>> = ps
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut e = Engine::new(
                model.clone(),
                EngineConfig::default(),
                tok.stop_ids().to_vec(),
            )
            .unwrap();
            e.add(RequestId(i as u64), p.clone(), params(i)).unwrap();
            let id = RequestId(i as u64);
            (id, e.run_to_completion().unwrap().remove(&id).unwrap())
        })
        .collect();
    // A small cache and token budget: admissions wait for blocks, prompts are chunked.
    let cfg = EngineConfig {
        num_blocks: 12,
        max_batch_tokens: 24,
        ..Default::default()
    };
    let mut e = Engine::new(model, cfg, tok.stop_ids().to_vec()).unwrap();
    for (i, p) in ps.iter().enumerate() {
        e.add(RequestId(i as u64), p.clone(), params(i)).unwrap();
    }
    let mut peak_running_blocks = 0;
    let mut together: BTreeMap<RequestId, Vec<u32>> = BTreeMap::new();
    while e.has_work() {
        for ev in e.step().unwrap() {
            together.entry(ev.id).or_default().push(ev.token);
        }
        peak_running_blocks = peak_running_blocks.max(e.total_blocks() - e.free_blocks());
    }
    assert_eq!(together, alone);
    assert!(peak_running_blocks <= 12);
    assert_eq!(e.free_blocks(), e.total_blocks());
}

#[test]
fn abort_frees_blocks_at_once() {
    let (model, tok) = load_model();
    let mut e = Engine::new(
        model,
        EngineConfig {
            num_blocks: 8,
            ..Default::default()
        },
        tok.stop_ids().to_vec(),
    )
    .unwrap();
    e.add(
        RequestId(1),
        vec![1, 2, 3, 4, 5],
        SamplingParams::greedy(50),
    )
    .unwrap();
    e.add(RequestId(2), vec![6, 7, 8], SamplingParams::greedy(50))
        .unwrap();
    e.step().unwrap();
    assert!(e.free_blocks() < 8);
    assert!(e.release(RequestId(1), engine::Release::Cancelled));
    assert!(e.release(RequestId(2), engine::Release::Cancelled));
    assert!(!e.release(RequestId(2), engine::Release::Cancelled));
    assert_eq!(e.free_blocks(), 8);
    assert!(!e.has_work());
}

/// The disaggregated split inside one process: one engine computes the prompt's KV
/// (prefill-only), another receives it into reserved blocks and generates; the tokens are those
/// of a single engine, greedy and seeded.
#[test]
fn prefill_on_one_engine_decode_on_another_matches_single_engine() {
    let (model, tok) = load_model();
    let ps = prompts(model.config.vocab_size as u32);
    let mut prefill = Engine::new(
        model.clone(),
        EngineConfig {
            max_batch_tokens: 7,
            ..Default::default()
        },
        vec![],
    )
    .unwrap();
    let mut decode = Engine::new(
        model.clone(),
        EngineConfig {
            num_blocks: 64,
            ..Default::default()
        },
        tok.stop_ids().to_vec(),
    )
    .unwrap();
    let params = |i: usize| SamplingParams {
        max_tokens: Some(8),
        temperature: if i % 2 == 0 { 0.0 } else { 0.9 },
        seed: 7 + i as u64,
        ..Default::default()
    };
    for (i, p) in ps.iter().enumerate().skip(1).take(6) {
        let mut single = Engine::new(
            model.clone(),
            EngineConfig::default(),
            tok.stop_ids().to_vec(),
        )
        .unwrap();
        single.add(RequestId(0), p.clone(), params(i)).unwrap();
        let want = single
            .run_to_completion()
            .unwrap()
            .remove(&RequestId(0))
            .unwrap();

        decode
            .reserve_remote(RequestId(i as u64), p.clone(), params(i), 0)
            .unwrap();
        prefill
            .add_prefill_only(RequestId(i as u64), p[..p.len() - 1].to_vec(), 0, None)
            .unwrap();
        while prefill.take_prefilled().is_empty() {
            assert!(
                prefill.step().unwrap().is_empty(),
                "prefill-only requests sample nothing"
            );
        }
        let kv = prefill.export_kv(RequestId(i as u64)).unwrap();
        assert_eq!(prefill.free_blocks(), prefill.total_blocks());
        decode.admit_remote(RequestId(i as u64), &kv).unwrap();
        let got = decode
            .run_to_completion()
            .unwrap()
            .remove(&RequestId(i as u64))
            .unwrap();
        assert_eq!(got, want, "prompt {i}");
    }
    assert_eq!(decode.free_blocks(), decode.total_blocks());
    // A reservation that never gets its KV is freed by abort.
    decode
        .reserve_remote(RequestId(99), ps[3].clone(), params(0), 0)
        .unwrap();
    assert!(decode.free_blocks() < decode.total_blocks());
    assert!(decode.release(RequestId(99), engine::Release::Cancelled));
    assert_eq!(decode.free_blocks(), decode.total_blocks());
}

/// What a migration asks of a decode worker, on one engine: 8 copies of a greedy stream
/// resumed at once from staggered points (its prompt plus its first `s` tokens, as the router
/// re-sends it), sharing cached prefixes with each other and with the earlier groups, their
/// prompts chunked with other sequences' decodes: each resumed copy's next tokens are bitwise
/// the uninterrupted stream's. (A CI run once saw a migrated stream diverge under contention;
/// this pins the engine's part of that path.)
#[test]
fn streams_resumed_from_any_point_continue_exactly() {
    let (model, tok) = load_model();
    let prompt: Vec<u32> = (0..37u32).map(|i| 400 + (i * 7919) % 20_000).collect();
    let greedy = |n| SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(n)
    };
    let stops = tok.stop_ids().to_vec();
    let mut cold = Engine::new(model.clone(), EngineConfig::default(), stops.clone()).unwrap();
    cold.add(RequestId(0), prompt.clone(), greedy(170)).unwrap();
    let want = cold
        .run_to_completion()
        .unwrap()
        .remove(&RequestId(0))
        .unwrap();
    for budget in [64, 256] {
        let config = EngineConfig {
            max_batch_tokens: budget,
            ..Default::default()
        };
        let mut e = Engine::new(model.clone(), config, stops.clone()).unwrap();
        let mut next = 0u64;
        for s in (1..140).step_by(23) {
            let mut starts = BTreeMap::new();
            for j in 0..8 {
                let at = s + j * 3;
                let resumed: Vec<u32> = prompt.iter().chain(&want[..at]).copied().collect();
                e.add(RequestId(next), resumed, greedy(4)).unwrap();
                starts.insert(RequestId(next), at);
                next += 1;
            }
            for (id, got) in e.run_to_completion().unwrap() {
                let at = starts[&id];
                assert_eq!(
                    got,
                    want[at..at + 4],
                    "budget {budget}: resumed after {at} tokens"
                );
            }
        }
        assert_eq!(e.free_blocks(), e.total_blocks());
    }
}
