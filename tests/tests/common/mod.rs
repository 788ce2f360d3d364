//! Support shared by the checkpoint test binaries (`checkpoint.rs`, `forged.rs`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Records a source hands over per poll (`JobConfig::with_batch_records`) in a job under a
/// [`Hold`]: a source injects barriers between polls, so small polls keep barriers getting
/// through while held records take 1 ms each (the default 1024 lets one in once a second).
pub const HELD_BATCH_RECORDS: usize = 64;

/// Holds back the end of a bounded job's input until the test is done with the running job.
///
/// Several tests need checkpoints, a savepoint or injected failures to happen while a bounded
/// job still runs, and then cancel, stop or restart it. On an idle machine the job runs long
/// enough; on a slow one (2 busy cores, fsyncs of 55-500 ms) it ends first: the checkpoint the
/// test waits for is the final one, a savepoint finds the job ended, a failure is never
/// injected. While the hold is set, each record at the held end of the input (by its index:
/// the last tenth in most tests) takes 1 ms more where the job calls [`Hold::delay`]; with
/// [`HELD_BATCH_RECORDS`], barriers keep getting through. The test calls [`Hold::release`]
/// once it cancelled the job, took its savepoint or injected its failures, before it waits for
/// the end. Only the time records take changes (no record, order or count), so a held test
/// asserts all it did without the hold; on an idle machine a test is done with the running
/// job at or before the held end, so that the hold costs it little time.
#[derive(Clone)]
pub struct Hold {
    held: Arc<AtomicBool>,
    /// The first index held: records `from..n` of indices `0..n`.
    from: u64,
}

impl Hold {
    /// A hold, set, on the last `held` of indices `0..n`.
    pub fn new(n: u64, held: u64) -> Hold {
        Hold {
            held: Arc::new(AtomicBool::new(true)),
            from: n.saturating_sub(held),
        }
    }

    /// Called with each record's index where the job should wait: 1 ms in the held tail.
    pub fn delay(&self, index: u64) {
        if index >= self.from && self.held.load(Ordering::Acquire) {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Lets the rest of the input run at full speed.
    pub fn release(&self) {
        self.held.store(false, Ordering::Release);
    }
}
