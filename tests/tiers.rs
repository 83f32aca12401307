//! KV tiers through a real cluster on the real engine: a decode worker's prefix evicted to its
//! disk tier outlives a `kill -9`; started again on the same directory, the worker reports the
//! blocks, the router indexes them, and the next turn loads them instead of computing them —
//! the same tokens as before.

use std::time::Duration;

use serde_json::{json, Value};
use tandem_tests::cluster::{metric_at, post_json, Cluster};
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
