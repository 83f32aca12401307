//! A small etcd v3 client: the calls membership needs (leases kept alive, keys put under them,
//! a prefix listed and watched, an election campaigned in), over tonic with the messages of
//! `proto/` (a subset of etcd's API, written for tandem).

use std::time::Duration;

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};
use tonic::Streaming;

/// The generated messages and clients.
#[allow(missing_docs, clippy::all)]
pub mod pb {
    /// etcd's key-value types.
    pub mod mvccpb {
        tonic::include_proto!("mvccpb");
    }
    /// etcd's KV, Watch and Lease services.
    pub mod etcdserverpb {
        tonic::include_proto!("etcdserverpb");
    }
    /// etcd's election service.
    pub mod v3electionpb {
        tonic::include_proto!("v3electionpb");
    }
}

use pb::etcdserverpb::kv_client::KvClient;
use pb::etcdserverpb::lease_client::LeaseClient;
use pb::etcdserverpb::watch_client::WatchClient;
use pb::etcdserverpb::{
    watch_request, LeaseGrantRequest, LeaseKeepAliveRequest, LeaseKeepAliveResponse,
    LeaseRevokeRequest, PutRequest, RangeRequest, WatchCreateRequest, WatchRequest, WatchResponse,
};
use pb::mvccpb::KeyValue;
use pb::v3electionpb::election_client::ElectionClient;
use pb::v3electionpb::CampaignRequest;

/// Why a call to etcd failed.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    /// No endpoint could be connected to.
    #[error("connecting to etcd ({endpoints}): {why}")]
    Connect {
        /// The endpoints tried.
        endpoints: String,
        /// The last one's error.
        why: String,
    },
    /// etcd answered with an error (or the connection broke mid-call).
    #[error("{}: {}", .0.code(), .0.message())]
    Status(#[from] tonic::Status),
}

/// A connection to one of etcd's endpoints.
#[derive(Clone)]
pub struct Etcd {
    channel: Channel,
}

/// The sending half of a lease's keep-alive stream, and its answers.
pub struct KeepAlive {
    tx: mpsc::Sender<LeaseKeepAliveRequest>,
    answers: Streaming<LeaseKeepAliveResponse>,
    id: i64,
}

impl KeepAlive {
    /// Renews the lease; its TTL in seconds as etcd answers (0: the lease is gone).
    pub async fn renew(&mut self) -> Result<i64, EtcdError> {
        let closed = || tonic::Status::unavailable("the keep-alive stream closed");
        let req = LeaseKeepAliveRequest { id: self.id };
        self.tx.send(req).await.map_err(|_| closed())?;
        match self.answers.message().await? {
            Some(a) => Ok(a.ttl),
            None => Err(closed().into()),
        }
    }
}

/// A watch of a prefix: its events as etcd sends them.
pub struct Watch {
    /// Held while the watch lasts: etcd ends a watch stream whose sending side closes.
    _tx: mpsc::Sender<WatchRequest>,
    stream: Streaming<WatchResponse>,
}

impl Watch {
    /// The next response (`None`: the stream ended).
    pub async fn next(&mut self) -> Result<Option<WatchResponse>, EtcdError> {
        Ok(self.stream.message().await?)
    }
}

/// The end of the range of keys starting with `prefix` (its last byte below 0xff incremented,
/// what follows dropped; `\0`, every key from `prefix` on, when all are 0xff).
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(b) = end.pop() {
        if b < 0xff {
            end.push(b + 1);
            return end;
        }
    }
    vec![0]
}

/// The endpoint `e`: under `https://`, mutual TLS with `tls` against a server certificate for
/// [`crate::ETCD_NAME`].
fn endpoint(e: &str, tls: Option<&crate::Tls>) -> Result<Endpoint, String> {
    let endpoint = Endpoint::from_shared(e.to_string()).map_err(|err| err.to_string())?;
    if !e.starts_with("https://") {
        return Ok(endpoint);
    }
    let t = tls.ok_or("an https endpoint needs the cluster's credentials (not insecure = true)")?;
    let config = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(&t.ca))
        .identity(tonic::transport::Identity::from_pem(&t.cert, &t.key))
        .domain_name(crate::ETCD_NAME);
    endpoint.tls_config(config).map_err(|err| err.to_string())
}

impl Etcd {
    /// Connects to the first of `endpoints` that answers within `deadline`; the connection
    /// pings every `ping` (not below 5 s: etcd closes connections that ping more often) and
    /// fails when a ping goes unanswered for `deadline`.
    pub async fn connect(
        endpoints: &[String],
        deadline: Duration,
        tls: Option<&crate::Tls>,
    ) -> Result<Etcd, EtcdError> {
        let mut why = String::from("no endpoint");
        for e in endpoints {
            let endpoint = match endpoint(e, tls) {
                Ok(x) => x,
                Err(err) => {
                    why = format!("{e}: {err}");
                    continue;
                }
            };
            let endpoint = endpoint
                .connect_timeout(deadline)
                .http2_keep_alive_interval(Duration::from_secs(5))
                .keep_alive_timeout(deadline)
                .keep_alive_while_idle(true);
            match endpoint.connect().await {
                Ok(channel) => return Ok(Etcd { channel }),
                Err(err) => why = format!("{e}: {err}"),
            }
        }
        Err(EtcdError::Connect {
            endpoints: endpoints.join(", "),
            why,
        })
    }

    /// A lease of `ttl_secs`; its id.
    pub async fn grant(&self, ttl_secs: i64) -> Result<i64, EtcdError> {
        let req = LeaseGrantRequest {
            ttl: ttl_secs,
            id: 0,
        };
        let r = LeaseClient::new(self.channel.clone())
            .lease_grant(req)
            .await?;
        Ok(r.into_inner().id)
    }

    /// Ends lease `id` now (its keys go with it).
    pub async fn revoke(&self, id: i64) -> Result<(), EtcdError> {
        let req = LeaseRevokeRequest { id };
        LeaseClient::new(self.channel.clone())
            .lease_revoke(req)
            .await?;
        Ok(())
    }

    /// A keep-alive stream for lease `id`, renewed once. (etcd answers a stream's headers
    /// with its first message: the first renewal goes before the call, or neither side moves.)
    pub async fn keep_alive(&self, id: i64) -> Result<KeepAlive, EtcdError> {
        let (tx, rx) = mpsc::channel(1);
        tx.send(LeaseKeepAliveRequest { id })
            .await
            .map_err(|_| tonic::Status::internal("the keep-alive request was not sent"))?;
        let mut client = LeaseClient::new(self.channel.clone());
        let mut answers = client
            .lease_keep_alive(ReceiverStream::new(rx))
            .await?
            .into_inner();
        match answers.message().await? {
            Some(a) if a.ttl > 0 => Ok(KeepAlive { tx, answers, id }),
            _ => Err(tonic::Status::not_found("the lease is gone").into()),
        }
    }

    /// Puts `key = value` under lease `lease` (0: none).
    pub async fn put(&self, key: &str, value: Vec<u8>, lease: i64) -> Result<(), EtcdError> {
        let req = PutRequest {
            key: key.as_bytes().to_vec(),
            value,
            lease,
        };
        KvClient::new(self.channel.clone()).put(req).await?;
        Ok(())
    }

    /// Every key starting with `prefix`, and the store's revision they were read at.
    pub async fn list(&self, prefix: &str) -> Result<(Vec<KeyValue>, i64), EtcdError> {
        let req = RangeRequest {
            key: prefix.as_bytes().to_vec(),
            range_end: prefix_end(prefix.as_bytes()),
            limit: 0,
            revision: 0,
        };
        let r = KvClient::new(self.channel.clone())
            .range(req)
            .await?
            .into_inner();
        Ok((r.kvs, r.header.map_or(0, |h| h.revision)))
    }

    /// Watches the keys starting with `prefix` from revision `from` on (the create request goes
    /// before the call, as for [`Etcd::keep_alive`]).
    pub async fn watch(&self, prefix: &str, from: i64) -> Result<Watch, EtcdError> {
        let (tx, rx) = mpsc::channel(1);
        let create = WatchCreateRequest {
            key: prefix.as_bytes().to_vec(),
            range_end: prefix_end(prefix.as_bytes()),
            start_revision: from,
            ..Default::default()
        };
        let req = WatchRequest {
            request_union: Some(watch_request::RequestUnion::CreateRequest(create)),
        };
        tx.send(req)
            .await
            .map_err(|_| tonic::Status::internal("the watch request was not sent"))?;
        let stream = WatchClient::new(self.channel.clone())
            .watch(ReceiverStream::new(rx))
            .await?
            .into_inner();
        Ok(Watch { _tx: tx, stream })
    }

    /// Campaigns in election `name` with `value` under lease `lease`: returns once this member
    /// leads (it waits while another does).
    pub async fn campaign(&self, name: &str, value: Vec<u8>, lease: i64) -> Result<(), EtcdError> {
        let req = CampaignRequest {
            name: name.as_bytes().to_vec(),
            lease,
            value,
        };
        ElectionClient::new(self.channel.clone())
            .campaign(req)
            .await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_range_ends_past_every_key_starting_with_it() {
        assert_eq!(prefix_end(b"/tandem/a/"), b"/tandem/a0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff\xff"), b"\0");
    }
}
