//! A shard's side of checkpointing: participants report their parts of checkpoint `n`; when
//! all did, the shard acknowledges `n` to the coordinator.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};

use super::config::{CheckpointConfig, CheckpointMode};
use super::snapshot::{Part, ShardSnapshot};
use super::store::CheckpointStore;

/// What a shard tells the coordinator.
pub(crate) enum Ack {
    Done {
        shard: usize,
        checkpoint_id: u64,
        snapshot: ShardSnapshot,
        sync_ns: u64,
        async_ns: u64,
        alignment_ns: u64,
        persisted_inflight_bytes: u64,
        /// When the checkpoint's first barrier reached this shard (see `Pending::barrier_at`).
        barrier_at: std::time::Instant,
    },
    Decline {
        shard: usize,
        checkpoint_id: u64,
        reason: String,
    },
}

/// State shared by the coordinator and every shard.
pub(crate) struct Shared {
    pub config: CheckpointConfig,
    /// The newest checkpoint whose barrier sources should inject.
    pub requested: AtomicU64,
    /// The newest complete checkpoint.
    pub completed: AtomicU64,
    /// Recently completed checkpoint ids (an aborted checkpoint's files are deleted, so only
    /// files of these may be reused by later checkpoints).
    pub completed_ids: std::sync::Mutex<std::collections::VecDeque<u64>>,
    /// The newest aborted checkpoint (participants drop what they hold for it).
    pub aborted: AtomicU64,
    /// Source heads of the job, and how many of them read their input to the end.
    pub sources_total: AtomicUsize,
    pub sources_finished: AtomicUsize,
    /// Shards that finished building their operators.
    pub shards_ready: AtomicUsize,
    /// The id of the checkpoint taken after every source finished (0: none yet). Sources end
    /// their streams once it is complete, so a finished job's output is committed. It is
    /// always aligned (in Flink too it comes after every record was processed): unaligned,
    /// its barriers would overtake queued records, whose results come after it and are
    /// published when the input ends, and a restart from it would replay those records and
    /// commit their results twice. Set before its barriers are requested.
    pub final_id: AtomicU64,
    /// The job is ending (stop triggering).
    pub stopping: AtomicBool,
    /// The checkpoint of a stop-with-savepoint (0: none, or withdrawn): nothing is triggered
    /// after it, and a source that injected its barrier reads nothing more while it stands
    /// (Flink's synchronous savepoint), so that no record past it reaches a sink, not even
    /// one that does not commit with checkpoints (a collecting sink held records that the
    /// restored job read again). Set before the checkpoint's barriers are requested.
    pub stop_at: AtomicU64,
    /// The stop-with-savepoint checkpoint whose savepoint was copied out (0: none): the shards
    /// end once it completed and their sinks committed it (see `StopGate`).
    pub stop_go: AtomicU64,
    pub store: Arc<dyn CheckpointStore>,
    pub acks: std::sync::Mutex<mpsc::Sender<Ack>>,
}

impl Shared {
    pub fn mode(&self) -> CheckpointMode {
        self.config.mode
    }

    /// Whether checkpoint `id` is the final one (taken aligned).
    pub fn is_final(&self, id: u64) -> bool {
        id != 0 && self.final_id.load(Ordering::Acquire) == id
    }

    /// True once the final checkpoint completed: finished sources may end their streams.
    pub fn final_complete(&self) -> bool {
        let f = self.final_id.load(Ordering::Acquire);
        f != 0 && self.completed.load(Ordering::Acquire) >= f
    }
}

struct Pending {
    parts: Vec<Part>,
    reported: usize,
    outstanding_async: usize,
    sync_ns: u64,
    async_ns: u64,
    alignment_ns: u64,
    inflight_bytes: u64,
    declined: Option<String>,
    /// The earliest moment a participant saw the checkpoint's barrier: the first report, less
    /// the synchronous part it had just taken, or the start of an input's alignment.
    barrier_at: std::time::Instant,
}

/// Something that wants to hear that a checkpoint completed (sinks commit, stores release
/// older snapshots).
pub(crate) trait CompletionListener {
    fn checkpoint_complete(&self, checkpoint_id: u64);
}

/// One shard's checkpoint bookkeeping.
pub(crate) struct ShardCheckpoint {
    pub shared: Arc<Shared>,
    pub shard: usize,
    expected: usize,
    pending: BTreeMap<u64, Pending>,
    tx: mpsc::Sender<Ack>,
    listeners: Vec<Rc<dyn CompletionListener>>,
    seen_completed: u64,
}

pub(crate) type ShardCheckpointRef = Rc<RefCell<ShardCheckpoint>>;

impl ShardCheckpoint {
    pub fn new(shared: Arc<Shared>, shard: usize) -> ShardCheckpointRef {
        let tx = shared
            .acks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let seen = shared.completed.load(Ordering::Acquire);
        Rc::new(RefCell::new(Self {
            shared,
            shard,
            expected: 0,
            pending: BTreeMap::new(),
            tx,
            listeners: Vec::new(),
            seen_completed: seen,
        }))
    }

    /// Registers a participant: it will report one part per checkpoint.
    pub fn register(&mut self) {
        self.expected += 1;
    }

    pub fn listen(&mut self, l: Rc<dyn CompletionListener>) {
        self.listeners.push(l);
    }

    /// The pending checkpoint `id`; what calls it saw the barrier `ago_ns` before now.
    fn entry(&mut self, id: u64, ago_ns: u64) -> &mut Pending {
        let now = std::time::Instant::now();
        let seen = now
            .checked_sub(std::time::Duration::from_nanos(ago_ns))
            .unwrap_or(now);
        let p = self.pending.entry(id).or_insert_with(|| Pending {
            parts: Vec::new(),
            reported: 0,
            outstanding_async: 0,
            sync_ns: 0,
            async_ns: 0,
            alignment_ns: 0,
            inflight_bytes: 0,
            declined: None,
            barrier_at: seen,
        });
        p.barrier_at = p.barrier_at.min(seen);
        p
    }

    /// A participant's synchronous part of checkpoint `id`.
    pub fn report(&mut self, id: u64, part: Part, sync_ns: u64) {
        self.report_maybe(id, Some(part), sync_ns);
    }

    /// [`Self::report`] of a participant that may have nothing to store (`None`): it counts
    /// as reported, and the checkpoint holds no part of it.
    pub fn report_maybe(&mut self, id: u64, part: Option<Part>, sync_ns: u64) {
        let p = self.entry(id, sync_ns);
        p.parts.extend(part);
        p.reported += 1;
        p.sync_ns += sync_ns;
        self.maybe_ack(id);
    }

    /// A participant reported synchronously and will finish its part in the background.
    pub fn report_async_start(&mut self, id: u64, sync_ns: u64) {
        let p = self.entry(id, sync_ns);
        p.reported += 1;
        p.outstanding_async += 1;
        p.sync_ns += sync_ns;
    }

    /// A further part of checkpoint `id` from a participant that has not reported it yet
    /// (an exchange input's watermark valve, beside its channel state): held with the parts,
    /// it counts as no report.
    pub fn attach(&mut self, id: u64, part: Part) {
        self.entry(id, 0).parts.push(part);
    }

    /// The background part of a participant's snapshot finished.
    pub fn report_async_done(&mut self, id: u64, result: Result<Part, String>, async_ns: u64) {
        let p = self.entry(id, 0);
        p.outstanding_async = p.outstanding_async.saturating_sub(1);
        p.async_ns = p.async_ns.max(async_ns);
        match result {
            Ok(part) => p.parts.push(part),
            Err(e) => {
                p.declined.get_or_insert(e);
            }
        }
        self.maybe_ack(id);
    }

    /// A participant cannot take checkpoint `id`.
    pub fn decline(&mut self, id: u64, reason: String) {
        let p = self.entry(id, 0);
        p.reported += 1;
        p.declined.get_or_insert(reason);
        self.maybe_ack(id);
    }

    /// Time an exchange input spent aligning barrier `id`.
    pub fn record_alignment(&mut self, id: u64, ns: u64, inflight_bytes: u64) {
        let p = self.entry(id, ns);
        p.alignment_ns = p.alignment_ns.max(ns);
        p.inflight_bytes += inflight_bytes;
    }

    fn maybe_ack(&mut self, id: u64) {
        let done = self
            .pending
            .get(&id)
            .is_some_and(|p| p.reported >= self.expected && p.outstanding_async == 0);
        if !done {
            return;
        }
        let Some(p) = self.pending.remove(&id) else {
            return;
        };
        let ack = match p.declined {
            Some(reason) => Ack::Decline {
                shard: self.shard,
                checkpoint_id: id,
                reason,
            },
            None => Ack::Done {
                shard: self.shard,
                checkpoint_id: id,
                snapshot: ShardSnapshot {
                    shard: self.shard as u32,
                    parts: p.parts,
                },
                sync_ns: p.sync_ns,
                async_ns: p.async_ns,
                alignment_ns: p.alignment_ns,
                persisted_inflight_bytes: p.inflight_bytes,
                barrier_at: p.barrier_at,
            },
        };
        // The coordinator is gone only when the job is ending.
        let _ = self.tx.send(ack);
    }

    /// True once this shard told its listeners (sinks committed) of the completion of the
    /// stop-with-savepoint's checkpoint, and its savepoint is out: the shard may end.
    pub fn stop_reached(this: &ShardCheckpointRef) -> bool {
        let s = this.borrow();
        let go = s.shared.stop_go.load(Ordering::Acquire);
        go != 0 && s.seen_completed >= go
    }

    /// Tells listeners about checkpoints completed since the last call; drops bookkeeping of
    /// aborted ones. Called by the shard loop; cheap when nothing changed.
    pub fn poll_completed(this: &ShardCheckpointRef) {
        let (completed, listeners) = {
            let mut s = this.borrow_mut();
            let c = s.shared.completed.load(Ordering::Acquire);
            let aborted = s.shared.aborted.load(Ordering::Acquire);
            // Entries of complete or aborted checkpoints are stale: late parts of them are
            // dropped on arrival by the coordinator anyway.
            s.pending.retain(|id, _| *id > c && *id != aborted);
            if c <= s.seen_completed {
                return;
            }
            s.seen_completed = c;
            (c, s.listeners.clone())
        };
        for l in listeners {
            l.checkpoint_complete(completed);
        }
    }
}
