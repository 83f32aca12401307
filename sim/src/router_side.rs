//! The router's side of the simulation: each request's [`router::core::Request`] — the
//! router's own request logic — fed the inputs a real router gets, its actions carried out as
//! events on the virtual clock (a call to a worker arrives a hop later; its answer a hop after
//! the worker gave it).

use router::core::{Action, Cx, Input, Note, Params, Phase};
use types::RequestId;

use crate::{ns, widx, Call, Event, Sim};

impl Sim {
    /// Request `r` reaches the router.
    pub(crate) fn arrive(&mut self, r: usize) {
        let params = Params {
            max_tokens: Some(self.requests[r].output as u32),
            ..Default::default()
        };
        let prompt = self.requests[r].prompt.clone();
        let now = self.instant();
        let Sim {
            table,
            signals,
            cfg,
            ids,
            ..
        } = self;
        let mut next_id = || {
            *ids += 1;
            RequestId(*ids)
        };
        let mut cx = Cx {
            table,
            signals,
            settings: &cfg.router,
            next_id: &mut next_id,
        };
        let (core, actions) = router::core::Request::start(prompt, params, None, now, &mut cx);
        self.reqs[r].core = Some(core);
        self.act(r, actions, self.now);
    }

    /// Input `input` for request `r`'s try `id` at virtual time `at` (now, or later: a token's
    /// way out): now if it is due, else when it is.
    pub(crate) fn input_at(&mut self, r: usize, id: RequestId, input: Input, at: u64) {
        match at > self.now {
            true => {
                let input = Box::new(input);
                self.schedule(at, Event::Input { req: r, id, input })
            }
            false => self.input(r, id, input, at),
        }
    }

    /// Request `r`'s core takes `input` for its try `id` at `at` (dropped if the request has
    /// moved on to another try, or ended).
    pub(crate) fn input(&mut self, r: usize, id: RequestId, input: Input, at: u64) {
        let instant = self.instant_at(at);
        let Sim {
            table,
            signals,
            cfg,
            ids,
            reqs,
            ..
        } = self;
        let Some(core) = reqs[r].core.as_mut().filter(|c| c.id() == id) else {
            return;
        };
        let mut next_id = || {
            *ids += 1;
            RequestId(*ids)
        };
        let mut cx = Cx {
            table,
            signals,
            settings: &cfg.router,
            next_id: &mut next_id,
        };
        let actions = core.handle(instant, input, &mut cx);
        self.act(r, actions, at);
    }

    /// Carries out request `r`'s actions, decided at `at`.
    fn act(&mut self, r: usize, actions: Vec<Action>, at: u64) {
        let hop = ns(self.cfg.hop);
        for a in actions {
            match a {
                Action::Open {
                    worker,
                    remote,
                    local_max,
                } => self.open(r, widx(worker), remote, local_max, at + hop),
                Action::Prefill {
                    worker,
                    decode,
                    skip,
                    fetch,
                    guard,
                    pending,
                    ..
                } => {
                    let id = self.id(r);
                    let worker = widx(worker);
                    self.reqs[r].call = Some(Call {
                        worker,
                        _guards: (guard, pending),
                    });
                    let ev = Event::Prefill {
                        req: r,
                        id,
                        worker,
                        to: (widx(decode), skip, fetch.map(|(p, n)| (widx(p), n))),
                    };
                    self.schedule(at + hop, ev);
                }
                Action::Release {
                    pool,
                    worker,
                    request,
                } => {
                    if pool == proto::Pool::Prefill {
                        self.reqs[r].call = None;
                    }
                    self.release_on(widx(worker), request);
                }
                Action::Pause { worker, request } => {
                    let ev = Event::Pause {
                        req: r,
                        id: request,
                        worker: widx(worker),
                    };
                    self.schedule(at + hop, ev);
                }
                // The simulator's streams are the core's phases: nothing to keep aside.
                Action::Park { .. } => {}
                Action::Resume { worker, request } => {
                    let w = widx(worker);
                    if self.workers[w].stopped.is_none() {
                        self.workers[w].engine.resume(request);
                        self.kick(w);
                    }
                }
                Action::Handoff {
                    from,
                    request,
                    decode,
                    skip,
                    ..
                } => {
                    let ev = Event::Handoff {
                        req: r,
                        id: self.id(r),
                        from: widx(from),
                        paused: request,
                        decode: widx(decode),
                        skip,
                    };
                    self.schedule(at + hop, ev);
                }
                Action::Remove(_) => {}
                Action::MarkStalled(w) => {
                    self.lose(widx(w), Input::DecodeLost, Input::PrefillLost);
                }
                Action::Emit => self.emitted(r, at),
                Action::Fail(e) => self.failed(r, e.to_string()),
                Action::Note(n) => self.note(r, n),
            }
        }
        self.settled(r);
    }

    /// The id of request `r`'s current try.
    fn id(&self, r: usize) -> RequestId {
        self.reqs[r].core.as_ref().expect("started").id()
    }

    /// The router opens request `r`'s stream on decode worker `w`, the call arriving at `at`.
    /// While the requests waiting for room ask again after `w`'s heartbeat, one it plainly has
    /// no room for — more blocks than it has free, less what the requests before it take — is
    /// refused at once, as its engine would refuse it, without the call (thousands waiting on a
    /// cluster of hundreds would spend the simulation on calls refused; the reckoning counts
    /// none of a prompt the worker may hold, so a request fitting only thanks to its prefix
    /// cache waits longer).
    fn open(&mut self, r: usize, w: usize, remote: bool, local_max: u32, at: u64) {
        let id = self.id(r);
        if let Some((beat, room)) = self.poking.filter(|(b, _)| *b == w) {
            let core = self.reqs[r].core.as_ref().expect("started");
            let left = core.params().max_tokens.unwrap_or(0) as usize;
            let bs = self.cfg.decode.engine.block_size;
            let need = (core.prompt().len() + left).div_ceil(bs);
            if need > room {
                let why = "no room (by its last heartbeat)".to_string();
                let refused = Input::OpenFailed(proto::Cause::Full, why);
                return self.input(r, id, refused, self.now);
            }
            self.poking = Some((beat, room - need));
        }
        let ev = Event::Open {
            req: r,
            id,
            worker: w,
            remote,
            local_max,
        };
        self.schedule(at, ev);
    }

    /// Request `r`'s token passed on to its client at `at`.
    fn emitted(&mut self, r: usize, at: u64) {
        let q = &mut self.reqs[r];
        match q.first {
            None => q.first = Some(at),
            Some(_) => q.gaps.push(std::time::Duration::from_nanos(at - q.last)),
        }
        q.last = at;
        q.tokens += 1;
    }

    fn failed(&mut self, r: usize, why: String) {
        let q = &mut self.reqs[r];
        if q.error.is_none() {
            q.error = Some(why);
        }
    }

    /// Counts what the core noted for request `r`.
    fn note(&mut self, r: usize, n: Note) {
        match n {
            Note::Entered(p) => self.reqs[r].phases.push(p),
            Note::Decided(d) => {
                self.reqs[r].decisions.push(d);
                *self.result.decisions.entry(d.label()).or_default() += 1;
            }
            Note::Migrated => self.result.migrations += 1,
            Note::Moved(_) => self.result.moves += 1,
            Note::Stayed => self.result.moves_stayed += 1,
            Note::Recomputed(why) => *self.result.decisions.entry(why.label()).or_default() += 1,
            Note::Held => self.result.admission_holds += 1,
            Note::PeerFetch(p) => *self.result.peer_fetch.entry(p.label()).or_default() += 1,
            Note::Refused => self.reqs[r].refusals += 1,
            Note::Ttft(t) => {
                let ph = &mut self.result.ttft_phases;
                let mut add = |name: &'static str, d: std::time::Duration| {
                    let e = ph.entry(name).or_default();
                    *e = (e.0 + 1, e.1 + d.as_secs_f64());
                };
                add("admission", t.admission);
                if let Some(p) = t.prefill {
                    add("prefill", p);
                }
                add("first_token", t.first_token);
            }
        }
    }

    /// After request `r` moved: counted out once it has ended; in the waiting list (with its
    /// admission deadline) while it waits for room; draining workers it left may retire.
    fn settled(&mut self, r: usize) {
        let id = self.id(r);
        if self.reqs[r].known_as != Some(id) {
            self.reqs[r].known_as = Some(id);
            self.by_id.insert(id, r);
        }
        let core = self.reqs[r].core.as_ref().expect("started");
        if core.ended() {
            if !std::mem::replace(&mut self.reqs[r].done, true) {
                self.open -= 1;
            }
        } else if let Phase::Reserving { asking: None, .. } = core.phase() {
            let (id, by) = (core.id(), core.admit_by());
            if !self.waiting.contains(&r) {
                self.waiting.push(r);
            }
            if self.reqs[r].deadline_set != Some(id) {
                self.reqs[r].deadline_set = Some(id);
                let at = by.saturating_duration_since(self.base);
                self.schedule(ns(at), Event::AdmissionDeadline { req: r, id });
            }
        }
        if !self.draining.is_empty() {
            for w in self.draining.clone() {
                self.retire(w);
            }
            self.draining.retain(|&w| self.workers[w].stopped.is_none());
        }
    }

    /// The requests waiting for room ask again, in the order they came to wait: after decode
    /// worker `beat`'s heartbeat (the only worker new to them), or after any change (`None`).
    pub(crate) fn poke(&mut self, beat: Option<usize>) {
        self.poking = beat.map(|w| (w, self.workers[w].engine.free_blocks()));
        for r in std::mem::take(&mut self.waiting) {
            let waits = self.reqs[r]
                .core
                .as_ref()
                .is_some_and(|c| matches!(c.phase(), Phase::Reserving { asking: None, .. }));
            if waits {
                let id = self.id(r);
                self.input(r, id, Input::Changed, self.now);
            }
        }
        self.poking = None;
    }

    /// Request `r`'s admission deadline may have passed.
    pub(crate) fn admission_deadline(&mut self, r: usize, id: RequestId) {
        let due = self.reqs[r]
            .core
            .as_ref()
            .is_some_and(|c| c.id() == id && self.instant() >= c.admit_by());
        if due {
            self.input(r, id, Input::AdmissionDeadline, self.now);
        }
    }

    /// Request `r`'s deadline passed.
    pub(crate) fn timeout(&mut self, r: usize) {
        if let Some(c) = self.reqs[r].core.as_ref().filter(|c| !c.ended()) {
            let id = c.id();
            self.input(r, id, Input::Timeout, self.now);
        }
    }

    /// A token a decode worker's step produced: it reaches the router a hop and its drawn delay
    /// later, not before the one before it.
    pub(crate) fn token(&mut self, ev: engine::TokenEvent) {
        let Some(&r) = self.by_id.get(&ev.id) else {
            return;
        };
        let q = &self.reqs[r];
        let delay = self.cfg.token_delay.draw_token(r, q.tokens);
        let at = (self.now + ns(self.cfg.hop) + delay).max(q.last);
        let input = Input::Token {
            id: ev.token,
            finish: ev.finish,
        };
        self.input(r, ev.id, input, at);
    }

    /// A decode worker's step preempted request `id`: its stream says so a hop later, after
    /// the tokens before it.
    pub(crate) fn preempted(&mut self, id: RequestId) {
        let Some(&r) = self.by_id.get(&id) else {
            return;
        };
        let at = (self.now + ns(self.cfg.hop)).max(self.reqs[r].last);
        self.input(r, id, Input::Preempted, at);
    }

    /// The router loses worker `w`: each request on it as a decode worker gets `decode`, each
    /// prefilling on it gets `prefill`.
    pub(crate) fn lose(&mut self, w: usize, decode: Input, prefill: Input) {
        let id = crate::wid(w);
        for r in 0..self.reqs.len() {
            let Some(core) = self.reqs[r].core.as_ref().filter(|c| !c.ended()) else {
                continue;
            };
            let rid = core.id();
            let on_decode = core.phase().decode_worker() == Some(id);
            let prefilling =
                matches!(core.phase(), Phase::Prefilling { prefill, .. } if *prefill == id);
            if on_decode {
                self.input(r, rid, clone_input(&decode), self.now);
            } else if prefilling {
                self.input(r, rid, clone_input(&prefill), self.now);
            }
        }
    }
}

/// A copy of a loss's input (those carry no payload but a cause and a message).
fn clone_input(i: &Input) -> Input {
    match i {
        Input::DecodeLost => Input::DecodeLost,
        Input::PrefillLost => Input::PrefillLost,
        Input::DecodeFailed(c, m) => Input::DecodeFailed(*c, m.clone()),
        Input::PrefillFailed(c, m) => Input::PrefillFailed(*c, m.clone()),
        _ => unreachable!("a loss"),
    }
}
