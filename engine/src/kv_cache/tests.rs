//! The paged KV cache's block accounting, windows and prefix sharing.

use super::*;

#[test]
fn blocks_are_reserved_all_or_nothing_and_freed_once() {
    let mut kv = KvCache::new(2, 8, 16, 4).unwrap();
    let mut a = BlockTable::default();
    kv.reserve(&mut a, 33).unwrap();
    assert_eq!(a.blocks().len(), 3);
    assert_eq!(kv.free_blocks(), 1);
    let mut b = BlockTable::default();
    assert!(kv.reserve(&mut b, 20).is_err());
    assert_eq!(b.blocks().len(), 0);
    assert_eq!(kv.free_blocks(), 1);
    kv.reserve(&mut b, 16).unwrap();
    assert_eq!(
        kv.slot(a.blocks(), 17),
        Some(a.blocks()[1] as usize * 16 + 1)
    );
    assert_eq!(kv.slot(a.blocks(), 48), None);
    kv.release(a);
    kv.release(b);
    assert_eq!(kv.free_blocks(), 4);
}

#[test]
fn a_released_sequences_tail_is_evicted_before_its_head() {
    let mut kv = KvCache::new(1, 2, 2, 4).unwrap();
    let (seed, tokens) = (9, [1, 2, 3, 4, 5, 6]);
    let mut a = BlockTable::default();
    kv.reserve(&mut a, 6).unwrap();
    let mut chain = (0, crate::prefix::ROOT);
    kv.register(seed, &a, &tokens, 6, &mut chain);
    kv.release(a);
    assert_eq!(kv.block_counts().cached, 3);
    // One block is needed: the last of the three goes, the first two still make a prefix.
    let mut b = BlockTable::default();
    kv.reserve(&mut b, 4).unwrap();
    let mut c = BlockTable::default();
    assert_eq!(
        kv.share_prefix((seed, crate::prefix::ROOT), &mut c, &tokens)
            .0,
        4
    );
    assert_eq!(kv.evicted_blocks(), 1);
    kv.release(b);
    kv.release(c);
}

#[test]
fn layers_group_by_window_in_groups_of_one_size() {
    // Gemma 3 270M: five windowed layers, then a global one, three times.
    let gemma: Vec<Option<usize>> = (0..18).map(|l| (l % 6 != 5).then_some(512)).collect();
    let (groups, at) = groups_of(&gemma);
    assert_eq!(groups.len(), 6);
    assert_eq!(groups[0].window, None, "group 0 sees every token");
    assert_eq!((at[5], at[11], at[17]), ((0, 0), (0, 1), (0, 2)));
    assert_eq!(
        (at[0], at[2], at[3], at[6]),
        ((1, 0), (1, 2), (2, 0), (2, 2))
    );
    // Counts without a common divisor: one layer a group.
    let odd = [None, Some(8), Some(8), None, Some(8)];
    assert_eq!(groups_of(&odd).0.len(), 5);
    assert_eq!(groups_of(&[None; 4]).0.len(), 1);
}

#[test]
fn a_windowed_group_holds_its_window_and_its_pages_are_promised() {
    // One global layer and two windowed ones (window 4), blocks of 2, chunks of 2.
    let windows = [None, Some(4), Some(4)];
    let mut kv = KvCache::with_windows(&windows, 1, 2, 8, 2).unwrap();
    assert_eq!((kv.groups(), kv.total_blocks()), (3, 24));
    let mut t = BlockTable::default();
    kv.reserve(&mut t, 10).unwrap();
    // 5 blocks now for the global group; 4 promised each (window 4 + chunk 2 - 1 → 3, +1).
    assert_eq!((t.held(), kv.free_blocks()), (5, 24 - 5 - 8));
    assert_eq!(
        t.reserved(),
        5 + 8,
        "the promises are part of the reservation"
    );
    let tokens: Vec<u32> = (1..=10).collect();
    let mut chain = (0, crate::prefix::ROOT);
    for start in (0..10).step_by(2) {
        kv.ensure(&mut t, start, start + 2).unwrap();
        kv.register(3, &t, &tokens, start + 2, &mut chain);
        kv.trim(&mut t, start + 2);
        assert_eq!(
            kv.free_blocks(),
            24 - 5 - 8,
            "a trimmed block returns to the promise"
        );
    }
    // The next query (at 10) reads keys 7..: blocks 3 and 4 of each windowed group.
    assert_eq!(&t.group(1)[..3], &[GONE; 3]);
    assert_eq!(t.held(), 5 + 2 + 2);
    kv.release(t);
    assert_eq!(kv.free_blocks(), 24);
    // A later sequence with the same first 9 tokens: 4 whole blocks, whose windowed groups
    // need blocks 2 and 3 (the window of a query at 8): cached though trimmed.
    let mut u = BlockTable::default();
    assert_eq!(
        kv.share_prefix((3, crate::prefix::ROOT), &mut u, &tokens[..9])
            .0,
        8
    );
    assert_eq!(u.group(0).len(), 4);
    assert!(u.group(1)[..2].iter().all(|&b| b == GONE));
    assert_eq!(u.held(), 4 + 2 + 2);
    kv.release(u);
    assert_eq!(kv.free_blocks(), 24);
}

#[test]
fn a_windowed_layer_reads_and_writes_its_window_only() {
    let windows = [None, Some(3)];
    let mut kv = KvCache::with_windows(&windows, 1, 2, 8, 4).unwrap();
    let mut t = BlockTable::default();
    kv.reserve(&mut t, 8).unwrap();
    kv.ensure(&mut t, 8, 8).unwrap();
    assert_eq!(kv.kept(1, 0..8), 6..8, "a query at 8 sees 6, 7 and itself");
    assert_eq!(kv.kept(0, 2..8), 2..8);
    let data = vec![1u8; 4 * 2];
    kv.write_range(&t, 1, 0..8, &data).unwrap();
    let mut out = Vec::new();
    kv.read_range(&t, 1, 0..8, &mut out);
    assert_eq!(out, data);
    assert!(
        kv.write_range(&t, 1, 0..8, &[0; 12]).is_err(),
        "sizes are checked"
    );
    kv.release(t);
}

#[test]
fn sequences_sharing_windowed_blocks_never_overdraw_the_pool() {
    // A and B share a windowed prefix; A trims shared blocks B still holds. Every page a
    // step asks for is there, the promises never exceed what is available, and all comes
    // back. 7 blocks = 14 pages: A reserves 9, B 4 more.
    let windows = [None, Some(4)];
    let mut kv = KvCache::with_windows(&windows, 1, 2, 7, 2).unwrap();
    let tokens: Vec<u32> = (1..=10).collect();
    let sane = |kv: &KvCache| assert!(kv.pool.available() >= kv.promised);
    let step = |kv: &mut KvCache, t: &mut BlockTable, chain: &mut (usize, u64), at: usize| {
        kv.ensure(t, at, at + 2).unwrap();
        kv.register(5, t, &tokens, at + 2, chain);
        kv.trim(t, at + 2);
    };
    let (mut a, mut ca) = (BlockTable::default(), (0, crate::prefix::ROOT));
    kv.reserve(&mut a, 10).unwrap();
    for at in [0, 2, 4] {
        step(&mut kv, &mut a, &mut ca, at);
        sane(&kv);
    }
    let mut b = BlockTable::default();
    let (shared, last) = kv.share_prefix((5, crate::prefix::ROOT), &mut b, &tokens[..7]);
    assert_eq!(shared, 6);
    let mut cb = (3, last);
    kv.reserve(&mut b, 10).unwrap();
    sane(&kv);
    for at in [6, 8] {
        step(&mut kv, &mut a, &mut ca, at);
        sane(&kv);
    }
    for at in [6, 8] {
        step(&mut kv, &mut b, &mut cb, at);
        sane(&kv);
    }
    kv.release(a);
    kv.release(b);
    assert_eq!((kv.free_blocks(), kv.promised), (14, 0));
}
