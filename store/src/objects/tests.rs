use super::*;

fn key(i: u64) -> ObjectKey {
    ObjectKey {
        model: 42,
        block: BlockHash(i),
    }
}

fn bytes(i: u64, len: usize) -> Vec<u8> {
    (0..len).map(|j| (i as usize * 31 + j * 7) as u8).collect()
}

fn sum(b: &[u8]) -> u64 {
    types::sum::sum(b)
}

/// A store of 1,000 bytes, objects of 100 (high water 900, low 850).
fn small() -> Objects {
    Objects::new(Limits {
        capacity: 1_000,
        max_object: 200,
        max_puts: 4,
        max_leases: 8,
        ..Default::default()
    })
}

/// Puts object `i` of `len` bytes whole; returns whether it was published.
fn put(o: &mut Objects, i: u64, len: usize, now: Instant) -> Result<(), StoreError> {
    let b = bytes(i, len);
    let PutStart::Write(id) = o.put_start(key(i), len as u64, sum(&b), now)? else {
        panic!("object {i} is new")
    };
    o.put_write(id, 0, &b[..len / 2])?;
    o.put_write(id, (len / 2) as u64, &b[len / 2..])?;
    o.put_end(id)
}

#[test]
fn a_put_is_visible_only_once_published_and_comes_back_whole() {
    let (mut o, t) = (small(), Instant::now());
    let b = bytes(1, 100);
    let PutStart::Write(id) = o.put_start(key(1), 100, sum(&b), t).unwrap() else {
        panic!()
    };
    o.put_write(id, 0, &b[..60]).unwrap();
    assert!(o.get(key(1), t).unwrap().is_none(), "half written: a miss");
    assert_eq!(o.put_start(key(1), 100, sum(&b), t), Ok(PutStart::Held));
    assert_eq!(
        o.put_end(id),
        Err(StoreError::Incomplete {
            id,
            written: 60,
            size: 100
        })
    );
    assert!(matches!(
        o.put_write(id, 0, &b[60..]),
        Err(StoreError::OutOfOrder { .. })
    ));
    assert!(matches!(
        o.put_write(id, 60, &[0; 41]),
        Err(StoreError::OutOfRange { .. })
    ));
    o.put_write(id, 60, &b[60..]).unwrap();
    o.put_end(id).unwrap();
    let got = o.get(key(1), t).unwrap().expect("published");
    assert_eq!((&got.data[..], got.sum), (&b[..], sum(&b)));
    assert_eq!(o.take_changes(), vec![Change::Stored(key(1))]);
    let s = o.stats();
    assert_eq!(
        (s.objects, s.bytes, s.puts, s.hits, s.misses),
        (1, 100, 1, 1, 1)
    );
    assert_eq!(o.put_start(key(1), 100, 0, t), Ok(PutStart::Held));
}

#[test]
fn a_corrupt_put_is_dropped_and_counted() {
    let (mut o, t) = (small(), Instant::now());
    let b = bytes(2, 100);
    let PutStart::Write(id) = o.put_start(key(2), 100, sum(&b), t).unwrap() else {
        panic!()
    };
    let mut bad = b.clone();
    bad[37] ^= 0x10;
    o.put_write(id, 0, &bad).unwrap();
    assert_eq!(o.put_end(id), Err(StoreError::Corrupt(id)));
    assert!(!o.holds(key(2)));
    let s = o.stats();
    assert_eq!((s.puts_corrupt, s.bytes, s.pending_bytes), (1, 0, 0));
    assert!(o.take_changes().is_empty(), "nothing was ever visible");
}

#[test]
fn an_abandoned_put_is_freed_at_its_deadline_never_seen() {
    let (mut o, t) = (small(), Instant::now());
    let b = bytes(3, 100);
    let PutStart::Write(id) = o.put_start(key(3), 100, sum(&b), t).unwrap() else {
        panic!()
    };
    o.put_write(id, 0, &b[..10]).unwrap();
    o.tick(t + Duration::from_secs(29));
    assert_eq!(o.stats().pending_bytes, 100, "still under way");
    o.tick(t + Duration::from_secs(30));
    let s = o.stats();
    assert_eq!((s.puts_abandoned, s.pending_bytes), (1, 0));
    assert_eq!(
        o.put_write(id, 10, &b[10..]),
        Err(StoreError::UnknownPut(id))
    );
    assert!(!o.holds(key(3)));
    // Its key is free for another writer.
    put(&mut o, 3, 100, t).unwrap();
}

#[test]
fn past_high_water_the_least_recently_used_go_down_to_low_water() {
    let (mut o, t) = (small(), Instant::now());
    for i in 0..9 {
        put(&mut o, i, 100, t).unwrap();
    }
    // 900 held: at the mark, not past it. Object 0 used again: last out.
    let g = o.get(key(0), t).unwrap().unwrap();
    o.release(g.lease);
    o.take_changes();
    put(&mut o, 9, 100, t).unwrap();
    // 1000 would pass 900: evicted until 850 would hold it (down to 700 held, then 800).
    assert_eq!(
        o.take_changes(),
        vec![
            Change::Removed(key(1)),
            Change::Removed(key(2)),
            Change::Stored(key(9))
        ]
    );
    let s = o.stats();
    assert_eq!((s.objects, s.bytes, s.evictions), (8, 800, 2));
    assert!(o.holds(key(0)), "used recently: kept");
}

#[test]
fn leased_and_hard_pinned_objects_are_never_evicted_soft_pins_last() {
    let (mut o, t) = (small(), Instant::now());
    for i in 0..9 {
        put(&mut o, i, 100, t).unwrap();
    }
    o.pin(key(1), Pin::Hard).unwrap();
    o.pin(key(2), Pin::Soft).unwrap();
    // Every unpinned object leased: only the soft pin can go.
    let leases: Vec<Got> = [0, 3, 4, 5, 6, 7, 8]
        .map(|i| o.get(key(i), t).unwrap().unwrap())
        .into();
    o.take_changes();
    put(&mut o, 9, 100, t).unwrap();
    assert_eq!(
        o.take_changes(),
        vec![Change::Removed(key(2)), Change::Stored(key(9))],
        "the soft pin went, nothing leased or hard-pinned"
    );
    // The leases run out: the least recently used unpinned objects go again, never the hard pin.
    o.tick(leases[0].expires);
    assert_eq!(o.stats().leases, 0);
    put(&mut o, 10, 100, t).unwrap();
    assert_eq!(
        o.take_changes(),
        vec![
            Change::Removed(key(0)),
            Change::Removed(key(3)),
            Change::Stored(key(10))
        ]
    );
    for i in 11..40 {
        put(&mut o, i, 100, t).unwrap();
    }
    assert!(o.holds(key(1)), "hard-pinned: kept through every eviction");
}

#[test]
fn a_full_store_refuses_with_its_reason_and_counts() {
    let (mut o, t) = (small(), Instant::now());
    let mut leases = Vec::new();
    for i in 0..8 {
        put(&mut o, i, 100, t).unwrap();
        leases.push(o.get(key(i), t).unwrap().unwrap().lease);
    }
    // 800 held, every object leased, and a put of 200 under way: 1,000 (it fits); no more.
    let under_way = o.put_start(key(8), 200, 0, t).unwrap();
    assert!(matches!(under_way, PutStart::Write(_)));
    let e = o.put_start(key(9), 100, 0, t).unwrap_err();
    assert!(matches!(e, StoreError::Full { len: 100, .. }), "{e}");
    assert!(matches!(
        o.put_start(key(10), 201, 0, t),
        Err(StoreError::TooLarge { len: 201, max: 200 })
    ));
    assert_eq!(o.stats().puts_refused, 2);
    for l in leases {
        o.release(l);
    }
    put(&mut o, 9, 100, t).unwrap();
}

#[test]
fn puts_and_leases_under_way_are_capped() {
    let (mut o, t) = (small(), Instant::now());
    for i in 0..4 {
        assert!(matches!(
            o.put_start(key(i), 10, 0, t),
            Ok(PutStart::Write(_))
        ));
    }
    assert_eq!(o.put_start(key(4), 10, 0, t), Err(StoreError::Busy(4)));
    let mut o = small();
    put(&mut o, 1, 10, t).unwrap();
    for _ in 0..8 {
        o.get(key(1), t).unwrap().unwrap();
    }
    assert_eq!(o.get(key(1), t).unwrap_err(), StoreError::TooManyLeases(8));
}

#[test]
fn a_lease_renews_until_its_bound_and_expires_unrenewed() {
    let (mut o, t) = (small(), Instant::now());
    put(&mut o, 1, 100, t).unwrap();
    let g = o.get(key(1), t).unwrap().unwrap();
    assert_eq!(g.expires, t + Duration::from_secs(10));
    let s = |n| t + Duration::from_secs(n);
    assert_eq!(o.renew(g.lease, s(9)), Ok(s(19)));
    assert_eq!(o.renew(g.lease, s(50)), Ok(s(60)));
    assert_eq!(
        o.renew(g.lease, s(51)),
        Err(StoreError::LeaseTooOld {
            id: g.lease,
            max: Duration::from_secs(60)
        })
    );
    o.tick(s(60));
    assert_eq!(o.stats().leases, 0);
    assert_eq!(
        o.renew(g.lease, s(60)),
        Err(StoreError::UnknownLease(g.lease))
    );
}

#[test]
fn hard_pins_hold_at_most_their_share() {
    let (mut o, t) = (small(), Instant::now());
    for i in 0..6 {
        put(&mut o, i, 100, t).unwrap();
    }
    for i in 0..5 {
        o.pin(key(i), Pin::Hard).unwrap();
    }
    assert_eq!(
        o.pin(key(5), Pin::Hard),
        Err(StoreError::PinLimit {
            want: 600,
            max: 500
        })
    );
    o.pin(key(0), Pin::None).unwrap();
    o.pin(key(5), Pin::Hard).unwrap();
    assert_eq!(o.stats().hard_pins, 5);
    assert_eq!(o.pin(key(99), Pin::Soft), Err(StoreError::NotHeld(key(99))));
}

/// A whole put whose checksum its reader summed piece by piece (as the node's data connection
/// does) publishes; one whose bytes changed after they were summed, or were summed wrong, is
/// dropped and counted.
#[test]
fn a_whole_put_summed_as_it_arrived_is_checked_against_its_checksum() {
    let (mut o, t) = (small(), Instant::now());
    for (i, corrupt) in [(3, false), (4, true)] {
        let b = bytes(i, 100);
        let PutStart::Write(id) = o.put_start(key(i), 100, sum(&b), t).unwrap() else {
            panic!()
        };
        let mut s = types::sum::Summer::default();
        for piece in b.chunks(37) {
            s.sum(piece);
        }
        let mut data = b.clone();
        if corrupt {
            data[99] ^= 1;
            s = types::sum::Summer::default();
            s.sum(&data);
        }
        let out = o.put_whole_summed(id, data, s.finish());
        assert_eq!(out.is_ok(), !corrupt, "{out:?}");
        assert_eq!(o.holds(key(i)), !corrupt);
    }
    assert_eq!(o.stats().puts_corrupt, 1);
}
