//! Structured output's grammars, compiled off the engine thread: a request's constraint is
//! compiled on tokio's blocking pool, at most [`SLOTS`] at once, within [`BUDGET`]; the engine
//! gets the compiled guide ([`Constraint::Compiled`]) and never compiles a grammar between its
//! steps. A constraint that takes longer is refused as a bad request (its compilation runs on
//! to its end, holding its slot: a stream of them cannot pile up work); a request that finds
//! every slot taken for as long is refused as `Full` (the router tries another worker).

use std::sync::Arc;
use std::time::Duration;

use engine::grammar::{Compiled, Grammars};
use engine::sampler::Constraint;
use proto::Cause;
use tokio::sync::Semaphore;
use tonic::Status;

/// How long a constraint may take to compile, and a request may wait for a slot.
pub const BUDGET: Duration = Duration::from_secs(2);

/// Grammars compiled at once.
pub const SLOTS: usize = 2;

/// A worker's grammar compiler.
#[derive(Clone)]
pub struct Compiler {
    grammars: Arc<Grammars>,
    slots: Arc<Semaphore>,
}

impl Compiler {
    /// The compiler over a vocabulary's `grammars`.
    pub fn new(grammars: Arc<Grammars>) -> Compiler {
        Compiler {
            grammars,
            slots: Arc::new(Semaphore::new(SLOTS)),
        }
    }

    /// Replaces `constraint`, if any, by its compiled guide, or says why it cannot be.
    pub async fn prepare(&self, constraint: &mut Option<Constraint>) -> Result<(), Status> {
        self.prepare_within(constraint, BUDGET).await
    }

    async fn prepare_within(
        &self,
        constraint: &mut Option<Constraint>,
        budget: Duration,
    ) -> Result<(), Status> {
        let Some(given) = constraint.take() else {
            return Ok(());
        };
        let slot = tokio::time::timeout(budget, self.slots.clone().acquire_owned()).await;
        let Ok(Ok(slot)) = slot else {
            let msg = format!("{SLOTS} grammars are compiling here; no slot freed in {budget:?}");
            return Err(Cause::Full.status(msg));
        };
        let grammars = self.grammars.clone();
        let job = tokio::task::spawn_blocking(move || {
            let _slot = slot;
            grammars.guide(&given)
        });
        match tokio::time::timeout(budget, job).await {
            Err(_) => {
                metrics::counter!("tandem_decode_grammar_timeouts_total").increment(1);
                let msg = format!("the response format did not compile within {budget:?}");
                Err(Cause::BadRequest.status(msg))
            }
            Ok(Err(e)) => Err(Cause::Engine.status(format!("grammar compilation failed: {e}"))),
            Ok(Ok(Err(e))) => Err(crate::status(e)),
            Ok(Ok(Ok(guide))) => {
                *constraint = Some(Constraint::Compiled(Compiled::new(guide)));
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compiler() -> Compiler {
        let (_, tok) = tandem_tests::load_model();
        Compiler::new(Arc::new(Grammars::new(&tok).expect("grammars")))
    }

    #[tokio::test]
    async fn a_constraint_is_compiled_off_the_engine_and_a_bad_one_refused() {
        let c = compiler();
        let mut none = None;
        c.prepare(&mut none).await.expect("nothing to compile");
        assert!(none.is_none());
        let mut rx = Some(Constraint::Regex("[0-9]{3}".into()));
        c.prepare(&mut rx).await.expect("compiles");
        assert!(matches!(rx, Some(Constraint::Compiled(_))), "{rx:?}");
        let mut bad = Some(Constraint::Regex("(unclosed".into()));
        let e = c.prepare(&mut bad).await.expect_err("does not compile");
        assert_eq!(Cause::of(&e), Cause::BadRequest, "{e:?}");
    }

    #[tokio::test]
    async fn with_every_slot_taken_a_request_is_refused_as_full_within_the_budget() {
        let c = compiler();
        let held = c.slots.clone().acquire_many_owned(SLOTS as u32).await;
        let mut rx = Some(Constraint::Regex("[0-9]{3}".into()));
        let wait = Duration::from_millis(50);
        let e = c.prepare_within(&mut rx, wait).await.expect_err("no slot");
        assert_eq!(Cause::of(&e), Cause::Full, "{e:?}");
        drop(held);
        c.prepare(&mut Some(Constraint::Regex("a".into())))
            .await
            .expect("a slot is free again");
    }
}
