//! The on-disk formats of checkpoint storage: the `_metadata` file and the data files in
//! `shared/` and `taskowned/`. `docs/checkpoint-format.md` documents every byte; the constants
//! here are the single source of truth and a test decodes the hex fixture in that document.

use std::collections::BTreeSet;
use std::path::{Component, Path, PathBuf};

use crate::error::FormatError;
use crate::frame::{crc32, BLOCK_HEADER_LEN, CHECKSUM_CRC32_IEEE};

/// Magic of a `_metadata` file.
pub const METADATA_MAGIC: [u8; 8] = *b"WEIRMETA";
/// The metadata format version this build writes. Version 2 may name raw files in `shared/`
/// (hard links of uploaded segments, see `raw_file_name`); its bytes are laid out as version
/// 1's, which this build still reads (every file it names is framed).
pub const METADATA_VERSION: u16 = 2;
/// The oldest metadata version this build reads.
pub const METADATA_VERSION_MIN: u16 = 1;
/// Bytes before the metadata body: magic, version, checksum algorithm, kind, body length.
pub const METADATA_HEADER_LEN: usize = 16;
/// Bytes after the metadata body: the CRC-32 of everything before it.
pub const METADATA_TRAILER_LEN: usize = 4;
/// The longest a `_metadata` file can be: header, a body of at most `u32::MAX` bytes (its
/// length is a u32), trailer. A reader refuses a longer file before reading it.
pub(crate) const METADATA_LEN_MAX: u64 =
    METADATA_HEADER_LEN as u64 + u32::MAX as u64 + METADATA_TRAILER_LEN as u64;

/// Magic of a checkpoint data file (an uploaded file or a merged physical file).
pub const DATA_MAGIC: [u8; 8] = *b"WEIRCKPD";
/// The data file format version.
pub const DATA_VERSION: u16 = 1;
/// Size of a data file's header.
pub const DATA_HEADER_LEN: usize = 40;
/// The block kind of data blocks in a data file.
pub const DATA_BLOCK_KIND: u8 = 1;

/// File kind byte: one uploaded file (an LSM segment) in `shared/`.
pub(crate) const FILE_KIND_UPLOAD: u8 = 1;
/// File kind byte: a merged physical file of shared logical files in `shared/`.
pub(crate) const FILE_KIND_MERGED_SHARED: u8 = 2;
/// File kind byte: a merged physical file of task-owned logical files in `taskowned/`.
pub(crate) const FILE_KIND_MERGED_TASKOWNED: u8 = 3;
/// Not a header byte: the kind of a raw file in `shared/` (the source's bytes verbatim, no
/// header, no framing; see [`raw_file_name`]), which has no header to carry it.
pub(crate) const FILE_KIND_RAW: u8 = 4;

/// Directory (relative to the job or savepoint directory) of files shared by checkpoints.
pub const SHARED_DIR: &str = "shared";
/// Directory of per-checkpoint files (in-flight channel state, operator state).
pub const TASKOWNED_DIR: &str = "taskowned";
/// Name of the metadata file inside a checkpoint or savepoint directory.
pub const METADATA_FILE: &str = "_metadata";
/// Name of the file in a job directory that records the id of the newest checkpoint known to
/// have completed: the id in decimal, a space, the CRC-32 of those digits in 8 lowercase hex
/// digits, `\n`. See `CheckpointStorage::completed_marker`.
pub const COMPLETED_FILE: &str = "COMPLETED";
/// Name of the file in a job directory that records where the newest run of the job started:
/// its first checkpoint id, and the checkpoint or savepoint it restored, if any. See
/// `CheckpointStorage::run_origin` and docs/checkpoint-format.md.
pub const RUN_ORIGIN_FILE: &str = "RUN_ORIGIN";

/// Whether a checkpoint is a periodic checkpoint or a self-contained savepoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CheckpointKind {
    /// A periodic checkpoint in `<job>/chk-<n>/`, sharing files with other checkpoints.
    Checkpoint,
    /// A savepoint: a self-contained directory.
    Savepoint,
}

impl CheckpointKind {
    fn to_byte(self) -> u8 {
        match self {
            CheckpointKind::Checkpoint => 1,
            CheckpointKind::Savepoint => 2,
        }
    }
    fn from_byte(b: u8) -> Option<CheckpointKind> {
        match b {
            1 => Some(CheckpointKind::Checkpoint),
            2 => Some(CheckpointKind::Savepoint),
            _ => None,
        }
    }
}

/// Where a small file goes when it is merged into a physical file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SmallFileKind {
    /// Belongs to this checkpoint only (channel state, operator state): `taskowned/`.
    TaskOwned,
    /// May be reused by later checkpoints (small segments): `shared/`.
    Shared,
}

/// A whole file in `shared/` (an uploaded LSM segment).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FileRef {
    /// Path relative to the job (or savepoint) directory, e.g. `shared/7-…-seg`.
    pub path: PathBuf,
    /// Length of the file's content (the uploaded source file), not of its framing.
    pub size_bytes: u64,
    /// CRC-32/IEEE of the content.
    pub crc32: u32,
}

impl FileRef {
    /// Whether the file is raw (the uploaded file's bytes verbatim, a hard link of it) rather
    /// than framed in checksummed blocks: its name says so (see `raw_file_name`).
    pub fn is_raw(&self) -> bool {
        self.path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(is_raw_file_name)
    }
}

/// A logical file: a range of blocks inside a merged physical file.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LogicalFileRef {
    /// Path of the physical file relative to the job (or savepoint) directory.
    pub physical: PathBuf,
    /// Byte offset of the logical file's first block in the physical file.
    pub offset: u64,
    /// Length of the logical file's content (not of its framing).
    pub size_bytes: u64,
    /// Index of its first block in the physical file (blocks carry their index).
    pub first_block: u32,
    /// CRC-32/IEEE of the content.
    pub crc32: u32,
}

/// The content of a `_metadata` file: everything needed to verify, restore and garbage-collect
/// a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointMetadata {
    pub job_id: String,
    pub checkpoint_id: u64,
    pub kind: CheckpointKind,
    pub trigger_timestamp_ms: u64,
    pub completion_timestamp_ms: u64,
    /// Bytes this checkpoint wrote to storage (framing included): its incremental size.
    pub new_bytes: u64,
    /// Whole files the checkpoint uses, sorted.
    pub files: Vec<FileRef>,
    /// Logical files the checkpoint uses, sorted.
    pub logical_files: Vec<LogicalFileRef>,
    /// Opaque named sections filled by the runtime (state handles, source positions, ...).
    pub sections: Vec<(String, Vec<u8>)>,
}

impl CheckpointMetadata {
    /// The physical files (relative paths) the checkpoint references.
    pub fn physical_paths(&self) -> BTreeSet<PathBuf> {
        self.files
            .iter()
            .map(|f| f.path.clone())
            .chain(self.logical_files.iter().map(|l| l.physical.clone()))
            .collect()
    }

    /// Total content bytes the checkpoint references (its full state size). Saturates: the
    /// sizes come from a file (one whose CRC was written again after an edit can state any).
    pub fn size_bytes(&self) -> u64 {
        self.files
            .iter()
            .map(|f| f.size_bytes)
            .chain(self.logical_files.iter().map(|l| l.size_bytes))
            .fold(0, u64::saturating_add)
    }

    /// The bytes of the section named `name`, if any.
    pub fn section(&self, name: &str) -> Option<&[u8]> {
        self.sections
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, b)| b.as_slice())
    }

    /// Encode as a `_metadata` file. Panics if a string or count exceeds its length field or a
    /// path is not a valid relative UTF-8 path: both are programmer errors.
    pub fn encode(&self) -> Vec<u8> {
        let mut body = Vec::new();
        body.extend_from_slice(&self.checkpoint_id.to_le_bytes());
        body.extend_from_slice(&self.trigger_timestamp_ms.to_le_bytes());
        body.extend_from_slice(&self.completion_timestamp_ms.to_le_bytes());
        body.extend_from_slice(&self.new_bytes.to_le_bytes());
        put_str(&mut body, &self.job_id);
        put_u32(&mut body, self.files.len());
        for f in &self.files {
            put_path(&mut body, &f.path);
            body.extend_from_slice(&f.size_bytes.to_le_bytes());
            body.extend_from_slice(&f.crc32.to_le_bytes());
        }
        put_u32(&mut body, self.logical_files.len());
        for l in &self.logical_files {
            put_path(&mut body, &l.physical);
            body.extend_from_slice(&l.offset.to_le_bytes());
            body.extend_from_slice(&l.size_bytes.to_le_bytes());
            body.extend_from_slice(&l.first_block.to_le_bytes());
            body.extend_from_slice(&l.crc32.to_le_bytes());
        }
        put_u32(&mut body, self.sections.len());
        for (name, bytes) in &self.sections {
            put_str(&mut body, name);
            put_u32(&mut body, bytes.len());
            body.extend_from_slice(bytes);
        }
        let mut out = Vec::with_capacity(METADATA_HEADER_LEN + body.len() + METADATA_TRAILER_LEN);
        out.extend_from_slice(&METADATA_MAGIC);
        out.extend_from_slice(&METADATA_VERSION.to_le_bytes());
        out.push(CHECKSUM_CRC32_IEEE);
        out.push(self.kind.to_byte());
        put_u32(&mut out, body.len());
        out.extend_from_slice(&body);
        let crc = crc32(&[&out]);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    /// Decode and verify a `_metadata` file read from `file`. Every failure is a typed error
    /// naming `file` and the byte offset; nothing panics on any input.
    pub fn decode(file: &Path, bytes: &[u8]) -> Result<CheckpointMetadata, FormatError> {
        let version = Self::check_header(file, bytes, bytes.len() as u64)?;
        // `check_header` checked that `bytes` is header, body and trailer.
        let crc_at = bytes.len() - METADATA_TRAILER_LEN;
        let expected = le_u32(&bytes[crc_at..]);
        let actual = crc32(&[&bytes[..crc_at]]);
        if expected != actual {
            return Err(FormatError::ChecksumMismatch {
                file: file.to_owned(),
                offset: crc_at as u64,
                expected,
                actual,
            });
        }
        // Below this line the CRC matched: errors mean a buggy or foreign writer.
        let kind = CheckpointKind::from_byte(bytes[11]).ok_or_else(|| FormatError::Malformed {
            file: file.to_owned(),
            offset: 11,
            reason: format!("unknown checkpoint kind {}", bytes[11]),
        })?;
        let mut c = Cursor {
            file,
            bytes: &bytes[..crc_at],
            pos: METADATA_HEADER_LEN,
        };
        let checkpoint_id = c.u64()?;
        let trigger_timestamp_ms = c.u64()?;
        let completion_timestamp_ms = c.u64()?;
        let new_bytes = c.u64()?;
        let job_id = c.string()?;
        let n = c.count(8 + 4)?;
        let mut files: Vec<FileRef> = Vec::with_capacity(n);
        for _ in 0..n {
            let at = c.pos;
            let f = FileRef {
                path: c.rel_path()?,
                size_bytes: c.u64()?,
                crc32: c.u32()?,
            };
            if f.is_raw() && version < 2 {
                return Err(FormatError::Malformed {
                    file: file.to_owned(),
                    offset: at as u64,
                    reason: format!("version {version} names the raw file {}", f.path.display()),
                });
            }
            if let Some(prev) = files.last() {
                sorted_and_unique(file, at, (&prev.path, 0), (&f.path, 0))?;
            }
            files.push(f);
        }
        let n = c.count(8 + 8 + 4 + 4)?;
        let mut logical_files: Vec<LogicalFileRef> = Vec::with_capacity(n);
        for _ in 0..n {
            let at = c.pos;
            let l = LogicalFileRef {
                physical: c.rel_path()?,
                offset: c.u64()?,
                size_bytes: c.u64()?,
                first_block: c.u32()?,
                crc32: c.u32()?,
            };
            if let Some(prev) = logical_files.last() {
                sorted_and_unique(
                    file,
                    at,
                    (&prev.physical, prev.offset),
                    (&l.physical, l.offset),
                )?;
            }
            logical_files.push(l);
        }
        let n = c.count(4)?;
        let mut sections = Vec::with_capacity(n);
        for _ in 0..n {
            let name = c.string()?;
            let len = c.u32()? as usize;
            sections.push((name, c.take(len)?.to_vec()));
        }
        if c.pos != crc_at {
            return Err(FormatError::Malformed {
                file: file.to_owned(),
                offset: c.pos as u64,
                reason: format!("{} unparsed bytes before the checksum", crc_at - c.pos),
            });
        }
        Ok(CheckpointMetadata {
            job_id,
            checkpoint_id,
            kind,
            trigger_timestamp_ms,
            completion_timestamp_ms,
            new_bytes,
            files,
            logical_files,
            sections,
        })
    }

    /// The checks of [`decode`](Self::decode) that need only the header and the file's
    /// length, in its order: at most [`METADATA_LEN_MAX`] bytes, magic, version, checksum
    /// algorithm, then exactly as long as the body length field says. `head` holds the first
    /// `min(file_len, 16)` bytes of the file (or more), `file_len` is the file's length.
    /// Returns the version.
    ///
    /// Why apart: a reader runs them on the header before it allocates a buffer for the whole
    /// file. The length comes from the file system, so an oversized file (a stray
    /// `truncate -s 1T`) must be refused by its length, not by a failed allocation that
    /// aborts the process.
    pub(crate) fn check_header(
        file: &Path,
        head: &[u8],
        file_len: u64,
    ) -> Result<u16, FormatError> {
        let need = |offset: u64, needed: u64| FormatError::Truncated {
            file: file.to_owned(),
            offset,
            needed,
            available: file_len.saturating_sub(offset),
        };
        if file_len > METADATA_LEN_MAX {
            return Err(FormatError::Malformed {
                file: file.to_owned(),
                offset: METADATA_LEN_MAX,
                reason: format!(
                    "the file is {file_len} bytes, longer than the {METADATA_LEN_MAX} bytes a \
                     metadata file can be"
                ),
            });
        }
        let header_len = METADATA_HEADER_LEN as u64;
        if file_len < 8 || head.len() < 8 {
            return Err(need(0, header_len));
        }
        if head[..8] != METADATA_MAGIC {
            return Err(FormatError::BadMagic {
                file: file.to_owned(),
                offset: 0,
                found: le_u64(&head[..8]),
            });
        }
        if file_len < header_len || head.len() < METADATA_HEADER_LEN {
            return Err(need(0, header_len));
        }
        let version = u16::from_le_bytes([head[8], head[9]]);
        if !(METADATA_VERSION_MIN..=METADATA_VERSION).contains(&version) {
            return Err(FormatError::UnsupportedVersion {
                file: file.to_owned(),
                offset: 8,
                found: version,
                supported: METADATA_VERSION,
            });
        }
        if head[10] != CHECKSUM_CRC32_IEEE {
            return Err(FormatError::UnsupportedChecksum {
                file: file.to_owned(),
                offset: 10,
                found: head[10],
            });
        }
        // In u64: no sum of a u32 and the small header and trailer overflows.
        let body_len = u64::from(le_u32(&head[12..16]));
        let expected_len = header_len + body_len + METADATA_TRAILER_LEN as u64;
        if file_len < expected_len {
            return Err(need(header_len, body_len + METADATA_TRAILER_LEN as u64));
        }
        if file_len > expected_len {
            return Err(FormatError::Malformed {
                file: file.to_owned(),
                offset: expected_len,
                reason: format!(
                    "{} trailing bytes after the checksum: the file is {file_len} bytes, its \
                     header says {expected_len}",
                    file_len - expected_len
                ),
            });
        }
        Ok(version)
    }
}

fn put_u32(out: &mut Vec<u8>, n: usize) {
    let n = u32::try_from(n).expect("count or length exceeds u32");
    out.extend_from_slice(&n.to_le_bytes());
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    let n = u16::try_from(s.len()).expect("string longer than 65535 bytes");
    out.extend_from_slice(&n.to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_path(out: &mut Vec<u8>, p: &Path) {
    let s = p.to_str().expect("checkpoint paths are UTF-8");
    assert!(is_safe_relative(p), "checkpoint path {s} is not relative");
    put_str(out, s);
}

fn le_u32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

fn le_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

/// True for a relative path of plain components (no `..`, no root): a path from a foreign
/// metadata file can then never make GC or a reader touch anything outside the directory.
pub(crate) fn is_safe_relative(p: &Path) -> bool {
    p.components().count() > 0 && p.components().all(|c| matches!(c, Component::Normal(_)))
}

struct Cursor<'a> {
    file: &'a Path,
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], FormatError> {
        let available = self.bytes.len() - self.pos;
        if n > available {
            return Err(FormatError::Truncated {
                file: self.file.to_owned(),
                offset: self.pos as u64,
                needed: n as u64,
                available: available as u64,
            });
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn u16(&mut self) -> Result<u16, FormatError> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, FormatError> {
        Ok(le_u32(self.take(4)?))
    }
    fn u64(&mut self) -> Result<u64, FormatError> {
        Ok(le_u64(self.take(8)?))
    }
    /// A count of entries of at least `min_entry_bytes` each; rejects counts the remaining
    /// bytes cannot hold, so a bad count cannot make us allocate a huge vector.
    fn count(&mut self, min_entry_bytes: usize) -> Result<usize, FormatError> {
        let at = self.pos;
        let n = self.u32()? as usize;
        let remaining = self.bytes.len() - self.pos;
        if n.saturating_mul(min_entry_bytes) > remaining {
            return Err(FormatError::Malformed {
                file: self.file.to_owned(),
                offset: at as u64,
                reason: format!("count {n} does not fit in the {remaining} remaining bytes"),
            });
        }
        Ok(n)
    }
    fn string(&mut self) -> Result<String, FormatError> {
        let len = self.u16()? as usize;
        let at = self.pos;
        let b = self.take(len)?;
        String::from_utf8(b.to_vec()).map_err(|_| FormatError::Malformed {
            file: self.file.to_owned(),
            offset: at as u64,
            reason: "string is not UTF-8".into(),
        })
    }
    fn rel_path(&mut self) -> Result<PathBuf, FormatError> {
        let at = self.pos + 2;
        let p = PathBuf::from(self.string()?);
        if !is_safe_relative(&p) {
            return Err(FormatError::Malformed {
                file: self.file.to_owned(),
                offset: at as u64,
                reason: format!("path {} is not a plain relative path", p.display()),
            });
        }
        Ok(p)
    }
}

/// The header of a data file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct DataHeader {
    pub file_kind: u8,
    pub block_payload_bytes_max: u32,
    pub file_id: u64,
    pub checkpoint_id: u64,
}

impl DataHeader {
    pub(crate) fn encode(&self) -> [u8; DATA_HEADER_LEN] {
        let mut h = [0u8; DATA_HEADER_LEN];
        h[0..8].copy_from_slice(&DATA_MAGIC);
        h[8..10].copy_from_slice(&DATA_VERSION.to_le_bytes());
        h[10] = CHECKSUM_CRC32_IEEE;
        h[11] = self.file_kind;
        h[12..16].copy_from_slice(&self.block_payload_bytes_max.to_le_bytes());
        h[16..24].copy_from_slice(&self.file_id.to_le_bytes());
        h[24..32].copy_from_slice(&self.checkpoint_id.to_le_bytes());
        let crc = crc32(&[&h[..36]]);
        h[36..40].copy_from_slice(&crc.to_le_bytes());
        h
    }

    /// Decode and check a data file header against what its name promises.
    pub(crate) fn decode(
        file: &Path,
        bytes: &[u8],
        expect_file_id: u64,
        expect_checkpoint_id: u64,
    ) -> Result<DataHeader, FormatError> {
        if bytes.len() < DATA_HEADER_LEN {
            return Err(FormatError::Truncated {
                file: file.to_owned(),
                offset: 0,
                needed: DATA_HEADER_LEN as u64,
                available: bytes.len() as u64,
            });
        }
        if bytes[..8] != DATA_MAGIC {
            return Err(FormatError::BadMagic {
                file: file.to_owned(),
                offset: 0,
                found: le_u64(&bytes[..8]),
            });
        }
        let version = u16::from_le_bytes([bytes[8], bytes[9]]);
        if version != DATA_VERSION {
            return Err(FormatError::UnsupportedVersion {
                file: file.to_owned(),
                offset: 8,
                found: version,
                supported: DATA_VERSION,
            });
        }
        if bytes[10] != CHECKSUM_CRC32_IEEE {
            return Err(FormatError::UnsupportedChecksum {
                file: file.to_owned(),
                offset: 10,
                found: bytes[10],
            });
        }
        let expected = le_u32(&bytes[36..40]);
        let actual = crc32(&[&bytes[..36]]);
        if expected != actual {
            return Err(FormatError::ChecksumMismatch {
                file: file.to_owned(),
                offset: 0,
                expected,
                actual,
            });
        }
        let h = DataHeader {
            file_kind: bytes[11],
            block_payload_bytes_max: le_u32(&bytes[12..16]),
            file_id: le_u64(&bytes[16..24]),
            checkpoint_id: le_u64(&bytes[24..32]),
        };
        for (field, offset, want, got) in [
            ("file id", 16, expect_file_id, h.file_id),
            ("checkpoint id", 24, expect_checkpoint_id, h.checkpoint_id),
        ] {
            if want != got {
                return Err(FormatError::Misdirected {
                    file: file.to_owned(),
                    offset,
                    field,
                    expected: want,
                    found: got,
                });
            }
        }
        if h.block_payload_bytes_max == 0 {
            return Err(FormatError::Malformed {
                file: file.to_owned(),
                offset: 12,
                reason: "block payload size is zero".into(),
            });
        }
        Ok(h)
    }
}

/// Number of blocks that hold `size_bytes` of content (an empty file still has one block, so
/// that every logical file has a header that names it).
pub(crate) fn block_count(size_bytes: u64, block_payload_bytes_max: u32) -> u64 {
    size_bytes
        .div_ceil(u64::from(block_payload_bytes_max))
        .max(1)
}

/// On-disk length of `size_bytes` of content framed in blocks.
pub(crate) fn framed_len(size_bytes: u64, block_payload_bytes_max: u32) -> u64 {
    // Saturates (a size read from metadata can be anything): no file is that long.
    let headers =
        block_count(size_bytes, block_payload_bytes_max).saturating_mul(BLOCK_HEADER_LEN as u64);
    size_bytes.saturating_add(headers)
}

/// File lists are sorted and unique, by path (logical files: by physical file, then offset),
/// as the writer makes them: an entry at `at` that does not come after the previous one is
/// `Malformed` there. A list that names a file twice, under a CRC written again, is a forged
/// or foreign one, whatever its entries say.
fn sorted_and_unique(
    file: &Path,
    at: usize,
    prev: (&PathBuf, u64),
    this: (&PathBuf, u64),
) -> Result<(), FormatError> {
    if prev < this {
        return Ok(());
    }
    let shown = |(p, o): (&PathBuf, u64)| match o {
        0 => p.display().to_string(),
        o => format!("{} at {o}", p.display()),
    };
    Err(FormatError::Malformed {
        file: file.to_owned(),
        offset: at as u64,
        reason: format!(
            "file list not sorted and unique: {} after {}",
            shown(this),
            shown(prev)
        ),
    })
}

/// The name of a data file: `<checkpoint id>-<file id, 16 hex digits>-<hint>`. The name binds
/// the file to its header, so a file renamed or copied to the wrong place is caught.
pub(crate) fn data_file_name(checkpoint_id: u64, file_id: u64, hint: &str) -> String {
    format!("{checkpoint_id}-{file_id:016x}-{hint}")
}

/// Name of a raw file: a data file name whose hint starts with `raw-`. Sanitized hints never
/// contain `-`, so no framed file's name has this form.
pub(crate) fn raw_file_name(checkpoint_id: u64, file_id: u64, hint: &str) -> String {
    format!("{checkpoint_id}-{file_id:016x}-{RAW_PREFIX}{hint}")
}

const RAW_PREFIX: &str = "raw-";

/// True if `name` is a raw file's name ([`raw_file_name`]).
pub(crate) fn is_raw_file_name(name: &str) -> bool {
    parse_data_file_name(name).is_some()
        && name
            .split_once('-')
            .and_then(|(_, rest)| rest.get(17..))
            .is_some_and(|hint| hint.starts_with(RAW_PREFIX))
}

/// Parse a data file name into (checkpoint id, file id); `None` for anything else (GC never
/// touches a file it cannot parse). Only the spelling [`data_file_name`] writes parses: the
/// checkpoint id as [`parse_id`] takes it, the file id as 16 lowercase hex digits. So a
/// foreign `04-…` or `4-…ABCD-…` is never taken for checkpoint 4's file and deleted by GC.
pub(crate) fn parse_data_file_name(name: &str) -> Option<(u64, u64)> {
    let (ckpt, rest) = name.split_once('-')?;
    let id = rest.get(..16)?;
    if rest.as_bytes().get(16) != Some(&b'-') || !is_lower_hex(id, 16) {
        return None;
    }
    Some((parse_id(ckpt)?, u64::from_str_radix(id, 16).ok()?))
}

/// `s` as an id in the one spelling the writer gives it (`{id}`): decimal digits, no sign, no
/// leading zero except in `0` itself (ids start at 0: `begin(0)` is allowed). `None` for any
/// other. Why not `str::parse`: it also takes `+4` and `04`, so a directory `chk-04` beside
/// `chk-4` was listed as a second checkpoint 4, and `retain` deleted its contents as 4's. One
/// id, one name: anything else is not ours, and is never listed or deleted.
pub(crate) fn parse_id(s: &str) -> Option<u64> {
    let digits = !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits || (s.len() > 1 && s.starts_with('0')) {
        return None;
    }
    // Digits only: fails only on overflow.
    s.parse().ok()
}

/// True if `s` is `len` lowercase hex digits, the spelling of `{:0len$x}`.
pub(crate) fn is_lower_hex(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Prefix of a checkpoint directory's name, `chk-<n>`.
const CHECKPOINT_DIR_PREFIX: &str = "chk-";

/// The name of checkpoint `checkpoint_id`'s directory in its job directory: `chk-<n>`.
pub fn checkpoint_dir_name(checkpoint_id: u64) -> String {
    format!("{CHECKPOINT_DIR_PREFIX}{checkpoint_id}")
}

/// The checkpoint id of a directory named `chk-<n>`, `n` spelt as storage writes it (decimal,
/// no sign, no leading zeros); `None` for any other name. `chk-04` or `chk-+4` is not
/// checkpoint 4's directory: storage neither lists nor deletes it, and a tool given such a
/// directory must not take it for `chk-4`.
pub fn parse_checkpoint_dir_name(name: &str) -> Option<u64> {
    parse_id(name.strip_prefix(CHECKPOINT_DIR_PREFIX)?)
}

/// Keep a name hint short and to a safe alphabet.
pub(crate) fn sanitize_hint(hint: &str) -> String {
    let s: String = hint
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.'))
        .take(48)
        .collect();
    if s.is_empty() {
        "file".into()
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn sample() -> CheckpointMetadata {
        CheckpointMetadata {
            job_id: "job".into(),
            checkpoint_id: 7,
            kind: CheckpointKind::Checkpoint,
            trigger_timestamp_ms: 1000,
            completion_timestamp_ms: 1250,
            new_bytes: 99,
            files: vec![FileRef {
                path: "shared/5-0000000100000001-seg".into(),
                size_bytes: 10,
                crc32: 0xdead_beef,
            }],
            logical_files: vec![LogicalFileRef {
                physical: "taskowned/7-0000000100000002-merged".into(),
                offset: 40,
                size_bytes: 3,
                first_block: 0,
                crc32: 1,
            }],
            sections: vec![("sources".into(), vec![1, 2, 3])],
        }
    }

    /// Sizes come from a file: any value sums and frames without overflowing (a panic in
    /// debug builds, found by restoring forged metadata), saturating instead.
    #[test]
    fn stated_sizes_saturate() {
        let mut m = sample();
        assert_eq!(m.size_bytes(), 13);
        m.files[0].size_bytes = u64::MAX - 1;
        assert_eq!(m.size_bytes(), u64::MAX);
        assert_eq!(framed_len(u64::MAX - 1, 1), u64::MAX);
        assert_eq!(framed_len(u64::MAX, u32::MAX), u64::MAX);
        assert_eq!(framed_len(10, 4), 10 + 3 * BLOCK_HEADER_LEN as u64);
    }

    #[test]
    fn metadata_round_trip_and_every_flip_and_cut_is_an_error() {
        let m = sample();
        let b = m.encode();
        let f = Path::new("m");
        assert_eq!(CheckpointMetadata::decode(f, &b).unwrap(), m);
        for i in 0..b.len() {
            let mut x = b.clone();
            x[i] ^= 0x10;
            let e = CheckpointMetadata::decode(f, &x).unwrap_err();
            assert_eq!(e.file(), f);
        }
        for cut in 0..b.len() {
            assert!(matches!(
                CheckpointMetadata::decode(f, &b[..cut]),
                Err(FormatError::Truncated { .. })
            ));
        }
    }

    /// File lists are sorted and unique as the writer makes them; a list written otherwise
    /// under a valid CRC (a duplicate, or reversed) is refused where the entry is, not read.
    #[test]
    fn file_lists_out_of_order_or_twice_are_refused() {
        let f = Path::new("m");
        let file = |p: &str| FileRef {
            path: p.into(),
            size_bytes: 10,
            crc32: 1,
        };
        let logical = |p: &str, offset| LogicalFileRef {
            physical: p.into(),
            offset,
            size_bytes: 3,
            first_block: 0,
            crc32: 1,
        };
        let mut ok = sample();
        ok.files = vec![
            file("shared/5-0000000100000001-seg"),
            file("shared/6-0000000100000001-seg"),
        ];
        ok.logical_files = vec![
            logical("taskowned/7-0000000100000002-merged", 40),
            logical("taskowned/7-0000000100000002-merged", 67),
        ];
        assert_eq!(CheckpointMetadata::decode(f, &ok.encode()).unwrap(), ok);
        let mut twice = ok.clone();
        twice.files[1] = twice.files[0].clone();
        let mut reversed = ok.clone();
        reversed.files.reverse();
        let mut same_offset = ok.clone();
        same_offset.logical_files[1].offset = 40;
        let mut logical_reversed = ok.clone();
        logical_reversed.logical_files.reverse();
        for (bad, says) in [
            (twice, "5-0000000100000001-seg after shared/5"),
            (reversed, "5-0000000100000001-seg after shared/6"),
            (
                same_offset,
                "merged at 40 after taskowned/7-0000000100000002-merged at 40",
            ),
            (
                logical_reversed,
                "merged at 40 after taskowned/7-0000000100000002-merged at 67",
            ),
        ] {
            let e = CheckpointMetadata::decode(f, &bad.encode()).unwrap_err();
            assert!(
                matches!(&e, FormatError::Malformed { reason, offset, .. }
                    if reason.contains("not sorted and unique") && reason.contains(says)
                        && *offset > METADATA_HEADER_LEN as u64),
                "{e}"
            );
        }
    }

    /// The header checks need no more than the header and the file's length: a reader refuses
    /// a file of any length that cannot be the one its header describes before reading it.
    #[test]
    fn header_checks_bound_the_length_before_reading() {
        let b = sample().encode();
        let f = Path::new("m");
        let head = &b[..METADATA_HEADER_LEN];
        let len = b.len() as u64;
        assert_eq!(
            CheckpointMetadata::check_header(f, head, len),
            Ok(METADATA_VERSION)
        );
        let e = CheckpointMetadata::check_header(f, head, len + 1).unwrap_err();
        assert!(
            matches!(&e, FormatError::Malformed { offset, .. } if *offset == len),
            "{e}"
        );
        let e = CheckpointMetadata::check_header(f, head, len - 1).unwrap_err();
        assert!(
            matches!(e, FormatError::Truncated { offset: 16, .. }),
            "{e}"
        );
        // The longest body the u32 length field can state is the longest file.
        let mut longest = head.to_vec();
        longest[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(
            CheckpointMetadata::check_header(f, &longest, METADATA_LEN_MAX),
            Ok(METADATA_VERSION)
        );
        for (h, n) in [
            (&longest[..], METADATA_LEN_MAX + 1),
            (&[0u8; 16][..], 1 << 40),
        ] {
            let e = CheckpointMetadata::check_header(f, h, n).unwrap_err();
            assert!(
                matches!(&e, FormatError::Malformed { offset, reason, .. }
                    if *offset == METADATA_LEN_MAX && reason.contains(&n.to_string())),
                "{e}"
            );
        }
        // Fewer header bytes than the file has: refused as truncated, never a panic.
        assert!(CheckpointMetadata::check_header(f, &head[..4], len).is_err());
        assert!(CheckpointMetadata::check_header(f, &head[..12], len).is_err());
    }

    #[test]
    fn names_parse_and_reject_foreign() {
        let n = data_file_name(12, 0xab, "seg");
        assert_eq!(parse_data_file_name(&n), Some((12, 0xab)));
        let n = raw_file_name(0, u64::MAX, "seg");
        assert_eq!(parse_data_file_name(&n), Some((0, u64::MAX)));
        for bad in [
            "x",
            "12",
            "12-zz-a",
            "-0000000000000001-a",
            "LOCK",
            "1-0000000000000001",
            // Other spellings of checkpoint 12's file 0xab: not a name the writer makes.
            "012-00000000000000ab-seg",
            "+12-00000000000000ab-seg",
            "12-00000000000000AB-seg",
            "12-+0000000000000ab-seg",
        ] {
            assert_eq!(parse_data_file_name(bad), None, "{bad}");
            assert!(!is_raw_file_name(bad), "{bad}");
        }
    }

    /// Ids parse only as the writer spells them, so that no two names stand for one id.
    #[test]
    fn ids_parse_only_in_their_canonical_spelling() {
        for (s, id) in [
            ("0", 0),
            ("4", 4),
            ("10", 10),
            ("18446744073709551615", u64::MAX),
        ] {
            assert_eq!(parse_id(s), Some(id), "{s}");
            assert_eq!(id.to_string(), s);
            assert_eq!(
                parse_checkpoint_dir_name(&checkpoint_dir_name(id)),
                Some(id)
            );
        }
        for bad in [
            "",
            "00",
            "04",
            "+4",
            "-4",
            " 4",
            "4 ",
            "4a",
            "0x4",
            "\u{0664}",
            "18446744073709551616",
        ] {
            assert_eq!(parse_id(bad), None, "{bad:?}");
            assert_eq!(
                parse_checkpoint_dir_name(&format!("chk-{bad}")),
                None,
                "{bad:?}"
            );
        }
        for bad in ["chk4", "CHK-4", "chk-", "savepoint-4", "4"] {
            assert_eq!(parse_checkpoint_dir_name(bad), None, "{bad}");
        }
    }

    #[test]
    fn unsafe_paths_are_rejected() {
        assert!(is_safe_relative(Path::new("shared/a")));
        for p in ["/etc/passwd", "../x", "shared/../../x", ""] {
            assert!(!is_safe_relative(Path::new(p)), "{p}");
        }
    }
}
