//! Runtime benchmarks: whole jobs on shards, each beside a plain-Rust baseline doing the same
//! work on one thread in the same run.
//!
//! * `chain_gen_map_filter_sink_1shard`: generator -> map -> filter -> sink chained on one shard;
//!   baseline: the same generator, map, filter and count in a plain loop.
//! * `keyed_count_2shards`: generator -> key_by -> keyed count -> sink on two shards (one ring hop
//!   per record for half of them, state in the shard's store); baseline: the same records counted
//!   in one hashbrown map on one thread. `per_cpu_sec` is records per CPU second of the whole
//!   process (all shards), i.e. per core.
//! * `latency_keyed_half_peak`: the keyed job throttled to half the peak rate just measured;
//!   per-record source-to-sink latency, from the time each record was due on the generator's
//!   fixed schedule (so time a shard spends unable to poll its source counts: no coordinated
//!   omission), with 64 records per step and prefaulted state memory. The schedule starts
//!   when the job's status is `Running` (every shard built), `schedule_start_ms` after the
//!   job is made; wall and CPU time count from then to the job's end, so `ratio` is the
//!   share of the offered rate the job kept. Each run has its own histogram; the row is the
//!   run with the median p99, beside the raw ring's run with the median p99 (`raw_spsc_*`),
//!   and every run's p99, max, steal and startup are in `extra`.
//!
//! * `idle_nap_200us`: how an idle shard waits (`weir_runtime::platform::nap`: its thread
//!   sleeps, timer slack 1 us, then the task yields) beside `glommio::timer::sleep`, each in a
//!   one-task executor as a shard's is. `per_cpu_sec` is waits per CPU second of the
//!   executor's thread (what an idle shard burns), `ratio` nap / timer; `extra` has each one's
//!   mean wall time per wait, at 200 us and at 10 us (a shard's first nap), and
//!   `idle_job_2shards_core_share`: the CPU of a whole 2-shard job whose source has nothing
//!   for a second, as a share of one core.
//!
//! Every figure is the median of several runs; all runs are listed in `extra`.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use weir_runtime::sink::{Sink, SinkWriter};
use weir_runtime::source::{splitmix64, GeneratorSource, ScheduleStart};
use weir_runtime::{Job, JobConfig, JobStatus, StartError, Stream};

use crate::{process_cpu_ns, thread_cpu_ns, BenchResult, Opts};

/// Peak resident set size of the process, in bytes.
pub fn peak_rss_bytes() -> u64 {
    // SAFETY: an all-zero rusage is a valid value for getrusage to overwrite.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a valid, writable rusage; RUSAGE_SELF is a valid target.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    if rc != 0 {
        return 0;
    }
    ru.ru_maxrss as u64 * 1024
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Measured {
    records: u64,
    wall_ns: u64,
    cpu_ns: u64,
}

impl Measured {
    fn per_wall(&self) -> f64 {
        self.records as f64 * 1e9 / self.wall_ns.max(1) as f64
    }
    fn per_cpu(&self) -> f64 {
        self.records as f64 * 1e9 / self.cpu_ns.max(1) as f64
    }
}

pub(crate) fn measure(f: impl FnOnce() -> u64) -> Measured {
    let (w0, c0) = (Instant::now(), process_cpu_ns());
    let records = f();
    Measured {
        records,
        wall_ns: w0.elapsed().as_nanos() as u64,
        cpu_ns: process_cpu_ns() - c0,
    }
}

fn median(mut runs: Vec<Measured>) -> (Measured, Vec<Measured>) {
    let all = runs.clone();
    runs.sort_by(|a, b| a.per_cpu().total_cmp(&b.per_cpu()));
    (runs[runs.len() / 2], all)
}

pub(crate) fn row(
    bench: &str,
    ours: Vec<Measured>,
    baseline: &str,
    base: Vec<Measured>,
) -> BenchResult {
    let (m, all) = median(ours);
    let (b, ball) = median(base);
    let mut extra = Vec::new();
    for (i, r) in all.iter().enumerate() {
        extra.push((format!("run{i}_per_cpu_sec"), r.per_cpu()));
        extra.push((format!("run{i}_per_wall_sec"), r.per_wall()));
    }
    for (i, r) in ball.iter().enumerate() {
        extra.push((format!("baseline_run{i}_per_cpu_sec"), r.per_cpu()));
    }
    BenchResult {
        bench: bench.into(),
        per_wall_sec: m.per_wall(),
        per_cpu_sec: m.per_cpu(),
        baseline: baseline.into(),
        baseline_per_cpu_sec: b.per_cpu(),
        ratio: m.per_cpu() / b.per_cpu().max(1e-9),
        extra,
        ..Default::default()
    }
}

/// Records per step in the latency job (the throughput jobs use 4096). Same machine, four runs
/// each: p99 19-32 us with 64, 41-178 us with 256, 1.5-6.7 ms with 4096 (and no prefault).
pub(crate) const LATENCY_BATCH_RECORDS: usize = 64;

pub(crate) fn config(shards: usize) -> JobConfig {
    JobConfig::new()
        .with_shards(shards)
        .with_batch_records(4096)
        .with_latency_marker_interval_ms(0)
        // Shards poll instead of sleeping when idle: latency is what these figures are about.
        .with_idle_sleep_max_us(0)
}

#[inline]
fn gen_value(i: u64, r: u64) -> (u64, u64) {
    (r, i)
}

/// generator -> map -> filter -> sink on one shard.
fn chain_job(n: u64) -> u64 {
    let count = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let c2 = count.clone();
    let job = Job::new(config(1));
    job.source(GeneratorSource::new(Some(n), 1, gen_value))
        .map(|(r, i)| (r.wrapping_mul(3), i))
        .filter(|(r, _)| r & 3 != 0)
        .sink(CountSink(c2));
    job.run().expect("chain job");
    count.load(std::sync::atomic::Ordering::Relaxed)
}

fn chain_baseline(n: u64) -> u64 {
    let mut kept = 0u64;
    for i in 0..n {
        let (r, i) = gen_value(i, splitmix64(1, i));
        let (r, _) = std::hint::black_box((r.wrapping_mul(3), i));
        if r & 3 != 0 {
            kept += 1;
        }
    }
    kept
}

/// generator -> key_by -> keyed count -> sink on `shards` shards; returns records counted.
fn keyed_job(n: u64, keys: u64, shards: usize) -> u64 {
    let count = Arc::new(std::sync::atomic::AtomicU64::new(0));
    // The field is the index: a clock read per record would cost the job.
    let gen = GeneratorSource::new(Some(n), 3, move |i: u64, r: u64| (r % keys, i));
    let job = Job::new(config(shards));
    keyed_count(job.source(gen)).sink(CountSink(count.clone()));
    job.run().expect("keyed job");
    count.load(std::sync::atomic::Ordering::Relaxed)
}

/// The keyed job on `shards` shards, each generator throttled to `rate_per_shard` on a fixed
/// schedule that starts once the job runs, every record stamped with its due time, and each
/// record's latency at the sink in `h`. Returns what was measured from the schedule's start
/// to the job's end, and how long the job took to start (made to `Running`).
fn latency_job(
    n: u64,
    keys: u64,
    shards: usize,
    rate_per_shard: u64,
    h: Arc<Mutex<Histogram<u64>>>,
) -> (Measured, Duration) {
    let count = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let epoch = Instant::now();
    // Latency counts from when a record should have entered, not from when the source got
    // to it (no coordinated omission). The schedule starts when every shard is built: its
    // state memory faulted in, which took 0.3-0.7 s per shard on a busy host (a fixed 500 ms
    // start then put that wait into the first records' latency, and into the p99).
    let schedule = ScheduleStart::new();
    let origin_ns = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let origin2 = origin_ns.clone();
    let per_shard = shards as u64;
    let gen = GeneratorSource::new(Some(n), 3, move |i: u64, r: u64| {
        let origin = origin2.load(std::sync::atomic::Ordering::Relaxed);
        (
            r % keys,
            origin + (i / per_shard) * 1_000_000_000 / rate_per_shard,
        )
    })
    .with_rate_per_shard(rate_per_shard)
    .with_schedule(schedule.clone());
    // Tuned for latency, as Flink's buffer timeout is: a step moves at most
    // LATENCY_BATCH_RECORDS records, so a burst after a stall is not queued behind 4096 of
    // them, and the memtables' pages are faulted in before any record is generated.
    let cfg = config(shards)
        .with_batch_records(LATENCY_BATCH_RECORDS)
        .with_prefault_state_memory(true);
    let job = Job::new(cfg);
    keyed_count(job.source(gen)).sink(LatencySink {
        epoch,
        out: h,
        count: count.clone(),
        live: None,
    });
    let handle = job.start().expect("latency job");
    while handle.status() == JobStatus::Initializing {
        std::thread::sleep(Duration::from_micros(200));
    }
    assert_eq!(handle.status(), JobStatus::Running, "latency job");
    let started = epoch.elapsed();
    let origin = Instant::now();
    // Read by the generators only after the schedule starts (its start publishes this).
    origin_ns.store(
        (origin - epoch).as_nanos() as u64,
        std::sync::atomic::Ordering::Relaxed,
    );
    let m = measure(|| {
        schedule.start_at(origin);
        handle.wait().expect("latency job");
        count.load(std::sync::atomic::Ordering::Relaxed)
    });
    (m, started)
}

/// `(key, field)` -> key_by -> keyed count: the keyed job of the runtime and checkpoint suites.
/// Emits `(count so far, field)`; the source and the count have stable uids.
pub(crate) fn keyed_count(source: Stream<(u64, u64)>) -> Stream<(u64, u64)> {
    source
        .uid("gen")
        .key_by(|(k, _)| *k)
        .process(weir_runtime::FnProcess::new(
            move |rec: (u64, u64), ctx: &mut weir_runtime::KeyedContext<'_, u64, (u64, u64)>| {
                let n = ctx.value::<u64>("count").unwrap_or(0) + 1;
                ctx.set_value("count", &n);
                ctx.emit((n, rec.1));
            },
        ))
        .uid("count")
}

fn keyed_baseline(n: u64, keys: u64) -> u64 {
    let mut m: hashbrown::HashMap<u64, u64> = hashbrown::HashMap::new();
    let mut emitted = 0u64;
    for i in 0..n {
        let k = splitmix64(3, i) % keys;
        let c = m.entry(k).or_insert(0);
        *c += 1;
        std::hint::black_box(*c);
        emitted += 1;
    }
    emitted
}

struct CountSink(Arc<std::sync::atomic::AtomicU64>);
struct CountWriter(Arc<std::sync::atomic::AtomicU64>, u64);

impl<T: 'static> SinkWriter<T> for CountWriter {
    #[inline]
    fn write(&mut self, _rec: T, _ts: i64) -> std::io::Result<()> {
        self.1 += 1;
        Ok(())
    }
    fn finish(&mut self) -> std::io::Result<()> {
        self.0
            .fetch_add(self.1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
}

impl<T: 'static> Sink<T> for CountSink {
    fn create_writer(&self, _: usize, _: usize) -> Result<Box<dyn SinkWriter<T>>, StartError> {
        Ok(Box::new(CountWriter(self.0.clone(), 0)))
    }
}

/// Records each record's age (its second field: creation time in ns since `epoch`) into a
/// per-shard histogram, merged into `out` at the end; counts the records into `count`.
pub(crate) struct LatencySink {
    pub epoch: Instant,
    pub out: Arc<Mutex<Histogram<u64>>>,
    pub count: Arc<std::sync::atomic::AtomicU64>,
    /// Records written so far, advanced every [`LIVE_STEP`] records per writer (the rest at
    /// finish), for an observer that watches the job's progress while it runs.
    pub live: Option<Arc<std::sync::atomic::AtomicU64>>,
}

/// How many records a [`LatencySink`] writer counts before it adds them to `live`.
pub(crate) const LIVE_STEP: u64 = 1024;

struct LatencyWriter {
    epoch: Instant,
    /// Records written (a record whose time field is 0 carries no stamp and is only counted).
    records: u64,
    h: Histogram<u64>,
    out: Arc<Mutex<Histogram<u64>>>,
    count: Arc<std::sync::atomic::AtomicU64>,
    live: Option<Arc<std::sync::atomic::AtomicU64>>,
    unreported: u64,
}

impl SinkWriter<(u64, u64)> for LatencyWriter {
    fn write(&mut self, rec: (u64, u64), _ts: i64) -> std::io::Result<()> {
        self.records += 1;
        if rec.1 != 0 {
            let now = self.epoch.elapsed().as_nanos() as u64;
            let _ = self.h.record(now.saturating_sub(rec.1).max(1));
        }
        if let Some(live) = &self.live {
            self.unreported += 1;
            if self.unreported == LIVE_STEP {
                live.fetch_add(LIVE_STEP, std::sync::atomic::Ordering::Relaxed);
                self.unreported = 0;
            }
        }
        Ok(())
    }
    fn finish(&mut self) -> std::io::Result<()> {
        if let Some(live) = &self.live {
            live.fetch_add(self.unreported, std::sync::atomic::Ordering::Relaxed);
            self.unreported = 0;
        }
        self.count
            .fetch_add(self.records, std::sync::atomic::Ordering::Relaxed);
        let _ = self
            .out
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .add(&self.h);
        Ok(())
    }
}

impl Sink<(u64, u64)> for LatencySink {
    fn create_writer(
        &self,
        _: usize,
        _: usize,
    ) -> Result<Box<dyn SinkWriter<(u64, u64)>>, StartError> {
        Ok(Box::new(LatencyWriter {
            epoch: self.epoch,
            records: 0,
            h: new_hist(),
            out: self.out.clone(),
            count: self.count.clone(),
            live: self.live.clone(),
            unreported: 0,
        }))
    }
}

/// Milliseconds the hypervisor took the CPUs away (steal time, summed over CPUs, from
/// /proc/stat; 0 where unavailable). A vCPU taken away for a few milliseconds is a latency
/// spike no engine can avoid, so the latency row reports it beside its percentiles.
fn steal_ms() -> u64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    // "cpu  user nice system idle iowait irq softirq steal ...", in USER_HZ (100) ticks.
    stat.lines()
        .next()
        .and_then(|l| l.split_whitespace().nth(8))
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(0, |ticks| ticks * 10)
}

/// The machine's floor for the latency row: one producer thread makes `n` timestamps on the
/// schedule of one shard's generator (`rate` per second), a consumer thread takes them from
/// a raw SPSC ring (rtrb) and records how late each arrived, both spinning. No engine can
/// beat what this pair sees on the same machine at the same time.
fn raw_latency_baseline(n: u64, rate: u64) -> Histogram<u64> {
    let (mut tx, mut rx) = rtrb::RingBuffer::<u64>::new(1 << 16);
    let origin = Instant::now() + Duration::from_millis(10);
    let producer = std::thread::spawn(move || {
        for k in 0..n {
            let due = k * 1_000_000_000 / rate;
            let due_at = origin + Duration::from_nanos(due);
            while Instant::now() < due_at {
                std::hint::spin_loop();
            }
            while tx.push(due).is_err() {
                std::hint::spin_loop();
            }
        }
    });
    let mut h = new_hist();
    let mut got = 0;
    while got < n {
        match rx.pop() {
            Ok(due) => {
                let now = origin.elapsed().as_nanos() as u64;
                let _ = h.record(now.saturating_sub(due).max(1));
                got += 1;
            }
            Err(_) => std::hint::spin_loop(),
        }
    }
    let _ = producer.join();
    h
}

pub(crate) fn new_hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("constant bounds are valid")
}

/// `n` idle waits of `d` in a fresh one-task glommio executor, by `nap` or by glommio's timer;
/// wall and CPU time of the executor's thread over them.
fn idle_waits(d: Duration, n: u64, by_nap: bool) -> Measured {
    glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
        .spawn(move || async move {
            weir_runtime::platform::set_fine_timer_slack();
            let (w0, c0) = (Instant::now(), thread_cpu_ns());
            for _ in 0..n {
                if by_nap {
                    weir_runtime::platform::nap(d).await;
                } else {
                    glommio::timer::sleep(d).await;
                }
            }
            Measured {
                records: n,
                wall_ns: w0.elapsed().as_nanos() as u64,
                cpu_ns: thread_cpu_ns() - c0,
            }
        })
        .expect("an executor")
        .join()
        .expect("the executor's thread")
}

/// CPU seconds per wall second of a 2-shard job (default idle waits) whose ingress source
/// stays empty for `idle`, measured once every shard is running.
fn idle_job_core_share(idle: Duration) -> f64 {
    let (tx, src) = weir_runtime::source::ingress::<u64>(4);
    let job = Job::new(
        JobConfig::new()
            .with_shards(2)
            .with_pinning(weir_runtime::Pinning::Never),
    );
    let out = job.source(src).map(|x| x + 1).collect();
    let handle = job.start().expect("the idle job starts");
    while handle.status() == JobStatus::Initializing {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(handle.status(), JobStatus::Running, "idle job");
    // Past the shards' first rounds (spins, then naps growing to their longest).
    std::thread::sleep(Duration::from_millis(100));
    let (w0, c0) = (Instant::now(), process_cpu_ns());
    std::thread::sleep(idle);
    let share = (process_cpu_ns() - c0) as f64 / w0.elapsed().as_nanos().max(1) as f64;
    tx.push_batch(vec![1]).expect("the job takes a record");
    tx.close();
    handle.wait().expect("the idle job");
    assert_eq!(out.take(), vec![2], "the idle job's one record");
    share
}

/// The `idle_nap_200us` row (see the module docs): the 200-us waits make the row; each kind's
/// wall and CPU time per wait, from its run with the median CPU, at 200 and 10 us in `extra`.
fn idle_row(reps: usize, quick: bool) -> BenchResult {
    let total = Duration::from_millis(if quick { 100 } else { 1000 });
    // Nap and timer alternate, so that both see the same neighbours.
    let runs = |us: u64| -> (Vec<Measured>, Vec<Measured>) {
        let d = Duration::from_micros(us);
        let n = (total.as_nanos() / d.as_nanos()) as u64;
        (0..reps)
            .map(|_| (idle_waits(d, n, true), idle_waits(d, n, false)))
            .unzip()
    };
    let mut extra = Vec::new();
    let mut long = None;
    for us in [200, 10] {
        let (naps, timers) = runs(us);
        for (kind, v) in [("nap", &naps), ("timer", &timers)] {
            let (m, _) = median(v.clone());
            let per_wait = |ns: u64| ns as f64 / m.records.max(1) as f64;
            extra.push((
                format!("{kind}_{us}us_wall_ns_per_wait"),
                per_wait(m.wall_ns),
            ));
            extra.push((format!("{kind}_{us}us_cpu_ns_per_wait"), per_wait(m.cpu_ns)));
        }
        long.get_or_insert((naps, timers));
    }
    let mut shares: Vec<f64> = (0..reps).map(|_| idle_job_core_share(total)).collect();
    shares.sort_by(f64::total_cmp);
    extra.push((
        "idle_job_2shards_core_share".into(),
        shares[shares.len() / 2],
    ));
    let (naps, timers) = long.expect("the 200-us runs");
    let mut r = row("idle_nap_200us", naps, "glommio_timer_sleep_200us", timers);
    extra.append(&mut r.extra);
    r.extra = extra;
    r
}

pub fn run(opts: &Opts) -> Vec<BenchResult> {
    let reps = if opts.quick { 1 } else { 3 };
    let mut rows = if opts.wants("ring") {
        crate::ring::run(opts)
    } else {
        Vec::new()
    };
    if opts.wants("idle_nap") {
        rows.push(idle_row(reps, opts.quick));
    }

    if opts.wants("chain") {
        let n = if opts.quick { 2_000_000 } else { 50_000_000 };
        chain_job(n / 10); // warm up page faults and code
        let ours: Vec<Measured> = (0..reps).map(|_| measure(|| chain_job(n))).collect();
        let base: Vec<Measured> = (0..reps).map(|_| measure(|| chain_baseline(n))).collect();
        rows.push(row(
            "chain_gen_map_filter_sink_1shard",
            ours,
            "plain_loop_gen_map_filter_count",
            base,
        ));
    }
    // The latency figure needs the keyed job's peak rate, so either name runs the keyed job;
    // `--only keyed_count` runs it alone (for profiling it without the latency runs).
    const KEYED: &str = "keyed_count_2shards_1Mkeys";
    const LATENCY: &str = "latency_keyed_2shards_half_peak";
    if !opts.wants(KEYED) && !opts.wants(LATENCY) {
        return rows;
    }

    let n = if opts.quick { 1_000_000 } else { 20_000_000 };
    let keys = 1_000_000;
    let rss_before = peak_rss_bytes();
    let ours: Vec<Measured> = (0..reps)
        .map(|_| measure(|| keyed_job(n, keys, 2)))
        .collect();
    let rss = peak_rss_bytes();
    let base: Vec<Measured> = (0..reps)
        .map(|_| measure(|| keyed_baseline(n, keys)))
        .collect();
    let mut r = row(KEYED, ours, "hashbrown_count_1thread", base);
    // A (u64, u64) record in a ring: 16-byte frame header + 16-byte archived payload.
    r.extra
        .push(("ring_bytes_per_inflight_record".into(), 32.0));
    r.extra.push(("peak_rss_bytes".into(), rss as f64));
    r.extra
        .push(("peak_rss_bytes_before".into(), rss_before as f64));
    let peak = r.per_wall_sec;
    rows.push(r);
    if !opts.wants(LATENCY) {
        return rows;
    }

    // Latency at half the peak rate just measured, split over two shards' generators.
    let rate = (peak / 2.0 / 2.0).max(1000.0) as u64;
    let n = if opts.quick {
        (rate * 2).min(2_000_000)
    } else {
        rate * 6
    };
    // Several runs, each its own histogram; the row is the run with the median p99 (a run's
    // p99 is mostly whether the VM took the CPU away during it), every run in `extra`.
    let mut runs = Vec::new();
    for _ in 0..reps {
        let h = Arc::new(Mutex::new(new_hist()));
        let steal0 = steal_ms();
        let (m, started) = latency_job(n, keys, 2, rate, h.clone());
        let steal = steal_ms() - steal0;
        let h = h.lock().unwrap_or_else(|p| p.into_inner()).clone();
        // The same number of records per shard, on one shard's schedule, through a raw ring.
        let steal1 = steal_ms();
        let raw = raw_latency_baseline(n / 2, rate);
        let raw_steal = steal_ms() - steal1;
        runs.push((m, steal, h, raw, raw_steal, started));
    }
    let mut order: Vec<usize> = (0..runs.len()).collect();
    order.sort_by_key(|&i| runs[i].2.value_at_quantile(0.99));
    let (m, steal, h, _, _, started) = &runs[order[order.len() / 2]];
    // The raw baseline's figures are its own median run (by its p99).
    let mut raw_order: Vec<usize> = (0..runs.len()).collect();
    raw_order.sort_by_key(|&i| runs[i].3.value_at_quantile(0.99));
    let (_, _, _, raw, raw_steal, _) = &runs[raw_order[raw_order.len() / 2]];
    let mut extra = vec![
        ("samples".into(), h.len() as f64),
        ("batch_records".into(), LATENCY_BATCH_RECORDS as f64),
        ("prefault_state_memory".into(), 1.0),
        ("schedule_start_ms".into(), started.as_secs_f64() * 1e3),
        ("steal_ms".into(), *steal as f64),
        ("raw_spsc_p50_ns".into(), raw.value_at_quantile(0.5) as f64),
        ("raw_spsc_p99_ns".into(), raw.value_at_quantile(0.99) as f64),
        (
            "raw_spsc_p999_ns".into(),
            raw.value_at_quantile(0.999) as f64,
        ),
        ("raw_spsc_max_ns".into(), raw.max() as f64),
        ("raw_spsc_steal_ms".into(), *raw_steal as f64),
        ("runs".into(), runs.len() as f64),
    ];
    for (i, (_, steal, h, raw, _, started)) in runs.iter().enumerate() {
        extra.push((format!("run{i}_startup_ms"), started.as_secs_f64() * 1e3));
        extra.push((format!("run{i}_p99_ns"), h.value_at_quantile(0.99) as f64));
        extra.push((format!("run{i}_max_ns"), h.max() as f64));
        extra.push((format!("run{i}_steal_ms"), *steal as f64));
        extra.push((
            format!("run{i}_raw_spsc_p99_ns"),
            raw.value_at_quantile(0.99) as f64,
        ));
    }
    rows.push(BenchResult {
        bench: LATENCY.into(),
        per_wall_sec: m.per_wall(),
        per_cpu_sec: m.per_cpu(),
        baseline: "offered_rate".into(),
        baseline_per_cpu_sec: (rate * 2) as f64,
        ratio: m.per_wall() / (rate * 2) as f64,
        p50_ns: Some(h.value_at_quantile(0.5)),
        p99_ns: Some(h.value_at_quantile(0.99)),
        p999_ns: Some(h.value_at_quantile(0.999)),
        max_ns: Some(h.max()),
        extra,
    });
    rows
}
