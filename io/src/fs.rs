//! The file-system abstraction the store and checkpoints use, and its `std::fs` implementation.

use std::fmt::Debug;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use crate::error::IoError;

/// The operations durable state needs, nothing more. Object safe: callers hold `Arc<dyn Fs>`.
pub trait Fs: Send + Sync + Debug {
    /// Create a new file for reading and writing; fails if it exists.
    fn create(&self, path: &Path) -> Result<Box<dyn FsFile>, IoError>;
    /// [`Self::create`] for a file written once, front to back, in large pieces through
    /// [`FsFile::write_behind`], and read afterwards through maps: a piece whose buffer
    /// address, file offset and length are multiples of [`DIRECT_ALIGN`] may bypass the page
    /// cache (`O_DIRECT`, where the file system has it). Every other call behaves as on a file
    /// from `create`, and the first unaligned one turns the bypass off for the rest of the
    /// file. Durability is unchanged: [`FsFile::sync`] as always.
    ///
    /// Why: a buffered write copies into page-cache pages, fresh ones for a new file, and a
    /// page's first touch costs microseconds on this VM (PLATFORM.md). In the keyed job
    /// checkpointing every 100 ms that copy was about a quarter of the CPU checkpoints cost
    /// (0.56-0.67 s of 1.7-2.4 s a run), and `dd` wrote 100 MiB at 1.4-2.1 GB/s direct
    /// against 0.4-1.3 GB/s buffered. The pages are read in from the device instead when the
    /// file is mapped, without a copy by the CPU.
    fn create_direct(&self, path: &Path) -> Result<Box<dyn FsFile>, IoError> {
        self.create(path)
    }
    /// Open an existing file for reading and writing.
    fn open(&self, path: &Path) -> Result<Box<dyn FsFile>, IoError>;
    /// [`Self::open`] for a sealed file read front to back in large pieces through
    /// [`FsFile::read_upto`]: a read whose buffer address, file offset and buffer length are
    /// multiples of [`DIRECT_ALIGN`] may bypass the page cache (`O_DIRECT`, where the file
    /// system has it); any other read is buffered, and turns the bypass off for the rest of the
    /// file.
    ///
    /// Why: a compaction reads each input once. Through the segment's map, every page came
    /// from the device into a fresh page-cache page, whose first touch costs microseconds on
    /// this VM (PLATFORM.md): 26% of the maintenance thread in the updates benchmark. A direct
    /// read lands in the reader's own buffer, reused from piece to piece.
    fn open_direct(&self, path: &Path) -> Result<Box<dyn FsFile>, IoError> {
        self.open(path)
    }
    /// Atomically rename `from` to `to` (replacing `to`).
    fn rename(&self, from: &Path, to: &Path) -> Result<(), IoError>;
    /// fsync a directory so that entries created, renamed or removed in it are durable.
    fn sync_dir(&self, dir: &Path) -> Result<(), IoError>;
    /// Remove a file.
    fn remove(&self, path: &Path) -> Result<(), IoError>;
    /// Remove an empty directory. Like a file's removal, durable once its parent is synced.
    fn remove_dir(&self, dir: &Path) -> Result<(), IoError> {
        std::fs::remove_dir(dir).map_err(|e| IoError::os("remove dir", dir, e))
    }
    /// The paths of the entries of a directory, sorted.
    fn list_dir(&self, dir: &Path) -> Result<Vec<PathBuf>, IoError>;
    /// Create a directory and its parents.
    fn create_dir_all(&self, dir: &Path) -> Result<(), IoError>;
    /// Map a sealed file read-only, exactly its current length. The caller promises that nobody
    /// truncates or writes the file while the map lives (see [`DirLock`]).
    fn map_readonly(&self, path: &Path) -> Result<Mapped, IoError>;
    /// Make `dst` a second name of the file `src` (a hard link; fails if `dst` exists). Only
    /// for immutable files: both names see every later write. The new entry is durable once
    /// its directory is synced ([`Self::sync_dir`]). A file system without links returns an
    /// error, and callers copy instead.
    fn hard_link(&self, src: &Path, dst: &Path) -> Result<(), IoError> {
        let _ = src;
        Err(IoError::os(
            "hard link",
            dst,
            std::io::Error::from(std::io::ErrorKind::Unsupported),
        ))
    }
}

/// An open file.
pub trait FsFile: Send + Debug {
    /// The path the file was opened with.
    fn path(&self) -> &Path;
    /// Write all of `buf` at `offset`; a short write is resubmitted or is an error.
    fn write_at(&mut self, offset: u64, buf: &[u8]) -> Result<(), IoError>;
    /// Fill all of `buf` from `offset`; reading past the end is an [`IoError::Short`].
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), IoError>;
    /// Read from `offset` into `buf` until it is full or the file ends; the number of bytes
    /// read (fewer than `buf.len()` only at the end of the file, 0 at or past it).
    fn read_upto(&self, offset: u64, buf: &mut [u8]) -> Result<usize, IoError> {
        let n = self.len()?.saturating_sub(offset).min(buf.len() as u64) as usize;
        if n > 0 {
            self.read_at(offset, &mut buf[..n])?;
        }
        Ok(n)
    }
    /// Start a [`Self::read_upto`] of `buf.bytes_mut()` at `offset` and return before it is
    /// done, so that the caller's work overlaps the read; [`Self::wait_ahead`] hands the
    /// buffer back filled. The file owns `buf` meanwhile. At most one such read is in flight:
    /// a call while one is waits for it and drops it. Returns the finished read at once where
    /// it was not started in the background (implementations that read at once, an empty
    /// range, a read the bypass does not take).
    fn read_ahead(
        &mut self,
        offset: u64,
        mut buf: Box<dyn ReadBuf>,
    ) -> Result<Option<ReadAhead>, IoError> {
        let len = self.read_upto(offset, buf.bytes_mut())?;
        Ok(Some(ReadAhead { buf, offset, len }))
    }
    /// Wait for the read [`Self::read_ahead`] left in flight, if any; its buffer and length.
    fn wait_ahead(&mut self) -> Result<Option<ReadAhead>, IoError> {
        Ok(None)
    }
    /// fdatasync.
    fn sync(&mut self) -> Result<(), IoError>;
    /// Start writing `len` bytes at `offset` back to the device, without waiting for them. A
    /// hint for long sequential writers: the final [`FsFile::sync`] then waits only for what
    /// is left, instead of for the whole file, and durability still needs that `sync`.
    fn start_writeback(&mut self, offset: u64, len: u64) -> Result<(), IoError> {
        let _ = (offset, len);
        Ok(())
    }
    /// Start writing all of `buf` at `offset`, and its writeback ([`FsFile::start_writeback`]),
    /// and return before the copy into the page cache is done, so that the caller's next work
    /// overlaps it. The file owns `buf` until the write completed. At most one such write is
    /// in flight: the call first waits for the previous one, and returns its buffer for reuse
    /// (implementations that write at once return `buf` itself). A failure of a write is
    /// returned by this call or by the next [`FsFile::wait_behind`]; [`FsFile::sync`] waits
    /// for the write first, so it never makes a write durable that did not complete. An
    /// implementation may make earlier pieces durable in the background meanwhile; a failure
    /// of that fails a later call and every later [`FsFile::sync`].
    fn write_behind(
        &mut self,
        offset: u64,
        buf: Box<dyn WriteBuf>,
    ) -> Result<Option<Box<dyn WriteBuf>>, IoError> {
        self.write_at(offset, buf.bytes())?;
        self.start_writeback(offset, buf.bytes().len() as u64)?;
        Ok(Some(buf))
    }
    /// Wait for the write [`FsFile::write_behind`] left in flight, if any, and return the
    /// buffer of the last piece that no call returned yet (another write may have waited for
    /// that piece already): every buffer comes back once.
    fn wait_behind(&mut self) -> Result<Option<Box<dyn WriteBuf>>, IoError> {
        Ok(None)
    }
    /// The file's length in bytes.
    fn len(&self) -> Result<u64, IoError>;
    /// True when the file holds no bytes.
    fn is_empty(&self) -> Result<bool, IoError> {
        Ok(self.len()? == 0)
    }
}

/// Alignment of buffer address, file offset and length that direct writes need
/// ([`Fs::create_direct`]): the page size, a multiple of every logical block size here.
pub const DIRECT_ALIGN: usize = 4096;

/// A buffer that [`FsFile::write_behind`] owns while the kernel reads it.
///
/// # Safety
///
/// Every call of [`WriteBuf::bytes`] on a value returns the same slice, and that memory stays
/// valid and unchanged for as long as the value lives and is not accessed mutably: a write in
/// flight reads it after `bytes` returned, without a borrow.
pub unsafe trait WriteBuf: Send + 'static {
    /// The bytes to write.
    fn bytes(&self) -> &[u8];
    /// The buffer as its own type again, for reuse (`downcast`).
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send>;
}

// SAFETY: a `Vec`'s heap buffer does not move or change while nobody mutates the vector.
unsafe impl WriteBuf for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
        self
    }
}

/// A buffer that [`FsFile::read_ahead`] owns while the kernel writes into it.
///
/// # Safety
///
/// Every call of [`ReadBuf::bytes_mut`] on a value returns the same memory, which stays valid
/// for as long as the value lives and is accessed by nobody else: a read in flight writes it
/// after `bytes_mut` returned, without a borrow.
pub unsafe trait ReadBuf: Send + 'static {
    /// The bytes to read into.
    fn bytes_mut(&mut self) -> &mut [u8];
    /// The buffer as its own type again (`downcast`).
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send>;
}

/// A finished [`FsFile::read_ahead`]: `len` bytes of the file from `offset` at the start of
/// `buf` (fewer than its length only at the end of the file).
pub struct ReadAhead {
    pub buf: Box<dyn ReadBuf>,
    pub offset: u64,
    pub len: usize,
}

impl Debug for ReadAhead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadAhead")
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

/// A read-only map of a whole sealed file. Derefs to the file's bytes.
#[derive(Debug)]
pub struct Mapped {
    // `None` for an empty file: mapping zero bytes is an error in mmap(2).
    map: Option<memmap2::Mmap>,
    path: PathBuf,
}

impl Mapped {
    /// Map `path`; shared by every [`Fs`] implementation.
    pub fn map(path: &Path) -> Result<Mapped, IoError> {
        let file = File::open(path).map_err(|e| IoError::os("open for map", path, e))?;
        let len = file
            .metadata()
            .map_err(|e| IoError::os("stat", path, e))?
            .len();
        if len == 0 {
            return Ok(Mapped {
                map: None,
                path: path.to_owned(),
            });
        }
        let len_usize = usize::try_from(len).map_err(|_| {
            IoError::os(
                "map",
                path,
                std::io::Error::new(std::io::ErrorKind::InvalidInput, "file too large"),
            )
        })?;
        // SAFETY: memmap2's contract is that the file is not modified or truncated while mapped.
        // Callers of `Fs::map_readonly` only map sealed files (written, fsynced, never written
        // again) in a directory they hold a `DirLock` on, and map exactly the current length, so
        // no page of the map lies past EOF (PLATFORM.md: SIGBUS).
        let map = unsafe { memmap2::MmapOptions::new().len(len_usize).map(&file) }
            .map_err(|e| IoError::os("mmap", path, e))?;
        // Huge pages for the map: a fault of a page not in the page cache then reads its whole
        // 2 MiB into one folio mapped by one TLB entry (a file written past the page cache,
        // `Fs::create_direct`, was otherwise mapped in small pieces: 24 of 64 MiB huge in a
        // test here, and a page walk per 4 KiB costs more than the cache miss on this VM).
        // Pages already cached (written buffered in 2 MiB pieces) were huge anyway. No
        // WILLNEED: its readahead filled the cache in small folios first (57 of 64 MiB huge),
        // and the update bench's maintenance was no cheaper with it. Failure is harmless.
        let _ = map.advise(memmap2::Advice::HugePage);
        Ok(Mapped {
            map: Some(map),
            path: path.to_owned(),
        })
    }

    /// The mapped file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl std::ops::Deref for Mapped {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match &self.map {
            Some(m) => m,
            None => &[],
        }
    }
}

/// `std::fs` implementation: portable, needs no io_uring.
#[derive(Debug, Default, Clone, Copy)]
pub struct StdFs;

#[derive(Debug)]
pub(crate) struct StdFile {
    pub(crate) file: File,
    pub(crate) path: PathBuf,
}

/// `sync_file_range(SYNC_FILE_RANGE_WRITE)`: queue the range's dirty pages for writeback.
pub(crate) fn start_writeback(
    file: &File,
    path: &Path,
    offset: u64,
    len: u64,
) -> Result<(), IoError> {
    // SAFETY: sync_file_range reads no memory of ours; the descriptor is open for the call.
    let rc = unsafe {
        libc::sync_file_range(
            file.as_raw_fd(),
            offset as libc::off64_t,
            len as libc::off64_t,
            libc::SYNC_FILE_RANGE_WRITE,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(IoError::os(
            "sync_file_range",
            path,
            std::io::Error::last_os_error(),
        ))
    }
}

impl FsFile for StdFile {
    fn path(&self) -> &Path {
        &self.path
    }
    fn start_writeback(&mut self, offset: u64, len: u64) -> Result<(), IoError> {
        start_writeback(&self.file, &self.path, offset, len)
    }
    fn write_at(&mut self, offset: u64, buf: &[u8]) -> Result<(), IoError> {
        self.file
            .write_all_at(buf, offset)
            .map_err(|e| IoError::os("write", &self.path, e))
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), IoError> {
        self.file.read_exact_at(buf, offset).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                IoError::Short {
                    op: "read",
                    path: self.path.clone(),
                    offset,
                    wanted: buf.len() as u64,
                    done: 0,
                }
            } else {
                IoError::os("read", &self.path, e)
            }
        })
    }
    fn sync(&mut self) -> Result<(), IoError> {
        self.file
            .sync_data()
            .map_err(|e| IoError::os("fdatasync", &self.path, e))
    }
    fn len(&self) -> Result<u64, IoError> {
        Ok(self
            .file
            .metadata()
            .map_err(|e| IoError::os("stat", &self.path, e))?
            .len())
    }
}

pub(crate) fn std_create(path: &Path) -> Result<StdFile, IoError> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(|e| IoError::os("create", path, e))?;
    Ok(StdFile {
        file,
        path: path.to_owned(),
    })
}

pub(crate) fn std_open(path: &Path) -> Result<StdFile, IoError> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| IoError::os("open", path, e))?;
    Ok(StdFile {
        file,
        path: path.to_owned(),
    })
}

/// Open an existing file for reading only.
pub(crate) fn std_open_read(path: &Path) -> Result<StdFile, IoError> {
    let file = OpenOptions::new()
        .read(true)
        .open(path)
        .map_err(|e| IoError::os("open", path, e))?;
    Ok(StdFile {
        file,
        path: path.to_owned(),
    })
}

pub(crate) fn std_rename(from: &Path, to: &Path) -> Result<(), IoError> {
    std::fs::rename(from, to).map_err(|e| IoError::os("rename", from, e))
}

pub(crate) fn std_sync_dir(dir: &Path) -> Result<(), IoError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| IoError::os("fsync dir", dir, e))
}

pub(crate) fn std_remove(path: &Path) -> Result<(), IoError> {
    std::fs::remove_file(path).map_err(|e| IoError::os("remove", path, e))
}

pub(crate) fn std_list_dir(dir: &Path) -> Result<Vec<PathBuf>, IoError> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| IoError::os("read dir", dir, e))? {
        out.push(entry.map_err(|e| IoError::os("read dir", dir, e))?.path());
    }
    out.sort();
    Ok(out)
}

pub(crate) fn std_hard_link(src: &Path, dst: &Path) -> Result<(), IoError> {
    std::fs::hard_link(src, dst).map_err(|e| IoError::os("hard link", dst, e))
}

pub(crate) fn std_create_dir_all(dir: &Path) -> Result<(), IoError> {
    std::fs::create_dir_all(dir).map_err(|e| IoError::os("create dir", dir, e))
}

impl Fs for StdFs {
    fn create(&self, path: &Path) -> Result<Box<dyn FsFile>, IoError> {
        Ok(Box::new(std_create(path)?))
    }
    fn open(&self, path: &Path) -> Result<Box<dyn FsFile>, IoError> {
        Ok(Box::new(std_open(path)?))
    }
    fn open_direct(&self, path: &Path) -> Result<Box<dyn FsFile>, IoError> {
        // Buffered: std has no aligned-buffer contract; only the reads are shared.
        Ok(Box::new(std_open_read(path)?))
    }
    fn rename(&self, from: &Path, to: &Path) -> Result<(), IoError> {
        std_rename(from, to)
    }
    fn sync_dir(&self, dir: &Path) -> Result<(), IoError> {
        std_sync_dir(dir)
    }
    fn remove(&self, path: &Path) -> Result<(), IoError> {
        std_remove(path)
    }
    fn list_dir(&self, dir: &Path) -> Result<Vec<PathBuf>, IoError> {
        std_list_dir(dir)
    }
    fn create_dir_all(&self, dir: &Path) -> Result<(), IoError> {
        std_create_dir_all(dir)
    }
    fn map_readonly(&self, path: &Path) -> Result<Mapped, IoError> {
        Mapped::map(path)
    }
    fn hard_link(&self, src: &Path, dst: &Path) -> Result<(), IoError> {
        std_hard_link(src, dst)
    }
}

/// `fs.create_dir_all(dir)`, then fsync the parent of every directory it created, outermost
/// first: a directory whose entry is not durable goes at a power cut with everything made
/// durable inside it (a sink's output directory with its committed files, say).
pub fn create_dir_all_durable(fs: &dyn Fs, dir: &Path) -> Result<(), IoError> {
    let missing: Vec<&Path> = dir
        .ancestors()
        .take_while(|d| !d.as_os_str().is_empty() && !d.exists())
        .collect();
    fs.create_dir_all(dir)?;
    for d in missing.iter().rev() {
        let parent = match d.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        fs.sync_dir(parent)?;
    }
    Ok(())
}

/// Durably publish `bytes` at `path`: write `<path>.tmp`, fsync it, rename over `path`, fsync
/// the directory. A crash at any point leaves either the old file (or none) or the new one.
pub fn publish_file(fs: &dyn Fs, path: &Path, bytes: &[u8]) -> Result<(), IoError> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    // A leftover temp file from an earlier crash is garbage: replace it.
    if tmp.exists() {
        fs.remove(&tmp)?;
    }
    let mut file = fs.create(&tmp)?;
    file.write_at(0, bytes)?;
    file.sync()?;
    drop(file);
    fs.rename(&tmp, path)?;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    fs.sync_dir(dir)
}

/// `p` absolute with symbolic links resolved as far as it exists (an output directory may not
/// yet), so that two spellings of one path compare equal. Past what exists, `.` is dropped
/// and `..` takes back the component before it, as `create_dir_all` does when it makes the
/// path (it creates `x`, then `x/..` is `x`'s parent): `CK/x/../JOB/sp` with no `x` yet is
/// `CK/JOB/sp`, which it left as spelt (its prefix `CK/x/..` does not resolve, and has no
/// last name to set aside), so it did not compare as inside `CK/JOB`.
pub fn resolved_path(p: &Path) -> PathBuf {
    use std::path::Component;
    let Ok(abs) = std::path::absolute(p) else {
        return p.to_path_buf();
    };
    let parts: Vec<Component<'_>> = abs.components().collect();
    for n in (1..=parts.len()).rev() {
        let existing: PathBuf = parts[..n].iter().collect();
        if let Ok(mut resolved) = std::fs::canonicalize(&existing) {
            for part in &parts[n..] {
                match part {
                    Component::ParentDir => {
                        resolved.pop();
                    }
                    Component::CurDir => {}
                    other => resolved.push(other),
                }
            }
            return resolved;
        }
    }
    abs
}

/// An exclusive advisory lock (`flock`) on `<dir>/LOCK` (or another name), held until dropped.
/// Mapped files must have no other writer: a second store on the same directory fails with
/// [`IoError::Locked`]. The exactly-once file sink locks its output directory the same way.
/// The holder writes its process id into the file, so that a lock still held for an exited
/// process can be told from one a live process holds (see `DEAD_OWNER_WAIT`).
#[derive(Debug)]
pub struct DirLock {
    _file: File,
    path: PathBuf,
}

/// How long [`DirLock::acquire`] waits for a lock whose recorded owner process has exited.
/// The kernel closes an exited process's files only when its io_uring instances are torn
/// down (the `iou_exit` workqueue, after their requests in flight), so the lock outlives the
/// process: a `kill -9` loop of `weir run demo --restore latest` found it still held by the
/// reaped process at the next start (4 of 6 starts refused), and free ~30 ms later.
pub const DEAD_OWNER_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

impl DirLock {
    /// Take the lock, creating the lock file if needed. Held by a live process (this one
    /// included): [`IoError::Locked`] at once. Held for a process that has exited: waits for
    /// the kernel to release it, up to `DEAD_OWNER_WAIT` (30 s).
    pub fn acquire(dir: &Path) -> Result<DirLock, IoError> {
        DirLock::acquire_named(dir, "LOCK")
    }

    /// [`DirLock::acquire`] with the lock file `<dir>/<name>` (a directory whose readers list
    /// it, as a sink's output directory, takes a hidden name).
    pub fn acquire_named(dir: &Path, name: &str) -> Result<DirLock, IoError> {
        DirLock::acquire_with(dir, name, &mut || {})
    }

    /// [`DirLock::acquire_named`], calling `waiting` before each wait for a dead owner's lock
    /// (tests observe the waits through it rather than through a clock).
    fn acquire_with(dir: &Path, name: &str, waiting: &mut dyn FnMut()) -> Result<DirLock, IoError> {
        let path = dir.join(name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| IoError::os("open lock file", &path, e))?;
        let deadline = std::time::Instant::now() + DEAD_OWNER_WAIT;
        loop {
            // SAFETY: flock on a valid, owned file descriptor; no memory is passed.
            let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
            if rc == 0 {
                // Best effort: without it a later contender just cannot tell a dead owner
                // and refuses at once, as for a live one.
                let pid = format!("{}\n", std::process::id());
                let _ = file
                    .set_len(0)
                    .and_then(|()| file.write_all_at(pid.as_bytes(), 0));
                return Ok(DirLock { _file: file, path });
            }
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
                return Err(IoError::os("flock", &path, err));
            }
            let dead_owner = lock_owner(&file).is_some_and(|pid| !process_alive(pid));
            if !dead_owner || std::time::Instant::now() >= deadline {
                return Err(IoError::Locked {
                    dir: dir.to_owned(),
                    lock_file: path,
                });
            }
            waiting();
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    /// The lock file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The process id a lock file records (see [`DirLock`]), if it holds one.
fn lock_owner(file: &File) -> Option<u32> {
    let mut buf = [0u8; 16];
    let n = file.read_at(&mut buf, 0).ok()?;
    std::str::from_utf8(&buf[..n]).ok()?.trim().parse().ok()
}

/// False when no process `pid` exists, or when it is a zombie: it has exited, and what is
/// left (threads still finishing their io_uring requests, an entry its parent has not reaped)
/// runs no more of its code. A process we may not signal exists.
fn process_alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return true;
    };
    if pid <= 0 {
        return true;
    }
    // SAFETY: signal 0 sends nothing; the call only checks that the process exists.
    let rc = unsafe { libc::kill(pid, 0) };
    if rc != 0 {
        return std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH);
    }
    // `/proc/<pid>/stat`: "pid (comm) state ...", comm may hold spaces and parentheses.
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let state = stat
        .rfind(')')
        .and_then(|i| stat[i + 1..].trim_start().chars().next());
    !matches!(state, Some('Z' | 'X'))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Past what exists, `..` takes back the component before it, as `create_dir_all` makes
    /// the path: a `..` after a name not yet made left the path as spelt, so a savepoint
    /// directory `CK/x/../JOB/sp` was not seen to be in `CK/JOB`.
    #[test]
    fn resolved_path_takes_dot_dot_past_what_exists_as_create_dir_all_does() {
        let dir = tempfile::tempdir().unwrap();
        let root = std::fs::canonicalize(dir.path()).unwrap();
        std::fs::create_dir(root.join("job")).unwrap();
        for spelt in [
            "x/../job/sp",
            "job/a/../sp",
            "x/y/../../job/./sp",
            "job/../job/sp",
        ] {
            assert_eq!(
                resolved_path(&dir.path().join(spelt)),
                root.join("job").join("sp"),
                "{spelt}"
            );
        }
        assert!(!root.join("x").exists(), "nothing made");
        // Through a link that exists, `..` is the link target's parent, as for the kernel.
        std::fs::create_dir_all(root.join("deep/inner")).unwrap();
        std::os::unix::fs::symlink(root.join("deep/inner"), root.join("link")).unwrap();
        assert_eq!(
            resolved_path(&root.join("link/../new")),
            root.join("deep").join("new")
        );
    }

    /// The lock is exclusive. One whose recorded owner has exited is waited for (the kernel
    /// may still hold it for that process's io_uring teardown); one whose owner lives is
    /// refused at once. One test: a process spawned while a lock is held holds it too until
    /// its exec closes the descriptor, so the children are made before any lock is taken.
    #[test]
    fn dir_lock_is_exclusive_and_waits_for_a_dead_owner_only() {
        // A process that has exited and not been reaped yet (a zombie) is dead too.
        let mut zombie = std::process::Command::new("true").spawn().unwrap();
        while std::fs::read_to_string(format!("/proc/{}/stat", zombie.id()))
            .is_ok_and(|s| !s.contains(") Z"))
        {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(!process_alive(zombie.id()));
        zombie.wait().unwrap();
        // A process that has exited and been reaped.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        assert!(!process_alive(dead));
        assert!(process_alive(std::process::id()));

        let dir = tempfile::tempdir().unwrap();
        let held = DirLock::acquire(dir.path()).unwrap();
        assert!(matches!(
            DirLock::acquire(dir.path()),
            Err(IoError::Locked { .. })
        ));
        let lock_file = dir.path().join("LOCK");
        assert_eq!(
            std::fs::read_to_string(&lock_file).unwrap().trim(),
            std::process::id().to_string()
        );
        std::fs::write(&lock_file, format!("{dead}\n")).unwrap();
        // The lock is released only once `acquire` has found it held for the dead owner and
        // waits: it must then take it.
        let (waits_tx, waits_rx) = std::sync::mpsc::channel();
        let release = std::thread::spawn(move || {
            waits_rx.recv().unwrap();
            drop(held);
        });
        let mut waits = 0;
        let got = DirLock::acquire_with(dir.path(), "LOCK", &mut || {
            waits += 1;
            let _ = waits_tx.send(());
        })
        .expect("waited for the dead owner's lock");
        release.join().unwrap();
        assert!(waits >= 1);
        assert_eq!(
            std::fs::read_to_string(&lock_file).unwrap().trim(),
            std::process::id().to_string()
        );
        // A live owner (this process) is refused without a single wait.
        let mut waits = 0;
        assert!(matches!(
            DirLock::acquire_with(dir.path(), "LOCK", &mut || waits += 1),
            Err(IoError::Locked { .. })
        ));
        assert_eq!(waits, 0);
        drop(got);
    }

    #[test]
    fn std_fs_round_trip_and_map() {
        let dir = tempfile::tempdir().unwrap();
        let fs = StdFs;
        let p = dir.path().join("a");
        let mut f = fs.create(&p).unwrap();
        f.write_at(0, b"hello world").unwrap();
        f.start_writeback(0, 11).unwrap();
        f.sync().unwrap();
        assert_eq!(f.len().unwrap(), 11);
        // A range the kernel refuses is a typed error naming the file, not a panic.
        match f.start_writeback(u64::MAX, 1) {
            Err(IoError::Os { path, .. }) => assert_eq!(path, p),
            other => panic!("{other:?}"),
        }
        let mut buf = [0u8; 5];
        f.read_at(6, &mut buf).unwrap();
        assert_eq!(&buf, b"world");
        assert!(matches!(f.read_at(8, &mut buf), Err(IoError::Short { .. })));
        assert!(fs.create(&p).is_err(), "create must not replace");
        let m = fs.map_readonly(&p).unwrap();
        assert_eq!(&m[..], b"hello world");
        let e = dir.path().join("empty");
        fs.create(&e).unwrap();
        assert_eq!(fs.map_readonly(&e).unwrap().len(), 0);
        assert_eq!(fs.list_dir(dir.path()).unwrap(), vec![p.clone(), e.clone()]);
        fs.remove(&e).unwrap();
        assert_eq!(fs.list_dir(dir.path()).unwrap(), vec![p]);
    }

    #[test]
    fn publish_replaces_atomically() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("meta");
        publish_file(&StdFs, &p, b"one").unwrap();
        publish_file(&StdFs, &p, b"two!").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two!");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
