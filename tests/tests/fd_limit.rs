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
