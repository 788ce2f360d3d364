//! Checkpoints and recovery: state after a restore equals the state at the barrier, under
//! repeated injected failures, in exactly-once and at-least-once modes.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use weir_runtime::checkpoint::{CheckpointConfig, CheckpointMode, RestartStrategy};
use weir_runtime::{
    FnProcess, Job, JobConfig, KeyedContext, KeyedProcessFunction, Pinning, RestoreFrom,
    TimeDomain, WatermarkStrategy, WindowAssigner,
};

use weir_io::{Fault, FaultConfig, FaultyFs};
use weir_runtime::sink::TransactionalFileSink;

use common::{Hold, HELD_BATCH_RECORDS};

const KEYS: u64 = 50;
/// See `exactly_once_state_survives_failures_while_memtables_reuse_their_memory`.
const MEMTABLE_BUDGET: usize = 512 << 10;

fn ck(dir: &std::path::Path, mode: CheckpointMode) -> CheckpointConfig {
    ck_with(dir, mode, false, Duration::ZERO)
}

fn ck_with(
    dir: &std::path::Path,
    mode: CheckpointMode,
    unaligned: bool,
    aligned_timeout: Duration,
) -> CheckpointConfig {
    CheckpointConfig::new(dir, "verify")
        .with_unaligned(unaligned)
        .with_aligned_timeout(aligned_timeout)
        .with_interval(Duration::from_millis(20))
        .with_mode(mode)
        .with_retained(2)
        .with_restart(RestartStrategy::FixedDelay {
            attempts: 10,
            delay: Duration::from_millis(10),
        })
}

struct Outcome {
    /// Highest sequence number seen per key (replays may show one twice; max is idempotent).
    max_seq: HashMap<u64, u64>,
    /// Records whose sequence number did not follow the key's state: lost or duplicated state.
    violations: u64,
    /// Of which records whose sequence number was ahead of the key's state: lost records.
    gaps: u64,
    restarts: u64,
    completed: u64,
    /// With [`Setup::restore_inflight`]: the in-flight bytes of each checkpoint a failure
    /// restored.
    restored_inflight: Vec<u64>,
    /// Memtables the `verify` operator's stores flushed (over shards and attempts) before
    /// the last injected failure.
    flushes_before_last_failure: u64,
    /// The retained history of checkpoint statistics.
    history: Vec<weir_runtime::checkpoint::CheckpointStats>,
}

/// Each record carries a per-key sequence number; a keyed operator checks that every record
/// continues its key's sequence in state. After a restore, the state is the state at the
/// barrier and the source rewinds to its position at the barrier, so in exactly-once mode
/// the check never fails, however many times the job fails. The test injects each failure
/// only after a new checkpoint completed, so every restart restores real state; the last
/// sequence numbers are held (see [`Hold`]) until the last failure was injected.
fn run_verification(mode: CheckpointMode, shards: usize, n: u64, failures: u32) -> Outcome {
    run_verification_with(mode, Setup::default(), shards, n, failures)
}

/// How the verification job deviates from the plain aligned one.
struct Setup {
    unaligned: bool,
    aligned_timeout: Duration,
    /// A sink slow enough that the rings fill and barriers queue behind data.
    slow_sink: bool,
    /// Each shard's state memory, when not the default.
    memtable_budget: Option<usize>,
    keys: u64,
    /// No periodic checkpoints: before each failure, checkpoints are triggered by hand until
    /// one persisted in-flight records, so that every restore replays channel state.
    restore_inflight: bool,
    /// Before the last failure, wait until the `verify` operator's stores flushed a memtable
    /// and a checkpoint completed after that, so that the last restore follows a flush.
    flush_before_last_failure: bool,
    /// Records per source poll: [`HELD_BATCH_RECORDS`], so that barriers get through the
    /// held end of the input (see [`Hold`]) at once rather than after a second.
    batch_records: usize,
}

impl Default for Setup {
    fn default() -> Self {
        Setup {
            unaligned: false,
            aligned_timeout: Duration::ZERO,
            slow_sink: false,
            memtable_budget: None,
            keys: KEYS,
            restore_inflight: false,
            flush_before_last_failure: false,
            batch_records: HELD_BATCH_RECORDS,
        }
    }
}

fn run_verification_with(
    mode: CheckpointMode,
    setup: Setup,
    shards: usize,
    n: u64,
    failures: u32,
) -> Outcome {
    let Setup {
        unaligned,
        aligned_timeout,
        slow_sink,
        memtable_budget,
        keys,
        restore_inflight,
        flush_before_last_failure,
        batch_records,
    } = setup;
    let dir = tempfile::tempdir().expect("tmp");
    let fail_now = Arc::new(AtomicBool::new(false));
    let violations = Arc::new(AtomicU64::new(0));
    let gaps = Arc::new(AtomicU64::new(0));
    let max_seq: Arc<Mutex<HashMap<u64, u64>>> = Arc::default();
    let mut checkpointing = ck_with(dir.path(), mode, unaligned, aligned_timeout);
    if restore_inflight {
        checkpointing = checkpointing.with_interval(Duration::from_secs(3600));
    }
    let mut config = JobConfig::new()
        .with_shards(shards)
        .with_pinning(Pinning::Never)
        .with_ring_capacity_bytes(64 << 10)
        .with_batch_records(batch_records)
        .with_checkpointing(checkpointing);
    if let Some(bytes) = memtable_budget {
        config = config.with_memtable_budget_bytes(bytes);
    }
    let job = Job::new(config);
    let (f2, v2, g2, m2) = (
        fail_now.clone(),
        violations.clone(),
        gaps.clone(),
        max_seq.clone(),
    );
    // Every key belongs to one source shard, so that its records arrive in order.
    let per_shard = keys / shards as u64;
    // The last sequence numbers are held (of `0..seqs`).
    let seqs = (n / shards as u64 - 1) / per_shard + 1;
    let hold = Hold::new(seqs, seqs / 10);
    let map_hold = hold.clone();
    job.from_iter(move |shard, shards| {
        (0..n / shards as u64).map(move |t| {
            (
                shard as u64 + shards as u64 * (t % per_shard),
                t / per_shard,
            )
        })
    })
    .uid("gen")
    .map(move |r: (u64, u64)| {
        if f2.swap(false, Ordering::AcqRel) {
            panic!("injected failure");
        }
        // Slow enough that checkpoints complete while the job runs.
        if (r.1 * keys + r.0).is_multiple_of(200) {
            std::thread::sleep(Duration::from_millis(1));
        }
        // With a slow sink, only source shard 0's keys are held: while that shard sleeps it
        // reads none of its exchange inputs, so the other shards keep its rings full
        // (backpressure, and barriers behind queued records), where a hold of every source
        // would let the rings drain.
        if !slow_sink || r.0.is_multiple_of(shards as u64) {
            map_hold.delay(r.1);
        }
        r
    })
    .key_by(|r: &(u64, u64)| r.0)
    .process(FnProcess::new(
        move |(k, seq): (u64, u64), ctx: &mut KeyedContext<'_, u64, (u64, u64)>| {
            let expected = ctx.value::<u64>("next").unwrap_or(0);
            if seq != expected {
                v2.fetch_add(1, Ordering::Relaxed);
            }
            if seq > expected {
                g2.fetch_add(1, Ordering::Relaxed);
            }
            ctx.set_value("next", &(seq + 1));
            ctx.emit((k, seq));
        },
    ))
    .uid("verify")
    .for_each(move |(k, seq): (u64, u64)| {
        if slow_sink && seq.is_multiple_of(16) {
            // A slow sink: the rings fill up and barriers queue behind data.
            std::thread::sleep(Duration::from_micros(300));
        }
        let mut m = m2.lock().unwrap_or_else(|p| p.into_inner());
        let e = m.entry(k).or_insert(0);
        *e = (*e).max(seq);
    });
    let handle = job.start().expect("start");
    let mut seen = 0;
    let mut restored_inflight = Vec::new();
    let mut flushes_before_last_failure = 0;
    for i in 0..failures {
        // Wait for a checkpoint newer than the last restore, then fail.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let await_one = |seen: u64| {
            while handle.checkpoint_metrics().number_of_completed_checkpoints <= seen {
                assert!(
                    std::time::Instant::now() < deadline,
                    "no checkpoint completed"
                );
                std::thread::sleep(Duration::from_millis(1));
            }
            handle.checkpoint_metrics()
        };
        if restore_inflight {
            // Only these checkpoints complete, so the newest is the one the failure restores.
            loop {
                handle.trigger_checkpoint().expect("trigger");
                let m = await_one(seen);
                seen = m.number_of_completed_checkpoints;
                let newest = m
                    .history
                    .iter()
                    .rev()
                    .find(|c| c.failure.is_none())
                    .expect("a complete checkpoint");
                if newest.persisted_inflight_bytes > 0 {
                    restored_inflight.push(newest.persisted_inflight_bytes);
                    break;
                }
            }
        } else {
            seen = await_one(seen).number_of_completed_checkpoints;
        }
        if flush_before_last_failure && i + 1 == failures {
            while handle.metrics().state_flushes("verify") == 0 {
                assert!(std::time::Instant::now() < deadline, "no memtable flushed");
                std::thread::sleep(Duration::from_millis(1));
            }
            seen = await_one(seen).number_of_completed_checkpoints;
        }
        let newest = handle
            .checkpoint_metrics()
            .last_completed_checkpoint_id
            .expect("a checkpoint completed before the failure");
        flushes_before_last_failure = handle.metrics().state_flushes("verify");
        fail_now.store(true, Ordering::Release);
        while handle.restarts() <= u64::from(i) {
            assert!(
                std::time::Instant::now() < deadline,
                "the job did not restart"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        // The restart restored the newest checkpoint (or one that completed in the moment
        // before the failure), not the beginning: a restart from scratch would also give
        // every key an unbroken sequence.
        let restored = handle.checkpoint_metrics().last_restored_checkpoint_id;
        assert!(
            restored.is_some_and(|r| r >= newest),
            "failure {i} restored {restored:?}, the newest checkpoint was {newest}"
        );
    }
    hold.release();
    let summary = handle
        .wait()
        .expect("the job recovers from every injected failure");
    let max_seq = max_seq.lock().unwrap_or_else(|p| p.into_inner()).clone();
    Outcome {
        max_seq,
        violations: violations.load(Ordering::Relaxed),
        gaps: gaps.load(Ordering::Relaxed),
        restarts: summary.restarts,
        completed: summary.checkpoints.number_of_completed_checkpoints,
        flushes_before_last_failure,
        history: summary.checkpoints.history,
        restored_inflight,
    }
}

fn assert_complete(o: &Outcome, n: u64, shards: u64) {
    assert_complete_keys(o, n, shards, KEYS);
}

fn assert_complete_keys(o: &Outcome, n: u64, shards: u64, keys: u64) {
    let per_shard = keys / shards;
    assert_eq!(o.max_seq.len() as u64, per_shard * shards);
    for (k, last) in &o.max_seq {
        assert_eq!(
            *last,
            (n / shards - 1) / per_shard,
            "key {k} reached its last sequence number"
        );
    }
}

#[test]
fn exactly_once_state_survives_repeated_failures() {
    let n = 150_000;
    let o = run_verification(CheckpointMode::ExactlyOnce, 3, n, 3);
    assert_eq!(o.restarts, 3, "three injected failures, three restarts");
    assert!(
        o.completed >= 4,
        "checkpoints completed between the failures: {}",
        o.completed
    );
    assert_eq!(o.violations, 0, "no record lost or counted twice in state");
    assert_complete(&o, n, 3);
    // Start delay as Flink measures it: until the barrier reached every shard, which is
    // before any shard finished its snapshot and acknowledged, and every acknowledgement
    // before the checkpoint completed; the duration in milliseconds is the nanoseconds'.
    let done: Vec<_> = o.history.iter().filter(|c| c.failure.is_none()).collect();
    assert!(!done.is_empty());
    for c in done {
        let first_ack = c.ack_ns.iter().copied().min().unwrap();
        let last_ack = c.ack_ns.iter().copied().max().unwrap();
        assert!(
            c.start_delay_ns < first_ack && last_ack <= c.duration_ns,
            "checkpoint {}: start delay {} ns, acknowledgements {:?}, duration {} ns",
            c.checkpoint_id,
            c.start_delay_ns,
            c.ack_ns,
            c.duration_ns
        );
        assert_eq!(c.duration_ms, c.duration_ns / 1_000_000, "{c:?}");
    }
}

/// With state memory small enough that every few checkpoints fill the memtable, the shards'
/// stores reuse the chunks of records copied after each seal, copy the last live records out
/// of sparse chunks, and freeze: restores across all of that keep the state exact.
#[test]
fn exactly_once_state_survives_failures_while_memtables_reuse_their_memory() {
    // A whole number of records per key.
    let n = 160_000;
    let keys = 4000;
    let setup = Setup {
        memtable_budget: Some(MEMTABLE_BUDGET),
        keys,
        flush_before_last_failure: true,
        // The default: in polls of 64 records the memtables filled only after about twice as
        // many records, past the start of the hold even on an idle machine, and held records
        // fill them slowly (9 s instead of 1.5 s).
        batch_records: JobConfig::new().batch_records,
        ..Setup::default()
    };
    let o = run_verification_with(CheckpointMode::ExactlyOnce, setup, 2, n, 3);
    assert_eq!(o.restarts, 3);
    // Flushed before the last failure, so that a restore followed memtable reuse.
    assert!(
        o.flushes_before_last_failure > 0,
        "the memtables filled and froze before the last failure"
    );
    assert_eq!(o.violations, 0, "no record lost or counted twice in state");
    assert_complete_keys(&o, n, 2, keys);
}

#[test]
fn at_least_once_loses_nothing() {
    let n = 60_000;
    let o = run_verification(CheckpointMode::AtLeastOnce, 2, n, 1);
    assert_eq!(o.restarts, 1);
    // Replays after the restore may repeat records (counted in `violations`), but no record
    // may be skipped.
    assert_eq!(o.gaps, 0, "records lost");
    assert_complete(&o, n, 2);
}

/// Runs a bounded job over `0..n` (split over two shards) that sums the records of each key
/// (`x % keys`), checkpointing into `dir`: its summary and the running sums it emitted.
fn run_bounded_sums(
    dir: &std::path::Path,
    restore: Option<RestoreFrom>,
    n: u64,
    keys: u64,
) -> (weir_runtime::JobSummary, Vec<u64>) {
    let mut c = exactly_once(dir, 2);
    if let Some(r) = restore {
        c = c.with_restore(r);
    }
    let job = Job::new(c);
    let out = job
        .from_iter(move |shard, shards| (0..n).filter(move |i| *i as usize % shards == shard))
        .key_by(move |x: &u64| x % keys)
        .reduce(|a, b| a + b)
        .uid("sum")
        .collect();
    let s = job.run().expect("job");
    (s, out.take())
}

#[test]
fn a_finished_job_commits_a_final_checkpoint_and_restore_latest_resumes() {
    let dir = tempfile::tempdir().expect("tmp");
    let run = |restore, n| run_bounded_sums(dir.path(), restore, n, 7);
    let (s, out) = run(None, 1000);
    assert_eq!(out.len(), 1000);
    assert!(
        s.checkpoints.number_of_completed_checkpoints >= 1,
        "the final checkpoint completed"
    );
    let last = s.checkpoints.last_completed_checkpoint_id.expect("an id");
    // Restoring the final checkpoint of a finished bounded job replays nothing.
    let (s2, out2) = run(Some(RestoreFrom::Latest), 1000);
    assert!(
        out2.is_empty(),
        "everything was already processed: {} records",
        out2.len()
    );
    assert!(
        s2.checkpoints.last_completed_checkpoint_id.expect("an id") > last,
        "ids keep increasing"
    );
}

/// The final checkpoint of a bounded job commits all of its output, so it is taken aligned
/// even when checkpoints are unaligned (in Flink too it comes after every record was
/// processed). Unaligned, its barriers overtook the records queued in the exchange rings: their
/// results came after the checkpoint, were published when the input ended, and a restart
/// from that checkpoint replayed the records and emitted the results again (the CLI's
/// unaligned kill loop saw a key's last three sums committed twice).
#[test]
fn the_final_checkpoint_is_aligned_so_restoring_it_replays_nothing() {
    // Whether the final barrier finds records queued depends on the moment the sources end:
    // several runs, so that a final checkpoint taken unaligned would be caught.
    let mut overtook = 0;
    for timeout in [Duration::ZERO, Duration::from_millis(1)] {
        for _ in 0..3 {
            let dir = tempfile::tempdir().expect("tmp");
            let cfg = || ck_with(dir.path(), CheckpointMode::ExactlyOnce, true, timeout);
            let n = 40_000;
            let (s, out) = run_slow_sums(cfg(), None, n);
            assert_eq!(out.len() as u64, n);
            let history = &s.checkpoints.history;
            let last = history.last().expect("the final checkpoint");
            assert_eq!(
                Some(last.checkpoint_id),
                s.checkpoints.last_completed_checkpoint_id
            );
            assert_eq!(
                last.persisted_inflight_bytes, 0,
                "the final checkpoint holds no channel state (aligned timeout {timeout:?})"
            );
            overtook += history
                .iter()
                .filter(|c| c.persisted_inflight_bytes > 0)
                .count();
            let (_, out2) = run_slow_sums(cfg(), Some(RestoreFrom::Latest), n);
            assert!(
                out2.is_empty(),
                "restoring the final checkpoint emitted {} results again (aligned timeout \
                 {timeout:?})",
                out2.len()
            );
        }
    }
    // The periodic checkpoints before the final ones did overtake queued records: the jobs
    // took them unaligned.
    assert!(overtook > 0, "no checkpoint overtook a queued record");
}

/// Echoes each record and registers a processing-time timer `.0` ms later, which emits
/// `(key, -1, its time)`.
struct EchoThenTimer(i64);

impl KeyedProcessFunction<u64, (u64, i64, u64), (u64, i64, u64)> for EchoThenTimer {
    fn process_element(
        &self,
        rec: (u64, i64, u64),
        ctx: &mut KeyedContext<'_, u64, (u64, i64, u64)>,
    ) {
        ctx.emit(rec);
        let at = ctx.current_processing_time() + self.0;
        ctx.register_processing_timer(at);
    }

    fn on_timer(&self, ts: i64, _: TimeDomain, ctx: &mut KeyedContext<'_, u64, (u64, i64, u64)>) {
        let k = *ctx.key();
        ctx.emit((k, -1, ts as u64));
    }
}

/// A sink whose pre-commits each sleep `stall` first, then go to `inner`'s.
struct StalledPreCommit<S> {
    inner: S,
    stall: Duration,
}

struct StalledWriter<T> {
    inner: Box<dyn weir_runtime::sink::SinkWriter<T>>,
    stall: Duration,
}

impl<T: 'static> weir_runtime::sink::SinkWriter<T> for StalledWriter<T> {
    fn write(&mut self, rec: T, ts: i64) -> std::io::Result<()> {
        self.inner.write(rec, ts)
    }
    fn finish(&mut self) -> std::io::Result<()> {
        self.inner.finish()
    }
    fn pre_commit(&mut self, id: u64) -> std::io::Result<Vec<u8>> {
        std::thread::sleep(self.stall);
        self.inner.pre_commit(id)
    }
    fn commit(&mut self, id: u64) -> std::io::Result<()> {
        self.inner.commit(id)
    }
    fn restore(&mut self, id: u64, state: &[u8]) -> std::io::Result<()> {
        self.inner.restore(id, state)
    }
    fn allow_rewind(&mut self, allowed: bool) {
        self.inner.allow_rewind(allowed);
    }
    fn check_restore(&mut self, id: u64, states: &[&[u8]]) -> std::io::Result<()> {
        self.inner.check_restore(id, states)
    }
}

impl<T: 'static, S: weir_runtime::sink::Sink<T>> weir_runtime::sink::Sink<T>
    for StalledPreCommit<S>
{
    fn create_writer(
        &self,
        shard: usize,
        shards: usize,
    ) -> Result<Box<dyn weir_runtime::sink::SinkWriter<T>>, weir_runtime::StartError> {
        Ok(Box::new(StalledWriter {
            inner: self.inner.create_writer(shard, shards)?,
            stall: self.stall,
        }))
    }
}

/// A checkpoint still pending when a failure restarts the job is failed in the metrics and
/// the history, as Flink counts the checkpoints its failover aborts: every id triggered is
/// then completed, failed or in progress. It was in none (an audit: 48 completed and 0
/// failed of 49).
#[test]
fn a_checkpoint_pending_at_a_failover_counts_as_failed() {
    let dir = tempfile::tempdir().expect("tmp");
    let ck = CheckpointConfig::new(dir.path().join("ckpt"), "failover")
        .with_interval(Duration::from_millis(50))
        .with_restart(RestartStrategy::FixedDelay {
            attempts: 3,
            delay: Duration::from_millis(10),
        });
    let job = Job::new(
        JobConfig::new()
            .with_shards(2)
            .with_pinning(Pinning::Never)
            .with_checkpointing(ck),
    );
    // Set while a checkpoint is pending (its pre-commits stall): the next record fails.
    let fail = Arc::new(AtomicBool::new(false));
    let f = fail.clone();
    job.from_iter(|shard, shards| {
        (0..20_000u64)
            .filter(move |i| *i as usize % shards == shard)
            .inspect(|_| std::thread::sleep(Duration::from_micros(100)))
            .map(|i| (i % 7, 1, i))
    })
    .uid("input")
    .map(move |r: (u64, i64, u64)| {
        if f.swap(false, Ordering::AcqRel) {
            panic!("injected failure");
        }
        r
    })
    .key_by(|r: &(u64, i64, u64)| r.0)
    .reduce(|a, b| (a.0, a.1 + b.1, b.2))
    .sink(StalledPreCommit {
        inner: sum_sink(&dir.path().join("out")),
        stall: Duration::from_millis(100),
    });
    let h = job.start().expect("start");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let m = h.checkpoint_metrics();
        if m.number_of_completed_checkpoints >= 1 && m.number_of_in_progress_checkpoints >= 1 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{m:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
    fail.store(true, Ordering::Release);
    let s = h.wait().expect("the job recovers");
    assert_eq!(s.restarts, 1);
    let m = &s.checkpoints;
    let mut ids: Vec<u64> = m.history.iter().map(|c| c.checkpoint_id).collect();
    ids.sort_unstable();
    let triggered = ids.iter().copied().max().expect("checkpoints");
    assert!(m.history.len() < 32, "the whole history is retained");
    assert_eq!(
        ids,
        (1..=triggered).collect::<Vec<_>>(),
        "every checkpoint triggered is in the history"
    );
    assert_eq!(
        m.number_of_completed_checkpoints
            + m.number_of_failed_checkpoints
            + m.number_of_in_progress_checkpoints,
        triggered,
        "{m:?}"
    );
    assert!(
        m.history.iter().any(|c| c
            .failure
            .as_deref()
            .is_some_and(|f| f.contains("attempt ended"))),
        "{:?}",
        m.history
    );
}

/// A checkpoint's synchronous part is its longest shard's, as its asynchronous part is: two
/// shards pre-commit at once, and summed, their 30 ms stalls made a checkpoint's
/// synchronous part longer than the checkpoint (an audit saw it on every run of `weir run
/// keyed-sum` on 2 shards).
#[test]
fn the_synchronous_part_is_the_longest_shard_s_not_their_sum() {
    let dir = tempfile::tempdir().expect("tmp");
    let stall = Duration::from_millis(30);
    let ck = CheckpointConfig::new(dir.path().join("ckpt"), "sync")
        .with_interval(Duration::from_millis(20));
    let job = Job::new(
        JobConfig::new()
            .with_shards(2)
            .with_pinning(Pinning::Never)
            .with_checkpointing(ck),
    );
    job.from_iter(|shard, shards| {
        (0..2_000u64)
            .filter(move |i| *i as usize % shards == shard)
            .inspect(|_| std::thread::sleep(Duration::from_micros(100)))
            .map(|i| (i % 7, 1, i))
    })
    .key_by(|r: &(u64, i64, u64)| r.0)
    .reduce(|a, b| (a.0, a.1 + b.1, b.2))
    .sink(StalledPreCommit {
        inner: sum_sink(&dir.path().join("out")),
        stall,
    });
    let s = job.run().expect("job");
    let done: Vec<_> = s
        .checkpoints
        .history
        .iter()
        .filter(|c| c.failure.is_none())
        .collect();
    assert!(done.len() >= 2, "{:?}", s.checkpoints);
    for c in done {
        assert!(
            c.sync_duration_ns >= stall.as_nanos() as u64 && c.sync_duration_ns <= c.duration_ns,
            "checkpoint {}: synchronous part {} ns, duration {} ns",
            c.checkpoint_id,
            c.sync_duration_ns,
            c.duration_ns
        );
    }
}

/// A restore keeps an operator's key type, as Flink refuses an incompatible key serializer:
/// keys of another type encode to other bytes and key groups, so the restored state and
/// timers would not be found (or found under wrong keys). Before, a job whose reduce was keyed
/// by `u64` restored into one keyed by `i64` (or `String`) ran on without an error, every
/// key's restored sum lost (an audit's job: 2,878 of 3,000 per key). Now the restore is
/// refused at start, naming the operator and both types; the same key type restores.
#[test]
fn a_restore_into_another_key_type_is_refused() {
    let dir = tempfile::tempdir().expect("tmp");
    let run = |restore: bool, signed: bool| {
        let mut c = JobConfig::new()
            .with_shards(2)
            .with_pinning(Pinning::Never)
            .with_checkpointing(
                CheckpointConfig::new(dir.path(), "keys").with_interval(Duration::from_secs(3600)),
            );
        if restore {
            c = c.with_restore(RestoreFrom::Latest);
        }
        let job = Job::new(c);
        let input = job
            .from_vec((0..1_000u64).map(|i| (i % 10, 1u64)).collect())
            .uid("input");
        let out = if signed {
            input
                .key_by(|r: &(u64, u64)| r.0 as i64)
                .reduce(|a, b| (a.0, a.1 + b.1))
                .uid("sum")
                .collect()
        } else {
            input
                .key_by(|r: &(u64, u64)| r.0)
                .reduce(|a, b| (a.0, a.1 + b.1))
                .uid("sum")
                .collect()
        };
        job.run().map(|_| out.take())
    };
    // The finished job's final checkpoint holds every key's sum.
    let first = run(false, false).expect("first run");
    assert_eq!(first.len(), 1_000);
    let e = run(true, true).expect_err("a restore into i64 keys");
    assert!(
        matches!(
            &e,
            weir_runtime::JobError::Start(weir_runtime::StartError::Restore { .. })
        ) && !e.is_recoverable(),
        "{e:?}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("`sum`") && msg.contains("key<u64>") && msg.contains("key<i64>"),
        "{msg}"
    );
    // The same key type restores the finished job: nothing more to read, nothing emitted.
    assert_eq!(run(true, false).expect("a restore into u64 keys"), vec![]);
}

/// A head with one input has nothing to align: its barrier is the first and the last, and
/// its alignment is 0, as Flink reports a single channel's. Before, a 1-shard job reported
/// 1-3 us, the time the head took to pass the barrier on. A 2-shard job's heads align two
/// inputs: their figure is measured, and within the checkpoint's duration.
#[test]
fn a_head_with_one_input_aligns_for_no_time() {
    for shards in [1, 2] {
        let dir = tempfile::tempdir().expect("tmp");
        let ck = CheckpointConfig::new(dir.path().join("ckpt"), "align")
            .with_interval(Duration::from_millis(10));
        let job = Job::new(
            JobConfig::new()
                .with_shards(shards)
                .with_pinning(Pinning::Never)
                .with_checkpointing(ck),
        );
        job.from_iter(|shard, shards| {
            (0..2_000u64)
                .filter(move |i| *i as usize % shards == shard)
                .inspect(|_| std::thread::sleep(Duration::from_micros(50)))
                .map(|i| (i % 7, 1, i))
        })
        .key_by(|r: &(u64, i64, u64)| r.0)
        .reduce(|a, b| (a.0, a.1 + b.1, b.2))
        .sink(sum_sink(&dir.path().join("out")));
        let s = job.run().expect("job");
        let done: Vec<(u64, u64, u64)> = s
            .checkpoints
            .history
            .iter()
            .filter(|c| c.failure.is_none())
            .map(|c| (c.checkpoint_id, c.alignment_duration_ns, c.duration_ns))
            .collect();
        assert!(done.len() >= 2, "{shards} shards: {:?}", s.checkpoints);
        if shards == 1 {
            assert!(
                done.iter().all(|&(_, align, _)| align == 0),
                "(id, alignment ns, duration ns): {done:?}"
            );
        } else {
            assert!(
                done.iter().all(|&(_, align, d)| align <= d)
                    && done.iter().any(|&(_, align, _)| align > 0),
                "(id, alignment ns, duration ns): {done:?}"
            );
        }
    }
}

/// The final checkpoint is a finished job's last word, as in Flink, which stops an
/// operator's processing-time timers at the end of its input (FLINK-14231): timers not due
/// when its barrier passes never fire. Two ways this failed, each seen by an audit:
/// - timers due while the final checkpoint's pre-commit stalled fired after its barrier; the
///   sink published their output when the input ended, outside any checkpoint, and a
///   `restore latest` of that checkpoint was refused ("committed after checkpoint 1");
/// - timers due after the job ended stayed in the final checkpoint, and its restore fired
///   them: 10 lines the finished run never had.
#[test]
fn processing_timers_never_fire_past_the_final_checkpoint() {
    for shards in [1, 2] {
        // (timer delay, pre-commit stall, pause before the restore)
        for (delay, stall, pause) in [(20, 200, 0), (1_000, 0, 1_500)] {
            let dir = tempfile::tempdir().expect("tmp");
            let out = dir.path().join("out");
            let run = |restore: bool, stall: u64| {
                let ck = CheckpointConfig::new(dir.path().join("ckpt"), "timers")
                    .with_interval(Duration::from_secs(3600));
                let mut c = JobConfig::new()
                    .with_shards(shards)
                    .with_pinning(Pinning::Never)
                    .with_checkpointing(ck);
                if restore {
                    c = c.with_restore(RestoreFrom::Latest);
                }
                let job = Job::new(c);
                job.from_iter(|shard, shards| {
                    (0..10u64)
                        .filter(move |i| *i as usize % shards == shard)
                        .map(|i| (i % 3, 1, i))
                })
                .key_by(|r: &(u64, i64, u64)| r.0)
                .process(EchoThenTimer(delay))
                .uid("timers")
                .sink(StalledPreCommit {
                    inner: sum_sink(&out),
                    stall: Duration::from_millis(stall),
                });
                job.run()
            };
            let what = format!("{shards} shards, timers after {delay} ms");
            run(false, stall).unwrap_or_else(|e| panic!("{what}: {e}"));
            let mut first = parse_sums(committed_lines(&out));
            first.sort_unstable();
            let mut records: Vec<u64> = first.iter().filter(|r| r.1 != -1).map(|r| r.2).collect();
            records.sort_unstable();
            assert_eq!(records, (0..10).collect::<Vec<_>>(), "{what}");
            std::thread::sleep(Duration::from_millis(pause));
            let s = run(true, 0)
                .unwrap_or_else(|e| panic!("{what}: restore of the final checkpoint: {e}"));
            assert_eq!(s.metrics.records_out("timers"), 0, "{what}");
            let mut after = parse_sums(committed_lines(&out));
            after.sort_unstable();
            assert_eq!(after, first, "{what}: the restored run committed nothing");
        }
    }
}

/// A bounded job over `0..n` (two shards) summing per key `x % 7` behind small exchange
/// rings that stay full: every 4th sum takes 50 us downstream of them, so that they take
/// longer to drain than a checkpoint takes. The job's summary and the sums it emitted.
fn run_slow_sums(
    ck: CheckpointConfig,
    restore: Option<RestoreFrom>,
    n: u64,
) -> (weir_runtime::JobSummary, Vec<u64>) {
    let mut c = JobConfig::new()
        .with_shards(2)
        .with_pinning(Pinning::Never)
        .with_ring_capacity_bytes(64 << 10)
        .with_checkpointing(ck);
    if let Some(r) = restore {
        c = c.with_restore(r);
    }
    let job = Job::new(c);
    let out = job
        .from_iter(move |shard, shards| (0..n).filter(move |i| *i as usize % shards == shard))
        .key_by(|x: &u64| x % 7)
        .reduce(|a, b| a + b)
        .uid("sum")
        .map(|s: u64| {
            if s.is_multiple_of(4) {
                std::thread::sleep(Duration::from_micros(50));
            }
            s
        })
        .collect();
    let s = job.run().expect("job");
    (s, out.take())
}

/// A restore from the job's own checkpoints keeps their state files where they are: the
/// next checkpoint references the restored segments' files instead of uploading them again
/// (before, every restore added the whole state to what the next checkpoint held), and
/// restoring it gives the same state.
#[test]
fn checkpoints_after_a_restore_reference_the_restored_segments() {
    let dir = tempfile::tempdir().expect("tmp");
    let run = |restore, n| run_bounded_sums(dir.path(), restore, n, 5000);
    let storage = || {
        weir_io::CheckpointStorage::open_read_only(Arc::new(weir_io::StdFs), dir.path(), "verify")
            .expect("storage")
    };
    let shared = |id: u64| -> Vec<std::path::PathBuf> {
        let m = storage().read_metadata(id).expect("metadata");
        m.files
            .into_iter()
            .map(|f| f.path)
            .filter(|p| p.starts_with(weir_io::SHARED_DIR))
            .collect()
    };
    let (s, _) = run(None, 20_000);
    let first = s.checkpoints.last_completed_checkpoint_id.expect("an id");
    let before = shared(first);
    assert!(!before.is_empty(), "the keyed state is in shared files");
    let (s2, out2) = run(Some(RestoreFrom::Latest), 20_000);
    assert!(out2.is_empty(), "nothing to replay");
    let second = s2.checkpoints.last_completed_checkpoint_id.expect("an id");
    assert!(second > first);
    let after = shared(second);
    assert_eq!(after, before, "the restored segments were uploaded again");
    // The state restores from those files: the sums go on from where they were.
    let (_, out3) = run(Some(RestoreFrom::Latest), 20_010);
    let mut got: Vec<u64> = out3;
    got.sort_unstable();
    // Records 20 000..20 010 (keys 0..10): each key's sum so far plus the new record.
    let want: Vec<u64> = (20_000..20_010u64)
        .map(|i| (0..=i).filter(|j| j % 5000 == i % 5000).sum())
        .collect();
    assert_eq!(got, want);
}

/// The shared files (keyed state segments) checkpoint `id` in `dir` refers to.
fn shared_files(dir: &std::path::Path, id: u64) -> std::collections::BTreeSet<std::path::PathBuf> {
    let storage =
        weir_io::CheckpointStorage::open_read_only(Arc::new(weir_io::StdFs), dir, "verify")
            .expect("storage");
    let m = storage.read_metadata(id).expect("metadata");
    m.files
        .into_iter()
        .map(|f| f.path)
        .filter(|p| p.starts_with(weir_io::SHARED_DIR))
        .collect()
}

/// `incremental` off (Flink's full checkpoints): every checkpoint writes the whole keyed
/// state again, sharing no file with another checkpoint, so that each one's new bytes are
/// its size; a restore from it gives the same state. On, the newer of two retained
/// checkpoints refers to files the older one wrote. (The setting was loaded and then
/// ignored: every checkpoint was incremental.)
#[test]
fn full_checkpoints_share_no_file_and_restore_the_same_state() {
    for incremental in [false, true] {
        let dir = tempfile::tempdir().expect("tmp");
        let ck = || {
            CheckpointConfig::new(dir.path(), "verify")
                .with_interval(Duration::from_millis(20))
                .with_retained(2)
                .with_incremental(incremental)
        };
        let (s, out) = run_slow_sums(ck(), None, 30_000);
        assert_eq!(out.len(), 30_000);
        assert!(
            s.checkpoints.number_of_completed_checkpoints >= 2,
            "{incremental}"
        );
        let storage = weir_io::CheckpointStorage::open_read_only(
            Arc::new(weir_io::StdFs),
            dir.path(),
            "verify",
        )
        .expect("storage");
        let kept: Vec<_> = storage
            .list()
            .expect("list")
            .into_iter()
            .filter(|c| c.complete)
            .collect();
        assert_eq!(kept.len(), 2, "{incremental}: retained");
        let (older, newer) = (
            shared_files(dir.path(), kept[0].id),
            shared_files(dir.path(), kept[1].id),
        );
        assert!(!older.is_empty() && !newer.is_empty(), "{incremental}");
        let common = older.intersection(&newer).count();
        if incremental {
            assert!(common > 0, "incremental checkpoints share segments");
        } else {
            assert_eq!(
                common, 0,
                "a full checkpoint shares no file: {older:?} {newer:?}"
            );
            // Nor bytes: no file is another name of one the other checkpoint holds (each
            // linked the same local segment, so a damaged byte damaged both).
            use std::os::unix::fs::MetadataExt;
            let inodes = |files: &std::collections::BTreeSet<std::path::PathBuf>| {
                files
                    .iter()
                    .map(|f| {
                        std::fs::metadata(dir.path().join("verify").join(f))
                            .expect("file")
                            .ino()
                    })
                    .collect::<std::collections::BTreeSet<u64>>()
            };
            assert_eq!(
                inodes(&older).intersection(&inodes(&newer)).count(),
                0,
                "a full checkpoint shares no bytes"
            );
            for c in &kept {
                // Copies, each framed in checksummed blocks, frames counted on both sides: the
                // full size (on disk) was the content alone, below the bytes written.
                assert_eq!(
                    c.new_bytes, c.size_bytes,
                    "checkpoint {} wrote all it holds",
                    c.id
                );
            }
        }
        // The newest (final) checkpoint restores the sums: 7 more records, one per key (so
        // that the two shards' order does not matter), continue them.
        let (_, mut got) = run_slow_sums(ck(), Some(RestoreFrom::Latest), 30_007);
        got.sort_unstable();
        let want: Vec<u64> = (30_000..30_007u64)
            .map(|i| (0..=i).filter(|j| j % 7 == i % 7).sum())
            .collect();
        assert_eq!(got, want, "{incremental}");
    }
}

#[test]
fn unaligned_checkpoints_under_backpressure_are_exactly_once() {
    let n = 90_000;
    let setup = Setup {
        unaligned: true,
        slow_sink: true,
        restore_inflight: true,
        ..Setup::default()
    };
    let o = run_verification_with(CheckpointMode::ExactlyOnce, setup, 3, n, 2);
    assert_eq!(o.restarts, 2);
    assert!(o.completed >= 3, "checkpoints completed: {}", o.completed);
    assert!(
        o.restored_inflight.len() == 2 && o.restored_inflight.iter().all(|&b| b > 0),
        "each failure restored a checkpoint whose barriers overtook queued records: {:?}",
        o.restored_inflight
    );
    assert_eq!(
        o.violations, 0,
        "replayed channel state restores every overtaken record once"
    );
    assert_complete(&o, n, 3);
}

#[test]
fn alignment_timeout_turns_aligned_checkpoints_unaligned() {
    let n = 90_000;
    let setup = Setup {
        unaligned: true,
        aligned_timeout: Duration::from_millis(1),
        slow_sink: true,
        restore_inflight: true,
        ..Setup::default()
    };
    let o = run_verification_with(CheckpointMode::ExactlyOnce, setup, 2, n, 2);
    assert_eq!(o.restarts, 2);
    // A checkpoint persists in-flight records only once its alignment timed out.
    assert!(
        o.restored_inflight.len() == 2 && o.restored_inflight.iter().all(|&b| b > 0),
        "each failure restored a checkpoint that turned unaligned: {:?}",
        o.restored_inflight
    );
    // Its alignment lasted until it turned, as Flink reports it: the time it aligned was
    // dropped at the switch (an audit saw 0.06 ms against a 5 ms timeout).
    let turned: Vec<(u64, u64)> = o
        .history
        .iter()
        .filter(|c| c.persisted_inflight_bytes > 0)
        .map(|c| (c.checkpoint_id, c.alignment_duration_ns))
        .collect();
    assert!(!turned.is_empty());
    assert!(
        turned.iter().all(|&(_, ns)| ns >= 1_000_000),
        "alignments of checkpoints that turned unaligned: {turned:?}"
    );
    assert_eq!(o.violations, 0);
    assert_complete(&o, n, 2);
}

/// A sink whose pre-commit fails (declines) or stalls for its first few checkpoints.
struct FlakySink {
    declines: Arc<AtomicU64>,
    stalls: Arc<AtomicU64>,
    stall: Duration,
}

struct FlakyWriter {
    declines: Arc<AtomicU64>,
    stalls: Arc<AtomicU64>,
    stall: Duration,
}

impl weir_runtime::sink::SinkWriter<u64> for FlakyWriter {
    fn write(&mut self, _rec: u64, _ts: i64) -> std::io::Result<()> {
        Ok(())
    }
    fn finish(&mut self) -> std::io::Result<()> {
        Ok(())
    }
    fn pre_commit(&mut self, _id: u64) -> std::io::Result<Vec<u8>> {
        if self
            .declines
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok()
        {
            return Err(std::io::Error::other("injected pre-commit failure"));
        }
        if self
            .stalls
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok()
        {
            std::thread::sleep(self.stall);
        }
        Ok(Vec::new())
    }
}

impl weir_runtime::sink::Sink<u64> for FlakySink {
    fn create_writer(
        &self,
        _: usize,
        _: usize,
    ) -> Result<Box<dyn weir_runtime::sink::SinkWriter<u64>>, weir_runtime::StartError> {
        Ok(Box::new(FlakyWriter {
            declines: self.declines.clone(),
            stalls: self.stalls.clone(),
            stall: self.stall,
        }))
    }
}

fn flaky_job(
    dir: &std::path::Path,
    declines: u64,
    stalls: u64,
    tolerable: u32,
    timeout: Duration,
) -> Result<weir_runtime::JobSummary, weir_runtime::JobError> {
    let c = CheckpointConfig::new(dir, "flaky")
        .with_interval(Duration::from_millis(10))
        .with_timeout(timeout)
        .with_tolerable_failures(tolerable)
        .with_restart(RestartStrategy::None);
    let job = Job::new(
        JobConfig::new()
            .with_shards(2)
            .with_pinning(Pinning::Never)
            .with_checkpointing(c),
    );
    job.from_iter(|_, _| (0..400u64).inspect(|_| std::thread::sleep(Duration::from_micros(500))))
        .key_by(|x: &u64| *x % 5)
        .reduce(|a, b| a + b)
        .uid("sum")
        .sink(FlakySink {
            declines: Arc::new(AtomicU64::new(declines)),
            stalls: Arc::new(AtomicU64::new(stalls)),
            stall: Duration::from_millis(300),
        });
    job.run()
}

#[test]
fn declined_checkpoints_within_the_tolerable_number_do_not_fail_the_job() {
    let dir = tempfile::tempdir().expect("tmp");
    let s = flaky_job(dir.path(), 2, 0, 5, Duration::from_secs(10)).expect("tolerated");
    assert!(
        s.checkpoints.number_of_failed_checkpoints >= 1,
        "{:?}",
        s.checkpoints
    );
    assert!(s.checkpoints.number_of_completed_checkpoints >= 1);
    let declined = s
        .checkpoints
        .history
        .iter()
        .filter_map(|h| h.failure.as_deref())
        .any(|f| f.contains("declined") && f.contains("injected pre-commit failure"));
    assert!(declined, "{:?}", s.checkpoints.history);
}

#[test]
fn more_declines_than_tolerable_fail_the_job() {
    let dir = tempfile::tempdir().expect("tmp");
    match flaky_job(dir.path(), 100, 0, 1, Duration::from_secs(10)) {
        Err(weir_runtime::JobError::CheckpointFailures { reason }) => {
            assert!(reason.contains("exceed the tolerable 1"), "{reason}")
        }
        other => panic!("expected a checkpoint failure, got {other:?}"),
    }
}

/// More failed checkpoints than tolerated fail the job when the failure is the final
/// checkpoint's too: once the job is failing, the coordinator triggers nothing more, as
/// Flink's stops its scheduler. It retried the final checkpoint, and a 1-shard job whose
/// retry completed before the failure was acted on ended without an error (an audit's run).
#[test]
fn a_declined_final_checkpoint_beyond_the_tolerable_number_fails_the_job() {
    for shards in [1, 2] {
        let dir = tempfile::tempdir().expect("tmp");
        // Only the final checkpoint: the interval is longer than the job.
        let c = CheckpointConfig::new(dir.path(), "final")
            .with_interval(Duration::from_secs(3600))
            .with_tolerable_failures(0)
            .with_restart(RestartStrategy::None);
        let job = Job::new(
            JobConfig::new()
                .with_shards(shards)
                .with_pinning(Pinning::Never)
                .with_checkpointing(c),
        );
        job.from_iter(|_, _| 0..100u64)
            .key_by(|x: &u64| *x % 5)
            .reduce(|a, b| a + b)
            .sink(FlakySink {
                declines: Arc::new(AtomicU64::new(1)),
                stalls: Arc::new(AtomicU64::new(0)),
                stall: Duration::ZERO,
            });
        match job.run() {
            Err(weir_runtime::JobError::CheckpointFailures { reason }) => {
                assert!(reason.contains("exceed the tolerable 0"), "{reason}")
            }
            other => panic!("{shards} shards: expected a checkpoint failure, got {other:?}"),
        }
    }
}

#[test]
fn a_checkpoint_that_outlives_its_timeout_is_aborted_and_counted() {
    let dir = tempfile::tempdir().expect("tmp");
    // Checkpoints keep expiring while the sink stalls (300 ms against a 100 ms timeout) and
    // until the shards catch up after it, which on a loaded 2-vCPU CI machine once took six
    // timeouts: the job tolerates any number here (the limit has its own test above).
    let s = flaky_job(dir.path(), 0, 1, 1000, Duration::from_millis(100)).expect("tolerated");
    let expired = s
        .checkpoints
        .history
        .iter()
        .filter_map(|h| h.failure.as_deref())
        .any(|f| f.contains("expired"));
    assert!(expired, "{:?}", s.checkpoints.history);
    assert!(
        s.checkpoints.number_of_completed_checkpoints >= 1,
        "later checkpoints complete"
    );
}

/// Records `(key, value, index)` over 101 keys, with each key's total and the running sum at
/// every index: what a keyed running sum must emit.
struct Sums {
    data: Vec<(u64, i64, u64)>,
    expected: HashMap<u64, i64>,
    at: HashMap<u64, i64>,
}

impl Sums {
    fn new(n: u64) -> Sums {
        let data: Vec<(u64, i64, u64)> = (0..n)
            .map(|i| (i * 7919 % 101, (i % 13) as i64 - 6, i))
            .collect();
        let (mut expected, mut at) = (HashMap::new(), HashMap::new());
        for (k, v, i) in &data {
            let s: &mut i64 = expected.entry(*k).or_default();
            *s += v;
            at.insert(*i, *s);
        }
        Sums { data, expected, at }
    }
}

/// The keyed running sum the restore tests run: `data` from a source with uid `input`, with a
/// `hold` every 500th record 1 ms late and the end held (so that checkpoints complete while it
/// runs; its job takes [`HELD_BATCH_RECORDS`]), summed per key by an operator with uid
/// `sum_uid`.
fn running_sum_job(
    job: &Job,
    data: &[(u64, i64, u64)],
    hold: Option<Hold>,
    sum_uid: &str,
) -> weir_runtime::Stream<(u64, i64, u64)> {
    job.from_vec(data.to_vec())
        .uid("input")
        .inspect(move |r: &(u64, i64, u64)| {
            if let Some(hold) = &hold {
                if r.2.is_multiple_of(500) {
                    std::thread::sleep(Duration::from_millis(1));
                }
                hold.delay(r.2);
            }
        })
        .key_by(|r| r.0)
        .reduce(|a, b| (a.0, a.1 + b.1, b.2))
        .uid(sum_uid)
}

/// A checkpoint triggered by hand right after the start, before the coordinator of the first
/// attempt ran, is taken: with no periodic checkpoints, the job completes it and then the
/// final one. (The coordinator used to count requests made before it existed as seen, and
/// dropped them; a request during a restart went the same way.)
#[test]
fn a_checkpoint_triggered_right_after_the_start_completes() {
    let dir = tempfile::tempdir().expect("tmp");
    let n = 100_000u64;
    let Sums { data, at, .. } = Sums::new(n);
    let config = CheckpointConfig::new(dir.path(), "manual").with_mode(CheckpointMode::ExactlyOnce);
    assert!(config.interval.is_none(), "no periodic checkpoints");
    let job = Job::new(
        JobConfig::new()
            .with_shards(2)
            .with_pinning(Pinning::Never)
            .with_batch_records(HELD_BATCH_RECORDS)
            .with_checkpointing(config),
    );
    // Held, so that the sources cannot end before the coordinator served the trigger.
    let hold = Hold::new(n, n / 10);
    let out = running_sum_job(&job, &data, Some(hold.clone()), "sum").collect();
    let h = job.start().expect("start");
    h.trigger_checkpoint().expect("trigger");
    await_checkpoints(&h, 1);
    hold.release();
    let summary = h.wait().expect("job");
    let ids: Vec<u64> = summary
        .checkpoints
        .history
        .iter()
        .filter(|c| c.failure.is_none())
        .map(|c| c.checkpoint_id)
        .collect();
    assert_eq!(
        ids.len(),
        2,
        "the manual checkpoint, then the final one: {ids:?}"
    );
    let got = out.take();
    assert_eq!(got.len() as u64, n);
    assert!(got.iter().all(|(_, sum, i)| at.get(i) == Some(sum)));
}

/// A job that has ended takes no checkpoint and no savepoint: both are errors (a trigger
/// returned `Ok` and nothing came of it).
#[test]
fn an_ended_job_refuses_triggers() {
    let dir = tempfile::tempdir().expect("tmp");
    let job = Job::new(exactly_once(dir.path(), 2));
    let _ = job.from_vec((0..1000u64).collect()).collect();
    let h = job.start().expect("start");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !h.is_finished() {
        assert!(std::time::Instant::now() < deadline, "the job did not end");
        std::thread::sleep(Duration::from_millis(2));
    }
    match h.trigger_checkpoint() {
        Err(weir_runtime::StartError::Checkpoint { reason }) => {
            assert!(reason.contains("ended"), "{reason}")
        }
        other => panic!("a checkpoint of an ended job: {other:?}"),
    }
    assert!(matches!(
        h.trigger_savepoint(&dir.path().join("sp")),
        Err(weir_runtime::SavepointError::JobEnded)
    ));
    h.wait().expect("job");
}

/// A savepoint requested while the job waits out its restart delay fails at once, as Flink
/// refuses one while its tasks are not running (it waited for the next attempt: here an
/// hour), and is withdrawn: the job then runs on without stopping.
#[test]
fn a_savepoint_during_a_restart_fails_at_once() {
    let dir = tempfile::tempdir().expect("tmp");
    let config = JobConfig::new()
        .with_shards(1)
        .with_pinning(Pinning::Never)
        .with_checkpointing(ck(dir.path(), CheckpointMode::ExactlyOnce).with_restart(
            RestartStrategy::FixedDelay {
                attempts: 1,
                delay: Duration::from_secs(3600),
            },
        ));
    let job = Job::new(config);
    let _ = job
        .from_iter(|_, _| 0..u64::MAX)
        .map(|x| {
            assert!(x != 1000, "fails once, at 1000");
            x
        })
        .collect();
    let h = job.start().expect("start");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while h.status() != weir_runtime::JobStatus::Restarting {
        assert!(std::time::Instant::now() < deadline, "no restart");
        std::thread::sleep(Duration::from_millis(2));
    }
    for stop in [false, true] {
        let sp = dir.path().join("sp");
        // On a thread: before, the call waited out the restart delay; the cancel ends that.
        let r = std::thread::scope(|scope| {
            let (tx, rx) = std::sync::mpsc::channel();
            let (h, sp) = (&h, &sp);
            scope.spawn(move || {
                let _ = tx.send(if stop {
                    h.stop_with_savepoint(sp)
                } else {
                    h.trigger_savepoint(sp)
                });
            });
            let r = rx.recv_timeout(Duration::from_secs(30));
            if r.is_err() {
                h.cancel();
            }
            r
        });
        assert!(
            matches!(r, Ok(Err(weir_runtime::SavepointError::Restarting))),
            "stop {stop}: {r:?}"
        );
    }
    assert_eq!(h.status(), weir_runtime::JobStatus::Restarting);
    h.cancel();
}

/// Concurrent checkpoints (max 3, every 10 ms, one retained) on a keyed job whose small
/// memtables flush segments all the time. Two defects failed such jobs: a checkpoint reused
/// a shared file that retention had dropped when a concurrent one completed ("reuses ...,
/// which no longer exists"; now checked and held under the GC lock, and uploaded again if
/// gone), and one whose barrier the sources skipped stayed pending until its timeout (now
/// subsumed by the next one that completes). With no failure tolerated and no restart,
/// the job must end with its checkpoints complete and the right sums.
#[test]
fn concurrent_checkpoints_complete_on_a_keyed_job() {
    let dir = tempfile::tempdir().expect("tmp");
    let config = JobConfig::new()
        .with_shards(2)
        .with_pinning(Pinning::Never)
        .with_checkpointing(
            CheckpointConfig::new(dir.path(), "concurrent")
                .with_interval(Duration::from_millis(10))
                .with_max_concurrent(3)
                .with_timeout(Duration::from_secs(5))
                .with_retained(1)
                .with_restart(RestartStrategy::None),
        );
    let job = Job::new(config);
    let n = 1_000_000u64;
    let got = job
        .from_iter(move |shard, shards| (0..n).filter(move |i| *i as usize % shards == shard))
        .map(|i| (i % 100_000, 1u64))
        .key_by(|r| r.0)
        .reduce(|a, b| (a.0, a.1 + b.1))
        .collect();
    let h = job.start().expect("start");
    while !h.is_finished() {
        std::thread::sleep(Duration::from_millis(5));
    }
    let m = h.checkpoint_metrics();
    h.wait().expect("the job");
    assert!(m.number_of_completed_checkpoints >= 3, "{m:?}");
    let mut last = HashMap::new();
    for (k, c) in got.take() {
        let e = last.entry(k).or_insert(0);
        *e = (*e).max(c);
    }
    assert_eq!(last.len(), 100_000);
    assert!(last.values().all(|c| *c == n / 100_000));
}

/// A long run of incremental checkpoints over a state that barely changes writes little
/// per checkpoint, past the 64th as before it: a segment's file was reused only
/// while the checkpoint that uploaded it was among the 64 newest complete ones, so every
/// 64 checkpoints the whole state was uploaded again.
#[test]
fn incremental_checkpoints_stay_small_past_64_checkpoints() {
    let dir = tempfile::tempdir().expect("tmp");
    let config = JobConfig::new()
        .with_shards(1)
        .with_pinning(Pinning::Never)
        // A poll takes a batch: small ones, so that barriers go in every few ms.
        .with_batch_records(16)
        .with_checkpointing(
            CheckpointConfig::new(dir.path(), "long")
                .with_interval(Duration::from_millis(10))
                .with_retained(1)
                .with_restart(RestartStrategy::None),
        );
    let job = Job::new(config);
    let fill = 50_000u64;
    let done = Arc::new(AtomicBool::new(false));
    let stop = done.clone();
    // The whole state first, then one key now and then until the test has seen enough
    // checkpoints.
    let _ = job
        .from_iter(move |_, _| {
            let stop = stop.clone();
            (0..fill).map(Some).chain(std::iter::from_fn(move || {
                std::thread::sleep(Duration::from_millis(1));
                (!stop.load(Ordering::Acquire)).then_some(None)
            }))
        })
        .map(|k: Option<u64>| (k.unwrap_or(0), 1u64))
        .key_by(|r| r.0)
        .reduce(|a, b| (a.0, a.1 + b.1))
        .collect();
    let h = job.start().expect("start");
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    // The history holds the newest 32: checkpoints 49 to 80 include those just past 64.
    while h.checkpoint_metrics().number_of_completed_checkpoints < 80 {
        assert!(std::time::Instant::now() < deadline, "too few checkpoints");
        std::thread::sleep(Duration::from_millis(10));
    }
    let m = h.checkpoint_metrics();
    done.store(true, Ordering::Release);
    h.wait().expect("the job");
    let full = m.last_checkpoint_full_size;
    let late: Vec<(u64, u64)> = m
        .history
        .iter()
        .filter(|s| s.failure.is_none() && s.checkpoint_id > 40)
        .map(|s| (s.checkpoint_id, s.size_bytes))
        .collect();
    assert!(!late.is_empty(), "{m:?}");
    assert!(
        late.iter().all(|(_, b)| *b * 4 < full),
        "full size {full}; checkpoints and their new bytes: {late:?}"
    );
}

/// `c` restoring from `restore`, if any, and with the small batches of a held job (`held`:
/// see [`HELD_BATCH_RECORDS`]).
/// An exactly-once job on `shards` unpinned shards checkpointing into `dir` ([`ck`]).
fn exactly_once(dir: &std::path::Path, shards: usize) -> JobConfig {
    JobConfig::new()
        .with_shards(shards)
        .with_pinning(Pinning::Never)
        .with_checkpointing(ck(dir, CheckpointMode::ExactlyOnce))
}

fn restoring(c: JobConfig, restore: Option<RestoreFrom>, held: bool) -> JobConfig {
    let c = match restore {
        Some(r) => c.with_restore(r),
        None => c,
    };
    if held {
        c.with_batch_records(HELD_BATCH_RECORDS)
    } else {
        c
    }
}

/// Waits (30 s at most) until `read(&h)` reaches `at` (else fails naming `what`), then until
/// two more checkpoints completed, so that one began past that point; then cancels the run
/// and releases its hold.
fn cancel_after_checkpoints_past(
    h: weir_runtime::JobHandle,
    hold: &Hold,
    read: impl Fn(&weir_runtime::JobHandle) -> u64,
    at: u64,
    what: &str,
) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while read(&h) < at {
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: the held input was not reached"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let done = h.checkpoint_metrics().number_of_completed_checkpoints;
    await_checkpoints(&h, done + 2);
    h.cancel();
    hold.release();
    assert!(matches!(h.wait(), Err(weir_runtime::JobError::Cancelled)));
}

/// The records operator `operator` dropped as late in a run, over every shard.
fn records_dropped(summary: &weir_runtime::JobSummary, operator: &str) -> u64 {
    summary
        .metrics
        .operators
        .iter()
        .filter(|o| o.operator == operator)
        .map(|o| o.records_dropped)
        .sum()
}

/// Waits (30 s at most) until `h` completed `n` checkpoints.
fn await_checkpoints(h: &weir_runtime::JobHandle, n: u64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while h.checkpoint_metrics().number_of_completed_checkpoints < n {
        assert!(
            std::time::Instant::now() < deadline,
            "{n} checkpoints did not complete"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Wait for a checkpoint triggered after the source `source_uid` emitted records: on a loaded
/// machine the first one can be taken before any record moved. The one in flight when the
/// records show may have been triggered before them, so it is the one after that.
fn await_checkpoint_past_start(h: &weir_runtime::JobHandle, source_uid: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while h.metrics().records_out(source_uid) == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "no record left the source"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let done = h.checkpoint_metrics().number_of_completed_checkpoints;
    await_checkpoints(h, done + 2);
}

/// Every emitted `(key, sum, index)` is the running sum at its index (the state was restored
/// as it was), and every key ends at its total.
fn assert_resumed_sums(
    got: &[(u64, i64, u64)],
    at: &HashMap<u64, i64>,
    expected: &HashMap<u64, i64>,
) {
    let mut last: HashMap<u64, (u64, i64)> = HashMap::new();
    for (k, sum, i) in got {
        assert_eq!(
            Some(sum),
            at.get(i),
            "key {k} at record {i}: state restored"
        );
        let e = last.entry(*k).or_insert((*i, *sum));
        if *i >= e.0 {
            *e = (*i, *sum);
        }
    }
    for (k, total) in expected {
        assert_eq!(
            last.get(k).map(|l| l.1),
            Some(*total),
            "key {k} ends at its total"
        );
    }
}

/// A job checkpoints on 2 shards and is cancelled; the same job restored onto 3 shards
/// continues from the checkpoint: every key's state moved with its key group, so every sum it
/// emits equals the sequential running sum at that record, and it ends at the key's total.
#[test]
fn restore_onto_another_number_of_shards_keeps_keyed_state() {
    let dir = tempfile::tempdir().expect("tmp");
    let n = 200_000u64;
    let Sums { data, expected, at } = Sums::new(n);
    let hold = Hold::new(n, n / 10);
    let run = |shards: usize, restore: bool, hold: Option<Hold>| {
        let c = restoring(
            exactly_once(dir.path(), shards),
            restore.then_some(RestoreFrom::Latest),
            hold.is_some(),
        );
        let job = Job::new(c);
        let out = running_sum_job(&job, &data, hold, "sum").collect();
        (job.start().expect("start"), out)
    };
    let (h, _) = run(2, false, Some(hold.clone()));
    resume_after_cancel(
        h,
        &hold,
        || run(3, true, None),
        n,
        (&at, &expected),
        "2 -> 3",
    );
}

/// Cancels held job `h` once a checkpoint past its source's start completed, lets `hold` go,
/// and runs the job `restored` starts to the end: it resumed mid-way, every sum it emitted is
/// the running sum at its record (`sums.0`), and every key ends at its total (`sums.1`).
fn resume_after_cancel(
    h: weir_runtime::JobHandle,
    hold: &Hold,
    restored: impl FnOnce() -> (
        weir_runtime::JobHandle,
        weir_runtime::sink::Collected<(u64, i64, u64)>,
    ),
    n: u64,
    sums: (&HashMap<u64, i64>, &HashMap<u64, i64>),
    what: &str,
) {
    await_checkpoint_past_start(&h, "input");
    h.cancel();
    hold.release();
    assert!(matches!(h.wait(), Err(weir_runtime::JobError::Cancelled)));
    let (h, out) = restored();
    h.wait()
        .unwrap_or_else(|e| panic!("{what} shards: restored job: {e}"));
    let got = out.take();
    assert!(
        !got.is_empty() && (got.len() as u64) < n,
        "{what}: resumed mid-way, {} records",
        got.len()
    );
    assert_resumed_sums(&got, sums.0, sums.1);
}

/// A source whose readers split the input among shards (a generator: shard `s` of `n` makes
/// the indices `s, s + n, ..`) restores onto fewer and onto more shards: the new readers take
/// over the old readers' splits (old shard `s` to new shard `s % shards`), so every record is
/// read once and each key's records, all in one split, keep their order. Every sum emitted
/// after the restore is the running sum at its record, and every key ends at its total.
/// Before, 3 -> 2 was refused ("positions cannot be merged"), and 2 -> 3 was refused or,
/// where an old index fitted the new stride, read other shards' records while the third
/// shard started over.
#[test]
fn a_split_source_restores_onto_fewer_and_more_shards() {
    for (before, after) in [(3usize, 2usize), (2, 3)] {
        let dir = tempfile::tempdir().expect("tmp");
        let n = 120_000u64;
        // A key lies in one split of the first run: its records' order is their index order.
        let split = before as u64;
        let record = move |i: u64, r: u64| (i % split + split * (r % 40), (r % 13) as i64 - 6, i);
        let (mut at, mut expected) = (HashMap::new(), HashMap::new());
        for i in 0..n {
            let (k, v, _) = record(i, weir_runtime::source::splitmix64(9, i));
            let s = expected.entry(k).or_insert(0i64);
            *s += v;
            at.insert(i, *s);
        }
        let hold = Hold::new(n, n / 10);
        let run = |shards: usize, restore: bool, hold: Option<Hold>| {
            let c = restoring(
                exactly_once(dir.path(), shards),
                restore.then_some(RestoreFrom::Latest),
                hold.is_some(),
            );
            let job = Job::new(c);
            let out = job
                .source(weir_runtime::source::GeneratorSource::new(
                    Some(n),
                    9,
                    record,
                ))
                .uid("input")
                .inspect(move |r: &(u64, i64, u64)| {
                    if let Some(hold) = &hold {
                        hold.delay(r.2);
                    }
                })
                .key_by(|r| r.0)
                .reduce(|a, b| (a.0, a.1 + b.1, b.2))
                .uid("sum")
                .collect();
            (job.start().expect("start"), out)
        };
        let (h, _) = run(before, false, Some(hold.clone()));
        let what = format!("{before} -> {after}");
        resume_after_cancel(
            h,
            &hold,
            || run(after, true, None),
            n,
            (&at, &expected),
            &what,
        );
    }
}

/// Watermarks are restored with the rest: a record that was late before a restore is late
/// after it. The input's tail is late (timestamps far behind the watermark), and the job is
/// stopped and restored while it reads the tail. Every window the restored run emits is one
/// the straight run emitted, with the same count. Before, the watermark generator and the
/// window operator started over from no watermark, so the first tail record after the
/// restore set a low watermark and the late records opened windows of their own again.
#[test]
fn a_record_late_before_a_restore_is_late_after_it() {
    let dir = tempfile::tempdir().expect("tmp");
    let (n, tail) = (4_000u64, 2_000u64);
    // Keys 0..4; timestamps rise by 10 ms, then the tail goes back to the first 500 ms.
    let records: Vec<(u64, i64, u64)> = (0..n)
        .map(|i| {
            let ts = if i < n - tail {
                i as i64 * 10
            } else {
                (i % 50) as i64 * 10
            };
            (i % 4, ts, i)
        })
        .collect();
    let run = |restore: bool, hold: Option<Hold>| {
        let c = restoring(
            exactly_once(dir.path(), 1),
            restore.then_some(RestoreFrom::Latest),
            hold.is_some(),
        );
        let job = Job::new(c);
        let out = job
            .from_vec(records.clone())
            .uid("input")
            .inspect(move |r: &(u64, i64, u64)| {
                if let Some(hold) = &hold {
                    hold.delay(r.2);
                }
            })
            .assign_timestamps(
                WatermarkStrategy::bounded_out_of_orderness(0, |r: &(u64, i64, u64)| r.1)
                    .with_watermark_per_record(),
            )
            .key_by(|r| r.0)
            .window(WindowAssigner::tumbling(100))
            .count_with(|k, w, c| (*k, w.start, c))
            .uid("counts")
            .collect();
        (job.start().expect("start"), out)
    };
    let straight = {
        let job = Job::new(JobConfig::new().with_shards(1).with_pinning(Pinning::Never));
        let out = job
            .from_vec(records.clone())
            .assign_timestamps(
                WatermarkStrategy::bounded_out_of_orderness(0, |r: &(u64, i64, u64)| r.1)
                    .with_watermark_per_record(),
            )
            .key_by(|r| r.0)
            .window(WindowAssigner::tumbling(100))
            .count_with(|k, w, c| (*k, w.start, c))
            .collect();
        job.run().expect("straight run");
        out.take()
    };
    // The held tail reads a record a millisecond: checkpoints complete inside it.
    let hold = Hold::new(n, tail);
    let (h, _) = run(false, Some(hold.clone()));
    let read = |h: &weir_runtime::JobHandle| h.metrics().records_out("input");
    cancel_after_checkpoints_past(h, &hold, read, n - tail + 20, "the tail");
    let (h, out) = run(true, None);
    let summary = h.wait().expect("restored run");
    assert!(
        records_dropped(&summary, "counts") > 0,
        "the restored run read late records"
    );
    let got = out.take();
    for w in &got {
        assert!(
            straight.contains(w),
            "window {w:?} is not the straight run's"
        );
    }
}

/// A window count per key: `(key, window start, count)`.
type WindowCount = (u64, i64, u64);

/// Runs the job `job_of` builds (its windows' uid `counts`, reading `(key, timestamp, position
/// in its split)` from the sources `sources`, `per_split` records each split) straight on 2
/// shards, then held on 2 shards (every split's second half a record a millisecond) until
/// both halves are read and two more checkpoints completed, cancels it, and restores it onto
/// 1 shard with small polls, so that the splits' records take turns. The restored run must
/// drop no record as late, and every window it fires must be the straight run's.
fn assert_on_time_after_a_restore_onto_one_shard(
    what: &str,
    per_split: u64,
    sources: &[&str],
    job_of: impl Fn(&Job, Option<Hold>) -> weir_runtime::sink::Collected<WindowCount>,
) {
    let dir = tempfile::tempdir().expect("tmp");
    let straight = {
        let job = Job::new(JobConfig::new().with_shards(2).with_pinning(Pinning::Never));
        let out = job_of(&job, None);
        job.run().expect("straight run");
        out.take()
    };
    let hold = Hold::new(per_split, per_split / 2);
    let job = Job::new(restoring(exactly_once(dir.path(), 2), None, true));
    let _ = job_of(&job, Some(hold.clone()));
    let h = job.start().expect("start");
    let read = |h: &weir_runtime::JobHandle| -> u64 {
        sources.iter().map(|s| h.metrics().records_out(s)).sum()
    };
    cancel_after_checkpoints_past(h, &hold, read, per_split + 40, what);
    let job = Job::new(restoring(
        exactly_once(dir.path(), 1),
        Some(RestoreFrom::Latest),
        true,
    ));
    let out = job_of(&job, None);
    let summary = job.start().expect("restore").wait().expect("restored run");
    let dropped = records_dropped(&summary, "counts");
    assert_eq!(dropped, 0, "{what}: records dropped as late");
    let got = out.take();
    assert!(!got.is_empty(), "{what}: the restored run fired windows");
    for w in &got {
        assert!(
            straight.contains(w),
            "{what}: window {w:?} is not the straight run's"
        );
    }
}

/// `(key, timestamp, position)` records of split `shard`, 20 s of event time ahead on shard 0
/// (the split a reader of both reads first).
fn split_records(shard: usize, n: u64) -> impl Iterator<Item = (u64, i64, u64)> {
    let ahead = if shard == 0 { 20_000 } else { 0 };
    (0..n).map(move |i| (i % 4, ahead + i as i64 * 10, i))
}

/// Holds a record of a held run at its position; lets it through otherwise.
fn held(hold: Option<Hold>) -> impl Fn(&(u64, i64, u64)) + Send + Sync + 'static {
    move |r| {
        if let Some(hold) = &hold {
            hold.delay(r.2);
        }
    }
}

fn per_record() -> WatermarkStrategy<(u64, i64, u64)> {
    WatermarkStrategy::bounded_out_of_orderness(0, |r: &(u64, i64, u64)| r.1)
        .with_watermark_per_record()
}

/// Tumbling windows of 100 ms counted per key, uid `counts`.
fn window_counts(
    s: weir_runtime::Stream<(u64, i64, u64)>,
) -> weir_runtime::sink::Collected<WindowCount> {
    s.key_by(|r| r.0)
        .window(WindowAssigner::tumbling(100))
        .count_with(|k, w, c| (*k, w.start, c))
        .uid("counts")
        .collect()
}

/// Watermarks per split: a restore onto fewer shards gives a reader the splits of several
/// old readers, which it reads in turn; the watermark follows the least of their largest
/// timestamps, so the records of a split that lags are on time when they were on time
/// before. One split is 20 s of event time ahead of the other. Before, the watermark
/// followed the first split to its end, and 272 records of the other were dropped.
#[test]
fn records_on_time_before_a_restore_onto_fewer_shards_are_on_time_after_it() {
    let n = 2_000;
    assert_on_time_after_a_restore_onto_one_shard("one source", n, &["input"], |job, hold| {
        let input = job
            .from_iter(move |shard, _| split_records(shard, n))
            .uid("input");
        window_counts(input.inspect(held(hold)).assign_timestamps(per_record()))
    });
}

/// Watermarks per split through a union and through two timestamp assigners in a row: two
/// sources each read on one shard (`a` on shard 0, `b` on shard 1), unioned; or one source,
/// under two assigners. Before, an assigner after a union took its input as one stream (848
/// records dropped), and of two assigners in a row only the nearer to the source kept splits
/// apart (528 dropped).
#[test]
fn splits_stay_apart_through_a_union_and_a_second_assigner_after_a_restore() {
    let n = 2_000;
    assert_on_time_after_a_restore_onto_one_shard("union", n, &["a", "b"], |job, hold| {
        let only = move |on: usize| {
            move |shard: usize, _| split_records(on, if shard == on { n } else { 0 })
        };
        let a = job.from_iter(only(0)).uid("a");
        let b = job.from_iter(only(1)).uid("b");
        window_counts(
            a.union(b)
                .inspect(held(hold))
                .assign_timestamps(per_record()),
        )
    });
    assert_on_time_after_a_restore_onto_one_shard("two assigners", n, &["input"], |job, hold| {
        let input = job
            .from_iter(move |shard, _| split_records(shard, n))
            .uid("input");
        let inner = input
            .inspect(held(hold))
            .assign_timestamps(per_record())
            .uid("inner");
        window_counts(inner.assign_timestamps(per_record()))
    });
}

/// The end of input is no watermark to restore: a finished job's final checkpoint, restored
/// into the job with a third source unioned in, counts every record of the new source (its
/// timestamps start far behind the others'). Before, the timestamp assigner stored the
/// end-of-input watermark and sent it again after the restore, and all 1,000 were dropped.
#[test]
fn a_source_added_after_a_final_checkpoint_is_not_behind_an_ended_watermark() {
    let dir = tempfile::tempdir().expect("tmp");
    let n = 1_000;
    let build = |job: &Job, with_c: bool| {
        // Read on the first shard only: split 0's records (20 s ahead) or split 1's.
        let only_first = move |split: usize| {
            move |shard: usize, _| split_records(split, if shard == 0 { n } else { 0 })
        };
        let a = job.from_iter(only_first(0)).uid("a");
        let b = job.from_iter(only_first(0)).uid("b");
        let mut u = a.union(b);
        if with_c {
            u = u.union(job.from_iter(only_first(1)).uid("c"));
        }
        window_counts(u.assign_timestamps(per_record()).uid("wm"))
    };
    let job = Job::new(exactly_once(dir.path(), 1));
    let _ = build(&job, false);
    job.run().expect("first run");
    let job = Job::new(restoring(
        exactly_once(dir.path(), 1),
        Some(RestoreFrom::Latest),
        false,
    ));
    let out = build(&job, true);
    let summary = job.run().expect("restored run");
    let dropped = records_dropped(&summary, "counts");
    assert_eq!(dropped, 0, "records of the added source dropped as late");
    let counted: u64 = out.take().iter().map(|w| w.2).sum();
    assert_eq!(counted, n, "only the added source's records are new");
}

/// A restore must find an operator for every state the checkpoint holds. The same job with
/// its keyed operator's uid changed (`sum` to `total`) is refused before any record moves,
/// naming `sum`; with `with_allow_non_restored_state` it runs: the source resumes at its
/// position and `total` starts empty, so each key's first sum is that record's own value.
#[test]
fn a_restore_refuses_state_no_operator_takes_unless_allowed() {
    let dir = tempfile::tempdir().expect("tmp");
    let n = 100_000u64;
    let Sums { data, .. } = Sums::new(n);
    let hold = Hold::new(n, n / 10);
    let run = |uid: &str, restore: bool, allow: bool, hold: Option<Hold>| {
        let c = restoring(
            exactly_once(dir.path(), 2).with_allow_non_restored_state(allow),
            restore.then_some(RestoreFrom::Latest),
            hold.is_some(),
        );
        let job = Job::new(c);
        let out = running_sum_job(&job, &data, hold, uid).collect();
        (job.start().expect("start"), out)
    };
    let (h, _) = run("sum", false, false, Some(hold.clone()));
    // Under load a first checkpoint before any record would make the restore below start
    // from the beginning (seen once with two test binaries at a time on 2 vCPUs).
    await_checkpoint_past_start(&h, "input");
    h.cancel();
    hold.release();
    assert!(matches!(h.wait(), Err(weir_runtime::JobError::Cancelled)));

    let (h, out) = run("total", true, false, None);
    match h.wait() {
        Err(weir_runtime::JobError::Start(weir_runtime::StartError::Restore { reason })) => {
            assert!(
                reason.contains("`sum` (keyed)") && reason.contains("--allow-non-restored-state"),
                "{reason}"
            );
            assert!(
                !reason.contains("input"),
                "the source was matched: {reason}"
            );
        }
        other => panic!("expected a refused restore, got {other:?}"),
    }
    assert!(out.take().is_empty(), "no record moved");

    let (h, out) = run("total", true, true, None);
    h.wait().expect("restored job skipping `sum`");
    let got = out.take();
    assert!(
        !got.is_empty() && (got.len() as u64) < n,
        "the source resumed mid-way: {} records",
        got.len()
    );
    let mut first: HashMap<u64, (u64, i64)> = HashMap::new();
    for (k, sum, i) in &got {
        let e = first.entry(*k).or_insert((*i, *sum));
        if *i < e.0 {
            *e = (*i, *sum);
        }
    }
    for (k, (i, sum)) in first {
        assert_eq!(
            sum, data[i as usize].1,
            "key {k} starts empty at record {i}"
        );
    }
}

/// A stop-with-savepoint whose checkpoint completes but whose copy fails (here: the savepoint
/// directory is a file) returns the error and leaves the job running, as Flink's does when
/// its savepoint fails: it checkpoints again and, its input read, commits every record's sum
/// once. Before, the shards ended as the stop's checkpoint completed, so the job finished
/// with half its output and no savepoint (`weir run`, asked to stop on a full disk, said
/// "the job goes on" and exited 0).
#[test]
fn a_stop_whose_savepoint_is_not_copied_out_leaves_the_job_running() {
    let dir = tempfile::tempdir().expect("tmp");
    let out = dir.path().join("out");
    let not_a_dir = dir.path().join("file");
    std::fs::write(&not_a_dir, "x").expect("file");
    let n = 100_000u64;
    let Sums { data, at, .. } = Sums::new(n);
    let hold = Hold::new(n, n / 10);
    let c = restoring(exactly_once(&dir.path().join("ckpt"), 2), None, true);
    let job = Job::new(c);
    sums_to_files(
        running_sum_job(&job, &data, Some(hold.clone()), "sum"),
        &out,
    );
    let h = job.start().expect("start");
    await_checkpoints(&h, 1);
    let stop_id = match h.stop_with_savepoint(&not_a_dir) {
        Err(weir_runtime::SavepointError::Export { checkpoint_id, .. }) => checkpoint_id,
        other => panic!("expected a failed copy, got {other:?}"),
    };
    hold.release();
    let summary = h.wait().expect("the job ran on to its end");
    assert!(
        summary
            .checkpoints
            .last_completed_checkpoint_id
            .is_some_and(|id| id > stop_id),
        "checkpoints went on after the withdrawn stop's {stop_id}: {:?}",
        summary.checkpoints.last_completed_checkpoint_id
    );
    assert_every_sum_once(&parse_sums(committed_lines(&out)), &at, n);
}

/// A failover whose newest checkpoint has a damaged file (one only it uses) does not restore
/// it. Falling back to the checkpoint before could commit output twice (the file sink
/// committed what the newer one's transactions held), so the job stops with an error naming
/// the checkpoint, the file and its offset, and what was committed stays exactly once. With
/// `allow_fallback` the failover restores the older checkpoint and the job completes every
/// record (those between the two checkpoints may be committed twice: the price accepted).
/// The startup restore of such a directory is the CLI tests'; this is the failover's path.
#[test]
fn a_failover_past_a_damaged_checkpoint_stops_unless_fallback_is_allowed() {
    for allow in [false, true] {
        let dir = tempfile::tempdir().expect("tmp");
        let (ckpt, out) = (dir.path().join("ckpt"), dir.path().join("out"));
        let n = 60_000u64;
        let Sums { data, at, .. } = Sums::new(n);
        // Most of the input trickles, so that records still flow when the failure is set.
        let hold = Hold::new(n, n - 2_000);
        let fail = Arc::new(AtomicBool::new(false));
        let c = JobConfig::new()
            .with_shards(2)
            .with_pinning(Pinning::Never)
            .with_batch_records(HELD_BATCH_RECORDS)
            .with_allow_fallback(allow)
            .with_checkpointing(
                // Manual checkpoints only: none completes between the damage and the failure.
                CheckpointConfig::new(&ckpt, "verify")
                    .with_mode(CheckpointMode::ExactlyOnce)
                    .with_retained(2)
                    .with_restart(RestartStrategy::FixedDelay {
                        attempts: 1,
                        delay: Duration::ZERO,
                    }),
            );
        let job = Job::new(c);
        let failing = fail.clone();
        let sums = running_sum_job(&job, &data, Some(hold.clone()), "sum").inspect(
            move |_: &(u64, i64, u64)| {
                if failing.swap(false, Ordering::AcqRel) {
                    panic!("injected failure");
                }
            },
        );
        sums_to_files(sums, &out);
        let h = job.start().expect("start");
        // Records in each checkpoint's sink transactions: the fallback would repeat some.
        let mut ids = Vec::new();
        for _ in 0..2 {
            let seen = h.metrics().records_out("input");
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            while h.metrics().records_out("input") < seen + 500 {
                assert!(std::time::Instant::now() < deadline, "records stopped");
                std::thread::sleep(Duration::from_millis(2));
            }
            let done = h.checkpoint_metrics().number_of_completed_checkpoints;
            h.trigger_checkpoint().expect("trigger");
            await_checkpoints(&h, done + 1);
            ids.push(
                h.checkpoint_metrics()
                    .last_completed_checkpoint_id
                    .expect("completed"),
            );
        }
        let (older, newer) = (ids[0], ids[1]);
        let only_newer: Vec<_> = shared_files(&ckpt, newer)
            .difference(&shared_files(&ckpt, older))
            .cloned()
            .collect();
        let damaged = ckpt.join("verify").join(&only_newer[0]);
        let mut bytes = std::fs::read(&damaged).expect("read");
        let at_byte = bytes.len() / 2;
        bytes[at_byte] ^= 0x10;
        std::fs::write(&damaged, &bytes).expect("damage");
        fail.store(true, Ordering::Release);
        let name = damaged.file_name().unwrap().to_string_lossy().into_owned();
        if !allow {
            let e = h
                .wait()
                .expect_err("the failover must not fall back")
                .to_string();
            for part in [
                format!("checkpoint {newer} does not verify"),
                name.clone(),
                "offset".into(),
                format!("falling back to checkpoint {older} could duplicate"),
            ] {
                assert!(e.contains(&part), "{part:?} not in: {e}");
            }
            let got = parse_sums(committed_lines(&out));
            assert!(!got.is_empty(), "checkpoint {newer} committed records");
            let mut seen = std::collections::HashSet::new();
            for (k, sum, i) in &got {
                assert_eq!(Some(sum), at.get(i), "key {k} at record {i}");
                assert!(seen.insert(*i), "record {i} committed twice");
            }
        } else {
            hold.release();
            let summary = h.wait().expect("the fallback completes the job");
            assert_eq!(summary.restarts, 1);
            assert_eq!(summary.checkpoints.last_restored_checkpoint_id, Some(older));
            let got = parse_sums(committed_lines(&out));
            let mut seen = std::collections::HashSet::new();
            for (k, sum, i) in &got {
                assert_eq!(Some(sum), at.get(i), "key {k} at record {i}");
                seen.insert(*i);
            }
            assert_eq!(seen.len() as u64, n, "every record committed");
        }
    }
}

/// I/O failures of the exactly-once file sink while the job runs, one per run: a torn write
/// of a part file, a failed fsync at a barrier (its checkpoint cannot complete), a failed
/// rename (of a part file made pending at a barrier, or of a pending file at its commit after
/// its checkpoint completed, which the restore then publishes). Each fails the job, the
/// restart restores the latest complete checkpoint, and the committed output ends with every
/// record's sum exactly once.
#[test]
fn sink_io_failures_fail_over_and_the_output_stays_exactly_once() {
    for fault in [Fault::TearWrite, Fault::FailSync, Fault::FailRename] {
        run_with_an_io_fault(fault, "", FaultIn::Sink, 1);
    }
}

/// I/O failures of the checkpoint storage while the job runs, one per run: a torn write, a
/// failed fsync, a failed rename of a checkpoint's `_metadata` into place. The checkpoint
/// fails, which fails the job (no failure is tolerated); the restart restores the latest
/// complete checkpoint and the committed output ends with every record's sum exactly once.
/// A failed rename of the `COMPLETED` record, written after the metadata is durable, fails
/// nothing: the record is best effort (it may only say less), the checkpoint completes and
/// its transactions commit, and the job goes on without a restart.
#[test]
fn checkpoint_storage_io_failures_fail_over_and_the_output_stays_exactly_once() {
    for fault in [Fault::TearWrite, Fault::FailSync, Fault::FailRename] {
        run_with_an_io_fault(fault, "", FaultIn::Storage, 1);
    }
    run_with_an_io_fault(
        Fault::FailRename,
        weir_io::COMPLETED_FILE,
        FaultIn::Storage,
        0,
    );
}

/// I/O failures of the shards' state stores while the job runs, one per run: a torn write
/// and a failed fsync of the segment a checkpoint's snapshot writes. The snapshot fails, its
/// checkpoint is declined, which fails the job (no failure is tolerated); the restart
/// restores every store from the latest complete checkpoint, and the committed output ends
/// with every record's sum exactly once.
#[test]
fn state_store_io_failures_fail_over_and_the_output_stays_exactly_once() {
    for fault in [Fault::TearWrite, Fault::FailSync] {
        run_with_an_io_fault(fault, "", FaultIn::State, 1);
    }
}

/// A checkpoint failed by the storage's I/O (its `_metadata` not written, or not renamed into
/// place) within the tolerable number of failures: the job goes on without a restart, the
/// sink's transactions of the failed checkpoint are committed with the next complete one,
/// and every record's sum is committed exactly once.
#[test]
fn a_checkpoint_failed_by_storage_io_within_the_tolerable_number_commits_with_the_next() {
    for fault in [Fault::TearWrite, Fault::FailRename] {
        run_with_an_io_fault(fault, "_metadata", FaultIn::Storage, 0);
    }
}

/// A restore that fails is an attempt like any other: after an injected failure the restart
/// restores the latest checkpoint, and meets an I/O error there. That attempt fails, the
/// restart strategy's next one restores the checkpoint again, and every record's sum is
/// committed exactly once. In the state store: a hard link of a segment fails and its copy
/// is torn. In the sink: the directory fsync after it removed its files in progress fails.
#[test]
fn a_restore_that_fails_is_retried_by_the_restart_strategy() {
    restore_fails_once(FaultIn::Storage, &[Fault::FailLink, Fault::TearWrite]);
    restore_fails_once(FaultIn::Sink, &[Fault::FailSyncDir]);
}

/// See [`a_restore_that_fails_is_retried_by_the_restart_strategy`]: `faults` armed in
/// `place` once a checkpoint is complete and committed, then an operator panics.
fn restore_fails_once(place: FaultIn, faults: &[Fault]) {
    let r = FaultRun::new();
    let fail = Arc::new(AtomicBool::new(false));
    // Manual checkpoints only: nothing links, copies or publishes a file between the arming
    // of the faults and the restore.
    let checkpointing = CheckpointConfig::new(&r.ckpt, "restore-fault")
        .with_mode(CheckpointMode::ExactlyOnce)
        .with_restart(RestartStrategy::FixedDelay {
            attempts: 2,
            delay: Duration::ZERO,
        });
    let job = r.job(checkpointing, place);
    let failing = fail.clone();
    let sums = running_sum_job(&job, &r.data, Some(r.hold.clone()), "sum").inspect(
        move |_: &(u64, i64, u64)| {
            if failing.swap(false, Ordering::AcqRel) {
                panic!("injected failure");
            }
        },
    );
    sums.sink(r.sink(place)).uid("out");
    let h = job.start().expect("start");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while h.metrics().records_out("input") < 1_000 {
        assert!(std::time::Instant::now() < deadline, "records stopped");
        std::thread::sleep(Duration::from_millis(2));
    }
    h.trigger_checkpoint().expect("trigger");
    await_checkpoints(&h, 1);
    // Both shards' commits of it are done: their part files are published.
    while visible_files(&r.out) < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "checkpoint 1 not committed"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    for &f in faults {
        r.fs.arm(f);
    }
    fail.store(true, Ordering::Release);
    // The failure, then the failed restore.
    r.end_after_the_faults(h, 2, &format!("{faults:?} in {place:?}"));
}

/// What an I/O-fault test runs: a running sum over 40,000 records, most of them trickling
/// (so that records and checkpoints still flow when a fault is armed), into the exactly-once
/// file sink, with the `FaultyFs` the faults are armed on.
struct FaultRun {
    _dir: tempfile::TempDir,
    ckpt: std::path::PathBuf,
    out: std::path::PathBuf,
    n: u64,
    data: Vec<(u64, i64, u64)>,
    at: HashMap<u64, i64>,
    hold: Hold,
    fs: FaultyFs,
}

impl FaultRun {
    fn new() -> FaultRun {
        let dir = tempfile::tempdir().expect("tmp");
        let n = 40_000u64;
        let Sums { data, at, .. } = Sums::new(n);
        FaultRun {
            ckpt: dir.path().join("ckpt"),
            out: dir.path().join("out"),
            _dir: dir,
            n,
            data,
            at,
            hold: Hold::new(n, n - 2_000),
            fs: FaultyFs::new(FaultConfig::default()),
        }
    }

    /// A job on two shards checkpointing as `checkpointing` says, with the faulty file system
    /// in the checkpoint storage or the state stores if `place` says so.
    fn job(&self, mut checkpointing: CheckpointConfig, place: FaultIn) -> Job {
        if let FaultIn::Storage = place {
            checkpointing = checkpointing.with_fs(Arc::new(self.fs.clone()));
        }
        let mut config = JobConfig::new()
            .with_shards(2)
            .with_pinning(Pinning::Never)
            .with_batch_records(HELD_BATCH_RECORDS)
            .with_checkpointing(checkpointing);
        if let FaultIn::State = place {
            config = config.with_state_fs(Arc::new(self.fs.clone()));
        }
        Job::new(config)
    }

    /// The sums' sink into `out`, on the faulty file system if `place` is the sink.
    fn sink(
        &self,
        place: FaultIn,
    ) -> TransactionalFileSink<impl Fn(&(u64, i64, u64), &mut String) + Send + Sync + 'static> {
        let sink = sum_sink(&self.out);
        match place {
            FaultIn::Sink => sink.with_fs(Arc::new(self.fs.clone())),
            _ => sink,
        }
    }

    /// [`end_after_the_faults`], then every record's sum committed exactly once.
    fn end_after_the_faults(&self, h: weir_runtime::JobHandle, restarts: u64, what: &str) {
        end_after_the_faults(h, &self.fs, &self.hold, restarts, what);
        assert_every_sum_once(&parse_sums(committed_lines(&self.out)), &self.at, self.n);
    }
}

/// Waits (30 s at most) until every fault armed on `fs` fired, lets the held input end, waits
/// for the job, and checks that it restarted `restarts` times. `what` names the case.
fn end_after_the_faults(
    h: weir_runtime::JobHandle,
    fs: &FaultyFs,
    hold: &Hold,
    restarts: u64,
    what: &str,
) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while fs.is_armed() {
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: no operation met the fault"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    hold.release();
    let summary = h
        .wait()
        .unwrap_or_else(|e| panic!("{what}: the restart completes the job: {e}"));
    assert_eq!(summary.restarts, restarts, "{what}");
}

/// Files under `dir` whose names do not start with `.` (published ones).
fn visible_files(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir).map_or(0, |d| {
        d.flatten()
            .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
            .count()
    })
}

/// Where [`run_with_an_io_fault`] injects its fault.
#[derive(Debug, Clone, Copy)]
enum FaultIn {
    /// The exactly-once file sink's file system.
    Sink,
    /// The checkpoint storage's.
    Storage,
    /// The shards' state stores'.
    State,
}

/// A running sum into the exactly-once file sink, checkpointing every 20 ms with one restart
/// allowed, gets `fault` armed in `place` (for files whose names start with `name`) once a
/// checkpoint completed while records flow: the job must restart `restarts` times and commit
/// every record's sum exactly once. No failed checkpoint is tolerated when a restart is
/// expected, one when none is.
fn run_with_an_io_fault(fault: Fault, name: &str, place: FaultIn, restarts: u64) {
    let r = FaultRun::new();
    let checkpointing = CheckpointConfig::new(&r.ckpt, "io-fault")
        .with_mode(CheckpointMode::ExactlyOnce)
        .with_interval(Duration::from_millis(20))
        .with_tolerable_failures(u32::from(restarts == 0))
        .with_restart(RestartStrategy::FixedDelay {
            attempts: 1,
            delay: Duration::ZERO,
        });
    let job = r.job(checkpointing, place);
    running_sum_job(&job, &r.data, Some(r.hold.clone()), "sum")
        .sink(r.sink(place))
        .uid("out");
    let h = job.start().expect("start");
    await_checkpoint_past_start(&h, "input");
    r.fs.arm_for(fault, name);
    r.end_after_the_faults(h, restarts, &format!("{fault:?} {name:?} in {place:?}"));
}

/// Writes a running sum's `key,sum,index` lines to `out` through the exactly-once file sink
/// (uid `out`).
fn sums_to_files(sums: weir_runtime::Stream<(u64, i64, u64)>, out: &std::path::Path) {
    sums.sink(sum_sink(out)).uid("out");
}

/// The exactly-once file sink of a running sum's `key,sum,index` lines into `out`.
fn sum_sink(
    out: &std::path::Path,
) -> TransactionalFileSink<impl Fn(&(u64, i64, u64), &mut String) + Send + Sync + 'static> {
    TransactionalFileSink::new(
        out.to_path_buf(),
        |r: &(u64, i64, u64), line: &mut String| {
            line.push_str(&format!("{},{},{}", r.0, r.1, r.2));
        },
    )
}

/// The `key,sum,index` lines of a running-sum job's file sink.
fn parse_sums(lines: Vec<String>) -> Vec<(u64, i64, u64)> {
    lines
        .iter()
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            (
                f[0].parse().expect("key"),
                f[1].parse().expect("sum"),
                f[2].parse().expect("index"),
            )
        })
        .collect()
}

/// Every record `0..n` was emitted exactly once, with the running sum at its index.
fn assert_every_sum_once(got: &[(u64, i64, u64)], at: &HashMap<u64, i64>, n: u64) {
    let mut all: Vec<u64> = got
        .iter()
        .map(|(k, sum, i)| {
            assert_eq!(Some(sum), at.get(i), "key {k} at record {i}");
            *i
        })
        .collect();
    all.sort_unstable();
    if all != (0..n).collect::<Vec<_>>() {
        // Named, not listed: the records are tens of thousands.
        let mut count = vec![0u32; n as usize];
        for &i in &all {
            if let Some(c) = count.get_mut(i as usize) {
                *c += 1;
            }
        }
        let missing: Vec<usize> = (0..count.len()).filter(|&i| count[i] == 0).collect();
        let twice: Vec<usize> = (0..count.len()).filter(|&i| count[i] > 1).collect();
        panic!(
            "every record's sum exactly once: {} of {n} missing (first {:?}), {} more than once \
             (first {:?}), {} past the input",
            missing.len(),
            &missing[..missing.len().min(5)],
            twice.len(),
            &twice[..twice.len().min(5)],
            all.iter().filter(|&&i| i >= n).count()
        );
    }
}

/// The lines of the visible (committed) files under `dir`.
fn committed_lines(dir: &std::path::Path) -> Vec<String> {
    let mut lines = Vec::new();
    for e in std::fs::read_dir(dir).expect("output dir").flatten() {
        if e.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        let text = std::fs::read_to_string(e.path()).expect("part file");
        lines.extend(text.lines().map(str::to_owned));
    }
    lines
}

/// Flink's stop-with-savepoint: a running job with an exactly-once file sink stops with a
/// savepoint while its input is half read. `wait` returns `Ok`, no checkpoint completed
/// after the savepoint, and what was committed is exactly the running sums up to it: a job
/// restored from the savepoint then completes the output with every record's sum once,
/// none lost and none twice.
#[test]
fn stop_with_savepoint_commits_up_to_the_savepoint_and_ends_the_job() {
    let dir = tempfile::tempdir().expect("tmp");
    let (out, sps) = (dir.path().join("out"), dir.path().join("savepoints"));
    let n = 200_000u64;
    let Sums { data, at, .. } = Sums::new(n);
    let hold = Hold::new(n, n / 10);
    let run = |ckpt: &str, restore: Option<RestoreFrom>, hold: Option<Hold>| {
        let c = restoring(
            exactly_once(&dir.path().join(ckpt), 2),
            restore,
            hold.is_some(),
        );
        let job = Job::new(c);
        sums_to_files(running_sum_job(&job, &data, hold, "sum"), &out);
        job.start().expect("start")
    };
    let h = run("ckpt", None, Some(hold.clone()));
    await_checkpoints(&h, 1);
    let sp = h.stop_with_savepoint(&sps).expect("stop with savepoint");
    hold.release();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !h.is_finished() {
        assert!(std::time::Instant::now() < deadline, "the job did not stop");
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(h.status(), weir_runtime::JobStatus::Finished);
    let summary = h.wait().expect("a stopped job ends well");
    let sp_id: u64 = sp
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.split('-').nth(1))
        .and_then(|id| id.parse().ok())
        .expect("savepoint-<id>-<nonce>");
    assert_eq!(
        summary.checkpoints.last_completed_checkpoint_id,
        Some(sp_id),
        "no checkpoint after the savepoint"
    );
    let first = parse_sums(committed_lines(&out));
    assert!(
        !first.is_empty() && (first.len() as u64) < n,
        "stopped mid-way: {} lines committed",
        first.len()
    );
    for (k, sum, i) in &first {
        assert_eq!(Some(sum), at.get(i), "key {k} at record {i}");
    }

    let h = run("ckpt2", Some(RestoreFrom::Path(sp)), None);
    h.wait().expect("restored job");
    assert_every_sum_once(&parse_sums(committed_lines(&out)), &at, n);
}

/// A run restored from a savepoint and killed before its first checkpoint is continued by
/// `latest` from that savepoint, as its own failover would be: the directory holds no
/// checkpoint, and starting from the beginning committed the records before the savepoint a
/// second time. The run's `RUN_ORIGIN` says where it started.
#[test]
fn latest_after_a_restored_run_without_checkpoints_restores_what_that_run_restored() {
    latest_after_a_restored_run("ckpt2", false);
}

/// The same, the restored run checkpointing into the directory the savepoint's job used, and
/// its `COMPLETED` record torn: beside checkpoints with their `_metadata` that says nothing,
/// and `latest` still continues from the savepoint.
#[test]
fn latest_after_a_restored_run_in_the_same_directory_passes_a_torn_completed_record() {
    latest_after_a_restored_run("ckpt", true);
}

/// See the tests above: the restored run checkpoints into `second`, with `COMPLETED` torn
/// after it was cancelled if `tear`.
fn latest_after_a_restored_run(second: &str, tear: bool) {
    let dir = tempfile::tempdir().expect("tmp");
    let (out, sps) = (dir.path().join("out"), dir.path().join("savepoints"));
    let n = 200_000u64;
    let Sums { data, at, .. } = Sums::new(n);
    let run = |ckpt: &str, restore: Option<RestoreFrom>, hold: Option<Hold>, every: Duration| {
        let mut c = restoring(
            exactly_once(&dir.path().join(ckpt), 2),
            restore,
            hold.is_some(),
        );
        c.checkpoint = c.checkpoint.map(|k| k.with_interval(every));
        let job = Job::new(c);
        sums_to_files(running_sum_job(&job, &data, hold, "sum"), &out);
        job.start().expect("start")
    };
    let hold = Hold::new(n, n / 10);
    let h = run("ckpt", None, Some(hold.clone()), Duration::from_millis(20));
    await_checkpoints(&h, 1);
    let sp = h.stop_with_savepoint(&sps).expect("stop with savepoint");
    hold.release();
    h.wait().expect("a stopped job ends well");
    let sp_id = weir_io::Savepoint::open(std::sync::Arc::new(weir_io::StdFs), &sp)
        .expect("savepoint")
        .metadata()
        .checkpoint_id;

    // Restored, every record slow, no checkpoint for an hour: cancelled, as a kill would.
    let slow = Hold::new(n, n);
    let h = run(
        second,
        Some(RestoreFrom::Path(sp.clone())),
        Some(slow.clone()),
        Duration::from_secs(3600),
    );
    // Running: its shards are built, and it recorded where it started.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while h.status() != weir_runtime::JobStatus::Running {
        assert!(
            std::time::Instant::now() < deadline,
            "the job did not start"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    h.cancel();
    slow.release();
    assert!(h.wait().is_err(), "a cancelled job");
    let job_dir = dir.path().join(second).join("verify");
    let run_origin = || {
        weir_io::CheckpointStorage::open_read_only_with(
            std::sync::Arc::new(weir_io::StdFs),
            &dir.path().join(second),
            "verify",
            weir_runtime::checkpoint::storage_options(),
        )
        .expect("storage")
        .run_origin()
        .expect("record")
        .expect("the run recorded its origin")
    };
    let origin = run_origin();
    assert_eq!(origin.restored, Some((sp_id, weir_io::resolved_path(&sp))));
    assert!(
        std::fs::read_dir(&job_dir)
            .expect("job dir")
            .flatten()
            .all(|e| e
                .file_name()
                .to_str()
                .and_then(|n| n.strip_prefix("chk-"))
                .and_then(|id| id.parse::<u64>().ok())
                .is_none_or(|id| id < origin.first_id)),
        "the restored run began no checkpoint"
    );
    if tear {
        let record = job_dir.join(weir_io::COMPLETED_FILE);
        let mut b = std::fs::read(&record).expect("a completed checkpoint's record");
        b[0] ^= 0x01;
        std::fs::write(&record, b).expect("tear");
    }

    // Without the savepoint the run cannot be continued: the start stops, naming it.
    let moved = dir.path().join("moved");
    std::fs::rename(&sp, &moved).expect("move the savepoint away");
    let c = exactly_once(&dir.path().join(second), 2).with_restore(RestoreFrom::Latest);
    let job = Job::new(c);
    sums_to_files(running_sum_job(&job, &data, None, "sum"), &out);
    let e = job
        .start()
        .err()
        .expect("no savepoint to continue from")
        .to_string();
    assert!(
        e.contains(sp.to_str().expect("utf8")) && e.contains("--allow-fallback"),
        "{e}"
    );
    std::fs::rename(&moved, &sp).expect("move it back");

    // `latest` runs to the end: the checkpoint it restored; every sum is committed once.
    let latest = || {
        let h = run(
            second,
            Some(RestoreFrom::Latest),
            None,
            Duration::from_millis(20),
        );
        let summary = h.wait().expect("continued");
        assert_every_sum_once(&parse_sums(committed_lines(&out)), &at, n);
        summary.checkpoints.last_restored_checkpoint_id
    };
    assert_eq!(latest(), Some(sp_id));

    // The savepoint again: the sink refuses it (its output is committed since), and the
    // refused run leaves the record of the run before, which `latest` still continues.
    let before = run_origin();
    assert!(before.first_id > sp_id, "{before:?}");
    let h = run(
        second,
        Some(RestoreFrom::Path(sp.clone())),
        None,
        Duration::from_millis(20),
    );
    assert!(
        h.wait().is_err(),
        "restoring behind committed output is refused"
    );
    assert_eq!(run_origin(), before);
    assert!(latest() > Some(sp_id));
}

/// A collecting sink hands over what it holds when its job stops with a savepoint, as when
/// the job finishes: it kept up to 4095 records a shard back, so the stopped job's
/// collection and the restored job's together missed records. Together they hold every
/// record's sum once: the sources stop at the savepoint's barrier.
#[test]
fn stop_with_savepoint_hands_over_every_collected_record() {
    let dir = tempfile::tempdir().expect("tmp");
    let sps = dir.path().join("savepoints");
    let n = 200_000u64;
    let Sums { data, at, .. } = Sums::new(n);
    let hold = Hold::new(n, n / 10);
    let run = |ckpt: &str, restore: Option<RestoreFrom>, hold: Option<Hold>| {
        let c = restoring(
            exactly_once(&dir.path().join(ckpt), 2),
            restore,
            hold.is_some(),
        );
        let job = Job::new(c);
        let out = running_sum_job(&job, &data, hold, "sum").collect();
        (job.start().expect("start"), out)
    };
    let (h, first) = run("ckpt", None, Some(hold.clone()));
    await_checkpoints(&h, 1);
    let sp = h.stop_with_savepoint(&sps).expect("stop with savepoint");
    hold.release();
    h.wait().expect("a stopped job ends well");
    let mut got = first.take();
    assert!(
        !got.is_empty() && (got.len() as u64) < n,
        "stopped mid-way: {} records collected",
        got.len()
    );
    let (h, rest) = run("ckpt2", Some(RestoreFrom::Path(sp)), None);
    h.wait().expect("restored job");
    got.extend(rest.take());
    assert_every_sum_once(&got, &at, n);
}

/// A savepoint taken from a running 2-shard job is self-contained: with the job's checkpoint
/// directory deleted, a job on 3 shards starts from it and continues every key's state.
/// Retention never touches it, and a savepoint of a job without checkpointing is an error.
#[test]
fn a_savepoint_restores_onto_another_number_of_shards_without_the_checkpoints() {
    savepoint_round_trip(false);
}

/// The same with unaligned checkpoints: the savepoint may hold channel state, which the
/// restore onto 3 shards replays.
#[test]
fn an_unaligned_savepoint_restores_onto_another_number_of_shards() {
    savepoint_round_trip(true);
}

fn savepoint_round_trip(unaligned: bool) {
    let dir = tempfile::tempdir().expect("tmp");
    let (ckpt, savepoints) = (dir.path().join("ckpt"), dir.path().join("savepoints"));
    let n = 200_000u64;
    let Sums { data, expected, at } = Sums::new(n);
    // The restored run fails once, at its first record: before it took any checkpoint, so
    // the failover must restore the savepoint again (not start from the beginning).
    let failed = Arc::new(AtomicBool::new(false));
    let hold = Hold::new(n, n / 10);
    let run = |shards: usize, ck_dir: &std::path::Path, restore: Option<RestoreFrom>| {
        // The first run is slowed down and held, so that it is still running when the
        // savepoint is taken and until the checkpoints after it completed.
        let slow = restore.is_none();
        let (failed, hold) = (failed.clone(), hold.clone());
        let c = restoring(
            JobConfig::new()
                .with_shards(shards)
                .with_pinning(Pinning::Never)
                .with_checkpointing(
                    ck_with(
                        ck_dir,
                        CheckpointMode::ExactlyOnce,
                        unaligned,
                        Duration::ZERO,
                    )
                    .with_retained(1),
                ),
            restore,
            slow,
        );
        let job = Job::new(c);
        let out = job
            .from_vec(data.clone())
            .uid("input")
            .inspect(move |r: &(u64, i64, u64)| {
                if slow {
                    if r.2.is_multiple_of(500) {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    hold.delay(r.2);
                }
                if !slow && !failed.swap(true, Ordering::AcqRel) {
                    panic!("injected failure before the restored run's first checkpoint");
                }
            })
            .key_by(|r| r.0)
            .reduce(|a, b| (a.0, a.1 + b.1, b.2))
            .uid("sum")
            .collect();
        (job.start().expect("start"), out)
    };
    let (h, _) = run(2, &ckpt, None);
    // Past the first checkpoint, so that the savepoint's sources are past the start.
    await_checkpoints(&h, 1);
    let sp = h.trigger_savepoint(&savepoints).expect("savepoint");
    assert!(sp.starts_with(&savepoints), "{}", sp.display());
    let taken = h
        .checkpoint_metrics()
        .last_completed_checkpoint_id
        .expect("its checkpoint completed");
    // Newer checkpoints complete and retention (1 kept) drops the savepoint's checkpoint.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while h
        .checkpoint_metrics()
        .last_completed_checkpoint_id
        .is_none_or(|id| id < taken + 2)
    {
        assert!(std::time::Instant::now() < deadline, "no newer checkpoint");
        std::thread::sleep(Duration::from_millis(2));
    }
    h.cancel();
    hold.release();
    assert!(matches!(h.wait(), Err(weir_runtime::JobError::Cancelled)));
    let opened = weir_io::Savepoint::open(std::sync::Arc::new(weir_io::StdFs), &sp)
        .expect("a savepoint directory");
    opened.verify().expect("every byte of it verifies");
    std::fs::remove_dir_all(&ckpt).expect("drop the checkpoints");

    let (h, out) = run(3, &dir.path().join("ckpt2"), Some(RestoreFrom::Path(sp)));
    let summary = h.wait().expect("job restored from the savepoint");
    assert_eq!(summary.restarts, 1);
    let got = out.take();
    assert!(
        !got.is_empty() && (got.len() as u64) < n,
        "resumed mid-way: {} records",
        got.len()
    );
    assert!(
        got.iter().all(|r| r.2 > 0),
        "the failover restored the savepoint again: nothing from the start"
    );
    assert_resumed_sums(&got, &at, &expected);

    let job = Job::new(JobConfig::new().with_shards(1));
    job.from_vec(vec![1u64]).for_each(|_| {});
    let h = job.start().expect("start");
    assert!(matches!(
        h.trigger_savepoint(&savepoints),
        Err(weir_runtime::SavepointError::NoCheckpointing)
    ));
    let _ = h.wait();
}

/// A job started without a restore, into a directory where an earlier run left checkpoints,
/// fails before its own first checkpoint: the failover starts it from the beginning again,
/// not from the earlier run's state (which would offset every sum).
#[test]
fn a_failover_never_restores_a_checkpoint_of_an_earlier_run() {
    let dir = tempfile::tempdir().expect("tmp");
    let run = |values: i64, fail: Option<Arc<AtomicBool>>, interval: Duration| {
        let n = 50_000u64;
        let data: Vec<(u64, i64, u64)> = (0..n).map(|i| (i % 17, values, i)).collect();
        let c = JobConfig::new()
            .with_shards(2)
            .with_pinning(Pinning::Never)
            .with_checkpointing(
                ck(dir.path(), CheckpointMode::ExactlyOnce).with_interval(interval),
            );
        let job = Job::new(c);
        let out = job
            .from_vec(data)
            .uid("input")
            .inspect(move |r: &(u64, i64, u64)| {
                if let Some(f) = &fail {
                    if r.2 == 30_000 && !f.swap(true, Ordering::AcqRel) {
                        panic!("injected failure");
                    }
                }
            })
            .key_by(|r| r.0)
            .reduce(|a, b| (a.0, a.1 + b.1, b.2))
            .uid("sum")
            .collect();
        let summary = job.start().expect("start").wait().expect("job");
        (summary, out.take())
    };
    // The earlier run leaves complete checkpoints of a state made of large values.
    let (first, _) = run(1_000_000, None, Duration::from_millis(5));
    assert!(first.checkpoints.number_of_completed_checkpoints >= 1);
    let (summary, got) = run(
        1,
        Some(Arc::new(AtomicBool::new(false))),
        Duration::from_secs(3600),
    );
    assert_eq!(summary.restarts, 1);
    // The restart restored nothing (as Flink, the restore metrics stay unset).
    assert_eq!(summary.checkpoints.last_restored_checkpoint_id, None);
    assert_eq!(summary.checkpoints.last_checkpoint_restore_timestamp, None);
    for (k, sum, i) in &got {
        // Record i of key k is that key's (i / 17 + 1)-th record, each of value 1.
        assert_eq!(*sum, (i / 17 + 1) as i64, "key {k} at record {i}");
    }
    let seen: std::collections::HashSet<u64> = got.iter().map(|r| r.2).collect();
    assert_eq!(seen.len(), 50_000, "every record reached the sink");
}

/// A failed attempt shows as `Restarting` for the restart delay, the next attempt as
/// `Running` again, and the job ends `Finished`: the status history lists each change once,
/// in order, with its attempt, and the restart delay between `Restarting` and the next
/// attempt's `Initializing`.
#[test]
fn the_job_status_shows_a_restart_between_running_attempts() {
    use weir_runtime::JobStatus::*;
    let dir = tempfile::tempdir().expect("tmp");
    let delay = Duration::from_millis(300);
    let c = JobConfig::new()
        .with_shards(2)
        .with_pinning(Pinning::Never)
        .with_checkpointing(
            ck(dir.path(), CheckpointMode::ExactlyOnce)
                .with_restart(RestartStrategy::FixedDelay { attempts: 1, delay }),
        );
    let job = Job::new(c);
    let (failed, release) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let (f2, r2) = (failed.clone(), release.clone());
    // Each shard of each attempt makes its readers once: the count tells the attempt.
    let made = Arc::new(AtomicU64::new(0));
    job.from_iter(move |_, shards| {
        let attempt = made.fetch_add(1, Ordering::AcqRel) / shards as u64;
        (0u64..200).map(move |x| (x, attempt))
    })
    .uid("input")
    .inspect(move |&(x, attempt)| {
        if x == 100 && !f2.swap(true, Ordering::AcqRel) {
            panic!("injected failure");
        }
        // The second attempt holds its last record until the test saw it run.
        while x == 199 && attempt == 1 && !r2.load(Ordering::Acquire) {
            std::thread::sleep(Duration::from_millis(1));
        }
    })
    .key_by(|r| r.0 % 3)
    .reduce(|a, b| (a.0 + b.0, a.1))
    .uid("sum")
    .for_each(|_| {});
    let h = job.start().expect("start");
    // The second attempt runs (it holds its last record): the live status says so, and the
    // history so far ends there.
    let running_again = |h: &weir_runtime::JobHandle| {
        h.status_history()
            .iter()
            .any(|c| c.status == Running && c.attempt == 1)
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !running_again(&h) {
        assert!(
            std::time::Instant::now() < deadline,
            "no second attempt ran"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(failed.load(Ordering::Acquire));
    assert_eq!(h.status(), Running);
    assert_eq!(h.restarts(), 1);
    release.store(true, Ordering::Release);
    assert_eq!(weir_tests::await_status(&h, Finished), Finished);
    let s = h.wait().expect("job");
    assert_eq!(s.restarts, 1);
    assert_eq!(
        weir_tests::status_steps(&s.status_history),
        [
            (Initializing, 0),
            (Running, 0),
            (Restarting, 0),
            (Initializing, 1),
            (Running, 1),
            (Finished, 1),
        ]
    );
    // The delay ran between the failure and the next attempt (wall-clock times, as Flink's;
    // a clock stepped back by NTP in between would fail this).
    let h = &s.status_history;
    assert!(
        h[3].at_ms.saturating_sub(h[2].at_ms) >= delay.as_millis() as u64 - 1,
        "{h:?}"
    );
}

/// A failure that a restart would meet again fails the job at once, whatever the restart
/// strategy allows: a malformed record under the fail policy is replayed by every restart
/// (before, the job restarted until the strategy gave up: forever under the default one).
/// Failures that may pass, as the injected panics above, are restarted.
#[test]
fn a_malformed_record_under_the_fail_policy_fails_the_job_without_restarts() {
    use weir_runtime::source::{FileFormat, FileSource, SourceError};
    use weir_runtime::{JobError, JobStatus};
    let dir = tempfile::tempdir().expect("tmp");
    let input = dir.path().join("in.csv");
    let mut text = String::from("user,amount\n");
    for i in 0..2000 {
        text.push_str(&format!("u{},{i}\n", i % 7));
    }
    text.push_str("u1,oops\n");
    std::fs::write(&input, text).expect("write");
    let job = Job::new(exactly_once(&dir.path().join("ck"), 2));
    let source = FileSource::new(
        input.clone(),
        FileFormat::Csv,
        &["user", "amount"],
        |f: &[&str], _| {
            let v = f[1].parse::<i64>().map_err(|e| e.to_string())?;
            Ok((f[0].to_owned(), v))
        },
    );
    job.source(source)
        .uid("input")
        .key_by(|r: &(String, i64)| r.0.clone())
        .reduce(|a, b| (a.0, a.1 + b.1))
        .uid("sum")
        .for_each(|_| {});
    let h = job.start().expect("start");
    assert_eq!(
        weir_tests::await_status(&h, JobStatus::Failed),
        JobStatus::Failed
    );
    assert_eq!(h.restarts(), 0, "no restart replays into the same record");
    match h.wait() {
        Err(JobError::Source {
            source: SourceError::Malformed { file, line, .. },
            ..
        }) => assert_eq!((file, line), (input, 2002)),
        other => panic!("expected the malformed record's error, got {other:?}"),
    }
}

/// A job that fails in its first `failures` attempts, each at its 50th record of 100; the
/// rest of its configuration as `checkpoint` says.
fn failing_job(checkpoint: CheckpointConfig, failures: u64) -> Job {
    let job = Job::new(
        JobConfig::new()
            .with_shards(2)
            .with_pinning(Pinning::Never)
            .with_checkpointing(checkpoint),
    );
    // Each shard of each attempt makes its readers once: the count tells the attempt.
    let made = Arc::new(AtomicU64::new(0));
    job.from_iter(move |_, shards| {
        let attempt = made.fetch_add(1, Ordering::AcqRel) / shards as u64;
        (0u64..100).map(move |x| (x, attempt))
    })
    .uid("input")
    .inspect(move |&(x, attempt)| {
        if x == 50 && attempt < failures {
            panic!("injected failure");
        }
    })
    .for_each(|_| {});
    job
}

/// An exponential restart delay with the largest multiplier accepted (`f64::MAX`) grows
/// straight to its max at the second failure: it used to overflow `Duration::mul_f64` there
/// and end the job with a panic instead of a restart.
#[test]
fn the_largest_restart_multiplier_stops_at_the_max_delay() {
    let dir = tempfile::tempdir().expect("tmp");
    let ck = CheckpointConfig::from_toml(&format!(
        "dir = \"{}\"\njob-id = \"backoff\"\n[restart]\nstrategy = \"exponential-delay\"\n\
         initial = \"1ms\"\nmax = \"20ms\"\nmultiplier = 1.7976931348623157e308\njitter = 0.0\n",
        dir.path().display()
    ))
    .expect("the largest finite multiplier is accepted");
    let s = failing_job(ck, 2)
        .start()
        .expect("start")
        .wait()
        .expect("two failures, two restarts, then the job finishes");
    assert_eq!(s.restarts, 2);
}

/// A restart delay of the longest duration accepted (100 years) waits (no overflow), and a
/// cancel ends the wait; a longer one, built in code past `from_toml`, is refused at start by
/// name.
#[test]
fn the_longest_restart_delay_waits_for_a_cancel_and_a_longer_one_is_refused() {
    use weir_runtime::checkpoint::config::MAX_DURATION;
    use weir_runtime::{JobError, JobStatus, StartError};
    let dir = tempfile::tempdir().expect("tmp");
    let ck = |delay| {
        CheckpointConfig::new(dir.path(), "long")
            .with_interval(MAX_DURATION)
            .with_restart(RestartStrategy::FixedDelay { attempts: 1, delay })
    };
    match failing_job(ck(MAX_DURATION + Duration::from_secs(1)), 1).start() {
        Err(StartError::Config { key, .. }) => assert_eq!(key, "checkpoint.restart.delay"),
        Err(e) => panic!("expected a configuration error, got {e}"),
        Ok(_) => panic!("a delay past the bound started"),
    }
    let h = failing_job(ck(MAX_DURATION), 1).start().expect("start");
    assert_eq!(
        weir_tests::await_status(&h, JobStatus::Restarting),
        JobStatus::Restarting
    );
    h.cancel();
    assert!(matches!(h.wait(), Err(JobError::Cancelled)));
}

/// A stray `chk-18446744073709551615` in the job's directory leaves no checkpoint id: the job
/// does not start, and says which directory and id (the id used to wrap to 0, and the job
/// restarted forever with "checkpoint 0 is not newer than the latest complete checkpoint").
#[test]
fn a_job_whose_checkpoint_ids_are_exhausted_does_not_start() {
    use weir_runtime::StartError;
    let dir = tempfile::tempdir().expect("tmp");
    let stray = dir.path().join("ids").join(format!("chk-{}", u64::MAX));
    std::fs::create_dir_all(&stray).expect("mkdir");
    let ck = CheckpointConfig::new(dir.path(), "ids");
    match failing_job(ck, 0).start() {
        Err(StartError::Checkpoint { reason }) => assert!(
            reason.contains(&dir.path().join("ids").display().to_string())
                && reason.contains(&format!("chk-{}", u64::MAX))
                && reason.contains("checkpoint ids are exhausted"),
            "{reason}"
        ),
        Err(e) => panic!("expected exhausted checkpoint ids, got {e}"),
        Ok(_) => panic!("a job without checkpoint ids started"),
    }
}

/// A job that starts with one id left takes that checkpoint, then fails rather than wrap:
/// its coordinator finds no id for the next, and the restart refuses to start, naming the
/// directory (no endless restarts).
#[test]
fn a_job_that_uses_the_last_checkpoint_id_fails_without_wrapping() {
    use weir_runtime::{JobError, StartError};
    let dir = tempfile::tempdir().expect("tmp");
    let stray = dir.path().join("ids").join(format!("chk-{}", u64::MAX - 1));
    std::fs::create_dir_all(&stray).expect("mkdir");
    let ck = CheckpointConfig::new(dir.path(), "ids")
        .with_interval(Duration::from_millis(5))
        .with_restart(RestartStrategy::FixedDelay {
            attempts: 10,
            delay: Duration::from_millis(1),
        });
    let job = Job::new(
        JobConfig::new()
            .with_shards(2)
            .with_pinning(Pinning::Never)
            .with_checkpointing(ck),
    );
    // Slow enough for several periodic triggers.
    job.from_iter(|_, _| 0u64..200)
        .uid("input")
        .inspect(|_| std::thread::sleep(Duration::from_millis(1)))
        .for_each(|_| {});
    let h = job.start().expect("one id is left");
    match h.wait() {
        Err(JobError::Start(StartError::Checkpoint { reason })) => {
            assert!(reason.contains("checkpoint ids are exhausted"), "{reason}")
        }
        other => panic!("expected exhausted checkpoint ids, got {other:?}"),
    }
}

/// A late record behind a watermark in a backpressured ring, overtaken by an unaligned
/// barrier, is late after a restore from that checkpoint as it was before: the checkpoint's
/// channel state holds the watermark frames among the records it captured, with the input's
/// watermark valve, and the replay hands them to the valve in order. Before, the channel
/// state held the records alone: replayed with no watermark before it, the record that had
/// been dropped as late counted in a window of its own.
///
/// Deterministic: every record goes to shard 1 (its key's owner) from shard 0, the only
/// shard with input. Once a window fired there (so shard 1's own input, whose source is
/// empty, has ended and no longer holds the watermark back), shard 1 is held inside the
/// window's aggregate on a record while the test lets `[record 100][watermark 99][record
/// 50]` into the ring and triggers the checkpoint, so that shard 1's exchange input takes it
/// unaligned, capturing those frames, when it runs again. A failure then restores that
/// checkpoint. Watermarks are per record, so which records are late does not depend on
/// timing.
#[test]
fn a_late_record_in_unaligned_channel_state_stays_late_after_a_restore() {
    use weir_runtime::source::{Source, SourceError, SourcePoll, SourceReader};
    use weir_runtime::KeyCodec;

    type Rec = (u64, i64, u64);

    struct Gated {
        items: Arc<Vec<Rec>>,
        gate: Arc<AtomicU64>,
        read: Arc<AtomicU64>,
        positions: Arc<AtomicU64>,
    }
    struct GatedReader {
        items: Arc<Vec<Rec>>,
        next: usize,
        gate: Arc<AtomicU64>,
        read: Arc<AtomicU64>,
        positions: Arc<AtomicU64>,
    }
    impl SourceReader<Rec> for GatedReader {
        fn poll(&mut self, out: &mut Vec<Rec>, max: usize) -> Result<SourcePoll, SourceError> {
            let open = (self.gate.load(Ordering::Acquire) as usize).min(self.items.len());
            if self.next >= open && open < self.items.len() {
                return Ok(SourcePoll::Idle);
            }
            let end = (self.next + max).min(open);
            out.extend_from_slice(&self.items[self.next..end]);
            self.read.store(end as u64, Ordering::Release);
            self.next = end;
            Ok(if end == self.items.len() {
                SourcePoll::Finished
            } else {
                SourcePoll::Ready
            })
        }
        fn position(&self) -> Vec<u8> {
            self.positions.fetch_add(1, Ordering::AcqRel);
            (self.next as u64).to_le_bytes().to_vec()
        }
        fn seek(&mut self, position: &[u8]) -> Result<(), SourceError> {
            let n = <[u8; 8]>::try_from(position)
                .map(u64::from_le_bytes)
                .map_err(|_| SourceError::BadPosition("expected 8 bytes".into()))?;
            self.next = n as usize;
            Ok(())
        }
    }
    impl Source<Rec> for Gated {
        fn create_reader(
            &self,
            shard: usize,
            _shards: usize,
        ) -> Result<Box<dyn SourceReader<Rec>>, SourceError> {
            if shard != 0 {
                return Ok(Box::new(weir_runtime::source::EmptyReader));
            }
            Ok(Box::new(GatedReader {
                items: self.items.clone(),
                next: 0,
                gate: self.gate.clone(),
                read: self.read.clone(),
                positions: self.positions.clone(),
            }))
        }
    }

    /// Counts a window's records; holds its shard on record 2 while `hold` is set.
    struct Count {
        hold: Arc<AtomicBool>,
        held: Arc<AtomicBool>,
    }
    impl weir_runtime::AggregateFunction<Rec, u64, u64> for Count {
        fn create(&self) -> u64 {
            0
        }
        fn add(&self, acc: u64, r: Rec) -> u64 {
            if r.2 == 2 {
                self.held.store(true, Ordering::Release);
                while self.hold.load(Ordering::Acquire) {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            acc + 1
        }
        fn result(&self, acc: &u64) -> u64 {
            *acc
        }
        fn merge(&self, a: u64, b: u64) -> u64 {
            a + b
        }
    }

    // A key shard 1 of 2 owns.
    let key = (0..100u64)
        .find(|k| {
            let mut b = Vec::new();
            k.encode_key(&mut b);
            weir_runtime::shard_for_key_group(weir_state::key_group_for(&b, 128), 128, 2) == 1
        })
        .expect("a key on shard 1");
    // (key, event time, index): 20's watermark fires 0's window, 30 holds shard 1, 50 is late
    // after 100 (watermark 99).
    let items: Vec<Rec> = [0, 20, 30, 100, 50, 200, 205]
        .iter()
        .enumerate()
        .map(|(i, ts)| (key, *ts, i as u64))
        .collect();
    // A failure-free run's windows: 50's is not among them.
    let want = vec![
        "window 0 1",
        "window 100 1",
        "window 20 1",
        "window 200 2",
        "window 30 1",
    ];

    let dir = tempfile::tempdir().expect("tmp");
    let out = dir.path().join("out");
    let gate = Arc::new(AtomicU64::new(2));
    let fired = Arc::new(AtomicBool::new(false));
    let fired_in = fired.clone();
    let read = Arc::new(AtomicU64::new(0));
    let positions = Arc::new(AtomicU64::new(0));
    let hold = Arc::new(AtomicBool::new(true));
    let held = Arc::new(AtomicBool::new(false));
    let fail = Arc::new(AtomicBool::new(false));
    let checkpointing = CheckpointConfig::new(dir.path().join("ck"), "late")
        .with_unaligned(true)
        .with_interval(Duration::from_secs(3600))
        .with_restart(RestartStrategy::FixedDelay {
            attempts: 2,
            delay: Duration::from_millis(5),
        });
    let job = Job::new(
        JobConfig::new()
            .with_shards(2)
            .with_max_parallelism(128)
            .with_pinning(Pinning::Never)
            .with_checkpointing(checkpointing),
    );
    let f = fail.clone();
    job.source(Gated {
        items: Arc::new(items),
        gate: gate.clone(),
        read: read.clone(),
        positions: positions.clone(),
    })
    .uid("input")
    .inspect(move |_| {
        if f.swap(false, Ordering::AcqRel) {
            panic!("injected failure");
        }
    })
    .assign_timestamps(
        WatermarkStrategy::bounded_out_of_orderness(0, |r: &Rec| r.1).with_watermark_per_record(),
    )
    .key_by(|r: &Rec| r.0)
    .window(WindowAssigner::tumbling(10))
    .aggregate_with(
        Count {
            hold: hold.clone(),
            held: held.clone(),
        },
        |_k, w, n| format!("window {} {n}", w.start),
    )
    .uid("windows")
    .inspect(move |_| fired_in.store(true, Ordering::Release))
    .sink(TransactionalFileSink::new(
        out.clone(),
        |l: &String, buf: &mut String| buf.push_str(l),
    ))
    .uid("out");
    let h = job.start().expect("start");
    let wait = |what: &str, f: &dyn Fn() -> bool| {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !f() {
            assert!(
                std::time::Instant::now() < deadline,
                "timed out waiting for {what}"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    // A window fired: shard 1's exchange input from shard 1 had ended (else its watermark,
    // none, held the valve back, and whether 50 is late would depend on when it ended).
    wait("the first window", &|| fired.load(Ordering::Acquire));
    gate.store(3, Ordering::Release);
    wait("shard 1 held", &|| held.load(Ordering::Acquire));
    // Behind the held record: [record 100][watermark 99][record 50] in shard 1's ring.
    gate.store(5, Ordering::Release);
    wait("the records read", &|| read.load(Ordering::Acquire) >= 5);
    let before = positions.load(Ordering::Acquire);
    h.trigger_checkpoint().expect("trigger");
    // The source took its position and sent the barrier after them (announced with it).
    wait("the barrier", &|| {
        positions.load(Ordering::Acquire) > before
    });
    std::thread::sleep(Duration::from_millis(50));
    hold.store(false, Ordering::Release);
    wait("the checkpoint", &|| {
        h.checkpoint_metrics().number_of_completed_checkpoints >= 1
    });
    let history = h.checkpoint_metrics().history;
    assert!(
        history
            .iter()
            .any(|s| s.failure.is_none() && s.persisted_inflight_bytes > 0),
        "the checkpoint was taken unaligned with records in flight: {history:?}"
    );
    // Restores that checkpoint; then the rest of the input.
    fail.store(true, Ordering::Release);
    gate.store(u64::MAX, Ordering::Release);
    wait("the restart", &|| h.restarts() >= 1 || h.is_finished());
    assert_eq!(h.restarts(), 1, "one failure, restored");
    h.wait().expect("job");
    let mut got: Vec<String> = Vec::new();
    for e in std::fs::read_dir(&out).expect("out").flatten() {
        if e.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        let text = std::fs::read_to_string(e.path()).expect("part file");
        got.extend(text.lines().map(str::to_owned));
    }
    got.sort();
    assert_eq!(got, want, "the windows of a failure-free run");
}

/// A restore refuses a state used as another value type than the checkpoint recorded, as
/// Flink refuses an incompatible serializer (`StateMigrationException`): restored values pass
/// rkyv's structural check whatever type reads them, and a `u64` read as an `f64` gave
/// `4.94e-315`. Here the job's code reads `x` as an `f64` from its second attempt on (each
/// attempt builds its sources anew), after a failure injected once a checkpoint completed:
/// the restored attempt fails at its first read, naming the state and both types, and the
/// job ends there (a restart would meet it again) instead of restarting.
#[test]
fn a_restore_refuses_a_state_read_as_another_type() {
    let dir = tempfile::tempdir().expect("tmp");
    let n = 20_000u64;
    let hold = Hold::new(n / 2, n / 4);
    let built = Arc::new(AtomicU64::new(0));
    let fail = Arc::new(AtomicBool::new(false));
    let job = Job::new(
        JobConfig::new()
            .with_shards(2)
            .with_pinning(Pinning::Never)
            .with_batch_records(HELD_BATCH_RECORDS)
            .with_checkpointing(
                CheckpointConfig::new(dir.path(), "types")
                    .with_interval(Duration::from_millis(20))
                    .with_restart(RestartStrategy::FixedDelay {
                        attempts: 5,
                        delay: Duration::from_millis(5),
                    }),
            ),
    );
    let (b2, h2, f2) = (built.clone(), hold.clone(), fail.clone());
    job.from_iter(move |_, shards| {
        b2.fetch_add(1, Ordering::AcqRel);
        0..n / shards as u64
    })
    .uid("gen")
    .map(move |i: u64| {
        if f2.swap(false, Ordering::AcqRel) {
            panic!("injected failure");
        }
        h2.delay(i);
        i
    })
    .key_by(|i: &u64| *i % 10)
    .process(FnProcess::new({
        let built = built.clone();
        move |i: u64, ctx: &mut KeyedContext<'_, u64, u64>| {
            // Both shards' sources are built before any record moves.
            if built.load(Ordering::Acquire) > 2 {
                let x = ctx.value::<f64>("x").unwrap_or(0.0);
                ctx.emit(x as u64);
            } else {
                ctx.set_value("x", &i);
            }
        }
    }))
    .uid("types")
    .for_each(|_| {});
    let h = job.start().expect("start");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    // A checkpoint that holds `x` (the first may come before any record).
    while !h
        .checkpoint_metrics()
        .history
        .iter()
        .any(|c| c.failure.is_none() && c.full_size_bytes > 0)
    {
        assert!(
            std::time::Instant::now() < deadline && !h.is_finished(),
            "no checkpoint with state completed"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    fail.store(true, Ordering::Release);
    hold.release();
    let e = h.wait().expect_err("the read as f64 fails");
    assert!(
        matches!(e, weir_runtime::JobError::StateType { .. }) && !e.is_recoverable(),
        "{e:?}"
    );
    let e = e.to_string();
    assert!(
        e.contains("state `x`")
            && e.contains("the checkpoint restored holds it as value<u64>")
            && e.contains("value<f64>"),
        "{e}"
    );
}
