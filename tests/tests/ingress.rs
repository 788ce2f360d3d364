//! Ingress sources in running jobs: every record a host pushed reaches an exactly-once sink
//! once across a restart, and the input ends when the hosts let go of their handles.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use weir_runtime::checkpoint::{CheckpointConfig, CheckpointMode, RestartStrategy};
use weir_runtime::sink::TransactionalFileSink;
use weir_runtime::source::ingress;
use weir_runtime::{Job, JobConfig, JobHandle, JobSummary, Pinning};

/// Records pushed, in batches of [`BATCH`]; the map panics once at record `N / 2`.
const N: u64 = 300_000;
const BATCH: u64 = 1_000;

/// An exactly-once job on `shards` shards, checkpointing every `interval` into `dir`, with a
/// fixed-delay restart.
fn config(dir: &std::path::Path, shards: usize, interval: Duration) -> JobConfig {
    JobConfig::new()
        .with_shards(shards)
        .with_pinning(Pinning::Never)
        .with_checkpointing(
            CheckpointConfig::new(dir.join("ckpt"), "ingress")
                .with_mode(CheckpointMode::ExactlyOnce)
                .with_interval(interval)
                .with_restart(RestartStrategy::FixedDelay {
                    attempts: 3,
                    delay: Duration::from_millis(10),
                }),
        )
}

/// Waits (30 s at most) until `h` completed `n` checkpoints.
fn await_checkpoints(h: &JobHandle, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while h.checkpoint_metrics().number_of_completed_checkpoints < n {
        assert!(
            Instant::now() < deadline,
            "{n} checkpoints did not complete"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A host thread pushes `0..N` into an ingress job on `shards` shards (a map that panics once
/// at `N / 2`, a rebalance, the exactly-once file sink). With `checkpoint_first`, it pushes
/// the first 40% and waits until a checkpoint taken after the job read records completed, so
/// that the restart restores it; without, no checkpoint is taken before the failure. Returns
/// the committed records, sorted, and the job's summary.
fn run(shards: usize, checkpoint_first: bool) -> (Vec<u64>, JobSummary) {
    let dir = tempfile::tempdir().expect("tmp");
    let out = dir.path().join("out");
    let interval = if checkpoint_first {
        Duration::from_millis(20)
    } else {
        Duration::from_secs(3600)
    };
    let (tx, src) = ingress::<u64>(8);
    let job = Job::new(config(dir.path(), shards, interval));
    let fail = Arc::new(AtomicBool::new(true));
    job.source(src)
        .uid("ingress")
        .map(move |x: u64| {
            if x == N / 2 && fail.swap(false, Ordering::AcqRel) {
                panic!("injected failure");
            }
            x
        })
        .rebalance()
        .sink(TransactionalFileSink::new(
            out.clone(),
            |x: &u64, line: &mut String| line.push_str(&x.to_string()),
        ))
        .uid("out");
    let h = job.start().expect("start");
    let (go, wait) = mpsc::channel::<()>();
    let first = if checkpoint_first { N * 2 / 5 } else { N };
    let host = std::thread::spawn(move || {
        let batches = |from: u64, to: u64| {
            for b in (from..to).step_by(BATCH as usize) {
                tx.push_batch((b..(b + BATCH).min(to)).collect())
                    .expect("the job takes the batch");
            }
        };
        batches(0, first);
        if first < N {
            wait.recv().expect("go on");
            batches(first, N);
        }
        tx.close();
    });
    if checkpoint_first {
        let deadline = Instant::now() + Duration::from_secs(30);
        while h.metrics().records_out("ingress") == 0 {
            assert!(Instant::now() < deadline, "no record left the ingress");
            std::thread::sleep(Duration::from_millis(1));
        }
        // The one in flight may have been triggered before the records.
        let done = h.checkpoint_metrics().number_of_completed_checkpoints;
        await_checkpoints(&h, done + 2);
        go.send(()).expect("the host waits");
    }
    host.join().expect("host");
    let summary = h.wait().expect("the job recovers and finishes");
    let mut got: Vec<u64> = Vec::new();
    for e in std::fs::read_dir(&out).expect("output").flatten() {
        if e.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        let text = std::fs::read_to_string(e.path()).expect("part file");
        got.extend(text.lines().map(|l| l.parse::<u64>().expect("a record")));
    }
    got.sort_unstable();
    (got, summary)
}

/// Every pushed record exactly once: names how many are missing or doubled, not all.
fn assert_exactly_the_input(got: &[u64], what: &str) {
    if got.iter().copied().eq(0..N) {
        return;
    }
    let mut count = vec![0u32; N as usize];
    for &x in got {
        if let Some(c) = count.get_mut(x as usize) {
            *c += 1;
        }
    }
    let missing: Vec<usize> = (0..count.len()).filter(|&i| count[i] == 0).collect();
    let twice: Vec<usize> = (0..count.len()).filter(|&i| count[i] > 1).collect();
    panic!(
        "{what}: {} lines for {N} records: {} missing (first {:?}), {} more than once (first \
         {:?})",
        got.len(),
        missing.len(),
        &missing[..missing.len().min(5)],
        twice.len(),
        &twice[..twice.len().min(5)],
    );
}

/// The audit's repro: an ingress job that fails once mid-stream and restarts from a
/// checkpoint committed 285,120 of 300,000 records (what the failed attempt took from the
/// queue after the checkpoint, and the rest of the batch it was reading, were gone). Each
/// shard's reader now replays what it took after the restored position: on one shard and on
/// two (both read the queue), the output is exactly the pushed records.
#[test]
fn an_ingress_job_restored_from_a_checkpoint_commits_every_pushed_record_once() {
    for shards in [1, 2] {
        let (got, summary) = run(shards, true);
        let what = format!("{shards} shards");
        assert_eq!(summary.restarts, 1, "{what}");
        assert!(
            summary.checkpoints.last_restored_checkpoint_id.is_some(),
            "{what}: the restart restored a checkpoint"
        );
        assert_exactly_the_input(&got, &what);
    }
}

/// A failure before the first checkpoint completed restarts from the beginning, as Flink does
/// with a replayable source: the ingress replays everything its shards took.
#[test]
fn an_ingress_job_restarted_before_its_first_checkpoint_commits_every_pushed_record_once() {
    for shards in [1, 2] {
        let (got, summary) = run(shards, false);
        let what = format!("{shards} shards");
        assert_eq!(summary.restarts, 1, "{what}");
        assert_eq!(
            summary.checkpoints.last_restored_checkpoint_id, None,
            "{what}: no checkpoint before the failure"
        );
        assert_exactly_the_input(&got, &what);
    }
}

/// Hosts that drop every handle (a clone too) without `close` end the input, as a channel's
/// senders do: the job read what they pushed and finishes. It used to run forever.
#[test]
fn dropping_every_ingress_handle_ends_the_job() {
    let (tx, src) = ingress::<u64>(4);
    let job = Job::new(JobConfig::new().with_shards(2).with_pinning(Pinning::Never));
    let out = job.source(src).map(|x| x * 2).collect();
    let h = job.start().expect("start");
    let tx2 = tx.clone();
    let host = std::thread::spawn(move || {
        tx2.push_batch(vec![1, 2]).expect("push");
    });
    tx.push_batch(vec![3]).expect("push");
    drop(tx);
    host.join().expect("host");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !h.is_finished() {
        if Instant::now() > deadline {
            h.cancel();
            panic!("the job did not end when its hosts dropped their handles");
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    h.wait().expect("job");
    let mut got = out.take();
    got.sort_unstable();
    assert_eq!(got, vec![2, 4, 6]);
}

/// With checkpointing, the ingress keeps what its shards read since the last completed
/// checkpoint: once every record was read and checkpoints completed after that, nothing;
/// without checkpointing it never keeps anything. (A source never told of completed
/// checkpoints kept all 300,000.)
#[test]
fn an_ingress_keeps_only_what_was_read_since_the_last_completed_checkpoint() {
    for checkpointing in [true, false] {
        let dir = tempfile::tempdir().expect("tmp");
        let (tx, src) = ingress::<u64>(8);
        let config = if checkpointing {
            config(dir.path(), 2, Duration::from_millis(20))
        } else {
            JobConfig::new().with_shards(2).with_pinning(Pinning::Never)
        };
        let job = Job::new(config);
        let out = job.source(src).uid("ingress").map(|x: u64| x).collect();
        let h = job.start().expect("start");
        let mut most = 0;
        for b in (0..N).step_by(BATCH as usize) {
            tx.push_batch((b..b + BATCH).collect()).expect("push");
            most = most.max(tx.replay_records());
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while h.metrics().records_out("ingress") < N {
            assert!(
                Instant::now() < deadline,
                "the job did not read every record"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        if checkpointing {
            // Checkpoints whose barriers came after the last record: their positions are
            // the logs' ends.
            let done = h.checkpoint_metrics().number_of_completed_checkpoints;
            await_checkpoints(&h, done + 2);
            while tx.replay_records() > 0 {
                assert!(
                    Instant::now() < deadline,
                    "{} records kept after checkpoints past every record completed",
                    tx.replay_records()
                );
                std::thread::sleep(Duration::from_millis(1));
            }
        } else {
            assert_eq!((most, tx.replay_records()), (0, 0), "without checkpointing");
        }
        tx.close();
        h.wait().expect("job");
        assert_eq!(out.len() as u64, N);
    }
}
