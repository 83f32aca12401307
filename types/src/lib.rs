//! tandem's vocabulary: the types every crate names the same things with, and nothing that
//! does I/O. The engine, the wire (`proto`), the KV transfer, the router and the simulator all
//! speak these.
//!
//! - ids: [`WorkerId`], [`RequestId`], [`BlockHash`] — newtypes, so a worker id is never
//!   passed where a request id belongs; [`TransferTicket`], a decode worker's permission for
//!   one KV transfer;
//! - [`ModelIdentity`]: what two workers must agree on to exchange KV;
//! - [`KvEvent`]: a worker's prefix-cache change on its way to the router's KV index;
//! - [`KvRegions`]: a KV pool as raw memory, for RDMA registration;
//! - [`sum`]: the checksum every stored KV block carries (a worker's tiers, the cluster's
//!   store), computed as the bytes are copied; and FNV-1a, a small hash of names and ids.

mod identity;
mod ids;
mod kv;
pub mod sum;

pub use identity::ModelIdentity;
pub use ids::{BlockHash, RequestId, TransferTicket, WorkerId};
pub use kv::{KvEvent, KvRegions, Tier};
