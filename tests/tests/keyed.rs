//! Multi-shard keyed jobs compared with an independent sequential computation.

use std::collections::HashMap;

use weir_runtime::testing::TestDriver;
use weir_runtime::{Job, JobConfig, WatermarkStrategy, WindowAssigner};

fn config(shards: usize) -> JobConfig {
    // Tests pass with more shards than cores: unpinned.
    JobConfig::new()
        .with_shards(shards)
        .with_pinning(weir_runtime::Pinning::Never)
}

fn input(n: u64, keys: u64) -> Vec<(u64, i64)> {
    (0..n)
        .map(|i| {
            let r = weir_runtime::source::splitmix64(7, i);
            (r % keys, (r >> 20) as i64 % 1000 - 500)
        })
        .collect()
}

/// Per-key running sums of `data` (a keyed reduce with uid "sum"), and the job's summary.
fn running_sums(
    config: JobConfig,
    data: &[(u64, i64)],
) -> (Vec<(u64, i64)>, weir_runtime::JobSummary) {
    let job = Job::new(config);
    let out = job
        .from_vec(data.to_vec())
        .key_by(|(k, _)| *k)
        .reduce(|(k, a), (_, b)| (k, a + b))
        .uid("sum")
        .collect();
    let summary = job.run().expect("job runs");
    (out.take(), summary)
}

#[test]
fn keyed_running_sum_on_four_shards_matches_sequential() {
    let data = input(20_000, 97);
    let (out, summary) = running_sums(config(4), &data);
    let mut got: HashMap<u64, Vec<i64>> = HashMap::new();
    for (k, s) in out {
        got.entry(k).or_default().push(s);
    }
    let mut want: HashMap<u64, Vec<i64>> = HashMap::new();
    let mut sums: HashMap<u64, i64> = HashMap::new();
    for (k, v) in &data {
        let s = sums.entry(*k).or_default();
        *s += v;
        want.entry(*k).or_default().push(*s);
    }
    assert_eq!(got, want, "per key, the running sums arrive in input order");
    assert_eq!(summary.metrics.records_in("sum"), data.len() as u64);
}

#[test]
fn tumbling_window_counts_with_out_of_order_and_late_events() {
    // (key, ts): window size 10, out-of-orderness 5.
    let events: Vec<(u32, i64)> = vec![
        (1, 1),
        (1, 3),
        (2, 4),
        (1, 12),
        (1, 8),
        (2, 15),
        (1, 25),
        (1, 2),
        (2, 30),
        (1, 14),
    ];
    let mut d = TestDriver::new(|s| {
        s.assign_timestamps(WatermarkStrategy::bounded_out_of_orderness(
            5,
            |e: &(u32, i64)| e.1,
        ))
        .key_by(|e| e.0)
        .window(WindowAssigner::tumbling(10))
        .count_with(|k, w, n| (*k, w.start, n))
    })
    .expect("driver");
    for e in &events {
        d.push(*e);
        // Periodic watermark emission follows processing time.
        d.set_processing_time(d_now(e.1));
        d.run_until_idle().expect("run");
    }
    let mut out = d.finish().expect("finish");
    out.sort();
    // After (1,25) the watermark is 25 - 5 - 1 = 19: (1,2) and (1,14) arrive after their
    // windows' last millisecond (9 and 19) was passed: late, dropped.
    assert_eq!(
        out,
        vec![
            (1, 0, 3),
            (1, 10, 1),
            (1, 20, 1),
            (2, 0, 1),
            (2, 10, 1),
            (2, 30, 1)
        ]
    );
}

fn d_now(ts: i64) -> i64 {
    1_000_000 + ts * 1000
}

#[test]
fn a_store_whose_flushes_lag_stalls_the_shard_and_loses_nothing() {
    // A 16 KiB memtable freezes every few hundred records, far faster than flushes (each
    // fsyncs) complete: the shards must stop at the store's write-stall limit instead of
    // queueing frozen memtables without bound, then go on with every record.
    let data = input(200_000, 50_000);
    let (got, summary) = running_sums(config(2).with_memtable_budget_bytes(16 << 10), &data);
    let mut sums: HashMap<u64, i64> = HashMap::new();
    for (k, v) in &data {
        *sums.entry(*k).or_default() += v;
    }
    let mut last: HashMap<u64, i64> = HashMap::new();
    assert_eq!(got.len(), data.len());
    for (k, s) in got {
        last.insert(k, s);
    }
    assert_eq!(last, sums, "every key's final sum");
    let stalled: u64 = summary
        .metrics
        .heads
        .iter()
        .filter(|h| h.head == weir_runtime::STATE_STALL)
        .map(|h| h.backpressured_ns)
        .sum();
    assert!(stalled > 0, "the shards never waited for their stores");
}
