//! Event time: timestamp assignment and watermark strategies.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;

use crate::data::Data;
use crate::graph::{name_of, BuildCtx, Factory};
use crate::metrics::{bump, OperatorCounters};
use crate::operator::{Collector, Event, Out};
use crate::stream::Stream;

/// How a stream gets event timestamps and watermarks (Flink's WatermarkStrategy).
pub struct WatermarkStrategy<T> {
    pub(crate) timestamp: Arc<dyn Fn(&T) -> i64 + Send + Sync>,
    pub(crate) out_of_orderness_ms: i64,
    pub(crate) idle_timeout_ms: Option<i64>,
    pub(crate) per_record: bool,
}

impl<T> WatermarkStrategy<T> {
    /// Timestamps never decrease: the watermark follows the largest timestamp seen.
    pub fn monotonous(timestamp: impl Fn(&T) -> i64 + Send + Sync + 'static) -> Self {
        Self::bounded_out_of_orderness(0, timestamp)
    }

    /// Records arrive at most `max_ms` later than a record with a larger timestamp: the
    /// watermark is the largest timestamp seen minus `max_ms` minus one. A negative `max_ms`
    /// stops the job before it starts, as Flink refuses one (it was taken as 0 without a word).
    pub fn bounded_out_of_orderness(
        max_ms: i64,
        timestamp: impl Fn(&T) -> i64 + Send + Sync + 'static,
    ) -> Self {
        Self {
            timestamp: Arc::new(timestamp),
            out_of_orderness_ms: max_ms,
            idle_timeout_ms: None,
            per_record: false,
        }
    }

    /// Declares the input idle after `ms` of processing time without records, so that it does
    /// not hold back the watermark of operators downstream. Each source split (each input of
    /// a union before the assigner, each split a reader tells) goes idle on its own too, as in
    /// Flink: the watermark is the least of the splits not idle, so an open split that sends
    /// nothing stops holding it back, and its next records may be late. `ms` must be more
    /// than 0 (Flink's rule; 0 or less marked the input idle at once); else the job stops
    /// before it starts.
    pub fn with_idleness(mut self, ms: i64) -> Self {
        self.idle_timeout_ms = Some(ms);
        self
    }

    /// Emits the watermark after every record that advances it (Flink's punctuated
    /// generators), instead of periodically. Costs a control frame per advance; makes results
    /// independent of processing time.
    pub fn with_watermark_per_record(mut self) -> Self {
        self.per_record = true;
        self
    }
}

pub(crate) fn assign<T: Data>(up: Stream<T>, strategy: WatermarkStrategy<T>) -> Stream<T> {
    if strategy.out_of_orderness_ms < 0 {
        up.errors.borrow_mut().push(format!(
            "watermark strategy: the out-of-orderness bound must not be negative, got {} ms",
            strategy.out_of_orderness_ms
        ));
    }
    if let Some(ms) = strategy.idle_timeout_ms.filter(|ms| *ms <= 0) {
        up.errors.borrow_mut().push(format!(
            "watermark strategy: the idle timeout must be more than 0 ms, got {ms} ms"
        ));
    }
    let name = up.new_name("watermarks");
    let upf = up.factory.clone();
    let slot = name.clone();
    let ts = strategy.timestamp.clone();
    let (delay, idle, per_record) = (
        strategy.out_of_orderness_ms,
        strategy.idle_timeout_ms,
        strategy.per_record,
    );
    let factory: Factory<T> = Arc::new(move |ctx: &mut BuildCtx, down: Out<T>| {
        let name = name_of(&slot);
        // The generator's state: the largest timestamp seen (of each split), and the
        // watermark it sent.
        let restored = restored_generator(ctx, &name)?;
        if let Some(c) = &ctx.checkpoint {
            c.borrow_mut().register();
        }
        let tags = Rc::new(SplitTags::default());
        // The source heads of this chain, if nothing but record-by-record operators and
        // unions stand between, tell the splits through them (see `BuildCtx::split_tags`).
        ctx.split_tags.push(tags.clone());
        let emitted = restored.emitted;
        let op = WatermarkOp {
            ts: ts.clone(),
            delay,
            idle_timeout_ms: idle,
            splits: Vec::new(),
            cur: 0,
            tags,
            synced: NOT_SYNCED,
            stamp: NOT_SYNCED,
            restored,
            emitted,
            resend: emitted != i64::MIN,
            checkpoint: ctx.checkpoint.clone(),
            interval_ms: ctx.config.auto_watermark_interval_ms as i64,
            next_emit_ms: i64::MIN,
            timer: IdlenessTimer::NEW,
            now_ms: i64::MIN,
            idle: false,
            per_record,
            counters: ctx.metrics.operator(&name, ctx.shard),
            name,
            shard: ctx.shard,
            fail: ctx.fail.clone(),
            down,
        };
        upf(ctx, Box::new(op))
    });
    up.derive(factory, name)
}

/// Shared by a timestamp assigner and the heads that drive its chain (one, or one per input
/// of unions): each registers under a number and tells the split of the records it collects
/// ([`crate::source::SourceReader::splits`]; a reader that does not tell reads one, split `0`,
/// and so does an exchange head), and which splits it has not finished.
#[derive(Default)]
pub(crate) struct SplitTags {
    /// The source (its number) and split of the records a head collects now.
    current: Cell<(u32, u64)>,
    /// Bumped whenever `current` or `splits` changes: the one thing an assigner checks per
    /// record.
    stamp: Cell<u64>,
    /// Bumped whenever `splits` changes; 0 while no head published (the assigner's input is
    /// then one stream).
    version: Cell<u64>,
    /// The operator names of the registered sources, by number: what a checkpoint keys their
    /// splits by.
    sources: RefCell<Vec<String>>,
    /// The (source, split)s the assigner's watermark waits for: the readers' unfinished
    /// splits, and those of the records being collected.
    splits: RefCell<Vec<(u32, u64)>>,
}

impl SplitTags {
    /// Registers source `name`; returns its number.
    pub fn register(&self, name: &str) -> u32 {
        let mut sources = self.sources.borrow_mut();
        sources.push(name.to_owned());
        (sources.len() - 1) as u32
    }

    /// The records collected from now on are of split `split` of source `source`.
    #[inline]
    pub fn set_current(&self, source: u32, split: u64) {
        if self.current.get() != (source, split) {
            self.current.set((source, split));
            self.stamp.set(self.stamp.get() + 1);
        }
    }

    /// Sets source `source`'s splits to `live` and those of `runs`, if they are not those
    /// already.
    pub fn publish(&self, source: u32, live: &[u64], runs: &[(u64, usize)]) {
        let mut splits = self.splits.borrow_mut();
        let wanted = live.iter().chain(runs.iter().map(|r| &r.0));
        let same = self.version.get() != 0
            && wanted.clone().all(|&id| splits.contains(&(source, id)))
            && splits
                .iter()
                .filter(|s| s.0 == source)
                .all(|&(_, id)| live.contains(&id) || runs.iter().any(|r| r.0 == id));
        if same {
            return;
        }
        splits.retain(|s| s.0 != source);
        for &id in wanted {
            if !splits.contains(&(source, id)) {
                splits.push((source, id));
            }
        }
        self.version.set(self.version.get() + 1);
        self.stamp.set(self.stamp.get() + 1);
    }
}

/// [`WatermarkOp::synced`] before the first look at the tags.
const NOT_SYNCED: u64 = u64::MAX;

/// Flink's `IdlenessTimer`: an input is quiet once a whole timeout passed since the first
/// check that found no record since the one before. Stamping records with the time their
/// step began made a step longer than the timeout (a slow chain, a busy shard) look idle at
/// its end, and the other inputs' watermark made this one's next records late.
#[derive(Clone, Copy, Debug)]
struct IdlenessTimer {
    /// Records came since the last check.
    active: bool,
    /// The first check that found no record since the one before (`i64::MIN`: none yet).
    inactive_since_ms: i64,
}

impl IdlenessTimer {
    const NEW: Self = Self {
        active: false,
        inactive_since_ms: i64::MIN,
    };

    /// A check at `now_ms`: whether the input has been quiet for `timeout_ms`.
    fn quiet(&mut self, now_ms: i64, timeout_ms: i64) -> bool {
        if std::mem::take(&mut self.active) {
            self.inactive_since_ms = i64::MIN;
        } else if self.inactive_since_ms == i64::MIN {
            self.inactive_since_ms = now_ms;
        }
        self.inactive_since_ms != i64::MIN
            && now_ms.saturating_sub(self.inactive_since_ms) >= timeout_ms
    }
}

/// A split the watermark waits for (one, `(0, 0)`, when the input is one stream).
#[derive(Clone, Copy, Debug)]
struct Split {
    /// (source, split), as the tags tell it.
    key: (u32, u64),
    /// The largest timestamp seen.
    max_ts: i64,
    /// Its own idleness, as Flink's per-split `WatermarksWithIdleness`: one open split that
    /// sends nothing would otherwise hold the watermark back for good.
    timer: IdlenessTimer,
    /// Quiet for the idle timeout: left out of the watermark until its next record. Not
    /// checkpointed, as in Flink.
    idle: bool,
}

impl Split {
    fn new(key: (u32, u64), max_ts: i64) -> Self {
        Self {
            key,
            max_ts,
            timer: IdlenessTimer::NEW,
            idle: false,
        }
    }
}

/// Assigns timestamps and emits periodic watermarks, as Flink's periodic generators do: the
/// watermark is computed from the records, and emitted every `interval_ms` of processing time
/// and at the end of input. When the source heads of its chain tell the records' splits, the
/// largest timestamp is tracked per split and the watermark follows the least of them, as
/// Flink's per-split watermarks in sources: a reader that a restore onto fewer shards gave
/// several old readers' splits reads them one after another, and a watermark that followed
/// the first made the records of the others, on time before, late. With an idle timeout each
/// split has its own, as Flink wraps each split's generator: the watermark is the least of
/// the splits not idle, and the operator is idle (`Idle(true)`) when no split sent records.
pub(crate) struct WatermarkOp<T> {
    ts: Arc<dyn Fn(&T) -> i64 + Send + Sync>,
    delay: i64,
    idle_timeout_ms: Option<i64>,
    /// Each (source, split) the watermark waits for.
    splits: Vec<Split>,
    /// The entry of the split of the last record.
    cur: usize,
    tags: Rc<SplitTags>,
    /// The tags' version that `splits` follows.
    synced: u64,
    /// The tags' stamp that `splits` and `cur` follow.
    stamp: u64,
    /// What the restore gave: taken when the splits are first known.
    restored: RestoredGenerator,
    emitted: i64,
    /// A restored watermark not sent again yet: it goes downstream before anything else, so
    /// that records after a restore meet the watermark they met before it.
    resend: bool,
    checkpoint: Option<crate::checkpoint::shard::ShardCheckpointRef>,
    interval_ms: i64,
    next_emit_ms: i64,
    /// The whole input's idleness: no record of any split.
    timer: IdlenessTimer,
    now_ms: i64,
    idle: bool,
    per_record: bool,
    counters: Arc<OperatorCounters>,
    name: String,
    shard: usize,
    fail: crate::graph::FailCell,
    down: Out<T>,
}

impl<T: 'static> WatermarkOp<T> {
    /// Sends the restored watermark, once, before the first record or event after a restore.
    #[inline]
    fn resend_restored(&mut self) {
        if self.resend {
            self.resend = false;
            self.down.event(Event::Watermark(self.emitted));
        }
    }

    /// Follows the splits the source head published, if they changed.
    #[inline]
    fn sync(&mut self) {
        let version = self.tags.version.get();
        if version != self.synced {
            self.resync(version);
        }
    }

    #[cold]
    fn resync(&mut self, version: u64) {
        if version == 0 {
            // One stream: its largest timestamp is the least of the old shards' it takes.
            self.splits = vec![Split::new((0, 0), self.restored.max_ts)];
        } else {
            // A split kept keeps its idleness too: one that stayed quiet stays left out.
            let splits: Vec<Split> = self
                .tags
                .splits
                .borrow()
                .iter()
                .map(|&key| match self.splits.iter().find(|s| s.key == key) {
                    Some(s) => *s,
                    None => Split::new(key, self.known(key)),
                })
                .collect();
            self.splits = splits;
        }
        self.synced = version;
        self.cur = 0;
        // `cur` is found again before the next record counts.
        self.stamp = NOT_SYNCED;
    }

    /// The largest timestamp of split `key` so far: this run's, else the restored one, else
    /// none (`i64::MIN`).
    fn known(&self, key: (u32, u64)) -> i64 {
        if let Some(s) = self.splits.iter().find(|s| s.key == key) {
            return s.max_ts;
        }
        let sources = self.tags.sources.borrow();
        let Some(source) = sources.get(key.0 as usize) else {
            return i64::MIN;
        };
        self.restored
            .splits
            .iter()
            .find(|r| r.0 == *source && r.1 == key.1)
            .map_or(i64::MIN, |r| r.2)
    }

    /// Follows the tags after they changed: the splits, and the entry of the current one.
    #[cold]
    fn follow(&mut self) {
        self.sync();
        let key = self.tags.current.get();
        if self.splits.get(self.cur).is_none_or(|s| s.key != key) {
            self.cur = match self.splits.iter().position(|s| s.key == key) {
                Some(i) => i,
                // Not published (a head always publishes before it collects): added.
                None => {
                    self.splits.push(Split::new(key, self.known(key)));
                    self.splits.len() - 1
                }
            };
        }
        self.stamp = self.tags.stamp.get();
    }

    /// The least of the largest timestamps of the splits not idle (`i64::MIN` while one has
    /// none, or when there is no split left to wait for: the end of input sends the last
    /// watermark; or when every split is idle: the watermark stays where it is).
    fn max_ts(&self) -> i64 {
        self.splits
            .iter()
            .filter(|s| !s.idle)
            .map(|s| s.max_ts)
            .min()
            .unwrap_or(i64::MIN)
    }

    /// The least of every split's largest timestamp, idle or not: what a checkpoint stores
    /// (idleness is not checkpointed).
    fn max_ts_all(&self) -> i64 {
        self.splits
            .iter()
            .map(|s| s.max_ts)
            .min()
            .unwrap_or(i64::MIN)
    }

    fn current(&self) -> i64 {
        let max_ts = self.max_ts();
        if max_ts == i64::MIN {
            i64::MIN
        } else {
            max_ts.saturating_sub(self.delay).saturating_sub(1)
        }
    }

    fn emit_watermark(&mut self) {
        self.send(self.current());
    }

    fn send(&mut self, w: i64) {
        if w > self.emitted {
            self.emitted = w;
            self.down.event(Event::Watermark(w));
        }
    }
}

impl<T: 'static> Collector<T> for WatermarkOp<T> {
    #[inline]
    fn collect(&mut self, rec: T, _ts: i64) {
        self.resend_restored();
        bump(&self.counters.records_in, 1);
        let ts = (self.ts)(&rec);
        if ts == crate::operator::NO_TS {
            // Downstream it would read as a record without a timestamp (and an event-time
            // window would blame the job's wiring instead of the record).
            self.fail.fail(crate::JobError::Operator {
                operator: self.name.clone(),
                shard: self.shard,
                message: format!(
                    "the timestamp assigner returned {}, which marks a record without a \
                     timestamp; event timestamps are {} to {} ms",
                    i64::MIN,
                    i64::MIN + 1,
                    i64::MAX
                ),
            });
            return;
        }
        if self.tags.stamp.get() != self.stamp {
            self.follow();
        }
        let split = &mut self.splits[self.cur];
        if ts > split.max_ts {
            split.max_ts = ts;
        }
        split.timer.active = true;
        // Back in the watermark, which it may be behind: its records are then late, as in
        // Flink.
        split.idle = false;
        self.timer.active = true;
        if self.idle {
            self.idle = false;
            self.down.event(Event::Idle(false));
        }
        bump(&self.counters.records_out, 1);
        self.down.collect(rec, ts);
        if self.per_record {
            self.emit_watermark();
        }
    }

    fn event(&mut self, ev: Event) {
        self.resend_restored();
        self.sync();
        match ev {
            // Upstream watermarks are replaced by this operator's own; the final one passes.
            Event::Watermark(w) if w == i64::MAX => {
                self.emitted = i64::MAX;
                self.down.event(ev);
            }
            Event::Watermark(_) | Event::Idle(_) => {}
            // The generator's state goes into the checkpoint (unlike Flink, which starts
            // watermarks over after a restore): records after a restore are late exactly when
            // they were before, and the issue restores watermarks with the rest.
            Event::Barrier(id) => {
                let bytes = self.encode();
                report_bytes(self.checkpoint.as_ref(), id, &self.name, bytes);
                self.down.event(ev);
            }
            Event::LatencyMarker { .. } => self.down.event(ev),
            Event::EndOfInput => {
                self.emit_watermark();
                self.down.event(ev);
            }
        }
    }

    fn processing_time(&mut self, now_ms: i64) {
        if now_ms == self.now_ms {
            return;
        }
        self.sync();
        self.now_ms = now_ms;
        if let Some(t) = self.idle_timeout_ms {
            // The watermark of the records so far, before any split is left out of it.
            let before = self.current();
            // Each split's timer, as Flink's per-split `WatermarksWithIdleness`: a split left
            // out no longer holds the others back.
            let mut split_went_idle = false;
            for s in &mut self.splits {
                if s.timer.quiet(now_ms, t) && !s.idle {
                    s.idle = true;
                    split_went_idle = true;
                }
            }
            // The whole input's (every split quiet): `Idle(true)` downstream.
            let quiet = self.timer.quiet(now_ms, t);
            if !self.idle && (quiet || split_went_idle) {
                // The watermark of the records so far first, as Flink's periodic emit after
                // them sends it before its idleness check can find the input idle: held, the
                // windows it closes waited for the input to be active again. With splits left
                // out it can only be later, unless none is left (then `before` stands).
                let after = self.current();
                self.send(before.max(after));
            }
            if !self.idle && quiet {
                self.idle = true;
                self.down.event(Event::Idle(true));
            }
        }
        // An idle input sends no periodic watermark, as Flink's `WatermarksWithIdleness`:
        // downstream a watermark is the input turning active again, and one sent after the
        // idle mark (an idle timeout shorter than the interval) made it active for good,
        // holding every other input back.
        if now_ms >= self.next_emit_ms {
            self.next_emit_ms = now_ms + self.interval_ms.max(1);
            if !self.idle {
                self.emit_watermark();
            }
        }
        self.down.processing_time(now_ms);
    }
}

impl<T: 'static> WatermarkOp<T> {
    /// The checkpoint part: `largest timestamp i64 | watermark sent i64`, then, unless the
    /// input is one stream, per source `name length u32 | name | splits u32 | splits x (split
    /// u64 | its largest timestamp i64)`: the splits move to other shards with the sources'
    /// positions. None while every timestamp is `i64::MIN` (see [`report_bytes`]).
    fn encode(&self) -> Option<Vec<u8>> {
        // The end of every input (`i64::MAX`, passed on from the sources) is stored as no
        // watermark, as a keyed operator's is: a restore of it finds the same inputs at their
        // end, which send it again, while an input the restored job added (or a source whose
        // position it does not take) starts over, and met an end-of-input watermark that
        // dropped all its records as late.
        let emitted = if self.emitted == i64::MAX {
            i64::MIN
        } else {
            self.emitted
        };
        let seen = emitted != i64::MIN || self.splits.iter().any(|s| s.max_ts != i64::MIN);
        if !seen {
            return None;
        }
        let mut b = Vec::with_capacity(16 + 32 * self.splits.len());
        b.extend_from_slice(&self.max_ts_all().to_le_bytes());
        b.extend_from_slice(&emitted.to_le_bytes());
        if self.synced != 0 {
            for (n, source) in self.tags.sources.borrow().iter().enumerate() {
                let mine = || self.splits.iter().filter(|s| s.key.0 == n as u32);
                let count = mine().count();
                if count == 0 {
                    continue;
                }
                b.extend_from_slice(&(source.len() as u32).to_le_bytes());
                b.extend_from_slice(source.as_bytes());
                b.extend_from_slice(&(count as u32).to_le_bytes());
                for s in mine() {
                    b.extend_from_slice(&s.key.1.to_le_bytes());
                    b.extend_from_slice(&s.max_ts.to_le_bytes());
                }
            }
        }
        Some(b)
    }
}

/// Reports `bytes` as operator `name`'s watermark part of checkpoint `id`. None while nothing
/// was seen (every timestamp and watermark `i64::MIN`) is what a restore assumes of a missing
/// part; a job without event time stores none.
fn report_bytes(
    checkpoint: Option<&crate::checkpoint::shard::ShardCheckpointRef>,
    id: u64,
    name: &str,
    bytes: Option<Vec<u8>>,
) {
    let Some(c) = checkpoint else { return };
    let part = bytes.map(|bytes| crate::checkpoint::snapshot::Part {
        operator: name.to_owned(),
        kind: crate::checkpoint::snapshot::PartKind::Watermark,
        bytes,
        files: Vec::new(),
        logical: Vec::new(),
    });
    c.borrow_mut().report_maybe(id, part, 0);
}

/// Reports a keyed operator's watermark `w` as its watermark part of checkpoint `id`. The end
/// of every input (`i64::MAX`, which a job without event time sees too) is stored as no part,
/// as no watermark is: a restore of it finds its inputs at their end, and they send it again
/// before anything else reaches the operator.
pub(crate) fn report_watermark(
    checkpoint: Option<&crate::checkpoint::shard::ShardCheckpointRef>,
    id: u64,
    name: &str,
    w: i64,
) {
    let bytes = (w != i64::MAX && w != i64::MIN).then(|| w.to_le_bytes().to_vec());
    report_bytes(checkpoint, id, name, bytes);
}

/// The `i64`s of operator `name`'s watermark parts that this shard takes over in a restore,
/// element by element the least of them: after a rescale a shard's watermark is no further
/// than that of any old shard whose input it takes, so a record on time before is on time
/// after. A watermark generator's input is its source's splits, which go from old shard `s`
/// to new shard `s % shards`; a keyed operator's is its key groups, which come from every old
/// shard whose range meets the new one's (`keyed`). Before, keyed operators took the first
/// rule too: a new shard holding key groups of an old shard whose watermark it did not take
/// could start ahead of that shard, and dropped its replayed records as late. All `i64::MIN`
/// (nothing seen) when the checkpoint holds none: one taken before watermarks were
/// checkpointed, or a shard a scale-up added.
fn restored_values<const N: usize>(
    ctx: &BuildCtx,
    name: &str,
    keyed: bool,
) -> Result<[i64; N], crate::StartError> {
    match &ctx.restore {
        Some(r) => restored_values_from(r, ctx.shard, ctx.config.max_parallelism, name, keyed),
        None => Ok([i64::MIN; N]),
    }
}

/// [`restored_values`] of restore `r` for shard `shard`.
pub(crate) fn restored_values_from<const N: usize>(
    r: &crate::checkpoint::restore::RestoreState,
    shard: usize,
    max_parallelism: u16,
    name: &str,
    keyed: bool,
) -> Result<[i64; N], crate::StartError> {
    let mut out = [i64::MIN; N];
    let kind = crate::checkpoint::snapshot::PartKind::Watermark;
    let (parts, taken) = if keyed {
        (
            r.parts_for_key_groups(name, kind, shard, max_parallelism),
            r.old_shards_for_key_groups(shard, max_parallelism),
        )
    } else {
        (
            r.parts_for_shard(name, kind, shard),
            r.old_shards_for_shard(shard),
        )
    };
    if parts.len() < taken {
        // An old shard whose input this one takes had no part: it had seen nothing, its
        // values all `i64::MIN`, and so is the least of them. Taking the least of the parts
        // alone started the shard at another old shard's watermark, and after a scale-down
        // the first shard's records, not yet read, were dropped as late.
        return Ok(out);
    }
    for (k, p) in parts.iter().enumerate() {
        let values: Option<Vec<i64>> = (p.bytes.len() == 8 * N).then(|| {
            p.bytes
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect()
        });
        let Some(values) = values else {
            return Err(crate::StartError::Restore {
                reason: format!(
                    "checkpoint {}: watermark of `{name}`: {} bytes, expected {}",
                    r.checkpoint_id,
                    p.bytes.len(),
                    8 * N
                ),
            });
        };
        for (o, v) in out.iter_mut().zip(values) {
            *o = if k == 0 { v } else { (*o).min(v) };
        }
    }
    Ok(out)
}

/// A keyed operator's restored watermark (see [`restored_values`]).
pub(crate) fn restored_watermark(ctx: &BuildCtx, name: &str) -> Result<i64, crate::StartError> {
    Ok(restored_values::<1>(ctx, name, true)?[0])
}

/// What a watermark generator takes over in a restore.
#[derive(Debug, PartialEq)]
pub(crate) struct RestoredGenerator {
    /// The least of the old shards' largest timestamps (each the least of its splits').
    pub max_ts: i64,
    /// The least of the watermarks they sent.
    pub emitted: i64,
    /// The largest timestamp of each split their sources told: source name, split; sorted,
    /// each split once.
    pub splits: Vec<(String, u64, i64)>,
}

/// A watermark generator's restored state (see [`restored_values`] for which old shards'):
/// none, all `i64::MIN`, without a restore.
fn restored_generator(ctx: &BuildCtx, name: &str) -> Result<RestoredGenerator, crate::StartError> {
    match &ctx.restore {
        Some(r) => restored_generator_from(r, ctx.shard, name),
        None => Ok(RestoredGenerator {
            max_ts: i64::MIN,
            emitted: i64::MIN,
            splits: Vec::new(),
        }),
    }
}

/// [`restored_generator`] of restore `r` for shard `shard`, from parts as
/// [`WatermarkOp::encode`] writes them. A part that does not decode is an error naming the
/// checkpoint, the operator and the byte.
pub(crate) fn restored_generator_from(
    r: &crate::checkpoint::restore::RestoreState,
    shard: usize,
    name: &str,
) -> Result<RestoredGenerator, crate::StartError> {
    let kind = crate::checkpoint::snapshot::PartKind::Watermark;
    let parts = r.parts_for_shard(name, kind, shard);
    let mut out = RestoredGenerator {
        max_ts: i64::MIN,
        emitted: i64::MIN,
        splits: Vec::new(),
    };
    for (k, p) in parts.iter().enumerate() {
        let bad = |at: usize, what: &str| crate::StartError::Restore {
            reason: format!(
                "checkpoint {}: watermark of `{name}`, byte {at} of {}: {what}",
                r.checkpoint_id,
                p.bytes.len()
            ),
        };
        let b = &p.bytes;
        let take = |at: usize, n: usize| b.get(at..at.saturating_add(n));
        let u32_at = |at: usize| take(at, 4).map(|x| u32::from_le_bytes(x.try_into().expect("4")));
        let i64_at = |at: usize| take(at, 8).map(|x| i64::from_le_bytes(x.try_into().expect("8")));
        let (Some(max_ts), Some(emitted)) = (i64_at(0), i64_at(8)) else {
            return Err(bad(0, "shorter than its 16-byte head"));
        };
        if k == 0 {
            (out.max_ts, out.emitted) = (max_ts, emitted);
        } else {
            out.max_ts = out.max_ts.min(max_ts);
            out.emitted = out.emitted.min(emitted);
        }
        let mut at = 16;
        while at < b.len() {
            let len = u32_at(at).ok_or_else(|| bad(at, "a source name's length is cut"))?;
            let source = take(at + 4, len as usize)
                .ok_or_else(|| bad(at, "a source name is cut"))
                .and_then(|x| {
                    std::str::from_utf8(x).map_err(|_| bad(at + 4, "a source name is not UTF-8"))
                })?;
            at += 4 + len as usize;
            let count = u32_at(at).ok_or_else(|| bad(at, "a split count is cut"))? as usize;
            // A count from the bytes sizes nothing before the bytes are there.
            if (b.len() - at - 4) / 16 < count {
                return Err(bad(at, "fewer bytes than the splits it counts"));
            }
            at += 4;
            for _ in 0..count {
                let (split, max_ts) = (
                    i64_at(at).expect("counted") as u64,
                    i64_at(at + 8).expect("counted"),
                );
                at += 16;
                out.splits.push((source.to_owned(), split, max_ts));
            }
        }
    }
    // A split is read on one shard; were it in two parts, the lesser is the safe one. Sorted
    // first: a forged part of millions of entries costs a sort, not a search per entry.
    out.splits.sort_unstable();
    out.splits.dedup_by(|later, kept| {
        let same = later.0 == kept.0 && later.1 == kept.1;
        if same {
            kept.2 = kept.2.min(later.2);
        }
        same
    });
    if parts.len() < r.old_shards_for_shard(shard) {
        // An old shard whose input this one takes had no part: it had seen nothing (see
        // `restored_values_from`). Its splits, unknown here, start with nothing seen too.
        out.max_ts = i64::MIN;
        out.emitted = i64::MIN;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::operator::NO_TS;

    /// Keeps the events that reach it.
    #[derive(Clone, Default)]
    struct Sink(Rc<RefCell<Vec<Event>>>);

    impl Collector<i64> for Sink {
        fn collect(&mut self, _rec: i64, _ts: i64) {}
        fn event(&mut self, ev: Event) {
            self.0.borrow_mut().push(ev);
        }
        fn processing_time(&mut self, _now_ms: i64) {}
    }

    /// An assigner of `i64` timestamps (the records themselves) after a head that publishes
    /// splits 1 and 2 of one source, as a union of two inputs would.
    fn op(idle_timeout_ms: Option<i64>) -> (WatermarkOp<i64>, Rc<SplitTags>, Sink) {
        let tags = Rc::new(SplitTags::default());
        let source = tags.register("src");
        tags.publish(source, &[1, 2], &[]);
        let sink = Sink::default();
        let op = WatermarkOp {
            ts: Arc::new(|r: &i64| *r),
            delay: 0,
            idle_timeout_ms,
            splits: Vec::new(),
            cur: 0,
            tags: tags.clone(),
            synced: NOT_SYNCED,
            stamp: NOT_SYNCED,
            restored: RestoredGenerator {
                max_ts: i64::MIN,
                emitted: i64::MIN,
                splits: Vec::new(),
            },
            emitted: i64::MIN,
            resend: false,
            checkpoint: None,
            interval_ms: 200,
            next_emit_ms: i64::MIN,
            timer: IdlenessTimer::NEW,
            now_ms: i64::MIN,
            idle: false,
            per_record: true,
            counters: Arc::new(OperatorCounters::default()),
            name: "watermarks".into(),
            shard: 0,
            fail: crate::graph::FailCell::default(),
            down: Box::new(sink.clone()),
        };
        (op, tags, sink)
    }

    fn events(sink: &Sink) -> Vec<Event> {
        std::mem::take(&mut *sink.0.borrow_mut())
    }

    /// Split 2 is open and never sends: with an idle timeout it is left out of the watermark
    /// once quiet for the timeout, and split 1's records move it; a record on split 2 brings
    /// it back (behind: the watermark does not go back).
    #[test]
    fn a_quiet_split_is_left_out_once_idle() {
        let (mut op, tags, sink) = op(Some(100));
        op.processing_time(1_000);
        tags.set_current(0, 1);
        op.collect(50, NO_TS);
        op.processing_time(1_050);
        assert_eq!(
            events(&sink),
            vec![],
            "split 2 holds the watermark at nothing"
        );
        // Split 2's first quiet check was at 1 000: idle at 1 100. Split 1 had a record since
        // the check at 1 000, so it is not.
        op.processing_time(1_100);
        assert_eq!(events(&sink), vec![Event::Watermark(49)]);
        tags.set_current(0, 1);
        op.collect(150, NO_TS);
        assert_eq!(events(&sink), vec![Event::Watermark(149)]);
        // Split 2 comes back, behind: it holds the watermark again, which stays.
        tags.set_current(0, 2);
        op.collect(120, NO_TS);
        tags.set_current(0, 1);
        op.collect(200, NO_TS);
        assert_eq!(events(&sink), vec![]);
        tags.set_current(0, 2);
        op.collect(180, NO_TS);
        assert_eq!(events(&sink), vec![Event::Watermark(179)]);
        // Every split quiet (from the check at 1 300): the operator goes idle once, as before,
        // and a record makes it active again.
        op.processing_time(1_200);
        op.processing_time(1_300);
        assert_eq!(events(&sink), vec![]);
        op.processing_time(1_400);
        op.processing_time(1_500);
        assert_eq!(events(&sink), vec![Event::Idle(true)]);
        tags.set_current(0, 1);
        op.collect(300, NO_TS);
        assert_eq!(
            events(&sink),
            vec![Event::Idle(false), Event::Watermark(299)]
        );
    }

    /// Without an idle timeout a quiet split holds the watermark, however long.
    #[test]
    fn without_idleness_a_quiet_split_holds_the_watermark() {
        let (mut op, tags, sink) = op(None);
        tags.set_current(0, 1);
        for t in 0..50 {
            op.collect(t * 10, NO_TS);
            op.processing_time(1_000 + t * 100);
        }
        assert_eq!(events(&sink), vec![]);
        op.event(Event::EndOfInput);
        assert_eq!(events(&sink), vec![Event::EndOfInput]);
    }

    /// A split that stays published keeps its idleness when the splits change; one that
    /// is published anew starts active, and holds the watermark until it is quiet too.
    #[test]
    fn idleness_follows_the_splits_by_key() {
        let (mut op, tags, sink) = op(Some(100));
        op.processing_time(1_000);
        tags.set_current(0, 1);
        op.collect(50, NO_TS);
        op.processing_time(1_100);
        assert_eq!(events(&sink), vec![Event::Watermark(49)]);
        // Split 3 joins; 2 stays idle, 3 holds the watermark at nothing.
        tags.publish(0, &[1, 2, 3], &[]);
        tags.set_current(0, 1);
        op.collect(80, NO_TS);
        assert_eq!(events(&sink), vec![]);
        assert!(op.splits.iter().any(|s| s.key == (0, 2) && s.idle));
        op.processing_time(1_150);
        op.collect(90, NO_TS);
        op.processing_time(1_250);
        assert_eq!(events(&sink), vec![Event::Watermark(89)]);
        // The checkpoint part is as without idleness: the least of every split's.
        let b = op.encode().expect("seen");
        assert_eq!(i64::from_le_bytes(b[..8].try_into().unwrap()), i64::MIN);
    }
}
