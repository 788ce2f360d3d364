//! State store benchmarks: keyed updates with flushes and compaction, point gets from
//! segments, bloom rejections, segment write bandwidth, snapshot synchronous latency, updates
//! while a snapshot job holds its epoch (and the job's CPU per record), memory, compaction.
//! Every figure is per core (one working thread), per wall second and per CPU second of that
//! thread, against a baseline measured in the same run.

use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::path::Path;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Instant;

use weir_io::{Fs, StdFs, UringFs};
use weir_state::{
    CompactionJob, FlushJob, JobDone, KeyGroupRange, KeyedBackend, Store, StoreConfig,
    StoreMetrics, ValueState,
};

use crate::{process_cpu_ns, thread_cpu_ns, BenchResult, Opts};

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

/// Keys per batched lookup in the get benchmarks.
const GET_BATCH: usize = 64;

/// The batch size, and the single-get figures reported beside a batched one.
fn single_get_extras(gets: u64, t_single: &Timed) -> [(String, f64); 3] {
    [
        ("batch".into(), GET_BATCH as f64),
        (
            "single_get_per_cpu_sec".into(),
            per_sec(gets, t_single.cpu_ns),
        ),
        (
            "single_get_per_wall_sec".into(),
            per_sec(gets, t_single.wall_ns),
        ),
    ]
}

/// The updates' baseline map: 12-byte keys, 16-byte values.
type BaseMap = hashbrown::HashMap<[u8; 12], [u8; 16], hashbrown::DefaultHashBuilder>;

/// `updates` random updates over `keys` keys into a preallocated [`BaseMap`], as
/// `update_round` draws them; returns the map and the loop's time.
///
/// The only caller of this map type's `insert` in the crate, so that LLVM inlines it into the
/// loop (a function with one call site is inlined whatever its size). Called out of line,
/// from two places, each insert's two cache misses (control bytes, then the bucket) stopped
/// overlapping the next insert's, and the map ran at a third of its speed: 3.2 against
/// 8.9 M updates per CPU second here, which flattered the store's ratio by as much.
#[inline(never)]
fn hashbrown_updates(keys: u64, updates: u64) -> (BaseMap, Timed) {
    let mut map = BaseMap::with_capacity_and_hasher(keys as usize, Default::default());
    let mut rng = Rng(1);
    let mut k = [0u8; 12];
    let t = timed(|| {
        for i in 0..updates {
            key_of(rng.next() % keys, &mut k);
            let mut v = [0u8; 16];
            v[..8].copy_from_slice(&i.to_le_bytes());
            map.insert(k, v);
        }
    });
    (map, t)
}

/// Gets of `users`' keys from the updates' baseline map: the gets' baseline. Returns the
/// loop's time and how many it found. Out of `run` for the reason `hashbrown_updates` is.
#[inline(never)]
fn hashbrown_gets(map: &BaseMap, users: &[u32]) -> (Timed, u64) {
    let mut k = [0u8; 12];
    let mut found = 0;
    let t = timed(|| {
        for &user in users {
            key_of(u64::from(user), &mut k);
            found += u64::from(map.contains_key(&k));
        }
    });
    (t, found)
}

/// The hot-path row's baseline: `ops` get-then-insert counts over `keys`, drawn as that row
/// draws them. Out of its caller for the reason `hashbrown_updates` is.
#[inline(never)]
fn hashbrown_get_insert(keys: &[[u8; 8]], ops: u64) -> Timed {
    let n_keys = keys.len() as u64;
    let mut map: hashbrown::HashMap<[u8; 8], u64, hashbrown::DefaultHashBuilder> =
        hashbrown::HashMap::with_capacity_and_hasher(keys.len(), Default::default());
    for k in keys {
        map.insert(*k, 0);
    }
    let mut rng = Rng(9);
    timed(|| {
        for _ in 0..ops {
            let i = (rng.next() % n_keys) as usize;
            let n = map.get(&keys[i]).copied().unwrap_or(0);
            map.insert(keys[i], n + 1);
        }
        std::hint::black_box(&map);
    })
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

/// A maintenance job for the background thread.
enum Job {
    Flush(FlushJob),
    Compact(CompactionJob),
}

/// Maintenance off the processing thread, as in the engine (DESIGN invariant 5): flush and
/// compaction jobs run on one background thread and are installed back by the caller; a
/// flush that arrives during a compaction runs at its next yield, as the engine's does.
struct Background {
    tx: Option<mpsc::Sender<Job>>,
    rx: mpsc::Receiver<JobDone>,
    in_flight: usize,
    thread: Option<std::thread::JoinHandle<BackgroundCpu>>,
}

/// The maintenance thread's CPU nanoseconds: in all, and in flush and compaction jobs.
#[derive(Clone, Copy, Default)]
struct BackgroundCpu {
    total: u64,
    flush: u64,
    compaction: u64,
}

impl Background {
    fn new() -> Background {
        let (tx, jobs) = mpsc::channel::<Job>();
        let (done_tx, rx) = mpsc::channel::<JobDone>();
        let thread = std::thread::spawn(move || {
            let c0 = thread_cpu_ns();
            let mut cpu = BackgroundCpu::default();
            // Jobs that arrived during a compaction and wait for it (a compaction: the store
            // hands out one at a time).
            let mut deferred = std::collections::VecDeque::new();
            loop {
                let j = match deferred.pop_front() {
                    Some(j) => j,
                    None => match jobs.recv() {
                        Ok(j) => j,
                        Err(_) => break,
                    },
                };
                let j0 = thread_cpu_ns();
                let d: JobDone = match j {
                    Job::Flush(j) => {
                        let d = j.run().into();
                        cpu.flush += thread_cpu_ns() - j0;
                        d
                    }
                    Job::Compact(j) => {
                        // As the engine's maintenance thread (`serve` in the runtime's
                        // backend.rs): a flush that arrives during a compaction runs at the
                        // compaction's next yield, so a stalled writer waits for a flush,
                        // not for the whole compaction.
                        let mut nested = 0;
                        let d = j
                            .run_yielding(&mut || {
                                while let Ok(a) = jobs.try_recv() {
                                    match a {
                                        Job::Flush(f) => {
                                            let f0 = thread_cpu_ns();
                                            let d = f.run().into();
                                            nested += thread_cpu_ns() - f0;
                                            let _ = done_tx.send(d);
                                        }
                                        a => deferred.push_back(a),
                                    }
                                }
                                ControlFlow::Continue(())
                            })
                            .into();
                        cpu.flush += nested;
                        cpu.compaction += (thread_cpu_ns() - j0).saturating_sub(nested);
                        d
                    }
                };
                if done_tx.send(d).is_err() {
                    break;
                }
            }
            cpu.total = thread_cpu_ns() - c0;
            cpu
        });
        Background {
            tx: Some(tx),
            rx,
            in_flight: 0,
            thread: Some(thread),
        }
    }

    fn submit(&mut self, store: &mut Store) {
        let tx = self.tx.as_ref().expect("open");
        if let Some(j) = store.flush_job() {
            tx.send(Job::Flush(j)).expect("worker");
            self.in_flight += 1;
        }
        if let Some(j) = store.compaction_job() {
            tx.send(Job::Compact(j)).expect("worker");
            self.in_flight += 1;
        }
    }

    /// Install finished jobs, start due ones; block while the store stalls writes (its
    /// memtables fill the budget), as the runtime's shards do.
    fn pump(&mut self, store: &mut Store) {
        while let Ok(d) = self.rx.try_recv() {
            self.in_flight -= 1;
            store.install(d).expect("install");
        }
        self.submit(store);
        while store.write_stalled() && self.in_flight > 0 {
            let d = self.rx.recv().expect("worker");
            self.in_flight -= 1;
            store.install(d).expect("install");
            self.submit(store);
        }
    }

    /// Wait until no job is running or due.
    fn drain(&mut self, store: &mut Store) {
        self.submit(store);
        while self.in_flight > 0 {
            let d = self.rx.recv().expect("worker");
            self.in_flight -= 1;
            store.install(d).expect("install");
            self.submit(store);
        }
    }

    /// Stop the thread; its CPU.
    fn finish(mut self) -> BackgroundCpu {
        self.tx = None;
        self.thread
            .take()
            .map_or(BackgroundCpu::default(), |t| t.join().expect("worker"))
    }
}

/// The memory sample with the highest ratio of anonymous RSS growth to what the store may
/// hold: its memtable budget and the indexes and filters of its segments at that moment
/// (`index` includes those being built).
struct MemorySample {
    budget: usize,
    grown: u64,
    index: usize,
    filter: usize,
}

impl MemorySample {
    fn new(budget: usize) -> MemorySample {
        MemorySample {
            budget,
            grown: 0,
            index: 0,
            filter: 0,
        }
    }

    fn expected(&self) -> u64 {
        (self.budget + self.index + self.filter) as u64
    }

    fn ratio(&self) -> f64 {
        self.grown as f64 / self.expected() as f64
    }

    fn sample(&mut self, grown: u64, index: usize, filter: usize) {
        let s = MemorySample {
            budget: self.budget,
            grown,
            index,
            filter,
        };
        if s.ratio() > self.ratio() {
            *self = s;
        }
    }
}

/// (RssAnon, RssFile) of this process in bytes, from /proc/self/status (0 if unavailable).
fn rss_now() -> (u64, u64) {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        s.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    (field("RssAnon:"), field("RssFile:"))
}

/// Update rounds of the `state_random_updates` row (see `run`).
const UPDATE_ROUNDS: usize = 3;

/// Rounds of the point-get benchmark (each `gets` batched lookups and as many baseline ones).
const GET_ROUNDS: usize = 3;

/// What one round of the update benchmark measured.
struct UpdateRound {
    /// The processing thread, updates only.
    t: Timed,
    /// The processing thread, freezing and waiting for the last jobs.
    t_drain: Timed,
    /// The maintenance thread's CPU.
    bg_cpu: u64,
    /// Of which in flush and in compaction jobs.
    flush_cpu: u64,
    compaction_cpu: u64,
    /// The whole process's CPU over the round.
    process_cpu: u64,
    metrics: StoreMetrics,
    anon0: u64,
    peak_anon: u64,
    peak_file: u64,
    worst: MemorySample,
}

impl UpdateRound {
    fn threads_cpu(&self) -> u64 {
        self.t.cpu_ns + self.t_drain.cpu_ns + self.bg_cpu
    }

    /// At least the two threads' (the clocks differ in resolution).
    fn all_cpu(&self) -> u64 {
        self.process_cpu.max(self.threads_cpu())
    }
}

/// `updates` random updates over `keys` keys into `store`, with its flushes and compactions
/// on a background thread, then the last memtable flushed and every due job done.
fn update_round(store: &mut Store, keys: u64, updates: u64, budget: usize) -> UpdateRound {
    let (anon0, _) = rss_now();
    let mut peak_anon = anon0;
    let mut peak_file = 0u64;
    let mut worst = MemorySample::new(budget);
    let mut bg = Background::new();
    let mut rng = Rng(1);
    // Keys are issued as the runtime's keyed operators issue them: each one's index slot is
    // prefetched `AHEAD` updates before the update (`Store::prefetch`), so that the misses
    // of consecutive random keys overlap.
    const AHEAD: usize = 8;
    let mut ahead = [[0u8; 12]; AHEAD];
    for a in ahead.iter_mut() {
        key_of(rng.next() % keys, a);
    }
    // The whole process's CPU as well: the kernel's io_uring workers copy buffered writes
    // into the page cache on threads of their own, which neither thread's clock sees.
    let p0 = process_cpu_ns();
    let t = timed(|| {
        for i in 0..updates {
            let slot = i as usize % AHEAD;
            let k = ahead[slot];
            key_of(rng.next() % keys, &mut ahead[slot]);
            store.prefetch(xxhash_rust::xxh3::xxh3_64(&ahead[slot]));
            let mut v = [0u8; 16];
            v[..8].copy_from_slice(&i.to_le_bytes());
            store.put(&k, &v);
            if i % 4096 == 0 {
                bg.pump(store);
                if i % (1 << 16) == 0 {
                    let (a, f) = rss_now();
                    let m = store.metrics();
                    worst.sample(
                        a.saturating_sub(anon0),
                        m.index_bytes + m.building_bytes,
                        m.filter_bytes,
                    );
                    peak_anon = peak_anon.max(a);
                    peak_file = peak_file.max(f);
                }
            }
        }
    });
    let t_drain = timed(|| {
        store.freeze();
        bg.drain(store);
    });
    let (a, f) = rss_now();
    peak_anon = peak_anon.max(a);
    peak_file = peak_file.max(f);
    let BackgroundCpu {
        total: bg_cpu,
        flush: flush_cpu,
        compaction: compaction_cpu,
    } = bg.finish();
    let process_cpu = process_cpu_ns() - p0;
    let metrics = store.metrics();
    worst.sample(
        a.saturating_sub(anon0),
        metrics.index_bytes + metrics.building_bytes,
        metrics.filter_bytes,
    );
    UpdateRound {
        t,
        t_drain,
        bg_cpu,
        flush_cpu,
        compaction_cpu,
        process_cpu,
        metrics,
        anon0,
        peak_anon,
        peak_file,
        worst,
    }
}

/// Each section of `run` and the rows it prints.
const SECTIONS: [(&str, &[&str]); 8] = [
    ("updates", &["state_random_updates", "state_memory"]),
    (
        "gets",
        &["state_point_get_segment", "state_get_absent_bloom"],
    ),
    ("write", &["state_segment_write"]),
    ("snapshot", &["state_snapshot_sync_part"]),
    ("epoch", &["state_updates_under_snapshot"]),
    ("memtable", &["memtable_hash_vs_btree"]),
    ("hot", &["keyed_value_u64_get_update"]),
    ("compaction", &["state_compaction"]),
];

/// Whether `section` runs: `WEIR_STATE_BENCH` lists it (or is unset), and `--only` selects
/// one of its rows.
fn enabled(opts: &Opts, section: &str) -> bool {
    let listed = match std::env::var("WEIR_STATE_BENCH") {
        Ok(v) if !v.is_empty() => v.split(',').any(|s| s == section),
        _ => true,
    };
    listed
        && SECTIONS
            .iter()
            .filter(|(name, _)| *name == section)
            .any(|(_, rows)| rows.iter().any(|r| opts.wants(r)))
}

/// Run the state benchmarks.
/// `WEIR_STATE_BENCH=updates,gets,write,snapshot,epoch,memtable,hot,compaction` selects
/// sections (gets need updates); `WEIR_BENCH_STATE_UPDATES` sets the number of updates.
pub fn run(opts: &Opts) -> Vec<BenchResult> {
    let (fs, fs_name) = fs();
    let keys: u64 = if opts.quick { 200_000 } else { 10_000_000 };
    // `WEIR_BENCH_STATE_UPDATES` sets the update count of section 1: a longer run reaches
    // the larger compactions that 20 M updates (76 flushes) do not.
    let updates: u64 = std::env::var("WEIR_BENCH_STATE_UPDATES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(if opts.quick { 400_000 } else { 20_000_000 });
    let budget: usize = if opts.quick { 8 << 20 } else { 64 << 20 };
    let mut out = Vec::new();
    let dir = bench_dir();

    // 1. Random updates over `keys` distinct keys, 16-byte values; flushes and compactions
    // run on a background thread as in the engine. Figures: per CPU second of the processing
    // thread, and (extra) per CPU second of both threads. Several rounds, each on a fresh
    // store; the row is the round with the median rate including maintenance (a single run
    // of this shared machine moved it by 15% from one run to the next).
    let config = StoreConfig {
        memtable_budget_bytes: budget,
        ..StoreConfig::default()
    };
    let mut k = [0u8; 12];
    let mut store = None;
    let mut base_map = None;
    if enabled(opts, "updates") || enabled(opts, "gets") {
        let rounds = if opts.quick { 1 } else { UPDATE_ROUNDS };
        let mut done = Vec::new();
        for round in 0..rounds {
            let sdir = dir.path().join(format!("updates{round}"));
            let mut s = Store::open(fs.clone(), &sdir, config.clone()).expect("open");
            done.push(update_round(&mut s, keys, updates, budget));
            if round + 1 == rounds {
                // The gets below read the last round's store.
                store = Some(s);
            } else {
                drop(s);
                let _ = std::fs::remove_dir_all(&sdir);
            }
        }
        let incl = |u: &UpdateRound| per_sec(updates, u.all_cpu());
        let mut by_rate: Vec<&UpdateRound> = done.iter().collect();
        by_rate.sort_by(|a, b| incl(a).total_cmp(&incl(b)));
        let u = by_rate[by_rate.len() / 2];
        // Baseline: an honest fast hash map (hashbrown with foldhash, preallocated), kept for
        // the gets' baseline below: it holds exactly the keys the updates wrote.
        let (map, base) = hashbrown_updates(keys, updates);
        let baseline_len = map.len();
        base_map = enabled(opts, "gets").then_some(map);
        let mut r = result(
            "state_random_updates",
            updates,
            &u.t,
            "hashbrown_foldhash_prealloc_insert",
            updates,
            &base,
        );
        let (m, threads_cpu, all_cpu) = (&u.metrics, u.threads_cpu(), u.all_cpu());
        r.extra = vec![
            ("distinct_keys".into(), keys as f64),
            ("updates".into(), updates as f64),
            ("baseline_map_len".into(), baseline_len as f64),
            ("per_cpu_sec_incl_maintenance".into(), incl(u)),
            ("maintenance_cpu_s".into(), u.bg_cpu as f64 / 1e9),
            ("flush_cpu_s".into(), u.flush_cpu as f64 / 1e9),
            ("compaction_cpu_s".into(), u.compaction_cpu as f64 / 1e9),
            // What neither thread's clock saw: io_uring workers' buffered-write copies.
            (
                "io_worker_cpu_s".into(),
                (all_cpu - threads_cpu) as f64 / 1e9,
            ),
            (
                "per_cpu_sec_incl_maintenance_threads_only".into(),
                per_sec(updates, threads_cpu),
            ),
            ("final_drain_wall_s".into(), u.t_drain.wall_ns as f64 / 1e9),
            ("flushes".into(), m.flushes as f64),
            ("compactions".into(), m.compactions as f64),
            ("segments".into(), m.segments as f64),
            ("segment_bytes".into(), m.segment_bytes as f64),
            ("compaction_bytes_in".into(), m.compaction_bytes_in as f64),
            ("compaction_bytes_out".into(), m.compaction_bytes_out as f64),
            ("rounds".into(), rounds as f64),
        ];
        // Every round, in run order.
        for (i, d) in done.iter().enumerate() {
            r.extra.push((
                format!("round{i}_per_cpu_sec"),
                per_sec(updates, d.t.cpu_ns),
            ));
            r.extra
                .push((format!("round{i}_per_cpu_sec_incl_maintenance"), incl(d)));
            r.extra
                .push((format!("round{i}_maintenance_cpu_s"), d.bg_cpu as f64 / 1e9));
        }
        out.push(r);
        // Memory of the store alone (sampled before any baseline map exists): anonymous RSS
        // growth against the memtable budget (every memtable: mutable, frozen, kept for
        // reuse) + the block indexes and bloom filters the store holds at that moment (they
        // shrink when a compaction drops duplicates), those a running flush or compaction
        // builds included (`building_bytes`, counted with the indexes). The row is the worst
        // of the samples taken every 65536 updates and after the final drain, over every
        // round. Mapped segment pages are page cache (RssFile).
        let w = done
            .iter()
            .max_by(|a, b| a.worst.ratio().total_cmp(&b.worst.ratio()))
            .expect("a round");
        out.push(BenchResult {
            bench: "state_memory".into(),
            per_wall_sec: 0.0,
            per_cpu_sec: 0.0,
            baseline: "memtable_budget_plus_index_plus_filter".into(),
            baseline_per_cpu_sec: w.worst.expected() as f64,
            ratio: w.worst.ratio(),
            p50_ns: None,
            p99_ns: None,
            p999_ns: None,
            max_ns: None,
            extra: vec![
                (
                    "peak_anon_rss_growth_bytes".into(),
                    w.peak_anon.saturating_sub(w.anon0) as f64,
                ),
                (
                    "worst_sample_anon_rss_growth_bytes".into(),
                    w.worst.grown as f64,
                ),
                ("worst_sample_index_bytes".into(), w.worst.index as f64),
                ("worst_sample_filter_bytes".into(), w.worst.filter as f64),
                ("anon_rss_at_start_bytes".into(), w.anon0 as f64),
                ("peak_file_rss_bytes".into(), w.peak_file as f64),
                ("memtable_budget_bytes".into(), budget as f64),
                ("index_bytes".into(), w.metrics.index_bytes as f64),
                ("filter_bytes".into(), w.metrics.filter_bytes as f64),
            ],
        });
    }

    // 2. Point gets from segments (warm page cache) and absent keys (bloom negatives).
    if let (true, Some(store)) = (enabled(opts, "gets"), store.as_mut()) {
        store.flush_and_compact_all().expect("compact");
        let gets: u64 = if opts.quick { 200_000 } else { 4_000_000 };
        let mut rng = Rng(2);
        // Gets of keys the updates wrote, drawn at random from them before each timed loop:
        // `updates` random updates over `keys` keys write about 86% of them (1 - e^-2 for
        // twice as many updates as keys), and a get of another key stops at the bloom
        // filter, which a row of gets of present keys must not count (an eighth did before).
        // `update_round` draws the key of update `i` as the `i`th value of `Rng(1)`.
        let written = {
            let mut w = vec![false; keys as usize];
            let mut r = Rng(1);
            for _ in 0..updates {
                w[(r.next() % keys) as usize] = true;
            }
            w
        };
        let mut present_rng = Rng(3);
        let mut present_keys = |n: u64| -> Vec<u32> {
            let mut v = Vec::with_capacity(n as usize);
            while v.len() < n as usize {
                let user = present_rng.next() % keys;
                if written[user as usize] {
                    v.push(user as u32);
                }
            }
            v
        };
        // Warm-up: touch the pages once (PLATFORM.md: first touch is expensive on this VM).
        for &user in &present_keys(gets / 4) {
            key_of(u64::from(user), &mut k);
            store.get(&k).expect("get");
        }
        let mut found = 0u64;
        let base_map = base_map.take().expect("the updates' baseline map");
        // Gets as a keyed operator issues them: in batches (`Store::multi_get`), whose steps
        // overlap the cache misses of neighbouring keys; single gets beside them. Rounds of
        // the store's gets and the baseline's, alternated, so that both see the same moments
        // of this shared machine (one run's figure moved by a fifth from one run to the
        // next); the row is the round with the median store rate.
        let mut batch = vec![[0u8; 12]; GET_BATCH];
        let rounds = if opts.quick { 1 } else { GET_ROUNDS };
        let mut runs = Vec::with_capacity(rounds);
        let mut base_found = 0u64;
        for _ in 0..rounds {
            let ids = present_keys(gets);
            let t = timed(|| {
                for chunk in ids.chunks_exact(GET_BATCH) {
                    for (b, &user) in batch.iter_mut().zip(chunk) {
                        key_of(u64::from(user), b);
                    }
                    store
                        .multi_get(&batch, |_, f| found += u64::from(f.is_some()))
                        .expect("multi_get");
                }
            });
            let ids = present_keys(gets);
            let (base, n) = hashbrown_gets(&base_map, &ids);
            base_found += n;
            runs.push((per_sec(gets, t.cpu_ns), t, base));
        }
        drop(base_map);
        let rates: Vec<(f64, f64)> = runs
            .iter()
            .map(|(rate, _, base)| (*rate, per_sec(gets, base.cpu_ns)))
            .collect();
        runs.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (_, t, base) = &runs[runs.len() / 2];
        let mut single_found = 0u64;
        let ids = present_keys(gets);
        let t_single = timed(|| {
            for &user in &ids {
                key_of(u64::from(user), &mut k);
                single_found += u64::from(store.get(&k).expect("get").is_some());
            }
        });
        let mut r = result(
            "state_point_get_segment",
            gets,
            t,
            "hashbrown_get",
            gets,
            base,
        );
        r.extra = vec![
            ("found".into(), found as f64),
            ("baseline_found".into(), base_found as f64),
            ("single_found".into(), single_found as f64),
        ];
        r.extra.extend(single_get_extras(gets, &t_single));
        r.extra.push(("rounds".into(), rounds as f64));
        // Each round's figures, in run order.
        for (i, (rate, base_rate)) in rates.iter().enumerate() {
            r.extra.push((format!("round{i}_per_cpu_sec"), *rate));
            r.extra
                .push((format!("round{i}_baseline_per_cpu_sec"), *base_rate));
        }
        out.push(r);

        let bloom_before = store.metrics().bloom_negatives;
        let mut absent_found = 0u64;
        let t = timed(|| {
            for _ in 0..gets / GET_BATCH as u64 {
                for b in batch.iter_mut() {
                    key_of(keys + rng.next() % keys, b);
                }
                store
                    .multi_get(&batch, |_, f| absent_found += u64::from(f.is_some()))
                    .expect("multi_get");
            }
        });
        let neg = store.metrics().bloom_negatives - bloom_before;
        let mut single_absent_found = 0u64;
        let t_single = timed(|| {
            for _ in 0..gets {
                key_of(keys + rng.next() % keys, &mut k);
                single_absent_found += u64::from(store.get(&k).expect("get").is_some());
            }
        });
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
            ("single_false_found".into(), single_absent_found as f64),
        ];
        r.extra.extend(single_get_extras(gets, &t_single));
        out.push(r);
    }
    drop(store);

    // 3. Segment write bandwidth vs raw sequential writes + fsync of the same size.
    if enabled(opts, "write") {
        let wcfg = StoreConfig {
            memtable_budget_bytes: 1 << 30,
            ..StoreConfig::default()
        };
        let n_write: u64 = if opts.quick { 200_000 } else { 2_000_000 };
        // Rounds of a segment job and a raw write of its size, alternating, so that both see
        // the same moments of this shared machine; the row is the measured round with the
        // median ratio. The first round is a warm-up that the row does not count: its job
        // faults in the flush's scratch buffers (sort buffers, key order, write pieces), which
        // a store reuses for every later flush (its job ran at 365-745 MB per CPU second in
        // four runs, the later rounds at 544-789). Its ratio is reported beside the row.
        let (warmups, measured) = if opts.quick { (0, 1) } else { (1, 5) };
        let mut rounds = Vec::new();
        for round in 0..warmups + measured {
            let wdir = dir.path().join(format!("write{round}"));
            let mut ws = Store::open(fs.clone(), &wdir, wcfg.clone()).expect("open");
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
            drop(ws);
            let raw_path = dir.path().join(format!("raw{round}.bin"));
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
            let _ = std::fs::remove_dir_all(&wdir);
            let _ = std::fs::remove_file(&raw_path);
            let ratio = per_sec(seg_bytes, t.wall_ns) / per_sec(seg_bytes, base.wall_ns);
            rounds.push((ratio, seg_bytes, t, base));
        }
        // Each round's segment job in bytes per CPU second of its thread, in run order (the
        // warm-up first).
        let cpu_rates: Vec<f64> = rounds
            .iter()
            .map(|(_, bytes, t, _)| per_sec(*bytes, t.cpu_ns))
            .collect();
        let warmup_ratios: Vec<f64> = rounds.drain(..warmups).map(|r| r.0).collect();
        rounds.sort_by(|a, b| a.0.total_cmp(&b.0));
        let ratios: Vec<f64> = rounds.iter().map(|r| r.0).collect();
        let (ratio, seg_bytes, t, base) = &rounds[rounds.len() / 2];
        // The segment job also builds the file (sort, encode, bloom) and verifies it on open;
        // bandwidth is bytes per wall second, the ratio per wall second as well (I/O bound).
        let mut r = result(
            "state_segment_write",
            *seg_bytes,
            t,
            "raw_sequential_write_fsync",
            *seg_bytes,
            base,
        );
        r.ratio = *ratio;
        r.extra = vec![
            ("segment_bytes".into(), *seg_bytes as f64),
            (
                "baseline_bytes_per_wall_sec".into(),
                per_sec(*seg_bytes, base.wall_ns),
            ),
            ("fs_uring".into(), f64::from(u8::from(fs_name == "uring"))),
        ];
        for (i, x) in ratios.iter().enumerate() {
            r.extra.push((format!("ratio_sorted_{i}"), *x));
        }
        for x in &warmup_ratios {
            r.extra.push(("warmup_ratio".into(), *x));
        }
        for (i, x) in cpu_rates.iter().enumerate() {
            r.extra.push((format!("round{i}_bytes_per_cpu_sec"), *x));
        }
        out.push(r);
    }

    // 4. Snapshot synchronous part with a full memtable.
    if enabled(opts, "snapshot") {
        // The mutable memtable's share (half the budget) above the 64 MiB it is filled to:
        // this measures the seal, not a freeze.
        let scfg = StoreConfig {
            memtable_budget_bytes: budget * 4,
            ..StoreConfig::default()
        };
        let rounds = if opts.quick { 5 } else { 100 };
        let mut ss = Store::open(fs.clone(), &dir.path().join("snap"), scfg).expect("open");
        let mut lat = Vec::new();
        let mut keys_in = 0u64;
        while ss.metrics().memtable_bytes < budget {
            key_of(keys_in, &mut k);
            ss.put(&k, &[1u8; 16]);
            keys_in += 1;
        }
        // Every snapshot seals an epoch of writes: the fill for the first, then a tenth of the
        // keys updated in place (as the keyed checkpoint benchmarks change state between
        // checkpoints). Before, the rounds after the first sealed an empty epoch, a no-op that
        // measured nothing; the row's p99 was then its first round alone.
        let per_round = (keys_in / 10).max(1);
        let mut rng = Rng(7);
        for ckpt in 0..rounds {
            if ckpt > 0 {
                for _ in 0..per_round {
                    key_of(rng.next() % keys_in, &mut k);
                    ss.put(&k, &u128::from(ckpt).to_le_bytes());
                }
            }
            let t0 = Instant::now();
            let job = ss.snapshot(ckpt);
            lat.push(t0.elapsed().as_nanos() as u64);
            job.run().expect("snapshot");
            // The previous checkpoint is released once this one completed, as the engine does.
            if ckpt > 0 {
                ss.release_snapshot(ckpt - 1);
            }
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
                ("keys".into(), keys_in as f64),
                ("updates_per_epoch".into(), per_round as f64),
            ],
        });
        drop(ss);
    }

    // 4b. What a checkpoint costs the store, without a job around it: updates while a
    // snapshot job holds the previous epoch (copies of the chunks it reads) against the same
    // updates without snapshots, in alternating rounds on this thread, and the snapshot job's
    // CPU per record it writes. The keyed checkpoint benchmark measures the same costs end to
    // end, as the difference of two runs: on this shared machine that difference was noisier
    // than the costs themselves.
    if enabled(opts, "epoch") {
        let n: u64 = if opts.quick { 100_000 } else { 500_000 };
        let rounds = if opts.quick { 2 } else { 6 };
        // The runtime's default budget: the epochs and their copies fit without a freeze.
        let ecfg = StoreConfig {
            memtable_budget_bytes: weir_runtime::JobConfig::default().memtable_budget_bytes,
            ..StoreConfig::default()
        };
        let mut es = Store::open(fs.clone(), &dir.path().join("epoch"), ecfg).expect("open");
        for user in 0..n {
            key_of(user, &mut k);
            es.put(&k, &[1u8; 16]);
        }
        let mut rng = Rng(11);
        // 2n updates of random keys: about 86% of the keys change between two snapshots.
        let mut update = |s: &mut Store, round: u64| {
            let mut v = [0u8; 16];
            v[..8].copy_from_slice(&round.to_le_bytes());
            timed(|| {
                for _ in 0..2 * n {
                    key_of(rng.next() % n, &mut k);
                    s.put(&k, &v);
                }
            })
        };
        // One snapshot first, untimed: once a memtable was sealed, its updates log each
        // record's first write of an epoch, snapshots or not; without it, the first plain
        // round alone skipped that and made the snapshots look dearer.
        es.snapshot(0).run().expect("snapshot");
        es.release_snapshot(0);
        let (mut plain, mut held, mut job) = (Vec::new(), Vec::new(), Vec::new());
        let mut records = 0u64;
        for round in 0..rounds as u64 {
            // Alternate which goes first.
            for with_snapshot in [round % 2 == 1, round % 2 == 0] {
                if !with_snapshot {
                    plain.push(update(&mut es, round));
                    continue;
                }
                let j = es.snapshot(round + 1);
                held.push(update(&mut es, round));
                let mut h = None;
                job.push(timed(|| h = Some(j.run().expect("snapshot"))));
                let h = h.expect("ran");
                records += h
                    .segments
                    .iter()
                    .filter(|r| r.is_new)
                    .map(|r| r.entry_count)
                    .sum::<u64>();
                es.release_snapshot(round + 1);
                es.run_pending_maintenance().expect("maintenance");
            }
        }
        let sum = |v: &[Timed]| Timed {
            wall_ns: v.iter().map(|t| t.wall_ns).sum(),
            cpu_ns: v.iter().map(|t| t.cpu_ns).sum(),
        };
        let (held_t, plain_t, job_t) = (sum(&held), sum(&plain), sum(&job));
        let ups = 2 * n * rounds as u64;
        let mut r = result(
            "state_updates_under_snapshot",
            ups,
            &held_t,
            "same_updates_without_snapshots",
            ups,
            &plain_t,
        );
        r.extra = vec![
            ("keys".into(), n as f64),
            ("rounds".into(), rounds as f64),
            (
                "ratio_incl_snapshot_job".into(),
                per_sec(ups, held_t.cpu_ns + job_t.cpu_ns) / per_sec(ups, plain_t.cpu_ns),
            ),
            ("epoch_records".into(), records as f64 / rounds as f64),
            (
                "snapshot_job_cpu_ns_per_record".into(),
                job_t.cpu_ns as f64 / records.max(1) as f64,
            ),
        ];
        // Per round: the updates' CPU with the epoch held less without, and the job's.
        for (i, ((h, p), j)) in held.iter().zip(&plain).zip(&job).enumerate() {
            let extra_ms = (h.cpu_ns as f64 - p.cpu_ns as f64) / 1e6;
            r.extra
                .push((format!("round{i}_updates_extra_cpu_ms"), extra_ms));
            r.extra.push((
                format!("round{i}_snapshot_job_cpu_ms"),
                j.cpu_ns as f64 / 1e6,
            ));
        }
        out.push(r);
        drop(es);
    }

    // 5. Memtable design: hash index (the store) vs a sorted map, same updates, no flushes.
    if enabled(opts, "memtable") {
        let n_mem: u64 = if opts.quick { 200_000 } else { 2_000_000 };
        let distinct = n_mem / 4;
        let mcfg = StoreConfig {
            memtable_budget_bytes: 1 << 30,
            ..StoreConfig::default()
        };
        let mut ms = Store::open(fs.clone(), &dir.path().join("mem"), mcfg).expect("open");
        let mut rng = Rng(3);
        // 16-byte values on both sides, as the other state rows write.
        let t = timed(|| {
            for i in 0..n_mem {
                key_of(rng.next() % distinct, &mut k);
                let mut v = [0u8; 16];
                v[..8].copy_from_slice(&i.to_le_bytes());
                ms.put(&k, &v);
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
    }

    // 6. Keyed-count hot path: ValueState<u64> value() + update() of keys in the memtable,
    // as the runtime calls it (set_current_key_bytes, set_namespace(&[]), value, update).
    if enabled(opts, "hot") {
        out.push(hot_path(&fs, dir.path(), opts));
    }

    // 7. Compaction: a merge of a tier of flushed segments into one.
    if enabled(opts, "compaction") {
        out.push(compaction(&fs, dir.path(), opts));
    }

    let _ = KeyGroupRange::all(128);
    let _: &Path = dir.path();
    out
}

/// Segments merged by the compaction benchmark: the default `compaction_min_merge` (10) plus
/// two, a tier of the size the updates benchmark's store merges.
const COMPACTION_INPUTS: usize = 12;

/// A full compaction of `COMPACTION_INPUTS` flushed segments of random keys (a quarter of them
/// in two or more segments, so the merge also drops shadowed versions), in entries read per
/// CPU second of the job's thread. Baseline: the textbook k-way merge of the same entries,
/// held in memory as sorted vectors, through `std`'s binary heap, keeping each key's newest
/// version. The figure covers what the merge costs beyond it: reading and checking the
/// segments' blocks, and writing, checksumming and filtering the output. Alternated rounds on
/// fresh stores; the row is the round with the median rate.
fn compaction(fs: &Arc<dyn Fs>, dir: &Path, opts: &Opts) -> BenchResult {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;

    let per_seg: u64 = if opts.quick { 20_000 } else { 250_000 };
    let space = per_seg * COMPACTION_INPUTS as u64 * 3;
    let rounds = if opts.quick { 1 } else { 5 };
    let config = StoreConfig {
        memtable_budget_bytes: 1 << 30,
        max_segments: COMPACTION_INPUTS * 2,
        ..StoreConfig::default()
    };
    let mut k = [0u8; 12];
    let mut runs = Vec::new();
    for round in 0..rounds {
        let sdir = dir.join(format!("compaction{round}"));
        let mut store = Store::open(fs.clone(), &sdir, config.clone()).expect("open");
        // The same entries in memory for the baseline: one sorted run per segment.
        let mut sorted: Vec<Vec<([u8; 12], [u8; 16])>> = Vec::new();
        let mut rng = Rng(11 + round as u64);
        for s in 0..COMPACTION_INPUTS {
            let mut run = Vec::with_capacity(per_seg as usize);
            for i in 0..per_seg {
                key_of(rng.next() % space, &mut k);
                let mut v = [0u8; 16];
                v[..8].copy_from_slice(&(s as u64 * per_seg + i).to_le_bytes());
                store.put(&k, &v);
                run.push((k, v));
            }
            store.freeze();
            let job = store.flush_job().expect("flush job");
            store.install(job.run()).expect("flush");
            // Within a segment a key's last put wins: reversed, a stable sort puts it first
            // among its key's entries, and `dedup_by` keeps the first.
            run.reverse();
            run.sort_by_key(|e| e.0);
            run.dedup_by(|later, first| later.0 == first.0);
            sorted.push(run);
        }
        let entries_in: u64 = sorted.iter().map(|r| r.len() as u64).sum();
        // A scan over the same segments: the merge without the output's writing.
        let mut visible = 0u64;
        let t_scan = timed(|| visible = store.scan_range(&[], None).count() as u64);
        let job = store.full_compaction_job().expect("compaction job");
        let mut done = None;
        let t = timed(|| done = Some(job.run()));
        store.install(done.expect("ran")).expect("compaction");
        let entries_out = store.scan_range(&[], None).count() as u64;
        drop(store);
        let _ = std::fs::remove_dir_all(&sdir);

        let mut merged: Vec<([u8; 12], [u8; 16])> = Vec::with_capacity(entries_out as usize);
        let base = timed(|| {
            // Newest segment first on equal keys: the heap orders by (key, age).
            let mut heap = BinaryHeap::with_capacity(sorted.len());
            let mut pos = vec![0usize; sorted.len()];
            for (s, run) in sorted.iter().enumerate() {
                if let Some(e) = run.first() {
                    heap.push(Reverse((e.0, COMPACTION_INPUTS - s)));
                }
            }
            while let Some(Reverse((key, age))) = heap.pop() {
                let s = COMPACTION_INPUTS - age;
                if merged.last().is_none_or(|m| m.0 != key) {
                    merged.push(sorted[s][pos[s]]);
                }
                pos[s] += 1;
                if let Some(e) = sorted[s].get(pos[s]) {
                    heap.push(Reverse((e.0, age)));
                }
            }
            std::hint::black_box(&merged);
        });
        assert_eq!(
            merged.len() as u64,
            entries_out,
            "the baseline and the store merged to different key counts"
        );
        assert_eq!(visible, entries_out, "the scan and the compaction disagree");
        runs.push((
            per_sec(entries_in, t.cpu_ns),
            entries_in,
            entries_out,
            t,
            base,
            t_scan,
        ));
    }
    // In run order, as their `round{i}` names say.
    let rates: Vec<f64> = runs.iter().map(|r| r.0).collect();
    let scan_rates: Vec<f64> = runs.iter().map(|r| per_sec(r.1, r.5.cpu_ns)).collect();
    runs.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (_, entries_in, entries_out, t, base, _) = &runs[runs.len() / 2];
    let mut r = result(
        "state_compaction",
        *entries_in,
        t,
        "binary_heap_kmerge_in_memory",
        *entries_in,
        base,
    );
    r.extra = vec![
        ("inputs".into(), COMPACTION_INPUTS as f64),
        ("entries_in".into(), *entries_in as f64),
        ("entries_out".into(), *entries_out as f64),
        (
            "ns_per_entry_cpu".into(),
            t.cpu_ns as f64 / *entries_in as f64,
        ),
        (
            "baseline_ns_per_entry_cpu".into(),
            base.cpu_ns as f64 / *entries_in as f64,
        ),
    ];
    for (i, x) in rates.iter().enumerate() {
        r.extra.push((format!("round{i}_per_cpu_sec"), *x));
    }
    // Each round's scan, in entries read per CPU second.
    for (i, x) in scan_rates.iter().enumerate() {
        r.extra.push((format!("round{i}_scan_per_cpu_sec"), *x));
    }
    r
}

fn hot_path(fs: &Arc<dyn Fs>, dir: &Path, opts: &Opts) -> BenchResult {
    let n_keys: u64 = 100_000;
    let ops: u64 = if opts.quick { 1_000_000 } else { 20_000_000 };
    let store = Store::open(fs.clone(), &dir.join("hot"), StoreConfig::default()).expect("open");
    let mut be = KeyedBackend::new(store, KeyGroupRange::all(128)).expect("backend");
    let id = be.state_id("count");
    let keys: Vec<[u8; 8]> = (0..n_keys).map(|i| (i * 7919).to_be_bytes()).collect();
    let kgs: Vec<u16> = keys
        .iter()
        .map(|k| (xxhash_rust::xxh3::xxh3_64(k) % 128) as u16)
        .collect();
    for (k, &kg) in keys.iter().zip(&kgs) {
        be.set_current_key_bytes(kg, k);
        be.set_namespace(&[]);
        ValueState::<u64>::from_id(id)
            .update(&mut be, &0)
            .expect("update");
    }
    let mut rng = Rng(9);
    let t = timed(|| {
        for _ in 0..ops {
            let i = (rng.next() % n_keys) as usize;
            be.set_current_key_bytes(kgs[i], &keys[i]);
            be.set_namespace(&[]);
            let count = ValueState::<u64>::from_id(id);
            let n = count.value(&mut be).expect("get").unwrap_or(0);
            count.update(&mut be, &(n + 1)).expect("update");
        }
    });
    // The same updates through `update_with` (one call, one lookup).
    let mut rng = Rng(9);
    let t_with = timed(|| {
        for _ in 0..ops {
            let i = (rng.next() % n_keys) as usize;
            be.set_current_key_bytes(kgs[i], &keys[i]);
            be.set_namespace(&[]);
            ValueState::<u64>::from_id(id)
                .update_with(&mut be, |old| old.map_or(0, |n| n.to_native()) + 1)
                .expect("update_with");
        }
    });
    let base = hashbrown_get_insert(&keys, ops);
    let mut r = result(
        "keyed_value_u64_get_update",
        ops,
        &t,
        "hashbrown_foldhash_get_insert",
        ops,
        &base,
    );
    r.extra = vec![
        ("ns_per_op_cpu".into(), t.cpu_ns as f64 / ops as f64),
        (
            "update_with_ns_per_op_cpu".into(),
            t_with.cpu_ns as f64 / ops as f64,
        ),
        (
            "baseline_ns_per_op_cpu".into(),
            base.cpu_ns as f64 / ops as f64,
        ),
        ("keys".into(), n_keys as f64),
    ];
    r
}
