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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_print_and_serialise_as_their_numbers() {
        assert_eq!(WorkerId(7).to_string(), "7");
        assert_eq!(u64::from(RequestId::from(9)), 9);
        assert!(BlockHash(1) < BlockHash(2));
    }
}
