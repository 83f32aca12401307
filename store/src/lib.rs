//! tandem's cluster KV store: KV blocks kept by store nodes apart from any worker, so a prefix
//! computed anywhere serves every worker and outlives the worker that computed it.
//!
//! The store's logic has no I/O and is driven with the time passed in (as `kv-transfer`'s
//! core is):
//!
//! - [`Objects`]: one node's objects. A put is started, written and published — a half-written
//!   object is never visible, an abandoned one is freed after its deadline; every object
//!   carries its checksum ([`types::sum`]), checked before it is published. A get takes a read
//!   lease (renewable, bounded) that keeps the object from eviction; soft pins are evicted last
//!   and hard pins never; past the high-water mark the least recently used objects go until
//!   the low-water mark, leased and hard-pinned ones skipped. Everything a peer can make a node
//!   hold is capped: the bytes, one object's size, the puts under way, the leases.
//! - [`place`]: which nodes hold an object — rendezvous hashing over the nodes' names, so a
//!   node that joins or leaves moves only the objects it gains or held.
//!
//! [`node`] serves it: a store node's gRPC service (`Store` in `tandem.proto`) for the control,
//! every call checked against the caller's certificate, and [`data`], the node's data
//! connections, for the bytes of puts and gets.

pub mod data;
pub mod node;
mod objects;
mod place;

pub use objects::{
    Change, Got, LeaseId, Limits, ObjectKey, Objects, Pin, PutId, PutStart, StoreError, StoreStats,
};
pub use place::{name_hash as node_id, place};

/// Has the C allocator keep freed memory for reuse rather than return it to the system at
/// once: KV blocks (about a MiB each) are allocated and freed all the time by a store node's
/// puts and evictions and a worker's fetches, and memory new to the process costs a page
/// fault per 4 KiB (zeroed by the kernel), more than the bytes' trip over loopback. Blocks
/// under 32 MiB come from the allocator's heaps, and up to 256 MiB freed at a heap's top is
/// kept. Called once, first thing, by the `tandem` binary (every role); glibc only.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt sets glibc's malloc parameters and touches no memory of ours; it is
    // called before any other thread runs.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
    }
}
