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
        "{shards} shards need {need} free file descriptors; the process has {open} open of a \
         limit of {limit}. hint: raise it (`ulimit -n`, or LimitNOFILE= in a systemd unit)"
    )]
    TooFewDescriptors {
        shards: usize,
        need: u64,
        open: u64,
        limit: u64,
    },
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
    #[error("output directory {path}: {source}")]
    OutputDir {
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
    /// An I/O error of a shard's state store while it opens or restores (linking or copying a
    /// checkpoint's file, reading or writing its own): unlike [`StartError::State`], one that
    /// a restart may pass, so a failover's restore that meets it is restarted.
    #[error("state store of shard {shard}: {reason}")]
    StateIo { shard: usize, reason: String },
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
    /// The job was restarting after a failure (waiting out its restart delay) before a
    /// checkpoint was triggered for the savepoint, as Flink refuses a savepoint while its
    /// tasks are not running: the request is withdrawn, not served whenever the next
    /// attempt runs.
    #[error("the job is restarting after a failure: trigger the savepoint again once it runs")]
    Restarting,
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
    /// `bytes`: the record's frame (or the bound it exceeded), above the largest frame its
    /// ring takes, half of `capacity_bytes`.
    #[error("record too large for a ring on exchange `{operator}`: {bytes} bytes (ring capacity {capacity_bytes}, frames up to half of it)")]
    RecordTooLarge {
        operator: String,
        bytes: usize,
        capacity_bytes: usize,
    },
    #[error("shard {shard} panicked: {message}")]
    Panic { shard: usize, message: String },
    /// A state used as another kind or value type than it holds (in this process, or as the
    /// checkpoint it was restored from recorded), or two state names with one id: the job as
    /// written, which every restart would meet again.
    #[error("operator `{operator}` on shard {shard}: {message}")]
    StateType {
        operator: String,
        shard: usize,
        message: String,
    },
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

    /// False for a failure that a restart would meet again, because it follows from the input
    /// or the job as written, not from the moment: a malformed record under the fail policy
    /// (the restart replays it), an unknown column, a restored position the source rejects,
    /// a record larger than a ring, a state used as another type, a failure to start. The restart strategy does not apply to
    /// them (Flink's `SuppressRestartsException`): the job fails at once with the error, where
    /// it would otherwise restart forever under the default strategy. Operator errors and
    /// panics, I/O errors and checkpoint failures may pass, and are restarted; so is a state
    /// store's I/O error while it opens or restores ([`StartError::StateIo`]), which a torn
    /// copy or a full disk during a failover's restore gives, and a sink's I/O error while it
    /// restores ([`StartError::Sink`]) unless it found its files other than its checkpoint
    /// describes, or gone (data, not the moment).
    pub fn is_recoverable(&self) -> bool {
        match self {
            JobError::Source { source, .. } => !matches!(
                source,
                SourceError::Malformed { .. }
                    | SourceError::UnknownColumn { .. }
                    | SourceError::BadPosition(_)
                    | SourceError::Corrupt { .. }
            ),
            JobError::Start(StartError::StateIo { .. }) => true,
            // A sink's restore or open that failed on I/O (publishing or removing its files);
            // not one that found them other than its checkpoint describes, or gone, nor a path
            // that cannot be a directory of files.
            JobError::Start(StartError::Sink { source, .. }) => !matches!(
                source.kind(),
                std::io::ErrorKind::InvalidData
                    | std::io::ErrorKind::InvalidInput
                    | std::io::ErrorKind::NotFound
                    | std::io::ErrorKind::PermissionDenied
                    | std::io::ErrorKind::ReadOnlyFilesystem
                    | std::io::ErrorKind::AlreadyExists
                    | std::io::ErrorKind::NotADirectory
                    | std::io::ErrorKind::IsADirectory
            ),
            JobError::RecordTooLarge { .. }
            | JobError::StateType { .. }
            | JobError::Start(_)
            | JobError::Cancelled => false,
            JobError::Operator { .. }
            | JobError::SinkIo { .. }
            | JobError::Panic { .. }
            | JobError::CheckpointFailures { .. } => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a restart would meet again is not recoverable; what may pass is.
    #[test]
    fn only_failures_that_may_pass_are_recoverable() {
        let source = |source| JobError::Source {
            operator: "input".into(),
            shard: 0,
            source,
        };
        let file = PathBuf::from("in.csv");
        let deterministic = [
            source(SourceError::Malformed {
                file: file.clone(),
                line: 3,
                reason: "x".into(),
            }),
            source(SourceError::UnknownColumn {
                file: file.clone(),
                column: "c".into(),
                available: "a".into(),
            }),
            source(SourceError::BadPosition("p".into())),
            source(SourceError::Corrupt {
                file: file.clone(),
                offset: 8,
                reason: "c".into(),
            }),
            JobError::RecordTooLarge {
                operator: "x".into(),
                bytes: 2,
                capacity_bytes: 1,
            },
            JobError::StateType {
                operator: "k".into(),
                shard: 0,
                message: "state `x` is used as value<f64>".into(),
            },
            JobError::Start(StartError::State {
                shard: 0,
                reason: "a handle that does not decode".into(),
            }),
            JobError::Start(StartError::Sink {
                operator: "out".into(),
                shard: 0,
                source: std::io::Error::new(std::io::ErrorKind::InvalidData, "not as recorded"),
            }),
        ];
        for e in &deterministic {
            assert!(!e.is_recoverable(), "{e}");
        }
        let may_pass = [
            source(SourceError::Io {
                path: file,
                source: std::io::Error::other("gone"),
            }),
            source(SourceError::Other("o".into())),
            JobError::Operator {
                operator: "m".into(),
                shard: 1,
                message: "m".into(),
            },
            JobError::Panic {
                shard: 0,
                message: "p".into(),
            },
            JobError::SinkIo {
                operator: "s".into(),
                shard: 0,
                source: std::io::Error::other("full"),
            },
            JobError::CheckpointFailures { reason: "r".into() },
            JobError::Start(StartError::StateIo {
                shard: 1,
                reason: "a torn copy".into(),
            }),
            JobError::Start(StartError::Sink {
                operator: "out".into(),
                shard: 1,
                source: std::io::Error::other("directory fsync failed"),
            }),
        ];
        for e in &may_pass {
            assert!(e.is_recoverable(), "{e}");
        }
    }
}
