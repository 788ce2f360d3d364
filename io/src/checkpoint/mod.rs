//! Checkpoint storage: the directory layout of a job's checkpoints, the commit of a
//! checkpoint's metadata, merged physical files, reference counting and garbage collection,
//! and self-contained savepoints. The byte formats are in `docs/checkpoint-format.md`.
//!
//! ```text
//! <checkpoint-dir>/<job-id>/
//!     LOCK                   exclusive lock of the writing process
//!     chk-<n>/_metadata      one per complete checkpoint
//!     shared/                uploaded files and merged physical files shared by checkpoints
//!     taskowned/             merged physical files of one checkpoint (channel state, ...)
//! <savepoint-dir>/<name>/    _metadata, shared/, taskowned/: self-contained
//! ```
//!
//! Threading: [`CheckpointStorage`] and [`PendingCheckpoint`] are `Send + Sync`; each shard's
//! background thread gets its own [`CheckpointWriter`] (one set of physical files per writer,
//! fsynced by that thread in [`CheckpointWriter::finish`]); the coordinator then calls
//! [`CheckpointStorage::commit`], which only syncs directories and publishes the metadata.

mod error;
mod format;
mod read;
mod storage;

pub use error::{CheckpointError, VerifyError};
pub use format::{
    checkpoint_dir_name, parse_checkpoint_dir_name, CheckpointKind, CheckpointMetadata, FileRef,
    LogicalFileRef, SmallFileKind, COMPLETED_FILE, DATA_HEADER_LEN, DATA_MAGIC, DATA_VERSION,
    METADATA_FILE, METADATA_HEADER_LEN, METADATA_MAGIC, METADATA_TRAILER_LEN, METADATA_VERSION,
    RUN_ORIGIN_FILE, SHARED_DIR, TASKOWNED_DIR,
};
pub use read::{RawDiagnose, Savepoint, VerifyReport};
pub use storage::{
    is_valid_name, savepoint_dir_name, CheckpointInfo, CheckpointPin, CheckpointStorage,
    CheckpointWriter, CommitInfo, CompletedCheckpoint, GcReport, PendingCheckpoint, RunOrigin,
    StorageOptions, WriterStats, VALID_NAME,
};
