//! Why a call to a worker failed, as a type: workers attach it to every error status as the
//! `tandem-cause` metadata, and the router acts on it (try another worker, recompute, drop the
//! worker, answer 400) without reading messages.

use tonic::{Code, Status};

const KEY: &str = "tandem-cause";

/// Why a worker call failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Cause {
    /// No room now: try another worker, or wait.
    Full,
    /// The request is malformed or could never fit: the client's fault.
    BadRequest,
    /// The worker is draining and admits nothing new.
    Draining,
    /// Moving the KV between two workers failed (connect, transfer, checksum, lease): the
    /// prompt can be recomputed.
    KvTransfer,
    /// The worker's engine failed (a step, a stopped engine thread).
    Engine,
    /// The worker could not be reached, or the call broke without a cause from the worker.
    Unreachable,
}

impl Cause {
    /// The name carried on the wire and used in metric labels.
    pub fn name(self) -> &'static str {
        match self {
            Cause::Full => "full",
            Cause::BadRequest => "bad_request",
            Cause::Draining => "draining",
            Cause::KvTransfer => "kv_transfer",
            Cause::Engine => "engine",
            Cause::Unreachable => "unreachable",
        }
    }

    fn code(self) -> Code {
        match self {
            Cause::Full => Code::ResourceExhausted,
            Cause::BadRequest => Code::InvalidArgument,
            Cause::Draining | Cause::Unreachable => Code::Unavailable,
            Cause::KvTransfer => Code::Aborted,
            Cause::Engine => Code::Internal,
        }
    }

    /// A status for this cause with `message`.
    pub fn status(self, message: impl Into<String>) -> Status {
        let mut s = Status::new(self.code(), message);
        s.metadata_mut()
            .insert(KEY, self.name().parse().expect("ASCII name"));
        s
    }

    /// The cause of a failed call: the worker's, or [`Cause::Unreachable`] for a status the
    /// worker did not make (the connection failed or broke).
    pub fn of(s: &Status) -> Cause {
        let named = s.metadata().get(KEY).and_then(|v| v.to_str().ok());
        match named {
            Some("full") => Cause::Full,
            Some("bad_request") => Cause::BadRequest,
            Some("draining") => Cause::Draining,
            Some("kv_transfer") => Cause::KvTransfer,
            Some("engine") => Cause::Engine,
            _ => Cause::Unreachable,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cause_survives_its_status_and_a_bare_status_means_unreachable() {
        for c in [
            Cause::Full,
            Cause::BadRequest,
            Cause::Draining,
            Cause::KvTransfer,
            Cause::Engine,
            Cause::Unreachable,
        ] {
            assert_eq!(Cause::of(&c.status("x")), c);
        }
        assert_eq!(
            Cause::of(&Status::unavailable("transport error")),
            Cause::Unreachable
        );
        assert_eq!(
            Cause::of(&Status::internal("h2 protocol error")),
            Cause::Unreachable
        );
    }
}
