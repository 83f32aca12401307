//! KV beyond one sequence: the events that keep the router's index of every worker's prefix
//! cache, and a pool's memory as an RDMA device sees it.

use std::sync::Arc;

use crate::BlockHash;

/// Where a cached block lives on its worker, nearest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    /// The worker's KV pool (G1), where its forward passes read it.
    Pool,
    /// Host memory outside the pool (G2): loaded back into the pool before use.
    Host,
    /// Local disk (G3): loaded back into the pool before use; kept across restarts.
    Disk,
}

impl Tier {
    /// Every tier, nearest first.
    pub const ALL: [Tier; 3] = [Tier::Pool, Tier::Host, Tier::Disk];

    /// Its number on the wire (0 the pool, 1 host, 2 disk).
    pub fn index(self) -> u32 {
        self as u32
    }

    /// The tier numbered `i` on the wire.
    pub fn from_index(i: u32) -> Option<Tier> {
        Tier::ALL.get(i as usize).copied()
    }

    /// Its name in metrics and logs.
    pub fn name(self) -> &'static str {
        match self {
            Tier::Pool => "pool",
            Tier::Host => "host",
            Tier::Disk => "disk",
        }
    }
}

/// A change to a worker's prefix cache, in the order it happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvEvent {
    /// The block is cached (registered) in `tier`: a prompt starting with its tokens can
    /// share it.
    Stored {
        /// The block.
        block: BlockHash,
        /// Where.
        tier: Tier,
    },
    /// The block is no longer cached in `tier` (evicted).
    Removed {
        /// The block.
        block: BlockHash,
        /// Where it was.
        tier: Tier,
    },
}

impl KvEvent {
    /// The block the event is about.
    pub fn block(&self) -> BlockHash {
        match *self {
            KvEvent::Stored { block, .. } | KvEvent::Removed { block, .. } => block,
        }
    }

    /// Whether the block is cached after the event.
    pub fn stored(&self) -> bool {
        matches!(self, KvEvent::Stored { .. })
    }

    /// The tier the event is about.
    pub fn tier(&self) -> Tier {
        match *self {
            KvEvent::Stored { tier, .. } | KvEvent::Removed { tier, .. } => tier,
        }
    }
}

/// A decode worker's KV pool as raw memory, for registration with an RDMA device.
pub struct KvRegions {
    /// Per layer: (address, bytes) of the keys and of the values.
    pub layers: Vec<[(usize, usize); 2]>,
    /// Bytes of one block in one pool.
    pub block_bytes: usize,
    /// What keeps that memory allocated and unmoved: a registration holds these as long as it
    /// lives.
    pub owners: Vec<Arc<dyn Send + Sync>>,
}
