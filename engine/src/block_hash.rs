//! The prefix cache's block hashes: a full block of tokens is named by a hash chained over its
//! parent block's hash and its own tokens, seeded by the model's KV identity. Workers register
//! their cached blocks under these names and report them; the router computes the same names
//! for a prompt to know, per worker, how much of it is already cached. Stable across processes
//! and machines; SHA-256, so that names cannot be forged.

use types::BlockHash;

use crate::ModelConfig;

/// A map keyed by block names (or by names with more): hashed with foldhash under a seed drawn
/// per process, several times faster than the standard SipHash on these small keys (the names
/// are already a cryptographic hash's bytes; the per-process seed keeps a map's layout private
/// all the same).
pub type NameMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// A set of block names (see [`NameMap`]).
pub type NameSet = std::collections::HashSet<u64, foldhash::fast::RandomState>;

/// The hash chain's value before the first block.
pub const ROOT: u64 = 0xcbf2_9ce4_8422_2325;

/// The hash of a block with these `tokens` after a block hashed `parent`, for a model whose
/// identity hashes to `seed`: the first 8 bytes of a SHA-256 of the three. Stable across
/// processes and machines, so that every worker and the router agree; cryptographic, so that
/// nobody can craft a prompt whose blocks take another prompt's names (a fast chain whose seed
/// is known can be inverted: vLLM's CVE-2025-25183). A match is only a routing hint at the
/// router; a worker compares the tokens too.
pub fn chain(seed: u64, parent: u64, tokens: &[u32]) -> u64 {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    h.update(seed.to_le_bytes());
    h.update(parent.to_le_bytes());
    h.update((tokens.len() as u64).to_le_bytes());
    let mut buf = [0u8; 256];
    for part in tokens.chunks(buf.len() / 4) {
        for (b, t) in buf.chunks_exact_mut(4).zip(part) {
            b.copy_from_slice(&t.to_le_bytes());
        }
        h.update(&buf[..part.len() * 4]);
    }
    u64::from_le_bytes(h.finalize()[..8].try_into().expect("8 bytes"))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_depend_on_every_input_and_on_token_boundaries() {
        let base = chain(1, 2, &[3, 4]);
        assert_eq!(base, chain(1, 2, &[3, 4]), "stable");
        for other in [
            chain(9, 2, &[3, 4]),
            chain(1, 9, &[3, 4]),
            chain(1, 2, &[4, 3]),
        ] {
            assert_ne!(base, other);
        }
        // Tokens are hashed whole and with their count: [0x0100] is not [0x00, 0x01].
        assert_ne!(chain(1, 2, &[0x0100]), chain(1, 2, &[0, 1]));
        assert_ne!(chain(1, 2, &[]), chain(1, 2, &[0]));
        // More tokens than one buffer's worth hash every token.
        let long: Vec<u32> = (0..200).collect();
        let mut changed = long.clone();
        changed[150] = 7;
        assert_ne!(chain(1, 2, &long), chain(1, 2, &changed));
    }
}
