//! State store benchmarks: keyed updates with flushes and compaction, point gets from
//! segments, bloom rejections, segment write bandwidth, snapshot synchronous latency, memory.
//! Every figure is per core (one working thread), per wall second and per CPU second of that
//! thread, against a baseline measured in the same run.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use weir_io::{Fs, StdFs, UringFs};
use weir_state::{KeyGroupRange, Store, StoreConfig};

use crate::{thread_cpu_ns, BenchResult, Opts};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// A keyed-state store key: key group, state id 1, 8-byte user key.
fn key_of(user: u64, out: &mut [u8; 12]) {
    out[0..2].copy_from_slice(&((user % 128) as u16).to_be_bytes());
    out[2..4].copy_from_slice(&1u16.to_be_bytes());
    out[4..12].copy_from_slice(&user.to_be_bytes());
}

struct Timed {
    wall_ns: u64,
    cpu_ns: u64,
}

fn timed(f: impl FnOnce()) -> Timed {
    let c0 = thread_cpu_ns();
    let t0 = Instant::now();
    f();
    Timed {
        wall_ns: t0.elapsed().as_nanos() as u64,
        cpu_ns: thread_cpu_ns() - c0,
    }
}

fn per_sec(n: u64, ns: u64) -> f64 {
    n as f64 * 1e9 / ns.max(1) as f64
}

fn result(
    bench: &str,
    n: u64,
    t: &Timed,
    baseline: &str,
    base_n: u64,
    base: &Timed,
) -> BenchResult {
    let per_cpu_sec = per_sec(n, t.cpu_ns);
    let baseline_per_cpu_sec = per_sec(base_n, base.cpu_ns);
    BenchResult {
        bench: bench.to_owned(),
        per_wall_sec: per_sec(n, t.wall_ns),
        per_cpu_sec,
        baseline: baseline.to_owned(),
        baseline_per_cpu_sec,
        ratio: per_cpu_sec / baseline_per_cpu_sec,
        p50_ns: None,
        p99_ns: None,
        p999_ns: None,
        max_ns: None,
        extra: Vec::new(),
    }
}

fn fs() -> (Arc<dyn Fs>, &'static str) {
    match UringFs::new() {
        Ok(u) => (Arc::new(u), "uring"),
        Err(_) => (Arc::new(StdFs), "std"),
    }
}

fn bench_dir() -> tempfile::TempDir {
    // Not /tmp: it may be tmpfs, which would flatter the write bandwidth.
    let base = std::env::var("WEIR_BENCH_DIR").unwrap_or_else(|_| ".".to_owned());
    tempfile::Builder::new()
        .prefix("weir-bench-state")
        .tempdir_in(base)
        .expect("bench dir")
}

fn peak_rss_bytes() -> u64 {
    // SAFETY: getrusage fills the zeroed struct we pass; no other memory is touched.
    unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut ru);
        ru.ru_maxrss as u64 * 1024
    }
}

/// Run the state benchmarks.
pub fn run(opts: &Opts) -> Vec<BenchResult> {
    let (fs, fs_name) = fs();
    let keys: u64 = if opts.quick { 200_000 } else { 10_000_000 };
    let updates: u64 = if opts.quick { 400_000 } else { 20_000_000 };
    let budget: usize = if opts.quick { 8 << 20 } else { 64 << 20 };
    let mut out = Vec::new();
    let dir = bench_dir();

    // 1. Random updates over `keys` distinct keys, 16-byte values, maintenance inline.
    let config = StoreConfig {
        memtable_budget_bytes: budget,
        ..StoreConfig::default()
    };
    let mut store =
        Store::open(fs.clone(), &dir.path().join("updates"), config.clone()).expect("open");
    let mut rng = Rng(1);
    let mut k = [0u8; 12];
    let t = timed(|| {
        for i in 0..updates {
            let user = rng.next() % keys;
            key_of(user, &mut k);
            let mut v = [0u8; 16];
            v[..8].copy_from_slice(&i.to_le_bytes());
            store.put(&k, &v);
            if i % 4096 == 0 && store.needs_maintenance() {
                store.run_pending_maintenance().expect("maintenance");
            }
        }
        store.freeze();
        store.run_pending_maintenance().expect("maintenance");
    });
    let m = store.metrics();
    let mut base_map: hashbrown::HashMap<[u8; 12], [u8; 16]> = hashbrown::HashMap::new();
    let mut rng = Rng(1);
    let base = timed(|| {
        for i in 0..updates {
            let user = rng.next() % keys;
            key_of(user, &mut k);
            let mut v = [0u8; 16];
            v[..8].copy_from_slice(&i.to_le_bytes());
            base_map.insert(k, v);
        }
    });
    let baseline_len = base_map.len();
    drop(base_map);
    let mut r = result(
        "state_random_updates",
        updates,
        &t,
        "hashbrown_insert",
        updates,
        &base,
    );
    r.extra = vec![
        ("distinct_keys".into(), keys as f64),
        ("baseline_map_len".into(), baseline_len as f64),
        ("flushes".into(), m.flushes as f64),
        ("compactions".into(), m.compactions as f64),
        ("segments".into(), m.segments as f64),
        ("segment_bytes".into(), m.segment_bytes as f64),
    ];
    out.push(r);

    // 2. Point gets from segments (warm page cache) and absent keys (bloom negatives).
    store.flush_and_compact_all().expect("compact");
    let gets: u64 = if opts.quick { 200_000 } else { 4_000_000 };
    let mut rng = Rng(2);
    let mut found = 0u64;
    // Warm-up: touch the pages once (PLATFORM.md: first touch is expensive on this VM).
    for _ in 0..gets / 4 {
        key_of(rng.next() % keys, &mut k);
        found += u64::from(store.get(&k).is_some());
    }
    let t = timed(|| {
        for _ in 0..gets {
            key_of(rng.next() % keys, &mut k);
            found += u64::from(store.get(&k).is_some());
        }
    });
    let mut base_map: hashbrown::HashMap<[u8; 12], [u8; 16]> =
        hashbrown::HashMap::with_capacity(keys as usize);
    for user in 0..keys {
        key_of(user, &mut k);
        base_map.insert(k, [0; 16]);
    }
    let mut base_found = 0u64;
    let base = timed(|| {
        for _ in 0..gets {
            key_of(rng.next() % keys, &mut k);
            base_found += u64::from(base_map.contains_key(&k));
        }
    });
    drop(base_map);
    let mut r = result(
        "state_point_get_segment",
        gets,
        &t,
        "hashbrown_get",
        gets,
        &base,
    );
    r.extra = vec![
        ("found".into(), found as f64),
        ("baseline_found".into(), base_found as f64),
    ];
    out.push(r);

    let bloom_before = store.metrics().bloom_negatives;
    let mut absent_found = 0u64;
    let t = timed(|| {
        for _ in 0..gets {
            key_of(keys + rng.next() % keys, &mut k);
            absent_found += u64::from(store.get(&k).is_some());
        }
    });
    let neg = store.metrics().bloom_negatives - bloom_before;
    let base_t = timed(|| {
        let mut h = 0u64;
        for _ in 0..gets {
            key_of(keys + rng.next() % keys, &mut k);
            h ^= xxhash_rust::xxh3::xxh3_64(&k);
        }
        std::hint::black_box(h);
    });
    let mut r = result(
        "state_get_absent_bloom",
        gets,
        &t,
        "xxh3_of_key",
        gets,
        &base_t,
    );
    r.extra = vec![
        ("bloom_negative_fraction".into(), neg as f64 / gets as f64),
        ("false_found".into(), absent_found as f64),
    ];
    out.push(r);
    let index_bytes = store.metrics().index_bytes;
    let filter_bytes = store.metrics().filter_bytes;
    drop(store);

    // 3. Segment write bandwidth vs raw sequential writes + fsync of the same size.
    let wcfg = StoreConfig {
        memtable_budget_bytes: 1 << 30,
        ..StoreConfig::default()
    };
    let n_write: u64 = if opts.quick { 200_000 } else { 2_000_000 };
    let mut ws = Store::open(fs.clone(), &dir.path().join("write"), wcfg).expect("open");
    for user in 0..n_write {
        key_of(
            user.wrapping_mul(0x9e37_79b9_7f4a_7c15) % (n_write * 4),
            &mut k,
        );
        ws.put(&k, &[7u8; 16]);
    }
    ws.freeze();
    let job = ws.flush_job().expect("flush job");
    let mut done = None;
    let t = timed(|| done = Some(job.run()));
    ws.install(done.expect("ran")).expect("flush");
    let seg_bytes = ws.metrics().segment_bytes;
    let raw_path = dir.path().join("raw.bin");
    let chunk = vec![0x5au8; 4 << 20];
    let base = timed(|| {
        let mut f = fs.create(&raw_path).expect("create");
        let mut off = 0u64;
        while off < seg_bytes {
            let n = (seg_bytes - off).min(chunk.len() as u64) as usize;
            f.write_at(off, &chunk[..n]).expect("write");
            off += n as u64;
        }
        f.sync().expect("sync");
    });
    // The segment job also builds the file (sort, encode, bloom) and verifies it on open;
    // bandwidth is bytes per wall second, the ratio per wall second as well (I/O bound).
    let mut r = result(
        "state_segment_write",
        seg_bytes,
        &t,
        "raw_sequential_write_fsync",
        seg_bytes,
        &base,
    );
    r.ratio = per_sec(seg_bytes, t.wall_ns) / per_sec(seg_bytes, base.wall_ns);
    r.extra = vec![
        ("segment_bytes".into(), seg_bytes as f64),
        (
            "baseline_bytes_per_wall_sec".into(),
            per_sec(seg_bytes, base.wall_ns),
        ),
        ("fs_uring".into(), f64::from(u8::from(fs_name == "uring"))),
    ];
    out.push(r);
    drop(ws);

    // 4. Snapshot synchronous part with a full memtable.
    let scfg = StoreConfig {
        memtable_budget_bytes: budget * 2,
        ..StoreConfig::default()
    };
    let rounds = if opts.quick { 5 } else { 20 };
    let mut ss = Store::open(fs.clone(), &dir.path().join("snap"), scfg).expect("open");
    let mut lat = Vec::new();
    let mut user = 0u64;
    for ckpt in 0..rounds {
        while ss.metrics().memtable_bytes < budget {
            key_of(user, &mut k);
            ss.put(&k, &[1u8; 16]);
            user += 1;
        }
        let t0 = Instant::now();
        let job = ss.snapshot(ckpt);
        lat.push(t0.elapsed().as_nanos() as u64);
        job.run().expect("snapshot");
        ss.release_snapshot(ckpt);
        ss.run_pending_maintenance().expect("maintenance");
    }
    lat.sort_unstable();
    let pct = |p: f64| lat[((lat.len() as f64 * p).ceil() as usize).clamp(1, lat.len()) - 1];
    let mut base_lat = Vec::new();
    for _ in 0..rounds {
        let v: Vec<u8> = vec![1; 64];
        let t0 = Instant::now();
        let b = Arc::new(v);
        std::hint::black_box(&b);
        base_lat.push(t0.elapsed().as_nanos() as u64);
    }
    let total: u64 = lat.iter().sum();
    out.push(BenchResult {
        bench: "state_snapshot_sync_part".into(),
        per_wall_sec: per_sec(rounds, total),
        per_cpu_sec: per_sec(rounds, total),
        baseline: "arc_new_small_vec".into(),
        baseline_per_cpu_sec: per_sec(rounds, base_lat.iter().sum()),
        ratio: per_sec(rounds, total) / per_sec(rounds, base_lat.iter().sum()),
        p50_ns: Some(pct(0.5)),
        p99_ns: Some(pct(0.99)),
        p999_ns: Some(pct(0.999)),
        max_ns: lat.last().copied(),
        extra: vec![
            ("memtable_budget_bytes".into(), budget as f64),
            ("samples".into(), rounds as f64),
        ],
    });
    drop(ss);

    // 5. Memtable design: hash index (the store) vs a sorted map, same updates, no flushes.
    let n_mem: u64 = if opts.quick { 200_000 } else { 2_000_000 };
    let distinct = n_mem / 4;
    let mcfg = StoreConfig {
        memtable_budget_bytes: 1 << 30,
        ..StoreConfig::default()
    };
    let mut ms = Store::open(fs.clone(), &dir.path().join("mem"), mcfg).expect("open");
    let mut rng = Rng(3);
    let t = timed(|| {
        for i in 0..n_mem {
            key_of(rng.next() % distinct, &mut k);
            ms.put(&k, &i.to_le_bytes());
        }
    });
    let mut bt: BTreeMap<Vec<u8>, [u8; 16]> = BTreeMap::new();
    let mut rng = Rng(3);
    let base = timed(|| {
        for i in 0..n_mem {
            key_of(rng.next() % distinct, &mut k);
            let mut v = [0u8; 16];
            v[..8].copy_from_slice(&i.to_le_bytes());
            match bt.get_mut(&k[..]) {
                Some(slot) => *slot = v,
                None => {
                    bt.insert(k.to_vec(), v);
                }
            }
        }
    });
    out.push(result(
        "memtable_hash_vs_btree",
        n_mem,
        &t,
        "btreemap_sorted_insert",
        n_mem,
        &base,
    ));
    drop(ms);

    // 6. Memory: peak RSS against what the store should hold.
    let rss = peak_rss_bytes();
    let expected = budget as u64 * 2 + index_bytes as u64 + filter_bytes as u64;
    out.push(BenchResult {
        bench: "state_memory".into(),
        per_wall_sec: 0.0,
        per_cpu_sec: 0.0,
        baseline: "memtable_budget_x2_plus_index_plus_filter".into(),
        baseline_per_cpu_sec: expected as f64,
        ratio: rss as f64 / expected as f64,
        p50_ns: None,
        p99_ns: None,
        p999_ns: None,
        max_ns: None,
        extra: vec![
            ("peak_rss_bytes".into(), rss as f64),
            ("memtable_budget_bytes".into(), budget as f64),
            ("index_bytes".into(), index_bytes as f64),
            ("filter_bytes".into(), filter_bytes as f64),
            ("note_rss_includes_baseline_hashmaps".into(), 1.0),
        ],
    });
    let _ = KeyGroupRange::all(128);
    let _: &Path = dir.path();
    out
}
