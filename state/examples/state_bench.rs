//! Runs `benches/src/state.rs` standalone (the lead wires it into `weir-bench`).
//! `cargo run --release -p weir-state --example state_bench [-- quick]`

#[path = "../../benches/src/state.rs"]
mod state;

pub struct Opts {
    pub json: bool,
    pub quick: bool,
}

pub struct BenchResult {
    pub bench: String,
    pub per_wall_sec: f64,
    pub per_cpu_sec: f64,
    pub baseline: String,
    pub baseline_per_cpu_sec: f64,
    pub ratio: f64,
    pub p50_ns: Option<u64>,
    pub p99_ns: Option<u64>,
    pub p999_ns: Option<u64>,
    pub max_ns: Option<u64>,
    pub extra: Vec<(String, f64)>,
}

pub fn thread_cpu_ns() -> u64 {
    cpu_clock_ns(libc::CLOCK_THREAD_CPUTIME_ID)
}

pub fn process_cpu_ns() -> u64 {
    cpu_clock_ns(libc::CLOCK_PROCESS_CPUTIME_ID)
}

fn cpu_clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec we own.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn main() {
    let quick = std::env::args().any(|a| a == "quick");
    let opts = Opts { json: false, quick };
    for r in state::run(&opts) {
        let lat = match (r.p50_ns, r.p99_ns, r.p999_ns, r.max_ns) {
            (Some(a), Some(b), Some(c), Some(d)) => {
                format!(" p50={a}ns p99={b}ns p999={c}ns max={d}ns")
            }
            _ => String::new(),
        };
        let extra: Vec<String> = r.extra.iter().map(|(k, v)| format!("{k}={v:.3}")).collect();
        println!(
            "{:<28} {:>14.0}/wall-s {:>14.0}/cpu-s | {} {:>14.0}/cpu-s ratio {:.3}{} [{}]",
            r.bench,
            r.per_wall_sec,
            r.per_cpu_sec,
            r.baseline,
            r.baseline_per_cpu_sec,
            r.ratio,
            lat,
            extra.join(" ")
        );
        let _ = opts.json;
    }
}
