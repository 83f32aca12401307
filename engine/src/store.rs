//! The engine's side of the cluster KV store (the `store` crate): the blocks this engine
//! computes, copied out for a worker to put, and blocks a worker fetched, staged below the
//! pool before the request that wants them is admitted (see [`crate::kv_cache`]'s `store`).

use crate::kv_cache::{Staged, StoreBlock};
use crate::scheduler::Engine;

impl Engine {
    /// What names this engine's blocks in the store: the block names' seed (`None` without a
    /// prefix cache) and the store's model key — the seed joined with a fingerprint of the
    /// weights, so two models of one name and shape never share KV.
    pub fn store_names(&self) -> Option<(u64, u64)> {
        let seed = self.prefix_seed?;
        Some((
            seed,
            seed ^ self.model.weights_fingerprint().rotate_left(29),
        ))
    }

    /// Copies every block computed from now on for the store, up to `cap` waiting (more are
    /// dropped, counted). `false` where this engine cannot take part: a model with windowed
    /// layer groups, or a pool on a GPU.
    pub fn set_store_out(&mut self, cap: usize) -> bool {
        self.prefix_seed.is_some() && self.kv.set_store_out(cap, self.model.tier_values())
    }

    /// The blocks copied out since the last call, and how many were dropped in all.
    pub fn take_store_blocks(&mut self) -> (Vec<StoreBlock>, u64) {
        self.kv.take_store_blocks()
    }

    /// The names of `prompt`'s whole blocks (all but its last token: always computed) past
    /// the leading run this engine holds: what a worker fetches from the store for it.
    pub fn store_wanted(&self, prompt: &[u32], salt: Option<&str>) -> Vec<types::BlockHash> {
        let Some(seed) = self.prefix_seed else {
            return Vec::new();
        };
        let known = &prompt[..prompt.len().saturating_sub(1)];
        let root = crate::block_hash::root(salt);
        self.kv.missing_blocks((seed, root), known)
    }

    /// Whether it can serve its cached blocks to other workers ([`Engine::export_blocks`]): a
    /// prefix cache, one table, pages in host memory.
    pub fn can_export(&self) -> bool {
        self.prefix_seed.is_some() && self.kv.exports()
    }

    /// The cached blocks of `hashes` in this engine's pool or its host tier, in order up to the
    /// first it lacks, as the store keeps them: what it serves a worker fetching them (peer
    /// fetch).
    pub fn export_blocks(&mut self, hashes: &[types::BlockHash]) -> Vec<StoreBlock> {
        match self.prefix_seed {
            Some(_) => self.kv.export(hashes, self.model.tier_values()),
            None => Vec::new(),
        }
    }

    /// Puts blocks fetched from the store in G2, where the next prefix lookup finds them;
    /// blocks that fail their checksum are dropped (computed instead), counted.
    pub fn stage_store(&mut self, blocks: &[StoreBlock]) -> Staged {
        self.kv.stage(blocks)
    }
}
