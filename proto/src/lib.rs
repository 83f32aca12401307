//! tandem's declarative protocol crate: the facts every process must agree on.
//!
//! - [`PROTOCOL_VERSION`] and [`ModelIdentity`]: what workers announce when they join, so that
//!   the router refuses a prefill/decode pair that cannot exchange KV.
//! - [`config`]: the `cluster.toml` schema and its validation.
//! - [`ledger`]: who holds which KV blocks on a worker (owned by the engine, driven by transfers).
//! - [`grpc`]: the control plane between router and workers (`proto/tandem.proto`), and
//!   [`membership`], the worker side of joining.

pub mod cause;
pub mod config;
pub mod ledger;
pub mod membership;
pub mod metrics;

/// Generated gRPC messages, clients and servers of `proto/tandem.proto`.
#[allow(missing_docs, clippy::all)]
pub mod grpc {
    tonic::include_proto!("tandem.v1");
    include!(concat!(env!("OUT_DIR"), "/load_fields.rs"));
}

pub use cause::Cause;

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

/// A decode worker's KV pool as raw memory, for registration with an RDMA device.
pub struct KvRegions {
    /// Per layer: (address, bytes) of the keys and of the values.
    pub layers: Vec<[(usize, usize); 2]>,
    /// Bytes of one block in one pool.
    pub block_bytes: usize,
    /// What keeps that memory allocated and unmoved: a registration holds these as long as it
    /// lives.
    pub owners: Vec<std::sync::Arc<dyn Send + Sync>>,
}

/// Version of tandem's control and KV-transfer protocols; peers with another version are refused.
pub const PROTOCOL_VERSION: u32 = 3;

/// What a worker computes with: two workers can exchange KV only if these agree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelIdentity {
    /// Model name and a digest of its weights file.
    pub model: String,
    /// Element type of the KV cache ("f16").
    pub kv_dtype: String,
    /// Tokens per KV block.
    pub block_size: u32,
    /// Transformer layers.
    pub n_layers: u32,
    /// KV heads per layer.
    pub n_kv_heads: u32,
    /// Values per head.
    pub head_dim: u32,
    /// Per layer, the attention window whose keys the layer keeps (0: every token); empty
    /// when no layer has one.
    pub windows: Vec<u32>,
}

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

impl ModelIdentity {
    /// Explains why KV computed under `self` cannot be used under `other`, if it cannot.
    pub fn incompatibility(&self, other: &ModelIdentity) -> Option<String> {
        let fields = [
            ("model", self.model.clone(), other.model.clone()),
            ("kv_dtype", self.kv_dtype.clone(), other.kv_dtype.clone()),
            (
                "block_size",
                self.block_size.to_string(),
                other.block_size.to_string(),
            ),
            (
                "n_layers",
                self.n_layers.to_string(),
                other.n_layers.to_string(),
            ),
            (
                "n_kv_heads",
                self.n_kv_heads.to_string(),
                other.n_kv_heads.to_string(),
            ),
            (
                "head_dim",
                self.head_dim.to_string(),
                other.head_dim.to_string(),
            ),
            (
                "windows",
                format!("{:?}", self.windows),
                format!("{:?}", other.windows),
            ),
        ];
        let diffs: Vec<String> = fields
            .into_iter()
            .filter(|(_, a, b)| a != b)
            .map(|(k, a, b)| format!("{k}: {a} vs {b}"))
            .collect();
        (!diffs.is_empty()).then(|| diffs.join(", "))
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

    #[test]
    fn mismatches_are_named() {
        let a = ModelIdentity {
            model: "m".into(),
            kv_dtype: "f16".into(),
            block_size: 16,
            n_layers: 30,
            n_kv_heads: 3,
            head_dim: 64,
            windows: vec![],
        };
        assert_eq!(a.incompatibility(&a.clone()), None);
        let b = ModelIdentity {
            block_size: 32,
            ..a.clone()
        };
        assert_eq!(a.incompatibility(&b).unwrap(), "block_size: 16 vs 32");
    }
}
