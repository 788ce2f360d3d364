//! Reading and verifying checkpoint files: every byte returned has passed its CRC, and every
//! block its header check (invariant 4). Shared by checkpoints and savepoints.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::checkpoint::error::{is_not_found, CheckpointError, VerifyError};
use crate::checkpoint::format::{
    block_count, framed_len, parse_data_file_name, CheckpointKind, CheckpointMetadata, DataHeader,
    FileRef, LogicalFileRef, DATA_BLOCK_KIND, DATA_HEADER_LEN, FILE_KIND_MERGED_SHARED,
    FILE_KIND_MERGED_TASKOWNED, FILE_KIND_RAW, FILE_KIND_UPLOAD, METADATA_FILE,
    METADATA_HEADER_LEN, TASKOWNED_DIR,
};
use crate::error::{FormatError, IoError};
use crate::frame::{decode_block, BlockHeader, BLOCK_HEADER_LEN};
use crate::fs::Fs;

/// Locates the damage in a raw file (one a checkpoint holds byte for byte: see
/// [`StorageOptions::link_uploads`](crate::StorageOptions::link_uploads)) whose whole-file CRC
/// failed, from the file's own format: the error of the first part of it that fails its own
/// check (a segment's block CRCs, say), with that part's offset. `None` when it cannot tell
/// (not a format it knows, or every part checks out), and the mismatch stays at offset 0.
/// Storage knows no format of the files it holds raw; their owner supplies this
/// ([`StorageOptions::raw_diagnose`](crate::StorageOptions::raw_diagnose)).
pub type RawDiagnose = fn(fs: &dyn Fs, path: &Path) -> Option<FormatError>;

/// Read and decode the metadata of `dir`. `Ok(None)` when there is no `_metadata`.
///
/// The header is read and checked against the file's length first (see
/// [`CheckpointMetadata::check_header`]), and only a file exactly as long as its header says
/// is read whole: the length comes from the file system, so an oversized or inconsistent file
/// is a typed error naming it, never an allocation of its length.
pub(crate) fn read_metadata_file(
    fs: &dyn Fs,
    dir: &Path,
) -> Result<Option<CheckpointMetadata>, CheckpointError> {
    let path = dir.join(METADATA_FILE);
    let f = match fs.open(&path) {
        Ok(f) => f,
        Err(e) if is_not_found(&e) => return Ok(None),
        Err(e) => return Err(not_a_file(&path, e)),
    };
    let len = f.len()?;
    let mut head = [0u8; METADATA_HEADER_LEN];
    let head = &mut head[..len.min(METADATA_HEADER_LEN as u64) as usize];
    f.read_at(0, head).map_err(|e| not_a_file(&path, e))?;
    CheckpointMetadata::check_header(&path, head, len)?;
    // At most METADATA_LEN_MAX (4 GiB + 19) now; where even that much memory is not to be
    // had, an error rather than the abort of a failed allocation.
    let mut bytes = Vec::new();
    bytes.try_reserve_exact(len as usize).map_err(|e| {
        IoError::os(
            "read",
            &path,
            std::io::Error::new(
                std::io::ErrorKind::OutOfMemory,
                format!("no memory for its {len} bytes: {e}"),
            ),
        )
    })?;
    bytes.resize(len as usize, 0);
    f.read_at(0, &mut bytes)?;
    Ok(Some(CheckpointMetadata::decode(&path, &bytes)?))
}

/// A `_metadata` that is a directory is a damaged checkpoint (what `list` shows as
/// incomplete and `verify` reports as corrupt), not an I/O failure: taken for one, it failed
/// the listing of every checkpoint of the job, the intact ones too.
fn not_a_file(path: &Path, e: IoError) -> CheckpointError {
    match &e {
        IoError::Os { source, .. } if source.kind() == std::io::ErrorKind::IsADirectory => {
            CheckpointError::Format(FormatError::Malformed {
                file: path.to_path_buf(),
                offset: 0,
                reason: "a directory, not a file".into(),
            })
        }
        _ => e.into(),
    }
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
        let raw = r.is_raw();
        Span {
            rel: &r.path,
            file_kind: if raw { FILE_KIND_RAW } else { FILE_KIND_UPLOAD },
            offset: if raw { 0 } else { DATA_HEADER_LEN as u64 },
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

/// Bytes read per `read_at` while streaming a span (rounded to whole frames): bounded memory
/// for files of any size, large enough that syscalls do not dominate.
const STREAM_CHUNK_BYTES: u64 = 4 << 20;

/// Stream the content of `span` under `base` to `sink`, block by block in order, after
/// checking the file header (against the file's name) and each block's header and CRC. The
/// content CRC is checked after the last block: `sink` may see bytes of a span that fails
/// that final check, so a caller must not trust what it received before `Ok`. Returns the
/// content length. One pass over the bytes, memory bounded by [`STREAM_CHUNK_BYTES`].
fn stream_span(
    fs: &dyn Fs,
    base: &Path,
    span: &Span<'_>,
    diagnose: Option<RawDiagnose>,
    mut sink: impl FnMut(&[u8]) -> Result<(), CheckpointError>,
) -> Result<u64, CheckpointError> {
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
    if span.file_kind == FILE_KIND_RAW {
        return stream_raw(&*file, &path, file_len, span, sink)
            .map_err(|e| diagnosed(fs, &path, e, diagnose));
    }
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
    let Some(end) = end.filter(|e| span.offset >= DATA_HEADER_LEN as u64 && *e <= file_len) else {
        return Err(FormatError::Truncated {
            file: path,
            offset: span.offset,
            needed: framed,
            available: file_len.saturating_sub(span.offset),
        }
        .into());
    };
    // An uploaded file is its blocks and nothing after them: bytes past the last one are
    // covered by no CRC (a raw file is held to its length the same way).
    if span.file_kind == FILE_KIND_UPLOAD && end < file_len {
        return Err(past_the_end(&path, end, file_len, "the file's last block"));
    }
    // Whole frames per read, so that no block straddles two reads.
    let frame_max = u64::from(block_max) + BLOCK_HEADER_LEN as u64;
    let per_read = (STREAM_CHUNK_BYTES / frame_max).max(1) * frame_max;
    let mut buf = Vec::new();
    let mut crc = crc32fast::Hasher::new();
    let mut pos = span.offset;
    let mut remaining = span.size_bytes;
    let blocks = block_count(span.size_bytes, block_max);
    let mut i = 0u64;
    while i < blocks {
        let len = per_read.min(end - pos) as usize;
        buf.resize(len, 0);
        file.read_at(pos, &mut buf)?;
        let mut at = 0usize;
        while at < len && i < blocks {
            let block_index = u32::try_from(u64::from(span.first_block) + i).map_err(|_| {
                FormatError::Malformed {
                    file: path.clone(),
                    offset: pos + at as u64,
                    reason: "block index overflows u32".into(),
                }
            })?;
            let payload_len = remaining.min(u64::from(block_max)) as u32;
            let expect = BlockHeader {
                file_id,
                block_index,
                kind: DATA_BLOCK_KIND,
                payload_len,
            };
            let payload = decode_block(&path, &buf[at..], pos + at as u64, expect)?;
            crc.update(payload);
            sink(payload)?;
            at += BLOCK_HEADER_LEN + payload.len();
            remaining -= u64::from(payload_len);
            i += 1;
        }
        if at == 0 {
            // Cannot happen (the frames fill `end - pos` exactly); never loop on it.
            return Err(FormatError::Truncated {
                file: path,
                offset: pos,
                needed: BLOCK_HEADER_LEN as u64,
                available: 0,
            }
            .into());
        }
        pos += at as u64;
    }
    let actual = crc.finalize();
    if actual != span.crc32 {
        return Err(FormatError::ChecksumMismatch {
            file: path,
            offset: span.offset,
            expected: span.crc32,
            actual,
        }
        .into());
    }
    Ok(span.size_bytes)
}

/// `e`, or where it is a raw file's whole-file CRC mismatch (which cannot say where the file
/// changed), what `diagnose` finds in the file's own format.
fn diagnosed(
    fs: &dyn Fs,
    path: &Path,
    e: CheckpointError,
    diagnose: Option<RawDiagnose>,
) -> CheckpointError {
    if let (CheckpointError::Format(FormatError::ChecksumMismatch { .. }), Some(d)) = (&e, diagnose)
    {
        if let Some(found) = d(fs, path) {
            return found.into();
        }
    }
    e
}

/// A raw file is as long as its reference says: `Truncated` at its length if shorter,
/// `Malformed` at the referenced length if longer.
fn check_raw_len(path: &Path, file_len: u64, span: &Span<'_>) -> Result<(), CheckpointError> {
    if file_len < span.size_bytes {
        return Err(FormatError::Truncated {
            file: path.to_owned(),
            offset: file_len,
            needed: span.size_bytes,
            available: file_len,
        }
        .into());
    }
    if file_len > span.size_bytes {
        return Err(FormatError::Malformed {
            file: path.to_owned(),
            offset: span.size_bytes,
            reason: format!(
                "{} bytes past the referenced length",
                file_len - span.size_bytes
            ),
        }
        .into());
    }
    Ok(())
}

/// [`stream_span`] of a raw file: its whole length is the content, checked against the
/// reference's length and content CRC (there are no blocks). The source's own format (an LSM
/// segment's block CRCs) is its reader's to check once this passed.
fn stream_raw(
    file: &dyn crate::fs::FsFile,
    path: &Path,
    file_len: u64,
    span: &Span<'_>,
    mut sink: impl FnMut(&[u8]) -> Result<(), CheckpointError>,
) -> Result<u64, CheckpointError> {
    check_raw_len(path, file_len, span)?;
    let mut buf = vec![0u8; STREAM_CHUNK_BYTES.min(file_len) as usize];
    let mut crc = crc32fast::Hasher::new();
    let mut pos = 0u64;
    while pos < file_len {
        let n = (file_len - pos).min(buf.len() as u64) as usize;
        file.read_at(pos, &mut buf[..n])?;
        crc.update(&buf[..n]);
        sink(&buf[..n])?;
        pos += n as u64;
    }
    let actual = crc.finalize();
    if actual != span.crc32 {
        return Err(FormatError::ChecksumMismatch {
            file: path.to_owned(),
            offset: 0,
            expected: span.crc32,
            actual,
        }
        .into());
    }
    Ok(file_len)
}

/// Read the content of `span` under `base`, checking the file header (against the file's
/// name), every block header and CRC, and the content CRC, before returning a byte.
pub(crate) fn read_span(
    fs: &dyn Fs,
    base: &Path,
    span: &Span<'_>,
    diagnose: Option<RawDiagnose>,
) -> Result<Vec<u8>, CheckpointError> {
    let mut out = Vec::new();
    stream_span(fs, base, span, diagnose, |payload| {
        out.extend_from_slice(payload);
        Ok(())
    })?;
    Ok(out)
}

/// Write the content of `span` under `base` to a new file `dest` (which must not exist),
/// verified as [`read_span`] verifies it, in one pass with bounded memory. On any error
/// `dest` is removed (best effort) and the error names the checkpoint file and offset. The
/// copy is not fsynced: it is a scratch copy that a crash discards (a restore starts over
/// from checkpoint storage), and a reader of it checks it again. A raw file is the content
/// itself: once it verified, `dest` becomes a second name of it (no copy). Checkpoint files
/// are never written again, and the reader of `dest` only maps it. Where links fail
/// (another file system), it is copied.
pub(crate) fn copy_span_to(
    fs: &dyn Fs,
    base: &Path,
    span: &Span<'_>,
    diagnose: Option<RawDiagnose>,
    dest: &Path,
) -> Result<u64, CheckpointError> {
    give_span_to(fs, base, span, diagnose, dest, true)
}

/// [`copy_span_to`], except that a whole raw file is linked once its length is checked,
/// without reading it. For a caller that has verified the checkpoint already and whose reader
/// checks every byte it uses once more against the size and CRC it holds (a store opening a
/// segment checks every block, then size and whole-file CRC against its handle): a restore
/// read each segment three times, and the third read alone is what the store trusts.
pub(crate) fn link_span_to(
    fs: &dyn Fs,
    base: &Path,
    span: &Span<'_>,
    diagnose: Option<RawDiagnose>,
    dest: &Path,
) -> Result<u64, CheckpointError> {
    give_span_to(fs, base, span, diagnose, dest, false)
}

/// [`copy_span_to`] (`read_raw`) or [`link_span_to`].
fn give_span_to(
    fs: &dyn Fs,
    base: &Path,
    span: &Span<'_>,
    diagnose: Option<RawDiagnose>,
    dest: &Path,
    read_raw: bool,
) -> Result<u64, CheckpointError> {
    if span.file_kind == FILE_KIND_RAW {
        let path = base.join(span.rel);
        let n = if read_raw {
            stream_span(fs, base, span, diagnose, |_| Ok(()))?
        } else {
            check_raw_len(&path, fs.open(&path)?.len()?, span)?;
            span.size_bytes
        };
        if fs.hard_link(&path, dest).is_ok() {
            return Ok(n);
        }
    }
    let mut out = fs.create(dest)?;
    let mut pending: Vec<u8> = Vec::new();
    let mut written = 0u64;
    let result = stream_span(fs, base, span, diagnose, |payload| {
        pending.extend_from_slice(payload);
        if pending.len() as u64 >= STREAM_CHUNK_BYTES {
            out.write_at(written, &pending)?;
            written += pending.len() as u64;
            pending.clear();
        }
        Ok(())
    })
    .and_then(|n| {
        if !pending.is_empty() {
            out.write_at(written, &pending)?;
        }
        Ok(n)
    });
    drop(out);
    if result.is_err() {
        let _ = fs.remove(dest);
    }
    result
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
    diagnose: Option<RawDiagnose>,
) -> Result<VerifyReport, VerifyError> {
    let checkpoint_id = meta.checkpoint_id;
    let wrap = |e: CheckpointError| VerifyError::from_read(checkpoint_id, base, e);
    let mut report = VerifyReport {
        checkpoint_id,
        ..VerifyReport::default()
    };
    let spans: Vec<Span<'_>> = meta
        .files
        .iter()
        .map(Span::of_file)
        .chain(meta.logical_files.iter().map(Span::of_logical))
        .collect();
    // Files verify independently, so they are checked on as many threads as there are cores:
    // a restore verifies before it trusts (1.6 GiB took 0.5-0.9 s on one thread here), and
    // nothing else runs while it waits. The error reported is the first in metadata order,
    // as a sequential check would report it.
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(VERIFY_THREADS_MAX)
        .min(spans.len())
        .max(1);
    let results = verify_spans(fs, base, &spans, diagnose, threads);
    for (i, r) in results.into_iter().enumerate() {
        report.bytes_checked += r.map_err(wrap)?;
        if i < meta.files.len() {
            report.files += 1;
        } else {
            report.logical_files += 1;
        }
    }
    check_merged_coverage(fs, base, meta).map_err(wrap)?;
    Ok(report)
}

/// `FormatError::Malformed` at `end` for the bytes of a file of `file_len` past it.
fn past_the_end(path: &Path, end: u64, file_len: u64, what: &str) -> CheckpointError {
    FormatError::Malformed {
        file: path.to_owned(),
        offset: end,
        reason: format!("{} bytes past the end of {what}", file_len - end),
    }
    .into()
}

/// Every byte of a merged physical file that checkpoint `meta` created is in one of its
/// logical files: each writer appends only its own checkpoint's logical files to the files it
/// creates, from the file header on, and the metadata lists every one it wrote. So those
/// files, in offset order, follow each other from the header to the file's end. Bytes
/// appended after the last one (or left between two) are covered by no CRC: they passed
/// `verify` and were copied into savepoints. A merged file of an earlier checkpoint that
/// this one reuses may hold logical files only that one lists: it is checked with it.
/// Called after every span verified (each file's header and blocks are sound).
fn check_merged_coverage(
    fs: &dyn Fs,
    base: &Path,
    meta: &CheckpointMetadata,
) -> Result<(), CheckpointError> {
    let mut by_file: std::collections::BTreeMap<&Path, Vec<&LogicalFileRef>> =
        std::collections::BTreeMap::new();
    for r in &meta.logical_files {
        let name = r
            .physical
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("");
        if parse_data_file_name(name).is_some_and(|(c, _)| c == meta.checkpoint_id) {
            by_file.entry(&r.physical).or_default().push(r);
        }
    }
    for (rel, mut refs) in by_file {
        let path = base.join(rel);
        let file = fs.open(&path)?;
        let file_len = file.len()?;
        let mut head = [0u8; DATA_HEADER_LEN];
        file.read_at(0, &mut head)?;
        let name = rel.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let file_id = parse_data_file_name(name).map_or(0, |(_, f)| f);
        let block_max =
            DataHeader::decode(&path, &head, file_id, meta.checkpoint_id)?.block_payload_bytes_max;
        refs.sort_by_key(|r| r.offset);
        let mut end = DATA_HEADER_LEN as u64;
        for r in refs {
            if r.offset != end {
                return Err(FormatError::Malformed {
                    file: path,
                    offset: end,
                    reason: format!(
                        "{} bytes before the logical file at offset {} are in none of checkpoint \
                         {}'s logical files",
                        r.offset.abs_diff(end),
                        r.offset,
                        meta.checkpoint_id
                    ),
                }
                .into());
            }
            end = r.offset.saturating_add(framed_len(r.size_bytes, block_max));
        }
        if end < file_len {
            return Err(past_the_end(
                &path,
                end,
                file_len,
                &format!("checkpoint {}'s last logical file", meta.checkpoint_id),
            ));
        }
    }
    Ok(())
}

/// Most threads a verification uses.
const VERIFY_THREADS_MAX: usize = 8;

/// Check every span (streamed: never a whole file in memory) on `threads` threads, largest
/// first so that the threads finish together; results in `spans` order. After a failure,
/// spans later in that order are skipped (their result is never looked at).
fn verify_spans(
    fs: &dyn Fs,
    base: &Path,
    spans: &[Span<'_>],
    diagnose: Option<RawDiagnose>,
    threads: usize,
) -> Vec<Result<u64, CheckpointError>> {
    let discard = |_: &[u8]| Ok::<(), CheckpointError>(());
    if threads <= 1 {
        let mut out = Vec::with_capacity(spans.len());
        for s in spans {
            let r = stream_span(fs, base, s, diagnose, discard);
            let failed = r.is_err();
            out.push(r);
            if failed {
                break;
            }
        }
        return out;
    }
    let mut order: Vec<usize> = (0..spans.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(spans[i].size_bytes));
    let next = std::sync::atomic::AtomicUsize::new(0);
    // The lowest span index that failed so far: spans after it need no check.
    let first_failed = std::sync::atomic::AtomicUsize::new(usize::MAX);
    let slots: Vec<std::sync::Mutex<Option<Result<u64, CheckpointError>>>> =
        spans.iter().map(|_| std::sync::Mutex::new(None)).collect();
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                let k = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(&i) = order.get(k) else {
                    break;
                };
                if i > first_failed.load(std::sync::atomic::Ordering::Relaxed) {
                    continue;
                }
                let r = stream_span(fs, base, &spans[i], diagnose, discard);
                if r.is_err() {
                    first_failed.fetch_min(i, std::sync::atomic::Ordering::Relaxed);
                }
                *slots[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
            });
        }
    });
    let mut out = Vec::with_capacity(spans.len());
    for slot in slots {
        match slot.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(r) => {
                let failed = r.is_err();
                out.push(r);
                if failed {
                    break;
                }
            }
            // Skipped after an earlier failure, which comes first in `out`.
            None => break,
        }
    }
    out
}

/// A self-contained savepoint directory, opened for reading: its metadata is verified on open.
#[derive(Debug, Clone)]
pub struct Savepoint {
    fs: Arc<dyn Fs>,
    dir: PathBuf,
    metadata: CheckpointMetadata,
    diagnose: Option<RawDiagnose>,
}

impl Savepoint {
    /// Open the savepoint in `dir` (the directory holding `_metadata`).
    pub fn open(fs: Arc<dyn Fs>, dir: &Path) -> Result<Savepoint, CheckpointError> {
        let metadata =
            read_metadata_file(&*fs, dir)?.ok_or_else(|| CheckpointError::NoSavepoint {
                dir: dir.to_owned(),
                file: METADATA_FILE,
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
            diagnose: None,
        })
    }

    /// Locate the damage in raw files whose CRC fails with `diagnose` (see [`RawDiagnose`]).
    pub fn with_raw_diagnose(mut self, diagnose: RawDiagnose) -> Savepoint {
        self.diagnose = Some(diagnose);
        self
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
        read_span(&*self.fs, &self.dir, &Span::of_file(r), self.diagnose)
    }

    /// Copy the content of a whole file of the savepoint to the new file `dest`, verified as
    /// [`read_file`](Self::read_file) verifies it, without holding it in memory. `dest` is
    /// removed on error and not fsynced (see [`CheckpointStorage::copy_file_to`](crate::CheckpointStorage::copy_file_to)).
    pub fn copy_file_to(&self, r: &FileRef, dest: &Path) -> Result<u64, CheckpointError> {
        copy_span_to(&*self.fs, &self.dir, &Span::of_file(r), self.diagnose, dest)
    }

    /// [`CheckpointStorage::link_file_to`](crate::CheckpointStorage::link_file_to) for a file
    /// of the savepoint.
    pub fn link_file_to(&self, r: &FileRef, dest: &Path) -> Result<u64, CheckpointError> {
        link_span_to(&*self.fs, &self.dir, &Span::of_file(r), self.diagnose, dest)
    }

    /// Read a logical file of the savepoint, verified.
    pub fn read_logical(&self, r: &LogicalFileRef) -> Result<Vec<u8>, CheckpointError> {
        read_span(&*self.fs, &self.dir, &Span::of_logical(r), self.diagnose)
    }

    /// Check every CRC of every file the savepoint references.
    pub fn verify(&self) -> Result<VerifyReport, VerifyError> {
        verify_files(&*self.fs, &self.dir, &self.metadata, self.diagnose)
    }
}
