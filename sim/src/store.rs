//! The cluster KV store in the simulator: the store's own [`store::objects::Objects`] on the
//! virtual clock, used as the real workers and router use a node. After each step a worker
//! puts the whole blocks its engine computed (their bytes travel beside the steps, as a real
//! worker's uploader sends them); before a request reaches a worker's engine it fetches the
//! prompt's blocks past the run it holds, up to the first the store lacks, and stages them in
//! its host tier, where the prefix lookup loads them — the fetch priced on the engine's next
//! step by the timing model's store link (`MockTiming::store_link`), as the mock engine prices
//! it. The router's KV index follows the objects' changes as it follows a node's `Watch`.

use proto::grpc::KvEvents;
use store::{Limits, ObjectKey, Objects, PutStart};

use crate::Sim;

/// The store a simulated cluster uses (`[store]` with a node set).
#[derive(Debug, Clone, Copy)]
pub struct StoreSpec {
    /// Bytes of objects it keeps (`store.capacity_bytes`).
    pub capacity_bytes: u64,
}

/// The simulated node.
pub(crate) struct SimStore {
    objects: Objects,
    /// The store's key for the model's blocks (every simulated engine's: one model).
    model: u64,
    /// The next change's number, as a node's watch numbers them.
    next: u64,
}

/// Blocks a worker's engine keeps for the store between two steps at most.
const QUEUE: usize = 1 << 16;

impl SimStore {
    pub(crate) fn new(spec: StoreSpec, model: u64) -> SimStore {
        let limits = Limits {
            capacity: spec.capacity_bytes,
            ..Limits::default()
        };
        SimStore {
            objects: Objects::new(limits),
            model,
            next: 0,
        }
    }

    fn key(&self, block: types::BlockHash) -> ObjectKey {
        ObjectKey {
            model: self.model,
            block,
        }
    }
}

impl Sim {
    /// The store, set up for worker `w`'s engine: its blocks copied out after each step; the
    /// key the worker announces (0: no store).
    pub(crate) fn store_join(&mut self, engine: &mut engine::Engine) -> u64 {
        let Some(spec) = self.cfg.store else {
            return 0;
        };
        let Some((_, key)) = engine.store_names() else {
            return 0;
        };
        assert!(
            engine.set_store_out(QUEUE),
            "a simulated engine takes part in the store"
        );
        if self.store.is_none() {
            self.store = Some(SimStore::new(spec, key));
            let snapshot = KvEvents {
                snapshot: true,
                ..Default::default()
            };
            self.table.index_mut().apply_store(0, &snapshot);
        }
        key
    }

    /// Worker `w` puts the blocks its last step computed; the router's index hears of them.
    pub(crate) fn store_puts(&mut self, w: usize) {
        let now = self.instant();
        let Some(s) = self.store.as_mut() else {
            return;
        };
        let (blocks, _) = self.workers[w].engine.take_store_blocks();
        for b in blocks {
            let key = s.key(b.hash);
            let size = b.bytes.len() as u64;
            // A refused put (full of leased or pinned objects) is dropped, as a worker drops it.
            if let Ok(PutStart::Write(id)) = s.objects.put_start(key, size, b.sum, now) {
                // As a node takes a put's bytes off its data connection.
                if s.objects.put_whole(id, b.bytes).is_err() {
                    s.objects.put_abort(id);
                }
            }
        }
        self.store_watch();
    }

    /// Before a request for `prompt` reaches worker `w`'s engine: the prompt's blocks past the
    /// run the engine holds, fetched up to the first the store lacks, staged in its host tier.
    pub(crate) fn store_fetch(&mut self, w: usize, prompt: &[u32]) {
        let now = self.instant();
        let Some(s) = self.store.as_mut() else {
            return;
        };
        let engine = &mut self.workers[w].engine;
        let mut got = Vec::new();
        for hash in engine.store_wanted(prompt, None) {
            match s.objects.get(s.key(hash), now) {
                Ok(Some(g)) => {
                    s.objects.release(g.lease);
                    got.push(engine::StoreBlock {
                        hash,
                        bytes: g.data.to_vec(),
                        sum: g.sum,
                    });
                }
                _ => break,
            }
        }
        if !got.is_empty() {
            engine.stage_store(&got);
            self.result.store_hits += got.len() as u64;
        }
    }

    /// Peer fetch: before prefill worker `w` computes `prompt`, the blocks of its first `held`
    /// tokens that decode worker `d` holds and `w` lacks, copied out of `d`'s pool into `w`'s
    /// host tier — the real workers' engine calls (`export_blocks`, `stage_store`), priced on
    /// `w`'s next step as a store fetch.
    pub(crate) fn peer_fetch(&mut self, w: usize, d: usize, prompt: &[u32], held: usize) {
        if !self.cfg.peer_fetch || held == 0 || w == d {
            return;
        }
        // The held tokens and one more: a lookup never counts a prompt's last token.
        let known = &prompt[..(held + 1).min(prompt.len())];
        let wanted = self.workers[w].engine.store_wanted(known, None);
        let got = self.workers[d].engine.export_blocks(&wanted);
        if !got.is_empty() {
            let wk = &mut self.workers[w];
            wk.engine.stage_store(&got);
            self.result.peer_hits += got.len() as u64;
            // What the fetch costs, as the step that loads it is charged (a store fetch).
            let traffic = engine::TierTraffic {
                block_tokens: self.cfg.decode.engine.block_size,
                fetched: got.len() as u64,
                ..Default::default()
            };
            wk.peer.0 += got.len() as u64;
            wk.peer.1 += wk.timing.tier_time(&traffic).as_secs_f64();
        }
    }

    /// The objects' changes since the last call, into the router's KV index.
    fn store_watch(&mut self) {
        let Some(s) = self.store.as_mut() else {
            return;
        };
        let events = store::node::watch_events(&s.objects.take_changes(), s.model, s.next);
        if events.hashes.is_empty() {
            return;
        }
        s.next = events.next;
        self.table.index_mut().apply_store(0, &events);
    }
}
