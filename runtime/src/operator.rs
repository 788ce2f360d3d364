//! The push interface between chained operators, and the stateless operators.
//!
//! Operators on one shard are chained as plain calls: each holds its downstream as a boxed
//! [`Collector`] and calls it directly. A record carries an event timestamp (or [`NO_TS`]).
//! Control events (watermarks, latency markers, end of input) flow through the same chain.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use crate::metrics::{bump, OperatorCounters};

/// The timestamp of a record that has none.
pub const NO_TS: i64 = i64::MIN;

/// A control event that flows through a chain in order with the records.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// No record with a timestamp at or below this will follow (except late ones).
    Watermark(i64),
    /// The input went idle (true) or active again (false): an idle input does not hold back
    /// the watermark of an operator with several inputs.
    Idle(bool),
    /// Emitted by a source at `created_ns` (monotonic, process-wide); sinks record its age.
    LatencyMarker { created_ns: u64 },
    /// Checkpoint barrier `n`: everything before it belongs to checkpoint `n`.
    Barrier(u64),
    /// The input has ended; nothing follows.
    EndOfInput,
}

/// The downstream end of an operator: where it pushes records and events.
pub(crate) trait Collector<T>: 'static {
    fn collect(&mut self, rec: T, ts: i64);
    /// True if this collector uses [`Self::hint`]; asked once, when the chain starts.
    fn wants_hints(&self) -> bool {
        false
    }
    /// `rec` will be collected a few records from now: start loading what it will touch (a
    /// keyed operator prefetches its state), so that cache misses of consecutive records
    /// overlap. Only called when [`Self::wants_hints`] said so.
    fn hint(&mut self, _rec: &T) {}
    fn event(&mut self, ev: Event);
    /// Processing time advanced to `now_ms`. Operators with processing-time timers fire them.
    fn processing_time(&mut self, now_ms: i64);
}

pub(crate) type Out<T> = Box<dyn Collector<T>>;

/// Counts records that pass an edge into an operator (its `records_in`) and out of it.
pub(crate) struct Counted<T> {
    pub counters: Arc<OperatorCounters>,
    pub down: Out<T>,
}

impl<T: 'static> Collector<T> for Counted<T> {
    #[inline]
    fn collect(&mut self, rec: T, ts: i64) {
        bump(&self.counters.records_out, 1);
        self.down.collect(rec, ts);
    }
    fn wants_hints(&self) -> bool {
        self.down.wants_hints()
    }
    #[inline]
    fn hint(&mut self, rec: &T) {
        self.down.hint(rec);
    }
    fn event(&mut self, ev: Event) {
        self.down.event(ev);
    }
    fn processing_time(&mut self, now_ms: i64) {
        self.down.processing_time(now_ms);
    }
}

#[inline]
pub(crate) fn count_in(c: &AtomicU64) {
    bump(c, 1);
}

/// A stateless one-to-many operator: map, filter, flat_map, filter_map and inspect are all
/// this with a different function (the compiler specializes each).
pub(crate) struct FlatMapOp<T, U, F> {
    pub f: F,
    pub counters: Arc<OperatorCounters>,
    pub down: Out<U>,
    pub _t: std::marker::PhantomData<fn(T)>,
}

/// Emits the outputs of one input record.
pub(crate) struct Emit<'a, U> {
    down: &'a mut Out<U>,
    ts: i64,
    n: u64,
}

impl<U: 'static> Emit<'_, U> {
    #[inline]
    pub fn emit(&mut self, v: U) {
        self.n += 1;
        self.down.collect(v, self.ts);
    }
}

impl<T: 'static, U: 'static, F: FnMut(T, &mut Emit<'_, U>) + 'static> Collector<T>
    for FlatMapOp<T, U, F>
{
    #[inline]
    fn collect(&mut self, rec: T, ts: i64) {
        count_in(&self.counters.records_in);
        let mut e = Emit {
            down: &mut self.down,
            ts,
            n: 0,
        };
        (self.f)(rec, &mut e);
        let n = e.n;
        bump(&self.counters.records_out, n);
    }
    fn event(&mut self, ev: Event) {
        self.down.event(ev);
    }
    fn processing_time(&mut self, now_ms: i64) {
        self.down.processing_time(now_ms);
    }
}

/// Combines several inputs on one shard: forwards the minimum watermark of the active,
/// aligned inputs, and end of input once every input ended. This is Flink's
/// `StatusWatermarkValve`.
pub(crate) struct InputMerger {
    watermarks: Vec<i64>,
    idle: Vec<bool>,
    /// Per input: its watermark counts towards the minimum. An input that goes idle stops
    /// counting; one that turns active again counts only once its watermark has caught up with
    /// the one forwarded, so that a source resuming behind does not hold back the inputs that
    /// went on (the records it sends meanwhile are late, as in Flink).
    aligned: Vec<bool>,
    ended: Vec<bool>,
    emitted: i64,
    /// Every input is idle, and downstream was told so (`Event::Idle(true)`), as Flink's
    /// valve marks its output idle: without it a consumer of several shards held its
    /// watermark back for a shard whose sources were all quiet.
    idle_out: bool,
    /// The barrier being aligned and the inputs that delivered it.
    barrier: Option<(u64, Vec<bool>)>,
    /// Per input: delivered the barrier being aligned and must not deliver more records until
    /// it is complete (aligned checkpoints only).
    pub blocked: Vec<std::rc::Rc<std::cell::Cell<bool>>>,
    /// Block inputs that delivered the barrier (exactly once) or not (at least once).
    pub align: bool,
    /// The newest barrier forwarded or abandoned: older ones are stale.
    last_barrier: u64,
}

impl InputMerger {
    pub fn new(inputs: usize) -> Self {
        Self {
            watermarks: vec![i64::MIN; inputs],
            idle: vec![false; inputs],
            aligned: vec![true; inputs],
            ended: vec![false; inputs],
            emitted: i64::MIN,
            idle_out: false,
            barrier: None,
            blocked: (0..inputs)
                .map(|_| std::rc::Rc::new(std::cell::Cell::new(false)))
                .collect(),
            align: true,
            last_barrier: 0,
        }
    }

    /// Whether input `i` must wait for the other inputs' barrier.
    pub fn is_blocked(&self, i: usize) -> bool {
        self.blocked[i].get()
    }

    /// Input `i` delivered barrier `id`: forwards it once every input that has not ended did.
    fn on_barrier(&mut self, i: usize, id: u64, out: &mut dyn FnMut(Event)) {
        if id <= self.last_barrier {
            return;
        }
        match &self.barrier {
            // A stale barrier of a checkpoint this operator already passed or abandoned.
            Some((cur, _)) if id < *cur => return,
            // A newer barrier while aligning an older one: the older checkpoint can no longer
            // complete here (its barrier was skipped upstream); align the newer one instead.
            Some((cur, _)) if id > *cur => self.release(),
            _ => {}
        }
        let n = self.ended.len();
        let arrived = &mut self.barrier.get_or_insert_with(|| (id, vec![false; n])).1;
        arrived[i] = true;
        if self.align {
            self.blocked[i].set(true);
        }
        self.maybe_forward(out);
    }

    fn maybe_forward(&mut self, out: &mut dyn FnMut(Event)) {
        let done = match &self.barrier {
            Some((_, arrived)) => arrived.iter().zip(&self.ended).all(|(a, e)| *a || *e),
            None => false,
        };
        if done {
            if let Some((id, _)) = self.barrier {
                self.release();
                out(Event::Barrier(id));
            }
        }
    }

    /// The barrier being aligned, if any.
    pub fn aligning(&self) -> Option<u64> {
        self.barrier.as_ref().map(|(id, _)| *id)
    }

    /// Barrier `id` is taken unaligned instead: stops aligning it (and anything older) and
    /// returns which inputs had delivered it. Its in-band barriers are ignored from now on.
    pub fn abandon(&mut self, id: u64) -> Vec<bool> {
        let n = self.ended.len();
        let arrived = match &self.barrier {
            Some((cur, arrived)) if *cur == id => arrived.clone(),
            _ => vec![false; n],
        };
        if self.barrier.as_ref().is_some_and(|(cur, _)| *cur <= id) {
            self.release();
        }
        self.last_barrier = self.last_barrier.max(id);
        arrived
            .iter()
            .zip(&self.ended)
            .map(|(a, e)| *a || *e)
            .collect()
    }

    fn release(&mut self) {
        if let Some((id, _)) = &self.barrier {
            self.last_barrier = self.last_barrier.max(*id);
        }
        self.barrier = None;
        for b in &self.blocked {
            b.set(false);
        }
    }

    /// Takes an event of input `i`; returns the events to forward, in order.
    pub fn on_event(&mut self, i: usize, ev: Event, out: &mut dyn FnMut(Event)) {
        match ev {
            Event::Watermark(w) => {
                // A watermark from an idle input is its return to activity (what a source
                // sends when it resumes).
                self.set_idle(i, false);
                if w > self.watermarks[i] {
                    self.watermarks[i] = w;
                }
                if w >= self.emitted {
                    self.aligned[i] = true;
                }
                self.advance(out);
            }
            Event::Idle(idle) => {
                self.set_idle(i, idle);
                self.advance(out);
            }
            Event::LatencyMarker { .. } => out(ev),
            Event::Barrier(id) => self.on_barrier(i, id, out),
            Event::EndOfInput => {
                self.ended[i] = true;
                self.watermarks[i] = i64::MAX;
                self.idle[i] = false;
                self.aligned[i] = true;
                self.advance(out);
                // An ended input no longer holds back a barrier.
                self.maybe_forward(out);
                if self.ended.iter().all(|e| *e) {
                    out(Event::EndOfInput);
                }
            }
        }
    }

    /// Input `i` turns idle (and stops counting towards the watermark) or active (counting
    /// again at once only if its watermark is not behind the one forwarded).
    fn set_idle(&mut self, i: usize, idle: bool) {
        if idle == self.idle[i] {
            return;
        }
        self.idle[i] = idle;
        self.aligned[i] = !idle && self.watermarks[i] >= self.emitted;
    }

    fn advance(&mut self, out: &mut dyn FnMut(Event)) {
        let all_idle = self.idle.iter().all(|i| *i);
        if !all_idle && self.idle_out {
            // Active again before any watermark it sends.
            self.idle_out = false;
            out(Event::Idle(false));
        }
        self.advance_watermark(out);
        if all_idle && !self.idle_out {
            // After the flushed watermark, as Flink's valve.
            self.idle_out = true;
            out(Event::Idle(true));
        }
    }

    fn advance_watermark(&mut self, out: &mut dyn FnMut(Event)) {
        let all_idle = self.idle.iter().all(|i| *i);
        // Idle inputs are never aligned.
        let aligned = self
            .watermarks
            .iter()
            .zip(&self.aligned)
            .filter(|(_, a)| **a)
            .map(|(w, _)| *w)
            .min();
        // Every input idle: no input will advance, so the largest watermark among them goes
        // out, as Flink's watermark valve flushes it (held, the windows that watermark closes
        // never fired while every source was quiet). Active inputs none of which is aligned
        // yet hold it where it is; it never goes back.
        let w = if all_idle {
            self.watermarks.iter().copied().max()
        } else {
            aligned
        };
        if let Some(w) = w {
            if w > self.emitted {
                self.emitted = w;
                out(Event::Watermark(w));
            }
        }
    }

    pub fn all_ended(&self) -> bool {
        self.ended.iter().all(|e| *e)
    }

    /// The valve's watermark state, for an unaligned checkpoint's channel state: the frames
    /// it captures are replayed on top of it.
    pub fn valve(&self) -> ValveState {
        ValveState {
            emitted: self.emitted,
            inputs: (0..self.watermarks.len())
                .map(|i| (self.watermarks[i], self.idle[i], self.aligned[i]))
                .collect(),
        }
    }

    /// Takes over a restored [`Self::valve`] of as many inputs (the caller checked the
    /// count), and returns what the valve had last told downstream, to be sent again before
    /// anything else: its watermark, then its idleness when every input was idle (as
    /// [`Self::advance`] sends them). Downstream had them before the barrier; a consumer that
    /// restored none (an exchange after this one that passed the checkpoint aligned) would
    /// otherwise wait for more, and operators and valves take a repeat as nothing new. End of
    /// input is not restored: an input that had ended ends again after the restore (its
    /// watermark, `i64::MAX`, holds meanwhile).
    pub fn restore_valve(&mut self, v: &ValveState) -> Vec<Event> {
        debug_assert_eq!(v.inputs.len(), self.watermarks.len());
        for (i, &(w, idle, aligned)) in v.inputs.iter().enumerate().take(self.watermarks.len()) {
            self.watermarks[i] = w;
            self.idle[i] = idle;
            self.aligned[i] = aligned && !idle;
        }
        self.emitted = v.emitted;
        self.idle_out = !self.idle.is_empty() && self.idle.iter().all(|i| *i);
        let mut again = Vec::new();
        if self.emitted != i64::MIN {
            again.push(Event::Watermark(self.emitted));
        }
        if self.idle_out {
            again.push(Event::Idle(true));
        }
        again
    }
}

/// An [`InputMerger`]'s watermark state ([`InputMerger::valve`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ValveState {
    /// The watermark forwarded.
    pub emitted: i64,
    /// Per input: its watermark, whether it is idle, whether it counts towards the minimum.
    pub inputs: Vec<(i64, bool, bool)>,
}

/// One input of a union on a shard.
pub(crate) struct UnionInput<T> {
    pub index: usize,
    pub merger: Rc<RefCell<InputMerger>>,
    pub down: Rc<RefCell<Out<T>>>,
}

impl<T: 'static> Collector<T> for UnionInput<T> {
    #[inline]
    fn collect(&mut self, rec: T, ts: i64) {
        self.down.borrow_mut().collect(rec, ts);
    }
    fn event(&mut self, ev: Event) {
        let mut fwd = Vec::with_capacity(2);
        self.merger
            .borrow_mut()
            .on_event(self.index, ev, &mut |e| fwd.push(e));
        let mut down = self.down.borrow_mut();
        for e in fwd {
            down.event(e);
        }
    }
    fn processing_time(&mut self, now_ms: i64) {
        // Every input of the union forwards time; operators ignore time that did not advance.
        self.down.borrow_mut().processing_time(now_ms);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merger_forwards_min_watermark_and_end_after_all() {
        let mut m = InputMerger::new(2);
        let mut got = Vec::new();
        m.on_event(0, Event::Watermark(10), &mut |e| got.push(e));
        assert!(got.is_empty(), "input 1 has no watermark yet");
        m.on_event(1, Event::Watermark(5), &mut |e| got.push(e));
        assert_eq!(got, vec![Event::Watermark(5)]);
        m.on_event(1, Event::Idle(true), &mut |e| got.push(e));
        assert_eq!(
            got.last(),
            Some(&Event::Watermark(10)),
            "idle input no longer holds back"
        );
        m.on_event(0, Event::EndOfInput, &mut |e| got.push(e));
        assert!(!m.all_ended());
        m.on_event(1, Event::EndOfInput, &mut |e| got.push(e));
        assert_eq!(got.last(), Some(&Event::EndOfInput));
        assert!(got.contains(&Event::Watermark(i64::MAX)));
    }

    /// Every input idle: the largest of their watermarks goes out (Flink's valve flushes it;
    /// it was held, and windows that it closes never fired while every source was quiet).
    #[test]
    fn merger_flushes_the_largest_watermark_when_every_input_is_idle() {
        let mut m = InputMerger::new(3);
        let mut got = Vec::new();
        m.on_event(0, Event::Watermark(99), &mut |e| got.push(e));
        m.on_event(1, Event::Watermark(40), &mut |e| got.push(e));
        m.on_event(1, Event::Idle(true), &mut |e| got.push(e));
        assert!(got.is_empty(), "input 2 holds the watermark back");
        m.on_event(2, Event::Idle(true), &mut |e| got.push(e));
        assert_eq!(got, vec![Event::Watermark(99)], "input 1 is the one active");
        m.on_event(0, Event::Idle(true), &mut |e| got.push(e));
        assert_eq!(got[1..], [Event::Idle(true)], "99 is out already; idle now");
        // Input 1 resumes behind what went out: nothing goes back, and it does not hold
        // input 0 back until it catches up.
        m.on_event(1, Event::Watermark(60), &mut |e| got.push(e));
        assert_eq!(got[2..], [Event::Idle(false)], "active again");
        m.on_event(0, Event::Watermark(120), &mut |e| got.push(e));
        assert_eq!(
            got[3..],
            [Event::Watermark(120)],
            "input 1 at 60 is not aligned"
        );

        let mut m = InputMerger::new(2);
        let mut got = Vec::new();
        m.on_event(0, Event::Watermark(99), &mut |e| got.push(e));
        m.on_event(0, Event::Idle(true), &mut |e| got.push(e));
        assert!(got.is_empty(), "input 1 is active, with no watermark");
        m.on_event(1, Event::Idle(true), &mut |e| got.push(e));
        assert_eq!(
            got,
            vec![Event::Watermark(99), Event::Idle(true)],
            "every input idle: flushed, then idle"
        );
    }

    /// An input that turns active again behind the watermark that went out counts again only
    /// once it caught up (Flink's `StatusWatermarkValve`): it held the others back, so that
    /// records it let through were on time here and late in Flink.
    #[test]
    fn a_resumed_input_behind_the_watermark_counts_once_it_caught_up() {
        let mut m = InputMerger::new(2);
        let mut got = Vec::new();
        let mut feed = |m: &mut InputMerger, i: usize, ev: Event| {
            let mut out = Vec::new();
            m.on_event(i, ev, &mut |e| out.push(e));
            got.push(out);
        };
        feed(&mut m, 0, Event::Watermark(50));
        feed(&mut m, 1, Event::Watermark(40));
        feed(&mut m, 1, Event::Idle(true));
        feed(&mut m, 0, Event::Watermark(100));
        feed(&mut m, 1, Event::Idle(false));
        feed(&mut m, 0, Event::Watermark(150));
        feed(&mut m, 1, Event::Watermark(120));
        feed(&mut m, 0, Event::Watermark(200));
        feed(&mut m, 1, Event::Watermark(210));
        feed(&mut m, 0, Event::Watermark(300));
        feed(&mut m, 1, Event::Idle(true));
        // Resumes with a watermark, without an `Idle(false)` first: aligned at once, as it
        // is not behind.
        feed(&mut m, 1, Event::Watermark(400));
        feed(&mut m, 0, Event::Watermark(500));
        let w = Event::Watermark;
        assert_eq!(
            got,
            vec![
                vec![],
                vec![w(40)],
                vec![w(50)],
                vec![w(100)],
                vec![],
                vec![w(150)],
                vec![],
                vec![w(200)],
                vec![],
                vec![w(210)],
                vec![w(300)],
                vec![],
                vec![w(400)],
            ]
        );
    }

    #[test]
    fn merger_aligns_barriers_and_blocks_inputs_that_delivered_them() {
        let mut m = InputMerger::new(3);
        let mut got = Vec::new();
        m.on_event(0, Event::Barrier(5), &mut |e| got.push(e));
        assert!(m.is_blocked(0) && !m.is_blocked(1));
        m.on_event(2, Event::EndOfInput, &mut |e| got.push(e));
        assert!(
            !got.contains(&Event::Barrier(5)),
            "input 1 has not delivered barrier 5"
        );
        m.on_event(1, Event::Barrier(5), &mut |e| got.push(e));
        assert_eq!(got.iter().filter(|e| **e == Event::Barrier(5)).count(), 1);
        assert!(
            !m.is_blocked(0) && !m.is_blocked(1),
            "aligned: every input released"
        );
        // A stale barrier is ignored; a newer one abandons the older alignment.
        got.clear();
        m.on_event(0, Event::Barrier(4), &mut |e| got.push(e));
        assert!(got.is_empty() && !m.is_blocked(0));
        m.on_event(0, Event::Barrier(6), &mut |e| got.push(e));
        m.on_event(1, Event::Barrier(7), &mut |e| got.push(e));
        assert!(
            !m.is_blocked(0) && m.is_blocked(1),
            "barrier 6 abandoned for 7"
        );
        m.on_event(0, Event::Barrier(7), &mut |e| got.push(e));
        assert_eq!(got, vec![Event::Barrier(7)]);
    }

    #[test]
    fn at_least_once_merger_forwards_on_the_last_barrier_without_blocking() {
        let mut m = InputMerger::new(2);
        m.align = false;
        let mut got = Vec::new();
        m.on_event(0, Event::Barrier(1), &mut |e| got.push(e));
        assert!(!m.is_blocked(0));
        assert!(got.is_empty());
        m.on_event(1, Event::Barrier(1), &mut |e| got.push(e));
        assert_eq!(got, vec![Event::Barrier(1)]);
    }

    #[test]
    fn merger_never_moves_watermark_backwards() {
        let mut m = InputMerger::new(1);
        let mut got = Vec::new();
        m.on_event(0, Event::Watermark(10), &mut |e| got.push(e));
        m.on_event(0, Event::Watermark(3), &mut |e| got.push(e));
        assert_eq!(got, vec![Event::Watermark(10)]);
    }
}
