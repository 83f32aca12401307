//! The tandem prefill worker.
//!
//! It serves the `Prefill` gRPC service: a request names the tokens whose KV to compute (a
//! prompt less its last token) and the decode worker's KV endpoint. The engine thread batches
//! waiting prompts under a token budget (chunked prefill), and as each completes its KV is copied
//! out, its blocks freed, and the KV sent straight to the decode worker over `kv-transfer` —
//! never through the router. The call returns once the decode worker has acknowledged the KV.
//! A call the router drops is cancelled: the request leaves the engine and its blocks are freed.
//!
//! What it shares with the decode worker (engine thread, model load, control plane, metrics,
//! the `Worker` service) lives in the `worker` crate; this crate is what a prefill does with
//! finished KV.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use engine::{Engine, PromptRate, RequestId};
use kv_transfer::{KvSender, Layers};
use proto::grpc::prefill_server::{Prefill, PrefillServer};
use proto::grpc::{PrefillReply, PrefillRequest, WorkerLoad};
use proto::{Cause, Pool};
use tokio::sync::{mpsc, oneshot};
use tonic::{Request, Response, Status};
use worker::kv_send::{SendConfig, Senders};
use worker::service::ReleaseOnDrop;
use worker::{EngineHandle, Settings, WorkerError};

/// How a prefill worker runs.
#[derive(Debug, Clone)]
pub struct PrefillConfig {
    /// What every worker is configured with.
    pub worker: Settings,
    /// How its KV is sent.
    pub send: SendConfig,
    /// Send each layer's KV as soon as it is computed (overlapping the transfer with the rest
    /// of the prefill) rather than all at the end.
    pub layerwise: bool,
}

/// Where a request's KV layers go, in order, as the engine produces them, and when the last
/// one was computed.
struct LayerTx {
    tx: mpsc::UnboundedSender<kv_transfer::Layer>,
    done: Arc<OnceLock<Instant>>,
}

impl LayerTx {
    /// Hands on one layer, checksummed here on the engine thread while its bytes are hot.
    fn send(&self, bytes: Vec<u8>, last: bool) {
        if last {
            let _ = self.done.set(Instant::now());
        }
        let _ = self.tx.send(kv_transfer::Layer::new(bytes));
    }
}

/// A prompt to prefill (its KV sent from token `send_from` on), its admission verdict, and
/// where its layers go.
struct Cmd {
    id: RequestId,
    tokens: Vec<u32>,
    send_from: usize,
    cache_salt: Option<String>,
    accepted: oneshot::Sender<Result<(), Status>>,
    layers: LayerTx,
}

/// The prefill pool's engine role: computes prompts and hands their KV layers on. With
/// `layerwise`, each layer of a completing prompt as soon as it is computed; otherwise all
/// layers once the prompt is done.
struct Prefiller {
    engine: Engine,
    outs: HashMap<RequestId, LayerTx>,
    /// Prompt tokens per second of engine time, reported as capacity.
    rate: PromptRate,
    layerwise: bool,
}

impl Prefiller {
    /// Runs one step; the KV of prompts it completes goes to their callers.
    fn run_step(&mut self) -> engine::Result<()> {
        let n_layers = self.engine.model().config.n_layers;
        if self.layerwise {
            let outs = &mut self.outs;
            self.engine.step_streaming(&mut |id, l, bytes| {
                let last = l + 1 == n_layers;
                if let Some(t) = outs.get(&id) {
                    t.send(bytes, last);
                }
                if last {
                    outs.remove(&id);
                }
            })?;
        } else {
            self.engine.step()?;
        }
        for id in self.engine.take_prefilled() {
            let kv = self.engine.export_kv(id).expect("reported as prefilled");
            if let Some(t) = self.outs.remove(&id) {
                let n = kv.len();
                kv.into_iter()
                    .enumerate()
                    .for_each(|(l, bytes)| t.send(bytes, l + 1 == n));
            }
        }
        Ok(())
    }

    fn measure(&mut self, prompt_tokens: usize, secs: f64) {
        self.rate.measure(prompt_tokens, secs);
        metrics::histogram!("tandem_prefill_step_seconds").record(secs);
        metrics::histogram!("tandem_prefill_batch_tokens").record(prompt_tokens as f64);
        metrics::counter!("tandem_prefill_prompt_tokens_total").increment(prompt_tokens as u64);
    }
}

impl worker::Role for Prefiller {
    type Cmd = Cmd;

    fn has_work(&self) -> bool {
        self.engine.has_work()
    }

    fn command(&mut self, c: Cmd, draining: bool) {
        let verdict = if draining {
            Err(Cause::Draining.status("this prefill worker is draining"))
        } else {
            self.engine
                .add_prefill_only(c.id, c.tokens, c.send_from, c.cache_salt)
                .map(|()| {
                    self.outs.insert(c.id, c.layers);
                })
                .map_err(worker::status)
        };
        let _ = c.accepted.send(verdict);
    }

    fn release(&mut self, id: RequestId) -> bool {
        self.outs.remove(&id);
        self.engine.release(id, engine::Release::Cancelled)
    }

    fn step(&mut self) {
        let t0 = Instant::now();
        let stepped = self.run_step();
        let took = t0.elapsed();
        self.measure(self.engine.last_step().0, took.as_secs_f64());
        if let Some(modelled) = self.engine.model().take_modelled_time() {
            metrics::histogram!("tandem_prefill_step_overhead_seconds")
                .record(took.saturating_sub(modelled).as_secs_f64());
        }
        if let Err(e) = stepped {
            // Dropping the senders fails every transfer in progress; keep serving.
            tracing::error!("prefill step failed: {e}");
            for (id, _) in std::mem::take(&mut self.outs) {
                self.engine.release(id, engine::Release::StepFailed);
            }
        }
    }

    fn store_blocks(&mut self) -> Vec<engine::StoreBlock> {
        self.engine.take_store_blocks().0
    }

    fn stage(&mut self, blocks: Vec<engine::StoreBlock>) {
        self.engine.stage_store(&blocks);
    }

    fn kv_events(&mut self) -> Vec<engine::KvEvent> {
        self.engine.take_kv_events()
    }

    fn tiers_busy(&self) -> bool {
        self.engine.tier_writes_pending()
    }

    fn load(&self) -> WorkerLoad {
        let l = WorkerLoad {
            prompt_tokens_per_s: self.rate.per_s() as f32,
            ..worker::wire::load(&self.engine.load())
        };
        metrics::gauge!("tandem_prefill_queue_depth").set(l.waiting as f64);
        metrics::gauge!("tandem_prefill_running").set(l.running as f64);
        l
    }
}

struct Service {
    engine: EngineHandle<Cmd>,
    /// The cluster KV store, when the cluster has one this engine can use.
    store: Option<worker::store::StoreLink>,
    /// Fetches from the decode worker the blocks it holds and this worker lacks (peer fetch).
    peers: Option<worker::peer::PeerLink>,
    /// Where the KV goes: connections to decode workers, the transport chosen per peer.
    senders: Senders,
    width: u32,
    n_layers: u32,
    layerwise: bool,
}

impl Service {
    /// Sends the layers as the engine produces them (streamed) or once all are computed.
    async fn transfer(
        &self,
        conn: &mut KvSender,
        id: (RequestId, kv_transfer::TransferTicket),
        n_tokens: u32,
        rx: &mut mpsc::UnboundedReceiver<kv_transfer::Layer>,
    ) -> Result<kv_transfer::TransferStats, kv_transfer::TransferError> {
        let timeout = self.senders.cfg.transfer_timeout;
        if self.layerwise {
            let layers = Layers::Stream {
                n_layers: self.n_layers,
                rx,
            };
            return conn.send(id, n_tokens, self.width, layers, timeout).await;
        }
        let mut all = Vec::with_capacity(self.n_layers as usize);
        while all.len() < self.n_layers as usize {
            match rx.recv().await {
                Some(l) => all.push(l),
                None => {
                    return Err(kv_transfer::TransferError::Protocol(
                        "the prefill of this request failed".into(),
                    ))
                }
            }
        }
        conn.send(id, n_tokens, self.width, Layers::Ready(&all), timeout)
            .await
    }
}

#[tonic::async_trait]
impl Prefill for Service {
    async fn prefill(
        &self,
        req: Request<PrefillRequest>,
    ) -> Result<Response<PrefillReply>, Status> {
        let req = req.into_inner();
        let id = RequestId(req.request_id);
        let ticket = kv_transfer::TransferTicket::from_slice(&req.transfer_ticket)
            .ok_or_else(|| Cause::BadRequest.status("transfer_ticket must be 16 bytes"))?;
        let send_from = req.skip_tokens as usize;
        // Tokens whose KV travels: those after what the decode worker holds.
        let n = req.tokens.len().saturating_sub(send_from) as u32;
        let t0 = Instant::now();
        let (accepted, verdict) = oneshot::channel();
        let (tx, mut rx) = mpsc::unbounded_channel();
        let done = Arc::new(OnceLock::new());
        let layers = LayerTx {
            tx,
            done: done.clone(),
        };
        let cache_salt = (!req.cache_salt.is_empty()).then_some(req.cache_salt);
        let tokens = req.tokens;
        let salt = cache_salt.as_deref();
        // The blocks a decode worker holds first (the request's: it holds them for this very
        // request; or another the router found holding more), then the store's past them.
        let mut staged = 0;
        if let (Some(link), false) = (&self.peers, req.peer_endpoint.is_empty()) {
            let held = match req.peer_tokens {
                0 => send_from,
                n => n as usize,
            };
            let held_there = (&tokens[..], held);
            let peer = &req.peer_endpoint;
            staged = worker::peer::prefetch(link, &self.engine, peer, held_there, salt).await?;
        }
        if let Some(link) = &self.store {
            worker::store::prefetch(link, &self.engine, &tokens, salt, staged).await?;
        }
        self.engine.send(Cmd {
            id,
            tokens,
            send_from,
            cache_salt,
            accepted,
            layers,
        })?;
        // From here on, however this call ends, the request leaves the engine.
        let _release = ReleaseOnDrop::new(&self.engine, id);
        verdict
            .await
            .map_err(|_| Cause::Engine.status("the engine thread has stopped"))??;
        let _counted = self.senders.count();
        let (offer, why) = self.senders.choose(&req.offers)?;
        // Connected while the prompt computes; then the layers, streamed or whole.
        let mut conn = self.senders.connection(&offer).await?;
        let transport = offer.transport.name();
        let sent = self.transfer(&mut conn, (id, ticket), n, &mut rx).await;
        Senders::record(transport, &sent);
        let stats = sent.map_err(|e| Cause::KvTransfer.status(e.to_string()))?;
        self.senders.put_back(offer.endpoint, conn);
        Ok(Response::new(PrefillReply {
            kv_bytes: stats.bytes,
            compute_us: done.get().map_or(0, |d| (*d - t0).as_micros() as u64),
            transfer_us: done.get().map_or(0, |d| d.elapsed().as_micros() as u64),
            transport: stats.transport.name().into(),
            transport_reason: why,
        }))
    }
}

/// Loads the model, starts the gRPC service, joins the router and serves until the process ends.
pub async fn run(cfg: PrefillConfig) -> Result<(), WorkerError> {
    let loaded = worker::load(&cfg.worker).await?;
    let model = loaded.model.clone();
    let mut engine = Engine::new(model.clone(), cfg.worker.engine.clone(), Vec::new())?;
    let (store, out) = worker::store::link(&cfg.worker, &mut engine)?.unzip();
    let peers = worker::peer::PeerLink::new(&cfg.worker, engine.store_names());
    let role = Prefiller {
        engine,
        outs: HashMap::new(),
        rate: PromptRate::default(),
        layerwise: cfg.layerwise,
    };
    let local = kv_transfer::Local {
        tickets: None,
        identity: loaded.identity.clone(),
        secret: cfg.worker.secret.clone(),
        security: cfg.worker.security.clone(),
        max_kv_tokens: u32::MAX,
    };
    let senders = Senders::new(local, cfg.send.clone());
    // Requests between admission and the decode worker's ack, counted by the service.
    let counted = senders.transfers.clone();
    let mut handle = worker::engine_thread::spawn_with("prefill-engine", role, out)
        .with_live(move |l| l.transfers_in_flight = counted.load(Ordering::SeqCst) as u32);
    if let Some(link) = &store {
        let counters = link.counters.clone();
        handle = handle.with_live(move |l| worker::store::fill(&counters, l));
    }
    if let Some(link) = &peers {
        let counters = link.counters.clone();
        handle = handle.with_live(move |l| worker::peer::fill(&counters, l));
    }
    let store_model = store.as_ref().map_or(0, |l| l.model());
    let service = Service {
        engine: handle.clone(),
        store,
        peers,
        senders,
        width: model.config.kv_width() as u32,
        n_layers: model.config.n_layers as u32,
        layerwise: cfg.layerwise,
    };
    let routes = tonic::service::Routes::new(PrefillServer::new(service));
    let announce = worker::Announce {
        pool: Pool::Prefill,
        kv_offers: Vec::new(),
        detail: String::new(),
        metrics: METRICS,
        store_model,
        peer_endpoint: String::new(),
    };
    worker::serve(&cfg.worker, &loaded, &handle, routes, announce).await
}

use proto::metrics::Kind::{Counter, Gauge, Histogram};

/// Every metric a prefill worker exports, with its help text.
const METRICS: &[(&str, proto::metrics::Kind, &str)] = &[
    (
        "tandem_prefill_queue_depth",
        Gauge,
        "Prompts waiting for the engine.",
    ),
    ("tandem_prefill_running", Gauge, "Prompts being computed."),
    (
        "tandem_prefill_step_seconds",
        Histogram,
        "Duration of one engine step.",
    ),
    (
        "tandem_prefill_step_overhead_seconds",
        Histogram,
        "A mock engine's step beyond its timing model's time: what this machine adds (the simulator draws its steps' overheads from it).",
    ),
    (
        "tandem_prefill_batch_tokens",
        Histogram,
        "Prompt tokens in one engine step.",
    ),
    (
        "tandem_prefill_prompt_tokens_total",
        Counter,
        "Prompt tokens computed (rate: prompt tokens per second).",
    ),
    (
        "tandem_kv_sent_bytes_total",
        Counter,
        "KV bytes delivered to decode workers, by transport.",
    ),
    (
        "tandem_kv_send_seconds",
        Histogram,
        "One request's KV transfer, first byte to ack, by transport.",
    ),
    (
        "tandem_kv_send_failures_total",
        Counter,
        "KV transfers that failed, by transport.",
    ),
];
