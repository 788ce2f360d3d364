//! [`UringFs`]: reads, writes and fdatasync through an io_uring ring owned by the calling
//! thread (thread-local, created on first use), never inside a glommio executor's ring.
//!
//! Large writes are cut into [`URING_CHUNK_BYTES`] pieces with up to [`URING_DEPTH`] in flight.
//! Every completion's result is checked: a negative result is an error, a short transfer is
//! resubmitted for its remainder, a transfer of zero bytes is an [`IoError::Short`].

use std::cell::{Cell, RefCell};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use io_uring::{opcode, types, IoUring};

use crate::error::IoError;
use crate::fs::{self, FsFile, Mapped, StdFile, DIRECT_ALIGN};
use crate::Fs;

/// Bytes per submitted write or read. 2 MiB, the huge page size: each piece of a write that
/// starts at a multiple of it covers whole 2 MiB ranges of the file, which the page cache can
/// then hold as 2 MiB folios and map with one TLB entry (1 MiB pieces, written concurrently by
/// io-wq workers, left every folio smaller, and readers of the map paid a page walk per 4 KiB).
pub const URING_CHUNK_BYTES: usize = 2 << 20;
/// Operations in flight per call.
pub const URING_DEPTH: usize = 4;
const RING_ENTRIES: u32 = 8;

thread_local! {
    static RING: RefCell<Option<IoUring>> = const { RefCell::new(None) };
}

fn unavailable(err: std::io::Error) -> IoError {
    let disabled = std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "unknown".to_owned());
    let hint = match err.raw_os_error() {
        Some(libc::ENOSYS) => {
            "the kernel lacks io_uring (needs Linux >= 5.6); use StdFs".to_owned()
        }
        Some(libc::EPERM) | Some(libc::EACCES) => format!(
            "io_uring_setup was refused: a seccomp profile (containers block io_uring by default) \
             or kernel.io_uring_disabled (= {disabled}) forbids it; allow io_uring or use StdFs"
        ),
        Some(libc::ENOMEM) => "RLIMIT_MEMLOCK is too small for the ring; raise it".to_owned(),
        _ => format!("kernel.io_uring_disabled = {disabled}"),
    };
    IoError::UringUnavailable {
        reason: err.to_string(),
        hint,
    }
}

fn with_ring<R>(f: impl FnOnce(&mut IoUring) -> Result<R, IoError>) -> Result<R, IoError> {
    RING.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            *slot = Some(IoUring::new(RING_ENTRIES).map_err(unavailable)?);
        }
        match slot.as_mut() {
            Some(ring) => f(ring),
            None => unreachable!("ring was just created"),
        }
    })
}

#[derive(Clone, Copy)]
enum Dir {
    Write,
    Read,
}

#[derive(Clone, Copy)]
struct Piece {
    offset: u64,
    start: usize,
    len: usize,
}

/// Transfer `len` bytes between `ptr` and the file at `offset`, chunked, `URING_DEPTH` in flight.
/// Returns only after every submitted operation completed, so the buffer outlives them all.
fn transfer(
    fd: i32,
    path: &Path,
    dir: Dir,
    ptr: *mut u8,
    len: usize,
    offset: u64,
) -> Result<(), IoError> {
    with_ring(|ring| {
        let mut pending: Vec<Piece> = Vec::new();
        let mut pos = 0usize;
        while pos < len {
            let n = (len - pos).min(URING_CHUNK_BYTES);
            pending.push(Piece {
                offset: offset + pos as u64,
                start: pos,
                len: n,
            });
            pos += n;
        }
        pending.reverse(); // pop() from the front of the file first
        let mut slots: [Option<Piece>; URING_DEPTH] = [None; URING_DEPTH];
        let mut in_flight = 0usize;
        let mut first_err: Option<IoError> = None;
        let op = match dir {
            Dir::Write => "write",
            Dir::Read => "read",
        };
        loop {
            // Submit while there is room, unless an error already stopped new work.
            while first_err.is_none() && in_flight < URING_DEPTH {
                let Some(piece) = pending.pop() else { break };
                let slot = slots.iter().position(Option::is_none).unwrap_or(0);
                // SAFETY: piece.start + piece.len <= len, so the offset stays inside the
                // caller's buffer of `len` bytes.
                let p = unsafe { ptr.add(piece.start) };
                let entry = match dir {
                    Dir::Write => opcode::Write::new(types::Fd(fd), p, piece.len as u32)
                        .offset(piece.offset)
                        .build(),
                    Dir::Read => opcode::Read::new(types::Fd(fd), p, piece.len as u32)
                        .offset(piece.offset)
                        .build(),
                }
                .user_data(slot as u64);
                // SAFETY: the entry points into the caller's buffer, which stays borrowed until
                // this function returns, and we return only once `in_flight` is zero.
                if unsafe { ring.submission().push(&entry) }.is_err() {
                    pending.push(piece);
                    break;
                }
                slots[slot] = Some(piece);
                in_flight += 1;
            }
            if in_flight == 0 {
                break;
            }
            if let Err(e) = ring.submit_and_wait(1) {
                if e.raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                // The kernel may still own submitted entries; we cannot safely return while it
                // does, and cannot wait for them either. Abort rather than risk memory safety.
                panic!("io_uring_enter failed with operations in flight: {e}");
            }
            let completed: Vec<(u64, i32)> = ring
                .completion()
                .map(|c| (c.user_data(), c.result()))
                .collect();
            for (slot, res) in completed {
                let Some(piece) = slots[slot as usize].take() else {
                    continue;
                };
                in_flight -= 1;
                if res < 0 {
                    if -res == libc::EINTR || -res == libc::EAGAIN {
                        pending.push(piece);
                    } else if first_err.is_none() {
                        first_err = Some(IoError::os(
                            op,
                            path,
                            std::io::Error::from_raw_os_error(-res),
                        ));
                    }
                } else if res == 0 {
                    if first_err.is_none() {
                        first_err = Some(IoError::Short {
                            op,
                            path: path.to_owned(),
                            offset: piece.offset,
                            wanted: piece.len as u64,
                            done: 0,
                        });
                    }
                } else if (res as usize) < piece.len {
                    // Short transfer: resubmit the remainder.
                    let done = res as usize;
                    pending.push(Piece {
                        offset: piece.offset + done as u64,
                        start: piece.start + done,
                        len: piece.len - done,
                    });
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    })
}

fn fdatasync(fd: i32, path: &Path) -> Result<(), IoError> {
    with_ring(|ring| {
        let entry = opcode::Fsync::new(types::Fd(fd))
            .flags(types::FsyncFlags::DATASYNC)
            .build()
            .user_data(0);
        // SAFETY: an fsync entry references no memory.
        unsafe { ring.submission().push(&entry) }
            .map_err(|_| IoError::os("fsync", path, std::io::Error::other("submission full")))?;
        loop {
            match ring.submit_and_wait(1) {
                Ok(_) => break,
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => return Err(IoError::os("fsync", path, e)),
            }
        }
        let res = ring
            .completion()
            .next()
            .map(|c| c.result())
            .ok_or_else(|| IoError::os("fsync", path, std::io::Error::other("no completion")))?;
        if res < 0 {
            return Err(IoError::os(
                "fsync",
                path,
                std::io::Error::from_raw_os_error(-res),
            ));
        }
        Ok(())
    })
}

/// io_uring implementation of [`Fs`]. Metadata operations (open, rename, directory fsync) use
/// plain system calls; data transfer and fdatasync go through the calling thread's ring.
#[derive(Debug, Clone, Copy)]
pub struct UringFs {
    _probe: (),
}

impl UringFs {
    /// Probe io_uring on the calling thread; a typed error with a hint when it is unavailable
    /// (seccomp, `kernel.io_uring_disabled`, old kernel).
    pub fn new() -> Result<UringFs, IoError> {
        with_ring(|_| Ok(()))?;
        Ok(UringFs { _probe: () })
    }
}

struct UringFile {
    inner: StdFile,
    /// Writes started by `write_behind`, on a ring of the file's own (the thread's ring is
    /// for calls that wait for everything they submit).
    behind: Option<Behind>,
    /// `O_DIRECT` is set: aligned write-behind pieces bypass the page cache
    /// ([`Fs::create_direct`]). Cleared for good by the first call that is not such a piece.
    direct: Cell<bool>,
    /// The buffer of a write-behind drained early (to leave direct mode), for the next
    /// `write_behind` to return.
    returned: Option<Box<dyn crate::WriteBuf>>,
    /// The read started by `read_ahead`, on a ring of the file's own (as `behind`).
    ahead: Option<Ahead>,
}

/// `read_ahead`'s ring and the read in flight on it (at most one).
struct Ahead {
    ring: IoUring,
    in_flight: Option<AheadRead>,
}

struct AheadRead {
    buf: Box<dyn crate::ReadBuf>,
    offset: u64,
    /// Bytes up to the end of the file (the read asks for whole pages, at most the buffer).
    len: usize,
}

impl Ahead {
    /// Wait for the read in flight; it and its result. On a ring failure the buffer the kernel
    /// may still write is leaked, never freed.
    fn wait(&mut self, path: &Path) -> Result<Option<(AheadRead, i32)>, IoError> {
        let Some(r) = self.in_flight.take() else {
            return Ok(None);
        };
        loop {
            if let Some(c) = self.ring.completion().next() {
                return Ok(Some((r, c.result())));
            }
            if let Err(e) = self.ring.submit_and_wait(1) {
                if e.raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                std::mem::forget(r.buf);
                return Err(IoError::os("io_uring_enter (read ahead)", path, e));
            }
        }
    }
}

impl std::fmt::Debug for UringFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringFile")
            .field("inner", &self.inner)
            .field("behind", &self.behind)
            .field("direct", &self.direct.get())
            .finish()
    }
}

/// Whether a write of `len` bytes from `ptr` at `offset` meets direct I/O's alignment.
fn direct_aligned(ptr: *const u8, len: usize, offset: u64) -> bool {
    (ptr as usize | len).is_multiple_of(DIRECT_ALIGN) && offset.is_multiple_of(DIRECT_ALIGN as u64)
}

/// Set or clear `O_DIRECT` on `fd`. A file system without direct I/O refuses to set it.
fn set_direct(fd: i32, on: bool) -> std::io::Result<()> {
    // SAFETY: F_GETFL takes no argument and touches no memory of ours; `fd` is open.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let flags = if on {
        flags | libc::O_DIRECT
    } else {
        flags & !libc::O_DIRECT
    };
    // SAFETY: F_SETFL takes an int of status flags and touches no memory of ours.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Ring entries of a file's write-behind ring: a write, its linked writeback, and a data sync
/// of earlier pieces.
const BEHIND_ENTRIES: u32 = 4;

/// Once this many bytes of write-behind pieces were submitted since the last one, the next
/// piece is issued with an `fdatasync` of the file that nobody waits for (as RocksDB's
/// `bytes_per_sync`), so that the device's flush of what is written overlaps the writer's
/// encoding instead of being paid at `sync`. This VM's virtual disk makes written data durable
/// at about 1 ms per MB, all of it at the final `fdatasync` otherwise: 74-88 ms (strace) of a
/// 77 MB segment job that ran ~130 ms of CPU. Measured (`state_segment_write`, two runs each): the
/// ratio to raw writes 0.58-0.65 without, 0.63-0.69 every 8 MiB, 0.72-0.81 every 4 MiB,
/// 0.72-0.87 every 2 MiB; the updates benchmark's maintenance CPU did not change.
const SYNC_BEHIND_BYTES: u64 = 4 << 20;

/// `write_behind`'s ring and the write in flight on it (at most one). The write is linked to
/// a `sync_file_range` of its range, so writeback starts as soon as the copy into the page
/// cache is done, without a system call of ours.
struct Behind {
    ring: IoUring,
    in_flight: Option<InFlight>,
    /// Bytes of pieces submitted since the last background data sync was issued.
    unsynced: u64,
    /// A background `fdatasync` is in flight (see [`SYNC_BEHIND_BYTES`]).
    sync_in_flight: bool,
    /// The error of a background `fdatasync`: sticky, every later `sync` of the file fails
    /// (Linux reports a writeback error to one `fsync` only; the data it concerned may be
    /// lost even if a later one succeeds).
    sync_failed: Option<i32>,
    /// Background data syncs issued (tests observe them).
    syncs_issued: u64,
}

struct InFlight {
    buf: Box<dyn crate::WriteBuf>,
    offset: u64,
    /// Issued with `O_DIRECT` set.
    direct: bool,
    /// Completion results of the write and of its linked writeback.
    write: Option<i32>,
    writeback: Option<i32>,
}

/// `user_data` of the entries of a write behind.
const UD_WRITE: u64 = 0;
const UD_WRITEBACK: u64 = 1;
const UD_SYNC: u64 = 2;

impl std::fmt::Debug for Behind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Behind")
            .field("in_flight", &self.in_flight.is_some())
            .finish()
    }
}

impl Behind {
    /// Reap completions until the write in flight and its writeback have both completed;
    /// takes it out. On a ring failure the buffer the kernel may still read is leaked, never
    /// freed.
    fn wait(&mut self, path: &Path) -> Result<Option<InFlight>, IoError> {
        loop {
            match &self.in_flight {
                None => return Ok(None),
                Some(w) if w.write.is_some() && w.writeback.is_some() => {
                    return Ok(self.in_flight.take())
                }
                Some(_) => {}
            }
            if let Err(e) = self.ring.submit_and_wait(1) {
                if e.raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                // The kernel may still read the buffer: leaking it is the safe choice.
                if let Some(w) = self.in_flight.take() {
                    std::mem::forget(w.buf);
                }
                return Err(IoError::os("io_uring_enter (write behind)", path, e));
            }
            self.absorb();
        }
    }

    /// Take the completions the ring holds, without waiting.
    fn absorb(&mut self) {
        for c in self.ring.completion() {
            match (c.user_data(), &mut self.in_flight) {
                (UD_SYNC, _) => {
                    self.sync_in_flight = false;
                    if c.result() < 0 && self.sync_failed.is_none() {
                        self.sync_failed = Some(-c.result());
                    }
                }
                (UD_WRITE, Some(w)) => w.write = Some(c.result()),
                (_, Some(w)) => w.writeback = Some(c.result()),
                (_, None) => {}
            }
        }
    }

    /// Wait for the background data sync in flight, if any.
    fn wait_sync(&mut self, path: &Path) -> Result<(), IoError> {
        while self.sync_in_flight {
            if let Err(e) = self.ring.submit_and_wait(1) {
                if e.raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                return Err(IoError::os("io_uring_enter (data sync)", path, e));
            }
            self.absorb();
        }
        Ok(())
    }

    /// The background data syncs' error, if one failed.
    fn check_sync(&self, path: &Path) -> Result<(), IoError> {
        match self.sync_failed {
            Some(errno) => Err(IoError::os(
                "fdatasync (behind)",
                path,
                std::io::Error::from_raw_os_error(errno),
            )),
            None => Ok(()),
        }
    }
}

impl UringFile {
    fn new(inner: StdFile) -> UringFile {
        UringFile {
            inner,
            behind: None,
            direct: Cell::new(false),
            returned: None,
            ahead: None,
        }
    }

    /// Clear `O_DIRECT` (see [`UringFile::direct`]).
    fn clear_direct(&self) -> Result<(), IoError> {
        if self.direct.get() {
            set_direct(self.inner.file.as_raw_fd(), false)
                .map_err(|e| IoError::os("fcntl (clear O_DIRECT)", &self.inner.path, e))?;
            self.direct.set(false);
        }
        Ok(())
    }

    /// Before a write that is not an aligned write-behind piece: the piece in flight completes
    /// first, so that no write of this file is issued under the flags of the other mode.
    fn leave_direct(&mut self) -> Result<(), IoError> {
        if self.direct.get() {
            if let Some(b) = self.drain_behind()? {
                self.returned = Some(b);
            }
            self.clear_direct()?;
        }
        Ok(())
    }

    /// Check a completed write-behind: finish a short or interrupted write and its writeback
    /// with waiting calls, or report its error; the buffer is then free.
    fn settle(&mut self, w: InFlight) -> Result<Box<dyn crate::WriteBuf>, IoError> {
        let bytes = w.buf.bytes();
        let len = bytes.len();
        let res = w.write.unwrap_or(-libc::EINTR);
        if w.direct && -res == libc::EINVAL {
            // The device wants a larger alignment than DIRECT_ALIGN: write through the page
            // cache from here on.
            self.clear_direct()?;
            self.write_at(w.offset, bytes)?;
            self.start_writeback(w.offset, len as u64)?;
            return Ok(w.buf);
        }
        let retry = -res == libc::EINTR || -res == libc::EAGAIN;
        if res < 0 && !retry {
            return Err(IoError::os(
                "write",
                &self.inner.path,
                std::io::Error::from_raw_os_error(-res),
            ));
        }
        if res == 0 && len > 0 {
            return Err(IoError::Short {
                op: "write",
                path: self.inner.path.clone(),
                offset: w.offset,
                wanted: len as u64,
                done: 0,
            });
        }
        let done = res.max(0) as usize;
        if done < len {
            // The link broke (the writeback was cancelled): write the rest and start its
            // writeback here.
            self.write_at(w.offset + done as u64, &bytes[done..])?;
            self.start_writeback(w.offset, len as u64)?;
        } else if let Some(r) = w.writeback.filter(|&r| r < 0) {
            if -r == libc::EINTR || -r == libc::EAGAIN || -r == libc::ECANCELED {
                self.start_writeback(w.offset, len as u64)?;
            } else {
                return Err(IoError::os(
                    "sync_file_range",
                    &self.inner.path,
                    std::io::Error::from_raw_os_error(-r),
                ));
            }
        }
        Ok(w.buf)
    }

    /// Wait for the write in flight, if any; its buffer.
    fn drain_behind(&mut self) -> Result<Option<Box<dyn crate::WriteBuf>>, IoError> {
        let path = &self.inner.path;
        let Some(b) = self.behind.as_mut() else {
            return Ok(None);
        };
        match b.wait(path) {
            Ok(Some(w)) => self.settle(w).map(Some),
            Ok(None) => Ok(None),
            Err(e) => {
                // A ring that failed may still complete the leaked write: never reuse it.
                self.behind = None;
                Err(e)
            }
        }
    }
}

impl Drop for UringFile {
    fn drop(&mut self) {
        // The kernel must be done with every buffer before it is freed. A failure here is of
        // a write nobody synced: the file was abandoned, and its writer reported or will
        // report the error that made it do so.
        let _ = self.drain_behind();
        if let Some(a) = &mut self.ahead {
            let _ = a.wait(&self.inner.path);
        }
    }
}

impl FsFile for UringFile {
    fn path(&self) -> &Path {
        &self.inner.path
    }
    fn write_at(&mut self, offset: u64, buf: &[u8]) -> Result<(), IoError> {
        self.leave_direct()?;
        // The kernel only reads from the buffer for a write; the cast is for the shared helper.
        transfer(
            self.inner.file.as_raw_fd(),
            &self.inner.path,
            Dir::Write,
            buf.as_ptr() as *mut u8,
            buf.len(),
            offset,
        )
    }
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), IoError> {
        // Reads of a file being written are rare (tests): no drain, only the flag.
        self.clear_direct()?;
        transfer(
            self.inner.file.as_raw_fd(),
            &self.inner.path,
            Dir::Read,
            buf.as_mut_ptr(),
            buf.len(),
            offset,
        )
    }
    fn read_upto(&self, offset: u64, buf: &mut [u8]) -> Result<usize, IoError> {
        let n = self.len()?.saturating_sub(offset).min(buf.len() as u64) as usize;
        if n == 0 {
            return Ok(0);
        }
        if !(self.direct.get() && direct_aligned(buf.as_ptr(), buf.len(), offset)) {
            self.read_at(offset, &mut buf[..n])?;
            return Ok(n);
        }
        let fd = self.inner.file.as_raw_fd();
        let whole = n / DIRECT_ALIGN * DIRECT_ALIGN;
        if whole > 0 {
            match transfer(
                fd,
                &self.inner.path,
                Dir::Read,
                buf.as_mut_ptr(),
                whole,
                offset,
            ) {
                Err(IoError::Os { source, .. }) if source.raw_os_error() == Some(libc::EINVAL) => {
                    // The device wants a larger alignment than DIRECT_ALIGN: read through the
                    // page cache from here on.
                    self.read_at(offset, &mut buf[..n])?;
                    return Ok(n);
                }
                r => r?,
            }
        }
        if whole < n {
            // The file's last, partial page: a direct read must ask for a whole one (`buf` has
            // room: its length is a multiple of the page, and `whole < n <= buf.len()`), and
            // it stops at the end of the file.
            let page = &mut buf[whole..whole + DIRECT_ALIGN];
            let at = offset + whole as u64;
            let tail = n - whole;
            let got = loop {
                // SAFETY: `page` is a live, exclusively borrowed buffer of `DIRECT_ALIGN`
                // bytes; pread writes at most that many.
                let r = unsafe {
                    libc::pread(
                        fd,
                        page.as_mut_ptr().cast(),
                        DIRECT_ALIGN,
                        at as libc::off_t,
                    )
                };
                if r >= 0 {
                    break r as usize;
                }
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(IoError::os("read", &self.inner.path, e));
                }
            };
            if got == 0 {
                return Err(IoError::Short {
                    op: "read",
                    path: self.inner.path.clone(),
                    offset: at,
                    wanted: tail as u64,
                    done: 0,
                });
            }
            if got < tail {
                // A short direct read: the rest is unaligned, so buffered.
                self.read_at(at + got as u64, &mut page[got..tail])?;
            }
        }
        Ok(n)
    }
    fn read_ahead(
        &mut self,
        offset: u64,
        mut buf: Box<dyn crate::ReadBuf>,
    ) -> Result<Option<crate::ReadAhead>, IoError> {
        drop(self.wait_ahead()?);
        let b = buf.bytes_mut();
        let (ptr, cap) = (b.as_mut_ptr(), b.len());
        let len = self.len()?.saturating_sub(offset).min(cap as u64) as usize;
        if len == 0 || !(self.direct.get() && direct_aligned(ptr, cap, offset)) {
            let len = self.read_upto(offset, buf.bytes_mut())?;
            return Ok(Some(crate::ReadAhead { buf, offset, len }));
        }
        let ahead = match self.ahead.take() {
            Some(a) => a,
            None => match IoUring::new(2) {
                Ok(ring) => Ahead {
                    ring,
                    in_flight: None,
                },
                // No ring of its own (memlock): the read happens now instead.
                Err(_) => {
                    let len = self.read_upto(offset, buf.bytes_mut())?;
                    return Ok(Some(crate::ReadAhead { buf, offset, len }));
                }
            },
        };
        let a = self.ahead.insert(ahead);
        // Whole pages (`cap` is a multiple of the page, so they fit): a direct read stops at
        // the end of the file by itself.
        let want = len.div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
        let entry = opcode::Read::new(types::Fd(self.inner.file.as_raw_fd()), ptr, want as u32)
            .offset(offset)
            .build()
            .user_data(0);
        // SAFETY: the entry points into `buf`'s memory, which `ReadBuf` keeps valid and
        // unaliased while the box lives; the box moves into `in_flight` below and is freed only
        // after the completion is reaped (`Ahead::wait`, also from `drop`), or leaked.
        if unsafe { a.ring.submission().push(&entry) }.is_err() {
            let len = self.read_upto(offset, buf.bytes_mut())?;
            return Ok(Some(crate::ReadAhead { buf, offset, len }));
        }
        a.in_flight = Some(AheadRead { buf, offset, len });
        // A failed submit leaves the entry queued: `wait` submits it again.
        let _ = a.ring.submit();
        Ok(None)
    }
    fn wait_ahead(&mut self) -> Result<Option<crate::ReadAhead>, IoError> {
        let Some(a) = &mut self.ahead else {
            return Ok(None);
        };
        let Some((mut r, res)) = a.wait(&self.inner.path)? else {
            return Ok(None);
        };
        let done = if res < 0 {
            let e = -res;
            if e != libc::EINVAL && e != libc::EINTR && e != libc::EAGAIN {
                return Err(IoError::os(
                    "read",
                    &self.inner.path,
                    std::io::Error::from_raw_os_error(e),
                ));
            }
            // Refused alignment or an interruption: read it again, waiting.
            0
        } else {
            (res as usize).min(r.len)
        };
        if done < r.len {
            // What the read did not bring (rare: a short direct read), read now. Unaligned,
            // so buffered from here on.
            let b = r.buf.bytes_mut();
            let got = self.read_upto(r.offset + done as u64, &mut b[done..r.len])?;
            if done + got < r.len {
                return Err(IoError::Short {
                    op: "read",
                    path: self.inner.path.clone(),
                    offset: r.offset,
                    wanted: r.len as u64,
                    done: (done + got) as u64,
                });
            }
        }
        Ok(Some(crate::ReadAhead {
            buf: r.buf,
            offset: r.offset,
            len: r.len,
        }))
    }
    fn sync(&mut self) -> Result<(), IoError> {
        self.drain_behind()?;
        if let Some(b) = &mut self.behind {
            b.wait_sync(&self.inner.path)?;
            b.check_sync(&self.inner.path)?;
        }
        fdatasync(self.inner.file.as_raw_fd(), &self.inner.path)
    }
    fn start_writeback(&mut self, offset: u64, len: u64) -> Result<(), IoError> {
        crate::fs::start_writeback(&self.inner.file, &self.inner.path, offset, len)
    }
    fn write_behind(
        &mut self,
        offset: u64,
        buf: Box<dyn crate::WriteBuf>,
    ) -> Result<Option<Box<dyn crate::WriteBuf>>, IoError> {
        // Pieces reach the page cache one after another, in file order, as waiting writes
        // did: the previous write (usually long done) completes before this one starts.
        // Concurrent writes of neighbouring pieces, on several io-wq workers, left the page
        // cache in smaller folios.
        {
            let bytes = buf.bytes();
            if !direct_aligned(bytes.as_ptr(), bytes.len(), offset) {
                self.leave_direct()?;
            }
        }
        let previous = match self.drain_behind()? {
            Some(b) => Some(b),
            None => self.returned.take(),
        };
        let direct = self.direct.get();
        let b = match &mut self.behind {
            Some(b) => b,
            None => self.behind.insert(Behind {
                ring: IoUring::new(BEHIND_ENTRIES).map_err(unavailable)?,
                in_flight: None,
                unsynced: 0,
                sync_in_flight: false,
                sync_failed: None,
                syncs_issued: 0,
            }),
        };
        b.absorb();
        b.check_sync(&self.inner.path)?;
        let bytes = buf.bytes();
        let (ptr, len) = (bytes.as_ptr(), bytes.len());
        let Ok(len32) = u32::try_from(len) else {
            // One submission carries at most 4 GiB: write such a buffer at once.
            self.write_at(offset, buf.bytes())?;
            self.start_writeback(offset, len as u64)?;
            return Ok(Some(buf));
        };
        debug_assert!(b.in_flight.is_none());
        let fd = types::Fd(self.inner.file.as_raw_fd());
        let write = opcode::Write::new(fd, ptr, len32)
            .offset(offset)
            .build()
            .flags(io_uring::squeue::Flags::IO_LINK)
            .user_data(UD_WRITE);
        let writeback = opcode::SyncFileRange::new(fd, len32)
            .offset(offset)
            .flags(libc::SYNC_FILE_RANGE_WRITE)
            .build()
            .user_data(UD_WRITEBACK);
        // The pieces before this one completed (drained above): a data sync now makes them
        // durable while this one is written and the next encoded. Not linked: no write waits
        // for it.
        if b.unsynced >= SYNC_BEHIND_BYTES && !b.sync_in_flight {
            let sync = opcode::Fsync::new(fd)
                .flags(types::FsyncFlags::DATASYNC)
                .build()
                .user_data(UD_SYNC);
            // SAFETY: a sync reads no memory of ours; the ring has room (at most one sync and
            // one write with its writeback are ever in flight, BEHIND_ENTRIES is 4).
            if unsafe { b.ring.submission().push(&sync) }.is_ok() {
                b.sync_in_flight = true;
                b.syncs_issued += 1;
                b.unsynced = 0;
            }
        }
        b.unsynced += len as u64;
        // Nothing else is in flight, so the two entries fit.
        // SAFETY: the write reads `len` bytes at `ptr`, the memory of `buf`, which `WriteBuf`'s
        // contract keeps valid and unchanged while `buf` lives; `buf` moves into `in_flight`
        // and is freed only after the write's completion was reaped (or is leaked).
        let pushed = unsafe { b.ring.submission().push_multiple(&[write, writeback]) };
        if pushed.is_err() {
            return Err(IoError::os(
                "write behind",
                &self.inner.path,
                std::io::Error::other("submission queue full"),
            ));
        }
        b.in_flight = Some(InFlight {
            buf,
            offset,
            direct,
            write: None,
            writeback: None,
        });
        // A failed submit leaves the entries queued: `wait_oldest` (in the next call, `sync`
        // or at drop) submits them again, and leaks the buffer if that fails too.
        let _ = b.ring.submit();
        Ok(previous)
    }
    fn wait_behind(&mut self) -> Result<Option<Box<dyn crate::WriteBuf>>, IoError> {
        // The last piece may have completed already, when an unaligned write (a writer's
        // tail) left direct I/O: its buffer is handed back here. It used to be dropped with
        // the file, and every segment writer faulted a fresh 2 MiB buffer in for the next.
        match self.drain_behind()? {
            Some(b) => Ok(Some(b)),
            None => Ok(self.returned.take()),
        }
    }
    fn len(&self) -> Result<u64, IoError> {
        self.inner.len()
    }
}

impl Fs for UringFs {
    fn create(&self, path: &Path) -> Result<Box<dyn FsFile>, IoError> {
        Ok(Box::new(UringFile::new(fs::std_create(path)?)))
    }
    fn create_direct(&self, path: &Path) -> Result<Box<dyn FsFile>, IoError> {
        let f = UringFile::new(fs::std_create(path)?);
        // Refused (tmpfs): the file is written through the page cache, as from `create`.
        f.direct
            .set(set_direct(f.inner.file.as_raw_fd(), true).is_ok());
        Ok(Box::new(f))
    }
    fn open(&self, path: &Path) -> Result<Box<dyn FsFile>, IoError> {
        Ok(Box::new(UringFile::new(fs::std_open(path)?)))
    }
    fn open_direct(&self, path: &Path) -> Result<Box<dyn FsFile>, IoError> {
        let f = UringFile::new(fs::std_open_read(path)?);
        // Refused (a file system without direct I/O): buffered reads, as from `open`.
        f.direct
            .set(set_direct(f.inner.file.as_raw_fd(), true).is_ok());
        Ok(Box::new(f))
    }
    fn rename(&self, from: &Path, to: &Path) -> Result<(), IoError> {
        fs::std_rename(from, to)
    }
    fn sync_dir(&self, dir: &Path) -> Result<(), IoError> {
        fs::std_sync_dir(dir)
    }
    fn remove(&self, path: &Path) -> Result<(), IoError> {
        fs::std_remove(path)
    }
    fn list_dir(&self, dir: &Path) -> Result<Vec<PathBuf>, IoError> {
        fs::std_list_dir(dir)
    }
    fn create_dir_all(&self, dir: &Path) -> Result<(), IoError> {
        fs::std_create_dir_all(dir)
    }
    fn map_readonly(&self, path: &Path) -> Result<Mapped, IoError> {
        Mapped::map(path)
    }
    fn hard_link(&self, src: &Path, dst: &Path) -> Result<(), IoError> {
        // A directory operation, as rename: no data moves, so no ring either.
        fs::std_hard_link(src, dst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uring_large_write_read_round_trip() {
        let Some(fs) = uring_or_skip() else { return };
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("big");
        let mut f = fs.create(&p).unwrap();
        // Not a multiple of the chunk size, so the last piece is partial.
        let data: Vec<u8> = (0..(URING_CHUNK_BYTES * 5 + 12345))
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        f.write_at(0, &data).unwrap();
        f.start_writeback(0, data.len() as u64).unwrap();
        f.write_at(data.len() as u64, b"tail").unwrap();
        f.sync().unwrap();
        assert_eq!(f.len().unwrap(), data.len() as u64 + 4);
        let mut back = vec![0u8; data.len()];
        f.read_at(0, &mut back).unwrap();
        assert!(back == data);
        let mut past = [0u8; 8];
        assert!(matches!(
            f.read_at(data.len() as u64, &mut past),
            Err(IoError::Short { .. })
        ));
        // Another thread gets its own ring.
        let p2 = p.clone();
        std::thread::spawn(move || {
            let f = UringFs::new().unwrap().open(&p2).unwrap();
            let mut b = [0u8; 4];
            f.read_at(5 * URING_CHUNK_BYTES as u64 + 12345, &mut b)
                .unwrap();
            assert_eq!(&b, b"tail");
        })
        .join()
        .unwrap();
    }

    /// io_uring, or `None` where it is unavailable and `WEIR_ALLOW_NO_URING` is set: without
    /// the variable these tests fail rather than pass having checked nothing.
    fn uring_or_skip() -> Option<UringFs> {
        match UringFs::new() {
            Ok(fs) => Some(fs),
            Err(e) => {
                // The probe's error must be the typed one with a hint.
                assert!(matches!(e, IoError::UringUnavailable { .. }), "{e}");
                assert!(
                    std::env::var_os("WEIR_ALLOW_NO_URING").is_some(),
                    "{e} (set WEIR_ALLOW_NO_URING=1 to skip the io_uring tests)"
                );
                eprintln!("skipping: {e}");
                None
            }
        }
    }

    /// Past `SYNC_BEHIND_BYTES` of pieces, a later piece goes out with a data sync of the
    /// earlier ones that nobody waits for; `sync` waits for it, and the file is exact.
    #[test]
    fn write_behind_syncs_earlier_pieces_in_the_background() {
        let Some(_fs) = uring_or_skip() else { return };
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("synced");
        let mut f = UringFile::new(fs::std_create(&p).unwrap());
        let piece = 1 << 20;
        let pieces = 3 * SYNC_BEHIND_BYTES as usize / piece + 1;
        let mut expect = Vec::new();
        for k in 0..pieces {
            let buf: Vec<u8> = (0..piece).map(|i| ((i + 13 * k) % 251) as u8).collect();
            let off = expect.len() as u64;
            expect.extend_from_slice(&buf);
            f.write_behind(off, Box::new(buf)).unwrap();
        }
        let issued = f.behind.as_ref().map_or(0, |b| b.syncs_issued);
        // The first is certain; later ones are skipped while one is still in flight.
        assert!(
            (1..pieces as u64).contains(&issued),
            "{issued} background syncs"
        );
        f.sync().unwrap();
        let b = f.behind.as_ref().unwrap();
        assert!(!b.sync_in_flight, "sync waits for the background sync");
        drop(f);
        assert!(std::fs::read(&p).unwrap() == expect);
    }

    /// A background data sync that failed fails every later `sync` of the file, and the next
    /// write behind: Linux reports a writeback error to one fsync only, so a later fsync's
    /// success would not mean the data is durable. (The error is planted: a real one needs a
    /// failing device.)
    #[test]
    fn a_failed_background_sync_fails_every_later_sync() {
        let Some(_fs) = uring_or_skip() else { return };
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("failed");
        let mut f = UringFile::new(fs::std_create(&p).unwrap());
        f.write_behind(0, Box::new(vec![1u8; 4096])).unwrap();
        f.behind.as_mut().unwrap().sync_failed = Some(libc::EIO);
        for _ in 0..2 {
            let e = f.sync().unwrap_err();
            assert!(e.to_string().contains("fdatasync (behind)"), "{e}");
            assert!(e.to_string().contains(&p.display().to_string()), "{e}");
        }
        assert!(f.write_behind(4096, Box::new(vec![2u8; 4096])).is_err());
    }

    #[test]
    fn write_behind_writes_every_piece_and_hands_buffers_back() {
        let Some(fs) = uring_or_skip() else { return };
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("behind");
        let mut f = fs.create(&p).unwrap();
        let piece =
            |k: usize| -> Vec<u8> { (0..300_001).map(|i| ((i + 7 * k) % 253) as u8).collect() };
        let mut expect = Vec::new();
        let mut spare: Option<Vec<u8>> = None;
        let mut returned = 0;
        for k in 0..9 {
            // Refill a returned buffer, as a writer does.
            let mut buf = spare.take().unwrap_or_default();
            buf.clear();
            buf.extend_from_slice(&piece(k));
            let off = expect.len() as u64;
            expect.extend_from_slice(&buf);
            if let Some(back) = f.write_behind(off, Box::new(buf)).unwrap() {
                returned += 1;
                spare = Some(*back.into_any().downcast::<Vec<u8>>().unwrap());
            }
        }
        // Every write but the last completed by the time the next one was started.
        assert_eq!(returned, 8);
        f.write_at(expect.len() as u64, b"tail").unwrap();
        expect.extend_from_slice(b"tail");
        // sync waits for the write still in flight.
        f.sync().unwrap();
        assert!(f.wait_behind().unwrap().is_none());
        assert!(std::fs::read(&p).unwrap() == expect);
    }

    /// A page-aligned buffer, as the segment writer's mapped ones.
    struct Aligned(memmap2::MmapMut);

    // SAFETY: an anonymous map neither moves nor changes while nobody writes through it.
    unsafe impl crate::WriteBuf for Aligned {
        fn bytes(&self) -> &[u8] {
            &self.0
        }
        fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
            self
        }
    }

    // SAFETY: an anonymous map does not move while it lives, and only its owner touches it.
    unsafe impl crate::ReadBuf for Aligned {
        fn bytes_mut(&mut self) -> &mut [u8] {
            &mut self.0
        }
        fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
            self
        }
    }

    /// Reads ahead land whole, up to the end of the file, in the buffer they own, through the
    /// ring in the background when direct reads are possible, and at once otherwise; a second
    /// read ahead drops the first.
    #[test]
    fn reads_ahead_return_their_buffer_filled() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("data");
        let data: Vec<u8> = (0..5 * DIRECT_ALIGN + 77)
            .map(|i| (i * 13 % 251) as u8)
            .collect();
        std::fs::write(&p, &data).unwrap();
        let buf = |pages: usize| {
            Box::new(Aligned(
                memmap2::MmapMut::map_anon(pages * DIRECT_ALIGN).unwrap(),
            ))
        };
        let bytes = |r: crate::ReadAhead| -> Vec<u8> {
            let a = r.buf.into_any().downcast::<Aligned>().unwrap();
            a.0[..r.len].to_vec()
        };
        let mut fss: Vec<Box<dyn Fs>> = vec![Box::new(crate::StdFs)];
        if let Some(u) = uring_or_skip() {
            fss.push(Box::new(u));
        }
        let direct_ok = opens_direct(&p);
        for (i, fs) in fss.iter().enumerate() {
            let mut f = fs.open_direct(&p).unwrap();
            let started = f.read_ahead(DIRECT_ALIGN as u64, buf(2)).unwrap();
            if i == 1 && direct_ok {
                assert!(started.is_none(), "io_uring reads ahead in the background");
            }
            let r = match started {
                Some(r) => r,
                None => f.wait_ahead().unwrap().expect("the read in flight"),
            };
            assert_eq!((r.offset, r.len), (DIRECT_ALIGN as u64, 2 * DIRECT_ALIGN));
            assert!(bytes(r) == data[DIRECT_ALIGN..3 * DIRECT_ALIGN]);
            assert!(
                f.wait_ahead().unwrap().is_none(),
                "nothing is left in flight"
            );
            // The tail: the last partial page, and nothing past the end.
            let at = 4 * DIRECT_ALIGN as u64;
            let r = match f.read_ahead(at, buf(4)).unwrap() {
                Some(r) => r,
                None => f.wait_ahead().unwrap().unwrap(),
            };
            assert_eq!(r.len, DIRECT_ALIGN + 77);
            assert!(bytes(r) == data[4 * DIRECT_ALIGN..]);
            let past = f.read_ahead(data.len() as u64, buf(1)).unwrap().unwrap();
            assert_eq!(past.len, 0);
            // Two in a row: the first is dropped, the second arrives.
            let first = f.read_ahead(0, buf(1)).unwrap();
            let second = match f.read_ahead(2 * DIRECT_ALIGN as u64, buf(1)).unwrap() {
                Some(r) => r,
                None => f.wait_ahead().unwrap().unwrap(),
            };
            drop(first);
            assert_eq!(second.offset, 2 * DIRECT_ALIGN as u64);
            assert!(bytes(second) == data[2 * DIRECT_ALIGN..3 * DIRECT_ALIGN]);
            // A read ahead left in flight is waited for when the file drops (through io_uring
            // it is in flight here, so the drop's wait runs).
            let left = f.read_ahead(0, buf(3)).unwrap();
            if i == 1 && direct_ok {
                assert!(left.is_none(), "the read is in flight when the file drops");
            }
            drop(f);
        }
    }

    /// Whether the file system of `p` (an existing file) opens it for direct reads.
    fn opens_direct(p: &Path) -> bool {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(p)
            .is_ok()
    }

    /// Which pages of the file at `p` are in the page cache.
    fn resident(p: &Path) -> Vec<bool> {
        let file = std::fs::File::open(p).unwrap();
        // SAFETY: read-only map of a file nobody writes while it lives (this test's own).
        let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
        let pages = map.len().div_ceil(DIRECT_ALIGN);
        let mut v = vec![0u8; pages];
        // SAFETY: `map` covers `map.len()` bytes from a page-aligned start; `v` has one byte
        // per page of that range.
        let r = unsafe { libc::mincore(map.as_ptr() as *mut _, map.len(), v.as_mut_ptr()) };
        assert_eq!(r, 0, "mincore: {}", std::io::Error::last_os_error());
        v.iter().map(|b| b & 1 == 1).collect()
    }

    /// A writer's sequence: aligned pieces written behind, an unaligned tail, then the wait
    /// for what is behind, which hands back the last piece's buffer whether the tail's switch
    /// out of direct I/O already waited for it or not.
    #[test]
    fn wait_behind_hands_back_the_last_piece_after_an_unaligned_tail() {
        let Some(fs) = uring_or_skip() else { return };
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("tail");
        let mut f = fs.create_direct(&p).unwrap();
        let piece = 64 << 10;
        let mut back = 0;
        for k in 0..3u8 {
            let mut m = memmap2::MmapMut::map_anon(piece).unwrap();
            m.fill(k + 1);
            let off = (usize::from(k) * piece) as u64;
            back += usize::from(f.write_behind(off, Box::new(Aligned(m))).unwrap().is_some());
        }
        f.write_at(3 * piece as u64, b"tail").unwrap();
        let last = f.wait_behind().unwrap();
        assert_eq!(back, 2);
        assert!(last.is_some(), "the last piece's buffer comes back");
        assert!(f.wait_behind().unwrap().is_none(), "and only once");
        f.sync().unwrap();
        let data = std::fs::read(&p).unwrap();
        assert_eq!(data.len(), 3 * piece + 4);
        assert!(data[2 * piece..3 * piece].iter().all(|&b| b == 3));
        assert_eq!(&data[3 * piece..], b"tail");
    }

    #[test]
    fn direct_files_write_aligned_pieces_past_the_page_cache() {
        let Some(fs) = uring_or_skip() else { return };
        let dir = tempfile::tempdir().unwrap();
        let probe = dir.path().join("probe");
        let direct_ok = {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .custom_flags(libc::O_DIRECT)
                .open(&probe)
                .is_ok()
        };
        let p = dir.path().join("direct");
        let mut f = fs.create_direct(&p).unwrap();
        let piece = 64 << 10;
        let mut expect = Vec::new();
        let mut returned = 0;
        for k in 0..6u8 {
            let mut m = memmap2::MmapMut::map_anon(piece).unwrap();
            m.fill(k + 1);
            expect.extend_from_slice(&m);
            let off = (usize::from(k) * piece) as u64;
            returned += usize::from(f.write_behind(off, Box::new(Aligned(m))).unwrap().is_some());
        }
        assert_eq!(returned, 5);
        // An unaligned write ends the bypass; the piece in flight is handed back next.
        f.write_at(expect.len() as u64, b"tail").unwrap();
        expect.extend_from_slice(b"tail");
        let off = expect.len() as u64;
        let back = f.write_behind(off, Box::new(vec![9u8; 5000])).unwrap();
        assert!(back.is_some(), "the drained piece's buffer comes back");
        expect.extend_from_slice(&[9u8; 5000]);
        f.sync().unwrap();
        // Before anything reads the file in.
        let pages = resident(&p);
        let direct_pages = 6 * piece / DIRECT_ALIGN;
        if direct_ok {
            assert!(
                pages[..direct_pages].iter().all(|r| !r),
                "direct pieces went through the page cache"
            );
        } else {
            eprintln!("no O_DIRECT on this file system: buffered throughout");
        }
        // What followed the unaligned write went through the page cache.
        assert!(pages[direct_pages..].iter().all(|r| *r));
        assert!(std::fs::read(&p).unwrap() == expect);
    }

    #[test]
    fn direct_reads_stop_at_the_end_of_the_file_and_skip_the_page_cache() {
        let Some(fs) = uring_or_skip() else { return };
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("data");
        // Three whole pages and a partial one.
        let data: Vec<u8> = (0..3 * DIRECT_ALIGN + 100)
            .map(|i| (i * 7 % 253) as u8)
            .collect();
        std::fs::write(&p, &data).unwrap();
        let f = std::fs::File::open(&p).unwrap();
        // Clean pages only leave the page cache: written back first.
        f.sync_all().unwrap();
        // SAFETY: plain advice about the page cache; `f` is open.
        let r = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        assert_eq!(r, 0);
        let direct_ok = opens_direct(&p);
        let f = fs.open_direct(&p).unwrap();
        let mut buf = memmap2::MmapMut::map_anon(4 * DIRECT_ALIGN).unwrap();
        assert_eq!(f.read_upto(0, &mut buf).unwrap(), data.len());
        assert!(buf[..data.len()] == data[..]);
        // From a page in the middle: up to the end of the file, partial page included.
        let mut small = memmap2::MmapMut::map_anon(2 * DIRECT_ALIGN).unwrap();
        let at = DIRECT_ALIGN as u64;
        assert_eq!(f.read_upto(at, &mut small).unwrap(), 2 * DIRECT_ALIGN);
        assert!(small[..] == data[DIRECT_ALIGN..3 * DIRECT_ALIGN]);
        assert_eq!(f.read_upto(2 * at, &mut small).unwrap(), DIRECT_ALIGN + 100);
        assert!(small[..DIRECT_ALIGN + 100] == data[2 * DIRECT_ALIGN..]);
        assert_eq!(f.read_upto(data.len() as u64, &mut small).unwrap(), 0);
        assert_eq!(f.read_upto(1 << 20, &mut small).unwrap(), 0);
        if direct_ok {
            // The reads above were direct: the page cache holds none of the file.
            assert!(resident(&p).iter().all(|r| !r), "a direct read was cached");
        }
        // An unaligned read is buffered, and the reads after it too; all stay correct.
        let mut odd = vec![0u8; 5000];
        assert_eq!(f.read_upto(3, &mut odd).unwrap(), 5000);
        assert!(odd[..] == data[3..5003]);
        assert_eq!(f.read_upto(0, &mut buf).unwrap(), data.len());
        assert!(buf[..data.len()] == data[..]);
    }

    #[test]
    fn write_behind_reports_a_failed_write() {
        let Some(fs) = uring_or_skip() else { return };
        // Writes to /dev/full fail with ENOSPC.
        let Ok(mut f) = fs.open(Path::new("/dev/full")) else {
            eprintln!("skipping: no /dev/full");
            return;
        };
        let first = f.write_behind(0, Box::new(vec![1u8; 4096]));
        let err = match first {
            Err(e) => e,
            Ok(_) => match f.wait_behind() {
                Err(e) => e,
                Ok(_) => panic!("a write to /dev/full must fail"),
            },
        };
        match &err {
            IoError::Os { op, path, source } => {
                assert!(op.contains("write"), "{err}");
                assert_eq!(path, Path::new("/dev/full"));
                assert_eq!(source.raw_os_error(), Some(libc::ENOSPC), "{err}");
            }
            other => panic!("not an OS error naming the write: {other:?}"),
        }
        // A failure is reported once: the failed write is no longer in flight, and the file
        // is usable for the caller's cleanup.
        assert!(f.wait_behind().unwrap().is_none());
        drop(f);
    }

    #[test]
    fn a_file_dropped_with_a_write_in_flight_waits_for_it() {
        let Some(fs) = uring_or_skip() else { return };
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("dropped");
        let mut f = fs.create(&p).unwrap();
        let data = vec![0xa5u8; 4 << 20];
        assert!(f.write_behind(0, Box::new(data.clone())).unwrap().is_none());
        drop(f);
        assert!(std::fs::read(&p).unwrap() == data);
    }
}
