//! Errors of checkpoint storage: one enum for writing, listing and reading
//! ([`CheckpointError`]), one for [`verify`](crate::CheckpointStorage::verify) ([`VerifyError`]).

use std::path::PathBuf;

use crate::error::{FormatError, IoError};

/// An operating error of checkpoint storage. Every variant names what and where.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// A system call failed.
    #[error(transparent)]
    Io(#[from] IoError),
    /// Bytes on disk do not decode or do not verify (names the file and offset).
    #[error(transparent)]
    Format(#[from] FormatError),
    /// A checkpoint failed verification.
    #[error(transparent)]
    Verify(#[from] VerifyError),
    /// No complete checkpoint with this id.
    #[error("checkpoint {checkpoint_id} not found (no valid {path})")]
    NotFound { checkpoint_id: u64, path: PathBuf },
    /// A directory opened as a savepoint holds no `_metadata` (a savepoint has no id to name,
    /// so this is not [`CheckpointError::NotFound`]).
    #[error("{dir} is not a savepoint or checkpoint directory: it holds no {file}")]
    NoSavepoint { dir: PathBuf, file: &'static str },
    /// `begin` was called with an id not above the newest complete checkpoint.
    #[error("checkpoint {checkpoint_id} is not newer than the latest complete checkpoint {latest_complete}")]
    StaleId {
        checkpoint_id: u64,
        latest_complete: u64,
    },
    /// `begin` was called twice for one id.
    #[error("checkpoint {checkpoint_id} is already in progress")]
    AlreadyInProgress { checkpoint_id: u64 },
    /// The pending checkpoint was aborted; its writers can do nothing more.
    #[error("checkpoint {checkpoint_id} was aborted")]
    Aborted { checkpoint_id: u64 },
    /// An earlier write or fsync of this checkpoint failed: the checkpoint cannot complete
    /// (a failed fsync is never retried and trusted).
    #[error("checkpoint {checkpoint_id} failed earlier and cannot commit: {reason}")]
    Failed { checkpoint_id: u64, reason: String },
    /// `commit` was called while writers of the checkpoint had not finished.
    #[error("checkpoint {checkpoint_id}: {open_writers} writer(s) not finished at commit")]
    WritersNotFinished {
        checkpoint_id: u64,
        open_writers: usize,
    },
    /// A file that the checkpoint reuses from an earlier one no longer exists.
    #[error("checkpoint {checkpoint_id} reuses {path}, which no longer exists")]
    MissingReusedFile { checkpoint_id: u64, path: PathBuf },
    /// The target of a savepoint export already exists.
    #[error("{path} already exists")]
    AlreadyExists { path: PathBuf },
    /// The storage was opened read-only.
    #[error("checkpoint storage {path} is open read-only: {operation} is not allowed")]
    ReadOnly {
        path: PathBuf,
        operation: &'static str,
    },
    /// A caller-supplied argument is invalid (job id, savepoint name, retention count).
    #[error("invalid {what}: {reason}")]
    InvalidArgument { what: &'static str, reason: String },
}

/// A checkpoint (or savepoint) that does not verify. Names the checkpoint, and through the
/// source the file and byte offset.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VerifyError {
    /// A CRC, header or structure check failed.
    #[error("checkpoint {checkpoint_id} is corrupt: {source}")]
    Corrupt {
        checkpoint_id: u64,
        #[source]
        source: FormatError,
    },
    /// A file could not be read.
    #[error("checkpoint {checkpoint_id} could not be read: {source}")]
    Io {
        checkpoint_id: u64,
        #[source]
        source: IoError,
    },
    /// The checkpoint has no `_metadata`.
    #[error("checkpoint {checkpoint_id} has no metadata at {path}")]
    NotFound { checkpoint_id: u64, path: PathBuf },
}

impl VerifyError {
    /// What a failure to read checkpoint `checkpoint_id` (at `path`) means for verification:
    /// bytes that do not decode are corruption; anything else could not be read.
    pub(crate) fn from_read(
        checkpoint_id: u64,
        path: &std::path::Path,
        e: CheckpointError,
    ) -> Self {
        match e {
            CheckpointError::Format(source) => VerifyError::Corrupt {
                checkpoint_id,
                source,
            },
            CheckpointError::NotFound { path, .. } => VerifyError::NotFound {
                checkpoint_id,
                path,
            },
            CheckpointError::Io(source) => VerifyError::Io {
                checkpoint_id,
                source,
            },
            other => VerifyError::Io {
                checkpoint_id,
                source: IoError::Os {
                    op: "verify",
                    path: path.to_owned(),
                    source: std::io::Error::other(other.to_string()),
                },
            },
        }
    }

    /// The file and offset of a corruption, if that is what failed.
    pub fn format_error(&self) -> Option<&FormatError> {
        match self {
            VerifyError::Corrupt { source, .. } => Some(source),
            _ => None,
        }
    }
}

pub(crate) fn is_not_found(e: &IoError) -> bool {
    matches!(e, IoError::Os { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
}
