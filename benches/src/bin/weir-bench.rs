//! `weir-bench SUITE [--json] [--quick] [--only TEXT]`: runs a benchmark suite and prints its
//! figures (with `--only`, the rows whose name contains TEXT).

use clap::{Parser, ValueEnum};
use weir_benches::report::{print_json, print_table};
use weir_benches::Opts;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Suite {
    /// Rings, chained operators, keyed jobs, latency.
    Runtime,
    /// The LSM store: updates, gets, bloom filters, segment writes, snapshots.
    State,
    /// Checkpoints: overhead, duration, unaligned under backpressure, recovery.
    Checkpoint,
    /// Nexmark queries q0-q3, q5, q7, q8, q11 against the same queries as sequential loops.
    Nexmark,
    /// Every suite.
    All,
}

#[derive(Parser)]
#[command(
    name = "weir-bench",
    about = "weir's benchmarks: figures per wall and CPU second beside a same-run baseline"
)]
struct Cli {
    #[arg(value_enum)]
    suite: Suite,
    /// One JSON object per line instead of a table.
    #[arg(long)]
    json: bool,
    /// Small inputs: a smoke run, not a measurement.
    #[arg(long)]
    quick: bool,
    /// Run only the benchmarks whose name contains this text (a text no benchmark of the
    /// suite has is a usage error, exit 2).
    #[arg(long, value_parser = clap::builder::NonEmptyStringValueParser::new())]
    only: Option<String>,
}

fn main() {
    let cli = Cli::parse();
    let opts = Opts {
        json: cli.json,
        quick: cli.quick,
        only: cli.only,
    };
    let mut rows = Vec::new();
    if matches!(cli.suite, Suite::Runtime | Suite::All) {
        rows.extend(weir_benches::runtime::run(&opts));
    }
    if matches!(cli.suite, Suite::State | Suite::All) {
        rows.extend(weir_benches::state::run(&opts));
    }
    if matches!(cli.suite, Suite::Checkpoint | Suite::All) {
        rows.extend(weir_benches::checkpoint::run(&opts));
    }
    if matches!(cli.suite, Suite::Nexmark | Suite::All) {
        rows.extend(weir_benches::nexmark::run(&opts));
    }
    rows.retain(|r| opts.shows(&r.bench));
    if let (Some(only), true) = (&opts.only, rows.is_empty()) {
        // It printed an empty table, or nothing, and exited 0: a misspelt name looked like a
        // benchmark that measured nothing.
        eprintln!(
            "error: --only {only:?}: no benchmark of the {:?} suite has it in its name",
            cli.suite
        );
        std::process::exit(2);
    }
    if opts.json {
        print_json(&rows);
    } else {
        print_table(&rows);
    }
}
