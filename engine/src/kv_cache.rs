//! Paged KV cache: a pool of fixed-size blocks shared by all sequences, and per-sequence block
//! tables that map token positions to cache slots.
//!
//! A block is owned by at most one [`BlockTable`] at a time; tables are not `Clone`, and
//! [`KvCache::release`] consumes a table, so every block is freed exactly once.

use std::cell::UnsafeCell;
use std::sync::Arc;

use half::f16;

use crate::error::{EngineError, Result};
use crate::prefix::{BlockPool, PoolCounts};

/// The blocks one sequence holds, in token order: token `j` lives in `blocks[j / block_size]`.
#[derive(Debug, Default)]
pub struct BlockTable {
    blocks: Vec<u32>,
}

impl BlockTable {
    /// Block ids, in token order.
    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }
}

/// One pool of f16 values whose memory can be handed to a device (an RDMA registration):
/// the device side holds [`PoolBuf::owner`], so the memory is freed only when the cache and
/// every registration are gone — whichever goes last.
pub struct PoolBuf(Arc<PoolMem>);

struct PoolMem(UnsafeCell<kernels::mem::HugeBuf<f16>>);

// SAFETY: the values are read and written only through the one `PoolBuf` (not `Clone`), by
// `&self`/`&mut self` borrows as for a `Vec`; the other holders of the `Arc` (see
// `PoolBuf::owner`) only keep the allocation alive and never touch its contents from Rust.
unsafe impl Sync for PoolMem {}

impl PoolBuf {
    fn zeroed(n: usize) -> PoolBuf {
        // In huge pages where the OS gives them (attention streams the cache as the matmuls
        // stream the weights).
        let mut v = kernels::mem::HugeBuf::<f16>::zeroed(n);
        // The pool's memory is claimed now, one write a page, not page by page as blocks are
        // first written: a worker's footprint is fixed from its start (a machine without the
        // memory fails it at once, not under load later), and its RSS stays flat thereafter.
        let page = 4096 / std::mem::size_of::<f16>();
        for i in (0..n).step_by(page) {
            v[i] = std::hint::black_box(f16::ZERO);
        }
        PoolBuf(Arc::new(PoolMem(UnsafeCell::new(v))))
    }

    /// Keeps this pool's memory allocated (and unmoved: it never grows) while held.
    pub fn owner(&self) -> Arc<dyn Send + Sync> {
        self.0.clone()
    }
}

impl std::ops::Deref for PoolBuf {
    type Target = [f16];
    fn deref(&self) -> &[f16] {
        // SAFETY: see `PoolMem`: this `PoolBuf` is the only way to its contents, and `&self`
        // excludes a `&mut` from `deref_mut`.
        unsafe { &*self.0 .0.get() }
    }
}

impl std::ops::DerefMut for PoolBuf {
    fn deref_mut(&mut self) -> &mut [f16] {
        // SAFETY: as for `deref`; `&mut self` makes this borrow unique.
        unsafe { &mut *self.0 .0.get() }
    }
}

/// One layer's keys and values, `[num_blocks, block_size, n_kv_heads * head_dim]` as f16.
pub struct LayerKv {
    /// Keys.
    pub k: PoolBuf,
    /// Values.
    pub v: PoolBuf,
}

/// The KV cache of all layers plus its block pool (with the prefix cache, see
/// [`crate::prefix`]).
pub struct KvCache {
    block_size: usize,
    width: usize,
    layers: Vec<LayerKv>,
    pool: BlockPool,
}

impl KvCache {
    /// A cache of `num_blocks` blocks of `block_size` tokens for `n_layers` layers of `width`
    /// (= KV heads × head dim) values per token.
    pub fn new(
        n_layers: usize,
        width: usize,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<KvCache> {
        if block_size == 0 || num_blocks == 0 {
            return Err(EngineError::InvalidRequest(
                "KV cache needs at least one block of at least one token".into(),
            ));
        }
        let per_layer = num_blocks * block_size * width;
        let layers = (0..n_layers)
            .map(|_| LayerKv {
                k: PoolBuf::zeroed(per_layer),
                v: PoolBuf::zeroed(per_layer),
            })
            .collect();
        Ok(KvCache {
            block_size,
            width,
            layers,
            pool: BlockPool::new(num_blocks),
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    /// Values per token per layer (KV heads × head dim).
    pub fn width(&self) -> usize {
        self.width
    }
    /// Blocks in the pool.
    pub fn total_blocks(&self) -> usize {
        self.pool.total()
    }
    /// Blocks not held by any table: free, or cached and evictable.
    pub fn free_blocks(&self) -> usize {
        self.pool.available()
    }
    /// Prefixes registered and forgotten since the last call (see [`BlockPool::take_events`]).
    pub fn take_events(&mut self) -> Vec<(bool, u64)> {
        self.pool.take_events()
    }

    /// Blocks by state (held, cached and unreferenced, free).
    pub fn block_counts(&self) -> PoolCounts {
        self.pool.counts()
    }
    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }
    /// One layer's storage.
    pub fn layer(&self, l: usize) -> &LayerKv {
        &self.layers[l]
    }
    /// One layer's storage, writable.
    pub fn layer_mut(&mut self, l: usize) -> &mut LayerKv {
        &mut self.layers[l]
    }

    /// Grows `table` to cover `tokens` tokens. All or nothing: on failure the table is unchanged.
    pub fn reserve(&mut self, table: &mut BlockTable, tokens: usize) -> Result<()> {
        let need = self.blocks_for(tokens).saturating_sub(table.blocks.len());
        if need > self.pool.available() {
            return Err(EngineError::OutOfBlocks(format!(
                "{need} more blocks needed for {tokens} tokens, {} free of {}",
                self.pool.available(),
                self.total_blocks()
            )));
        }
        for _ in 0..need {
            table.blocks.push(self.pool.alloc().expect("counted above"));
        }
        Ok(())
    }

    /// Returns every block of `table` to the pool (a block holding a known prefix stays cached
    /// until its space is needed). Last block first: among a sequence's cached blocks the
    /// tail is evicted before the head, so no cached block outlives the parent it extends
    /// (a block whose parent is gone can never be found again).
    pub fn release(&mut self, table: BlockTable) {
        for b in table.blocks.into_iter().rev() {
            self.pool.release(b);
        }
    }

    /// Cached blocks evicted for new owners so far.
    pub fn evicted_blocks(&self) -> u64 {
        self.pool.evicted()
    }

    /// Starts an empty `table` with the cached blocks holding the longest prefix of `tokens`
    /// in whole blocks (shared, not copied); returns how many tokens they cover and the last
    /// block's hash (where registration continues).
    pub fn share_prefix(
        &mut self,
        seed: u64,
        table: &mut BlockTable,
        tokens: &[u32],
    ) -> (usize, u64) {
        debug_assert!(table.blocks.is_empty());
        let (found, last) = self.pool.lookup(seed, self.block_size, tokens);
        for &b in &found {
            self.pool.retain(b);
        }
        table.blocks = found;
        (table.blocks.len() * self.block_size, last)
    }

    /// Registers the blocks of `table` that `computed` tokens of `tokens` fill, from block
    /// `chain.0` on, whose parent hash is `chain.1`; advances `chain`.
    pub fn register(
        &mut self,
        seed: u64,
        table: &BlockTable,
        tokens: &[u32],
        computed: usize,
        chain: &mut (usize, u64),
    ) {
        let bs = self.block_size;
        while (chain.0 + 1) * bs <= computed.min(tokens.len()) {
            let i = chain.0;
            let hash = self.pool.register(
                seed,
                table.blocks[i],
                chain.1,
                &tokens[i * bs..(i + 1) * bs],
            );
            *chain = (i + 1, hash);
        }
    }

    /// Appends tokens `0..n` of a sequence's layer `layer` to `out` as little-endian f16: all
    /// keys (`n * width` values) followed by all values. This is the wire layout of KV transfer.
    pub fn read_tokens(&self, table: &[u32], layer: usize, n: usize, out: &mut Vec<u8>) {
        self.read_range(table, layer, 0..n, out)
    }

    /// [`KvCache::read_tokens`] for the tokens in `range` only (a delta transfer: the receiver
    /// holds the tokens before it).
    pub fn read_range(
        &self,
        table: &[u32],
        layer: usize,
        range: std::ops::Range<usize>,
        out: &mut Vec<u8>,
    ) {
        let w = self.width;
        let lk = &self.layers[layer];
        out.reserve(4 * range.len() * w);
        for src in [&lk.k, &lk.v] {
            for (slot, run) in self.runs(table, range.clone()) {
                extend_le(out, &src[slot * w..(slot + run) * w]);
            }
        }
    }

    /// The cache slots of `range`'s tokens as (first slot, tokens) runs: a block's tokens are
    /// contiguous in the pool.
    fn runs(&self, table: &[u32], range: std::ops::Range<usize>) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        let mut p = range.start;
        while p < range.end {
            let slot = self.slot(table, p).expect("table covers the tokens");
            let run = (self.block_size - p % self.block_size).min(range.end - p);
            out.push((slot, run));
            p += run;
        }
        out
    }

    /// Writes tokens `0..n` of layer `layer` from `data` (the layout of [`KvCache::read_tokens`]).
    pub fn write_tokens(
        &mut self,
        table: &[u32],
        layer: usize,
        n: usize,
        data: &[u8],
    ) -> Result<()> {
        self.write_range(table, layer, 0..n, data)
    }

    /// [`KvCache::write_tokens`] for the tokens in `range` (the layout of
    /// [`KvCache::read_range`]).
    pub fn write_range(
        &mut self,
        table: &[u32],
        layer: usize,
        range: std::ops::Range<usize>,
        data: &[u8],
    ) -> Result<()> {
        let (w, n) = (self.width, range.len());
        if data.len() != 4 * n * w {
            return Err(EngineError::InvalidRequest(format!(
                "layer {layer}: {} bytes of KV for {n} tokens, expected {}",
                data.len(),
                4 * n * w
            )));
        }
        if self.blocks_for(range.end) > table.len() {
            return Err(EngineError::InvalidRequest(format!(
                "tokens up to {} do not fit in {} blocks",
                range.end,
                table.len()
            )));
        }
        let runs = self.runs(table, range);
        let lk = &mut self.layers[layer];
        for (half, dst) in [&mut lk.k, &mut lk.v].into_iter().enumerate() {
            let mut src = &data[half * n * w * 2..(half + 1) * n * w * 2];
            for &(slot, run) in &runs {
                let (now, rest) = src.split_at(run * w * 2);
                copy_le(&mut dst[slot * w..(slot + run) * w], now);
                src = rest;
            }
        }
        Ok(())
    }

    /// What keeps every pool's memory allocated (hand it to whatever registers the pools).
    pub fn owners(&self) -> Vec<Arc<dyn Send + Sync>> {
        self.layers
            .iter()
            .flat_map(|l| [l.k.owner(), l.v.owner()])
            .collect()
    }

    /// The pools as raw memory, for registration with an RDMA device: per layer, (address,
    /// bytes) of the keys and of the values. The pools never move or reallocate after `new`;
    /// [`KvCache::owners`] keeps them allocated.
    pub fn raw_regions(&mut self) -> Vec<[(usize, usize); 2]> {
        self.layers
            .iter_mut()
            .map(|l| {
                [
                    (l.k.as_mut_ptr() as usize, l.k.len() * 2),
                    (l.v.as_mut_ptr() as usize, l.v.len() * 2),
                ]
            })
            .collect()
    }

    /// Bytes of one block in one pool.
    pub fn block_bytes(&self) -> usize {
        self.block_size * self.width * 2
    }

    /// The cache slot (block × block_size + offset) of token `pos` of a sequence.
    pub fn slot(&self, table: &[u32], pos: usize) -> Option<usize> {
        table
            .get(pos / self.block_size)
            .map(|&b| b as usize * self.block_size + pos % self.block_size)
    }
}

/// Appends `src` as little-endian f16 bytes (one copy on little-endian machines).
fn extend_le(out: &mut Vec<u8>, src: &[f16]) {
    if cfg!(target_endian = "little") {
        out.extend_from_slice(bytemuck::cast_slice(src));
    } else {
        out.extend(src.iter().flat_map(|h| h.to_bits().to_le_bytes()));
    }
}

/// Fills `dst` from little-endian f16 bytes (one copy on little-endian machines).
fn copy_le(dst: &mut [f16], src: &[u8]) {
    if cfg!(target_endian = "little") {
        bytemuck::cast_slice_mut::<f16, u8>(dst).copy_from_slice(src);
    } else {
        for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
            *d = f16::from_bits(u16::from_le_bytes([c[0], c[1]]));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_reserved_all_or_nothing_and_freed_once() {
        let mut kv = KvCache::new(2, 8, 16, 4).unwrap();
        let mut a = BlockTable::default();
        kv.reserve(&mut a, 33).unwrap();
        assert_eq!(a.blocks().len(), 3);
        assert_eq!(kv.free_blocks(), 1);
        let mut b = BlockTable::default();
        assert!(kv.reserve(&mut b, 20).is_err());
        assert_eq!(b.blocks().len(), 0);
        assert_eq!(kv.free_blocks(), 1);
        kv.reserve(&mut b, 16).unwrap();
        assert_eq!(
            kv.slot(a.blocks(), 17),
            Some(a.blocks()[1] as usize * 16 + 1)
        );
        assert_eq!(kv.slot(a.blocks(), 48), None);
        kv.release(a);
        kv.release(b);
        assert_eq!(kv.free_blocks(), 4);
    }

    #[test]
    fn a_released_sequences_tail_is_evicted_before_its_head() {
        let mut kv = KvCache::new(1, 2, 2, 4).unwrap();
        let (seed, tokens) = (9, [1, 2, 3, 4, 5, 6]);
        let mut a = BlockTable::default();
        kv.reserve(&mut a, 6).unwrap();
        let mut chain = (0, crate::prefix::ROOT);
        kv.register(seed, &a, &tokens, 6, &mut chain);
        kv.release(a);
        assert_eq!(kv.block_counts().cached, 3);
        // One block is needed: the last of the three goes, the first two still make a prefix.
        let mut b = BlockTable::default();
        kv.reserve(&mut b, 4).unwrap();
        let mut c = BlockTable::default();
        assert_eq!(kv.share_prefix(seed, &mut c, &tokens).0, 4);
        assert_eq!(kv.evicted_blocks(), 1);
        kv.release(b);
        kv.release(c);
    }
}
