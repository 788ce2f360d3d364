//! Keyed process functions with event-time and processing-time timers, and a keyed join, on
//! several shards and in the test driver, checked against sequential computations.

use std::collections::{BTreeMap, HashMap};

use weir_runtime::testing::TestDriver;
use weir_runtime::{
    CoProcessFunction, Job, JobConfig, KeyedContext, KeyedProcessFunction, Pinning, TimeDomain,
    WatermarkStrategy,
};

fn config(shards: usize) -> JobConfig {
    JobConfig::new()
        .with_shards(shards)
        .with_pinning(Pinning::Never)
}

/// Emits (key, count of records, last timestamp) when a key has been quiet for 100 ms of
/// event time: an event-time timer at last + 100, moved forward by each record.
struct QuietAfter;

impl KeyedProcessFunction<u32, (u32, i64), (u32, u64, i64)> for QuietAfter {
    fn process_element(&self, rec: (u32, i64), ctx: &mut KeyedContext<'_, u32, (u32, u64, i64)>) {
        if let Some(old) = ctx.value::<i64>("last") {
            ctx.delete_timer(TimeDomain::EventTime, old + 100);
        }
        let n = ctx.value::<u64>("n").unwrap_or(0) + 1;
        ctx.set_value("n", &n);
        let last = ctx.value::<i64>("last").map_or(rec.1, |l| l.max(rec.1));
        ctx.set_value("last", &last);
        ctx.register_event_timer(last + 100);
    }

    fn on_timer(
        &self,
        ts: i64,
        domain: TimeDomain,
        ctx: &mut KeyedContext<'_, u32, (u32, u64, i64)>,
    ) {
        assert_eq!(domain, TimeDomain::EventTime);
        let n = ctx.value::<u64>("n").unwrap_or(0);
        let last = ctx.value::<i64>("last").unwrap_or(ts);
        let key = *ctx.key();
        ctx.emit((key, n, last));
        ctx.clear_value("n");
        ctx.clear_value("last");
    }
}

/// The same logic, sequentially: each record is processed, then the watermark `ts - 1` that
/// follows it fires every due timer (the watermark is shared by all keys).
fn quiet_oracle(events: &[(u32, i64)]) -> Vec<(u32, u64, i64)> {
    let mut state: HashMap<u32, (u64, i64)> = HashMap::new();
    let mut timers: BTreeMap<(i64, u32), ()> = BTreeMap::new();
    let mut out = Vec::new();
    let mut fire =
        |upto: i64, state: &mut HashMap<u32, (u64, i64)>, timers: &mut BTreeMap<(i64, u32), ()>| {
            while let Some((&(t, k), _)) = timers.first_key_value() {
                if t > upto {
                    break;
                }
                timers.pop_first();
                if let Some((n, last)) = state.remove(&k) {
                    out.push((k, n, last));
                }
            }
        };
    for &(k, t) in events {
        let e = state.entry(k).or_insert((0, t));
        if e.0 > 0 {
            timers.remove(&(e.1 + 100, k));
        }
        e.0 += 1;
        e.1 = e.1.max(t);
        timers.insert((e.1 + 100, k), ());
        fire(t - 1, &mut state, &mut timers);
    }
    fire(i64::MAX, &mut state, &mut timers);
    out.sort();
    out
}

fn bursty_events() -> Vec<(u32, i64)> {
    let mut v = Vec::new();
    let mut t = 0i64;
    for i in 0..3000u64 {
        let r = weir_runtime::source::splitmix64(11, i);
        // Mostly small steps, sometimes a long pause: bursts per key.
        t += if r.is_multiple_of(50) {
            500
        } else {
            (r % 7) as i64
        };
        v.push(((r >> 8) as u32 % 13, t));
    }
    v
}

/// On several shards the watermark an operator sees depends on when the other shards' sources
/// report (a shard that starts late holds everyone's watermark back), so bursts may be merged;
/// what must hold whatever the timing: every record is counted exactly once, each output ends a
/// run of consecutive records of its key at its `last`, and a run ends only where the key's
/// next record is more than 100 ms later (a timer never fires early).
///
/// All events are read on shard 0, but only once the other shards' sources have ended (and
/// 20 ms later, for their end to reach every shard, and 1 ms before each record after a long
/// pause): the watermark then follows shard 0's
/// records, and timers fire mid-stream. Read at once, the events all passed before the other
/// shards' ends arrived in three runs of five, and every timer fired at the end, with nothing
/// to check. (Several sources racing each other merge nearly every burst; the merge of
/// watermarks is tested on its own in `operator.rs`.)
#[test]
fn event_time_timers_on_four_shards_never_fire_early_nor_lose_records() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let events = bursty_events();
    let job = Job::new(config(4));
    let shared = Arc::new(events.clone());
    let ended = Arc::new(AtomicUsize::new(0));
    let out = job
        .from_iter(move |shard, shards| {
            let (events, ended) = (shared.clone(), ended.clone());
            if shard != 0 {
                // Polled once, empty: the source ends right after.
                let mut told = false;
                let it = std::iter::from_fn(move || {
                    if !std::mem::replace(&mut told, true) {
                        ended.fetch_add(1, Ordering::AcqRel);
                    }
                    None
                });
                return Box::new(it) as Box<dyn Iterator<Item = (u32, i64)>>;
            }
            Box::new((0..events.len()).map(move |i| {
                if i == 0 {
                    while ended.load(Ordering::Acquire) < shards - 1 {
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    }
                    std::thread::sleep(std::time::Duration::from_millis(20));
                } else if events[i].1 - events[i - 1].1 >= 500 {
                    // And before each long pause's end: on a loaded machine an end that took
                    // longer than 20 ms to arrive still leaves later bursts to check.
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                events[i]
            }))
        })
        .assign_timestamps(
            WatermarkStrategy::monotonous(|e: &(u32, i64)| e.1).with_watermark_per_record(),
        )
        .key_by(|e| e.0)
        .process(QuietAfter)
        .uid("quiet")
        .collect();
    job.run().expect("job");
    let mut got = out.take();
    got.sort();
    let mut per_key: BTreeMap<u32, Vec<i64>> = BTreeMap::new();
    for (k, t) in &events {
        per_key.entry(*k).or_default().push(*t);
    }
    let mut checked_gaps = 0usize;
    for (k, ts) in per_key {
        let mut runs: Vec<(u64, i64)> = got
            .iter()
            .filter(|o| o.0 == k)
            .map(|o| (o.1, o.2))
            .collect();
        runs.sort_by_key(|r| r.1);
        let mut i = 0usize;
        for (n, last) in runs {
            i += n as usize;
            assert_eq!(
                ts[i - 1],
                last,
                "key {k}: a run of {n} ends at its last record"
            );
            if let Some(next) = ts.get(i) {
                assert!(
                    next - last > 100,
                    "key {k}: timer at {last}+100 fired before the watermark passed it"
                );
                checked_gaps += 1;
            }
        }
        assert_eq!(i, ts.len(), "key {k}: every record counted once");
    }
    assert!(
        checked_gaps > 0,
        "no timer fired before the end of input: nothing was checked"
    );
}

/// Emits the count of a key's records 1000 ms of processing time after its first record.
struct CountFor1s;

impl KeyedProcessFunction<u32, u32, (u32, u64)> for CountFor1s {
    fn process_element(&self, _rec: u32, ctx: &mut KeyedContext<'_, u32, (u32, u64)>) {
        let n = ctx.value::<u64>("n").unwrap_or(0);
        if n == 0 {
            let at = ctx.current_processing_time() + 1000;
            ctx.register_processing_timer(at);
        }
        ctx.set_value("n", &(n + 1));
    }

    fn on_timer(&self, _ts: i64, domain: TimeDomain, ctx: &mut KeyedContext<'_, u32, (u32, u64)>) {
        assert_eq!(domain, TimeDomain::ProcessingTime);
        let n = ctx.value::<u64>("n").unwrap_or(0);
        let k = *ctx.key();
        ctx.emit((k, n));
        ctx.clear_value("n");
    }
}

#[test]
fn processing_time_timers_fire_when_the_driver_advances_time() {
    let mut d =
        TestDriver::new(|s| s.key_by(|k: &u32| *k).process(CountFor1s).stream()).expect("driver");
    d.set_processing_time(10_000);
    for k in [1, 2, 1, 1] {
        d.push(k);
    }
    assert!(d.drain().expect("run").is_empty(), "no timer is due yet");
    d.set_processing_time(10_999);
    assert!(d.drain().expect("run").is_empty(), "still 1 ms early");
    d.set_processing_time(11_000);
    let mut out = d.drain().expect("run");
    out.sort();
    assert_eq!(out, vec![(1, 3), (2, 1)]);
    d.push(2);
    d.set_processing_time(12_500);
    assert!(
        d.drain().expect("run").is_empty(),
        "the new timer is due at 13500"
    );
    d.set_processing_time(13_500);
    assert_eq!(d.drain().expect("run"), vec![(2, 1)]);
}

/// In a processing-time timer, `timestamp()` is the timer's time and output carries no
/// timestamp, as in Flink's `KeyedProcessOperator` (it erases the output's timestamp and its
/// `OnTimerContext::timestamp` is the timer's); an event-time timer's output carries its time.
/// `timestamp()` was `None` in a processing-time timer.
struct TimerStamps;

impl KeyedProcessFunction<u32, u32, (u32, Option<i64>)> for TimerStamps {
    fn process_element(&self, rec: u32, ctx: &mut KeyedContext<'_, u32, (u32, Option<i64>)>) {
        ctx.register_processing_timer(20);
        ctx.register_event_timer(i64::from(rec));
    }

    fn on_timer(
        &self,
        ts: i64,
        _domain: TimeDomain,
        ctx: &mut KeyedContext<'_, u32, (u32, Option<i64>)>,
    ) {
        assert_eq!(ctx.timestamp(), Some(ts));
        let k = *ctx.key();
        ctx.emit((k, ctx.timestamp()));
    }
}

#[test]
fn a_timer_sees_its_time_and_only_event_time_output_carries_it() {
    let mut d =
        TestDriver::new(|s| s.key_by(|k: &u32| *k).process(TimerStamps).stream()).expect("driver");
    d.set_processing_time(10);
    d.push_at(7, 5);
    d.drain().expect("run");
    d.set_processing_time(20);
    assert_eq!(
        d.drain_with_timestamps().expect("run"),
        vec![((7, Some(20)), None)],
        "a processing-time timer: its time in the context, none on the output"
    );
    d.watermark(7);
    assert_eq!(
        d.drain_with_timestamps().expect("run"),
        vec![((7, Some(7)), Some(7))],
        "an event-time timer: its time on both"
    );
}

/// A processing-time timer registered at or before the current time fires at once, as in
/// Flink, without waiting for time to move: the driver fired it only once the test set
/// another time (a job, at its next millisecond tick).
struct PastTimer;

impl KeyedProcessFunction<u32, u32, (u32, i64)> for PastTimer {
    fn process_element(&self, rec: u32, ctx: &mut KeyedContext<'_, u32, (u32, i64)>) {
        ctx.register_processing_timer(i64::from(rec));
    }

    fn on_timer(&self, ts: i64, _domain: TimeDomain, ctx: &mut KeyedContext<'_, u32, (u32, i64)>) {
        let k = *ctx.key();
        ctx.emit((k, ts));
    }
}

/// A driver at processing time 10 with timers registered at 5, 10 and 11 (`PastTimer`).
fn timers_at_5_10_and_11() -> TestDriver<u32, (u32, i64)> {
    let mut d =
        TestDriver::new(|s| s.key_by(|k: &u32| *k).process(PastTimer).stream()).expect("driver");
    d.set_processing_time(10);
    d.push(5);
    d.push(10);
    d.push(11);
    d
}

#[test]
fn a_processing_timer_in_the_past_fires_without_time_moving() {
    let mut d = timers_at_5_10_and_11();
    let mut out = d.drain().expect("run");
    out.sort();
    assert_eq!(
        out,
        vec![(5, 5), (10, 10)],
        "the timer at 11 is not due yet"
    );
    d.set_processing_time(11);
    assert_eq!(d.drain().expect("run"), vec![(11, 11)]);
}

/// Timers due when the input ends fire; those not yet due never do (Flink stops them at the
/// end of input). A due timer was dropped when the end came in the same step as its record:
/// in the driver always, in a job now and then (112 of 200 in an audit's run).
#[test]
fn timers_due_at_the_end_of_input_fire_and_later_ones_do_not() {
    let mut out = timers_at_5_10_and_11().finish().expect("run");
    out.sort();
    assert_eq!(out, vec![(5, 5), (10, 10)], "the timer at 11 is not due");
    for shards in [1, 2] {
        let job = Job::new(config(shards));
        let out = job
            .from_vec((0..200u32).collect())
            .key_by(|k: &u32| *k)
            .process(DueNow)
            .collect();
        job.run().expect("job");
        assert_eq!(out.take().len(), 200, "{shards} shards: one timer a record");
    }
}

/// Registers a processing-time timer at the current time, due at once.
struct DueNow;

impl KeyedProcessFunction<u32, u32, (u32, i64)> for DueNow {
    fn process_element(&self, _rec: u32, ctx: &mut KeyedContext<'_, u32, (u32, i64)>) {
        let now = ctx.current_processing_time();
        ctx.register_processing_timer(now);
    }

    fn on_timer(&self, ts: i64, _domain: TimeDomain, ctx: &mut KeyedContext<'_, u32, (u32, i64)>) {
        let k = *ctx.key();
        ctx.emit((k, ts));
    }
}

/// Joins orders with payments by order id; each side may come first.
struct OrderPayment;

impl CoProcessFunction<u64, (u64, String), (u64, i64), (u64, String, i64)> for OrderPayment {
    fn process_left(
        &self,
        order: (u64, String),
        ctx: &mut KeyedContext<'_, u64, (u64, String, i64)>,
    ) {
        match ctx.value::<i64>("payment") {
            Some(p) => ctx.emit((order.0, order.1, p)),
            None => ctx.set_value("order", &order.1),
        }
    }

    fn process_right(&self, pay: (u64, i64), ctx: &mut KeyedContext<'_, u64, (u64, String, i64)>) {
        match ctx.value::<String>("order") {
            Some(o) => ctx.emit((pay.0, o, pay.1)),
            None => ctx.set_value("payment", &pay.1),
        }
    }
}

#[test]
fn keyed_join_on_three_shards_matches_sequential() {
    let orders: Vec<(u64, String)> = (0..2000u64)
        .map(|i| (i, format!("item-{}", i % 17)))
        .collect();
    // Payments for every third order, in another order.
    let payments: Vec<(u64, i64)> = (0..2000u64)
        .rev()
        .filter(|i| i % 3 == 0)
        .map(|i| (i, (i * 7 % 1000) as i64))
        .collect();
    let job = Job::new(config(3));
    let o = job.from_vec(orders.clone()).key_by(|o| o.0);
    let p = job.from_vec(payments.clone()).key_by(|p| p.0);
    let out = o.connect(p).process(OrderPayment).uid("join").collect();
    job.run().expect("job");
    let mut got = out.take();
    got.sort();
    let by_id: HashMap<u64, String> = orders.into_iter().collect();
    let mut want: Vec<(u64, String, i64)> = payments
        .iter()
        .map(|(id, amt)| (*id, by_id[id].clone(), *amt))
        .collect();
    want.sort();
    assert_eq!(got, want);
}

#[test]
fn event_time_timers_in_the_driver_match_sequential() {
    let events = bursty_events();
    let mut d = TestDriver::new(|s| {
        s.assign_timestamps(
            WatermarkStrategy::monotonous(|e: &(u32, i64)| e.1).with_watermark_per_record(),
        )
        .key_by(|e| e.0)
        .process(QuietAfter)
        .stream()
    })
    .expect("driver");
    for e in &events {
        d.push(*e);
    }
    let mut got = d.finish().expect("finish");
    got.sort();
    assert_eq!(got, quiet_oracle(&events));
}

/// A late record within the allowed lateness that merges two fired session windows fires
/// the merged window once, at once; the next watermark and the end fire nothing again (each
/// merged result was emitted twice: its firing timer was registered behind the watermark).
#[test]
fn a_late_record_merging_fired_sessions_fires_the_merged_window_once() {
    let mut d = TestDriver::new(|s| {
        s.key_by(|e: &(u32, i64)| e.0)
            .window(weir_runtime::WindowAssigner::session(5))
            .allowed_lateness(100)
            .count_with(|k, w, n| (*k, w.start, w.end, n))
    })
    .expect("driver");
    let mut got = Vec::new();
    let mut step = |d: &mut TestDriver<_, _>, rec: Option<(u32, i64)>, watermark: Option<i64>| {
        if let Some(r) = rec {
            d.push_at(r, r.1);
        }
        if let Some(w) = watermark {
            d.watermark(w);
        }
        d.run_until_idle().expect("run");
        let out = d.drain().expect("drain");
        got.push(out);
    };
    step(&mut d, Some((1, 1)), None);
    step(&mut d, Some((1, 10)), Some(20));
    step(&mut d, Some((1, 5)), None);
    step(&mut d, None, Some(25));
    step(&mut d, Some((1, 12)), None);
    let end = d.finish().expect("finish");
    assert_eq!(
        got,
        vec![
            vec![],
            // Two sessions, [1, 6) and [10, 15), fired by watermark 20.
            vec![(1, 1, 6, 1), (1, 10, 15, 1)],
            // 5 joins them into [1, 15): fired at once.
            vec![(1, 1, 15, 3)],
            // Nothing again at watermark 25.
            vec![],
            // 12 widens it to [1, 17).
            vec![(1, 1, 17, 4)],
        ]
    );
    assert_eq!(end, vec![], "the end fires nothing again");
}

/// The records a driver's operators dropped.
fn dropped<I: weir_runtime::Data, O: weir_runtime::Data>(d: &TestDriver<I, O>) -> u64 {
    d.metrics()
        .operators
        .iter()
        .map(|o| o.records_dropped)
        .sum()
}

/// A record whose own session is late joins a live session that its window touches, as in
/// Flink (`WindowOperator` merges first, then asks whether the merged window is late): it
/// was dropped as late. A record whose merged window is late is still dropped, once.
#[test]
fn a_late_record_joins_a_live_session_it_touches() {
    let mut d = TestDriver::new(|s| {
        s.key_by(|e: &(u32, i64)| e.0)
            .window(weir_runtime::WindowAssigner::session(10))
            .count_with(|k, w, n| (*k, w.start, w.end, n))
    })
    .expect("driver");
    d.push_at((1, 10), 10);
    d.watermark(15);
    // Its own session, [5, 15), is late; merged with [10, 20) it is not.
    d.push_at((1, 5), 5);
    d.run_until_idle().expect("run");
    assert_eq!(dropped(&d), 0, "5 joined the live session");
    d.watermark(30);
    d.run_until_idle().expect("run");
    assert_eq!(d.drain().expect("drain"), vec![(1, 5, 20, 2)]);
    // [2, 12) touches no live session: late, dropped.
    d.push_at((1, 2), 2);
    assert_eq!(d.finish().expect("finish"), vec![]);
    assert_eq!(dropped(&d), 1);
}

/// A record counts as dropped once, and only when none of its windows takes it (Flink's
/// `numLateRecordsDropped`): a sliding window's record counted once per late window.
#[test]
fn a_sliding_window_record_is_dropped_once_and_only_when_every_window_is_late() {
    let mut d = TestDriver::new(|s| {
        s.key_by(|e: &(u32, i64)| e.0)
            .window(weir_runtime::WindowAssigner::sliding(30, 10))
            .count_with(|k, w, n| (*k, w.start, w.end, n))
    })
    .expect("driver");
    d.push_at((1, 100), 100);
    d.watermark(99);
    // [50, 80), [60, 90) and [70, 100): every window late.
    d.push_at((1, 75), 75);
    // [70, 100) late; [80, 110) and [90, 120) take it.
    d.push_at((1, 95), 95);
    let mut got = d.finish().expect("finish");
    got.sort();
    assert_eq!(
        got,
        vec![(1, 80, 110, 2), (1, 90, 120, 2), (1, 100, 130, 1)]
    );
    assert_eq!(dropped(&d), 1);
}

/// A record in the gap between sliding windows that slide further than they last belongs to
/// no window: it is not dropped as late unless it is late itself (Flink counts a record that
/// no window takes only if `timestamp + allowed lateness <= watermark`). Before, every such
/// record counted as dropped, on time or not.
#[test]
fn a_record_between_sliding_windows_is_dropped_only_if_late() {
    let mut d = TestDriver::new(|s| {
        s.key_by(|e: &(u32, i64)| e.0)
            .window(weir_runtime::WindowAssigner::sliding(30, 70))
            .count_with(|k, w, n| (*k, w.start, w.end, n))
    })
    .expect("driver");
    // Windows [0, 30), [70, 100), [140, 170): 50 and 110 fall between them.
    d.push_at((1, 10), 10);
    d.push_at((1, 50), 50);
    d.push_at((1, 80), 80);
    d.run_until_idle().expect("run");
    assert_eq!(dropped(&d), 0, "a record on time in a gap");
    d.watermark(120);
    // Late, and in a gap: dropped. Late, in [70, 100), past its end: dropped.
    d.push_at((1, 110), 110);
    d.push_at((1, 90), 90);
    let mut got = d.finish().expect("finish");
    got.sort();
    assert_eq!(got, vec![(1, 0, 30, 1), (1, 70, 100, 1)]);
    assert_eq!(dropped(&d), 2);
}

/// Allowed lateness: a window fires at the watermark, again for each late record within the
/// lateness (with everything so far), and drops records after it; the firings are those of a
/// sequential reading of the same input.
#[test]
fn late_records_within_the_allowed_lateness_fire_their_window_again() {
    let mut d = TestDriver::new(|s| {
        s.key_by(|e: &(u32, i64)| e.0)
            .window(weir_runtime::WindowAssigner::tumbling(100))
            .allowed_lateness(50)
            .count_with(|k, w, n| (*k, w.start, n))
    })
    .expect("driver");
    // Key 1's window [0, 100) closes at watermark 99; its lateness ends at 149.
    for (rec, ts, watermark) in [
        ((1, 10), 10, None),
        ((1, 20), 20, None),
        ((2, 60), 60, Some(120)),
        ((1, 30), 30, None),
        ((1, 40), 40, Some(200)),
        ((1, 50), 50, None),
        ((1, 210), 210, None),
    ] {
        d.push_at(rec, ts);
        if let Some(w) = watermark {
            d.watermark(w);
        }
        d.run_until_idle().expect("run");
    }
    let got = d.finish().expect("finish");
    assert_eq!(
        got,
        vec![
            // At watermark 120: both windows of [0, 100).
            (1, 0, 2),
            (2, 0, 1),
            // Late, within the lateness: fired again with 3, then 4 records.
            (1, 0, 3),
            (1, 0, 4),
            // (1, 50) came after watermark 200 passed 149: dropped. The end fires [200, 300).
            (1, 200, 1),
        ]
    );
}

/// Map state in a keyed process function (Flink's `MapState`): per key, how often each value
/// came, with entries removed at a count of 3 and the whole map cleared by value 0; every
/// record emits the key's map as it then is. A 2-shard job and the test driver give what a
/// sequential reading gives.
struct ValueCounts;

impl KeyedProcessFunction<u32, (u32, u64), (u32, Vec<(u64, u32)>)> for ValueCounts {
    fn process_element(
        &self,
        rec: (u32, u64),
        ctx: &mut KeyedContext<'_, u32, (u32, Vec<(u64, u32)>)>,
    ) {
        if rec.1 == 0 {
            ctx.clear_map("counts");
        } else {
            let n = ctx.map_get::<u64, u32>("counts", &rec.1).unwrap_or(0) + 1;
            if n == 3 {
                ctx.map_remove("counts", &rec.1);
            } else {
                ctx.map_put("counts", &rec.1, &n);
            }
        }
        let entries = ctx.map_entries::<u64, u32>("counts");
        ctx.emit((rec.0, entries));
    }
}

#[test]
fn map_state_in_a_process_function_matches_a_sequential_reading() {
    let recs: Vec<(u32, u64)> = (0..20_000u64)
        .map(|i| {
            let r = weir_runtime::source::splitmix64(5, i);
            ((r % 17) as u32, (r >> 20) % 9)
        })
        .collect();
    let mut maps: HashMap<u32, BTreeMap<u64, u32>> = HashMap::new();
    let mut want: Vec<(u32, Vec<(u64, u32)>)> = Vec::new();
    for &(k, v) in &recs {
        let m = maps.entry(k).or_default();
        if v == 0 {
            m.clear();
        } else {
            let n = m.get(&v).copied().unwrap_or(0) + 1;
            if n == 3 {
                m.remove(&v);
            } else {
                m.insert(v, n);
            }
        }
        want.push((k, m.iter().map(|(a, b)| (*a, *b)).collect()));
    }
    // Per key in input order (shards interleave keys, never one key's records).
    let per_key = |v: &[(u32, Vec<(u64, u32)>)]| {
        let mut by: BTreeMap<u32, Vec<Vec<(u64, u32)>>> = BTreeMap::new();
        for (k, m) in v {
            by.entry(*k).or_default().push(m.clone());
        }
        by
    };
    let job = Job::new(config(2));
    let out = job
        .from_vec(recs.clone())
        .key_by(|r: &(u32, u64)| r.0)
        .process(ValueCounts)
        .uid("counts")
        .collect();
    job.run().expect("job");
    assert_eq!(per_key(&out.take()), per_key(&want));

    let mut d = TestDriver::new(|s| s.key_by(|r: &(u32, u64)| r.0).process(ValueCounts).stream())
        .expect("driver");
    for r in &recs {
        d.push(*r);
    }
    assert_eq!(d.finish().expect("finish"), want);
}

/// The mean of the values added (Flink's `AggregatingState` with an `AggregateFunction`).
struct Mean;

impl weir_runtime::AggregateFunction<u64, (u64, u64), f64> for Mean {
    fn create(&self) -> (u64, u64) {
        (0, 0)
    }
    fn add(&self, acc: (u64, u64), v: u64) -> (u64, u64) {
        (acc.0 + v, acc.1 + 1)
    }
    fn result(&self, acc: &(u64, u64)) -> f64 {
        acc.0 as f64 / acc.1 as f64
    }
    fn merge(&self, a: (u64, u64), b: (u64, u64)) -> (u64, u64) {
        (a.0 + b.0, a.1 + b.1)
    }
}

/// Reducing and aggregating state in a keyed process function: per key, the largest value
/// (reducing) and the mean (aggregating) since the last 0, which clears both. Every record
/// emits (key, largest, mean, mean read back with `aggregating_get`).
struct MaxAndMean;

type MaxMean = (u32, u64, f64, f64);

impl KeyedProcessFunction<u32, (u32, u64), MaxMean> for MaxAndMean {
    fn process_element(&self, rec: (u32, u64), ctx: &mut KeyedContext<'_, u32, MaxMean>) {
        if rec.1 == 0 {
            ctx.clear_value("max");
            ctx.clear_value("mean");
            return;
        }
        let max = ctx.reducing_add("max", rec.1, u64::max).expect("max");
        let mean = ctx.aggregating_add("mean", &Mean, rec.1).expect("mean");
        let read = ctx.aggregating_get("mean", &Mean).expect("read back");
        ctx.emit((rec.0, max, mean, read));
    }
}

#[test]
fn reducing_and_aggregating_state_match_a_sequential_reading() {
    let recs: Vec<(u32, u64)> = (0..20_000u64)
        .map(|i| {
            let r = weir_runtime::source::splitmix64(11, i);
            ((r % 13) as u32, (r >> 20) % 50)
        })
        .collect();
    let mut by_key: HashMap<u32, Vec<u64>> = HashMap::new();
    let mut want: Vec<MaxMean> = Vec::new();
    for &(k, v) in &recs {
        let seen = by_key.entry(k).or_default();
        if v == 0 {
            seen.clear();
            continue;
        }
        seen.push(v);
        let max = *seen.iter().max().expect("a value");
        let mean = seen.iter().sum::<u64>() as f64 / seen.len() as f64;
        want.push((k, max, mean, mean));
    }
    let per_key = |v: &[MaxMean]| {
        let mut by: BTreeMap<u32, Vec<(u64, u64, u64)>> = BTreeMap::new();
        for &(k, max, mean, read) in v {
            by.entry(k)
                .or_default()
                .push((max, mean.to_bits(), read.to_bits()));
        }
        by
    };
    let job = Job::new(config(2));
    let out = job
        .from_vec(recs.clone())
        .key_by(|r: &(u32, u64)| r.0)
        .process(MaxAndMean)
        .uid("max-mean")
        .collect();
    job.run().expect("job");
    assert_eq!(per_key(&out.take()), per_key(&want));

    let mut d = TestDriver::new(|s| s.key_by(|r: &(u32, u64)| r.0).process(MaxAndMean).stream())
        .expect("driver");
    for r in &recs {
        d.push(*r);
    }
    assert_eq!(d.finish().expect("finish"), want);
}

/// Per key: on (key, 1) writes a value, appends to a list and puts a map entry, all of states
/// with a TTL, and a value of a state without one; on (key, 0) emits what it reads of each.
struct TtlProbe;

/// (key, value, list, map entries, value without TTL)
type Probe = (u32, Option<u64>, Vec<u64>, Vec<(u32, u64)>, Option<u64>);

impl KeyedProcessFunction<u32, (u32, u64), Probe> for TtlProbe {
    fn process_element(&self, rec: (u32, u64), ctx: &mut KeyedContext<'_, u32, Probe>) {
        if rec.1 == 0 {
            let out = (
                rec.0,
                ctx.value::<u64>("v"),
                ctx.list::<u64>("l"),
                ctx.map_entries::<u32, u64>("m"),
                ctx.value::<u64>("kept"),
            );
            ctx.emit(out);
            return;
        }
        let now = ctx.current_processing_time() as u64;
        ctx.set_value("v", &now);
        ctx.append("l", &now);
        ctx.map_put("m", &(now as u32), &now);
        ctx.set_value("kept", &now);
    }
}

fn ttl_driver() -> TestDriver<(u32, u64), Probe> {
    TestDriver::new(|s| {
        s.key_by(|r: &(u32, u64)| r.0)
            .process(TtlProbe)
            .state_ttl("v", std::time::Duration::from_millis(100))
            .state_ttl("l", std::time::Duration::from_millis(100))
            .state_ttl("m", std::time::Duration::from_millis(100))
            .stream()
    })
    .expect("driver")
}

#[test]
fn state_ttl_expires_entries_in_processing_time() {
    let mut d = ttl_driver();
    let step = |d: &mut TestDriver<(u32, u64), Probe>, now: i64, rec: (u32, u64)| {
        d.set_processing_time(now);
        d.push(rec);
        d.drain().expect("run")
    };
    assert!(step(&mut d, 1_000, (7, 1)).is_empty());
    // 99 ms after the write: everything is there.
    assert_eq!(
        step(&mut d, 1_099, (7, 0)),
        vec![(
            7,
            Some(1_000),
            vec![1_000],
            vec![(1_000, 1_000)],
            Some(1_000)
        )]
    );
    // A second write refreshes the value and the map entry it overwrites, and adds a list
    // element and a map entry of its own, each with its own expiry.
    assert!(step(&mut d, 1_050, (7, 1)).is_empty());
    assert_eq!(
        step(&mut d, 1_100, (7, 0)),
        vec![(
            7,
            Some(1_050),
            vec![1_050],
            vec![(1_050, 1_050)],
            Some(1_050)
        )]
    );
    // 100 ms after the last write: the TTL'd states are gone, the state without TTL stays.
    assert_eq!(
        step(&mut d, 1_150, (7, 0)),
        vec![(7, None, vec![], vec![], Some(1_050))]
    );
    // Another key is untouched by the first's expiry, and expires on its own clock.
    assert!(step(&mut d, 1_200, (8, 1)).is_empty());
    assert_eq!(
        step(&mut d, 1_250, (8, 0)),
        vec![(
            8,
            Some(1_200),
            vec![1_200],
            vec![(1_200, 1_200)],
            Some(1_200)
        )]
    );
}

#[test]
fn a_state_ttl_under_a_millisecond_is_refused() {
    let r = TestDriver::<(u32, u64), Probe>::new(|s| {
        s.key_by(|r: &(u32, u64)| r.0)
            .process(TtlProbe)
            .state_ttl("v", std::time::Duration::from_micros(500))
            .stream()
    });
    let e = r.err().expect("refused").to_string();
    assert!(
        e.contains("state `v`") && e.contains("at least 1 ms"),
        "{e}"
    );
}

/// A keyed operator's output chains on without `.stream()`, as Flink's
/// `SingleOutputStreamOperator` does: filter, map and a second key_by after `process`.
#[test]
fn a_process_functions_output_chains_on() {
    let recs: Vec<(u32, u64)> = (0..5_000u64)
        .map(|i| ((i % 7) as u32, 1 + i % 40))
        .collect();
    let job = Job::new(config(2));
    let out = job
        .from_vec(recs.clone())
        .key_by(|r: &(u32, u64)| r.0)
        .process(MaxAndMean)
        .filter(|r: &MaxMean| r.1 >= 20)
        .map(|r: MaxMean| (r.0 % 2, 1u64))
        .key_by(|r: &(u32, u64)| r.0)
        .reduce(|a, b| (a.0, a.1 + b.1))
        .collect();
    job.run().expect("job");
    let mut max: HashMap<u32, u64> = HashMap::new();
    let mut want: BTreeMap<u32, u64> = BTreeMap::new();
    for &(k, v) in &recs {
        let m = max.entry(k).or_default();
        *m = (*m).max(v);
        if *m >= 20 {
            *want.entry(k % 2).or_default() += 1;
        }
    }
    let mut got: BTreeMap<u32, u64> = BTreeMap::new();
    for (k, n) in out.take() {
        let e = got.entry(k).or_default();
        *e = (*e).max(n);
    }
    assert_eq!(got, want);
}

/// A state name used with another value type, or as another kind, fails the job with an
/// error naming the state (in-memory values are read as the type of the first use).
#[test]
fn a_state_name_used_with_another_type_fails_the_job_naming_it() {
    for case in 0..2 {
        let mut d = TestDriver::new(move |s| {
            s.key_by(|r: &(u32, u64)| r.0)
                .process(weir_runtime::FnProcess::new(
                    move |r: (u32, u64), ctx: &mut KeyedContext<'_, u32, u64>| {
                        ctx.set_value("z", &(r.1 as u32));
                        match case {
                            0 => {
                                let _ = ctx.value::<String>("z");
                            }
                            _ => ctx.append("z", &r.1),
                        }
                        ctx.emit(r.1);
                    },
                ))
                .stream()
        })
        .expect("driver");
        d.push((1, 7));
        let e = d.finish().expect_err("a type mismatch").to_string();
        assert!(e.contains("state `") && e.contains("/z`"), "{e}");
    }
}

/// Two keyed operators' outputs union without conversions, either way round.
#[test]
fn process_functions_outputs_union() {
    let recs: Vec<(u32, u64)> = (0..2_000u64).map(|i| ((i % 5) as u32, 1 + i % 9)).collect();
    let job = Job::new(config(2));
    let a = job
        .from_vec(recs.clone())
        .key_by(|r: &(u32, u64)| r.0)
        .process(MaxAndMean);
    let keyed = || {
        job.from_vec(recs.clone())
            .key_by(|r: &(u32, u64)| r.0)
            .process(MaxAndMean)
    };
    let (b, d) = (keyed(), keyed());
    let c = job
        .from_vec(recs.clone())
        .map(|r: (u32, u64)| (r.0, r.1, 0.0, 0.0));
    let out = c.union(a.union(b)).union(d).collect();
    job.run().expect("job");
    assert_eq!(out.take().len(), 4 * recs.len());
}
