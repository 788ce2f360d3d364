//! `weir run demo`: a seeded Nexmark-like bid stream, counted per auction in one-second
//! event-time windows, with a live status line and a final summary.

use std::io::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use weir_runtime::source::GeneratorSource;
use weir_runtime::{AggregateFunction, Job, JobConfig, WatermarkStrategy, WindowAssigner};

use crate::DemoArgs;

/// A bid, as Nexmark's: an auction, a bidder, a price and an event time.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Clone, Debug)]
pub struct Bid {
    pub auction: u64,
    pub bidder: u64,
    pub price: u64,
    pub ts: i64,
}

/// Count and highest price of a window.
struct CountMax;

impl AggregateFunction<Bid, (u64, u64), (u64, u64)> for CountMax {
    fn create(&self) -> (u64, u64) {
        (0, 0)
    }
    fn add(&self, (n, max): (u64, u64), b: Bid) -> (u64, u64) {
        (n + 1, max.max(b.price))
    }
    fn result(&self, acc: &(u64, u64)) -> (u64, u64) {
        *acc
    }
    fn merge(&self, a: (u64, u64), b: (u64, u64)) -> (u64, u64) {
        (a.0 + b.0, a.1.max(b.1))
    }
}

/// Event time advances one millisecond per this many bids.
const BIDS_PER_MS: u64 = 1000;

pub fn run(a: &DemoArgs) -> Result<(), String> {
    let mut config = JobConfig::new();
    if let Some(n) = a.shards {
        config = config.with_shards(n);
    }
    let config = crate::apply_checkpointing(config, &a.checkpoint)?;
    let checkpointing = a.checkpoint.checkpoint_dir.is_some();
    let keys = a.keys;
    let gen = GeneratorSource::new(Some(a.events), a.seed, move |i: u64, r: u64| Bid {
        auction: r % keys,
        bidder: (r >> 24) % 1_000_000,
        price: 1 + (r >> 44) % 10_000,
        ts: (i / BIDS_PER_MS) as i64,
    });
    let windows = Arc::new(AtomicU64::new(0));
    let counted = Arc::new(AtomicU64::new(0));
    let (w2, c2) = (windows.clone(), counted.clone());
    let job = Job::new(config);
    let shards = job.config().shards;
    job.source(gen)
        .uid("bids")
        .filter(|b| b.price > 0)
        .assign_timestamps(WatermarkStrategy::bounded_out_of_orderness(
            10,
            |b: &Bid| b.ts,
        ))
        .key_by(|b: &Bid| b.auction)
        .window(WindowAssigner::tumbling(1000))
        .aggregate_with(CountMax, |auction, w, (n, max)| (*auction, w.start, n, max))
        .uid("bids-per-auction")
        .for_each(move |(_, _, n, _): (u64, i64, u64, u64)| {
            w2.fetch_add(1, Ordering::Relaxed);
            c2.fetch_add(n, Ordering::Relaxed);
        });
    eprintln!(
        "weir demo: {} bids over {keys} auctions on {shards} shards, counted per auction in 1 s event-time windows",
        a.events
    );
    let started = Instant::now();
    let mut stopper = crate::stop::Stopper::install(&a.checkpoint)?;
    let handle = job.start().map_err(|e| e.to_string())?;
    let mut last = (Instant::now(), vec![0u64; shards]);
    while !handle.is_finished() {
        for _ in 0..10 {
            std::thread::sleep(Duration::from_millis(25));
            if let Some(s) = stopper.as_mut() {
                s.poll(&handle);
            }
        }
        let m = handle.metrics();
        let now = m.records_out_per_shard("bids", shards);
        let dt = last.0.elapsed().as_secs_f64().max(1e-9);
        let rates: Vec<String> = now
            .iter()
            .zip(&last.1)
            .map(|(n, l)| format!("{:.1}M/s", (n - l) as f64 / dt / 1e6))
            .collect();
        let total: u64 = now.iter().sum();
        let ck = if checkpointing {
            format!(
                "  {}",
                crate::jobs::checkpoint_status(&handle.checkpoint_metrics())
            )
        } else {
            String::new()
        };
        eprint!(
            "\r  {:>5.1}s  {:>11} bids  {:>7.2}M records/s  per shard [{}]  windows {:>8}{ck}   ",
            started.elapsed().as_secs_f64(),
            total,
            (total - last.1.iter().sum::<u64>()) as f64 / dt / 1e6,
            rates.join(" "),
            windows.load(Ordering::Relaxed)
        );
        let _ = std::io::stderr().flush();
        last = (Instant::now(), now);
    }
    eprintln!();
    let summary = handle.wait().map_err(|e| e.to_string())?;
    let m = &summary.metrics;
    let secs = m.elapsed.as_secs_f64();
    let read = m.records_out("bids");
    let n = counted.load(Ordering::Relaxed);
    // Every bid lands in exactly one window, so the two counts agree for a run that started
    // from the beginning. After a restore (`--restore`, or a restart) the windows this process
    // fired also hold bids a process before it counted into the restored state, and bids of
    // windows fired before the checkpoint are not counted here: no equation holds. Nor after
    // a stop with a savepoint, which leaves the open windows unfired.
    let stopped = stopper.as_ref().is_some_and(crate::stop::Stopper::stopped);
    let restored = summary.restarts > 0
        || summary
            .checkpoints
            .last_checkpoint_restore_timestamp
            .is_some();
    // Said on the lines, so that two counts that differ are not read as a loss.
    let (gen_note, win_note) = match (restored, stopped) {
        (true, _) => (
            "  (by this process, after the restore)",
            "  (in the windows this process fired, bids from before the restore included)",
        ),
        (false, true) => ("", "  (the stop left the open windows unfired)"),
        (false, false) => ("", ""),
    };
    let restored = restored || stopped;
    println!("bids generated         {read}{gen_note}");
    println!("bids counted in windows {n}{win_note}");
    println!("windows emitted        {}", windows.load(Ordering::Relaxed));
    println!("elapsed                {secs:.2} s");
    println!(
        "throughput             {:.2} M bids/s ({:.2} M/s per shard)",
        read as f64 / secs / 1e6,
        read as f64 / secs / 1e6 / shards as f64
    );
    println!(
        "latency (markers)      p50 {:.1} us  p99 {:.1} us  max {:.1} us  ({} samples)",
        m.latency.p50_ns as f64 / 1e3,
        m.latency.p99_ns as f64 / 1e3,
        m.latency.max_ns as f64 / 1e3,
        m.latency.samples
    );
    if checkpointing {
        println!("{}", crate::jobs::checkpoint_summary(&summary.checkpoints));
    }
    if n != read && !restored {
        return Err(format!(
            "counted {n} bids in windows but generated {read}: records were lost or duplicated"
        ));
    }
    Ok(())
}
