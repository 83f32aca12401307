//! The engine thread: one OS thread owns a worker's engine and applies commands between steps.
//!
//! With nothing to step it blocks on its command channel — or, when the role holds something
//! with a deadline (a decode worker's KV reservations), until the earliest deadline. It never
//! polls: a caller that goes away sends a release (see [`crate::service::ReleaseOnDrop`]).
//!
//! New work waits in the channel only up to [`MAX_QUEUED`] commands: past that a request is
//! refused as `Full` (the router tries another worker or waits), never queued without bound.
//! What follows admitted work — a release, arriving KV — is never refused: it is bounded by
//! the work admitted, and refusing it would leak what that work holds.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, TryRecvError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use proto::grpc::WorkerLoad;
use types::{KvEvent, RequestId};

use crate::kv_log::KvLog;
use crate::store::StoreCounters;
use engine::StoreBlock;
use tokio::sync::oneshot;
use tonic::Status;

/// What a pool's worker does with its engine; the thread around it is the same for both pools.
pub trait Role: Send + 'static {
    /// The pool's own commands (a prompt to prefill, a request to generate, arriving KV).
    type Cmd: Send + 'static;
    /// Whether a step would do anything.
    fn has_work(&self) -> bool;
    /// Applies one command; `draining` workers admit nothing new.
    fn command(&mut self, cmd: Self::Cmd, draining: bool);
    /// Frees everything request `id` holds here (cancelled, or its caller went away); whether
    /// it held anything.
    fn release(&mut self, id: RequestId) -> bool;
    /// Runs one engine step and hands its results on.
    fn step(&mut self);
    /// The earliest instant the role must act without a command (a lease running out).
    fn deadline(&self) -> Option<Instant> {
        None
    }
    /// Acts on deadlines at or before `now`.
    fn expire(&mut self, _now: Instant) {}
    /// The load to report (heartbeats, `Stats`), with the role's gauges updated.
    fn load(&self) -> WorkerLoad;
    /// Whether its KV tiers have writes in flight: the thread wakes to report them (the
    /// router's index learns of blocks written to disk while the worker is idle).
    fn tiers_busy(&self) -> bool {
        false
    }
    /// Prefix-cache blocks registered or forgotten since the last call, in order.
    fn kv_events(&mut self) -> Vec<KvEvent> {
        Vec::new()
    }
    /// Blocks computed since the last call, copied out for the cluster store.
    fn store_blocks(&mut self) -> Vec<StoreBlock> {
        Vec::new()
    }
    /// Blocks fetched from the cluster store, for the prefix lookups of the commands after.
    fn stage(&mut self, _blocks: Vec<StoreBlock>) {}
    /// The cached blocks of `hashes` it holds, in order up to the first it lacks (served to
    /// a worker fetching them: peer fetch).
    fn export(&mut self, _hashes: &[types::BlockHash]) -> Vec<StoreBlock> {
        Vec::new()
    }
}

/// Most commands of new work waiting for the engine thread at once.
pub const MAX_QUEUED: usize = 1024;

enum Command<C> {
    /// New work: counted against [`MAX_QUEUED`].
    Role(C),
    /// What follows work already admitted: never refused.
    Follow(C),
    Release {
        id: RequestId,
        found: Option<oneshot::Sender<bool>>,
    },
    Drain,
    /// Blocks fetched from the cluster store for the command that follows.
    Stage(Vec<StoreBlock>),
    /// Copies of cached blocks, for a worker fetching them.
    Export(Vec<types::BlockHash>, oneshot::Sender<Vec<StoreBlock>>),
}

/// Figures a worker keeps outside its engine thread, filled into each load it reports.
type Live = Arc<dyn Fn(&mut WorkerLoad) + Send + Sync>;

/// The way into an engine thread, shared by the gRPC services of its worker.
pub struct EngineHandle<C> {
    tx: mpsc::Sender<Command<C>>,
    /// Commands of new work sent and not yet taken by the engine thread.
    queued: Arc<AtomicUsize>,
    load: Arc<Mutex<WorkerLoad>>,
    live: Option<Live>,
    kv: Arc<Mutex<KvLog>>,
}

impl<C> Clone for EngineHandle<C> {
    fn clone(&self) -> Self {
        EngineHandle {
            tx: self.tx.clone(),
            queued: self.queued.clone(),
            load: self.load.clone(),
            live: self.live.clone(),
            kv: self.kv.clone(),
        }
    }
}

fn stopped() -> Status {
    proto::Cause::Engine.status("the engine thread has stopped")
}

impl<C: Send + 'static> EngineHandle<C> {
    /// Sends one of the role's commands bringing new work; refused as `Full` while
    /// [`MAX_QUEUED`] wait.
    pub fn send(&self, cmd: C) -> Result<(), Status> {
        if self.queued.fetch_add(1, Ordering::AcqRel) >= MAX_QUEUED {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            metrics::counter!("tandem_worker_commands_refused_total").increment(1);
            let msg = format!("{MAX_QUEUED} commands wait for this worker's engine");
            return Err(proto::Cause::Full.status(msg));
        }
        self.tx.send(Command::Role(cmd)).map_err(|_| stopped())
    }

    /// Sends one of the role's commands following work already admitted (arriving KV):
    /// never refused.
    pub fn follow(&self, cmd: C) -> Result<(), Status> {
        self.tx.send(Command::Follow(cmd)).map_err(|_| stopped())
    }

    /// Releases request `id`; whether it held anything here.
    pub async fn cancel(&self, id: RequestId) -> Result<bool, Status> {
        let (found, rx) = oneshot::channel();
        let found = Some(found);
        self.tx
            .send(Command::Release { id, found })
            .map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())
    }

    /// Releases request `id` without waiting for the answer (its caller went away).
    pub fn forget(&self, id: RequestId) {
        let _ = self.tx.send(Command::Release { id, found: None });
    }

    /// Stages blocks fetched from the cluster store before the commands sent after this
    /// (never refused: a fetch is bounded by the request it is for).
    pub fn stage(&self, blocks: Vec<StoreBlock>) -> Result<(), Status> {
        self.tx.send(Command::Stage(blocks)).map_err(|_| stopped())
    }

    /// Copies of the cached blocks of `hashes` the engine holds, in order up to the first it
    /// lacks, taken between two steps (a peer fetch's: the caller bounds how many).
    pub async fn export(&self, hashes: Vec<types::BlockHash>) -> Result<Vec<StoreBlock>, Status> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Command::Export(hashes, tx))
            .map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())
    }

    /// Admits nothing new from now on.
    pub fn drain(&self) -> Result<(), Status> {
        self.tx.send(Command::Drain).map_err(|_| stopped())
    }

    /// Drained: the engine thread has taken [`EngineHandle::drain`] (its load says so, and
    /// counts every command taken before it) and holds nothing — no command of new work
    /// waiting, no sequence running, queued, paused for a move or awaiting its KV, no KV being
    /// sent.
    pub fn idle(&self) -> bool {
        let l = self.load();
        l.draining
            && self.queued.load(Ordering::Acquire) == 0
            && l.running + l.waiting + l.pending_transfers + l.paused + l.transfers_in_flight == 0
    }

    /// The load after the engine's last step or command, with the live figures kept outside
    /// the engine thread read now.
    pub fn load(&self) -> WorkerLoad {
        let mut l = self.load.lock().expect("load lock").clone();
        if let Some(live) = &self.live {
            live(&mut l);
        }
        l
    }

    /// What the next heartbeat tells the router's KV index, after it has events before `from`
    /// (see [`KvLog::since`]).
    pub fn kv_events(&self, from: u64, resync: bool) -> proto::grpc::KvEvents {
        self.kv.lock().expect("kv log lock").since(from, resync)
    }

    /// How many of `blocks`, from the first, the engine holds in some tier (as of its last
    /// step).
    pub fn held_run(&self, blocks: &[types::BlockHash]) -> usize {
        self.kv.lock().expect("kv log lock").held_run(blocks)
    }

    /// This handle, filling figures kept outside the engine thread (e.g. a prefill worker's
    /// transfers in flight) into every load it reports.
    /// Each call adds to those before.
    pub fn with_live(mut self, live: impl Fn(&mut WorkerLoad) + Send + Sync + 'static) -> Self {
        self.live = Some(match self.live.take() {
            None => Arc::new(live),
            Some(before) => Arc::new(move |l: &mut WorkerLoad| {
                before(l);
                live(l)
            }),
        });
        self
    }
}

/// How often an idle engine thread looks for tier writes finished (while some are in flight).
const TIER_POLL: Duration = Duration::from_millis(50);

/// Where the blocks a role computes go: the store uploader's queue, and the counters its
/// drops are counted in.
pub type StoreOut = (tokio::sync::mpsc::Sender<StoreBlock>, Arc<StoreCounters>);

/// Starts the thread `name` around `role`.
pub fn spawn<R: Role>(name: &str, role: R) -> EngineHandle<R::Cmd> {
    spawn_with(name, role, None)
}

/// [`spawn`], the blocks the role computes sent to the cluster store through `out`.
pub fn spawn_with<R: Role>(name: &str, mut role: R, out: Option<StoreOut>) -> EngineHandle<R::Cmd> {
    let (tx, rx) = mpsc::channel();
    let load = Arc::new(Mutex::new(role.load()));
    // What the cache holds from the start (a disk tier re-read) is in the first heartbeat.
    let mut log = KvLog::default();
    log.push(role.kv_events());
    let kv = Arc::new(Mutex::new(log));
    let queued = Arc::new(AtomicUsize::new(0));
    let (l, k, q) = (load.clone(), kv.clone(), queued.clone());
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || run(role, rx, q, (l, k), out))
        .expect("engine thread starts");
    EngineHandle {
        tx,
        queued,
        load,
        live: None,
        kv,
    }
}

/// The next command: at once when the role has work, else blocking until one comes or the
/// role's deadline passes. `Err` when every handle is gone.
fn next<C>(rx: &mpsc::Receiver<C>, busy: bool, deadline: Option<Instant>) -> Result<Option<C>, ()> {
    let r = match (busy, deadline) {
        (true, _) => rx.try_recv().map_err(|e| e == TryRecvError::Disconnected),
        (false, None) => rx.recv().map_err(|_| true),
        (false, Some(d)) => rx
            .recv_timeout(d.saturating_duration_since(Instant::now()))
            .map_err(|e| e == RecvTimeoutError::Disconnected),
    };
    match r {
        Ok(c) => Ok(Some(c)),
        Err(true) => Err(()),
        Err(false) => Ok(None),
    }
}

fn run<R: Role>(
    mut role: R,
    rx: mpsc::Receiver<Command<R::Cmd>>,
    queued: Arc<AtomicUsize>,
    (load, kv): (Arc<Mutex<WorkerLoad>>, Arc<Mutex<KvLog>>),
    out: Option<StoreOut>,
) {
    let mut draining = false;
    loop {
        let poll = role.tiers_busy().then(|| Instant::now() + TIER_POLL);
        let deadline = [role.deadline(), poll].into_iter().flatten().min();
        let Ok(first) = next(&rx, role.has_work(), deadline) else {
            break;
        };
        for cmd in first
            .into_iter()
            .chain(std::iter::from_fn(|| rx.try_recv().ok()))
        {
            match cmd {
                Command::Role(c) => {
                    queued.fetch_sub(1, Ordering::AcqRel);
                    role.command(c, draining)
                }
                Command::Follow(c) => role.command(c, draining),
                Command::Release { id, found } => {
                    let held = role.release(id);
                    if let Some(f) = found {
                        let _ = f.send(held);
                    }
                }
                Command::Drain => draining = true,
                Command::Stage(blocks) => role.stage(blocks),
                Command::Export(hashes, tx) => {
                    let _ = tx.send(role.export(&hashes));
                }
            }
        }
        role.expire(Instant::now());
        if role.has_work() {
            role.step();
        }
        if let Some((tx, counters)) = &out {
            for b in role.store_blocks() {
                if tx.try_send(b).is_err() {
                    counters.dropped.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        *load.lock().expect("load lock") = WorkerLoad {
            draining,
            ..role.load()
        };
        let events = role.kv_events();
        if !events.is_empty() {
            kv.lock().expect("kv log lock").push(events);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc as std_mpsc;
    use std::time::Duration;

    use super::*;

    /// A role that records what the thread asks of it (a test double, named as one): work
    /// is a count of steps still to run; a lease expires at `deadline`.
    struct MockRole {
        work: usize,
        deadline: Option<Instant>,
        held: Vec<RequestId>,
        seen: std_mpsc::Sender<String>,
    }

    impl Role for MockRole {
        type Cmd = (RequestId, usize);
        fn has_work(&self) -> bool {
            self.work > 0
        }
        fn command(&mut self, (id, steps): (RequestId, usize), draining: bool) {
            if !draining {
                self.held.push(id);
                self.work += steps;
            }
            let _ = self.seen.send(format!("cmd {id} draining={draining}"));
        }
        fn release(&mut self, id: RequestId) -> bool {
            let held = self.held.contains(&id);
            self.held.retain(|&h| h != id);
            held
        }
        fn step(&mut self) {
            self.work -= 1;
            let _ = self.seen.send(format!("step, {} left", self.work));
        }
        fn deadline(&self) -> Option<Instant> {
            self.deadline
        }
        fn expire(&mut self, now: Instant) {
            if self.deadline.is_some_and(|d| d <= now) {
                self.deadline = None;
                let _ = self.seen.send("expired".into());
            }
        }
        fn load(&self) -> WorkerLoad {
            WorkerLoad {
                running: self.held.len() as u32,
                ..Default::default()
            }
        }
    }

    fn start(
        deadline: Option<Instant>,
    ) -> (EngineHandle<(RequestId, usize)>, std_mpsc::Receiver<String>) {
        let (seen, rx) = std_mpsc::channel();
        let role = MockRole {
            work: 0,
            deadline,
            held: Vec::new(),
            seen,
        };
        (spawn("test-engine", role), rx)
    }

    fn next(rx: &std_mpsc::Receiver<String>) -> String {
        rx.recv_timeout(Duration::from_secs(5))
            .expect("the thread acts")
    }

    #[tokio::test]
    async fn commands_step_until_idle_release_answers_and_drain_admits_nothing() {
        let (h, rx) = start(None);
        h.send((RequestId(7), 2)).unwrap();
        assert_eq!(next(&rx), "cmd 7 draining=false");
        assert_eq!(next(&rx), "step, 1 left");
        assert_eq!(next(&rx), "step, 0 left");
        assert!(h.cancel(RequestId(7)).await.unwrap(), "held, now released");
        assert!(!h.cancel(RequestId(7)).await.unwrap(), "released once");
        h.drain().unwrap();
        h.send((RequestId(8), 1)).unwrap();
        assert_eq!(next(&rx), "cmd 8 draining=true");
        // Asked through the command channel, not the published load (which the thread writes
        // after the commands it has read together, so it may lag behind "cmd 8").
        assert!(
            !h.cancel(RequestId(8)).await.unwrap(),
            "draining: 8 was not admitted"
        );
        assert!(
            rx.recv_timeout(Duration::from_millis(100)).is_err(),
            "idle: no step"
        );
    }

    #[test]
    fn an_idle_thread_wakes_for_the_roles_deadline_without_a_command() {
        let (_h, rx) = start(Some(Instant::now() + Duration::from_millis(50)));
        assert_eq!(next(&rx), "expired");
    }

    #[test]
    fn the_thread_ends_when_every_handle_is_gone() {
        let (h, rx) = start(None);
        drop(h);
        // The role (and its sender) is dropped with the thread.
        assert!(matches!(
            rx.recv_timeout(Duration::from_secs(5)),
            Err(std_mpsc::RecvTimeoutError::Disconnected)
        ));
    }
}
