//! The simulated workers: each a real engine over the mock timing model on the virtual clock.
//! What a worker does is modelled here as a real worker does it: it takes the router's calls
//! between its steps (a reservation, a prefill), steps, hands finished prefills' KV to the link,
//! writes arriving KV before its next step, and heartbeats its load and its prefix cache's
//! events to the router's table every `HEARTBEAT_PERIOD`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use engine::{Engine, PromptRate, Release, RequestId, SamplingParams};
use proto::grpc::{self, Heartbeat, JoinRequest, KvEvents};
use proto::{Cause, Pool};
use router::core::{Input, Reservation};

use crate::{ns, wid, Event, Overhead, PoolSpec, Sim, HEARTBEAT};

/// One simulated worker.
pub(crate) struct Worker {
    pub(crate) pool: Pool,
    pub(crate) engine: Engine,
    overhead: Overhead,
    /// Steps it has run (which overhead each draws).
    stepped: u64,
    /// Engine time owed to KV writes since its last step (ns): its next step starts later.
    writes: u64,
    /// The step time the virtual mock left (ns).
    clock: Arc<AtomicU64>,
    /// A step is running (its results are delivered at its end), until this virtual time.
    pub(crate) busy: bool,
    busy_until: u64,
    /// Decode: the router's opens that came while it stepped: its engine thread takes them
    /// when the step ends.
    opening: Vec<Opening>,
    /// Decode: the router's pauses (for live moves) that came while it stepped, taken when
    /// the step ends.
    pub(crate) pausing: Vec<(usize, RequestId)>,
    /// The running step's tokens, delivered at its end.
    pending: Vec<engine::TokenEvent>,
    /// Prefill: prompt tokens per second of engine time, as a real prefill worker measures it.
    rate: PromptRate,
    /// Its timing model (what a peer fetch costs it).
    pub(crate) timing: engine::MockTiming,
    /// Prefill: blocks fetched from decode workers and the seconds that took, as a real
    /// prefill worker's heartbeat reports them.
    pub(crate) peer: (u64, f64),
    /// The next KV event number (what its heartbeats carry).
    kv_next: u64,
    /// Let go by the planner: takes no new requests.
    pub(crate) draining: bool,
    /// When it joined and when it left — drained or dead (virtual ns).
    pub(crate) started: u64,
    pub(crate) stopped: Option<u64>,
    /// Frozen: no step ends until it thaws; the step that would have ended meanwhile ends then.
    pub(crate) frozen: bool,
    pub(crate) deferred: bool,
}

/// An open the router sent a decode worker.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Opening {
    pub(crate) req: usize,
    pub(crate) id: RequestId,
    pub(crate) remote: bool,
    pub(crate) local_max: u32,
}

impl Sim {
    /// A new worker of `pool` joins the router's table (its first heartbeat: an empty cache).
    pub(crate) fn add_worker(&mut self, pool: Pool, spec: &PoolSpec) -> engine::Result<()> {
        let (model, clock) = engine::Model::mock_virtual(self.cfg.model.clone(), spec.timing);
        let mut engine = Engine::new(Arc::new(model), spec.engine.clone(), Vec::new())?;
        let store_model = self.store_join(&mut engine);
        let w = self.workers.len();
        let join = JoinRequest {
            protocol_version: proto::PROTOCOL_VERSION,
            role: grpc::Role::from(pool) as i32,
            name: format!("{pool}-{w}"),
            identity: Some(engine::identity(engine.model(), spec.engine.block_size).into()),
            kv_blocks_total: engine.total_blocks() as u32,
            kv_tier_blocks: engine.model().kv_tier_blocks(&spec.engine),
            worker_id: wid(w).0,
            device: "mock".into(),
            store_model,
            // A simulated decode worker serves its blocks to peers where peer fetch is on.
            peer_endpoint: match self.cfg.peer_fetch && pool == Pool::Decode {
                true => format!("{pool}-{w}"),
                false => String::new(),
            },
            ..Default::default()
        };
        let now = self.instant();
        self.table
            .join(join, now)
            .expect("a simulated worker matches the cluster's model");
        let snapshot = KvEvents {
            snapshot: true,
            ..Default::default()
        };
        self.workers.push(Worker {
            pool,
            engine,
            overhead: spec.step_overhead.clone(),
            stepped: 0,
            writes: 0,
            clock,
            busy: false,
            busy_until: 0,
            opening: Vec::new(),
            pausing: Vec::new(),
            pending: Vec::new(),
            rate: PromptRate::default(),
            timing: spec.timing,
            peer: (0, 0.0),
            kv_next: 0,
            draining: false,
            started: self.now,
            stopped: None,
            frozen: false,
            deferred: false,
        });
        self.heartbeat(w, Some(snapshot));
        // Its heartbeats, every period from a phase of its own.
        let phase = ((w as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 33) % ns(HEARTBEAT);
        self.schedule(self.now + phase, Event::Beat(w));
        Ok(())
    }

    /// Worker `w`'s heartbeat: its load and its prefix cache's events reach the router's
    /// table; a decode worker's news wakes the requests waiting for room.
    pub(crate) fn beat(&mut self, w: usize) {
        // (None once every request has ended: the run is over.)
        if self.workers[w].stopped.is_some() || self.open == 0 {
            return;
        }
        self.heartbeat(w, None);
        self.schedule(self.now + ns(HEARTBEAT), Event::Beat(w));
        let wk = &self.workers[w];
        if wk.pool == Pool::Decode && !wk.draining && !self.waiting.is_empty() {
            self.poke(Some(w));
        }
        if self.workers[w].pool == Pool::Decode {
            self.rebalance();
        }
    }

    /// Sends worker `w`'s heartbeat (its cache's events since the last, or `kv`).
    fn heartbeat(&mut self, w: usize, kv: Option<KvEvents>) {
        let wk = &mut self.workers[w];
        let kv = kv.unwrap_or_else(|| {
            let events = wk.engine.take_kv_events();
            let first = wk.kv_next;
            wk.kv_next += events.len() as u64;
            KvEvents {
                first,
                hashes: events.iter().map(|e| e.block().0).collect(),
                stored: events.iter().map(|e| e.stored()).collect(),
                snapshot: false,
                next: wk.kv_next,
                tiers: events.iter().map(|e| e.tier().index()).collect(),
            }
        });
        let load = grpc::WorkerLoad {
            prompt_tokens_per_s: wk.rate.per_s() as f32,
            kv_peer_hits: wk.peer.0,
            kv_peer_load_seconds: wk.peer.1,
            ..worker::wire::load(&wk.engine.load())
        };
        let hb = Heartbeat {
            worker_id: wid(w).0,
            load: Some(load),
            kv: Some(kv),
        };
        let now = self.instant();
        // (A simulated worker the table forgot is a dead one: it never beats again.)
        if let Ok(b) = self.table.beat(hb, now) {
            if b.stalled {
                self.result.stalls += 1;
                self.lose(w, Input::DecodeLost, Input::PrefillLost);
            }
        }
    }

    /// Starts worker `w`'s next step if it is idle and has work: the engine runs the step now,
    /// its results are delivered when the step's time has passed.
    pub(crate) fn kick(&mut self, w: usize) {
        let wk = &mut self.workers[w];
        if wk.busy || wk.frozen || wk.stopped.is_some() || !wk.engine.has_work() {
            return;
        }
        let events = match wk.engine.step() {
            Ok(events) => events,
            Err(e) => panic!("simulated engine step failed: {e}"),
        };
        let overhead = wk.overhead.draw(w, wk.stepped);
        wk.stepped += 1;
        let d = wk.clock.load(Ordering::Relaxed) + overhead + std::mem::take(&mut wk.writes);
        let t = self.result.step_time.entry(wk.pool.name()).or_default();
        *t = (t.0 + 1, t.1 + d as f64 / 1e9);
        wk.busy = true;
        wk.busy_until = self.now + d;
        if wk.pool == Pool::Prefill {
            wk.rate.measure(wk.engine.last_step().0, d as f64 / 1e9);
        }
        wk.pending = events;
        self.result.steps += 1;
        self.schedule(self.now + d, Event::StepDone(w));
    }

    /// Worker `w`'s step ended: its tokens go to the router, finished prefills start their
    /// transfers; then the opens that came meanwhile, and its next step.
    pub(crate) fn step_done(&mut self, w: usize) {
        let wk = &mut self.workers[w];
        if wk.stopped.is_some() {
            // Dead: what its last step did went with it (a drained worker has no step left).
            return;
        }
        if wk.frozen {
            wk.deferred = true;
            return;
        }
        wk.busy = false;
        // As a real worker sends them: the step's preemptions, then its tokens.
        for id in self.workers[w].engine.take_preempted() {
            self.preempted(id);
        }
        for ev in std::mem::take(&mut self.workers[w].pending) {
            self.token(ev);
        }
        for id in self.workers[w].engine.take_prefilled() {
            let Some(sent) = self.workers[w].engine.discard_prefilled(id) else {
                continue;
            };
            self.transfer(id, sent);
        }
        self.store_puts(w);
        for o in std::mem::take(&mut self.workers[w].opening) {
            self.open_now(o, w);
        }
        for (req, id) in std::mem::take(&mut self.workers[w].pausing) {
            self.pause_now(req, id, w);
        }
        self.kick(w);
        self.retire(w);
    }

    /// The router's open of request `req` (try `id`) reaches decode worker `w`: taken between
    /// its steps.
    pub(crate) fn open_at(
        &mut self,
        req: usize,
        id: RequestId,
        w: usize,
        remote: bool,
        local_max: u32,
    ) {
        let o = Opening {
            req,
            id,
            remote,
            local_max,
        };
        match self.workers[w].busy {
            true => self.workers[w].opening.push(o),
            false => self.open_now(o, w),
        }
    }

    /// Decode worker `w` takes open `o`: reserves for a remote prefill (computing the prompt
    /// itself when little enough of it is uncached) or takes the whole request; or refuses.
    /// The answer reaches the router a hop later.
    fn open_now(&mut self, o: Opening, w: usize) {
        let Some(core) = self.reqs[o.req].core.as_ref().filter(|c| c.id() == o.id) else {
            return;
        };
        let back = self.now + ns(self.cfg.hop);
        let wk = &mut self.workers[w];
        if wk.stopped.is_some() {
            let input = Input::OpenFailed(Cause::Unreachable, "the worker is gone".into());
            return self.input_at(o.req, o.id, input, back);
        }
        if wk.draining {
            let input = Input::OpenFailed(Cause::Draining, "this decode worker is draining".into());
            return self.input_at(o.req, o.id, input, back);
        }
        let p = core.params();
        let params = SamplingParams {
            max_tokens: p.max_tokens.map(|m| m as usize),
            generated: p.generated as usize,
            ignore_eos: true,
            ..Default::default()
        };
        let prompt = core.prompt().to_vec();
        self.store_fetch(w, &prompt);
        let wk = &mut self.workers[w];
        let input = match o.remote {
            true => match wk
                .engine
                .reserve_remote(o.id, prompt, params, o.local_max as usize)
            {
                // The simulator moves no bytes: a ticket's check is the KV listener's.
                Ok(r) => Input::Opened(Some(Reservation {
                    cached_tokens: r.cached as u32,
                    local: r.local,
                    ticket: types::TransferTicket::default(),
                })),
                Err(e) => refused(e),
            },
            false => match wk.engine.add(o.id, prompt, params) {
                Ok(()) => Input::Opened(None),
                Err(e) => refused(e),
            },
        };
        self.input_at(o.req, o.id, input, back);
        self.kick(w);
    }

    /// The router's prefill call for request `req` (try `id`) reaches prefill worker `w`.
    pub(crate) fn prefill_at(
        &mut self,
        req: usize,
        id: RequestId,
        w: usize,
        to: (usize, u32, Option<(usize, u32)>),
    ) {
        let (_, skip, fetch) = to;
        let Some(core) = self.reqs[req].core.as_ref().filter(|c| c.id() == id) else {
            return;
        };
        let back = self.now + ns(self.cfg.hop);
        if self.workers[w].stopped.is_some() {
            let input = Input::PrefillFailed(Cause::Unreachable, "the worker is gone".into());
            return self.input_at(req, id, input, back);
        }
        let prompt = core.prompt().to_vec();
        if let Some((from, tokens)) = fetch {
            self.peer_fetch(w, from, &prompt, tokens as usize);
        }
        self.store_fetch(w, &prompt);
        let tokens = prompt[..prompt.len() - 1].to_vec();
        match self.workers[w]
            .engine
            .add_prefill_only(id, tokens, skip as usize, None)
        {
            Ok(()) => self.kick(w),
            Err(e) => {
                let input = match refused(e) {
                    Input::OpenFailed(cause, m) => Input::PrefillFailed(cause, m),
                    other => other,
                };
                self.input_at(req, id, input, back);
            }
        }
    }

    /// Try `id`'s `tokens` of KV leave for its decode worker over the link to its rack.
    fn transfer(&mut self, id: RequestId, tokens: usize) {
        let Some(&req) = self.by_id.get(&id) else {
            return;
        };
        let Some(decode) = self.reqs[req]
            .core
            .as_ref()
            .filter(|c| c.id() == id)
            .and_then(|c| c.phase().decode_worker())
        else {
            return;
        };
        self.send_kv(req, id, tokens, crate::widx(decode));
    }

    /// Try `id` of request `req`: `tokens` of KV leave for decode worker `decode` over the
    /// link to its rack (a prefill's, or a live move's handoff).
    pub(crate) fn send_kv(&mut self, req: usize, id: RequestId, tokens: usize, decode: usize) {
        let bytes = tokens as u64 * self.kv_bytes_per_token();
        let share = self.link_share[self.rack(decode)];
        if share <= 0.0 {
            // A cut link: the transfer fails at its deadline, and the prompt is recomputed.
            let at = self.now + ns(self.cfg.liveness.transfer_timeout);
            return self.schedule(at, Event::TransferFailed { req, id });
        }
        self.result.kv_bytes += bytes;
        self.reqs[req].kv_bytes = bytes;
        let link = self.cfg.link;
        let wire = bytes as f64 / (link.bandwidth * share) * 1e9;
        let at = self.now + ns(link.latency) + wire as u64;
        self.schedule(at, Event::KvArrived { req, id, decode });
    }

    /// Request `req`'s KV reaches decode worker `d`: its engine thread takes it between steps,
    /// writes it, answers; the prefill's call returns to the router a hop later.
    pub(crate) fn kv_arrived(&mut self, req: usize, id: RequestId, d: usize) {
        if !self.reqs[req].core.as_ref().is_some_and(|c| c.id() == id) {
            return;
        }
        let wk = &mut self.workers[d];
        let admitted = match wk.stopped {
            Some(_) => Err("the decode worker is gone".to_string()),
            None => wk.engine.admit_simulated(id).map_err(|e| e.to_string()),
        };
        if let Err(e) = admitted {
            let input = Input::PrefillFailed(Cause::KvTransfer, e);
            return self.input(req, id, input, self.now);
        }
        let write = self.reqs[req].kv_bytes as f64 * self.cfg.link.write_ns_per_byte;
        wk.writes += write as u64;
        let step_end = wk.busy_until.max(self.now);
        let returned = step_end + write as u64 + ns(self.cfg.hop);
        self.schedule(returned, Event::PrefillReturned { req, id });
        self.kick(d);
    }

    /// Request `req`'s prefill call returns: it stops being counted on its prefill worker, and
    /// the router hears the prefill is done.
    pub(crate) fn prefill_returned(&mut self, req: usize, id: RequestId) {
        if !self.reqs[req].core.as_ref().is_some_and(|c| c.id() == id) {
            return;
        }
        let p = self.reqs[req].call.take().map(|c| c.worker);
        self.input(req, id, Input::PrefillDone, self.now);
        if let Some(p) = p {
            self.retire(p);
        }
    }

    /// Worker `w` releases try `id` (the router cancelled it).
    pub(crate) fn release_on(&mut self, w: usize, id: RequestId) {
        let wk = &mut self.workers[w];
        if wk.stopped.is_none() {
            wk.engine.release(id, Release::Cancelled);
            wk.opening.retain(|o| o.id != id);
        }
    }

    /// A draining worker with nothing left leaves (its time stops counting).
    pub(crate) fn retire(&mut self, w: usize) {
        let wk = &self.workers[w];
        let idle = self.table.get(wid(w)).is_none_or(|x| x.in_flight() == 0);
        if wk.draining && wk.stopped.is_none() && idle && !wk.busy {
            self.workers[w].stopped = Some(self.now);
            self.table.remove(wid(w));
        }
    }
}

/// A worker's refusal as the router receives it (`worker::status`'s mapping of the engine's
/// error to a gRPC status and its cause).
fn refused(e: engine::EngineError) -> Input {
    let s = worker::status(e);
    Input::OpenFailed(Cause::of(&s), s.message().to_string())
}

impl Sim {
    /// Workers of `pool` that take new requests: alive, not draining, not stalled.
    pub(crate) fn pool(&self, pool: Pool) -> Vec<usize> {
        (0..self.workers.len())
            .filter(|&w| {
                let wk = &self.workers[w];
                wk.pool == pool
                    && !wk.draining
                    && wk.stopped.is_none()
                    && self.table.get(wid(w)).is_some_and(|x| x.usable())
            })
            .collect()
    }
}
