//! Ingress: host threads hand batches of records to a running job.
//!
//! A shard never waits for a host thread and a host thread never wakes a shard per record:
//! host threads push whole batches into a bounded queue, and the shards poll it between their
//! other work (PLATFORM.md: one cross-thread wake costs tens of microseconds). Every shard
//! reads the queue; a batch goes whole to the shard that takes it first.
//!
//! A host pushes a batch once, so with checkpointing the ingress keeps what it may have to
//! read again: each shard's *replay log*, the batches its readers took since the last
//! completed checkpoint. It lives in the queue's shared state, which outlives a failed
//! attempt (the job's sources are built again per attempt from the same [`IngressSource`]);
//! a reader takes its shard's log when made and puts it back when dropped. The guarantees
//! are on [`IngressSource`].

use std::collections::VecDeque;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use super::{Source, SourceError, SourcePoll, SourceReader};

struct Queue<T> {
    batches: VecDeque<Vec<T>>,
    /// Closed by the host ([`Ingress::close`], or its last handle dropped), or no job reads
    /// the queue any more (its [`IngressSource`] went with the job): pushes are refused, and a
    /// host thread blocked on a full queue wakes (it waited for good once the job had ended).
    closed: bool,
    /// Live [`Ingress`] handles: the last one dropped closes the queue, as a channel's last
    /// sender does (a job whose hosts forgot `close` ran forever).
    hosts: usize,
    /// Each shard's replay log while no reader holds it: a reader takes its shard's when made
    /// and puts it back when dropped, so the next attempt's reader replays it. `None`: a live
    /// reader holds it.
    logs: Vec<Option<Log<T>>>,
}

struct Shared<T> {
    q: Mutex<Queue<T>>,
    not_full: Condvar,
    capacity_batches: usize,
    /// Names this ingress in its positions: another ingress's positions (another process's,
    /// from a savepoint) mean nothing to this one's logs.
    id: u64,
    /// Records in the replay logs, held by readers or not ([`Ingress::replay_records`]).
    logged: AtomicU64,
}

impl<T> Shared<T> {
    fn lock(&self) -> MutexGuard<'_, Queue<T>> {
        self.q.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The batches one shard's readers took from the queue since the last checkpoint that
/// completed (or since the job started), each numbered: batch `base` is `batches[0]`.
struct Log<T> {
    base: u64,
    batches: VecDeque<Vec<T>>,
}

impl<T> Default for Log<T> {
    fn default() -> Self {
        Self {
            base: 0,
            batches: VecDeque::new(),
        }
    }
}

impl<T> Log<T> {
    /// The number the next batch taken gets.
    fn end(&self) -> u64 {
        self.base + self.batches.len() as u64
    }

    fn records(&self) -> u64 {
        self.batches.iter().map(|b| b.len() as u64).sum()
    }

    fn get(&self, seq: u64) -> Option<&Vec<T>> {
        let i = usize::try_from(seq.checked_sub(self.base)?).ok()?;
        self.batches.get(i)
    }

    /// Lets go of the batches before `seq`: no restore reads them again. Counted off
    /// `logged`.
    fn release_before(&mut self, seq: u64, logged: &AtomicU64) {
        let mut records = 0;
        while self.base < seq {
            let Some(b) = self.batches.pop_front() else {
                break;
            };
            records += b.len() as u64;
            self.base += 1;
        }
        logged.fetch_sub(records, Ordering::Relaxed);
    }
}

/// The host side of an ingress: push batches, then [`Ingress::close`], or drop every handle
/// (this one and its clones): as with a channel's senders, the input then ends.
pub struct Ingress<T> {
    shared: Arc<Shared<T>>,
}

impl<T> Clone for Ingress<T> {
    fn clone(&self) -> Self {
        self.shared.lock().hosts += 1;
        Self {
            shared: self.shared.clone(),
        }
    }
}

/// The last host handle gone, nothing can push: the job's sources finish once they read
/// what was pushed.
impl<T> Drop for Ingress<T> {
    fn drop(&mut self) {
        let mut q = self.shared.lock();
        q.hosts = q.hosts.saturating_sub(1);
        if q.hosts == 0 {
            q.closed = true;
            self.shared.not_full.notify_all();
        }
    }
}

/// The job side of an ingress: give it to [`Job::source`](crate::Job::source). Every shard
/// reads it, each batch on the shard that takes it first.
///
/// **Failures and restarts.** With checkpointing, a record that [`Ingress::push_batch`]
/// accepted reaches an exactly-once sink once within the process (one
/// [`JobHandle`](crate::JobHandle), its restarts included): not lost, not twice, as with a
/// replayable source in Flink. Each shard's reader logs the batches it takes, and its
/// position is where it stands in that log (batch number and record). A restart from a
/// checkpoint replays each shard's log from that checkpoint's position, then goes on with the
/// queue; a restart before the first checkpoint completed replays the logs from the
/// beginning, as Flink restarts a replayable source from its start. A completed checkpoint
/// lets go of the batches its positions passed, so a log holds what its shard read since the
/// last completed checkpoint: that much memory, and more while checkpoints fail
/// ([`Ingress::replay_records`] tells how many records). Records are
/// cloned out of the log (a copy of the bytes for plain data), the price of the replay.
/// Without checkpointing a job does not restart (a failure ends it), so nothing is kept and
/// records are moved out.
///
/// Positions name the ingress that took them. A job restored in another process (from a
/// savepoint, or `latest`), or a new job in this one, has a new ingress whose queue and logs
/// are empty: it passes over the old positions, on any number of shards, and reads what hosts
/// push next. What the old ingress held (queued, or read after the checkpoint) went with it;
/// hosts that need it there push it again.
///
/// When the job ends, pushes are refused ([`Closed`]).
pub struct IngressSource<T> {
    shared: Arc<Shared<T>>,
}

/// The queue was closed, or the job that read it ended.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("the ingress is closed")]
pub struct Closed;

/// A random id for a new ingress: `RandomState` is seeded from the OS once per process and
/// stepped per instance, and the counter keeps two instances of one process apart.
fn new_ingress_id() -> u64 {
    static MADE: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(MADE.fetch_add(1, Ordering::Relaxed));
    h.write_u32(std::process::id());
    h.finish()
}

/// A bounded ingress: its queue holds at most `capacity_batches` batches that no shard took
/// yet (a host pushing into a full queue waits). The replay logs are apart from that bound.
/// A capacity of 0 is taken as 1: a queue that holds nothing could only hand a batch over
/// while a shard waits in a poll, and shards poll, they do not wait.
pub fn ingress<T>(capacity_batches: usize) -> (Ingress<T>, IngressSource<T>) {
    let shared = Arc::new(Shared {
        q: Mutex::new(Queue {
            batches: VecDeque::new(),
            closed: false,
            hosts: 1,
            logs: Vec::new(),
        }),
        not_full: Condvar::new(),
        capacity_batches: capacity_batches.max(1),
        id: new_ingress_id(),
        logged: AtomicU64::new(0),
    });
    (
        Ingress {
            shared: shared.clone(),
        },
        IngressSource { shared },
    )
}

impl<T> Ingress<T> {
    /// Pushes a batch, waiting while the queue is full (backpressure on the host thread).
    pub fn push_batch(&self, batch: Vec<T>) -> Result<(), Closed> {
        let mut q = self.shared.lock();
        loop {
            if q.closed {
                return Err(Closed);
            }
            if q.batches.len() < self.shared.capacity_batches {
                q.batches.push_back(batch);
                return Ok(());
            }
            q = self
                .shared
                .not_full
                .wait(q)
                .unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Pushes a batch if there is room; gives it back otherwise.
    pub fn try_push_batch(&self, batch: Vec<T>) -> Result<(), (Vec<T>, Option<Closed>)> {
        let mut q = self.shared.lock();
        if q.closed {
            return Err((batch, Some(Closed)));
        }
        if q.batches.len() >= self.shared.capacity_batches {
            return Err((batch, None));
        }
        q.batches.push_back(batch);
        Ok(())
    }

    /// Records the job keeps to read again after a failure: with checkpointing, what its
    /// shards read since the last completed checkpoint (see [`IngressSource`]); 0 without.
    pub fn replay_records(&self) -> u64 {
        self.shared.logged.load(Ordering::Relaxed)
    }

    /// Ends the input: the job's sources finish once the queue is drained.
    pub fn close(&self) {
        let mut q = self.shared.lock();
        q.closed = true;
        self.shared.not_full.notify_all();
    }
}

/// A position: format byte, the ingress's id, then the batch number and the record in it of
/// the next record to read, all little-endian.
const POSITION_FORMAT: u8 = 1;
const POSITION_LEN: usize = 1 + 8 + 8 + 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Position {
    ingress: u64,
    seq: u64,
    off: u64,
}

impl Position {
    fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(POSITION_LEN);
        b.push(POSITION_FORMAT);
        b.extend_from_slice(&self.ingress.to_le_bytes());
        b.extend_from_slice(&self.seq.to_le_bytes());
        b.extend_from_slice(&self.off.to_le_bytes());
        b
    }

    fn decode(b: &[u8]) -> Result<Position, String> {
        if b.len() != POSITION_LEN || b[0] != POSITION_FORMAT {
            return Err(format!(
                "an ingress position is {POSITION_LEN} bytes of format {POSITION_FORMAT}, not \
                 {} bytes{}",
                b.len(),
                b.first()
                    .map_or(String::new(), |f| format!(" of format {f}"))
            ));
        }
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[1 + 8 * i..9 + 8 * i]);
            u64::from_le_bytes(w)
        };
        Ok(Position {
            ingress: word(0),
            seq: word(1),
            off: word(2),
        })
    }
}

/// A reader's place in its shard's replay log, with checkpointing.
struct Replay<T> {
    log: Log<T>,
    /// The next record: record `off` of batch `seq` (`seq == log.end()`: the queue's next).
    seq: u64,
    off: usize,
    /// A restored position placed it; otherwise [`SourceReader::start`] puts it at the log's
    /// beginning.
    restored: bool,
    /// (checkpoint id, batch number) of the positions barriers took, oldest first, until their
    /// checkpoint (or a later one) completes.
    pending: VecDeque<(u64, u64)>,
}

struct IngressReader<T> {
    shared: Arc<Shared<T>>,
    shard: usize,
    shards: usize,
    /// Without checkpointing: the batch being read, its records moved out.
    current: std::vec::IntoIter<T>,
    /// With checkpointing ([`SourceReader::enable_checkpointing`]).
    replay: Option<Replay<T>>,
    /// This shard's log while no checkpointing took it into `replay`; given back when the
    /// reader is dropped, with `replay`'s.
    idle_log: Option<Log<T>>,
}

impl<T> IngressReader<T> {
    /// Takes the next batch from the queue; when there is none, whether the queue is closed.
    fn take_batch(&self) -> Result<Vec<T>, bool> {
        let mut q = self.shared.lock();
        match q.batches.pop_front() {
            Some(b) => {
                drop(q);
                self.shared.not_full.notify_one();
                Ok(b)
            }
            None => Err(q.closed),
        }
    }

    fn bad(&self, why: String) -> SourceError {
        SourceError::BadPosition(format!(
            "ingress, shard {} of {}: {why}",
            self.shard, self.shards
        ))
    }
}

impl<T: Clone + Send + 'static> IngressReader<T> {
    fn poll_moved(&mut self, out: &mut Vec<T>, max: usize) -> SourcePoll {
        let before = out.len();
        loop {
            out.extend(self.current.by_ref().take(max - (out.len() - before)));
            if out.len() - before >= max {
                return SourcePoll::Ready;
            }
            match self.take_batch() {
                Ok(b) => self.current = b.into_iter(),
                Err(closed) => return ended(out.len() > before, closed),
            }
        }
    }

    /// Reads on in the log (a replay after a restart, or the batch being read), then takes
    /// batches from the queue into the log. Records are cloned out: the log keeps them until
    /// a checkpoint past them completes.
    fn poll_logged(&mut self, out: &mut Vec<T>, max: usize) -> SourcePoll {
        let before = out.len();
        loop {
            let room = max - (out.len() - before);
            if room == 0 {
                return SourcePoll::Ready;
            }
            let Some(r) = self.replay.as_mut() else {
                return SourcePoll::Finished;
            };
            debug_assert!(r.seq >= r.log.base, "the log let go of unread batches");
            if let Some(b) = r.log.get(r.seq) {
                let from = r.off.min(b.len());
                let n = room.min(b.len() - from);
                out.extend_from_slice(&b[from..from + n]);
                r.off = from + n;
                if r.off == b.len() {
                    r.seq += 1;
                    r.off = 0;
                }
                continue;
            }
            match self.take_batch() {
                // An empty batch takes no number: no position falls into it.
                Ok(b) if b.is_empty() => {}
                Ok(b) => {
                    if let Some(r) = self.replay.as_mut() {
                        self.shared
                            .logged
                            .fetch_add(b.len() as u64, Ordering::Relaxed);
                        r.log.batches.push_back(b);
                    }
                }
                Err(closed) => return ended(out.len() > before, closed),
            }
        }
    }

    /// Continues from position `p` of this ingress, which this shard's readers took.
    fn seek_own(&mut self, p: Position) -> Result<(), SourceError> {
        let Some(r) = self.replay.as_ref() else {
            // Without checkpointing nothing is logged (and no restart happens in this
            // process): the position's records are not here.
            return Ok(());
        };
        let (base, end) = (r.log.base, r.log.end());
        if p.seq < base {
            return Err(self.bad(format!(
                "position (batch {}, record {}) is before what this ingress still holds (from \
                 batch {base}): those records were let go when a later checkpoint completed, \
                 and restoring this one would lose them; restore the newest checkpoint",
                p.seq, p.off
            )));
        }
        let len = r.log.get(p.seq).map_or(0, |b| b.len() as u64);
        if p.seq > end || p.off > len {
            return Err(self.bad(format!(
                "position (batch {}, record {}) is past what this shard read (batch {end}{})",
                p.seq,
                p.off,
                if p.seq < end {
                    format!(", {len} records in batch {}", p.seq)
                } else {
                    String::new()
                }
            )));
        }
        let Some(r) = self.replay.as_mut() else {
            return Ok(());
        };
        // The restored checkpoint completed: nothing before its position is read again.
        r.log.release_before(p.seq, &self.shared.logged);
        r.seq = p.seq;
        r.off = p.off as usize;
        if r.log.get(r.seq).is_some_and(|b| r.off == b.len()) {
            r.seq += 1;
            r.off = 0;
        }
        r.restored = true;
        r.pending.clear();
        Ok(())
    }
}

/// What a poll that found the queue empty returns.
fn ended(appended: bool, closed: bool) -> SourcePoll {
    if appended {
        SourcePoll::Ready
    } else if closed {
        SourcePoll::Finished
    } else {
        SourcePoll::Idle
    }
}

impl<T: Clone + Send + 'static> SourceReader<T> for IngressReader<T> {
    fn poll(&mut self, out: &mut Vec<T>, max: usize) -> Result<SourcePoll, SourceError> {
        Ok(if self.replay.is_some() {
            self.poll_logged(out, max)
        } else {
            self.poll_moved(out, max)
        })
    }

    fn enable_checkpointing(&mut self) {
        if let Some(log) = self.idle_log.take() {
            self.replay = Some(Replay {
                seq: log.base,
                log,
                off: 0,
                restored: false,
                pending: VecDeque::new(),
            });
        }
    }

    /// Empty without checkpointing: nothing could be replayed from it.
    fn position(&self) -> Vec<u8> {
        self.replay.as_ref().map_or_else(Vec::new, |r| {
            Position {
                ingress: self.shared.id,
                seq: r.seq,
                off: r.off as u64,
            }
            .encode()
        })
    }

    fn snapshot_position(&mut self, checkpoint_id: u64) -> Vec<u8> {
        if let Some(r) = self.replay.as_mut() {
            r.pending.push_back((checkpoint_id, r.seq));
        }
        self.position()
    }

    fn notify_checkpoint_complete(&mut self, checkpoint_id: u64) {
        let Some(r) = self.replay.as_mut() else {
            return;
        };
        let mut upto = None;
        while let Some(&(id, seq)) = r.pending.front() {
            if id > checkpoint_id {
                break;
            }
            upto = Some(seq);
            r.pending.pop_front();
        }
        if let Some(seq) = upto {
            // Its batch itself stays: the position may be inside it.
            r.log.release_before(seq.min(r.seq), &self.shared.logged);
        }
    }

    fn seek(&mut self, position: &[u8]) -> Result<(), SourceError> {
        self.restore(self.shards, &[(self.shard, position)])
    }

    /// Takes this shard's own position back, if the checkpoint is this ingress's; positions
    /// of another ingress (another process's, a savepoint's, on any number of shards) are
    /// passed over: this ingress never had their records, and reads what hosts push next.
    fn restore(
        &mut self,
        old_shards: usize,
        positions: &[(usize, &[u8])],
    ) -> Result<(), SourceError> {
        let mut own = None;
        for &(old, bytes) in positions {
            let p =
                Position::decode(bytes).map_err(|e| self.bad(format!("old shard {old}: {e}")))?;
            if p.ingress != self.shared.id {
                continue;
            }
            // One ingress serves one job, whose shard count never changes: a position of
            // this ingress elsewhere than its own shard was not written by it.
            if old_shards != self.shards || old != self.shard || own.is_some() {
                return Err(self.bad(format!(
                    "a position of this ingress from old shard {old} of {old_shards}: this \
                     ingress's job runs on {} shards",
                    self.shards
                )));
            }
            own = Some(p);
        }
        match own {
            Some(p) => self.seek_own(p),
            None => Ok(()),
        }
    }

    /// Not restored (the job's start, or a restart before its first checkpoint completed):
    /// replays this shard's log from the beginning, all it read since the job started.
    fn start(&mut self) -> Result<(), SourceError> {
        let Some(r) = self.replay.as_ref() else {
            return Ok(());
        };
        if r.restored {
            return Ok(());
        }
        if r.log.base > 0 {
            return Err(self.bad(format!(
                "a start from the beginning, but this ingress let go of its first {} batches \
                 when a checkpoint completed: restore that checkpoint (a start from the \
                 beginning would lose them)",
                r.log.base
            )));
        }
        if let Some(r) = self.replay.as_mut() {
            r.seq = 0;
            r.off = 0;
        }
        Ok(())
    }
}

/// Puts this shard's log back for the next attempt's reader: a restart replays it.
impl<T> Drop for IngressReader<T> {
    fn drop(&mut self) {
        let log = self
            .replay
            .take()
            .map(|r| r.log)
            .or_else(|| self.idle_log.take());
        let mut q = self.shared.lock();
        match q.logs.get_mut(self.shard) {
            Some(slot) => *slot = log,
            // The source went with its job (it cleared the logs): nothing reads this one
            // again.
            None => {
                let records = log.map_or(0, |l| l.records());
                self.shared.logged.fetch_sub(records, Ordering::Relaxed);
            }
        }
    }
}

/// The job that read the queue ended (or it was never given to one): nothing will take the
/// batches, so pushes are refused from now on, and the logs go.
impl<T> Drop for IngressSource<T> {
    fn drop(&mut self) {
        let mut q = self.shared.lock();
        q.closed = true;
        for log in q.logs.drain(..).flatten() {
            self.shared
                .logged
                .fetch_sub(log.records(), Ordering::Relaxed);
        }
        self.shared.not_full.notify_all();
    }
}

impl<T: Clone + Send + 'static> Source<T> for IngressSource<T> {
    fn create_reader(
        &self,
        shard: usize,
        shards: usize,
    ) -> Result<Box<dyn SourceReader<T>>, SourceError> {
        let log = {
            let mut q = self.shared.lock();
            let len = shards.max(shard.saturating_add(1));
            if q.logs.len() < len {
                q.logs.resize_with(len, || Some(Log::default()));
            }
            q.logs.get_mut(shard).and_then(Option::take)
        };
        // Attempts follow one another, each reader dropped with its attempt: a log still
        // out means a second reader of this shard, which would split its log.
        let Some(log) = log else {
            return Err(SourceError::Other(format!(
                "ingress: shard {shard} of {shards} already has a reader"
            )));
        };
        Ok(Box::new(IngressReader {
            shared: self.shared.clone(),
            shard,
            shards,
            current: Vec::new().into_iter(),
            replay: None,
            idle_log: Some(log),
        }))
    }

    fn name(&self) -> &str {
        "ingress"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_flow_and_close_finishes() {
        let (tx, src) = ingress::<u32>(2);
        let mut r = src.create_reader(0, 1).expect("reader");
        let mut out = Vec::new();
        assert_eq!(r.poll(&mut out, 10).expect("poll"), SourcePoll::Idle);
        tx.push_batch(vec![1, 2, 3]).expect("push");
        tx.push_batch(vec![4]).expect("push");
        assert!(tx.try_push_batch(vec![5]).is_err(), "bounded");
        assert_eq!(r.poll(&mut out, 2).expect("poll"), SourcePoll::Ready);
        assert_eq!(r.poll(&mut out, 10).expect("poll"), SourcePoll::Ready);
        assert_eq!(out, vec![1, 2, 3, 4]);
        tx.close();
        assert_eq!(r.poll(&mut out, 10).expect("poll"), SourcePoll::Finished);
        assert_eq!(tx.push_batch(vec![9]), Err(Closed));
    }

    #[test]
    fn a_full_queue_blocks_the_host_until_the_shard_takes_a_batch() {
        let (tx, src) = ingress::<u32>(1);
        tx.push_batch(vec![1]).expect("push");
        let tx2 = tx.clone();
        let t = std::thread::spawn(move || tx2.push_batch(vec![2]));
        // The host stays blocked while nothing is taken. (A push that did not block would
        // return within this time; one that blocks is never finished here, however slow the
        // machine: the check cannot fail spuriously.)
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!t.is_finished(), "push_batch returned with the queue full");
        let mut r = src.create_reader(0, 1).expect("reader");
        let mut out = Vec::new();
        // A lost wake-up fails here rather than hanging the suite.
        let give_up = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while out.len() < 2 {
            assert!(
                std::time::Instant::now() < give_up,
                "the host was never woken"
            );
            r.poll(&mut out, 10).expect("poll");
            std::thread::yield_now();
        }
        t.join().expect("join").expect("push");
        assert_eq!(out, vec![1, 2]);
    }

    /// A reader of `shard` of `shards` of a job that takes checkpoints, restored from
    /// `positions` (old shard, position) of a checkpoint taken on `old_shards`, then started.
    fn checkpointed(
        src: &IngressSource<u32>,
        shard: usize,
        shards: usize,
        old_shards: usize,
        positions: &[(usize, &[u8])],
    ) -> Result<Box<dyn SourceReader<u32>>, SourceError> {
        let mut r = src.create_reader(shard, shards)?;
        r.enable_checkpointing();
        if !positions.is_empty() {
            r.restore(old_shards, positions)?;
        }
        r.start()?;
        Ok(r)
    }

    /// Polls `r` (`max` a poll) until it has nothing more for now; what it read and how the
    /// last poll ended.
    fn drain(r: &mut dyn SourceReader<u32>, max: usize) -> (Vec<u32>, SourcePoll) {
        let mut out = Vec::new();
        loop {
            match r.poll(&mut out, max).expect("poll") {
                SourcePoll::Ready => {}
                end => return (out, end),
            }
        }
    }

    /// Reads exactly `n` records.
    fn read(r: &mut dyn SourceReader<u32>, n: usize) -> Vec<u32> {
        let mut out = Vec::new();
        assert_eq!(r.poll(&mut out, n).expect("poll"), SourcePoll::Ready);
        assert_eq!(out.len(), n, "{out:?}");
        out
    }

    /// The first batch number and the records of `shard`'s log, while no reader holds it.
    fn logged(src: &IngressSource<u32>, shard: usize) -> (u64, Vec<u32>) {
        let q = src.shared.lock();
        let log = q.logs[shard].as_ref().expect("no reader holds the log");
        (log.base, log.batches.iter().flatten().copied().collect())
    }

    fn push(tx: &Ingress<u32>, records: std::ops::Range<u32>) {
        tx.push_batch(records.collect()).expect("push");
    }

    /// What a failed attempt read after the checkpoint's barrier (the rest of the batch it
    /// was in, whole batches, part of a batch) is read again by the next attempt's reader,
    /// restored from the checkpoint, before what hosts pushed since: nothing lost, nothing
    /// twice. (Without the replay log the restored reader started with the queue: records
    /// 5..23 were lost.)
    #[test]
    fn a_restore_replays_what_the_failed_attempt_read_after_the_checkpoint() {
        let (tx, src) = ingress::<u32>(8);
        push(&tx, 0..10);
        push(&tx, 10..20);
        let mut r = checkpointed(&src, 0, 1, 1, &[]).expect("reader");
        assert_eq!(read(&mut *r, 5), (0..5).collect::<Vec<_>>());
        let at_1 = r.snapshot_position(1);
        assert_eq!(drain(&mut *r, 100), ((5..20).collect(), SourcePoll::Idle));
        push(&tx, 20..30);
        assert_eq!(read(&mut *r, 3), vec![20, 21, 22]);
        drop(r);
        push(&tx, 30..40);
        let mut r = checkpointed(&src, 0, 1, 1, &[(0, &at_1)]).expect("restored");
        assert_eq!(drain(&mut *r, 7), ((5..40).collect(), SourcePoll::Idle));
        tx.close();
        assert_eq!(drain(&mut *r, 7), (Vec::new(), SourcePoll::Finished));
    }

    /// A restart before any checkpoint completed starts from the beginning: the log holds
    /// everything the job read, and the new reader reads it again, then the queue.
    #[test]
    fn a_restart_before_the_first_checkpoint_replays_from_the_beginning() {
        let (tx, src) = ingress::<u32>(8);
        push(&tx, 0..10);
        push(&tx, 10..20);
        let mut r = checkpointed(&src, 0, 1, 1, &[]).expect("reader");
        // A checkpoint that never completes releases nothing.
        let _ = r.snapshot_position(1);
        assert_eq!(read(&mut *r, 12), (0..12).collect::<Vec<_>>());
        drop(r);
        push(&tx, 20..25);
        let mut r = checkpointed(&src, 0, 1, 1, &[]).expect("restarted");
        assert_eq!(drain(&mut *r, 100), ((0..25).collect(), SourcePoll::Idle));
    }

    /// A completed checkpoint lets go of the batches before its position (not the batch the
    /// position is in), also when its completion is the only one told of a later one; a
    /// restore of an older position than the log holds, or a start from the beginning after
    /// it let go, is refused rather than losing records.
    #[test]
    fn a_completed_checkpoint_lets_go_of_what_its_position_passed() {
        let (tx, src) = ingress::<u32>(8);
        for b in 0..4 {
            push(&tx, b * 10..b * 10 + 10);
        }
        let mut r = checkpointed(&src, 0, 1, 1, &[]).expect("reader");
        let at_1 = r.snapshot_position(1);
        read(&mut *r, 15);
        let at_2 = r.snapshot_position(2);
        read(&mut *r, 10);
        let at_3 = r.snapshot_position(3);
        r.notify_checkpoint_complete(2);
        drop(r);
        // Batch 3 is still queued.
        assert_eq!(logged(&src, 0), (1, (10..30).collect()), "from batch 1");
        assert_eq!(tx.replay_records(), 20);
        let mut r = checkpointed(&src, 0, 1, 1, &[(0, &at_2)]).expect("at 2");
        assert_eq!(drain(&mut *r, 100).0, (15..40).collect::<Vec<_>>());
        // Checkpoint 3 completed before this attempt failed: at 3 stays restorable.
        drop(r);
        let mut r = checkpointed(&src, 0, 1, 1, &[(0, &at_3)]).expect("at 3");
        assert_eq!(logged_while_read(&mut *r), (25..40).collect::<Vec<_>>());
        drop(r);
        // Restored at 3, the log starts at its batch.
        assert_eq!(logged(&src, 0).0, 2);
        assert_eq!(tx.replay_records(), 20, "batches 2 and 3");
        for (what, pos) in [("checkpoint 1", &at_1[..]), ("checkpoint 2", &at_2[..])] {
            match checkpointed(&src, 0, 1, 1, &[(0, pos)]) {
                Err(SourceError::BadPosition(why)) => assert!(why.contains("let go"), "{why}"),
                Err(e) => panic!("{what}: {e}"),
                Ok(_) => panic!("{what}: restored behind the log"),
            }
        }
        match checkpointed(&src, 0, 1, 1, &[]) {
            Err(SourceError::BadPosition(why)) => assert!(why.contains("beginning"), "{why}"),
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("a start from the beginning behind the log"),
        }
        // The job ended: its logs go.
        drop(src);
        assert_eq!(tx.replay_records(), 0);
    }

    fn logged_while_read(r: &mut dyn SourceReader<u32>) -> Vec<u32> {
        drain(r, 100).0
    }

    /// Without checkpointing a job never restarts: records are moved out and nothing is kept,
    /// however much is read.
    #[test]
    fn without_checkpointing_nothing_is_kept() {
        let (tx, src) = ingress::<u32>(4);
        let mut r = src.create_reader(0, 1).expect("reader");
        r.start().expect("start");
        for b in 0..100 {
            push(&tx, b * 10..b * 10 + 10);
            assert_eq!(
                drain(&mut *r, 64).0,
                (b * 10..b * 10 + 10).collect::<Vec<_>>()
            );
        }
        assert!(r.position().is_empty());
        drop(r);
        assert_eq!(logged(&src, 0), (0, Vec::new()));
        assert_eq!(tx.replay_records(), 0);
    }

    /// Every shard reads the queue and keeps its own log: each restored reader replays what
    /// its shard read after the checkpoint, so that together they read every record once.
    #[test]
    fn each_shard_replays_what_it_read() {
        let (tx, src) = ingress::<u32>(16);
        let mut r0 = checkpointed(&src, 0, 2, 2, &[]).expect("reader 0");
        let mut r1 = checkpointed(&src, 1, 2, 2, &[]).expect("reader 1");
        let mut seen = Vec::new();
        for b in 0..6 {
            push(&tx, b * 10..b * 10 + 10);
            let r = if b % 2 == 0 { &mut r0 } else { &mut r1 };
            seen.extend(read(&mut **r, if b < 2 { 10 } else { 4 }));
        }
        let at = [r0.snapshot_position(1), r1.snapshot_position(1)];
        let before = seen.len();
        seen.extend(drain(&mut *r0, 3).0);
        seen.extend(drain(&mut *r1, 3).0);
        assert_eq!(seen.len(), 60);
        drop((r0, r1));
        push(&tx, 60..70);
        let mut again = seen[..before].to_vec();
        for shard in 0..2 {
            let mine = crate::source::taken_over(&at, 2, shard);
            assert_eq!(mine, vec![(shard, &at[shard][..])]);
            let mut r = checkpointed(&src, shard, 2, 2, &mine).expect("restored");
            again.extend(drain(&mut *r, 5).0);
        }
        again.sort_unstable();
        assert_eq!(again, (0..70).collect::<Vec<_>>());
    }

    /// Positions of another ingress (another process's, from a savepoint) mean nothing here,
    /// on as many shards as before, fewer or more: the readers read what hosts push next.
    #[test]
    fn positions_of_another_ingress_are_passed_over_on_any_shard_count() {
        let (old_tx, old_src) = ingress::<u32>(8);
        let old: Vec<Vec<u8>> = (0..2)
            .map(|s| {
                let mut r = checkpointed(&old_src, s, 2, 2, &[]).expect("old reader");
                push(&old_tx, 0..10);
                read(&mut *r, 4);
                r.snapshot_position(1)
            })
            .collect();
        for shards in [1, 2, 3] {
            let (tx, src) = ingress::<u32>(8);
            push(&tx, 100..110);
            let mut got = Vec::new();
            for shard in 0..shards {
                let mine = crate::source::taken_over(&old, shards, shard);
                let mut r = checkpointed(&src, shard, shards, 2, &mine).expect("restored");
                got.extend(drain(&mut *r, 64).0);
            }
            assert_eq!(got, (100..110).collect::<Vec<_>>(), "{shards} shards");
        }
    }

    /// Positions that this ingress cannot have written are refused, never a panic: of
    /// another format or length, past what the shard read, inside no batch, or of this
    /// ingress but from another shard or shard count.
    #[test]
    fn malformed_positions_are_refused() {
        let (tx, src) = ingress::<u32>(8);
        push(&tx, 0..10);
        let mut r = checkpointed(&src, 0, 2, 2, &[]).expect("reader");
        read(&mut *r, 10);
        let good = r.snapshot_position(1);
        drop(r);
        let with = |seq: u64, off: u64| {
            Position {
                ingress: src.shared.id,
                seq,
                off,
            }
            .encode()
        };
        let mut other_format = good.clone();
        other_format[0] = 7;
        let cases: Vec<(&str, Vec<u8>, usize, usize)> = vec![
            ("empty", vec![POSITION_FORMAT], 0, 2),
            ("short", good[..POSITION_LEN - 1].to_vec(), 0, 2),
            ("long", [good.clone(), vec![0]].concat(), 0, 2),
            ("format", other_format, 0, 2),
            ("past the log", with(2, 0), 0, 2),
            ("at the end, a record in", with(1, 1), 0, 2),
            ("past the batch", with(0, 11), 0, 2),
            ("far past", with(u64::MAX, u64::MAX), 0, 2),
            ("another shard's", good.clone(), 1, 2),
            ("another shard count", good.clone(), 0, 3),
        ];
        for (what, pos, old_shard, old_shards) in cases {
            match checkpointed(&src, 0, 2, old_shards, &[(old_shard, &pos)]) {
                Err(SourceError::BadPosition(why)) => {
                    assert!(why.contains("ingress, shard 0 of 2"), "{what}: {why}")
                }
                Err(e) => panic!("{what}: {e}"),
                Ok(_) => panic!("{what}: accepted"),
            }
        }
        // The batch's end is the next batch's start.
        let mut r = checkpointed(&src, 0, 2, 2, &[(0, &with(0, 10))]).expect("at the end");
        push(&tx, 10..12);
        assert_eq!(drain(&mut *r, 8).0, vec![10, 11]);
    }

    /// A second reader of a shard whose reader lives would split its log: refused.
    #[test]
    fn a_second_reader_of_a_shard_is_refused() {
        let (_tx, src) = ingress::<u32>(2);
        let r = src.create_reader(1, 2).expect("reader");
        assert!(matches!(
            src.create_reader(1, 2),
            Err(SourceError::Other(_))
        ));
        drop(r);
        src.create_reader(1, 2).expect("the next attempt's reader");
    }

    /// Dropping every host handle, clones included, ends the input as `close` does (the
    /// job's readers returned `Idle` forever), after what was pushed is read.
    #[test]
    fn dropping_every_host_handle_ends_the_input() {
        let (tx, src) = ingress::<u32>(4);
        let tx2 = tx.clone();
        let mut r = src.create_reader(0, 1).expect("reader");
        push(&tx, 0..3);
        drop(tx);
        assert_eq!(drain(&mut *r, 8), (vec![0, 1, 2], SourcePoll::Idle));
        push(&tx2, 3..5);
        drop(tx2);
        assert_eq!(drain(&mut *r, 8), (vec![3, 4], SourcePoll::Finished));
        let mut r = checkpointed(&src, 1, 2, 2, &[]).expect("a checkpointed reader");
        assert_eq!(drain(&mut *r, 8), (Vec::new(), SourcePoll::Finished));
    }
}
