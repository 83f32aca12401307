//! Placement by rendezvous (highest-random-weight) hashing: each node scores each object, and
//! the `replicas` highest-scoring nodes hold it. A node that leaves moves only its own objects
//! (each to the next-highest node); one that joins takes only those it now scores highest on.

use crate::ObjectKey;

/// FNV-1a over a node's name: stable across processes and builds (a node's id in etcd, too).
pub fn name_hash(name: &str) -> u64 {
    use types::sum::{fnv1a, FNV_OFFSET};
    name.bytes().fold(FNV_OFFSET, |h, b| fnv1a(h, b as u64))
}

/// SplitMix64's finaliser: every input bit moves every output bit.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Node `name`'s score for `key`.
fn score(key: ObjectKey, name: &str) -> u64 {
    let k = mix(key.model ^ mix(key.block.0));
    mix(k ^ name_hash(name))
}

/// The nodes among `nodes` that hold `key`, best first: the `replicas` highest scores (all the
/// nodes when there are fewer). Ties — two nodes of one name — keep the first.
pub fn place(key: ObjectKey, nodes: &[String], replicas: usize) -> Vec<&str> {
    let mut scored: Vec<(u64, usize)> = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| (score(key, n), i))
        .collect();
    scored.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    scored
        .into_iter()
        .take(replicas)
        .map(|(_, i)| nodes[i].as_str())
        .collect()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use types::BlockHash;

    use super::*;

    fn key(i: u64) -> ObjectKey {
        ObjectKey {
            model: 7,
            block: BlockHash(i.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
        }
    }

    fn nodes(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("store-{i}")).collect()
    }

    #[test]
    fn replicas_are_distinct_nodes_spread_evenly() {
        let ns = nodes(4);
        let mut first = BTreeMap::<&str, usize>::new();
        for i in 0..8_000 {
            let p = place(key(i), &ns, 2);
            assert_eq!(p.len(), 2);
            assert_ne!(p[0], p[1], "two replicas on two nodes");
            *first.entry(p[0]).or_default() += 1;
        }
        for (n, c) in &first {
            assert!((1_700..=2_300).contains(c), "{n} is first for {c} of 8000");
        }
        assert_eq!(place(key(1), &ns[..1], 3), vec!["store-0"], "fewer nodes");
    }

    #[test]
    fn a_node_leaving_moves_only_its_own_objects() {
        let ns = nodes(5);
        let fewer: Vec<String> = ns.iter().filter(|n| *n != "store-2").cloned().collect();
        let mut moved = 0;
        for i in 0..5_000 {
            let (before, after) = (place(key(i), &ns, 2), place(key(i), &fewer, 2));
            for n in &before {
                if *n != "store-2" {
                    assert!(after.contains(n), "object {i} left {n}, which stayed");
                }
            }
            moved += before.contains(&"store-2") as usize;
        }
        // About 2 in 5 objects had a copy on the node that left.
        assert!((1_700..=2_300).contains(&moved), "{moved}");
    }
}
