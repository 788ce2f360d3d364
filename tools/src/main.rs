//! `weir`: run jobs, and (with checkpointing) list, verify, inspect and clean checkpoints.
//!
//! Exit codes: 0 success, 1 a failure of the job or its input (one line on stderr naming what
//! and where), 2 a usage error, 3 a checkpoint that failed `verify` (naming file and offset).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

mod checkpoints;
mod demo;
mod jobs;
mod stop;

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
#[expect(
    clippy::large_enum_variant,
    reason = "parsed once at startup; boxing buys nothing"
)]
enum Command {
    /// Run a built-in job.
    #[command(subcommand)]
    Run(RunCommand),
    /// List, verify, inspect and clean checkpoints; make savepoints of them.
    #[command(subcommand)]
    Checkpoints(CheckpointsCommand),
}

#[derive(Subcommand)]
enum CheckpointsCommand {
    /// List the checkpoints under DIR (a checkpoint directory or one job's directory in it).
    List(checkpoints::ListArgs),
    /// Check every CRC of every file a checkpoint uses; exit 3 on corruption.
    Verify(checkpoints::VerifyArgs),
    /// Show what a checkpoint or savepoint holds: its files and each shard's parts.
    Inspect(checkpoints::InspectArgs),
    /// Keep the newest complete checkpoints (--keep, default 1) and delete what nothing kept
    /// uses; refuses while the job runs.
    Clean(checkpoints::CleanArgs),
    /// Copy a complete checkpoint into a self-contained savepoint directory (for --restore
    /// PATH, on any number of shards); prints its path.
    Savepoint(checkpoints::SavepointArgs),
}

/// Checkpointing of `weir run` jobs.
// The field docs are clap's help text, where `<job-id>` is meant literally.
#[allow(rustdoc::invalid_html_tags)]
#[derive(Args, Clone, Debug, Default)]
pub struct CheckpointArgs {
    /// Checkpoint into DIR/<job-id>; with it, --output is written exactly once (two-phase
    /// commit) and a failed job restarts from its latest checkpoint.
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Interval between checkpoints.
    // `requires`: without --checkpoint-dir these flags were ignored without a word.
    #[arg(long, value_parser = parse_interval_ms, default_value = "1s", requires = "checkpoint_dir")]
    pub checkpoint_interval: i64,
    /// exactly-once or at-least-once (which takes no --unaligned: it does not align).
    #[arg(
        long,
        value_enum,
        default_value = "exactly-once",
        requires = "checkpoint_dir"
    )]
    pub mode: ModeArg,
    /// Barriers overtake in-flight data, which is stored with the checkpoint.
    #[arg(long, requires = "checkpoint_dir")]
    pub unaligned: bool,
    /// With --unaligned: align for this long first, then turn unaligned (without it, checkpoints
    /// stay aligned and this has no effect, as in Flink; `weir run` says so on stderr).
    #[arg(long, value_parser = parse_timeout_ms)]
    pub aligned_timeout: Option<i64>,
    /// Restore from `latest` (the newest complete checkpoint in --checkpoint-dir; none: start
    /// from the beginning) or from a checkpoint or savepoint directory.
    // Empty, it was taken for a directory: "restore: : checkpoint 0 not found".
    #[arg(long, value_parser = clap::builder::NonEmptyStringValueParser::new())]
    pub restore: Option<String>,
    /// Let restore fall back to an older checkpoint even where that may duplicate output.
    #[arg(long)]
    pub allow_fallback: bool,
    /// Let restore skip the state of operators this job does not have (as Flink's
    /// --allowNonRestoredState); without it such a restore fails, naming them.
    #[arg(long)]
    pub allow_non_restored_state: bool,
    /// The job's name in the checkpoint directory (default: the job's kind).
    #[arg(long, requires = "checkpoint_dir")]
    pub job_id: Option<String>,
    /// Complete checkpoints to keep (at least 1).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..), requires = "checkpoint_dir")]
    pub retained: u64,
    /// Where a stop (SIGINT or SIGTERM) writes the job's savepoint [default:
    /// CHECKPOINT_DIR/savepoints]. A second signal ends the process at once.
    #[arg(long, requires = "checkpoint_dir")]
    pub savepoint_dir: Option<PathBuf>,
    /// Where the shards keep their local state (segment files) [default: a fresh directory in
    /// the system's temporary directory, removed at exit]. On the checkpoint directory's file
    /// system, checkpoints hard-link segments instead of copying them.
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, Default, ValueEnum)]
pub enum ModeArg {
    #[default]
    ExactlyOnce,
    AtLeastOnce,
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
    #[arg(long, value_parser = parse_shards)]
    pub shards: Option<usize>,
    /// Directory for the output CSV files (`part-*.csv`).
    #[arg(long)]
    pub output: PathBuf,
    #[command(flatten)]
    pub checkpoint: CheckpointArgs,
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

/// Applies the checkpoint flags (and `--state-dir`) to a job configuration.
pub fn apply_checkpointing(
    c: weir_runtime::JobConfig,
    a: &CheckpointArgs,
    default_job_id: &str,
) -> Result<weir_runtime::JobConfig, String> {
    use weir_runtime::checkpoint::{CheckpointConfig, CheckpointMode};
    let c = match &a.state_dir {
        Some(d) => c.with_state_dir(d),
        None => c,
    };
    // Used only when a signal stops the job: a file there failed that savepoint then, the job
    // going on until a second signal ended it without one.
    if let Some(d) = a
        .savepoint_dir
        .as_ref()
        .filter(|d| d.exists() && !d.is_dir())
    {
        return Err(format!(
            "--savepoint-dir {}: exists and is not a directory",
            d.display()
        ));
    }
    let Some(dir) = &a.checkpoint_dir else {
        if a.restore.as_deref() == Some("latest") {
            return Err("--restore latest needs --checkpoint-dir".into());
        }
        let c = c
            .with_allow_fallback(a.allow_fallback)
            .with_allow_non_restored_state(a.allow_non_restored_state);
        return Ok(match &a.restore {
            Some(p) => c.with_restore(weir_runtime::RestoreFrom::Path(p.into())),
            None => c,
        });
    };
    let mut ck = CheckpointConfig::new(dir, a.job_id.as_deref().unwrap_or(default_job_id))
        .with_interval(Duration::from_millis(a.checkpoint_interval.unsigned_abs()))
        .with_mode(match a.mode {
            ModeArg::ExactlyOnce => CheckpointMode::ExactlyOnce,
            ModeArg::AtLeastOnce => CheckpointMode::AtLeastOnce,
        })
        .with_unaligned(a.unaligned)
        .with_retained(usize::try_from(a.retained).unwrap_or(usize::MAX));
    if let Some(t) = a.aligned_timeout {
        ck = ck.with_aligned_timeout(Duration::from_millis(t.max(0) as u64));
    }
    let mut c = c
        .with_checkpointing(ck)
        .with_allow_fallback(a.allow_fallback)
        .with_allow_non_restored_state(a.allow_non_restored_state);
    match a.restore.as_deref() {
        None => {}
        Some("latest") => c = c.with_restore(weir_runtime::RestoreFrom::Latest),
        Some(p) => c = c.with_restore(weir_runtime::RestoreFrom::Path(p.into())),
    }
    Ok(c)
}

fn parse_duration_ms(s: &str) -> Result<i64, String> {
    let d: Duration = humantime::parse_duration(s)
        .map_err(|e| format!("`{s}`: {e} (examples: 10s, 500ms, 2m)"))?;
    if !d.subsec_nanos().is_multiple_of(1_000_000) {
        return Err(format!("`{s}` is not a whole number of milliseconds"));
    }
    i64::try_from(d.as_millis()).map_err(|_| format!("`{s}` is too long"))
}

/// A duration that must not be zero (a window size, a checkpoint interval).
fn parse_positive_ms(s: &str) -> Result<i64, String> {
    match parse_duration_ms(s)? {
        0 => Err(format!("`{s}` must be more than 0")),
        ms => Ok(ms),
    }
}

/// A checkpoint duration past `MAX_DURATION` is refused here, as a usage error naming the
/// flag: the job's own check of it came later, as exit 1 naming a configuration key.
fn at_most_max_duration(s: &str, ms: i64) -> Result<i64, String> {
    let max = weir_runtime::checkpoint::config::MAX_DURATION;
    if u128::from(ms.unsigned_abs()) > max.as_millis() {
        return Err(format!(
            "`{s}` is more than {}, the longest duration accepted",
            humantime::format_duration(max)
        ));
    }
    Ok(ms)
}

/// `--checkpoint-interval`: more than zero, at most `MAX_DURATION`.
fn parse_interval_ms(s: &str) -> Result<i64, String> {
    at_most_max_duration(s, parse_positive_ms(s)?)
}

/// `--aligned-timeout`: zero (start unaligned) up to `MAX_DURATION`.
fn parse_timeout_ms(s: &str) -> Result<i64, String> {
    at_most_max_duration(s, parse_duration_ms(s)?)
}

/// The runtime's limit on shards (`JobConfig::validate`).
const MAX_SHARDS: usize = 1024;

/// `--shards`: checked as the flag is parsed, so that 0 or 100000 is a usage error naming the
/// flag (exit 2) rather than exit 1 after the demo had announced "on 0 shards".
fn parse_shards(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n @ 1..=MAX_SHARDS) => Ok(n),
        _ => Err(format!(
            "`{s}` is not a number of shards in 1..={MAX_SHARDS}"
        )),
    }
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
    #[arg(long, value_parser = parse_positive_ms)]
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
    #[arg(long, value_parser = parse_shards)]
    pub shards: Option<usize>,
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Distinct auctions (keys), at least 1.
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub keys: u64,
    #[command(flatten)]
    pub checkpoint: CheckpointArgs,
}

/// The checkpoint flags of a `weir run` command.
fn run_checkpoint_args(cli: &Cli) -> Option<&CheckpointArgs> {
    match &cli.command {
        Command::Run(RunCommand::KeyedSum(a)) => Some(&a.input.checkpoint),
        Command::Run(RunCommand::WindowCount(a)) => Some(&a.input.checkpoint),
        Command::Run(RunCommand::Demo(a)) => Some(&a.checkpoint),
        Command::Checkpoints(_) => None,
    }
}

/// A combination of flags that clap's attributes cannot refuse (exit code 2).
fn usage_error(cli: &Cli) -> Option<String> {
    let ck = run_checkpoint_args(cli)?;
    // At-least-once does not align barriers, so it has nothing to make unaligned: the flag
    // was ignored without a word (Flink refuses the combination too).
    if ck.unaligned && matches!(ck.mode, ModeArg::AtLeastOnce) {
        return Some("--unaligned needs --mode exactly-once: at-least-once does not align".into());
    }
    None
}

/// A flag that has no effect in the combination given: said on stderr, the run goes on.
/// `--aligned-timeout` without `--unaligned` is one: Flink ignores its aligned-checkpoint
/// timeout unless unaligned checkpoints are on, and a command line that gives it alone is
/// one the flags allow, so it is not refused.
fn usage_note(cli: &Cli) -> Option<&'static str> {
    let ck = run_checkpoint_args(cli)?;
    (ck.aligned_timeout.is_some() && !ck.unaligned).then_some(
        "note: --aligned-timeout has no effect without --unaligned: checkpoints stay aligned",
    )
}

/// Corruption exits with code 3 (after its error line); other failures go on as usual.
fn corrupt_is_3(r: Result<(), checkpoints::VerifyFailed>) -> Result<(), String> {
    match r {
        Ok(()) => Ok(()),
        Err(checkpoints::VerifyFailed::Corrupt(msg)) => {
            eprintln!("error: {msg}");
            std::process::exit(3);
        }
        Err(checkpoints::VerifyFailed::Other(msg)) => Err(msg),
    }
}

fn main() -> ExitCode {
    // A reader that stops early (`weir checkpoints inspect DIR | head`) ends the process as it
    // ends other Unix tools, by SIGPIPE. Rust starts with SIGPIPE ignored, so every print to a
    // closed pipe was a panic ("failed printing to stdout", exit 101) instead.
    // SAFETY: `signal` with SIG_DFL installs no handler of ours; it runs first thing in
    // `main`, before any other thread exists that could race on the disposition.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    if let Some(msg) = usage_error(&cli) {
        use clap::CommandFactory as _;
        Cli::command()
            .error(clap::error::ErrorKind::ArgumentConflict, msg)
            .exit();
    }
    if let Some(note) = usage_note(&cli) {
        eprintln!("weir: {note}");
    }
    let r = match cli.command {
        Command::Run(RunCommand::KeyedSum(a)) => jobs::keyed_sum(&a),
        Command::Run(RunCommand::WindowCount(a)) => jobs::window_count(&a),
        Command::Run(RunCommand::Demo(a)) => demo::run(&a),
        Command::Checkpoints(CheckpointsCommand::List(a)) => checkpoints::list(&a),
        Command::Checkpoints(CheckpointsCommand::Verify(a)) => {
            corrupt_is_3(checkpoints::verify(&a))
        }
        Command::Checkpoints(CheckpointsCommand::Inspect(a)) => {
            corrupt_is_3(checkpoints::inspect(&a))
        }
        Command::Checkpoints(CheckpointsCommand::Clean(a)) => checkpoints::clean(&a),
        Command::Checkpoints(CheckpointsCommand::Savepoint(a)) => {
            corrupt_is_3(checkpoints::savepoint(&a))
        }
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}
