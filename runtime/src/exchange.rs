//! Exchanges: how records move between shards.
//!
//! Every exchange has one ring per (producer shard, consumer shard) pair. The writer at the end
//! of the upstream chain serializes each record once, with rkyv, straight into the target
//! ring's memory; the reader at the head of the downstream chain reads it in place. When a
//! ring is full the writer keeps the frame in a bounded spill buffer of its target and its
//! chain's head stops pulling input until the spill drained: backpressure, never loss.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::marker::PhantomData;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rkyv::util::AlignedVec;
use weir_ring::{Consumer, FrameKind, Header, Producer, PushWithError};

use crate::checkpoint::shard::ShardCheckpointRef;
use crate::data::{read_trusted, serialize_into, Data};
use crate::error::{JobError, StartError};
use crate::graph::{name_of, BuildCtx, Factory, FailCell, Flush, Head, HeadStatus};
use crate::metrics::{bump, HeadCounters, OperatorCounters};
use crate::operator::{Collector, Event, InputMerger, Out};
use crate::stream::Stream;

/// Flag of a watermark frame that carries an idleness change instead of a watermark.
pub(crate) const FLAG_IDLE: u8 = 1;

/// The largest spill buffer a writer tries for one record: records beyond a ring's largest
/// frame are refused, and the buffer grows past it only to name the record's size (larger
/// ones are named by this bound, which caps the memory an error may take).
const SPILL_PROBE_MAX: usize = 64 << 20;

/// The event a watermark frame with `flags` and `ts` carries.
#[inline]
pub(crate) fn watermark_event(flags: u8, ts: i64) -> Event {
    if flags & FLAG_IDLE != 0 {
        Event::Idle(ts != 0)
    } else {
        Event::Watermark(ts)
    }
}

/// Where a record goes.
pub(crate) enum Route<T> {
    /// To shard `i % shards` for the `i`-th record of each producer.
    RoundRobin,
    /// To every shard.
    Broadcast,
    /// To the shard owning the record's key group: `f(record, max_parallelism, scratch)`.
    KeyGroup(KeyGroupFn<T>),
}

impl<T> Clone for Route<T> {
    fn clone(&self) -> Self {
        match self {
            Route::RoundRobin => Route::RoundRobin,
            Route::Broadcast => Route::Broadcast,
            Route::KeyGroup(f) => Route::KeyGroup(f.clone()),
        }
    }
}

/// Computes a record's key group, given the max parallelism and a scratch buffer for the
/// encoded key (reused, so that routing allocates nothing per record).
pub(crate) type KeyGroupFn<T> = Arc<dyn Fn(&T, u16, &mut Vec<u8>) -> u16 + Send + Sync>;

/// The ring ends of one shard, by exchange id.
#[derive(Default)]
pub(crate) struct ExchangeEndpoints {
    /// For each exchange, a producer towards every consumer shard.
    pub producers: HashMap<usize, Vec<Producer>>,
    /// For each exchange, a consumer from every producer shard.
    pub consumers: HashMap<usize, Vec<Consumer>>,
}

/// Creates the rings of `exchanges` exchanges among `shards` shards, and hands each shard its
/// ends.
pub(crate) fn wire(exchanges: usize, shards: usize, ring_bytes: usize) -> Vec<ExchangeEndpoints> {
    let mut eps: Vec<ExchangeEndpoints> =
        (0..shards).map(|_| ExchangeEndpoints::default()).collect();
    for e in 0..exchanges {
        let mut cons: Vec<Vec<Option<Consumer>>> = (0..shards)
            .map(|_| (0..shards).map(|_| None).collect())
            .collect();
        for (p, ep) in eps.iter_mut().enumerate() {
            let mut prods = Vec::with_capacity(shards);
            for row in cons.iter_mut() {
                let (tx, rx) = weir_ring::ring(ring_bytes);
                prods.push(tx);
                row[p] = Some(rx);
            }
            ep.producers.insert(e, prods);
        }
        for (c, row) in cons.into_iter().enumerate() {
            eps[c].consumers.insert(
                e,
                row.into_iter()
                    .map(|r| r.expect("every pair wired"))
                    .collect(),
            );
        }
    }
    eps
}

/// Builds an exchange between `up` and whatever consumes the returned stream.
pub(crate) fn exchange<T: Data>(up: Stream<T>, kind: &'static str, route: Route<T>) -> Stream<T> {
    let id = up.graph.borrow_mut().new_exchange();
    let name = up.new_name(kind);
    let upf = up.factory.clone();
    let slot = name.clone();
    let factory: Factory<T> = Arc::new(move |ctx: &mut BuildCtx, down: Out<T>| {
        let name = name_of(&slot);
        let consumers =
            ctx.exchanges
                .consumers
                .remove(&id)
                .ok_or_else(|| StartError::Executor {
                    shard: ctx.shard,
                    reason: format!("exchange {id} ({name}) has no rings"),
                })?;
        let counters = ctx.metrics.operator(&name, ctx.shard);
        let mut merger = InputMerger::new(consumers.len());
        merger.align = crate::checkpoint::aligns(ctx);
        let keyed = matches!(route, Route::KeyGroup(_));
        let mut channels = crate::unaligned::Channels::new(ctx, &name, keyed, consumers.len())?;
        // A restored valve's last watermark (and idleness) goes downstream again before
        // anything else, as a timestamp assigner's does (`InputMerger::restore_valve`).
        let resend = channels
            .take_valve()
            .map(|v| merger.restore_valve(&v))
            .unwrap_or_default();
        // A timestamp assigner of this chain behind a union (or right after the exchange)
        // takes this head's records as one split of their own: counted against a source's
        // split, records ahead of that source's carried its records past the watermark.
        let split_tags = std::mem::take(&mut ctx.split_tags)
            .into_iter()
            .map(|tags| {
                let source = tags.register(&name);
                tags.publish(source, &[0], &[]);
                (tags, source)
            })
            .collect();
        let head = ExchangeHead::<T> {
            name: name.clone(),
            split_tags,
            merger,
            checkpoint: ctx.checkpoint.clone(),
            align_started: None,
            channels,
            resend,
            consumers,
            ended: Vec::new(),
            down,
            gate: ctx.take_gate(),
            batch: ctx.config.batch_records,
            counters: counters.clone(),
            head: ctx.metrics.head(&name, ctx.shard),
            next_input: 0,
            done: false,
            hints: None,
            ahead: VecDeque::with_capacity(crate::keyed::LOOKAHEAD + 1),
            stop: ctx.stop.clone(),
            _t: PhantomData,
        };
        ctx.heads.push(Box::new(head));
        let producers =
            ctx.exchanges
                .producers
                .remove(&id)
                .ok_or_else(|| StartError::Executor {
                    shard: ctx.shard,
                    reason: format!("exchange {id} ({name}) has no rings"),
                })?;
        let writer = Rc::new(RefCell::new(WriterState::new(
            producers,
            name.clone(),
            counters,
            ctx.fail.clone(),
        )));
        writer.borrow_mut().announce = crate::checkpoint::unaligned_after(ctx).is_some();
        ctx.gate.register(Rc::new(WriterFlush(writer.clone())));
        let w = ExchangeWriter {
            state: writer,
            route: route.clone(),
            shards: ctx.shards,
            max_parallelism: ctx.config.max_parallelism,
            next: ctx.shard,
            scratch: Vec::with_capacity(64),
            arena: rkyv::ser::allocator::Arena::new(),
        };
        upf(ctx, Box::new(w))
    });
    up.derive(factory, name)
}

struct WriterState {
    producers: Vec<Producer>,
    /// Unaligned checkpoints: announce each barrier with its ring position, so consumers can
    /// act on it before reading up to it.
    announce: bool,
    /// Per target: a barrier frame still in the spill buffer (id, its offset there), announced
    /// when it reaches the ring.
    pending_announce: Vec<Option<(u64, usize)>>,
    last_announced: Vec<u64>,
    /// Frames that did not fit their ring yet, per target, in order.
    spill: Vec<AlignedVec<16>>,
    spilled: usize,
    name: String,
    counters: Arc<OperatorCounters>,
    fail: FailCell,
    closed: bool,
}

impl WriterState {
    fn new(
        producers: Vec<Producer>,
        name: String,
        counters: Arc<OperatorCounters>,
        fail: FailCell,
    ) -> Self {
        let n = producers.len();
        Self {
            producers,
            announce: false,
            pending_announce: vec![None; n],
            last_announced: vec![0; n],
            spill: (0..n).map(|_| AlignedVec::new()).collect(),
            spilled: 0,
            name,
            counters,
            fail,
            closed: false,
        }
    }

    /// Writes one frame to `target`: into ring memory when there is room and nothing is
    /// spilled before it, else into the target's spill buffer.
    fn write(
        &mut self,
        target: usize,
        header: Header,
        fill: &mut dyn FnMut(&mut [u8]) -> Option<usize>,
    ) {
        if self.spill[target].is_empty() {
            let mut want = 256usize;
            // A frame is at most the ring's largest: a region can offer more (a drained
            // ring's whole free space), and a frame written there only because the ring was
            // empty made the same record fit or not by the ring's state.
            let most = self.producers[target].max_frame_bytes() - weir_ring::HEADER_BYTES;
            loop {
                let p = &mut self.producers[target];
                match p.writer(want.min(p.max_frame_bytes())) {
                    Ok(Some(mut w)) => match w.push_with(header, |buf| {
                        let n = buf.len().min(most);
                        fill(&mut buf[..n]).ok_or(())
                    }) {
                        Ok(()) => {
                            // Published in a batch when the head flushes its chain.
                            w.commit_deferred();
                            return;
                        }
                        Err(PushWithError::Payload(())) | Err(PushWithError::NoSpace) => {
                            if want >= self.producers[target].max_frame_bytes() {
                                break;
                            }
                            want *= 4;
                        }
                    },
                    Ok(None) => break,
                    Err(too_large) => {
                        self.fail.fail(JobError::RecordTooLarge {
                            operator: self.name.clone(),
                            bytes: too_large.requested_bytes,
                            capacity_bytes: self.producers[target].capacity(),
                        });
                        return;
                    }
                }
            }
        }
        self.spill_frame(target, header, fill);
    }

    /// Writes one frame to `target`'s spill buffer, or fails the job with
    /// [`JobError::RecordTooLarge`] if it exceeds the ring's largest frame.
    fn spill_frame(
        &mut self,
        target: usize,
        header: Header,
        fill: &mut dyn FnMut(&mut [u8]) -> Option<usize>,
    ) {
        let max = self.producers[target].max_frame_bytes();
        let buf = &mut self.spill[target];
        let start = buf.len();
        let mut room = 256usize;
        let refused = loop {
            buf.resize(start + weir_ring::HEADER_BYTES + room, 0);
            if let Some(len) = fill(&mut buf[start + weir_ring::HEADER_BYTES..]) {
                let total = weir_ring::frame_bytes(len);
                if total > max {
                    // Spilled, it would never fit its ring: the job waited for it for good.
                    break total;
                }
                buf.resize(start + total, 0);
                buf[start..start + weir_ring::HEADER_BYTES]
                    .copy_from_slice(&header.encode(len as u32));
                buf[start + weir_ring::HEADER_BYTES + len..start + total].fill(0);
                self.spilled += 1;
                let held: usize = self.spill.iter().map(|b| b.len()).sum();
                let max = &self.counters.max_buffered_bytes;
                if held as u64 > max.load(std::sync::atomic::Ordering::Relaxed) {
                    max.store(held as u64, std::sync::atomic::Ordering::Relaxed);
                }
                return;
            }
            // Grown past the ring's largest frame to learn the record's size for the error;
            // a record that does not serialize even into this much is named by that bound.
            if room >= SPILL_PROBE_MAX {
                break room;
            }
            room = (room * 4).min(SPILL_PROBE_MAX);
        };
        self.spill[target].resize(start, 0);
        self.fail.fail(JobError::RecordTooLarge {
            operator: self.name.clone(),
            bytes: refused,
            capacity_bytes: self.producers[target].capacity(),
        });
    }

    /// Moves spilled frames into their rings, in order, as far as they fit.
    fn drain_spill(&mut self) -> bool {
        if self.spilled == 0 {
            return true;
        }
        let mut all = true;
        for (t, buf) in self.spill.iter_mut().enumerate() {
            let mut off = 0;
            while off < buf.len() {
                let len = u32::from_le_bytes([buf[off], buf[off + 1], buf[off + 2], buf[off + 3]]);
                let frame_len = weir_ring::frame_bytes(len as usize);
                let pos = self.producers[t].write_position();
                match self.producers[t].reserve(frame_len) {
                    Ok(Some(mut region)) => {
                        region.as_mut_slice()[..frame_len]
                            .copy_from_slice(&buf[off..off + frame_len]);
                        region.commit(frame_len);
                        if let Some((id, at)) = self.pending_announce[t] {
                            if at == off {
                                // The barrier frame reached the ring at `pos`.
                                self.producers[t].announce(id, pos);
                                self.last_announced[t] = id;
                                self.pending_announce[t] = None;
                            }
                        }
                        off += frame_len;
                        self.spilled -= 1;
                    }
                    _ => break,
                }
            }
            if off > 0 {
                if let Some((_, at)) = &mut self.pending_announce[t] {
                    *at -= off;
                }
                let rest = buf.len() - off;
                buf.as_mut_slice().copy_within(off.., 0);
                buf.resize(rest, 0);
            }
            all &= buf.is_empty();
        }
        all
    }

    /// Sends barrier `id` to every target; with `announce`, also announces it at its ring
    /// position (now, or when the frame leaves the spill buffer).
    fn barrier(&mut self, id: u64) {
        for t in 0..self.producers.len() {
            let in_ring = self.spill[t].is_empty();
            let pos = self.producers[t].write_position();
            let spill_at = self.spill[t].len();
            self.write(t, Header::barrier(id), &mut |_| Some(0));
            if !self.announce || id <= self.last_announced[t] {
                continue;
            }
            if in_ring && self.spill[t].is_empty() {
                self.producers[t].announce(id, pos);
                self.last_announced[t] = id;
            } else {
                self.pending_announce[t] = Some((id, spill_at));
            }
        }
    }

    fn broadcast_control(&mut self, header: Header) {
        for t in 0..self.producers.len() {
            self.write(t, header, &mut |_| Some(0));
        }
    }
}

struct WriterFlush(Rc<RefCell<WriterState>>);

impl Flush for WriterFlush {
    fn flush(&self) -> bool {
        let mut s = self.0.borrow_mut();
        for p in &mut s.producers {
            p.publish();
        }
        let drained = s.drain_spill();
        if drained && s.closed {
            for p in &mut s.producers {
                p.close();
            }
        }
        drained
    }
}

/// The tail of the upstream chain of an exchange.
struct ExchangeWriter<T> {
    state: Rc<RefCell<WriterState>>,
    route: Route<T>,
    shards: usize,
    max_parallelism: u16,
    next: usize,
    scratch: Vec<u8>,
    /// The serializer's scratch space, reused for every record.
    arena: rkyv::ser::allocator::Arena,
}

impl<T: Data> Collector<T> for ExchangeWriter<T> {
    #[inline]
    fn collect(&mut self, rec: T, ts: i64) {
        let mut s = self.state.borrow_mut();
        let arena = &mut self.arena;
        let mut fill = |buf: &mut [u8]| serialize_into(&rec, buf, arena);
        match &self.route {
            Route::KeyGroup(kg) => {
                let kg = kg(&rec, self.max_parallelism, &mut self.scratch);
                let target =
                    crate::keyed::shard_for_key_group(kg, self.max_parallelism, self.shards);
                s.write(target, Header::record(kg, ts), &mut fill);
            }
            Route::RoundRobin => {
                let target = self.next % self.shards;
                self.next = self.next.wrapping_add(1);
                s.write(target, Header::record(0, ts), &mut fill);
            }
            Route::Broadcast => {
                for t in 0..self.shards {
                    s.write(t, Header::record(0, ts), &mut fill);
                }
            }
        }
    }

    fn event(&mut self, ev: Event) {
        let mut s = self.state.borrow_mut();
        match ev {
            Event::Watermark(w) => s.broadcast_control(Header::watermark(w)),
            Event::Idle(idle) => {
                s.broadcast_control(Header::watermark(i64::from(idle)).with_flags(FLAG_IDLE))
            }
            Event::LatencyMarker { created_ns } => {
                // One marker per record path is enough: send it to a single, rotating shard.
                let target = self.next % self.shards;
                self.next = self.next.wrapping_add(1);
                s.write(target, Header::user_control(created_ns as i64), &mut |_| {
                    Some(0)
                });
            }
            Event::Barrier(id) => s.barrier(id),
            Event::EndOfInput => {
                s.broadcast_control(Header::end_of_stream());
                s.closed = true;
                if s.drain_spill() {
                    for p in &mut s.producers {
                        p.close();
                    }
                }
            }
        }
    }

    fn processing_time(&mut self, _now_ms: i64) {}
}

/// The head of the downstream chain of an exchange: reads every input ring in place.
struct ExchangeHead<T> {
    name: String,
    /// The timestamp assigners of the chain, each with the number this head has there.
    split_tags: Vec<(Rc<crate::time::SplitTags>, u32)>,
    consumers: Vec<Consumer>,
    merger: InputMerger,
    ended: Vec<bool>,
    down: Out<T>,
    gate: Rc<crate::graph::Gate>,
    batch: usize,
    counters: Arc<OperatorCounters>,
    head: Arc<HeadCounters>,
    next_input: usize,
    done: bool,
    checkpoint: Option<ShardCheckpointRef>,
    /// When the first barrier of the alignment in progress arrived.
    align_started: Option<std::time::Instant>,
    /// Unaligned checkpoints: in-flight data captured, restored data to replay.
    channels: crate::unaligned::Channels,
    /// What the restored valve had told downstream, not sent again yet.
    resend: Vec<Event>,
    /// Whether the chain wants records hinted ahead ([`Collector::hint`]); asked at the first
    /// step.
    hints: Option<bool>,
    /// Records read and hinted but not yet collected, at most `LOOKAHEAD`; always empty
    /// between frames of other kinds and between steps, so order with events is kept.
    ahead: VecDeque<(T, i64)>,
    /// See `BuildCtx::stop`: read before each record.
    stop: Arc<AtomicBool>,
    _t: PhantomData<fn() -> T>,
}

/// Hands every record still held ahead down the chain, in order.
#[inline]
fn drain_ahead<T: 'static>(ahead: &mut VecDeque<(T, i64)>, down: &mut Out<T>) {
    while let Some((rec, ts)) = ahead.pop_front() {
        down.collect(rec, ts);
    }
}

impl<T: Data> ExchangeHead<T> {
    /// Takes checkpoint `id` unaligned from here on: the barrier goes down the chain now,
    /// ahead of the data still queued in the rings.
    fn start_unaligned(&mut self, id: u64) {
        let was_aligning = self.merger.aligning() == Some(id);
        let done = self.merger.abandon(id);
        // An aligned checkpoint that timed out: its alignment lasted until now, as Flink
        // reports it (the time it aligned was lost, and the figure fell below the timeout).
        if let (Some(started), true, Some(c)) =
            (self.align_started.take(), was_aligning, &self.checkpoint)
        {
            c.borrow_mut()
                .record_alignment(id, started.elapsed().as_nanos() as u64, 0);
        }
        self.down.event(Event::Barrier(id));
        // The valve's state goes with the channel state: its captured frames, replayed on
        // top of it, leave the valve where a failure-free run left it.
        self.channels.start(id, done, self.merger.valve());
    }

    /// Whether checkpoint `id` must stay aligned: the final checkpoint of a bounded job (see
    /// `Shared::final_id`).
    fn stays_aligned(&self, id: u64) -> bool {
        self.checkpoint
            .as_ref()
            .is_some_and(|c| c.borrow().shared.is_final(id))
    }

    /// Acts on barrier announcements and on an alignment that waited too long.
    fn check_unaligned(&mut self) {
        let Some(timeout) = self.channels.unaligned_after else {
            return;
        };
        if let (Some(started), Some(id)) = (self.align_started, self.merger.aligning()) {
            if started.elapsed() >= timeout
                && id > self.channels.last_id()
                && !self.stays_aligned(id)
            {
                self.start_unaligned(id);
            }
        }
        for i in 0..self.consumers.len() {
            if self.ended[i] {
                continue;
            }
            let Some((id, pos)) = self.consumers[i].announcement() else {
                continue;
            };
            if id > self.channels.last_id() && timeout.is_zero() && !self.stays_aligned(id) {
                self.start_unaligned(id);
            }
            if self.channels.active_id() == Some(id) && self.channels.capturing(i) {
                let (a, b) = self.consumers[i].peek_range(pos);
                self.channels.capture_ring(i, a, b);
            }
        }
        self.channels.maybe_finish();
    }
}

impl<T: Data> Head for ExchangeHead<T> {
    fn name(&self) -> &str {
        &self.name
    }

    fn step(&mut self, now_ms: i64) -> Result<HeadStatus, JobError> {
        let t0 = std::time::Instant::now();
        if !self.gate.flush() || self.gate.is_blocked() {
            bump(&self.head.backpressured_ns, t0.elapsed().as_nanos() as u64);
            return Ok(HeadStatus::Blocked);
        }
        if self.done {
            return Ok(HeadStatus::Done);
        }
        for (tags, source) in &self.split_tags {
            tags.set_current(*source, 0);
        }
        if self.ended.is_empty() {
            self.ended = vec![false; self.consumers.len()];
        }
        self.down.processing_time(now_ms);
        self.channels.poll();
        for ev in std::mem::take(&mut self.resend) {
            self.down.event(ev);
        }
        if self.channels.has_replay() {
            // Restored in-flight records come before any new input.
            // Watermark frames go through the valve, as when they were read live.
            let (down, counters, merger) = (&mut self.down, &self.counters, &mut self.merger);
            let n = self
                .channels
                .replay::<T>(self.batch, |input, item| match item {
                    crate::unaligned::Replayed::Record(rec, ts) => {
                        bump(&counters.records_in, 1);
                        down.collect(rec, ts);
                    }
                    crate::unaligned::Replayed::Event(ev) => {
                        merger.on_event(input, ev, &mut |e| down.event(e));
                    }
                })?;
            self.gate.flush();
            bump(&self.head.busy_ns, t0.elapsed().as_nanos() as u64);
            return Ok(if n > 0 {
                HeadStatus::Progress
            } else {
                HeadStatus::Idle
            });
        }
        self.check_unaligned();
        // A barrier forwarded there (taken unaligned) can make a union downstream hold this
        // chain back. What the barrier overtook then waits: read now, it would reach the
        // union's output before the union's other input delivers the barrier, inside the
        // checkpoint whose channel state replays it.
        if self.gate.is_blocked() {
            self.gate.flush();
            bump(&self.head.busy_ns, t0.elapsed().as_nanos() as u64);
            return Ok(HeadStatus::Progress);
        }
        let n_inputs = self.consumers.len();
        let hints = *self.hints.get_or_insert_with(|| self.down.wants_hints());
        let mut budget = self.batch;
        let mut moved = 0usize;
        for k in 0..n_inputs {
            let i = (self.next_input + k) % n_inputs;
            // An input that delivered the barrier being aligned waits for the others.
            if self.ended[i] || self.merger.is_blocked(i) {
                continue;
            }
            let Some(region) = self.consumers[i].read() else {
                continue;
            };
            let mut frames = region.frames();
            let mut end = false;
            for f in frames.by_ref() {
                moved += 1;
                if f.kind != FrameKind::Record {
                    // Events stay in order with the records before them.
                    drain_ahead(&mut self.ahead, &mut self.down);
                }
                match f.kind {
                    FrameKind::Record => {
                        if self.stop.load(Ordering::Relaxed) {
                            return Err(JobError::Cancelled);
                        }
                        // SAFETY: every record frame of this ring was written by an
                        // `ExchangeWriter<T>` of this job in this process, with
                        // `serialize_into::<T>` into 16-aligned ring memory.
                        let rec: T = unsafe { read_trusted::<T>(f.payload) };
                        if self.channels.capturing(i) {
                            self.channels
                                .capture_record(i, f.key_group, f.ts, f.payload);
                        }
                        bump(&self.counters.records_in, 1);
                        if hints {
                            self.down.hint(&rec);
                            self.ahead.push_back((rec, f.ts));
                            if self.ahead.len() > crate::keyed::LOOKAHEAD {
                                if let Some((rec, ts)) = self.ahead.pop_front() {
                                    self.down.collect(rec, ts);
                                }
                            }
                        } else {
                            self.down.collect(rec, f.ts);
                        }
                        budget = budget.saturating_sub(1);
                        continue;
                    }
                    FrameKind::Watermark => {
                        // Channel state keeps the watermarks among the records it captures,
                        // so that a replayed record meets the watermarks before it on its input.
                        if self.channels.capturing(i) {
                            self.channels.capture_watermark(i, f.flags, f.ts);
                        }
                        let ev = watermark_event(f.flags, f.ts);
                        let down = &mut self.down;
                        self.merger.on_event(i, ev, &mut |e| down.event(e));
                    }
                    FrameKind::UserControl => {
                        self.down.event(Event::LatencyMarker {
                            created_ns: f.ts as u64,
                        });
                    }
                    FrameKind::EndOfStream => {
                        end = true;
                        self.channels.input_done(i);
                        let down = &mut self.down;
                        self.merger
                            .on_event(i, Event::EndOfInput, &mut |e| down.event(e));
                    }
                    FrameKind::Barrier if f.ts as u64 <= self.channels.last_id() => {
                        // Taken unaligned already: the in-band barrier only ends the capture.
                        if self.channels.active_id() == Some(f.ts as u64) {
                            self.channels.input_done(i);
                        }
                    }
                    FrameKind::Barrier => {
                        let id = f.ts as u64;
                        // The first barrier of this checkpoint here. If it is also the last
                        // (one input, or every other input ended), nothing was aligned: 0,
                        // as Flink reports a single channel's alignment, not the few
                        // microseconds the merger takes to pass the barrier on.
                        let first = self.align_started.is_none();
                        let started = *self
                            .align_started
                            .get_or_insert_with(std::time::Instant::now);
                        let (down, ckpt) = (&mut self.down, &self.checkpoint);
                        let mut forwarded = false;
                        self.merger.on_event(i, Event::Barrier(id), &mut |e| {
                            if e == Event::Barrier(id) {
                                forwarded = true;
                                if let Some(c) = ckpt {
                                    let ns = if first {
                                        0
                                    } else {
                                        started.elapsed().as_nanos() as u64
                                    };
                                    c.borrow_mut().record_alignment(id, ns, 0);
                                }
                            }
                            down.event(e)
                        });
                        if forwarded {
                            self.align_started = None;
                            self.channels.aligned(id);
                        }
                        // Records after the barrier belong to the next checkpoint: not read
                        // while this input waits for its other rings' barriers, nor while an
                        // alignment downstream (a union's) holds this chain back.
                        if self.merger.is_blocked(i) || self.gate.is_blocked() {
                            break;
                        }
                    }
                }
                if budget == 0 || end {
                    break;
                }
            }
            drain_ahead(&mut self.ahead, &mut self.down);
            let consumed = frames.consumed();
            region.release(consumed);
            if end {
                self.ended[i] = true;
            }
            if budget == 0 {
                self.next_input = (i + 1) % n_inputs;
                break;
            }
            // A barrier forwarded in this step can make an alignment downstream (a union's)
            // hold this chain back: every ring is past that barrier, so all of them wait.
            if self.gate.is_blocked() {
                self.next_input = (i + 1) % n_inputs;
                break;
            }
        }
        self.channels.maybe_finish();
        self.gate.flush();
        let spent = t0.elapsed().as_nanos() as u64;
        if self.merger.all_ended() {
            self.done = true;
            for (tags, source) in &self.split_tags {
                tags.publish(*source, &[], &[]);
            }
            bump(&self.head.busy_ns, spent);
            return Ok(HeadStatus::Progress);
        }
        if moved > 0 {
            bump(&self.head.busy_ns, spent);
            Ok(HeadStatus::Progress)
        } else {
            bump(&self.head.idle_ns, spent);
            Ok(HeadStatus::Idle)
        }
    }
}
