//! `Pinning::Auto` across the jobs of one process. In a test binary of its own: no other
//! test's job may hold cores meanwhile.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use weir_runtime::{Job, JobConfig, JobHandle, Pinning};

/// A 1-shard job that runs until `stop` is set.
fn running(stop: &Arc<AtomicBool>) -> JobHandle {
    let job = Job::new(JobConfig::new().with_shards(1).with_pinning(Pinning::Auto));
    let stop = stop.clone();
    let _ = job
        .from_iter(move |_, _| {
            let stop = stop.clone();
            std::iter::from_fn(move || {
                std::thread::sleep(Duration::from_millis(1));
                (!stop.load(Ordering::Acquire)).then_some(1u64)
            })
        })
        .collect();
    job.start().expect("start")
}

/// Two running jobs are pinned to different cores, a third that finds no free core runs
/// unpinned, and the cores of a job that ended are free again. Before, every job pinned
/// shard i to core i: concurrent 1-shard jobs all shared core 0 and ran at half speed.
#[test]
fn auto_pins_concurrent_jobs_to_different_cores() {
    let cores = core_affinity::get_core_ids().unwrap_or_default().len();
    if cores < 2 {
        eprintln!("skipped: {cores} core(s), two jobs cannot be pinned apart");
        return;
    }
    let stop_a = Arc::new(AtomicBool::new(false));
    let a = running(&stop_a);
    let stop_rest = Arc::new(AtomicBool::new(false));
    let mut rest = vec![running(&stop_rest)];
    let (ca, cb) = (a.shard_cores()[0], rest[0].shard_cores()[0]);
    assert!(ca.is_some() && cb.is_some(), "{ca:?} {cb:?}");
    assert_ne!(ca, cb, "two running jobs on one core");
    // Fill the other cores: then one more finds none free.
    for _ in 2..cores {
        rest.push(running(&stop_rest));
    }
    let extra = running(&stop_rest);
    assert_eq!(extra.shard_cores(), vec![None], "no free core: unpinned");
    stop_a.store(true, Ordering::Release);
    a.wait().expect("job a");
    let again = running(&stop_rest);
    assert_eq!(again.shard_cores(), vec![ca], "job a's core is free again");
    stop_rest.store(true, Ordering::Release);
    for h in rest.into_iter().chain([extra, again]) {
        h.wait().expect("job");
    }
}
