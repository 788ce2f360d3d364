//! The ring itself: shared state, [`Producer`], [`Consumer`] and their regions.
//! See the crate docs for the protocol and the memory-ordering argument.

use std::alloc::{self, Layout};

use crate::frame::{
    self, FrameWriter, Frames, Header, FRAME_ALIGN, HEADER_BYTES, KIND_WRAP, OFF_KIND,
};
use crate::sync::{fence, Arc, AtomicBool, AtomicU64, CachePadded, Ordering};

/// Smallest accepted capacity. Under `--cfg loom` it is 64 bytes so a model can wrap cheaply.
#[cfg(not(loom))]
pub const MIN_CAPACITY: usize = 4096;
/// Smallest accepted capacity. Under `--cfg loom` it is 64 bytes so a model can wrap cheaply.
#[cfg(loom)]
pub const MIN_CAPACITY: usize = 64;
/// Largest accepted capacity (1 GiB).
pub const MAX_CAPACITY: usize = 1 << 30;
/// Alignment of the ring buffer allocation (a cache line; frames need 16).
pub const BUFFER_ALIGN: usize = 64;

/// A frame or reservation larger than the ring can ever hold contiguously
/// ([`Producer::max_frame_bytes`], capacity / 2). Waiting would hang, so it is an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameTooLarge {
    /// Bytes asked for.
    pub requested_bytes: usize,
    /// Largest reservation this ring grants.
    pub max_bytes: usize,
}

impl std::fmt::Display for FrameTooLarge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ring frame of {} bytes exceeds the ring's largest frame of {} bytes (capacity / 2)",
            self.requested_bytes, self.max_bytes
        )
    }
}
impl std::error::Error for FrameTooLarge {}

/// Rarely written producer-side state: end of stream and the barrier announcement seqlock.
struct Side {
    closed: AtomicBool,
    /// Seqlock sequence: odd while the producer writes, `2 * announcements` when stable.
    ann_seq: AtomicU64,
    ann_barrier: AtomicU64,
    ann_position: AtomicU64,
}

struct Shared {
    /// Committed write position. Stored (Release) only by the producer, after the bytes it
    /// publishes; loaded (Acquire) by the consumer before it reads them.
    tail: CachePadded<AtomicU64>,
    /// Released read position. Stored (Release) only by the consumer, after it has finished
    /// reading the bytes it frees; loaded (Acquire) by the producer before it overwrites them.
    head: CachePadded<AtomicU64>,
    side: CachePadded<Side>,
    buf: *mut u8,
    cap: usize,
    #[cfg(loom)]
    slots: crate::sync::SlotCells,
}

// SAFETY: `Shared` is the state both ends point to. Its atomics are thread-safe; the buffer
// behind `buf` is only read and written through the producer and consumer, whose accesses to
// any byte are ordered by the tail/head Release/Acquire protocol (see the crate docs). Nothing
// in `Shared` itself touches the buffer except `Drop`, which runs once, after both ends are gone.
unsafe impl Send for Shared {}
// SAFETY: as above; `&Shared` only exposes atomics.
unsafe impl Sync for Shared {}

impl Shared {
    fn layout(cap: usize) -> Layout {
        Layout::from_size_align(cap, BUFFER_ALIGN).expect("ring layout")
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // SAFETY: `buf` was allocated in `ring` with exactly this layout and is freed only
        // here, when the last of the producer and the consumer is gone.
        unsafe { alloc::dealloc(self.buf, Self::layout(self.cap)) }
    }
}

/// Creates a ring of `capacity_bytes` (a power of two in `MIN_CAPACITY..=MAX_CAPACITY`).
///
/// # Panics
/// On a capacity that is not a power of two or out of range (a programmer error).
pub fn ring(capacity_bytes: usize) -> (Producer, Consumer) {
    assert!(
        capacity_bytes.is_power_of_two()
            && (MIN_CAPACITY..=MAX_CAPACITY).contains(&capacity_bytes),
        "ring capacity must be a power of two in {MIN_CAPACITY}..={MAX_CAPACITY}, got {capacity_bytes}"
    );
    let layout = Shared::layout(capacity_bytes);
    // SAFETY: the layout has a non-zero size (at least MIN_CAPACITY bytes). Zeroed memory makes
    // every byte initialized, so `&[u8]`/`&mut [u8]` views of any part of it are valid.
    let buf = unsafe { alloc::alloc_zeroed(layout) };
    if buf.is_null() {
        alloc::handle_alloc_error(layout);
    }
    let shared = Arc::new(Shared {
        tail: CachePadded(AtomicU64::new(0)),
        head: CachePadded(AtomicU64::new(0)),
        side: CachePadded(Side {
            closed: AtomicBool::new(false),
            ann_seq: AtomicU64::new(0),
            ann_barrier: AtomicU64::new(0),
            ann_position: AtomicU64::new(0),
        }),
        buf,
        cap: capacity_bytes,
        #[cfg(loom)]
        slots: crate::sync::SlotCells::new(capacity_bytes / FRAME_ALIGN),
    });
    let producer = Producer {
        shared: Arc::clone(&shared),
        buf,
        cap: capacity_bytes,
        mask: capacity_bytes - 1,
        tail: 0,
        published: 0,
        cached_head: 0,
        closed: false,
    };
    let consumer = Consumer {
        shared,
        buf,
        cap: capacity_bytes,
        mask: capacity_bytes - 1,
        head: 0,
        cached_tail: 0,
    };
    (producer, consumer)
}

/// The writing end. `Send`, not `Sync`, not `Clone`: exactly one thread writes.
///
/// ```compile_fail
/// fn sync<T: Sync>() {}
/// sync::<weir_ring::Producer>();
/// ```
pub struct Producer {
    shared: Arc<Shared>,
    buf: *mut u8,
    cap: usize,
    mask: usize,
    /// Committed write position: at least `shared.tail`, which only this side stores; more
    /// while deferred commits wait for [`Producer::publish`].
    tail: u64,
    /// The tail last stored to `shared.tail`.
    published: u64,
    /// Last head loaded from `shared.head`; at most the real head, so free space is never
    /// overestimated.
    cached_head: u64,
    closed: bool,
}

// SAFETY: the producer owns its `Arc<Shared>` reference and a raw pointer into the shared
// buffer. It writes only bytes in `[tail, head + cap)`, which the consumer does not read until
// the producer's Release store of `tail` (and which it stops reading before its Release store
// of `head`), so moving the producer to another thread cannot create unsynchronized access.
// It is not `Sync`: two threads calling `reserve` through `&`-sharing is impossible anyway
// (it takes `&mut self`), and `announce` must come from the single writer.
unsafe impl Send for Producer {}

impl Producer {
    /// Ring capacity in bytes.
    #[inline]
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Largest reservation (and so frame) the ring grants: capacity / 2, which a drained ring
    /// can always offer contiguously, wherever its positions stand.
    #[inline]
    pub fn max_frame_bytes(&self) -> usize {
        self.cap / 2
    }

    /// A contiguous, 16-aligned writable region of at least `min_bytes` (rounded up to 16),
    /// or `Ok(None)` when the ring has not that much room (backpressure: retry later, nothing is
    /// dropped). The region offers all contiguous free space, so one reservation can take a
    /// whole batch of frames. When the space left before the end of the buffer is too short,
    /// the producer skips it (a wrap marker is written there on commit) and the region starts at
    /// buffer offset 0.
    ///
    /// # Errors
    /// [`FrameTooLarge`] when `min_bytes` exceeds [`Producer::max_frame_bytes`].
    ///
    /// # Panics
    /// After [`Producer::close`].
    #[inline]
    pub fn reserve(&mut self, min_bytes: usize) -> Result<Option<WriteRegion<'_>>, FrameTooLarge> {
        let min = frame::pad16(min_bytes.max(1));
        if min > self.max_frame_bytes() {
            return Err(FrameTooLarge {
                requested_bytes: min_bytes,
                max_bytes: self.max_frame_bytes(),
            });
        }
        assert!(!self.closed, "ring: reserve after close");
        let idx = (self.tail as usize) & self.mask;
        let to_end = self.cap - idx;
        let skip = if to_end >= min { 0 } else { to_end };
        let need = (skip + min) as u64;
        let cap = self.cap as u64;
        let mut free = cap - (self.tail - self.cached_head);
        if free < need {
            // Acquire: the consumer's reads of the bytes it released happen-before our writes.
            self.cached_head = self.shared.head.load(Ordering::Acquire);
            free = cap - (self.tail - self.cached_head);
            if free < need {
                return Ok(None);
            }
        }
        let free = free as usize;
        let (start, len) = if skip == 0 {
            (idx, to_end.min(free))
        } else {
            (0, free - skip)
        };
        debug_assert!(len >= min && start % FRAME_ALIGN == 0 && start + len <= self.cap);
        Ok(Some(WriteRegion {
            #[cfg(loom)]
            guards: self.shared.slots.write(start, len),
            producer: self,
            start,
            len,
            skip,
        }))
    }

    /// [`Producer::reserve`] wrapped in a [`FrameWriter`].
    ///
    /// # Errors
    /// As [`Producer::reserve`].
    #[inline]
    pub fn writer(&mut self, min_bytes: usize) -> Result<Option<FrameWriter<'_>>, FrameTooLarge> {
        Ok(self.reserve(min_bytes)?.map(WriteRegion::into_writer))
    }

    /// Writes and publishes one frame. `Ok(false)` when the ring is full (retry later).
    ///
    /// # Errors
    /// [`FrameTooLarge`] when the frame exceeds [`Producer::max_frame_bytes`].
    #[inline]
    pub fn push(&mut self, header: Header, payload: &[u8]) -> Result<bool, FrameTooLarge> {
        let total = frame::frame_bytes(payload.len());
        let Some(mut w) = self.writer(total)? else {
            return Ok(false);
        };
        w.push(header, payload)
            .expect("reserved region holds the frame");
        w.commit();
        Ok(true)
    }

    /// Makes every deferred commit visible to the consumer (one Release store; nothing when
    /// nothing is pending).
    #[inline]
    pub fn publish(&mut self) {
        if self.tail != self.published {
            self.published = self.tail;
            // Release: every byte committed before happens-before the consumer's Acquire load
            // that sees this tail.
            self.shared.tail.store(self.tail, Ordering::Release);
        }
    }

    /// Free bytes right now (loads the consumer's head; informational, not a reservation).
    #[inline]
    pub fn free_bytes(&self) -> usize {
        let head = self.shared.head.load(Ordering::Acquire);
        self.cap - (self.tail - head) as usize
    }

    /// Monotonic committed write position in bytes (never wraps; includes wrap padding).
    #[inline]
    pub fn write_position(&self) -> u64 {
        self.tail
    }

    /// Announces that barrier `barrier_id` was emitted at write position `position` (normally
    /// [`Producer::write_position`] right after committing the barrier frame or right before
    /// it). A consumer sees only the latest announcement; barrier frames still travel in-band.
    ///
    /// # Panics
    /// If `position` is beyond the committed write position, or `barrier_id` does not grow.
    pub fn announce(&mut self, barrier_id: u64, position: u64) {
        // The announced bytes must be visible: a consumer that sees the announcement peeks up
        // to its position.
        self.publish();
        assert!(
            position <= self.tail,
            "ring: announce position {position} beyond write position {}",
            self.tail
        );
        let side = &self.shared.side;
        // Only this side writes the seqlock, so Relaxed loads of our own stores are exact.
        let seq = side.ann_seq.load(Ordering::Relaxed);
        if seq != 0 {
            let last = side.ann_barrier.load(Ordering::Relaxed);
            assert!(
                barrier_id > last,
                "ring: barrier {barrier_id} announced after barrier {last}"
            );
        }
        side.ann_seq.store(seq + 1, Ordering::Relaxed);
        // Release fence: a reader that sees any of the stores below also sees `seq + 1` (odd)
        // on its re-check after its Acquire fence, and retries.
        fence(Ordering::Release);
        side.ann_barrier.store(barrier_id, Ordering::Relaxed);
        side.ann_position.store(position, Ordering::Relaxed);
        // Release: a reader that loads `seq + 2` sees both fields and every byte up to `position`.
        side.ann_seq.store(seq + 2, Ordering::Release);
    }

    /// Ends the stream: the consumer reports [`Consumer::is_closed`] once it has released
    /// everything. Also done on drop. Idempotent.
    pub fn close(&mut self) {
        if !self.closed {
            self.publish();
            self.closed = true;
            // Release: orders after every tail store, so a consumer seeing `closed` sees the final tail.
            self.shared.side.closed.store(true, Ordering::Release);
        }
    }

    /// True once the consumer has been dropped (nothing will ever free space again).
    #[inline]
    pub fn is_consumer_gone(&self) -> bool {
        Arc::strong_count(&self.shared) == 1
    }
}

impl Drop for Producer {
    fn drop(&mut self) {
        self.close();
    }
}

/// A reserved, not yet published, contiguous part of the ring. Dropping it publishes nothing.
pub struct WriteRegion<'a> {
    producer: &'a mut Producer,
    /// Buffer offset of the first byte (16-aligned).
    start: usize,
    len: usize,
    /// Padding skipped before `start` (0, or the bytes from the old tail to the buffer end).
    skip: usize,
    #[cfg(loom)]
    guards: Vec<loom::cell::MutPtr<()>>,
}

impl<'a> WriteRegion<'a> {
    /// Bytes in the region (a multiple of 16).
    #[inline]
    #[expect(clippy::len_without_is_empty, reason = "a region is never empty")]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Ring position of the region's first byte.
    #[inline]
    pub fn position(&self) -> u64 {
        self.producer.tail + self.skip as u64
    }

    /// The writable bytes, starting 16-aligned (64-aligned buffer, 16-aligned offset).
    #[inline]
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `[start, start + len)` lies inside the allocation (checked in `reserve`), is
        // initialized (zeroed at allocation, only ever overwritten with bytes), and is free
        // space: the consumer reads nothing at or after `tail` and the producer's Acquire load
        // of `head` ordered the consumer's last reads of these bytes before us. The `&mut self`
        // borrow makes this the only live view.
        unsafe { std::slice::from_raw_parts_mut(self.producer.buf.add(self.start), self.len) }
    }

    /// Pointer to the region's first byte; valid for writes of `len` bytes while the region lives.
    #[inline]
    pub(crate) fn as_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_slice().as_mut_ptr()
    }

    /// The region's bytes, read-only.
    #[cfg(debug_assertions)]
    fn as_slice(&self) -> &[u8] {
        // SAFETY: as in `as_mut_slice`; the shared borrow of `self` excludes a mutable view.
        unsafe { std::slice::from_raw_parts(self.producer.buf.add(self.start), self.len) }
    }

    /// Wraps the region in a [`FrameWriter`].
    #[inline]
    pub fn into_writer(self) -> FrameWriter<'a> {
        FrameWriter::new(self)
    }

    /// Publishes the first `bytes` of the region (whole frames, a multiple of 16) with one
    /// Release store of the tail. `commit(0)` publishes nothing.
    ///
    /// # Panics
    /// If `bytes` is not a multiple of 16 or exceeds the region; in debug builds also if the
    /// bytes are not well-formed frames.
    #[inline]
    pub fn commit(self, bytes: usize) {
        let p = self.commit_local(bytes);
        p.publish();
    }

    /// Like [`WriteRegion::commit`], but the frames become visible to the consumer only at the
    /// producer's next [`Producer::publish`] (or commit, announce, close): a batch of frames
    /// written one at a time costs one Release store and one cache-line transfer, not one per
    /// frame.
    ///
    /// # Panics
    /// As [`WriteRegion::commit`].
    #[inline]
    pub fn commit_deferred(self, bytes: usize) {
        self.commit_local(bytes);
    }

    /// Advances the producer's own tail past `bytes` (and the wrap marker, if any).
    #[inline]
    fn commit_local(self, bytes: usize) -> &'a mut Producer {
        assert!(
            bytes % FRAME_ALIGN == 0 && bytes <= self.len,
            "ring: bad commit of {bytes} bytes"
        );
        if bytes == 0 {
            return self.producer;
        }
        #[cfg(debug_assertions)]
        debug_check_frames(&self.as_slice()[..bytes]);
        #[cfg(loom)]
        drop(self.guards);
        let skip = self.skip;
        let p = self.producer;
        if skip > 0 {
            let idx = (p.tail as usize) & p.mask;
            #[cfg(loom)]
            let _g = p.shared.slots.write(idx, HEADER_BYTES);
            let hdr = frame::encode_raw(skip as u32, KIND_WRAP, 0, 0, 0);
            // SAFETY: `[idx, idx + 16)` starts the skipped padding `[idx, cap)`, which `reserve`
            // found free (skip + len <= free) and which is 16-aligned and at least 16 bytes.
            unsafe { std::ptr::copy_nonoverlapping(hdr.as_ptr(), p.buf.add(idx), HEADER_BYTES) }
        }
        p.tail += (skip + bytes) as u64;
        p
    }
}

#[cfg(debug_assertions)]
fn debug_check_frames(bytes: &[u8]) {
    let mut off = 0;
    while off < bytes.len() {
        assert!(
            bytes.len() - off >= HEADER_BYTES,
            "ring: commit ends inside a frame header"
        );
        let len = u32::from_le_bytes(bytes[off..off + 4].try_into().expect("4 bytes")) as usize;
        let kind = bytes[off + OFF_KIND];
        assert!(
            frame::FrameKind::from_u8(kind).is_some(),
            "ring: committed frame at offset {off} has bad kind byte {kind:#x}"
        );
        off += frame::frame_bytes(len);
    }
    assert!(off == bytes.len(), "ring: commit ends inside a frame");
}

/// The reading end. `Send`, not `Sync`, not `Clone`: exactly one thread reads.
///
/// ```compile_fail
/// fn sync<T: Sync>() {}
/// sync::<weir_ring::Consumer>();
/// ```
pub struct Consumer {
    shared: Arc<Shared>,
    buf: *mut u8,
    cap: usize,
    mask: usize,
    /// Read (and released) position; equal to `shared.head`, which only this side stores.
    head: u64,
    /// Last tail loaded from `shared.tail`; at most the real tail.
    cached_tail: u64,
}

// SAFETY: the consumer reads only bytes in `[head, tail)`, published by the producer's Release
// store of `tail` and loaded with Acquire, and the producer does not touch them until the
// consumer's Release store of `head`; so moving it to another thread is sound. It is not
// `Sync`; all reading methods that hand out views take `&mut self` or tie views to `&self`.
unsafe impl Send for Consumer {}

impl Consumer {
    /// Ring capacity in bytes.
    #[inline]
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// The committed frames from the read position up to the tail or the end of the buffer,
    /// whichever comes first (a wrap marker at the read position is skipped and released).
    /// `None` when nothing is committed. The region may end with a wrap marker, which
    /// [`ReadRegion::frames`] does not yield but counts as consumed.
    #[inline]
    pub fn read(&mut self) -> Option<ReadRegion<'_>> {
        loop {
            if self.cached_tail == self.head {
                // Acquire: the producer's writes of the bytes up to this tail happen-before our reads.
                self.cached_tail = self.shared.tail.load(Ordering::Acquire);
                if self.cached_tail == self.head {
                    return None;
                }
            }
            let idx = (self.head as usize) & self.mask;
            if self.kind_at(idx) == KIND_WRAP {
                let skip = (self.cap - idx) as u64;
                // Negative space: the ring itself publishes a marker only with the frames after
                // it, so its padding is always committed. Anything else is corrupt ring memory
                // (raw bytes committed through `WriteRegion::as_mut_slice`); stop, don't race.
                assert!(
                    skip < self.cached_tail - self.head,
                    "ring: wrap marker at position {} not followed by committed frames",
                    self.head
                );
                self.head += skip;
                // Release: our read of the marker happens-before the producer reuses its slot.
                self.shared.head.store(self.head, Ordering::Release);
                continue;
            }
            let len = ((self.cached_tail - self.head) as usize).min(self.cap - idx);
            return Some(ReadRegion {
                #[cfg(loom)]
                guards: self.shared.slots.read(idx, len),
                consumer: self,
                start: idx,
                len,
            });
        }
    }

    /// Kind byte of the committed frame header at buffer offset `idx`.
    #[inline]
    fn kind_at(&self, idx: usize) -> u8 {
        #[cfg(loom)]
        let _g = self.shared.slots.read(idx, HEADER_BYTES);
        // SAFETY: callers pass the offset of a committed, unreleased frame header (inside the
        // allocation, published by the producer's Release tail store that we loaded with
        // Acquire); the producer does not write it until we store a head beyond it.
        unsafe { self.buf.add(idx + OFF_KIND).read() }
    }

    /// Payload length field of the committed frame header at buffer offset `idx`.
    fn len_at(&self, idx: usize) -> usize {
        #[cfg(loom)]
        let _g = self.shared.slots.read(idx, HEADER_BYTES);
        let mut b = [0u8; 4];
        // SAFETY: as in `kind_at`: a committed, unreleased header inside the allocation.
        unsafe { std::ptr::copy_nonoverlapping(self.buf.add(idx), b.as_mut_ptr(), 4) }
        u32::from_le_bytes(b) as usize
    }

    /// Monotonic read position in bytes (everything before it is released).
    #[inline]
    pub fn read_position(&self) -> u64 {
        self.head
    }

    /// Committed bytes not yet released (includes wrap padding).
    #[inline]
    pub fn readable_bytes(&self) -> usize {
        (self.shared.tail.load(Ordering::Acquire) - self.head) as usize
    }

    /// The latest barrier announcement `(barrier_id, position)`, if any. Every byte before
    /// `position` is committed by the time the announcement is visible.
    pub fn announcement(&self) -> Option<(u64, u64)> {
        let side = &self.shared.side;
        loop {
            // Acquire: pairs with the producer's final Release store of the sequence.
            let s1 = side.ann_seq.load(Ordering::Acquire);
            if s1 == 0 {
                return None;
            }
            if s1 % 2 == 1 {
                crate::sync::spin_hint();
                continue;
            }
            let barrier = side.ann_barrier.load(Ordering::Relaxed);
            let position = side.ann_position.load(Ordering::Relaxed);
            // Acquire fence: if the loads above saw a newer write, the re-check sees its odd
            // sequence (pairs with the producer's Release fence).
            fence(Ordering::Acquire);
            if side.ann_seq.load(Ordering::Relaxed) == s1 {
                return Some((barrier, position));
            }
            crate::sync::spin_hint();
        }
    }

    /// The frames between the read position and `upto` (an announced position), straight from
    /// ring memory, as up to two slices: the concatenation is whole frames with no wrap marker.
    /// For persisting the in-flight data an unaligned checkpoint overtook. Empty when `upto` is
    /// not beyond the read position.
    ///
    /// # Panics
    /// If `upto` is beyond the committed write position.
    pub fn peek_range(&self, upto: u64) -> (&[u8], &[u8]) {
        // Acquire: bytes up to the loaded tail are visible (an announcement's Acquire already
        // guarantees the tail is at least its position).
        let tail = self.shared.tail.load(Ordering::Acquire);
        assert!(
            upto <= tail,
            "ring: peek_range to {upto} beyond committed position {tail}"
        );
        if upto <= self.head {
            return (&[], &[]);
        }
        let idx = (self.head as usize) & self.mask;
        let n = (upto - self.head) as usize;
        if idx + n < self.cap {
            return (self.bytes(idx, n), &[]);
        }
        // The range reaches the buffer end: trim the first part at a wrap marker, if any.
        let mut end = idx;
        while end < self.cap && self.kind_at(end) != KIND_WRAP {
            end += frame::frame_bytes(self.len_at(end));
        }
        assert!(
            end <= self.cap,
            "ring: corrupt frame header in range to peek"
        );
        (
            self.bytes(idx, end - idx),
            self.bytes(0, n - (self.cap - idx)),
        )
    }

    /// A view of `n` committed, unreleased bytes at buffer offset `idx`.
    fn bytes(&self, idx: usize, n: usize) -> &[u8] {
        #[cfg(loom)]
        drop(self.shared.slots.read(idx, n));
        // SAFETY: `[idx, idx + n)` is inside the allocation and holds committed, unreleased
        // bytes (published by a Release tail store we loaded with Acquire); the producer writes
        // them only after a head store beyond them, which needs `&mut self`, so not while the
        // returned borrow of `self` lives.
        unsafe { std::slice::from_raw_parts(self.buf.add(idx), n) }
    }

    /// True when the producer closed the ring (or was dropped) and everything was released.
    #[inline]
    pub fn is_closed(&self) -> bool {
        // Acquire on `closed` orders the producer's final tail store before our tail load.
        self.shared.side.closed.load(Ordering::Acquire)
            && self.shared.tail.load(Ordering::Acquire) == self.head
    }
}

/// Committed frames handed to the consumer, in place. Dropping it releases nothing.
pub struct ReadRegion<'a> {
    consumer: &'a mut Consumer,
    start: usize,
    len: usize,
    #[cfg(loom)]
    guards: Vec<loom::cell::ConstPtr<()>>,
}

impl ReadRegion<'_> {
    /// Bytes in the region (whole frames, possibly ending with a wrap marker's padding).
    #[inline]
    #[expect(clippy::len_without_is_empty, reason = "a region is never empty")]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Ring position of the region's first byte.
    #[inline]
    pub fn position(&self) -> u64 {
        self.consumer.head
    }

    /// The bytes, starting 16-aligned.
    #[inline]
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `[start, start + len)` is inside the allocation and committed (published by
        // the producer's Release tail store, loaded with Acquire in `read`); the producer does
        // not write it until `release` stores a head beyond it, which consumes the region.
        unsafe { std::slice::from_raw_parts(self.consumer.buf.add(self.start), self.len) }
    }

    /// The frames of the region (stops at a wrap marker).
    #[inline]
    pub fn frames(&self) -> Frames<'_> {
        Frames::new(self.as_slice())
    }

    /// Releases the first `bytes` of the region (a frame boundary, e.g. [`Frames::consumed`])
    /// with one Release store of the head; the producer may then overwrite them.
    ///
    /// # Panics
    /// If `bytes` is not a multiple of 16 or exceeds the region.
    #[inline]
    pub fn release(self, bytes: usize) {
        assert!(
            bytes % FRAME_ALIGN == 0 && bytes <= self.len,
            "ring: bad release of {bytes} bytes"
        );
        #[cfg(loom)]
        drop(self.guards);
        if bytes == 0 {
            return;
        }
        let c = self.consumer;
        c.head += bytes as u64;
        // Release: our reads of the released bytes happen-before the producer's Acquire load
        // that sees this head, and so before it overwrites them.
        c.shared.head.store(c.head, Ordering::Release);
    }

    /// Releases the whole region.
    #[inline]
    pub fn release_all(self) {
        let n = self.len;
        self.release(n);
    }
}
