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
//! [`node`] serves it: a store node's gRPC service (`Store` in `tandem.proto`), every call
//! checked against the caller's certificate.

pub mod node;
mod objects;
mod place;

pub use objects::{
    Change, Got, LeaseId, Limits, ObjectKey, Objects, Pin, PutId, PutStart, StoreError, StoreStats,
};
pub use place::place;
