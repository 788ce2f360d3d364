//! Errors of starting and running a job. Each names what failed and where.

use std::path::PathBuf;

use crate::source::SourceError;

/// Why a job could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    #[error("invalid configuration `{key}`: {reason}")]
    Config { key: String, reason: String },
    #[error(
        "RLIMIT_MEMLOCK is {have_bytes} bytes; a shard's executor needs at least {need_bytes}. \
         hint: raise it (`ulimit -l 8192`, or LimitMEMLOCK= in a systemd unit)"
    )]
    MemlockTooLow { have_bytes: u64, need_bytes: u64 },
    #[error(
        "io_uring is not usable: {reason}. hint: weir's shards need io_uring; check \
         `sysctl kernel.io_uring_disabled` (must be 0) and the container's seccomp profile; \
         `weir_runtime::testing::TestDriver` runs jobs without io_uring"
    )]
    IoUringUnavailable { reason: String },
    #[error("state directory {path}: {source}")]
    StateDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("could not start shard {shard}: {reason}")]
    Executor { shard: usize, reason: String },
    #[error("source `{operator}`: {source}")]
    Source {
        operator: String,
        #[source]
        source: SourceError,
    },
    #[error("state store of shard {shard}: {reason}")]
    State { shard: usize, reason: String },
    #[error("sink `{operator}` on shard {shard}: {source}")]
    Sink {
        operator: String,
        shard: usize,
        #[source]
        source: std::io::Error,
    },
    #[error("checkpoint storage: {reason}")]
    Checkpoint { reason: String },
    #[error("restore: {reason}")]
    Restore { reason: String },
}

/// Why [`JobHandle::trigger_savepoint`](crate::JobHandle::trigger_savepoint) took no
/// savepoint.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SavepointError {
    #[error("the job has no checkpoint directory: a savepoint is a checkpoint copied out")]
    NoCheckpointing,
    #[error("the savepoint's checkpoint failed: {reason}")]
    CheckpointFailed { reason: String },
    #[error("the job ended before its savepoint's checkpoint completed")]
    JobEnded,
    #[error("copying checkpoint {checkpoint_id} to {dir}: {reason}")]
    Export {
        checkpoint_id: u64,
        dir: PathBuf,
        reason: String,
    },
}

/// Why a running job failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JobError {
    #[error(transparent)]
    Start(#[from] StartError),
    #[error("{source}")]
    Source {
        operator: String,
        shard: usize,
        #[source]
        source: SourceError,
    },
    #[error("operator `{operator}` on shard {shard}: {message}")]
    Operator {
        operator: String,
        shard: usize,
        message: String,
    },
    #[error("sink `{operator}` on shard {shard}: {source}")]
    SinkIo {
        operator: String,
        shard: usize,
        #[source]
        source: std::io::Error,
    },
    #[error("record too large for a ring on exchange `{operator}`: {bytes} bytes (ring capacity {capacity_bytes})")]
    RecordTooLarge {
        operator: String,
        bytes: usize,
        capacity_bytes: usize,
    },
    #[error("shard {shard} panicked: {message}")]
    Panic { shard: usize, message: String },
    #[error("the job was cancelled")]
    Cancelled,
    #[error("{reason}")]
    CheckpointFailures { reason: String },
}

impl JobError {
    /// A failure that other shards report because one shard failed first: hidden behind the
    /// first cause when shards' errors are combined.
    pub(crate) fn is_cancellation(&self) -> bool {
        matches!(self, JobError::Cancelled)
    }
}
