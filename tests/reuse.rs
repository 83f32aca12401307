//! KV reuse through real clusters on the real engine: a conversation moves only its new blocks
//! and matches the cold engine bit for bit; short uncached suffixes are prefilled on the decode
//! worker and counted by reason; a conversation stays on the decode worker that caches it.

use std::time::{Duration, Instant};

use engine::{Engine, EngineConfig, SamplingParams};
use serde_json::json;
use tandem_tests::cluster::{metric_at, post_json, Cluster};
use tandem_tests::load_model;

use router::core::PrefillDecision as Decision;

const EXE: &str = env!("CARGO_BIN_EXE_tandem");
const MODEL: &str = "SmolLM2-135M-Instruct.Q4_1";

#[test]
fn a_conversation_moves_only_new_blocks_and_matches_the_cold_engine_bitwise() {
    let c = Cluster::start(EXE.as_ref(), 1, 1);
    converse(&c, false);
    assert_eq!(peer_figure(&c, "prefill", "kv_peer_hits"), 0);
    let computed = peer_figure(&c, "prefill", "prompt_tokens")
        - peer_figure(&c, "prefill", "prefix_hit_tokens");
    eprintln!("without peer fetch the prefill computed {computed} prompt tokens");
}

/// Peer fetch (`[kv_transfer] peer_fetch`): each turn's prompt starts with what the decode
/// worker holds from the turn before (the prompt and its answer); the prefill worker fetches
/// those blocks from it instead of computing them — it computes only what neither holds.
#[test]
fn with_peer_fetch_the_prefill_worker_fetches_the_blocks_the_decode_worker_holds() {
    let c = Cluster::of(1, 1)
        .pools(["[prefill.kv_tiers]\nhost_bytes = 100_000_000\n", ""])
        .kv("peer_fetch = true")
        .start(EXE.as_ref());
    let fetched = converse(&c, true);
    let computed = peer_figure(&c, "prefill", "prompt_tokens")
        - peer_figure(&c, "prefill", "prefix_hit_tokens");
    let told = fetch_decisions(&c);
    eprintln!("{fetched} blocks fetched from the decode worker on {told} decisions to fetch; the prefill computed {computed} prompt tokens");
    assert!(fetched > 0 && told >= 1.0);
    assert_eq!(peer_figure(&c, "prefill", "kv_peer_hits"), fetched);
    assert_eq!(peer_figure(&c, "decode", "kv_peer_served"), fetched);
    assert_eq!(peer_figure(&c, "prefill", "kv_peer_fetch_failures"), 0);
    assert_eq!(peer_figure(&c, "prefill", "kv_tier_corrupt"), 0);
}

/// The router's decisions to have a prefill worker fetch from the decode worker (and probes).
fn fetch_decisions(c: &Cluster) -> f64 {
    let n = |d: &str| {
        metric_at(
            c.operator,
            &format!("tandem_router_peer_fetch_total{{decision=\"{d}\"}}"),
        )
    };
    n("fetch") + n("probe")
}

/// A worker's live figure `name`, summed over the `role` pool.
fn peer_figure(c: &Cluster, role: &str, name: &str) -> u64 {
    c.workers()
        .iter()
        .filter(|w| w["role"] == role)
        .map(|w| w["stats"][name].as_u64().unwrap_or(0))
        .sum()
}

/// Two 6-turn conversations (greedy, seeded) through `c`, each turn's text asserted against
/// the cold engine's and its path from counters: only the blocks the decode worker lacks are
/// sent; the prefill worker computes only what it lacks — with `peer`, only what neither it
/// nor the decode worker holds, the rest fetched. Returns the blocks fetched from the decode
/// worker.
fn converse(c: &Cluster, peer: bool) -> u64 {
    let (model, tok) = load_model();
    let per_token = (model.config.n_layers * 4 * model.config.kv_width()) as f64;
    let bs = 16;
    let greedy = SamplingParams::greedy(8);
    let seeded = SamplingParams {
        temperature: 0.8,
        top_k: 40,
        seed: 11,
        ..SamplingParams::greedy(8)
    };
    let (mut transfers, mut fetched_before) = (0, 0);
    for (conv, params) in [greedy, seeded].into_iter().enumerate() {
        let user = |k: usize| -> Vec<u32> {
            (0..20 + 3 * k as u32)
                .map(|i| 300 + (conv as u32 * 7 + k as u32 * 7919 + i * 104_729) % 40_000)
                .collect()
        };
        let mut prompt: Vec<u32> = Vec::new();
        let (mut decode_held, mut prefill_held) = (0usize, 0usize);
        for k in 0..6 {
            prompt.extend(user(k));
            let mut cold = EngineConfig::default();
            cold.prefix_cache = false;
            let mut e = Engine::new(model.clone(), cold, tok.stop_ids().to_vec()).unwrap();
            let params = SamplingParams {
                ignore_eos: true,
                ..params.clone()
            };
            e.add(engine::RequestId(0), prompt.clone(), params.clone())
                .unwrap();
            let want = e
                .run_to_completion()
                .unwrap()
                .remove(&engine::RequestId(0))
                .unwrap();
            let bytes0 = metric_at(
                c.operator,
                "tandem_kv_transfer_bytes_total{transport=\"tcp\"}",
            );
            let hits0 = prefill_hits(c);
            let fetches0 = fetch_decisions(c);
            let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 8, "ignore_eos": true,
                              "temperature": params.temperature, "top_k": params.top_k, "seed": params.seed});
            let (status, v) = post_json(c.http, "/v1/completions", &body);
            assert_eq!(status, 200, "{v}");
            assert_eq!(
                v["choices"][0]["text"],
                tok.decode(&want, true).unwrap(),
                "conv {conv} turn {k}"
            );
            transfers += 1;
            c.wait_transfers("tcp", transfers);
            let sent = metric_at(
                c.operator,
                "tandem_kv_transfer_bytes_total{transport=\"tcp\"}",
            ) - bytes0;
            let held = decode_held.min((prompt.len() - 2) / bs * bs);
            let want_sent = (prompt.len() - 1 - held) as f64 * per_token;
            assert_eq!(
                sent, want_sent,
                "conv {conv} turn {k}: only the blocks the decode worker lacks"
            );
            let hit = prefill_hits(c) - hits0;
            let findable = |held: usize| held.min((prompt.len() - 2) / bs * bs);
            let fetched = (findable(decode_held.max(prefill_held)) - findable(prefill_held)) / bs;
            let now_fetched = peer_figure(c, "prefill", "kv_peer_hits");
            let why = format!("conv {conv} turn {k}: the prefill computed only what it lacked");
            // The router has the prefill worker fetch while fetching measures cheaper than
            // computing (always, so far, on loopback): the path follows its decision.
            let told = fetch_decisions(c) - fetches0;
            assert!(
                told <= 1.0 && (peer || told == 0.0),
                "{why}: {told} decisions"
            );
            match peer && told == 1.0 {
                false => {
                    assert_eq!(hit, findable(prefill_held) as u64, "{why}");
                    assert_eq!(now_fetched, fetched_before, "{why}: nothing fetched");
                }
                true => {
                    let held = findable(decode_held.max(prefill_held)) as u64;
                    assert_eq!(hit, held, "{why}, or fetched");
                    assert_eq!(now_fetched - fetched_before, fetched as u64, "{why}");
                }
            }
            fetched_before = now_fetched;
            // What each worker holds for the next turn, in whole blocks: the decode worker the
            // prompt and the answer but its last token; the prefill worker the prompt less its
            // last token.
            prefill_held = (prompt.len() - 1) / bs * bs;
            prompt.extend(&want);
            decode_held = (prompt.len() - 1) / bs * bs;
        }
    }
    assert!(
        metric_at(
            c.operator,
            "tandem_router_prefill_decisions_total{decision=\"remote\"}"
        ) >= 12.0
    );
    c.wait_all_free(Duration::from_secs(5));
    fetched_before
}

/// The prefill worker's prefix-cache hits (prompt tokens not computed), asked live.
fn prefill_hits(c: &Cluster) -> u64 {
    c.workers()
        .iter()
        .filter(|w| w["role"] == "prefill")
        .map(|w| w["stats"]["prefix_hit_tokens"].as_u64().unwrap_or(0))
        .sum()
}

#[test]
fn short_uncached_suffixes_are_prefilled_on_the_decode_worker_and_counted_by_reason() {
    let (model, tok) = load_model();
    let mut c = Cluster::of(1, 1)
        .router("local_prefill_max_tokens = 40")
        .start(EXE.as_ref());
    let cold = |prompt: &[u32]| {
        let mut cfg = EngineConfig::default();
        cfg.prefix_cache = false;
        let mut e = Engine::new(model.clone(), cfg, tok.stop_ids().to_vec()).unwrap();
        let params = SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(8)
        };
        e.add(engine::RequestId(0), prompt.to_vec(), params)
            .unwrap();
        e.run_to_completion()
            .unwrap()
            .remove(&engine::RequestId(0))
            .unwrap()
    };
    let http = c.http;
    let ask = |prompt: &[u32]| {
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 8, "ignore_eos": true, "temperature": 0});
        let (status, v) = post_json(http, "/v1/completions", &body);
        assert_eq!(status, 200, "{v}");
        v["choices"][0]["text"].as_str().unwrap().to_string()
    };
    let decisions = |c: &Cluster, d: Decision| {
        let d = d.label();
        metric_at(
            c.operator,
            &format!("tandem_router_prefill_decisions_total{{decision=\"{d}\"}}"),
        )
    };
    let transfers = |c: &Cluster| -> u64 {
        let ws = c.workers();
        ws.iter()
            .map(|w| w["kv_transfers"]["tcp"].as_u64().unwrap_or(0))
            .sum()
    };
    // 99 tokens to compute: the prefill pool does it.
    let mut prompt: Vec<u32> = (0..100).map(|i| 300 + i * 389 % 40_000).collect();
    let answer = cold(&prompt);
    assert_eq!(ask(&prompt), tok.decode(&answer, true).unwrap());
    c.wait_transfers("tcp", 1);
    assert_eq!(decisions(&c, Decision::Remote), 1.0);
    // The next turn: the decode worker holds 96 tokens; 21 are left, under 40: computed there.
    prompt.extend(&answer);
    prompt.extend((0..10).map(|i| 5_000 + i));
    let answer = cold(&prompt);
    assert_eq!(ask(&prompt), tok.decode(&answer, true).unwrap());
    assert_eq!(decisions(&c, Decision::LocalShortSuffix), 1.0);
    assert_eq!(transfers(&c), 1, "no KV moved for it");
    // Without a prefill worker the decode worker prefills, and says why.
    c.kill_worker("prefill-0");
    let t0 = Instant::now();
    while c.workers().iter().any(|w| w["role"] == "prefill") {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the prefill worker is dropped"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let other: Vec<u32> = (0..50).map(|i| 7_000 + i).collect();
    assert_eq!(ask(&other), tok.decode(&cold(&other), true).unwrap());
    assert_eq!(decisions(&c, Decision::LocalNoPrefillWorker), 1.0);
    c.wait_all_free(Duration::from_secs(5));
}

#[test]
fn a_conversation_stays_on_the_decode_worker_that_caches_it() {
    let c = Cluster::start(EXE.as_ref(), 0, 2);
    let mut prompt: Vec<u32> = (0..60).map(|i| 2_000 + i * 13).collect();
    let stats = |c: &Cluster, key: &str| -> Vec<u64> {
        let ws = c.workers();
        ws.iter()
            .map(|w| w["stats"][key].as_u64().unwrap_or(0))
            .collect()
    };
    for turn in 0..4 {
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 8, "ignore_eos": true, "temperature": 0});
        let (status, v) = post_json(c.http, "/v1/completions", &body);
        assert_eq!(status, 200, "{v}");
        // The next turn is routed by what the workers' heartbeats have told the index: wait
        // until it holds at least this prompt's full blocks (16 tokens each). The workers'
        // own counts come by the same heartbeats, so they cannot tell whether one has arrived.
        let full_blocks = prompt.len() as u64 / 16;
        let t0 = Instant::now();
        while (metric_at(c.operator, "tandem_router_kv_index_blocks") as u64) < full_blocks {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "turn {turn}: the index hears of the blocks"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        prompt.extend((0..20).map(|i| 9_000 + turn * 100 + i));
    }
    let hits = stats(&c, "prefix_hit_tokens");
    let prompts = stats(&c, "prompt_tokens");
    assert!(
        hits.iter().filter(|&&h| h > 0).count() == 1,
        "one worker reused the conversation: {hits:?}"
    );
    let (busy, idle) = if prompts[0] > prompts[1] {
        (0, 1)
    } else {
        (1, 0)
    };
    assert_eq!(
        prompts[idle], 0,
        "every turn went to the same worker: {prompts:?}"
    );
    assert!(
        hits[busy] >= 3 * 64,
        "turns 1..3 each found the earlier turns cached: {hits:?}"
    );
    c.wait_all_free(Duration::from_secs(5));
}

/// Prompt tokens served from a worker's prefix cache, over every worker.
fn hits(c: &Cluster) -> u64 {
    c.workers()
        .iter()
        .map(|w| w["stats"]["prefix_hit_tokens"].as_u64().unwrap_or(0))
        .sum()
}

#[test]
fn tenants_with_different_cache_salts_never_share_a_cached_block() {
    let c = Cluster::start(EXE.as_ref(), 0, 1);
    let prompt: Vec<u32> = (0..80).map(|i| 500 + i * 37).collect();
    let ask = |salt: Option<&str>| {
        let mut body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0});
        if let Some(s) = salt {
            body["cache_salt"] = json!(s);
        }
        let before = hits(&c);
        let (status, v) = post_json(c.http, "/v1/completions", &body);
        assert_eq!(status, 200, "{v}");
        hits(&c) - before
    };
    assert_eq!(ask(Some("tenant-a")), 0, "a cold cache");
    assert!(
        ask(Some("tenant-a")) >= 64,
        "the same tenant hits its own blocks"
    );
    assert_eq!(
        ask(Some("tenant-b")),
        0,
        "another tenant's salt shares nothing"
    );
    assert_eq!(ask(None), 0, "nor does a request without a salt");
    assert!(ask(Some("tenant-b")) >= 64, "tenant b hits its own blocks");
    let (status, v) = post_json(
        c.http,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "hi", "cache_salt": ""}),
    );
    assert_eq!(status, 400, "{v}");
}
