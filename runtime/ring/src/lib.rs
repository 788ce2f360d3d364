//! weir's exchange ring: one bounded, lock-free, single-producer single-consumer **byte ring**
//! per (producer shard, consumer shard) pair. It carries 16-aligned **frames** whose payloads
//! are rkyv archives that the consumer reads in place. The producer serializes straight into
//! ring memory and publishes a batch of frames with one Release store; the consumer processes a
//! contiguous batch in place and frees it with one Release store. The ring knows nothing of
//! executors or wakers: the runtime polls it.
//!
//! ```
//! use weir_ring::{ring, Header, FrameKind};
//! let (mut p, mut c) = ring(4096);
//! let mut w = p.writer(64).unwrap().expect("empty ring has room");
//! w.push(Header::record(7, 1_000), b"hello").unwrap();
//! w.push(Header::barrier(1), &[]).unwrap();
//! w.commit();
//! let r = c.read().expect("committed frames");
//! let kinds: Vec<_> = r.frames().map(|f| (f.kind, f.payload.len())).collect();
//! assert_eq!(kinds, [(FrameKind::Record, 5), (FrameKind::Barrier, 0)]);
//! r.release_all();
//! ```
//!
//! # Positions
//!
//! The ring has a power-of-two capacity `C` (at least 4 KiB) allocated 64-aligned. Read and
//! write positions are monotonic `u64` byte counts that never wrap; the buffer offset of
//! position `p` is `p & (C - 1)`. `tail - head` is the committed, unreleased byte count
//! (`0..=C`), so a full ring is distinguishable from an empty one.
//!
//! # Frame layout
//!
//! Every frame starts 16-aligned in ring memory: a 16-byte little-endian header, then the
//! payload, then zero padding up to the next multiple of 16.
//!
//! ```text
//! offset size field
//!   0     4   len               payload length in bytes, unpadded (u32)
//!   4     1   kind              1 record, 2 watermark, 3 barrier, 4 end-of-stream,
//!                               5 user-control, 0xFF wrap marker (ring-internal)
//!   5     1   flags             free flag bits
//!   6     2   key_group         key group of a record (u16)
//!   8     8   timestamp_or_arg  record event time, watermark value or barrier id (i64)
//!  16   len   payload           16-aligned (rkyv archives need it)
//!  16+len ..  padding           zeros up to frame_bytes(len) = 16 + round_up(len, 16)
//! ```
//!
//! A frame never straddles the buffer end. When a reservation does not fit before the end,
//! the producer writes a **wrap marker** at the old tail (a header with kind `0xFF`; its `len`
//! holds the skipped byte count, marker included), and the bytes up to the buffer end are
//! padding that both positions count. The marker is published together with the first frames
//! after it (never alone), so a committed stream never ends in a wrap. The consumer skips a
//! marker at its read position; [`Frames`] stops at one. A reservation is at most `C / 2` bytes
//! ([`Producer::max_frame_bytes`]): a drained ring can always offer that contiguously, so
//! backpressure always ends, and a larger frame is the typed error [`FrameTooLarge`].
//!
//! # Memory ordering
//!
//! | field | stored by | store | loaded by | load |
//! | --- | --- | --- | --- | --- |
//! | `tail` (published write position) | producer, on commit or `publish` | Release | consumer, when its cached tail is used up; `peek_range`, `is_closed` | Acquire |
//! | `head` (released read position) | consumer, on release and when skipping a wrap | Release | producer, when its cached head shows too little room | Acquire |
//! | `closed` | producer, on close/drop | Release | consumer, `is_closed` | Acquire |
//! | announcement seqlock (`seq`, `barrier`, `position`) | producer | odd seq Relaxed + Release fence, fields Relaxed, even seq Release | consumer | seq Acquire, fields Relaxed, Acquire fence, seq Relaxed |
//!
//! * **Producer writes → consumer reads.** The producer writes frame bytes (and a wrap marker)
//!   in `[tail, tail + n)`, then stores `tail + n` with Release. A consumer whose Acquire load
//!   returns that value (or a later one: the Release sequence of single-writer stores) sees the
//!   bytes. It reads only below the tail it loaded.
//! * **Consumer reads → producer overwrites.** The consumer finishes reading `[head, head + n)`
//!   (the `ReadRegion` borrow ends in `release`), then stores `head + n` with Release. The
//!   producer writes only below `cached_head + C`, where `cached_head` came from an Acquire load
//!   of `head`, so every read of those bytes happens-before their overwrite.
//! * **Deferred commits.** `commit_deferred` advances only the producer's private tail; the
//!   bytes become visible at the next `publish` (also done by `commit`, `announce` and `close`),
//!   whose single Release store covers every frame committed before it. Nothing else changes:
//!   the consumer still reads only below a tail it loaded with Acquire.
//! * **Caching.** Each side keeps a private copy of the other's position, refreshed only when
//!   it shows too little (room for the producer, data for the consumer). A stale copy is never
//!   ahead of the real value, so it can only under-estimate; the hot paths touch the other
//!   side's cache line once per batch, not per frame. `head` and `tail` sit on separate
//!   128-byte-aligned lines.
//! * **Close.** `closed` is stored with Release after the last tail store; `is_closed` loads it
//!   with Acquire and then the tail, so it sees the final tail and reports closed only when
//!   everything was released.
//! * **Announcements.** A seqlock with one writer. `announce` publishes first, so the position
//!   announced is at most the published tail, and the seq Release store comes after that tail store in program order, so
//!   a consumer that reads the announcement (seq Acquire) then loads a tail of at least the
//!   position: [`Consumer::peek_range`] up to it is always valid. Only the latest announcement
//!   is kept; barrier frames still travel in-band and ids grow.
//!
//! The protocol is model-checked with loom (`tests/loom.rs`): under `--cfg loom` the atomics
//! come from loom and every 16-byte slot has a loom cell whose access guards the regions hold,
//! so an unordered write and read of one slot fails the model.

mod frame;
mod ring;
mod sync;

pub use frame::{
    frame_bytes, pad16, Frame, FrameKind, FrameWriter, Frames, Header, NoSpace, PushWithError,
    FRAME_ALIGN, HEADER_BYTES, KIND_WRAP, OFF_FLAGS, OFF_KEY_GROUP, OFF_KIND, OFF_LEN, OFF_TS,
};
pub use ring::{
    ring, Consumer, FrameTooLarge, Producer, ReadRegion, WriteRegion, BUFFER_ALIGN, MAX_CAPACITY,
    MIN_CAPACITY,
};
