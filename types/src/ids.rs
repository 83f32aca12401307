//! Newtypes for the ids that cross crates.

use std::fmt;

macro_rules! id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(
            Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, serde::Serialize,
        )]
        #[serde(transparent)]
        pub struct $name(pub u64);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }

        impl From<u64> for $name {
            fn from(v: u64) -> $name {
                $name(v)
            }
        }

        impl From<$name> for u64 {
            fn from(v: $name) -> u64 {
                v.0
            }
        }
    };
}

id!(
    /// A worker, as the router (or etcd) numbered it when it joined.
    WorkerId
);
id!(
    /// One try of a request on the workers: a router's random prefix and a counter. A request
    /// recomputed or migrated gets a new one, so a late answer to an old try is never mistaken
    /// for the new one's.
    RequestId
);
id!(
    /// The name of a whole KV block: a hash of its tokens and of every token before it, seeded
    /// by the model's KV identity (`engine::block_hash`). Equal names, equal KV.
    BlockHash
);

/// A decode worker's permission for one KV transfer into one reservation: 16 random bytes
/// issued with the reservation, handed by the router to the prefill worker it picks and shown in
/// the transfer's `Begin`. Whoever lacks it cannot write into the reservation. Printed as
/// `TransferTicket(..)`: it is a secret while the reservation waits.
#[derive(Clone, Copy, PartialEq, Eq, Default)]
pub struct TransferTicket(pub [u8; 16]);

impl TransferTicket {
    /// The ticket in these 16 bytes; `None` for any other length.
    pub fn from_slice(bytes: &[u8]) -> Option<TransferTicket> {
        Some(TransferTicket(bytes.try_into().ok()?))
    }

    /// Whether `other` is this ticket, comparing every byte whatever the first difference.
    pub fn matches(&self, other: &TransferTicket) -> bool {
        let diff = self
            .0
            .iter()
            .zip(&other.0)
            .fold(0u8, |d, (a, b)| d | (a ^ b));
        diff == 0
    }
}

impl fmt::Debug for TransferTicket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("TransferTicket(..)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_print_and_serialise_as_their_numbers() {
        assert_eq!(WorkerId(7).to_string(), "7");
        assert_eq!(u64::from(RequestId::from(9)), 9);
        assert!(BlockHash(1) < BlockHash(2));
    }

    #[test]
    fn a_ticket_matches_only_itself_and_never_prints() {
        let t = TransferTicket([7; 16]);
        let mut other = t;
        other.0[15] = 8;
        assert!(t.matches(&t) && !t.matches(&other));
        assert_eq!(TransferTicket::from_slice(&[7; 16]), Some(t));
        assert_eq!(TransferTicket::from_slice(&[7; 15]), None);
        assert_eq!(format!("{t:?}"), "TransferTicket(..)");
    }
}
