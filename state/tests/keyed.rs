//! Keyed state API: every state kind, namespaces, timers, TTL, snapshot and restore onto
//! another shard count, the rkyv layout, and the allocation-free hot path.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::Arc;

use weir_io::{Fs, StdFs};
use weir_state::{
    AggregateFunction, KeyGroupRange, KeyedBackend, SnapshotHandle, StateError, Store, StoreConfig,
    TimeDomain,
};

/// Counts allocations of the current thread (other test threads do not interfere).
struct CountingAlloc;
thread_local! { static ALLOCS: Cell<u64> = const { Cell::new(0) }; }
// SAFETY: forwards every call to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as our caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: same contract as our caller's.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: same contract as our caller's.
        unsafe { System.realloc(p, l, n) }
    }
}
#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

fn cfg(mp: u16) -> StoreConfig {
    StoreConfig {
        memtable_budget_bytes: 256 << 10,
        block_target_bytes: 512,
        max_parallelism: mp,
        ..StoreConfig::default()
    }
}

fn backend(dir: &std::path::Path, mp: u16) -> KeyedBackend {
    let fs: Arc<dyn Fs> = Arc::new(StdFs);
    KeyedBackend::new(
        Store::open(fs, dir, cfg(mp)).unwrap(),
        KeyGroupRange::all(mp),
    )
    .unwrap()
}

#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug, PartialEq, Clone)]
struct Bid {
    auction: u64,
    price: u32,
    bidder: String,
}

struct Avg;
impl AggregateFunction for Avg {
    type In = u64;
    type Acc = (u64, u64);
    type Out = f64;
    fn create_accumulator(&self) -> (u64, u64) {
        (0, 0)
    }
    fn add(&self, v: &u64, acc: &mut (u64, u64)) {
        acc.0 += v;
        acc.1 += 1;
    }
    fn result(&self, acc: &(u64, u64)) -> f64 {
        acc.0 as f64 / acc.1 as f64
    }
}

#[test]
fn every_state_kind_round_trips_through_segments() {
    let dir = tempfile::tempdir().unwrap();
    let mut be = backend(dir.path(), 128);
    let count = be.value_state::<u64>("count");
    let bids = be.list_state::<Bid>("bids");
    let prices = be.map_state::<String, u32>("prices");
    let max = be.reducing_state::<u64, _>("max", |a: u64, b: u64| a.max(b));
    let avg = be.aggregating_state("avg", Avg);
    for user in 0..300u64 {
        be.set_current_key(&user);
        for i in 0..3u64 {
            let n = count.get(&mut be).unwrap().map_or(0, |v| v.to_native());
            count.update(&mut be, &(n + 1)).unwrap();
            bids.add(
                &mut be,
                &Bid {
                    auction: i,
                    price: (user * 10 + i) as u32,
                    bidder: format!("u{user}"),
                },
            )
            .unwrap();
            prices
                .put(&mut be, &format!("item{}", 2 - i), &((user + i) as u32))
                .unwrap();
            max.add(&mut be, user * i).unwrap();
            avg.add(&mut be, &(i * 2)).unwrap();
        }
        if user % 50 == 0 {
            be.store_mut().run_pending_maintenance().unwrap();
        }
    }
    be.store_mut().flush_and_compact_all().unwrap();
    for user in (0..300u64).step_by(7) {
        be.set_current_key(&user);
        assert_eq!(count.value(&mut be).unwrap(), Some(3));
        let got = bids.get(&mut be).unwrap();
        assert_eq!(got.len(), 3);
        assert_eq!(
            got[2],
            Bid {
                auction: 2,
                price: (user * 10 + 2) as u32,
                bidder: format!("u{user}")
            }
        );
        let entries = prices.entries(&mut be).unwrap();
        assert_eq!(
            entries.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(),
            vec!["item0", "item1", "item2"]
        );
        assert_eq!(
            prices
                .get(&mut be, &"item0".to_owned())
                .unwrap()
                .map(|v| v.to_native()),
            Some((user + 2) as u32)
        );
        assert_eq!(
            max.get(&mut be).unwrap().map(|v| v.to_native()),
            Some(user * 2)
        );
        assert_eq!(avg.get(&mut be).unwrap(), Some(2.0));
    }
    be.set_current_key(&5u64);
    prices.remove(&mut be, &"item1".to_owned()).unwrap();
    assert!(!prices.contains(&mut be, &"item1".to_owned()).unwrap());
    // A map key longer than keyed state takes is an error naming its length, for every
    // call (before, the store's key-length assertion panicked), and the map is unchanged.
    let long = "k".repeat(weir_state::MAX_KEY_BYTES);
    let too_long = |r: Result<(), StateError>| {
        matches!(r, Err(StateError::KeyTooLong { what: "map key", len, max })
            if len == weir_state::MAX_KEY_BYTES + 2 && max == weir_state::MAX_KEY_BYTES)
    };
    assert!(too_long(prices.put(&mut be, &long, &1u32)));
    assert!(too_long(prices.get(&mut be, &long).map(|_| ())));
    assert!(too_long(prices.contains(&mut be, &long).map(|_| ())));
    assert!(too_long(prices.remove(&mut be, &long)));
    let longest = "k".repeat(weir_state::MAX_KEY_BYTES - 2);
    prices.put(&mut be, &longest, &7u32).unwrap();
    assert_eq!(
        prices
            .get(&mut be, &longest)
            .unwrap()
            .map(|v| v.to_native()),
        Some(7)
    );
    prices.remove(&mut be, &longest).unwrap();
    bids.clear(&mut be).unwrap();
    assert!(bids.get(&mut be).unwrap().is_empty());
    count.clear(&mut be);
    assert_eq!(count.value(&mut be).unwrap(), None);
    be.set_current_key(&6u64);
    assert_eq!(
        count.value(&mut be).unwrap(),
        Some(3),
        "other keys untouched"
    );
}

#[test]
fn namespaces_isolate_windows() {
    let dir = tempfile::tempdir().unwrap();
    let mut be = backend(dir.path(), 128);
    let sum = be.value_state::<u64>("sum");
    be.set_current_key("alice");
    for w in 0..4u64 {
        be.set_namespace_of(&(w * 1000));
        sum.update(&mut be, &(w + 10)).unwrap();
    }
    be.set_namespace_of(&2000u64);
    assert_eq!(sum.value(&mut be).unwrap(), Some(12));
    sum.clear(&mut be);
    be.set_namespace_of(&3000u64);
    assert_eq!(sum.value(&mut be).unwrap(), Some(13));
    be.set_namespace(&[]);
    assert_eq!(sum.value(&mut be).unwrap(), None);
}

#[test]
fn timers_order_dedupe_delete_and_survive_restore_on_other_shards() {
    let root = tempfile::tempdir().unwrap();
    let fs: Arc<dyn Fs> = Arc::new(StdFs);
    let mp = 32;
    let mut be = backend(&root.path().join("a"), mp);
    let last = be.value_state::<u64>("last");
    for k in 0..40u64 {
        be.set_current_key(&k);
        be.set_namespace_of(&7u32);
        be.register_timer(TimeDomain::EventTime, 100 + (k * 37) % 50);
        be.register_timer(TimeDomain::EventTime, 100 + (k * 37) % 50); // idempotent
        be.register_timer(TimeDomain::ProcessingTime, 5000 + k);
        last.update(&mut be, &k).unwrap();
    }
    be.set_current_key(&3u64);
    be.set_namespace_of(&7u32);
    be.delete_timer(TimeDomain::ProcessingTime, 5003);
    assert_eq!(be.timer_count(TimeDomain::EventTime), 40);
    assert_eq!(be.timer_count(TimeDomain::ProcessingTime), 39);
    // Pop a few, then snapshot: popped timers must not come back.
    let mut times = Vec::new();
    while let Some(t) = be.pop_due(TimeDomain::EventTime, 110) {
        times.push(t.time_ms);
    }
    assert!(times.windows(2).all(|w| w[0] <= w[1]) && !times.is_empty());
    assert!(be.next_timer_ms(TimeDomain::EventTime).unwrap() > 110);
    let h = be.snapshot(1).run().unwrap();
    let h = SnapshotHandle::from_bytes(&h.to_bytes()).unwrap();
    let mut event = 0;
    let mut proc = 0;
    for shard in 0..3u16 {
        let range = KeyGroupRange::for_shard(shard, 3, mp);
        let store = Store::restore(
            fs.clone(),
            &root.path().join(format!("r{shard}")),
            cfg(mp),
            std::slice::from_ref(&h),
            range,
        )
        .unwrap();
        let mut rb = KeyedBackend::new(store, range).unwrap();
        while let Some(t) = rb.pop_due(TimeDomain::EventTime, u64::MAX) {
            assert!(t.time_ms > 110 && range.contains(t.key_group));
            assert_eq!(t.namespace, {
                let mut n = Vec::new();
                weir_state::KeyCodec::encode_key(&7u32, &mut n);
                n
            });
            // State of the timer's key is there too.
            rb.set_current_key_bytes(t.key_group, &t.key);
            rb.set_namespace_of(&7u32);
            assert!(last.value(&mut rb).unwrap().is_some());
            event += 1;
        }
        proc += rb.timer_count(TimeDomain::ProcessingTime);
    }
    assert_eq!(event, 40 - times.len());
    assert_eq!(proc, 39);
}

#[test]
fn ttl_per_state() {
    let dir = tempfile::tempdir().unwrap();
    let mut be = backend(dir.path(), 128);
    let session = be.value_state::<u64>("session");
    let total = be.value_state::<u64>("total");
    be.set_ttl(session.id(), Some(60_000));
    be.set_now_ms(1_000);
    be.set_current_key(&1u32);
    session.update(&mut be, &1).unwrap();
    total.update(&mut be, &1).unwrap();
    be.set_now_ms(61_000);
    assert_eq!(session.value(&mut be).unwrap(), None);
    assert_eq!(total.value(&mut be).unwrap(), Some(1));
}

#[test]
fn rkyv_archived_layout_is_pinned() {
    // Golden bytes: a change of rkyv features or version that alters the on-disk value layout
    // must fail here (PLATFORM.md: no `unaligned`, `big_endian`, `pointer_width_64`).
    let b = rkyv::to_bytes::<rkyv::rancor::Error>(&0x0102_0304_0506_0708u64).unwrap();
    assert_eq!(&b[..], &[8, 7, 6, 5, 4, 3, 2, 1]);
    let bid = Bid {
        auction: 7,
        price: 9,
        bidder: "ab".to_owned(),
    };
    let b = rkyv::to_bytes::<rkyv::rancor::Error>(&bid).unwrap();
    assert_eq!(
        &b[..],
        &[
            7, 0, 0, 0, 0, 0, 0, 0, // auction u64 LE
            9, 0, 0, 0, // price u32 LE
            b'a', b'b', 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, // inline string "ab" (8 bytes)
            0, 0, 0, 0, // padding to the struct's 8-byte alignment
        ][..]
    );
}

#[test]
fn hot_path_value_state_does_not_allocate() {
    let dir = tempfile::tempdir().unwrap();
    let mut be = backend(dir.path(), 128);
    let count = be.value_state::<u64>("count");
    for k in 0..100u64 {
        be.set_current_key(&k);
        count.update(&mut be, &0).unwrap();
    }
    let before = ALLOCS.with(Cell::get);
    for i in 0..10_000u64 {
        be.set_current_key(&(i % 100));
        let n = count.get(&mut be).unwrap().map_or(0, |v| v.to_native());
        count.update(&mut be, &(n + 1)).unwrap();
    }
    let after = ALLOCS.with(Cell::get);
    assert_eq!(after - before, 0, "the get+update hot path allocated");
    be.set_current_key(&42u64);
    assert_eq!(count.value(&mut be).unwrap(), Some(100));
}

#[test]
fn handles_from_cached_ids_see_the_same_state() {
    let dir = tempfile::tempdir().unwrap();
    let mut be = backend(dir.path(), 128);
    let count = be.value_state::<u64>("count");
    let list = be.list_state::<u64>("list");
    let map = be.map_state::<u32, u64>("map");
    let id = be.state_id("count");
    assert_eq!(id, count.id());
    be.set_current_key(&7u64);
    count.update(&mut be, &41).unwrap();
    let by_id = weir_state::ValueState::<u64>::from_id(id);
    assert_eq!(by_id.value(&mut be).unwrap(), Some(41));
    by_id.update(&mut be, &42).unwrap();
    assert_eq!(count.value(&mut be).unwrap(), Some(42));
    let l = weir_state::ListState::<u64>::from_id(list.id());
    l.add(&mut be, &1).unwrap();
    list.add(&mut be, &2).unwrap();
    assert_eq!(l.get(&mut be).unwrap(), vec![1, 2]);
    let m = weir_state::MapState::<u32, u64>::from_id(map.id());
    m.put(&mut be, &3, &30).unwrap();
    assert_eq!(map.entries(&mut be).unwrap(), vec![(3, 30)]);
    let r = weir_state::ReducingState::<u64, _>::from_id(be.state_id("sum"), |a, b| a + b);
    r.add(&mut be, 5).unwrap();
    r.add(&mut be, 6).unwrap();
    assert_eq!(r.get(&mut be).unwrap().map(|v| v.to_native()), Some(11));
    let a = weir_state::AggregatingState::from_id(be.state_id("avg"), Avg);
    a.add(&mut be, &4).unwrap();
    a.add(&mut be, &8).unwrap();
    assert_eq!(a.get(&mut be).unwrap(), Some(6.0));
}

#[test]
fn list_appends_interleaved_with_scans_stay_ordered() {
    // The runtime's window pattern: append to list state, read it back, many times.
    let dir = tempfile::tempdir().unwrap();
    let mut be = backend(dir.path(), 128);
    let list = be.list_state::<u64>("buf");
    be.set_current_key(&1u64);
    let mut n = 0usize;
    for i in 0..3000u64 {
        list.add(&mut be, &i).unwrap();
        if i % 3 == 0 {
            let mut seen = 0u64;
            list.for_each(&mut be, |v| {
                assert_eq!(v.to_native(), seen);
                seen += 1;
            })
            .unwrap();
            assert_eq!(seen, i + 1);
            n += 1;
        }
    }
    assert_eq!(n, 1000);
}

/// `update_with` and `value()` then `update()` reuse the cached key, its hash and the record's
/// memtable position; a model check over key, namespace and state switches, values that grow
/// (the record moves), clears, freezes (small budget), flushes and snapshots.
#[test]
fn cached_key_and_position_stay_correct_under_moves_freezes_and_switches() {
    let dir = tempfile::tempdir().unwrap();
    let mut be = backend(dir.path(), 128);
    let count = be.value_state::<u64>("count");
    let text = be.value_state::<String>("text");
    let mut model: std::collections::HashMap<(u64, u8, u8), String> = Default::default();
    let mut x = 0x1234_5678_9abc_def0u64;
    let mut rnd = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for step in 0..60_000u64 {
        let r = rnd();
        let key = r % 500;
        let ns = ((r >> 20) % 3) as u8;
        be.set_current_key(&key);
        be.set_namespace(&[ns][..usize::from(ns > 0)]);
        match (r >> 32) % 8 {
            0..=3 => {
                count
                    .update_with(&mut be, |old| old.map_or(0, |n| n.to_native()) + 1)
                    .unwrap();
                let e = model.entry((key, ns, 0)).or_insert_with(|| "0".into());
                *e = (e.parse::<u64>().unwrap() + 1).to_string();
            }
            4 | 5 => {
                // Grows by one character each time: values outgrow their record.
                let old = text.value(&mut be).unwrap().unwrap_or_default();
                let next = format!("{old}{}", step % 10);
                let next = if next.len() > 300 {
                    String::new()
                } else {
                    next
                };
                text.update(&mut be, &next).unwrap();
                model.insert((key, ns, 1), next);
            }
            6 => {
                count.clear(&mut be);
                model.remove(&(key, ns, 0));
            }
            _ => {
                let want = model.get(&(key, ns, 0)).map(|s| s.parse::<u64>().unwrap());
                assert_eq!(count.value(&mut be).unwrap(), want, "step {step}");
                let want = model.get(&(key, ns, 1)).cloned();
                assert_eq!(text.value(&mut be).unwrap(), want, "step {step}");
            }
        }
        if step % 7919 == 0 {
            be.store_mut().run_pending_maintenance().unwrap();
        }
        if step % 20_011 == 0 {
            let job = be.snapshot(step);
            job.run().unwrap();
        }
    }
    be.store_mut().flush_and_compact_all().unwrap();
    for ((key, ns, which), v) in &model {
        be.set_current_key(key);
        be.set_namespace(&[*ns][..usize::from(*ns > 0)]);
        if *which == 0 {
            assert_eq!(count.value(&mut be).unwrap(), Some(v.parse().unwrap()));
        } else {
            assert_eq!(text.value(&mut be).unwrap().as_ref(), Some(v));
        }
    }
    assert!(
        be.store().metrics().flushes > 0,
        "the test must cross freezes"
    );
}

#[test]
fn update_with_is_the_allocation_free_keyed_count() {
    let dir = tempfile::tempdir().unwrap();
    let mut be = backend(dir.path(), 128);
    let count = be.value_state::<u64>("count");
    for k in 0..100u64 {
        be.set_current_key_bytes(k as u16 % 128, &k.to_be_bytes());
        count.update(&mut be, &0).unwrap();
    }
    let before = ALLOCS.with(Cell::get);
    for i in 0..10_000u64 {
        let k = i % 100;
        be.set_current_key_bytes(k as u16 % 128, &k.to_be_bytes());
        be.set_namespace(&[]);
        count
            .update_with(&mut be, |old| old.map_or(0, |n| n.to_native()) + 1)
            .unwrap();
    }
    assert_eq!(ALLOCS.with(Cell::get) - before, 0, "update_with allocated");
    be.set_current_key_bytes(42, &42u64.to_be_bytes());
    assert_eq!(count.value(&mut be).unwrap(), Some(100));
}

/// A state is held to the kind and value type of its first use in the process: in-memory
/// values are read unchecked as that type, so another type (here a u32 read as a String or
/// a (u64, u64), a value read as a list) is a typed error naming the state, not a read past
/// the value's bytes. Clearing takes any type.
#[test]
fn a_state_used_with_another_type_or_kind_is_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    let mut be = backend(dir.path(), 128);
    be.set_current_key(&1u32);
    let z = be.value_state::<u32>("z");
    z.update(&mut be, &7).unwrap();
    let mismatch = |r: Result<(), StateError>, now: &str| match r {
        Err(e @ StateError::TypeMismatch { .. }) => {
            let m = e.to_string();
            assert!(m.contains("state `z`") && m.contains(now), "{m}");
        }
        other => panic!("{now}: {other:?}"),
    };
    let as_string = be.value_state::<String>("z");
    mismatch(as_string.value(&mut be).map(drop), "String");
    mismatch(as_string.update(&mut be, &"x".to_owned()), "String");
    let as_pair = be.value_state::<(u64, u64)>("z");
    mismatch(as_pair.value(&mut be).map(drop), "(u64, u64)");
    let as_list = be.list_state::<u32>("z");
    mismatch(as_list.add(&mut be, &1), "ListState");
    mismatch(as_list.get(&mut be).map(drop), "ListState");
    let as_map = be.map_state::<u32, u32>("z");
    mismatch(as_map.put(&mut be, &1, &1), "MapState");
    // The first type still reads its value.
    assert_eq!(z.value(&mut be).unwrap(), Some(7));
    as_string.clear(&mut be);
    assert_eq!(z.value(&mut be).unwrap(), None);
}

/// The key type is recorded beside the states' types, under `KEY_TYPE_ID`, and a restore
/// that recorded another refuses it: `u64` keys read as `i64` or `String` find none of the
/// restored state. A backend restored from a record without a key type checks nothing, and
/// the key type it is given is recorded again.
#[test]
fn a_restored_key_type_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let mut be = backend(dir.path(), 128);
    be.set_key_type("key<u64>".into()).unwrap();
    be.set_current_key(&1u64);
    be.value_state::<u64>("x").update(&mut be, &7).unwrap();
    let recorded = be.state_types();
    assert!(
        recorded.contains(&(weir_state::KEY_TYPE_ID, String::new(), "key<u64>".into())),
        "{recorded:?}"
    );
    let restored = |at: &str, types: Vec<(u16, String, String)>| {
        let mut be = backend(&dir.path().join(at), 128);
        be.restore_state_types(types);
        be
    };
    match restored("a", recorded.clone()).set_key_type("key<i64>".into()) {
        Err(e @ StateError::RestoredKeyTypeMismatch { .. }) => {
            let m = e.to_string();
            assert!(m.contains("key<u64>") && m.contains("key<i64>"), "{m}");
        }
        other => panic!("u64 keys restored as i64: {other:?}"),
    }
    let mut same = restored("b", recorded.clone());
    same.set_key_type("key<u64>".into()).unwrap();
    same.set_current_key(&1u64);
    same.value_state::<u64>("x").update(&mut same, &8).unwrap();
    assert_eq!(same.state_types(), recorded);
    let without: Vec<_> = recorded
        .iter()
        .filter(|t| t.0 != weir_state::KEY_TYPE_ID)
        .cloned()
        .collect();
    let mut older = restored("c", without);
    older.set_key_type("key<String>".into()).unwrap();
    assert!(older.state_types().contains(&(
        weir_state::KEY_TYPE_ID,
        String::new(),
        "key<String>".into()
    )));
}

/// The kinds and value types a checkpoint recorded hold a restored state to them: a `u64`
/// read back as an `f64`, or a value read as a list, passes rkyv's structural check (the
/// audit read `4.94e-315`), so the first use is checked against the record instead. States a
/// restore recorded and this process did not use are recorded again, so that the next
/// restore still checks them.
#[test]
fn a_restored_state_used_with_another_type_or_kind_is_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    let mut be = backend(dir.path(), 128);
    be.set_current_key(&1u32);
    be.value_state::<u64>("x").update(&mut be, &7).unwrap();
    be.list_state::<u64>("l").add(&mut be, &1).unwrap();
    be.map_state::<u32, u32>("m").put(&mut be, &1, &1).unwrap();
    let recorded = be.state_types();
    let described: Vec<&str> = recorded.iter().map(|(_, _, d)| d.as_str()).collect();
    assert!(described.contains(&"value<u64>"), "{recorded:?}");
    assert!(described.contains(&"list<u64>"), "{recorded:?}");
    assert!(described.contains(&"map<u32, u32>"), "{recorded:?}");
    let restored = |at: &str| {
        let mut be = backend(&dir.path().join(at), 128);
        be.restore_state_types(recorded.clone());
        be.set_current_key(&1u32);
        be
    };
    let mismatch = |r: Result<(), StateError>, state: &str, was: &str, now: &str| match r {
        Err(e @ StateError::RestoredTypeMismatch { .. }) => {
            let m = e.to_string();
            assert!(
                m.contains(&format!("state `{state}`")) && m.contains(was) && m.contains(now),
                "{m}"
            );
        }
        other => panic!("{state} as {now}: {other:?}"),
    };
    let mut be2 = restored("a");
    let as_f64 = be2.value_state::<f64>("x");
    mismatch(
        as_f64.value(&mut be2).map(drop),
        "x",
        "value<u64>",
        "value<f64>",
    );
    let as_value = be2.value_state::<u64>("l");
    mismatch(
        as_value.value(&mut be2).map(drop),
        "l",
        "list<u64>",
        "value<u64>",
    );
    let as_strings = be2.map_state::<u32, String>("m");
    mismatch(
        as_strings.get(&mut be2, &1).map(drop),
        "m",
        "map<u32, u32>",
        "map<u32, String>",
    );
    // The recorded types pass, and a state not used here is recorded again.
    let mut be3 = restored("b");
    be3.value_state::<u64>("x").update(&mut be3, &8).unwrap();
    assert_eq!(be3.state_types(), recorded);
    // A backend that restored nothing records what it used only.
    let fresh = backend(&dir.path().join("c"), 128);
    assert!(fresh.state_types().is_empty());
}

/// Recorded type names keep no module path, so that a type std or a crate moves between
/// modules (as `IpAddr` moved from `std::net` to `core::net`) still restores.
#[test]
fn recorded_type_names_keep_no_module_path() {
    use weir_state::short_type_name;
    assert_eq!(short_type_name::<u64>(), "u64");
    assert_eq!(short_type_name::<String>(), "String");
    assert_eq!(
        short_type_name::<Option<Vec<String>>>(),
        "Option<Vec<String>>"
    );
    assert_eq!(short_type_name::<(u64, Vec<u8>)>(), "(u64, Vec<u8>)");
    assert_eq!(short_type_name::<std::net::IpAddr>(), "IpAddr");
    assert_eq!(short_type_name::<[u8; 4]>(), "[u8; 4]");
    assert_eq!(short_type_name::<str>(), "str");
    assert_eq!(
        short_type_name::<std::collections::HashMap<String, (i64, bool)>>(),
        "HashMap<String, (i64, bool)>"
    );
}

/// Two names whose ids collide: `try_state_id` says so, naming both, instead of panicking.
#[test]
fn colliding_state_names_are_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    let mut be = backend(dir.path(), 128);
    // Names registered one after another until one collides (among 2^16 ids, within a few
    // hundred), found by the error itself.
    let mut probe = backend(&dir.path().join("probe"), 128);
    let (first, second) = (0u32..)
        .find_map(|i| match probe.try_state_id(&format!("n{i}")) {
            Err(StateError::NameCollision { first, second }) => Some((first, second)),
            _ => None,
        })
        .expect("a collision");
    assert_ne!(first, second);
    assert_eq!(be.try_state_id(&first).unwrap(), be.state_id(&first));
    match be.try_state_id(&second) {
        Err(e @ StateError::NameCollision { .. }) => {
            let m = e.to_string();
            assert!(m.contains(&first) && m.contains(&second), "{m}");
        }
        other => panic!("{other:?}"),
    }
}
