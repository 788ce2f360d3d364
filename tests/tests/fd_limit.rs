//! A job on 2 shards under a file-descriptor limit that lets some executors be built and not
//! others. In a test binary of its own: the limit is the whole process's.

use std::time::{Duration, Instant};

use weir_runtime::{Job, JobConfig, Pinning};

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

/// Whatever the limit, the job ends (with an error where a shard's executor could not be
/// built). glommio returns an error, not a panic, when it cannot set up an executor's rings;
/// the shard's closure was then dropped unrun, and the other shard waited for good for it to
/// be built: the job hung in Initializing.
#[test]
fn a_job_ends_whatever_descriptors_its_shards_find() {
    let mut soft = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `soft` is a valid rlimit for getrlimit to fill.
    let got = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut soft) };
    assert_eq!(got, 0);
    let (mut ok, mut failed) = (0, 0);
    for extra in 0..40u64 {
        let base = open_fds();
        let job = Job::new(JobConfig::new().with_shards(2).with_pinning(Pinning::Never));
        let out = job.from_vec((0..1000u64).collect()).collect();
        set_soft_limit(base + extra);
        // `true`: the job ran to its end; `false`: it failed to start or failed.
        let ran = match job.start() {
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
                h.wait().is_ok()
            }
            Err(_) => false,
        };
        set_soft_limit(soft.rlim_cur);
        if ran {
            assert_eq!(out.take().len(), 1000, "{extra} spare descriptors");
            ok += 1;
        } else {
            failed += 1;
        }
        if ok >= 3 {
            break;
        }
    }
    assert!(
        ok >= 1 && failed >= 1,
        "ok {ok}, failed {failed}: the limits tried did not give both"
    );
}
