//! Multi-shard keyed jobs compared with an independent sequential computation.

use std::collections::HashMap;

use weir_runtime::testing::TestDriver;
use weir_runtime::{Job, JobConfig, WatermarkStrategy, WindowAssigner};

fn config(shards: usize) -> JobConfig {
    // Tests pass with more shards than cores: unpinned.
    JobConfig::new()
        .with_shards(shards)
        .with_pinning(weir_runtime::Pinning::Never)
}

fn input(n: u64, keys: u64) -> Vec<(u64, i64)> {
    (0..n)
        .map(|i| {
            let r = weir_runtime::source::splitmix64(7, i);
            (r % keys, (r >> 20) as i64 % 1000 - 500)
        })
        .collect()
}

/// Per-key running sums of `data` (a keyed reduce with uid "sum"), and the job's summary.
fn running_sums(
    config: JobConfig,
    data: &[(u64, i64)],
) -> (Vec<(u64, i64)>, weir_runtime::JobSummary) {
    let job = Job::new(config);
    let out = job
        .from_vec(data.to_vec())
        .key_by(|(k, _)| *k)
        .reduce(|(k, a), (_, b)| (k, a + b))
        .uid("sum")
        .collect();
    let summary = job.run().expect("job runs");
    (out.take(), summary)
}

#[test]
fn keyed_running_sum_on_four_shards_matches_sequential() {
    let data = input(20_000, 97);
    let (out, summary) = running_sums(config(4), &data);
    let mut got: HashMap<u64, Vec<i64>> = HashMap::new();
    for (k, s) in out {
        got.entry(k).or_default().push(s);
    }
    let mut want: HashMap<u64, Vec<i64>> = HashMap::new();
    let mut sums: HashMap<u64, i64> = HashMap::new();
    for (k, v) in &data {
        let s = sums.entry(*k).or_default();
        *s += v;
        want.entry(*k).or_default().push(*s);
    }
    assert_eq!(got, want, "per key, the running sums arrive in input order");
    assert_eq!(summary.metrics.records_in("sum"), data.len() as u64);
}

#[test]
fn tumbling_window_counts_with_out_of_order_and_late_events() {
    // (key, ts): window size 10, out-of-orderness 5.
    let events: Vec<(u32, i64)> = vec![
        (1, 1),
        (1, 3),
        (2, 4),
        (1, 12),
        (1, 8),
        (2, 15),
        (1, 25),
        (1, 2),
        (2, 30),
        (1, 14),
    ];
    let mut d = TestDriver::new(|s| {
        s.assign_timestamps(WatermarkStrategy::bounded_out_of_orderness(
            5,
            |e: &(u32, i64)| e.1,
        ))
        .key_by(|e| e.0)
        .window(WindowAssigner::tumbling(10))
        .count_with(|k, w, n| (*k, w.start, n))
    })
    .expect("driver");
    for e in &events {
        d.push(*e);
        // Periodic watermark emission follows processing time.
        d.set_processing_time(d_now(e.1));
        d.run_until_idle().expect("run");
    }
    let mut out = d.finish().expect("finish");
    out.sort();
    // After (1,25) the watermark is 25 - 5 - 1 = 19: (1,2) and (1,14) arrive after their
    // windows' last millisecond (9 and 19) was passed: late, dropped.
    assert_eq!(
        out,
        vec![
            (1, 0, 3),
            (1, 10, 1),
            (1, 20, 1),
            (2, 0, 1),
            (2, 10, 1),
            (2, 30, 1)
        ]
    );
}

/// A timestamp whose window does not fit in i64 fails the job naming the timestamp (before,
/// the window start wrapped to a far-future window and the record was counted there), and a
/// timestamp of `i64::MIN`, which marks records without one, fails it at the assigner.
#[test]
fn timestamps_without_a_representable_window_fail_the_job() {
    let run = |ts: i64| {
        let mut d = TestDriver::new(|s| {
            s.assign_timestamps(WatermarkStrategy::bounded_out_of_orderness(
                0,
                |e: &(u32, i64)| e.1,
            ))
            .key_by(|e| e.0)
            .window(WindowAssigner::tumbling(10_000))
            .count_with(|k, w, n| (*k, w.start, n))
        })
        .expect("driver");
        d.push((1, 5));
        d.push((1, ts));
        d.run_until_idle().and_then(|()| d.finish()).map(|mut out| {
            out.sort();
            out
        })
    };
    let e = run(-9_223_372_036_854_775_807).expect_err("no window holds it");
    assert!(
        e.to_string().contains("-9223372036854775807")
            && e.to_string().contains("64-bit millisecond range"),
        "{e}"
    );
    assert!(run(i64::MAX - 3).is_err());
    let e = run(i64::MIN).expect_err("reserved");
    assert!(e.to_string().contains("timestamp assigner returned"), "{e}");
    // Timestamps near the ends whose windows fit are counted as any other.
    let ok = i64::MAX - i64::MAX.rem_euclid(10_000) - 1;
    assert_eq!(
        run(ok).expect("fits"),
        [(1, 0, 1), (1, ok - ok.rem_euclid(10_000), 1)]
    );
}

/// A key longer than keyed state takes fails the job naming the operator and the key's
/// length, for keyed process functions and windows alike; before, the store's key-length
/// assertion panicked the shard.
#[test]
fn a_key_longer_than_keyed_state_takes_fails_the_job() {
    let long = "k".repeat(weir_state::MAX_KEY_BYTES);
    let reduce = |key: String| {
        let mut d = TestDriver::new(|s| {
            s.key_by(|e: &(String, i64)| e.0.clone())
                .reduce(|a, b| (a.0, a.1 + b.1))
        })
        .expect("driver");
        d.push(("a".to_owned(), 1));
        d.push((key, 2));
        d.run_until_idle().and_then(|()| d.finish())
    };
    let e = reduce(long.clone()).expect_err("too long");
    let message = e.to_string();
    assert!(
        message.contains(&format!("{} bytes", weir_state::MAX_KEY_BYTES + 2))
            && message.contains("longer than"),
        "{message}"
    );
    let fits = "k".repeat(weir_state::MAX_KEY_BYTES - 2);
    assert_eq!(reduce(fits.clone()).expect("fits").len(), 2);
    let mut d = TestDriver::new(|s| {
        s.assign_timestamps(WatermarkStrategy::bounded_out_of_orderness(
            0,
            |e: &(String, i64)| e.1,
        ))
        .key_by(|e| e.0.clone())
        .window(WindowAssigner::tumbling(10))
        .count_with(|k, w, n| (k.len(), w.start, n))
    })
    .expect("driver");
    d.push((long, 1));
    let e = d
        .run_until_idle()
        .and_then(|()| d.finish())
        .expect_err("too long");
    assert!(e.to_string().contains("longer than"), "{e}");
}

fn d_now(ts: i64) -> i64 {
    1_000_000 + ts * 1000
}

#[test]
fn a_store_whose_flushes_lag_stalls_the_shard_and_loses_nothing() {
    // A 16 KiB memtable freezes every few hundred records, far faster than flushes (each
    // fsyncs) complete: the shards must stop at the store's write-stall limit instead of
    // queueing frozen memtables without bound, then go on with every record.
    let data = input(200_000, 50_000);
    let (got, summary) = running_sums(config(2).with_memtable_budget_bytes(16 << 10), &data);
    let mut sums: HashMap<u64, i64> = HashMap::new();
    for (k, v) in &data {
        *sums.entry(*k).or_default() += v;
    }
    let mut last: HashMap<u64, i64> = HashMap::new();
    assert_eq!(got.len(), data.len());
    for (k, s) in got {
        last.insert(k, s);
    }
    assert_eq!(last, sums, "every key's final sum");
    let stalled: u64 = summary
        .metrics
        .heads
        .iter()
        .filter(|h| h.head == weir_runtime::STATE_STALL)
        .map(|h| h.backpressured_ns)
        .sum();
    assert!(stalled > 0, "the shards never waited for their stores");
}

/// `JobHandle::wait` returns once the job let go of its files. A cancelled job's maintenance
/// threads used to finish the snapshot they were writing after `wait` had returned: the
/// checkpoint writer they held kept the checkpoint directory's lock, so that the next job on
/// that directory was refused ("locked by another owner"), and their run directories were
/// still in the state directory. Each round cancels a job whose checkpoints run back to back
/// (large values, a 5 ms interval) while a checkpoint after its first is in progress, so that
/// a snapshot is being written then. Without the wait it failed 3 of 3 runs.
#[test]
fn wait_returns_once_the_job_let_go_of_its_checkpoint_directory_and_state() {
    use std::time::{Duration, Instant};
    use weir_runtime::checkpoint::CheckpointConfig;
    for round in 0..5 {
        let tmp = tempfile::tempdir().expect("tmp");
        let (ck, state) = (tmp.path().join("ck"), tmp.path().join("state"));
        let job = Job::new(config(2).with_state_dir(&state).with_checkpointing(
            CheckpointConfig::new(&ck, "release").with_interval(Duration::from_millis(5)),
        ));
        job.from_iter(|shard, shards| {
            (0u64..).map(move |i| {
                let k = (i * shards as u64 + shard as u64) % 150_000;
                (k, "v".repeat(300))
            })
        })
        .key_by(|(k, _)| *k)
        .reduce(|(k, a), (_, b)| (k, if a.len() < b.len() { b } else { a }))
        .uid("latest")
        .for_each(drop);
        let h = job.start().expect("starts");
        let deadline = Instant::now() + Duration::from_secs(60);
        // Cancel while a checkpoint after the first is in progress.
        while {
            let m = h.checkpoint_metrics();
            m.number_of_completed_checkpoints < 1 || m.number_of_in_progress_checkpoints == 0
        } {
            assert!(Instant::now() < deadline, "round {round}: no checkpoint");
            std::thread::sleep(Duration::from_millis(1));
        }
        h.cancel();
        assert!(
            matches!(h.wait(), Err(weir_runtime::JobError::Cancelled)),
            "round {round}"
        );
        let lock = weir_io::DirLock::acquire(&ck.join("release"));
        assert!(lock.is_ok(), "round {round}: {:?}", lock.err());
        drop(lock);
        let own = format!("run-{}-", std::process::id());
        for shard in std::fs::read_dir(&state).expect("state dir").flatten() {
            for op in std::fs::read_dir(shard.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                for run in std::fs::read_dir(op.path()).into_iter().flatten().flatten() {
                    let name = run.file_name().to_string_lossy().into_owned();
                    assert!(
                        !name.starts_with(&own),
                        "round {round}: {} is still there",
                        run.path().display()
                    );
                }
            }
        }
    }
}

/// A panic in user code under the test driver is an error, as in a real job
/// (`JobError::Panic`), not a panic of the test that drives it; the driver stays failed.
#[test]
fn a_panic_in_the_test_driver_is_a_job_error() {
    let mut d = TestDriver::new(|s| {
        s.key_by(|r: &(u32, i64)| r.0).reduce(|a, b| {
            assert!(b.1 != 13, "unlucky value");
            (a.0, a.1 + b.1)
        })
    })
    .expect("driver");
    d.push((1, 1));
    assert_eq!(d.drain().expect("fine so far"), vec![(1, 1)]);
    d.push((1, 13));
    for _ in 0..2 {
        match d.drain() {
            Err(weir_runtime::JobError::Panic { message, .. }) => {
                assert!(message.contains("unlucky value"), "{message}");
                assert!(message.contains("(in the chain from `key_by"), "{message}");
            }
            other => panic!("a panic's error: {other:?}"),
        }
    }
}
