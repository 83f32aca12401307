//! Sending KV to decode workers: what a prefill worker does with a computed prompt and a
//! decode worker with a sequence it hands off (a live move). One pool of connections per
//! receiving endpoint, the transport chosen per peer (and said once per peer), the transfer
//! counted while it runs.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kv_transfer::{KvSender, Offer, Transport};
use proto::Cause;
use tonic::Status;

/// How KV is sent.
#[derive(Debug, Clone)]
pub struct SendConfig {
    /// Connect and handshake deadline for KV connections.
    pub connect_timeout: Duration,
    /// Deadline for one request's KV transfer.
    pub transfer_timeout: Duration,
    /// Transports in order of preference.
    pub prefer: Vec<Transport>,
    /// The only transport allowed, if the cluster requires one.
    pub require: Option<Transport>,
}

/// How long a KV connection may sit idle before it is closed.
const IDLE_CONNECTION: Duration = Duration::from_secs(60);

/// Closes the connections idle for longer than [`IDLE_CONNECTION`], and forgets endpoints left
/// without one.
fn close_idle(conns: &mut HashMap<String, Vec<(KvSender, Instant)>>) {
    for idle in conns.values_mut() {
        idle.retain(|(_, since)| since.elapsed() < IDLE_CONNECTION);
    }
    conns.retain(|_, idle| !idle.is_empty());
}

/// Counts a transfer in flight until dropped, however the call ends.
pub struct Counted(Arc<AtomicUsize>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A worker's KV senders: idle connections to decode workers, by KV endpoint, with when each
/// went idle. A connection is taken out while a transfer uses it, so a cancelled transfer
/// drops its (possibly half-written) connection; one idle longer than [`IDLE_CONNECTION`] is
/// closed (a decode worker that went away, or restarted elsewhere, leaves no socket here).
pub struct Senders {
    /// This worker's side of the handshake (identity, secret, credentials).
    pub local: kv_transfer::Local,
    /// How KV is sent.
    pub cfg: SendConfig,
    conns: Mutex<HashMap<String, Vec<(KvSender, Instant)>>>,
    /// Peers whose transport choice has been logged.
    announced: Mutex<HashSet<String>>,
    /// Transfers under way.
    pub transfers: Arc<AtomicUsize>,
}

impl Senders {
    /// Senders shaking hands as `local`.
    pub fn new(local: kv_transfer::Local, cfg: SendConfig) -> Senders {
        Senders {
            local,
            cfg,
            conns: Mutex::new(HashMap::new()),
            announced: Mutex::new(HashSet::new()),
            transfers: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Counts a transfer until the guard is dropped.
    pub fn count(&self) -> Counted {
        self.transfers.fetch_add(1, Ordering::SeqCst);
        Counted(self.transfers.clone())
    }

    /// The decode worker's offer to use, and why (logged once per peer).
    pub fn choose(&self, offers: &[proto::grpc::KvOffer]) -> Result<(Offer, String), Status> {
        let offers: Vec<Offer> = offers.iter().filter_map(Offer::from_wire).collect();
        let (local, _) = kv_transfer::negotiate::local_transports();
        let (offer, why) =
            kv_transfer::negotiate::choose(&offers, &local, &self.cfg.prefer, self.cfg.require)
                .map_err(|e| Cause::KvTransfer.status(e.to_string()))?;
        let peer = offer.endpoint.clone();
        if self
            .announced
            .lock()
            .expect("announced lock")
            .insert(peer.clone())
        {
            tracing::info!(%peer, transport = %offer.transport, "KV transport chosen: {why}");
            eprintln!("tandem: KV to {peer} over {why}");
        }
        Ok((offer, why))
    }

    /// An idle connection to `offer`'s worker, or a new one.
    pub async fn connection(&self, offer: &Offer) -> Result<KvSender, Status> {
        let idle = {
            let mut conns = self.conns.lock().expect("conns lock");
            close_idle(&mut conns);
            conns
                .get_mut(&offer.endpoint)
                .and_then(Vec::pop)
                .map(|(c, _)| c)
        };
        match idle {
            Some(c) => Ok(c),
            None => KvSender::connect(offer, &self.local, self.cfg.connect_timeout)
                .await
                .map_err(|e| Cause::KvTransfer.status(e.to_string())),
        }
    }

    /// Puts back a connection whose transfer completed, for the next one to `endpoint`.
    pub fn put_back(&self, endpoint: String, conn: KvSender) {
        let mut conns = self.conns.lock().expect("conns lock");
        conns
            .entry(endpoint)
            .or_default()
            .push((conn, Instant::now()));
        close_idle(&mut conns);
    }

    /// Counts a transfer's outcome in the sender's metrics.
    pub fn record(
        transport: &'static str,
        r: &Result<kv_transfer::TransferStats, kv_transfer::TransferError>,
    ) {
        match r {
            Ok(stats) => {
                metrics::counter!("tandem_kv_sent_bytes_total", "transport" => transport)
                    .increment(stats.bytes);
                metrics::histogram!("tandem_kv_send_seconds", "transport" => transport)
                    .record(stats.elapsed.as_secs_f64());
            }
            Err(_) => metrics::counter!("tandem_kv_send_failures_total", "transport" => transport)
                .increment(1),
        }
    }
}
