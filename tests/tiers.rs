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

/// The cluster KV store through a real cluster: a prompt computed on one decode worker is put
/// in the store; that worker killed, the other serves the same prompt from the store's blocks
/// (fetched, staged in its host tier, loaded into its pool), computing only the rest — the
/// same text, asserted from both workers' store counters and the prefix hits.
#[test]
fn a_prefix_computed_by_a_worker_killed_since_serves_another_through_the_store() {
    let scratch = std::env::temp_dir().join(format!("tandem-store-e2e-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).unwrap();
    // The store and the cluster share one CA.
    let security = format!("[security]\ndir = {:?}\n", scratch.join("pki"));
    let store = format!("[decode]\n{security}[store]\ncapacity_bytes = 1_000_000_000\n");
    std::fs::write(scratch.join("store.toml"), store).unwrap();
    let (_store, at) = StoreNode::start(EXE.as_ref(), &scratch.join("store.toml"));
    let lines = format!(
        "[decode.kv_tiers]\nhost_bytes = 100_000_000\n\n[store]\nnode = {at:?}\n\n{security}"
    );
    let mut c = Cluster::of(0, 2).pools(["", &lines]).start(EXE.as_ref());
    let first = prompt(11, 6);
    let text = complete(&c, &first);
    let puts = |c: &Cluster, w: &str| stat(c, w, "kv_store_puts");
    wait_until(
        "the prompt's blocks in the store",
        Duration::from_secs(20),
        || puts(&c, "decode-0") + puts(&c, "decode-1") >= 6,
    );
    let (served, other) = match puts(&c, "decode-0") >= 6 {
        true => ("decode-0", "decode-1"),
        false => ("decode-1", "decode-0"),
    };
    assert_eq!(
        puts(&c, served),
        6,
        "the prompt's 6 whole blocks, each put once"
    );
    let hits_before = stat(&c, other, "prefix_hit_tokens");
    c.kill_worker(served);
    c.wait_for(0, 1);
    assert_eq!(
        complete(&c, &first),
        text,
        "the same text from the store's blocks"
    );
    assert_eq!(
        stat(&c, other, "kv_store_hits"),
        6,
        "fetched from the store"
    );
    assert_eq!(
        stat(&c, other, "kv_host_hits"),
        6,
        "staged in G2 and loaded from there"
    );
    let found = stat(&c, other, "prefix_hit_tokens") - hits_before;
    assert_eq!(
        found,
        6 * BS as u64,
        "only the prompt's last token computed"
    );
    assert_eq!(stat(&c, other, "kv_tier_corrupt"), 0);
    drop(c);
    let _ = std::fs::remove_dir_all(&scratch);
}
