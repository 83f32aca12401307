//! tandem's declarative protocol crate: the facts every process must agree on.
//!
//! - [`PROTOCOL_VERSION`] and [`ModelIdentity`]: what workers announce when they join, so that
//!   the router refuses a prefill/decode pair that cannot exchange KV.
//! - [`config`]: the `cluster.toml` schema and its validation.
//! - [`grpc`]: the control plane between router and workers (`proto/tandem.proto`), and
//!   [`membership`], the worker side of joining; [`secure`], gRPC over the cluster's identity
//!   (mutual TLS, the peer's role).

pub mod cause;
pub mod config;
pub mod membership;
pub mod metrics;
pub mod secure;

/// Generated gRPC messages, clients and servers of `proto/tandem.proto`.
#[allow(missing_docs, clippy::all)]
pub mod grpc {
    tonic::include_proto!("tandem.v1");
    include!(concat!(env!("OUT_DIR"), "/load_fields.rs"));
}

pub use cause::Cause;
pub use types::{KvRegions, ModelIdentity};

/// `t` in µs since the Unix epoch (0 before it).
pub fn unix_us(t: std::time::SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// A bound gRPC listener's connections, each with Nagle's algorithm off. tonic sets `TCP_NODELAY`
/// only on the listeners it binds itself; on ours, a stream's small frames (a reservation, a
/// token) waited for the peer's delayed ACK — up to 40 ms each on Linux.
pub fn grpc_incoming(listener: tokio::net::TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true))
}

/// A worker pool, and so a worker's role: one type from cluster.toml through the control plane
/// to the planner.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Pool {
    /// Computes prompts' KV and sends it to decode workers; scales on TTFT.
    Prefill,
    /// Generates tokens with continuous batching; scales on ITL.
    Decode,
}

impl Pool {
    /// The pool's name in config, logs, metrics labels and the command line.
    pub fn name(self) -> &'static str {
        match self {
            Pool::Prefill => "prefill",
            Pool::Decode => "decode",
        }
    }
}

impl std::fmt::Display for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl From<Pool> for grpc::Role {
    fn from(p: Pool) -> grpc::Role {
        match p {
            Pool::Prefill => grpc::Role::Prefill,
            Pool::Decode => grpc::Role::Decode,
        }
    }
}

impl TryFrom<grpc::Role> for Pool {
    type Error = grpc::Role;
    fn try_from(r: grpc::Role) -> Result<Pool, grpc::Role> {
        match r {
            grpc::Role::Prefill => Ok(Pool::Prefill),
            grpc::Role::Decode => Ok(Pool::Decode),
            other => Err(other),
        }
    }
}

/// Version of tandem's control and KV-transfer protocols; peers with another version are refused.
pub const PROTOCOL_VERSION: u32 = 5;

impl From<grpc::ModelIdentity> for ModelIdentity {
    fn from(g: grpc::ModelIdentity) -> Self {
        ModelIdentity {
            model: g.model,
            kv_dtype: g.kv_dtype,
            block_size: g.block_size,
            n_layers: g.n_layers,
            n_kv_heads: g.n_kv_heads,
            head_dim: g.head_dim,
            windows: g.windows,
        }
    }
}

impl From<ModelIdentity> for grpc::ModelIdentity {
    fn from(m: ModelIdentity) -> Self {
        grpc::ModelIdentity {
            model: m.model,
            kv_dtype: m.kv_dtype,
            block_size: m.block_size,
            n_layers: m.n_layers,
            n_kv_heads: m.n_kv_heads,
            head_dim: m.head_dim,
            windows: m.windows,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Connections a gRPC server accepts through [`grpc_incoming`] do not wait for ACKs to
    /// send small frames.
    #[tokio::test]
    async fn grpc_connections_have_nagle_off() {
        use tokio_stream::StreamExt;
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let mut incoming = grpc_incoming(l);
        let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
        let accepted = incoming.next().await.unwrap().unwrap();
        assert!(accepted.nodelay().unwrap());
    }
}
