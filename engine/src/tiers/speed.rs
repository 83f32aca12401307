//! How fast the tiers load (issue 34, acceptance 8), beside their limits in the same run: a G2
//! load against a plain copy of the same bytes, a G3 load against one sequential read of as many
//! bytes from a file on the same disk, each with the page cache dropped first (root; otherwise
//! the figures say the cache was warm). A benchmark, not a test: it asserts only exactness.
//!
//!     cargo test --release -p engine --lib tiers::speed -- --ignored --nocapture

use std::io::{Read, Write};
use std::time::Instant;

use super::*;

/// SmolLM2-135M's page: 30 layers, K and V, 16 tokens × 192 values × 2 bytes.
const SEGMENTS: usize = 60;
const SEGMENT: usize = 16 * 192 * 2;
const PAGE: usize = SEGMENTS * SEGMENT;
const PAGES: u64 = 1024;

fn fill(k: u64) -> Vec<u8> {
    (0..PAGE)
        .map(|i| (k as usize * 131 + i * 7) as u8)
        .collect()
}

/// Drops the page cache; whether it could.
fn drop_cache() -> bool {
    // A write to procfs: it fails without root.
    let _ = std::process::Command::new("sync").status();
    std::fs::write("/proc/sys/vm/drop_caches", "1").is_ok()
}

fn gbs(bytes: u64, s: f64) -> f64 {
    bytes as f64 / s / 1e9
}

/// Stores every page, letting G3's writer catch up every 32 (its queue holds 64: a store never
/// waits, and a full queue would skip).
fn store_all(t: &mut Tiers) {
    for k in 0..PAGES {
        let data = fill(k);
        let segs: Vec<&[u8]> = data.chunks(SEGMENT).collect();
        t.store(Evicted {
            key: (0, k),
            tokens: &[k as u32],
            hits: 0,
            data: &segs,
        });
        if k % 32 == 31 {
            t.flush(std::time::Duration::from_secs(60));
        }
    }
}

/// Loads every page from `t` into one destination page; seconds taken, the last page checked.
fn load_all(t: &mut Tiers, want: Tier) -> f64 {
    let mut out = vec![0u8; PAGE];
    let t0 = Instant::now();
    for k in 0..PAGES {
        let mut segs: Vec<&mut [u8]> = out.chunks_mut(SEGMENT).collect();
        let (tier, _) = t.load((0, k), &[k as u32], &mut segs).expect("stored");
        assert_eq!(tier, want);
    }
    let s = t0.elapsed().as_secs_f64();
    assert!(
        out == fill(PAGES - 1),
        "the bytes loaded are the bytes stored"
    );
    s
}

/// Loads every page from G2 as a prefix lookup does: taken 64 at a time, then copied into 64
/// destination pages and checked together on the kernel threads; seconds taken.
fn load_batched(t: &mut Tiers) -> f64 {
    let mut pages = vec![vec![0u8; PAGE]; 64];
    let t0 = Instant::now();
    for first in (0..PAGES).step_by(64) {
        let taken: Vec<(Key, usize)> = (first..first + 64)
            .map(|k| {
                let (_, at) = t.start((0, k), &[k as u32], None).unwrap().unwrap();
                ((0, k), at)
            })
            .collect();
        let mut outs: Vec<Vec<&mut [u8]>> = pages
            .iter_mut()
            .map(|p| p.chunks_mut(SEGMENT).collect())
            .collect();
        let ok = t.finish_started(&taken, Some(&mut outs));
        assert!(ok.iter().all(|&o| o), "every block checks");
    }
    let s = t0.elapsed().as_secs_f64();
    assert!(
        pages[63] == fill(PAGES - 1),
        "the bytes loaded are the bytes stored"
    );
    s
}

/// Reads every page from G3's files as a prefix lookup does: taken 64 at a time, then read
/// into 64 destination pages and checked together on the kernel threads; seconds taken.
fn read_batched(t: &mut Tiers) -> f64 {
    let mut pages = vec![vec![0u8; PAGE]; 64];
    let tokens: Vec<[u32; 1]> = (0..PAGES as u32).map(|k| [k]).collect();
    let t0 = Instant::now();
    for first in (0..PAGES).step_by(64) {
        let taken: Vec<(Key, &[u32])> = (first..first + 64)
            .map(|k| {
                t.take_disk((0, k), &tokens[k as usize]).expect("on disk");
                ((0, k), &tokens[k as usize][..])
            })
            .collect();
        let mut outs: Vec<Vec<&mut [u8]>> = pages
            .iter_mut()
            .map(|p| p.chunks_mut(SEGMENT).collect())
            .collect();
        let ok = t.finish_taken_disk(&taken, &mut outs);
        assert!(ok.iter().all(|&o| o), "every block checks");
    }
    let s = t0.elapsed().as_secs_f64();
    assert!(
        pages[63] == fill(PAGES - 1),
        "the bytes read are the bytes stored"
    );
    s
}

#[test]
#[ignore = "a benchmark: run with --ignored --nocapture"]
fn load_speed_against_memcpy_and_a_sequential_read() {
    let bytes = PAGES * PAGE as u64;
    // G2 against a copy of the same pages (segment by segment, as a load writes them).
    let mut t = Tiers::open(
        &TierConfig {
            host_bytes: bytes,
            ..Default::default()
        },
        1,
        PAGE,
        true,
    )
    .unwrap();
    store_all(&mut t);
    let src: Vec<u8> = (0..PAGES).flat_map(fill).collect();
    let mut out = vec![0u8; PAGE];
    let t0 = Instant::now();
    for page in src.chunks(PAGE) {
        for (o, s) in out.chunks_mut(SEGMENT).zip(page.chunks(SEGMENT)) {
            o.copy_from_slice(s);
        }
        std::hint::black_box(&out);
    }
    let copy = t0.elapsed().as_secs_f64();
    let host = load_all(&mut t, Tier::Host);
    let batched = load_batched(&mut t);
    drop(t);
    println!(
        "G2: {:.2} GB/s; memcpy of the same pages {:.2} GB/s; ratio {:.2} (target >= 0.8)",
        gbs(bytes, host),
        gbs(bytes, copy),
        copy / host
    );
    println!(
        "G2 as a prefix hit loads it (64 pages at a time on {} kernel threads): {:.2} GB/s; ratio {:.2}",
        kernels::threads(),
        gbs(bytes, batched),
        copy / batched
    );

    // G3 against one file read front to back, both from a cold page cache.
    let dir = std::env::temp_dir().join(format!("tandem-tier-speed-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let config = TierConfig {
        disk_path: Some(dir.clone()),
        disk_bytes: 2 * bytes,
        ..Default::default()
    };
    let mut t = Tiers::open(&config, 1, PAGE, true).unwrap();
    store_all(&mut t);
    assert!(t.flush(std::time::Duration::from_secs(120)), "written");
    assert_eq!(t.stats().disk.blocks, PAGES, "no write skipped");
    let flat = dir.join("sequential");
    let mut f = std::fs::File::create(&flat).unwrap();
    for page in src.chunks(PAGE) {
        f.write_all(page).unwrap();
    }
    f.sync_all().unwrap();
    drop(f);
    let cold = drop_cache();
    let mut f = std::fs::File::open(&flat).unwrap();
    let t0 = Instant::now();
    let mut buf = vec![0u8; PAGE];
    while f.read(&mut buf).unwrap() > 0 {
        std::hint::black_box(&buf);
    }
    let read = t0.elapsed().as_secs_f64();
    drop_cache();
    let disk = load_all(&mut t, Tier::Disk);
    println!("G3: {:.2} GB/s; sequential read of the same bytes {:.2} GB/s; ratio {:.2} (target >= 0.8){}",
        gbs(bytes, disk), gbs(bytes, read), read / disk,
        if cold { "" } else { " — page cache warm (not root): both are memory reads" });
    drop_cache();
    let batched = read_batched(&mut t);
    println!(
        "G3 as a prefix hit loads it (64 files at a time on {} kernel threads): {:.2} GB/s; ratio {:.2}",
        kernels::threads(),
        gbs(bytes, batched),
        read / batched
    );
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}
