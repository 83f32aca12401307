//! KV below the pool: cached blocks the pool evicts go down to host memory (G2) and from
//! there to local disk (G3) instead of being forgotten, and a prefix lookup that runs out of
//! pool blocks continues through them (see [`crate::KvCache::share_prefix`]).
//!
//! A block is stored by the key the pool caches it under — its layer group and its chained
//! name — with its tokens (a lookup compares them, as the pool's does) and a checksum over
//! tokens and bytes, checked on every load: a block that fails it is dropped and counted, and
//! the caller computes it again. Each tier evicts least recently used; an eviction from G2
//! goes to G3. G2 is one bounded arena of page-sized slots written on the engine thread (a
//! copy); G3's files are written by a thread of their own behind a bounded queue, so a disk
//! that falls behind skips writes (counted) and never holds a step. G3 outlives the process:
//! [`Tiers::open`] re-reads its directory's blocks when they were written for the same model
//! identity and page size, and discards them otherwise.
//!
//! The tiers are inclusive: a block loaded back into the pool stays where it was found, so
//! evicting it again costs no write.

mod disk;
mod g3;
mod host;

use std::path::PathBuf;
use std::time::Instant;

use types::{BlockHash, KvEvent, Tier};

use crate::error::Result;
use crate::forward::PageDevice;

pub use types::sum::{copy_sum, Summer};

/// A stored block's key: its layer group and its prefix's name.
pub(crate) type Key = (u32, u64);

/// Which evicted pool blocks go down a tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WritePolicy {
    /// Every cached block the pool evicts.
    #[default]
    Evicted,
    /// Only blocks shared from the cache at least twice (KVBM's disk filter): one-off prompts
    /// cost no writes.
    HitTwice,
}

/// Sizes and places of the tiers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TierConfig {
    /// Bytes of host memory for G2 (0: no G2).
    pub host_bytes: u64,
    /// G3's directory, when there is one; this process must be the only one using it.
    pub disk_path: Option<PathBuf>,
    /// Bytes of G3's block files at most.
    pub disk_bytes: u64,
    /// Which evicted blocks are written down.
    pub write_policy: WritePolicy,
    /// G3 writes queued at most, each holding a page's bytes (`None`: 256 MiB of pages, at
    /// least 64); a write beyond is skipped. Tests that must not lose a write raise it.
    pub disk_queue: Option<usize>,
}

impl TierConfig {
    /// Blocks of `page_bytes` the tiers hold at most.
    pub fn capacity(&self, page_bytes: usize) -> u64 {
        let page = page_bytes.max(1) as u64;
        let disk = self
            .disk_path
            .as_ref()
            .map_or(0, |_| self.disk_bytes / page);
        self.host_bytes / page + disk
    }

    /// Whether any tier is configured.
    pub fn enabled(&self) -> bool {
        self.host_bytes > 0 || (self.disk_path.is_some() && self.disk_bytes > 0)
    }
}

/// One tier's counters since the process started (G3's blocks include those re-read at
/// start).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TierStats {
    /// Blocks held now.
    pub blocks: u64,
    /// Bytes those blocks take.
    pub bytes: u64,
    /// Blocks loaded back into the pool (prefix hits served from this tier).
    pub hits: u64,
    /// Bytes loaded into the pool.
    pub bytes_loaded: u64,
    /// Bytes written into this tier.
    pub bytes_stored: u64,
    /// Seconds spent loading.
    pub load_seconds: f64,
    /// Writes skipped because the tier fell behind (G3's queue full) or failed (a full disk).
    pub writes_skipped: u64,
    /// Blocks whose checksum failed on load (dropped; the caller computes them again).
    pub corrupt: u64,
    /// Blocks copied out for other workers fetching them (peer fetch; G2 only).
    pub exported: u64,
}

/// Both tiers' counters.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TiersStats {
    /// G2, host memory.
    pub host: TierStats,
    /// G3, local disk.
    pub disk: TierStats,
}

/// One block on its way down: what the pool's cache knew of it and its bytes.
pub(crate) struct Evicted<'a> {
    pub key: Key,
    pub tokens: &'a [u32],
    /// Times it was shared from the cache.
    pub hits: u32,
    /// The page's bytes as segments, in order (none on a cache without values: the
    /// simulator's mock).
    pub data: &'a [&'a [u8]],
}

/// G2 and G3 of one engine.
pub struct Tiers {
    page_bytes: usize,
    policy: WritePolicy,
    /// Whether the tiers keep the pages' bytes (or only their accounting).
    values: bool,
    /// Blocks staged from the cluster store since the last [`Tiers::take_traffic`].
    fetched: u64,
    host: Option<host::Host>,
    disk: Option<g3::G3>,
    stats: TiersStats,
    events: Vec<KvEvent>,
    /// The counters as of the last [`Tiers::take_traffic`].
    seen: TiersStats,
}

impl Tiers {
    /// The tiers of `config` for pages of `page_bytes` bytes (what a page of the model's KV
    /// takes: the size the tiers count, whether or not the cache holds values) of a model
    /// whose blocks are named under `identity` (its prefix seed); `backed`: whether the cache
    /// holds values (the simulator's mock keeps only the accounting, and so do its tiers).
    /// G3's directory is re-read: its blocks are kept when they were written for the same
    /// identity and page size. Without values G3 is only its index, in memory (no files).
    pub fn open(
        config: &TierConfig,
        identity: u64,
        page_bytes: usize,
        backed: bool,
    ) -> Result<Tiers> {
        let page = page_bytes.max(1) as u64;
        let slot = if backed { page_bytes } else { 0 };
        let host =
            (config.host_bytes >= page).then(|| host::Host::new(config.host_bytes / page, slot));
        let cap = config.disk_bytes / page;
        let disk = match &config.disk_path {
            Some(_) if cap == 0 => None,
            Some(_) if !backed => Some(g3::G3::modelled(cap)),
            Some(dir) => Some(g3::G3::Files(disk::Disk::open(
                dir,
                identity,
                slot,
                cap as usize,
                config
                    .disk_queue
                    .unwrap_or_else(|| disk::default_queue(page_bytes))
                    .max(1),
            )?)),
            None => None,
        };
        let mut t = Tiers {
            page_bytes,
            values: backed,
            fetched: 0,
            policy: config.write_policy,
            host,
            disk,
            stats: TiersStats::default(),
            events: Vec::new(),
            seen: TiersStats::default(),
        };
        t.poll();
        Ok(t)
    }

    /// Whether blocks of `hits` shared uses go down (the write policy).
    fn wanted(&self, hits: u32) -> bool {
        match self.policy {
            WritePolicy::Evicted => true,
            WritePolicy::HitTwice => hits >= 2,
        }
    }

    /// Whether the tiers keep pages' bytes: without, a page going down or coming back moves
    /// none (the mock's tiers and the simulator's: only the accounting, priced by the timing
    /// model).
    pub(crate) fn values(&self) -> bool {
        self.values
    }

    /// Whether [`Tiers::store`] would copy the bytes of block `key` holding `tokens`, shared
    /// `hits` times (the write policy wants it, and the tier it goes to lacks it): a pool on a
    /// device copies a page off it only then.
    pub(crate) fn takes(&self, key: Key, tokens: &[u32], hits: u32) -> bool {
        self.wanted(hits)
            && match (&self.host, &self.disk) {
                (Some(h), _) => !h.has(key, tokens),
                (None, Some(d)) => !d.has(key, tokens),
                (None, None) => false,
            }
    }

    /// A block the pool evicts: into G2 (whose own eviction goes to G3), or straight to G3
    /// without a G2. A block a tier holds already is only marked used.
    pub(crate) fn store(&mut self, b: Evicted<'_>) {
        if !self.wanted(b.hits) {
            return;
        }
        if self.host.is_none() {
            self.to_disk(b);
            return;
        }
        self.to_host(b);
    }

    /// A block fetched for G2 (from the cluster store) failed its checksum: counted as G2's.
    pub(crate) fn count_corrupt(&mut self) {
        self.stats.host.corrupt += 1;
    }

    /// Whether there is a G2.
    pub(crate) fn has_host(&self) -> bool {
        self.host.is_some()
    }

    /// Whether G2 holds the block `key` holding `tokens` (a swap copies only what it lacks).
    pub(crate) fn host_has(&self, key: Key, tokens: &[u32]) -> bool {
        self.host.as_ref().is_some_and(|h| h.has(key, tokens))
    }

    /// A block that must be in G2 whatever the write policy — a preempted sequence's, or one
    /// fetched from the cluster store — (marked used where it is already). Returns whether
    /// there is a G2 to hold it.
    pub(crate) fn swap(&mut self, b: Evicted<'_>) -> bool {
        if self.host.is_none() {
            return false;
        }
        self.to_host(b);
        true
    }

    fn to_host(&mut self, b: Evicted<'_>) {
        let host = self.host.as_mut().expect("checked by the caller");
        let stored = host.store(b.key, b.tokens, b.hits, b.data, |down| {
            Self::down(&mut self.disk, &mut self.stats, &mut self.events, down)
        });
        if stored {
            self.stats.host.bytes_stored += self.page_bytes as u64;
            push(&mut self.events, b.key, true, Tier::Host);
        }
    }

    /// G2's evicted block `down` to G3 (or forgotten without one).
    fn down(
        disk: &mut Option<g3::G3>,
        stats: &mut TiersStats,
        events: &mut Vec<KvEvent>,
        down: Evicted<'_>,
    ) {
        push(events, down.key, false, Tier::Host);
        if let Some(d) = disk {
            if !d.write(down) {
                stats.disk.writes_skipped += 1;
            }
        }
    }

    fn to_disk(&mut self, b: Evicted<'_>) {
        if let Some(d) = self.disk.as_mut() {
            if !d.write(b) {
                self.stats.disk.writes_skipped += 1;
            }
        }
    }

    /// Where the block `key` holding `tokens` is: the nearest tier holding it, marked used
    /// there (a lookup about to load it keeps it from being the next evicted).
    /// Whether a tier holds block `key` with `tokens` (nothing marked used).
    pub(crate) fn holds(&self, key: Key, tokens: &[u32]) -> bool {
        self.host.as_ref().is_some_and(|h| h.has(key, tokens))
            || self.disk.as_ref().is_some_and(|d| d.has(key, tokens))
    }

    /// Copies block `key` from G2 into `out` (a page's segments, in order) for a peer fetching
    /// it, its checksum checked (a corrupt copy is dropped and counted); returns its tokens.
    /// Not one of this worker's hits (`exported` counts it). G3's blocks are not served: a
    /// disk read would hold the engine's step.
    pub(crate) fn export_host(&mut self, key: Key, out: &mut [&mut [u8]]) -> Option<Vec<u32>> {
        let h = self.host.as_mut()?;
        let (tokens, len) = h.stored(key)?;
        if out.iter().map(|o| o.len()).sum::<usize>() != len {
            return None;
        }
        let tokens = tokens.to_vec();
        if !h.load(key, out) {
            self.corrupt(key, Tier::Host);
            return None;
        }
        self.stats.host.exported += 1;
        Some(tokens)
    }

    /// `n` blocks fetched from the cluster store were staged (the timing model prices them).
    pub(crate) fn count_fetched(&mut self, n: u64) {
        self.fetched += n;
    }

    pub(crate) fn find(&mut self, key: Key, tokens: &[u32]) -> Option<Tier> {
        if let Some(h) = self.host.as_mut().filter(|h| h.has(key, tokens)) {
            h.touch(key);
            return Some(Tier::Host);
        }
        let d = self.disk.as_mut().filter(|d| d.has(key, tokens))?;
        d.touch(key);
        Some(Tier::Disk)
    }

    /// Copies the block `key` holding `tokens` into `out` (a page's segments, in order) from
    /// the nearest tier holding it, its checksum checked; marks it used there. `None` when no
    /// tier holds it or its copy is corrupt (dropped and counted: compute it again).
    pub(crate) fn load(
        &mut self,
        key: Key,
        tokens: &[u32],
        out: &mut [&mut [u8]],
    ) -> Option<(Tier, u32)> {
        let t0 = Instant::now();
        let (tier, ok, hits) = if let Some(h) = self.host.as_mut().filter(|h| h.has(key, tokens)) {
            let hits = h.hits(key);
            (Tier::Host, h.load(key, out), hits)
        } else if let Some(d) = self.disk.as_mut().filter(|d| d.has(key, tokens)) {
            let hits = d.hits(key);
            match d.load(key, tokens, out) {
                Ok(()) => (Tier::Disk, true, hits),
                Err(disk::Fault::Gone) => return None,
                Err(disk::Fault::Corrupt) => (Tier::Disk, false, hits),
            }
        } else {
            return None;
        };
        if !ok {
            self.corrupt(key, tier);
            return None;
        }
        self.loaded(tier, t0);
        Some((tier, hits))
    }

    /// Maps G2's arena into `device` (a GPU worker's pool): blocks found there are then
    /// loaded by [`Tiers::load_onto`], straight from the arena.
    pub(crate) fn map_host(&mut self, device: &dyn PageDevice) -> Result<()> {
        self.host.as_mut().map_or(Ok(()), |h| h.map(device))
    }

    /// Takes block `key` holding `tokens` from G2 for a page of the pool, its copy and
    /// checksum left to [`Tiers::finish_started`] (many blocks at once, on the kernel
    /// threads): its hits and its place in the arena. With `onto` (a device with G2's arena
    /// mapped, and the page), the copy onto the device and into the host cache starts now.
    /// `None` when G2 does not hold it (load it with [`Tiers::load`]); `Some(None)` when the
    /// device failed.
    pub(crate) fn start(
        &mut self,
        key: Key,
        tokens: &[u32],
        onto: Option<(&dyn PageDevice, u32)>,
    ) -> Option<Option<(u32, usize)>> {
        let h = self.host.as_mut().filter(|h| h.has(key, tokens))?;
        let hits = h.hits(key);
        let at = h.take(key)?;
        let Some((device, page)) = onto else {
            return Some(Some((hits, at)));
        };
        let Some(src) = h.device_addr(at) else {
            tracing::warn!("G2 is not mapped into the device");
            return Some(None);
        };
        // SAFETY: `src` is the block's slot in the mapped arena; the copy is waited for before
        // any slot is written (a page comes off the device first, `to_host`), and a slot
        // written meanwhile fails `finish_started` instead of being used.
        match unsafe { device.page_from(src, page) } {
            Ok(()) => Some(Some((hits, at))),
            Err(e) => {
                tracing::warn!(page, "a KV page could not reach the device: {e}");
                Some(None)
            }
        }
    }

    /// Finishes the blocks [`Tiers::start`] took (each its key and place in the arena), on the
    /// kernel threads: copies each into its page's segments in `outs` (one entry a block; on
    /// a device, `None`: the device copied them) and checks its checksum. Returns whether each
    /// may be used; counts the good ones as G2's hits, drops and counts the corrupt ones (a
    /// block whose slot went to another meanwhile is neither: it is only not used).
    pub(crate) fn finish_started(
        &mut self,
        started: &[(Key, usize)],
        outs: Option<&mut [Vec<&mut [u8]>]>,
    ) -> Vec<bool> {
        let t0 = Instant::now();
        let Some(h) = self.host.as_ref() else {
            return vec![false; started.len()];
        };
        let mut ok = vec![None; started.len()];
        match outs {
            Some(outs) => {
                let mut jobs: Vec<_> = ok.iter_mut().zip(outs.iter_mut()).collect();
                kernels::for_each_chunk_mut(&mut jobs, 1, |i, j| {
                    let (r, out) = &mut j[0];
                    **r = h.copy_checked(started[i].0, started[i].1, out);
                });
            }
            None => kernels::for_each_chunk_mut(&mut ok, 1, |i, r| {
                r[0] = h.check(started[i].0, started[i].1)
            }),
        }
        let mut good = 0;
        for (&(key, _), r) in started.iter().zip(&ok) {
            match r {
                Some(true) => good += 1,
                Some(false) => self.corrupt(key, Tier::Host),
                None => {}
            }
        }
        let s = &mut self.stats.host;
        s.hits += good;
        s.bytes_loaded += good * self.page_bytes as u64;
        s.load_seconds += t0.elapsed().as_secs_f64();
        ok.into_iter().map(|r| r == Some(true)).collect()
    }

    /// Takes block `key` holding `tokens` from G3's files for a page of the pool (marked used
    /// there), its read and checksum left to [`Tiers::finish_taken_disk`] (many blocks at
    /// once, on the kernel threads): its hits. `None` when G3 has no file of it (a G2 holding
    /// it, or a G3 of only its index, loads it with [`Tiers::load`]).
    pub(crate) fn take_disk(&mut self, key: Key, tokens: &[u32]) -> Option<u32> {
        if self.host.as_ref().is_some_and(|h| h.has(key, tokens)) {
            return None;
        }
        let d = self.disk.as_mut().filter(|d| d.has(key, tokens))?;
        d.files()?;
        d.touch(key);
        Some(d.hits(key))
    }

    /// Reads the blocks [`Tiers::take_disk`] took (each its key and tokens) into their pages'
    /// segments `outs`, on the kernel threads, checking each: whether each may be used.
    /// Counts the good ones as G3's hits; a corrupt file is deleted and counted; one gone
    /// meanwhile (evicted by the writer) is only not used.
    pub(crate) fn finish_taken_disk(
        &mut self,
        taken: &[(Key, &[u32])],
        outs: &mut [Vec<&mut [u8]>],
    ) -> Vec<bool> {
        let t0 = Instant::now();
        let Some(d) = self.disk.as_ref().and_then(g3::G3::files) else {
            return vec![false; taken.len()];
        };
        let mut done = vec![Err(disk::Fault::Gone); taken.len()];
        let mut jobs: Vec<_> = done.iter_mut().zip(outs.iter_mut()).collect();
        kernels::for_each_chunk_mut(&mut jobs, 1, |i, j| {
            let (r, out) = &mut j[0];
            **r = d.load(taken[i].0, taken[i].1, out);
        });
        let mut good = 0;
        for (&(key, _), r) in taken.iter().zip(&done) {
            match r {
                Ok(()) => good += 1,
                Err(disk::Fault::Corrupt) => self.corrupt(key, Tier::Disk),
                Err(disk::Fault::Gone) => {}
            }
        }
        let s = &mut self.stats.disk;
        s.hits += good;
        s.bytes_loaded += good * self.page_bytes as u64;
        s.load_seconds += t0.elapsed().as_secs_f64();
        done.into_iter().map(|r| r.is_ok()).collect()
    }

    /// Adds `seconds` to G2's load time: the device's share of the copies started by
    /// [`Tiers::start`], waited for together.
    pub(crate) fn add_host_load_time(&mut self, seconds: f64) {
        self.stats.host.load_seconds += seconds;
    }

    fn loaded(&mut self, tier: Tier, t0: Instant) {
        let s = match tier {
            Tier::Host => &mut self.stats.host,
            _ => &mut self.stats.disk,
        };
        s.hits += 1;
        s.bytes_loaded += self.page_bytes as u64;
        s.load_seconds += t0.elapsed().as_secs_f64();
    }

    /// Block `key`'s copy in `tier` failed its checksum: counted, and dropped from G2 (G3's
    /// file is deleted by the disk tier itself).
    fn corrupt(&mut self, key: Key, tier: Tier) {
        match tier {
            Tier::Host => self.stats.host.corrupt += 1,
            _ => self.stats.disk.corrupt += 1,
        }
        tracing::warn!(
            group = key.0,
            block = key.1,
            ?tier,
            "a stored KV block failed its checksum: dropped, computed again"
        );
        if tier == Tier::Host {
            self.host.as_mut().expect("a G2 block").remove(key);
            push(&mut self.events, key, false, Tier::Host);
        }
    }

    /// Takes in what G3's writer finished (stored and removed files) as events and counts.
    pub(crate) fn poll(&mut self) {
        if let Some(d) = self.disk.as_mut() {
            self.stats.disk.writes_skipped += d.take_failed();
            for (key, stored) in d.take_done() {
                if stored {
                    self.stats.disk.bytes_stored += self.page_bytes as u64;
                }
                push(&mut self.events, key, stored, Tier::Disk);
            }
        }
    }

    /// Blocks loaded into the pool, and stored into G2, since the last call (for a timing
    /// model; G3's writes run beside the steps).
    pub fn take_traffic(&mut self, block_tokens: usize) -> crate::TierTraffic {
        let (now, was) = (self.stats, std::mem::replace(&mut self.seen, self.stats));
        let page = self.page_bytes.max(1) as u64;
        crate::TierTraffic {
            block_tokens,
            loaded: [now.host.hits - was.host.hits, now.disk.hits - was.disk.hits],
            stored: [(now.host.bytes_stored - was.host.bytes_stored) / page, 0],
            fetched: std::mem::take(&mut self.fetched),
        }
    }

    /// Whether G3 has writes queued, or finished and not yet taken.
    pub fn writes_pending(&self) -> bool {
        self.disk.as_ref().is_some_and(g3::G3::busy)
    }

    /// Tier changes since the last call (group 0's blocks: the router's index names a
    /// prefix once), in order.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.poll();
        std::mem::take(&mut self.events)
    }

    /// Counters of both tiers (G3's as of the last [`Tiers::take_events`]).
    pub fn stats(&self) -> TiersStats {
        let mut s = self.stats;
        let page = self.page_bytes as u64;
        if let Some(h) = &self.host {
            s.host.blocks = h.len() as u64;
            s.host.bytes = s.host.blocks * page;
        }
        if let Some(d) = &self.disk {
            s.disk.blocks = d.len() as u64;
            s.disk.bytes = s.disk.blocks * page;
        }
        s
    }

    /// Waits (at most `limit`) until G3's writer has written everything queued: for tests and
    /// an orderly shutdown; a step never waits on it.
    pub fn flush(&mut self, limit: std::time::Duration) -> bool {
        let done = self.disk.as_ref().is_none_or(|d| d.flush(limit));
        self.poll();
        done
    }
}

fn push(events: &mut Vec<KvEvent>, key: Key, stored: bool, tier: Tier) {
    if key.0 != 0 {
        return;
    }
    let block = BlockHash(key.1);
    events.push(match stored {
        true => KvEvent::Stored { block, tier },
        false => KvEvent::Removed { block, tier },
    });
}

#[cfg(test)]
mod speed;
#[cfg(test)]
mod tests;
