//! The mock engine, named as such: a [`crate::Model`] with the model's shape and tokenizer but
//! no weights, whose forward ([`MockForward`]) runs no kernels but takes the time a timing
//! model gives for each step, writes no KV values (the blocks are allocated and moved at their
//! real size; its KV tiers keep only their accounting, each load and store priced by the
//! timing model as the simulator prices it), and produces deterministic tokens. Scaling tests and planner benchmarks need it:
//! on a 2-core machine extra real CPU workers add no capacity, mock ones do.

use std::time::Duration;
#[cfg(feature = "runtime")]
use std::time::Instant;

/// One KV tier's link as the timing model prices it: each batch of blocks moved in a step
/// costs `latency_us` plus its bytes at the rate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TierLink {
    /// Fixed cost of a step's loads (or stores) from this tier.
    pub latency_us: f64,
    /// Bytes per second loaded into the pool.
    pub read_bytes_per_s: f64,
    /// Bytes per second stored from the pool.
    pub write_bytes_per_s: f64,
}

impl TierLink {
    fn time_us(&self, bytes: f64, rate: f64) -> f64 {
        match bytes > 0.0 && rate > 0.0 {
            true => self.latency_us + bytes / rate * 1e6,
            false => 0.0,
        }
    }
}

/// Blocks moved between the pool and the tiers below it since the last step, by tier (host
/// memory, disk): what a timing model charges the next step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierTraffic {
    /// Tokens a block holds.
    pub block_tokens: usize,
    /// Blocks loaded into the pool.
    pub loaded: [u64; 2],
    /// Blocks stored on the step's path (the host tier's copies; the disk's writer runs
    /// beside the steps).
    pub stored: [u64; 2],
    /// Blocks fetched from the cluster KV store (staged in the host tier).
    pub fetched: u64,
}

impl TierTraffic {
    /// Whether nothing moved.
    pub fn is_empty(&self) -> bool {
        self.loaded == [0, 0] && self.stored == [0, 0] && self.fetched == 0
    }
}

/// How long a mock forward step takes:
/// `step_us + prefill_token_us × prompt tokens + decode_token_us × decode tokens
///  + kv_token_ns × KV tokens attended`, plus the tier traffic charged to it
/// ([`MockTiming::tier_time`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MockTiming {
    /// Fixed cost of a step.
    pub step_us: f64,
    /// Per token of a prefill chunk.
    pub prefill_token_us: f64,
    /// Per decoding sequence (one token each).
    pub decode_token_us: f64,
    /// Per token of KV the step's attention reads.
    pub kv_token_ns: f64,
    /// KV bytes a token takes in the modelled model: what a tier moves of a block.
    pub kv_bytes_per_token: f64,
    /// The host-memory tier (G2): PCIe to pinned memory on a GPU, a copy on a CPU.
    pub host_tier: TierLink,
    /// The disk tier (G3).
    pub disk_tier: TierLink,
    /// The cluster KV store's node over the network (a fetch reads it).
    pub store_link: TierLink,
}

impl MockTiming {
    /// Fitted to this project's CPU engine on SmolLM2-135M Q4_1 with 2 threads
    /// (`BENCHMARKS.md`): batch-1 decode ≈ 2.5 ms a token, batch 16 ≈ 23 ms a step, prefill
    /// ≈ 970 tokens/s.
    pub const CPU_SMOLLM2: MockTiming = MockTiming {
        step_us: 1150.0,
        prefill_token_us: 1030.0,
        decode_token_us: 1350.0,
        kv_token_ns: 0.0,
        // SmolLM2-135M: 30 layers × 3 KV heads × 64 × (K, V) × 2 bytes (f16).
        kv_bytes_per_token: 23_040.0,
        // A copy in this machine's memory (~8 GB/s one core), and its page cache or SSD.
        host_tier: TierLink {
            latency_us: 2.0,
            read_bytes_per_s: 8e9,
            write_bytes_per_s: 8e9,
        },
        disk_tier: TierLink {
            latency_us: 50.0,
            read_bytes_per_s: 2e9,
            write_bytes_per_s: 1e9,
        },
        // A store node on this machine's loopback, as `cargo bench -p store` measures a get.
        store_link: TierLink {
            latency_us: 900.0,
            read_bytes_per_s: 2e9,
            write_bytes_per_s: 0.7e9,
        },
    };

    /// H200-like figures for a Llama-8B-sized model in bf16, estimated from the card's memory
    /// bandwidth (4.8 TB/s: 16 GB of weights ≈ 3.4 ms a step, 128 KB of KV per token) and a
    /// prefill rate of ~20k tokens/s — estimates, not measurements.
    pub const H200_LLAMA8B: MockTiming = MockTiming {
        step_us: 4000.0,
        prefill_token_us: 50.0,
        decode_token_us: 40.0,
        kv_token_ns: 27.0,
        // Llama-8B: 32 layers × 8 KV heads × 128 × (K, V) × 2 bytes.
        kv_bytes_per_token: 131_072.0,
        // PCIe Gen5 x16 to pinned host memory (~50 GB/s each way in practice).
        host_tier: TierLink {
            latency_us: 10.0,
            read_bytes_per_s: 50e9,
            write_bytes_per_s: 50e9,
        },
        // One NVMe SSD (~7 GB/s sequential read, ~5 GB/s write).
        disk_tier: TierLink {
            latency_us: 100.0,
            read_bytes_per_s: 7e9,
            write_bytes_per_s: 5e9,
        },
        // A store node across a 100 Gb/s network (~12 GB/s), a round trip and a read.
        store_link: TierLink {
            latency_us: 50.0,
            read_bytes_per_s: 12e9,
            write_bytes_per_s: 12e9,
        },
    };

    /// The time of one step.
    pub fn step_time(
        &self,
        prefill_tokens: usize,
        decode_tokens: usize,
        kv_tokens: usize,
    ) -> Duration {
        let us = self.step_us
            + self.prefill_token_us * prefill_tokens as f64
            + self.decode_token_us * decode_tokens as f64
            + self.kv_token_ns * kv_tokens as f64 / 1000.0;
        Duration::from_secs_f64(us.max(0.0) / 1e6)
    }

    /// The time `t` takes on the tiers' links: never free, cheaper than computing the blocks.
    pub fn tier_time(&self, t: &TierTraffic) -> Duration {
        let bytes =
            |blocks: u64| (blocks as usize * t.block_tokens) as f64 * self.kv_bytes_per_token;
        let links = [&self.host_tier, &self.disk_tier];
        let store = &self.store_link;
        let us: f64 = (0..2)
            .map(|i| {
                let l = links[i];
                l.time_us(bytes(t.loaded[i]), l.read_bytes_per_s)
                    + l.time_us(bytes(t.stored[i]), l.write_bytes_per_s)
            })
            .sum::<f64>()
            + store.time_us(bytes(t.fetched), store.read_bytes_per_s);
        Duration::from_secs_f64(us / 1e6)
    }
}

/// The mock's next token after `last` at position `pos`: deterministic, never a special token
/// (ids below 256 hold SmolLM2's specials and bytes), so a request runs to its length limit.
pub fn next_token(last: u32, pos: usize, vocab: usize) -> u32 {
    let span = vocab.saturating_sub(256).max(1) as u64;
    let h =
        (last as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (pos as u64).wrapping_mul(0xC2B2_AE3D);
    256 + (h % span) as u32
}

/// Sleeps until `t0 + total × (l + 1) / n`: spreads a step's time over its layers without
/// accumulating the oversleep of many short sleeps.
#[cfg(feature = "runtime")]
fn wait_layer(t0: Instant, total: Duration, l: usize, n: usize) {
    let due = t0 + total.mul_f64((l + 1) as f64 / n.max(1) as f64);
    let now = Instant::now();
    if due > now {
        std::thread::sleep(due - now);
    }
}

/// The mock engine's forward: the timing model's time, spread over the layers (so layer-wise
/// streaming behaves as with real compute), and one-hot logits.
#[cfg(feature = "runtime")]
pub struct MockForward {
    /// How long each step takes.
    pub timing: MockTiming,
    /// On a virtual clock: steps do not sleep; each leaves its time here (nanoseconds).
    pub clock: Option<std::sync::Arc<std::sync::atomic::AtomicU64>>,
    /// The last step's modelled time (nanoseconds; 0: taken), for
    /// [`crate::forward::Forward::take_modelled_time`].
    pub modelled: std::sync::atomic::AtomicU64,
    /// Tier traffic's time charged to the next step (nanoseconds).
    pub tier_ns: std::sync::atomic::AtomicU64,
}

#[cfg(feature = "runtime")]
impl crate::forward::Forward for MockForward {
    fn name(&self) -> String {
        "mock".into()
    }

    fn kv_backed(&self) -> bool {
        self.clock.is_none()
    }

    fn tier_values(&self) -> bool {
        false
    }

    fn tier_traffic(&self, t: &TierTraffic) {
        let ns = self.timing.tier_time(t).as_nanos() as u64;
        self.tier_ns
            .fetch_add(ns, std::sync::atomic::Ordering::Relaxed);
    }

    fn modelled_time(&self) -> Option<Duration> {
        match self.modelled.load(std::sync::atomic::Ordering::Relaxed) {
            0 => None,
            ns => Some(Duration::from_nanos(ns)),
        }
    }

    fn take_modelled_time(&self) -> Option<Duration> {
        match self.modelled.swap(0, std::sync::atomic::Ordering::Relaxed) {
            0 => None,
            ns => Some(Duration::from_nanos(ns)),
        }
    }

    fn forward(
        &self,
        c: &crate::ModelConfig,
        kv: &mut crate::KvCache,
        batch: &[crate::SeqChunk<'_>],
        mut sink: Option<crate::forward::LayerSink<'_>>,
    ) -> crate::Result<Vec<Option<Vec<f32>>>> {
        let (mut prefill, mut decode, mut attended) = (0, 0, 0);
        for s in batch {
            match s.tokens.len() {
                1 if s.start_pos > 0 => decode += 1,
                // A verify chunk (a decoding sequence's newest token and its drafts): priced
                // as that many decode tokens.
                n if s.logits == crate::Logits::Verify => decode += n,
                n => prefill += n,
            }
            attended += s.start_pos + s.tokens.len();
        }
        let tier = self.tier_ns.swap(0, std::sync::atomic::Ordering::Relaxed);
        let total = self.timing.step_time(prefill, decode, attended) + Duration::from_nanos(tier);
        // At least 1 ns, so that a step of zero modelled time still counts as one.
        let at_least = (total.as_nanos() as u64).max(1);
        self.modelled
            .store(at_least, std::sync::atomic::Ordering::Relaxed);
        if let Some(clock) = &self.clock {
            let ns = total.as_nanos() as u64;
            clock.store(ns, std::sync::atomic::Ordering::Relaxed);
            return Ok(one_hot(c, batch));
        }
        let t0 = Instant::now();
        // The step's time is spread over four groups of layers (layer-wise streaming still sees
        // layers arrive over the step) rather than one sleep a layer, whose wake-ups would add
        // the machine's scheduling latency thirty times.
        let group = c.n_layers.div_ceil(4).max(1);
        for l in 0..c.n_layers {
            if (l + 1) % group == 0 || l + 1 == c.n_layers {
                wait_layer(t0, total, l, c.n_layers);
            }
            if let Some(sink) = sink.as_deref_mut() {
                sink(l, kv);
            }
        }
        Ok(one_hot(c, batch))
    }
}

/// Each logits row of the batch one-hot at the mock's next token.
#[cfg(feature = "runtime")]
fn one_hot(c: &crate::ModelConfig, batch: &[crate::SeqChunk<'_>]) -> Vec<Option<Vec<f32>>> {
    batch
        .iter()
        .map(|s| {
            let rows = s.logits.rows(s.tokens.len());
            (!rows.is_empty()).then(|| {
                let mut l = vec![0f32; rows.len() * c.vocab_size];
                for (r, j) in rows.enumerate() {
                    let end = s.start_pos + j + 1;
                    let next = next_token(s.tokens[j], end, c.vocab_size) as usize;
                    l[r * c.vocab_size + next] = 1.0;
                }
                l
            })
        })
        .collect()
}
