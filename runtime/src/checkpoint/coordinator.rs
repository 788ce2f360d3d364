//! The checkpoint coordinator (Flink's CheckpointCoordinator), on a thread of its own.
//!
//! It triggers checkpoints (periodically, manually, and once after every source finished),
//! collects every shard's acknowledgement, declines and timeouts, writes the metadata durably
//! through the checkpoint store — only then is a checkpoint complete — and publishes the
//! newest complete id, which shards poll to commit sinks and release old snapshots.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use super::shard::{Ack, Shared};
use super::snapshot::{
    encode, shard_section, JobSnapshot, ShardSnapshot, JOB_SECTION, SECTIONS_VERSION,
};

/// Figures of one checkpoint (Flink's per-checkpoint statistics).
#[derive(Clone, Debug, Default)]
pub struct CheckpointStats {
    pub checkpoint_id: u64,
    /// Milliseconds since the epoch.
    pub trigger_timestamp_ms: u64,
    /// Trigger to completion (the metadata durable), in Flink's milliseconds.
    pub duration_ms: u64,
    /// The same span in nanoseconds: checkpoints of a few milliseconds, which the millisecond
    /// figure cannot compare.
    pub duration_ns: u64,
    /// The longest synchronous part of a shard (its participants', one after another).
    /// Shards take theirs at once: summed over shards, the figure exceeded the duration.
    pub sync_duration_ns: u64,
    /// The longest background part of a shard.
    pub async_duration_ns: u64,
    /// The longest barrier alignment of an exchange head: from its first barrier of the
    /// checkpoint to its last (0 where they are one, as with a single input).
    pub alignment_duration_ns: u64,
    /// Flink's start delay: the time from the trigger until the checkpoint's first barrier
    /// reached a shard, the longest over shards (how long a checkpoint waited to begin, behind
    /// queued records, not how long it took).
    pub start_delay_ns: u64,
    pub persisted_inflight_bytes: u64,
    /// Bytes this checkpoint wrote (incremental size).
    pub size_bytes: u64,
    /// Bytes of every file it references.
    pub full_size_bytes: u64,
    /// Per shard, the time from trigger to its acknowledgement.
    pub ack_ns: Vec<u64>,
    /// `None` when complete; the reason otherwise.
    pub failure: Option<String>,
}

/// The job's checkpoint metrics, with Flink's names.
#[derive(Clone, Debug, Default)]
pub struct CheckpointMetrics {
    pub number_of_completed_checkpoints: u64,
    pub number_of_failed_checkpoints: u64,
    pub number_of_in_progress_checkpoints: u64,
    pub last_checkpoint_duration_ms: u64,
    pub last_checkpoint_size: u64,
    pub last_checkpoint_full_size: u64,
    /// When the job last restored from a checkpoint (ms since the epoch), if it did.
    pub last_checkpoint_restore_timestamp: Option<u64>,
    /// The id of the checkpoint or savepoint the job last restored from, if it did (an
    /// attempt that found no checkpoint starts over and leaves both unchanged).
    pub last_restored_checkpoint_id: Option<u64>,
    /// Id of the newest complete checkpoint.
    pub last_completed_checkpoint_id: Option<u64>,
    /// The most recent checkpoints, newest last.
    pub history: Vec<CheckpointStats>,
}

const HISTORY: usize = 32;

struct Pending {
    trigger: Instant,
    trigger_ms: u64,
    snapshots: Vec<Option<ShardSnapshot>>,
    stats: CheckpointStats,
    acked: usize,
}

/// Where a savepoint request hears of its checkpoint: pinned once complete (with the gate of
/// a stop-with-savepoint), or why not.
pub(crate) type SavepointWaiter =
    mpsc::Sender<Result<(weir_io::CheckpointPin, Option<StopGate>), String>>;

/// Handed to a stop-with-savepoint's caller with its completed checkpoint: the shards end
/// only once the caller says the savepoint is out ([`StopGate::stop`]). Dropped without that
/// (the copy failed), the job goes on and checkpoints again, as when Flink's stop-with-
/// savepoint fails; before, the shards ended as the checkpoint completed, and a failed copy
/// left the job ended with no savepoint.
pub(crate) struct StopGate {
    shared: Arc<Shared>,
    id: u64,
    stopped: bool,
}

impl StopGate {
    /// The savepoint is out: the shards end once they told their sinks of its checkpoint.
    pub fn stop(mut self) {
        self.stopped = true;
        self.shared.stop_go.store(self.id, Ordering::Release);
    }
}

impl Drop for StopGate {
    fn drop(&mut self) {
        if !self.stopped {
            withdraw_stop(&self.shared, self.id);
        }
    }
}

/// Withdraws the stop-with-savepoint at checkpoint `id`, if it is still the one pending: the
/// coordinator sees it gone and triggers again, and the shards run on.
fn withdraw_stop(shared: &Shared, id: u64) {
    let _ = shared
        .stop_at
        .compare_exchange(id, 0, Ordering::AcqRel, Ordering::Acquire);
}

/// A savepoint request from the job handle.
pub(crate) struct SavepointRequest {
    pub waiter: SavepointWaiter,
    /// Tells the request apart from others, so that its caller can withdraw it.
    pub token: u64,
    /// Stop the job with this savepoint (Flink's stop-with-savepoint).
    pub stop: bool,
}

/// Requests to the coordinator from the job handle. They outlive an attempt: a request the
/// coordinator of a failed attempt did not take is served after the restart (a savepoint's
/// caller withdraws its request once the job is restarting, see `JobHandle::savepoint`).
#[derive(Default)]
pub(crate) struct Requests {
    pub manual: std::sync::atomic::AtomicU64,
    /// How many of `manual` a coordinator took: kept here, not in the coordinator, so that a
    /// request made before an attempt's coordinator exists (right after the start, during a
    /// restart) is served rather than counted as seen.
    pub manual_taken: std::sync::atomic::AtomicU64,
    /// Savepoint requests waiting for a checkpoint to be triggered for them.
    pub savepoints: Mutex<Vec<SavepointRequest>>,
}

pub(crate) struct Coordinator {
    shared: Arc<Shared>,
    shards: usize,
    max_parallelism: u16,
    rx: mpsc::Receiver<Ack>,
    pending: BTreeMap<u64, Pending>,
    /// The id of the next checkpoint; `None` once `u64::MAX` was taken (ids never repeat).
    next_id: Option<u64>,
    last_completion: Option<Instant>,
    /// When the next periodic checkpoint is due; `None`: never (no interval, or one too long
    /// for the clock to reach).
    next_periodic: Option<Instant>,
    consecutive_failures: u32,
    requests: Arc<Requests>,
    /// Savepoint requests, the checkpoint that serves them, and whether they stop the job.
    savepoint_waiters: Vec<(u64, SavepointWaiter, bool)>,
    /// The checkpoint of a stop-with-savepoint in progress: none is triggered after it.
    stop_id: Option<u64>,
    pub metrics: Arc<Mutex<CheckpointMetrics>>,
    /// Set when checkpoint failures exceed the tolerable number: the job must fail.
    pub failure: Arc<Mutex<Option<String>>>,
}

pub(crate) fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Coordinator {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        shared: Arc<Shared>,
        shards: usize,
        max_parallelism: u16,
        rx: mpsc::Receiver<Ack>,
        first_id: u64,
        requests: Arc<Requests>,
        metrics: Arc<Mutex<CheckpointMetrics>>,
        failure: Arc<Mutex<Option<String>>>,
    ) -> Self {
        // `checked_add`: validation bounds the interval, but a deadline past what an
        // `Instant` holds must mean "never", not a panic.
        let next_periodic = shared
            .config
            .interval
            .and_then(|i| Instant::now().checked_add(i));
        Self {
            shared,
            shards,
            max_parallelism,
            rx,
            pending: BTreeMap::new(),
            next_id: Some(first_id),
            last_completion: None,
            next_periodic,
            consecutive_failures: 0,
            requests,
            savepoint_waiters: Vec::new(),
            stop_id: None,
            metrics,
            failure,
        }
    }

    /// Runs until the job stops.
    pub fn run(mut self) {
        loop {
            if self.shared.stopping.load(Ordering::Acquire) {
                // Checkpoints pending when the attempt ends (a failover, a cancel) are failed,
                // as Flink counts those its failover aborts, without counting towards the
                // tolerable failures: uncounted, completed + failed + in progress fell short of
                // the checkpoints triggered, and the history skipped them.
                for (id, p) in std::mem::take(&mut self.pending) {
                    self.shared.store.abort(id);
                    let reason = "aborted: the job attempt ended before it completed".to_string();
                    for (_, w, _) in self.waiters_of(id) {
                        let _ = w.send(Err(reason.clone()));
                    }
                    self.record_failure(id, Some(p), reason);
                }
                // The job is going: nothing is in progress any more.
                self.update_in_progress();
                return;
            }
            match self.rx.recv_timeout(Duration::from_millis(5)) {
                Ok(ack) => self.on_ack(ack),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            }
            self.check_timeouts();
            self.maybe_trigger();
        }
    }

    fn ready(&self) -> bool {
        self.shared.shards_ready.load(Ordering::Acquire) >= self.shards
    }

    fn maybe_trigger(&mut self) {
        // A stop whose savepoint could not be copied out was withdrawn (see `StopGate`).
        if self
            .stop_id
            .is_some_and(|id| self.shared.stop_at.load(Ordering::Acquire) != id)
        {
            self.stop_id = None;
        }
        // A job failing on its checkpoint failures triggers nothing more, as Flink's
        // coordinator stops its scheduler: a final checkpoint retried here could complete
        // before the failure was acted on, and the job then ended as if none had happened.
        let failing = self
            .failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some();
        if failing
            || !self.ready()
            || self.pending.len() >= self.shared.config.max_concurrent
            || self.stop_id.is_some()
        {
            return;
        }
        let now = Instant::now();
        let sources_done = {
            let total = self.shared.sources_total.load(Ordering::Acquire);
            total > 0 && self.shared.sources_finished.load(Ordering::Acquire) >= total
        };
        let paused = self
            .last_completion
            .is_some_and(|t| now.duration_since(t) < self.shared.config.min_pause);
        // Not only once nothing is pending: with concurrent checkpoints, one whose barrier
        // the sources skipped (they inject the newest requested) never completes, and the
        // final one waited out its timeout. The final one subsumes it when it completes.
        // The minimum pause holds before it too, as before any periodic checkpoint.
        if sources_done && self.shared.final_id.load(Ordering::Acquire) == 0 && !paused {
            // Every source read its input to the end: take the checkpoint that commits the
            // job's last output. Sources end their streams once it completes. It is marked
            // final before its barriers exist, so that every exchange sees the mark and takes
            // it aligned (see `Shared::final_id`); a failed trigger clears the mark.
            if let Some(id) = self.next_id {
                self.shared.final_id.store(id, Ordering::Release);
            }
            self.trigger(now);
            return;
        }
        if sources_done {
            return;
        }
        let waiting = std::mem::take(
            &mut *self
                .requests
                .savepoints
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        );
        if !waiting.is_empty() {
            // A savepoint ignores the minimum pause, as a manual checkpoint does.
            // Stop-with-savepoint: no checkpoint after this one, so no output past its
            // barrier is committed; the shards end once it completed.
            let stop = waiting.iter().any(|r| r.stop);
            match self.trigger_with(now, stop) {
                Some(id) => {
                    if stop {
                        self.stop_id = Some(id);
                    }
                    self.savepoint_waiters
                        .extend(waiting.into_iter().map(|r| (id, r.waiter, r.stop)));
                }
                None => {
                    for r in waiting {
                        let _ = r.waiter.send(Err("the checkpoint could not begin".into()));
                    }
                }
            }
            return;
        }
        let manual = self.requests.manual.load(Ordering::Acquire);
        if manual > self.requests.manual_taken.load(Ordering::Acquire) {
            // Requests made meanwhile are served by this one checkpoint.
            self.requests.manual_taken.store(manual, Ordering::Release);
            self.trigger(now);
            return;
        }
        if self.next_periodic.is_some_and(|t| now >= t) && !paused {
            self.trigger(now);
        }
    }

    fn trigger(&mut self, now: Instant) -> Option<u64> {
        self.trigger_with(now, false)
    }

    /// Triggers a checkpoint; `stop`: the checkpoint of a stop-with-savepoint, marked as such
    /// (`Shared::stop_at`) before its barriers are requested, so that every source that
    /// injects its barrier sees the mark and reads nothing past it.
    fn trigger_with(&mut self, now: Instant, stop: bool) -> Option<u64> {
        let Some(id) = self.next_id else {
            self.ids_exhausted();
            return None;
        };
        self.next_id = id.checked_add(1);
        if let Some(i) = self.shared.config.interval {
            self.next_periodic = now.checked_add(i);
        }
        if let Err(e) = self.shared.store.begin(id) {
            self.fail_checkpoint(id, None, format!("could not begin: {e}"));
            return None;
        }
        self.pending.insert(
            id,
            Pending {
                trigger: now,
                trigger_ms: now_ms(),
                snapshots: vec![None; self.shards],
                stats: CheckpointStats {
                    checkpoint_id: id,
                    trigger_timestamp_ms: now_ms(),
                    ack_ns: vec![0; self.shards],
                    ..Default::default()
                },
                acked: 0,
            },
        );
        self.update_in_progress();
        tracing::debug!("ckpt {id} triggered");
        if stop {
            self.shared.stop_at.store(id, Ordering::Release);
        }
        self.shared.requested.fetch_max(id, Ordering::AcqRel);
        Some(id)
    }

    /// No id is left for a checkpoint. Wrapping to 0 would make every later checkpoint
    /// "not newer" than the complete ones (and restart the job forever), so the job fails
    /// instead; its restart then refuses to start, naming the checkpoint directory.
    fn ids_exhausted(&self) {
        let mut f = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        if f.is_none() {
            let reason = format!(
                "checkpoint ids are exhausted: checkpoint {} was the last possible one, and \
                 ids never repeat",
                u64::MAX
            );
            tracing::error!("{reason}");
            *f = Some(reason);
        }
    }

    fn update_in_progress(&self) {
        let mut m = self.metrics.lock().unwrap_or_else(|p| p.into_inner());
        m.number_of_in_progress_checkpoints = self.pending.len() as u64;
    }

    fn on_ack(&mut self, ack: Ack) {
        match ack {
            Ack::Decline {
                shard,
                checkpoint_id,
                reason,
            } => {
                if let Some(p) = self.pending.remove(&checkpoint_id) {
                    self.shared.store.abort(checkpoint_id);
                    self.fail_checkpoint(
                        checkpoint_id,
                        Some(p),
                        format!("declined by shard {shard}: {reason}"),
                    );
                }
            }
            Ack::Done {
                shard,
                checkpoint_id,
                snapshot,
                sync_ns,
                async_ns,
                alignment_ns,
                persisted_inflight_bytes,
                barrier_at,
            } => {
                // Late or duplicate acknowledgements of aborted or completed checkpoints.
                let Some(p) = self.pending.get_mut(&checkpoint_id) else {
                    return;
                };
                if shard >= self.shards || p.snapshots[shard].is_some() {
                    return;
                }
                let since = p.trigger.elapsed().as_nanos() as u64;
                let delay = barrier_at.saturating_duration_since(p.trigger).as_nanos() as u64;
                p.stats.start_delay_ns = p.stats.start_delay_ns.max(delay);
                p.stats.ack_ns[shard] = since;
                p.stats.sync_duration_ns = p.stats.sync_duration_ns.max(sync_ns);
                p.stats.async_duration_ns = p.stats.async_duration_ns.max(async_ns);
                p.stats.alignment_duration_ns = p.stats.alignment_duration_ns.max(alignment_ns);
                p.stats.persisted_inflight_bytes += persisted_inflight_bytes;
                p.snapshots[shard] = Some(snapshot);
                p.acked += 1;
                if p.acked == self.shards {
                    if let Some(p) = self.pending.remove(&checkpoint_id) {
                        self.complete(checkpoint_id, p);
                    }
                }
            }
        }
    }

    fn complete(&mut self, id: u64, mut p: Pending) {
        tracing::debug!("ckpt {id} all acked");
        let job = JobSnapshot {
            shards: self.shards as u32,
            max_parallelism: self.max_parallelism,
            format_version: SECTIONS_VERSION,
        };
        let mut sections = vec![(JOB_SECTION.to_string(), encode(&job))];
        for (s, snap) in p.snapshots.iter().enumerate() {
            let Some(snap) = snap else { continue };
            sections.push((shard_section(s), encode(snap)));
        }
        // The storage tracked every file the shards' writers uploaded or reused.
        match self.shared.store.commit(id, p.trigger_ms, sections) {
            Ok(info) => {
                // Durable: only now is the checkpoint complete and may anyone be told.
                {
                    let mut ids = self
                        .shared
                        .completed_ids
                        .lock()
                        .unwrap_or_else(|p| p.into_inner());
                    ids.push_back(id);
                    if ids.len() > 64 {
                        ids.pop_front();
                    }
                }
                self.shared.completed.fetch_max(id, Ordering::AcqRel);
                self.last_completion = Some(Instant::now());
                self.consecutive_failures = 0;
                let took = p.trigger.elapsed();
                p.stats.duration_ms = took.as_millis() as u64;
                p.stats.duration_ns = took.as_nanos() as u64;
                p.stats.size_bytes = info.new_bytes;
                p.stats.full_size_bytes = info.full_bytes;
                {
                    let mut m = self.metrics.lock().unwrap_or_else(|p| p.into_inner());
                    m.number_of_completed_checkpoints += 1;
                    m.last_checkpoint_duration_ms = p.stats.duration_ms;
                    m.last_checkpoint_size = info.new_bytes;
                    m.last_checkpoint_full_size = info.full_bytes;
                    m.last_completed_checkpoint_id = Some(id);
                    push_history(&mut m.history, p.stats);
                }
                self.subsume_older(id);
                self.update_in_progress();
                // Pinned before retention runs: no later checkpoint can drop it meanwhile.
                for (_, w, stop) in self.waiters_of(id) {
                    let reply = self.shared.store.pin(id).map(|pin| {
                        let gate = stop.then(|| StopGate {
                            shared: self.shared.clone(),
                            id,
                            stopped: false,
                        });
                        (pin, gate)
                    });
                    // A stop without a pin has no savepoint: withdrawn at once. (A gate the
                    // caller never received, its thread gone, withdraws it as it drops.)
                    if stop && reply.is_err() {
                        withdraw_stop(&self.shared, id);
                    }
                    let _ = w.send(reply);
                }
                if let Err(e) = self.shared.store.retain(self.shared.config.retained) {
                    tracing::warn!("checkpoint retention after {id} failed: {e}");
                }
            }
            Err(e) => {
                self.shared.store.abort(id);
                self.fail_checkpoint(id, Some(p), format!("writing metadata failed: {e}"));
            }
        }
    }

    fn check_timeouts(&mut self) {
        let timeout = self.shared.config.timeout;
        let expired: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, p)| p.trigger.elapsed() > timeout)
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            let p = self.pending.remove(&id);
            self.shared.store.abort(id);
            self.fail_checkpoint(id, p, format!("expired after {timeout:?}"));
        }
    }

    /// The savepoint requests served by checkpoint `id`, taken out.
    fn waiters_of(&mut self, id: u64) -> Vec<(u64, SavepointWaiter, bool)> {
        let (mine, rest) = std::mem::take(&mut self.savepoint_waiters)
            .into_iter()
            .partition(|(c, _, _)| *c == id);
        self.savepoint_waiters = rest;
        mine
    }

    /// Checkpoint `id` (`pending`, if it got that far) failed: it counts towards the
    /// tolerable failures.
    fn fail_checkpoint(&mut self, id: u64, pending: Option<Pending>, reason: String) {
        tracing::debug!("ckpt {id} failed: {reason}");
        for (_, w, _) in self.waiters_of(id) {
            let _ = w.send(Err(reason.clone()));
        }
        tracing::warn!("checkpoint {id} failed: {reason}");
        self.consecutive_failures += 1;
        self.record_failure(id, pending, reason.clone());
        if self.consecutive_failures > self.shared.config.tolerable_failures {
            let mut f = self.failure.lock().unwrap_or_else(|p| p.into_inner());
            f.get_or_insert_with(|| {
                format!(
                    "{} consecutive checkpoint failures exceed the tolerable {} (last: checkpoint {id}: {reason})",
                    self.consecutive_failures, self.shared.config.tolerable_failures
                )
            });
        }
    }

    /// The pending checkpoints older than `id`, which just completed, are subsumed, as in
    /// Flink: they can no longer complete where a newer barrier passed them, and one whose
    /// barrier the sources skipped never had a chance to. They are aborted without counting
    /// towards the tolerable failures; a savepoint waiting for one is served by `id`.
    fn subsume_older(&mut self, id: u64) {
        let older: Vec<u64> = self.pending.range(..id).map(|(o, _)| *o).collect();
        for o in older {
            let p = self.pending.remove(&o);
            self.shared.store.abort(o);
            for (c, _, stop) in self.savepoint_waiters.iter_mut() {
                if *c == o && !*stop {
                    *c = id;
                }
            }
            let reason = format!("subsumed by checkpoint {id}");
            for (_, w, _) in self.waiters_of(o) {
                let _ = w.send(Err(reason.clone()));
            }
            tracing::debug!("ckpt {o} {reason}");
            self.record_failure(o, p, reason);
        }
    }

    /// Records checkpoint `id` as failed in the metrics, with its trigger time and how long
    /// it ran if it was pending (a failed checkpoint showed neither), and undoes the marks it
    /// set as the final or a stop's checkpoint.
    fn record_failure(&mut self, id: u64, pending: Option<Pending>, reason: String) {
        self.shared.aborted.fetch_max(id, Ordering::AcqRel);
        {
            let stats = match pending {
                Some(p) => {
                    let took = p.trigger.elapsed();
                    CheckpointStats {
                        duration_ms: took.as_millis() as u64,
                        duration_ns: took.as_nanos() as u64,
                        failure: Some(reason),
                        ..p.stats
                    }
                }
                None => CheckpointStats {
                    checkpoint_id: id,
                    trigger_timestamp_ms: now_ms(),
                    failure: Some(reason),
                    ..Default::default()
                },
            };
            let mut m = self.metrics.lock().unwrap_or_else(|p| p.into_inner());
            m.number_of_failed_checkpoints += 1;
            push_history(&mut m.history, stats);
        }
        self.update_in_progress();
        // A failed final checkpoint is retried: the sources wait for one to complete.
        if self.shared.final_id.load(Ordering::Acquire) == id {
            self.shared.final_id.store(0, Ordering::Release);
        }
        // A failed stop-with-savepoint leaves the job running, as in Flink.
        if self.stop_id == Some(id) {
            self.stop_id = None;
            self.shared.stop_at.store(0, Ordering::Release);
        }
    }
}

fn push_history(h: &mut Vec<CheckpointStats>, s: CheckpointStats) {
    h.push(s);
    if h.len() > HISTORY {
        h.remove(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::store::IoCheckpointStore;
    use crate::checkpoint::CheckpointConfig;
    use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};

    /// A coordinator of a one-shard job whose shard is ready, checkpointing into `dir`.
    fn coordinator(dir: &std::path::Path, config: CheckpointConfig, first_id: u64) -> Coordinator {
        let fs: Arc<dyn weir_io::Fs> = Arc::new(weir_io::StdFs);
        let storage = weir_io::CheckpointStorage::open(fs, dir, "job").expect("storage");
        let (tx, rx) = mpsc::channel();
        let shared = Arc::new(Shared {
            config,
            requested: AtomicU64::new(first_id - 1),
            completed: AtomicU64::new(first_id - 1),
            completed_ids: Mutex::default(),
            aborted: AtomicU64::new(0),
            sources_total: AtomicUsize::new(0),
            sources_finished: AtomicUsize::new(0),
            shards_ready: AtomicUsize::new(1),
            final_id: AtomicU64::new(0),
            stop_at: AtomicU64::new(0),
            stop_go: AtomicU64::new(0),
            stopping: AtomicBool::new(false),
            store: Arc::new(IoCheckpointStore::new(storage)),
            acks: Mutex::new(tx),
        });
        Coordinator::new(
            shared,
            1,
            128,
            rx,
            first_id,
            Arc::default(),
            Arc::default(),
            Arc::default(),
        )
    }

    /// Triggers a checkpoint by hand, as `JobHandle::trigger_checkpoint` does.
    fn trigger_by_hand(c: &mut Coordinator) {
        c.requests.manual.fetch_add(1, Ordering::AcqRel);
        c.maybe_trigger();
    }

    /// Shard 0's acknowledgement of checkpoint `id`, with nothing in it.
    fn ack(c: &mut Coordinator, id: u64) {
        c.on_ack(Ack::Done {
            shard: 0,
            checkpoint_id: id,
            snapshot: Default::default(),
            sync_ns: 0,
            async_ns: 0,
            alignment_ns: 0,
            persisted_inflight_bytes: 0,
            barrier_at: Instant::now(),
        });
    }

    /// With concurrent checkpoints, a completed one subsumes the older pending ones, as in
    /// Flink: the sources inject only the newest barrier requested, so an older one can never
    /// complete, and it waited out its timeout (and failed the job with no failure
    /// tolerated). Subsumed, it is in the history as failed, with its trigger time, but does
    /// not count towards the tolerable failures; a savepoint waiting for it is served by the
    /// newer one.
    #[test]
    fn a_completed_checkpoint_subsumes_older_pending_ones() {
        let tmp = tempfile::tempdir().expect("tmp");
        let mut config = CheckpointConfig::new(tmp.path(), "job");
        config.max_concurrent = 3;
        let mut c = coordinator(tmp.path(), config, 1);
        trigger_by_hand(&mut c);
        let (tx, rx) = mpsc::channel();
        c.requests
            .savepoints
            .lock()
            .expect("lock")
            .push(SavepointRequest {
                waiter: tx,
                token: 0,
                stop: false,
            });
        c.maybe_trigger();
        trigger_by_hand(&mut c);
        assert_eq!(c.pending.keys().copied().collect::<Vec<_>>(), [1, 2, 3]);
        ack(&mut c, 3);
        assert!(c.pending.is_empty(), "{:?}", c.pending.keys());
        assert!(c.failure.lock().expect("lock").is_none());
        assert_eq!(c.consecutive_failures, 0);
        let m = c.metrics.lock().expect("lock").clone();
        assert_eq!(m.number_of_completed_checkpoints, 1);
        assert_eq!(m.number_of_failed_checkpoints, 2);
        assert_eq!(m.number_of_in_progress_checkpoints, 0);
        for s in m.history.iter().filter(|s| s.checkpoint_id < 3) {
            assert_eq!(s.failure.as_deref(), Some("subsumed by checkpoint 3"));
            assert!(s.trigger_timestamp_ms > 0, "{s:?}");
        }
        let pin = rx.try_recv().expect("served").expect("pinned").0;
        assert_eq!(
            pin.checkpoint_id(),
            3,
            "the savepoint's checkpoint 2 was subsumed"
        );
    }

    /// A checkpoint that expires keeps its trigger time and duration in the history (both
    /// were 0), and once the job stops nothing is in progress any more.
    #[test]
    fn a_failed_checkpoint_keeps_its_times_and_a_stop_clears_the_in_progress_count() {
        let tmp = tempfile::tempdir().expect("tmp");
        let mut config = CheckpointConfig::new(tmp.path(), "job");
        config.timeout = Duration::from_millis(1);
        config.tolerable_failures = 5;
        let mut c = coordinator(tmp.path(), config, 1);
        trigger_by_hand(&mut c);
        std::thread::sleep(Duration::from_millis(5));
        c.check_timeouts();
        let m = c.metrics.lock().expect("lock").clone();
        let s = &m.history[0];
        assert!(
            s.failure.as_deref().is_some_and(|f| f.contains("expired")),
            "{s:?}"
        );
        assert!(
            s.trigger_timestamp_ms > 0 && s.duration_ns >= 1_000_000,
            "{s:?}"
        );
        trigger_by_hand(&mut c);
        assert_eq!(
            c.metrics
                .lock()
                .expect("lock")
                .number_of_in_progress_checkpoints,
            1
        );
        let metrics = c.metrics.clone();
        c.shared.stopping.store(true, Ordering::Release);
        c.run();
        assert_eq!(
            metrics
                .lock()
                .expect("lock")
                .number_of_in_progress_checkpoints,
            0
        );
    }

    /// An interval past what an `Instant` holds (built in code, never validated) means no
    /// periodic checkpoint, not a panic when the coordinator starts or triggers.
    #[test]
    fn an_interval_past_the_clock_never_comes_due() {
        let tmp = tempfile::tempdir().expect("tmp");
        let config = CheckpointConfig::new(tmp.path(), "job").with_interval(Duration::MAX);
        let mut c = coordinator(tmp.path(), config, 1);
        assert_eq!(c.next_periodic, None);
        trigger_by_hand(&mut c);
        assert_eq!(c.pending.keys().copied().collect::<Vec<_>>(), [1]);
        assert_eq!(c.next_periodic, None);
    }

    /// After checkpoint `u64::MAX` no id is left: the next trigger begins nothing (the id
    /// used to wrap to 0, which no complete checkpoint is older than) and fails the job.
    #[test]
    fn checkpoint_ids_never_wrap() {
        let tmp = tempfile::tempdir().expect("tmp");
        let mut config = CheckpointConfig::new(tmp.path(), "job");
        config.max_concurrent = 2;
        let mut c = coordinator(tmp.path(), config, u64::MAX);
        trigger_by_hand(&mut c);
        assert_eq!(c.pending.keys().copied().collect::<Vec<_>>(), [u64::MAX]);
        assert!(c.failure.lock().expect("lock").is_none());
        trigger_by_hand(&mut c);
        assert_eq!(
            c.pending.keys().copied().collect::<Vec<_>>(),
            [u64::MAX],
            "no checkpoint after the last id"
        );
        assert_eq!(c.shared.requested.load(Ordering::Acquire), u64::MAX);
        let failure = c
            .failure
            .lock()
            .expect("lock")
            .clone()
            .expect("the job fails");
        assert!(
            failure.contains("checkpoint ids are exhausted"),
            "{failure}"
        );
    }
}
