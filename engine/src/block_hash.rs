//! The prefix cache's block hashes: a full block of tokens is named by a hash chained over its
//! parent block's hash and its own tokens, seeded by the model's KV identity. Workers register
//! their cached blocks under these names and report them; the router computes the same names
//! for a prompt to know, per worker, how much of it is already cached. Stable across processes
//! and machines.

use types::BlockHash;

use crate::ModelConfig;

/// A map keyed by block names (or by names with more): hashed with foldhash under a seed drawn
/// per process, several times faster than the standard SipHash on these small keys. Keyed,
/// because the names come from a fast chain whose seed is public: a client must not be able to
/// craft prompts whose names crowd one bucket.
pub type NameMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// A set of block names (see [`NameMap`]).
pub type NameSet = std::collections::HashSet<u64, foldhash::fast::RandomState>;

/// The hash chain's value before the first block.
pub const ROOT: u64 = 0xcbf2_9ce4_8422_2325;

/// The hash of a block with these `tokens` after a block hashed `parent`, for a model whose
/// identity hashes to `seed`. Stable across processes and machines (a word-at-a-time
/// multiply-rotate, then splitmix64's finaliser), so that every worker and the router agree.
/// A match is only a routing hint at the router; a worker compares the tokens too.
pub fn chain(seed: u64, parent: u64, tokens: &[u32]) -> u64 {
    let mut h = ROOT ^ seed;
    let mut mix = |w: u64| h = (h ^ w).wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29);
    mix(parent);
    tokens.iter().for_each(|&t| mix(t as u64));
    let mut h = h ^ tokens.len() as u64;
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// The seed of a model's chain: a hash of its identity's text.
pub fn seed(identity: &str) -> u64 {
    let tokens: Vec<u32> = identity.bytes().map(u32::from).collect();
    chain(0, 0, &tokens)
}

/// The chain's seed for a model of this shape with KV blocks of `block_size` tokens: blocks of
/// two models or layouts never share a name.
pub fn identity_seed(config: &ModelConfig, block_size: usize) -> u64 {
    seed(&format!("{:?}", crate::identity_of(config, block_size)))
}

/// Where a request's chain starts: [`ROOT`], or under a `cache_salt` a root of that salt's own
/// (the first 8 bytes of a SHA-256 of it), so that requests of different salts, or with none,
/// never name a block alike — a tenant's cached blocks are hits for that tenant only.
pub fn root(salt: Option<&str>) -> u64 {
    use sha2::Digest;
    let Some(salt) = salt else {
        return ROOT;
    };
    let mut h = sha2::Sha256::new();
    h.update(b"tandem cache salt\0");
    h.update(salt.as_bytes());
    let d = h.finalize();
    u64::from_le_bytes(d[..8].try_into().expect("8 bytes"))
}

/// The names of the whole blocks of `tokens`, in order, from the chain's `root`.
pub fn prompt_hashes(seed: u64, root: u64, block_size: usize, tokens: &[u32]) -> Vec<BlockHash> {
    let mut parent = root;
    tokens
        .chunks_exact(block_size)
        .map(|b| {
            parent = chain(seed, parent, b);
            BlockHash(parent)
        })
        .collect()
}
