//! KV tiers below the pool on the real models (SmolLM2 and Gemma 3): a conversation's prefix
//! evicted from the pool to host memory (G2), then on to disk (G3), then read back by a
//! restarted engine gives bitwise the tokens of a cold engine, and the engine computed only
//! what no tier held (asserted from its counters); a block damaged on disk is found by its
//! checksum, dropped, counted and computed again, and the tokens are still exact.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use engine::tiers::{TierConfig, WritePolicy};
use engine::{Engine, EngineConfig, Model, SamplingParams};
use tandem_tests::{generate, load_gemma3, load_model};

/// Pool pages a layer group: a filler prompt takes nearly all of them.
const BLOCKS: usize = 32;

/// A scratch directory, removed when dropped.
struct Scratch(std::path::PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("tandem-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Scratch(dir)
    }
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `host_pages` pages of each layer group in G2; G3 in `disk`, when given.
fn config(host_pages: u64, disk: Option<&Path>, model: &Model) -> EngineConfig {
    let base = EngineConfig::default();
    let groups = model.kv_pages(1);
    let page = model.kv_page_bytes(base.block_size);
    EngineConfig {
        num_blocks: BLOCKS,
        tiers: TierConfig {
            host_bytes: host_pages * groups as u64 * page as u64,
            disk_path: disk.map(Path::to_path_buf),
            disk_bytes: disk.map_or(0, |_| 1 << 30),
            write_policy: WritePolicy::Evicted,
            // Every eviction reaches the disk however slow this machine's disk is today.
            disk_queue: Some(1 << 16),
        },
        ..base
    }
}

/// Plain token ids (none special), different for each `k`.
fn text(k: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 300 + (k * 7919 + i * 104_729) % 20_000)
        .collect()
}

/// Runs a prompt that takes nearly the whole pool: every cached block not held is evicted.
fn fill(e: &mut Engine, k: u32) {
    let bs = EngineConfig::default().block_size;
    generate(
        e,
        1000 + k as u64,
        &text(100 + k, (BLOCKS - 2) * bs),
        &SamplingParams::greedy(8),
    );
}

struct Turn {
    tokens: Vec<u32>,
    /// Prompt tokens found cached (pool or tier), and blocks loaded from G2 and from G3.
    hit: u64,
    host: u64,
    disk: u64,
    corrupt: u64,
}

fn turn(e: &mut Engine, id: u64, prompt: &[u32], params: &SamplingParams) -> Turn {
    let before = e.load();
    let tokens = generate(e, id, prompt, params);
    let after = e.load();
    Turn {
        tokens,
        hit: after.prefix_hit_tokens - before.prefix_hit_tokens,
        host: after.tiers.host.hits - before.tiers.host.hits,
        disk: after.tiers.disk.hits - before.tiers.disk.hits,
        corrupt: after.tiers.disk.corrupt - before.tiers.disk.corrupt,
    }
}

fn prefix_survives_the_tiers_and_a_restart(model: Arc<Model>, stops: Vec<u32>) {
    let bs = EngineConfig::default().block_size;
    let prompt = text(1, 5 * bs + 7);
    let whole = ((prompt.len() - 1) / bs * bs) as u64;
    for (i, params) in [
        SamplingParams::greedy(12),
        SamplingParams {
            max_tokens: Some(12),
            temperature: 0.8,
            top_k: 40,
            seed: 7,
            ..Default::default()
        },
    ]
    .into_iter()
    .enumerate()
    {
        let cold_config = EngineConfig {
            prefix_cache: false,
            ..config(0, None, &model)
        };
        let mut cold = Engine::new(model.clone(), cold_config, stops.clone()).unwrap();
        let want = generate(&mut cold, 1, &prompt, &params);
        let dir = Scratch::new(&format!("tiers-{}-{i}", model.config.arch));
        {
            let mut e = Engine::new(
                model.clone(),
                config(16, Some(dir.path()), &model),
                stops.clone(),
            )
            .unwrap();
            let first = turn(&mut e, 1, &prompt, &params);
            assert_eq!((first.tokens.as_slice(), first.hit), (want.as_slice(), 0));
            fill(&mut e, 1);
            let g2 = turn(&mut e, 2, &prompt, &params);
            assert_eq!(g2.tokens, want, "params {i}: read back from G2");
            assert_eq!(g2.hit, whole, "params {i}: only the suffix computed");
            assert!(
                g2.host > 0 && g2.disk == 0,
                "params {i}: G2 served it ({} blocks)",
                g2.host
            );
            // Two more fillers: the prefix leaves the pool again, then G2 for G3.
            fill(&mut e, 2);
            fill(&mut e, 3);
            assert!(e.flush_tiers(Duration::from_secs(30)), "G3's writes finish");
            assert_eq!(
                e.load().tiers.disk.writes_skipped,
                0,
                "every write reached the disk"
            );
            let g3 = turn(&mut e, 3, &prompt, &params);
            assert_eq!(g3.tokens, want, "params {i}: read back from G3");
            assert_eq!(g3.hit, whole);
            assert!(
                g3.disk > 0 && g3.host == 0,
                "params {i}: G3 served it ({} blocks)",
                g3.disk
            );
            assert!(e.flush_tiers(Duration::from_secs(30)));
        }
        // A restart: a new engine on the same directory.
        let mut e = Engine::new(
            model.clone(),
            config(16, Some(dir.path()), &model),
            stops.clone(),
        )
        .unwrap();
        assert!(e.load().tiers.disk.blocks > 0, "G3's blocks re-read");
        let stored = e.take_kv_events().iter().filter(|ev| ev.stored()).count();
        assert!(stored > 0, "and reported for the router's index");
        let back = turn(&mut e, 4, &prompt, &params);
        assert_eq!(back.tokens, want, "params {i}: after a restart");
        assert_eq!(
            back.hit, whole,
            "params {i}: only the suffix computed after a restart"
        );
        assert!(back.disk > 0);
        drop(e);
        // Damage the prefix's second block in every layer group's file.
        let seed = engine::block_hash::identity_seed(&model.config, bs);
        let names = engine::block_hash::prompt_hashes(seed, engine::block_hash::ROOT, bs, &prompt);
        let mut damaged = 0;
        for g in 0..model.kv_pages(1) {
            let path = dir.path().join(format!("{g:04x}-{:016x}.kv", names[1].0));
            if let Ok(mut bytes) = std::fs::read(&path) {
                let at = bytes.len() - 100;
                bytes[at] ^= 0x10;
                std::fs::write(&path, bytes).unwrap();
                damaged += 1;
            }
        }
        assert!(damaged > 0, "the second block is on disk");
        let mut e = Engine::new(
            model.clone(),
            config(16, Some(dir.path()), &model),
            stops.clone(),
        )
        .unwrap();
        let bad = turn(&mut e, 5, &prompt, &params);
        assert_eq!(
            bad.tokens, want,
            "params {i}: a damaged block changes no token"
        );
        assert!(bad.corrupt >= 1, "params {i}: the damage was found");
        assert_eq!(
            bad.hit, bs as u64,
            "params {i}: only the block before it served"
        );
    }
}

#[test]
fn smollm2_prefix_evicted_to_host_then_disk_then_restarted_is_exact() {
    let (model, tok) = load_model();
    prefix_survives_the_tiers_and_a_restart(model, tok.stop_ids().to_vec());
}

#[test]
fn gemma3_prefix_evicted_to_host_then_disk_then_restarted_is_exact() {
    let (model, tok) = load_gemma3();
    prefix_survives_the_tiers_and_a_restart(model, tok.stop_ids().to_vec());
}

/// The blocks engine `from` copied out, through a store node's objects (each put checked
/// against its checksum, then got back under a lease) as another worker would fetch them.
fn through_the_store(from: &mut Engine) -> Vec<engine::StoreBlock> {
    use store::{Limits, ObjectKey, Objects, PutStart};
    let (blocks, dropped) = from.take_store_blocks();
    assert_eq!(dropped, 0);
    let mut node = Objects::new(Limits::default());
    let now = std::time::Instant::now();
    let key = |b: &engine::StoreBlock| ObjectKey {
        model: 1,
        block: b.hash,
    };
    for b in &blocks {
        let size = b.bytes.len() as u64;
        let PutStart::Write(id) = node.put_start(key(b), size, b.sum, now).unwrap() else {
            panic!("a new block")
        };
        node.put_whole(id, b.bytes.clone()).unwrap();
    }
    let got = |b: &engine::StoreBlock| {
        let g = node.get(key(b), now).unwrap().expect("held");
        engine::StoreBlock {
            hash: b.hash,
            bytes: g.data.to_vec(),
            sum: g.sum,
        }
    };
    blocks.iter().map(got).collect()
}

/// A decode worker serves a peer its host tier too: a prefix computed on one engine, then
/// evicted from its pool to G2, is copied out of G2 (counted as exported, none of the engine's
/// own hits) bitwise as it was copied out of the pool; staged in another engine it gives the
/// cold engine's tokens, the prefix loaded, not computed.
#[test]
fn smollm2_prefix_evicted_to_host_is_served_to_a_peer_exactly() {
    let (model, tok) = load_model();
    let stops = tok.stop_ids().to_vec();
    let bs = EngineConfig::default().block_size;
    let prompt = text(4, 5 * bs + 7);
    let params = SamplingParams::greedy(12);
    let mut held = Engine::new(model.clone(), config(64, None, &model), stops.clone()).unwrap();
    let want = generate(&mut held, 1, &prompt, &params);
    let mut other = Engine::new(model.clone(), config(64, None, &model), stops.clone()).unwrap();
    let names = other.store_wanted(&prompt, None);
    assert_eq!(names.len(), 5, "the prompt's whole blocks");
    let from_pool = held.export_blocks(&names);
    assert_eq!(from_pool.len(), 5);
    // Two fillers: every block of the prompt leaves the pool.
    fill(&mut held, 1);
    fill(&mut held, 2);
    let before = held.load().tiers.host;
    let from_host = held.export_blocks(&names);
    let after = held.load().tiers.host;
    assert_eq!(
        (after.exported - before.exported, after.hits - before.hits),
        (5, 0),
        "all five from G2, none of them a hit of its own"
    );
    let bytes = |b: &[engine::StoreBlock]| {
        b.iter()
            .map(|b| (b.bytes.clone(), b.sum))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        bytes(&from_host),
        bytes(&from_pool),
        "G2's copy is the pool's"
    );
    let staged = other.stage_store(&from_host);
    assert_eq!((staged.staged, staged.corrupt), (5, 0));
    let t = turn(&mut other, 2, &prompt, &params);
    assert_eq!(
        t.tokens, want,
        "served from a peer's G2: the cold engine's tokens"
    );
    assert_eq!((t.hit, t.host), (5 * bs as u64, 5), "the prefix was loaded");
}

/// A prefix computed by one engine, put in a store node and staged in another engine's G2,
/// gives that engine bitwise the cold engine's tokens (greedy and seeded), computing only the
/// rest; a block damaged on the way is dropped, counted and computed again, and the tokens are
/// still exact.
#[test]
fn smollm2_prefix_from_another_engine_through_the_store_is_exact() {
    let (model, tok) = load_model();
    let stops = tok.stop_ids().to_vec();
    let bs = EngineConfig::default().block_size;
    let prompt = text(3, 5 * bs + 7);
    for params in [
        SamplingParams::greedy(12),
        SamplingParams {
            max_tokens: Some(12),
            temperature: 0.8,
            top_k: 40,
            seed: 9,
            ..Default::default()
        },
    ] {
        let mut first = Engine::new(model.clone(), config(0, None, &model), stops.clone()).unwrap();
        assert!(first.set_store_out(64), "SmolLM2 on a CPU takes part");
        let want = generate(&mut first, 1, &prompt, &params);
        let mut blocks = through_the_store(&mut first);
        // The prompt's 5 whole blocks, and the generated tokens' first.
        assert_eq!(blocks.len(), 6);
        let mut other =
            Engine::new(model.clone(), config(64, None, &model), stops.clone()).unwrap();
        let staged = other.stage_store(&blocks);
        assert_eq!((staged.staged, staged.corrupt), (6, 0));
        let t = turn(&mut other, 2, &prompt, &params);
        assert_eq!(
            t.tokens, want,
            "staged from the store: the first engine's tokens"
        );
        assert_eq!(
            (t.hit, t.host),
            (5 * bs as u64, 5),
            "the prefix came from G2"
        );
        // Block 2 damaged on its way: blocks 0 and 1 serve, the rest is computed.
        blocks[2].bytes[4 * bs + 100] ^= 0x20;
        let mut damaged =
            Engine::new(model.clone(), config(64, None, &model), stops.clone()).unwrap();
        let staged = damaged.stage_store(&blocks);
        assert_eq!((staged.staged, staged.corrupt), (5, 1));
        let t = turn(&mut damaged, 3, &prompt, &params);
        assert_eq!(t.tokens, want, "a damaged block never makes a wrong token");
        assert_eq!((t.hit, t.host), (2 * bs as u64, 2));
    }
    let (gemma, tok) = load_gemma3();
    let mut e = Engine::new(
        gemma.clone(),
        config(0, None, &gemma),
        tok.stop_ids().to_vec(),
    )
    .unwrap();
    assert!(
        !e.set_store_out(64),
        "windowed layer groups do not take part yet"
    );
}

#[test]
fn a_mock_engines_tiers_keep_only_their_accounting_and_price_every_move() {
    // The mock engine on a real clock (as `tandem up` runs it): its pool has pages of the
    // model's real size, but its tiers copy none of those meaningless bytes — a load or store
    // costs the timing model's time, as in the simulator, not this machine's copies as well.
    let (m, tok) = engine::load_mock(&tandem_tests::model_path(), engine::MockTiming::CPU_SMOLLM2)
        .expect("the mock loads");
    let model = Arc::new(m);
    let dir = Scratch::new("mock-tiers");
    let mut e = Engine::new(
        model.clone(),
        config(2, Some(dir.path()), &model),
        tok.stop_ids().to_vec(),
    )
    .unwrap();
    let bs = EngineConfig::default().block_size;
    let prompt = text(1, 5 * bs + 7);
    let params = SamplingParams::greedy(4);
    let want = turn(&mut e, 1, &prompt, &params).tokens;
    // Two fillers push the prompt's blocks out of the pool, through G2 (2 pages) and to G3.
    fill(&mut e, 1);
    fill(&mut e, 2);
    let t = turn(&mut e, 2, &prompt, &params);
    assert_eq!(t.tokens, want);
    assert_eq!(
        t.hit,
        5 * bs as u64,
        "every whole block came back from a tier"
    );
    assert!(
        t.host + t.disk == 5 && t.disk > 0,
        "{} + {}",
        t.host,
        t.disk
    );
    assert_eq!(t.corrupt, 0);
    let files = std::fs::read_dir(dir.path()).map_or(0, |d| d.count());
    assert_eq!(files, 0, "the mock's disk tier writes no files");
    // Counted at the model's page size: what the timing model prices (`TierTraffic`).
    let page = model.kv_page_bytes(bs) as u64;
    let tiers = e.load().tiers;
    assert_eq!(tiers.host.bytes_loaded + tiers.disk.bytes_loaded, 5 * page);
    assert!(tiers.host.bytes_stored >= 5 * page);
}
