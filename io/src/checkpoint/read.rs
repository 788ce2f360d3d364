//! Reading and verifying checkpoint files: every byte returned has passed its CRC, and every
//! block its header check (invariant 4). Shared by checkpoints and savepoints.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::checkpoint::error::{is_not_found, CheckpointError, VerifyError};
use crate::checkpoint::format::{
    block_count, framed_len, parse_data_file_name, CheckpointKind, CheckpointMetadata, DataHeader,
    FileRef, LogicalFileRef, DATA_BLOCK_KIND, DATA_HEADER_LEN, FILE_KIND_MERGED_SHARED,
    FILE_KIND_MERGED_TASKOWNED, FILE_KIND_UPLOAD, METADATA_FILE, TASKOWNED_DIR,
};
use crate::error::{FormatError, IoError};
use crate::frame::{crc32, decode_block, BlockHeader, BLOCK_HEADER_LEN};
use crate::fs::Fs;

/// Read a whole file through `fs`.
pub(crate) fn read_all(fs: &dyn Fs, path: &Path) -> Result<Vec<u8>, IoError> {
    let f = fs.open(path)?;
    let len = f.len()?;
    let mut buf = vec![0u8; len as usize];
    f.read_at(0, &mut buf)?;
    Ok(buf)
}

/// Read and decode the metadata of `dir`. `Ok(None)` when there is no `_metadata`.
pub(crate) fn read_metadata_file(
    fs: &dyn Fs,
    dir: &Path,
) -> Result<Option<CheckpointMetadata>, CheckpointError> {
    let path = dir.join(METADATA_FILE);
    let bytes = match read_all(fs, &path) {
        Ok(b) => b,
        Err(e) if is_not_found(&e) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    Ok(Some(CheckpointMetadata::decode(&path, &bytes)?))
}

/// Which span of which data file to read.
pub(crate) struct Span<'a> {
    pub rel: &'a Path,
    pub file_kind: u8,
    pub offset: u64,
    pub first_block: u32,
    pub size_bytes: u64,
    pub crc32: u32,
}

impl<'a> Span<'a> {
    pub(crate) fn of_file(r: &'a FileRef) -> Span<'a> {
        Span {
            rel: &r.path,
            file_kind: FILE_KIND_UPLOAD,
            offset: DATA_HEADER_LEN as u64,
            first_block: 0,
            size_bytes: r.size_bytes,
            crc32: r.crc32,
        }
    }
    pub(crate) fn of_logical(r: &'a LogicalFileRef) -> Span<'a> {
        let taskowned = r.physical.starts_with(TASKOWNED_DIR);
        Span {
            rel: &r.physical,
            file_kind: if taskowned {
                FILE_KIND_MERGED_TASKOWNED
            } else {
                FILE_KIND_MERGED_SHARED
            },
            offset: r.offset,
            first_block: r.first_block,
            size_bytes: r.size_bytes,
            crc32: r.crc32,
        }
    }
}

/// Read the content of `span` under `base`, checking the file header (against the file's
/// name), every block header and CRC, and the content CRC, before returning a byte.
pub(crate) fn read_span(
    fs: &dyn Fs,
    base: &Path,
    span: &Span<'_>,
) -> Result<Vec<u8>, CheckpointError> {
    let path = base.join(span.rel);
    let name = span.rel.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let (checkpoint_id, file_id) =
        parse_data_file_name(name).ok_or_else(|| FormatError::Malformed {
            file: path.clone(),
            offset: 0,
            reason: "not a checkpoint data file name".into(),
        })?;
    let file = fs.open(&path)?;
    let file_len = file.len()?;
    let mut head = vec![0u8; DATA_HEADER_LEN.min(file_len as usize)];
    file.read_at(0, &mut head)?;
    let header = DataHeader::decode(&path, &head, file_id, checkpoint_id)?;
    if header.file_kind != span.file_kind {
        return Err(FormatError::Misdirected {
            file: path,
            offset: 11,
            field: "file kind",
            expected: u64::from(span.file_kind),
            found: u64::from(header.file_kind),
        }
        .into());
    }
    let block_max = header.block_payload_bytes_max;
    let framed = framed_len(span.size_bytes, block_max);
    let end = span.offset.checked_add(framed);
    if span.offset < DATA_HEADER_LEN as u64 || end.is_none_or(|e| e > file_len) {
        return Err(FormatError::Truncated {
            file: path,
            offset: span.offset,
            needed: framed,
            available: file_len.saturating_sub(span.offset),
        }
        .into());
    }
    let mut buf = vec![0u8; framed as usize];
    file.read_at(span.offset, &mut buf)?;
    let mut out = Vec::with_capacity(span.size_bytes as usize);
    let mut pos = 0usize;
    let mut remaining = span.size_bytes;
    for i in 0..block_count(span.size_bytes, block_max) {
        let block_index =
            u32::try_from(u64::from(span.first_block) + i).map_err(|_| FormatError::Malformed {
                file: path.clone(),
                offset: span.offset + pos as u64,
                reason: "block index overflows u32".into(),
            })?;
        let payload_len = remaining.min(u64::from(block_max)) as u32;
        let expect = BlockHeader {
            file_id,
            block_index,
            kind: DATA_BLOCK_KIND,
            payload_len,
        };
        let payload = decode_block(&path, &buf[pos..], span.offset + pos as u64, expect)?;
        out.extend_from_slice(payload);
        pos += BLOCK_HEADER_LEN + payload.len();
        remaining -= u64::from(payload_len);
    }
    let actual = crc32(&[&out]);
    if actual != span.crc32 {
        return Err(FormatError::ChecksumMismatch {
            file: path,
            offset: span.offset,
            expected: span.crc32,
            actual,
        }
        .into());
    }
    Ok(out)
}

/// What [`verify`](crate::CheckpointStorage::verify) checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct VerifyReport {
    pub checkpoint_id: u64,
    /// Whole files checked.
    pub files: usize,
    /// Logical files checked.
    pub logical_files: usize,
    /// Content bytes whose CRC was checked.
    pub bytes_checked: u64,
}

/// Check every CRC of every file `meta` references, under `base`.
pub(crate) fn verify_files(
    fs: &dyn Fs,
    base: &Path,
    meta: &CheckpointMetadata,
) -> Result<VerifyReport, VerifyError> {
    let checkpoint_id = meta.checkpoint_id;
    let wrap = |e: CheckpointError| VerifyError::from_read(checkpoint_id, base, e);
    let mut report = VerifyReport {
        checkpoint_id,
        ..VerifyReport::default()
    };
    for f in &meta.files {
        report.bytes_checked += read_span(fs, base, &Span::of_file(f)).map_err(wrap)?.len() as u64;
        report.files += 1;
    }
    for l in &meta.logical_files {
        report.bytes_checked += read_span(fs, base, &Span::of_logical(l))
            .map_err(wrap)?
            .len() as u64;
        report.logical_files += 1;
    }
    Ok(report)
}

/// A self-contained savepoint directory, opened for reading: its metadata is verified on open.
#[derive(Debug, Clone)]
pub struct Savepoint {
    fs: Arc<dyn Fs>,
    dir: PathBuf,
    metadata: CheckpointMetadata,
}

impl Savepoint {
    /// Open the savepoint in `dir` (the directory holding `_metadata`).
    pub fn open(fs: Arc<dyn Fs>, dir: &Path) -> Result<Savepoint, CheckpointError> {
        let metadata = read_metadata_file(&*fs, dir)?.ok_or_else(|| CheckpointError::NotFound {
            checkpoint_id: 0,
            path: dir.join(METADATA_FILE),
        })?;
        if metadata.kind != CheckpointKind::Savepoint {
            return Err(FormatError::Misdirected {
                file: dir.join(METADATA_FILE),
                offset: 11,
                field: "kind",
                expected: 2,
                found: 1,
            }
            .into());
        }
        Ok(Savepoint {
            fs,
            dir: dir.to_owned(),
            metadata,
        })
    }

    /// The savepoint's verified metadata.
    pub fn metadata(&self) -> &CheckpointMetadata {
        &self.metadata
    }

    /// The savepoint's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Read a whole file of the savepoint, verified.
    pub fn read_file(&self, r: &FileRef) -> Result<Vec<u8>, CheckpointError> {
        read_span(&*self.fs, &self.dir, &Span::of_file(r))
    }

    /// Read a logical file of the savepoint, verified.
    pub fn read_logical(&self, r: &LogicalFileRef) -> Result<Vec<u8>, CheckpointError> {
        read_span(&*self.fs, &self.dir, &Span::of_logical(r))
    }

    /// Check every CRC of every file the savepoint references.
    pub fn verify(&self) -> Result<VerifyReport, VerifyError> {
        verify_files(&*self.fs, &self.dir, &self.metadata)
    }
}
