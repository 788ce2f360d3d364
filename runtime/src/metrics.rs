//! Metrics per operator and shard. Counters are written by one shard thread with relaxed
//! load + store (a plain move, no locked instruction on the hot path) and read by any thread.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use hdrhistogram::Histogram;

/// Adds to a counter that only one thread writes.
#[inline]
pub(crate) fn bump(c: &AtomicU64, n: u64) {
    c.store(c.load(Relaxed).wrapping_add(n), Relaxed);
}

/// Counters of one operator instance (one operator on one shard).
#[derive(Debug, Default)]
pub struct OperatorCounters {
    pub records_in: AtomicU64,
    pub records_out: AtomicU64,
    /// Records dropped by policy (late events, malformed input that was skipped).
    pub records_dropped: AtomicU64,
    /// Most bytes an exchange writer held outside its rings (backpressure spill).
    pub max_buffered_bytes: AtomicU64,
}

/// What one head (a source or an exchange input driving a chain of operators) spent its time on.
#[derive(Debug, Default)]
pub struct HeadCounters {
    pub busy_ns: AtomicU64,
    pub backpressured_ns: AtomicU64,
    pub idle_ns: AtomicU64,
}

/// One keyed operator's state store on one shard, as of its last installed flush, compaction
/// or snapshot (what Flink reports of RocksDB as native metrics).
#[derive(Debug, Default)]
pub(crate) struct StateCounters {
    pub flushes: AtomicU64,
    pub compactions: AtomicU64,
    pub segments: AtomicU64,
    pub segment_bytes: AtomicU64,
    pub memtable_bytes: AtomicU64,
}

/// One registered instance's counters: an operator, a source head or a store, on a shard.
#[derive(Debug)]
pub(crate) struct Entry<C> {
    pub name: String,
    pub shard: usize,
    pub counters: Arc<C>,
}

/// Registers fresh counters for `name` on `shard` in `list`, returning them to the writer.
fn register<C: Default>(list: &Mutex<Vec<Entry<C>>>, name: &str, shard: usize) -> Arc<C> {
    let counters = Arc::new(C::default());
    lock(list).push(Entry {
        name: name.to_string(),
        shard,
        counters: counters.clone(),
    });
    counters
}

/// The registry a job's shards write into and its handle reads from.
#[derive(Debug)]
pub(crate) struct Registry {
    pub operators: Mutex<Vec<Entry<OperatorCounters>>>,
    pub heads: Mutex<Vec<Entry<HeadCounters>>>,
    pub states: Mutex<Vec<Entry<StateCounters>>>,
    /// Source-to-sink latency from latency markers, in nanoseconds.
    pub latency: Mutex<Histogram<u64>>,
    pub started: std::time::Instant,
}

impl Registry {
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            operators: Mutex::new(Vec::new()),
            heads: Mutex::new(Vec::new()),
            states: Mutex::new(Vec::new()),
            latency: Mutex::new(new_latency_histogram()),
            started: std::time::Instant::now(),
        })
    }

    pub fn operator(&self, name: &str, shard: usize) -> Arc<OperatorCounters> {
        register(&self.operators, name, shard)
    }

    pub fn head(&self, name: &str, shard: usize) -> Arc<HeadCounters> {
        register(&self.heads, name, shard)
    }

    pub fn state(&self, name: &str, shard: usize) -> Arc<StateCounters> {
        register(&self.states, name, shard)
    }

    pub fn record_latency(&self, h: &Histogram<u64>) {
        let _ = lock(&self.latency).add(h);
    }

    pub fn snapshot(&self) -> JobMetrics {
        let operators = lock(&self.operators)
            .iter()
            .map(|e| OperatorMetrics {
                operator: e.name.clone(),
                shard: e.shard,
                records_in: e.counters.records_in.load(Relaxed),
                records_out: e.counters.records_out.load(Relaxed),
                records_dropped: e.counters.records_dropped.load(Relaxed),
                max_buffered_bytes: e.counters.max_buffered_bytes.load(Relaxed),
            })
            .collect();
        let heads = lock(&self.heads)
            .iter()
            .map(|e| HeadMetrics {
                head: e.name.clone(),
                shard: e.shard,
                busy_ns: e.counters.busy_ns.load(Relaxed),
                backpressured_ns: e.counters.backpressured_ns.load(Relaxed),
                idle_ns: e.counters.idle_ns.load(Relaxed),
            })
            .collect();
        let states = lock(&self.states)
            .iter()
            .map(|e| StateMetrics {
                operator: e.name.clone(),
                shard: e.shard,
                flushes: e.counters.flushes.load(Relaxed),
                compactions: e.counters.compactions.load(Relaxed),
                segments: e.counters.segments.load(Relaxed),
                segment_bytes: e.counters.segment_bytes.load(Relaxed),
                memtable_bytes: e.counters.memtable_bytes.load(Relaxed),
            })
            .collect();
        let h = lock(&self.latency);
        let latency = LatencySummary {
            samples: h.len(),
            p50_ns: h.value_at_quantile(0.5),
            p99_ns: h.value_at_quantile(0.99),
            p999_ns: h.value_at_quantile(0.999),
            max_ns: h.max(),
        };
        JobMetrics {
            elapsed: self.started.elapsed(),
            operators,
            heads,
            states,
            latency,
        }
    }
}

pub(crate) fn new_latency_histogram() -> Histogram<u64> {
    // 1 ns .. 100 s with 3 significant digits: bounded memory, no resizing on record.
    match Histogram::new_with_bounds(1, 100_000_000_000, 3) {
        Ok(h) => h,
        Err(e) => panic!("constant histogram bounds are valid: {e}"),
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A poisoned registry only means a shard panicked while registering; the data is counters.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A snapshot of one operator instance's counters.
#[derive(Clone, Debug)]
pub struct OperatorMetrics {
    pub operator: String,
    pub shard: usize,
    pub records_in: u64,
    pub records_out: u64,
    pub records_dropped: u64,
    pub max_buffered_bytes: u64,
}

/// A snapshot of one head's time split.
#[derive(Clone, Debug)]
pub struct HeadMetrics {
    pub head: String,
    pub shard: usize,
    pub busy_ns: u64,
    pub backpressured_ns: u64,
    pub idle_ns: u64,
}

/// A snapshot of one keyed operator's state store on one shard (one entry per attempt: a
/// restart opens the stores again).
#[derive(Clone, Debug)]
pub struct StateMetrics {
    pub operator: String,
    pub shard: usize,
    /// Memtables written as segments.
    pub flushes: u64,
    pub compactions: u64,
    /// Live segments and their bytes.
    pub segments: u64,
    pub segment_bytes: u64,
    pub memtable_bytes: u64,
}

/// Source-to-sink latency measured by latency markers.
#[derive(Clone, Debug, Default)]
pub struct LatencySummary {
    pub samples: u64,
    pub p50_ns: u64,
    pub p99_ns: u64,
    pub p999_ns: u64,
    pub max_ns: u64,
}

/// A snapshot of a job's metrics.
#[derive(Clone, Debug)]
pub struct JobMetrics {
    pub elapsed: std::time::Duration,
    pub operators: Vec<OperatorMetrics>,
    pub heads: Vec<HeadMetrics>,
    pub states: Vec<StateMetrics>,
    pub latency: LatencySummary,
}

impl JobMetrics {
    /// Records that entered operator `name`, summed over shards.
    pub fn records_in(&self, name: &str) -> u64 {
        self.operators
            .iter()
            .filter(|o| o.operator == name)
            .map(|o| o.records_in)
            .sum()
    }

    /// Records that left operator `name`, summed over shards.
    pub fn records_out(&self, name: &str) -> u64 {
        self.operators
            .iter()
            .filter(|o| o.operator == name)
            .map(|o| o.records_out)
            .sum()
    }

    /// Flushes of operator `name`'s state stores, summed over shards and attempts.
    pub fn state_flushes(&self, name: &str) -> u64 {
        self.states
            .iter()
            .filter(|s| s.operator == name)
            .map(|s| s.flushes)
            .sum()
    }

    /// Records that left operator `name` on each shard.
    pub fn records_out_per_shard(&self, name: &str, shards: usize) -> Vec<u64> {
        let mut v = vec![0; shards];
        for o in self.operators.iter().filter(|o| o.operator == name) {
            if let Some(slot) = v.get_mut(o.shard) {
                *slot += o.records_out;
            }
        }
        v
    }
}
