//! Frame header layout, frame kinds, the [`FrameWriter`] and the [`Frames`] iterator.

use std::marker::PhantomData;

use crate::ring::WriteRegion;

/// Size of a frame header in bytes.
pub const HEADER_BYTES: usize = 16;
/// Alignment of every frame (header start) and therefore of every payload.
pub const FRAME_ALIGN: usize = 16;

/// Byte offset of `len: u32` in the header.
pub const OFF_LEN: usize = 0;
/// Byte offset of `kind: u8` in the header.
pub const OFF_KIND: usize = 4;
/// Byte offset of `flags: u8` in the header.
pub const OFF_FLAGS: usize = 5;
/// Byte offset of `key_group: u16` in the header.
pub const OFF_KEY_GROUP: usize = 6;
/// Byte offset of `timestamp_or_arg: i64` in the header.
pub const OFF_TS: usize = 8;

/// Kind byte of a wrap marker: the rest of the buffer up to its end is padding, the next frame
/// starts at buffer offset 0. Written only by the ring itself, never yielded by [`Frames`].
pub const KIND_WRAP: u8 = 0xFF;

/// Rounds `n` up to a multiple of [`FRAME_ALIGN`].
#[inline]
pub const fn pad16(n: usize) -> usize {
    (n + (FRAME_ALIGN - 1)) & !(FRAME_ALIGN - 1)
}

/// Total ring bytes a frame with a `payload_len`-byte payload occupies (header + padded payload).
#[inline]
pub const fn frame_bytes(payload_len: usize) -> usize {
    HEADER_BYTES + pad16(payload_len)
}

/// What a frame carries. The byte values are part of the in-flight-data format (unaligned
/// checkpoints persist ring bytes), so they never change.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameKind {
    /// A data record; `ts` is its event time, `payload` its rkyv archive.
    Record = 1,
    /// A watermark; `ts` is its value.
    Watermark = 2,
    /// A checkpoint barrier; `ts` is the barrier (checkpoint) id.
    Barrier = 3,
    /// End of stream from this producer.
    EndOfStream = 4,
    /// A runtime control message; `ts` is a free argument.
    UserControl = 5,
}

impl FrameKind {
    /// Decodes a kind byte; `None` for unknown bytes and for [`KIND_WRAP`].
    #[inline]
    pub const fn from_u8(b: u8) -> Option<Self> {
        match b {
            1 => Some(Self::Record),
            2 => Some(Self::Watermark),
            3 => Some(Self::Barrier),
            4 => Some(Self::EndOfStream),
            5 => Some(Self::UserControl),
            _ => None,
        }
    }
}

/// The fields of a frame header other than `len`, which the writer fills in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// What the frame carries.
    pub kind: FrameKind,
    /// Free flag bits (none defined by the ring).
    pub flags: u8,
    /// Key group of a record (0 for other kinds).
    pub key_group: u16,
    /// Event time, watermark value or barrier id, by kind.
    pub ts: i64,
}

impl Header {
    /// A record header.
    #[inline]
    pub const fn record(key_group: u16, event_time: i64) -> Self {
        Self {
            kind: FrameKind::Record,
            flags: 0,
            key_group,
            ts: event_time,
        }
    }
    /// A watermark header.
    #[inline]
    pub const fn watermark(value: i64) -> Self {
        Self {
            kind: FrameKind::Watermark,
            flags: 0,
            key_group: 0,
            ts: value,
        }
    }
    /// A barrier header (the id is stored as the `i64` bit pattern).
    #[inline]
    pub const fn barrier(barrier_id: u64) -> Self {
        Self {
            kind: FrameKind::Barrier,
            flags: 0,
            key_group: 0,
            ts: barrier_id as i64,
        }
    }
    /// An end-of-stream header.
    #[inline]
    pub const fn end_of_stream() -> Self {
        Self {
            kind: FrameKind::EndOfStream,
            flags: 0,
            key_group: 0,
            ts: 0,
        }
    }
    /// A control header with a free argument.
    #[inline]
    pub const fn user_control(arg: i64) -> Self {
        Self {
            kind: FrameKind::UserControl,
            flags: 0,
            key_group: 0,
            ts: arg,
        }
    }
    /// The same header with `flags` set.
    #[inline]
    pub const fn with_flags(mut self, flags: u8) -> Self {
        self.flags = flags;
        self
    }

    /// The 16 header bytes for a payload of `payload_len` bytes.
    #[inline]
    pub fn encode(&self, payload_len: u32) -> [u8; HEADER_BYTES] {
        encode_raw(
            payload_len,
            self.kind as u8,
            self.flags,
            self.key_group,
            self.ts,
        )
    }
}

#[inline]
pub(crate) fn encode_raw(len: u32, kind: u8, flags: u8, key_group: u16, ts: i64) -> [u8; 16] {
    let word0 = u64::from(len)
        | u64::from(kind) << 32
        | u64::from(flags) << 40
        | u64::from(key_group) << 48;
    let mut out = [0u8; HEADER_BYTES];
    out[..8].copy_from_slice(&word0.to_le_bytes());
    out[8..].copy_from_slice(&ts.to_le_bytes());
    out
}

/// One frame read from ring memory. `payload` starts 16-aligned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Frame<'a> {
    /// What the frame carries.
    pub kind: FrameKind,
    /// Flag bits.
    pub flags: u8,
    /// Key group (records).
    pub key_group: u16,
    /// Event time, watermark value or barrier id.
    pub ts: i64,
    /// The payload, unpadded (`len` bytes), 16-aligned in memory.
    pub payload: &'a [u8],
}

impl Frame<'_> {
    /// The barrier id if this is a barrier frame.
    #[inline]
    pub fn barrier_id(&self) -> Option<u64> {
        (self.kind == FrameKind::Barrier).then_some(self.ts as u64)
    }
}

/// Iterator over the whole frames of a byte slice of ring memory (a [`crate::ReadRegion`] or a
/// [`crate::Consumer::peek_range`] slice). Stops at the end of the slice or at a wrap marker.
///
/// The bytes must be frames written through this crate (the ring never exposes anything
/// else); a malformed header is a broken invariant and panics. Bytes from disk are validated
/// by their reader (CRC) before they are handed to this iterator.
#[derive(Clone, Debug)]
pub struct Frames<'a> {
    /// Start of the slice.
    start: *const u8,
    /// Next header; `start <= cur <= end`.
    cur: *const u8,
    /// One past the end of the slice.
    end: *const u8,
    _bytes: PhantomData<&'a [u8]>,
}

// SAFETY: `Frames` is a borrowed `&'a [u8]` in pointer form (start, cursor, end); it only
// reads through them, so it may cross or be shared between threads exactly like `&[u8]`.
unsafe impl Send for Frames<'_> {}
// SAFETY: as above; `&Frames` allows no access at all beyond reading the pointers.
unsafe impl Sync for Frames<'_> {}

impl<'a> Frames<'a> {
    /// Iterates the frames in `bytes`, which must start at a frame boundary.
    #[inline]
    pub fn new(bytes: &'a [u8]) -> Self {
        let range = bytes.as_ptr_range();
        Self {
            start: range.start,
            cur: range.start,
            end: range.end,
            _bytes: PhantomData,
        }
    }

    /// Bytes of the slice consumed by the frames yielded so far (plus a wrap marker's padding
    /// once the iterator has met it). Passing this to [`crate::ReadRegion::release`] releases
    /// exactly the frames already seen.
    #[inline]
    pub fn consumed(&self) -> usize {
        self.cur as usize - self.start as usize
    }

    /// A wrap marker ends the iteration; anything else is a broken invariant.
    #[cold]
    #[inline(never)]
    fn not_a_frame(&mut self, kind_byte: u8) {
        assert!(
            kind_byte == KIND_WRAP,
            "ring frames: bad kind byte {kind_byte:#x} at offset {}",
            self.consumed()
        );
        self.cur = self.end;
    }
}

/// How far ahead of the frame being read [`Frames`] asks for the bytes it will read next,
/// within what was committed (never beyond: lines the producer is still writing would
/// bounce between the cores).
const READ_AHEAD_BYTES: usize = 512;

/// A hint to load the cache line at `p`; it reads nothing and cannot fault.
#[inline(always)]
fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint: it accesses no memory architecturally and cannot fault,
    // whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

impl<'a> Iterator for Frames<'a> {
    type Item = Frame<'a>;

    #[inline]
    fn next(&mut self) -> Option<Frame<'a>> {
        let rest = self.end as usize - self.cur as usize;
        if rest < HEADER_BYTES {
            assert!(rest == 0, "ring frames: {rest} trailing bytes");
            return None;
        }
        let h = self.cur;
        if rest > READ_AHEAD_BYTES {
            // Where the next header is depends on this one's length, so frame after frame
            // the reads form one chain of misses on lines another core wrote; a request for
            // the bytes a few frames on overlaps them.
            prefetch(h.wrapping_add(READ_AHEAD_BYTES));
        }
        // SAFETY: `h + HEADER_BYTES <= end` (checked above), so both 8-byte reads are inside
        // the borrowed slice; `read_unaligned` needs no alignment (slices from disk may have none).
        let (word0, ts) = unsafe {
            (
                u64::from_le(h.cast::<u64>().read_unaligned()),
                i64::from_le(h.add(8).cast::<i64>().read_unaligned()),
            )
        };
        let len = (word0 & 0xFFFF_FFFF) as usize;
        let kind_byte = (word0 >> 32) as u8;
        let Some(kind) = FrameKind::from_u8(kind_byte) else {
            self.not_a_frame(kind_byte);
            return None;
        };
        // In u64 so that a corrupt length cannot overflow on 32-bit targets.
        let total = HEADER_BYTES as u64 + ((len as u64 + 15) & !15);
        assert!(
            total <= rest as u64,
            "ring frames: frame of {total} bytes overruns the slice"
        );
        let total = total as usize;
        // SAFETY: `[h + 16, h + 16 + len)` and the new `cur = h + total` lie inside
        // `[h, h + rest]`, i.e. inside the borrowed slice (checked just above).
        let payload = unsafe {
            self.cur = h.add(total);
            std::slice::from_raw_parts(h.add(HEADER_BYTES), len)
        };
        Some(Frame {
            kind,
            flags: (word0 >> 40) as u8,
            key_group: (word0 >> 48) as u16,
            ts,
            payload,
        })
    }
}

/// The region has no room for this frame; commit what was written and reserve again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NoSpace;

impl std::fmt::Display for NoSpace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("no space left in the reserved ring region")
    }
}
impl std::error::Error for NoSpace {}

/// Why [`FrameWriter::push_with`] wrote nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PushWithError<E> {
    /// Fewer than [`HEADER_BYTES`] bytes are left in the region.
    NoSpace,
    /// The payload closure failed (for rkyv into a fixed buffer: it ran out of space).
    Payload(E),
}

/// Writes frames one after another into a [`WriteRegion`]; [`FrameWriter::commit`] publishes
/// all of them with one release store. Dropping the writer without committing publishes nothing.
pub struct FrameWriter<'a> {
    region: WriteRegion<'a>,
    pos: usize,
}

impl<'a> FrameWriter<'a> {
    #[inline]
    pub(crate) fn new(region: WriteRegion<'a>) -> Self {
        Self { region, pos: 0 }
    }

    /// Bytes still free in the region (header + padded payload of further frames).
    #[inline]
    pub fn remaining(&self) -> usize {
        self.region.len() - self.pos
    }

    /// Bytes of frames written so far.
    #[inline]
    pub fn bytes_written(&self) -> usize {
        self.pos
    }

    /// Appends one frame with a copy of `payload`; padding bytes are zeroed.
    #[inline]
    pub fn push(&mut self, header: Header, payload: &[u8]) -> Result<(), NoSpace> {
        let len = payload.len();
        let total = frame_bytes(len);
        if total > self.remaining() {
            return Err(NoSpace);
        }
        let hdr = header.encode(len as u32); // len < total <= capacity <= 1 GiB: fits u32
        let dst = self.region.as_mut_ptr();
        // SAFETY: `[pos, pos + total)` is inside the region (checked above), which is writable
        // ring memory exclusively ours while the region lives (see `WriteRegion::as_mut_slice`);
        // `payload` is a shared slice, so it cannot overlap the region we hold mutably.
        unsafe {
            let dst = dst.add(self.pos);
            std::ptr::copy_nonoverlapping(hdr.as_ptr(), dst, HEADER_BYTES);
            std::ptr::copy_nonoverlapping(payload.as_ptr(), dst.add(HEADER_BYTES), len);
            let pad = total - HEADER_BYTES - len;
            if pad != 0 {
                std::ptr::write_bytes(dst.add(HEADER_BYTES + len), 0, pad);
            }
        }
        self.pos += total;
        Ok(())
    }

    /// Appends one frame whose payload `fill` writes in place (for example rkyv serializing
    /// straight into ring memory). `fill` gets the whole free area after the header, 16-aligned,
    /// and returns the payload length it wrote. On error nothing is appended.
    #[inline]
    pub fn push_with<E>(
        &mut self,
        header: Header,
        fill: impl FnOnce(&mut [u8]) -> Result<usize, E>,
    ) -> Result<(), PushWithError<E>> {
        if self.remaining() < HEADER_BYTES {
            return Err(PushWithError::NoSpace);
        }
        let pos = self.pos;
        let area = &mut self.region.as_mut_slice()[pos..];
        let len = fill(&mut area[HEADER_BYTES..]).map_err(PushWithError::Payload)?;
        let total = frame_bytes(len);
        assert!(
            total <= area.len(),
            "push_with: payload of {len} bytes exceeds the area it was given"
        );
        let len32 = u32::try_from(len).expect("payload fits u32 (frames are at most capacity/2)");
        area[..HEADER_BYTES].copy_from_slice(&header.encode(len32));
        area[HEADER_BYTES + len..total].fill(0);
        self.pos += total;
        Ok(())
    }

    /// Publishes every frame written (one release store). Returns the bytes published.
    #[inline]
    pub fn commit(self) -> usize {
        let n = self.pos;
        self.region.commit(n);
        n
    }

    /// Commits every frame written without publishing it yet: the producer's next
    /// [`crate::Producer::publish`] makes a whole batch visible at once. Returns the bytes.
    #[inline]
    pub fn commit_deferred(self) -> usize {
        let n = self.pos;
        self.region.commit_deferred(n);
        n
    }
}
