//! One store node's objects, with no I/O: puts (start → write → publish), gets under read
//! leases, pins, high-water eviction. The time is passed in; [`Objects::tick`] expires what
//! ran out. The service in front of it binds each put and lease to the peer that holds it.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use types::sum::Summer;
use types::BlockHash;

#[cfg(test)]
mod tests;

/// An object's name: a KV block's name under one model's KV identity (two models' blocks of
/// the same tokens are different objects).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectKey {
    /// The model's KV identity (its weights and KV layout).
    pub model: u64,
    /// The block's name ([`BlockHash`]: its tokens and every token before).
    pub block: BlockHash,
}

macro_rules! handle {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub u64);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }
    };
}

handle!(
    /// A put under way.
    PutId
);
handle!(
    /// A read lease on one object.
    LeaseId
);

/// How an object is kept from eviction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
pub enum Pin {
    /// Evicted least recently used first.
    #[default]
    None,
    /// Evicted only when no unpinned object can go.
    Soft,
    /// Never evicted (an operator's, e.g. a system prompt's blocks).
    Hard,
}

/// What one node holds at most, and for how long.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Bytes of objects and puts under way.
    pub capacity: u64,
    /// Past this share of `capacity`, objects are evicted…
    pub high_water: f64,
    /// …down to this share.
    pub low_water: f64,
    /// Largest object.
    pub max_object: u64,
    /// Puts under way at once.
    pub max_puts: usize,
    /// A put not published within this is abandoned and freed (its writer died).
    pub put_deadline: Duration,
    /// A lease's length, from its grant or its last renewal.
    pub lease: Duration,
    /// Longest a lease is kept by renewing it, from its grant.
    pub lease_max: Duration,
    /// Leases held at once.
    pub max_leases: usize,
    /// Share of `capacity` hard pins may hold.
    pub hard_pin_share: f64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            capacity: 4 << 30,
            high_water: 0.90,
            low_water: 0.85,
            max_object: 64 << 20,
            max_puts: 1024,
            put_deadline: Duration::from_secs(30),
            lease: Duration::from_secs(10),
            lease_max: Duration::from_secs(60),
            max_leases: 65_536,
            hard_pin_share: 0.5,
        }
    }
}

/// Why an operation was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// A put of more than [`Limits::max_object`] bytes.
    #[error("an object of {len} bytes is over this store's limit of {max}")]
    TooLarge {
        /// The put's size.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// No room, even after evicting all that may go.
    #[error("the store is full: {len} bytes wanted, {held} of {capacity} held by leased, pinned or unfinished objects")]
    Full {
        /// The put's size.
        len: u64,
        /// Bytes held after evicting.
        held: u64,
        /// [`Limits::capacity`].
        capacity: u64,
    },
    /// [`Limits::max_puts`] puts are under way.
    #[error("{0} puts are under way, the most this store takes")]
    Busy(usize),
    /// A put never started, already over, or expired.
    #[error("put {0} is not under way (never started, published, or expired)")]
    UnknownPut(PutId),
    /// A write past the put's declared size.
    #[error("put {id}: {len} bytes at {offset} run past its {size}")]
    OutOfRange {
        /// The put.
        id: PutId,
        /// Where the write starts.
        offset: u64,
        /// The write's length.
        len: u64,
        /// The put's declared size.
        size: u64,
    },
    /// A write that does not continue the bytes written so far.
    #[error("put {id}: written at {offset}, where {written} bytes are written")]
    OutOfOrder {
        /// The put.
        id: PutId,
        /// Where the write starts.
        offset: u64,
        /// Bytes written so far.
        written: u64,
    },
    /// A put ended before all its bytes came.
    #[error("put {id}: {written} of {size} bytes written")]
    Incomplete {
        /// The put.
        id: PutId,
        /// Bytes written.
        written: u64,
        /// The put's declared size.
        size: u64,
    },
    /// A put whose bytes fail its checksum: dropped.
    #[error("put {0}: its bytes do not match its checksum (dropped)")]
    Corrupt(PutId),
    /// A lease never granted, released or expired.
    #[error("lease {0} is not held (never granted, released or expired)")]
    UnknownLease(LeaseId),
    /// A renewal past [`Limits::lease_max`] from the grant.
    #[error("lease {id} was granted {max:?} ago, the longest one is kept: get the object again")]
    LeaseTooOld {
        /// The lease.
        id: LeaseId,
        /// [`Limits::lease_max`].
        max: Duration,
    },
    /// [`Limits::max_leases`] leases are held.
    #[error("{0} leases are held, the most this store grants")]
    TooManyLeases(usize),
    /// No such object (to pin).
    #[error("no object {0:?}")]
    NotHeld(ObjectKey),
    /// Hard pins would hold more than [`Limits::hard_pin_share`] of the capacity.
    #[error("hard pins would hold {want} bytes, over their {max}")]
    PinLimit {
        /// Bytes hard-pinned with this one.
        want: u64,
        /// The share's bytes.
        max: u64,
    },
}

/// What [`Objects::put_start`] answers when it takes no bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutStart {
    /// Write the object under this put.
    Write(PutId),
    /// The object is held already, or another put of it is under way: nothing to send.
    Held,
}

/// A change in what the node holds, for the router's index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// Published: gets find it.
    Stored(ObjectKey),
    /// Evicted (or unpinned and evicted): gets miss it.
    Removed(ObjectKey),
}

/// A get's answer: the object's bytes and checksum, kept under a lease.
#[derive(Debug, Clone)]
pub struct Got {
    /// The lease that keeps the object from eviction until `expires` (or its release).
    pub lease: LeaseId,
    /// When the lease runs out unless renewed.
    pub expires: Instant,
    /// The object's bytes.
    pub data: Arc<Vec<u8>>,
    /// Their checksum ([`types::sum::sum`]), as its writer gave it and the store checked it.
    pub sum: u64,
}

/// A node's counters (totals since it started) and levels (now).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Objects held (published).
    pub objects: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Bytes taken by puts under way.
    pub pending_bytes: u64,
    /// Gets that found their object.
    pub hits: u64,
    /// Gets that did not.
    pub misses: u64,
    /// Objects published.
    pub puts: u64,
    /// Puts refused for room (full), for the puts under way (busy), or too large.
    pub puts_refused: u64,
    /// Puts whose bytes failed their checksum.
    pub puts_corrupt: u64,
    /// Puts never published within their deadline.
    pub puts_abandoned: u64,
    /// Objects evicted.
    pub evictions: u64,
    /// Leases held now.
    pub leases: u64,
    /// Objects softly pinned now.
    pub soft_pins: u64,
    /// Objects hard-pinned now.
    pub hard_pins: u64,
}

struct Object {
    data: Arc<Vec<u8>>,
    sum: u64,
    pin: Pin,
    /// Leases held on it.
    leases: u32,
    /// Its place in the eviction order (none while hard-pinned).
    stamp: u64,
}

struct Pending {
    key: ObjectKey,
    data: Vec<u8>,
    size: u64,
    sum: u64,
    started: Instant,
}

struct Lease {
    key: ObjectKey,
    granted: Instant,
    expires: Instant,
}

/// One node's objects.
pub struct Objects {
    limits: Limits,
    objects: HashMap<ObjectKey, Object>,
    /// Evictable objects, first out first: (pinned softly, stamp).
    order: BTreeMap<(bool, u64), ObjectKey>,
    puts: HashMap<PutId, Pending>,
    leases: HashMap<LeaseId, Lease>,
    /// Bytes of objects and of puts under way.
    used: u64,
    hard_pinned: u64,
    next: u64,
    stats: StoreStats,
    changes: Vec<Change>,
    /// Buffers of evicted objects, for the next puts' bytes (memory new to the process costs a
    /// page fault per 4 KiB); at most a sixteenth of the capacity.
    spare: Vec<Vec<u8>>,
}

impl Objects {
    /// An empty node under `limits`.
    pub fn new(limits: Limits) -> Objects {
        Objects {
            limits,
            objects: HashMap::new(),
            order: BTreeMap::new(),
            puts: HashMap::new(),
            leases: HashMap::new(),
            used: 0,
            hard_pinned: 0,
            next: 0,
            stats: StoreStats::default(),
            changes: Vec::new(),
            spare: Vec::new(),
        }
    }

    /// An empty buffer for a put's `len` bytes: an evicted object's (no more than twice that
    /// size), or a new one.
    pub fn buffer(&mut self, len: usize) -> Vec<u8> {
        let fits = |v: &Vec<u8>| v.capacity() >= len && v.capacity() <= len.max(1) * 2;
        match self.spare.iter().position(fits) {
            Some(i) => self.spare.swap_remove(i),
            None => Vec::with_capacity(len),
        }
    }

    /// Keeps an evicted object's buffer for [`Objects::buffer`] when no reader holds it and
    /// the spares have room.
    fn recycle(&mut self, data: Arc<Vec<u8>>) {
        let held: usize = self.spare.iter().map(Vec::capacity).sum();
        if let Ok(mut v) = Arc::try_unwrap(data) {
            if (held + v.capacity()) as u64 <= self.limits.capacity / 16 {
                v.clear();
                self.spare.push(v);
            }
        }
    }

    fn next(&mut self) -> u64 {
        self.next += 1;
        self.next
    }

    /// Starts putting `key`, `size` bytes whose checksum is `sum`: its room is taken now
    /// (evicting down to the low-water mark when the high one is passed).
    pub fn put_start(
        &mut self,
        key: ObjectKey,
        size: u64,
        sum: u64,
        now: Instant,
    ) -> Result<PutStart, StoreError> {
        if self.objects.contains_key(&key) || self.puts.values().any(|p| p.key == key) {
            return Ok(PutStart::Held);
        }
        let room = if size > self.limits.max_object {
            let max = self.limits.max_object;
            Err(StoreError::TooLarge { len: size, max })
        } else if self.puts.len() >= self.limits.max_puts {
            Err(StoreError::Busy(self.puts.len()))
        } else {
            self.make_room(size)
        };
        if let Err(e) = room {
            self.stats.puts_refused += 1;
            return Err(e);
        }
        let id = PutId(self.next());
        self.used += size;
        let pending = Pending {
            key,
            data: Vec::new(),
            size,
            sum,
            started: now,
        };
        self.puts.insert(id, pending);
        Ok(PutStart::Write(id))
    }

    /// Appends `bytes` at `offset` (the bytes written so far) to put `id`.
    pub fn put_write(&mut self, id: PutId, offset: u64, bytes: &[u8]) -> Result<(), StoreError> {
        let p = self.puts.get_mut(&id).ok_or(StoreError::UnknownPut(id))?;
        let (written, len) = (p.data.len() as u64, bytes.len() as u64);
        if offset + len > p.size {
            let size = p.size;
            return Err(StoreError::OutOfRange {
                id,
                offset,
                len,
                size,
            });
        }
        if offset != written {
            return Err(StoreError::OutOfOrder {
                id,
                offset,
                written,
            });
        }
        if p.data.capacity() == 0 {
            p.data.reserve_exact(p.size as usize);
        }
        p.data.extend_from_slice(bytes);
        Ok(())
    }

    /// The size of put `id` when it is under way and nothing of it is written yet (what
    /// [`Objects::put_whole`] takes).
    pub fn put_unwritten(&self, id: PutId) -> Option<u64> {
        let p = self.puts.get(&id)?;
        p.data.is_empty().then_some(p.size)
    }

    /// Writes all of put `id`'s bytes at once (taken as they are, not copied) and publishes it
    /// as [`Objects::put_end`] does.
    pub fn put_whole(&mut self, id: PutId, data: Vec<u8>) -> Result<(), StoreError> {
        let got = types::sum::sum(&data);
        self.put_whole_summed(id, data, got)
    }

    /// [`Objects::put_whole`] for bytes whose checksum the caller computed as they arrived
    /// (`got`: over exactly `data`; the node's data connection sums each piece it reads while
    /// it is in the CPU's cache, not in a second pass over the object).
    pub fn put_whole_summed(
        &mut self,
        id: PutId,
        data: Vec<u8>,
        got: u64,
    ) -> Result<(), StoreError> {
        let p = self.puts.get_mut(&id).ok_or(StoreError::UnknownPut(id))?;
        let (len, size) = (data.len() as u64, p.size);
        if !p.data.is_empty() {
            let written = p.data.len() as u64;
            return Err(StoreError::OutOfOrder {
                id,
                offset: 0,
                written,
            });
        }
        if len > size {
            let offset = 0;
            return Err(StoreError::OutOfRange {
                id,
                offset,
                len,
                size,
            });
        }
        p.data = data;
        self.publish(id, got)
    }

    /// Publishes put `id` once all its bytes are written and match its checksum; a put whose
    /// bytes do not is dropped. Either way the put is over.
    pub fn put_end(&mut self, id: PutId) -> Result<(), StoreError> {
        let p = self.puts.get(&id).ok_or(StoreError::UnknownPut(id))?;
        let mut s = Summer::default();
        s.sum(&p.data);
        self.publish(id, s.finish())
    }

    /// Publishes put `id`, all written, whose bytes' checksum is `got`, if that is its own.
    fn publish(&mut self, id: PutId, got: u64) -> Result<(), StoreError> {
        let p = self.puts.get(&id).ok_or(StoreError::UnknownPut(id))?;
        let (written, size) = (p.data.len() as u64, p.size);
        if written != size {
            return Err(StoreError::Incomplete { id, written, size });
        }
        let p = self.puts.remove(&id).expect("looked up above");
        if got != p.sum {
            self.used -= p.size;
            self.stats.puts_corrupt += 1;
            return Err(StoreError::Corrupt(id));
        }
        let stamp = self.next();
        self.order.insert((false, stamp), p.key);
        let object = Object {
            data: Arc::new(p.data),
            sum: p.sum,
            pin: Pin::None,
            leases: 0,
            stamp,
        };
        self.objects.insert(p.key, object);
        self.stats.puts += 1;
        self.changes.push(Change::Stored(p.key));
        Ok(())
    }

    /// Gives up put `id` (its writer says so): nothing of it is ever visible.
    pub fn put_abort(&mut self, id: PutId) {
        if let Some(p) = self.puts.remove(&id) {
            self.used -= p.size;
        }
    }

    /// Gives up put `id` because its writer went away before ending it (counted as
    /// abandoned): nothing of it is ever visible.
    pub fn abandon(&mut self, id: PutId) {
        if self.puts.contains_key(&id) {
            self.put_abort(id);
            self.stats.puts_abandoned += 1;
        }
    }

    /// Object `key` under a new read lease, marked used now; `None` (counted) when it is not
    /// held.
    pub fn get(&mut self, key: ObjectKey, now: Instant) -> Result<Option<Got>, StoreError> {
        if !self.objects.contains_key(&key) {
            self.stats.misses += 1;
            return Ok(None);
        }
        if self.leases.len() >= self.limits.max_leases {
            return Err(StoreError::TooManyLeases(self.leases.len()));
        }
        let stamp = self.next();
        let o = self.objects.get_mut(&key).expect("checked above");
        if o.pin != Pin::Hard {
            let soft = o.pin == Pin::Soft;
            self.order.remove(&(soft, o.stamp));
            self.order.insert((soft, stamp), key);
        }
        o.stamp = stamp;
        o.leases += 1;
        let (data, sum) = (o.data.clone(), o.sum);
        let lease = LeaseId(self.next());
        let expires = now + self.limits.lease;
        let granted = now;
        self.leases.insert(
            lease,
            Lease {
                key,
                granted,
                expires,
            },
        );
        self.stats.hits += 1;
        Ok(Some(Got {
            lease,
            expires,
            data,
            sum,
        }))
    }

    /// Extends lease `id` by another lease length; refused once it would outlive `lease_max`
    /// from its grant.
    pub fn renew(&mut self, id: LeaseId, now: Instant) -> Result<Instant, StoreError> {
        let l = self
            .leases
            .get_mut(&id)
            .ok_or(StoreError::UnknownLease(id))?;
        let expires = now + self.limits.lease;
        let max = self.limits.lease_max;
        if expires > l.granted + max {
            return Err(StoreError::LeaseTooOld { id, max });
        }
        l.expires = expires;
        Ok(expires)
    }

    /// Ends lease `id` (a reader done with the object).
    pub fn release(&mut self, id: LeaseId) {
        if let Some(l) = self.leases.remove(&id) {
            if let Some(o) = self.objects.get_mut(&l.key) {
                o.leases -= 1;
            }
        }
    }

    /// Pins object `key` (or unpins it, with [`Pin::None`]).
    pub fn pin(&mut self, key: ObjectKey, pin: Pin) -> Result<(), StoreError> {
        let o = self.objects.get(&key).ok_or(StoreError::NotHeld(key))?;
        let len = o.data.len() as u64;
        let max = (self.limits.capacity as f64 * self.limits.hard_pin_share) as u64;
        if pin == Pin::Hard && o.pin != Pin::Hard && self.hard_pinned + len > max {
            let want = self.hard_pinned + len;
            return Err(StoreError::PinLimit { want, max });
        }
        let o = self.objects.get_mut(&key).expect("checked above");
        match o.pin {
            Pin::Hard => self.hard_pinned -= len,
            was => {
                self.order.remove(&(was == Pin::Soft, o.stamp));
            }
        }
        match pin {
            Pin::Hard => self.hard_pinned += len,
            now => {
                self.order.insert((now == Pin::Soft, o.stamp), key);
            }
        }
        o.pin = pin;
        Ok(())
    }

    /// Frees what ran out by `now` — puts past their deadline (their writer is gone: nothing
    /// of them was visible), leases past their expiry — and evicts down to the low-water mark
    /// when the high one is passed.
    pub fn tick(&mut self, now: Instant) {
        let deadline = self.limits.put_deadline;
        let stale: Vec<PutId> = self
            .puts
            .iter()
            .filter(|(_, p)| now.saturating_duration_since(p.started) >= deadline)
            .map(|(id, _)| *id)
            .collect();
        for id in stale {
            self.abandon(id);
        }
        let expired: Vec<LeaseId> = self
            .leases
            .iter()
            .filter(|(_, l)| l.expires <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            self.release(id);
        }
        // Nothing is wanted beyond the marks: whatever can go down to them goes.
        let _ = self.make_room(0);
    }

    /// Evicts until `len` more bytes fit under the low-water mark, when they would pass the
    /// high-water one; refuses when even then they do not fit in the capacity.
    fn make_room(&mut self, len: u64) -> Result<(), StoreError> {
        let mark = |share: f64| (self.limits.capacity as f64 * share) as u64;
        let (high, low) = (mark(self.limits.high_water), mark(self.limits.low_water));
        if self.used + len > high {
            let leased: Vec<(bool, u64)> = self
                .order
                .iter()
                .filter(|(_, k)| self.objects[*k].leases == 0)
                .map(|(at, _)| *at)
                .collect();
            for at in leased {
                if self.used + len <= low {
                    break;
                }
                let key = self.order.remove(&at).expect("listed above");
                let o = self.objects.remove(&key).expect("ordered objects are held");
                self.used -= o.data.len() as u64;
                self.stats.evictions += 1;
                self.changes.push(Change::Removed(key));
                self.recycle(o.data);
            }
        }
        if self.used + len > self.limits.capacity {
            let (held, capacity) = (self.used, self.limits.capacity);
            return Err(StoreError::Full {
                len,
                held,
                capacity,
            });
        }
        Ok(())
    }

    /// The changes since the last call, in order.
    pub fn take_changes(&mut self) -> Vec<Change> {
        std::mem::take(&mut self.changes)
    }

    /// The blocks held of `model` (a watcher's snapshot).
    pub fn blocks(&self, model: u64) -> Vec<BlockHash> {
        let mut b: Vec<BlockHash> = (self.objects.keys())
            .filter(|k| k.model == model)
            .map(|k| k.block)
            .collect();
        b.sort_unstable();
        b
    }

    /// Whether put `id` is under way (started, neither ended nor expired).
    pub fn put_under_way(&self, id: PutId) -> bool {
        self.puts.contains_key(&id)
    }

    /// [`Limits::capacity`].
    pub fn capacity(&self) -> u64 {
        self.limits.capacity
    }

    /// Whether object `key` is held (published).
    pub fn holds(&self, key: ObjectKey) -> bool {
        self.objects.contains_key(&key)
    }

    /// The node's counters and levels now.
    pub fn stats(&self) -> StoreStats {
        let pins = |p| self.objects.values().filter(|o| o.pin == p).count() as u64;
        let pending_bytes = self.puts.values().map(|p| p.size).sum::<u64>();
        StoreStats {
            objects: self.objects.len() as u64,
            bytes: self.used - pending_bytes,
            pending_bytes,
            leases: self.leases.len() as u64,
            soft_pins: pins(Pin::Soft),
            hard_pins: pins(Pin::Hard),
            ..self.stats
        }
    }
}
