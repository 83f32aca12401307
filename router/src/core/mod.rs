//! The router's request core, with no I/O: what the router decides for each request, written
//! once and driven twice — by the router's tokio tasks ([`crate::request`]) over real gRPC
//! calls, and by the simulator (`sim`) over events on a virtual clock. The quinn discipline
//! (`kv-transfer/src/core` follows it too): nothing here touches a socket, a clock or a task;
//! time comes in with every call.
//!
//! - [`Table`]: the workers the router knows — their load as their heartbeats said it, what
//!   the router counts on each ([`InFlight`]), the KV index of their caches — and the one
//!   definition of a candidate's load and of picking a worker by the routing policy.
//! - [`Line`]: the requests waiting for a decode worker with room; the oldest holds the
//!   emptiest worker after [`HOLD_AFTER`].
//! - [`Request`]: one request's phases, each carrying its data, moved by
//!   [`Request::handle`]`(now, Input)` to the [`Action`]s its driver carries out (open a
//!   stream, start a prefill, cancel, emit a token) — reserving, refusals, the local-prefill
//!   rule, recomputation and migration, in one place; a live move off a decode worker
//!   (paused there, its KV handed to another) in `request::moving`.
//! - [`Rebalancer`]: when the decode pool's KV is uneven, the fullest worker sheds sequences,
//!   which move live.

mod line;
mod rebalance;
mod request;
mod table;
#[cfg(test)]
mod tests;
mod vocab;

pub use line::{Eligible, Line, HOLD_AFTER};
pub use rebalance::{Rebalancer, Shed, SETTLE};
pub use request::Request;
pub use table::{
    Beaten, InFlight, JoinRefused, Liveness, Picked, Route, Table, UnknownWorker, Worker,
};
pub use vocab::{
    Action, Cx, Held, Input, MoveWhy, Note, Params, PeerFetch, Phase, PhaseName, PrefillDecision,
    Recompute, Reservation, Settings, Trace, TtftPhases,
};
