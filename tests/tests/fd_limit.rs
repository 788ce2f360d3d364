//! A job on 2 shards under file-descriptor limits from none to enough. In a test binary of its
//! own: the limit is the whole process's.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use weir_runtime::checkpoint::{CheckpointConfig, RestartStrategy};
use weir_runtime::{Job, JobConfig, JobError, JobStatus, Pinning, StartError};

fn open_fds() -> u64 {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64)
}

fn set_soft_limit(n: u64) {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `l` is a valid rlimit for getrlimit to fill; setrlimit reads it.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut l), 0);
        l.rlim_cur = n.min(l.rlim_max);
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &l), 0);
    }
}

/// Jobs started at the same moment, and how many times.
const STARTS_AT_ONCE: usize = 8;
const STARTS_AT_ONCE_ROUNDS: usize = 5;

/// Whatever the limit, the job ends, and a limit too low for its shards is refused before any
/// executor is built, with a typed error naming the limit. glommio, out of descriptors while it
/// builds an executor, panics in places (reading sysfs; in its io_uring probe, which then stays
/// poisoned for the process's life, so that every later job of the process failed too: this
/// test failed so on a fresh CI machine). After the sweep, the process still runs a job.
#[test]
fn a_job_ends_whatever_descriptors_its_shards_find() {
    let mut soft = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `soft` is a valid rlimit for getrlimit to fill.
    let got = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut soft) };
    assert_eq!(got, 0);
    let (mut ok, mut refused) = (0, 0);
    for extra in (0..80u64).step_by(3) {
        let base = open_fds();
        let job = Job::new(JobConfig::new().with_shards(2).with_pinning(Pinning::Never));
        let out = job.from_vec((0..1000u64).collect());
        let out = out.collect();
        set_soft_limit(base + extra);
        let started = job.start();
        let ran = match started {
            Ok(h) => {
                let deadline = Instant::now() + Duration::from_secs(30);
                while !h.is_finished() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(5));
                }
                let finished = h.is_finished();
                if !finished {
                    h.cancel();
                }
                set_soft_limit(soft.rlim_cur);
                assert!(finished, "{extra} spare descriptors: the job did not end");
                let r = h.wait();
                assert!(r.is_ok(), "{extra} spare descriptors: {r:?}");
                true
            }
            Err(e) => {
                set_soft_limit(soft.rlim_cur);
                match &e {
                    StartError::TooFewDescriptors { shards, limit, .. } => {
                        assert_eq!(*shards, 2);
                        assert_eq!(*limit, base + extra);
                        let text = e.to_string();
                        assert!(text.contains("ulimit -n"), "{text}");
                    }
                    other => panic!("{extra} spare descriptors: {other}"),
                }
                false
            }
        };
        if ran {
            assert_eq!(out.take().len(), 1000, "{extra} spare descriptors");
            ok += 1;
        } else {
            refused += 1;
        }
        if ok >= 3 {
            break;
        }
    }
    assert!(
        ok >= 1 && refused >= 1,
        "ok {ok}, refused {refused}: the limits tried did not give both"
    );
    // Jobs started at the same moment: each one's check must count the descriptors that the
    // others' executors take, or all pass it and their executors then run out (a process-wide
    // lock holds each start's check and its executor builds apart from the others'). Under a
    // limit that fits one job's need, every start gives a job that runs until cancelled, or is
    // refused with the typed error. (The jobs have no end: one that ended at once would give
    // its descriptors back before the next check.)
    let need = 2 * weir_runtime::platform::DESCRIPTORS_PER_SHARD
        + weir_runtime::platform::DESCRIPTORS_PER_JOB;
    let (mut ran_together, mut refused_together) = (0, 0);
    for round in 0..STARTS_AT_ONCE_ROUNDS {
        let gate = Arc::new(std::sync::Barrier::new(STARTS_AT_ONCE + 1));
        let starts: Vec<_> = (0..STARTS_AT_ONCE)
            .map(|_| {
                let gate = gate.clone();
                std::thread::spawn(move || {
                    let job =
                        Job::new(JobConfig::new().with_shards(2).with_pinning(Pinning::Never));
                    let seen = Arc::new(AtomicBool::new(false));
                    let s = seen.clone();
                    job.from_iter(|_, _| 0..u64::MAX).for_each(move |_: u64| {
                        s.store(true, Ordering::Release);
                        std::thread::sleep(Duration::from_micros(50));
                    });
                    gate.wait();
                    (job.start(), seen)
                })
            })
            .collect();
        set_soft_limit(open_fds() + need);
        gate.wait();
        let started: Vec<_> = starts
            .into_iter()
            .map(|t| t.join().expect("start thread"))
            .collect();
        set_soft_limit(soft.rlim_cur);
        for (i, (started, seen)) in started.into_iter().enumerate() {
            match started {
                Ok(h) => {
                    let deadline = Instant::now() + Duration::from_secs(30);
                    while !seen.load(Ordering::Acquire) && !h.is_finished() {
                        assert!(
                            Instant::now() < deadline,
                            "round {round}, job {i}: no record"
                        );
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    h.cancel();
                    match h.wait() {
                        Err(JobError::Cancelled) => ran_together += 1,
                        // Past the check at start, refused by the first attempt's, which
                        // counts what jobs that started meanwhile built.
                        Err(JobError::Start(StartError::TooFewDescriptors {
                            shards: 2, ..
                        })) => refused_together += 1,
                        r => panic!("round {round}, job {i}: {r:?}"),
                    }
                }
                Err(StartError::TooFewDescriptors { shards: 2, .. }) => refused_together += 1,
                Err(other) => panic!("round {round}, job {i}: {other}"),
            }
        }
    }
    assert!(
        ran_together >= STARTS_AT_ONCE_ROUNDS && refused_together >= 1,
        "ran {ran_together}, refused {refused_together}"
    );

    // Nothing glommio keeps for the process was spoiled by the low limits.
    let job = Job::new(JobConfig::new().with_shards(2).with_pinning(Pinning::Never));
    let out = job.from_vec((0..100u64).collect()).collect();
    job.start().unwrap().wait().unwrap();
    assert_eq!(out.take().len(), 100);

    // A restart builds its executors anew: short of descriptors then, the job ends with the
    // same typed error (the limit is lowered while the job waits out its restart delay).
    let dir = tempfile::tempdir().expect("tmp");
    let fail = Arc::new(AtomicBool::new(false));
    let job = Job::new(
        JobConfig::new()
            .with_shards(2)
            .with_pinning(Pinning::Never)
            .with_checkpointing(CheckpointConfig::new(dir.path(), "fds").with_restart(
                RestartStrategy::FixedDelay {
                    attempts: 3,
                    delay: Duration::from_millis(500),
                },
            )),
    );
    let f = fail.clone();
    job.from_iter(|_, _| 0..u64::MAX)
        .map(move |i: u64| {
            if f.swap(false, Ordering::AcqRel) {
                panic!("injected failure");
            }
            std::thread::sleep(Duration::from_micros(50));
            i
        })
        .for_each(|_| {});
    let h = job.start().expect("start");
    fail.store(true, Ordering::Release);
    let deadline = Instant::now() + Duration::from_secs(30);
    while h.status() != JobStatus::Restarting {
        assert!(Instant::now() < deadline, "the job did not restart");
        std::thread::sleep(Duration::from_millis(1));
    }
    set_soft_limit(open_fds() + 10);
    // The input has no end: a restart that got its executors runs until cancelled.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !h.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    set_soft_limit(soft.rlim_cur);
    let finished = h.is_finished();
    h.cancel();
    let r = h.wait();
    assert!(finished, "the restart ran short of descriptors: {r:?}");
    match r {
        Err(JobError::Start(StartError::TooFewDescriptors { shards, .. })) => {
            assert_eq!(shards, 2)
        }
        other => panic!("a restart short of descriptors: {other:?}"),
    }
}
