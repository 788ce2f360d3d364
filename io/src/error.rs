//! Typed errors. I/O failures name the operation and path; decode failures carry evidence
//! (file, offset, expected and actual values).

use std::path::PathBuf;

/// An operating error while touching files.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IoError {
    /// A system call failed.
    #[error("{op} {path}: {source}")]
    Os {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A write or read moved fewer bytes than asked and could make no progress.
    #[error("{op} {path} at offset {offset}: short transfer ({done} of {wanted} bytes)")]
    Short {
        op: &'static str,
        path: PathBuf,
        offset: u64,
        wanted: u64,
        done: u64,
    },
    /// io_uring cannot be used in this process.
    #[error("io_uring is unavailable: {reason}; hint: {hint}")]
    UringUnavailable { reason: String, hint: String },
    /// A fault injected by [`crate::FaultyFs`]; the seed replays it.
    #[error("injected fault (seed {seed}, step {step}): {what} {path}")]
    Injected {
        seed: u64,
        step: u64,
        what: &'static str,
        path: PathBuf,
    },
    /// The directory is locked by another store.
    #[error("directory {dir} is locked by another owner ({lock_file})")]
    Locked { dir: PathBuf, lock_file: PathBuf },
}

impl IoError {
    pub(crate) fn os(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        IoError::Os {
            op,
            path: path.into(),
            source,
        }
    }
}

/// Bytes on disk that do not decode. Every variant names the file and the byte offset.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FormatError {
    #[error("{file}: checksum mismatch at offset {offset}: expected {expected:#010x}, computed {actual:#010x}")]
    ChecksumMismatch {
        file: PathBuf,
        offset: u64,
        expected: u32,
        actual: u32,
    },
    #[error("{file}: truncated at offset {offset}: need {needed} bytes, {available} available")]
    Truncated {
        file: PathBuf,
        offset: u64,
        needed: u64,
        available: u64,
    },
    #[error("{file}: bad magic at offset {offset}: found {found:#x}")]
    BadMagic {
        file: PathBuf,
        offset: u64,
        found: u64,
    },
    #[error(
        "{file}: unsupported format version {found} at offset {offset} (supported: {supported})"
    )]
    UnsupportedVersion {
        file: PathBuf,
        offset: u64,
        found: u16,
        supported: u16,
    },
    #[error("{file}: unsupported checksum algorithm {found} at offset {offset}")]
    UnsupportedChecksum {
        file: PathBuf,
        offset: u64,
        found: u8,
    },
    /// A block with a valid CRC that belongs elsewhere (stale or misdirected write).
    #[error(
        "{file}: misdirected block at offset {offset}: {field} is {found}, expected {expected}"
    )]
    Misdirected {
        file: PathBuf,
        offset: u64,
        field: &'static str,
        expected: u64,
        found: u64,
    },
    /// Structurally invalid content under a valid checksum (a foreign or buggy writer).
    #[error("{file}: malformed content at offset {offset}: {reason}")]
    Malformed {
        file: PathBuf,
        offset: u64,
        reason: String,
    },
}

impl FormatError {
    /// The file the error names.
    pub fn file(&self) -> &std::path::Path {
        match self {
            FormatError::ChecksumMismatch { file, .. }
            | FormatError::Truncated { file, .. }
            | FormatError::BadMagic { file, .. }
            | FormatError::UnsupportedVersion { file, .. }
            | FormatError::UnsupportedChecksum { file, .. }
            | FormatError::Misdirected { file, .. }
            | FormatError::Malformed { file, .. } => file,
        }
    }

    /// The same error naming `file` instead: for bytes checked in a copy (a framed file's
    /// content taken out to a scratch file), the file they came from.
    pub fn in_file(mut self, file: PathBuf) -> FormatError {
        match &mut self {
            FormatError::ChecksumMismatch { file: f, .. }
            | FormatError::Truncated { file: f, .. }
            | FormatError::BadMagic { file: f, .. }
            | FormatError::UnsupportedVersion { file: f, .. }
            | FormatError::UnsupportedChecksum { file: f, .. }
            | FormatError::Misdirected { file: f, .. }
            | FormatError::Malformed { file: f, .. } => *f = file,
        }
        self
    }

    /// The byte offset the error names.
    pub fn offset(&self) -> u64 {
        match self {
            FormatError::ChecksumMismatch { offset, .. }
            | FormatError::Truncated { offset, .. }
            | FormatError::BadMagic { offset, .. }
            | FormatError::UnsupportedVersion { offset, .. }
            | FormatError::UnsupportedChecksum { offset, .. }
            | FormatError::Misdirected { offset, .. }
            | FormatError::Malformed { offset, .. } => *offset,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    /// `in_file` names another file and keeps everything else the error says.
    #[test]
    fn in_file_names_the_other_file_and_keeps_the_offset() {
        let e = FormatError::Malformed {
            file: PathBuf::from("/scratch/content"),
            offset: 77,
            reason: "keys out of order".into(),
        };
        let e = e.in_file(PathBuf::from("shared/7-seg (content of the framed file)"));
        assert_eq!(
            e.file(),
            Path::new("shared/7-seg (content of the framed file)")
        );
        assert_eq!(e.offset(), 77);
        assert_eq!(
            e.to_string(),
            "shared/7-seg (content of the framed file): malformed content at offset 77: keys out of order"
        );
    }
}
