//! Job configuration. Every bound has a name and a unit.

use std::path::PathBuf;

/// Whether shards are pinned to cores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Pinning {
    /// Pin the shards, shard *i* to the *i*-th core that no other running job of this process
    /// is pinned to, when there are at least as many such cores as shards; otherwise leave
    /// every shard unpinned (pinning two busy shards to one core would halve both).
    /// [`crate::JobHandle::shard_cores`] says where they went.
    #[default]
    Auto,
    /// Never pin.
    Never,
}

/// How a job runs. Build with [`JobConfig::new`] and the `with_*` methods.
#[derive(Clone, Debug)]
pub struct JobConfig {
    /// Number of shards: one glommio executor thread each. Every operator runs on each shard.
    pub shards: usize,
    /// Number of key groups: the unit of keyed state distribution (Flink's max parallelism).
    pub max_parallelism: u16,
    pub pinning: Pinning,
    /// glommio's registered I/O memory per executor. Small, because RLIMIT_MEMLOCK is small here.
    /// At most [`MAX_IO_MEMORY_BYTES`].
    pub io_memory_bytes: usize,
    /// Capacity of each (producer shard, consumer shard) ring: a power of two from 64 KiB to
    /// the ring's largest, [`weir_ring::MAX_CAPACITY`] (1 GiB).
    pub ring_capacity_bytes: usize,
    /// Records a source hands over per poll, and the most a shard processes before it looks at
    /// its other inputs. 1 to [`MAX_BATCH_RECORDS`].
    pub batch_records: usize,
    /// Where shards keep their state stores. `None`: a fresh temporary directory per run.
    pub state_dir: Option<PathBuf>,
    /// Memtable budget of each shard's state store: all its memtable memory (the mutable
    /// memtable, which freezes at half of it, the one being flushed, one kept for reuse; see
    /// `weir_state::StoreConfig::memtable_budget_bytes`). A shard whose store fills it stops
    /// until the flush is installed. [`MIN_MEMTABLE_BUDGET_BYTES`] to
    /// [`MAX_MEMTABLE_BUDGET_BYTES`].
    pub memtable_budget_bytes: usize,
    /// Flushed memtables each store keeps readable in front of their segments (a read cache;
    /// 0 = off), a budget of its own beside `memtable_budget_bytes`. When a memtable is frozen,
    /// the keys a job keeps updating would otherwise be read back from segment files. At most
    /// [`MAX_MEMTABLE_BUDGET_BYTES`].
    pub retained_memtable_bytes: usize,
    /// Fault in each store's memtable memory when the job starts instead of while it fills
    /// (see `weir_state::StoreConfig::prefault_memtable`): the budget is resident from the
    /// start, and the first pass over the keys has no page-fault stalls. For latency-critical
    /// jobs; off by default, so that idle shards cost no memory. On, the shards' budgets
    /// together must fit in the machine's memory.
    pub prefault_state_memory: bool,
    /// How often periodic watermark strategies emit a watermark; at most [`MAX_INTERVAL_MS`].
    pub auto_watermark_interval_ms: u64,
    /// How often sources emit a latency marker (0: never); at most [`MAX_INTERVAL_MS`].
    pub latency_marker_interval_ms: u64,
    /// The longest a shard with nothing to do sleeps before it looks again. Latency of a
    /// record arriving at an idle shard is bounded by it; 0 never sleeps (lowest latency, a
    /// busy core). At most [`MAX_IDLE_SLEEP_US`].
    pub idle_sleep_max_us: u64,
    /// Checkpointing; `None`: no checkpoints and no restarts.
    pub checkpoint: Option<crate::checkpoint::CheckpointConfig>,
    /// What the job restores from when it starts.
    pub restore: Option<RestoreFrom>,
    /// Let a restore fall back to an older checkpoint when the newest does not verify, even
    /// where that may duplicate output a sink already committed.
    pub allow_fallback: bool,
    /// Let a restore skip state of operators the job does not have (Flink's
    /// `--allowNonRestoredState`); without it such a restore fails, naming them.
    pub allow_non_restored_state: bool,
    /// The file system the shards' state stores write their segments through; `None` (the
    /// default): io_uring (see [`Self::with_state_fs`]).
    pub state_fs: Option<std::sync::Arc<dyn weir_io::Fs>>,
}

/// Where a job's state comes from when it starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RestoreFrom {
    /// The newest complete checkpoint in the job's checkpoint directory; none there: start
    /// from the beginning (and say so), so one restart command serves every restart.
    Latest,
    /// A checkpoint directory (`.../chk-<n>`) or a savepoint directory.
    Path(PathBuf),
}

impl Default for JobConfig {
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self {
            shards: cores,
            max_parallelism: 128,
            pinning: Pinning::Auto,
            io_memory_bytes: 2 << 20,
            ring_capacity_bytes: 1 << 20,
            batch_records: 1024,
            state_dir: None,
            // 80 MiB mutable memtables: with 48-byte records they hold as many entries as the
            // 64 MiB ones did before the budget covered every memtable, their tables' capacity
            // and their flush's sort (fewer entries froze them more often, and checkpoints that
            // include a frozen memtable are the large ones).
            memtable_budget_bytes: 160 << 20,
            // More than a memtable at its freeze (80 MiB with its tables), or the cache holds
            // nothing: at 64 MiB every flushed memtable went straight to reuse, and after each
            // freeze the keys not yet written again were read from the new segment (5.5% of
            // the shards' samples in the checkpointed keyed job, 1.7% with this).
            retained_memtable_bytes: 96 << 20,
            prefault_state_memory: false,
            auto_watermark_interval_ms: 200,
            latency_marker_interval_ms: 100,
            idle_sleep_max_us: 200,
            checkpoint: None,
            restore: None,
            allow_fallback: false,
            allow_non_restored_state: false,
            state_fs: None,
        }
    }
}

impl JobConfig {
    /// The defaults: one shard per available core.
    pub fn new() -> Self {
        Self::default()
    }

    pub fn with_shards(mut self, shards: usize) -> Self {
        self.shards = shards;
        self
    }

    pub fn with_max_parallelism(mut self, max_parallelism: u16) -> Self {
        self.max_parallelism = max_parallelism;
        self
    }

    pub fn with_pinning(mut self, pinning: Pinning) -> Self {
        self.pinning = pinning;
        self
    }

    pub fn with_state_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.state_dir = Some(dir.into());
        self
    }

    pub fn with_batch_records(mut self, batch_records: usize) -> Self {
        self.batch_records = batch_records;
        self
    }

    pub fn with_ring_capacity_bytes(mut self, bytes: usize) -> Self {
        self.ring_capacity_bytes = bytes;
        self
    }

    pub fn with_memtable_budget_bytes(mut self, bytes: usize) -> Self {
        self.memtable_budget_bytes = bytes;
        self
    }

    pub fn with_retained_memtable_bytes(mut self, bytes: usize) -> Self {
        self.retained_memtable_bytes = bytes;
        self
    }

    pub fn with_prefault_state_memory(mut self, on: bool) -> Self {
        self.prefault_state_memory = on;
        self
    }

    pub fn with_io_memory_bytes(mut self, bytes: usize) -> Self {
        self.io_memory_bytes = bytes;
        self
    }

    pub fn with_latency_marker_interval_ms(mut self, ms: u64) -> Self {
        self.latency_marker_interval_ms = ms;
        self
    }

    pub fn with_idle_sleep_max_us(mut self, us: u64) -> Self {
        self.idle_sleep_max_us = us;
        self
    }

    /// Checkpoints the job as `config` says.
    pub fn with_checkpointing(mut self, config: crate::checkpoint::CheckpointConfig) -> Self {
        self.checkpoint = Some(config);
        self
    }

    /// Restores the job from `from` when it starts.
    pub fn with_restore(mut self, from: RestoreFrom) -> Self {
        self.restore = Some(from);
        self
    }

    /// Allows restore to fall back to an older checkpoint even where that may duplicate
    /// committed output. An ingress source still refuses one older than the newest complete
    /// checkpoint its readers were told of: it let go of the records before that checkpoint,
    /// and cannot read them again (`SourceError::BadPosition`, the job fails).
    pub fn with_allow_fallback(mut self, allow: bool) -> Self {
        self.allow_fallback = allow;
        self
    }

    /// Allows a restore to skip the state of operators (by uid) that this job does not have,
    /// as after removing an operator on purpose. Without it such a restore fails and names
    /// them: a renamed uid or the wrong checkpoint would otherwise start that state afresh.
    pub fn with_allow_non_restored_state(mut self, allow: bool) -> Self {
        self.allow_non_restored_state = allow;
        self
    }

    /// Let the shards' state stores write through another file-system implementation:
    /// `weir_io::FaultyFs` in tests of I/O failures while a job runs (as
    /// `CheckpointConfig::with_fs` and the file sink's `with_fs` for theirs).
    pub fn with_state_fs(mut self, fs: std::sync::Arc<dyn weir_io::Fs>) -> Self {
        self.state_fs = Some(fs);
        self
    }

    /// Checks the values that would otherwise fail deep inside a shard.
    pub fn validate(&self) -> Result<(), crate::StartError> {
        let bad = |key: &str, why: String| {
            Err(crate::StartError::Config {
                key: key.to_string(),
                reason: why,
            })
        };
        if self.shards == 0 || self.shards > 1024 {
            return bad("shards", format!("{} is not in 1..=1024", self.shards));
        }
        if self.max_parallelism == 0 || usize::from(self.max_parallelism) < self.shards {
            return bad(
                "max_parallelism",
                format!(
                    "{} must be at least the number of shards ({})",
                    self.max_parallelism, self.shards
                ),
            );
        }
        // The ring's own range (but a larger minimum): past it, building the rings panicked.
        let ring = self.ring_capacity_bytes;
        if !ring.is_power_of_two() || !(64 << 10..=weir_ring::MAX_CAPACITY).contains(&ring) {
            return bad(
                "ring_capacity_bytes",
                format!(
                    "{ring} must be a power of two from 64 KiB to {} bytes",
                    weir_ring::MAX_CAPACITY
                ),
            );
        }
        // A source allocates a batch up front: 1 << 40 records aborted the process.
        if !(1..=MAX_BATCH_RECORDS).contains(&self.batch_records) {
            return bad(
                "batch_records",
                format!("{} is not in 1..={MAX_BATCH_RECORDS}", self.batch_records),
            );
        }
        // Below that a memtable holds next to nothing, and a budget of 0 stalled the keyed
        // operators for good (the store waited for room that never came).
        if self.memtable_budget_bytes < MIN_MEMTABLE_BUDGET_BYTES {
            return bad(
                "memtable_budget_bytes",
                format!(
                    "{} must be at least {MIN_MEMTABLE_BUDGET_BYTES} bytes",
                    self.memtable_budget_bytes
                ),
            );
        }
        for (key, bytes) in [
            ("memtable_budget_bytes", self.memtable_budget_bytes),
            ("retained_memtable_bytes", self.retained_memtable_bytes),
        ] {
            if bytes > MAX_MEMTABLE_BUDGET_BYTES {
                return bad(
                    key,
                    format!("{bytes} is more than {MAX_MEMTABLE_BUDGET_BYTES} bytes"),
                );
            }
        }
        // Faulting in more than the machine has cannot succeed (1 << 50 aborted the process).
        // Each shard faults in at least one store's budget, if it has keyed state.
        if self.prefault_state_memory {
            let total = self.memtable_budget_bytes.saturating_mul(self.shards);
            if let Some(memory) = physical_memory_bytes().filter(|&m| total > m) {
                return bad(
                    "memtable_budget_bytes",
                    format!(
                        "{} bytes on each of {} shards, faulted in at start \
                         (prefault_state_memory), is more than this machine's {memory} bytes",
                        self.memtable_budget_bytes, self.shards
                    ),
                );
            }
        }
        // glommio allocates it as it builds each executor: 1 << 40 panicked there.
        if self.io_memory_bytes > MAX_IO_MEMORY_BYTES {
            return bad(
                "io_memory_bytes",
                format!(
                    "{} is more than {MAX_IO_MEMORY_BYTES} bytes",
                    self.io_memory_bytes
                ),
            );
        }
        // A shard naps without looking at cancels, barriers or input: u64::MAX naps for ever.
        if self.idle_sleep_max_us > MAX_IDLE_SLEEP_US {
            return bad(
                "idle_sleep_max_us",
                format!(
                    "{} is more than {MAX_IDLE_SLEEP_US} (1 s)",
                    self.idle_sleep_max_us
                ),
            );
        }
        // Added to the time in milliseconds as an i64: u64::MAX overflowed.
        for (key, ms) in [
            (
                "auto_watermark_interval_ms",
                self.auto_watermark_interval_ms,
            ),
            (
                "latency_marker_interval_ms",
                self.latency_marker_interval_ms,
            ),
        ] {
            if ms > MAX_INTERVAL_MS {
                return bad(
                    key,
                    format!("{ms} is more than {MAX_INTERVAL_MS} (100 years)"),
                );
            }
        }
        if let Some(c) = &self.checkpoint {
            // The rules `CheckpointConfig::from_toml` applies, so that a configuration built in
            // code cannot panic inside the job either; keys as the fields are spelled here.
            if let Err(e) = c.validate() {
                return bad(&format!("checkpoint.{}", e.key.replace('-', "_")), e.reason);
            }
        }
        if self.restore.is_some() && self.checkpoint.is_none() {
            if let Some(RestoreFrom::Latest) = self.restore {
                return bad("restore", "`latest` needs a checkpoint directory".into());
            }
        }
        Ok(())
    }
}

/// The smallest `memtable_budget_bytes` a job takes: 16 KiB.
pub const MIN_MEMTABLE_BUDGET_BYTES: usize = 16 << 10;

/// The largest `memtable_budget_bytes` (and `retained_memtable_bytes`) a job takes: 64 GiB
/// per store, RocksDB's cap on a write buffer. Far more than a store's memtables need, and
/// below the 128 GiB a memtable can address (65 534 arena chunks of 2 MiB).
pub const MAX_MEMTABLE_BUDGET_BYTES: usize = 64 << 30;

/// The largest `batch_records` a job takes: 1 Mi records (the default is 1024). A source
/// head allocates a batch of that many records up front.
pub const MAX_BATCH_RECORDS: usize = 1 << 20;

/// The largest `io_memory_bytes` a job takes: 1 GiB, the most io_uring registers as one
/// buffer (glommio registers its I/O memory so, and allocates it when the executor starts).
pub const MAX_IO_MEMORY_BYTES: usize = 1 << 30;

/// The largest `idle_sleep_max_us` a job takes: 1 s. An idle shard's nap is not
/// interrupted, so it delays a cancel, a barrier or new input by as much.
pub const MAX_IDLE_SLEEP_US: u64 = 1_000_000;

/// The largest `auto_watermark_interval_ms` and `latency_marker_interval_ms` a job takes:
/// [`crate::checkpoint::config::MAX_DURATION`] (100 years), the bound of every duration.
pub const MAX_INTERVAL_MS: u64 = crate::checkpoint::config::MAX_DURATION.as_millis() as u64;

/// The machine's physical memory; `None` where the system does not say.
fn physical_memory_bytes() -> Option<usize> {
    // SAFETY: `sysconf` reads system values and has no preconditions.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    let pages = usize::try_from(pages).ok()?;
    pages.checked_mul(usize::try_from(page).ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::CheckpointConfig;

    /// A memtable budget too small to hold anything is refused by name (0 stalled the job).
    #[test]
    fn a_memtable_budget_below_the_minimum_is_refused() {
        for bytes in [0, 1, MIN_MEMTABLE_BUDGET_BYTES - 1] {
            let c = JobConfig::new().with_memtable_budget_bytes(bytes);
            assert_eq!(key_of(c).as_deref(), Some("memtable_budget_bytes"));
        }
        let c = JobConfig::new().with_memtable_budget_bytes(MIN_MEMTABLE_BUDGET_BYTES);
        assert_eq!(key_of(c), None);
    }
    use std::time::Duration;

    fn key_of(c: JobConfig) -> Option<String> {
        match c.validate() {
            Err(crate::StartError::Config { key, .. }) => Some(key),
            _ => None,
        }
    }

    /// Checkpoint settings a builder or a field let through that would make every checkpoint
    /// fail or trigger without pause are refused at start, by name.
    #[test]
    fn zero_checkpoint_interval_timeout_or_concurrency_are_refused_by_name() {
        let ck = || CheckpointConfig::new("/tmp/unused", "j");
        let with = |c: CheckpointConfig| JobConfig::new().with_checkpointing(c);
        assert_eq!(
            key_of(with(ck().with_interval(Duration::from_millis(5)))),
            None
        );
        assert_eq!(
            key_of(with(ck().with_interval(Duration::ZERO))).as_deref(),
            Some("checkpoint.interval")
        );
        assert_eq!(
            key_of(with(ck().with_timeout(Duration::ZERO))).as_deref(),
            Some("checkpoint.timeout")
        );
        let mut c = ck();
        c.max_concurrent = 0;
        assert_eq!(
            key_of(with(c)).as_deref(),
            Some("checkpoint.max_concurrent")
        );
    }

    /// Durations and multipliers that would overflow an `Instant` or a `Duration` inside the
    /// job are refused at start too, not only by `CheckpointConfig::from_toml`.
    #[test]
    fn checkpoint_durations_past_the_bound_are_refused_by_name() {
        use crate::checkpoint::config::MAX_DURATION;
        use crate::checkpoint::RestartStrategy;
        let ck = || CheckpointConfig::new("/tmp/unused", "j");
        let with = |c: CheckpointConfig| JobConfig::new().with_shards(1).with_checkpointing(c);
        assert_eq!(key_of(with(ck().with_interval(MAX_DURATION))), None);
        assert_eq!(
            key_of(with(ck().with_interval(Duration::MAX))).as_deref(),
            Some("checkpoint.interval")
        );
        assert_eq!(
            key_of(with(ck().with_min_pause(Duration::MAX))).as_deref(),
            Some("checkpoint.min_pause")
        );
        let fixed = RestartStrategy::FixedDelay {
            attempts: 3,
            delay: Duration::from_secs(300_000_000_000 * 31_557_600),
        };
        assert_eq!(
            key_of(with(ck().with_restart(fixed))).as_deref(),
            Some("checkpoint.restart.delay")
        );
        let exp = RestartStrategy::ExponentialDelay {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(60),
            multiplier: f64::INFINITY,
            jitter: 0.1,
            reset_after: Duration::from_secs(3600),
        };
        assert_eq!(
            key_of(with(ck().with_restart(exp))).as_deref(),
            Some("checkpoint.restart.multiplier")
        );
    }

    /// Each numeric field past its bound is refused by name, with the bound in the reason;
    /// at the bound it passes. These values aborted the process (`batch_records` 1 << 40,
    /// `io_memory_bytes` 1 << 40), panicked in a shard (`usize::MAX` batches, rings past
    /// 1 GiB), napped for ever (`idle_sleep_max_us`) or overflowed (the intervals).
    #[test]
    fn numeric_fields_past_their_bounds_are_refused_by_name() {
        type Set = fn(JobConfig, u64) -> JobConfig;
        let cases: [(&str, u64, Set, &[u64]); 8] = [
            (
                "ring_capacity_bytes",
                weir_ring::MAX_CAPACITY as u64,
                |c, v| c.with_ring_capacity_bytes(v as usize),
                &[1 << 31, 1 << 40, 3 << 20],
            ),
            (
                "batch_records",
                MAX_BATCH_RECORDS as u64,
                |c, v| c.with_batch_records(v as usize),
                &[(MAX_BATCH_RECORDS + 1) as u64, 1 << 40, u64::MAX, 0],
            ),
            (
                "memtable_budget_bytes",
                MAX_MEMTABLE_BUDGET_BYTES as u64,
                |c, v| c.with_memtable_budget_bytes(v as usize),
                &[(MAX_MEMTABLE_BUDGET_BYTES + 1) as u64, 1 << 50, u64::MAX],
            ),
            (
                "retained_memtable_bytes",
                MAX_MEMTABLE_BUDGET_BYTES as u64,
                |c, v| c.with_retained_memtable_bytes(v as usize),
                &[(MAX_MEMTABLE_BUDGET_BYTES + 1) as u64, u64::MAX],
            ),
            (
                "io_memory_bytes",
                MAX_IO_MEMORY_BYTES as u64,
                |c, v| c.with_io_memory_bytes(v as usize),
                &[(MAX_IO_MEMORY_BYTES + 1) as u64, 1 << 40, u64::MAX],
            ),
            (
                "idle_sleep_max_us",
                MAX_IDLE_SLEEP_US,
                |c, v| c.with_idle_sleep_max_us(v),
                &[MAX_IDLE_SLEEP_US + 1, u64::MAX],
            ),
            (
                "latency_marker_interval_ms",
                MAX_INTERVAL_MS,
                |c, v| c.with_latency_marker_interval_ms(v),
                &[MAX_INTERVAL_MS + 1, i64::MAX as u64, u64::MAX],
            ),
            (
                "auto_watermark_interval_ms",
                MAX_INTERVAL_MS,
                |c, v| JobConfig {
                    auto_watermark_interval_ms: v,
                    ..c
                },
                &[MAX_INTERVAL_MS + 1, i64::MAX as u64, u64::MAX],
            ),
        ];
        let base = || JobConfig::new().with_shards(1);
        for (key, max, set, bad) in cases {
            assert_eq!(key_of(set(base(), max)), None, "{key} = {max}");
            for &v in bad {
                let Err(crate::StartError::Config { key: k, reason }) = set(base(), v).validate()
                else {
                    panic!("{key} = {v} passed");
                };
                assert_eq!(k, key, "{key} = {v}: {reason}");
                assert!(v == 0 || reason.contains(&max.to_string()), "{reason}");
            }
        }
        assert_eq!(MAX_INTERVAL_MS, 3_155_760_000_000, "100 years");
    }

    /// Faulting in more state memory than the machine has aborted the process: refused by
    /// name with `prefault_state_memory`, and only with it.
    #[test]
    fn prefaulting_more_than_the_machine_has_is_refused() {
        let c = || {
            JobConfig::new()
                .with_shards(1024)
                .with_max_parallelism(1024)
                .with_memtable_budget_bytes(MAX_MEMTABLE_BUDGET_BYTES)
        };
        assert_eq!(
            key_of(c()),
            None,
            "not faulted in: a budget, not an allocation"
        );
        assert_eq!(
            key_of(c().with_prefault_state_memory(true)).as_deref(),
            Some("memtable_budget_bytes"),
            "64 TiB"
        );
        assert_eq!(
            key_of(
                JobConfig::new()
                    .with_shards(1)
                    .with_prefault_state_memory(true)
            ),
            None
        );
    }

    /// An empty checkpoint directory is refused by its key, as the job sees it.
    #[test]
    fn an_empty_checkpoint_dir_is_refused_by_name() {
        let c = JobConfig::new().with_checkpointing(CheckpointConfig::new("", "j"));
        assert_eq!(key_of(c).as_deref(), Some("checkpoint.dir"));
    }
}
