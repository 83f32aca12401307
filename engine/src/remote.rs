//! The engine's remote-KV API: a decode worker reserving blocks for KV a prefill worker will
//! send, admitting it when it has arrived (copied in, or written in place by RDMA and checked),
//! and the ownership ledger's lease on each reservation; a prefill worker exporting a computed
//! prompt's KV. Every way out frees the blocks and the ledger entry together
//! ([`Engine::release`]).

use std::ops::Range;
use std::time::Instant;

use types::{KvRegions, RequestId};

use crate::error::{EngineError, Result};
use crate::ledger::LedgerCounts;
use crate::sampler::SamplingParams;
use crate::scheduler::Engine;

/// A decode worker's answer to a reservation for a remote prefill.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reservation {
    /// Prompt tokens (all but the last) this cache already holds, shared from its prefix
    /// cache: the prefill sends only the rest.
    pub cached: usize,
    /// The rest is computed here, not by a prefill worker (it was short enough).
    pub local: bool,
}

impl Engine {
    /// Reserves blocks for a request whose prompt KV (all but the last prompt token) will come
    /// from a prefill worker, sharing the longest prefix this cache holds (whole blocks, at
    /// most all but one token). When what is left to compute is at most `local_max` tokens,
    /// it is computed here instead ([`Engine::prefill_here`]). Fails at once with
    /// `OutOfBlocks` when the cache has no room now.
    pub fn reserve_remote(
        &mut self,
        id: RequestId,
        prompt: Vec<u32>,
        params: SamplingParams,
        local_max: usize,
    ) -> Result<Reservation> {
        if prompt.len() < 2 {
            return Err(EngineError::InvalidRequest(
                "a remote prefill needs a prompt of at least 2 tokens".into(),
            ));
        }
        if params.prompt_logprobs.is_some() {
            return Err(EngineError::InvalidRequest(
                "prompt log-probabilities need the whole prompt computed here, not a remote prefill"
                    .into(),
            ));
        }
        let rest = prompt.len() - 1;
        let cached = self.reserve_blocks(id, prompt, params)?;
        let local = rest - cached <= local_max;
        if local {
            self.prefill_here(id)?;
        }
        Ok(Reservation { cached, local })
    }

    /// Reserves blocks for prompt plus `max_tokens` (optimistic admission: the prompt and its
    /// first token), sharing the prompt's cached prefix (all but its last two tokens: the last
    /// is computed here, the one before it arrives); returns the tokens held.
    fn reserve_blocks(
        &mut self,
        id: RequestId,
        prompt: Vec<u32>,
        params: SamplingParams,
    ) -> Result<usize> {
        let mut seq = self.new_seq(id, prompt, params, false)?;
        if let Some(seed) = self.prefix_seed {
            let known = &seq.tokens[..seq.prompt_len - 2];
            let (shared, last) = self
                .kv
                .share_prefix((seed, seq.root), &mut seq.table, known);
            (seq.computed, seq.chain) = (shared, (seq.table.blocks().len(), last));
        }
        let need = self.admission_tokens(seq.prompt_len, seq.prompt_len, seq.max_tokens);
        if let Err(e) = self.kv.reserve(&mut seq.table, need) {
            self.kv.release(seq.table);
            self.refusals += 1;
            return Err(e);
        }
        if seq.computed > 0 {
            self.kv.note_hits(&seq.table);
        }
        let lease = self.config.kv_lease.map(|d| Instant::now() + d);
        self.ledger.reserve(id, seq.table.reserved() as u32, lease);
        let cached = seq.computed;
        self.awaiting.push(seq);
        Ok(cached)
    }

    /// A reserved request whose remaining prompt is computed here instead of arriving from a
    /// prefill worker (conditional disaggregation, or a failed prefill recomputed).
    pub fn prefill_here(&mut self, id: RequestId) -> Result<()> {
        let i = self.awaiting_at(id, "reserved")?;
        let seq = self.awaiting.remove(i);
        self.ledger.commit(id);
        self.prompt_tokens += seq.prompt_len as u64;
        self.prefix_hit_tokens += seq.computed as u64;
        self.waiting.push_front(seq);
        Ok(())
    }

    fn awaiting_at(&self, id: RequestId, expected: &'static str) -> Result<usize> {
        self.awaiting
            .iter()
            .position(|s| s.id == id)
            .ok_or(EngineError::UnknownRequest { id, expected })
    }

    /// The position in `awaiting` of reserved request `id` and the tokens its remote KV covers
    /// (after the ones this cache held), once `layers` (what arrived: one entry per layer)
    /// matches the model.
    fn awaiting_kv(&self, id: RequestId, layers: usize) -> Result<(usize, Range<usize>)> {
        let i = self.awaiting_at(id, "waiting for KV")?;
        let n = self.model.config.n_layers;
        if layers != n {
            let msg = format!("{layers} layers arrived; the model has {n}");
            return Err(EngineError::KvMismatch { id, msg });
        }
        let s = &self.awaiting[i];
        Ok((i, s.computed..s.prompt_len - 1))
    }

    /// Queues awaiting request `i`, whose first `n` tokens are in the cache, to generate from
    /// its last prompt token.
    fn admit(&mut self, i: usize, n: usize) -> Result<()> {
        // A GPU model's device pool follows the host cache the KV was written into: the
        // tokens that arrived only (the cached blocks before them are the device's own).
        let s = &self.awaiting[i];
        self.model.kv_written(&self.kv, &s.table, s.computed..n)?;
        let mut seq = self.awaiting.remove(i);
        seq.computed = n;
        if let Some(seed) = self.prefix_seed {
            self.kv
                .register(seed, &seq.table, &seq.tokens, n, &mut seq.chain);
        }
        self.ledger.commit(seq.id);
        self.waiting.push_front(seq);
        Ok(())
    }

    /// Writes the KV that arrived for a reserved request (one buffer per layer, see
    /// [`crate::KvCache::read_range`]: the tokens after those this cache held) and queues it to
    /// generate from its last prompt token.
    pub fn admit_remote(&mut self, id: RequestId, layers: &[Vec<u8>]) -> Result<()> {
        let (i, range) = self.awaiting_kv(id, layers.len())?;
        for (l, data) in layers.iter().enumerate() {
            let want = self.kv.layer_bytes(l, range.clone());
            if data.len() != want {
                let msg = format!("layer {l}: {} bytes, expected {want}", data.len());
                return Err(EngineError::KvMismatch { id, msg });
            }
        }
        let table = &mut self.awaiting[i].table;
        self.kv.write_arrived(table, range.clone(), layers)?;
        self.admit(i, range.end)
    }

    /// Whether in-place (RDMA) transfers can address this cache, or why not.
    fn in_place(&self) -> Result<()> {
        match self.kv.one_table() {
            true => Ok(()),
            false => Err(EngineError::NotInPlace(format!(
                "they address one block table of whole layers; this model's cache has {} \
                 layer groups (sliding-window layers keep their own blocks)",
                self.kv.groups()
            ))),
        }
    }

    /// In-place (RDMA) transfers: the blocks a reserved request's remote KV of `n_tokens`
    /// tokens (after the whole blocks this cache held) is written into, in token order.
    pub fn grant(&self, id: RequestId, n_tokens: usize) -> Result<Vec<u32>> {
        let seq = &self.awaiting[self.awaiting_at(id, "waiting for KV")?];
        self.in_place()?;
        let from = seq.computed;
        if from + n_tokens + 1 != seq.prompt_len {
            let msg = format!(
                "{n_tokens} tokens offered for a prompt of {} with {from} held here",
                seq.prompt_len
            );
            return Err(EngineError::KvMismatch { id, msg });
        }
        let blocks = self.kv.blocks_for(from)..self.kv.blocks_for(from + n_tokens);
        Ok(seq.table.blocks()[blocks].to_vec())
    }

    /// In-place transfers: admits a reserved request whose KV was written straight into its
    /// blocks, once every layer's bytes match the CRC32 the sender computed.
    pub fn admit_in_place(&mut self, id: RequestId, crcs: &[u32]) -> Result<()> {
        let (i, range) = self.awaiting_kv(id, crcs.len())?;
        let mut buf = Vec::new();
        for (layer, &want) in crcs.iter().enumerate() {
            buf.clear();
            let table = &self.awaiting[i].table;
            self.kv.read_range(table, layer, range.clone(), &mut buf);
            let got = crc32fast::hash(&buf);
            if got != want {
                return Err(EngineError::CorruptKv {
                    id,
                    layer,
                    got,
                    want,
                });
            }
        }
        self.admit(i, range.end)
    }

    /// The KV pool as raw memory for RDMA registration (see [`crate::KvCache::raw_regions`]),
    /// with what keeps it allocated; or why in-place writes cannot address it.
    pub fn kv_regions(&mut self) -> Result<KvRegions> {
        self.in_place()?;
        let layers = self
            .kv
            .raw_regions()
            .ok_or_else(|| EngineError::NotInPlace("the KV pool has no raw regions".into()))?;
        Ok(KvRegions {
            layers,
            block_bytes: self.kv.block_bytes(),
            owners: self.kv.owners(),
        })
    }

    /// Ids of prefill-only requests whose KV is complete and not yet exported.
    pub fn take_prefilled(&self) -> Vec<RequestId> {
        self.prefilled.iter().map(|s| s.id).collect()
    }

    /// Copies out a completed prefill-only request's KV (one buffer per layer) and frees its
    /// blocks.
    pub fn export_kv(&mut self, id: RequestId) -> Option<Vec<Vec<u8>>> {
        let i = self.prefilled.iter().position(|s| s.id == id)?;
        let seq = self.prefilled.remove(i);
        let layers = (0..self.model.config.n_layers)
            .map(|l| {
                let mut buf = Vec::new();
                let range = seq.send_from..seq.prompt_len;
                self.kv.read_range(&seq.table, l, range, &mut buf);
                buf
            })
            .collect();
        self.kv.release(seq.table);
        Some(layers)
    }

    /// The KV of reserved request `id` started to arrive (its lease still runs).
    pub fn kv_arriving(&mut self, id: RequestId) -> bool {
        self.ledger.in_flight(id)
    }

    /// The sender of reserved request `id`'s KV renewed it: its lease runs from now again.
    pub fn renew_lease(&mut self, id: RequestId) -> bool {
        match self.config.kv_lease {
            Some(d) => self.ledger.renew(id, Instant::now() + d),
            None => false,
        }
    }

    /// Reservations whose lease has passed by `now` without their KV (release them).
    pub fn expired(&self, now: Instant) -> Vec<RequestId> {
        self.ledger.expired(now)
    }

    /// The earliest lease still running.
    pub fn next_lease(&self) -> Option<Instant> {
        self.ledger.next_expiry()
    }

    /// Pauses decoding request `id` for a live move: it is no longer stepped and keeps its
    /// blocks until [`Engine::export_paused`] hands its KV on and [`Engine::release`] frees
    /// it. Returns the tokens it generated (all of them already out as [`crate::TokenEvent`]s);
    /// `None` when it is not decoding here (unknown, finished, queued or still prefilling).
    pub fn pause(&mut self, id: RequestId) -> Option<usize> {
        let i = self
            .running
            .iter()
            .position(|s| s.id == id && s.decoding() && !s.prefill_only)?;
        let seq = self.running.remove(i);
        let generated = seq.tokens.len() - seq.prompt_len;
        self.paused.push(seq);
        Some(generated)
    }

    /// Resumes paused request `id` (its move found no room elsewhere): it steps again from where
    /// it paused. Whether it was paused.
    pub fn resume(&mut self, id: RequestId) -> bool {
        let Some(i) = self.paused.iter().position(|s| s.id == id) else {
            return false;
        };
        let seq = self.paused.remove(i);
        self.running.push(seq);
        true
    }

    /// A paused request's KV for a receiver that reserved it with prompt = its `n_tokens`
    /// tokens and holds the first `skip` (one buffer per layer, the layout of
    /// [`crate::KvCache::read_range`]): the tokens after `skip` but the newest, whose KV the
    /// receiver's first step computes. The request stays paused.
    pub fn export_paused(
        &self,
        id: RequestId,
        skip: usize,
        n_tokens: usize,
    ) -> Result<Vec<Vec<u8>>> {
        let s = self
            .paused
            .iter()
            .find(|s| s.id == id)
            .ok_or(EngineError::UnknownRequest {
                id,
                expected: "paused",
            })?;
        let end = s.tokens.len() - 1;
        if n_tokens != s.tokens.len() || skip > end || s.computed != end {
            let msg = format!(
                "a handoff of {n_tokens} tokens (the receiver holds {skip}); {} here, {} computed",
                s.tokens.len(),
                s.computed
            );
            return Err(EngineError::KvMismatch { id, msg });
        }
        if !self.model.kv_on_host() {
            return Err(EngineError::Handoff(format!(
                "request {id}'s KV is on {}, not in host memory: a handoff from a GPU worker is \
                 not implemented (the router computes it again elsewhere)",
                self.model.device_name()
            )));
        }
        Ok((0..self.model.config.n_layers)
            .map(|l| {
                let mut buf = Vec::new();
                self.kv.read_range(&s.table, l, skip..end, &mut buf);
                buf
            })
            .collect())
    }

    /// The ledger's blocks per state.
    pub fn ledger(&self) -> LedgerCounts {
        self.ledger.counts()
    }
}

/// The simulator's hooks (feature `sim`): its workers run real engines over the mock timing
/// model on a virtual clock, whose cache holds block accounting only, so no KV bytes move.
#[cfg(feature = "sim")]
impl Engine {
    /// The simulator's transfer: frees a completed prefill-only request's blocks without
    /// copying its KV out; returns the tokens it would have sent.
    pub fn discard_prefilled(&mut self, id: RequestId) -> Option<usize> {
        let i = self.prefilled.iter().position(|s| s.id == id)?;
        let seq = self.prefilled.remove(i);
        let sent = seq.prompt_len - seq.send_from;
        self.kv.release(seq.table);
        Some(sent)
    }

    /// The simulator's arrival: admits reserved request `id` as if its remote KV had been
    /// written (see [`Engine::discard_prefilled`]).
    pub fn admit_simulated(&mut self, id: RequestId) -> Result<()> {
        let (i, range) = self.awaiting_kv(id, self.model.config.n_layers)?;
        self.admit(i, range.end)
    }
}
