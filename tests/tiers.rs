//! KV tiers through a real cluster on the real engine: a decode worker's prefix evicted to its
//! disk tier outlives a `kill -9`; started again on the same directory, the worker reports the
//! blocks, the router indexes them, and the next turn loads them instead of computing them —
//! the same tokens as before.

use std::time::Duration;

use serde_json::{json, Value};
use tandem_tests::cluster::{metric_at, post_json, Cluster};
use tandem_tests::store::StoreNode;
use tandem_tests::wait_until;

const EXE: &str = env!("CARGO_BIN_EXE_tandem");
const MODEL: &str = "SmolLM2-135M-Instruct.Q4_1";
const BS: usize = 16;

/// Worker `name`'s live stat `key` (0 while it has not joined).
fn stat(c: &Cluster, name: &str, key: &str) -> u64 {
    c.workers()
        .iter()
        .find(|w| w["name"] == name)
        .map_or(0, |w| w["stats"][key].as_u64().unwrap_or(0))
}

/// A prompt of `blocks` whole blocks and one token more, distinct per `seed`.
fn prompt(seed: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks * BS + 1) as u32)
        .map(|i| 300 + (seed * 7919 + i * 104_729) % 40_000)
        .collect()
}

/// The completion's text of a greedy request for `prompt`.
fn complete(c: &Cluster, prompt: &[u32]) -> String {
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 6, "ignore_eos": true,
                      "temperature": 0});
    let (status, v): (u16, Value) = post_json(c.http, "/v1/completions", &body);
    assert_eq!(status, 200, "{v}");
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

#[test]
fn a_prefix_on_disk_outlives_kill_9_and_serves_hits_after_the_restart() {
    // One colocated decode worker whose pool holds about three prompts' blocks; no host tier,
    // so every evicted cached block goes straight to disk.
    let tiers = "[decode.kv_tiers]\ndisk_path = \"g3\"\ndisk_bytes = 200_000_000\n";
    let mut c = Cluster::of(0, 1)
        .decode_blocks(24)
        .pools(["", tiers])
        .start(EXE.as_ref());
    let worker = "decode-0";
    let first = prompt(1, 6);
    let before = complete(&c, &first);
    // Other prompts push the first one's blocks out of the pool and onto disk.
    for seed in 2..8 {
        complete(&c, &prompt(seed, 6));
    }
    wait_until(
        "the first prompt's blocks on disk",
        Duration::from_secs(20),
        || stat(&c, worker, "kv_disk_blocks") >= 6,
    );
    let on_disk = stat(&c, worker, "kv_disk_blocks");
    assert_eq!(stat(&c, worker, "kv_disk_hits"), 0);

    c.kill_worker(worker);
    // The router drops the dead worker (and its index entries) before it comes back.
    c.wait_for(0, 0);
    assert_eq!(metric_at(c.operator, "tandem_router_kv_index_blocks"), 0.0);
    let config = c.config_file().to_path_buf();
    c.add_worker("decode", worker, &config);
    c.wait_for(0, 1);
    assert_eq!(
        stat(&c, worker, "kv_disk_blocks"),
        on_disk,
        "the restarted worker re-read every block file"
    );
    let disk = "tandem_router_kv_index_tier_blocks{tier=\"disk\"}";
    wait_until(
        "the disk blocks in the router's index",
        Duration::from_secs(10),
        || metric_at(c.operator, disk) as u64 == on_disk,
    );

    let (prompt0, hit0) = (
        stat(&c, worker, "prompt_tokens"),
        stat(&c, worker, "prefix_hit_tokens"),
    );
    assert_eq!(
        complete(&c, &first),
        before,
        "tokens from loaded KV as from computed"
    );
    assert_eq!(
        stat(&c, worker, "prompt_tokens") - prompt0,
        first.len() as u64
    );
    assert_eq!(
        stat(&c, worker, "prefix_hit_tokens") - hit0,
        (6 * BS) as u64,
        "every whole block of the prompt came from disk, none was computed"
    );
    assert_eq!(stat(&c, worker, "kv_disk_hits"), 6);
    assert_eq!(stat(&c, worker, "kv_tier_corrupt"), 0);
}

/// Decode memory pressure through a real cluster: streams whose KV outgrows the decode
/// worker's pool (`admission = "optimistic"`) are preempted and wait there for room for longer
/// than the router's stall timeout. The worker tells the router each preemption, so the router
/// neither takes the worker for wedged nor moves a request off it (before, it did both, and
/// with no other decode worker the moved requests failed after the admission wait). Every
/// stream ends with the tokens it has alone — its KV swapped to the host tier and loaded back,
/// or, in a pool without one, computed again.
#[test]
fn preempted_streams_wait_for_room_without_being_taken_for_stalled() {
    let host = "[decode.kv_tiers]\nhost_bytes = 100_000_000\n";
    for (tiers, kind) in [(host, "preempted_swapped"), ("", "preempted_recomputed")] {
        let decode = format!("admission = \"optimistic\"\n{tiers}");
        let c = Cluster::of(1, 1)
            .decode_blocks(24)
            .pools(["", &decode])
            .router("stall_timeout_ms = 1500")
            .start(EXE.as_ref());
        // Each grows to 19 pages (33 + 256 tokens); the pool holds 24: one runs, the others
        // wait there (seconds, on this model) once preempted.
        let prompts: Vec<Vec<u32>> = (1..=3).map(|seed| prompt(seed, 2)).collect();
        let generate = |p: &Vec<u32>| {
            let body = json!({"model": MODEL, "prompt": p, "max_tokens": 256,
                              "ignore_eos": true, "temperature": 0});
            let (status, v): (u16, Value) = post_json(c.http, "/v1/completions", &body);
            assert_eq!(status, 200, "{v}");
            v["choices"][0]["text"].as_str().unwrap().to_string()
        };
        let alone: Vec<String> = prompts.iter().map(generate).collect();
        assert_eq!(
            stat(&c, "decode-0", kind),
            0,
            "one at a time: room for each"
        );
        let together: Vec<String> = std::thread::scope(|s| {
            let hs: Vec<_> = prompts.iter().map(|p| s.spawn(|| generate(p))).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(together, alone, "{kind}: every stream's tokens as alone");
        wait_until("the preemptions reported", Duration::from_secs(10), || {
            stat(&c, "decode-0", kind) > 0
        });
        let migrations = metric_at(c.operator, "tandem_router_migrations_total");
        assert_eq!(
            migrations, 0.0,
            "{kind}: nothing moved off a worker that was stepping"
        );
    }
}

/// Store nodes (started first, on a CA they share with the cluster) and a cluster of
/// `prefill` + `decode` workers using them, each with the host tier that fetched blocks are
/// staged in; the scratch directory is removed when dropped.
struct WithStore {
    c: Cluster,
    node: StoreNode,
    /// Nodes beyond the first ([`with_store_nodes`]).
    more: Vec<StoreNode>,
    scratch: std::path::PathBuf,
}

impl Drop for WithStore {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.scratch);
    }
}

fn with_store(name: &str, prefill: usize, decode: usize) -> WithStore {
    with_store_nodes(name, prefill, decode, 1)
}

/// [`with_store`] with `nodes` store nodes, each block on two of them.
fn with_store_nodes(name: &str, prefill: usize, decode: usize, nodes: usize) -> WithStore {
    with_store_env(name, (prefill, decode), nodes, &[])
}

/// [`with_store_nodes`], the nodes started with more environment (fault injection).
fn with_store_env(
    name: &str,
    (prefill, decode): (usize, usize),
    nodes: usize,
    env: &[(&str, &str)],
) -> WithStore {
    let scratch = std::env::temp_dir().join(format!("tandem-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).unwrap();
    let security = format!("[security]\ndir = {:?}\n", scratch.join("pki"));
    let store = format!("[decode]\n{security}[store]\ncapacity_bytes = 1_000_000_000\n");
    std::fs::write(scratch.join("store.toml"), store).unwrap();
    let (mut started, mut at) = (Vec::new(), Vec::new());
    for _ in 0..nodes {
        let (node, uri) = StoreNode::start_with(EXE.as_ref(), &scratch.join("store.toml"), env);
        started.push(node);
        at.push(uri);
    }
    let host = |pool: &str| format!("[{pool}.kv_tiers]\nhost_bytes = 100_000_000\n");
    let decode_lines = format!(
        "{}\n[store]\nnodes = {at:?}\nreplicas = 2\n\n{security}",
        host("decode")
    );
    let prefill_lines = host("prefill");
    let c = Cluster::of(prefill, decode)
        .pools([&prefill_lines, &decode_lines])
        .start(EXE.as_ref());
    let node = started.remove(0);
    WithStore {
        c,
        node,
        more: started,
        scratch,
    }
}

/// Blocks worker `name` put in the store.
fn puts(c: &Cluster, name: &str) -> u64 {
    stat(c, name, "kv_store_puts")
}

/// Completes `prompt` (6 whole blocks) on one of two colocated decode workers and waits for its
/// blocks in the store; returns the text, the worker that served it and the other.
fn put_by_one(c: &Cluster, prompt: &[u32]) -> (String, &'static str, &'static str) {
    let text = complete(c, prompt);
    wait_until(
        "the prompt's blocks in the store",
        Duration::from_secs(20),
        || puts(c, "decode-0") + puts(c, "decode-1") >= 6,
    );
    match puts(c, "decode-0") >= 6 {
        true => (text, "decode-0", "decode-1"),
        false => (text, "decode-1", "decode-0"),
    }
}

/// The cluster KV store through a real cluster: a prompt computed on one decode worker is put
/// in the store; that worker killed, the other serves the same prompt from the store's blocks
/// (fetched, staged in its host tier, loaded into its pool), computing only the rest — the
/// same text, asserted from both workers' store counters and the prefix hits; the router's
/// KV index follows the store's blocks.
#[test]
fn a_prefix_computed_by_a_worker_killed_since_serves_another_through_the_store() {
    let mut s = with_store("store-colocated", 0, 2);
    let c = &mut s.c;
    let first = prompt(11, 6);
    let (text, served, other) = put_by_one(c, &first);
    assert_eq!(
        puts(c, served),
        6,
        "the prompt's 6 whole blocks, each put once"
    );
    // The router follows the store's holdings in its KV index.
    let indexed = "tandem_router_kv_index_tier_blocks{tier=\"store\"}";
    wait_until(
        "the store's blocks in the router's index",
        Duration::from_secs(10),
        || metric_at(c.operator, indexed) == 6.0,
    );
    let hits_before = stat(c, other, "prefix_hit_tokens");
    c.kill_worker(served);
    c.wait_for(0, 1);
    assert_eq!(
        complete(c, &first),
        text,
        "the same text from the store's blocks"
    );
    assert_eq!(stat(c, other, "kv_store_hits"), 6, "fetched from the store");
    assert_eq!(
        stat(c, other, "kv_host_hits"),
        6,
        "staged in G2 and loaded from there"
    );
    let found = stat(c, other, "prefix_hit_tokens") - hits_before;
    assert_eq!(
        found,
        6 * BS as u64,
        "only the prompt's last token computed"
    );
    assert_eq!(stat(c, other, "kv_tier_corrupt"), 0);
    // The store's own counters say the same.
    let store = |m: &str| metric_at(s.node.metrics, m);
    wait_until("the store's gauges", Duration::from_secs(5), || {
        store("tandem_store_hits") == 6.0
    });
    assert_eq!(store("tandem_store_objects"), 6.0);
    assert_eq!(store("tandem_store_puts"), 6.0);
}

/// A store node that corrupts what it sends (fault injection): the worker fetching a prompt's
/// blocks finds every one by its checksum, drops it (counted) and computes the prompt itself —
/// the same text, nothing taken from the store.
#[test]
fn a_corrupted_block_from_the_store_is_found_and_computed_instead() {
    let env = [("TANDEM_FAULT_STORE_CORRUPT_GETS", "1")];
    let mut s = with_store_env("store-corrupt", (0, 2), 1, &env);
    let c = &mut s.c;
    let first = prompt(12, 6);
    let (text, served, other) = put_by_one(c, &first);
    let hits_before = stat(c, other, "prefix_hit_tokens");
    c.kill_worker(served);
    c.wait_for(0, 1);
    assert_eq!(complete(c, &first), text, "the same text, computed");
    assert_eq!(stat(c, other, "kv_store_hits"), 6, "the 6 blocks fetched");
    assert_eq!(
        stat(c, other, "kv_tier_corrupt"),
        6,
        "each found corrupt by its checksum"
    );
    assert_eq!(stat(c, other, "kv_host_hits"), 0, "none loaded");
    assert_eq!(
        stat(c, other, "prefix_hit_tokens"),
        hits_before,
        "the whole prompt computed"
    );
}

/// Disaggregated, every worker that computed a prompt gone: a new prefill worker and the other
/// decode worker both take its blocks from the store — the decode worker's reservation counts
/// them as cached, the prefill worker loads them and computes only the rest — each block put
/// once in the whole cluster.
#[test]
fn a_new_prefill_worker_and_another_decode_worker_take_a_prefix_from_the_store() {
    let mut s = with_store("store-disaggregated", 1, 2);
    let c = &mut s.c;
    let first = prompt(12, 6);
    let text = complete(c, &first);
    let all = ["prefill-0", "decode-0", "decode-1"];
    wait_until(
        "the prompt's blocks in the store",
        Duration::from_secs(20),
        || all.iter().map(|w| puts(c, w)).sum::<u64>() >= 6,
    );
    assert_eq!(
        all.iter().map(|w| puts(c, w)).sum::<u64>(),
        6,
        "each block put once"
    );
    let served = match stat(c, "decode-0", "engine_steps") > 0 {
        true => "decode-0",
        false => "decode-1",
    };
    let other = if served == "decode-0" {
        "decode-1"
    } else {
        "decode-0"
    };
    c.kill_worker(served);
    c.kill_worker("prefill-0");
    let config = c.config_file().to_path_buf();
    c.add_worker("prefill", "prefill-1", &config);
    c.wait_for(1, 1);
    assert_eq!(
        complete(c, &first),
        text,
        "the same text from the store's blocks"
    );
    // The decode worker fetched the prompt's 6 whole blocks; its reservation holds all but
    // the prompt's last two tokens — 5 blocks, loaded from where they were staged — and the
    // prefill worker sends the tokens after them.
    assert_eq!(stat(c, other, "kv_store_hits"), 6);
    assert_eq!(stat(c, other, "kv_host_hits"), 5);
    // The prefill worker is sent all but the last token (96: 6 whole blocks) and computes at
    // least its last one, so it looks up — and fetches — the first 5 blocks and computes the
    // sixth (as it would from its own pool).
    let p = "prefill-1";
    assert_eq!(
        (stat(c, p, "kv_store_hits"), stat(c, p, "kv_host_hits")),
        (5, 5)
    );
    assert_eq!(stat(c, p, "prompt_tokens"), (6 * BS) as u64);
    assert_eq!(stat(c, p, "prefix_hit_tokens"), 5 * BS as u64);
}

/// A store node frozen (`SIGSTOP`), then killed: no request fails or hangs — a worker's fetch
/// gives up at its timeout, the prompt is computed instead (the same text), the failure is
/// counted, and the worker leaves the store alone for a while (the next request pays no
/// timeout); the router's index forgets the store's blocks once its watch's pings go
/// unanswered, and once the node is dead.
#[test]
fn a_frozen_or_killed_store_fails_no_request() {
    let mut s = with_store("store-faults", 0, 1);
    let w = "decode-0";
    let first = prompt(13, 6);
    let text = complete(&s.c, &first);
    wait_until("the blocks in the store", Duration::from_secs(20), || {
        puts(&s.c, w) >= 6
    });
    s.node.signal(libc::SIGSTOP);
    // Another prompt: the worker lacks its blocks, asks the frozen store, gives up.
    let t0 = std::time::Instant::now();
    let other = prompt(14, 6);
    let other_text = complete(&s.c, &other);
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "the fetch timed out, not the request"
    );
    assert_eq!(stat(&s.c, w, "kv_store_fetch_failures"), 1);
    // Resting from the store: a new prompt within the rest (2 s from the failure, which came
    // no sooner than the fetch timeout after t0) does not ask it at all.
    complete(&s.c, &prompt(15, 6));
    if t0.elapsed() < Duration::from_millis(2500) {
        assert_eq!(stat(&s.c, w, "kv_store_fetch_failures"), 1, "left alone");
    }
    // The router's watch pings the frozen node, gets no answer, and forgets its blocks.
    let indexed = "tandem_router_kv_index_tier_blocks{tier=\"store\"}";
    wait_until(
        "the router forgets the frozen store's blocks",
        Duration::from_secs(15),
        || metric_at(s.c.operator, indexed) == 0.0,
    );
    s.node.signal(libc::SIGCONT);
    s.node.kill();
    wait_until(
        "the router forgets the dead store's blocks",
        Duration::from_secs(10),
        || metric_at(s.c.operator, indexed) == 0.0,
    );
    // Once its rest is over, a new prompt asks the dead store, fails at once, and is computed.
    // (One more failure than before: the third prompt asked the frozen store too if it came
    // after the rest.)
    let failed = stat(&s.c, w, "kv_store_fetch_failures");
    let mut k = 16;
    wait_until(
        "a fetch from the dead store fails",
        Duration::from_secs(20),
        || {
            k += 1;
            assert!(!complete(&s.c, &prompt(k, 6)).is_empty());
            stat(&s.c, w, "kv_store_fetch_failures") == failed + 1
        },
    );
    assert_eq!(complete(&s.c, &first), text, "the same text, computed");
    assert_eq!(complete(&s.c, &other), other_text);
    assert_eq!(stat(&s.c, w, "kv_tier_corrupt"), 0);
}

/// Two store nodes, each block on both (`replicas = 2`): a prompt's blocks are put on each;
/// one node killed, the other decode worker still takes every block from the survivor —
/// the same text, the prompt computed only past its blocks — and the router's index keeps
/// them, the survivor still holding them; the status page shows each node's figures, and the
/// killed one down.
#[test]
fn with_two_replicas_a_killed_store_node_loses_no_block() {
    let mut s = with_store_nodes("store-replicas", 0, 2, 2);
    let c = &mut s.c;
    let first = prompt(21, 6);
    let text = complete(c, &first);
    wait_until(
        "the prompt's blocks on both nodes",
        Duration::from_secs(20),
        || puts(c, "decode-0") + puts(c, "decode-1") >= 12,
    );
    let (served, other) = match puts(c, "decode-0") >= 12 {
        true => ("decode-0", "decode-1"),
        false => ("decode-1", "decode-0"),
    };
    assert_eq!(puts(c, served), 12, "6 blocks, a copy on each node");
    let objects = |n: &StoreNode| metric_at(n.metrics, "tandem_store_objects");
    wait_until("each node's gauge", Duration::from_secs(5), || {
        (objects(&s.node), objects(&s.more[0])) == (6.0, 6.0)
    });
    let indexed = "tandem_router_kv_index_tier_blocks{tier=\"store\"}";
    wait_until("both nodes followed", Duration::from_secs(10), || {
        metric_at(c.operator, indexed) == 6.0
    });
    // The status page has each node's own figures, as the router last asked them.
    let nodes = || {
        let (_, body) = tandem_tests::cluster::get(c.operator, "/status.json").unwrap();
        let v: Value = serde_json::from_str(&body).unwrap();
        v["store_nodes"].as_array().cloned().unwrap_or_default()
    };
    wait_until("both nodes' figures", Duration::from_secs(10), || {
        let ns = nodes();
        ns.len() == 2
            && ns
                .iter()
                .all(|n| n["up"] == true && n["load"]["objects"] == 6)
    });
    s.node.kill();
    wait_until(
        "the killed node shown down",
        Duration::from_secs(10),
        || nodes().iter().filter(|n| n["up"] == false).count() == 1,
    );
    c.kill_worker(served);
    c.wait_for(0, 1);
    let hits_before = stat(c, other, "prefix_hit_tokens");
    assert_eq!(complete(c, &first), text, "the same text from the survivor");
    assert_eq!(stat(c, other, "kv_store_hits"), 6, "every block fetched");
    let found = stat(c, other, "prefix_hit_tokens") - hits_before;
    assert_eq!(found, 6 * BS as u64, "only the last token computed");
    assert_eq!(objects(&s.more[0]), 6.0, "the survivor holds them all");
    assert_eq!(metric_at(c.operator, indexed), 6.0, "the index keeps them");
}

/// `tandem up` on a file whose pools have host tiers embeds a store node: it says so, starts
/// the node before the router, points every worker and the router at it — the workers put the
/// blocks they compute, the router's index follows them — and Ctrl-C stops it with the rest.
#[test]
fn tandem_up_embeds_a_store_node_its_workers_and_router_use() {
    let dir = std::env::temp_dir().join(format!("tandem-up-store-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let host = |pool: &str| format!("[{pool}.kv_tiers]\nhost_bytes = 100_000_000\n");
    let cfg = Cluster::of(1, 1)
        .pools([&host("prefill"), &host("decode")])
        .write(&dir);
    let (mut up, printed) = tandem_tests::cluster::tandem_up(EXE.as_ref(), &cfg);
    assert!(
        printed.contains("cluster KV store: one node of its own"),
        "{printed}"
    );
    let addr = |after: &str, until: char| -> std::net::SocketAddr {
        let rest = printed
            .split(after)
            .nth(1)
            .unwrap_or_else(|| panic!("{printed}"));
        rest.split(until).next().unwrap().parse().unwrap()
    };
    let (http, operator) = (
        addr("behind http://", '\n'),
        addr("status page: http://", '/'),
    );
    let body = json!({"model": MODEL, "prompt": prompt(17, 6), "max_tokens": 4,
                      "temperature": 0});
    let (status, v): (u16, Value) = post_json(http, "/v1/completions", &body);
    assert_eq!(status, 200, "{v}");
    let indexed = "tandem_router_kv_index_tier_blocks{tier=\"store\"}";
    wait_until(
        "the prompt's blocks in the store and the router's index",
        Duration::from_secs(20),
        || metric_at(operator, indexed) >= 6.0,
    );
    // The workers' counters, as their heartbeats bring them.
    wait_until("the workers' puts", Duration::from_secs(10), || {
        metric_lines(operator, "tandem_worker_kv_store_puts{") >= 6
    });
    // SAFETY: signalling our own child process.
    unsafe { libc::kill(up.id() as i32, libc::SIGINT) };
    wait_until("tandem up stops", Duration::from_secs(20), || {
        up.try_wait().unwrap().is_some()
    });
    let _ = std::fs::remove_dir_all(&dir);
}

/// The sum of the samples of the metric lines at `at` starting with `prefix`.
fn metric_lines(at: std::net::SocketAddr, prefix: &str) -> u64 {
    let (_, m) = tandem_tests::cluster::get(at, "/metrics").unwrap();
    m.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// Read repair: two store nodes, each block on both; one restarted empty on its address (so
/// the same blocks are placed on it), a fresh worker fetching three prompts asks it first for
/// some, finds them on the other, and puts those back on it — counted by the worker, held by
/// the node again; the same texts throughout.
#[test]
fn a_store_node_restarted_empty_is_given_back_what_it_was_asked_for() {
    let mut s = with_store_nodes("store-repair", 0, 1, 2);
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| prompt(31 + i, 6)).collect();
    let texts: Vec<String> = prompts.iter().map(|p| complete(&s.c, p)).collect();
    let objects = |n: &StoreNode| metric_at(n.metrics, "tandem_store_objects");
    wait_until("18 blocks on each node", Duration::from_secs(20), || {
        (objects(&s.node), objects(&s.more[0])) == (18.0, 18.0)
    });
    s.node.restart();
    assert_eq!(objects(&s.node), 0.0, "restarted empty");
    // A fresh worker: nothing of the prompts in its own tiers.
    let cfg = s.c.config_file().to_path_buf();
    s.c.kill_worker("decode-0");
    s.c.add_worker("decode", "decode-1", &cfg);
    s.c.wait_for(0, 1);
    for (p, text) in prompts.iter().zip(&texts) {
        assert_eq!(&complete(&s.c, p), text, "the same text from the store");
    }
    assert_eq!(
        stat(&s.c, "decode-1", "kv_store_hits"),
        18,
        "every block fetched"
    );
    let repaired = stat(&s.c, "decode-1", "kv_store_repaired");
    // Each block is first asked of one of its two nodes: the chance that the restarted one
    // was first for none of 18 is 2^-18.
    assert!(repaired > 0, "nothing put back");
    wait_until(
        "the repaired blocks held again",
        Duration::from_secs(10),
        || objects(&s.node) == repaired as f64,
    );
    assert_eq!(objects(&s.more[0]), 18.0);
}

/// Store nodes found through etcd (`[store] discover`): the workers and the router are told
/// nothing of the store but etcd's address. Before any node registers, a prompt's blocks have
/// nowhere to go (dropped, counted); a node started then is found by all of them — the next
/// prompt's blocks are put there, indexed by the router, and served from there to the other
/// worker once the first is killed; its registration deleted while it still serves, it leaves
/// the workers' links, the router's index and its metrics.
#[test]
fn store_nodes_registered_in_etcd_are_found_used_and_forgotten() {
    if !tandem_tests::etcd::available() {
        return eprintln!("skipped: no etcd binary (apt install etcd-server)");
    }
    let etcd = tandem_tests::etcd::Etcd::start();
    let scratch = std::env::temp_dir().join(format!("tandem-store-etcd-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).unwrap();
    let security = format!("[security]\ndir = {:?}\n", scratch.join("pki"));
    let discovery = format!(
        "[discovery]\netcd = [{:?}]\nprefix = \"/tandem/store-{}\"\nlease_ttl_ms = 2000\n",
        etcd.endpoint(),
        std::process::id()
    );
    let decode = format!("[decode.kv_tiers]\nhost_bytes = 100_000_000\n\n[store]\ndiscover = true\n\n{security}{discovery}");
    let mut c = Cluster::of(0, 2).pools(["", &decode]).start(EXE.as_ref());
    let nodes_used =
        |c: &Cluster| stat(c, "decode-0", "kv_store_nodes") + stat(c, "decode-1", "kv_store_nodes");
    let found = |c: &Cluster, source: &str| {
        metric_at(
            c.operator,
            &format!("tandem_router_store_nodes{{source=\"{source}\"}}"),
        )
    };
    let dropped = |c: &Cluster| {
        stat(c, "decode-0", "kv_store_puts_dropped") + stat(c, "decode-1", "kv_store_puts_dropped")
    };
    assert_eq!(nodes_used(&c), 0);
    complete(&c, &prompt(21, 6));
    wait_until(
        "the blocks dropped: no node yet",
        Duration::from_secs(20),
        || dropped(&c) >= 6,
    );

    let store_cfg = scratch.join("store.toml");
    let store = format!("[decode]\n{security}{discovery}[store]\ncapacity_bytes = 1_000_000_000\n");
    std::fs::write(&store_cfg, store).unwrap();
    let (mut node, _) = StoreNode::start(EXE.as_ref(), &store_cfg);
    wait_until(
        "the node found by both workers and the router",
        Duration::from_secs(20),
        || nodes_used(&c) == 2 && found(&c, "etcd") == 1.0,
    );
    assert_eq!(found(&c, "config"), 0.0);
    let second = prompt(22, 6);
    let (text, served, other) = put_by_one(&c, &second);
    let indexed = "tandem_router_kv_index_tier_blocks{tier=\"store\"}";
    wait_until(
        "the node's blocks in the router's index",
        Duration::from_secs(10),
        || metric_at(c.operator, indexed) == 6.0,
    );
    c.kill_worker(served);
    c.wait_for(0, 1);
    assert_eq!(
        complete(&c, &second),
        text,
        "the same text from the store's blocks"
    );
    assert_eq!(
        stat(&c, other, "kv_store_hits"),
        6,
        "fetched from the node found in etcd"
    );

    // Its registration deleted while it still serves (the router's watch on it holds): only
    // etcd says it is gone, and the router and the workers forget it.
    etcd.delete(&format!("/tandem/store-{}/stores/", std::process::id()));
    wait_until(
        "the node's registration gone and the node forgotten",
        Duration::from_secs(20),
        || found(&c, "etcd") == 0.0 && metric_at(c.operator, indexed) == 0.0,
    );
    wait_until(
        "the worker's link without the node",
        Duration::from_secs(10),
        || stat(&c, other, "kv_store_nodes") == 0,
    );
    node.kill();
    let _ = std::fs::remove_dir_all(&scratch);
}
