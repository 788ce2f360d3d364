//! The output contract of every suite: one row per figure, printed as a table or as JSON lines
//! with at least `bench`, `per_wall_sec`, `per_cpu_sec`, `baseline`, `baseline_per_cpu_sec`,
//! `ratio`, and `p50_ns`, `p99_ns`, `p999_ns`, `max_ns` where they apply.

use serde_json::{Map, Number, Value};

/// Options shared by every suite.
#[derive(Clone, Debug, Default)]
pub struct Opts {
    /// Print JSON lines instead of a table.
    pub json: bool,
    /// Smaller inputs: a smoke run for CI, not a measurement.
    pub quick: bool,
    /// Run only the benchmarks whose name contains this.
    pub only: Option<String>,
}

impl Opts {
    /// Whether the benchmark `name`, or a group of benchmarks whose names start with `name`,
    /// is selected: `--only` may name a row in full (`checkpoint_duration_1024MiB_1pct`
    /// selects the `checkpoint_duration` group) or any part of its name.
    pub fn wants(&self, name: &str) -> bool {
        self.only
            .as_deref()
            .is_none_or(|o| name.contains(o) || o.starts_with(name))
    }

    /// Whether a printed row is selected: its name contains `--only`'s text. A suite may run
    /// a section that a selected row needs (the point gets read the updates' store) and
    /// print only the selected rows.
    pub fn shows(&self, bench: &str) -> bool {
        self.only.as_deref().is_none_or(|o| bench.contains(o))
    }
}

/// One measured figure and the baseline it is compared with.
#[derive(Clone, Debug, Default)]
pub struct BenchResult {
    pub bench: String,
    pub per_wall_sec: f64,
    pub per_cpu_sec: f64,
    pub baseline: String,
    pub baseline_per_cpu_sec: f64,
    /// `per_cpu_sec / baseline_per_cpu_sec`.
    pub ratio: f64,
    pub p50_ns: Option<u64>,
    pub p99_ns: Option<u64>,
    pub p999_ns: Option<u64>,
    pub max_ns: Option<u64>,
    /// Further named figures (bytes per record, peak RSS, ...).
    pub extra: Vec<(String, f64)>,
}

impl BenchResult {
    /// The row as one JSON object.
    pub fn to_json(&self) -> Value {
        let mut m = Map::new();
        m.insert("bench".into(), Value::String(self.bench.clone()));
        m.insert("per_wall_sec".into(), num(self.per_wall_sec));
        m.insert("per_cpu_sec".into(), num(self.per_cpu_sec));
        m.insert("baseline".into(), Value::String(self.baseline.clone()));
        m.insert(
            "baseline_per_cpu_sec".into(),
            num(self.baseline_per_cpu_sec),
        );
        m.insert("ratio".into(), num(self.ratio));
        for (k, v) in [
            ("p50_ns", self.p50_ns),
            ("p99_ns", self.p99_ns),
            ("p999_ns", self.p999_ns),
            ("max_ns", self.max_ns),
        ] {
            if let Some(v) = v {
                m.insert(k.into(), Value::Number(v.into()));
            }
        }
        for (k, v) in &self.extra {
            m.insert(k.clone(), num(*v));
        }
        Value::Object(m)
    }
}

fn num(v: f64) -> Value {
    Number::from_f64(v).map_or(Value::Null, Value::Number)
}

/// CPU time consumed by the calling thread, in nanoseconds (`CLOCK_THREAD_CPUTIME_ID`).
pub fn thread_cpu_ns() -> u64 {
    cpu_clock_ns(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// CPU time of the whole process (every thread, the kernel's io_uring workers included), in
/// nanoseconds.
pub fn process_cpu_ns() -> u64 {
    cpu_clock_ns(libc::CLOCK_PROCESS_CPUTIME_ID)
}

fn cpu_clock_ns(clock: libc::clockid_t) -> u64 {
    try_cpu_clock_ns(clock).expect("CPU-time clocks are always available on Linux")
}

/// The time of CPU clock `clock` in nanoseconds, or None if the kernel refuses the clock id
/// (a thread's clock once the thread has exited).
pub(crate) fn try_cpu_clock_ns(clock: libc::clockid_t) -> Option<u64> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; an unknown or stale clock id makes the call
    // fail with EINVAL, nothing else.
    let rc = unsafe { libc::clock_gettime(clock, &mut ts) };
    (rc == 0).then(|| ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64)
}

/// Prints rows as an aligned table.
pub fn print_table(rows: &[BenchResult]) {
    println!(
        "{:<48} {:>14} {:>14} {:>28} {:>14} {:>7} {:>9} {:>9} {:>9}",
        "bench",
        "per_wall_sec",
        "per_cpu_sec",
        "baseline",
        "base_cpu_sec",
        "ratio",
        "p50_ns",
        "p99_ns",
        "p999_ns"
    );
    for r in rows {
        let o = |v: Option<u64>| v.map_or_else(|| "-".to_string(), |v| v.to_string());
        println!(
            "{:<48} {:>14.0} {:>14.0} {:>28} {:>14.0} {:>7.3} {:>9} {:>9} {:>9}",
            r.bench,
            r.per_wall_sec,
            r.per_cpu_sec,
            r.baseline,
            r.baseline_per_cpu_sec,
            r.ratio,
            o(r.p50_ns),
            o(r.p99_ns),
            o(r.p999_ns)
        );
        for (k, v) in &r.extra {
            println!("    {k} = {v:.1}");
        }
    }
}

/// Prints rows as JSON lines.
pub fn print_json(rows: &[BenchResult]) {
    for r in rows {
        println!("{}", r.to_json());
    }
}
