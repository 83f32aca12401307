//! Paged KV cache: a pool of fixed-size blocks shared by all sequences, and per-sequence block
//! tables that map token positions to cache slots.
//!
//! A block is held by the block tables that share it (a cached prefix is shared by every
//! sequence starting with it), reference counted in the pool ([`crate::prefix::BlockPool`]);
//! tables are not `Clone`, and [`KvCache::release`] consumes a table, so each table gives back
//! each of its blocks exactly once. A block nobody holds is free, or cached and evictable.

use std::cell::UnsafeCell;
use std::sync::Arc;

use half::f16;

use crate::error::{EngineError, Result};
use crate::prefix::{BlockPool, PoolCounts};

/// A block-table entry for a block this sequence no longer holds: its tokens are outside
/// every window of the group's layers.
const GONE: u32 = u32::MAX;

/// One layer group's blocks of a sequence, in token order: token `j` lives in
/// `blocks[j / block_size]` (`GONE` before the group's window).
#[derive(Debug, Default)]
struct GroupBlocks {
    blocks: Vec<u32>,
    /// Blocks this sequence may still take without asking (its reservation, see
    /// [`KvCache::reserve`]).
    promised: usize,
    /// Tokens before this one may be missing from the group's blocks (a transfer sends a
    /// windowed layer only its window): blocks before it are never registered as a prefix.
    valid_from: usize,
}

/// The blocks one sequence holds: one table per layer group (see [`KvCache`]).
#[derive(Debug, Default)]
pub struct BlockTable {
    groups: Vec<GroupBlocks>,
}

impl BlockTable {
    /// Group 0's block ids, in token order: the layers that see every token (on a model whose
    /// layers all do, the whole table).
    pub fn blocks(&self) -> &[u32] {
        self.group(0)
    }

    /// Layer group `g`'s block ids, in token order (`u32::MAX` where the sequence no longer
    /// holds a block: its tokens are outside the group's window).
    pub fn group(&self, g: usize) -> &[u32] {
        self.groups.get(g).map_or(&[], |t| &t.blocks)
    }

    /// Blocks held, over all groups.
    pub fn held(&self) -> usize {
        let held = |t: &GroupBlocks| t.blocks.iter().filter(|&&b| b != GONE).count();
        self.groups.iter().map(held).sum()
    }

    /// Blocks held or promised (see [`KvCache::reserve`]): what the sequence's reservation
    /// keeps from others, over all groups.
    pub fn reserved(&self) -> usize {
        self.held() + self.groups.iter().map(|t| t.promised).sum::<usize>()
    }
}

/// Layers that keep the same tokens: the same attention window (`None`: every token). A
/// page of the pool holds one block of tokens of one group's layers.
#[derive(Debug, Clone)]
struct Group {
    window: Option<usize>,
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

/// One storage position's keys and values, `[pages, block_size, n_kv_heads * head_dim]` as
/// f16: the `j`th layer of every group lives here, each group in its own pages.
pub struct LayerKv {
    /// Keys.
    pub k: PoolBuf,
    /// Values.
    pub v: PoolBuf,
}

/// The KV cache of all layers plus its page pool (with the prefix cache, see
/// [`crate::prefix`]).
///
/// Layers are cut into groups of equal size whose layers share an attention window (Gemma 3
/// 270M's 18 layers: one group of its 3 global layers, five of 3 sliding-window layers each;
/// a model without windows: one group of all layers). A page holds one block of tokens of one
/// group, so every page is the same size and all groups draw on one pool. Each sequence has a
/// block table per group; a windowed group's blocks leave the table (back to the pool, cached
/// when they hold a registered prefix) as soon as no later query's window reaches them, so a
/// long sequence holds a window's worth of pages in those groups instead of all of them.
pub struct KvCache {
    block_size: usize,
    width: usize,
    /// One per position in a group: layer `l` is stored at `layer_at[l].1`.
    layers: Vec<LayerKv>,
    groups: Vec<Group>,
    /// Each layer's (group, storage position).
    layer_at: Vec<(usize, usize)>,
    /// Most tokens of one sequence a forward step runs (what a windowed group must hold beside
    /// its window).
    max_chunk: usize,
    pool: BlockPool,
    /// Pages promised to reservations and not taken yet.
    promised: usize,
    /// Host memory and disk below the pool, when configured ([`crate::tiers`]).
    tiers: Option<crate::tiers::Tiers>,
    /// Where the pages live besides this host memory (a GPU's pool): the tiers copy through
    /// it.
    device: Option<Arc<dyn crate::forward::PageDevice>>,
    /// Blocks computed here on their way to the cluster store, when it takes them.
    store_out: Option<store::StoreOut>,
}

/// The groups of layers with windows `windows` (see [`KvCache`]): group 0 sees the most
/// tokens. Returns the groups and each layer's (group, position in its group).
fn groups_of(windows: &[Option<usize>]) -> (Vec<Group>, Vec<(usize, usize)>) {
    let mut classes: Vec<Option<usize>> = windows.to_vec();
    classes.sort_by_key(|w| std::cmp::Reverse(w.unwrap_or(usize::MAX)));
    classes.dedup();
    let count = |c: &Option<usize>| windows.iter().filter(|w| *w == c).count();
    let size = classes.iter().map(count).fold(0, gcd).max(1);
    let (mut groups, mut at) = (Vec::new(), vec![(0, 0); windows.len()]);
    for c in &classes {
        let mine: Vec<usize> = (0..windows.len()).filter(|&l| windows[l] == *c).collect();
        for chunk in mine.chunks(size) {
            for (j, &l) in chunk.iter().enumerate() {
                at[l] = (groups.len(), j);
            }
            groups.push(Group { window: *c });
        }
    }
    if groups.is_empty() {
        groups.push(Group { window: None });
    }
    (groups, at)
}

/// How many groups layers with windows `windows` make (see [`KvCache`]).
pub fn group_count(windows: &[Option<usize>]) -> usize {
    groups_of(windows).0.len()
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

impl KvCache {
    /// A cache of `num_blocks` blocks of `block_size` tokens for `n_layers` layers of `width`
    /// (= KV heads × head dim) values per token, every layer seeing every token.
    pub fn new(
        n_layers: usize,
        width: usize,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<KvCache> {
        KvCache::with_windows(&vec![None; n_layers], width, block_size, num_blocks, 1)
    }

    /// A cache for layers with attention windows `windows` (one per layer), the memory of
    /// `num_blocks` blocks of every layer, for steps of at most `max_chunk` tokens a sequence.
    pub fn with_windows(
        windows: &[Option<usize>],
        width: usize,
        block_size: usize,
        num_blocks: usize,
        max_chunk: usize,
    ) -> Result<KvCache> {
        if block_size == 0 || num_blocks == 0 {
            return Err(EngineError::Config(
                "KV cache needs at least one block of at least one token".into(),
            ));
        }
        let (groups, layer_at) = groups_of(windows);
        let per_group = windows.len() / groups.len();
        let pages = num_blocks * groups.len();
        let per_layer = pages * block_size * width;
        let layers = (0..per_group)
            .map(|_| LayerKv {
                k: PoolBuf::zeroed(per_layer),
                v: PoolBuf::zeroed(per_layer),
            })
            .collect();
        Ok(KvCache {
            block_size,
            width,
            layers,
            groups,
            layer_at,
            max_chunk: max_chunk.max(1),
            pool: BlockPool::new(pages),
            promised: 0,
            tiers: None,
            device: None,
            store_out: None,
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
    /// Pages in the pool (one block of one layer group each).
    pub fn total_blocks(&self) -> usize {
        self.pool.total()
    }
    /// Pages a new reservation can take: free, or cached and evictable, less those promised.
    pub fn free_blocks(&self) -> usize {
        self.pool.available().saturating_sub(self.promised)
    }
    /// Layer groups (see [`KvCache`]).
    pub fn groups(&self) -> usize {
        self.groups.len()
    }
    /// The group layer `l` belongs to.
    pub fn group_of(&self, l: usize) -> usize {
        self.layer_at[l].0
    }
    /// Prefixes registered and forgotten since the last call (see [`BlockPool::take_events`]),
    /// then the tiers' (each tier's in order).
    pub fn take_events(&mut self) -> Vec<types::KvEvent> {
        let mut events = self.pool.take_events();
        if let Some(t) = self.tiers.as_mut() {
            events.extend(t.take_events());
        }
        events
    }

    /// Pages by state (held, cached and unreferenced, free).
    pub fn block_counts(&self) -> PoolCounts {
        self.pool.counts()
    }
    /// Blocks needed to hold `tokens` tokens in one group.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }
    /// Tokens `table`'s groups that keep every token can write without taking a page: what a
    /// step's drafts may fill (under optimistic admission they never take pages).
    pub fn held_tokens(&self, table: &BlockTable) -> usize {
        (0..self.groups.len())
            .filter(|&g| self.groups[g].window.is_none())
            .map(|g| {
                let t = table.groups.get(g).map_or(&[][..], |t| &t.blocks[..]);
                t.iter().take_while(|&&b| b != GONE).count() * self.block_size
            })
            .min()
            .unwrap_or(usize::MAX)
    }

    /// Pages a sequence of `tokens` tokens holds at most, over all groups.
    pub fn pages_for(&self, tokens: usize) -> usize {
        (0..self.groups.len()).map(|g| self.quota(g, tokens)).sum()
    }
    /// One layer's storage.
    pub fn layer(&self, l: usize) -> &LayerKv {
        &self.layers[self.layer_at[l].1]
    }
    /// One layer's storage, writable.
    pub fn layer_mut(&mut self, l: usize) -> &mut LayerKv {
        &mut self.layers[self.layer_at[l].1]
    }

    /// Blocks group `g` of a sequence of `tokens` tokens holds at most: all of them, or on a
    /// windowed group those a step's queries reach — the window behind a chunk and the chunk,
    /// one more for a window that does not start on a block.
    fn quota(&self, g: usize, tokens: usize) -> usize {
        let n = self.blocks_for(tokens);
        match self.groups[g].window {
            None => n,
            Some(w) => n.min((w + self.max_chunk - 1).div_ceil(self.block_size) + 1),
        }
    }

    /// The first block of group `g` a query at `pos` (or any later one) reads.
    fn first_kept(&self, g: usize, pos: usize) -> usize {
        kernels::Query::first_in_window(pos, self.groups[g].window) / self.block_size
    }

    /// Reserves `table` the pages of `tokens` tokens: a full group's blocks now, a windowed
    /// group's as a promise taken as its tokens come ([`KvCache::ensure`]). All or nothing: on
    /// failure the table is unchanged.
    pub fn reserve(&mut self, table: &mut BlockTable, tokens: usize) -> Result<()> {
        table
            .groups
            .resize_with(self.groups.len(), Default::default);
        let (mut now, mut promise) = (vec![0; self.groups.len()], vec![0; self.groups.len()]);
        for (g, t) in table.groups.iter().enumerate() {
            let quota = self.quota(g, tokens);
            match self.groups[g].window {
                None => now[g] = quota.saturating_sub(t.blocks.len()),
                Some(_) => {
                    let held = t.blocks.iter().filter(|&&b| b != GONE).count();
                    promise[g] = quota.saturating_sub(held + t.promised);
                }
            }
        }
        let need: usize = now.iter().sum::<usize>() + promise.iter().sum::<usize>();
        if need > self.free_blocks() {
            return Err(EngineError::OutOfBlocks(format!(
                "{need} more KV pages needed for {tokens} tokens, {} free of {}",
                self.free_blocks(),
                self.total_blocks()
            )));
        }
        for (g, t) in table.groups.iter_mut().enumerate() {
            for _ in 0..now[g] {
                t.blocks.push(self.alloc().expect("counted above"));
            }
            t.promised += promise[g];
            self.promised += promise[g];
        }
        Ok(())
    }

    /// Gives `table`'s windowed groups the blocks a step over tokens `start..end` writes and
    /// reads, from the table's reservation.
    pub fn ensure(&mut self, table: &mut BlockTable, start: usize, end: usize) -> Result<()> {
        let hi = self.blocks_for(end);
        for g in 0..self.groups.len() {
            let t = &mut table.groups[g];
            // A full group's blocks were all taken at reservation.
            if self.groups[g].window.is_none() && t.blocks.len() >= hi {
                continue;
            }
            let lo = self.first_kept(g, start);
            if t.blocks.len() < hi {
                t.blocks.resize(hi, GONE);
            }
            for i in lo..hi {
                if t.blocks[i] != GONE {
                    continue;
                }
                // Without a promise left (a trimmed block another sequence still shares did
                // not come back), only a page nobody was promised will do.
                let promised = t.promised > 0;
                if !promised && self.pool.available() <= self.promised {
                    return Err(EngineError::OutOfBlocks(format!(
                        "group {g} needs block {i} for tokens {start}..{end}: no page free now"
                    )));
                }
                t.blocks[i] = self.alloc().ok_or_else(|| {
                    EngineError::OutOfBlocks(format!("no KV page for group {g}'s block {i}"))
                })?;
                if promised {
                    t.promised -= 1;
                    self.promised -= 1;
                }
            }
        }
        Ok(())
    }

    /// Returns the blocks of `table`'s windowed groups that no query at `next` or later reads
    /// (cached where they hold a registered prefix); they go back to the table's promise — a
    /// block another sequence still shares frees no page, so it comes back only if a page is
    /// free (else the table asks [`KvCache::ensure`] for one when it needs it).
    pub fn trim(&mut self, table: &mut BlockTable, next: usize) {
        for g in 0..table.groups.len() {
            let lo = self.first_kept(g, next).min(table.groups[g].blocks.len());
            let t = &mut table.groups[g];
            // Blocks before the first one gone went at an earlier trim (or were never held).
            for b in t.blocks[..lo].iter_mut().rev().take_while(|b| **b != GONE) {
                let freed = self.pool.release(*b);
                *b = GONE;
                if freed || self.pool.available() > self.promised {
                    t.promised += 1;
                    self.promised += 1;
                }
            }
        }
    }

    /// Returns every block of `table` to the pool (a block holding a known prefix stays cached
    /// until its space is needed) and its promise. Last block first: among a sequence's cached
    /// blocks the tail is evicted before the head, so no cached block outlives the parent it
    /// extends (a block whose parent is gone can never be found again).
    pub fn release(&mut self, table: BlockTable) {
        let len = table
            .groups
            .iter()
            .map(|t| t.blocks.len())
            .max()
            .unwrap_or(0);
        for i in (0..len).rev() {
            for t in &table.groups {
                match t.blocks.get(i) {
                    Some(&b) if b != GONE => {
                        self.pool.release(b);
                    }
                    _ => {}
                }
            }
        }
        self.promised -= table.groups.iter().map(|t| t.promised).sum::<usize>();
    }

    /// Cached pages evicted for new owners so far.
    pub fn evicted_blocks(&self) -> u64 {
        self.pool.evicted()
    }

    /// Starts an empty `table` with the cached blocks holding the longest prefix of `tokens`
    /// in whole blocks (shared, not copied) that every group can continue from: group 0's
    /// blocks from the first, each windowed group's within its window of the next token;
    /// returns how many tokens they cover and the last block's hash (where registration
    /// continues).
    pub fn share_prefix(
        &mut self,
        (seed, root): (u64, u64),
        table: &mut BlockTable,
        tokens: &[u32],
    ) -> (usize, u64) {
        debug_assert!(table.groups.iter().all(|t| t.blocks.is_empty()));
        let bs = self.block_size;
        // What the tiers below hold of the chain comes into the pool first, held until shared.
        let restored = self.restore((seed, root), tokens);
        let chain = self.pool.lookup(seed, root, bs, tokens);
        // Per group, each block of the chain found or not, and runs of found blocks.
        let found: Vec<Vec<Option<u32>>> = (0..self.groups.len())
            .map(|g| {
                let block = |(i, &(b, hash)): (usize, &(u32, u64))| match g {
                    0 => Some(b),
                    _ => self
                        .pool
                        .find(g as u32, hash, &tokens[i * bs..(i + 1) * bs]),
                };
                chain.iter().enumerate().map(block).collect()
            })
            .collect();
        let reaches = |g: usize, m: usize| {
            let lo = self.first_kept(g, m * bs);
            found[g][lo..m].iter().all(Option::is_some)
        };
        // Taking an unreferenced cached block takes a page others could allocate: no more of
        // them than are free of promises.
        let takes = |m: usize| {
            (0..self.groups.len())
                .flat_map(|g| found[g][self.first_kept(g, m * bs)..m].iter().flatten())
                .filter(|&&b| self.pool.unreferenced(b))
                .count()
        };
        let m = (0..=chain.len())
            .rev()
            .find(|&m| {
                (0..self.groups.len()).all(|g| reaches(g, m)) && takes(m) <= self.free_blocks()
            })
            .unwrap_or(0);
        table
            .groups
            .resize_with(self.groups.len(), Default::default);
        for (g, t) in table.groups.iter_mut().enumerate() {
            let lo = self.first_kept(g, m * bs);
            t.blocks = vec![GONE; lo];
            for b in found[g][lo..m].iter().flatten() {
                self.pool.retain(*b);
                t.blocks.push(*b);
            }
            t.valid_from = lo * bs;
        }
        for b in restored {
            self.pool.release(b);
        }
        let last = m.checked_sub(1).map_or(root, |i| chain[i].1);
        (m * bs, last)
    }

    /// Counts a hit on each shared block of `table` (every group's): a request admitted with
    /// them — not one that shared them and gave them back to wait — makes them worth keeping
    /// (the tiers' `hit-twice` policy).
    pub fn note_hits(&mut self, table: &BlockTable) {
        for t in &table.groups {
            for &b in t.blocks.iter().filter(|&&b| b != GONE) {
                self.pool.note_hit(b);
            }
        }
    }

    /// Registers the blocks of `table` that `computed` tokens of `tokens` fill, from block
    /// `chain.0` on, whose parent hash is `chain.1`; advances `chain`. A windowed group's
    /// block is registered where the group still holds it whole.
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
            let block = &tokens[i * bs..(i + 1) * bs];
            let hash = crate::prefix::chain(seed, chain.1, block);
            for (g, t) in table.groups.iter().enumerate() {
                match t.blocks.get(i) {
                    Some(&b) if b != GONE && i * bs >= t.valid_from => {
                        if self.pool.register_in(g as u32, b, hash, block) && g == 0 {
                            self.offer(b, hash, block);
                        }
                    }
                    _ => {}
                }
            }
            *chain = (i + 1, hash);
        }
    }

    /// KV of tokens `range` arrived for `table` (from a prefill worker): `layers`, one entry a
    /// layer in the layout of [`KvCache::read_range`]. A windowed group's blocks before the
    /// window of the next query (at `range.end`) go back, the blocks the range needs are taken,
    /// every layer's tokens are written, and a windowed group records that the tokens before
    /// its window are missing (it was sent only its window).
    pub fn write_arrived(
        &mut self,
        table: &mut BlockTable,
        range: std::ops::Range<usize>,
        layers: &[Vec<u8>],
    ) -> Result<()> {
        self.trim(table, range.end);
        self.ensure(table, range.end, range.end)?;
        for (l, data) in layers.iter().enumerate() {
            self.write_range(table, l, range.clone(), data)?;
        }
        for (g, t) in table.groups.iter_mut().enumerate() {
            let start = kernels::Query::first_in_window(range.end, self.groups[g].window);
            if start > range.start {
                t.valid_from = t.valid_from.max(start);
            }
        }
        Ok(())
    }

    /// Bytes of layer `layer`'s KV for the tokens of `range` it keeps (the layout of
    /// [`KvCache::read_range`]).
    pub fn layer_bytes(&self, layer: usize, range: std::ops::Range<usize>) -> usize {
        4 * self.kept(layer, range).len() * self.width
    }

    /// The tokens of `range` layer `layer` keeps: all of them, or on a windowed layer those in
    /// the window of a query at `range.end` (what a transfer sends: the receiver's next query
    /// is there).
    pub fn kept(&self, layer: usize, range: std::ops::Range<usize>) -> std::ops::Range<usize> {
        let w = self.groups[self.layer_at[layer].0].window;
        range
            .start
            .max(kernels::Query::first_in_window(range.end, w))..range.end
    }

    /// Appends layer `layer`'s KV of tokens `range` (those it keeps, [`KvCache::kept`]) of a
    /// sequence to `out` as little-endian f16: all keys then all values. This is the wire
    /// layout of KV transfer; a range after the first token is a delta transfer (the receiver
    /// holds the tokens before it).
    pub fn read_range(
        &self,
        table: &BlockTable,
        layer: usize,
        range: std::ops::Range<usize>,
        out: &mut Vec<u8>,
    ) {
        let range = self.kept(layer, range);
        let w = self.width;
        let lk = self.layer(layer);
        let blocks = table.group(self.layer_at[layer].0);
        out.reserve(4 * range.len() * w);
        for src in [&lk.k, &lk.v] {
            for (slot, run) in self.runs(blocks, range.clone()) {
                extend_le(out, &src[slot * w..(slot + run) * w]);
            }
        }
    }

    /// The cache slots of `range`'s tokens as (first slot, tokens) runs: a block's tokens are
    /// contiguous in the pool.
    fn runs(&self, blocks: &[u32], range: std::ops::Range<usize>) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        let mut p = range.start;
        while p < range.end {
            let slot = self.slot(blocks, p).expect("table covers the tokens");
            let run = (self.block_size - p % self.block_size).min(range.end - p);
            out.push((slot, run));
            p += run;
        }
        out
    }

    /// Writes layer `layer`'s tokens `range` (those it keeps) from `data`, the layout of
    /// [`KvCache::read_range`].
    pub fn write_range(
        &mut self,
        table: &BlockTable,
        layer: usize,
        range: std::ops::Range<usize>,
        data: &[u8],
    ) -> Result<()> {
        let range = self.kept(layer, range);
        let (w, n) = (self.width, range.len());
        if data.len() != 4 * n * w {
            return Err(EngineError::Internal(format!(
                "layer {layer}: {} bytes of KV for {n} tokens, expected {}",
                data.len(),
                4 * n * w
            )));
        }
        let blocks = table.group(self.layer_at[layer].0);
        if let Some(p) = range.clone().find(|&p| self.slot(blocks, p).is_none()) {
            return Err(EngineError::Internal(format!(
                "layer {layer}: the block table does not hold token {p}"
            )));
        }
        let runs = self.runs(blocks, range);
        let at = self.layer_at[layer].1;
        let lk = &mut self.layers[at];
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

    /// Whether every layer keeps every token in one group: what in-place (RDMA) writes need,
    /// which address one block table and whole layers.
    pub fn one_table(&self) -> bool {
        self.groups.len() == 1 && self.groups[0].window.is_none()
    }

    /// The pools as raw memory, for registration with an RDMA device: per layer, (address,
    /// bytes) of the keys and of the values, where [`KvCache::one_table`] holds (`None`
    /// otherwise). The pools never move or reallocate after `new`; [`KvCache::owners`] keeps
    /// them allocated.
    pub fn raw_regions(&mut self) -> Option<Vec<[(usize, usize); 2]>> {
        if !self.one_table() {
            return None;
        }
        let regions = self
            .layers
            .iter_mut()
            .map(|l| {
                [
                    (l.k.as_mut_ptr() as usize, l.k.len() * 2),
                    (l.v.as_mut_ptr() as usize, l.v.len() * 2),
                ]
            })
            .collect();
        Some(regions)
    }

    /// Bytes of one block in one pool.
    pub fn block_bytes(&self) -> usize {
        self.block_size * self.width * 2
    }

    /// The cache slot (block × block_size + offset) of token `pos` in one group's `blocks`.
    pub fn slot(&self, blocks: &[u32], pos: usize) -> Option<usize> {
        match blocks.get(pos / self.block_size) {
            Some(&b) if b != GONE => Some(b as usize * self.block_size + pos % self.block_size),
            _ => None,
        }
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

mod store;
mod tiered;

pub use store::{Staged, StoreBlock};

#[cfg(test)]
mod tests;
