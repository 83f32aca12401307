//! The prefix cache on the real model: a request whose prompt starts with cached blocks
//! computes only the rest and gives bitwise the tokens (and the KV) of a cold run; cached
//! blocks are evicted, least recently used first, when space is needed.

use engine::RequestId;
use engine::{Engine, EngineConfig, SamplingParams};
use tandem_tests::{generate, load_model};

fn cold(prefix_cache: bool, num_blocks: usize) -> EngineConfig {
    EngineConfig {
        num_blocks,
        prefix_cache,
        ..Default::default()
    }
}

/// Some user text of `n` tokens for turn `k` (plain ids, none special).
fn user_turn(k: u32, n: u32) -> Vec<u32> {
    (0..n)
        .map(|i| 300 + (k * 7919 + i * 104_729) % 40_000)
        .collect()
}

#[test]
fn a_conversation_computes_only_each_turns_new_tokens_and_matches_cold_runs_bitwise() {
    let (model, tok) = load_model();
    let stops = tok.stop_ids().to_vec();
    let bs = EngineConfig::default().block_size;
    for params in [
        SamplingParams::greedy(12),
        SamplingParams {
            max_tokens: Some(12),
            temperature: 0.8,
            top_k: 40,
            seed: 7,
            ..Default::default()
        },
    ] {
        let mut warm = Engine::new(model.clone(), cold(true, 256), stops.clone()).unwrap();
        let mut prompt: Vec<u32> = Vec::new();
        let mut cached = 0usize; // tokens the previous turn left in whole cached blocks
        for k in 0..6u32 {
            prompt.extend(user_turn(k, 19 + 5 * k));
            let mut off = Engine::new(model.clone(), cold(false, 256), stops.clone()).unwrap();
            let want = generate(&mut off, 1, &prompt, &params);
            let before = warm.load().prefix_hit_tokens;
            let got = generate(&mut warm, 100 + k as u64, &prompt, &params);
            assert_eq!(got, want, "turn {k}: the cached prefix changes no token");
            let hit = (warm.load().prefix_hit_tokens - before) as usize;
            let expect = cached.min((prompt.len() - 1) / bs * bs);
            assert_eq!(
                hit, expect,
                "turn {k}: everything before the new tokens came from the cache"
            );
            assert_eq!(
                off.load().prefix_hit_tokens,
                0,
                "the cache-off engine computes it all"
            );
            // The next turn repeats this prompt and this answer; all but the last token's KV
            // was computed, in whole blocks.
            prompt.extend(&got);
            cached = (prompt.len() - 1) / bs * bs;
        }
        assert_eq!(
            warm.free_blocks(),
            warm.total_blocks(),
            "cached blocks count as free"
        );
        assert!(warm.load().kv_blocks_cached > 0);
    }
}

#[test]
fn a_prefill_engine_exports_the_kv_of_a_cold_one_computing_only_the_suffix() {
    let (model, _) = load_model();
    let system: Vec<u32> = user_turn(99, 40);
    let prompts: Vec<Vec<u32>> = (0..3u32)
        .map(|k| system.iter().copied().chain(user_turn(k, 9 + k)).collect())
        .collect();
    let mut warm = Engine::new(model.clone(), cold(true, 64), Vec::new()).unwrap();
    for (i, p) in prompts.iter().enumerate() {
        let mut off = Engine::new(model.clone(), cold(false, 64), Vec::new()).unwrap();
        off.add_prefill_only(RequestId(1), p.clone(), 0, None)
            .unwrap();
        off.run_to_completion().unwrap();
        let want = off.export_kv(RequestId(1)).unwrap();
        let before = warm.load().prefix_hit_tokens;
        warm.add_prefill_only(RequestId(i as u64), p.clone(), 0, None)
            .unwrap();
        warm.run_to_completion().unwrap();
        assert_eq!(
            warm.export_kv(RequestId(i as u64)).unwrap(),
            want,
            "prompt {i}: bitwise the same KV"
        );
        let hit = warm.load().prefix_hit_tokens - before;
        assert_eq!(
            hit,
            if i == 0 { 0 } else { 32 },
            "prompt {i}: the shared blocks"
        );
    }
}

#[test]
fn under_pressure_the_least_recently_used_prefix_is_evicted_and_nothing_is_refused() {
    let (model, tok) = load_model();
    // 8 blocks of 16 tokens: each request (40-token prompt + 8) needs 3; two fit cached at
    // most beside a running one.
    let mut e = Engine::new(model, cold(true, 8), tok.stop_ids().to_vec()).unwrap();
    let params = SamplingParams::greedy(8);
    let prompts: Vec<Vec<u32>> = (0..6u32).map(|k| user_turn(k, 40)).collect();
    for (i, p) in prompts.iter().enumerate() {
        generate(&mut e, i as u64, p, &params);
        let c = e.load();
        assert_eq!(
            c.kv_blocks_free, c.kv_blocks_total,
            "request {i} freed everything"
        );
    }
    let hits = |e: &Engine| e.load().prefix_hit_tokens;
    let before = hits(&e);
    generate(&mut e, 10, &prompts[5], &params);
    assert_eq!(hits(&e) - before, 32, "the newest prompt is still cached");
    let before = hits(&e);
    generate(&mut e, 11, &prompts[0], &params);
    assert_eq!(
        hits(&e) - before,
        0,
        "the oldest was evicted for the others"
    );
}

#[test]
fn a_delta_transfer_carries_only_the_tokens_the_decode_engine_lacks() {
    let (model, tok) = load_model();
    let stops = tok.stop_ids().to_vec();
    let params = SamplingParams::greedy(8);
    let per_token = 4 * model.config.kv_width();
    let mut prefill = Engine::new(model.clone(), cold(true, 64), Vec::new()).unwrap();
    let mut decode = Engine::new(model.clone(), cold(true, 64), stops.clone()).unwrap();
    let mut prompt = user_turn(5, 37);
    for turn in 0..3u64 {
        let mut single = Engine::new(model.clone(), cold(false, 64), stops.clone()).unwrap();
        let want = generate(&mut single, 0, &prompt, &params);
        let held = decode
            .reserve_remote(RequestId(turn), prompt.clone(), params.clone(), 0)
            .unwrap()
            .cached;
        let known = prompt[..prompt.len() - 1].to_vec();
        prefill
            .add_prefill_only(RequestId(turn), known, held, None)
            .unwrap();
        prefill.run_to_completion().unwrap();
        let kv = prefill.export_kv(RequestId(turn)).unwrap();
        let sent = prompt.len() - 1 - held;
        assert_eq!(
            kv[0].len(),
            sent * per_token,
            "turn {turn}: only what is missing"
        );
        assert_eq!(held > 0, turn > 0, "turn {turn}: {held} tokens held");
        decode.admit_remote(RequestId(turn), &kv).unwrap();
        let got = decode
            .run_to_completion()
            .unwrap()
            .remove(&RequestId(turn))
            .unwrap();
        assert_eq!(got, want, "turn {turn}: bitwise the single engine's tokens");
        prompt.extend(&got);
        prompt.extend(user_turn(turn as u32, 11));
    }
    assert_eq!(decode.free_blocks(), decode.total_blocks());
}

#[test]
fn a_prefix_being_computed_is_waited_for_not_computed_twice() {
    let (model, tok) = load_model();
    let stops = tok.stop_ids().to_vec();
    let params = SamplingParams::greedy(6);
    let system = user_turn(42, 64);
    let prompts: Vec<Vec<u32>> = (0..3u32)
        .map(|k| system.iter().copied().chain(user_turn(k, 10)).collect())
        .collect();
    // Steps of 16 tokens: the shared 64 take four steps to compute.
    let chunked = EngineConfig {
        max_batch_tokens: 16,
        ..cold(true, 64)
    };
    let mut e = Engine::new(model.clone(), chunked, stops.clone()).unwrap();
    for (i, p) in prompts.iter().enumerate() {
        e.add(RequestId(i as u64), p.clone(), params.clone())
            .unwrap();
    }
    let got = e.run_to_completion().unwrap();
    assert_eq!(
        e.load().prefix_hit_tokens,
        2 * 64,
        "the later two found the prefix cached"
    );
    for (i, p) in prompts.iter().enumerate() {
        let mut off = Engine::new(model.clone(), cold(false, 64), stops.clone()).unwrap();
        assert_eq!(
            got[&RequestId(i as u64)],
            generate(&mut off, 0, p, &params),
            "request {i}"
        );
    }
}
