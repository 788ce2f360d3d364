//! Stateless operators, union, rebalance, broadcast, windows on several shards, backpressure
//! through a slow sink, and failures of user code.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use weir_runtime::{
    Job, JobConfig, JobError, JobStatus, Pinning, WatermarkStrategy, WindowAssigner,
};
use weir_tests::{await_status, status_steps};

fn config(shards: usize) -> JobConfig {
    JobConfig::new()
        .with_shards(shards)
        .with_pinning(Pinning::Never)
}

#[test]
fn chained_operators_union_and_rebalance_keep_every_record() {
    let job = Job::new(config(4));
    let a = job.from_iter(|shard, shards| {
        (0..10_000u64).filter(move |i| i % shards as u64 == shard as u64)
    });
    let b = job.from_vec((10_000..12_000u64).collect());
    let out = a
        .union(b)
        .map(|x| x * 2)
        .filter(|x| x % 3 != 0)
        .flat_map(|x| [x, x + 1])
        .filter_map(|x| (x % 5 != 0).then_some(x))
        .inspect(|x| assert!(*x < 24_002))
        .rebalance()
        .collect();
    job.run().expect("job");
    let mut got = out.take();
    got.sort();
    let mut want: Vec<u64> = (0..12_000u64)
        .map(|x| x * 2)
        .filter(|x| x % 3 != 0)
        .flat_map(|x| [x, x + 1])
        .filter(|x| x % 5 != 0)
        .collect();
    want.sort();
    assert_eq!(got, want);
}

#[test]
fn broadcast_delivers_every_record_to_every_shard() {
    let job = Job::new(config(3));
    let out = job.from_vec((0..500u32).collect()).broadcast().collect();
    job.run().expect("job");
    let mut got = out.take();
    got.sort();
    let mut want: Vec<u32> = (0..500).flat_map(|x| [x, x, x]).collect();
    want.sort();
    assert_eq!(got, want);
}

#[test]
fn sliding_and_session_windows_on_four_shards_match_sequential() {
    // In-order timestamps so that no record is late, whatever the watermark timing.
    let events: Vec<(u8, i64, u64)> = (0..4000u64)
        .map(|i| {
            let r = weir_runtime::source::splitmix64(5, i);
            ((r % 5) as u8, (i * 3 + (i / 97) * 400) as i64, r % 100)
        })
        .collect();
    let job = Job::new(config(4));
    let s = job
        .from_vec(events.clone())
        .assign_timestamps(WatermarkStrategy::monotonous(|e: &(u8, i64, u64)| e.1));
    let sums = s
        .key_by(|e| e.0)
        .window(WindowAssigner::sliding(100, 50))
        .reduce(|a, b| (a.0, a.1.max(b.1), a.2 + b.2))
        .uid("sliding")
        .collect();
    job.run().expect("job");
    let mut got: Vec<(u8, u64)> = sums.take().into_iter().map(|e| (e.0, e.2)).collect();
    got.sort();
    let mut want = Vec::new();
    for k in 0..5u8 {
        let mine: Vec<&(u8, i64, u64)> = events.iter().filter(|e| e.0 == k).collect();
        let max_ts = mine.iter().map(|e| e.1).max().unwrap_or(0);
        let mut start = -50;
        while start <= max_ts {
            let s: Vec<u64> = mine
                .iter()
                .filter(|e| e.1 >= start && e.1 < start + 100)
                .map(|e| e.2)
                .collect();
            if !s.is_empty() {
                want.push((k, s.iter().sum()));
            }
            start += 50;
        }
    }
    want.sort();
    assert_eq!(got, want);

    let job = Job::new(config(4));
    let sessions = job
        .from_vec(events.clone())
        .assign_timestamps(WatermarkStrategy::monotonous(|e: &(u8, i64, u64)| e.1))
        .key_by(|e| e.0)
        .window(WindowAssigner::session(60))
        .process(
            |k: &u8, w, items: Vec<(u8, i64, u64)>, out: &mut Vec<(u8, i64, i64, usize)>| {
                out.push((*k, w.start, w.end, items.len()))
            },
        )
        .uid("sessions")
        .collect();
    job.run().expect("job");
    let mut got = sessions.take();
    got.sort();
    let mut want = Vec::new();
    for k in 0..5u8 {
        let ts: Vec<i64> = events.iter().filter(|e| e.0 == k).map(|e| e.1).collect();
        let (mut start, mut end, mut n) = (ts[0], ts[0] + 60, 0);
        for t in ts {
            if t > end {
                want.push((k, start, end, n));
                start = t;
                n = 0;
            }
            end = end.max(t + 60);
            n += 1;
        }
        want.push((k, start, end, n));
    }
    want.sort();
    assert_eq!(got, want);
}

#[test]
fn a_slow_sink_backpressures_without_loss_or_unbounded_buffering() {
    use weir_runtime::KeyCodec;
    let seen = Arc::new(AtomicU64::new(0));
    let s2 = seen.clone();
    // The keys shard 1 owns: only their records are slow, so shard 0's source outruns
    // shard 1 and the ring between them fills (a shard whose own sink is slow slows its own
    // source down with it, which is no backpressure).
    let slow: Vec<bool> = (0..7u64)
        .map(|k| {
            let mut b = Vec::new();
            k.encode_key(&mut b);
            weir_runtime::shard_for_key_group(weir_state::key_group_for(&b, 128), 128, 2) == 1
        })
        .collect();
    assert!(slow.iter().any(|s| *s), "some key lives on shard 1");
    // Small rings and batches: the slow sink fills them quickly.
    let job = Job::new(
        config(2)
            .with_ring_capacity_bytes(64 << 10)
            .with_batch_records(64),
    );
    job.from_iter(|shard, _| {
        let n = if shard == 0 { 40_000u64 } else { 0 };
        (0..n).map(|i| (i % 7, i * 2))
    })
    .key_by(|r| r.0)
    .reduce(|a, b| (a.0, a.1.max(b.1)))
    .uid("max")
    .for_each(move |r: (u64, u64)| {
        if slow[r.0 as usize] && s2.fetch_add(1, Ordering::Relaxed).is_multiple_of(16) {
            std::thread::sleep(std::time::Duration::from_micros(100));
        } else if !slow[r.0 as usize] {
            s2.fetch_add(1, Ordering::Relaxed);
        }
    });
    let handle = job.start().expect("start");
    let summary = handle.wait().expect("job");
    assert_eq!(
        seen.load(Ordering::Relaxed),
        40_000,
        "no record lost or duplicated"
    );
    let heads = &summary.metrics.heads;
    let blocked: u64 = heads.iter().map(|h| h.backpressured_ns).sum();
    assert!(blocked > 0, "the sources saw backpressure: {heads:?}");
    let buffered = summary
        .metrics
        .operators
        .iter()
        .map(|o| o.max_buffered_bytes)
        .max()
        .unwrap_or(0);
    // Outside the rings a writer holds at most what one batch of input produced.
    assert!(
        buffered <= 64 * 2 * 64,
        "spill stayed within one batch per target: {buffered} bytes"
    );
}

/// A panic while a shard builds its operators (here in a source's factory, on one shard of
/// three) fails the job with the panic's message. It used to unwind past the count of running
/// shards, so that the job never ended: the job runs on a thread of its own, with a deadline.
#[test]
fn a_panic_while_a_shard_builds_its_operators_fails_the_job() {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let job = Job::new(config(3));
        job.from_iter(|shard, _| {
            if shard == 1 {
                panic!("no input for shard 1");
            }
            0..1000u64
        })
        .key_by(|x| *x % 10)
        .reduce(|a, b| a + b)
        .for_each(|_| {});
        let _ = tx.send(job.run());
    });
    match rx.recv_timeout(std::time::Duration::from_secs(60)) {
        Ok(Err(JobError::Panic { shard, message })) => {
            assert_eq!(shard, 1);
            assert!(message.contains("no input for shard 1"), "{message}");
        }
        Ok(other) => panic!("expected a panic failure, got {other:?}"),
        Err(_) => panic!("the job did not end within 60 s of a shard's panic"),
    }
}

#[test]
fn a_panicking_user_function_fails_the_job_with_its_message() {
    let job = Job::new(config(3));
    job.from_iter(|_, _| 0..100_000u64)
        .key_by(|x| *x % 10)
        .reduce(|a, b| {
            if b == 77_777 {
                panic!("bad record 77777");
            }
            a + b
        })
        .for_each(|_| {});
    match job.run() {
        Err(JobError::Panic { message, .. }) => {
            assert!(message.contains("bad record 77777"), "{message}");
            // The chain it came from, by the operator heading it: the keyed exchange.
            assert!(message.contains("(in the chain from `key_by"), "{message}");
        }
        other => panic!("expected a panic failure, got {other:?}"),
    }
}

#[test]
fn cancel_stops_an_endless_job() {
    let job = Job::new(config(2));
    job.from_iter(|_, _| 0u64..).map(|x| x + 1).for_each(|_| {});
    let h = job.start().expect("start");
    std::thread::sleep(std::time::Duration::from_millis(50));
    h.cancel();
    assert!(matches!(h.wait(), Err(JobError::Cancelled)));
}

/// A cancel stops a shard between two records of a batch, not after the whole batch: each
/// head reads the stop before every record it hands on. Both kinds of head, a source's and an
/// exchange's, run a chain whose sink takes 5 ms a record; a batch holds 1024. Before, the
/// sink went on through the rest of its batch (about a thousand calls, 4-5 s) after the
/// cancel.
#[test]
fn cancel_stops_a_shard_between_the_records_of_a_batch() {
    for through_exchange in [false, true] {
        let job = Job::new(config(1));
        let calls = Arc::new(AtomicU64::new(0));
        let seen = calls.clone();
        let slow = move |_: u64| {
            seen.fetch_add(1, Ordering::AcqRel);
            std::thread::sleep(std::time::Duration::from_millis(5));
        };
        let src = job.from_iter(|_, _| 0u64..);
        if through_exchange {
            src.rebalance().for_each(slow);
        } else {
            src.for_each(slow);
        }
        let h = job.start().expect("start");
        while calls.load(Ordering::Acquire) < 3 {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        h.cancel();
        let at_cancel = calls.load(Ordering::Acquire);
        assert!(matches!(h.wait(), Err(JobError::Cancelled)));
        let after = calls.load(Ordering::Acquire) - at_cancel;
        // The call in progress, and those while the cancel reaches the shard (its watcher
        // wakes at once); never the rest of the batch.
        assert!(
            after < 100,
            "{after} calls after the cancel (through an exchange: {through_exchange})"
        );
    }
}

#[test]
fn duplicate_uids_are_rejected_before_start() {
    let job = Job::new(config(1));
    let a = job.from_vec(vec![1u32]).map(|x| x).uid("same");
    a.map(|x| x).uid("same").for_each(|_| {});
    match job.start() {
        Err(e) => assert!(e.to_string().contains("same"), "names the uid: {e}"),
        Ok(_) => panic!("a job with a duplicate uid started"),
    }
}

/// A sink whose writer takes long to build on the last shard and notes when it is built.
struct SlowToBuild {
    built_at: Arc<std::sync::Mutex<Option<std::time::Instant>>>,
    /// The last shard's sink is built once this is set (a fixed delay raced the test's first
    /// status check on a loaded machine).
    release: Arc<std::sync::atomic::AtomicBool>,
}

struct Discard;

impl weir_runtime::sink::SinkWriter<u64> for Discard {
    fn write(&mut self, _: u64, _: i64) -> std::io::Result<()> {
        Ok(())
    }
    fn finish(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl weir_runtime::sink::Sink<u64> for SlowToBuild {
    fn create_writer(
        &self,
        shard: usize,
        shards: usize,
    ) -> Result<Box<dyn weir_runtime::sink::SinkWriter<u64>>, weir_runtime::StartError> {
        if shard + 1 == shards {
            while !self.release.load(std::sync::atomic::Ordering::Acquire) {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            *self.built_at.lock().unwrap() = Some(std::time::Instant::now());
        }
        Ok(Box::new(Discard))
    }
}

#[test]
fn the_job_status_is_initializing_until_every_shard_is_built_then_running() {
    let job = Job::new(config(2));
    let built_at = Arc::new(std::sync::Mutex::new(None));
    let release = Arc::new(std::sync::atomic::AtomicBool::new(false));
    job.from_iter(|_, _| 0u64..).rebalance().sink(SlowToBuild {
        built_at: built_at.clone(),
        release: release.clone(),
    });
    let h = job.start().expect("start");
    // The last shard's sink is not built until released, however long the other shard took.
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert_eq!(h.status(), JobStatus::Initializing);
    release.store(true, std::sync::atomic::Ordering::Release);
    assert_eq!(await_status(&h, JobStatus::Running), JobStatus::Running);
    assert!(
        built_at.lock().unwrap().is_some(),
        "running before the last shard was built"
    );
    h.cancel();
    assert_eq!(await_status(&h, JobStatus::Cancelled), JobStatus::Cancelled);
    assert_eq!(
        statuses(&h),
        [
            JobStatus::Initializing,
            JobStatus::Running,
            JobStatus::Cancelled
        ]
    );
    assert!(matches!(h.wait(), Err(JobError::Cancelled)));

    let job = Job::new(config(2));
    job.from_iter(|_, _| 0..1000u64).for_each(|_| {});
    let h = job.start().expect("start");
    assert_eq!(await_status(&h, JobStatus::Finished), JobStatus::Finished);
    assert!(h.is_finished());
    let s = h.wait().expect("finished");
    assert_eq!(
        status_steps(&s.status_history),
        [
            (JobStatus::Initializing, 0),
            (JobStatus::Running, 0),
            (JobStatus::Finished, 0)
        ]
    );

    let job = Job::new(config(2));
    job.from_iter(|_, _| 0..1000u64)
        .map(|x| if x == 500 { panic!("bad record") } else { x })
        .for_each(|_| {});
    let h = job.start().expect("start");
    assert_eq!(await_status(&h, JobStatus::Failed), JobStatus::Failed);
    assert_eq!(
        statuses(&h),
        [
            JobStatus::Initializing,
            JobStatus::Running,
            JobStatus::Failed
        ]
    );
    assert!(matches!(h.wait(), Err(JobError::Panic { .. })));
}

/// The statuses of `h`'s history, in order.
fn statuses(h: &weir_runtime::JobHandle) -> Vec<JobStatus> {
    status_steps(&h.status_history())
        .into_iter()
        .map(|(s, _)| s)
        .collect()
}

#[test]
fn no_shard_runs_before_every_shard_is_built() {
    // Shard 0 builds at once, the last shard takes 300 ms (as a restore of large state
    // would): shard 0's source must not produce before then.
    let job = Job::new(config(2));
    let first_record = Arc::new(std::sync::OnceLock::<std::time::Instant>::new());
    let first = first_record.clone();
    let built_at = Arc::new(std::sync::Mutex::new(None));
    job.from_iter(move |shard, _| {
        let first = first.clone();
        (0..1_000u64).inspect(move |_| {
            if shard == 0 {
                first.get_or_init(std::time::Instant::now);
            }
        })
    })
    .rebalance()
    .sink(SlowToBuild {
        built_at: built_at.clone(),
        // Built 300 ms after the start.
        release: {
            let r = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let r2 = r.clone();
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(300));
                r2.store(true, std::sync::atomic::Ordering::Release);
            });
            r
        },
    });
    job.run().expect("job");
    let built = built_at.lock().unwrap().expect("the last shard was built");
    let first = *first_record.get().expect("shard 0 produced records");
    assert!(
        first >= built,
        "shard 0 produced {:?} before the last shard was built",
        built - first
    );
}

/// A host thread pushing into an ingress whose job ended is refused, also one already blocked
/// on the full queue: pushes returned `Ok` after the job was cancelled, and blocked for good
/// once the queue filled.
#[test]
fn pushes_into_the_ingress_of_an_ended_job_are_refused() {
    let (tx, src) = weir_runtime::source::ingress::<u64>(2);
    let job = Job::new(config(2));
    let seen = Arc::new(AtomicU64::new(0));
    let s2 = seen.clone();
    job.source(src).for_each(move |_| {
        s2.fetch_add(1, Ordering::Relaxed);
    });
    let h = job.start().expect("start");
    tx.push_batch(vec![1, 2, 3]).expect("the job reads");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while seen.load(Ordering::Relaxed) < 3 {
        assert!(std::time::Instant::now() < deadline, "the job read nothing");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    // A host thread fills the queue and blocks while the job is cancelled.
    let host = {
        let tx = tx.clone();
        std::thread::spawn(move || loop {
            if let Err(e) = tx.push_batch(vec![0; 1000]) {
                return e;
            }
        })
    };
    h.cancel();
    let _ = h.wait();
    while !host.is_finished() {
        assert!(
            std::time::Instant::now() < deadline,
            "the blocked host thread was never woken"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(host.join().expect("host"), weir_runtime::source::Closed);
    assert_eq!(tx.push_batch(vec![4]), Err(weir_runtime::source::Closed));
}

/// Window sizes, slides, session gaps of 0 ms or less and a negative allowed lateness stop
/// the job before it starts, naming what is wrong, in a real job and in the test driver
/// (they were made 1 ms and 0 without a word).
#[test]
fn windows_of_no_size_or_a_negative_lateness_are_refused() {
    let cases: Vec<(WindowAssigner, i64, &str)> = vec![
        (WindowAssigner::tumbling(0), 0, "size"),
        (WindowAssigner::tumbling(-10), 0, "size"),
        (WindowAssigner::sliding(10, 0), 0, "slide"),
        (WindowAssigner::sliding(-1, 5), 0, "size"),
        (WindowAssigner::session(0), 0, "session gap"),
        (WindowAssigner::tumbling(10), -1, "allowed lateness"),
    ];
    for (assigner, lateness, named) in cases {
        let job = Job::new(config(2));
        let _ = job
            .from_vec(vec![(1u32, 5i64)])
            .assign_timestamps(WatermarkStrategy::bounded_out_of_orderness(
                0,
                |r: &(u32, i64)| r.1,
            ))
            .key_by(|r| r.0)
            .window(assigner)
            .allowed_lateness(lateness)
            .count_with(|k, w, n| (*k, w.start, n))
            .collect();
        match job.start() {
            Err(weir_runtime::StartError::Config { key, reason }) => {
                assert_eq!(key, "graph");
                assert!(reason.contains(named), "{assigner:?}: {reason}");
            }
            other => panic!("{assigner:?}, lateness {lateness}: {:?}", other.map(|_| ())),
        }
        let driver = weir_runtime::testing::TestDriver::new(move |s| {
            s.key_by(|r: &(u32, i64)| r.0)
                .window(assigner)
                .allowed_lateness(lateness)
                .count_with(|k, w, n| (*k, w.start, n))
        });
        assert!(driver.is_err(), "{assigner:?}: the test driver took it");
    }
    let mut out = Vec::new();
    assert!(WindowAssigner::tumbling(0).assign(5, &mut out).is_err());
    assert!(out.is_empty());
}

/// A window offset as large as the tumbling size or the sliding slide, either way, stops the
/// job before it starts, naming the values, as Flink's assigners refuse one: `Tumbling {
/// size_ms: 10, offset_ms: 1003 }` ran, as windows offset by 3 ms. Offsets within are taken.
#[test]
fn window_offsets_not_less_than_the_size_or_slide_are_refused() {
    let tumbling = |size_ms, offset_ms| WindowAssigner::Tumbling { size_ms, offset_ms };
    let sliding = |size_ms, slide_ms, offset_ms| WindowAssigner::Sliding {
        size_ms,
        slide_ms,
        offset_ms,
    };
    let refused = [
        (tumbling(10, 1003), "1003", "10"),
        (tumbling(10, 10), "10", "10"),
        (tumbling(10, -10), "-10", "10"),
        (sliding(30, 10, 10), "10", "10"),
        (sliding(30, 10, -15), "-15", "10"),
        (sliding(30, 10, 25), "25", "10"),
        (sliding(30, 10, i64::MIN), "-9223372036854775808", "10"),
    ];
    for (assigner, offset, of) in refused {
        let job = Job::new(config(1));
        let _ = job
            .from_vec(vec![(1u32, 5i64)])
            .assign_timestamps(WatermarkStrategy::monotonous(|r: &(u32, i64)| r.1))
            .key_by(|r| r.0)
            .window(assigner)
            .count_with(|k, w, n| (*k, w.start, n))
            .collect();
        match job.start() {
            Err(weir_runtime::StartError::Config { key, reason }) => {
                assert_eq!(key, "graph");
                let named = format!("{offset} ms for a");
                assert!(reason.contains("offset"), "{assigner:?}: {reason}");
                assert!(reason.contains(&named), "{assigner:?}: {reason}");
                assert!(
                    reason.contains(&format!("of {of} ms")),
                    "{assigner:?}: {reason}"
                );
            }
            other => panic!("{assigner:?}: {:?}", other.map(|_| ())),
        }
        let driver = weir_runtime::testing::TestDriver::new(move |s| {
            s.key_by(|r: &(u32, i64)| r.0)
                .window(assigner)
                .count_with(|k, w, n| (*k, w.start, n))
        });
        assert!(driver.is_err(), "{assigner:?}: the test driver took it");
    }
    for assigner in [tumbling(10, 9), tumbling(10, -9), sliding(30, 10, -9)] {
        let mut driver = weir_runtime::testing::TestDriver::new(move |s| {
            s.key_by(|r: &(u32, i64)| r.0)
                .window(assigner)
                .count_with(|k, w, n| (*k, w.start, n))
        })
        .unwrap_or_else(|e| panic!("{assigner:?}: {e}"));
        driver.push_at((1, 5), 5);
        driver.watermark(i64::MAX - 1);
        assert!(!driver.drain().expect("drain").is_empty(), "{assigner:?}");
    }
}

/// A negative out-of-orderness bound, or an idle timeout of 0 or less, stops the job before
/// it starts, naming it, as Flink refuses both: they were taken as 0 and as "idle at once"
/// without a word.
#[test]
fn a_negative_watermark_bound_or_idle_timeout_is_refused() {
    let strategies: Vec<(WatermarkStrategy<(u32, i64)>, &str)> = vec![
        (
            WatermarkStrategy::bounded_out_of_orderness(-5, |r: &(u32, i64)| r.1),
            "out-of-orderness",
        ),
        (
            WatermarkStrategy::bounded_out_of_orderness(0, |r: &(u32, i64)| r.1).with_idleness(0),
            "idle timeout",
        ),
        (
            WatermarkStrategy::monotonous(|r: &(u32, i64)| r.1).with_idleness(-1),
            "idle timeout",
        ),
    ];
    for (strategy, named) in strategies {
        let job = Job::new(config(1));
        let _ = job
            .from_vec(vec![(1u32, 5i64)])
            .assign_timestamps(strategy)
            .collect();
        match job.start() {
            Err(weir_runtime::StartError::Config { key, reason }) => {
                assert_eq!(key, "graph");
                assert!(reason.contains(named), "{reason}");
            }
            other => panic!("{named}: {:?}", other.map(|_| ())),
        }
    }
}

/// Two sources with idleness, one quiet after its first records and one that never sends:
/// once both are idle the largest watermark goes out (Flink's valve flushes it) and the
/// windows it closes fire while the sources stay open (none fired until they closed).
#[test]
fn windows_fire_when_every_source_is_idle() {
    let (tx1, s1) = weir_runtime::source::ingress::<(u64, i64)>(4);
    let (tx2, s2) = weir_runtime::source::ingress::<(u64, i64)>(4);
    let job = Job::new(config(2));
    let idle = |s| {
        job.source(s).assign_timestamps(
            WatermarkStrategy::bounded_out_of_orderness(0, |r: &(u64, i64)| r.1).with_idleness(100),
        )
    };
    let (a, b) = (idle(s1), idle(s2));
    let fired = Arc::new(std::sync::Mutex::new(Vec::new()));
    let f2 = fired.clone();
    a.union(b)
        .key_by(|r| r.0)
        .window(WindowAssigner::tumbling(10))
        .count_with(|k, w, n| (*k, w.start, n))
        .for_each(move |r| f2.lock().expect("lock").push(r));
    let h = job.start().expect("start");
    tx1.push_batch((1..=100).map(|t| (7, t)).collect())
        .expect("push");
    // [0, 10) holds 1..=9; the flushed watermark (99) closes every window up to [80, 90).
    await_window(
        &fired,
        (7, 80, 10),
        "no window fired with every source idle",
    );
    assert!(!h.is_finished());
    tx1.close();
    tx2.close();
    h.wait().expect("job");
    let mut got = fired.lock().expect("lock").clone();
    got.sort_unstable();
    let mut want: Vec<(u64, i64, u64)> = (0..=10).map(|w| (7, w * 10, 10)).collect();
    want[0].2 = 9;
    want[10].2 = 1;
    assert_eq!(got, want);
}

/// An input whose idle timeout (50 ms) is shorter than the periodic watermark interval
/// (200 ms) goes idle for good while it is quiet: the watermark still pending from its last
/// records went out after the idle mark, downstream took it as the input turning active
/// again, and it held the other input's windows back until it ended (Flink's
/// `WatermarksWithIdleness` sends no watermark while idle).
#[test]
fn a_short_idle_timeout_lets_the_other_input_advance() {
    let (tx1, s1) = weir_runtime::source::ingress::<(u64, i64)>(4);
    let (tx2, s2) = weir_runtime::source::ingress::<(u64, i64)>(4);
    // One shard: on a shard that took none of its batches the busy input would be active
    // and empty, holding everything back by itself.
    let job = Job::new(config(1));
    let quiet = job.source(s1).assign_timestamps(
        WatermarkStrategy::bounded_out_of_orderness(0, |r: &(u64, i64)| r.1).with_idleness(50),
    );
    let busy = job
        .source(s2)
        .assign_timestamps(WatermarkStrategy::bounded_out_of_orderness(
            0,
            |r: &(u64, i64)| r.1,
        ));
    let fired = Arc::new(std::sync::Mutex::new(Vec::new()));
    let f2 = fired.clone();
    quiet
        .union(busy)
        .key_by(|r| r.0)
        .window(WindowAssigner::tumbling(100))
        .count_with(|k, w, n| (*k, w.start, n))
        .for_each(move |r| f2.lock().expect("lock").push(r));
    let h = job.start().expect("start");
    tx1.push_batch((0..5).map(|i| (1, i * 5)).collect())
        .expect("push");
    tx2.push_batch((1..=100).map(|i| (2, i * 10)).collect())
        .expect("push");
    // The busy input's watermark (999) closes [800, 900) once the quiet one is idle.
    await_window(&fired, (2, 800, 10), "the quiet input held the watermark");
    assert!(!h.is_finished());
    tx1.close();
    tx2.close();
    h.wait().expect("job");
}

/// An input is idle only after a whole timeout without records, however long a step takes.
/// Each shard's split is in order, one 20 s of event time ahead of the other, and a slow map
/// (1 ms a record, 64 records a poll) makes every step longer than the 50 ms timeout. No
/// record is late. Before, a record was stamped with the time its step began, so each check
/// after a long step found the input idle: the shard ahead then moved the windows' watermark
/// past the other's records, and 912 of 2,000 were dropped.
#[test]
fn a_step_longer_than_the_idle_timeout_does_not_make_its_input_idle() {
    let job = Job::new(config(2).with_batch_records(64));
    let input = job
        .from_iter(|shard, _| {
            let ahead = if shard == 1 { 20_000 } else { 0 };
            (0..400u64).map(move |i| (i % 4, ahead + i as i64 * 10))
        })
        .inspect(|_| std::thread::sleep(std::time::Duration::from_millis(1)))
        .assign_timestamps(
            WatermarkStrategy::bounded_out_of_orderness(0, |r: &(u64, i64)| r.1).with_idleness(50),
        );
    assert_every_record_counted(job, input, 800);
}

/// A timestamp assigner after a union of a source with an exchanged stream keeps the two
/// apart: the exchanged records (20 s of event time ahead) are a split of their own, not
/// counted against the source's. Each input is in order, so no record is late. Before, they
/// raised the source split's largest timestamp, and 2,986 of the source's 3,000 records were
/// dropped as late (an audit's job; none without the rebalance).
#[test]
fn an_exchanged_input_of_a_union_is_a_split_of_its_own() {
    let job = Job::new(config(1).with_batch_records(7));
    let n = 3_000u64;
    let recs = move |ahead: i64| (0..n).map(move |i| (i % 4, ahead + i as i64 * 10));
    let ahead = job.from_iter(move |_, _| recs(20_000)).rebalance();
    let behind = job.from_iter(move |_, _| recs(0));
    let input = behind.union(ahead).assign_timestamps(
        WatermarkStrategy::bounded_out_of_orderness(0, |r: &(u64, i64)| r.1)
            .with_watermark_per_record(),
    );
    assert_every_record_counted(job, input, 2 * n);
}

/// Runs `job`, counting `input`'s `(key, timestamp)` records in tumbling windows of 100 ms:
/// no record may be dropped as late, and the windows must count `n` in all.
fn assert_every_record_counted(job: Job, input: weir_runtime::Stream<(u64, i64)>, n: u64) {
    let fired = Arc::new(std::sync::Mutex::new(Vec::new()));
    let f2 = fired.clone();
    input
        .key_by(|r| r.0)
        .window(WindowAssigner::tumbling(100))
        .count_with(|k, w, c| (*k, w.start, c))
        .uid("windows")
        .for_each(move |r| f2.lock().expect("lock").push(r));
    let summary = job.run().expect("job");
    let dropped: u64 = summary
        .metrics
        .operators
        .iter()
        .filter(|o| o.operator == "windows")
        .map(|o| o.records_dropped)
        .sum();
    assert_eq!(dropped, 0, "records dropped as late");
    let counted: u64 = fired.lock().expect("lock").iter().map(|w| w.2).sum();
    assert_eq!(counted, n);
}

/// Waits (60 s at most, else fails with `what`) until `fired` holds `window`.
fn await_window(
    fired: &std::sync::Mutex<Vec<(u64, i64, u64)>>,
    window: (u64, i64, u64),
    what: &str,
) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !fired.lock().expect("lock").contains(&window) {
        let got = fired.lock().expect("lock").clone();
        assert!(std::time::Instant::now() < deadline, "{what}: {got:?}");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// A shard whose executor cannot be built (glommio panicked setting up an io_uring buffer of
/// a TiB) ends the job with an error: the panic came before the shard's guard existed, so
/// the job waited in Initializing for good. Whether it is refused up front or fails in the
/// shard, it must end.
#[test]
fn a_shard_whose_executor_cannot_be_built_ends_the_job() {
    let job = Job::new(config(2).with_io_memory_bytes(1 << 40));
    let _ = job.from_vec((0..10u64).collect()).collect();
    let (tx, rx) = std::sync::mpsc::channel();
    let h = job.start();
    let h = match h {
        Ok(h) => h,
        Err(e) => {
            assert!(e.to_string().contains("io_memory_bytes"), "{e}");
            return;
        }
    };
    let waiter = std::thread::spawn(move || {
        let _ = tx.send(h.wait().map(|_| ()).map_err(|e| e.to_string()));
    });
    let r = rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("the job did not end");
    assert!(r.is_err(), "{r:?}");
    waiter.join().expect("waiter");
}

/// A record above its ring's largest frame (half the ring) is refused with its size, whether
/// the ring is empty or not, and one within it goes through. Between half the ring and the
/// writer's next spill buffer a record was neither: the job waited for it for good (an
/// audit's 40,000-byte strings on a 64 KiB ring), an empty ring having taken the first one;
/// and a refusal named the buffer tried, not the record (1 MiB for a 10 MiB string).
#[test]
fn a_record_above_the_largest_frame_is_refused_with_its_size() {
    let ring = 64 << 10;
    for (len, fits) in [(32_000usize, true), (40_000, false), (70_000, false)] {
        let job = Job::new(config(1).with_ring_capacity_bytes(ring));
        let input = vec!["a".repeat(len), "b".repeat(len)];
        let out = job.from_vec(input.clone()).rebalance().collect();
        let h = job.start().expect("start");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while !h.is_finished() {
            if std::time::Instant::now() > deadline {
                h.cancel();
                panic!("{len}-byte records: the job neither ended nor failed");
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        match (h.wait(), fits) {
            (Ok(_), true) => assert_eq!(out.take(), input),
            (
                Err(JobError::RecordTooLarge {
                    bytes,
                    capacity_bytes,
                    ..
                }),
                false,
            ) => {
                assert!(bytes > len && bytes <= len + 64, "{len}: {bytes} bytes");
                assert_eq!(capacity_bytes, ring);
            }
            (r, _) => panic!("{len}-byte records: {r:?}"),
        }
    }
}

/// A union of two ingresses, one open and quiet, before one timestamp assigner: each input is
/// a split of the assigner's, and with an idle timeout the quiet one is left out of the
/// watermark once idle (Flink's per-split idleness), so the busy one's windows fire while the
/// job runs, with every record counted. Without a timeout the quiet split holds them until
/// the end. Before, idleness was the whole assigner's: the quiet split held the windows back
/// for good, even with a timeout.
#[test]
fn a_quiet_split_of_a_union_goes_idle_and_lets_windows_fire() {
    for shards in [1, 2] {
        for idleness in [Some(100), None] {
            let (busy, s1) = weir_runtime::source::ingress::<(u64, i64)>(4);
            let (quiet, s2) = weir_runtime::source::ingress::<(u64, i64)>(4);
            let job = Job::new(config(shards));
            let mut strategy =
                WatermarkStrategy::monotonous(|r: &(u64, i64)| r.1).with_watermark_per_record();
            if let Some(ms) = idleness {
                strategy = strategy.with_idleness(ms);
            }
            let fired = Arc::new(std::sync::Mutex::new(Vec::new()));
            let f2 = fired.clone();
            job.source(s1)
                .union(job.source(s2))
                .assign_timestamps(strategy)
                .key_by(|r| r.0)
                .window(WindowAssigner::tumbling(100))
                .count_with(|k, w, n| (*k, w.start, n))
                .for_each(move |r| f2.lock().expect("lock").push(r));
            let h = job.start().expect("start");
            // Round `r` fills the window at `r * 100`; round `r + 1`'s watermark closes it.
            let round = |r: i64| (0..10).map(|i| (7, r * 100 + i * 10)).collect();
            for r in 0..10 {
                busy.push_batch(round(r)).expect("push");
                if idleness.is_some() && r > 0 {
                    await_window(
                        &fired,
                        (7, (r - 1) * 100, 10),
                        &format!("{shards} shard(s): the quiet split held the watermark"),
                    );
                }
            }
            if idleness.is_none() {
                std::thread::sleep(std::time::Duration::from_millis(500));
                let got = fired.lock().expect("lock").clone();
                assert_eq!(
                    got,
                    vec![],
                    "{shards} shard(s): a window fired without idleness"
                );
            }
            assert!(!h.is_finished());
            busy.close();
            quiet.close();
            h.wait().expect("job");
            let mut got = fired.lock().expect("lock").clone();
            got.sort_unstable();
            let want: Vec<(u64, i64, u64)> = (0..10).map(|r| (7, r * 100, 10)).collect();
            assert_eq!(got, want, "{shards} shard(s), idleness {idleness:?}");
        }
    }
}
