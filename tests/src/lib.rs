//! Support shared by weir's integration tests (`tests/tests/*.rs`).

use std::time::{Duration, Instant};

use weir_runtime::{JobHandle, JobStatus, StatusChange};

/// Each change of a status history as (status, attempt), the times left out.
pub fn status_steps(history: &[StatusChange]) -> Vec<(JobStatus, u64)> {
    history.iter().map(|c| (c.status, c.attempt)).collect()
}

/// Polls `h.status()` every millisecond until it is `want`, the job ended, or 20 s passed;
/// returns the status seen last.
pub fn await_status(h: &JobHandle, want: JobStatus) -> JobStatus {
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let s = h.status();
        if s == want || s.is_terminal() || Instant::now() > until {
            return s;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}
