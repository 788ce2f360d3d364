//! Checkpoint and restart configuration, with Flink's defaults. Built with methods or loaded
//! from TOML; an unknown key or a bad value is an error naming the key.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

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
    /// Write only what the previous checkpoint does not hold.
    pub incremental: bool,
    pub restart: RestartStrategy,
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
    pub fn with_retained(mut self, n: usize) -> Self {
        self.retained = n.max(1);
        self
    }
    pub fn with_restart(mut self, r: RestartStrategy) -> Self {
        self.restart = r;
        self
    }

    /// Checks every value, naming the bad one by its TOML key (`restart.<key>` for the restart
    /// strategy's): [`Self::from_toml`] runs it, and so does `JobConfig::validate` when a job
    /// starts, so that a configuration built in code meets the same rules. Intervals and
    /// timeouts must be more than zero, every duration at most [`MAX_DURATION`], counts of
    /// concurrent and retained checkpoints at least 1, the exponential delay's multiplier a
    /// finite number of at least 1 (any such works: the delay stops growing at `max`) and its
    /// jitter within 0..=1.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(d) = self.interval {
            check_duration("interval", d, true)?;
        }
        check_duration("timeout", self.timeout, true)?;
        check_duration("min-pause", self.min_pause, false)?;
        check_duration("aligned-timeout", self.aligned_timeout, false)?;
        if self.max_concurrent == 0 {
            return Err(ConfigError::new("max-concurrent", "must be at least 1"));
        }
        if self.retained == 0 {
            return Err(ConfigError::new("retained", "must be at least 1"));
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
                interval, delay, ..
            } => {
                restart("interval", *interval)?;
                restart("delay", *delay)?;
            }
        }
        Ok(())
    }

    /// Loads a configuration from TOML text, over the defaults. Durations are written as
    /// `"1s"`, `"500ms"`, `"2m"`, at most [`MAX_DURATION`]; the values must pass
    /// [`Self::validate`].
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
        let raw: RawConfig = toml::from_str(text).map_err(|e| ConfigError::from_toml(&e))?;
        let dir = raw
            .dir
            .ok_or_else(|| ConfigError::new("dir", "is required"))?;
        let mut c = CheckpointConfig::new(dir, raw.job_id.unwrap_or_else(|| "job".into()));
        let dur = |key: &str, v: Option<String>| -> Result<Option<Duration>, ConfigError> {
            v.map(|s| {
                humantime::parse_duration(&s)
                    .map_err(|e| ConfigError::new(key, &format!("`{s}`: {e}")))
            })
            .transpose()
        };
        c.interval = dur("interval", raw.interval)?;
        if let Some(d) = dur("timeout", raw.timeout)? {
            c.timeout = d;
        }
        if let Some(d) = dur("min-pause", raw.min_pause)? {
            c.min_pause = d;
        }
        if let Some(n) = raw.max_concurrent {
            c.max_concurrent = n;
        }
        if let Some(m) = raw.mode {
            c.mode = m;
        }
        if let Some(u) = raw.unaligned {
            c.unaligned = u;
        }
        if let Some(d) = dur("aligned-timeout", raw.aligned_timeout)? {
            c.aligned_timeout = d;
        }
        if let Some(n) = raw.tolerable_failures {
            c.tolerable_failures = n;
        }
        if let Some(n) = raw.retained {
            c.retained = n;
        }
        if let Some(i) = raw.incremental {
            c.incremental = i;
        }
        if let Some(r) = raw.restart {
            c.restart = r.into_strategy()?;
        }
        c.validate()?;
        Ok(c)
    }
}

/// Checks one duration setting: not zero where `positive` (a zero interval would trigger
/// without pause, a zero timeout abort every checkpoint), and not past [`MAX_DURATION`].
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

/// A configuration error naming the key.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("checkpoint configuration `{key}`: {reason}")]
pub struct ConfigError {
    pub key: String,
    pub reason: String,
}

impl ConfigError {
    fn new(key: &str, reason: &str) -> Self {
        Self {
            key: key.into(),
            reason: reason.into(),
        }
    }

    fn from_toml(e: &toml::de::Error) -> Self {
        // toml names unknown keys in its message; keep it whole, and the offending key if found.
        let msg = e.message().to_string();
        let key = msg
            .split('`')
            .nth(1)
            .map(str::to_string)
            .unwrap_or_else(|| "(toml)".to_string());
        Self { key, reason: msg }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct RawConfig {
    dir: Option<PathBuf>,
    job_id: Option<String>,
    interval: Option<String>,
    timeout: Option<String>,
    min_pause: Option<String>,
    max_concurrent: Option<usize>,
    mode: Option<CheckpointMode>,
    unaligned: Option<bool>,
    aligned_timeout: Option<String>,
    tolerable_failures: Option<u32>,
    retained: Option<usize>,
    incremental: Option<bool>,
    restart: Option<RawRestart>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct RawRestart {
    strategy: String,
    attempts: Option<u32>,
    delay: Option<String>,
    initial: Option<String>,
    max: Option<String>,
    multiplier: Option<f64>,
    jitter: Option<f64>,
    max_failures: Option<u32>,
    interval: Option<String>,
}

impl RawRestart {
    fn into_strategy(self) -> Result<RestartStrategy, ConfigError> {
        let d =
            |key: &str, v: &Option<String>, default: Duration| -> Result<Duration, ConfigError> {
                match v {
                    None => Ok(default),
                    Some(s) => humantime::parse_duration(s).map_err(|e| {
                        ConfigError::new(&format!("restart.{key}"), &format!("`{s}`: {e}"))
                    }),
                }
            };
        match self.strategy.as_str() {
            "none" => Ok(RestartStrategy::None),
            "fixed-delay" => Ok(RestartStrategy::FixedDelay {
                attempts: self.attempts.unwrap_or(u32::MAX),
                delay: d("delay", &self.delay, Duration::from_secs(1))?,
            }),
            // The multiplier and jitter are checked with the rest, in `validate`.
            "exponential-delay" => Ok(RestartStrategy::ExponentialDelay {
                initial: d("initial", &self.initial, Duration::from_secs(1))?,
                max: d("max", &self.max, Duration::from_secs(60))?,
                multiplier: self.multiplier.unwrap_or(1.5),
                jitter: self.jitter.unwrap_or(0.1),
                reset_after: Duration::from_secs(3600),
            }),
            "failure-rate" => Ok(RestartStrategy::FailureRate {
                max_failures: self.max_failures.unwrap_or(1),
                interval: d("interval", &self.interval, Duration::from_secs(60))?,
                delay: d("delay", &self.delay, Duration::from_secs(1))?,
            }),
            other => Err(ConfigError::new(
                "restart.strategy",
                &format!(
                    "`{other}` is not one of none, fixed-delay, exponential-delay, failure-rate"
                ),
            )),
        }
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
            "dir = \"/d\"\njob-id = \"orders\"\ninterval = \"1s\"\nmode = \"at-least-once\"\nunaligned = true\n\
             aligned-timeout = \"100ms\"\nretained = 3\n[restart]\nstrategy = \"fixed-delay\"\nattempts = 4\ndelay = \"2s\"\n",
        )
        .expect("valid");
        assert_eq!(c.job_id, "orders");
        assert_eq!(c.interval, Some(Duration::from_secs(1)));
        assert_eq!(c.mode, CheckpointMode::AtLeastOnce);
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

    /// A configuration built in code meets the same rules, with the same keys.
    #[test]
    fn validate_refuses_what_from_toml_refuses() {
        let ck = || CheckpointConfig::new("/d", "j");
        let key = |c: CheckpointConfig| c.validate().err().map(|e| e.key);
        assert_eq!(key(ck()), None);
        assert_eq!(key(ck().with_interval(MAX_DURATION)), None);
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
}
