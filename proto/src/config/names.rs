//! The config's choices as types: each a closed set of names, read from cluster.toml once (a
//! name outside the set is an error naming the file, the line and the key) and never parsed
//! again.

use std::fmt;
use std::str::FromStr;

/// Defines a config choice: an enum of named variants, its names, `FromStr` (whose error says
/// what the name is not and lists the ones there are) and `Deserialize` through it.
macro_rules! choice {
    ($(#[$doc:meta])* $name:ident, $err:literal, {
        $($(#[$vdoc:meta])* $variant:ident = $text:literal,)+
    }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum $name {
            $($(#[$vdoc])* $variant,)+
        }

        impl $name {
            /// Every variant, in order.
            pub const ALL: &'static [$name] = &[$($name::$variant,)+];

            /// Its name in cluster.toml, logs and metrics.
            pub fn name(self) -> &'static str {
                match self {
                    $($name::$variant => $text,)+
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.name())
            }
        }

        impl FromStr for $name {
            type Err = String;

            fn from_str(s: &str) -> Result<$name, String> {
                $name::ALL.iter().copied().find(|v| v.name() == s).ok_or_else(|| {
                    let known: Vec<&str> = $name::ALL.iter().map(|v| v.name()).collect();
                    format!($err, s, known.join(", "))
                })
            }
        }

        impl<'de> serde::Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<$name, D::Error> {
                let s = String::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}

choice!(
    /// How the router picks workers (`[router] policy`).
    Policy, "{:?} is not a routing policy ({})", {
        /// Cache-aware: by the prompt's cached prefix, within a load slack (`router::routing`).
        Kv = "kv",
        /// The worker with the fewest requests in flight and queued.
        LeastLoaded = "least-loaded",
        /// Each worker in turn.
        RoundRobin = "round-robin",
    }
);

impl Default for Policy {
    fn default() -> Policy {
        Policy::Kv
    }
}

choice!(
    /// What a pool's workers compute with (`[<pool>] engine`).
    EngineKind, "{:?} is not an engine ({})", {
        /// The real engine: the model's forward on the pool's device.
        Cpu = "cpu",
        /// The mock engine: the model's shape, a timing model instead of kernels.
        Mock = "mock",
    }
);

choice!(
    /// The mock engine's timing presets (`[<pool>.mock] preset`).
    MockPreset, "unknown preset {:?} (known: {})", {
        /// Fitted to this engine on a 2-core CPU, SmolLM2-135M.
        CpuSmollm2 = "cpu-smollm2",
        /// Estimated from an H200's bandwidth, Llama 3 8B.
        H200Llama8b = "h200-llama8b",
    }
);

choice!(
    /// What turns the planner's replica counts into workers (`[<pool>.autoscale] actuator`).
    Actuator, "{:?} is not an actuator ({})", {
        /// The router starts and drains worker processes itself.
        Local = "local",
        /// `<command> <pool> <replicas>` runs on every change.
        Command = "command",
        /// The pool's Deployment is scaled through the Kubernetes API server.
        Kubernetes = "kubernetes",
    }
);

choice!(
    /// A KV transport (`[kv_transfer] prefer`, `require`; the workers' offers).
    Transport, "unknown transport {:?} (known: {})", {
        /// One-sided RDMA writes (ibverbs).
        Rdma = "rdma",
        /// QUIC (quinn).
        Quic = "quic",
        /// TCP.
        Tcp = "tcp",
    }
);

choice!(
    /// Which blocks a worker's pool evicts go down its KV tiers (`[<pool>.kv_tiers]
    /// write_policy`).
    WritePolicy, "{:?} is not a write policy ({})", {
        /// Every cached block the pool evicts.
        Evicted = "evicted",
        /// Only blocks shared from the cache at least twice.
        HitTwice = "hit-twice",
    }
);

choice!(
    /// What a worker reserves when it admits a request (`[<pool>] admission`).
    Admission, "{:?} is not an admission ({})", {
        /// The prompt plus `max_tokens`: a running sequence is never preempted.
        Reserve = "reserve",
        /// The prompt: pages are taken as sequences decode, and the newest is preempted when
        /// the pool runs out (its KV swapped to the host tier where there is one).
        Optimistic = "optimistic",
    }
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_read_back_and_strangers_are_named_with_the_choices() {
        for p in Policy::ALL {
            assert_eq!(p.name().parse::<Policy>(), Ok(*p));
        }
        assert_eq!(
            "fastest".parse::<Policy>().unwrap_err(),
            "\"fastest\" is not a routing policy (kv, least-loaded, round-robin)"
        );
        assert_eq!(Transport::Tcp.to_string(), "tcp");
    }
}
