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
    /// watermark is the largest timestamp seen minus `max_ms` minus one.
    pub fn bounded_out_of_orderness(
        max_ms: i64,
        timestamp: impl Fn(&T) -> i64 + Send + Sync + 'static,
    ) -> Self {
        Self {
            timestamp: Arc::new(timestamp),
            out_of_orderness_ms: max_ms.max(0),
            idle_timeout_ms: None,
            per_record: false,
        }
    }

    /// Declares the input idle after `ms` of processing time without records, so that it does
    /// not hold back the watermark of operators downstream.
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
        let op = WatermarkOp {
            ts: ts.clone(),
            delay,
            idle_timeout_ms: idle,
            max_ts: i64::MIN,
            emitted: i64::MIN,
            interval_ms: ctx.config.auto_watermark_interval_ms as i64,
            next_emit_ms: i64::MIN,
            last_record_ms: i64::MIN,
            now_ms: i64::MIN,
            idle: false,
            per_record,
            counters: ctx.metrics.operator(&name_of(&slot), ctx.shard),
            name: name_of(&slot),
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
        match ev {
            // Upstream watermarks are replaced by this operator's own; the final one passes.
            Event::Watermark(w) if w == i64::MAX => {
                self.emitted = i64::MAX;
                self.down.event(ev);
            }
            Event::Watermark(_) | Event::Idle(_) => {}
            // Watermarks are not checkpointed (as in Flink): after a restore they are generated
            // again from the replayed records, so a record is late only as it would have been.
            Event::LatencyMarker { .. } | Event::Barrier(_) => self.down.event(ev),
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
        if now_ms >= self.next_emit_ms {
            self.next_emit_ms = now_ms + self.interval_ms.max(1);
            self.emit_watermark();
        }
        if let Some(t) = self.idle_timeout_ms {
            if !self.idle && now_ms - self.last_record_ms >= t {
                self.idle = true;
                self.down.event(Event::Idle(true));
            }
        }
        self.down.processing_time(now_ms);
    }
}
