//! Ring benchmark: 64-byte records between two threads on two cores, batched.
//!
//! * `ring_spsc_64B_batch32KiB`: weir's byte ring; every record is a frame of a 16-byte header
//!   plus a 64-byte payload (80 ring bytes), written with `FrameWriter::push` into one
//!   reservation per batch (up to 32 KiB) and read in place through `ReadRegion::frames`.
//! * baseline `rtrb_u8x64_chunks512`: a raw SPSC ring of `[u8; 64]` items (rtrb) moved in chunks
//!   of 512 items (32 KiB), same capacity in bytes, same records, same consumer check.
//!
//! Both producers build each record (sequence number in its first 8 bytes) and copy it into
//! ring memory; both consumers check every sequence number. `per_wall_sec` is records per wall
//! second; `per_cpu_sec` is records per *core* second: records / ((producer CPU + consumer CPU)
//! / 2), CPU time from `CLOCK_THREAD_CPUTIME_ID`. `ratio` = ours / baseline per core second.
//! Threads are pinned to two different cores (unpinned when fewer than two exist). Each side
//! runs `reps` times; the median run (by `per_cpu_sec`) is reported and every run is listed in
//! `extra`.

use std::sync::{Arc, Barrier};
use std::thread;
use std::time::Instant;

use weir_ring::{frame_bytes, ring, FrameKind, Header};

use crate::{thread_cpu_ns, BenchResult, Opts};

const RECORD_BYTES: usize = 64;
const RING_BYTES: usize = 256 * 1024;
const BATCH_BYTES: usize = 32 * 1024;

/// One measured run.
#[derive(Clone, Copy, Debug)]
struct Run {
    records: u64,
    wall_ns: u64,
    producer_cpu_ns: u64,
    consumer_cpu_ns: u64,
}

impl Run {
    fn per_wall_sec(&self) -> f64 {
        self.records as f64 / (self.wall_ns as f64 / 1e9)
    }
    fn per_cpu_sec(&self) -> f64 {
        let core_ns = (self.producer_cpu_ns + self.consumer_cpu_ns) as f64 / 2.0;
        self.records as f64 / (core_ns / 1e9)
    }
}

fn record(seq: u64) -> [u8; RECORD_BYTES] {
    let mut r = [0xA5u8; RECORD_BYTES];
    r[..8].copy_from_slice(&seq.to_le_bytes());
    r
}

fn seq_of(payload: &[u8]) -> u64 {
    u64::from_le_bytes(payload[..8].try_into().expect("8 bytes"))
}

fn pin(core: usize) {
    if let Some(ids) = core_affinity::get_core_ids() {
        if ids.len() >= 2 {
            core_affinity::set_for_current(ids[core]);
        }
    }
}

/// Runs `producer` and `consumer` on two pinned threads, started together.
fn two_threads(
    records: u64,
    producer: impl FnOnce() + Send + 'static,
    consumer: impl FnOnce() + Send + 'static,
) -> Run {
    let start = Arc::new(Barrier::new(3));
    let spawn = |core: usize, f: Box<dyn FnOnce() + Send>| {
        let start = Arc::clone(&start);
        thread::spawn(move || {
            pin(core);
            start.wait();
            let cpu0 = thread_cpu_ns();
            f();
            thread_cpu_ns() - cpu0
        })
    };
    let p = spawn(0, Box::new(producer));
    let c = spawn(1, Box::new(consumer));
    start.wait();
    let t0 = Instant::now();
    let producer_cpu_ns = p.join().expect("producer");
    let consumer_cpu_ns = c.join().expect("consumer");
    Run {
        records,
        wall_ns: t0.elapsed().as_nanos() as u64,
        producer_cpu_ns,
        consumer_cpu_ns,
    }
}

fn run_weir(records: u64) -> Run {
    let (mut p, mut c) = ring(RING_BYTES);
    let frame = frame_bytes(RECORD_BYTES);
    two_threads(
        records,
        move || {
            let mut seq = 0u64;
            while seq < records {
                let Some(mut w) = p.writer(frame).expect("64-byte frames fit") else {
                    std::hint::spin_loop();
                    continue;
                };
                let n = (w.remaining().min(BATCH_BYTES) / frame).min((records - seq) as usize);
                for _ in 0..n {
                    w.push(Header::record(seq as u16, seq as i64), &record(seq))
                        .expect("counted to fit");
                    seq += 1;
                }
                w.commit();
            }
        },
        move || {
            let mut expect = 0u64;
            while expect < records {
                let Some(r) = c.read() else {
                    std::hint::spin_loop();
                    continue;
                };
                for f in r.frames() {
                    assert!(
                        f.kind == FrameKind::Record && seq_of(f.payload) == expect,
                        "ring bench: frame {expect} out of order"
                    );
                    expect += 1;
                }
                r.release_all();
            }
        },
    )
}

fn run_rtrb(records: u64) -> Run {
    let (mut p, mut c) = rtrb::RingBuffer::<[u8; RECORD_BYTES]>::new(RING_BYTES / RECORD_BYTES);
    let chunk = BATCH_BYTES / RECORD_BYTES;
    two_threads(
        records,
        move || {
            let mut seq = 0u64;
            while seq < records {
                let n = p.slots().min(chunk).min((records - seq) as usize);
                if n == 0 {
                    std::hint::spin_loop();
                    continue;
                }
                let w = p.write_chunk_uninit(n).expect("slots counted");
                let first = seq;
                let written = w.fill_from_iter((first..first + n as u64).map(record));
                seq += written as u64;
            }
        },
        move || {
            let mut expect = 0u64;
            while expect < records {
                let n = c.slots().min(chunk);
                if n == 0 {
                    std::hint::spin_loop();
                    continue;
                }
                let r = c.read_chunk(n).expect("slots counted");
                let (a, b) = r.as_slices();
                for item in a.iter().chain(b) {
                    assert!(
                        seq_of(item) == expect,
                        "rtrb bench: item {expect} out of order"
                    );
                    expect += 1;
                }
                r.commit_all();
            }
        },
    )
}

fn median(mut runs: Vec<Run>) -> (Run, Vec<Run>) {
    let all = runs.clone();
    runs.sort_by(|a, b| a.per_cpu_sec().total_cmp(&b.per_cpu_sec()));
    (runs[runs.len() / 2], all)
}

/// Runs the ring benchmark and its same-run baseline.
pub fn run(opts: &Opts) -> Vec<BenchResult> {
    let (records, reps) = if opts.quick {
        (10_000_000, 1)
    } else {
        (100_000_000, 3)
    };
    // Warm up both (page faults, frequency), then interleave the measured runs so that noise
    // from neighbours hits both sides alike.
    run_weir(records / 10);
    run_rtrb(records / 10);
    let mut ours = Vec::new();
    let mut base = Vec::new();
    for _ in 0..reps {
        ours.push(run_weir(records));
        base.push(run_rtrb(records));
    }
    let (o, ours_all) = median(ours);
    let (b, base_all) = median(base);
    let mut extra = vec![
        ("records".to_string(), records as f64),
        ("ring_bytes".to_string(), RING_BYTES as f64),
        ("batch_bytes".to_string(), BATCH_BYTES as f64),
        ("frame_bytes".to_string(), frame_bytes(RECORD_BYTES) as f64),
        ("wall_s".to_string(), o.wall_ns as f64 / 1e9),
        ("producer_cpu_s".to_string(), o.producer_cpu_ns as f64 / 1e9),
        ("consumer_cpu_s".to_string(), o.consumer_cpu_ns as f64 / 1e9),
        ("baseline_per_wall_sec".to_string(), b.per_wall_sec()),
        (
            "ratio_per_wall_sec".to_string(),
            o.per_wall_sec() / b.per_wall_sec(),
        ),
    ];
    for (i, r) in ours_all.iter().enumerate() {
        extra.push((format!("run{i}_per_cpu_sec"), r.per_cpu_sec()));
        extra.push((format!("run{i}_per_wall_sec"), r.per_wall_sec()));
    }
    for (i, r) in base_all.iter().enumerate() {
        extra.push((format!("baseline_run{i}_per_cpu_sec"), r.per_cpu_sec()));
        extra.push((format!("baseline_run{i}_per_wall_sec"), r.per_wall_sec()));
    }
    vec![BenchResult {
        bench: "ring_spsc_64B_batch32KiB (per_cpu_sec = per core: records / mean CPU of 2 threads)"
            .to_string(),
        per_wall_sec: o.per_wall_sec(),
        per_cpu_sec: o.per_cpu_sec(),
        baseline: "rtrb_u8x64_chunks512".to_string(),
        baseline_per_cpu_sec: b.per_cpu_sec(),
        ratio: o.per_cpu_sec() / b.per_cpu_sec(),
        p50_ns: None,
        p99_ns: None,
        p999_ns: None,
        max_ns: None,
        extra,
    }]
}
