//! Restore equivalence, randomized and seeded: a job stopped at a random point and restored
//! (from its latest checkpoint after a cancel, after an injected failure, or from a savepoint;
//! onto the same or another number of shards; aligned, unaligned, with an alignment timeout
//! or at least once) ends with the output of a straight run without failures.
//!
//! Each case picks a job shape (keyed running reduce, event-time tumbling / sliding / session
//! windows over out-of-order input, keyed process functions with event-time timers, one with
//! timers and no other state, a keyed join, two keyed stages in a row, unions, windows over a
//! source split among shards), a mode, the shard
//! counts and the restore source, from its seed. Input is deterministic and never late (its
//! out-of-orderness stays within the watermark strategy's bound), so every shape's output is
//! a function of the input alone, whatever the watermark timing. Exactly-once modes compare
//! the committed (published) lines of a transactional file sink with the straight run's;
//! at-least-once checks that nothing was lost.
//!
//! `WEIR_RESTORE_CASES` sets the number of cases (default [`DEFAULT_CASES`]), and
//! `WEIR_RESTORE_SEED` the first seed (default 1); a failing case prints its seed and
//! parameters, and `WEIR_RESTORE_CASES=1 WEIR_RESTORE_SEED=<seed>` runs that case alone.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use weir_runtime::checkpoint::{CheckpointConfig, CheckpointMode, RestartStrategy};
use weir_runtime::sink::TransactionalFileSink;
use weir_runtime::source::{splitmix64, Source, SourceError, SourcePoll, SourceReader};
use weir_runtime::{
    CoProcessFunction, Job, JobConfig, JobError, KeyedContext, KeyedProcessFunction, Pinning,
    RestoreFrom, Stream, TimeDomain, WatermarkStrategy, WindowAssigner,
};

const DEFAULT_CASES: u64 = 60;
/// The watermark strategy's bound; the input's out-of-orderness stays below it.
const OUT_OF_ORDER_MS: i64 = 40;

/// An input record: key, event time, value, index.
type Ev = (u32, i64, u64, u64);

/// Slows the first run down so that it is still running when the test stops it: each poll
/// of the source hands out a few records and sleeps, until released.
#[derive(Clone)]
struct Throttle(Arc<AtomicBool>);

impl Throttle {
    fn new(on: bool) -> Self {
        Throttle(Arc::new(AtomicBool::new(on)))
    }
    fn release(&self) {
        self.0.store(false, Ordering::Release);
    }
    fn on(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// All records of a vector, read on shard 0 only; the other shards' readers are empty and
/// hold no position, so that a checkpoint restores onto any number of shards. Its polls can
/// be throttled and held at an index, which the runtime's `from_vec` cannot.
struct VecSource<T> {
    items: Arc<Vec<T>>,
    throttle: Throttle,
    /// Records handed out, over every reader of every run (for the test to know how far the
    /// job got).
    read: Arc<AtomicU64>,
    /// Records before this index are handed out, the others wait (idle) until it grows.
    gate: Arc<AtomicU64>,
}

struct VecReader<T> {
    items: Arc<Vec<T>>,
    next: usize,
    throttle: Throttle,
    read: Arc<AtomicU64>,
    gate: Arc<AtomicU64>,
}

impl<T: Clone + 'static> SourceReader<T> for VecReader<T> {
    fn poll(&mut self, out: &mut Vec<T>, max: usize) -> Result<SourcePoll, SourceError> {
        let max = if self.throttle.on() {
            std::thread::sleep(Duration::from_micros(500));
            max.min(8)
        } else {
            max
        };
        let open = self
            .gate
            .load(Ordering::Acquire)
            .min(self.items.len() as u64) as usize;
        if self.next >= open && open < self.items.len() {
            return Ok(SourcePoll::Idle);
        }
        let end = (self.next + max).min(open);
        out.extend_from_slice(&self.items[self.next..end]);
        self.read
            .fetch_add((end - self.next) as u64, Ordering::Relaxed);
        self.next = end;
        Ok(if end == self.items.len() {
            SourcePoll::Finished
        } else {
            SourcePoll::Ready
        })
    }
    fn position(&self) -> Vec<u8> {
        (self.next as u64).to_le_bytes().to_vec()
    }
    fn seek(&mut self, position: &[u8]) -> Result<(), SourceError> {
        let n = <[u8; 8]>::try_from(position)
            .map(u64::from_le_bytes)
            .map_err(|_| SourceError::BadPosition("expected 8 bytes".into()))?;
        if n as usize > self.items.len() {
            return Err(SourceError::BadPosition(format!("{n} past the end")));
        }
        self.next = n as usize;
        Ok(())
    }
}

impl<T: Clone + Send + Sync + 'static> Source<T> for VecSource<T> {
    fn create_reader(
        &self,
        shard: usize,
        _shards: usize,
    ) -> Result<Box<dyn SourceReader<T>>, SourceError> {
        if shard != 0 {
            return Ok(Box::new(weir_runtime::source::EmptyReader));
        }
        Ok(Box::new(VecReader {
            items: self.items.clone(),
            next: 0,
            throttle: self.throttle.clone(),
            read: self.read.clone(),
            gate: self.gate.clone(),
        }))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Shape {
    Reduce,
    Tumbling,
    Sliding,
    Session,
    /// A keyed process function that buckets records into its own windows with event-time
    /// timers (value state and timers).
    Buckets,
    /// A keyed process function with timers and no other state.
    TimersOnly,
    Join,
    /// Two keyed stages: a running sum per key, then a count per key of the first's output.
    Chain,
    /// A rebalance, then a running count per key: records of one key arrive from every shard.
    Rebalance,
    /// Two keyed stages side by side, each behind its own exchange, unioned into the sink: a
    /// running sum per key of the input and a running count per key class of a second
    /// source. The union aligns a barrier by holding back the chain that delivered it.
    Union,
    /// Two keyed stages behind their own exchanges, each after its own timestamp assigner,
    /// unioned, then keyed into tumbling windows: the watermark crosses two exchanges and a
    /// union, and the second source may finish long before the first.
    UnionWindow,
    /// Tumbling windows over a source split among the first run's shards (an iterator per
    /// shard, record `i` on shard `i % shards`): a restore onto fewer shards gives a reader
    /// several splits, read in turn, and each split's watermark is kept apart. Each split
    /// stays within the bound, the input as a whole too, so no record is ever late.
    SplitWindows,
}

const SHAPES: [Shape; 12] = [
    Shape::Reduce,
    Shape::Tumbling,
    Shape::Sliding,
    Shape::Session,
    Shape::Buckets,
    Shape::TimersOnly,
    Shape::Join,
    Shape::Chain,
    Shape::Rebalance,
    Shape::Union,
    Shape::UnionWindow,
    Shape::SplitWindows,
];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Aligned,
    Unaligned,
    AlignedTimeout,
    AtLeastOnce,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Via {
    /// Cancel, then a new job with `RestoreFrom::Latest`.
    CancelLatest,
    /// A failure injected into the running job: its own restart restores the latest checkpoint
    /// (same shard count).
    Failover,
    /// Stop with a savepoint, then a new job (another checkpoint directory) restores it.
    Savepoint,
}

/// One stop of a run and how the job resumes.
#[derive(Clone, Copy, Debug)]
struct Stop {
    /// Stop once the run's source handed out this many records (and two checkpoints
    /// completed after that).
    after: u64,
    via: Via,
    /// Shards of the job that resumes (the same for a failover).
    shards: usize,
}

#[derive(Clone, Debug)]
struct Case {
    seed: u64,
    shape: Shape,
    mode: Mode,
    shards: usize,
    /// One or two stops: a job restored once is stopped and restored again.
    stops: Vec<Stop>,
    keys: u32,
    n: usize,
    watermark_per_record: bool,
    /// A slow operator after the keyed one: the exchange rings fill, barriers queue behind
    /// records (and unaligned ones overtake them).
    slow: bool,
    /// The join's second source runs unthrottled: it finishes long before the first, and
    /// checkpoints are taken with one source finished.
    early_finish: bool,
    /// Windows' allowed lateness (nothing is late; it keeps fired windows' state longer).
    lateness: i64,
    /// A small memtable budget (with many keys: memtables freeze and flush, segments are
    /// compacted, snapshots are chains of deltas).
    small_memtables: bool,
}

impl Case {
    fn new(seed: u64) -> Case {
        let r = |i: u64| splitmix64(seed ^ 0x005e_ed0f_ca5e, i);
        let shape = SHAPES[(r(0) % SHAPES.len() as u64) as usize];
        let mode = [
            Mode::Aligned,
            Mode::Unaligned,
            Mode::AlignedTimeout,
            Mode::AtLeastOnce,
        ][(r(1) % 4) as usize];
        let shards = 1 + (r(3) % 3) as usize;
        let many_keys = r(11).is_multiple_of(4);
        let n = if many_keys {
            6000 + (r(5) % 6000) as usize
        } else {
            2000 + (r(5) % 3000) as usize
        };
        let mut stops = Vec::new();
        let mut at = shards;
        let two = r(12).is_multiple_of(3);
        for i in 0..(1 + u64::from(two)) {
            let via = [Via::CancelLatest, Via::Failover, Via::Savepoint][(r(20 + i) % 3) as usize];
            if via != Via::Failover {
                at = 1 + (r(30 + i) % 3) as usize;
            }
            // Each run's source counts from where it resumed.
            let share = if two { 40 } else { 70 };
            stops.push(Stop {
                after: (n as u64) * (10 + r(40 + i) % share) / 100,
                via,
                shards: at,
            });
        }
        Case {
            seed,
            shape,
            mode,
            shards,
            stops,
            keys: if many_keys {
                500 + (r(6) % 3000) as u32
            } else {
                3 + (r(6) % 40) as u32
            },
            n,
            watermark_per_record: r(8).is_multiple_of(2),
            slow: r(9).is_multiple_of(2),
            early_finish: r(10).is_multiple_of(2),
            lateness: if r(13).is_multiple_of(2) {
                0
            } else {
                50 + (r(14) % 200) as i64
            },
            small_memtables: many_keys && r(15).is_multiple_of(2),
        }
    }
}

/// Records whose timestamps run ahead by 2 ms per index (with a pause of 300 ms now and then,
/// for sessions and timers), each up to `OUT_OF_ORDER_MS - 1` behind: never late.
fn events(seed: u64, n: usize, keys: u32) -> Vec<Ev> {
    let mut base = 0i64;
    (0..n as u64)
        .map(|i| {
            let r = splitmix64(seed, i);
            base += if r.is_multiple_of(97) { 300 } else { 2 };
            let jitter = ((r >> 16) % OUT_OF_ORDER_MS as u64) as i64;
            ((r >> 32) as u32 % keys, base - jitter, (r >> 8) % 1000, i)
        })
        .collect()
}

/// Each record bucketed into `[start, start + 100)` by its own timer at the bucket's end: the
/// bucket's sum and count per key, emitted once the watermark passes the end.
struct Buckets;

impl KeyedProcessFunction<u32, Ev, String> for Buckets {
    fn process_element(&self, e: Ev, ctx: &mut KeyedContext<'_, u32, String>) {
        let end = e.1.div_euclid(100) * 100 + 99;
        let mut open = ctx
            .value::<Vec<(i64, u64, u64)>>("open")
            .unwrap_or_default();
        match open.iter_mut().find(|b| b.0 == end) {
            Some(b) => {
                b.1 += e.2;
                b.2 += 1;
            }
            None => open.push((end, e.2, 1)),
        }
        ctx.set_value("open", &open);
        ctx.register_event_timer(end);
    }

    fn on_timer(&self, ts: i64, _d: TimeDomain, ctx: &mut KeyedContext<'_, u32, String>) {
        let mut open = ctx
            .value::<Vec<(i64, u64, u64)>>("open")
            .unwrap_or_default();
        let k = *ctx.key();
        open.retain(|b| {
            if b.0 == ts {
                ctx.emit(format!("bucket {k} {ts} {} {}", b.1, b.2));
                false
            } else {
                true
            }
        });
        if open.is_empty() {
            ctx.clear_value("open");
        } else {
            ctx.set_value("open", &open);
        }
    }
}

/// A timer 30 ms after each record's time, per key; emits key and time when it fires. No
/// state but the timers.
struct TimersOnly;

impl KeyedProcessFunction<u32, Ev, String> for TimersOnly {
    fn process_element(&self, e: Ev, ctx: &mut KeyedContext<'_, u32, String>) {
        ctx.register_event_timer(e.1 + 30);
    }

    fn on_timer(&self, ts: i64, _d: TimeDomain, ctx: &mut KeyedContext<'_, u32, String>) {
        let k = *ctx.key();
        ctx.emit(format!("timer {k} {ts}"));
    }
}

/// Orders `(id, item)` joined with payments `(id, amount)`; either may come first.
struct OrderPayment;

impl CoProcessFunction<u64, (u64, u64), (u64, u64), String> for OrderPayment {
    fn process_left(&self, o: (u64, u64), ctx: &mut KeyedContext<'_, u64, String>) {
        match ctx.value::<u64>("payment") {
            Some(p) => ctx.emit(format!("join {} {} {p}", o.0, o.1)),
            None => ctx.set_value("order", &o.1),
        }
    }
    fn process_right(&self, p: (u64, u64), ctx: &mut KeyedContext<'_, u64, String>) {
        match ctx.value::<u64>("order") {
            Some(o) => ctx.emit(format!("join {} {o} {}", p.0, p.1)),
            None => ctx.set_value("payment", &p.1),
        }
    }
}

/// What a run shares with the test.
struct Wiring {
    throttle: Throttle,
    read: Arc<AtomicU64>,
    fail: Arc<AtomicBool>,
}

fn source<T: weir_runtime::Data + Sync>(
    job: &Job,
    items: Vec<T>,
    w: &Wiring,
    uid: &str,
) -> Stream<T> {
    job.source(VecSource {
        items: Arc::new(items),
        throttle: w.throttle.clone(),
        read: w.read.clone(),
        gate: Arc::new(AtomicU64::new(u64::MAX)),
    })
    .uid(uid)
}

/// Builds the case's job; its output lines.
fn build(job: &Job, c: &Case, w: &Wiring) -> Stream<String> {
    let out = build_shape(job, c, w);
    if !c.slow {
        return out;
    }
    let throttle = w.throttle.clone();
    out.inspect(move |l: &String| {
        if throttle.on() && l.len().is_multiple_of(3) {
            std::thread::sleep(Duration::from_micros(100));
        }
    })
}

fn build_shape(job: &Job, c: &Case, w: &Wiring) -> Stream<String> {
    let input = events(c.seed, c.n, c.keys);
    let fail = w.fail.clone();
    let ev = source(job, input, w, "input").inspect(move |_| {
        if fail.swap(false, Ordering::AcqRel) {
            panic!("injected failure");
        }
    });
    let strategy = || {
        let s = WatermarkStrategy::bounded_out_of_orderness(OUT_OF_ORDER_MS, |e: &Ev| e.1);
        if c.watermark_per_record {
            s.with_watermark_per_record()
        } else {
            s
        }
    };
    match c.shape {
        Shape::Reduce => ev
            .key_by(|e: &Ev| e.0)
            .reduce(|a, b| (a.0, a.1, a.2 + b.2, b.3))
            .uid("sum")
            .map(|e| format!("sum {} {} {}", e.0, e.2, e.3)),
        Shape::Tumbling => ev
            .assign_timestamps(strategy())
            .key_by(|e: &Ev| e.0)
            .window(WindowAssigner::tumbling(100))
            .allowed_lateness(c.lateness)
            .aggregate_with(SumCount, |k, w, (s, n)| {
                format!("tumble {k} {} {s} {n}", w.start)
            })
            .uid("tumbling"),
        Shape::Sliding => ev
            .assign_timestamps(strategy())
            .key_by(|e: &Ev| e.0)
            .window(WindowAssigner::sliding(120, 40))
            .allowed_lateness(c.lateness)
            .aggregate_with(SumCount, |k, w, (s, n)| {
                format!("slide {k} {} {s} {n}", w.start)
            })
            .uid("sliding"),
        Shape::Session => ev
            .assign_timestamps(strategy())
            .key_by(|e: &Ev| e.0)
            .window(WindowAssigner::session(150))
            .allowed_lateness(c.lateness)
            .process(|k: &u32, w, items: Vec<Ev>, out: &mut Vec<String>| {
                let s: u64 = items.iter().map(|e| e.2).sum();
                out.push(format!(
                    "session {k} {} {} {s} {}",
                    w.start,
                    w.end,
                    items.len()
                ))
            })
            .uid("sessions"),
        Shape::Buckets => ev
            .assign_timestamps(strategy())
            .key_by(|e: &Ev| e.0)
            .process(Buckets)
            .uid("buckets"),
        Shape::TimersOnly => ev
            .assign_timestamps(strategy())
            .key_by(|e: &Ev| e.0)
            .process(TimersOnly)
            .uid("timers"),
        Shape::Join => {
            // Orders from the events (id = index), payments for every third order, in
            // another order, from a second source.
            let n = c.n as u64;
            let payments: Vec<(u64, u64)> = (0..n)
                .rev()
                .filter(|i| i % 3 == 0)
                .map(|i| (i, i * 7 % 1000))
                .collect();
            let orders = ev.map(|e: Ev| (e.3, e.2)).key_by(|o: &(u64, u64)| o.0);
            let pays = if c.early_finish {
                let unthrottled = Wiring {
                    throttle: Throttle::new(false),
                    read: Arc::default(),
                    fail: Arc::default(),
                };
                source(job, payments, &unthrottled, "payments")
            } else {
                source(job, payments, w, "payments")
            }
            .key_by(|p: &(u64, u64)| p.0);
            orders.connect(pays).process(OrderPayment).uid("join")
        }
        Shape::Chain => ev
            .key_by(|e: &Ev| e.0)
            .reduce(|a, b| (a.0, a.1, a.2 + b.2, b.3))
            .uid("first")
            .map(|e: Ev| (e.0 % 5, e.2))
            .key_by(|x: &(u32, u64)| x.0)
            // A running count and sum: the count's sequence does not depend on the order in
            // which the first stage's shards deliver, the sum does (see `normalize`).
            .map_count()
            .uid("second")
            .map(|(k, n, s)| format!("chain {k} {n} {s}")),
        Shape::Rebalance => ev
            .rebalance()
            .map(|e: Ev| (e.0 % 7, e.2))
            .key_by(|x: &(u32, u64)| x.0)
            .map_count()
            .uid("count")
            .map(|(k, n, s)| format!("chain {k} {n} {s}")),
        Shape::Union => {
            let sums = ev
                .key_by(|e: &Ev| e.0)
                .reduce(|a, b| (a.0, a.1, a.2 + b.2, b.3))
                .uid("sum")
                .map(|e| format!("sum {} {} {}", e.0, e.2, e.3));
            let counts = source(job, events(c.seed ^ 1, c.n, c.keys), w, "input2")
                .map(|e: Ev| (e.0 % 3, 1u64, e.3))
                .key_by(|x: &(u32, u64, u64)| x.0)
                .reduce(|a, b| (a.0, a.1 + b.1, b.2))
                .uid("count")
                .map(|(k, n, i)| format!("count {k} {n} {i}"));
            sums.union(counts)
        }
        Shape::UnionWindow => {
            let sums = ev
                .assign_timestamps(strategy())
                .key_by(|e: &Ev| e.0)
                .reduce(|a, b| (a.0, a.1, a.2 + b.2, b.3))
                .uid("sum")
                .map(|e: Ev| (e.0 % 4, e.1, e.2, e.3));
            let unthrottled = Wiring {
                throttle: Throttle::new(false),
                read: Arc::default(),
                fail: Arc::default(),
            };
            let second = if c.early_finish { &unthrottled } else { w };
            let counts = source(job, events(c.seed ^ 1, c.n, c.keys), second, "input2")
                .assign_timestamps(strategy())
                .key_by(|e: &Ev| e.0 % 3)
                .reduce(|a, b| (a.0, a.1, a.2 + 1, b.3))
                .uid("count")
                .map(|e: Ev| (e.0 % 3 + 1, e.1, e.2, e.3));
            sums.union(counts)
                .key_by(|e: &Ev| e.0)
                .window(WindowAssigner::tumbling(100))
                .allowed_lateness(c.lateness)
                .aggregate_with(SumCount, |k, w, (s, n)| {
                    format!("uwin {k} {} {s} {n}", w.start)
                })
                .uid("uwindow")
        }
        Shape::SplitWindows => {
            let items = Arc::new(events(c.seed, c.n, c.keys));
            let (read, throttle, fail) = (w.read.clone(), w.throttle.clone(), w.fail.clone());
            // When the last record of all shards' was let through.
            let paced = Arc::new(Mutex::new(Instant::now()));
            job.from_iter(move |shard, shards| {
                let items = items.clone();
                (shard..items.len()).step_by(shards).map(move |i| items[i])
            })
            .uid("split-input")
            .inspect(move |_| {
                read.fetch_add(1, Ordering::Relaxed);
                // As the other shapes' throttled source, over all shards together: a record
                // each 62 us (8 per 500 us).
                if throttle.on() {
                    let now = Instant::now();
                    let at = {
                        let mut last = paced.lock().unwrap_or_else(|p| p.into_inner());
                        *last = (*last + Duration::from_micros(62)).max(now);
                        *last
                    };
                    std::thread::sleep(at - now);
                }
                if fail.swap(false, Ordering::AcqRel) {
                    panic!("injected failure");
                }
            })
            .assign_timestamps(strategy())
            .key_by(|e: &Ev| e.0)
            .window(WindowAssigner::tumbling(100))
            .allowed_lateness(c.lateness)
            .aggregate_with(SumCount, |k, w, (s, n)| {
                format!("split {k} {} {s} {n}", w.start)
            })
            .uid("split-windows")
        }
    }
}

trait MapCount {
    fn map_count(self) -> Stream<(u32, u64, u64)>;
}

impl MapCount for weir_runtime::KeyedStream<(u32, u64), u32> {
    fn map_count(self) -> Stream<(u32, u64, u64)> {
        self.process(weir_runtime::FnProcess::new(
            |x: (u32, u64), ctx: &mut KeyedContext<'_, u32, (u32, u64, u64)>| {
                let (n, s) = ctx.value::<(u64, u64)>("count").unwrap_or((0, 0));
                let next = (n + 1, s + x.1);
                ctx.set_value("count", &next);
                ctx.emit((x.0, next.0, next.1));
            },
        ))
        .stream()
    }
}

struct SumCount;

impl weir_runtime::AggregateFunction<Ev, (u64, u64), (u64, u64)> for SumCount {
    fn create(&self) -> (u64, u64) {
        (0, 0)
    }
    fn add(&self, acc: (u64, u64), e: Ev) -> (u64, u64) {
        (acc.0 + e.2, acc.1 + 1)
    }
    fn result(&self, acc: &(u64, u64)) -> (u64, u64) {
        *acc
    }
    fn merge(&self, a: (u64, u64), b: (u64, u64)) -> (u64, u64) {
        (a.0 + b.0, a.1 + b.1)
    }
}

/// The lines as a sorted multiset. A chain's running sum depends on the order in which the
/// first stage's shards deliver, so only each key's last sum (at its highest count) stays.
fn normalize(shape: Shape, mut lines: Vec<String>) -> Vec<String> {
    if matches!(shape, Shape::Chain | Shape::Rebalance) {
        let mut last: HashMap<String, (u64, String)> = HashMap::new();
        let mut counts = Vec::new();
        for l in &lines {
            let f: Vec<&str> = l.split(' ').collect();
            let n: u64 = f[2].parse().expect("count");
            counts.push(format!("chain {} {}", f[1], f[2]));
            let e = last.entry(f[1].to_owned()).or_insert((0, String::new()));
            if n >= e.0 {
                *e = (n, f[3].to_owned());
            }
        }
        lines = counts;
        lines.extend(
            last.into_iter()
                .map(|(k, (n, s))| format!("total {k} {n} {s}")),
        );
    }
    lines.sort();
    lines
}

/// What a line is a result for, without the values that at-least-once replays may inflate:
/// a running sum's record index, a window's key and bounds, a bucket's key and end, a
/// chain's key (and count, for the running counts), a running count's key and record index,
/// a window of a union's key and start.
fn identity(shape: Shape, line: &str) -> String {
    let f: Vec<&str> = line.split(' ').collect();
    let keep = |idx: &[usize]| idx.iter().map(|&i| f[i]).collect::<Vec<_>>().join(" ");
    match shape {
        Shape::Reduce => keep(&[0, 3]),
        Shape::Tumbling | Shape::Sliding | Shape::Buckets => keep(&[0, 1, 2]),
        Shape::Session => keep(&[0, 1, 2, 3]),
        Shape::Chain | Shape::Rebalance if f[0] == "total" => keep(&[0, 1]),
        Shape::UnionWindow | Shape::SplitWindows => keep(&[0, 1, 2]),
        Shape::Union if f[0] == "sum" => keep(&[0, 3]),
        Shape::Union => keep(&[0, 1, 3]),
        _ => line.to_owned(),
    }
}

fn checkpointing(dir: &Path, mode: Mode) -> CheckpointConfig {
    let c = CheckpointConfig::new(dir, "restore-eq")
        .with_interval(Duration::from_millis(15))
        .with_retained(2)
        .with_restart(RestartStrategy::FixedDelay {
            attempts: 3,
            delay: Duration::from_millis(5),
        });
    match mode {
        Mode::Aligned => c,
        Mode::Unaligned => c.with_unaligned(true),
        Mode::AlignedTimeout => c
            .with_unaligned(true)
            .with_aligned_timeout(Duration::from_millis(1)),
        Mode::AtLeastOnce => c.with_mode(CheckpointMode::AtLeastOnce),
    }
}

/// The lines of the visible (committed) files under `dir`.
fn committed_lines(dir: &Path) -> Vec<String> {
    let mut lines = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return lines;
    };
    for e in entries.flatten() {
        if e.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        let text = std::fs::read_to_string(e.path()).expect("part file");
        lines.extend(text.lines().map(str::to_owned));
    }
    lines
}

/// The straight run: one shard, no checkpoints, no failures.
fn reference(c: &Case) -> Vec<String> {
    let job = Job::new(JobConfig::new().with_shards(1).with_pinning(Pinning::Never));
    let w = Wiring {
        throttle: Throttle::new(false),
        read: Arc::default(),
        fail: Arc::default(),
    };
    let out = build(&job, c, &w).collect();
    job.run().expect("straight run");
    normalize(c.shape, out.take())
}

struct Run {
    handle: weir_runtime::JobHandle,
    w: Wiring,
    /// Without a transactional sink (at least once): what reached the sink, every attempt's.
    collected: Option<Arc<Mutex<Vec<String>>>>,
}

/// Starts a run; `throttled` until the test is done with it.
fn start(
    c: &Case,
    shards: usize,
    ck: &Path,
    out: &Path,
    restore: Option<RestoreFrom>,
    throttled: bool,
) -> Run {
    let throttle = Throttle::new(throttled);
    let mut config = JobConfig::new()
        .with_shards(shards)
        .with_pinning(Pinning::Never)
        .with_ring_capacity_bytes(64 << 10)
        .with_checkpointing(checkpointing(ck, c.mode));
    if let Some(r) = restore {
        config = config.with_restore(r);
    }
    if c.small_memtables {
        config = config.with_memtable_budget_bytes(512 << 10);
    }
    if c.shape == Shape::SplitWindows {
        // Its throttle is past the source, which polls a batch at a time, and a barrier
        // goes in between polls: 8 records a poll, as the throttled `VecSource` hands out.
        config = config.with_batch_records(8);
    }
    let job = Job::new(config);
    let w = Wiring {
        throttle,
        read: Arc::default(),
        fail: Arc::default(),
    };
    let lines = build(&job, c, &w);
    let collected = if c.mode == Mode::AtLeastOnce {
        let all: Arc<Mutex<Vec<String>>> = Arc::default();
        let to = all.clone();
        lines.for_each(move |l| to.lock().unwrap_or_else(|p| p.into_inner()).push(l));
        Some(all)
    } else {
        lines
            .sink(TransactionalFileSink::new(
                out.to_path_buf(),
                |l: &String, buf: &mut String| buf.push_str(l),
            ))
            .uid("out");
        None
    };
    let handle = job.start().expect("start");
    Run {
        handle,
        w,
        collected,
    }
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Runs the case; `Err` describes a discrepancy. `Ok(true)` when a checkpoint of a stopped
/// run held channel state (in-flight records an unaligned barrier overtook).
fn run_case(c: &Case) -> Result<bool, String> {
    let want = reference(c);
    let dir = tempfile::tempdir().expect("tmp");
    let out = dir.path().join("out");
    let mut ck = dir.path().join("ck0");
    let mut run = Some(start(c, c.shards, &ck, &out, None, true));
    let mut collected: Vec<String> = Vec::new();
    let mut inflight = false;
    let take = |col: &Option<Arc<Mutex<Vec<String>>>>, into: &mut Vec<String>| {
        if let Some(col) = col {
            into.extend(std::mem::take(
                &mut *col.lock().unwrap_or_else(|p| p.into_inner()),
            ));
        }
    };
    for (i, stop) in c.stops.iter().enumerate() {
        let Some(r) = run.take() else { break };
        let last = i + 1 == c.stops.len();
        let h = &r.handle;
        // Far enough, and a checkpoint that began after that point completed.
        wait_until("the stop point", || {
            r.w.read.load(Ordering::Relaxed) >= stop.after || h.is_finished()
        });
        let seen = h.checkpoint_metrics().number_of_completed_checkpoints;
        wait_until("a checkpoint past the stop point", || {
            h.checkpoint_metrics().number_of_completed_checkpoints >= seen + 2 || h.is_finished()
        });
        inflight |= h
            .checkpoint_metrics()
            .history
            .iter()
            .any(|s| s.failure.is_none() && s.persisted_inflight_bytes > 0);
        let restore = match stop.via {
            Via::Failover => {
                let before = h.restarts();
                r.w.fail.store(true, Ordering::Release);
                wait_until("the restart", || h.restarts() > before || h.is_finished());
                if !last {
                    // The same job goes on to its next stop.
                    run = Some(r);
                    continue;
                }
                None
            }
            Via::CancelLatest => {
                h.cancel();
                Some(RestoreFrom::Latest)
            }
            Via::Savepoint => match h.stop_with_savepoint(&dir.path().join("sp")) {
                Ok(sp) => {
                    ck = dir.path().join(format!("ck{}", i + 1));
                    Some(RestoreFrom::Path(sp))
                }
                // The job finished first: nothing to restore.
                Err(_) if h.is_finished() => None,
                Err(e) => return Err(format!("savepoint: {e}")),
            },
        };
        r.w.throttle.release();
        match r.handle.wait() {
            Err(JobError::Cancelled) | Ok(_) => {}
            Err(e) => return Err(format!("run {i}: {e}")),
        }
        take(&r.collected, &mut collected);
        if let Some(restore) = restore {
            run = Some(start(c, stop.shards, &ck, &out, Some(restore), !last));
        }
    }
    if let Some(r) = run {
        r.w.throttle.release();
        r.handle.wait().map_err(|e| format!("last run: {e}"))?;
        take(&r.collected, &mut collected);
    }
    if c.mode == Mode::AtLeastOnce {
        // Replayed records may be counted twice in state (the snapshot of an input that
        // delivered its barrier first can hold records after it), so values may be larger;
        // what must be there is every result by what it is for.
        let got = normalize(c.shape, collected);
        let have: std::collections::HashSet<String> =
            got.iter().map(|l| identity(c.shape, l)).collect();
        let lost: Vec<&String> = want
            .iter()
            .filter(|l| !have.contains(&identity(c.shape, l)))
            .collect();
        if !lost.is_empty() {
            return Err(format!(
                "{} of {} lines lost, e.g. {:?}",
                lost.len(),
                want.len(),
                &lost[..lost.len().min(5)]
            ));
        }
        return Ok(inflight);
    }
    let got = normalize(c.shape, committed_lines(&out));
    if got != want {
        return Err(diff(&want, &got));
    }
    Ok(inflight)
}

/// A short description of how two sorted multisets differ.
fn diff(want: &[String], got: &[String]) -> String {
    let mut count: BTreeMap<&String, i64> = BTreeMap::new();
    for l in want {
        *count.entry(l).or_default() += 1;
    }
    for l in got {
        *count.entry(l).or_default() -= 1;
    }
    let missing: Vec<_> = count.iter().filter(|(_, n)| **n > 0).map(|e| e.0).collect();
    let extra: Vec<_> = count.iter().filter(|(_, n)| **n < 0).map(|e| e.0).collect();
    format!(
        "{} lines expected, {} committed; {} missing (e.g. {:?}), {} extra (e.g. {:?})",
        want.len(),
        got.len(),
        missing.len(),
        &missing[..missing.len().min(4)],
        extra.len(),
        &extra[..extra.len().min(4)]
    )
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
fn restored_jobs_end_with_the_output_of_a_straight_run() {
    let cases = env_u64("WEIR_RESTORE_CASES", DEFAULT_CASES);
    let first = env_u64("WEIR_RESTORE_SEED", 1);
    let mut failures = Vec::new();
    for seed in first..first + cases {
        let c = Case::new(seed);
        let t0 = Instant::now();
        let r = run_case(&c);
        eprintln!(
            "case {seed}: {:?} {:?} {} shards, stops {:?}, {} keys, {} records{}{}{}: {} ({:?})",
            c.shape,
            c.mode,
            c.shards,
            c.stops
                .iter()
                .map(|s| (s.after, s.via, s.shards))
                .collect::<Vec<_>>(),
            c.keys,
            c.n,
            if c.slow { ", slow" } else { "" },
            if c.small_memtables {
                ", small memtables"
            } else {
                ""
            },
            if r == Ok(true) { ", channel state" } else { "" },
            if r.is_ok() { "ok" } else { "FAILED" },
            t0.elapsed()
        );
        if let Err(e) = r {
            eprintln!("  {e}");
            failures.push((c, e));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {cases} cases differ from the straight run:\n{}",
        failures.len(),
        failures
            .iter()
            .map(|(c, e)| format!("{c:?}: {e}"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// A keyed process function with timers and no other keyed state keeps its timers across a
/// restore, on the same number of shards and onto another. Ten keys each register a timer far
/// ahead; the job is checkpointed with all ten pending, cancelled and restored: the restored
/// job fires all ten at the end of input. The restore took timers only from parts whose state
/// segments covered the shard's key groups, and an operator without keyed state has no
/// segments: every timer was lost.
#[test]
fn timers_without_keyed_state_survive_a_restore() {
    for (shards, restore_shards) in [(1, 1), (2, 3), (3, 1)] {
        let dir = tempfile::tempdir().expect("tmp");
        let records: Vec<(u32, i64)> = (0..10).map(|k| (k, i64::from(k))).collect();
        let gate = Arc::new(AtomicU64::new(records.len() as u64));
        let run = |shards: usize, restore: Option<RestoreFrom>| {
            let mut config = JobConfig::new()
                .with_shards(shards)
                .with_pinning(Pinning::Never)
                .with_checkpointing(CheckpointConfig::new(dir.path(), "timers"));
            if let Some(r) = restore {
                config = config.with_restore(r);
            }
            let job = Job::new(config);
            let read = Arc::new(AtomicU64::new(0));
            let out = job
                .source(VecSource {
                    items: Arc::new(records.clone()),
                    throttle: Throttle::new(false),
                    read: read.clone(),
                    gate: gate.clone(),
                })
                .uid("input")
                .assign_timestamps(
                    WatermarkStrategy::monotonous(|r: &(u32, i64)| r.1).with_watermark_per_record(),
                )
                .key_by(|r: &(u32, i64)| r.0)
                .process(TimerAt1000)
                .uid("timers")
                .collect();
            (job.start().expect("start"), read, out)
        };
        // Every record is read, and then the source waits (its input is not over).
        gate.store(records.len() as u64 - 1, Ordering::Release);
        let (h, read, _) = run(shards, None);
        wait_until("the records read", || read.load(Ordering::Acquire) == 9);
        h.trigger_checkpoint().expect("trigger");
        wait_until("the checkpoint", || {
            h.checkpoint_metrics().number_of_completed_checkpoints >= 1
        });
        h.cancel();
        assert!(matches!(h.wait(), Err(JobError::Cancelled)));
        gate.store(u64::MAX, Ordering::Release);
        let (h, _, out) = run(restore_shards, Some(RestoreFrom::Latest));
        h.wait().expect("restored job");
        let mut got = out.take();
        got.sort();
        let want: Vec<(u32, i64)> = (0..10).map(|k| (k, i64::from(k) + 1000)).collect();
        assert_eq!(
            got, want,
            "{shards} -> {restore_shards} shards: the nine restored timers and the last record's"
        );
    }
}

/// Registers a timer 1000 ms after each record; emits (key, time) when it fires.
struct TimerAt1000;

impl KeyedProcessFunction<u32, (u32, i64), (u32, i64)> for TimerAt1000 {
    fn process_element(&self, r: (u32, i64), ctx: &mut KeyedContext<'_, u32, (u32, i64)>) {
        ctx.register_event_timer(r.1 + 1000);
    }

    fn on_timer(&self, ts: i64, _d: TimeDomain, ctx: &mut KeyedContext<'_, u32, (u32, i64)>) {
        let k = *ctx.key();
        ctx.emit((k, ts));
    }
}
