//! G3: a directory of block files, one file a block named by its key, written by a thread of
//! its own behind a bounded queue (a full queue skips the write: a step never waits on the
//! disk), read back on the engine thread. The index (which keys, their tokens, least recently
//! used first) lives in memory and is rebuilt from the files' headers when a worker starts on
//! the directory again — for the same model identity and page size only: an `IDENTITY` file
//! names them, and blocks of any other are deleted. A lock file keeps a second process off
//! the directory. Files are written under a temporary name and renamed, so a crash leaves
//! whole blocks or none; a file that is damaged anyway fails its checksum when read.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use super::{Evicted, Key};
use crate::error::{EngineError, Result};
use types::sum::{block_sum, Summer};

/// Bytes of pages queued for writing at most by default: room for the burst one step's
/// evictions send down (a reservation can evict hundreds of blocks at once), not only for a
/// steady rate; a burst beyond it is skipped.
pub(super) const QUEUE_BYTES: usize = 256 << 20;
/// Writes queued at least, whatever the page's size.
pub(super) const QUEUE_MIN: usize = 64;

/// The default queue for pages of `page_bytes`: [`QUEUE_BYTES`] of them, at least [`QUEUE_MIN`].
pub(super) fn default_queue(page_bytes: usize) -> usize {
    (QUEUE_BYTES / page_bytes.max(1)).max(QUEUE_MIN)
}
const MAGIC: &[u8; 4] = b"TKVB";
const VERSION: u32 = 2;
/// Bytes of a file's fixed header.
const HEADER: usize = 4 + 4 + 8 + 4 + 8 + 4 + 4 + 8 + 8;

struct Entry {
    tokens: Box<[u32]>,
    hits: u32,
    tick: u64,
}

#[derive(Default)]
struct Index {
    map: HashMap<Key, Entry>,
    lru: BTreeMap<u64, Key>,
    tick: u64,
    /// Files written or deleted since the engine last asked: (key, stored).
    done: Vec<(Key, bool)>,
    /// Writes queued and not finished.
    queued: usize,
    /// Writes that failed (a full disk) since the engine last asked.
    failed: u64,
}

impl Index {
    fn insert(&mut self, key: Key, tokens: Box<[u32]>, hits: u32) {
        self.tick += 1;
        if let Some(old) = self.map.insert(
            key,
            Entry {
                tokens,
                hits,
                tick: self.tick,
            },
        ) {
            self.lru.remove(&old.tick);
        }
        self.lru.insert(self.tick, key);
    }

    fn touch(&mut self, key: Key) {
        if let Some(e) = self.map.get_mut(&key) {
            self.lru.remove(&e.tick);
            self.tick += 1;
            e.tick = self.tick;
            self.lru.insert(self.tick, key);
        }
    }

    fn remove(&mut self, key: Key) -> bool {
        match self.map.remove(&key) {
            Some(e) => {
                self.lru.remove(&e.tick);
                true
            }
            None => false,
        }
    }
}

struct Shared {
    index: Mutex<Index>,
    /// Signalled when the queue drains.
    idle: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One write for the writer thread.
struct Job {
    key: Key,
    tokens: Box<[u32]>,
    hits: u32,
    sum: u64,
    data: Vec<u8>,
}

/// Why a load found no usable block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Fault {
    /// The file went (evicted meanwhile): a plain miss.
    Gone,
    /// The file is there and wrong.
    Corrupt,
}

pub(super) struct Disk {
    dir: PathBuf,
    identity: u64,
    page_bytes: usize,
    shared: Arc<Shared>,
    tx: Option<SyncSender<Job>>,
    writer: Option<JoinHandle<()>>,
    /// Held while the tier is open: the directory's lock.
    _lock: File,
}

fn io(what: &str, path: &Path, e: std::io::Error) -> EngineError {
    EngineError::Config(format!("KV disk tier: {what} {}: {e}", path.display()))
}

impl Disk {
    /// Opens G3 in `dir` (made when missing) for at most `cap` blocks of `page_bytes` bytes
    /// (0 for a cache without values), keeping the blocks of model `identity` found there;
    /// at most `queue` writes wait for the writer.
    pub(super) fn open(
        dir: &Path,
        identity: u64,
        page_bytes: usize,
        cap: usize,
        queue: usize,
    ) -> Result<Disk> {
        fs::create_dir_all(dir).map_err(|e| io("cannot make", dir, e))?;
        let lock_path = dir.join("lock");
        let lock = File::create(&lock_path).map_err(|e| io("cannot open", &lock_path, e))?;
        lock.try_lock().map_err(|_| {
            EngineError::Config(format!(
                "KV disk tier: {} is in use by another process (each worker needs a directory of its own)",
                dir.display()
            ))
        })?;
        let mut index = Index::default();
        for (key, tokens, hits) in read_dir(dir, identity, page_bytes)? {
            index.insert(key, tokens, hits);
            index.done.push((key, true));
        }
        while index.map.len() > cap {
            let (_, key) = index.lru.pop_first().expect("over the cap");
            index.map.remove(&key);
            index.done.push((key, false));
            let _ = fs::remove_file(dir.join(file_name(key)));
        }
        let shared = Arc::new(Shared {
            index: Mutex::new(index),
            idle: Condvar::new(),
        });
        let (tx, rx) = sync_channel(queue);
        let w = Writer {
            dir: dir.to_path_buf(),
            identity,
            cap,
            shared: shared.clone(),
        };
        let writer = std::thread::Builder::new()
            .name("kv-disk-tier".into())
            .spawn(move || w.run(rx))
            .map_err(|e| EngineError::Internal(format!("KV disk tier writer: {e}")))?;
        Ok(Disk {
            dir: dir.to_path_buf(),
            identity,
            page_bytes,
            shared,
            tx: Some(tx),
            writer: Some(writer),
            _lock: lock,
        })
    }

    pub(super) fn has(&self, key: Key, tokens: &[u32]) -> bool {
        let ix = self.shared.lock();
        ix.map.get(&key).is_some_and(|e| *e.tokens == *tokens)
    }

    /// Times block `key` was shared from a cache before.
    pub(super) fn hits(&self, key: Key) -> u32 {
        self.shared.lock().map.get(&key).map_or(0, |e| e.hits)
    }

    /// Marks block `key` used now.
    pub(super) fn touch(&self, key: Key) {
        self.shared.lock().touch(key);
    }

    /// Blocks held.
    pub(super) fn len(&self) -> usize {
        self.shared.lock().map.len()
    }

    /// Queues block `b` for writing (its bytes copied and summed now); `false` when the queue
    /// is full (skipped). A block held already is only marked used.
    pub(super) fn write(&mut self, b: Evicted<'_>) -> bool {
        {
            let mut ix = self.shared.lock();
            if let Some(e) = ix.map.get_mut(&b.key) {
                e.hits = e.hits.max(b.hits);
                ix.touch(b.key);
                return true;
            }
        }
        let mut data = Vec::with_capacity(b.data.iter().map(|d| d.len()).sum());
        let mut s = Summer::default();
        for d in b.data {
            s.sum(d);
            data.extend_from_slice(d);
        }
        let s = s.finish();
        let job = Job {
            key: b.key,
            tokens: b.tokens.into(),
            hits: b.hits,
            sum: block_sum(b.tokens, s),
            data,
        };
        let Some(tx) = &self.tx else {
            return false;
        };
        self.shared.lock().queued += 1;
        match tx.try_send(job) {
            Ok(()) => true,
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.shared.lock().queued -= 1;
                false
            }
        }
    }

    /// Reads block `key` holding `tokens` into `out` (a page's segments, in order), checking
    /// its header and checksum. A file that fails is deleted and forgotten.
    pub(super) fn load(
        &self,
        key: Key,
        tokens: &[u32],
        out: &mut [&mut [u8]],
    ) -> std::result::Result<(), Fault> {
        let path = self.dir.join(file_name(key));
        let len: usize = out.iter().map(|o| o.len()).sum();
        // One read of the whole file (header, tokens, page): a cold disk serves one large
        // request far faster than the segments' many small ones.
        let whole = HEADER + 4 * tokens.len() + len;
        let file = File::open(&path).map_err(|_| Fault::Gone);
        let read = file.and_then(|f| {
            let mut f = std::io::BufReader::with_capacity(whole + 1, f);
            let head = read_header(&mut f, self.identity, self.page_bytes);
            let head = head.ok_or(Fault::Corrupt)?;
            let good = head.key == key && *head.tokens == *tokens && head.len == len;
            good.then_some(()).ok_or(Fault::Corrupt)?;
            let mut s = Summer::default();
            for o in out.iter_mut() {
                f.read_exact(o).map_err(|_| Fault::Corrupt)?;
                s.sum(o);
            }
            let mut rest = [0u8; 1];
            let whole = matches!(f.read(&mut rest), Ok(0));
            (whole && block_sum(tokens, s.finish()) == head.sum)
                .then_some(())
                .ok_or(Fault::Corrupt)
        });
        let mut ix = self.shared.lock();
        match read {
            Ok(()) => ix.touch(key),
            Err(_) => {
                if ix.remove(key) {
                    ix.done.push((key, false));
                }
                // Under the lock: a write of the same block finishing meanwhile is not undone.
                let _ = fs::remove_file(&path);
            }
        }
        read
    }

    /// What the writer finished since the last call: (key, stored or deleted).
    pub(super) fn take_done(&mut self) -> Vec<(Key, bool)> {
        std::mem::take(&mut self.shared.lock().done)
    }

    /// Writes that failed since the last call.
    pub(super) fn take_failed(&mut self) -> u64 {
        std::mem::take(&mut self.shared.lock().failed)
    }

    /// Whether writes are queued, or finished and not yet taken.
    pub(super) fn busy(&self) -> bool {
        let ix = self.shared.lock();
        ix.queued > 0 || !ix.done.is_empty()
    }

    /// Waits at most `limit` for the queue to drain; whether it did.
    pub(super) fn flush(&self, limit: Duration) -> bool {
        let ix = self.shared.lock();
        let (ix, _) = self
            .shared
            .idle
            .wait_timeout_while(ix, limit, |ix| ix.queued > 0)
            .unwrap_or_else(|p| p.into_inner());
        ix.queued == 0
    }

    /// The path of block `key`'s file, to damage in tests.
    #[cfg(test)]
    pub(super) fn path_of(&self, key: Key) -> PathBuf {
        self.dir.join(file_name(key))
    }
}

impl Drop for Disk {
    fn drop(&mut self) {
        // The writer finishes what is queued (at most the queue's pages) and stops.
        self.tx.take();
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

struct Writer {
    dir: PathBuf,
    identity: u64,
    cap: usize,
    shared: Arc<Shared>,
}

impl Writer {
    fn run(self, rx: Receiver<Job>) {
        while let Ok(job) = rx.recv() {
            let written = self.write(&job);
            let mut ix = self.shared.lock();
            ix.queued -= 1;
            match written {
                Ok(()) => {
                    ix.insert(job.key, job.tokens, job.hits);
                    ix.done.push((job.key, true));
                    while ix.map.len() > self.cap {
                        let (_, old) = ix.lru.pop_first().expect("over the cap");
                        ix.map.remove(&old);
                        ix.done.push((old, false));
                        let _ = fs::remove_file(self.dir.join(file_name(old)));
                    }
                }
                Err(e) => {
                    ix.failed += 1;
                    tracing::warn!(error = %e, "KV disk tier: a block write failed (skipped)")
                }
            }
            if ix.queued == 0 {
                self.shared.idle.notify_all();
            }
        }
    }

    /// Writes `job`'s file under a temporary name and renames it into place; a failed write
    /// (a full disk) leaves no partial file behind.
    fn write(&self, job: &Job) -> std::io::Result<()> {
        let name = file_name(job.key);
        let tmp = self.dir.join(format!("{name}.tmp"));
        let written = File::create(&tmp).and_then(|mut f| {
            f.write_all(&header(self.identity, job))?;
            f.write_all(&job.data)
        });
        let placed = written.and_then(|()| fs::rename(&tmp, self.dir.join(name)));
        if placed.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        placed
    }
}

fn file_name((group, hash): Key) -> String {
    format!("{group:04x}-{hash:016x}.kv")
}

fn header(identity: u64, job: &Job) -> Vec<u8> {
    let mut h = Vec::with_capacity(HEADER + 4 * job.tokens.len());
    h.extend_from_slice(MAGIC);
    h.extend_from_slice(&VERSION.to_le_bytes());
    h.extend_from_slice(&identity.to_le_bytes());
    h.extend_from_slice(&job.key.0.to_le_bytes());
    h.extend_from_slice(&job.key.1.to_le_bytes());
    h.extend_from_slice(&job.hits.to_le_bytes());
    h.extend_from_slice(&(job.tokens.len() as u32).to_le_bytes());
    h.extend_from_slice(&(job.data.len() as u64).to_le_bytes());
    h.extend_from_slice(&job.sum.to_le_bytes());
    for t in job.tokens.iter() {
        h.extend_from_slice(&t.to_le_bytes());
    }
    h
}

struct Head {
    key: Key,
    hits: u32,
    tokens: Box<[u32]>,
    len: usize,
    sum: u64,
}

/// Reads a block file's header; `None` when it is not one of this identity's (or damaged).
fn read_header(f: &mut impl Read, identity: u64, page_bytes: usize) -> Option<Head> {
    let mut h = [0u8; HEADER];
    f.read_exact(&mut h).ok()?;
    let u32_at = |i: usize| u32::from_le_bytes(h[i..i + 4].try_into().expect("4 bytes"));
    let u64_at = |i: usize| u64::from_le_bytes(h[i..i + 8].try_into().expect("8 bytes"));
    let ours = &h[..4] == MAGIC && u32_at(4) == VERSION && u64_at(8) == identity;
    let (n, len) = (u32_at(32) as usize, u64_at(36) as usize);
    // A page's bytes, or none (a cache without values); a block's tokens are a page's.
    if !ours || (len != page_bytes && len != 0) || n > 1 << 16 {
        return None;
    }
    let mut t = vec![0u8; 4 * n];
    f.read_exact(&mut t).ok()?;
    let tokens = t
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect();
    Some(Head {
        key: (u32_at(16), u64_at(20)),
        hits: u32_at(28),
        tokens,
        len,
        sum: u64_at(44),
    })
}

/// The identity file's text for a model and page size.
fn identity_text(identity: u64, page_bytes: usize) -> String {
    format!("tandem KV disk tier {VERSION}\nmodel {identity:016x}\npage bytes {page_bytes}\n")
}

/// The blocks of `identity` in `dir`, oldest first (by modification time); every other file
/// of the tier's (another identity's blocks, a half-written one) is deleted.
fn read_dir(dir: &Path, identity: u64, page_bytes: usize) -> Result<Vec<(Key, Box<[u32]>, u32)>> {
    let id_path = dir.join("IDENTITY");
    let want = identity_text(identity, page_bytes);
    let same = fs::read_to_string(&id_path).is_ok_and(|t| t == want);
    let entries = fs::read_dir(dir).map_err(|e| io("cannot read", dir, e))?;
    let mut found = Vec::new();
    for e in entries.flatten() {
        let path = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if !(name.ends_with(".kv") || name.ends_with(".kv.tmp")) {
            continue;
        }
        let head = (same && name.ends_with(".kv"))
            .then(|| File::open(&path).ok())
            .flatten()
            .and_then(|mut f| read_header(&mut f, identity, page_bytes));
        match head {
            Some(h) if file_name(h.key) == name => {
                let when = e.metadata().and_then(|m| m.modified()).ok();
                found.push((when, h.key, h.tokens, h.hits));
            }
            _ => {
                let _ = fs::remove_file(&path);
            }
        }
    }
    if !same {
        fs::write(&id_path, want).map_err(|e| io("cannot write", &id_path, e))?;
    }
    found.sort_by_key(|f| f.0);
    Ok(found.into_iter().map(|(_, k, t, h)| (k, t, h)).collect())
}
