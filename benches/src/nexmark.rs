//! Nexmark (Tucker et al., as Apache Beam's and Flink's nexmark suites run it): an auction
//! site's event stream (persons, auctions, bids) and queries over it.
//!
//! Each row runs one query as a weir job on two shards, and the same query as a plain
//! sequential Rust loop over the same events on one thread (the baseline): `per_wall_sec` and
//! `per_cpu_sec` count events in per second, `ratio` is weir's events per CPU second over the
//! loop's. Both sides reduce their output to a count and an order-independent digest, and
//! `outputs_match` says whether they agree (1) or not (0): the figure is of a job that computed
//! the right answer.
//!
//! The generator follows Nexmark's shape, deterministically from the event index (so a shard
//! makes its events independently and the loop makes the same ones): of every 50 events one
//! is a person, 3 are auctions and 46 are bids; sellers and bidders are recent persons, a
//! quarter of them "hot", bids go half to the newest (hot) auctions, half to one of the last
//! 100. Event time advances 1 ms per 100 events, so a 10 s window holds a million events.
//! Differences to the reference generator: no `extra` padding fields, no URLs or
//! descriptions, prices uniform instead of log-scaled.
//!
//! Queries (Flink nexmark numbering): q0 pass-through of bids; q1 currency conversion; q2
//! selection (`auction % 123 == 0`); q3 local item suggestion (join of category-10 auctions
//! with their sellers in OR, ID or CA); q5 hot items (the auctions with the most bids per
//! sliding window, 10 s every 2 s); q7 highest bid per 10 s tumbling window; q8 new users
//! (persons who opened an auction in the 10 s window they registered in); q11 user sessions
//! (bids per bidder per session window, 10 s gap). Sources that read
//! two kinds (q3, q8) run the generator twice, each keeping one kind; the loop generates once.

// The loops' maps: hashbrown with foldhash, as fast as a sequential loop's maps come (std's
// SipHash made q5's loop, five map updates a bid, spend most of its time hashing).
use hashbrown::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use rkyv::{Archive, Deserialize, Serialize};
use weir_runtime::sink::{Sink, SinkWriter};
use weir_runtime::source::{splitmix64, GeneratorSource};
use weir_runtime::{
    CoProcessFunction, Job, KeyedContext, KeyedProcessFunction, StartError, Stream, TimeDomain,
    WatermarkStrategy, WindowAssigner,
};

use crate::runtime::{measure, row, Measured};
use crate::{BenchResult, Opts};

/// Of every `PROPORTION` events, one person, `AUCTIONS` auctions, the rest bids.
const PROPORTION: u64 = 50;
const AUCTIONS: u64 = 3;
/// Ids start here (Nexmark's first person and auction ids).
const FIRST_ID: u64 = 1000;
/// Sellers and bidders are among the last this many persons.
const ACTIVE_PEOPLE: u64 = 1000;
/// Non-hot bids go to one of the last this many auctions.
const IN_FLIGHT_AUCTIONS: u64 = 100;
/// Event time: this many events per millisecond.
const EVENTS_PER_MS: u64 = 100;
/// Event time of event 0 (ms since the epoch).
const BASE_TIME_MS: i64 = 1_700_000_000_000;
/// Window sizes of q5, q7, q8.
const WINDOW_MS: i64 = 10_000;
const SLIDE_MS: i64 = 2_000;
/// Watermarks trail the largest timestamp by this much (the shards' sources interleave
/// indices, so their event times are close).
const OUT_OF_ORDERNESS_MS: i64 = 100;
const SEED: u64 = 0x6e65_786d_6172_6b21;

const STATES: [&str; 6] = ["AZ", "CA", "ID", "OR", "WA", "WY"];
const CITIES: [&str; 10] = [
    "Phoenix",
    "Los Angeles",
    "San Francisco",
    "Boise",
    "Portland",
    "Bend",
    "Redmond",
    "Seattle",
    "Kent",
    "Cheyenne",
];
const FIRST_NAMES: [&str; 11] = [
    "Peter", "Paul", "Luke", "John", "Saul", "Vicky", "Kate", "Julie", "Sarah", "Deiter", "Walter",
];
const LAST_NAMES: [&str; 9] = [
    "Shultz", "Abrams", "Spencer", "White", "Bartels", "Walton", "Smith", "Jones", "Noris",
];

#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Person {
    pub id: u64,
    pub name: String,
    pub city: String,
    pub state: String,
    pub ts: i64,
}

#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Auction {
    pub id: u64,
    pub seller: u64,
    pub category: u64,
    pub initial_bid: u64,
    pub ts: i64,
}

#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash)]
pub struct Bid {
    pub auction: u64,
    pub bidder: u64,
    pub price: u64,
    pub ts: i64,
}

/// One Nexmark event.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum Event {
    Person(Person),
    Auction(Auction),
    Bid(Bid),
}

/// The newest person id at event `i` (the person of `i`'s block of 50 comes first).
fn last_person(i: u64) -> u64 {
    FIRST_ID + i / PROPORTION
}

/// The newest auction id at a bid `i` (its block's auctions come before its bids).
fn last_auction(i: u64) -> u64 {
    FIRST_ID + (i / PROPORTION) * AUCTIONS + AUCTIONS - 1
}

/// A recent person: a quarter hot (the newest, rounded down to a multiple of 4), the rest one
/// of the last `ACTIVE_PEOPLE`.
fn recent_person(i: u64, r: u64) -> u64 {
    let last = last_person(i);
    if r.is_multiple_of(4) {
        (last / 4 * 4).max(FIRST_ID)
    } else {
        last - (r >> 8) % ACTIVE_PEOPLE.min(last - FIRST_ID + 1)
    }
}

/// Event `i` of the stream (`r` is its random word, `splitmix64(SEED, i)`).
pub fn event(i: u64, r: u64) -> Event {
    let ts = BASE_TIME_MS + (i / EVENTS_PER_MS) as i64;
    let off = i % PROPORTION;
    if off == 0 {
        let id = last_person(i);
        let first = FIRST_NAMES[(r % 11) as usize];
        let last = LAST_NAMES[((r >> 8) % 9) as usize];
        Event::Person(Person {
            id,
            name: format!("{first} {last}"),
            city: CITIES[((r >> 16) % 10) as usize].to_string(),
            state: STATES[((r >> 24) % 6) as usize].to_string(),
            ts,
        })
    } else if off <= AUCTIONS {
        Event::Auction(Auction {
            id: FIRST_ID + (i / PROPORTION) * AUCTIONS + off - 1,
            seller: recent_person(i, r),
            category: 10 + (r >> 40) % 5,
            initial_bid: 100 + (r >> 44) % 10_000,
            ts,
        })
    } else {
        let last = last_auction(i);
        let auction = if r & 1 == 0 {
            // Hot: the newest auctions (Nexmark's hot auction ratio 2).
            last / 2 * 2
        } else {
            last - (r >> 4) % IN_FLIGHT_AUCTIONS.min(last - FIRST_ID + 1)
        };
        Event::Bid(Bid {
            auction,
            bidder: recent_person(i, r >> 20),
            price: 100 + (r >> 40) % 10_000_000,
            ts,
        })
    }
}

/// An order-independent digest of a multiset of outputs: the wrapping sum of their hashes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Digest {
    pub count: u64,
    pub sum: u64,
}

impl Digest {
    pub fn add<T: Hash>(&mut self, v: &T) {
        let mut h = Mix(0x243f_6a88_85a3_08d3);
        v.hash(&mut h);
        self.count += 1;
        self.sum = self.sum.wrapping_add(splitmix64(h.0, 0));
    }
}

/// A small deterministic hasher (std's default is seeded per process).
struct Mix(u64);

impl Hasher for Mix {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = splitmix64(self.0, v);
    }
    fn write_i64(&mut self, v: i64) {
        self.write_u64(v as u64);
    }
}

/// Digests every record per shard; adds into the shared total when the shard finishes.
struct DigestSink(Arc<[AtomicU64; 2]>);
struct DigestWriter(Arc<[AtomicU64; 2]>, Digest);

impl<T: Hash + 'static> SinkWriter<T> for DigestWriter {
    #[inline]
    fn write(&mut self, rec: T, _ts: i64) -> std::io::Result<()> {
        self.1.add(&rec);
        Ok(())
    }
    fn finish(&mut self) -> std::io::Result<()> {
        self.0[0].fetch_add(self.1.count, Ordering::Relaxed);
        self.0[1].fetch_add(self.1.sum, Ordering::Relaxed);
        Ok(())
    }
}

impl<T: Hash + 'static> Sink<T> for DigestSink {
    fn create_writer(&self, _: usize, _: usize) -> Result<Box<dyn SinkWriter<T>>, StartError> {
        Ok(Box::new(DigestWriter(self.0.clone(), Digest::default())))
    }
}

/// A query: its name, the weir job over `n` events, and the sequential loop.
pub struct Query {
    pub name: &'static str,
    pub job: fn(u64) -> Digest,
    pub baseline: fn(u64) -> Digest,
}

pub const QUERIES: [Query; 8] = [
    Query {
        name: "q0",
        job: q0_job,
        baseline: q0_loop,
    },
    Query {
        name: "q1",
        job: q1_job,
        baseline: q1_loop,
    },
    Query {
        name: "q2",
        job: q2_job,
        baseline: q2_loop,
    },
    Query {
        name: "q3",
        job: q3_job,
        baseline: q3_loop,
    },
    Query {
        name: "q5",
        job: q5_job,
        baseline: q5_loop,
    },
    Query {
        name: "q7",
        job: q7_job,
        baseline: q7_loop,
    },
    Query {
        name: "q8",
        job: q8_job,
        baseline: q8_loop,
    },
    Query {
        name: "q11",
        job: q11_job,
        baseline: q11_loop,
    },
];

const SHARDS: usize = 2;

/// Runs the job whose output `build` sends into the digest sink, and returns the digest.
fn run_job<T: weir_runtime::Data + Hash>(
    n: u64,
    build: impl FnOnce(&Job, u64) -> Stream<T>,
) -> Digest {
    let out = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
    let job = Job::new(crate::runtime::config(SHARDS));
    build(&job, n).sink(DigestSink(out.clone()));
    job.run().expect("nexmark job");
    Digest {
        count: out[0].load(Ordering::Relaxed),
        sum: out[1].load(Ordering::Relaxed),
    }
}

fn events(job: &Job, n: u64) -> Stream<Event> {
    job.source(GeneratorSource::new(Some(n), SEED, event))
}

fn bids(job: &Job, n: u64) -> Stream<Bid> {
    events(job, n).filter_map(|e| match e {
        Event::Bid(b) => Some(b),
        _ => None,
    })
}

/// Bids with their event time and watermarks.
fn timed_bids(job: &Job, n: u64) -> Stream<Bid> {
    bids(job, n).assign_timestamps(WatermarkStrategy::bounded_out_of_orderness(
        OUT_OF_ORDERNESS_MS,
        |b: &Bid| b.ts,
    ))
}

/// Every event of the loop's side, in index order.
fn each_event(n: u64, mut f: impl FnMut(Event)) {
    for i in 0..n {
        f(event(i, splitmix64(SEED, i)));
    }
}

fn each_bid(n: u64, mut f: impl FnMut(Bid)) {
    each_event(n, |e| {
        if let Event::Bid(b) = e {
            f(b)
        }
    });
}

// q0: pass-through.
fn q0_job(n: u64) -> Digest {
    run_job(n, bids)
}

fn q0_loop(n: u64) -> Digest {
    let mut d = Digest::default();
    each_bid(n, |b| d.add(&b));
    d
}

// q1: currency conversion (dollars to euros at 0.908).
fn euros(b: Bid) -> (u64, u64, u64, i64) {
    (b.auction, b.bidder, b.price * 908 / 1000, b.ts)
}

fn q1_job(n: u64) -> Digest {
    run_job(n, |job, n| bids(job, n).map(euros))
}

fn q1_loop(n: u64) -> Digest {
    let mut d = Digest::default();
    each_bid(n, |b| d.add(&euros(b)));
    d
}

// q2: selection.
fn q2_job(n: u64) -> Digest {
    run_job(n, |job, n| {
        bids(job, n)
            .filter(|b| b.auction % 123 == 0)
            .map(|b| (b.auction, b.price))
    })
}

fn q2_loop(n: u64) -> Digest {
    let mut d = Digest::default();
    each_bid(n, |b| {
        if b.auction % 123 == 0 {
            d.add(&(b.auction, b.price));
        }
    });
    d
}

// q3: local item suggestion.
fn q3_state(s: &str) -> bool {
    matches!(s, "OR" | "ID" | "CA")
}

/// Joins category-10 auctions with their sellers (person ids are unique: a person is stored
/// once, an auction only until its seller arrives).
struct Q3Join;

impl CoProcessFunction<u64, Person, Auction, (String, String, String, u64)> for Q3Join {
    fn process_left(
        &self,
        p: Person,
        ctx: &mut KeyedContext<'_, u64, (String, String, String, u64)>,
    ) {
        for a in ctx.list::<u64>("auctions") {
            ctx.emit((p.name.clone(), p.city.clone(), p.state.clone(), a));
        }
        ctx.clear_list("auctions");
        ctx.set_value("person", &p);
    }

    fn process_right(
        &self,
        a: Auction,
        ctx: &mut KeyedContext<'_, u64, (String, String, String, u64)>,
    ) {
        match ctx.value::<Person>("person") {
            Some(p) => ctx.emit((p.name, p.city, p.state, a.id)),
            None => ctx.append("auctions", &a.id),
        }
    }
}

fn q3_job(n: u64) -> Digest {
    run_job(n, |job, n| {
        let persons = events(job, n)
            .uid("persons")
            .filter_map(|e| match e {
                Event::Person(p) if q3_state(&p.state) => Some(p),
                _ => None,
            })
            .key_by(|p: &Person| p.id);
        let auctions = job
            .source(GeneratorSource::new(Some(n), SEED, event))
            .uid("auctions")
            .filter_map(|e| match e {
                Event::Auction(a) if a.category == 10 => Some(a),
                _ => None,
            })
            .key_by(|a: &Auction| a.seller);
        persons.connect(auctions).process(Q3Join).stream()
    })
}

fn q3_loop(n: u64) -> Digest {
    let mut d = Digest::default();
    let mut persons: HashMap<u64, Person> = HashMap::new();
    each_event(n, |e| match e {
        Event::Person(p) if q3_state(&p.state) => {
            persons.insert(p.id, p);
        }
        Event::Auction(a) if a.category == 10 => {
            // Sellers are persons of earlier events: the loop sees them first.
            if let Some(p) = persons.get(&a.seller) {
                d.add(&(p.name.clone(), p.city.clone(), p.state.clone(), a.id));
            }
        }
        _ => {}
    });
    d
}

/// Per window end: the largest value seen and the items that have it; emitted once the
/// watermark passes the window (every upstream window result for it has arrived by then).
struct MaxPerWindow;

impl KeyedProcessFunction<i64, (u64, i64, u64), (u64, i64, u64)> for MaxPerWindow {
    fn process_element(
        &self,
        (item, end, v): (u64, i64, u64),
        ctx: &mut KeyedContext<'_, i64, (u64, i64, u64)>,
    ) {
        let (max, mut items) = ctx
            .value::<(u64, Vec<u64>)>("max")
            .unwrap_or((0, Vec::new()));
        if items.is_empty() {
            ctx.register_event_timer(end - 1);
        }
        if v > max || items.is_empty() {
            ctx.set_value("max", &(v, vec![item]));
        } else if v == max {
            items.push(item);
            ctx.set_value("max", &(max, items));
        }
    }

    fn on_timer(
        &self,
        _ts: i64,
        _domain: TimeDomain,
        ctx: &mut KeyedContext<'_, i64, (u64, i64, u64)>,
    ) {
        if let Some((max, items)) = ctx.value::<(u64, Vec<u64>)>("max") {
            let end = *ctx.key();
            for item in items {
                ctx.emit((item, end, max));
            }
        }
        ctx.clear_value("max");
    }
}

// q5: hot items.
fn q5_job(n: u64) -> Digest {
    run_job(n, |job, n| {
        timed_bids(job, n)
            .key_by(|b: &Bid| b.auction)
            .window(WindowAssigner::sliding(WINDOW_MS, SLIDE_MS))
            .count_with(|auction, w, count| (*auction, w.end, count))
            .uid("bids-per-auction")
            .key_by(|r: &(u64, i64, u64)| r.1)
            .process(MaxPerWindow)
            .uid("hottest")
    })
}

/// The items with the largest value per window end, from (window end, item) -> value.
fn max_per_window(counts: HashMap<(i64, u64), u64>, d: &mut Digest) {
    let mut best: HashMap<i64, (u64, Vec<u64>)> = HashMap::new();
    for ((end, item), v) in counts {
        let e = best.entry(end).or_insert((v, Vec::new()));
        if v > e.0 {
            *e = (v, vec![item]);
        } else if v == e.0 {
            e.1.push(item);
        }
    }
    for (end, (max, items)) in best {
        for item in items {
            d.add(&(item, end, max));
        }
    }
}

fn q5_loop(n: u64) -> Digest {
    let mut counts: HashMap<(i64, u64), u64> = HashMap::new();
    each_bid(n, |b| {
        // The sliding windows holding `ts`: starts at multiples of the slide in (ts - size, ts].
        let last = b.ts - b.ts.rem_euclid(SLIDE_MS);
        let mut start = last;
        while start > b.ts - WINDOW_MS {
            *counts.entry((start + WINDOW_MS, b.auction)).or_default() += 1;
            start -= SLIDE_MS;
        }
    });
    let mut d = Digest::default();
    max_per_window(counts, &mut d);
    d
}

// q7: highest bid per window, as (auction, window end, price) of every bid with the window's
// highest price (per auction first, then over the window).
fn q7_job(n: u64) -> Digest {
    run_job(n, |job, n| {
        timed_bids(job, n)
            .key_by(|b: &Bid| b.auction)
            .window(WindowAssigner::tumbling(WINDOW_MS))
            .aggregate_with(HighestBid, |auction, w, (price, times)| {
                (*auction, w.end, price, times)
            })
            .uid("highest-per-auction")
            .flat_map(|(auction, end, price, times): (u64, i64, u64, u64)| {
                // One record per bid at that price, as the join in Nexmark's q7 gives.
                (0..times).map(move |_| (auction, end, price))
            })
            .key_by(|r: &(u64, i64, u64)| r.1)
            .process(MaxPerWindow)
            .uid("highest")
    })
}

/// (highest price, bids at it).
struct HighestBid;

impl weir_runtime::AggregateFunction<Bid, (u64, u64), (u64, u64)> for HighestBid {
    fn create(&self) -> (u64, u64) {
        (0, 0)
    }
    fn add(&self, (max, times): (u64, u64), b: Bid) -> (u64, u64) {
        if b.price > max {
            (b.price, 1)
        } else if b.price == max {
            (max, times + 1)
        } else {
            (max, times)
        }
    }
    fn result(&self, acc: &(u64, u64)) -> (u64, u64) {
        *acc
    }
    fn merge(&self, a: (u64, u64), b: (u64, u64)) -> (u64, u64) {
        match a.0.cmp(&b.0) {
            std::cmp::Ordering::Greater => a,
            std::cmp::Ordering::Less => b,
            std::cmp::Ordering::Equal => (a.0, a.1 + b.1),
        }
    }
}

fn q7_loop(n: u64) -> Digest {
    // Per window end: the highest price and the auctions of the bids at it (repeated).
    let mut best: HashMap<i64, (u64, Vec<u64>)> = HashMap::new();
    each_bid(n, |b| {
        let end = b.ts - b.ts.rem_euclid(WINDOW_MS) + WINDOW_MS;
        let e = best.entry(end).or_insert((b.price, Vec::new()));
        if b.price > e.0 {
            *e = (b.price, vec![b.auction]);
        } else if b.price == e.0 {
            e.1.push(b.auction);
        }
    });
    let mut d = Digest::default();
    for (end, (max, items)) in best {
        for item in items {
            d.add(&(item, end, max));
        }
    }
    d
}

// q8: monitor new users.
fn window_of(ts: i64) -> i64 {
    ts - ts.rem_euclid(WINDOW_MS)
}

/// Persons and the windows their auctions opened in, keyed by person id; emits a person once
/// if it opened an auction in the window it registered in. An auction can arrive before its
/// seller (the two sources run on different shards): its window waits in a list.
struct Q8Join;

type NewUser = (u64, String, i64);

impl CoProcessFunction<u64, (u64, String, i64), (u64, i64), NewUser> for Q8Join {
    fn process_left(
        &self,
        (id, name, ts): (u64, String, i64),
        ctx: &mut KeyedContext<'_, u64, NewUser>,
    ) {
        let w = window_of(ts);
        if ctx.list::<i64>("auction-windows").contains(&w) {
            ctx.emit((id, name, w));
            ctx.set_value("registered", &(String::new(), MATCHED));
        } else {
            ctx.set_value("registered", &(name, w));
        }
        ctx.clear_list("auction-windows");
    }

    fn process_right(&self, (seller, ts): (u64, i64), ctx: &mut KeyedContext<'_, u64, NewUser>) {
        let w = window_of(ts);
        match ctx.value::<(String, i64)>("registered") {
            Some((name, r)) if r == w => {
                ctx.emit((seller, name, w));
                ctx.set_value("registered", &(String::new(), MATCHED));
            }
            Some(_) => {}
            None => ctx.append("auction-windows", &w),
        }
    }
}

/// The window of a person already reported: no window matches it.
const MATCHED: i64 = i64::MIN;

fn q8_job(n: u64) -> Digest {
    run_job(n, |job, n| {
        let persons = events(job, n)
            .uid("persons")
            .filter_map(|e| match e {
                Event::Person(p) => Some((p.id, p.name, p.ts)),
                _ => None,
            })
            .key_by(|p: &(u64, String, i64)| p.0);
        let auctions = job
            .source(GeneratorSource::new(Some(n), SEED, event))
            .uid("auctions")
            .filter_map(|e| match e {
                Event::Auction(a) => Some((a.seller, a.ts)),
                _ => None,
            })
            .key_by(|a: &(u64, i64)| a.0);
        persons.connect(auctions).process(Q8Join).stream()
    })
}

fn q8_loop(n: u64) -> Digest {
    let mut d = Digest::default();
    let mut registered: HashMap<u64, (String, i64)> = HashMap::new();
    let mut matched: HashSet<u64> = HashSet::new();
    each_event(n, |e| match e {
        Event::Person(p) => {
            registered.insert(p.id, (p.name, window_of(p.ts)));
        }
        Event::Auction(a) => {
            if let Some((name, w)) = registered.get(&a.seller) {
                if *w == window_of(a.ts) && matched.insert(a.seller) {
                    d.add(&(a.seller, name.clone(), *w));
                }
            }
        }
        Event::Bid(_) => {}
    });
    d
}

// q11: user sessions: bids per bidder per session (a gap of 10 s closes one).
const SESSION_GAP_MS: i64 = 10_000;

fn q11_job(n: u64) -> Digest {
    run_job(n, |job, n| {
        timed_bids(job, n)
            .key_by(|b: &Bid| b.bidder)
            .window(WindowAssigner::session(SESSION_GAP_MS))
            .count_with(|bidder, w, count| (*bidder, count, w.start, w.end))
            .uid("sessions")
    })
}

fn q11_loop(n: u64) -> Digest {
    // Per bidder, its sessions as (start, end, bids): a bid opens [ts, ts + gap), which
    // absorbs every session it touches.
    let mut sessions: HashMap<u64, Vec<(i64, i64, u64)>> = HashMap::new();
    each_bid(n, |b| {
        let list = sessions.entry(b.bidder).or_default();
        let (mut start, mut end, mut count) = (b.ts, b.ts + SESSION_GAP_MS, 1);
        list.retain(|&(s, e, c)| {
            let touches = s <= end && e >= start;
            if touches {
                (start, end, count) = (start.min(s), end.max(e), count + c);
            }
            !touches
        });
        list.push((start, end, count));
    });
    let mut d = Digest::default();
    for (bidder, list) in sessions {
        for (start, end, count) in list {
            d.add(&(bidder, count, start, end));
        }
    }
    d
}

pub fn run(opts: &Opts) -> Vec<BenchResult> {
    let reps = if opts.quick { 1 } else { 3 };
    let n: u64 = if opts.quick { 400_000 } else { 10_000_000 };
    let mut rows = Vec::new();
    for q in &QUERIES {
        let name = format!("nexmark_{}", q.name);
        if !opts.wants(&name) {
            continue;
        }
        let mut ours_out = Digest::default();
        let mut base_out = Digest::default();
        let ours: Vec<Measured> = (0..reps)
            .map(|_| {
                measure(|| {
                    ours_out = (q.job)(n);
                    n
                })
            })
            .collect();
        let base: Vec<Measured> = (0..reps)
            .map(|_| {
                measure(|| {
                    base_out = (q.baseline)(n);
                    n
                })
            })
            .collect();
        let mut r = row(
            &format!("{name}_2shards"),
            ours,
            "sequential_rust_loop_same_query",
            base,
        );
        r.extra.push(("events".into(), n as f64));
        r.extra.push(("outputs".into(), ours_out.count as f64));
        r.extra
            .push(("baseline_outputs".into(), base_out.count as f64));
        r.extra.push((
            "outputs_match".into(),
            f64::from(u8::from(ours_out == base_out)),
        ));
        rows.push(r);
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every query's job computes what its sequential loop computes, on an input that spans
    /// several windows of q5 and q7 (4 s of event time) and both join orders of q3 and q8.
    #[test]
    fn every_query_matches_its_sequential_loop() {
        let n = 400_000;
        for q in &QUERIES {
            let (job, base) = ((q.job)(n), (q.baseline)(n));
            assert!(base.count > 0, "{}: the loop found outputs", q.name);
            assert_eq!(job, base, "{}: job and loop agree", q.name);
        }
    }

    /// The generator's references point at events that exist: sellers and bidders at earlier
    /// persons, bids at earlier auctions.
    #[test]
    fn events_refer_to_earlier_persons_and_auctions() {
        let (mut persons, mut auctions) = (HashSet::new(), HashSet::new());
        each_event(20_000, |e| match e {
            Event::Person(p) => assert!(persons.insert(p.id), "person ids are unique"),
            Event::Auction(a) => {
                assert!(persons.contains(&a.seller), "seller {} exists", a.seller);
                assert!(auctions.insert(a.id), "auction ids are unique");
            }
            Event::Bid(b) => {
                assert!(
                    auctions.contains(&b.auction),
                    "auction {} exists",
                    b.auction
                );
                assert!(persons.contains(&b.bidder), "bidder {} exists", b.bidder);
            }
        });
        assert_eq!(persons.len(), 400);
        assert_eq!(auctions.len(), 1200);
    }
}
