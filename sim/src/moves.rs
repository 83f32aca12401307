//! Live moves in the simulator: the router's request core asks a draining decode worker to
//! pause a sequence ([`router::core::Action::Pause`]), reserves it elsewhere and has the old
//! worker hand its KV over ([`router::core::Action::Handoff`]) — the engine's own pause, the
//! link's time for the bytes, the new worker's admission, as a prefill's KV arrives.

use engine::RequestId;
use proto::Cause;
use router::core::{Input, MoveWhy, Phase};

use crate::{ns, wid, Sim};

impl Sim {
    /// Decode worker `w` drains: every request decoding on it is told (the core moves it off
    /// live where another decode worker can take it).
    pub(crate) fn leaving(&mut self, w: usize) {
        let id = wid(w);
        for r in 0..self.reqs.len() {
            let Some(core) = self.reqs[r].core.as_ref().filter(|c| !c.ended()) else {
                continue;
            };
            if matches!(core.phase(), Phase::Decoding { decode } if decode.worker == id) {
                let rid = core.id();
                self.input(r, rid, Input::Leave(MoveWhy::Draining), self.now);
            }
        }
    }

    /// The router's rebalancer, after a decode worker's heartbeat: the requests decoding on
    /// the worker it asks to shed take it up, as many as it asked for.
    pub(crate) fn rebalance(&mut self) {
        let now = self.instant();
        let Some(shed) = self
            .rebalancer
            .as_mut()
            .and_then(|r| r.decide(&mut self.table, now))
        else {
            return;
        };
        for r in 0..self.reqs.len() {
            let Some(core) = self.reqs[r].core.as_ref().filter(|c| !c.ended()) else {
                continue;
            };
            let on =
                matches!(core.phase(), Phase::Decoding { decode } if decode.worker == shed.worker);
            if on && self.table.claim_shed(shed.worker) {
                let rid = core.id();
                self.input(r, rid, Input::Leave(MoveWhy::Rebalance), self.now);
            }
        }
    }

    /// The router's pause of request `req`'s try `id` reaches decode worker `w`: taken between
    /// its steps.
    pub(crate) fn pause_at(&mut self, req: usize, id: RequestId, w: usize) {
        match self.workers[w].busy {
            true => self.workers[w].pausing.push((req, id)),
            false => self.pause_now(req, id, w),
        }
    }

    /// Decode worker `w` pauses try `id`: the router hears so after the tokens before it.
    pub(crate) fn pause_now(&mut self, req: usize, id: RequestId, w: usize) {
        let wk = &mut self.workers[w];
        let paused = match wk.stopped {
            Some(_) => None,
            None => wk.engine.pause(id),
        };
        let input = match paused {
            Some(generated) => Input::Paused {
                generated: generated as u32,
            },
            None => Input::NotPaused,
        };
        let at = (self.now + ns(self.cfg.hop)).max(self.reqs[req].last);
        self.input_at(req, id, input, at);
    }

    /// The router's handoff call for request `req` (now try `id`) reaches decode worker
    /// `from`, holding it paused as `paused`: the KV after the `skip` tokens decode worker
    /// `decode` holds leaves over the link.
    pub(crate) fn handoff_at(
        &mut self,
        req: usize,
        id: RequestId,
        (from, paused): (usize, RequestId),
        decode: usize,
        skip: u32,
    ) {
        let Some(core) = self.reqs[req].core.as_ref().filter(|c| c.id() == id) else {
            return;
        };
        let tokens = core.prompt().len() - 1 - skip as usize;
        let wk = &self.workers[from];
        if wk.stopped.is_some() || wk.engine.blocks_of(paused) == 0 {
            let back = self.now + ns(self.cfg.hop);
            let m = format!("request {paused} is not paused on the worker it leaves");
            return self.input_at(req, id, Input::PrefillFailed(Cause::KvTransfer, m), back);
        }
        self.send_kv(req, id, tokens, decode);
    }
}
