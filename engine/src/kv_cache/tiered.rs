//! The cache's side of the tiers below the pool ([`crate::tiers`]): a cached page the pool
//! evicts is copied down before its new owner writes it, and a prefix lookup first loads what
//! the tiers hold of the prompt's chain into fresh pages, registered as the pool's own.

use std::sync::Arc;

use types::Tier;

use super::{BlockTable, KvCache, LayerKv, GONE};
use crate::forward::PageDevice;
use crate::tiers::{Evicted, Key, Tiers, TiersStats};

/// Page `b`'s bytes in every storage layer, keys then values, layer by layer: the layout a
/// tier stores.
pub(super) fn segments(layers: &[LayerKv], per_page: usize, b: u32) -> Vec<&[u8]> {
    let r = b as usize * per_page..(b as usize + 1) * per_page;
    layers
        .iter()
        .flat_map(|l| [&l.k[r.clone()], &l.v[r.clone()]])
        .map(|s| bytemuck::cast_slice(s))
        .collect()
}

/// [`segments_mut`] of each of `pages` (distinct), at once.
fn pages_mut<'a>(
    layers: &'a mut [LayerKv],
    per_page: usize,
    pages: &[u32],
) -> Vec<Vec<&'a mut [u8]>> {
    let mut seen = std::collections::HashSet::new();
    assert!(
        pages.iter().all(|p| seen.insert(*p)),
        "pages loaded once each"
    );
    let pools: Vec<(*mut half::f16, usize)> = layers
        .iter_mut()
        .flat_map(|l| [(l.k.as_mut_ptr(), l.k.len()), (l.v.as_mut_ptr(), l.v.len())])
        .collect();
    let page = |b: u32| -> Vec<&'a mut [u8]> {
        let at = b as usize * per_page;
        pools
            .iter()
            .map(|&(p, len)| {
                assert!(at + per_page <= len, "page {b} lies in the pool");
                // SAFETY: `at..at + per_page` lies in this pool, borrowed mutably for 'a; the
                // pages are distinct, so no two slices handed out overlap.
                unsafe { std::slice::from_raw_parts_mut(p.add(at) as *mut u8, per_page * 2) }
            })
            .collect()
    };
    pages.iter().map(|&b| page(b)).collect()
}

/// [`segments`], writable.
fn segments_mut(layers: &mut [LayerKv], per_page: usize, b: u32) -> Vec<&mut [u8]> {
    let r = b as usize * per_page..(b as usize + 1) * per_page;
    layers
        .iter_mut()
        .flat_map(|l| {
            let LayerKv { k, v } = l;
            [&mut k[r.clone()], &mut v[r.clone()]]
        })
        .map(|s| bytemuck::cast_slice_mut(s))
        .collect()
}

impl KvCache {
    /// Puts `tiers` under the pool: from now on evicted cached pages go down to them and
    /// lookups continue through them. With a `device` (a GPU's pool, [`PageDevice`]), a page
    /// going down is copied off the device first and one loaded is copied onto it.
    pub fn set_tiers(&mut self, tiers: Tiers, device: Option<Arc<dyn PageDevice>>) {
        self.tiers = Some(tiers);
        self.device = device;
    }

    /// The tiers' counters, when there are tiers.
    pub fn tier_stats(&self) -> Option<TiersStats> {
        self.tiers.as_ref().map(Tiers::stats)
    }

    /// The tiers, when there are any.
    pub fn tiers(&self) -> Option<&Tiers> {
        self.tiers.as_ref()
    }

    /// The tiers, when there are any (tests and shutdown).
    pub fn tiers_mut(&mut self) -> Option<&mut Tiers> {
        self.tiers.as_mut()
    }

    /// Bytes of one page over every layer of its group: what a tier stores of it (0 for a
    /// cache without values).
    pub fn page_bytes(&self) -> usize {
        self.layers.len() * 2 * self.block_bytes()
    }

    /// A page for a new owner (see [`crate::prefix::BlockPool::alloc`]); a cached page it
    /// evicts goes down to the tiers first.
    pub(super) fn alloc(&mut self) -> Option<u32> {
        let (b, gone) = self.pool.alloc_evicting()?;
        if let (Some(f), Some(tiers)) = (gone, self.tiers.as_mut()) {
            let key = (f.group, f.hash);
            let copy = self
                .device
                .as_ref()
                .filter(|_| tiers.takes(key, &f.tokens, f.hits));
            if let Some(Err(e)) = copy.map(|d| d.to_host(&[b])) {
                tracing::warn!(page = b, "a cached KV page could not leave the device: {e}");
                return Some(b);
            }
            let data = match tiers.values() {
                true => segments(&self.layers, self.block_size * self.width, b),
                false => Vec::new(),
            };
            tiers.store(Evicted {
                key,
                tokens: &f.tokens,
                hits: f.hits,
                data: &data,
            });
        }
        Some(b)
    }

    /// Copies into G2 the blocks of `table` that hold the chain of `tokens`' first `blocks`
    /// whole blocks from `root` (registered: a preempted sequence's KV, found again by its
    /// prefix lookup when it resumes), whatever the write policy; a block G2 holds already is
    /// only marked used. Returns whether there is a G2 and every copy off a device worked.
    pub(crate) fn swap_out(
        &mut self,
        (seed, root): (u64, u64),
        table: &BlockTable,
        tokens: &[u32],
        blocks: usize,
    ) -> bool {
        let Some(tiers) = self.tiers.as_ref().filter(|t| t.has_host()) else {
            return false;
        };
        let bs = self.block_size;
        let mut todo = Vec::new();
        let mut parent = root;
        for (i, block) in tokens[..blocks * bs].chunks_exact(bs).enumerate() {
            parent = crate::prefix::chain(seed, parent, block);
            for (g, t) in table.groups.iter().enumerate() {
                match t.blocks.get(i) {
                    Some(&b) if b != GONE && i * bs >= t.valid_from => {
                        todo.push(((g as u32, parent), i, b))
                    }
                    _ => {}
                }
            }
        }
        let off: Vec<u32> = todo
            .iter()
            .filter(|(key, i, _)| !tiers.host_has(*key, &tokens[i * bs..(i + 1) * bs]))
            .map(|&(.., b)| b)
            .collect();
        if let Some(Err(e)) = self.device.as_ref().map(|d| d.to_host(&off)) {
            tracing::warn!(
                pages = off.len(),
                "a preempted sequence's KV could not leave the device: {e}"
            );
            return false;
        }
        let per_page = bs * self.width;
        let tiers = self.tiers.as_mut().expect("checked above");
        let mut kept = true;
        for (key, i, b) in todo {
            let data = match tiers.values() {
                true => segments(&self.layers, per_page, b),
                false => Vec::new(),
            };
            kept &= tiers.swap(Evicted {
                key,
                tokens: &tokens[i * bs..(i + 1) * bs],
                hits: self.pool.hits(b),
                data: &data,
            });
        }
        kept
    }

    /// Loads into the pool what the tiers hold of the chain of `tokens`' whole blocks from
    /// `root` that the pool lacks: group 0's blocks from the first, each windowed group's
    /// within its window of where the chain ends. Returns the pages it holds (those of the
    /// chain it found in the pool, so loading cannot evict them, and those it loaded) for the
    /// caller to release once it has shared them.
    pub(super) fn restore(&mut self, (seed, root): (u64, u64), tokens: &[u32]) -> Vec<u32> {
        let Some(tiers) = self.tiers.as_mut() else {
            return Vec::new();
        };
        let bs = self.block_size;
        let mut hashes = Vec::new();
        let mut parent = root;
        for block in tokens.chunks_exact(bs) {
            let h = crate::prefix::chain(seed, parent, block);
            let here = self.pool.find(0, h, block).is_some() || tiers.find((0, h), block).is_some();
            if !here {
                break;
            }
            hashes.push(h);
            parent = h;
        }
        let mut held = Vec::new();
        let m = self.restore_group(0, 0, &hashes, tokens, &mut held);
        for g in 1..self.groups.len() {
            let lo = self.first_kept(g, m * bs);
            self.restore_group(g, lo, &hashes[..m], tokens, &mut held);
        }
        held
    }

    /// Group `g`'s blocks `from..` of the chain `hashes`: pinned where the pool has them,
    /// loaded where a tier has them, until one is neither or no page is free. Returns where
    /// it stopped.
    fn restore_group(
        &mut self,
        g: usize,
        from: usize,
        hashes: &[u64],
        tokens: &[u32],
        held: &mut Vec<u32>,
    ) -> usize {
        let bs = self.block_size;
        let mut loaded = Vec::new();
        let mut end = hashes.len();
        for (i, &h) in hashes.iter().enumerate().skip(from) {
            let block = &tokens[i * bs..(i + 1) * bs];
            if let Some(b) = self.pool.find(g as u32, h, block) {
                self.pool.retain(b);
                held.push(b);
                continue;
            }
            match (self.free_blocks() > 0).then(|| self.load(g, h, block)) {
                Some(Some(l)) => loaded.push((l, i)),
                _ => {
                    end = i;
                    break;
                }
            }
        }
        self.register_loaded(g, hashes, tokens, loaded, held);
        end
    }

    /// Pages `loaded` (each with its block's place in the chain) hold group `g`'s blocks: the
    /// ones taken from G2 copied (on a device: the copies started waited for) and checked, and
    /// the ones taken from G3 read and checked, each kind all at once on the kernel threads; on
    /// a device, the pages that came into the host cache copied onto it; then registered and
    /// held. Released unregistered when a check or the device fails (computed again).
    fn register_loaded(
        &mut self,
        g: usize,
        hashes: &[u64],
        tokens: &[u32],
        loaded: Vec<(Loaded, usize)>,
        held: &mut Vec<u32>,
    ) {
        let bs = self.block_size;
        let per_page = bs * self.width;
        let of = |from: fn(&From) -> bool| -> Vec<(u32, usize, Option<usize>)> {
            loaded
                .iter()
                .filter(|(l, _)| from(&l.from))
                .map(|(l, i)| {
                    (
                        l.page,
                        *i,
                        if let From::G2(at) = l.from {
                            Some(at)
                        } else {
                            None
                        },
                    )
                })
                .collect()
        };
        let (g2, g3) = (
            of(|f| matches!(f, From::G2(_))),
            of(|f| matches!(f, From::G3)),
        );
        let tiers = self.tiers.as_mut().expect("loading with tiers");
        let started: Vec<(Key, usize)> = g2
            .iter()
            .map(|&(_, i, at)| ((g as u32, hashes[i]), at.expect("G2")))
            .collect();
        let checked = match &self.device {
            Some(_) => tiers.finish_started(&started, None),
            None => {
                let pages: Vec<u32> = g2.iter().map(|&(b, ..)| b).collect();
                let mut outs = pages_mut(&mut self.layers, per_page, &pages);
                tiers.finish_started(&started, Some(&mut outs))
            }
        };
        let taken: Vec<(Key, &[u32])> = g3
            .iter()
            .map(|&(_, i, _)| ((g as u32, hashes[i]), &tokens[i * bs..(i + 1) * bs]))
            .collect();
        let pages: Vec<u32> = g3.iter().map(|&(b, ..)| b).collect();
        let read =
            tiers.finish_taken_disk(&taken, &mut pages_mut(&mut self.layers, per_page, &pages));
        let device_ok = match self.device.clone() {
            Some(d) => {
                let t0 = std::time::Instant::now();
                let copy: Vec<u32> = loaded
                    .iter()
                    .filter(|(l, _)| !matches!(l.from, From::G2(_)))
                    .map(|(l, _)| l.page)
                    .collect();
                let done = d.sync().and_then(|()| d.to_device(&copy));
                if !started.is_empty() {
                    tiers.add_host_load_time(t0.elapsed().as_secs_f64());
                }
                done.map_err(|e| {
                    tracing::warn!(
                        pages = loaded.len(),
                        "KV pages could not reach the device: {e}"
                    )
                })
                .is_ok()
            }
            None => true,
        };
        let (mut checked, mut read) = (checked.into_iter(), read.into_iter());
        for (l, i) in loaded {
            let good = match l.from {
                From::G2(_) => checked.next() == Some(true),
                From::G3 => read.next() == Some(true),
                From::Here => true,
            };
            if !(device_ok && good) {
                self.pool.release(l.page);
                continue;
            }
            let block = &tokens[i * bs..(i + 1) * bs];
            self.pool
                .register_with(g as u32, l.page, hashes[i], block, l.hits);
            held.push(l.page);
        }
    }

    /// Takes group `g`'s block named `hash` holding `tokens` from a tier for a fresh page, not
    /// yet registered; `None` when no tier has a good copy. A block in G2 or in G3's files is
    /// only taken here (on a device, a G2 block's copy there starts):
    /// [`KvCache::register_loaded`] copies and checks them all at once. Tiers of only their
    /// accounting load here.
    fn load(&mut self, g: usize, hash: u64, tokens: &[u32]) -> Option<Loaded> {
        let b = self.alloc()?;
        let key = (g as u32, hash);
        let tiers = self.tiers.as_mut().expect("restoring with tiers");
        // Tiers without values (the mock's, the simulator's) move only their accounting: each
        // block is loaded here, its time the timing model's.
        if tiers.values() {
            let onto = self.device.as_deref().map(|d| (d, b));
            let taken = match tiers.start(key, tokens, onto) {
                Some(Some((hits, at))) => Some((hits, From::G2(at))),
                Some(None) => {
                    self.pool.release(b);
                    return None;
                }
                None => tiers.take_disk(key, tokens).map(|hits| (hits, From::G3)),
            };
            if let Some((hits, from)) = taken {
                return Some(Loaded {
                    page: b,
                    hits,
                    from,
                });
            }
        }
        let per_page = self.block_size * self.width;
        let mut out = match tiers.values() {
            true => segments_mut(&mut self.layers, per_page, b),
            false => Vec::new(),
        };
        match tiers.load(key, tokens, &mut out) {
            Some((tier, hits)) => {
                debug_assert_ne!(tier, Tier::Pool);
                Some(Loaded {
                    page: b,
                    hits,
                    from: From::Here,
                })
            }
            None => {
                self.pool.release(b);
                None
            }
        }
    }
}

/// A block loaded from a tier into a page of the pool.
struct Loaded {
    page: u32,
    /// Times it was shared from a cache before.
    hits: u32,
    from: From,
}

/// Where a [`Loaded`] block's bytes still are.
enum From {
    /// In G2's arena at this offset, still to copy and check (on a device: its copy started).
    G2(usize),
    /// In G3's file, still to read and check.
    G3,
    /// In its page of the host cache already, checked.
    Here,
}
