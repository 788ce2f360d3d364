//! `weir`: run jobs, and (with checkpointing) list, verify and inspect checkpoints.
//!
//! Exit codes: 0 success, 1 a failure of the job or its input (one line on stderr naming what
//! and where), 2 a usage error.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

mod demo;
mod jobs;

#[derive(Parser)]
#[command(
    name = "weir",
    version,
    about = "weir: an embeddable thread-per-core stream processor"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a built-in job.
    #[command(subcommand)]
    Run(RunCommand),
}

#[derive(Subcommand)]
enum RunCommand {
    /// For every input record, emit `key,running_sum` (the sum of that key's values so far).
    KeyedSum(KeyedSumArgs),
    /// Count records per key in event-time tumbling windows; emit `window_start_ms,key,count`.
    WindowCount(WindowCountArgs),
    /// A seeded generator job with keyed state and windows, with a live status line.
    Demo(DemoArgs),
}

/// Input format of a file source.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Format {
    Csv,
    Jsonl,
}

#[derive(Args, Clone)]
pub struct InputArgs {
    /// A file, or a directory whose files are read in name order.
    #[arg(long)]
    pub input: PathBuf,
    #[arg(long, value_enum)]
    pub format: Format,
    /// What to do with a malformed line: fail (naming file and line), skip (and count), or
    /// dead-letter=PATH (append it to a JSON-lines file).
    #[arg(long, default_value = "fail", value_parser = parse_policy)]
    pub on_error: Policy,
    /// Number of shards (default: one per core).
    #[arg(long)]
    pub shards: Option<usize>,
    /// Directory for the output CSV files (`part-<shard>.csv`).
    #[arg(long)]
    pub output: PathBuf,
}

#[derive(Clone, Debug)]
pub enum Policy {
    Fail,
    Skip,
    DeadLetter(PathBuf),
}

fn parse_policy(s: &str) -> Result<Policy, String> {
    match s {
        "fail" => Ok(Policy::Fail),
        "skip" => Ok(Policy::Skip),
        _ => match s.strip_prefix("dead-letter=") {
            Some(p) if !p.is_empty() => Ok(Policy::DeadLetter(PathBuf::from(p))),
            _ => Err(format!("`{s}` is not one of fail, skip, dead-letter=PATH")),
        },
    }
}

fn parse_duration_ms(s: &str) -> Result<i64, String> {
    let d: Duration = humantime::parse_duration(s)
        .map_err(|e| format!("`{s}`: {e} (examples: 10s, 500ms, 2m)"))?;
    i64::try_from(d.as_millis()).map_err(|_| format!("`{s}` is too long"))
}

#[derive(Args)]
pub struct KeyedSumArgs {
    #[command(flatten)]
    pub input: InputArgs,
    /// The key column (CSV header name or JSON field).
    #[arg(long)]
    pub key: String,
    /// The integer value column.
    #[arg(long)]
    pub value: String,
}

#[derive(Args)]
pub struct WindowCountArgs {
    #[command(flatten)]
    pub input: InputArgs,
    #[arg(long)]
    pub key: String,
    /// The event-time column: integer milliseconds since the epoch.
    #[arg(long)]
    pub timestamp: String,
    /// Window size, e.g. 10s.
    #[arg(long, value_parser = parse_duration_ms)]
    pub window: i64,
    /// How late a record may arrive relative to the largest timestamp seen, e.g. 2s.
    #[arg(long, value_parser = parse_duration_ms, default_value = "0ms")]
    pub out_of_orderness: i64,
}

#[derive(Args)]
pub struct DemoArgs {
    /// Events to generate.
    #[arg(long, default_value_t = 20_000_000)]
    pub events: u64,
    #[arg(long)]
    pub shards: Option<usize>,
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Distinct auctions (keys).
    #[arg(long, default_value_t = 100_000)]
    pub keys: u64,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.command {
        Command::Run(RunCommand::KeyedSum(a)) => jobs::keyed_sum(&a),
        Command::Run(RunCommand::WindowCount(a)) => jobs::window_count(&a),
        Command::Run(RunCommand::Demo(a)) => demo::run(&a),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}
