//! Durable bytes for weir.
//!
//! * [`Fs`] / [`FsFile`]: the few file operations the state store and checkpoints need, with
//!   three implementations: [`UringFs`] (reads, writes and fsync through a thread-owned
//!   io_uring ring), [`StdFs`] (plain `std::fs`) and [`FaultyFs`] (a seeded fault-injecting
//!   wrapper for tests: torn writes, lost unsynced data, bit flips, failing fsync/rename).
//! * [`Mapped`]: a read-only memory map of a sealed file, exactly its length.
//! * Checksummed block framing ([`frame`](crate::encode_block)) with typed [`FormatError`]s that
//!   name the file and offset.
//! * [`publish_file`]: write temp, fsync, rename, fsync directory; [`create_dir_all_durable`]:
//!   directories whose entries are durable.
//! * [`DirLock`]: an exclusive lock file on a directory (mapped files must have no other writer).
//!
//! **Architecture invariant:** only this crate opens, writes or maps files.

mod checkpoint;
mod error;
mod faulty;
mod frame;
mod fs;
mod uring;

pub use checkpoint::{
    checkpoint_dir_name, is_valid_name, parse_checkpoint_dir_name, savepoint_dir_name,
    CheckpointError, CheckpointInfo, CheckpointKind, CheckpointMetadata, CheckpointPin,
    CheckpointStorage, CheckpointWriter, CommitInfo, CompletedCheckpoint, FileRef, GcReport,
    LogicalFileRef, PendingCheckpoint, RawDiagnose, RunOrigin, Savepoint, SmallFileKind,
    StorageOptions, VerifyError, VerifyReport, WriterStats, COMPLETED_FILE, DATA_HEADER_LEN,
    DATA_MAGIC, DATA_VERSION, METADATA_FILE, METADATA_HEADER_LEN, METADATA_MAGIC,
    METADATA_TRAILER_LEN, METADATA_VERSION, RUN_ORIGIN_FILE, SHARED_DIR, TASKOWNED_DIR, VALID_NAME,
};
pub use error::{FormatError, IoError};
pub use faulty::{Fault, FaultConfig, FaultyFs};
pub use frame::{
    crc32, decode_block, encode_block, BlockHeader, BLOCK_HEADER_LEN, CHECKSUM_CRC32_IEEE,
};
pub use fs::{
    create_dir_all_durable, publish_file, resolved_path, DirLock, Fs, FsFile, Mapped, ReadAhead,
    ReadBuf, StdFs, WriteBuf, DIRECT_ALIGN,
};
pub use uring::{UringFs, URING_CHUNK_BYTES, URING_DEPTH};
