//! Checkpoint and restart configuration, with Flink's defaults. Built with methods or loaded
//! from TOML; an unknown key or a bad value is an error naming the key.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;

/// The longest duration any setting may have: 100 years (humantime's years of 365.25 days,
/// so `"100years"` itself passes). Flink takes any `java.time.Duration`, but nobody waits a
/// century for a checkpoint or a restart; users who mean "never" write a year or so. The
/// bound keeps every deadline the coordinator and the supervisor compute (`now` plus an
/// interval or a restart delay, the delay doubled at most by jitter) far inside what an
/// `Instant` holds, where `"300000000000years"` overflowed it and panicked inside the job.
pub const MAX_DURATION: Duration = Duration::from_secs(100 * 31_557_600);

/// The guarantee checkpoints give.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CheckpointMode {
    /// Barriers are aligned (or unaligned): after a restore every record counts exactly once.
    #[default]
    ExactlyOnce,
    /// Nothing blocks; after a restore some records may count twice.
    AtLeastOnce,
}

/// What to do when a job fails.
#[derive(Clone, Debug, PartialEq)]
pub enum RestartStrategy {
    /// Fail the job at once.
    None,
    /// Restart up to `attempts` times, waiting `delay` before each.
    FixedDelay { attempts: u32, delay: Duration },
    /// Restart without limit, the delay growing by `multiplier` from `initial` up to `max`,
    /// with `jitter` (a fraction) of randomness; reset after `reset_after` without failure.
    ExponentialDelay {
        initial: Duration,
        max: Duration,
        multiplier: f64,
        jitter: f64,
        reset_after: Duration,
    },
    /// Restart unless more than `max_failures` happened within `interval`.
    FailureRate {
        max_failures: u32,
        interval: Duration,
        delay: Duration,
    },
}

impl Default for RestartStrategy {
    /// Flink's default with checkpointing: exponential delay, 1 s initial, x1.5, 1 min max,
    /// jitter 0.1.
    fn default() -> Self {
        RestartStrategy::ExponentialDelay {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(60),
            multiplier: 1.5,
            jitter: 0.1,
            reset_after: Duration::from_secs(3600),
        }
    }
}

/// How a job checkpoints. Defaults as Flink's.
#[derive(Clone, Debug)]
pub struct CheckpointConfig {
    /// Where checkpoints go: `<dir>/<job-id>/chk-<n>/...`.
    pub dir: PathBuf,
    /// The job's name in the checkpoint directory.
    pub job_id: String,
    /// Periodic trigger interval; `None`: only manual triggers.
    pub interval: Option<Duration>,
    /// A checkpoint not complete after this is aborted.
    pub timeout: Duration,
    /// Least time between the end of one checkpoint and the trigger of the next.
    pub min_pause: Duration,
    pub max_concurrent: usize,
    pub mode: CheckpointMode,
    /// Barriers overtake in-flight data, which is stored with the checkpoint.
    pub unaligned: bool,
    /// With `unaligned`: an aligned checkpoint that waits longer than this turns unaligned
    /// (zero: start unaligned).
    pub aligned_timeout: Duration,
    /// Failed checkpoints tolerated in a row before the job fails.
    pub tolerable_failures: u32,
    /// Complete checkpoints kept.
    pub retained: usize,
    /// Write only what the previous checkpoint does not hold; off, every checkpoint writes
    /// the whole keyed state (see [`Self::with_incremental`]).
    pub incremental: bool,
    pub restart: RestartStrategy,
    /// The file system the checkpoint storage writes through; `None` (the default): io_uring
    /// (see [`Self::with_fs`]).
    pub fs: Option<std::sync::Arc<dyn weir_io::Fs>>,
}

impl CheckpointConfig {
    /// Checkpoints into `dir` for job `job_id`, with Flink's defaults and no periodic trigger.
    pub fn new(dir: impl Into<PathBuf>, job_id: impl Into<String>) -> Self {
        Self {
            dir: dir.into(),
            job_id: job_id.into(),
            interval: None,
            timeout: Duration::from_secs(600),
            min_pause: Duration::ZERO,
            max_concurrent: 1,
            mode: CheckpointMode::ExactlyOnce,
            unaligned: false,
            aligned_timeout: Duration::ZERO,
            tolerable_failures: 0,
            retained: 1,
            incremental: true,
            restart: RestartStrategy::default(),
            fs: None,
        }
    }

    pub fn with_interval(mut self, d: Duration) -> Self {
        self.interval = Some(d);
        self
    }
    pub fn with_timeout(mut self, d: Duration) -> Self {
        self.timeout = d;
        self
    }
    pub fn with_min_pause(mut self, d: Duration) -> Self {
        self.min_pause = d;
        self
    }
    pub fn with_mode(mut self, m: CheckpointMode) -> Self {
        self.mode = m;
        self
    }
    pub fn with_unaligned(mut self, on: bool) -> Self {
        self.unaligned = on;
        self
    }
    pub fn with_aligned_timeout(mut self, d: Duration) -> Self {
        self.aligned_timeout = d;
        self
    }
    pub fn with_tolerable_failures(mut self, n: u32) -> Self {
        self.tolerable_failures = n;
        self
    }
    /// At least 1: [`Self::validate`] refuses 0, as `from_toml` does (it was made 1 without
    /// a word).
    pub fn with_retained(mut self, n: usize) -> Self {
        self.retained = n;
        self
    }
    pub fn with_max_concurrent(mut self, n: usize) -> Self {
        self.max_concurrent = n;
        self
    }
    /// Off: every checkpoint writes the whole keyed state again and shares no file with
    /// another (Flink's full checkpoints); on (the default), it writes only the segments the
    /// previous complete checkpoint does not hold.
    pub fn with_incremental(mut self, on: bool) -> Self {
        self.incremental = on;
        self
    }
    pub fn with_restart(mut self, r: RestartStrategy) -> Self {
        self.restart = r;
        self
    }
    /// Write checkpoints through another file-system implementation, as the exactly-once file
    /// sink can (`TransactionalFileSink::with_fs`): `weir_io::FaultyFs` in tests of I/O
    /// failures while a job runs. Restores from a path (`RestoreFrom::Path`) read through
    /// `std::fs`.
    pub fn with_fs(mut self, fs: std::sync::Arc<dyn weir_io::Fs>) -> Self {
        self.fs = Some(fs);
        self
    }

    /// Checks every value, naming the bad one by its TOML key (`restart.<key>` for the restart
    /// strategy's): [`Self::from_toml`] runs it, and so does `JobConfig::validate` when a job
    /// starts, so that a configuration built in code meets the same rules. `dir` must not be
    /// empty, and the job id must be a name the checkpoint directory takes
    /// ([`weir_io::is_valid_name`]). Intervals and timeouts must be at least 1 ms, every
    /// duration at most [`MAX_DURATION`], counts of concurrent and retained checkpoints at
    /// least 1. The restart strategies take what Flink's take: the exponential delay's
    /// `initial` and `reset-after` at least 1 ms and `initial` at most `max`, its multiplier a
    /// finite number of at least 1 (any such works: the delay stops growing at `max`) and its
    /// jitter within 0..=1; the failure rate's `max-failures` at least 1 and `interval` at
    /// least 1 ms.
    pub fn validate(&self) -> Result<(), ConfigError> {
        // An empty path would put the job's checkpoints in the working directory.
        if self.dir.as_os_str().is_empty() {
            return Err(ConfigError::new(
                "dir",
                "is empty: say where checkpoints go",
            ));
        }
        self.validate_values()
    }

    /// [`Self::validate`] but for `dir`, which [`Self::with_toml`] may leave unset.
    fn validate_values(&self) -> Result<(), ConfigError> {
        // The job's directory under `dir`: refused here, naming the key, rather than when the
        // job opens its checkpoint storage.
        if !weir_io::is_valid_name(&self.job_id) {
            return Err(ConfigError::new(
                "job-id",
                &format!("{:?}: {}", self.job_id, weir_io::VALID_NAME),
            ));
        }
        if let Some(d) = self.interval {
            check_duration("interval", d, true)?;
            at_least_1ms("interval", d)?;
        }
        check_duration("timeout", self.timeout, true)?;
        // A timeout under a millisecond expired every checkpoint before it could complete,
        // and an interval under one triggered without pause: built in code they passed
        // (`with_timeout(Duration::from_nanos(1))`), where the flags and the file take whole
        // milliseconds only. 1 ms is the least either takes, as for the restart delays.
        at_least_1ms("timeout", self.timeout)?;
        check_duration("min-pause", self.min_pause, false)?;
        check_duration("aligned-timeout", self.aligned_timeout, false)?;
        if self.max_concurrent == 0 {
            return Err(ConfigError::new("max-concurrent", "must be at least 1"));
        }
        if self.retained == 0 {
            return Err(ConfigError::new("retained", "must be at least 1"));
        }
        // At-least-once does not align barriers, so it has nothing to make unaligned: the
        // setting was ignored without a word (`weir run` refused it already).
        if self.unaligned && self.mode == CheckpointMode::AtLeastOnce {
            return Err(ConfigError::new(
                "unaligned",
                "needs mode exactly-once: at-least-once does not align barriers",
            ));
        }
        let restart = |key: &str, d: Duration| check_duration(&format!("restart.{key}"), d, false);
        match &self.restart {
            RestartStrategy::None => {}
            RestartStrategy::FixedDelay { delay, .. } => restart("delay", *delay)?,
            RestartStrategy::ExponentialDelay {
                initial,
                max,
                multiplier,
                jitter,
                reset_after,
            } => {
                restart("initial", *initial)?;
                restart("max", *max)?;
                restart("reset-after", *reset_after)?;
                // Flink's rules: a zero base delay restarted in a tight loop for ever, and a
                // zero `reset-after` reset the delay at every failure, so it never grew.
                at_least_1ms("restart.initial", *initial)?;
                at_least_1ms("restart.reset-after", *reset_after)?;
                if initial > max {
                    return Err(ConfigError::new(
                        "restart.initial",
                        &format!(
                            "`{}` is more than `restart.max` (`{}`): {INITIAL_OVER_MAX}",
                            humantime::format_duration(*initial),
                            humantime::format_duration(*max)
                        ),
                    ));
                }
                // NaN fails both comparisons, so it is refused too.
                if !(multiplier.is_finite() && *multiplier >= 1.0) {
                    return Err(ConfigError::new(
                        "restart.multiplier",
                        &format!("{multiplier} must be a finite number of at least 1"),
                    ));
                }
                if !(0.0..=1.0).contains(jitter) {
                    return Err(ConfigError::new(
                        "restart.jitter",
                        &format!("{jitter} must be within 0..=1"),
                    ));
                }
            }
            RestartStrategy::FailureRate {
                max_failures,
                interval,
                delay,
            } => {
                restart("interval", *interval)?;
                restart("delay", *delay)?;
                // Flink's rules: 0 failures never restarts (that is strategy `none`), and a
                // zero interval counts no earlier failure, so the job restarted for ever.
                if *max_failures == 0 {
                    return Err(ConfigError::new(
                        "restart.max-failures",
                        "must be at least 1 (strategy `none` restarts never)",
                    ));
                }
                at_least_1ms("restart.interval", *interval)?;
            }
        }
        Ok(())
    }

    /// Loads a configuration from TOML text, over the defaults. Durations are written as
    /// `"1s"`, `"500ms"`, `"2m"`, at most [`MAX_DURATION`], in whole milliseconds as
    /// `weir run`'s flags take them (`"1us"` is refused, naming the key and its line); the
    /// values must pass
    /// [`Self::validate`]. `dir` is required; `job-id` defaults to `"job"`. An error names
    /// the key, and the line where the text has one.
    ///
    /// ```toml
    /// dir = "/var/lib/weir/checkpoints"
    /// job-id = "orders"
    /// interval = "1s"
    /// mode = "exactly-once"
    /// unaligned = true
    /// aligned-timeout = "100ms"
    /// [restart]
    /// strategy = "fixed-delay"
    /// attempts = 3
    /// delay = "1s"
    /// ```
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let raw = RawConfig::parse(text)?;
        let Some(dir) = raw.dir.clone() else {
            return Err(ConfigError::new("dir", "is required"));
        };
        CheckpointConfig::new(dir.into_inner(), "job").load(raw, text)
    }

    /// Loads TOML text (the keys of [`Self::from_toml`]) over this configuration: each key
    /// the text sets replaces this one's value, the others stay, `dir` included (it may be
    /// empty here, and stay so if the text sets none). The result must pass
    /// [`Self::validate`], but for such an empty `dir`. `weir run --checkpoint-config` loads
    /// its file so, over its own defaults, before its flags (which may give the directory).
    pub fn with_toml(self, text: &str) -> Result<Self, ConfigError> {
        let raw = RawConfig::parse(text)?;
        self.load(raw, text)
    }

    fn load(mut self, raw: RawConfig, text: &str) -> Result<Self, ConfigError> {
        let at = |span: std::ops::Range<usize>| line_of(text, span.start);
        // The line of each top-level key set, and `restart.<key>`, for errors `validate`
        // finds in values that parsed.
        let mut lines: KeyLines = Vec::new();
        let mut dur = |key: &'static str,
                       v: Option<Spanned<String>>|
         -> Result<Option<Duration>, ConfigError> {
            let Some(v) = v else { return Ok(None) };
            let line = at(v.span());
            lines.push((key, line));
            whole_ms(key, v.get_ref(), line).map(Some)
        };
        if let Some(d) = dur("interval", raw.interval)? {
            self.interval = Some(d);
        }
        if let Some(d) = dur("timeout", raw.timeout)? {
            self.timeout = d;
        }
        if let Some(d) = dur("min-pause", raw.min_pause)? {
            self.min_pause = d;
        }
        if let Some(d) = dur("aligned-timeout", raw.aligned_timeout)? {
            self.aligned_timeout = d;
        }
        let mut set = |key: &'static str, span: std::ops::Range<usize>| lines.push((key, at(span)));
        let dir_set = raw.dir.is_some();
        if let Some(d) = raw.dir {
            set("dir", d.span());
            self.dir = d.into_inner();
        }
        if let Some(j) = raw.job_id {
            set("job-id", j.span());
            self.job_id = j.into_inner();
        }
        if let Some(n) = raw.max_concurrent {
            set("max-concurrent", n.span());
            self.max_concurrent = n.into_inner();
        }
        if let Some(m) = raw.mode {
            set("mode", m.span());
            self.mode = m.into_inner();
        }
        if let Some(u) = raw.unaligned {
            set("unaligned", u.span());
            self.unaligned = u.into_inner();
        }
        if let Some(n) = raw.tolerable_failures {
            set("tolerable-failures", n.span());
            self.tolerable_failures = n.into_inner();
        }
        if let Some(n) = raw.retained {
            set("retained", n.span());
            self.retained = n.into_inner();
        }
        if let Some(i) = raw.incremental {
            set("incremental", i.span());
            self.incremental = i.into_inner();
        }
        if let Some(r) = raw.restart {
            let (restart, restart_lines) = r.into_strategy(text)?;
            self.restart = restart;
            lines.extend(restart_lines);
        }
        let checked = if dir_set {
            self.validate()
        } else {
            self.validate_values()
        };
        checked.map_err(|e| {
            let line = |key: &str| lines.iter().find(|(k, _)| *k == key).map(|(_, l)| *l);
            match line(&e.key) {
                // `initial` over `max` when the text set only `max` (under the default 1 s
                // `initial`): the key to name is the one the text set.
                None if e.reason.ends_with(INITIAL_OVER_MAX) && line("restart.max").is_some() => {
                    ConfigError {
                        key: "restart.max".into(),
                        line: line("restart.max"),
                        ..e
                    }
                }
                l => ConfigError { line: l, ..e },
            }
        })?;
        Ok(self)
    }
}

/// The 1-based line of byte `offset` in `text`.
fn line_of(text: &str, offset: usize) -> usize {
    let end = offset.min(text.len());
    text.as_bytes()[..end]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

/// Checks one duration setting: not zero where `positive` (a zero interval would trigger
/// without pause, a zero timeout abort every checkpoint), and not past [`MAX_DURATION`].
/// A duration of the file (`"1s"`, `"500ms"`), in whole milliseconds as `weir run`'s flags
/// take them (`--checkpoint-interval 1us` is refused): the file took `interval = "1us"`,
/// `timeout = "1ns"`, `min-pause = "1ns"` and restart delays of microseconds. An error names
/// `key` and `line`.
fn whole_ms(key: &str, raw: &str, line: usize) -> Result<Duration, ConfigError> {
    let d = humantime::parse_duration(raw)
        .map_err(|e| ConfigError::new(key, &format!("`{raw}`: {e}")).at(line))?;
    if !d.subsec_nanos().is_multiple_of(1_000_000) {
        return Err(ConfigError::new(
            key,
            &format!("`{raw}` is not a whole number of milliseconds"),
        )
        .at(line));
    }
    Ok(d)
}

fn check_duration(key: &str, d: Duration, positive: bool) -> Result<(), ConfigError> {
    if positive && d.is_zero() {
        return Err(ConfigError::new(key, "must be more than 0"));
    }
    if d > MAX_DURATION {
        return Err(ConfigError::new(
            key,
            &format!(
                "`{}` is more than {}, the longest duration accepted",
                humantime::format_duration(d),
                humantime::format_duration(MAX_DURATION)
            ),
        ));
    }
    Ok(())
}

/// Checks a restart duration that must be at least 1 ms, as Flink's (in milliseconds) must be
/// more than 0.
fn at_least_1ms(key: &str, d: Duration) -> Result<(), ConfigError> {
    if d < Duration::from_millis(1) {
        return Err(ConfigError::new(
            key,
            &format!("`{}` must be at least 1ms", humantime::format_duration(d)),
        ));
    }
    Ok(())
}

/// Flink's words for an exponential delay whose `initial` is more than its `max`.
const INITIAL_OVER_MAX: &str = "initial backoff cannot be higher than maximum backoff";

/// A configuration error naming the key, and for TOML text the line where it is set (or
/// where the text fails to parse).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("checkpoint configuration `{key}`{}: {reason}", at_line(*.line))]
pub struct ConfigError {
    pub key: String,
    pub reason: String,
    /// 1-based line in the TOML text; `None` for a configuration built in code, or a key the
    /// text does not set (a required one missing).
    pub line: Option<usize>,
}

fn at_line(line: Option<usize>) -> String {
    line.map(|l| format!(" at line {l}")).unwrap_or_default()
}

impl ConfigError {
    fn new(key: &str, reason: &str) -> Self {
        Self {
            key: key.into(),
            reason: reason.into(),
            line: None,
        }
    }

    fn at(self, line: usize) -> Self {
        Self {
            line: Some(line),
            ..self
        }
    }

    fn from_toml(e: &toml::de::Error, text: &str) -> Self {
        // toml names an unknown or missing key in its message; a value of the wrong type or
        // an unknown variant only by its place, which is the key's line (the message's
        // first quoted word is then the value: "`sometimes` at line 2: unknown variant").
        // On one line: toml's syntax errors put what it expected on a second one.
        let msg = e.message().trim_end().replace('\n', "; ");
        let quoted = msg.split('`').nth(1).map(str::to_string);
        let at_span = || e.span().and_then(|s| key_at(text, s.start));
        // Text that is not TOML has no keys to look up, and the message's quoted words are
        // what the parser expected (`interval = ` named the key `"`): the key is the one the
        // line with the error sets, if it sets one.
        let syntax = toml_edit::ImDocument::parse(text).is_err();
        let key = if syntax {
            e.span().and_then(|s| key_on_line(text, s.start))
        } else if let Some(field) = msg.strip_prefix("unknown field") {
            // Named without its table. The fields serde expected tell which (only the restart
            // table has `strategy`), whether the text wrote it as a header, dotted keys or
            // inline; the text around the place did not (`[other]` was `other.other`).
            let in_restart = field
                .split_once("expected")
                .is_some_and(|(_, expected)| expected.contains("`strategy`"));
            quoted.map(|q| {
                if in_restart {
                    format!("restart.{q}")
                } else {
                    q
                }
            })
        } else if msg.starts_with("missing field") {
            // Every top-level key is optional: what is missing is the restart table's.
            quoted.map(|q| format!("restart.{q}"))
        } else {
            at_span().or(quoted)
        }
        .unwrap_or_else(|| "(toml)".to_string());
        Self {
            key,
            reason: msg,
            line: e.span().map(|s| line_of(text, s.start)),
        }
    }
}

/// The key that the line holding `pos` sets (`key = ...`, bare or dotted), under the table
/// of the header above it, read from the text alone (for text that does not parse).
fn key_on_line(text: &str, pos: usize) -> Option<String> {
    let start = text[..pos.min(text.len())].rfind('\n').map_or(0, |i| i + 1);
    let line = text[start..].lines().next().unwrap_or("");
    let (key, _) = line.split_once('=')?;
    let key = key.trim();
    let bare = |k: &str| {
        !k.is_empty()
            && k.split('.').all(|part| {
                let part = part.trim();
                !part.is_empty()
                    && part
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            })
    };
    if !bare(key) {
        return None;
    }
    let key: String = key.split('.').map(str::trim).collect::<Vec<_>>().join(".");
    let table = text[..start].lines().rev().find_map(|l| {
        let l = l.trim();
        let name = l.strip_prefix('[')?.trim_start_matches('[');
        let name = name.split(']').next()?.trim();
        bare(name).then(|| name.to_string())
    });
    Some(match table {
        Some(t) => format!("{t}.{key}"),
        None => key,
    })
}

/// The key whose value is at `pos` in TOML `text`, with its tables (`restart.delay` however
/// the text wrote it: under `[restart]`, as a dotted or quoted key, in an inline table, in a
/// value over several lines); a table header names its table. `None` if the text does not
/// parse or no key's value is at `pos`. The places come from toml_edit, the parser under
/// `toml`'s own, so that they are the places toml's errors name.
fn key_at(text: &str, pos: usize) -> Option<String> {
    let doc = toml_edit::ImDocument::parse(text).ok()?;
    let mut path = Vec::new();
    key_in(doc.as_table(), pos, &mut path).then(|| path.join("."))
}

/// Whether a key of `table` holds `pos`, leaving its path (below `table`) in `path`.
fn key_in(table: &dyn toml_edit::TableLike, pos: usize, path: &mut Vec<String>) -> bool {
    let holds = |span: Option<std::ops::Range<usize>>| span.is_some_and(|s| s.contains(&pos));
    for (key, item) in table.iter() {
        path.push(key.to_string());
        let found = match item {
            // A table's own span may cover its keys: they are asked first.
            toml_edit::Item::ArrayOfTables(tables) => tables
                .iter()
                .any(|t| key_in(t, pos, path) || holds(t.span())),
            toml_edit::Item::Table(t) => key_in(t, pos, path) || holds(t.span()),
            toml_edit::Item::Value(toml_edit::Value::InlineTable(t)) => {
                key_in(t, pos, path) || holds(t.span())
            }
            toml_edit::Item::Value(v) => holds(v.span()),
            toml_edit::Item::None => false,
        };
        if found {
            return true;
        }
        path.pop();
    }
    false
}

// Every value keeps its place in the text, for the line an error names.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct RawConfig {
    dir: Option<Spanned<PathBuf>>,
    job_id: Option<Spanned<String>>,
    interval: Option<Spanned<String>>,
    timeout: Option<Spanned<String>>,
    min_pause: Option<Spanned<String>>,
    max_concurrent: Option<Spanned<usize>>,
    mode: Option<Spanned<CheckpointMode>>,
    unaligned: Option<Spanned<bool>>,
    aligned_timeout: Option<Spanned<String>>,
    tolerable_failures: Option<Spanned<u32>>,
    retained: Option<Spanned<usize>>,
    incremental: Option<Spanned<bool>>,
    // Not `Spanned`: toml's `Spanned` takes no table of dotted keys (`restart.strategy = ..`),
    // and the keys inside keep their own places.
    restart: Option<RawRestart>,
}

impl RawConfig {
    fn parse(text: &str) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::from_toml(&e, text))
    }
}

/// The line of each key a TOML text set, by the key's name in errors.
type KeyLines = Vec<(&'static str, usize)>;

// `expecting`: `restart = "none"` said "expected struct RawRestart".
#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    rename_all = "kebab-case",
    expecting = "a table with `strategy` (none, fixed-delay, exponential-delay or \
                 failure-rate), such as `restart.strategy = \"none\"` or a `[restart]` table"
)]
struct RawRestart {
    strategy: Spanned<String>,
    attempts: Option<Spanned<u32>>,
    delay: Option<Spanned<String>>,
    initial: Option<Spanned<String>>,
    max: Option<Spanned<String>>,
    multiplier: Option<Spanned<f64>>,
    jitter: Option<Spanned<f64>>,
    reset_after: Option<Spanned<String>>,
    max_failures: Option<Spanned<u32>>,
    interval: Option<Spanned<String>>,
}

impl RawRestart {
    /// The strategy, and the line of each key set (`restart.<key>`). A key the strategy does
    /// not take (`attempts` of exponential-delay) is refused rather than ignored.
    fn into_strategy(self, text: &str) -> Result<(RestartStrategy, KeyLines), ConfigError> {
        let mut lines = Vec::new();
        let at = |span: std::ops::Range<usize>| line_of(text, span.start);
        let strategy_line = at(self.strategy.span());
        let taken: &[&str] = match self.strategy.get_ref().as_str() {
            "none" => &[],
            "fixed-delay" => &["attempts", "delay"],
            "exponential-delay" => &["initial", "max", "multiplier", "jitter", "reset-after"],
            "failure-rate" => &["max-failures", "interval", "delay"],
            other => {
                return Err(ConfigError::new(
                    "restart.strategy",
                    &format!(
                        "`{other}` is not one of none, fixed-delay, exponential-delay, \
                         failure-rate"
                    ),
                )
                .at(strategy_line))
            }
        };
        let given = [
            ("attempts", self.attempts.as_ref().map(Spanned::span)),
            ("delay", self.delay.as_ref().map(Spanned::span)),
            ("initial", self.initial.as_ref().map(Spanned::span)),
            ("max", self.max.as_ref().map(Spanned::span)),
            ("multiplier", self.multiplier.as_ref().map(Spanned::span)),
            ("jitter", self.jitter.as_ref().map(Spanned::span)),
            ("reset-after", self.reset_after.as_ref().map(Spanned::span)),
            (
                "max-failures",
                self.max_failures.as_ref().map(Spanned::span),
            ),
            ("interval", self.interval.as_ref().map(Spanned::span)),
        ];
        for (key, span) in given {
            if let Some(span) = span.filter(|_| !taken.contains(&key)) {
                return Err(ConfigError::new(
                    &format!("restart.{key}"),
                    &format!("strategy `{}` takes no `{key}`", self.strategy.get_ref()),
                )
                .at(at(span)));
            }
        }
        for (key, v) in [
            ("restart.attempts", &self.attempts),
            ("restart.max-failures", &self.max_failures),
        ] {
            if let Some(v) = v {
                lines.push((key, at(v.span())));
            }
        }
        let mut num = |key: &'static str, v: Option<Spanned<f64>>, default: f64| match v {
            Some(v) => {
                lines.push((key, at(v.span())));
                v.into_inner()
            }
            None => default,
        };
        let multiplier = num("restart.multiplier", self.multiplier, 1.5);
        let jitter = num("restart.jitter", self.jitter, 0.1);
        let mut d = |key: &'static str,
                     v: Option<Spanned<String>>,
                     default: Duration|
         -> Result<Duration, ConfigError> {
            let Some(v) = v else { return Ok(default) };
            let line = at(v.span());
            lines.push((key, line));
            whole_ms(key, v.get_ref(), line)
        };
        let count = |v: Option<Spanned<u32>>, default: u32| v.map_or(default, Spanned::into_inner);
        let strategy = match self.strategy.get_ref().as_str() {
            "fixed-delay" => RestartStrategy::FixedDelay {
                // Flink's `restart-strategy.fixed-delay.attempts` default.
                attempts: count(self.attempts, 1),
                delay: d("restart.delay", self.delay, Duration::from_secs(1))?,
            },
            // The multiplier and jitter are checked with the rest, in `validate`.
            "exponential-delay" => RestartStrategy::ExponentialDelay {
                initial: d("restart.initial", self.initial, Duration::from_secs(1))?,
                max: d("restart.max", self.max, Duration::from_secs(60))?,
                multiplier,
                jitter,
                reset_after: d(
                    "restart.reset-after",
                    self.reset_after,
                    Duration::from_secs(3600),
                )?,
            },
            "failure-rate" => RestartStrategy::FailureRate {
                max_failures: count(self.max_failures, 1),
                interval: d("restart.interval", self.interval, Duration::from_secs(60))?,
                delay: d("restart.delay", self.delay, Duration::from_secs(1))?,
            },
            _ => RestartStrategy::None,
        };
        Ok((strategy, lines))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_flinks() {
        let c = CheckpointConfig::new("/tmp/x", "j");
        assert_eq!(c.interval, None);
        assert_eq!(c.timeout, Duration::from_secs(600));
        assert_eq!(c.min_pause, Duration::ZERO);
        assert_eq!(c.max_concurrent, 1);
        assert_eq!(c.mode, CheckpointMode::ExactlyOnce);
        assert!(!c.unaligned);
        assert_eq!(c.aligned_timeout, Duration::ZERO);
        assert_eq!(c.tolerable_failures, 0);
        assert_eq!(c.retained, 1);
        assert!(c.incremental);
        assert!(
            matches!(c.restart, RestartStrategy::ExponentialDelay { multiplier, .. } if multiplier == 1.5)
        );
    }

    #[test]
    fn toml_loads_over_defaults() {
        let c = CheckpointConfig::from_toml(
            "dir = \"/d\"\njob-id = \"orders\"\ninterval = \"1s\"\nmode = \"exactly-once\"\nunaligned = true\n\
             aligned-timeout = \"100ms\"\nretained = 3\n[restart]\nstrategy = \"fixed-delay\"\nattempts = 4\ndelay = \"2s\"\n",
        )
        .expect("valid");
        assert_eq!(c.job_id, "orders");
        assert_eq!(c.interval, Some(Duration::from_secs(1)));
        assert_eq!(c.mode, CheckpointMode::ExactlyOnce);
        assert!(c.unaligned);
        assert_eq!(c.aligned_timeout, Duration::from_millis(100));
        assert_eq!(c.retained, 3);
        assert_eq!(
            c.restart,
            RestartStrategy::FixedDelay {
                attempts: 4,
                delay: Duration::from_secs(2)
            }
        );
    }

    /// Keys a strategy's table leaves out take Flink's defaults: one fixed-delay attempt
    /// after 1 s (not unlimited), one failure per minute.
    #[test]
    fn restart_keys_left_out_take_flinks_defaults() {
        let restart = |t: &str| {
            CheckpointConfig::from_toml(&format!("dir = \"/d\"\n[restart]\n{t}"))
                .expect("valid")
                .restart
        };
        assert_eq!(
            restart("strategy = \"fixed-delay\"\n"),
            RestartStrategy::FixedDelay {
                attempts: 1,
                delay: Duration::from_secs(1)
            }
        );
        assert_eq!(
            restart("strategy = \"failure-rate\"\n"),
            RestartStrategy::FailureRate {
                max_failures: 1,
                interval: Duration::from_secs(60),
                delay: Duration::from_secs(1)
            }
        );
        assert_eq!(
            restart("strategy = \"exponential-delay\"\n"),
            RestartStrategy::default()
        );
    }

    #[test]
    fn unknown_keys_and_bad_values_name_the_key() {
        let e = CheckpointConfig::from_toml("dir = \"/d\"\nintervall = \"1s\"\n")
            .expect_err("unknown key");
        assert_eq!(e.key, "intervall", "{e}");
        let e = CheckpointConfig::from_toml("dir = \"/d\"\ninterval = \"soon\"\n")
            .expect_err("bad duration");
        assert_eq!(e.key, "interval");
        let e = CheckpointConfig::from_toml("dir = \"/d\"\nretained = 0\n").expect_err("zero");
        assert_eq!(e.key, "retained");
        let e = CheckpointConfig::from_toml(
            "dir = \"/d\"\nmode = \"at-least-once\"\nunaligned = true\n",
        )
        .expect_err("nothing to make unaligned");
        assert_eq!(e.key, "unaligned");
        let e = CheckpointConfig::new("/d", "j").with_retained(0).validate();
        assert_eq!(e.expect_err("zero").key, "retained");
        let e = CheckpointConfig::from_toml("dir = \"/d\"\n[restart]\nstrategy = \"sometimes\"\n")
            .expect_err("bad strategy");
        assert_eq!(e.key, "restart.strategy");
        for key in ["interval", "timeout"] {
            let e = CheckpointConfig::from_toml(&format!("dir = \"/d\"\n{key} = \"0ms\"\n"))
                .expect_err("zero");
            assert_eq!(
                (e.key.as_str(), e.reason.as_str()),
                (key, "must be more than 0")
            );
        }
        let e = CheckpointConfig::from_toml("interval = \"1s\"\n").expect_err("no dir");
        assert_eq!(e.key, "dir");
        let e =
            CheckpointConfig::from_toml("dir = \"/d\"\nmode = \"twice\"\n").expect_err("bad mode");
        assert!(
            e.reason.contains("twice") || e.reason.contains("variant"),
            "{e}"
        );
    }

    /// An error names the line the key is on, whether the text fails to parse there or its
    /// value fails a check afterwards; a key the text does not set has no line.
    #[test]
    fn errors_name_the_line_of_the_key() {
        let line = |toml: &str| {
            let e = CheckpointConfig::from_toml(toml).expect_err(toml);
            (e.key.clone(), e.line, e.to_string())
        };
        let (key, at, msg) = line("dir = \"/d\"\n\nintervall = \"1s\"\n");
        assert_eq!((key.as_str(), at), ("intervall", Some(3)), "{msg}");
        assert!(
            msg.starts_with("checkpoint configuration `intervall` at line 3: "),
            "{msg}"
        );
        assert_eq!(line("dir = \"/d\"\ninterval = \"soon\"\n").1, Some(2));
        // Found by `validate`, after parsing.
        assert_eq!(
            line("dir = \"/d\"\nmode = \"at-least-once\"\nretained = 0\n"),
            (
                "retained".into(),
                Some(3),
                "checkpoint configuration `retained` at line 3: must be at least 1".into()
            )
        );
        assert_eq!(line("dir = \"/d\"\ntimeout = \"0s\"\n").1, Some(2));
        let exp = "dir = \"/d\"\n[restart]\nstrategy = \"exponential-delay\"\n";
        assert_eq!(
            line(&format!("{exp}initial = \"2s\"\nmultiplier = inf\n")).1,
            Some(5)
        );
        assert_eq!(line(&format!("{exp}jitter = 2.0\n")).1, Some(4));
        assert_eq!(line(&format!("{exp}max = \"1 fortnight\"\n")).1, Some(4));
        assert_eq!(line("dir = \"/d\"\nretained = -1\n").1, Some(2));
        assert_eq!(
            line("dir = \"/d\"\njob-id = \"a b\"\n"),
            (
                "job-id".into(),
                Some(2),
                "checkpoint configuration `job-id` at line 2: \"a b\": use 1 to 200 of \
                 [A-Za-z0-9._-], not . or .."
                    .into()
            )
        );
        // Missing: nowhere to point at.
        assert_eq!(line("interval = \"1s\"\n").1, None);
        let built = CheckpointConfig::new("/d", "j").with_retained(1);
        let built = CheckpointConfig {
            max_concurrent: 0,
            ..built
        };
        assert_eq!(built.validate().expect_err("zero").line, None);
    }

    /// A value of the wrong type, or not one of the variants, is named by its key and line
    /// (the message named the value, or "(toml)", where the key belongs).
    #[test]
    fn a_bad_value_is_named_by_its_key() {
        let base = CheckpointConfig::new("/flags", "keyed-sum");
        for (text, key, line) in [
            ("dir = \"c\"\nmode = \"sometimes\"\n", "mode", 2),
            ("dir = \"c\"\nunaligned = \"yes\"\n", "unaligned", 2),
            ("max-concurrent = -1\n", "max-concurrent", 1),
            ("incremental = 1\n", "incremental", 1),
            ("dir = 5\n", "dir", 1),
            (
                "# a comment\n[restart]\nstrategy = \"fixed-delay\"\nattempts = \"3\"\n",
                "restart.attempts",
                4,
            ),
            ("restart.strategy = 7\n", "restart.strategy", 1),
            ("bogus = 1\n", "bogus", 1),
            // A line inside a value over several lines that looks like a header or a key
            // (a scan of the text line by line named the first `x.mode`).
            (
                "job-id = \"\"\"\n[x]\n\"\"\"\nmode = \"sometimes\"\n",
                "mode",
                4,
            ),
            (
                "job-id = '''\na = {\n'''\nunaligned = \"yes\"\n",
                "unaligned",
                4,
            ),
            (
                "[restart]\nstrategy = \"fixed-delay\"\n'attempts' = \"3\"\n",
                "restart.attempts",
                3,
            ),
            ("\"restart\" . strategy = 7\n", "restart.strategy", 1),
        ] {
            let e = base.clone().with_toml(text).expect_err(text);
            assert_eq!((e.key.as_str(), e.line), (key, Some(line)), "{text:?}: {e}");
        }
    }

    /// Text that is not TOML: the key of the line with the error, under its table, and the
    /// parser's message on one line (`interval = ` was named as key `"`, over two lines).
    #[test]
    fn a_syntax_error_is_named_by_the_key_of_its_line() {
        let base = CheckpointConfig::new("/flags", "keyed-sum");
        for (text, key, line) in [
            ("dir = \"tck\"\ninterval = \n", "interval", 2),
            ("dir = \"c\"\nmode = = 1\n", "mode", 2),
            (
                "dir = \"c\"\n[restart]\nstrategy = \"fixed-delay\nattempts = 3\n",
                "restart.strategy",
                3,
            ),
            ("dir = \"c\"\n[restart\n", "(toml)", 2),
        ] {
            let e = base.clone().with_toml(text).expect_err(text);
            assert_eq!((e.key.as_str(), e.line), (key, Some(line)), "{text:?}: {e}");
            assert!(!e.to_string().contains('\n'), "{text:?}: {e}");
        }
    }

    /// `with_toml` replaces only what the text sets, `dir` included, and checks the result.
    #[test]
    fn with_toml_loads_over_a_configuration() {
        let base =
            CheckpointConfig::new("/flags", "keyed-sum").with_interval(Duration::from_secs(1));
        let c = base
            .clone()
            .with_toml("retained = 3\ntolerable-failures = 2\n[restart]\nstrategy = \"none\"\n")
            .expect("valid");
        assert_eq!(c.dir, PathBuf::from("/flags"));
        assert_eq!(c.job_id, "keyed-sum");
        assert_eq!(c.interval, Some(Duration::from_secs(1)));
        assert_eq!((c.retained, c.tolerable_failures), (3, 2));
        assert_eq!(c.restart, RestartStrategy::None);
        let c = base
            .clone()
            .with_toml(
                "dir = \"/file\"\njob-id = \"orders\"\ninterval = \"250ms\"\nincremental = false\n",
            )
            .expect("valid");
        assert_eq!(c.dir, PathBuf::from("/file"));
        assert_eq!(c.job_id, "orders");
        assert_eq!(c.interval, Some(Duration::from_millis(250)));
        assert!(!c.incremental);
        assert_eq!(c.with_toml("").expect("empty").job_id, "orders");
        let e = base.with_toml("max-concurrent = 0\n").expect_err("zero");
        assert_eq!((e.key.as_str(), e.line), ("max-concurrent", Some(1)));
    }

    /// Every key of every strategy loads; a key the chosen strategy does not take was ignored
    /// without a word, and is refused now.
    #[test]
    fn restart_keys_load_and_foreign_ones_are_refused() {
        let load = |r: &str| {
            CheckpointConfig::from_toml(&format!("dir = \"/d\"\n[restart]\n{r}\n"))
                .map(|c| c.restart)
        };
        assert_eq!(
            load("strategy = \"exponential-delay\"\ninitial = \"2s\"\nmax = \"5m\"\nmultiplier = 2.0\n\
                  jitter = 0.5\nreset-after = \"10m\""),
            Ok(RestartStrategy::ExponentialDelay {
                initial: Duration::from_secs(2),
                max: Duration::from_secs(300),
                multiplier: 2.0,
                jitter: 0.5,
                reset_after: Duration::from_secs(600),
            })
        );
        assert_eq!(
            load(
                "strategy = \"failure-rate\"\nmax-failures = 3\ninterval = \"5m\"\ndelay = \"10s\""
            ),
            Ok(RestartStrategy::FailureRate {
                max_failures: 3,
                interval: Duration::from_secs(300),
                delay: Duration::from_secs(10),
            })
        );
        for (r, key, at) in [
            (
                "strategy = \"exponential-delay\"\nattempts = 3",
                "restart.attempts",
                4,
            ),
            (
                "strategy = \"fixed-delay\"\ndelay = \"1s\"\njitter = 0.2",
                "restart.jitter",
                5,
            ),
            ("strategy = \"none\"\ndelay = \"1s\"", "restart.delay", 4),
            (
                "strategy = \"failure-rate\"\nmax = \"1m\"",
                "restart.max",
                4,
            ),
        ] {
            let e = load(r).expect_err(r);
            assert_eq!((e.key.as_str(), e.line), (key, Some(at)), "{r}: {e}");
            assert!(e.reason.contains("takes no"), "{e}");
        }
        let e = load("strategy = \"sometimes\"").expect_err("unknown");
        assert_eq!((e.key.as_str(), e.line), ("restart.strategy", Some(3)));
        // Keys a table lacks or does not know are named with their table.
        let e = CheckpointConfig::from_toml("dir = \"/d\"\n[restart]\nattempts = 3\n")
            .expect_err("no strategy");
        assert_eq!((e.key.as_str(), e.line), ("restart.strategy", Some(2)));
        let e = CheckpointConfig::from_toml(
            "dir = \"/d\"\n[restart]\nstrategy = \"none\"\nattempt = 3\n",
        )
        .expect_err("unknown key");
        assert_eq!(e.key, "restart.attempt");
    }

    /// Durations too long to add to an `Instant` and multipliers that are no finite number
    /// used to pass, and panicked inside the job at its first deadline or second restart.
    #[test]
    fn durations_past_the_bound_and_non_finite_multipliers_are_refused_by_key() {
        let huge = "\"300000000000years\"";
        let exp = "[restart]\nstrategy = \"exponential-delay\"";
        let rate = "[restart]\nstrategy = \"failure-rate\"";
        let cases = [
            (format!("interval = {huge}"), "interval"),
            (format!("timeout = {huge}"), "timeout"),
            (format!("min-pause = {huge}"), "min-pause"),
            (format!("aligned-timeout = {huge}"), "aligned-timeout"),
            (
                format!("[restart]\nstrategy = \"fixed-delay\"\ndelay = {huge}"),
                "restart.delay",
            ),
            (format!("{exp}\ninitial = {huge}"), "restart.initial"),
            (format!("{exp}\nmax = {huge}"), "restart.max"),
            (format!("{rate}\ndelay = {huge}"), "restart.delay"),
            (format!("{rate}\ninterval = {huge}"), "restart.interval"),
            // Just past the bound.
            ("interval = \"100years 1ns\"".to_string(), "interval"),
            (format!("{exp}\nmultiplier = inf"), "restart.multiplier"),
            (format!("{exp}\nmultiplier = nan"), "restart.multiplier"),
            (format!("{exp}\nmultiplier = 0.5"), "restart.multiplier"),
            (format!("{exp}\njitter = nan"), "restart.jitter"),
            (format!("{exp}\njitter = inf"), "restart.jitter"),
        ];
        for (toml, key) in cases {
            let e =
                CheckpointConfig::from_toml(&format!("dir = \"/d\"\n{toml}\n")).expect_err(&toml);
            assert_eq!(e.key, key, "{toml}: {e}");
        }
        let e = CheckpointConfig::from_toml(&format!("dir = \"/d\"\ninterval = {huge}\n"))
            .expect_err("huge");
        assert_eq!(
            e.reason,
            "`300000000000years` is more than 100years, the longest duration accepted"
        );
        // The bound itself passes, and so does the largest finite multiplier: the delay stops
        // growing at `max`.
        let c = CheckpointConfig::from_toml(&format!(
            "dir = \"/d\"\ninterval = \"100years\"\n{exp}\nmax = \"100years\"\n\
             multiplier = 1.7976931348623157e308\n"
        ))
        .expect("at the bounds");
        assert_eq!(c.interval, Some(MAX_DURATION));
        assert!(matches!(
            c.restart,
            RestartStrategy::ExponentialDelay { max, multiplier, .. }
                if max == MAX_DURATION && multiplier == f64::MAX
        ));
    }

    /// The file's durations take what `weir run`'s flags take: whole milliseconds (it took
    /// `interval = "1us"`, `timeout = "1ns"`, `min-pause = "1ns"`, restart delays of
    /// microseconds), refused by key and line.
    #[test]
    fn durations_in_toml_are_whole_milliseconds_as_the_flags_take() {
        for key in ["interval", "timeout", "min-pause", "aligned-timeout"] {
            for bad in ["1us", "1ns", "1ms 1ns", "1500us"] {
                let text = format!("dir = \"/d\"\n{key} = \"{bad}\"\n");
                let e = CheckpointConfig::from_toml(&text).expect_err(&text);
                assert_eq!((e.key.as_str(), e.line), (key, Some(2)), "{text}: {e}");
                assert_eq!(
                    e.to_string(),
                    format!(
                        "checkpoint configuration `{key}` at line 2: `{bad}` is not a whole \
                         number of milliseconds"
                    )
                );
            }
            let text = format!("dir = \"/d\"\n{key} = \"1s 1ms\"\n");
            CheckpointConfig::from_toml(&text).expect(&text);
        }
        // The restart strategies' durations too (they took microseconds).
        for (strategy, key) in [
            ("fixed-delay", "delay"),
            ("exponential-delay", "initial"),
            ("exponential-delay", "max"),
            ("exponential-delay", "reset-after"),
            ("failure-rate", "interval"),
            ("failure-rate", "delay"),
        ] {
            let text =
                format!("dir = \"/d\"\n[restart]\nstrategy = \"{strategy}\"\n{key} = \"1500us\"\n");
            let e = CheckpointConfig::from_toml(&text).expect_err(&text);
            assert_eq!(
                (e.key.clone(), e.line),
                (format!("restart.{key}"), Some(4)),
                "{text}: {e}"
            );
            assert!(
                e.to_string()
                    .contains("`1500us` is not a whole number of milliseconds"),
                "{e}"
            );
        }
        let c = CheckpointConfig::from_toml(
            "dir = \"/d\"\ninterval = \"1ms\"\ntimeout = \"1ms\"\nmin-pause = \"0ms\"\n",
        )
        .expect("the least the flags take");
        assert_eq!(c.timeout, Duration::from_millis(1));
        // The bounds are the flags' too: no zero interval or timeout.
        for key in ["interval", "timeout"] {
            let e = CheckpointConfig::from_toml(&format!("dir = \"/d\"\n{key} = \"0ns\"\n"))
                .expect_err("zero");
            assert_eq!(
                (e.key.as_str(), e.reason.as_str()),
                (key, "must be more than 0")
            );
        }
    }

    /// Built in code, a timeout or interval under 1 ms is refused by name (zero was; a
    /// nanosecond passed, and expired every checkpoint before it could complete).
    #[test]
    fn validate_refuses_a_timeout_or_interval_under_a_millisecond() {
        let ck = || CheckpointConfig::new("/d", "j");
        for d in [Duration::from_nanos(1), Duration::from_micros(999)] {
            let e = ck().with_timeout(d).validate().expect_err("sub-ms timeout");
            assert_eq!((e.key.as_str(), e.line), ("timeout", None), "{e}");
            let e = ck()
                .with_interval(d)
                .validate()
                .expect_err("sub-ms interval");
            assert_eq!(e.key, "interval", "{e}");
        }
        assert_eq!(
            ck().with_timeout(Duration::ZERO)
                .validate()
                .map_err(|e| e.key),
            Err("timeout".into())
        );
        ck().with_timeout(Duration::from_millis(1))
            .with_interval(Duration::from_millis(1))
            .validate()
            .expect("1 ms");
        // A job refuses it as it starts, naming the setting.
        let job =
            crate::JobConfig::new().with_checkpointing(ck().with_timeout(Duration::from_nanos(1)));
        match job.validate() {
            Err(crate::StartError::Config { key, .. }) => assert_eq!(key, "checkpoint.timeout"),
            other => panic!("{other:?}"),
        }
    }

    /// A configuration built in code meets the same rules, with the same keys.
    #[test]
    fn validate_refuses_what_from_toml_refuses() {
        let ck = || CheckpointConfig::new("/d", "j");
        let key = |c: CheckpointConfig| c.validate().err().map(|e| e.key);
        assert_eq!(key(ck()), None);
        assert_eq!(key(ck().with_interval(MAX_DURATION)), None);
        for bad in ["", ".", "..", "a/b", "../up", "é"] {
            assert_eq!(
                key(CheckpointConfig::new("/d", bad)).as_deref(),
                Some("job-id"),
                "{bad:?}"
            );
        }
        assert_eq!(key(CheckpointConfig::new("/d", "a".repeat(200))), None);
        assert_eq!(
            key(CheckpointConfig::new("/d", "a".repeat(201))).as_deref(),
            Some("job-id")
        );
        assert_eq!(
            key(ck().with_interval(Duration::MAX)).as_deref(),
            Some("interval")
        );
        assert_eq!(
            key(ck().with_aligned_timeout(Duration::MAX)).as_deref(),
            Some("aligned-timeout")
        );
        assert_eq!(
            key(ck().with_restart(RestartStrategy::FixedDelay {
                attempts: 1,
                delay: Duration::MAX,
            }))
            .as_deref(),
            Some("restart.delay")
        );
        let exp = |multiplier: f64, reset_after: Duration| RestartStrategy::ExponentialDelay {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(60),
            multiplier,
            jitter: 0.1,
            reset_after,
        };
        let hour = Duration::from_secs(3600);
        assert_eq!(
            key(ck().with_restart(exp(f64::INFINITY, hour))).as_deref(),
            Some("restart.multiplier")
        );
        assert_eq!(key(ck().with_restart(exp(f64::MAX, hour))), None);
        assert_eq!(
            key(ck().with_restart(exp(2.0, Duration::MAX))).as_deref(),
            Some("restart.reset-after")
        );
        let mut c = ck();
        c.retained = 0;
        assert_eq!(key(c).as_deref(), Some("retained"));
    }

    /// The restart values Flink refuses are refused, built in code or loaded, by key and line:
    /// a zero base delay restarted in a tight loop for ever, `initial` over `max`, a zero
    /// `reset-after`, and a failure rate of 0 failures or over a zero interval. What Flink
    /// takes still loads (fixed-delay's 0 attempts and zero delays among them).
    #[test]
    fn restart_strategies_take_what_flinks_take() {
        let ms = Duration::from_millis;
        let key = |r: RestartStrategy| {
            CheckpointConfig::new("/d", "j")
                .with_restart(r)
                .validate()
                .err()
                .map(|e| (e.key, e.reason))
        };
        let exp = |initial, max, reset_after| RestartStrategy::ExponentialDelay {
            initial,
            max,
            multiplier: 1.5,
            jitter: 0.1,
            reset_after,
        };
        let rate = |max_failures, interval| RestartStrategy::FailureRate {
            max_failures,
            interval,
            delay: Duration::ZERO,
        };
        let hour = Duration::from_secs(3600);
        for (r, bad) in [
            (exp(Duration::ZERO, ms(10), hour), "restart.initial"),
            (
                exp(Duration::from_micros(999), ms(10), hour),
                "restart.initial",
            ),
            (exp(ms(11), ms(10), hour), "restart.initial"),
            (exp(ms(1), ms(10), Duration::ZERO), "restart.reset-after"),
            (rate(0, hour), "restart.max-failures"),
            (rate(1, Duration::ZERO), "restart.interval"),
            (rate(1, Duration::from_micros(1)), "restart.interval"),
        ] {
            assert_eq!(
                key(r.clone()).map(|(k, _)| k).as_deref(),
                Some(bad),
                "{r:?}"
            );
        }
        let (_, reason) = key(exp(ms(11), ms(10), hour)).expect("initial over max");
        assert_eq!(
            reason,
            "`11ms` is more than `restart.max` (`10ms`): initial backoff cannot be higher than \
             maximum backoff"
        );
        for r in [
            exp(ms(1), ms(1), ms(1)),
            rate(1, ms(1)),
            RestartStrategy::FixedDelay {
                attempts: 0,
                delay: Duration::ZERO,
            },
        ] {
            assert_eq!(key(r.clone()), None, "{r:?}");
        }
        let load =
            |r: &str| CheckpointConfig::from_toml(&format!("dir = \"/d\"\n[restart]\n{r}\n"));
        let exp = "strategy = \"exponential-delay\"";
        let rate = "strategy = \"failure-rate\"";
        for (r, bad, at) in [
            (format!("{exp}\ninitial = \"0ms\""), "restart.initial", 4),
            (format!("{exp}\ninitial = \"2m\""), "restart.initial", 4),
            // Only `max` set, under the default 1 s `initial`: named is the key set.
            (format!("{exp}\n\nmax = \"500ms\""), "restart.max", 5),
            (
                format!("{exp}\nreset-after = \"0s\""),
                "restart.reset-after",
                4,
            ),
            (
                format!("{rate}\nmax-failures = 0"),
                "restart.max-failures",
                4,
            ),
            (format!("{rate}\ninterval = \"0s\""), "restart.interval", 4),
        ] {
            let e = load(&r).expect_err(&r);
            assert_eq!((e.key.as_str(), e.line), (bad, Some(at)), "{r}: {e}");
        }
        let c = load("strategy = \"fixed-delay\"\nattempts = 0\ndelay = \"0s\"").expect("Flink's");
        assert_eq!(
            c.restart,
            RestartStrategy::FixedDelay {
                attempts: 0,
                delay: Duration::ZERO
            }
        );
        load(&format!(
            "{exp}\ninitial = \"1m\"\nmax = \"1m\"\nreset-after = \"1ms\""
        ))
        .expect("equal");
    }

    /// Dotted keys (`restart.strategy = ..`) and an inline table load as a `[restart]` table
    /// does, and their errors name the key and its line. Dotted keys were refused with
    /// "invalid type: string \"strategy\", expected a borrowed string".
    #[test]
    fn dotted_keys_and_inline_tables_load_as_a_restart_table() {
        let want = RestartStrategy::FixedDelay {
            attempts: 4,
            delay: Duration::from_secs(2),
        };
        for text in [
            "[restart]\nstrategy = \"fixed-delay\"\nattempts = 4\ndelay = \"2s\"\n",
            "restart.strategy = \"fixed-delay\"\nrestart.attempts = 4\nrestart.delay = \"2s\"\n",
            "restart = { strategy = \"fixed-delay\", attempts = 4, delay = \"2s\" }\n",
        ] {
            let c = CheckpointConfig::from_toml(&format!("dir = \"/d\"\n{text}")).expect(text);
            assert_eq!(c.restart, want, "{text}");
        }
        let c = CheckpointConfig::from_toml("restart.strategy = \"none\"\ndir = \"/d\"\n")
            .expect("dotted at the top");
        assert_eq!(c.restart, RestartStrategy::None);
        let exp = "restart.strategy = \"exponential-delay\"";
        for (text, key, at) in [
            (
                "restart.strategy = \"fixed-delay\"\nrestart.attempts = \"3\"\n",
                "restart.attempts",
                3,
            ),
            (
                "restart = { strategy = \"fixed-delay\", attempts = \"3\" }\n",
                "restart.attempts",
                2,
            ),
            (
                "restart = { strategy = 'fixed-delay', delay = \"soon\" }\n",
                "restart.delay",
                2,
            ),
            (
                "\nrestart.strategy = \"sometimes\"\n",
                "restart.strategy",
                3,
            ),
            ("restart.attempts = 3\n", "restart.strategy", 2),
            ("restart = { attempts = 3 }\n", "restart.strategy", 2),
            (
                &format!("{exp}\nrestart.jitter = 2.0\n"),
                "restart.jitter",
                3,
            ),
            (
                &format!("{exp}\nrestart.initial = \"0s\"\n"),
                "restart.initial",
                3,
            ),
            (
                "restart = { strategy = \"exponential-delay\", jitter = 2.0 }\n",
                "restart.jitter",
                2,
            ),
            (
                "restart.strategy = \"none\"\nrestart.delay = \"1s\"\n",
                "restart.delay",
                3,
            ),
        ] {
            let e = CheckpointConfig::from_toml(&format!("dir = \"/d\"\n{text}")).expect_err(text);
            assert_eq!((e.key.as_str(), e.line), (key, Some(at)), "{text:?}: {e}");
        }
    }

    /// Unknown tables and keys are named by their whole path, in every TOML form, and a
    /// `restart` that is no table says what it should be. They were `checkpoint.checkpoint`,
    /// `bogus` (in `restart = { .. }`), and "expected struct RawRestart".
    #[test]
    fn unknown_tables_and_keys_are_named_by_their_path() {
        for (text, key, at) in [
            ("[checkpoint]\ninterval = \"1s\"\n", "checkpoint", 2),
            ("[other]\n", "other", 2),
            ("other.x = 1\n", "other", 2),
            (
                "restart = { strategy = \"none\", bogus = 1 }\n",
                "restart.bogus",
                2,
            ),
            (
                "restart.strategy = \"none\"\nrestart.bogus = 1\n",
                "restart.bogus",
                3,
            ),
            (
                "[restart]\nstrategy = \"none\"\nbogus = 1\n",
                "restart.bogus",
                4,
            ),
            (
                "[restart]\nstrategy = \"none\"\n[restart.sub]\n",
                "restart.sub",
                4,
            ),
            ("strategy = \"none\"\n", "strategy", 2),
            ("restart = \"none\"\n", "restart", 2),
            ("restart = 5 # no table\n", "restart", 2),
        ] {
            let e = CheckpointConfig::from_toml(&format!("dir = \"/d\"\n{text}")).expect_err(text);
            assert_eq!((e.key.as_str(), e.line), (key, Some(at)), "{text:?}: {e}");
        }
        let e = CheckpointConfig::from_toml("dir = \"/d\"\nrestart = \"none\"\n").expect_err("str");
        assert!(
            e.reason.contains("expected a table with `strategy`") && !e.reason.contains("Raw"),
            "{e}"
        );
    }

    /// An empty `dir` would put the checkpoints in the working directory: refused by name,
    /// built in code or loaded. `with_toml` over a configuration without one still loads a
    /// text that sets none (`weir run` takes it from `--checkpoint-dir` then).
    #[test]
    fn an_empty_dir_is_refused_by_name() {
        let e = CheckpointConfig::new("", "j")
            .validate()
            .expect_err("empty");
        assert_eq!((e.key.as_str(), e.line), ("dir", None));
        let e = CheckpointConfig::from_toml("job-id = \"j\"\ndir = \"\"\n").expect_err("empty");
        assert_eq!((e.key.as_str(), e.line), ("dir", Some(2)));
        let e = CheckpointConfig::new("/d", "j")
            .with_toml("dir = ''\n")
            .expect_err("set empty");
        assert_eq!((e.key.as_str(), e.line), ("dir", Some(1)));
        let c = CheckpointConfig::new("", "j")
            .with_toml("retained = 2\n")
            .expect("no dir yet");
        assert_eq!((c.dir.as_os_str().is_empty(), c.retained), (true, 2));
    }
}
