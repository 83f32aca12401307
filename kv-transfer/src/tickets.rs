//! A receiver's transfer tickets: a decode worker issues one with each reservation a remote
//! prefill will fill ([`Tickets::issue`]); the KV server accepts a transfer's `Begin` only with
//! the ticket of that request, once, and for no more tokens than were reserved
//! ([`Tickets::redeem`]) — before it allocates anything for the transfer. A reservation that
//! ends unfilled takes its ticket with it ([`Tickets::revoke`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use types::{RequestId, TransferTicket};

/// A ticket issued and not yet used.
#[derive(Debug, Clone, Copy)]
struct Issued {
    ticket: TransferTicket,
    max_tokens: u32,
}

/// The tickets one receiver has issued, shared by its engine thread (which issues and revokes)
/// and its KV listeners (which redeem).
#[derive(Debug, Clone, Default)]
pub struct Tickets(Arc<Mutex<HashMap<RequestId, Issued>>>);

impl Tickets {
    /// A fresh random ticket for a transfer of at most `max_tokens` tokens into request `id`'s
    /// reservation (replacing any earlier one of that request).
    pub fn issue(&self, id: RequestId, max_tokens: u32) -> TransferTicket {
        let mut bytes = [0u8; 16];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut bytes)
            .expect("the system's random source works");
        let ticket = TransferTicket(bytes);
        let issued = Issued { ticket, max_tokens };
        self.lock().insert(id, issued);
        ticket
    }

    /// Forgets request `id`'s ticket, if it has one unused.
    pub fn revoke(&self, id: RequestId) {
        self.lock().remove(&id);
    }

    /// Uses request `id`'s ticket for a transfer of `n_tokens`: it must be the ticket issued
    /// for that request, unused, for at least that many tokens. Used once, whatever the
    /// answer: a wrong guess also spends the request's ticket (its transfer fails and the
    /// router recomputes the prompt).
    pub fn redeem(
        &self,
        id: RequestId,
        shown: &TransferTicket,
        n_tokens: u32,
    ) -> Result<(), String> {
        let Some(issued) = self.lock().remove(&id) else {
            return Err(format!("no transfer into request {id} is expected here"));
        };
        if !issued.ticket.matches(shown) {
            return Err(format!("request {id}: wrong transfer ticket"));
        }
        if n_tokens > issued.max_tokens {
            let max = issued.max_tokens;
            return Err(format!("request {id}: {n_tokens} tokens, {max} reserved"));
        }
        Ok(())
    }

    /// Tickets issued and not used.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether none is waiting.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<RequestId, Issued>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ticket_opens_its_own_request_once_for_the_tokens_reserved() {
        let t = Tickets::default();
        let (a, b) = (RequestId(1), RequestId(2));
        let ta = t.issue(a, 100);
        let tb = t.issue(b, 100);
        assert!(t
            .redeem(a, &tb, 10)
            .unwrap_err()
            .contains("wrong transfer ticket"));
        // The wrong guess spent a's ticket.
        assert!(t.redeem(a, &ta, 10).unwrap_err().contains("no transfer"));
        assert!(t
            .redeem(b, &tb, 101)
            .unwrap_err()
            .contains("101 tokens, 100 reserved"));
        let tb = t.issue(b, 100);
        t.redeem(b, &tb, 100).expect("its own ticket");
        assert!(t.redeem(b, &tb, 100).is_err(), "used once");
        let c = RequestId(3);
        t.issue(c, 5);
        t.revoke(c);
        assert!(t.is_empty());
    }
}
