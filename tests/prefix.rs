//! The prefix cache and cache-aware routing through real clusters of mock-engine workers (real
//! processes, real KV blocks and transfers; a timing model instead of kernels, so four workers
//! add capacity on a 2-core machine): a hot system prompt is spread over the workers and
//! computed once on each (issue 12, acceptance 4), and caches overfilled for minutes end with
//! every block free or cached, the ledger balanced, nothing refused and the router's index
//! equal to what the workers cache (acceptance 7).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tandem_tests::cluster::{metric_at as metric, post_json, Cluster};

const EXE: &str = env!("CARGO_BIN_EXE_tandem");
const MODEL: &str = "SmolLM2-135M-Instruct.Q4_1";

/// A completion of `prompt` (token ids), `max_tokens` long whatever is sampled.
fn complete(http: SocketAddr, prompt: &[u32], max_tokens: usize) -> Value {
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                      "ignore_eos": true, "temperature": 0});
    let (status, v) = post_json(http, "/v1/completions", &body);
    assert_eq!(status, 200, "{v}");
    v
}

/// Each worker's live stat `key`, in the order of `/debug/workers`.
fn stat(c: &Cluster, key: &str) -> Vec<u64> {
    let ws = c.workers();
    ws.iter()
        .map(|w| w["stats"][key].as_u64().unwrap_or(0))
        .collect()
}

const SYSTEM: usize = 2000;
const QUESTION: usize = 64;

#[test]
fn a_hot_system_prompt_is_spread_over_the_workers_and_computed_once_on_each() {
    let toml = r#"
[router]
listen = "127.0.0.1:0"
control = "127.0.0.1:0"
operator = "127.0.0.1:0"
policy = "kv"

[decode]
threads = 1
kv_blocks = 2048
max_batch_tokens = 512
engine = "mock"
[decode.mock]
preset = "h200-llama8b"
"#;
    let c = Cluster::of(0, 4).toml(toml).start(EXE.as_ref());
    let system: Vec<u32> = (0..SYSTEM as u32).map(|i| 1_000 + i * 7 % 30_000).collect();
    let ask = |n: u32| {
        let mut prompt = system.clone();
        prompt.extend((0..QUESTION as u32).map(|i| 31_000 + (n * 97 + i * 13) % 9_000));
        prompt
    };
    // The first request puts the prefix in one worker's cache, and the router's index learns
    // of it: from then on that worker is the cache-aware choice for every other request.
    let http = c.http;
    complete(http, &ask(0), 32);
    let t0 = Instant::now();
    while metric(c.operator, "tandem_router_kv_index_blocks") < (SYSTEM / 16) as f64 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the index hears of the prefix"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // 199 more, one every 5 ms, each its own question after the shared 2,000 tokens; each
    // answer is 32 decode steps (at least ~150 ms here), so dozens run at once.
    let t0 = Instant::now();
    let threads: Vec<_> = (1..200u32)
        .map(|n| {
            let prompt = ask(n);
            std::thread::spawn(move || {
                let due = t0 + Duration::from_millis(5 * n as u64);
                std::thread::sleep(due.saturating_duration_since(Instant::now()));
                complete(http, &prompt, 32);
            })
        })
        .collect();
    threads.into_iter().for_each(|t| t.join().unwrap());
    let prompt = (SYSTEM + QUESTION) as u64;
    let (prompts, hits) = (stat(&c, "prompt_tokens"), stat(&c, "prefix_hit_tokens"));
    let taken: Vec<u64> = prompts.iter().map(|p| p / prompt).collect();
    eprintln!("requests per worker {taken:?}; prompt tokens {prompts:?}, cache hits {hits:?}");
    assert_eq!(taken.iter().sum::<u64>(), 200, "{prompts:?}");
    for (w, (&p, &h)) in prompts.iter().zip(&hits).enumerate() {
        assert_eq!(p % prompt, 0, "worker {w} admitted whole prompts only");
        assert!(taken[w] <= 80, "worker {w} took more than 40%: {taken:?}");
        // Beyond each request's own question, what the worker computed is the shared prefix:
        // at most once.
        let again = (p - h) - taken[w] * QUESTION as u64;
        assert!(
            again <= SYSTEM as u64,
            "worker {w} computed {again} tokens of the shared prefix: {taken:?} {hits:?}"
        );
    }
    c.wait_all_free(Duration::from_secs(10));
}

/// A small deterministic random source (xorshift64*), one per soak client.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }

    fn tokens(&mut self, n: u64) -> Vec<u32> {
        (0..n).map(|_| 100 + self.below(40_000) as u32).collect()
    }
}

/// Soak clients, each with requests in flight one at a time (so the KV held at once is
/// bounded: see the test).
const CLIENTS: u64 = 8;
/// Longest soak prompt; answers are `ANSWER` tokens.
const LONGEST: usize = 600;
const ANSWER: usize = 16;

/// One soak client until `until`: conversations of its own (each turn the whole conversation so
/// far plus a new message; one that would pass `LONGEST` tokens starts again on one of four
/// system prompts every client shares) and, one request in four, a prompt nobody repeats.
/// Returns how many requests it made.
fn soak_client(http: SocketAddr, k: u64, until: Instant) -> u64 {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (k + 1));
    let systems: Vec<Vec<u32>> = (0..4).map(|s| Rng(s + 77).tokens(100)).collect();
    let mut convs: Vec<Vec<u32>> = vec![Vec::new(); 6];
    let mut n = 0;
    while Instant::now() < until {
        n += 1;
        if rng.below(4) == 0 {
            let len = 100 + rng.below(400);
            complete(http, &rng.tokens(len), ANSWER);
            continue;
        }
        let c = rng.below(6) as usize;
        let len = 20 + rng.below(60) as usize;
        if convs[c].is_empty() || convs[c].len() + len + ANSWER > LONGEST {
            convs[c] = systems[rng.below(4) as usize].clone();
        }
        let message = rng.tokens(len as u64);
        convs[c].extend(message);
        complete(http, &convs[c], ANSWER);
        // The answer, as the next turn's tokens of its own (what the mock samples is arbitrary
        // text): the turn is a prefix of the next.
        let answer = rng.tokens(ANSWER as u64);
        convs[c].extend(answer);
    }
    n
}

#[test]
fn caches_overfilled_for_minutes_end_balanced_with_nothing_refused() {
    let secs: u64 = std::env::var("TANDEM_SOAK_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    // Every worker has 768 blocks. Held at once, at most: 8 requests in flight (one per
    // client), each at most 616 tokens = 39 blocks, twice over (a prefill worker frees a
    // request's blocks as the router hears back, a decode worker as the last token leaves):
    // 624 blocks. So a refusal could only come from cached blocks not being evicted, while
    // the clients' distinct prefixes need many times 768 blocks.
    let toml = r#"
[router]
listen = "127.0.0.1:0"
control = "127.0.0.1:0"
operator = "127.0.0.1:0"
policy = "kv"

[prefill]
threads = 1
kv_blocks = 768
max_batch_tokens = 1024
engine = "mock"
[prefill.mock]
preset = "h200-llama8b"

[decode]
threads = 1
kv_blocks = 768
max_batch_tokens = 1024
engine = "mock"
[decode.mock]
preset = "h200-llama8b"

[kv_transfer]
prefer = ["tcp"]
"#;
    let c = Cluster::of(1, 2).toml(toml).start(EXE.as_ref());
    let until = Instant::now() + Duration::from_secs(secs);
    let http = c.http;
    let clients: Vec<_> = (0..CLIENTS)
        .map(|k| std::thread::spawn(move || soak_client(http, k, until)))
        .collect();
    let requests: u64 = clients.into_iter().map(|t| t.join().unwrap()).sum();
    c.wait_all_free(Duration::from_secs(10));
    let (total, evicted) = (stat(&c, "kv_blocks_total"), stat(&c, "kv_blocks_evicted"));
    eprintln!(
        "{requests} requests in {secs} s; blocks evicted per worker {evicted:?} of {total:?}; \
         prefix hits {:?} of {:?} prompt tokens",
        stat(&c, "prefix_hit_tokens"),
        stat(&c, "prompt_tokens")
    );
    for (w, (&t, &e)) in total.iter().zip(&evicted).enumerate() {
        assert!(
            e >= 2 * t,
            "worker {w}'s cache was overfilled: {e} of {t} blocks evicted ({requests} requests)"
        );
    }
    assert_eq!(stat(&c, "kv_refusals"), [0, 0, 0], "nothing refused");
    assert!(stat(&c, "prefix_hit_tokens").iter().sum::<u64>() > 0);
    assert_eq!(
        metric(
            c.operator,
            "tandem_router_request_phases_total{phase=\"recomputing\"}"
        ),
        0.0,
        "every transfer went through"
    );
    assert_eq!(
        metric(
            c.operator,
            "tandem_router_request_phases_total{phase=\"done\"}"
        ) as u64,
        requests
    );
    index_matches_the_caches(&c);
}

/// The router's KV index holds exactly the blocks the workers cache (once their heartbeats
/// have caught up): evicted blocks left it.
fn index_matches_the_caches(c: &Cluster) {
    let t0 = Instant::now();
    loop {
        let cached: u64 = stat(c, "kv_blocks_cached").iter().sum();
        let indexed = metric(c.operator, "tandem_router_kv_index_blocks") as u64;
        if indexed == cached {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the index holds {indexed} blocks, the workers cache {cached}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
