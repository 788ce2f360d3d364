//! Checkpoint benchmarks: what checkpointing costs a running job, how long checkpoints take,
//! how they behave under backpressure, and how long a job takes to recover.
//!
//! * `checkpoint_overhead_keyed_100ms`: the keyed count job (generator -> key_by -> keyed count
//!   -> sink, two shards, 1 M keys) with a checkpoint every 100 ms beside the same job without
//!   checkpointing, interleaved in the same run. `ratio` = with / without per CPU second of
//!   the processing window: from the start until the last records reach the sink (process CPU,
//!   background work included). The bounded job then waits for its final checkpoint;
//!   `ratio_per_cpu_to_end` counts until the job finished, and `run<i>_with_final_wait_ms` is
//!   that wait. `ratio_per_cpu_second_half` is the ratio over the second half of the
//!   records, on memory the first half faulted in. `run<i>_cpu_ms_per_checkpoint` is the CPU
//!   a run took beyond the same records without checkpoints, per checkpoint completed;
//!   `run<i>_cpu_ms_per_checkpoint_<kind>` splits it by thread (`shards`, `maintenance`: the
//!   snapshot jobs, `io_workers`: the kernel's io_uring workers, `other`), each thread's own
//!   CPU clock read when the window ends, and `cpu_ms_per_checkpoint_<kind>` is the median.
//!   The throughput runs stamp one record in 64 with its creation time (the keyed benchmark
//!   reads no clock per record; stamping each cost the shards a fifth of their time), which
//!   gives the `run<i>_saturated_p99_ns_*` figures. Per-record latency (every record carries
//!   its creation time) is measured at half the peak rate
//!   just measured, with and without checkpoints, configured as the runtime suite's latency
//!   row; the row's p50..max are the run with them. `latency_run_alignment_max_ms`,
//!   `latency_run_sync_max_ms` and `latency_run_state_stall_ms` say where a checkpoint of
//!   that run can have held records up.
//! * `checkpoint_duration_<S>MiB_1pct`: a keyed state of S MiB (1 KiB values), 1% of its keys
//!   updated per checkpoint interval. p50/p99/p999 are checkpoint durations (trigger to durable
//!   metadata); per_wall/per_cpu are updates processed per second. For this row `baseline` is
//!   the state's size: `baseline_per_cpu_sec` holds `full_size_bytes` and `ratio` is bytes
//!   written per checkpoint / state bytes (incremental checkpoints: about 0.01 plus overhead).
//! * `checkpoint_unaligned_backpressure_10pct`: a sink throttled to 10% of the job's unthrottled
//!   rate. p50/p99/p999 are unaligned checkpoint durations under that backpressure; `ratio` =
//!   their p50 / the p50 of unaligned checkpoints of the same job at the same rate without
//!   backpressure (source throttled instead of the sink). Aligned durations are in `extra`.
//! * `checkpoint_recovery_<S>MiB`: in the same job as the duration bench, made unthrottled, a
//!   map panics on demand. p50/p99/p999/max are the time from the injected failure to
//!   throughput back at at least 90% of before; `extra` splits it into restore (failure to the
//!   first record processed after the restart) and replay (from there to at least 90%).
//!   per_wall/per_cpu: the first window at at least 90%; baseline: before the failure.
//!
//! Durations come from `CheckpointStats::duration_ns` (trigger to completion); `ack_*` extras
//! give trigger-to-last-shard-acknowledgement, both in nanoseconds. The state size of the full run is
//! 1 GiB unless `WEIR_BENCH_CKPT_STATE_MIB` says otherwise; the overhead runs process 24 M
//! records each unless `WEIR_BENCH_OVERHEAD_RECORDS` says otherwise.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use weir_runtime::checkpoint::{CheckpointConfig, CheckpointMetrics, RestartStrategy};
use weir_runtime::sink::{Sink, SinkWriter};
use weir_runtime::source::{
    splitmix64, GeneratorSource, ScheduleStart, Source, SourceError, SourcePoll, SourceReader,
};
use weir_runtime::{FnProcess, Job, JobConfig, JobHandle, JobStatus, KeyedContext, StartError};

use crate::runtime::{keyed_count, new_hist, LatencySink, LATENCY_BATCH_RECORDS, LIVE_STEP};
use crate::{process_cpu_ns, BenchResult, Opts};

const SHARDS: usize = 2;
/// Bytes of each keyed value in the large-state benchmarks.
const VALUE_LEN: usize = 1024;

fn config() -> JobConfig {
    JobConfig::new()
        .with_shards(SHARDS)
        .with_batch_records(4096)
        .with_latency_marker_interval_ms(0)
}

fn ck(dir: &Path, interval: Duration) -> CheckpointConfig {
    CheckpointConfig::new(dir, "bench")
        .with_interval(interval)
        // A slow checkpoint is a figure here, not a reason to fail the job.
        .with_tolerable_failures(1000)
        .with_restart(RestartStrategy::None)
}

/// The `q` quantile (nearest rank) of `v`; 0 when empty.
fn quantile(v: &[u64], q: f64) -> u64 {
    if v.is_empty() {
        return 0;
    }
    let mut s = v.to_vec();
    s.sort_unstable();
    let rank = ((q * s.len() as f64).ceil() as usize).clamp(1, s.len());
    s[rank - 1]
}

/// Median of `f` over the completed checkpoints in `m`'s history (NaN when none).
fn ckpt_median(
    m: &CheckpointMetrics,
    f: impl Fn(&weir_runtime::checkpoint::CheckpointStats) -> f64,
) -> f64 {
    let v: Vec<f64> = m
        .history
        .iter()
        .filter(|c| c.failure.is_none())
        .map(f)
        .collect();
    median_f(&v)
}

/// Largest `f` over the completed checkpoints in `m`'s history (0 when none).
fn ckpt_max(
    m: &CheckpointMetrics,
    f: impl Fn(&weir_runtime::checkpoint::CheckpointStats) -> f64,
) -> f64 {
    m.history
        .iter()
        .filter(|c| c.failure.is_none())
        .map(f)
        .fold(0.0, f64::max)
}

fn median_f(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}

/// Wall and CPU clocks at one instant, to turn counter deltas into rates.
#[derive(Clone, Copy)]
struct Clock {
    wall: Instant,
    cpu_ns: u64,
    count: u64,
}

impl Clock {
    fn now(count: &AtomicU64) -> Self {
        Self {
            wall: Instant::now(),
            cpu_ns: process_cpu_ns(),
            count: count.load(Ordering::Relaxed),
        }
    }
    /// (records per wall second, records per CPU second) since `self`.
    fn rates_to(&self, later: &Clock) -> (f64, f64) {
        let n = later.count.saturating_sub(self.count) as f64;
        let wall = later.wall.duration_since(self.wall).as_nanos().max(1) as f64;
        let cpu = later.cpu_ns.saturating_sub(self.cpu_ns).max(1) as f64;
        (n * 1e9 / wall, n * 1e9 / cpu)
    }
}

/// Polls `cond` every `every` until it holds or `limit` passed; returns whether it held.
fn wait_for(limit: Duration, every: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(every);
    }
}

/// Completed checkpoints with ids in `from..=to` from the metrics' history.
fn completed_between(
    m: &CheckpointMetrics,
    from: u64,
    to: u64,
) -> Vec<weir_runtime::checkpoint::CheckpointStats> {
    m.history
        .iter()
        .filter(|s| s.failure.is_none() && (from..=to).contains(&s.checkpoint_id))
        .cloned()
        .collect()
}

fn last_completed(h: &JobHandle) -> u64 {
    h.checkpoint_metrics()
        .last_completed_checkpoint_id
        .unwrap_or(0)
}

// ---------------------------------------------------------------------------------------------
// Sinks

/// Counts every record into a shared counter at once, so that a watcher sees progress live
/// (and across restarts); optionally throttled to a rate per writer.
struct LiveCountSink {
    count: Arc<AtomicU64>,
    rate_per_writer: Option<u64>,
}

struct LiveCountWriter {
    count: Arc<AtomicU64>,
    rate: Option<u64>,
    started: Option<Instant>,
    written: u64,
}

impl<T: 'static> SinkWriter<T> for LiveCountWriter {
    #[inline]
    fn write(&mut self, _rec: T, _ts: i64) -> std::io::Result<()> {
        self.count.fetch_add(1, Ordering::Relaxed);
        if let Some(rate) = self.rate {
            self.written += 1;
            let started = *self.started.get_or_insert_with(Instant::now);
            let due = Duration::from_nanos(self.written.saturating_mul(1_000_000_000) / rate);
            let ahead = due.saturating_sub(started.elapsed());
            // Sleep in slices of at least 200 us: a sleep per record would cost more than the
            // throttle is meant to take. Blocking the shard is the point: it backs up the rings.
            if ahead > Duration::from_micros(200) {
                std::thread::sleep(ahead);
            }
        }
        Ok(())
    }
    fn finish(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<T: 'static> Sink<T> for LiveCountSink {
    fn create_writer(&self, _: usize, _: usize) -> Result<Box<dyn SinkWriter<T>>, StartError> {
        Ok(Box::new(LiveCountWriter {
            count: self.count.clone(),
            rate: self.rate_per_writer,
            started: None,
            written: 0,
        }))
    }
}

/// Process CPU by thread kind, from each thread's own CPU clock: shards (`weir-shard-*`),
/// maintenance (`weir-maint-*`: snapshot jobs, flushes, compactions), the kernel's io_uring
/// workers (`iou-wrk-*`, which copy buffered writes into the page cache) and the rest.
/// Where a checkpoint's cost goes, which the process total alone does not say.
#[derive(Clone, Copy, Debug, Default)]
struct CpuSplit {
    shards: u64,
    maintenance: u64,
    io_workers: u64,
    other: u64,
}

/// The CPU nanoseconds each live thread of this process has used, with its kind.
fn thread_cpu() -> Vec<(i32, ThreadKind, u64)> {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in dir.flatten() {
        let Some(tid) = e.file_name().to_str().and_then(|t| t.parse::<i32>().ok()) else {
            continue;
        };
        let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
        let kind = if comm.starts_with("weir-shard") {
            ThreadKind::Shard
        } else if comm.starts_with("weir-maint") {
            ThreadKind::Maintenance
        } else if comm.starts_with("iou-wrk") {
            ThreadKind::IoWorker
        } else {
            ThreadKind::Other
        };
        // Linux's CPU clock of thread `tid` (MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED) in the
        // kernel's posix-timers.h, what glibc's pthread_getcpuclockid returns): any thread of
        // the calling process may be read. A thread that exited meanwhile fails: skipped.
        let clock = (!(tid as libc::clockid_t) << 3) | 6;
        if let Some(ns) = crate::report::try_cpu_clock_ns(clock) {
            out.push((tid, kind, ns));
        }
    }
    out
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ThreadKind {
    Shard,
    Maintenance,
    IoWorker,
    Other,
}

impl CpuSplit {
    /// The CPU each kind used between two [`thread_cpu`] readings; what no thread alive at
    /// `after` accounts for of `process_ns` (threads that exited meanwhile) counts as other.
    fn between(
        before: &[(i32, ThreadKind, u64)],
        after: &[(i32, ThreadKind, u64)],
        process_ns: u64,
    ) -> CpuSplit {
        let mut s = CpuSplit::default();
        for &(tid, kind, ns) in after {
            let base = before.iter().find(|b| b.0 == tid).map_or(0, |b| b.2);
            let d = ns.saturating_sub(base);
            match kind {
                ThreadKind::Shard => s.shards += d,
                ThreadKind::Maintenance => s.maintenance += d,
                ThreadKind::IoWorker => s.io_workers += d,
                ThreadKind::Other => s.other += d,
            }
        }
        s.other += process_ns.saturating_sub(s.shards + s.maintenance + s.io_workers + s.other);
        s
    }

    /// Names of the kinds, in the order of [`Self::by_kind`].
    const KINDS: [&'static str; 4] = ["shards", "maintenance", "io_workers", "other"];

    fn by_kind(&self) -> [u64; 4] {
        [self.shards, self.maintenance, self.io_workers, self.other]
    }

    fn total(&self) -> u64 {
        self.by_kind().iter().sum()
    }
}

/// Records each record's age (its second field is its creation time since `epoch`).
struct KeyedRun {
    records: u64,
    /// From the start until the job finished, its final checkpoint included.
    wall_ns: u64,
    cpu_ns: u64,
    /// From the start until (all but a few hundred of) the records reached the sink: the
    /// processing itself, with the periodic checkpoints taken meanwhile, without the final one.
    window_records: u64,
    window_wall_ns: u64,
    window_cpu_ns: u64,
    /// `window_cpu_ns` by thread kind (zero if the watcher missed the window's end).
    window_split: CpuSplit,
    /// (records, CPU) when half the records had reached the sink: the second half of the
    /// window runs on memory the first half faulted in (`per_cpu_second_half`).
    half: Option<(u64, u64)>,
    hist: Histogram<u64>,
    completed: u64,
    /// Time shards stopped for their stores' flushes (`weir_runtime::STATE_STALL`).
    stall_ns: u64,
    /// Medians over the completed checkpoints: duration (trigger to durable metadata), the
    /// longest shard's background part, and the start delay, in ms; bytes written.
    ckpt_duration_ms: f64,
    ckpt_async_ms: f64,
    ckpt_start_delay_ms: f64,
    ckpt_size_bytes: f64,
    /// Largest over the completed checkpoints: barrier alignment and synchronous part, in ms.
    ckpt_alignment_max_ms: f64,
    ckpt_sync_max_ms: f64,
}

impl KeyedRun {
    /// Throughput while processing (see `window_*`).
    fn per_wall(&self) -> f64 {
        self.window_records as f64 * 1e9 / self.window_wall_ns.max(1) as f64
    }
    fn per_cpu(&self) -> f64 {
        self.window_records as f64 * 1e9 / self.window_cpu_ns.max(1) as f64
    }
    /// [`Self::per_cpu`] over the window's second half (NaN if the watcher missed it).
    fn per_cpu_second_half(&self) -> f64 {
        match self.half {
            Some((r, c)) if self.window_cpu_ns > c => {
                (self.window_records - r) as f64 * 1e9 / (self.window_cpu_ns - c) as f64
            }
            _ => f64::NAN,
        }
    }

    /// The CPU of each thread kind beyond what `without` (the same job without checkpoints)
    /// took for as many records, per checkpoint completed, in ms. NaN if a window's split
    /// is missing.
    fn extra_cpu_ms_per_checkpoint(&self, without: &KeyedRun) -> [(&'static str, f64); 4] {
        let (w, o) = (self.window_split.by_kind(), without.window_split.by_kind());
        let scale = self.window_records as f64 / without.window_records.max(1) as f64;
        let n = self.completed.max(1) as f64;
        let missing = self.window_split.total() == 0 || without.window_split.total() == 0;
        std::array::from_fn(|k| {
            let ms = if missing {
                f64::NAN
            } else {
                (w[k] as f64 - o[k] as f64 * scale) / 1e6 / n
            };
            (CpuSplit::KINDS[k], ms)
        })
    }

    /// Throughput until the job finished, its final checkpoint included.
    fn per_wall_to_end(&self) -> f64 {
        self.records as f64 * 1e9 / self.wall_ns.max(1) as f64
    }
    fn per_cpu_to_end(&self) -> f64 {
        self.records as f64 * 1e9 / self.cpu_ns.max(1) as f64
    }
}

/// One record in this many carries its creation time in a throughput run (see [`keyed_run`]).
const STAMP_EVERY: u64 = 64;

/// The keyed count job of the runtime suite, optionally checkpointing every `interval`.
fn keyed_run(
    n: u64,
    keys: u64,
    rate_per_shard: Option<u64>,
    interval: Option<Duration>,
) -> KeyedRun {
    let dir = tempfile::tempdir().expect("checkpoint temp dir");
    let epoch = Instant::now();
    // Latency runs stamp every record with the time it was due on the rate's schedule, as
    // the runtime suite's latency row does: a record a stall held back (a checkpoint's
    // synchronous part, an alignment) keeps the stall in its latency. Stamped when made, the
    // generator's catch-up after a stall hid it (coordinated omission). The schedule starts
    // once the job runs (see below). Throughput runs stamp one record in STAMP_EVERY with its
    // creation time (0: no stamp), so that they cost what the keyed benchmark does: a clock
    // read per record was a fifth of the shards' time.
    let schedule = ScheduleStart::new();
    let origin_ns = Arc::new(AtomicU64::new(0));
    let origin = origin_ns.clone();
    let mut gen = GeneratorSource::new(Some(n), 3, move |i: u64, r: u64| {
        // Shard s generates indices s, s + SHARDS, ...: the shard's own `i / SHARDS`th.
        let own = i / SHARDS as u64;
        let stamp = match rate_per_shard {
            Some(rate) => origin.load(Ordering::Relaxed) + own * 1_000_000_000 / rate,
            None if own.is_multiple_of(STAMP_EVERY) => (epoch.elapsed().as_nanos() as u64).max(1),
            None => 0,
        };
        (r % keys, stamp)
    });
    if let Some(rate) = rate_per_shard {
        gen = gen
            .with_rate_per_shard(rate)
            .with_schedule(schedule.clone());
    }
    let mut cfg = config();
    if rate_per_shard.is_some() {
        // Latency runs: shards poll instead of sleeping when idle, as the runtime suite's.
        // And tuned for latency as the runtime suite's latency row is (steps of at most
        // LATENCY_BATCH_RECORDS records, memtable memory faulted in before the first record),
        // so that the run without checkpoints measures what that row does: its p99 went from
        // 1.4-3.5 ms to 24-44 us; with checkpoints it stayed 6-33 ms either way (both stamped
        // when made, before the due-time stamps above).
        cfg = cfg
            .with_idle_sleep_max_us(0)
            .with_batch_records(LATENCY_BATCH_RECORDS)
            .with_prefault_state_memory(true);
    }
    if let Some(i) = interval {
        cfg = cfg.with_checkpointing(ck(dir.path(), i));
    }
    let hist = Arc::new(Mutex::new(new_hist()));
    let live = Arc::new(AtomicU64::new(0));
    let count = Arc::new(AtomicU64::new(0));
    let job = Job::new(cfg);
    keyed_count(job.source(gen)).sink(LatencySink {
        epoch,
        out: hist.clone(),
        count: count.clone(),
        live: Some(live.clone()),
    });
    let threads0 = thread_cpu();
    let (w0, c0) = (Instant::now(), process_cpu_ns());
    // Watches the sink's progress: the moment (wall and process CPU) the last records arrived,
    // before the job's final checkpoint commits them.
    let done = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (live, done) = (live.clone(), done.clone());
        // Every writer may hold back fewer than LIVE_STEP records until it finishes.
        let all_but = n.saturating_sub(SHARDS as u64 * LIVE_STEP);
        std::thread::spawn(move || {
            let mut half = None;
            while !done.load(Ordering::Relaxed) {
                let seen = live.load(Ordering::Relaxed);
                if seen >= all_but {
                    let at = (seen, w0.elapsed().as_nanos() as u64, process_cpu_ns() - c0);
                    let split = CpuSplit::between(&threads0, &thread_cpu(), at.2);
                    return (Some((at, split)), half);
                }
                if half.is_none() && seen >= n / 2 {
                    half = Some((seen, process_cpu_ns() - c0));
                }
                std::thread::sleep(Duration::from_micros(500));
            }
            (None, half)
        })
    };
    let handle = job.start().expect("keyed job");
    if rate_per_shard.is_some() {
        while handle.status() == JobStatus::Initializing {
            std::thread::sleep(Duration::from_micros(200));
        }
        let start = Instant::now();
        // Read by the generators only after the schedule starts (its start publishes this).
        origin_ns.store((start - epoch).as_nanos() as u64, Ordering::Relaxed);
        schedule.start_at(start);
    }
    let summary = handle.wait().expect("keyed job");
    let (wall_ns, cpu_ns) = (w0.elapsed().as_nanos() as u64, process_cpu_ns() - c0);
    done.store(true, Ordering::Relaxed);
    let (processed, half) = watcher.join().expect("watcher");
    let hist = hist.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let records = count.load(Ordering::Relaxed);
    let ((window_records, window_wall_ns, window_cpu_ns), window_split) =
        processed.unwrap_or(((records, wall_ns, cpu_ns), CpuSplit::default()));
    KeyedRun {
        records,
        wall_ns,
        cpu_ns,
        window_records,
        window_wall_ns,
        window_cpu_ns,
        window_split,
        half,
        hist,
        completed: summary.checkpoints.number_of_completed_checkpoints,
        ckpt_duration_ms: ckpt_median(&summary.checkpoints, |c| c.duration_ms as f64),
        ckpt_async_ms: ckpt_median(&summary.checkpoints, |c| c.async_duration_ns as f64 / 1e6),
        ckpt_start_delay_ms: ckpt_median(&summary.checkpoints, |c| c.start_delay_ns as f64 / 1e6),
        ckpt_size_bytes: ckpt_median(&summary.checkpoints, |c| c.size_bytes as f64),
        ckpt_alignment_max_ms: ckpt_max(&summary.checkpoints, |c| {
            c.alignment_duration_ns as f64 / 1e6
        }),
        ckpt_sync_max_ms: ckpt_max(&summary.checkpoints, |c| c.sync_duration_ns as f64 / 1e6),
        stall_ns: summary
            .metrics
            .heads
            .iter()
            .filter(|h| h.head == weir_runtime::STATE_STALL)
            .map(|h| h.backpressured_ns)
            .sum(),
    }
}

fn overhead(opts: &Opts) -> BenchResult {
    let reps = if opts.quick { 1 } else { 3 };
    // Long enough for several memtable generations: 6 M records (0.7 s) measured mostly the
    // first freeze's fresh memory, and its runs spread over 0.59-0.89.
    let n = if opts.quick {
        2_000_000
    } else {
        std::env::var("WEIR_BENCH_OVERHEAD_RECORDS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(24_000_000)
    };
    let keys = 1_000_000;
    let interval = Duration::from_millis(100);
    keyed_run(n / 10, keys, None, None); // warm up page faults and code
    let (mut with, mut without) = (Vec::new(), Vec::new());
    // Interleaved, so that both see the same neighbours.
    for _ in 0..reps {
        without.push(keyed_run(n, keys, None, None));
        with.push(keyed_run(n, keys, None, Some(interval)));
    }
    let med =
        |v: &[KeyedRun], f: fn(&KeyedRun) -> f64| median_f(&v.iter().map(f).collect::<Vec<_>>());
    let (with_cpu, without_cpu) = (
        med(&with, KeyedRun::per_cpu),
        med(&without, KeyedRun::per_cpu),
    );
    // Each pair's extra CPU per checkpoint by thread kind (see `cpu_ms_per_checkpoint`).
    let splits: Vec<_> = with
        .iter()
        .zip(&without)
        .map(|(w, o)| w.extra_cpu_ms_per_checkpoint(o))
        .collect();
    let mut extra = Vec::new();
    for (i, (w, o)) in with.iter().zip(&without).enumerate() {
        extra.push((format!("run{i}_with_per_cpu_sec"), w.per_cpu()));
        extra.push((format!("run{i}_with_per_wall_sec"), w.per_wall()));
        extra.push((format!("run{i}_without_per_cpu_sec"), o.per_cpu()));
        extra.push((format!("run{i}_without_per_wall_sec"), o.per_wall()));
        extra.push((format!("run{i}_ratio_per_cpu"), w.per_cpu() / o.per_cpu()));
        extra.push((
            format!("run{i}_ratio_per_cpu_second_half"),
            w.per_cpu_second_half() / o.per_cpu_second_half(),
        ));
        extra.push((
            format!("run{i}_with_per_cpu_sec_to_end"),
            w.per_cpu_to_end(),
        ));
        extra.push((
            format!("run{i}_without_per_cpu_sec_to_end"),
            o.per_cpu_to_end(),
        ));
        extra.push((
            format!("run{i}_with_final_wait_ms"),
            w.wall_ns.saturating_sub(w.window_wall_ns) as f64 / 1e6,
        ));
        extra.push((format!("run{i}_with_checkpoints"), w.completed as f64));
        // What one checkpoint cost: the CPU the run took beyond the same records' CPU
        // without checkpoints, over its checkpoints. Faster checkpoints fit more of them into
        // a run, which the ratio alone counts against them.
        extra.push((
            format!("run{i}_cpu_ms_per_checkpoint"),
            (w.window_cpu_ns as f64 / 1e6 - w.window_records as f64 * 1e3 / o.per_cpu())
                / w.completed.max(1) as f64,
        ));
        // The same by thread kind: whose CPU a checkpoint costs (the shards' copies of the
        // arena chunks a snapshot holds, the snapshot jobs on the maintenance threads, ...).
        for (kind, ms) in splits[i] {
            extra.push((format!("run{i}_cpu_ms_per_checkpoint_{kind}"), ms));
        }
        extra.push((
            format!("run{i}_checkpoint_duration_p50_ms"),
            w.ckpt_duration_ms,
        ));
        extra.push((format!("run{i}_checkpoint_async_p50_ms"), w.ckpt_async_ms));
        extra.push((
            format!("run{i}_checkpoint_start_delay_p50_ms"),
            w.ckpt_start_delay_ms,
        ));
        extra.push((
            format!("run{i}_checkpoint_size_p50_bytes"),
            w.ckpt_size_bytes,
        ));
        extra.push((
            format!("run{i}_with_state_stall_ms"),
            w.stall_ns as f64 / 1e6,
        ));
        // At full speed a record's age is mostly the queue in front of it.
        extra.push((
            format!("run{i}_saturated_p99_ns_with"),
            w.hist.value_at_quantile(0.99) as f64,
        ));
        extra.push((
            format!("run{i}_saturated_p99_ns_without"),
            o.hist.value_at_quantile(0.99) as f64,
        ));
    }
    for (k, kind) in CpuSplit::KINDS.iter().enumerate() {
        let per: Vec<f64> = splits.iter().map(|s| s[k].1).collect();
        extra.push((format!("cpu_ms_per_checkpoint_{kind}"), median_f(&per)));
    }
    // Past the start: each job's memtables first grow into fresh memory (a first touch costs
    // microseconds a page here), and checkpoints add memory (copies of the arena chunks a
    // snapshot job still reads, and a second memtable after a freeze).
    extra.push((
        "ratio_per_cpu_second_half".into(),
        med(&with, KeyedRun::per_cpu_second_half) / med(&without, KeyedRun::per_cpu_second_half),
    ));
    extra.push((
        "ratio_per_wall".into(),
        med(&with, KeyedRun::per_wall) / med(&without, KeyedRun::per_wall),
    ));
    // Until each job finished: the final checkpoint after the last record included.
    extra.push((
        "ratio_per_cpu_to_end".into(),
        med(&with, KeyedRun::per_cpu_to_end) / med(&without, KeyedRun::per_cpu_to_end),
    ));
    extra.push((
        "ratio_per_wall_to_end".into(),
        med(&with, KeyedRun::per_wall_to_end) / med(&without, KeyedRun::per_wall_to_end),
    ));
    // Latency at half the peak rate without checkpoints, split over the shards' generators.
    let peak = med(&without, KeyedRun::per_wall);
    let rate = (peak / 2.0 / SHARDS as f64).max(1000.0) as u64;
    let secs = if opts.quick { 1 } else { 4 };
    let ln = rate * SHARDS as u64 * secs;
    let lat_without = keyed_run(ln, keys, Some(rate), None);
    let lat_with = keyed_run(ln, keys, Some(rate), Some(interval));
    for (name, r) in [("without", &lat_without), ("with", &lat_with)] {
        for (q, qn) in [(0.5, "p50"), (0.99, "p99"), (0.999, "p999")] {
            extra.push((
                format!("latency_{qn}_ns_{name}"),
                r.hist.value_at_quantile(q) as f64,
            ));
        }
        extra.push((format!("latency_max_ns_{name}"), r.hist.max() as f64));
    }
    extra.push(("latency_offered_rate".into(), (rate * SHARDS as u64) as f64));
    extra.push(("latency_run_checkpoints".into(), lat_with.completed as f64));
    // Where a checkpoint can hold records up: barrier alignment, the synchronous part, a
    // shard stopped for its store's flushes.
    extra.push((
        "latency_run_alignment_max_ms".into(),
        lat_with.ckpt_alignment_max_ms,
    ));
    extra.push(("latency_run_sync_max_ms".into(), lat_with.ckpt_sync_max_ms));
    extra.push((
        "latency_run_state_stall_ms".into(),
        lat_with.stall_ns as f64 / 1e6,
    ));
    extra.push((
        "latency_run_checkpoint_duration_p50_ms".into(),
        lat_with.ckpt_duration_ms,
    ));
    BenchResult {
        bench: "checkpoint_overhead_keyed_100ms".into(),
        per_wall_sec: med(&with, KeyedRun::per_wall),
        per_cpu_sec: with_cpu,
        baseline: "keyed_count_no_checkpoints".into(),
        baseline_per_cpu_sec: without_cpu,
        ratio: with_cpu / without_cpu.max(1e-9),
        p50_ns: Some(lat_with.hist.value_at_quantile(0.5)),
        p99_ns: Some(lat_with.hist.value_at_quantile(0.99)),
        p999_ns: Some(lat_with.hist.value_at_quantile(0.999)),
        max_ns: Some(lat_with.hist.max()),
        extra,
    }
}

// ---------------------------------------------------------------------------------------------
// Large state: duration and recovery

/// Fills `keys` keys once, then updates random keys, at `rate` per shard and second (0: as fast
/// as the job takes them). Replayable: record `i` is always the same, the position is `i`.
struct StateSource {
    keys: u64,
    rate: Arc<AtomicU64>,
}

struct StateReader {
    next: u64,
    step: u64,
    keys: u64,
    rate: Arc<AtomicU64>,
    tokens: f64,
    last: Option<Instant>,
}

impl SourceReader<(u64, u64)> for StateReader {
    fn poll(&mut self, out: &mut Vec<(u64, u64)>, max: usize) -> Result<SourcePoll, SourceError> {
        let mut budget = max;
        let rate = self.rate.load(Ordering::Relaxed);
        if self.next >= self.keys && rate > 0 {
            // A token bucket holding at most 10 ms of records: updates arrive evenly.
            let now = Instant::now();
            let dt = self
                .last
                .map_or(0.0, |l| now.duration_since(l).as_secs_f64());
            self.last = Some(now);
            self.tokens = (self.tokens + dt * rate as f64).min((rate as f64 / 100.0).max(1.0));
            budget = budget.min(self.tokens as usize);
            if budget == 0 {
                return Ok(SourcePoll::Idle);
            }
            self.tokens -= budget as f64;
        }
        for _ in 0..budget {
            let i = self.next;
            let key = if i < self.keys {
                i
            } else {
                splitmix64(7, i) % self.keys
            };
            out.push((key, i));
            self.next += self.step;
        }
        Ok(SourcePoll::Ready)
    }

    fn position(&self) -> Vec<u8> {
        self.next.to_le_bytes().to_vec()
    }

    fn seek(&mut self, position: &[u8]) -> Result<(), SourceError> {
        self.next = <[u8; 8]>::try_from(position)
            .map(u64::from_le_bytes)
            .map_err(|_| SourceError::BadPosition(format!("{} bytes", position.len())))?;
        self.last = None;
        self.tokens = 0.0;
        Ok(())
    }
}

impl Source<(u64, u64)> for StateSource {
    fn create_reader(
        &self,
        shard: usize,
        shards: usize,
    ) -> Result<Box<dyn SourceReader<(u64, u64)>>, SourceError> {
        Ok(Box::new(StateReader {
            next: shard as u64,
            step: shards as u64,
            keys: self.keys,
            rate: self.rate.clone(),
            tokens: 0.0,
            last: None,
        }))
    }
    fn name(&self) -> &str {
        "state-gen"
    }
}

fn state_bytes(opts: &Opts) -> u64 {
    let mib = if opts.quick {
        16
    } else {
        std::env::var("WEIR_BENCH_CKPT_STATE_MIB")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(1024)
    };
    mib << 20
}

fn large_state(opts: &Opts) -> Vec<BenchResult> {
    let bytes = state_bytes(opts);
    let mib = bytes >> 20;
    let keys = bytes / VALUE_LEN as u64;
    let interval = Duration::from_millis(if opts.quick { 200 } else { 500 });
    // 1% of the keys per interval, split over the shards' readers.
    let update_rate = ((keys / 100) as f64 / interval.as_secs_f64() / SHARDS as f64).max(1.0);
    let rate = Arc::new(AtomicU64::new(update_rate as u64));
    let count = Arc::new(AtomicU64::new(0));
    let fail = Arc::new(AtomicBool::new(false));
    let dir = tempfile::tempdir().expect("checkpoint temp dir");
    let cfg = config().with_checkpointing(ck(dir.path(), interval).with_restart(
        RestartStrategy::FixedDelay {
            attempts: 1000,
            // No delay: the figure is the engine's restore, not a back-off policy.
            delay: Duration::ZERO,
        },
    ));
    let job = Job::new(cfg);
    let f2 = fail.clone();
    job.source(StateSource {
        keys,
        rate: rate.clone(),
    })
    .uid("state-gen")
    .map(move |r: (u64, u64)| {
        // Load first: a swap per record would bounce the flag's cache line between shards.
        if f2.load(Ordering::Relaxed) && f2.swap(false, Ordering::AcqRel) {
            panic!("injected failure (checkpoint benchmark)");
        }
        r
    })
    .key_by(|r: &(u64, u64)| r.0)
    .process(FnProcess::new(
        move |(k, i): (u64, u64), ctx: &mut KeyedContext<'_, u64, (u64, u64)>| {
            let mut v = vec![(k as u8) | 1; VALUE_LEN];
            v[..8].copy_from_slice(&i.to_le_bytes());
            ctx.set_value("v", &v);
            ctx.emit((k, i));
        },
    ))
    .uid("state")
    .sink(LiveCountSink {
        count: count.clone(),
        rate_per_writer: None,
    });
    let t0 = Instant::now();
    let handle = job.start().expect("start large-state job");
    let limit = Duration::from_secs(if opts.quick { 30 } else { 600 });
    let tick = Duration::from_millis(1);
    let filled = wait_for(limit, tick, || count.load(Ordering::Relaxed) >= keys);
    let fill_ns = t0.elapsed().as_nanos() as u64;
    let mut rows = Vec::new();
    if !filled {
        eprintln!("checkpoint bench: the {mib} MiB state did not fill within {limit:?}");
        return rows;
    }
    // The checkpoint after the one in progress holds the whole state: wait for it.
    let at_fill = last_completed(&handle);
    let t_full = Instant::now();
    wait_for(limit, tick, || last_completed(&handle) >= at_fill + 2);
    let first_full_ns = t_full.elapsed().as_nanos() as u64;

    // Duration: checkpoints while 1% of the keys change per interval.
    let samples = if opts.quick { 6 } else { 20 };
    let id0 = last_completed(&handle);
    let c0 = Clock::now(&count);
    wait_for(interval * (samples as u32 * 4), tick, || {
        last_completed(&handle) >= id0 + samples
    });
    let c1 = Clock::now(&count);
    let m = handle.checkpoint_metrics();
    let stats = completed_between(&m, id0 + 1, id0 + samples);
    let durs: Vec<u64> = stats.iter().map(|s| s.duration_ns).collect();
    let acks: Vec<u64> = stats
        .iter()
        .map(|s| s.ack_ns.iter().copied().max().unwrap_or(0))
        .collect();
    let sizes: Vec<u64> = stats.iter().map(|s| s.size_bytes).collect();
    let full = stats.iter().map(|s| s.full_size_bytes).max().unwrap_or(0);
    let size_med = quantile(&sizes, 0.5);
    let changed_per_interval = (keys / 100) * VALUE_LEN as u64;
    let (per_wall, per_cpu) = c0.rates_to(&c1);
    let mut extra = vec![
        ("state_bytes_target".into(), bytes as f64),
        ("state_keys".into(), keys as f64),
        ("value_bytes".into(), VALUE_LEN as f64),
        ("interval_ms".into(), interval.as_millis() as f64),
        ("full_size_bytes".into(), full as f64),
        ("bytes_per_checkpoint_p50".into(), size_med as f64),
        (
            "bytes_per_checkpoint_max".into(),
            quantile(&sizes, 1.0) as f64,
        ),
        (
            "changed_value_bytes_per_interval".into(),
            changed_per_interval as f64,
        ),
        (
            "bytes_per_checkpoint_over_changed".into(),
            size_med as f64 / changed_per_interval.max(1) as f64,
        ),
        ("ack_p50_ns".into(), quantile(&acks, 0.5) as f64),
        ("ack_p99_ns".into(), quantile(&acks, 0.99) as f64),
        ("checkpoints_measured".into(), stats.len() as f64),
        ("fill_ns".into(), fill_ns as f64),
        (
            "fill_records_per_sec".into(),
            keys as f64 * 1e9 / fill_ns.max(1) as f64,
        ),
        ("first_full_checkpoint_wait_ns".into(), first_full_ns as f64),
    ];
    for (i, s) in stats.iter().enumerate() {
        extra.push((format!("ckpt{i}_duration_ms"), s.duration_ms as f64));
        extra.push((format!("ckpt{i}_size_bytes"), s.size_bytes as f64));
    }
    extra.push((
        "failed_checkpoints".into(),
        m.number_of_failed_checkpoints as f64,
    ));
    rows.push(BenchResult {
        bench: format!("checkpoint_duration_{mib}MiB_1pct"),
        per_wall_sec: per_wall,
        per_cpu_sec: per_cpu,
        baseline: "full_size_bytes".into(),
        baseline_per_cpu_sec: full as f64,
        ratio: size_med as f64 / full.max(1) as f64,
        p50_ns: Some(quantile(&durs, 0.5)),
        p99_ns: Some(quantile(&durs, 0.99)),
        p999_ns: Some(quantile(&durs, 0.999)),
        max_ns: Some(quantile(&durs, 1.0)),
        extra,
    });

    // Recovery: the same job, now as fast as it goes, failed on purpose.
    rate.store(0, Ordering::Relaxed);
    let failures: u64 = if opts.quick { 2 } else { 3 };
    let window = Duration::from_millis(if opts.quick { 50 } else { 100 });
    let measure = Duration::from_millis(if opts.quick { 500 } else { 2000 });
    std::thread::sleep(measure / 2); // let the memtables and rings settle at the new rate
    let mut runs: Vec<[f64; 9]> = Vec::new();
    for f in 0..failures {
        // Fail only after a checkpoint of this attempt completed: every restore is real.
        let seen = last_completed(&handle);
        wait_for(limit, tick, || last_completed(&handle) > seen);
        let b0 = Clock::now(&count);
        std::thread::sleep(measure);
        let b1 = Clock::now(&count);
        let (before_wall, before_cpu) = b0.rates_to(&b1);
        let fail_epoch_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        let t_fail = Instant::now();
        fail.store(true, Ordering::Release);
        let tiny = Duration::from_micros(100);
        if !wait_for(limit, tiny, || handle.restarts() > f) {
            eprintln!("checkpoint bench: no restart after injected failure {f}");
            break;
        }
        let restart_ns = t_fail.elapsed().as_nanos() as u64;
        let at_restart = count.load(Ordering::Relaxed);
        wait_for(limit, tiny, || count.load(Ordering::Relaxed) > at_restart);
        let first_ns = t_fail.elapsed().as_nanos() as u64;
        // Replay: windows until one runs at >= 90% of the rate before the failure.
        let mut w = Clock::now(&count);
        let mut after = (f64::NAN, f64::NAN);
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            std::thread::sleep(window);
            let w2 = Clock::now(&count);
            let r = w.rates_to(&w2);
            w = w2;
            if r.0 >= 0.9 * before_wall {
                after = r;
                break;
            }
        }
        let full_ns = w.wall.duration_since(t_fail).as_nanos() as u64;
        // The supervisor stamps the restore (ms since the epoch) once it decoded the checkpoint.
        let restore_ts = handle
            .checkpoint_metrics()
            .last_checkpoint_restore_timestamp
            .map_or(f64::NAN, |t| t.saturating_sub(fail_epoch_ms) as f64 * 1e6);
        runs.push([
            first_ns as f64,
            full_ns.saturating_sub(first_ns) as f64,
            full_ns as f64,
            before_wall,
            before_cpu,
            after.0,
            after.1,
            restart_ns as f64,
            restore_ts,
        ]);
    }
    let col = |j: usize| runs.iter().map(|r| r[j]).collect::<Vec<_>>();
    let totals: Vec<u64> = runs.iter().map(|r| r[2] as u64).collect();
    let mut extra = vec![
        ("state_bytes".into(), full as f64),
        ("restore_ns_p50".into(), median_f(&col(0))),
        ("replay_ns_p50".into(), median_f(&col(1))),
        ("restart_decided_ns_p50".into(), median_f(&col(7))),
        ("before_per_wall_sec".into(), median_f(&col(3))),
        ("window_ms".into(), window.as_millis() as f64),
        ("restart_delay_ms".into(), 0.0),
        ("restarts".into(), handle.restarts() as f64),
    ];
    for (i, r) in runs.iter().enumerate() {
        for (j, name) in [
            "restore_ns",
            "replay_ns",
            "total_ns",
            "before_per_wall_sec",
            "before_per_cpu_sec",
            "after_per_wall_sec",
            "after_per_cpu_sec",
            "restart_decided_ns",
            "restore_timestamp_after_failure_ns",
        ]
        .iter()
        .enumerate()
        {
            extra.push((format!("run{i}_{name}"), r[j]));
        }
    }
    let before_cpu = median_f(&col(4));
    let after_cpu = median_f(&col(6));
    rows.push(BenchResult {
        bench: format!("checkpoint_recovery_{mib}MiB"),
        per_wall_sec: median_f(&col(5)),
        per_cpu_sec: after_cpu,
        baseline: "before_failure".into(),
        baseline_per_cpu_sec: before_cpu,
        ratio: after_cpu / before_cpu,
        p50_ns: Some(quantile(&totals, 0.5)),
        p99_ns: Some(quantile(&totals, 0.99)),
        p999_ns: Some(quantile(&totals, 0.999)),
        max_ns: Some(quantile(&totals, 1.0)),
        extra,
    });
    handle.cancel();
    let _ = handle.wait();
    rows
}

// ---------------------------------------------------------------------------------------------
// Backpressure

struct BpRun {
    per_wall: f64,
    per_cpu: f64,
    durs: Vec<u64>,
    acks: Vec<u64>,
    align: Vec<u64>,
    inflight: Vec<u64>,
    failed: u64,
}

/// The keyed count job for `run`, unbounded, with the source or the sink throttled.
fn bp_run(
    run: Duration,
    interval: Option<Duration>,
    unaligned: bool,
    source_rate_per_shard: Option<u64>,
    sink_rate_per_writer: Option<u64>,
) -> BpRun {
    let keys = 100_000;
    let dir = tempfile::tempdir().expect("checkpoint temp dir");
    let count = Arc::new(AtomicU64::new(0));
    let mut gen = GeneratorSource::new(None, 5, move |i: u64, r: u64| (r % keys, i));
    if let Some(r) = source_rate_per_shard {
        gen = gen.with_rate_per_shard(r);
    }
    let mut cfg = config();
    if let Some(i) = interval {
        cfg = cfg.with_checkpointing(ck(dir.path(), i).with_unaligned(unaligned));
    }
    let job = Job::new(cfg);
    keyed_count(job.source(gen)).sink(LiveCountSink {
        count: count.clone(),
        rate_per_writer: sink_rate_per_writer,
    });
    let handle = job.start().expect("start backpressure job");
    // Skip the start: rings filling and the first checkpoint are not the steady state.
    std::thread::sleep(run / 5);
    let id0 = last_completed(&handle);
    let c0 = Clock::now(&count);
    std::thread::sleep(run);
    let c1 = Clock::now(&count);
    let id1 = last_completed(&handle);
    let m = handle.checkpoint_metrics();
    handle.cancel();
    let _ = handle.wait();
    let stats = completed_between(&m, id0 + 1, id1);
    let (per_wall, per_cpu) = c0.rates_to(&c1);
    BpRun {
        per_wall,
        per_cpu,
        durs: stats.iter().map(|s| s.duration_ns).collect(),
        acks: stats
            .iter()
            .map(|s| s.ack_ns.iter().copied().max().unwrap_or(0))
            .collect(),
        align: stats.iter().map(|s| s.alignment_duration_ns).collect(),
        inflight: stats.iter().map(|s| s.persisted_inflight_bytes).collect(),
        failed: m.number_of_failed_checkpoints,
    }
}

fn backpressure(opts: &Opts) -> BenchResult {
    let reps = if opts.quick { 1 } else { 2 };
    let run = Duration::from_millis(if opts.quick { 1500 } else { 6000 });
    let interval = Duration::from_millis(200);
    // The job's own unthrottled rate, without checkpoints.
    let free = bp_run(run / 2, None, false, None, None);
    let tenth = (free.per_wall * 0.1 / SHARDS as f64).max(100.0) as u64;
    let (mut unloaded, mut loaded, mut aligned) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..reps {
        // Same rate with the source throttled: no backpressure.
        unloaded.push(bp_run(run, Some(interval), true, Some(tenth), None));
        loaded.push(bp_run(run, Some(interval), true, None, Some(tenth)));
        aligned.push(bp_run(run, Some(interval), false, None, Some(tenth)));
    }
    let pool = |v: &[BpRun], f: fn(&BpRun) -> &Vec<u64>| -> Vec<u64> {
        v.iter().flat_map(|r| f(r).iter().copied()).collect()
    };
    let (ul, ll, al) = (
        pool(&unloaded, |r| &r.durs),
        pool(&loaded, |r| &r.durs),
        pool(&aligned, |r| &r.durs),
    );
    let mut extra = vec![
        ("unthrottled_per_wall_sec".into(), free.per_wall),
        ("unthrottled_per_cpu_sec".into(), free.per_cpu),
        ("throttle_rate_total".into(), (tenth * SHARDS as u64) as f64),
        ("interval_ms".into(), interval.as_millis() as f64),
    ];
    for (name, runs, d) in [
        ("unaligned_unloaded", &unloaded, &ul),
        ("unaligned_loaded", &loaded, &ll),
        ("aligned_loaded", &aligned, &al),
    ] {
        let acks = pool(runs, |r| &r.acks);
        let align = pool(runs, |r| &r.align);
        let inflight = pool(runs, |r| &r.inflight);
        extra.push((format!("{name}_p50_ns"), quantile(d, 0.5) as f64));
        extra.push((format!("{name}_p99_ns"), quantile(d, 0.99) as f64));
        extra.push((format!("{name}_ack_p50_ns"), quantile(&acks, 0.5) as f64));
        extra.push((format!("{name}_ack_p99_ns"), quantile(&acks, 0.99) as f64));
        extra.push((
            format!("{name}_alignment_p50_ns"),
            quantile(&align, 0.5) as f64,
        ));
        extra.push((
            format!("{name}_inflight_bytes_p50"),
            quantile(&inflight, 0.5) as f64,
        ));
        extra.push((format!("{name}_checkpoints"), d.len() as f64));
        for (i, r) in runs.iter().enumerate() {
            extra.push((format!("{name}_run{i}_per_wall_sec"), r.per_wall));
            extra.push((format!("{name}_run{i}_per_cpu_sec"), r.per_cpu));
            extra.push((
                format!("{name}_run{i}_p50_ns"),
                quantile(&r.durs, 0.5) as f64,
            ));
            extra.push((format!("{name}_run{i}_failed"), r.failed as f64));
        }
    }
    let ack_ratio = quantile(&pool(&loaded, |r| &r.acks), 0.5) as f64
        / quantile(&pool(&unloaded, |r| &r.acks), 0.5).max(1) as f64;
    extra.push(("ack_p50_ratio_loaded_over_unloaded".into(), ack_ratio));
    // Nanosecond durations: Flink's milliseconds would round a checkpoint of a few
    // milliseconds down by up to half of it (a 0 ms median had to count as 1 ms).
    let ratio = quantile(&ll, 0.5) as f64 / quantile(&ul, 0.5).max(1) as f64;
    BenchResult {
        bench: "checkpoint_unaligned_backpressure_10pct".into(),
        per_wall_sec: median_f(&loaded.iter().map(|r| r.per_wall).collect::<Vec<_>>()),
        per_cpu_sec: median_f(&loaded.iter().map(|r| r.per_cpu).collect::<Vec<_>>()),
        baseline: "unaligned_unloaded_same_rate".into(),
        baseline_per_cpu_sec: median_f(&unloaded.iter().map(|r| r.per_cpu).collect::<Vec<_>>()),
        ratio,
        p50_ns: Some(quantile(&ll, 0.5)),
        p99_ns: Some(quantile(&ll, 0.99)),
        p999_ns: Some(quantile(&ll, 0.999)),
        max_ns: Some(quantile(&ll, 1.0)),
        extra,
    }
}

pub fn run(opts: &Opts) -> Vec<BenchResult> {
    let mut rows = Vec::new();
    if opts.wants("checkpoint_overhead") {
        rows.push(overhead(opts));
    }
    if opts.wants("checkpoint_unaligned_backpressure") {
        rows.push(backpressure(opts));
    }
    if opts.wants("checkpoint_duration") || opts.wants("checkpoint_recovery") {
        rows.extend(large_state(opts));
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Spin until this thread has used at least `ns` of CPU (by its own clock: preempted
    /// time does not count).
    fn burn(ns: u64) {
        let t0 = crate::thread_cpu_ns();
        let mut x = 0u64;
        while crate::thread_cpu_ns() - t0 < ns {
            x = std::hint::black_box(x.wrapping_add(1));
        }
    }

    #[test]
    fn threads_are_read_by_kind_and_their_cpu_grows() {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<i32>();
        let shard = std::thread::Builder::new()
            .name("weir-shard-9-9".into())
            .spawn(move || {
                burn(20_000_000);
                // SAFETY: gettid has no preconditions.
                let tid = unsafe { libc::syscall(libc::SYS_gettid) } as i32;
                ready_tx.send(tid).expect("send");
                rx.recv().ok();
            })
            .expect("spawn");
        let tid = ready_rx.recv().expect("tid");
        let seen = thread_cpu();
        let (_, kind, ns) = *seen.iter().find(|t| t.0 == tid).expect("the shard thread");
        assert_eq!(kind, ThreadKind::Shard);
        assert!(ns >= 20_000_000, "{ns} ns after 20 ms of spinning");
        tx.send(()).expect("send");
        shard.join().expect("join");
        // SAFETY: gettid has no preconditions.
        let me = unsafe { libc::syscall(libc::SYS_gettid) } as i32;
        let mine = seen.iter().find(|t| t.0 == me).expect("this thread");
        assert_eq!(mine.1, ThreadKind::Other);
    }

    #[test]
    fn a_split_counts_deltas_and_gives_the_unaccounted_rest_to_other() {
        let before = [(1, ThreadKind::Other, 100), (2, ThreadKind::Shard, 1_000)];
        let after = [
            (1, ThreadKind::Other, 150),
            (2, ThreadKind::Shard, 4_000),
            (3, ThreadKind::Maintenance, 700),
            (4, ThreadKind::IoWorker, 30),
        ];
        // 50 + 3_000 + 700 + 30 = 3_780 by live threads; 220 more by threads that exited.
        let s = CpuSplit::between(&before, &after, 4_000);
        assert_eq!(s.by_kind(), [3_000, 700, 30, 270]);
        assert_eq!(s.total(), 4_000);
    }
}
