//! KV beyond one sequence: the events that keep the router's index of every worker's prefix
//! cache, and a pool's memory as an RDMA device sees it.

use std::sync::Arc;

use crate::BlockHash;

/// Where a cached block lives on its worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tier {
    /// The worker's KV pool, where its forward passes read it.
    Pool,
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
