//! Event time: timestamp assignment and watermark strategies.

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
    /// not hold back the watermark of operators downstream. `ms` must be more than 0 (Flink's
    /// rule; 0 or less marked the input idle at once); else the job stops before it starts.
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
        // The generator's state: the largest timestamp seen, and the watermark it sent.
        let (max_ts, emitted) = restored_pair(ctx, &name)?;
        if let Some(c) = &ctx.checkpoint {
            c.borrow_mut().register();
        }
        let op = WatermarkOp {
            ts: ts.clone(),
            delay,
            idle_timeout_ms: idle,
            max_ts,
            emitted,
            resend: emitted != i64::MIN,
            checkpoint: ctx.checkpoint.clone(),
            interval_ms: ctx.config.auto_watermark_interval_ms as i64,
            next_emit_ms: i64::MIN,
            last_record_ms: i64::MIN,
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

/// Assigns timestamps and emits periodic watermarks, as Flink's periodic generators do: the
/// watermark is computed from the records, and emitted every `interval_ms` of processing time
/// and at the end of input.
pub(crate) struct WatermarkOp<T> {
    ts: Arc<dyn Fn(&T) -> i64 + Send + Sync>,
    delay: i64,
    idle_timeout_ms: Option<i64>,
    max_ts: i64,
    emitted: i64,
    /// A restored watermark not sent again yet: it goes downstream before anything else, so
    /// that records after a restore meet the watermark they met before it.
    resend: bool,
    checkpoint: Option<crate::checkpoint::shard::ShardCheckpointRef>,
    interval_ms: i64,
    next_emit_ms: i64,
    last_record_ms: i64,
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

    fn current(&self) -> i64 {
        if self.max_ts == i64::MIN {
            i64::MIN
        } else {
            self.max_ts.saturating_sub(self.delay).saturating_sub(1)
        }
    }

    fn emit_watermark(&mut self) {
        let w = self.current();
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
        if ts > self.max_ts {
            self.max_ts = ts;
        }
        self.last_record_ms = self.now_ms;
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
                let values = [self.max_ts, self.emitted];
                report_part(self.checkpoint.as_ref(), id, &self.name, &values);
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
        self.now_ms = now_ms;
        if self.last_record_ms == i64::MIN {
            self.last_record_ms = now_ms;
        }
        if let Some(t) = self.idle_timeout_ms {
            if !self.idle && now_ms - self.last_record_ms >= t {
                // The watermark of the records so far first, as Flink's periodic emit after
                // them sends it before its idleness check can find the input idle: held, the
                // windows it closes waited for the input to be active again.
                self.emit_watermark();
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

/// Reports `values` as operator `name`'s watermark part of checkpoint `id`: no part while they
/// are all `i64::MIN` (no timestamp seen, no watermark), which is what a restore assumes of a
/// missing one; a job without event time stores none.
fn report_part(
    checkpoint: Option<&crate::checkpoint::shard::ShardCheckpointRef>,
    id: u64,
    name: &str,
    values: &[i64],
) {
    let Some(c) = checkpoint else { return };
    let part = values
        .iter()
        .any(|&v| v != i64::MIN)
        .then(|| crate::checkpoint::snapshot::Part {
            operator: name.to_owned(),
            kind: crate::checkpoint::snapshot::PartKind::Watermark,
            bytes: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
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
    let w = if w == i64::MAX { i64::MIN } else { w };
    report_part(checkpoint, id, name, &[w]);
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

/// A watermark generator's restored largest timestamp and sent watermark.
fn restored_pair(ctx: &BuildCtx, name: &str) -> Result<(i64, i64), crate::StartError> {
    let [max_ts, emitted] = restored_values::<2>(ctx, name, false)?;
    Ok((max_ts, emitted))
}
