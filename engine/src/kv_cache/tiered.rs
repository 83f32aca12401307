//! The cache's side of the tiers below the pool ([`crate::tiers`]): a cached page the pool
//! evicts is copied down before its new owner writes it, and a prefix lookup first loads what
//! the tiers hold of the prompt's chain into fresh pages, registered as the pool's own.

use types::Tier;

use super::{KvCache, LayerKv};
use crate::tiers::{Evicted, Tiers, TiersStats};

/// Page `b`'s bytes in every storage layer, keys then values, layer by layer: the layout a
/// tier stores.
fn segments(layers: &[LayerKv], per_page: usize, b: u32) -> Vec<&[u8]> {
    let r = b as usize * per_page..(b as usize + 1) * per_page;
    layers
        .iter()
        .flat_map(|l| [&l.k[r.clone()], &l.v[r.clone()]])
        .map(|s| bytemuck::cast_slice(s))
        .collect()
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
    /// lookups continue through them.
    pub fn set_tiers(&mut self, tiers: Tiers) {
        self.tiers = Some(tiers);
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
            let data = segments(&self.layers, self.block_size * self.width, b);
            tiers.store(Evicted {
                key: (f.group, f.hash),
                tokens: &f.tokens,
                hits: f.hits,
                data: &data,
            });
        }
        Some(b)
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
        for (i, &h) in hashes.iter().enumerate().skip(from) {
            let block = &tokens[i * bs..(i + 1) * bs];
            if let Some(b) = self.pool.find(g as u32, h, block) {
                self.pool.retain(b);
                held.push(b);
                continue;
            }
            if self.free_blocks() == 0 || !self.load(g, h, block, held) {
                return i;
            }
        }
        hashes.len()
    }

    /// Loads group `g`'s block named `hash` holding `tokens` from a tier into a fresh page,
    /// registered and held (pushed on `held`). `false` when no tier has a good copy.
    fn load(&mut self, g: usize, hash: u64, tokens: &[u32], held: &mut Vec<u32>) -> bool {
        let Some(b) = self.alloc() else {
            return false;
        };
        let per_page = self.block_size * self.width;
        let mut out = segments_mut(&mut self.layers, per_page, b);
        let tiers = self.tiers.as_mut().expect("restoring with tiers");
        match tiers.load((g as u32, hash), tokens, &mut out) {
            Some((tier, hits)) => {
                debug_assert_ne!(tier, Tier::Pool);
                self.pool.register_with(g as u32, b, hash, tokens, hits);
                held.push(b);
                true
            }
            None => {
                self.pool.release(b);
                false
            }
        }
    }
}
