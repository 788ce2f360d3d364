//! The file source: CSV or JSON-lines files, one file or a directory of them.
//!
//! Lines are read through a large buffered reader into one reused line buffer, by the source
//! itself: it keeps the record size bounded (`MAX_RECORD_BYTES`), the 1-based physical line
//! numbers exact, and each record's byte offset known, which positions (`position`/`seek`)
//! are made of. Parsing the lines is left to well-kept crates:
//!
//! - CSV: `csv_core`, the parser inside the `csv` crate, fed one physical line at a time and
//!   keeping its state across the lines of a record quoted over several. `csv::Reader` would
//!   do the reading itself: grow a record without bound, and place a record before the blank
//!   lines it skipped (so its line numbers would be off). `csv_core` never rejects input, so
//!   the source adds what strictness needs: every record has the header's number of fields,
//!   and `check_quoting` rejects a quote inside an unquoted field or text after a closing quote
//!   (which `csv_core` reads leniently).
//! - JSON lines: `serde_json`, with a visitor that keeps only the wanted fields, as the byte
//!   spans of their text in the line (each read as a `RawValue`); every other value is checked
//!   and dropped. A line is accepted when serde_json would read it as an object, within its
//!   recursion limit of 128 levels.
//!
//! So a line costs no allocation beyond what the user's `parse` builds: field text goes into
//! reused buffers, and an escaped JSON string is unescaped into a reused per-column buffer. (The
//! one exception: serde_json unescapes through a scratch buffer of its own, allocated afresh
//! for each line that has a string with escapes in it.)
//!
//! Bad input never panics (design invariant 6): a malformed line follows the [`ErrorPolicy`];
//! a file that cannot be read at all (missing, unknown column, broken CSV header, a wanted column
//! named twice in the header) is an error.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde::de::{DeserializeSeed, Deserializer, Error as _, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

use super::{EmptyReader, Source, SourceError, SourcePoll, SourceReader};

/// Read buffer size: large reads keep the number of system calls per line near zero.
const READ_BUFFER_BYTES: usize = 256 * 1024;
/// Longest record kept in memory. A longer line (or a CSV record that a stray quote stretched
/// over many lines) is malformed rather than a reason to exhaust memory.
const MAX_RECORD_BYTES: usize = 64 * 1024 * 1024;
/// Version byte of the position encoding: `version u8 | file index u64 | byte offset u64 |
/// line u64 | name length u32 | name | head length u32 | head CRC-32 u32 | tail length u32 |
/// tail CRC-32 u32 | dead-letter length u64 | dead-letter path length u32 | dead-letter path
/// (absolute)`, little-endian (no dead-letter file: path length 0, see
/// [`FileReader::dead_letter_len`]). The head is the file's first [`POSITION_WINDOW_BYTES`]
/// bytes and the tail the last ones before the offset (fewer, and the same bytes, when the
/// offset is smaller), as read: a restore refuses a file whose bytes there changed since (a
/// file replaced by another of the same name, cut or rewritten near the offset), rather than
/// read on from the offset into other content. An edit elsewhere in what was read goes
/// unseen: checking every byte would make a restore read the whole file up to the offset
/// again. Version 1, read still, had no windows.
const POSITION_VERSION: u8 = 2;
const POSITION_VERSION_1: u8 = 1;
/// Fixed part of a position: version, file index, byte offset, line number, name length.
const POSITION_FIXED_BYTES: usize = 1 + 8 + 8 + 8 + 4;
/// The windows after the name: head and tail, each its length and its CRC-32.
const POSITION_WINDOW_FIELDS: usize = 2 * (4 + 4);
/// The dead-letter length and path length after the windows.
const POSITION_DEAD_LETTER_FIELDS: usize = 8 + 4;
/// Bytes of each window of a position (see [`POSITION_VERSION`]).
const POSITION_WINDOW_BYTES: u64 = 4096;
/// The UTF-8 byte order mark that some tools put at the start of a text file.
const BOM: &[u8] = b"\xEF\xBB\xBF";

/// The format of the files a [`FileSource`] reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileFormat {
    /// Comma-separated values (RFC 4180 quoting) with a header row naming the columns.
    Csv,
    /// One JSON object per line; blank lines are ignored.
    JsonLines,
}

/// What a [`FileSource`] does with a malformed line.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ErrorPolicy {
    /// Stop the job with [`SourceError::Malformed`], naming the file and line.
    #[default]
    Fail,
    /// Count the line in [`FileSource::skipped`] and go on.
    Skip,
    /// Append the line to this file as a JSON object
    /// `{"file":..,"line":..,"reason":..,"raw":..}` per line, count it, and go on.
    DeadLetter(PathBuf),
}

/// Where a record came from: handed to the parse function and named in errors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Location {
    /// The file being read.
    pub file: PathBuf,
    /// The 1-based physical line on which the record starts (a CSV header is line 1).
    pub line: u64,
}

type ParseFn<T> = dyn Fn(&[&str], &Location) -> Result<T, String> + Send + Sync;

/// A source reading CSV or JSON-lines files.
///
/// The source does not split: shard 0 reads every file, in name order, and the other shards get
/// an [`EmptyReader`]. One reader keeps the input order of every key (which splitting files or
/// byte ranges across shards would not), and the keyed operators downstream redistribute the
/// records over the shards anyway.
pub struct FileSource<T> {
    path: PathBuf,
    format: FileFormat,
    columns: Vec<String>,
    parse: Arc<ParseFn<T>>,
    policy: ErrorPolicy,
    skipped: Arc<AtomicU64>,
    max_record_bytes: usize,
    /// Where a reader that starts from the beginning cuts the dead-letter file back to,
    /// shared with every reader.
    dead_start: Arc<DeadStart>,
}

/// The dead-letter file's length when the first reader of a source started from the
/// beginning (0 if the file did not exist): where every later reader that starts so cuts it
/// back to (see [`FileReader::fresh`]). Made once per source, so that the readers of later
/// attempts in the process start from the same place.
#[derive(Default)]
struct DeadStart {
    len: std::sync::OnceLock<Option<u64>>,
    /// Where that length is also kept durably, and whether one kept there is taken as the
    /// start: see [`FileSource::dead_letter_start_record`].
    record: Option<(PathBuf, bool)>,
}

impl<T> std::fmt::Debug for FileSource<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileSource")
            .field("path", &self.path)
            .field("format", &self.format)
            .field("columns", &self.columns)
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

impl<T: Send + 'static> FileSource<T> {
    /// A source reading `path`: a file, or a directory whose regular files are read in name
    /// order (names starting with '.' are skipped, as are subdirectories).
    ///
    /// `columns` names the fields the job needs (CSV header names or top-level JSON field
    /// names); `parse` receives their values in that order as text (JSON strings unescaped,
    /// numbers and booleans as written, nested arrays and objects as their JSON text) and
    /// returns the record or the reason it is malformed.
    pub fn new(
        path: impl Into<PathBuf>,
        format: FileFormat,
        columns: &[&str],
        parse: impl Fn(&[&str], &Location) -> Result<T, String> + Send + Sync + 'static,
    ) -> Self {
        Self {
            path: path.into(),
            format,
            columns: columns.iter().map(|c| (*c).to_owned()).collect(),
            parse: Arc::new(parse),
            policy: ErrorPolicy::Fail,
            skipped: Arc::new(AtomicU64::new(0)),
            max_record_bytes: MAX_RECORD_BYTES,
            dead_start: Arc::default(),
        }
    }

    /// Sets what happens to malformed lines (default [`ErrorPolicy::Fail`]).
    pub fn error_policy(mut self, policy: ErrorPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Keep the dead-letter file's length at the start of the job in the file `record` (see
    /// the format in `docs/checkpoint-format.md`), written durably before the first line is
    /// read, so that a restart from the beginning in another process cuts the dead-letter file
    /// back to it. With `resume` (the job restarts an earlier run, as `--restore latest`),
    /// a record that names the same dead-letter file is the start: the lines that the earlier
    /// run dead-lettered before its first checkpoint, which this run reads again, are not
    /// written twice. Without it, or with no such record, the record is written anew with the
    /// file's length now. A restore from a checkpoint cuts the file back to the length its
    /// position recorded instead, whatever the record says.
    ///
    /// Without a record a process knows only where it found the file: lines that a killed run
    /// wrote before its first checkpoint were written again by the restart.
    ///
    /// The record is read and written only by a reader that starts from the beginning
    /// ([`SourceReader::start`]); a restore from a checkpoint touches neither it nor the
    /// length it holds. A record that such a reader cannot decode fails the job with
    /// [`SourceError::Corrupt`], naming the file and offset, rather than cut the dead-letter
    /// file by a guess.
    pub fn dead_letter_start_record(mut self, record: impl Into<PathBuf>, resume: bool) -> Self {
        self.dead_start = Arc::new(DeadStart {
            len: std::sync::OnceLock::new(),
            record: Some((record.into(), resume)),
        });
        self
    }

    /// The number of lines skipped or dead-lettered so far, shared with the readers.
    pub fn skipped(&self) -> Arc<AtomicU64> {
        Arc::clone(&self.skipped)
    }
}

impl DeadStart {
    /// The length (see [`DeadStart`]), made by the first call; `None`: no dead-letter file,
    /// or one that cannot be examined, which is left as it is.
    fn get(&self, policy: &ErrorPolicy) -> Result<Option<u64>, SourceError> {
        if let Some(&len) = self.len.get() {
            return Ok(len);
        }
        // Only shard 0 makes readers, one attempt after another: no race to make it twice.
        let len = self.make(policy)?;
        Ok(*self.len.get_or_init(|| len))
    }

    /// The length now, or the start record's: read, or written anew.
    fn make(&self, policy: &ErrorPolicy) -> Result<Option<u64>, SourceError> {
        let ErrorPolicy::DeadLetter(path) = policy else {
            return Ok(None);
        };
        let now = match fs::metadata(path) {
            Ok(m) => Some(m.len()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Some(0),
            Err(_) => None,
        };
        let Some((record, resume)) = &self.record else {
            return Ok(now);
        };
        let absolute = std::path::absolute(path).map_err(io_error(path))?;
        if *resume {
            if let Some((was, len)) = read_start_record(record)? {
                if was == absolute {
                    return Ok(Some(len));
                }
            }
        }
        if let Some(len) = now {
            write_start_record(record, &absolute, len)?;
        }
        Ok(now)
    }
}

impl<T: Send + 'static> Source<T> for FileSource<T> {
    fn create_reader(
        &self,
        shard: usize,
        _shards: usize,
    ) -> Result<Box<dyn SourceReader<T>>, SourceError> {
        if shard != 0 {
            return Ok(Box::new(EmptyReader));
        }
        let files = list_files(&self.path)?;
        Ok(Box::new(FileReader {
            format: self.format,
            columns: self.columns.clone(),
            parse: Arc::clone(&self.parse),
            policy: self.policy.clone(),
            skipped: Arc::clone(&self.skipped),
            max_record_bytes: self.max_record_bytes,
            files,
            index: 0,
            open: None,
            finished: false,
            loc: Location {
                file: PathBuf::new(),
                line: 0,
            },
            rec: Vec::new(),
            csv: csv_parser(),
            csv_buf: Vec::new(),
            csv_ends: Vec::new(),
            json: JsonScratch::default(),
            strs: Vec::new(),
            dead: None,
            fresh: true,
            started: false,
            dead_start: None,
            dead_start_of: Arc::clone(&self.dead_start),
        }))
    }

    fn name(&self) -> &str {
        "file"
    }
}

fn io_error(path: &Path) -> impl FnOnce(io::Error) -> SourceError + '_ {
    move |source| SourceError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The dead-letter start record (`FileSource::dead_letter_start_record`): `magic 8 | version
/// u16 | checksum algorithm u8 (1: CRC-32/IEEE) | reserved u8 | path length u32 | dead-letter
/// length u64 | absolute path | CRC-32 u32 of everything before it`, little-endian.
const START_MAGIC: &[u8; 8] = b"WEIRDLS\0";
const START_VERSION: u16 = 1;
const START_FIXED_BYTES: usize = 24;
/// A record longer than this is not one (a path is at most a few KiB).
const START_MAX_BYTES: u64 = 1 << 20;

/// Writes a start record durably: a temporary file beside it, synced, renamed over it, the
/// directory synced.
fn write_start_record(record: &Path, dead_letters: &Path, len: u64) -> Result<(), SourceError> {
    let path = dead_letters.as_os_str().as_encoded_bytes();
    let mut bytes = Vec::with_capacity(START_FIXED_BYTES + path.len() + 4);
    bytes.extend_from_slice(START_MAGIC);
    bytes.extend_from_slice(&START_VERSION.to_le_bytes());
    bytes.extend_from_slice(&[1, 0]);
    bytes.extend_from_slice(&(path.len() as u32).to_le_bytes());
    bytes.extend_from_slice(&len.to_le_bytes());
    bytes.extend_from_slice(path);
    let crc = crc32fast::hash(&bytes);
    bytes.extend_from_slice(&crc.to_le_bytes());
    let dir = match record.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    fs::create_dir_all(dir).map_err(io_error(dir))?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(record.file_name().unwrap_or_default());
    tmp_name.push(".tmp");
    let tmp = dir.join(tmp_name);
    let mut f = File::create(&tmp).map_err(io_error(&tmp))?;
    f.write_all(&bytes).map_err(io_error(&tmp))?;
    f.sync_all().map_err(io_error(&tmp))?;
    fs::rename(&tmp, record).map_err(io_error(record))?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_error(dir))
}

/// Reads a start record: `None` if there is none, else the dead-letter file's absolute path
/// and the length it had at the start.
fn read_start_record(record: &Path) -> Result<Option<(PathBuf, u64)>, SourceError> {
    // What to do about it, too: the record only serves a restart from the beginning, and a
    // run without it may write again the dead letters of a run killed before its first
    // checkpoint, which the user can accept.
    let corrupt = |offset: u64, reason: String| SourceError::Corrupt {
        file: record.to_path_buf(),
        offset,
        reason: format!(
            "{reason} (a dead-letter start record; remove it to start without one, at the \
             risk of dead letters written twice)"
        ),
    };
    let len = match fs::metadata(record) {
        Ok(m) => m.len(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_error(record)(e)),
    };
    if len > START_MAX_BYTES {
        return Err(corrupt(
            START_MAX_BYTES,
            format!("{len} bytes, more than a dead-letter start record holds"),
        ));
    }
    let bytes = fs::read(record).map_err(io_error(record))?;
    let n = bytes.len();
    if n < START_FIXED_BYTES + 4 {
        return Err(corrupt(
            n as u64,
            format!(
                "{n} bytes, shorter than a dead-letter start record ({} at least)",
                START_FIXED_BYTES + 4
            ),
        ));
    }
    if &bytes[..8] != START_MAGIC {
        return Err(corrupt(
            0,
            "not a dead-letter start record (bad magic)".into(),
        ));
    }
    let version = u16::from_le_bytes([bytes[8], bytes[9]]);
    if version != START_VERSION {
        return Err(corrupt(
            8,
            format!("version {version}, this build reads {START_VERSION}"),
        ));
    }
    if bytes[10] != 1 {
        return Err(corrupt(
            10,
            format!("checksum algorithm {}, this build knows 1", bytes[10]),
        ));
    }
    let path_len = u32::from_le_bytes(bytes[12..16].try_into().expect("4 bytes")) as usize;
    if START_FIXED_BYTES + path_len + 4 != n {
        return Err(corrupt(
            12,
            format!("a path of {path_len} bytes does not fit a record of {n} bytes"),
        ));
    }
    let body = n - 4;
    let stored = u32::from_le_bytes(bytes[body..].try_into().expect("4 bytes"));
    let actual = crc32fast::hash(&bytes[..body]);
    if stored != actual {
        return Err(corrupt(
            body as u64,
            format!("CRC-32 {stored:08x} stored, {actual:08x} computed"),
        ));
    }
    if bytes[11] != 0 {
        return Err(corrupt(11, "reserved byte not zero".into()));
    }
    let dead_len = u64::from_le_bytes(bytes[16..24].try_into().expect("8 bytes"));
    let path = &bytes[START_FIXED_BYTES..body];
    let path = <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(path);
    Ok(Some((PathBuf::from(path), dead_len)))
}

/// The files to read, in name order.
fn list_files(path: &Path) -> Result<Vec<PathBuf>, SourceError> {
    let meta = fs::metadata(path).map_err(io_error(path))?;
    if !meta.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut files = Vec::new();
    for entry in fs::read_dir(path).map_err(io_error(path))? {
        let entry = entry.map_err(io_error(path))?;
        if entry.file_name().as_encoded_bytes().first() == Some(&b'.') {
            continue;
        }
        let file = entry.path();
        // metadata() follows symlinks, so a link to a regular file is read like one.
        if fs::metadata(&file).map_err(io_error(&file))?.is_file() {
            files.push(file);
        }
    }
    files.sort_by(|a, b| a.file_name().cmp(&b.file_name()));
    Ok(files)
}

/// One open file of a reader.
struct OpenFile {
    reader: BufReader<File>,
    /// Byte offset of the next unread line.
    offset: u64,
    /// Number of the next unread line.
    line: u64,
    /// CSV: for each wanted column, its field index in the header.
    map: Vec<usize>,
    /// CSV: the number of fields in the header, which every record must have.
    width: usize,
}

/// What reading one line (or one CSV record) found.
enum Step {
    /// The current file is exhausted.
    Eof,
    /// A line was consumed (a record, a blank line, or a malformed line that the policy let by).
    Line,
}

/// What reading one CSV record found.
enum CsvRead {
    Eof,
    Blank,
    Fields,
    Bad(String),
}

/// The dead-letter file, opened on first use. Each line goes to the file in one `write`
/// (append mode), unbuffered: a killed process leaves whole lines, and a position can say how
/// long the file is (see [`FileReader::dead_letter_len`]). Malformed lines are the exception,
/// so a system call each costs little.
struct DeadLetter {
    path: PathBuf,
    out: File,
    line: Vec<u8>,
}

impl DeadLetter {
    fn open(path: &Path) -> io::Result<Self> {
        if let Some(parent) = path.parent() {
            if !parent.as_os_str().is_empty() {
                fs::create_dir_all(parent)?;
            }
        }
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        Ok(Self {
            path: path.to_path_buf(),
            out: file,
            line: Vec::new(),
        })
    }

    fn write(&mut self, file: &Path, line: u64, reason: &str, raw: &[u8]) -> io::Result<()> {
        let out = &mut self.line;
        out.clear();
        out.extend_from_slice(b"{\"file\":");
        serde_json::to_writer(&mut *out, &file.to_string_lossy())?;
        write!(out, ",\"line\":{line},\"reason\":")?;
        serde_json::to_writer(&mut *out, reason)?;
        out.extend_from_slice(b",\"raw\":");
        // JSON strings are Unicode; an undecodable byte becomes U+FFFD.
        serde_json::to_writer(&mut *out, &String::from_utf8_lossy(raw))?;
        out.extend_from_slice(b"}\n");
        self.out.write_all(out)
    }
}

/// Shard 0's reader of a [`FileSource`].
struct FileReader<T> {
    format: FileFormat,
    columns: Vec<String>,
    parse: Arc<ParseFn<T>>,
    policy: ErrorPolicy,
    skipped: Arc<AtomicU64>,
    max_record_bytes: usize,
    files: Vec<PathBuf>,
    /// Index in `files` of the open file, or of the next one to open.
    index: usize,
    open: Option<OpenFile>,
    finished: bool,
    /// The location handed to `parse`; its path is replaced once per file, not per line.
    loc: Location,
    /// The raw bytes of the current line or CSV record, line terminators included.
    rec: Vec<u8>,
    /// CSV: the parser, which keeps its state from one line of a record to the next.
    csv: csv_core::Reader,
    /// CSV: the unquoted fields of the current record, back to back (its length is only room
    /// for them: where they end is in `csv_ends`).
    csv_buf: Vec<u8>,
    /// CSV: the end of each field in `csv_buf`.
    csv_ends: Vec<usize>,
    json: JsonScratch,
    /// An empty vector whose allocation is reused for the `&[&str]` handed to `parse`.
    strs: Vec<&'static str>,
    dead: Option<DeadLetter>,
    /// Neither restored (`seek`) nor polled yet. A reader that starts from the beginning
    /// first cuts the dead-letter file back to `dead_start`: an earlier attempt of the job in
    /// this process (restarted before any checkpoint completed) read the same lines and
    /// dead-lettered them already. Across processes the source knows that start only from a
    /// start record ([`FileSource::dead_letter_start_record`]); without one, lines that a
    /// killed process wrote before its first checkpoint stay, and a restart from the beginning
    /// appends them again.
    fresh: bool,
    /// [`SourceReader::start`] ran.
    started: bool,
    /// Set by `start` on a fresh reader: see [`DeadStart`].
    dead_start: Option<u64>,
    dead_start_of: Arc<DeadStart>,
}

/// Empties a vector of string slices and gives its allocation a new lifetime. The in-place
/// `collect` keeps the allocation (same element layout) and maps no element, as there is none.
fn recycle<'b>(mut v: Vec<&str>) -> Vec<&'b str> {
    v.clear();
    v.into_iter().map(|_| "").collect()
}

/// Drops a trailing "\n" or "\r\n".
fn strip_eol(line: &[u8]) -> &[u8] {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    line.strip_suffix(b"\r").unwrap_or(line)
}

/// Appends one physical line (with its terminator) to `buf`, keeping `buf` within `max` bytes.
/// Returns the bytes consumed from the file (0 at the end) and whether the line did not fit, in
/// which case the rest of it was consumed without being kept.
fn read_line(
    reader: &mut BufReader<File>,
    buf: &mut Vec<u8>,
    max: usize,
) -> io::Result<(u64, bool)> {
    let room = max.saturating_sub(buf.len());
    if room == 0 {
        let rest = reader.skip_until(b'\n')?;
        return Ok((rest as u64, rest > 0));
    }
    let n = reader.by_ref().take(room as u64).read_until(b'\n', buf)?;
    if n < room || buf.last() == Some(&b'\n') {
        return Ok((n as u64, false));
    }
    let rest = reader.skip_until(b'\n')?;
    Ok(((n as u64).saturating_add(rest as u64), rest > 0))
}

/// Collects a record's wanted fields (the first error ends it) into the reused `strs` and
/// hands them to `parse` with the record's location: the step shared by CSV and JSON lines.
fn parse_fields<'a, T>(
    strs: &mut Vec<&'static str>,
    parse: &ParseFn<T>,
    loc: &mut Location,
    line: u64,
    mut fields: impl Iterator<Item = Result<&'a str, String>>,
) -> Result<T, String> {
    let mut v = recycle(std::mem::take(strs));
    let result = fields
        .try_for_each(|f| f.map(|text| v.push(text)))
        .and_then(|()| {
            loc.line = line;
            parse(&v, loc)
        });
    *strs = recycle(v);
    result
}

/// The bytes of CSV field `i` in `buf`, whose fields lie back to back and end at `ends`.
fn csv_field<'a>(buf: &'a [u8], ends: &[usize], i: usize) -> Option<&'a [u8]> {
    let start = if i == 0 { 0 } else { *ends.get(i - 1)? };
    buf.get(start..*ends.get(i)?)
}

/// A CSV parser: RFC 4180 quoting (`,` between fields, a quoted field may hold commas, `""` and
/// line breaks), records ended by "\n" alone. The reader gives it one physical line at a time
/// and deals with a "\r" before the "\n" itself (see [`FileReader::read_csv_record`]), so that
/// a "\r" anywhere else is data, as it always was here.
fn csv_parser() -> csv_core::Reader {
    let mut parser = csv_core::ReaderBuilder::new()
        .terminator(csv_core::Terminator::Any(b'\n'))
        .build();
    restart(&mut parser);
    parser
}

/// Puts the parser at the start of a record, after a record was abandoned half-read or when a
/// file is opened. csv_core drops a byte order mark from the first bytes it reads after a reset;
/// the reader drops one itself, at the start of a file only, so the parser first reads an empty
/// line, which it skips.
fn restart(parser: &mut csv_core::Reader) {
    parser.reset();
    let _ = parser.read_field(b"\n", &mut [0]);
}

/// Checks the quoting of one CSV field as written (without the `,` or line end after it), and
/// returns what is wrong and at which of its bytes. csv_core parses RFC 4180 quoting but does
/// not reject what breaks it (text after a closing quote joins the field; a quote inside an
/// unquoted field is data), preferring some parse to none; this source is strict, as a stray
/// quote usually means a broken writer whose output should not be read as data.
fn check_quoting(raw: &[u8]) -> Result<(), (&'static str, usize)> {
    if raw.first() != Some(&b'"') {
        return match raw.iter().position(|&b| b == b'"') {
            Some(at) => Err(("quote inside an unquoted field", at)),
            None => Ok(()),
        };
    }
    let mut at = 1;
    loop {
        // The quoted part ends at the first quote that is not doubled.
        let Some(q) = raw
            .get(at..)
            .and_then(|rest| rest.iter().position(|&b| b == b'"'))
        else {
            // The parser ends no field inside quotes: only the end of the file leaves a quoted
            // field open, and that is reported before any field is checked.
            return Err(("unterminated quoted field", raw.len()));
        };
        at += q + 1;
        match raw.get(at) {
            Some(b'"') => at += 1,
            Some(_) => return Err(("unexpected character after a closing quote", at)),
            None => return Ok(()),
        }
    }
}

impl<T: 'static> FileReader<T> {
    /// Reads one CSV record into `csv_buf` and `csv_ends`. A record may span several physical
    /// lines inside quotes: its lines are read one at a time (so that its size stays bounded and
    /// the line numbers stay exact) and given to the parser until it ends the record.
    fn read_csv_record(&mut self, at_file_start: bool) -> Result<CsvRead, SourceError> {
        let Some(open) = self.open.as_mut() else {
            return Ok(CsvRead::Eof);
        };
        self.rec.clear();
        self.csv_ends.clear();
        // Where the record starts in `rec` (after a byte order mark at the start of the file),
        // how much of `rec` the parser has read, where the field being read starts in `rec`, and
        // how much field text the parser has written to `csv_buf`.
        let (mut start, mut fed, mut field_start, mut written) = (0, 0, 0, 0);
        let mut bad = None;
        let mut lines = 0u32;
        loop {
            let (n, too_long) = read_line(&mut open.reader, &mut self.rec, self.max_record_bytes)
                .map_err(io_error(&self.loc.file))?;
            if n == 0 {
                if lines == 0 {
                    return Ok(CsvRead::Eof);
                }
                restart(&mut self.csv);
                return Ok(CsvRead::Bad(
                    "unterminated quoted field at the end of the file".to_owned(),
                ));
            }
            lines += 1;
            open.offset += n;
            open.line += 1;
            if too_long {
                restart(&mut self.csv);
                return Ok(CsvRead::Bad(format!(
                    "record longer than {} bytes",
                    self.max_record_bytes
                )));
            }
            if self.rec.last() != Some(&b'\n') {
                // The last line of the file: end it for the parser.
                self.rec.push(b'\n');
            }
            if lines == 1 {
                if at_file_start && self.rec.starts_with(BOM) {
                    (start, fed, field_start) = (BOM.len(), BOM.len(), BOM.len());
                }
                if strip_eol(self.rec.get(start..).unwrap_or_default()).is_empty() {
                    return Ok(CsvRead::Blank);
                }
            }
            // Field text is never longer than the record, so the parser never runs out of room.
            if self.csv_buf.len() <= self.rec.len() {
                self.csv_buf.resize(self.rec.len() + 1, 0);
            }
            loop {
                let (result, read, wrote) = self.csv.read_field(
                    self.rec.get(fed..).unwrap_or_default(),
                    self.csv_buf.get_mut(written..).unwrap_or_default(),
                );
                fed += read;
                written += wrote;
                match result {
                    // The line ended inside a quoted field: the record goes on on the next line.
                    // (End comes only after empty input, which the parser is never given.)
                    csv_core::ReadFieldResult::InputEmpty | csv_core::ReadFieldResult::End => break,
                    csv_core::ReadFieldResult::OutputFull => {
                        let len = self.csv_buf.len();
                        self.csv_buf.resize(2 * len + 1, 0);
                    }
                    csv_core::ReadFieldResult::Field { record_end } => {
                        // The field as written ends before the "," or "\n" the parser just read.
                        let mut end = fed.saturating_sub(1);
                        let field = self.rec.get(field_start..end).unwrap_or_default();
                        if record_end && field.ends_with(b"\r") {
                            // A "\r\n" line end, whose "\r" the parser copied into the field.
                            end -= 1;
                            written = written.saturating_sub(1);
                        }
                        if bad.is_none() {
                            let field = self.rec.get(field_start..end).unwrap_or_default();
                            if let Err((what, at)) = check_quoting(field) {
                                let at = field_start - start + at;
                                bad = Some(format!("{what} (byte {at} of the record)"));
                            }
                        }
                        self.csv_ends.push(written);
                        field_start = fed;
                        if record_end {
                            return Ok(bad.map_or(CsvRead::Fields, CsvRead::Bad));
                        }
                    }
                }
            }
            if let Some(reason) = bad {
                // Give up on the record at the end of this line, as the next line cannot tell
                // what of it was meant to be inside quotes.
                restart(&mut self.csv);
                return Ok(CsvRead::Bad(reason));
            }
        }
    }

    /// Opens `files[index]`, reads a CSV header, and moves to `at` (offset, line) if given.
    fn open_current(&mut self, at: Option<(u64, u64, Option<Windows>)>) -> Result<(), SourceError> {
        let Some(path) = self.files.get(self.index) else {
            return Err(SourceError::Other(format!(
                "file source: no file at index {}",
                self.index
            )));
        };
        self.loc.file.clone_from(path);
        let path = &self.loc.file;
        let file = File::open(path).map_err(io_error(path))?;
        let len = file.metadata().map_err(io_error(path))?.len();
        self.open = Some(OpenFile {
            reader: BufReader::with_capacity(READ_BUFFER_BYTES, file),
            offset: 0,
            line: 1,
            map: Vec::with_capacity(self.columns.len()),
            width: 0,
        });
        if self.format == FileFormat::Csv {
            restart(&mut self.csv);
            self.read_header()?;
        }
        let Some((offset, line, window)) = at else {
            return Ok(());
        };
        let Some(open) = self.open.as_mut() else {
            return Ok(());
        };
        let path = &self.loc.file;
        let bad = |why: &str| SourceError::BadPosition(format!("{}: {why}", path.display()));
        if (offset, line) == (0, 1) {
            return Ok(());
        }
        let at_header_end = (offset, line) == (open.offset, open.line);
        if !at_header_end {
            if offset <= open.offset || line <= open.line {
                return Err(bad("offset lies before the first record"));
            }
            if offset > len {
                return Err(bad("offset lies beyond the end of the file"));
            }
        }
        let changed = |what: &str, w: Window, found: u32| {
            bad(&format!(
                "the {} bytes {what} are not those this position was taken after (CRC-32 \
                 {:08x}, now {found:08x}): the file changed since",
                w.len, w.crc32
            ))
        };
        if let Some(head) = window.map(|w| w.head).filter(|w| w.len > 0) {
            if u64::from(head.len) > offset {
                return Err(bad(&format!(
                    "a head of {} bytes before offset {offset}",
                    head.len
                )));
            }
            let mut bytes = vec![0u8; head.len as usize];
            use std::os::unix::fs::FileExt;
            open.reader
                .get_ref()
                .read_exact_at(&mut bytes, 0)
                .map_err(io_error(path))?;
            let found = crc32fast::hash(&bytes);
            if found != head.crc32 {
                return Err(changed(
                    &format!("at the start of the file, before offset {offset}"),
                    head,
                    found,
                ));
            }
        }
        // The tail before the offset (at least its last byte) is read where the reader then
        // goes on, so that reading resumes at the offset.
        let tail = window.map(|w| w.tail);
        let window_len = tail.map_or(1, |w| w.len).max(1);
        if u64::from(window_len) > offset {
            return Err(bad(&format!(
                "a window of {window_len} bytes before offset {offset}"
            )));
        }
        let mut before = vec![0u8; window_len as usize];
        open.reader
            .seek(SeekFrom::Start(offset - u64::from(window_len)))
            .map_err(io_error(path))?;
        open.reader
            .read_exact(&mut before)
            .map_err(io_error(path))?;
        // A record starts just after a line terminator, and the end of a file whose last line
        // has none is where its reader stops; anything else is not a position of ours.
        if !at_header_end && before.last() != Some(&b'\n') && offset != len {
            return Err(bad("offset is not at the start of a line"));
        }
        if let Some(w) = tail.filter(|w| w.len > 0) {
            let found = crc32fast::hash(&before);
            if found != w.crc32 {
                return Err(changed(&format!("before offset {offset}"), w, found));
            }
        }
        open.offset = offset;
        open.line = line;
        Ok(())
    }

    /// The windows of a position at the open file's offset (see [`POSITION_VERSION`]): none
    /// at offset 0, or where the bytes cannot be read back (then the position has none, as
    /// those of version 1 had).
    fn windows(&self) -> Windows {
        let Some(open) = self.open.as_ref().filter(|o| o.offset > 0) else {
            return Windows::default();
        };
        let len = open.offset.min(POSITION_WINDOW_BYTES);
        let read = |at: u64| {
            let mut buf = vec![0u8; len as usize];
            use std::os::unix::fs::FileExt;
            open.reader.get_ref().read_exact_at(&mut buf, at).ok()?;
            Some(Window {
                len: len as u32,
                crc32: crc32fast::hash(&buf),
            })
        };
        match (read(0), read(open.offset - len)) {
            (Some(head), Some(tail)) => Windows { head, tail },
            _ => Windows::default(),
        }
    }

    /// Reads the header of the open CSV file and maps the wanted columns to field indexes.
    fn read_header(&mut self) -> Result<(), SourceError> {
        let header_line = loop {
            let line = self.open.as_ref().map_or(1, |o| o.line);
            let at_start = self.open.as_ref().is_some_and(|o| o.offset == 0);
            match self.read_csv_record(at_start)? {
                // A file without a header has no records: nothing to map.
                CsvRead::Eof => return Ok(()),
                CsvRead::Blank => {}
                CsvRead::Bad(reason) => {
                    return Err(SourceError::Malformed {
                        file: self.loc.file.clone(),
                        line,
                        reason: format!("CSV header: {reason}"),
                    })
                }
                CsvRead::Fields => break line,
            }
        };
        let Some(open) = self.open.as_mut() else {
            return Ok(());
        };
        open.width = self.csv_ends.len();
        open.map.clear();
        for column in &self.columns {
            let found = (0..open.width)
                .find(|&i| csv_field(&self.csv_buf, &self.csv_ends, i) == Some(column.as_bytes()));
            match found {
                Some(i) => {
                    // Two fields of one name: which one the job reads would be a guess.
                    let again = (i + 1..open.width).find(|&j| {
                        csv_field(&self.csv_buf, &self.csv_ends, j) == Some(column.as_bytes())
                    });
                    if let Some(j) = again {
                        return Err(SourceError::Malformed {
                            file: self.loc.file.clone(),
                            line: header_line,
                            reason: format!(
                                "CSV header: column `{column}` is both field {} and field {}",
                                i + 1,
                                j + 1
                            ),
                        });
                    }
                    open.map.push(i)
                }
                None => {
                    let names = (0..open.width)
                        .map(|i| csv_field(&self.csv_buf, &self.csv_ends, i).unwrap_or_default());
                    let available = column_list(names, open.width);
                    return Err(SourceError::UnknownColumn {
                        file: self.loc.file.clone(),
                        column: column.clone(),
                        available,
                    });
                }
            }
        }
        Ok(())
    }

    /// Applies the error policy to the malformed line `line` (raw bytes in `self.rec`).
    fn malformed(&mut self, line: u64, reason: String) -> Result<(), SourceError> {
        let path = match &self.policy {
            ErrorPolicy::Fail => {
                return Err(SourceError::Malformed {
                    file: self.loc.file.clone(),
                    line,
                    reason,
                });
            }
            ErrorPolicy::Skip => None,
            ErrorPolicy::DeadLetter(path) => Some(path),
        };
        if let Some(path) = path {
            if self.dead.is_none() {
                self.dead = Some(DeadLetter::open(path).map_err(io_error(path))?);
            }
            if let Some(dead) = self.dead.as_mut() {
                dead.write(&self.loc.file, line, &reason, strip_eol(&self.rec))
                    .map_err(io_error(&dead.path))?;
            }
        }
        self.skipped.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Reads one CSV record and appends its parsed record to `out`.
    fn step_csv(&mut self, out: &mut Vec<T>) -> Result<Step, SourceError> {
        let line = self.open.as_ref().map_or(1, |o| o.line);
        match self.read_csv_record(false)? {
            CsvRead::Eof => return Ok(Step::Eof),
            CsvRead::Blank => return Ok(Step::Line),
            CsvRead::Bad(reason) => {
                self.malformed(line, reason)?;
                return Ok(Step::Line);
            }
            CsvRead::Fields => {}
        }
        let Some(open) = self.open.as_ref() else {
            return Ok(Step::Eof);
        };
        let result = if self.csv_ends.len() != open.width {
            Err(format!(
                "expected {} fields, found {}",
                open.width,
                self.csv_ends.len()
            ))
        } else {
            let (buf, ends) = (&self.csv_buf, &self.csv_ends);
            let fields = self.columns.iter().zip(&open.map).map(|(column, &i)| {
                match csv_field(buf, ends, i).map(std::str::from_utf8) {
                    Some(Ok(text)) => Ok(text),
                    _ => Err(format!("field `{column}` is not valid UTF-8")),
                }
            });
            parse_fields(&mut self.strs, &*self.parse, &mut self.loc, line, fields)
        };
        match result {
            Ok(record) => out.push(record),
            Err(reason) => self.malformed(line, reason)?,
        }
        Ok(Step::Line)
    }

    /// Reads one JSON line and appends its parsed record to `out`.
    fn step_json(&mut self, out: &mut Vec<T>) -> Result<Step, SourceError> {
        let Some(open) = self.open.as_mut() else {
            return Ok(Step::Eof);
        };
        let line = open.line;
        self.rec.clear();
        let (n, too_long) = read_line(&mut open.reader, &mut self.rec, self.max_record_bytes)
            .map_err(io_error(&self.loc.file))?;
        if n == 0 {
            return Ok(Step::Eof);
        }
        open.offset += n;
        open.line += 1;
        if too_long {
            let reason = format!("line longer than {} bytes", self.max_record_bytes);
            self.malformed(line, reason)?;
            return Ok(Step::Line);
        }
        let mut content = strip_eol(&self.rec);
        if line == 1 {
            content = content.strip_prefix(BOM).unwrap_or(content);
        }
        if content.iter().all(|b| is_json_space(*b)) {
            return Ok(Step::Line);
        }
        let result = match scan_object(content, &self.columns, &mut self.json) {
            Err(reason) => Err(reason),
            Ok(text) => {
                let json = &self.json;
                let fields = self.columns.iter().zip(&json.vals).zip(&json.esc).map(
                    |((column, val), esc)| match *val {
                        Val::Missing => Err(format!("missing field `{column}`")),
                        Val::Null => Err(format!("field `{column}` is null")),
                        Val::Escaped => Ok(esc.as_str()),
                        Val::Span(start, end) => text
                            .get(start..end)
                            .ok_or_else(|| format!("field `{column}`: bad span")),
                    },
                );
                parse_fields(&mut self.strs, &*self.parse, &mut self.loc, line, fields)
            }
        };
        match result {
            Ok(record) => out.push(record),
            Err(reason) => self.malformed(line, reason)?,
        }
        Ok(Step::Line)
    }

    /// Flushes the dead-letter file at the end of the input.
    fn finish(&mut self) -> Result<(), SourceError> {
        self.finished = true;
        if let Some(dead) = self.dead.as_mut() {
            dead.out.sync_data().map_err(io_error(&dead.path))?;
        }
        Ok(())
    }

    /// The dead-letter file's path and length now, for a position: what a restore truncates
    /// it to, so that the lines of records read after this position, which the restored job
    /// reads again, are not there twice. Its length is 0 when it does not exist yet (the
    /// restore then removes what a later run wrote), and `None` without one (another policy,
    /// or a file that cannot be examined: the restore then leaves the file as it is). The
    /// path is made absolute (from the working directory, without resolving links), so
    /// that a job restarted elsewhere with the same relative path does not cut another file.
    fn dead_letter_len(&self) -> Option<(PathBuf, u64)> {
        let ErrorPolicy::DeadLetter(path) = &self.policy else {
            return None;
        };
        let absolute = std::path::absolute(path).ok()?;
        if self.fresh {
            // What the first poll cuts the file back to.
            return Some((absolute, self.dead_start?));
        }
        let len = match &self.dead {
            Some(dead) => dead.out.metadata().ok()?.len(),
            None => match fs::metadata(path) {
                Ok(m) => m.len(),
                Err(e) if e.kind() == io::ErrorKind::NotFound => 0,
                Err(_) => return None,
            },
        };
        Some((absolute, len))
    }

    /// On a restore: cuts the dead-letter file back to the length a position recorded, if it
    /// is the same file (by its absolute path, see [`Self::dead_letter_len`]) and longer now.
    /// Shorter (its tail was written but not synced when the machine went down), it is left
    /// as it is.
    fn restore_dead_letters(&mut self, recorded: Option<(&[u8], u64)>) -> Result<(), SourceError> {
        let (Some((was, len)), ErrorPolicy::DeadLetter(path)) = (recorded, &self.policy) else {
            return Ok(());
        };
        let same = std::path::absolute(path).is_ok_and(|p| p.as_os_str().as_encoded_bytes() == was);
        if !same {
            return Ok(());
        }
        self.cut_dead_letters(Some(len))
    }

    /// Cuts the dead-letter file back to `len` bytes if it is longer (and syncs it).
    fn cut_dead_letters(&mut self, len: Option<u64>) -> Result<(), SourceError> {
        let (Some(len), ErrorPolicy::DeadLetter(path)) = (len, &self.policy) else {
            return Ok(());
        };
        self.dead = None;
        let file = match OpenOptions::new().write(true).open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(io_error(path)(e)),
        };
        if file.metadata().map_err(io_error(path))?.len() > len {
            file.set_len(len).map_err(io_error(path))?;
            file.sync_data().map_err(io_error(path))?;
        }
        Ok(())
    }
}

impl<T: 'static> SourceReader<T> for FileReader<T> {
    fn poll(&mut self, out: &mut Vec<T>, max: usize) -> Result<SourcePoll, SourceError> {
        if self.fresh {
            if !self.started {
                self.start()?;
            }
            self.fresh = false;
            let start = self.dead_start;
            self.cut_dead_letters(start)?;
        }
        if self.finished {
            return Ok(SourcePoll::Finished);
        }
        let before = out.len();
        // Lines examined, not records appended, bound the work of one poll, so that a long run
        // of skipped lines still returns control to the shard regularly.
        let mut examined = 0;
        while examined < max {
            if self.open.is_none() {
                if self.index >= self.files.len() {
                    self.finish()?;
                    return Ok(if out.len() > before {
                        SourcePoll::Ready
                    } else {
                        SourcePoll::Finished
                    });
                }
                self.open_current(None)?;
            }
            let step = match self.format {
                FileFormat::Csv => self.step_csv(out)?,
                FileFormat::JsonLines => self.step_json(out)?,
            };
            match step {
                Step::Eof => {
                    self.open = None;
                    self.index += 1;
                }
                Step::Line => examined += 1,
            }
        }
        Ok(SourcePoll::Ready)
    }

    fn position(&self) -> Vec<u8> {
        let (offset, line) = self.open.as_ref().map_or((0, 1), |o| (o.offset, o.line));
        let name = self.position_name(self.index);
        let windows = self.windows();
        let dead = self.dead_letter_len();
        let dead_path = dead
            .as_ref()
            .map_or(&[][..], |(p, _)| p.as_os_str().as_encoded_bytes());
        let mut pos = Vec::with_capacity(
            POSITION_FIXED_BYTES
                + name.len()
                + POSITION_WINDOW_FIELDS
                + POSITION_DEAD_LETTER_FIELDS
                + dead_path.len(),
        );
        pos.push(POSITION_VERSION);
        pos.extend_from_slice(&(self.index as u64).to_le_bytes());
        pos.extend_from_slice(&offset.to_le_bytes());
        pos.extend_from_slice(&line.to_le_bytes());
        pos.extend_from_slice(&(name.len() as u32).to_le_bytes());
        pos.extend_from_slice(name.as_bytes());
        for w in [windows.head, windows.tail] {
            pos.extend_from_slice(&w.len.to_le_bytes());
            pos.extend_from_slice(&w.crc32.to_le_bytes());
        }
        pos.extend_from_slice(&dead.as_ref().map_or(0, |(_, len)| *len).to_le_bytes());
        pos.extend_from_slice(&(dead_path.len() as u32).to_le_bytes());
        pos.extend_from_slice(dead_path);
        pos
    }

    /// A reader that starts from the beginning (not restored: still fresh) learns where to
    /// cut the dead-letter file back to, from the start record if the source keeps one.
    fn start(&mut self) -> Result<(), SourceError> {
        self.started = true;
        if self.fresh {
            self.dead_start = self.dead_start_of.get(&self.policy)?;
        }
        Ok(())
    }

    fn seek(&mut self, position: &[u8]) -> Result<(), SourceError> {
        let bad = |why: String| SourceError::BadPosition(why);
        let Decoded {
            index,
            offset,
            line,
            name,
            windows: window,
            dead_letter,
        } = decode_position(position).ok_or_else(|| {
            bad(format!(
                "not a file source position ({} bytes)",
                position.len()
            ))
        })?;
        let index =
            usize::try_from(index).map_err(|_| bad(format!("file index {index} out of range")))?;
        if index > self.files.len() {
            return Err(bad(format!(
                "file index {index}, but the source has {} files",
                self.files.len()
            )));
        }
        let expected = self.position_name(index);
        // Past the last file, positions written before the name of the last file was recorded
        // there carry none.
        let unnamed_end = index == self.files.len() && name.is_empty();
        if name != expected.as_bytes() && !unnamed_end {
            let was = String::from_utf8_lossy(name);
            return Err(bad(if index == self.files.len() {
                format!("the position is past the last file, `{was}`, but the last file is `{expected}` now")
            } else {
                format!("file {index} is `{was}` in the position but `{expected}` now")
            }));
        }
        if line == 0 || (index == self.files.len() && (offset, line) != (0, 1)) {
            return Err(bad(format!(
                "offset {offset}, line {line} is not a position of file {index}"
            )));
        }
        self.open = None;
        self.index = index;
        self.finished = false;
        if index < self.files.len() {
            self.open_current(Some((offset, line, window)))?;
        }
        // Only once the position is known good: a refused one changes nothing.
        self.fresh = false;
        self.restore_dead_letters(dead_letter)
    }
}

impl<T> FileReader<T> {
    /// The file name a position at file `index` records: that file's, or past the end the
    /// last file's, so that a finished source's position still says what it read (a restore
    /// onto other input then fails instead of reading nothing). Empty for no files.
    fn position_name(&self, index: usize) -> String {
        let at = if index == self.files.len() {
            index.checked_sub(1)
        } else {
            Some(index)
        };
        at.and_then(|i| self.files.get(i))
            .and_then(|p| p.file_name())
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    }
}

/// Most header columns an unknown-column error lists, and most characters of each: a binary
/// file read as CSV has a header of any length (up to [`MAX_RECORD_BYTES`]), which the one
/// error line should not print whole.
const LISTED_COLUMNS: usize = 16;
const LISTED_COLUMN_CHARS: usize = 40;

/// `names` (there are `count`) as a bounded, printable list for an error message.
fn column_list<'a>(names: impl Iterator<Item = &'a [u8]>, count: usize) -> String {
    let mut list: Vec<String> = names
        .take(LISTED_COLUMNS)
        .map(|n| {
            let text = String::from_utf8_lossy(n);
            let mut shown: String = text
                .chars()
                .take(LISTED_COLUMN_CHARS)
                .flat_map(char::escape_debug)
                .collect();
            if text.chars().nth(LISTED_COLUMN_CHARS).is_some() {
                shown.push('…');
            }
            shown
        })
        .collect();
    if count > LISTED_COLUMNS {
        list.push(format!("and {} more", count - LISTED_COLUMNS));
    }
    list.join(", ")
}

/// The fingerprint of some bytes of the file a position is in (see [`POSITION_VERSION`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Window {
    /// 0: none (offset 0, or unreadable when the position was taken).
    len: u32,
    crc32: u32,
}

/// A position's windows: the file's first bytes and the last ones before the offset.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Windows {
    head: Window,
    tail: Window,
}

/// A decoded position; one of version 1 has no windows and no dead-letter length.
struct Decoded<'a> {
    index: u64,
    offset: u64,
    line: u64,
    name: &'a [u8],
    windows: Option<Windows>,
    /// The dead-letter file's absolute path and its length.
    dead_letter: Option<(&'a [u8], u64)>,
}

fn decode_position(pos: &[u8]) -> Option<Decoded<'_>> {
    let u64_at = |at: usize| -> Option<u64> {
        Some(u64::from_le_bytes(pos.get(at..at + 8)?.try_into().ok()?))
    };
    let u32_at = |at: usize| -> Option<u32> {
        Some(u32::from_le_bytes(pos.get(at..at + 4)?.try_into().ok()?))
    };
    let version = *pos.first()?;
    if version != POSITION_VERSION && version != POSITION_VERSION_1 {
        return None;
    }
    let name_len = u32_at(25)? as usize;
    let name_end = POSITION_FIXED_BYTES.checked_add(name_len)?;
    let name = pos.get(POSITION_FIXED_BYTES..name_end)?;
    let window = if version == POSITION_VERSION_1 {
        None
    } else {
        let at = |i: usize| -> Option<Window> {
            let w = Window {
                len: u32_at(name_end + 8 * i)?,
                crc32: u32_at(name_end + 8 * i + 4)?,
            };
            (u64::from(w.len) <= POSITION_WINDOW_BYTES).then_some(w)
        };
        let (head, tail) = (at(0)?, at(1)?);
        // Of one length, as `windows` writes them (both none, or both as long).
        if head.len != tail.len {
            return None;
        }
        Some(Windows { head, tail })
    };
    let (dead_letter, end) = if version == POSITION_VERSION_1 {
        (None, name_end)
    } else {
        let at = name_end + POSITION_WINDOW_FIELDS;
        let (len, path_len) = (u64_at(at)?, u32_at(at + 8)? as usize);
        let path_at = at + POSITION_DEAD_LETTER_FIELDS;
        let path_end = path_at.checked_add(path_len)?;
        let path = pos.get(path_at..path_end)?;
        ((path_len > 0).then_some((path, len)), path_end)
    };
    if pos.len() != end {
        return None;
    }
    Some(Decoded {
        index: u64_at(1)?,
        offset: u64_at(9)?,
        line: u64_at(17)?,
        name,
        windows: window,
        dead_letter,
    })
}

fn is_json_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

/// Where the value of one wanted column is, once a line has been read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Val {
    Missing,
    Null,
    /// The text is this byte range of the line (a string's content, or a value as written).
    Span(usize, usize),
    /// The text is the column's unescape buffer.
    Escaped,
}

/// Per-line JSON scratch space, reused across lines.
#[derive(Default)]
struct JsonScratch {
    vals: Vec<Val>,
    /// Per column: the unescaped text of an escaped string value.
    esc: Vec<String>,
}

/// Reads `b` as exactly one JSON object (with whitespace around it) with serde_json and records
/// in `scratch.vals` where each of `columns` is. Returns the line as text, or the reason it is
/// malformed.
///
/// A line is accepted when serde_json would read it as a `serde_json::Value::Object`, and no
/// wanted field appears twice; nothing is built but the wanted values' text. A wanted value is
/// read as a [`RawValue`] (its text as written, borrowed from the line): numbers, booleans and
/// nested values keep that text, a string its content, unescaped (into a reused buffer) only
/// when it holds escapes. Other values are checked and dropped by [`Skip`].
fn scan_object<'a>(
    b: &'a [u8],
    columns: &[String],
    scratch: &mut JsonScratch,
) -> Result<&'a str, String> {
    let text =
        std::str::from_utf8(b).map_err(|e| format!("invalid UTF-8 at byte {}", e.valid_up_to()))?;
    scratch.vals.clear();
    scratch.vals.resize(columns.len(), Val::Missing);
    if scratch.esc.len() < columns.len() {
        scratch.esc.resize_with(columns.len(), String::new);
    }
    // serde_json would call another value an invalid type, or a syntax error if it is one.
    if b.iter().find(|b| !is_json_space(**b)) != Some(&b'{') {
        return Err("not a JSON object".to_owned());
    }
    let mut failure = None;
    let mut at_key = false;
    let mut de = serde_json::Deserializer::from_str(text);
    let object = Object {
        text,
        columns,
        scratch,
        failure: &mut failure,
        at_key: &mut at_key,
    };
    match de.deserialize_map(object).and_then(|()| de.end()) {
        Ok(()) => Ok(text),
        Err(e) => Err(failure.unwrap_or_else(|| invalid_json(&e, 0, at_key))),
    }
}

/// The reason for a serde_json syntax error in a line, `offset` being where the text that
/// serde_json read starts in the line. `at_key` says that a key of the line's object was due.
fn invalid_json(e: &serde_json::Error, offset: usize, at_key: bool) -> String {
    let message = e.to_string();
    let position = format!(" at line {} column {}", e.line(), e.column());
    let what = match message.strip_suffix(&position).unwrap_or(&message) {
        // serde_json's words for `{"a": 1,}` and `{a: 1}`, where a key was expected.
        "trailing comma" | "key must be a string" if at_key => "expected a string key",
        // And for a `\ud800` (a leading surrogate) that no `\udc00`-`\udfff` escape follows.
        "unexpected end of hex escape" => "lone leading surrogate in hex escape",
        what => what,
    };
    format!("invalid JSON at column {}: {what}", offset + e.column())
}

/// Where `part`, a slice of `whole`, lies in it.
fn span_in(whole: &str, part: &str) -> Option<(usize, usize)> {
    let start = part.as_ptr().addr().checked_sub(whole.as_ptr().addr())?;
    let end = start.checked_add(part.len())?;
    (end <= whole.len()).then_some((start, end))
}

/// The visitor of a line's object: notes where the wanted fields are, skips the others.
struct Object<'s, 'de> {
    /// The line, which every `&'de str` that serde_json hands out borrows from.
    text: &'de str,
    columns: &'s [String],
    scratch: &'s mut JsonScratch,
    /// Why the line is malformed when it is not a syntax error.
    failure: &'s mut Option<String>,
    /// Set while a key of the object is read.
    at_key: &'s mut bool,
}

impl<'de> Object<'_, 'de> {
    /// Where the text of `raw`, the value of wanted column `i`, is; or why it is malformed.
    fn value(&mut self, i: usize, raw: &'de RawValue) -> Result<Val, String> {
        let raw = raw.get();
        // A `&'de RawValue` is borrowed from the text read, so it lies in the line.
        let (start, end) = span_in(self.text, raw).ok_or("value outside the line")?;
        match raw.as_bytes().first() {
            Some(b'n') => Ok(Val::Null),
            Some(b'"') => {
                let content = raw.get(1..raw.len().saturating_sub(1)).unwrap_or_default();
                if !content.contains('\\') {
                    return Ok(Val::Span(start + 1, end - 1));
                }
                let buf = self.scratch.esc.get_mut(i).ok_or("scratch space missing")?;
                let mut de = serde_json::Deserializer::from_str(raw);
                de.deserialize_str(Unescape(buf))
                    .map_err(|e| invalid_json(&e, start, false))?;
                Ok(Val::Escaped)
            }
            Some(b'[' | b'{' | b'-' | b'0'..=b'9') => {
                // serde_json reads a raw value without recursing, so without a depth limit,
                // and without a number's value, so without its range (`1e400` overflows an
                // f64, and is refused in every other field): check it as the rest of the line
                // is checked.
                let mut de = serde_json::Deserializer::from_str(raw);
                de.deserialize_any(Skip)
                    .map_err(|e| invalid_json(&e, start, false))?;
                Ok(Val::Span(start, end))
            }
            _ => Ok(Val::Span(start, end)),
        }
    }
}

impl<'de> Visitor<'de> for Object<'_, 'de> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(mut self, mut map: A) -> Result<(), A::Error> {
        loop {
            *self.at_key = true;
            let key = map.next_key_seed(Column(self.columns))?;
            *self.at_key = false;
            let Some(key) = key else {
                return Ok(());
            };
            let Some(i) = key else {
                map.next_value_seed(Skip)?;
                continue;
            };
            let raw: &'de RawValue = map.next_value()?;
            let column = self.columns.get(i).map_or("", String::as_str);
            if self.scratch.vals.get(i) != Some(&Val::Missing) {
                *self.failure = Some(format!("duplicate field `{column}`"));
                return Err(A::Error::custom("duplicate field"));
            }
            let val = match self.value(i, raw) {
                Ok(val) => val,
                Err(reason) => {
                    *self.failure = Some(reason);
                    return Err(A::Error::custom("malformed value"));
                }
            };
            if let Some(slot) = self.scratch.vals.get_mut(i) {
                *slot = val;
            }
            // A column asked for twice gets the value twice.
            for j in i + 1..self.columns.len() {
                if self.columns.get(j).map(String::as_str) != Some(column) {
                    continue;
                }
                if let Some(slot) = self.scratch.vals.get_mut(j) {
                    *slot = val;
                }
                let (before, from_j) = self.scratch.esc.split_at_mut(j);
                if let (Val::Escaped, Some(from), Some(to)) =
                    (val, before.get(i), from_j.first_mut())
                {
                    to.clone_from(from);
                }
            }
        }
    }
}

/// A key of a line's object: the index of the first wanted column of that name, if any.
struct Column<'s>(&'s [String]);

impl<'de> DeserializeSeed<'de> for Column<'_> {
    type Value = Option<usize>;

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Option<usize>, D::Error> {
        de.deserialize_str(self)
    }
}

impl Visitor<'_> for Column<'_> {
    type Value = Option<usize>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a string key")
    }

    fn visit_str<E>(self, key: &str) -> Result<Option<usize>, E> {
        Ok(self.0.iter().position(|c| c == key))
    }
}

/// Checks a value and drops it. serde_json's own skipping (`IgnoredAny`, `RawValue`) does not
/// recurse, so it applies no depth limit, and takes a lone surrogate escape; this visits the
/// value as `serde_json::Value` would, with serde_json's recursion limit (128, which keeps a
/// hostile line from overflowing the stack) and its checks, without building anything.
struct Skip;

impl<'de> DeserializeSeed<'de> for Skip {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<(), D::Error> {
        de.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Skip {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }

    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }

    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }

    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }

    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }

    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Skip)?.is_some() {}
        Ok(())
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while map.next_entry_seed(Skip, Skip)?.is_some() {}
        Ok(())
    }
}

/// Unescapes a JSON string into a reused buffer.
struct Unescape<'s>(&'s mut String);

impl Visitor<'_> for Unescape<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a string")
    }

    fn visit_str<E>(self, s: &str) -> Result<(), E> {
        self.0.clear();
        self.0.push_str(s);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::{SourceError, SourcePoll, SourceReader};

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let path = dir.join(name);
        fs::write(&path, text).expect("write test file");
        path
    }

    /// `in.csv` in `dir`: a header and 40 lines, every fourth one (lines 5, 9, ..., 41)
    /// malformed for [`pair`].
    fn every_fourth_line_bad(dir: &Path) -> PathBuf {
        let text: String = (0..40)
            .map(|i| {
                if i % 4 == 3 {
                    format!("k{i},bad{i}\n")
                } else {
                    format!("k{i},{i}\n")
                }
            })
            .collect();
        write(dir, "in.csv", &format!("k,v\n{text}"))
    }

    /// The input line numbers of the dead letters in `p`, in file order.
    fn dead_lines(p: &Path) -> Vec<u64> {
        fs::read_to_string(p)
            .unwrap_or_default()
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).expect("a whole line");
                v["line"].as_u64().expect("line")
            })
            .collect()
    }

    /// Parses (key, integer value) from two fields.
    fn pair(fields: &[&str], _loc: &Location) -> Result<(String, i64), String> {
        let [key, value] = fields else {
            return Err(format!("expected 2 fields, got {}", fields.len()));
        };
        let value = value
            .parse::<i64>()
            .map_err(|e| format!("value `{value}`: {e}"))?;
        Ok(((*key).to_owned(), value))
    }

    /// All the fields as owned strings.
    fn texts(fields: &[&str], _loc: &Location) -> Result<Vec<String>, String> {
        Ok(fields.iter().map(|f| (*f).to_owned()).collect())
    }

    /// A reader of `source` that read at least `n` records, polling `step` lines at a time.
    fn read_past<T: Send + 'static>(
        source: &FileSource<T>,
        n: usize,
        step: usize,
    ) -> Box<dyn SourceReader<T>> {
        let mut r = reader(source);
        let mut out = Vec::new();
        while out.len() < n {
            r.poll(&mut out, step).expect("poll");
        }
        r
    }

    fn reader<T: Send + 'static>(source: &FileSource<T>) -> Box<dyn SourceReader<T>> {
        source.create_reader(0, 1).expect("create reader")
    }

    /// A reader as the runtime starts one that restores nothing: made, then started.
    fn started<T: Send + 'static>(source: &FileSource<T>) -> Box<dyn SourceReader<T>> {
        let mut r = reader(source);
        r.start().expect("start");
        r
    }

    fn drain<T: 'static>(
        reader: &mut dyn SourceReader<T>,
        max: usize,
    ) -> Result<Vec<T>, SourceError> {
        let mut all = Vec::new();
        let mut batch = Vec::new();
        loop {
            batch.clear();
            let poll = reader.poll(&mut batch, max)?;
            assert!(batch.len() <= max, "poll appended {} > {max}", batch.len());
            all.append(&mut batch);
            if poll == SourcePoll::Finished {
                return Ok(all);
            }
        }
    }

    fn kv(pairs: &[(&str, i64)]) -> Vec<(String, i64)> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect()
    }

    #[test]
    fn csv_reads_wanted_columns_in_order() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let path = write(
            tmp.path(),
            "in.csv",
            "id,name,score\n1,a,10\n2,b,-3\n\n3,c,7\n",
        );
        let source = FileSource::new(&path, FileFormat::Csv, &["name", "score"], pair);
        assert_eq!(source.name(), "file");
        let got = drain(reader(&source).as_mut(), 2).expect("read");
        assert_eq!(got, kv(&[("a", 10), ("b", -3), ("c", 7)]));
        assert_eq!(source.skipped().load(Ordering::Relaxed), 0);
    }

    #[test]
    fn csv_quoted_fields_crlf_and_multiline_records() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let text =
            "\u{feff}k,\"v\"\r\n\"a,b\",\"say \"\"hi\"\"\"\r\n\"two\nlines\",x\r\nlast,\"\"\r\n";
        let path = write(tmp.path(), "q.csv", text);
        let lines = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = Arc::clone(&lines);
        let source = FileSource::new(
            &path,
            FileFormat::Csv,
            &["k", "v"],
            move |f: &[&str], loc: &Location| {
                seen.lock().map_err(|e| e.to_string())?.push(loc.line);
                texts(f, loc)
            },
        );
        let got = drain(reader(&source).as_mut(), 10).expect("read");
        assert_eq!(
            got,
            vec![
                vec!["a,b".to_owned(), "say \"hi\"".to_owned()],
                vec!["two\nlines".to_owned(), "x".to_owned()],
                vec!["last".to_owned(), String::new()],
            ]
        );
        // The multi-line record starts on line 3 and the next record on line 5.
        assert_eq!(*lines.lock().expect("lock"), vec![2, 3, 5]);
    }

    #[test]
    fn csv_unknown_column_names_file_and_header() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let path = write(tmp.path(), "u.csv", "a,b\n1,2\n");
        let source = FileSource::new(&path, FileFormat::Csv, &["a", "zz"], texts);
        let err = drain(reader(&source).as_mut(), 10).expect_err("unknown column");
        match &err {
            SourceError::UnknownColumn {
                file,
                column,
                available,
            } => {
                assert_eq!(file, &path);
                assert_eq!(column, "zz");
                assert_eq!(available, "a, b");
            }
            other => panic!("unexpected error {other:?}"),
        }
        assert!(err.to_string().contains("u.csv"), "{err}");
        // A header of any size (a binary file read as CSV) is listed in bounds, printable.
        let header: Vec<String> = (0..100)
            .map(|i| format!("c{i}\u{1}{}", "x".repeat(60)))
            .collect();
        let path = write(tmp.path(), "wide.csv", &format!("{}\n", header.join(",")));
        let source = FileSource::new(&path, FileFormat::Csv, &["zz"], texts);
        match drain(reader(&source).as_mut(), 10) {
            Err(SourceError::UnknownColumn { available, .. }) => {
                let listed: Vec<&str> = available.split(", ").collect();
                assert_eq!(listed.len(), LISTED_COLUMNS + 1, "{available}");
                assert_eq!(listed[LISTED_COLUMNS], "and 84 more");
                assert!(listed[0].starts_with("c0\\u{1}xx") && listed[0].ends_with('…'));
                assert!(!available.contains('\u{1}'));
                assert!(available.len() < 2000, "{} bytes", available.len());
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn csv_malformed_lines_fail_with_file_and_line() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let cases = [
            (
                "count.csv",
                &b"k,v\na,1\nb,2,3\n"[..],
                3,
                "expected 2 fields, found 3",
            ),
            ("parse.csv", b"k,v\na,1\nb,1\nc,x\n", 4, "value `x`"),
            (
                "quote.csv",
                b"k,v\na,1\n\"b\"c,1\n",
                3,
                "after a closing quote",
            ),
            (
                "bare.csv",
                b"k,v\na,1\nb\"c,1\n",
                3,
                "quote inside an unquoted field",
            ),
            (
                "open.csv",
                b"k,v\na,1\n\"b,1\nc,2\n",
                3,
                "unterminated quoted field",
            ),
            ("utf8.csv", b"k,v\na,1\nb\xff,1\n", 3, "not valid UTF-8"),
        ];
        for (name, text, line, reason) in cases {
            let path = tmp.path().join(name);
            fs::write(&path, text).expect("write");
            let source = FileSource::new(&path, FileFormat::Csv, &["k", "v"], pair);
            let mut r = reader(&source);
            let mut out = Vec::new();
            let err = loop {
                match r.poll(&mut out, 1) {
                    Ok(SourcePoll::Finished) => panic!("{name}: no error"),
                    Ok(_) => {}
                    Err(e) => break e,
                }
            };
            assert!(out.iter().all(|(_, v)| *v == 1), "{name}: {out:?}");
            match &err {
                SourceError::Malformed {
                    file,
                    line: l,
                    reason: r,
                } => {
                    assert_eq!(file, &path, "{name}");
                    assert_eq!(*l, line, "{name}");
                    assert!(r.contains(reason), "{name}: {r}");
                }
                other => panic!("{name}: unexpected error {other:?}"),
            }
            assert!(
                err.to_string().contains(&format!("{name}:{line}:")),
                "{err}"
            );
        }
    }

    #[test]
    fn csv_empty_file_and_header_only_have_no_records() {
        let tmp = tempfile::tempdir().expect("temp dir");
        for (name, text) in [
            ("empty.csv", ""),
            ("header.csv", "k,v\n"),
            ("header-no-eol.csv", "k,v"),
        ] {
            let path = write(tmp.path(), name, text);
            let source = FileSource::new(&path, FileFormat::Csv, &["v"], texts);
            assert!(
                drain(reader(&source).as_mut(), 4).expect(name).is_empty(),
                "{name}"
            );
        }
    }

    #[test]
    fn jsonl_reads_fields_as_text() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let text = concat!(
            "{\"a\": \"plain\", \"b\": 12, \"c\": true, \"skip\": [1, {\"x\": null}]}\n",
            "\n   \n",
            "{\"c\": false, \"b\": -1.5e3, \"a\": \"q\\\"\\\\\\n\\u00e9\\ud83d\\ude00\"}\r\n",
            "{\"a\": \"\", \"b\": [1, 2], \"c\": {\"n\": \"m\"}, \"extra\": null}",
        );
        let path = write(tmp.path(), "in.jsonl", text);
        let source = FileSource::new(&path, FileFormat::JsonLines, &["a", "b", "c"], texts);
        let got = drain(reader(&source).as_mut(), 3).expect("read");
        let expect: Vec<Vec<String>> = vec![
            vec!["plain".into(), "12".into(), "true".into()],
            vec![
                "q\"\\\n\u{e9}\u{1F600}".into(),
                "-1.5e3".into(),
                "false".into(),
            ],
            vec![String::new(), "[1, 2]".into(), "{\"n\": \"m\"}".into()],
        ];
        assert_eq!(got, expect);
    }

    #[test]
    fn jsonl_escaped_keys_match_columns() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let path = write(
            tmp.path(),
            "k.jsonl",
            "{\"\\u0061\": 1, \"b\\u00e9\": \"x\"}\n",
        );
        let source = FileSource::new(&path, FileFormat::JsonLines, &["a", "b\u{e9}"], texts);
        let got = drain(reader(&source).as_mut(), 3).expect("read");
        assert_eq!(got, vec![vec!["1".to_owned(), "x".to_owned()]]);
    }

    #[test]
    fn jsonl_malformed_lines_fail_with_file_and_line() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let good = "{\"k\": \"a\", \"v\": 1}\n";
        let cases = [
            ("missing", "{\"k\": \"b\"}", "missing field `v`"),
            ("null", "{\"k\": \"b\", \"v\": null}", "field `v` is null"),
            ("badjson", "{\"k\": \"b\", \"v\": 1", "invalid JSON"),
            ("array", "[1, 2]", "not a JSON object"),
            (
                "trailing",
                "{\"k\": \"b\", \"v\": 1} x",
                "trailing characters",
            ),
            (
                "comma",
                "{\"k\": \"b\", \"v\": 1,}",
                "expected a string key",
            ),
            (
                "dup",
                "{\"k\": \"b\", \"v\": 1, \"v\": 2}",
                "duplicate field `v`",
            ),
            ("parse", "{\"k\": \"b\", \"v\": \"x\"}", "value `x`"),
            ("number", "{\"k\": \"b\", \"v\": 01}", "invalid JSON"),
            ("escape", "{\"k\": \"\\x\", \"v\": 1}", "invalid escape"),
            ("surrogate", "{\"k\": \"\\ud800\", \"v\": 1}", "surrogate"),
        ];
        for (name, bad, expected) in cases {
            let path = write(tmp.path(), name, &format!("{good}\n{bad}\n{good}"));
            let source = FileSource::new(&path, FileFormat::JsonLines, &["k", "v"], pair);
            let err = drain(reader(&source).as_mut(), 8).expect_err(name);
            match &err {
                SourceError::Malformed { file, line, reason } => {
                    assert_eq!(file, &path, "{name}");
                    assert_eq!(*line, 3, "{name}");
                    assert!(reason.contains(expected), "{name}: {reason}");
                }
                other => panic!("{name}: unexpected error {other:?}"),
            }
        }
    }

    #[test]
    fn json_scanner_agrees_with_serde_json() {
        let lines = [
            "{}",
            " { } ",
            "{\"a\":1}",
            "{\"a\":[]}",
            "{\"a\":[1,]}",
            "{\"a\":{\"b\":{}}}",
            "{\"a\":-0.0e+5}",
            "{\"a\":-}",
            "{\"a\":1.}",
            "{\"a\":.5}",
            "{\"a\":1e}",
            "{\"a\":tru}",
            "{\"a\":nul}",
            "{\"a\":\"\\u12\"}",
            "{\"a\":\"\\udc00\"}",
            "{\"a\":\"\\ud800\\u0041\"}",
            "{\"a\":\"\\ud800\\udc00\"}",
            "{\"a\":\"\t\"}",
            "{\"a\" 1}",
            "{a:1}",
            "{\"a\":1 \"b\":2}",
            "{\"a\":1}}",
            "{\"a\":[1 2]}",
            "\"str\"",
            "{\"a\":\"\\/\\b\\f\\r\\t\"}",
        ];
        let mut scratch = JsonScratch::default();
        let columns = vec!["a".to_owned()];
        for line in lines {
            let ours = scan_object(line.as_bytes(), &columns, &mut scratch).is_ok();
            let theirs = matches!(
                serde_json::from_str::<serde_json::Value>(line),
                Ok(serde_json::Value::Object(_))
            );
            assert_eq!(ours, theirs, "{line}");
        }
        let deep = format!("{{\"a\":{}{}}}", "[".repeat(200), "]".repeat(200));
        assert!(scan_object(deep.as_bytes(), &columns, &mut scratch).is_err());
    }

    #[test]
    fn skip_policy_counts_and_goes_on() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let path = write(tmp.path(), "s.csv", "k,v\na,1\nb\nc,x\nd,4\n");
        let source = FileSource::new(&path, FileFormat::Csv, &["k", "v"], pair)
            .error_policy(ErrorPolicy::Skip);
        let skipped = source.skipped();
        let got = drain(reader(&source).as_mut(), 1).expect("read");
        assert_eq!(got, kv(&[("a", 1), ("d", 4)]));
        assert_eq!(skipped.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn dead_letter_policy_writes_raw_lines() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let path = write(
            tmp.path(),
            "d.jsonl",
            "{\"k\":\"a\",\"v\":1}\r\nnot json\r\n{\"k\":\"b\"}\n{\"k\":\"c\",\"v\":3}\n",
        );
        let dead = tmp.path().join("errors").join("nested").join("dead.jsonl");
        let source = FileSource::new(&path, FileFormat::JsonLines, &["k", "v"], pair)
            .error_policy(ErrorPolicy::DeadLetter(dead.clone()));
        let got = drain(reader(&source).as_mut(), 100).expect("read");
        assert_eq!(got, kv(&[("a", 1), ("c", 3)]));
        assert_eq!(source.skipped().load(Ordering::Relaxed), 2);
        let text = fs::read_to_string(&dead).expect("dead-letter file");
        let entries: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).expect("dead-letter line is JSON"))
            .collect();
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0]["file"], path.to_string_lossy().as_ref());
        assert_eq!(entries[0]["line"], 2);
        assert_eq!(entries[0]["raw"], "not json");
        assert_eq!(entries[0]["reason"], "not a JSON object");
        assert_eq!(entries[1]["line"], 3);
        assert_eq!(entries[1]["raw"], "{\"k\":\"b\"}");
        assert_eq!(entries[1]["reason"], "missing field `v`");
    }

    #[test]
    fn too_long_lines_are_malformed_and_reading_goes_on() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let long = "x".repeat(100);
        let path = write(
            tmp.path(),
            "l.csv",
            &format!("k,v\na,1\n{long},2\nb,3\n\"{long}\n{long}\",4\nc,5"),
        );
        let mut source = FileSource::new(&path, FileFormat::Csv, &["k", "v"], pair)
            .error_policy(ErrorPolicy::Skip);
        source.max_record_bytes = 64;
        let got = drain(reader(&source).as_mut(), 10).expect("read");
        assert_eq!(got, kv(&[("a", 1), ("b", 3), ("c", 5)]));
        // Giving up on the quoted record after its first line leaves its second line, which is
        // malformed on its own: three lines skipped.
        assert_eq!(source.skipped().load(Ordering::Relaxed), 3);
    }

    /// A directory of three files, a hidden file and a subdirectory that are skipped.
    fn directory(format: FileFormat) -> (tempfile::TempDir, Vec<(String, i64)>) {
        let tmp = tempfile::tempdir().expect("temp dir");
        let mut expect = Vec::new();
        for (f, name) in ["c", "a", "b"].iter().enumerate() {
            let mut text = match format {
                FileFormat::Csv => "v,k\n".to_owned(),
                FileFormat::JsonLines => String::new(),
            };
            let file_number = match *name {
                "a" => 0,
                "b" => 1,
                _ => 2,
            };
            for i in 0..(3 + f as i64) {
                let v = file_number * 100 + i;
                let k = format!("{name}{i}");
                text.push_str(&match format {
                    FileFormat::Csv => format!("{v},\"{k}\"\r\n"),
                    FileFormat::JsonLines => format!("{{\"k\":\"{k}\",\"v\":{v}}}\n"),
                });
            }
            write(tmp.path(), &format!("part-{name}"), &text);
        }
        for name in ["a", "b", "c"] {
            let n = match name {
                "a" => 4,
                "b" => 5,
                _ => 3,
            };
            let file_number = match name {
                "a" => 0,
                "b" => 1,
                _ => 2,
            };
            for i in 0..n {
                expect.push((format!("{name}{i}"), file_number * 100 + i));
            }
        }
        write(tmp.path(), ".hidden", "garbage\n");
        fs::create_dir(tmp.path().join("sub")).expect("subdir");
        write(&tmp.path().join("sub"), "x", "garbage\n");
        (tmp, expect)
    }

    #[test]
    fn directory_files_are_read_in_name_order() {
        for format in [FileFormat::Csv, FileFormat::JsonLines] {
            let (tmp, expect) = directory(format);
            let source = FileSource::new(tmp.path(), format, &["k", "v"], pair);
            assert_eq!(
                drain(reader(&source).as_mut(), 2).expect("read"),
                expect,
                "{format:?}"
            );
            // Other shards read nothing.
            let mut other = source.create_reader(1, 2).expect("reader");
            let mut out = Vec::new();
            assert_eq!(
                other.poll(&mut out, 10).expect("poll"),
                SourcePoll::Finished
            );
            assert!(out.is_empty());
        }
    }

    #[test]
    fn seek_continues_with_the_next_record() {
        for format in [FileFormat::Csv, FileFormat::JsonLines] {
            let (tmp, expect) = directory(format);
            let source = FileSource::new(tmp.path(), format, &["k", "v"], pair);
            for n in 0..=expect.len() {
                let mut first = reader(&source);
                let mut out = Vec::new();
                // Read exactly n records, one per poll.
                while out.len() < n {
                    first.poll(&mut out, 1).expect("poll");
                }
                assert_eq!(out, expect[..n], "{format:?} n={n}");
                let position = first.position();
                let mut second = reader(&source);
                second.seek(&position).expect("seek");
                let rest = drain(second.as_mut(), 3).expect("read rest");
                assert_eq!(rest, expect[n..], "{format:?} n={n}");
                // And the first reader agrees with the second.
                assert_eq!(drain(first.as_mut(), 3).expect("read rest"), expect[n..]);
                // The end position of a finished reader is valid too.
                let mut third = reader(&source);
                third.seek(&first.position()).expect("seek to end");
                assert!(drain(third.as_mut(), 3).expect("read").is_empty());
            }
        }
    }

    #[test]
    fn bad_positions_are_rejected() {
        let tmp = tempfile::tempdir().expect("temp dir");
        write(
            tmp.path(),
            "a.jsonl",
            "{\"k\":\"a\",\"v\":1}\n{\"k\":\"b\",\"v\":2}\n",
        );
        let source = FileSource::new(tmp.path(), FileFormat::JsonLines, &["k", "v"], pair);
        let mut r = reader(&source);
        let mut out = Vec::new();
        r.poll(&mut out, 1).expect("poll");
        let good = r.position();
        // Version 1 (no window), as earlier checkpoints hold; `windowed` makes version 2.
        let encode = |index: u64, offset: u64, line: u64, name: &str| {
            let mut p = vec![POSITION_VERSION_1];
            p.extend_from_slice(&index.to_le_bytes());
            p.extend_from_slice(&offset.to_le_bytes());
            p.extend_from_slice(&line.to_le_bytes());
            p.extend_from_slice(&(name.len() as u32).to_le_bytes());
            p.extend_from_slice(name.as_bytes());
            p
        };
        // Version 2: `head` and `tail` windows, each (length, CRC-32), and no dead-letter
        // file.
        let windowed = |mut p: Vec<u8>, head: (u32, u32), tail: (u32, u32)| {
            p[0] = POSITION_VERSION;
            for (len, crc) in [head, tail] {
                p.extend_from_slice(&len.to_le_bytes());
                p.extend_from_slice(&crc.to_le_bytes());
            }
            p.extend_from_slice(&0u64.to_le_bytes());
            p.extend_from_slice(&0u32.to_le_bytes());
            p
        };
        let first = (16, crc32fast::hash(b"{\"k\":\"a\",\"v\":1}\n"));
        assert_eq!(good, windowed(encode(0, 16, 2, "a.jsonl"), first, first));
        reader(&source)
            .seek(&encode(0, 16, 2, "a.jsonl"))
            .expect("a version 1 position");
        let mut wrong_version = good.clone();
        wrong_version[0] = 9;
        let mut longer = good.clone();
        longer.push(0);
        // A dead-letter path longer than the position.
        let mut dead_path_past_end = good.clone();
        let n = dead_path_past_end.len();
        dead_path_past_end[n - 4..].copy_from_slice(&9u32.to_le_bytes());
        let bad = [
            Vec::new(),
            vec![1, 2, 3],
            good[..good.len() - 1].to_vec(),
            longer,
            dead_path_past_end,
            wrong_version,
            encode(5, 0, 1, ""),
            encode(0, 16, 2, "b.jsonl"),
            encode(0, 7, 2, "a.jsonl"),
            encode(0, 9999, 3, "a.jsonl"),
            encode(0, 16, 0, "a.jsonl"),
            encode(1, 5, 1, ""),
            // Windows longer than the offset, or than any position takes, of two lengths,
            // or whose bytes are not the file's.
            windowed(encode(0, 16, 2, "a.jsonl"), (17, first.1), (17, first.1)),
            windowed(
                encode(0, 16, 2, "a.jsonl"),
                (4097, first.1),
                (4097, first.1),
            ),
            windowed(encode(0, 16, 2, "a.jsonl"), first, (15, first.1)),
            windowed(encode(0, 16, 2, "a.jsonl"), first, (16, first.1 ^ 1)),
            windowed(encode(0, 16, 2, "a.jsonl"), (16, first.1 ^ 1), first),
            windowed(encode(0, 16, 2, "a.jsonl"), (15, first.1), (15, first.1)),
        ];
        for position in bad {
            let mut fresh = reader(&source);
            match fresh.seek(&position) {
                Err(SourceError::BadPosition(_)) => {}
                other => panic!("{position:?}: expected BadPosition, got {other:?}"),
            }
        }
        // A finished source's position names the last file it read, so that a restore onto
        // other input fails rather than read nothing; one without a name (written before)
        // is still taken.
        let mut done = reader(&source);
        assert!(until_error(done.as_mut()).1.is_none());
        let end = done.position();
        assert_eq!(end, windowed(encode(1, 0, 1, "a.jsonl"), (0, 0), (0, 0)));
        reader(&source).seek(&end).expect("the same input");
        reader(&source)
            .seek(&encode(1, 0, 1, ""))
            .expect("an unnamed end");
        write(tmp.path(), "b.jsonl", "{\"k\":\"c\",\"v\":3}\n");
        std::fs::remove_file(tmp.path().join("a.jsonl")).expect("remove");
        let other = FileSource::new(tmp.path(), FileFormat::JsonLines, &["k", "v"], pair);
        match reader(&other).seek(&end) {
            Err(SourceError::BadPosition(why)) => assert!(why.contains("b.jsonl"), "{why}"),
            other => panic!("expected BadPosition, got {other:?}"),
        }
    }

    /// A position records how long the dead-letter file was: a restore cuts it back to that,
    /// so the malformed lines after the position, read again, are in it once; a job given
    /// another dead-letter file leaves this one alone.
    #[test]
    fn a_restore_cuts_the_dead_letter_file_back_to_the_position() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let path = every_fourth_line_bad(tmp.path());
        let dead = tmp.path().join("dead.jsonl");
        let source = FileSource::new(&path, FileFormat::Csv, &["k", "v"], pair)
            .error_policy(ErrorPolicy::DeadLetter(dead.clone()));
        let mut r = read_past(&source, 15, 1);
        let position = r.position();
        let at_position = dead_lines(&dead);
        assert_eq!(at_position, [5, 9, 13, 17]);
        // The run goes on, writes more dead letters, and is killed.
        drain(r.as_mut(), 4).expect("the rest");
        assert_eq!(dead_lines(&dead).len(), 10);
        // The restored reader cuts the file back and writes the rest once.
        let mut restored = reader(&source);
        restored.seek(&position).expect("seek");
        assert_eq!(dead_lines(&dead), at_position);
        drain(restored.as_mut(), 4).expect("the rest again");
        assert_eq!(dead_lines(&dead), [5, 9, 13, 17, 21, 25, 29, 33, 37, 41]);
        // Another dead-letter file: the first is not cut.
        let other = tmp.path().join("other.jsonl");
        let source2 = FileSource::new(&path, FileFormat::Csv, &["k", "v"], pair)
            .error_policy(ErrorPolicy::DeadLetter(other.clone()));
        reader(&source2).seek(&position).expect("seek");
        assert_eq!(dead_lines(&dead).len(), 10);
        // A position taken before any dead letter (the file did not exist) cuts to empty.
        fs::remove_file(&dead).expect("remove");
        let early = started(&source).position();
        let mut r = reader(&source);
        drain(r.as_mut(), 4).expect("all");
        assert_eq!(dead_lines(&dead).len(), 10);
        reader(&source).seek(&early).expect("seek");
        assert!(dead_lines(&dead).is_empty());
        // A second attempt from the beginning in this process (a restart before any
        // checkpoint) cuts back to where the source's first reader found the file; another
        // source (another process) appends, as to any existing file.
        drain(reader(&source).as_mut(), 4).expect("first attempt");
        drain(reader(&source).as_mut(), 4).expect("second attempt");
        assert_eq!(dead_lines(&dead).len(), 10);
        let again = FileSource::new(&path, FileFormat::Csv, &["k", "v"], pair)
            .error_policy(ErrorPolicy::DeadLetter(dead.clone()));
        drain(reader(&again).as_mut(), 4).expect("another process");
        assert_eq!(dead_lines(&dead).len(), 20);
        // A position of a reader that has not read yet says what it will cut to.
        let unread = started(&again).position();
        let Decoded { dead_letter, .. } = decode_position(&unread).expect("position");
        let half = fs::metadata(&dead).expect("dead").len() / 2;
        assert_eq!(dead_letter.map(|(_, len)| len), Some(half));
    }

    /// A start record carries the dead-letter file's length at a run's start to another
    /// process: a source that resumes (a restart from the beginning after a run killed before
    /// its first checkpoint) cuts the file back to it, so the lines are there once and what
    /// was there before the first run stays. A source that does not resume, or a record of
    /// another dead-letter file, records the length now and appends.
    #[test]
    fn a_start_record_carries_the_dead_letter_start_to_a_restart() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let path = every_fourth_line_bad(tmp.path());
        let dead = tmp.path().join("dead.jsonl");
        fs::write(&dead, "earlier\n").expect("earlier dead letters");
        // In a directory that does not exist yet: the record makes it.
        let record = tmp.path().join("job").join("dead-letter-start");
        let source = |resume: bool, dead: &Path| {
            FileSource::new(&path, FileFormat::Csv, &["k", "v"], pair)
                .error_policy(ErrorPolicy::DeadLetter(dead.to_path_buf()))
                .dead_letter_start_record(&record, resume)
        };
        let count = |p: &Path| fs::read_to_string(p).expect("dead").lines().count();
        // A first run (resuming, with no record yet: it records where it starts) is killed
        // after dead-lettering all ten lines; so is a second one.
        drain(reader(&source(true, &dead)).as_mut(), 4).expect("first run");
        assert_eq!(count(&dead), 11);
        let abs = std::path::absolute(&dead).expect("absolute");
        assert_eq!(
            read_start_record(&record).expect("record"),
            Some((abs.clone(), 8))
        );
        drain(reader(&source(true, &dead)).as_mut(), 4).expect("second run");
        assert_eq!(count(&dead), 11, "the restart cut the first run's lines");
        assert_eq!(
            read_start_record(&record).expect("record"),
            Some((abs.clone(), 8)),
            "a resumed run keeps the record"
        );
        // A run that does not resume is another run: it appends, and records its start.
        drain(reader(&source(false, &dead)).as_mut(), 4).expect("another run");
        assert_eq!(count(&dead), 21);
        let len = fs::metadata(&dead).expect("dead").len();
        assert_eq!(
            read_start_record(&record).expect("record"),
            Some((abs, len - (len - 8) / 2))
        );
        // A record of another dead-letter file is not taken: this one is appended to.
        let other = tmp.path().join("other.jsonl");
        drain(reader(&source(true, &other)).as_mut(), 4).expect("other");
        drain(reader(&source(true, &dead)).as_mut(), 4).expect("after the other");
        assert_eq!(count(&dead), 31);
    }

    /// A start record that does not decode is refused with the file and the offset of what is
    /// wrong, whatever part of it is damaged, and fails the job without a restart: the
    /// dead-letter file is not cut by a guess.
    #[test]
    fn bad_start_records_are_refused() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let path = write(tmp.path(), "in.csv", "k,v\na,1\n");
        let dead = tmp.path().join("dead.jsonl");
        let record = tmp.path().join("dead-letter-start");
        write_start_record(&record, &std::path::absolute(&dead).expect("abs"), 5).expect("write");
        let good = fs::read(&record).expect("record");
        let n = good.len();
        let body = n - 4;
        let with = |f: &dyn Fn(&mut Vec<u8>)| {
            let mut b = good.clone();
            f(&mut b);
            b
        };
        let recrc = |b: &mut Vec<u8>| {
            let c = crc32fast::hash(&b[..b.len() - 4]);
            let at = b.len() - 4;
            b[at..].copy_from_slice(&c.to_le_bytes());
        };
        let cases: Vec<(&str, Vec<u8>, u64)> = vec![
            ("cut", good[..20].to_vec(), 20),
            ("empty", Vec::new(), 0),
            ("magic", with(&|b| b[0] = b'X'), 0),
            (
                "version",
                with(&|b| {
                    b[8] = 2;
                    recrc(b);
                }),
                8,
            ),
            (
                "algorithm",
                with(&|b| {
                    b[10] = 7;
                    recrc(b);
                }),
                10,
            ),
            (
                "path length",
                with(&|b| {
                    b[12] = b[12].wrapping_add(1);
                    recrc(b);
                }),
                12,
            ),
            ("appended", with(&|b| b.push(0)), 12),
            ("length bit", with(&|b| b[17] ^= 1), body as u64),
            (
                "path bit",
                with(&|b| b[START_FIXED_BYTES] ^= 1),
                body as u64,
            ),
            ("crc bit", with(&|b| b[body] ^= 1), body as u64),
            (
                "reserved",
                with(&|b| {
                    b[11] = 1;
                    recrc(b);
                }),
                11,
            ),
            (
                "huge",
                vec![0; START_MAX_BYTES as usize + 1],
                START_MAX_BYTES,
            ),
        ];
        for (what, bytes, offset) in cases {
            fs::write(&record, &bytes).expect("damage");
            let source = FileSource::new(&path, FileFormat::Csv, &["k", "v"], pair)
                .error_policy(ErrorPolicy::DeadLetter(dead.clone()))
                .dead_letter_start_record(&record, true);
            let start = || source.create_reader(0, 1).and_then(|mut r| r.start());
            match start() {
                Err(SourceError::Corrupt {
                    file, offset: at, ..
                }) => {
                    assert_eq!((file, at), (record.clone(), offset), "{what}");
                }
                other => panic!("{what}: {other:?}"),
            }
            let e = crate::JobError::Source {
                operator: "input".into(),
                shard: 0,
                source: start().expect_err("refused again"),
            };
            assert!(!e.is_recoverable(), "{what}: {e}");
        }
        // Not resuming, the record is not read: it is replaced.
        let source = FileSource::new(&path, FileFormat::Csv, &["k", "v"], pair)
            .error_policy(ErrorPolicy::DeadLetter(dead.clone()))
            .dead_letter_start_record(&record, false);
        started(&source);
        assert!(read_start_record(&record).expect("replaced").is_some());
    }

    /// Only a reader that starts from the beginning reads the start record: one restored from
    /// a position (which says where to cut the dead-letter file) starts, reads and cuts by
    /// that position even when the record is damaged, and leaves the record as it is.
    #[test]
    fn a_restored_reader_does_not_need_the_start_record() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let path = every_fourth_line_bad(tmp.path());
        let dead = tmp.path().join("dead.jsonl");
        let record = tmp.path().join("dead-letter-start");
        let source = || {
            FileSource::new(&path, FileFormat::Csv, &["k", "v"], pair)
                .error_policy(ErrorPolicy::DeadLetter(dead.clone()))
                .dead_letter_start_record(&record, true)
        };
        // A run takes a position after four dead letters and goes on to the end.
        let first = source();
        let mut r = read_past(&first, 15, 1);
        let position = r.position();
        assert_eq!(dead_lines(&dead), [5, 9, 13, 17]);
        drain(r.as_mut(), 4).expect("the rest");
        assert_eq!(dead_lines(&dead).len(), 10);
        // Its record is damaged.
        let mut bytes = fs::read(&record).expect("record");
        bytes[17] ^= 1;
        fs::write(&record, &bytes).expect("damage");
        // A fresh start refuses it ...
        let e = source()
            .create_reader(0, 1)
            .and_then(|mut r| r.start())
            .expect_err("a fresh start reads the record");
        assert!(matches!(e, SourceError::Corrupt { .. }), "{e}");
        // ... a restored one does not read it: it cuts the file back to the position's four
        // lines, dead-letters the other six again, and leaves the record alone.
        let again = source();
        let mut r = reader(&again);
        r.restore(1, &[(0, &position)]).expect("restore");
        r.start()
            .expect("a restored reader starts without the record");
        drain(r.as_mut(), 4).expect("restored run");
        let lines = dead_lines(&dead);
        let once: Vec<u64> = (0..10).map(|i| 5 + 4 * i).collect();
        assert_eq!(lines, once, "each dead letter once");
        assert_eq!(fs::read(&record).expect("record"), bytes);
    }

    /// A position fingerprints the file's first bytes and the bytes before its offset: a file
    /// changed there since (the same name, the offset still at a line start) is refused,
    /// naming file and offset, where reading on would mix two inputs. A change after the offset
    /// is input not read yet.
    #[test]
    fn a_position_in_a_file_changed_before_its_offset_is_refused() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let lines = ["k,v\n", "a,1\n", "b,2\n", "c,3\n"];
        let path = write(tmp.path(), "in.csv", &lines.concat());
        let source = FileSource::new(&path, FileFormat::Csv, &["k", "v"], texts);
        let position = read_past(&source, 2, 1).position();
        let offset = (lines[0].len() + lines[1].len() + lines[2].len()) as u64;
        let Decoded {
            offset: at,
            windows: window,
            ..
        } = decode_position(&position).expect("position");
        assert_eq!(at, offset);
        let w = window.expect("windows");
        assert_eq!(
            (u64::from(w.head.len), u64::from(w.tail.len)),
            (offset, offset)
        );
        // After the offset: taken, and the new line is read.
        write(tmp.path(), "in.csv", "k,v\na,1\nb,2\nd,4\n");
        let mut after = reader(&source);
        after.seek(&position).expect("changed after the offset");
        assert_eq!(
            drain(after.as_mut(), 1).expect("rest"),
            vec![vec!["d".to_owned(), "4".to_owned()]]
        );
        // Before it, with every line where it was: refused.
        write(tmp.path(), "in.csv", "k,v\na,1\nb,9\nc,3\n");
        match reader(&source).seek(&position) {
            Err(SourceError::BadPosition(why)) => assert!(
                why.contains("in.csv") && why.contains(&format!("offset {offset}")),
                "{why}"
            ),
            other => panic!("expected BadPosition, got {other:?}"),
        }
        // Windows hold at most POSITION_WINDOW_BYTES: the head from the start, the tail up to
        // the offset; a change in either is refused.
        let long: String = (0..2000).map(|i| format!("k{i},{i}\n")).collect();
        let path = write(tmp.path(), "long.csv", &format!("k,v\n{long}"));
        let source = FileSource::new(&path, FileFormat::Csv, &["k", "v"], texts);
        let position = read_past(&source, 1500, 100).position();
        let Decoded {
            offset: at,
            windows: window,
            ..
        } = decode_position(&position).expect("position");
        let w = window.expect("windows");
        assert_eq!(u64::from(w.head.len), POSITION_WINDOW_BYTES);
        assert_eq!(u64::from(w.tail.len), POSITION_WINDOW_BYTES);
        let bytes = std::fs::read(&path).expect("read");
        let at = at as usize;
        assert_eq!(w.head.crc32, crc32fast::hash(&bytes[..4096]));
        assert_eq!(w.tail.crc32, crc32fast::hash(&bytes[at - 4096..at]));
        reader(&source).seek(&position).expect("the same file");
        for (changed_at, what) in [(5, "at the start of the file"), (at - 3, "before offset")] {
            let mut changed = bytes.clone();
            changed[changed_at] = if changed[changed_at] == b'7' {
                b'8'
            } else {
                b'7'
            };
            std::fs::write(&path, &changed).expect("change");
            match reader(&source).seek(&position) {
                Err(SourceError::BadPosition(why)) => assert!(why.contains(what), "{why}"),
                other => panic!("byte {changed_at}: expected BadPosition, got {other:?}"),
            }
        }
    }

    #[test]
    fn missing_path_is_an_io_error_naming_it() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let path = tmp.path().join("nope");
        let source = FileSource::new(&path, FileFormat::Csv, &["k"], texts);
        match source.create_reader(0, 1) {
            Err(SourceError::Io { path: p, .. }) => assert_eq!(p, path),
            Err(other) => panic!("unexpected error {other:?}"),
            Ok(_) => panic!("a missing path has no reader"),
        }
    }

    /// Parses (key, integer value, line of the record) from two fields.
    fn located(fields: &[&str], loc: &Location) -> Result<(String, i64, u64), String> {
        pair(fields, loc).map(|(k, v)| (k, v, loc.line))
    }

    /// Reads one record per poll until the reader fails or finishes.
    fn until_error<T: 'static>(reader: &mut dyn SourceReader<T>) -> (Vec<T>, Option<SourceError>) {
        let mut out = Vec::new();
        loop {
            match reader.poll(&mut out, 1) {
                Ok(SourcePoll::Finished) => return (out, None),
                Ok(_) => {}
                Err(e) => return (out, Some(e)),
            }
        }
    }

    #[test]
    fn csv_quoted_comma_quote_and_newline_keep_line_numbers() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let text = concat!(
            "k,v\n",
            "\"a, \"\"b\"\"\nc\",1\n", // lines 2-3: comma, quotes and a line break in one field
            "d,2\n",                   // line 4
            "\"e\r\n\"\"\",3\r\n",     // lines 5-6: a CRLF inside quotes is data
            "\"\"\"\",4\n",            // line 7: a field that is one quote
            "g\rh,5\n",                // line 8: a lone "\r" is data
            "\"i\n\nj\",6\n",          // lines 9-11: an empty line inside quotes
            "k,x\n",                   // line 12: malformed
        );
        let path = write(tmp.path(), "q.csv", text);
        let source = FileSource::new(&path, FileFormat::Csv, &["k", "v"], located);
        let (got, err) = until_error(reader(&source).as_mut());
        let expect: Vec<(String, i64, u64)> = vec![
            ("a, \"b\"\nc".into(), 1, 2),
            ("d".into(), 2, 4),
            ("e\r\n\"".into(), 3, 5),
            ("\"".into(), 4, 7),
            ("g\rh".into(), 5, 8),
            ("i\n\nj".into(), 6, 9),
        ];
        assert_eq!(got, expect);
        match err {
            Some(SourceError::Malformed { file, line, reason }) => {
                assert_eq!(file, path);
                assert_eq!(line, 12);
                assert!(reason.contains("value `x`"), "{reason}");
            }
            other => panic!("expected a malformed line, got {other:?}"),
        }
    }

    #[test]
    fn csv_quoting_errors_name_the_byte() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let cases = [
            (
                "k,v\n\"ab\"c,1\n",
                "unexpected character after a closing quote (byte 4 ",
            ),
            (
                "k,v\nab,\"c\"\"\"d\n",
                "unexpected character after a closing quote (byte 8 ",
            ),
            ("k,v\nab,c\"d\n", "quote inside an unquoted field (byte 4 "),
            (
                "\u{feff}k,v\na\"b,1\n",
                "quote inside an unquoted field (byte 1 ",
            ),
            // The error is in the first line; the record is given up at its end, and the line
            // after it is read on its own (and is malformed too).
            (
                "k,v\nx\"y,\"z\nw\",1\n",
                "quote inside an unquoted field (byte 1 ",
            ),
        ];
        for (text, reason) in cases {
            let path = write(tmp.path(), "e.csv", text);
            let source = FileSource::new(&path, FileFormat::Csv, &["k", "v"], pair);
            match drain(reader(&source).as_mut(), 4) {
                Err(SourceError::Malformed {
                    line: 2, reason: r, ..
                }) => {
                    assert!(r.contains(reason), "{text:?}: {r}");
                }
                other => panic!("{text:?}: unexpected {other:?}"),
            }
            let source = source.error_policy(ErrorPolicy::Skip);
            assert!(drain(reader(&source).as_mut(), 4).expect("skip").is_empty());
            let lines = text.lines().count() as u64 - 1;
            assert_eq!(source.skipped().load(Ordering::Relaxed), lines, "{text:?}");
        }
    }

    #[test]
    fn csv_wrong_field_counts_follow_each_policy() {
        let tmp = tempfile::tempdir().expect("temp dir");
        // Line 3 has a field too many, line 4 one too few; the quoted comma on line 5 is not a
        // field separator.
        let text = "k,v\na,1\nb,2,3\nc\n\"d,e\",4\n";
        let path = write(tmp.path(), "n.csv", text);

        for (bad, line, reason) in [
            ("k,v\na,1\nb,2,3\n", 3, "expected 2 fields, found 3"),
            ("k,v\na,1\nc\n", 3, "expected 2 fields, found 1"),
            ("k,v\na,1\n\"b\",\"2\",\n", 3, "expected 2 fields, found 3"),
        ] {
            let fail = write(tmp.path(), "fail.csv", bad);
            let source = FileSource::new(&fail, FileFormat::Csv, &["k", "v"], pair);
            let (got, err) = until_error(reader(&source).as_mut());
            assert_eq!(got, kv(&[("a", 1)]), "{bad:?}");
            match err {
                Some(SourceError::Malformed {
                    file,
                    line: l,
                    reason: r,
                }) => {
                    assert_eq!(file, fail);
                    assert_eq!(l, line, "{bad:?}");
                    assert_eq!(r, reason, "{bad:?}");
                }
                other => panic!("{bad:?}: expected a malformed line, got {other:?}"),
            }
        }

        let source = FileSource::new(&path, FileFormat::Csv, &["k", "v"], pair)
            .error_policy(ErrorPolicy::Skip);
        let got = drain(reader(&source).as_mut(), 10).expect("skip");
        assert_eq!(got, kv(&[("a", 1), ("d,e", 4)]));
        assert_eq!(source.skipped().load(Ordering::Relaxed), 2);

        let dead = tmp.path().join("dead.jsonl");
        let source = FileSource::new(&path, FileFormat::Csv, &["k", "v"], pair)
            .error_policy(ErrorPolicy::DeadLetter(dead.clone()));
        let got = drain(reader(&source).as_mut(), 10).expect("dead-letter");
        assert_eq!(got, kv(&[("a", 1), ("d,e", 4)]));
        assert_eq!(source.skipped().load(Ordering::Relaxed), 2);
        let entries: Vec<serde_json::Value> = fs::read_to_string(&dead)
            .expect("dead-letter file")
            .lines()
            .map(|l| serde_json::from_str(l).expect("dead-letter line is JSON"))
            .collect();
        assert_eq!(entries.len(), 2);
        assert_eq!(entries[0]["line"], 3);
        assert_eq!(entries[0]["raw"], "b,2,3");
        assert_eq!(entries[0]["reason"], "expected 2 fields, found 3");
        assert_eq!(entries[1]["line"], 4);
        assert_eq!(entries[1]["raw"], "c");
        assert_eq!(entries[1]["reason"], "expected 2 fields, found 1");
    }

    #[test]
    fn jsonl_escapes_and_nested_values_in_other_fields() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let text = concat!(
            // Brackets, quotes and braces inside strings of fields that are not read, a wanted
            // name inside a nested object, and escapes everywhere.
            "{\"skip\": {\"v\": [1, {\"x\": \"a\\\"}]\\\\\"}], \"s\": \"}\\u0022,\"}, ",
            "\"k\": \"q\\u00e9\\t\\\"\", \"o\\u0074her\": \"\\ud83d\\ude00\", \"v\": 7}\n",
            "{\"k\": \"plain\", \"n\": [[], {}, [{\"k\": 1}]], \"v\": -2}\n",
        );
        let path = write(tmp.path(), "e.jsonl", text);
        let source = FileSource::new(&path, FileFormat::JsonLines, &["k", "v"], pair);
        let got = drain(reader(&source).as_mut(), 10).expect("read");
        assert_eq!(got, kv(&[("q\u{e9}\t\"", 7), ("plain", -2)]));

        // Fields that are not read are checked all the same.
        let good = "{\"k\": \"a\", \"v\": 1}\n";
        let deep = format!(
            "{{\"k\": \"b\", \"x\": {}{}, \"v\": 2}}",
            "[".repeat(200),
            "]".repeat(200)
        );
        let cases = [
            ("{\"k\": \"b\", \"x\": \"\\q\", \"v\": 2}", "invalid escape"),
            ("{\"k\": \"b\", \"x\": \"\\udc00\", \"v\": 2}", "surrogate"),
            ("{\"k\": \"b\", \"x\": [1,], \"v\": 2}", "invalid JSON"),
            (
                "{\"k\": \"b\", \"x\": {\"y\": 01}, \"v\": 2}",
                "invalid number",
            ),
            (deep.as_str(), "recursion limit"),
        ];
        for (bad, reason) in cases {
            let path = write(tmp.path(), "bad.jsonl", &format!("{good}{bad}\n{good}"));
            let source = FileSource::new(&path, FileFormat::JsonLines, &["k", "v"], pair);
            let (got, err) = until_error(reader(&source).as_mut());
            assert_eq!(got, kv(&[("a", 1)]), "{bad}");
            match err {
                Some(SourceError::Malformed {
                    line: 2, reason: r, ..
                }) => {
                    assert!(r.contains(reason), "{bad}: {r}");
                }
                other => panic!("{bad}: expected a malformed line, got {other:?}"),
            }
        }
    }

    #[test]
    fn seek_after_a_multiline_csv_record() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let text = concat!(
            "k,v\r\n",
            "\"a\nb\",1\n",              // lines 2-3
            "\"c,\r\n\"\"d\"\"\",2\r\n", // lines 4-5
            "\n",                        // line 6: blank
            "e,3\n",                     // line 7
            "\"f\n\n\",4",               // lines 8-10, no line end at the end of the file
        );
        let path = write(tmp.path(), "m.csv", text);
        let source = FileSource::new(&path, FileFormat::Csv, &["k", "v"], located);
        let expect: Vec<(String, i64, u64)> = vec![
            ("a\nb".into(), 1, 2),
            ("c,\r\n\"d\"".into(), 2, 4),
            ("e".into(), 3, 7),
            ("f\n\n".into(), 4, 8),
        ];
        // Where the next record starts after reading n records (n = 0: the file is not open
        // yet); reading the third record read the blank line before it too.
        let ends = [(0, 1), (13, 4), (28, 6), (33, 8), (text.len() as u64, 11)];
        for n in 0..=expect.len() {
            let mut first = reader(&source);
            let mut out = Vec::new();
            while out.len() < n {
                first.poll(&mut out, 1).expect("poll");
            }
            let position = first.position();
            let (offset, line) = ends[n];
            let Decoded {
                offset: at,
                line: at_line,
                ..
            } = decode_position(&position).expect("position");
            assert_eq!((at, at_line), (offset, line), "n={n}");
            let mut second = reader(&source);
            second.seek(&position).expect("seek");
            assert_eq!(
                drain(second.as_mut(), 1).expect("rest"),
                expect[n..],
                "n={n}"
            );
        }
    }

    #[test]
    fn a_column_asked_for_twice_gets_its_value_twice() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let path = write(tmp.path(), "d.jsonl", "{\"a\": \"x\\ty\", \"b\": 2}\n");
        let source = FileSource::new(&path, FileFormat::JsonLines, &["a", "b", "a"], texts);
        let got = drain(reader(&source).as_mut(), 2).expect("read");
        assert_eq!(
            got,
            vec![vec!["x\ty".to_owned(), "2".to_owned(), "x\ty".to_owned()]]
        );
        let path = write(tmp.path(), "d.csv", "a,b\nx,2\n");
        let source = FileSource::new(&path, FileFormat::Csv, &["b", "a", "b"], texts);
        let got = drain(reader(&source).as_mut(), 2).expect("read");
        assert_eq!(
            got,
            vec![vec!["2".to_owned(), "x".to_owned(), "2".to_owned()]]
        );
    }

    #[test]
    fn recycled_field_vector_keeps_its_allocation() {
        let mut v: Vec<&str> = Vec::with_capacity(8);
        v.push("x");
        let v: Vec<&'static str> = recycle(v);
        assert!(v.is_empty());
        assert!(v.capacity() >= 8);
    }

    /// The JSON scanner against serde_json on generated lines.
    mod generated {
        use super::*;
        use proptest::prelude::*;

        /// JSON-ish text: objects, arrays, strings (with escapes, surrogates), numbers, literals,
        /// nested a little, with random whitespace; a third of the lines then lose a character or
        /// gain a stray one.
        fn json_line() -> impl Strategy<Value = String> {
            let key = prop::sample::select(vec![
                "\"a\"",
                "\"b\"",
                "\"c\"",
                "\"\\u0061\"",
                "\"a\\n\"",
                "\"\"",
            ]);
            let leaf = prop::sample::select(vec![
                "1",
                "-0",
                "0.5e-3",
                "1e400",
                "-12.",
                "01",
                "true",
                "false",
                "null",
                "nul",
                "\"x\"",
                "\"\\u00e9\"",
                "\"\\ud800\"",
                "\"\\ud800\\udc00\"",
                "\"\\q\"",
                "\"tab\there\"",
                "\"\\/\\b\"",
                "[]",
                "{}",
            ])
            .prop_map(str::to_owned);
            let value = leaf.prop_recursive(3, 24, 4, move |inner| {
                prop_oneof![
                    prop::collection::vec(inner.clone(), 0..4)
                        .prop_map(|v| format!("[{}]", v.join(","))),
                    prop::collection::vec((key.clone(), inner), 0..4).prop_map(|kv| {
                        let kv: Vec<String> = kv.iter().map(|(k, v)| format!("{k}:{v}")).collect();
                        format!("{{{}}}", kv.join(","))
                    }),
                ]
            });
            let ws = prop::sample::select(vec!["", " ", "\t", "\r", "  "]);
            let top_key = prop::sample::select(vec![
                "\"a\"",
                "\"b\"",
                "\"c\"",
                "\"\\u0061\"",
                "\"b\\u0000\"",
            ]);
            let object = prop::collection::vec((top_key, value, ws.clone()), 0..5).prop_map(|kv| {
                let kv: Vec<String> = kv
                    .iter()
                    .map(|(k, v, w)| format!("{w}{k}{w}:{v}"))
                    .collect();
                format!("{{{}}}", kv.join(","))
            });
            let stray =
                prop::sample::select(vec!["", "{", "}", "[", "]", ",", ":", "\"", "\\", "x", "1"]);
            (
                object,
                ws,
                any::<prop::sample::Index>(),
                any::<bool>(),
                0u8..3,
                stray,
            )
                .prop_map(|(o, w, at, drop, mode, stray)| {
                    let mut line = format!("{w}{o}{w}");
                    if mode == 0 {
                        let cut = at.index(line.len() + 1);
                        let cut = (0..=cut)
                            .rev()
                            .find(|&c| line.is_char_boundary(c))
                            .unwrap_or(0);
                        if drop && cut < line.len() {
                            line.remove(cut);
                        } else {
                            line.insert_str(cut, stray);
                        }
                    }
                    line
                })
        }

        /// CSV text of `rows` under a header `c0,c1,..`: fields quoted when they need it (or
        /// always), `""` for a quote inside one, `eol` after each record, optionally none
        /// after the last, optionally a BOM first.
        fn csv_text(
            rows: &[Vec<String>],
            cols: usize,
            always: bool,
            eol: &str,
            last_eol: bool,
            bom: bool,
        ) -> String {
            let mut t = String::new();
            if bom {
                t.push('\u{feff}');
            }
            let header: Vec<String> = (0..cols).map(|c| format!("c{c}")).collect();
            t.push_str(&header.join(","));
            for row in rows {
                t.push_str(eol);
                let fields: Vec<String> = row
                    .iter()
                    .map(|f| {
                        // A lone empty field would be a blank line, which readers skip.
                        let special =
                            f.contains([',', '"', '\n', '\r']) || (cols == 1 && f.is_empty());
                        if always || special {
                            format!("\"{}\"", f.replace('"', "\"\""))
                        } else {
                            f.clone()
                        }
                    })
                    .collect();
                t.push_str(&fields.join(","));
            }
            if last_eol {
                t.push_str(eol);
            }
            t
        }

        fn csv_rows() -> impl Strategy<Value = (usize, Vec<Vec<String>>)> {
            let field = prop::collection::vec(
                prop::sample::select(vec![
                    "a", "b c", ",", "\"", "\n", "\r\n", " ", "\u{e9}", "0",
                ]),
                0..4,
            )
            .prop_map(|parts| parts.concat());
            (1usize..4).prop_flat_map(move |cols| {
                (
                    Just(cols),
                    prop::collection::vec(prop::collection::vec(field.clone(), cols), 0..12),
                )
            })
        }

        proptest::proptest! {
            #![proptest_config(proptest::prelude::ProptestConfig {
                cases: std::env::var("WEIR_PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(64),
                ..proptest::prelude::ProptestConfig::default()
            })]

            /// Records written as RFC 4180 CSV (quoted fields with commas, quotes, line breaks,
            /// CRLF or LF, with or without a final line break and a BOM) read back as written,
            /// each with the line it starts on.
            #[test]
            fn csv_records_round_trip(
                (cols, rows) in csv_rows(),
                always: bool,
                crlf: bool,
                last_eol: bool,
                bom: bool,
            ) {
                let eol = if crlf { "\r\n" } else { "\n" };
                let text = csv_text(&rows, cols, always, eol, last_eol, bom);
                let tmp = tempfile::tempdir().expect("temp dir");
                let path = write(tmp.path(), "in.csv", &text);
                let names: Vec<String> = (0..cols).map(|c| format!("c{c}")).collect();
                let names: Vec<&str> = names.iter().map(String::as_str).collect();
                let source = FileSource::new(
                    &path,
                    FileFormat::Csv,
                    &names,
                    |f: &[&str], loc: &Location| Ok((texts(f, loc)?, loc.line)),
                );
                let got = drain(reader(&source).as_mut(), 5);
                proptest::prop_assert!(got.is_ok(), "{:?}: {:?}", text, got.err());
                let got = got.unwrap_or_default();
                let records: Vec<Vec<String>> = got.iter().map(|(r, _)| r.clone()).collect();
                proptest::prop_assert_eq!(&records, &rows, "{:?}", text);
                // Line numbers: 1 is the header; a record starts after the line breaks of
                // those before it (inside quoted fields too).
                let mut line = 2;
                for (row, (_, at)) in rows.iter().zip(&got) {
                    proptest::prop_assert_eq!(*at, line, "{:?}", text);
                    line += 1 + row.iter().map(|f| f.matches('\n').count() as u64).sum::<u64>();
                }
            }
        }

        /// The top-level members of `line` as serde_json reads them, duplicates included.
        struct Members;

        impl<'de> Visitor<'de> for Members {
            type Value = Vec<(String, &'de RawValue)>;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an object")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut out = Vec::new();
                while let Some((k, v)) = map.next_entry::<String, &'de RawValue>()? {
                    out.push((k, v));
                }
                Ok(out)
            }
        }

        proptest::proptest! {
            #![proptest_config(proptest::prelude::ProptestConfig {
                cases: std::env::var("WEIR_PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(256),
                ..proptest::prelude::ProptestConfig::default()
            })]

            /// A line is accepted exactly when serde_json reads it as an object in which no wanted
            /// field appears twice, and each wanted field's text is what serde_json reads there: a
            /// string's content unescaped, any other value as written.
            #[test]
            fn json_scanner_agrees_with_serde_json_on_generated_lines(line in json_line()) {
                let columns = vec!["a".to_owned(), "b".to_owned(), "a".to_owned()];
                let mut scratch = JsonScratch::default();
                let ours = scan_object(line.as_bytes(), &columns, &mut scratch);
                let object = matches!(
                    serde_json::from_str::<serde_json::Value>(&line),
                    Ok(serde_json::Value::Object(_))
                );
                let members = {
                    let mut de = serde_json::Deserializer::from_str(&line);
                    de.deserialize_map(Members).ok()
                };
                let twice = |c: &str| {
                    members.as_ref().is_some_and(|m| m.iter().filter(|(k, _)| k == c).count() > 1)
                };
                let theirs = object && !twice("a") && !twice("b");
                proptest::prop_assert_eq!(ours.is_ok(), theirs, "{:?}: {:?}", line, ours);
                let Ok(text) = ours else {
                    return Ok(());
                };
                let members = members.unwrap_or_default();
                for (i, c) in columns.iter().enumerate() {
                    let want = members.iter().find(|(k, _)| k == c).map(|(_, v)| v.get());
                    let got = match scratch.vals[i] {
                        Val::Missing => None,
                        Val::Null => Some("null".to_owned()),
                        Val::Escaped => Some(format!("{:?}", scratch.esc[i])),
                        Val::Span(s, e) => Some(text[s..e].to_owned()),
                    };
                    let want = want.map(|raw| match serde_json::from_str::<String>(raw) {
                        // A string: its content, as `Escaped` (quoted by Debug) or a bare span.
                        Ok(s) if matches!(scratch.vals[i], Val::Escaped) => format!("{s:?}"),
                        Ok(s) => s,
                        Err(_) => raw.to_owned(),
                    });
                    proptest::prop_assert_eq!(got, want, "{:?} column {}", line, c);
                }
            }
        }
    }
}
