//! Stopping a `weir run` job from the terminal: with checkpointing, the first SIGINT or
//! SIGTERM stops the job with a savepoint (`JobHandle::stop_with_savepoint`), so that its
//! output is committed exactly up to that point and `--restore PATH` (or `--restore latest`)
//! continues from there; a second signal ends the process at once.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use weir_runtime::{Job, JobHandle, JobSummary, SavepointError};

use crate::CheckpointArgs;

/// Watches for the stop signals while a checkpointed job runs.
pub struct Stopper {
    signalled: Arc<AtomicBool>,
    dir: PathBuf,
    stopping: bool,
    stopped: bool,
}

impl Stopper {
    /// `None` without checkpointing: the signals keep their default action (the job's
    /// checkpoints are its recovery then, with `--restore latest`).
    pub fn install(c: &CheckpointArgs) -> Result<Option<Stopper>, String> {
        let Some(ck) = &c.checkpoint_dir else {
            return Ok(None);
        };
        let signalled = Arc::new(AtomicBool::new(false));
        for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
            // The second signal exits (130, as a shell reports an interrupt); registered
            // first, it sees the flag as the first signal left it.
            signal_hook::flag::register_conditional_shutdown(sig, 130, signalled.clone())
                .and_then(|_| signal_hook::flag::register(sig, signalled.clone()))
                .map_err(|e| format!("installing the stop signal handlers: {e}"))?;
        }
        Ok(Some(Stopper {
            signalled,
            dir: c
                .savepoint_dir
                .clone()
                .unwrap_or_else(|| ck.join("savepoints")),
            stopping: false,
            stopped: false,
        }))
    }

    /// True once the job was stopped with a savepoint: it ended before its input did.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Called while the job runs: at the first signal, stops it with a savepoint and says
    /// where that is. If the savepoint fails, the job goes on (as Flink's stop), and so does
    /// the wait for a second signal.
    pub fn poll(&mut self, h: &JobHandle) {
        if self.stopping || !self.signalled.load(Ordering::Acquire) {
            return;
        }
        self.stopping = true;
        eprintln!("\nweir: stopping with a savepoint (a second signal ends the process now)");
        match h.stop_with_savepoint(&self.dir) {
            Ok(p) => {
                self.stopped = true;
                eprintln!(
                    "weir: stopped with savepoint {}; continue with --restore {0}",
                    p.display()
                )
            }
            // It ended by itself meanwhile: nothing to stop, and said so (a script waiting
            // for the savepoint's path got nothing and no reason).
            Err(SavepointError::JobEnded) => eprintln!(
                "weir: the job ended before the savepoint: its input was done, so it finished \
                 (its output is complete) and there is no savepoint"
            ),
            Err(e) => eprintln!("weir: the stop's savepoint failed ({e}); the job goes on"),
        }
    }
}

/// How often a checkpointed run prints its status line.
const STATUS_EVERY: Duration = Duration::from_secs(1);

/// Runs `job` to its end, or until a stop signal stops it with a savepoint (see the module
/// docs): both end well. With checkpointing, a status line on standard error gives the
/// records `operator` took in and the job's checkpoints, once the first checkpoint completed
/// and then every second (rewritten in place on a terminal, a line each otherwise).
pub fn run(job: Job, c: &CheckpointArgs, operator: &str) -> Result<JobSummary, String> {
    let mut stopper = Stopper::install(c)?;
    let handle = job.start().map_err(|e| e.to_string())?;
    if let Some(s) = stopper.as_mut() {
        let started = Instant::now();
        let mut next_status = started + STATUS_EVERY;
        let tty = std::io::stderr().is_terminal();
        let mut shown = false;
        while !handle.is_finished() {
            s.poll(&handle);
            let checkpoints = handle.checkpoint_metrics();
            // The first once a checkpoint completed (a run shorter than a second shows one
            // too), then every second.
            let first = !shown && checkpoints.number_of_completed_checkpoints > 0;
            if first || Instant::now() >= next_status {
                next_status = Instant::now() + STATUS_EVERY;
                let line = format!(
                    "{operator}: {:.1}s, {} records in, {}",
                    started.elapsed().as_secs_f64(),
                    handle.metrics().records_in(operator),
                    crate::jobs::checkpoint_status(&checkpoints)
                );
                if tty {
                    eprint!("\r{line}   ");
                    let _ = std::io::stderr().flush();
                } else {
                    eprintln!("{line}");
                }
                shown = true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if shown && tty {
            eprintln!();
        }
    }
    handle.wait().map_err(|e| e.to_string())
}
