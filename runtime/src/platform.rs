//! Startup checks for the facts in PLATFORM.md that would otherwise fail late and obscurely:
//! RLIMIT_MEMLOCK, file descriptors, io_uring availability, and glommio's DMA read probe; and
//! how an idle shard waits without glommio's timers ([`nap`]).

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::StartError;

/// glommio refuses to start an executor below this memlock limit.
pub const MEMLOCK_MIN_BYTES: u64 = 512 << 10;

/// Name of the sentinel file whose DMA open decides glommio's read-probe for the process.
pub const SENTINEL_FILE: &str = ".weir-dma-probe";
const SENTINEL_BYTES: usize = 4096;

/// Checks RLIMIT_MEMLOCK.
pub fn check_memlock() -> Result<(), StartError> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, writable rlimit struct; RLIMIT_MEMLOCK is a valid resource.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) };
    if rc != 0 {
        // Unknown: let glommio decide; it reports its own error.
        return Ok(());
    }
    let have = lim.rlim_cur;
    if have != libc::RLIM_INFINITY && have < MEMLOCK_MIN_BYTES {
        return Err(StartError::MemlockTooLow {
            have_bytes: have,
            need_bytes: MEMLOCK_MIN_BYTES,
        });
    }
    Ok(())
}

/// Descriptors one shard holds while it runs: glommio's three rings, its eventfds, the DMA
/// sentinel, and room for the files its state and sinks open (measured: 6 each on 1 to 8
/// shards of a keyed job).
pub const DESCRIPTORS_PER_SHARD: u64 = 8;
/// Descriptors a job holds besides its shards' (checkpoint storage, the supervisor's files).
pub const DESCRIPTORS_PER_JOB: u64 = 16;

/// Checks that the process may open the descriptors `shards` shards need.
///
/// glommio builds an executor's rings on the shard's thread, and out of descriptors there it
/// does not always return an error: it panics reading sysfs, and the first executor of the
/// process panics in its io_uring probe, which poisons the probe for the process's life, so that
/// every later executor panics too (seen on a fresh CI machine, glommio 0.9). Refused here,
/// the job gets a typed error and the process stays usable.
pub fn check_descriptors(shards: usize) -> Result<(), StartError> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, writable rlimit struct; RLIMIT_NOFILE is a valid resource.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
    if rc != 0 || lim.rlim_cur == libc::RLIM_INFINITY {
        return Ok(());
    }
    // Unknown (no /proc): let glommio decide.
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return Ok(());
    };
    // The listing's own descriptor is counted too, and closed once `dir` is consumed.
    let open = dir.count() as u64;
    let need = shards as u64 * DESCRIPTORS_PER_SHARD + DESCRIPTORS_PER_JOB;
    let limit = lim.rlim_cur;
    if limit.saturating_sub(open) < need {
        return Err(StartError::TooFewDescriptors {
            shards,
            need,
            open,
            limit,
        });
    }
    Ok(())
}

/// Held from an attempt's descriptor check until each of its shards' executors is built or its
/// thread has ended: two jobs starting at once in one process would otherwise both count the
/// descriptors the other is about to take as free, and both pass the check into glommio's
/// panics. What a job opens once its executors exist (stores, files) fails with errors, not
/// panics, and is not held up.
pub(crate) fn executor_builds() -> std::sync::MutexGuard<'static, ()> {
    static BUILDS: std::sync::Mutex<()> = std::sync::Mutex::new(());
    // The mutex guards no data: a panic while it was held leaves nothing inconsistent.
    BUILDS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Checks that io_uring can be set up (it is blocked by default container seccomp profiles and
/// by `kernel.io_uring_disabled`; glommio has no fallback).
pub fn check_io_uring() -> Result<(), StartError> {
    // SAFETY: io_uring_params is a plain C struct for which all-zero is the documented default.
    let mut params: [u8; 120] = [0; 120];
    // SAFETY: io_uring_setup(entries, params) reads and writes the 120-byte params struct we
    // pass; the returned fd, if any, is closed below.
    let fd = unsafe { libc::syscall(libc::SYS_io_uring_setup, 4u32, params.as_mut_ptr()) };
    if fd < 0 {
        let err = std::io::Error::last_os_error();
        let disabled = std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled")
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "unknown".into());
        return Err(StartError::IoUringUnavailable {
            reason: format!("io_uring_setup failed: {err} (kernel.io_uring_disabled = {disabled})"),
        });
    }
    // SAFETY: `fd` is a file descriptor io_uring_setup just returned to us and nobody else owns.
    unsafe { libc::close(fd as i32) };
    Ok(())
}

/// Writes the 4 KiB sentinel file with std::fs (so it is never empty) and returns its path.
/// Each shard opens it with `DmaFile::open` before any other DMA file, so that glommio's
/// process-wide read probe sees a non-empty file opened for reading (PLATFORM.md, glommio).
pub fn write_sentinel(dir: &Path) -> Result<PathBuf, StartError> {
    let path = dir.join(SENTINEL_FILE);
    let io = |source| StartError::StateDir {
        path: path.clone(),
        source,
    };
    // The directory's own failure names the directory; a file in its place is said to be one
    // (mkdir(2) only says "File exists").
    let made = match std::fs::metadata(dir) {
        Ok(m) if !m.is_dir() => Err(std::io::Error::new(
            std::io::ErrorKind::NotADirectory,
            "exists and is not a directory",
        )),
        _ => std::fs::create_dir_all(dir),
    };
    made.map_err(|source| StartError::StateDir {
        path: dir.to_owned(),
        source,
    })?;
    let ok = std::fs::metadata(&path)
        .map(|m| m.len() == SENTINEL_BYTES as u64)
        .unwrap_or(false);
    if !ok {
        std::fs::write(&path, [0x77u8; SENTINEL_BYTES]).map_err(io)?;
    }
    Ok(path)
}

/// Opens the sentinel with glommio's DMA file and reads it back: this must be the process's
/// first DMA open. Must run inside a glommio executor.
pub(crate) async fn dma_probe(sentinel: &Path, shard: usize) -> Result<(), StartError> {
    let fail = |reason: String| StartError::Executor { shard, reason };
    let file = glommio::io::DmaFile::open(sentinel)
        .await
        .map_err(|e| fail(format!("DMA open of {}: {e}", sentinel.display())))?;
    let read = file
        .read_at(0, SENTINEL_BYTES)
        .await
        .map_err(|e| fail(format!("DMA read of {}: {e}", sentinel.display())))?;
    if read.len() != SENTINEL_BYTES {
        return Err(fail(format!(
            "DMA read of {} returned {} bytes, expected {SENTINEL_BYTES}",
            sentinel.display(),
            read.len()
        )));
    }
    let _ = file.close().await;
    Ok(())
}

/// An idle shard's wait: the thread sleeps for `d`, then the task yields to its executor.
/// Must be awaited on a glommio executor, and blocks every other task of it: for an executor
/// whose only task is the caller, as a shard's is.
///
/// Not `glommio::timer::sleep`: with no task runnable, that parks glommio's reactor in the
/// main ring on a poll of the latency ring's fd, where the timer's completion is to wake it,
/// and lost wake-ups on that path are reported upstream (glommio issues #326 and #547). A CI
/// run here once stalled for 220 s with both shards parked there, until a debugger's attach
/// interrupted the wait. A shard runs a single task, so blocking its thread starves nothing,
/// and the task stays runnable, so the executor never parks. [`set_fine_timer_slack`] keeps
/// short naps short. A nap also takes about a third of the CPU of a timer's sleep, and
/// overshoots less (`weir-bench runtime --only idle_nap`).
pub async fn nap(d: Duration) {
    std::thread::sleep(d);
    glommio::executor().yield_now().await;
}

/// Timer slack of the calling thread: 1 us instead of Linux's default 50 us, which would
/// stretch a shard's 10-us naps fivefold (an io_uring timeout, as glommio's timers use, has
/// none).
pub fn set_fine_timer_slack() {
    // SAFETY: PR_SET_TIMERSLACK takes one integer argument (nanoseconds) and touches only the
    // calling thread's scheduling attributes; no pointers are passed.
    let r = unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1_000 as libc::c_ulong, 0, 0, 0) };
    if r != 0 {
        tracing::debug!(
            "PR_SET_TIMERSLACK: {}; idle naps keep the default slack",
            std::io::Error::last_os_error()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shard thread's timer slack is what `nap` relies on: 1 us, on that thread only.
    #[test]
    fn a_shard_thread_naps_with_a_fine_timer_slack() {
        // SAFETY: PR_GET_TIMERSLACK takes no argument and returns the calling thread's slack.
        let slack = || unsafe { libc::prctl(libc::PR_GET_TIMERSLACK, 0, 0, 0, 0) };
        let here = slack();
        let there = std::thread::spawn(move || {
            set_fine_timer_slack();
            slack()
        })
        .join()
        .expect("thread");
        assert_eq!(there, 1_000);
        assert_eq!(slack(), here, "other threads keep theirs");
    }

    #[test]
    fn memlock_and_io_uring_are_usable_here() {
        // These are the machine's facts the engine depends on; the test documents them.
        check_memlock().expect("memlock");
        check_io_uring().expect("io_uring");
    }

    #[test]
    fn sentinel_is_written_once_with_4k() {
        let dir = tempfile::tempdir().expect("tmp");
        let p = write_sentinel(dir.path()).expect("sentinel");
        assert_eq!(std::fs::metadata(&p).expect("meta").len(), 4096);
        // A sentinel of the right size is kept as it is (a second shard or run does not
        // rewrite a file another may be reading)...
        std::fs::write(&p, [0x11u8; 4096]).expect("overwrite");
        let p2 = write_sentinel(dir.path()).expect("again");
        assert_eq!(p, p2);
        assert_eq!(std::fs::read(&p).expect("read"), [0x11u8; 4096]);
        // ...and one cut short (a crash while writing it) is written again, whole.
        std::fs::write(&p, b"short").expect("truncate");
        write_sentinel(dir.path()).expect("repair");
        assert_eq!(std::fs::read(&p).expect("read"), [0x77u8; 4096]);
    }

    /// A state directory that is a file is refused, naming it and saying what it is.
    #[test]
    fn a_file_as_state_directory_is_named_as_not_a_directory() {
        let dir = tempfile::tempdir().expect("tmp");
        let file = dir.path().join("state");
        std::fs::write(&file, b"x").expect("file");
        let e = write_sentinel(&file).expect_err("a file");
        assert!(
            matches!(&e, StartError::StateDir { path, .. } if *path == file),
            "{e:?}"
        );
        assert!(
            e.to_string().contains("exists and is not a directory"),
            "{e}"
        );
    }

    #[test]
    fn dma_probe_reads_the_sentinel_inside_an_executor() {
        let dir = tempfile::tempdir().expect("tmp");
        let p = write_sentinel(dir.path()).expect("sentinel");
        let r = glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
            .io_memory(2 << 20)
            .spawn(move || async move { dma_probe(&p, 0).await })
            .expect("executor")
            .join()
            .expect("join");
        r.expect("probe");
    }
}
