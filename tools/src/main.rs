//! `weir`: run jobs, and (with checkpointing) list, verify, inspect and clean checkpoints.
//!
//! Exit codes: 0 success, 1 a failure of the job or its input (one line on stderr naming what
//! and where), 2 a usage error, 3 a checkpoint that failed `verify` (naming file and offset),
//! or a job `clean` left whole because its `RUN_ORIGIN` record does not decode.

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
    /// uses; refuses while the job runs, and leaves whole (exit 3) a job whose RUN_ORIGIN
    /// does not decode.
    Clean(checkpoints::CleanArgs),
    /// Copy a complete checkpoint into a self-contained savepoint directory (for --restore
    /// PATH, on any number of shards); prints its path.
    Savepoint(checkpoints::SavepointArgs),
}

/// Checkpointing of `weir run` jobs.
// The field docs are clap's help text, where `<job-id>` is meant literally.
#[allow(rustdoc::invalid_html_tags)]
#[derive(Args, Clone, Debug, Default)]
#[command(group(
    clap::ArgGroup::new("checkpointing")
        .multiple(true)
        .args(["checkpoint_dir", "checkpoint_config"])
))]
pub struct CheckpointArgs {
    /// Checkpoint into DIR/<job-id>; with it, a failed job restarts from its latest
    /// checkpoint, and a file job's --output is written exactly once (two-phase commit).
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Checkpoint and restart settings from a TOML file (dir, job-id, interval, timeout,
    /// min-pause, max-concurrent, mode, unaligned, aligned-timeout, tolerable-failures,
    /// retained, incremental, and a `[restart]` table: see the README). Flags given beside it
    /// override its values; its `dir` stands for --checkpoint-dir.
    #[arg(long, value_name = "FILE")]
    pub checkpoint_config: Option<PathBuf>,
    /// Interval between checkpoints [default: 1s].
    // `requires`: without a checkpoint directory these flags were ignored without a word.
    // No clap default: a flag given overrides the --checkpoint-config file, a default must not.
    #[arg(long, allow_hyphen_values = true, value_parser = parse_interval_ms, requires = "checkpointing")]
    pub checkpoint_interval: Option<i64>,
    /// exactly-once or at-least-once (which takes no --unaligned: it does not align) [default:
    /// exactly-once].
    #[arg(long, value_enum, requires = "checkpointing")]
    pub mode: Option<ModeArg>,
    /// Barriers overtake in-flight data, which is stored with the checkpoint.
    #[arg(long, requires = "checkpointing")]
    pub unaligned: bool,
    /// With --unaligned: align for this long first, then turn unaligned (without it, checkpoints
    /// stay aligned and this has no effect, as in Flink; `weir run` says so on stderr).
    #[arg(long, allow_hyphen_values = true, value_parser = parse_timeout_ms)]
    pub aligned_timeout: Option<i64>,
    /// Restore from `latest` (the newest complete checkpoint of the last run in
    /// --checkpoint-dir, else what that run restored; neither: start from the beginning) or
    /// from a checkpoint or savepoint directory.
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
    #[arg(long, value_parser = parse_job_id, requires = "checkpointing")]
    pub job_id: Option<String>,
    /// Complete checkpoints to keep (at least 1) [default: 1].
    #[arg(long, allow_hyphen_values = true, value_parser = clap::value_parser!(u64).range(1..), requires = "checkpointing")]
    pub retained: Option<u64>,
    /// Where a stop (SIGINT or SIGTERM) writes the job's savepoint [default:
    /// CHECKPOINT_DIR/savepoints]. A second signal ends the process at once.
    #[arg(long, requires = "checkpointing")]
    pub savepoint_dir: Option<PathBuf>,
    /// Where the shards keep their local state (segment files) [default: a fresh directory in
    /// the system's temporary directory, removed at exit]. On the checkpoint directory's file
    /// system, checkpoints hard-link segments instead of copying them.
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    /// The checkpointing these flags and the --checkpoint-config file resolve to (see
    /// [`resolve_checkpointing`]); `None` without checkpointing.
    #[arg(skip)]
    pub resolved: Option<weir_runtime::checkpoint::CheckpointConfig>,
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
    #[arg(long, allow_hyphen_values = true, value_parser = parse_shards)]
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

/// Applies the resolved checkpointing (see [`resolve_checkpointing`]), the restore flags and
/// `--state-dir` to a job configuration.
pub fn apply_checkpointing(
    c: weir_runtime::JobConfig,
    a: &CheckpointArgs,
) -> Result<weir_runtime::JobConfig, String> {
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
    for (flag, d) in [
        ("--state-dir", &a.state_dir),
        ("--savepoint-dir", &a.savepoint_dir),
    ] {
        if let Some(d) = d {
            jobs::check_outside_job_dir(flag, d, a)?;
        }
    }
    let Some(ck) = a.resolved.clone() else {
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

/// `--job-id`: a name the checkpoint directory takes, refused as the flag is parsed (before,
/// the job refused it when it opened its checkpoint storage, exit 1).
fn parse_job_id(s: &str) -> Result<String, String> {
    if weir_io::is_valid_name(s) {
        Ok(s.to_string())
    } else {
        Err(weir_io::VALID_NAME.to_string())
    }
}

/// `--shards`: checked as the flag is parsed, so that 0 or 100000 is a usage error naming the
/// flag (exit 2) rather than exit 1 after the demo had announced "on 0 shards". Every `weir
/// run` job is keyed, and a job has no more shards than key groups (its max parallelism,
/// `JobConfig`'s default: 128): 129 to 1024 passed here and failed the job (exit 1, naming
/// `max_parallelism`, which no flag sets).
fn parse_shards(s: &str) -> Result<usize, String> {
    let max = usize::from(weir_runtime::JobConfig::new().max_parallelism);
    match s.parse::<usize>() {
        Ok(n) if (1..=max).contains(&n) => Ok(n),
        _ => Err(format!(
            "`{s}` is not a number of shards in 1..={max} (the jobs' key groups)"
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
    #[arg(long, allow_hyphen_values = true, value_parser = parse_positive_ms)]
    pub window: i64,
    /// How late a record may arrive relative to the largest timestamp seen, e.g. 2s.
    #[arg(long, allow_hyphen_values = true, value_parser = parse_duration_ms, default_value = "0ms")]
    pub out_of_orderness: i64,
}

#[derive(Args)]
pub struct DemoArgs {
    /// Events to generate.
    #[arg(long, allow_hyphen_values = true, default_value_t = 20_000_000)]
    pub events: u64,
    #[arg(long, allow_hyphen_values = true, value_parser = parse_shards)]
    pub shards: Option<usize>,
    #[arg(long, allow_hyphen_values = true, default_value_t = 42)]
    pub seed: u64,
    /// Distinct auctions (keys), at least 1.
    #[arg(long, allow_hyphen_values = true, default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub keys: u64,
    #[command(flatten)]
    pub checkpoint: CheckpointArgs,
}

/// The checkpoint flags of a `weir run` command, and the job's kind (its default job id).
fn run_checkpoint_args(cli: &mut Cli) -> Option<(&mut CheckpointArgs, &'static str)> {
    match &mut cli.command {
        Command::Run(RunCommand::KeyedSum(a)) => Some((&mut a.input.checkpoint, "keyed-sum")),
        Command::Run(RunCommand::WindowCount(a)) => Some((&mut a.input.checkpoint, "window-count")),
        Command::Run(RunCommand::Demo(a)) => Some((&mut a.checkpoint, "demo")),
        Command::Checkpoints(_) => None,
    }
}

/// Resolves a run's checkpointing, each layer over the one before: `weir run`'s defaults (a
/// checkpoint every second, the job's kind as its id, the rest Flink's), the
/// `--checkpoint-config` file, the flags given. The resolved directory and job id are
/// written back into the flags, which the rest of the run reads (output paths, the
/// dead-letter start record, savepoints); `a.resolved` is left `None` without checkpointing.
/// An error is a usage error (exit code 2). Returns a note for a setting that has no effect
/// in the combination given: an aligned-checkpoint timeout without unaligned checkpoints.
/// Flink ignores that timeout unless unaligned checkpoints are on, and a command line that
/// gives it alone is one the flags allow, so it is not refused.
fn resolve_checkpointing(a: &mut CheckpointArgs, kind: &str) -> Result<Option<String>, String> {
    use weir_runtime::checkpoint::{CheckpointConfig, CheckpointMode};
    const FLAG_NOTE: &str =
        "note: --aligned-timeout has no effect without --unaligned: checkpoints stay aligned";
    if a.checkpoint_dir.is_none() && a.checkpoint_config.is_none() {
        return Ok(a.aligned_timeout.map(|_| FLAG_NOTE.to_string()));
    }
    let mut c = CheckpointConfig::new(PathBuf::new(), kind).with_interval(Duration::from_secs(1));
    let mut file = None;
    if let Some(path) = &a.checkpoint_config {
        let named =
            |e: &dyn std::fmt::Display| format!("--checkpoint-config {}: {e}", path.display());
        let text = std::fs::read_to_string(path).map_err(|e| named(&e))?;
        c = c.with_toml(&text).map_err(|e| named(&e))?;
        file = Some(path.display().to_string());
    }
    if let Some(d) = &a.checkpoint_dir {
        c.dir = d.clone();
    }
    if let Some(j) = &a.job_id {
        c.job_id = j.clone();
    }
    if let Some(ms) = a.checkpoint_interval {
        c.interval = Some(Duration::from_millis(ms.unsigned_abs()));
    }
    if let Some(m) = a.mode {
        c.mode = match m {
            ModeArg::ExactlyOnce => CheckpointMode::ExactlyOnce,
            ModeArg::AtLeastOnce => CheckpointMode::AtLeastOnce,
        };
    }
    if a.unaligned {
        c.unaligned = true;
    }
    if let Some(ms) = a.aligned_timeout {
        c.aligned_timeout = Duration::from_millis(ms.unsigned_abs());
    }
    if let Some(n) = a.retained {
        c.retained = usize::try_from(n).unwrap_or(usize::MAX);
    }
    if c.dir.as_os_str().is_empty() {
        return Err(format!(
            "--checkpoint-config {}: sets no `dir`, and no --checkpoint-dir is given: say where \
             checkpoints go",
            file.unwrap_or_default()
        ));
    }
    // At-least-once does not align barriers, so it has nothing to make unaligned: the setting
    // was ignored without a word (Flink refuses the combination too).
    if c.unaligned && c.mode == CheckpointMode::AtLeastOnce {
        return Err(match file {
            None => "--unaligned needs --mode exactly-once: at-least-once does not align".into(),
            Some(f) => format!(
                "unaligned checkpoints need mode exactly-once, and --checkpoint-config {f} with \
                 the flags gives at-least-once: at-least-once does not align"
            ),
        });
    }
    // The flags' values were checked as they were parsed, the file's as it loaded; this
    // checks what they make together.
    c.validate().map_err(|e| e.to_string())?;
    let note = match (&file, a.aligned_timeout) {
        _ if c.unaligned => None,
        (_, Some(_)) => Some(FLAG_NOTE.to_string()),
        (Some(f), None) if !c.aligned_timeout.is_zero() => Some(format!(
            "note: aligned-timeout in --checkpoint-config {f} has no effect without unaligned \
             checkpoints: checkpoints stay aligned"
        )),
        _ => None,
    };
    a.checkpoint_dir = Some(c.dir.clone());
    a.job_id = Some(c.job_id.clone());
    a.resolved = Some(c);
    Ok(note)
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

/// A usage error as one line on stderr, exit code 2 (clap's own rendering adds the usage and
/// a hint on lines of their own, and the usage of `weir` itself for a subcommand's error);
/// help and version print as clap prints them.
fn usage_error(e: clap::Error) -> ! {
    use clap::error::ErrorKind;
    if matches!(
        e.kind(),
        ErrorKind::DisplayHelp
            | ErrorKind::DisplayVersion
            | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
    ) {
        e.exit()
    }
    let text = e.render().to_string();
    let line = text
        .lines()
        .map(str::trim)
        .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"))
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ");
    eprintln!("{line} (--help says more)");
    std::process::exit(2);
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
    let mut cli = Cli::try_parse().unwrap_or_else(|e| usage_error(e));
    if let Some((ck, kind)) = run_checkpoint_args(&mut cli) {
        match resolve_checkpointing(ck, kind) {
            Ok(Some(note)) => eprintln!("weir: {note}"),
            Ok(None) => {}
            Err(msg) => {
                use clap::CommandFactory as _;
                usage_error(Cli::command().error(clap::error::ErrorKind::ArgumentConflict, msg));
            }
        }
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
        Command::Checkpoints(CheckpointsCommand::Clean(a)) => corrupt_is_3(checkpoints::clean(&a)),
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
