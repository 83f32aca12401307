use std::path::{Path, PathBuf};
use std::time::Duration;

use super::*;
use crate::forward::PageDevice;

/// A scratch directory, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("tandem-tier-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const PAGE: usize = 96;

fn config(host_pages: u64, disk: Option<&Path>, disk_pages: u64) -> TierConfig {
    TierConfig {
        host_bytes: host_pages * PAGE as u64,
        disk_path: disk.map(Path::to_path_buf),
        disk_bytes: disk_pages * PAGE as u64,
        write_policy: WritePolicy::Evicted,
        disk_queue: None,
    }
}

fn page(k: u64) -> Vec<u8> {
    (0..PAGE).map(|i| (k as usize * 31 + i) as u8).collect()
}

fn store(t: &mut Tiers, k: u64, hits: u32) {
    let data = page(k);
    let (a, b) = data.split_at(40);
    t.store(Evicted {
        key: (0, k),
        tokens: &[k as u32, 1],
        hits,
        data: &[a, b],
    });
}

fn load(t: &mut Tiers, k: u64) -> Option<(Tier, Vec<u8>)> {
    let mut out = vec![0u8; PAGE];
    let (a, b) = out.split_at_mut(50);
    let (tier, _) = t.load((0, k), &[k as u32, 1], &mut [a, b])?;
    Some((tier, out))
}

/// Each page as two segments, as a page of the pool is many.
fn split(pages: &mut [Vec<u8>]) -> Vec<Vec<&mut [u8]>> {
    pages
        .iter_mut()
        .map(|p| {
            let (a, b) = p.split_at_mut(30);
            vec![a, b]
        })
        .collect()
}

fn event(k: u64, stored: bool, tier: Tier) -> KvEvent {
    let block = BlockHash(k);
    match stored {
        true => KvEvent::Stored { block, tier },
        false => KvEvent::Removed { block, tier },
    }
}

#[test]
fn evicted_blocks_go_down_host_then_disk_and_come_back_exact() {
    let dir = Scratch::new("down");
    let mut t = Tiers::open(&config(2, Some(&dir.0), 8), 7, PAGE, true).unwrap();
    for k in 1..=3 {
        store(&mut t, k, 0);
    }
    assert!(t.flush(Duration::from_secs(10)));
    assert_eq!(
        t.take_events(),
        [
            event(1, true, Tier::Host),
            event(2, true, Tier::Host),
            event(1, false, Tier::Host),
            event(3, true, Tier::Host),
            event(1, true, Tier::Disk),
        ],
        "block 1, the least recently used, went on to G3"
    );
    assert_eq!(load(&mut t, 3), Some((Tier::Host, page(3))));
    assert_eq!(load(&mut t, 1), Some((Tier::Disk, page(1))));
    assert_eq!(
        t.find((0, 1), &[1, 9]),
        None,
        "other tokens under the name: a miss"
    );
    assert_eq!(load(&mut t, 4), None);
    let s = t.stats();
    assert_eq!(
        (s.host.blocks, s.host.hits, s.disk.blocks, s.disk.hits),
        (2, 1, 1, 1)
    );
    assert_eq!(s.disk.bytes_loaded, PAGE as u64);
}

#[test]
fn a_damaged_copy_is_dropped_and_counted_in_either_tier() {
    let dir = Scratch::new("damage");
    let mut t = Tiers::open(&config(1, Some(&dir.0), 8), 7, PAGE, true).unwrap();
    store(&mut t, 1, 0);
    store(&mut t, 2, 0); // 1 goes to disk
    assert!(t.flush(Duration::from_secs(10)));
    t.host.as_mut().unwrap().bytes_mut((0, 2)).unwrap()[5] ^= 1;
    assert_eq!(load(&mut t, 2), None, "G2's copy fails its sum");
    let Some(g3::G3::Files(d)) = t.disk.as_ref() else {
        panic!("a backed G3 is files")
    };
    let path = d.path_of((0, 1));
    let mut bytes = std::fs::read(&path).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x80;
    std::fs::write(&path, bytes).unwrap();
    assert_eq!(load(&mut t, 1), None, "G3's copy fails its sum");
    let s = t.stats();
    assert_eq!((s.host.corrupt, s.disk.corrupt), (1, 1));
    assert_eq!((s.host.blocks, s.disk.blocks), (0, 0), "both dropped");
    assert!(!path.exists(), "the damaged file is deleted");
}

#[test]
fn the_disk_tier_outlives_its_process_for_the_same_identity_only() {
    let dir = Scratch::new("restart");
    {
        let mut t = Tiers::open(&config(0, Some(&dir.0), 2), 7, PAGE, true).unwrap();
        for k in 1..=3 {
            store(&mut t, k, 0);
        }
        assert!(t.flush(Duration::from_secs(10)));
        assert_eq!(t.stats().disk.blocks, 2, "bounded: the oldest file went");
        let again = Tiers::open(&config(0, Some(&dir.0), 2), 7, PAGE, true);
        assert!(
            again.is_err_and(|e| e.to_string().contains("in use")),
            "one process a directory"
        );
    }
    let mut t = Tiers::open(&config(0, Some(&dir.0), 8), 7, PAGE, true).unwrap();
    let mut stored: Vec<_> = t.take_events().iter().map(|e| e.block().0).collect();
    stored.sort();
    assert_eq!(stored, [2, 3], "re-read and reported");
    assert_eq!(load(&mut t, 3), Some((Tier::Disk, page(3))));
    drop(t);
    let mut other = Tiers::open(&config(0, Some(&dir.0), 8), 8, PAGE, true).unwrap();
    assert!(
        other.take_events().is_empty(),
        "another model's blocks are discarded"
    );
    assert_eq!(other.stats().disk.blocks, 0);
    let files = std::fs::read_dir(&dir.0).unwrap().flatten();
    assert_eq!(
        files
            .filter(|f| f.path().extension().is_some_and(|e| e == "kv"))
            .count(),
        0
    );
}

#[test]
fn hit_twice_writes_only_blocks_shared_twice() {
    let mut t = Tiers::open(
        &TierConfig {
            write_policy: WritePolicy::HitTwice,
            ..config(4, None, 0)
        },
        7,
        PAGE,
        true,
    )
    .unwrap();
    store(&mut t, 1, 1);
    store(&mut t, 2, 2);
    assert_eq!(t.stats().host.blocks, 1);
    assert_eq!(load(&mut t, 2).map(|l| l.0), Some(Tier::Host));
}

#[test]
fn a_cache_without_values_keeps_the_accounting() {
    let mut t = Tiers::open(&config(2, None, 0), 7, PAGE, false).unwrap();
    t.store(Evicted {
        key: (0, 1),
        tokens: &[1, 1],
        hits: 0,
        data: &[],
    });
    assert_eq!(t.find((0, 1), &[1, 1]), Some(Tier::Host));
    assert_eq!(
        t.load((0, 1), &[1, 1], &mut []).map(|l| l.0),
        Some(Tier::Host)
    );
    assert_eq!(
        t.stats().host.bytes,
        PAGE as u64,
        "counted at the page's size"
    );
}

/// A test double of a device pool ([`PageDevice`]), named as one: host memory is "mapped" at
/// its own address and a page "copied onto the device" lands in `pages`.
#[derive(Default)]
struct MockDevice {
    pages: std::sync::Mutex<std::collections::HashMap<u32, Vec<u8>>>,
}

impl PageDevice for MockDevice {
    fn to_host(&self, _: &[u32]) -> Result<()> {
        Ok(())
    }
    fn to_device(&self, _: &[u32]) -> Result<()> {
        Ok(())
    }
    unsafe fn map(&self, at: *mut u8, _: usize) -> Result<crate::forward::Mapped> {
        let guard = Box::new(());
        Ok(crate::forward::Mapped {
            addr: at as u64,
            guard,
        })
    }
    unsafe fn page_from(&self, src: u64, page: u32) -> Result<()> {
        // SAFETY: the caller's contract: `src` is a whole page of mapped (here: host) memory.
        let bytes = unsafe { std::slice::from_raw_parts(src as *const u8, PAGE) };
        self.pages.lock().unwrap().insert(page, bytes.to_vec());
        Ok(())
    }
    fn sync(&self) -> Result<()> {
        Ok(())
    }
}

#[test]
fn a_mapped_g2_copies_onto_the_device_and_checks_before_use() {
    let dev = MockDevice::default();
    let mut t = Tiers::open(&config(4, None, 0), 7, PAGE, true).unwrap();
    t.map_host(&dev).unwrap();
    for k in 1..=4 {
        store(&mut t, k, 0);
    }
    let start = |t: &mut Tiers, k: u64, page: u32| {
        let (_, at) = t
            .start((0, k), &[k as u32, 1], Some((&dev, page)))
            .unwrap()
            .unwrap();
        ((0, k), at)
    };
    let (one, two, three) = (
        start(&mut t, 1, 10),
        start(&mut t, 2, 11),
        start(&mut t, 3, 12),
    );
    assert!(
        t.start((0, 9), &[9, 1], Some((&dev, 13))).is_none(),
        "not in G2"
    );
    t.host.as_mut().unwrap().bytes_mut((0, 2)).unwrap()[5] ^= 1;
    // Block 3's slot goes to another block before the check: its copy cannot be vouched for.
    t.host.as_mut().unwrap().remove((0, 3));
    store(&mut t, 5, 0);
    assert_eq!(
        t.finish_started(&[one, two, three], None),
        [true, false, false]
    );
    assert_eq!(
        dev.pages.lock().unwrap()[&10],
        page(1),
        "block 1 on the device"
    );
    let s = t.stats();
    assert_eq!(
        (s.host.hits, s.host.corrupt),
        (1, 1),
        "3 was replaced, not corrupt"
    );
    assert_eq!(s.host.bytes_loaded, PAGE as u64);
    assert_eq!(load(&mut t, 2), None, "the damaged copy was dropped");
}

#[test]
fn blocks_taken_from_g2_are_copied_and_checked_together() {
    let mut t = Tiers::open(&config(4, None, 0), 7, PAGE, true).unwrap();
    for k in 1..=3 {
        store(&mut t, k, 0);
    }
    let take = |t: &mut Tiers, k: u64| {
        let (_, at) = t.start((0, k), &[k as u32, 1], None).unwrap().unwrap();
        ((0, k), at)
    };
    let (one, two, three) = (take(&mut t, 1), take(&mut t, 2), take(&mut t, 3));
    t.host.as_mut().unwrap().bytes_mut((0, 2)).unwrap()[70] ^= 4;
    t.host.as_mut().unwrap().remove((0, 3));
    store(&mut t, 4, 0); // into 3's slot
    let mut pages = vec![vec![0u8; PAGE]; 3];
    let mut outs = split(&mut pages);
    let ok = t.finish_started(&[one, two, three], Some(&mut outs));
    assert_eq!(ok, [true, false, false]);
    assert_eq!(pages[0], page(1), "block 1 copied whole");
    let s = t.stats();
    assert_eq!(
        (s.host.hits, s.host.corrupt),
        (1, 1),
        "3 was replaced, not corrupt"
    );
}

#[test]
fn blocks_taken_from_g3_are_read_and_checked_together() {
    let dir = Scratch::new("taken");
    let mut t = Tiers::open(&config(0, Some(&dir.0), 8), 7, PAGE, true).unwrap();
    for k in 1..=3 {
        store(&mut t, k, 0);
    }
    assert!(t.flush(Duration::from_secs(10)));
    let tokens: Vec<[u32; 2]> = (0..4).map(|k| [k, 1]).collect();
    let taken: Vec<(Key, &[u32])> = (1..=3)
        .map(|k| {
            assert!(t.take_disk((0, k), &tokens[k as usize]).is_some());
            ((0, k), &tokens[k as usize][..])
        })
        .collect();
    assert!(t.take_disk((0, 9), &[9, 1]).is_none(), "not on disk");
    let Some(g3::G3::Files(d)) = t.disk.as_ref() else {
        panic!("a backed G3 is files")
    };
    let (two, three) = (d.path_of((0, 2)), d.path_of((0, 3)));
    let mut bytes = std::fs::read(&two).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x80;
    std::fs::write(&two, bytes).unwrap();
    std::fs::remove_file(&three).unwrap(); // gone meanwhile: not corrupt
    let mut pages = vec![vec![0u8; PAGE]; 3];
    let mut outs = split(&mut pages);
    assert_eq!(t.finish_taken_disk(&taken, &mut outs), [true, false, false]);
    assert_eq!(pages[0], page(1), "block 1 read whole");
    let s = t.stats();
    assert_eq!((s.disk.hits, s.disk.corrupt), (1, 1));
    assert!(!two.exists(), "the damaged file is deleted");
}
