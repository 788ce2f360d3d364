//! The memtable: a hash index over an arena of records, sorted only when needed.
//!
//! Why a hash index and not a sorted map: the keyed-count path updates the same keys again and
//! again; a hash probe plus an in-place overwrite of a same-size value costs about one cache
//! miss, where a sorted insert costs a tree walk per record (measured in
//! `benches/src/state.rs`, `memtable_hash_vs_btree`). Order is produced lazily: new keys are
//! appended to an unsorted tail; a scan sorts the tail and merges it into the sorted runs; a
//! frozen memtable is sorted once, by the first scan or by its flush.
//!
//! A record is one arena allocation: a 16-byte header (expiry, value length, key length,
//! flags, spare value capacity), the key, and the value at the next multiple of 16, so rkyv
//! reads values in place. The hash slot points at the record directly: a lookup touches the
//! control bytes, the slot and the record, and nothing else (the entry table, id -> record, is
//! only read by scans).

use std::sync::{Arc, OnceLock};

use xxhash_rust::xxh3::xxh3_64;

use crate::hugemem::{
    prefetch_read, MapVec, Pod, ScratchPool, ZeroedBuf, ARENA_CHUNKS, HUGE_PAGE_BYTES,
};
use crate::key::bytes_eq;

/// Largest arena chunk (one huge page); bigger values get a chunk of their own.
const CHUNK_BYTES_MAX: usize = HUGE_PAGE_BYTES;
/// Most chunks a memtable may have: slots store the chunk in 16 bits. A memtable with this
/// many chunks reports itself full (see [`Memtable::approx_bytes`]), so the store freezes it.
const MAX_CHUNKS: usize = u16::MAX as usize - 1;
/// Smallest arena chunk.
const CHUNK_BYTES_MIN: usize = 4096;
/// Memory a flush needs per entry to sort a memtable (`order_of`: packed keys and the radix
/// sort's scratch, then the packed keys and the order), counted in the memtable's budget.
pub(crate) const FLUSH_ORDER_BYTES: usize = 16;

/// Expiry value meaning "never expires".
pub(crate) const NO_EXPIRY: u64 = u64::MAX;

/// Record header: `expire_at_ms u64 | value length u32 | key length u16 | flags u8 | spare
/// u8`. Value capacity is `round16(value length) + 16 * spare`.
const REC_HEADER: usize = 16;
const R_EXPIRE: usize = 0;
const R_VAL_LEN: usize = 8;
const R_KEY_LEN: usize = 12;
const R_FLAGS: usize = 14;
const R_SPARE: usize = 15;
const REC_TOMBSTONE: u8 = 1;
/// The record is in the log of the epoch being written but moved within it (its value
/// outgrew it): not part of that epoch.
const REC_DEAD: u8 = 2;

#[inline]
fn round16(n: usize) -> usize {
    n.div_ceil(16) * 16
}

/// Where a record lives: arena chunk and byte offset (a multiple of 16).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub(crate) struct Loc {
    chunk: u32,
    off: u32,
}

// SAFETY: two u32 fields, `repr(C)`, no padding; every bit pattern is valid. (Sort orders are
// `ZeroedBuf`s: huge pages, one fault per 2 MiB.)
unsafe impl Pod for Loc {}

/// One arena chunk. Shared (`Arc`) between the memtable that writes it and the [`Sealed`]
/// epochs whose records it holds: those are read by a snapshot job on another thread while
/// the shard goes on writing records above the seal mark, and copies the chunk before it
/// writes one below.
struct Chunk {
    /// Owns the memory; never borrowed after construction except uniquely (`populate`).
    buf: ZeroedBuf<u128>,
    /// The first byte of `buf`, taken from a unique borrow: every access goes through it, so
    /// no reference to the whole chunk is ever alive while another thread reads part of it.
    ptr: *mut u8,
    bytes: usize,
    /// Where the memory goes when the last holder drops the chunk.
    pool: &'static ScratchPool,
}

// SAFETY: `Chunk` owns its memory (moving `buf` moves neither a mapping nor a heap buffer, so
// `ptr` stays valid). Concurrent access follows the seal protocol (see `Arena::sealed_below`):
// in a chunk that a view shares, the owning memtable writes only records at or above the
// mark, through slices that start at such a record; below the mark it writes only chunks it
// holds alone (`Arena::own_chunk` copies a shared one first, and only a seal shares one
// again). Other threads read only through a sealed view, whose slices end at the mark, over
// records nobody writes again in that chunk. A chunk's memory is written again only after its
// last holder dropped it (the pool hands it out then) or after `Arena::reclaim` retired it,
// which requires the arena's `Arc` to be the only one (`Arc::get_mut`: every view that read
// it has been dropped, and that drop happens-before).
unsafe impl Send for Chunk {}
// SAFETY: as for `Send`.
unsafe impl Sync for Chunk {}

impl Chunk {
    /// A chunk of `elems` elements of any content (records are written before they are read).
    /// One huge page: a chunk given back to [`ARENA_CHUNKS`] if there is one, else fresh.
    fn new(elems: usize) -> Chunk {
        Chunk::new_in(&ARENA_CHUNKS, elems)
    }

    fn new_in(pool: &'static ScratchPool, elems: usize) -> Chunk {
        let mut buf = if elems * 16 == HUGE_PAGE_BYTES {
            ZeroedBuf::<u128>::scratch_in(pool, elems)
        } else {
            ZeroedBuf::<u128>::new(elems)
        };
        let ptr = buf.as_mut_ptr().cast::<u8>();
        Chunk {
            buf,
            ptr,
            bytes: elems * 16,
            pool,
        }
    }

    /// Fault the chunk in (see [`ZeroedBuf::populate`]); only while nothing else shares it.
    fn populate(&mut self) -> usize {
        let n = self.buf.populate();
        self.ptr = self.buf.as_mut_ptr().cast::<u8>();
        n
    }
}

impl Drop for Chunk {
    /// Whoever drops the last reference (the shard's memtable, or a snapshot job done with a
    /// sealed epoch) hands the memory, faulted in already, to the next arena that grows.
    /// Only huge-page chunks, the standard size of every budget from 32 MiB: the pool's maps
    /// are then all alike.
    fn drop(&mut self) {
        if self.bytes == HUGE_PAGE_BYTES {
            std::mem::replace(&mut self.buf, ZeroedBuf::new(0)).recycle_into(self.pool);
        }
    }
}

impl std::fmt::Debug for Chunk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Chunk").field("bytes", &self.bytes).finish()
    }
}

/// Which records of one arena chunk are live: allocated there and not replaced since by a
/// move. A bit per 16 bytes marks where each live record starts.
///
/// And which of its records sealed before the current epoch are in that epoch's log: a bit
/// per 16 bytes again, valid while `stamp` is the arena's seal count (see
/// [`Arena::log_sealed`]), so that a seal clears nothing.
#[derive(Debug, Default)]
struct ChunkUse {
    live: u32,
    born: u32,
    bits: Vec<u64>,
    logged: Vec<u64>,
    /// The seal count when `logged` was last cleared; 0 (no seal yet) means never.
    stamp: u64,
}

impl ChunkUse {
    /// The chunk (of `bytes`) becomes the one allocations come from.
    fn start(&mut self, bytes: usize) {
        self.bits.resize(bytes.div_ceil(16 * 64), 0);
    }

    fn clear(&mut self) {
        self.bits.fill(0);
        self.live = 0;
        self.born = 0;
        self.stamp = 0;
    }

    #[inline]
    fn born(&mut self, off: u32) {
        self.live += 1;
        self.born += 1;
        let unit = off as usize / 16;
        self.bits[unit / 64] |= 1 << (unit % 64);
    }

    /// The share of the records born here still live, in 1/1024ths.
    #[inline]
    fn live_share(&self) -> usize {
        (u64::from(self.live) * 1024 / u64::from(self.born.max(1))) as usize
    }

    /// Hint the CPU to load the logged bit of the record at `off`.
    #[inline]
    fn prefetch_logged(&self, off: u32) {
        let unit = off as usize / 16;
        if let Some(w) = self.logged.get(unit / 64) {
            prefetch_read(std::ptr::from_ref(w));
        }
    }

    /// Whether the sealed record at `off` is in the log of epoch `seals` already.
    #[inline]
    fn is_logged(&self, off: u32, seals: u64) -> bool {
        let unit = off as usize / 16;
        self.stamp == seals && self.logged[unit / 64] & (1 << (unit % 64)) != 0
    }

    /// Mark the sealed record at `off` as logged in the current epoch (the stamp is current);
    /// true if it was not yet.
    #[inline]
    fn log_once(&mut self, off: u32) -> bool {
        let unit = off as usize / 16;
        let (w, bit) = (&mut self.logged[unit / 64], 1u64 << (unit % 64));
        let new = *w & bit == 0;
        *w |= bit;
        new
    }

    /// True when that was the last live record.
    #[inline]
    fn release(&mut self, off: u32) -> bool {
        let unit = off as usize / 16;
        self.bits[unit / 64] &= !(1 << (unit % 64));
        self.live -= 1;
        self.live == 0
    }

    /// Offsets of the live records.
    fn live_offsets(&self) -> impl Iterator<Item = u32> + '_ {
        self.bits.iter().enumerate().flat_map(|(w, &word)| {
            let mut rest = word;
            std::iter::from_fn(move || {
                if rest == 0 {
                    return None;
                }
                let b = rest.trailing_zeros();
                rest &= rest - 1;
                Some(((w * 64 + b as usize) * 16) as u32)
            })
        })
    }
}

/// The placeholder of a chunk number that [`Arena::reclaim`] retired: no record refers to it.
fn retired_chunk() -> Arc<Chunk> {
    static RETIRED: OnceLock<Arc<Chunk>> = OnceLock::new();
    Arc::clone(RETIRED.get_or_init(|| Arc::new(Chunk::new_in(&ARENA_CHUNKS, 0))))
}

/// A record address as one ordered integer: allocation order within one arena life.
#[inline]
fn packed(loc: Loc) -> u64 {
    u64::from(loc.chunk) << 32 | u64::from(loc.off)
}

#[derive(Debug, Default)]
struct Arena {
    // u128 elements make every chunk 16-byte aligned.
    chunks: Vec<Arc<Chunk>>,
    /// The chunk number of `chunks[0]`: 0 in a memtable; in a sealed epoch's view, the chunk
    /// the epoch's first record is in (the view holds only the chunks its records use).
    base: usize,
    /// Per chunk (memtables only): which of its records are live, for [`Arena::reclaim`] and
    /// [`Memtable::make_room`].
    uses: Vec<ChunkUse>,
    /// Chunks whose live count fell to zero, candidates for [`Arena::reclaim`].
    emptied: Vec<u32>,
    /// The chunk allocations come from; chunks after it are recycled spares, not yet used.
    cur: usize,
    chunk_bytes: usize,
    used: usize,
    /// Bytes of the chunks in use (`chunks[..=cur]`).
    bytes: usize,
    /// Records allocated before this mark ([`packed`] address) are sealed: a snapshot job may
    /// be reading them, so the first write to one in an epoch makes the chunk the arena's own
    /// first (see [`Arena::log_sealed`]). Chunks in use are never reordered, so allocation
    /// order is address order.
    sealed_below: u64,
    /// Seals so far (never reset): the epoch that [`ChunkUse::stamp`] is compared with.
    seals: u64,
    /// Chunks [`Self::own_chunk`] copied, whose originals views may still hold, and the bytes
    /// of those that some view held at the last [`Self::refresh_away`]: memory the
    /// memtable's snapshots cost beside its own, counted in its budget.
    away: Vec<(std::sync::Weak<Chunk>, usize)>,
    away_bytes: usize,
    /// A sealed epoch's read-only view ([`Memtable::seal`]): its slices end at
    /// `sealed_below`, because the memtable goes on writing above it.
    view: bool,
    /// Records marked dead since the last seal (every mark is of a record above it).
    dead: usize,
    /// The last spare chunk was taken after a seal: [`Memtable::make_spare`] is due.
    wants_spare: bool,
}

impl Arena {
    #[inline]
    fn alloc(&mut self, len: usize) -> Loc {
        let len16 = round16(len);
        let fits = self
            .chunks
            .get(self.cur)
            .is_some_and(|c| c.bytes - self.used >= len16);
        if !fits {
            self.next_chunk(len16);
        }
        let loc = Loc {
            chunk: self.cur as u32,
            off: self.used as u32,
        };
        self.used += len16;
        self.uses[self.cur].born(loc.off);
        loc
    }

    /// The record at `loc` was replaced by a newer one elsewhere (a move).
    #[inline]
    fn release(&mut self, loc: Loc) {
        if self.uses[loc.chunk as usize].release(loc.off) {
            self.emptied.push(loc.chunk);
        }
    }

    /// Take back the memory of a chunk whose records were all replaced, once no sealed epoch
    /// reads it ([`Self::unread`]). Its number is retired (an empty placeholder keeps the
    /// numbering: allocation order stays address order, and the memory comes back under a
    /// new number above the mark). A standard-size chunk is returned for the next
    /// allocations; others are freed.
    ///
    /// Why: values that outgrow their records move, and a job whose values grow (lists,
    /// aggregates) would otherwise grow the memtable into fresh memory until it froze (a
    /// first touch costs about a millisecond per 2 MiB here).
    #[cold]
    fn reclaim(&mut self) {
        let mut i = 0;
        while i < self.emptied.len() {
            let c = self.emptied[i] as usize;
            if self.uses[c].live != 0 || self.chunks[c].bytes == 0 {
                // Written again since it emptied (it was the chunk in use), or retired.
                self.emptied.swap_remove(i);
                continue;
            }
            if !self.unread(c) {
                i += 1;
                continue;
            }
            self.emptied.swap_remove(i);
            self.retire(c);
        }
    }

    /// Whether chunk `c` lies wholly below the seal mark, the epoch being written logged none
    /// of its records (so every record in it, dead ones included, went to an epoch whose view
    /// holds the chunk), and no such view holds it any more: then nothing but this arena will
    /// read it.
    #[inline]
    fn unread(&mut self, c: usize) -> bool {
        c < (self.sealed_below >> 32) as usize
            && self.uses[c].stamp != self.seals
            && Arc::get_mut(&mut self.chunks[c]).is_some()
    }

    /// Retire chunk `c` (unread, no live record): an empty placeholder keeps its number, so
    /// that allocation order stays address order, and its memory comes back as a spare under
    /// a new number above the mark. A chunk of another size than the standard is freed.
    fn retire(&mut self, c: usize) {
        let chunk = std::mem::replace(&mut self.chunks[c], retired_chunk());
        let mut used = std::mem::take(&mut self.uses[c]);
        self.bytes -= chunk.bytes;
        if chunk.bytes == self.chunk_bytes {
            used.clear();
            self.chunks.push(chunk);
            self.uses.push(used);
        }
    }

    #[cold]
    fn next_chunk(&mut self, len16: usize) {
        self.refresh_away();
        let next = if self.chunks.is_empty() {
            0
        } else {
            self.cur + 1
        };
        let mut spare_fits = self.chunks.get(next).is_some_and(|c| c.bytes >= len16);
        if !spare_fits && len16 <= self.chunk_bytes && !self.emptied.is_empty() {
            self.reclaim();
            spare_fits = self.chunks.get(next).is_some_and(|c| c.bytes >= len16);
        }
        if !spare_fits {
            let n = len16.max(self.chunk_bytes) / 16;
            self.chunks.push(Arc::new(Chunk::new(n)));
            self.uses.push(ChunkUse::default());
            // Chunks after `cur` are unused spares: moving one does not move any data in use.
            let last = self.chunks.len() - 1;
            self.chunks.swap(next, last);
            self.uses.swap(next, last);
        }
        self.cur = next;
        self.used = 0;
        self.bytes += self.chunks[next].bytes;
        self.uses[next].start(self.chunks[next].bytes);
        // Moves leave chunks to reuse; they empty only past a seal.
        self.wants_spare = self.sealed_below != 0 && next + 1 == self.chunks.len();
    }

    /// Forget the copied chunks whose views are all gone (see `away`).
    #[cold]
    fn refresh_away(&mut self) {
        self.away.retain(|(w, _)| w.strong_count() > 0);
        self.away_bytes = self.away.iter().map(|&(_, b)| b).sum();
    }

    /// Fault in chunks until the arena holds `bytes` (in use and spare), adding standard-size
    /// spares as needed. Returns the bytes faulted in.
    fn prefault(&mut self, bytes: usize) -> usize {
        let was_empty = self.chunks.is_empty();
        let mut total: usize = self.chunks.iter().map(|c| c.bytes).sum();
        while total < bytes {
            let c = Chunk::new(self.chunk_bytes / 16);
            total += c.bytes;
            self.chunks.push(Arc::new(c));
            self.uses.push(ChunkUse::default());
        }
        if was_empty && !self.chunks.is_empty() {
            // As after `reset`: the first chunk is the one in use, and counts.
            self.cur = 0;
            self.used = 0;
            self.bytes = self.chunks[0].bytes;
            self.uses[0].start(self.chunks[0].bytes);
        }
        // A chunk a sealed epoch still reads is in memory already.
        self.chunks
            .iter_mut()
            .filter_map(Arc::get_mut)
            .map(Chunk::populate)
            .sum()
    }

    /// Forget every allocation but keep the standard-size chunks for reuse (their pages are
    /// already faulted in: PLATFORM.md, first touch costs microseconds per page here).
    fn reset(&mut self) {
        let std_bytes = self.chunk_bytes;
        // Chunks that sealed epochs still read are theirs until they finish: not reused.
        self.chunks
            .retain_mut(|c| c.bytes == std_bytes && Arc::get_mut(c).is_some());
        self.uses.truncate(self.chunks.len());
        self.uses.resize_with(self.chunks.len(), ChunkUse::default);
        self.uses.iter_mut().for_each(ChunkUse::clear);
        self.emptied.clear();
        self.cur = 0;
        self.used = 0;
        self.sealed_below = 0;
        self.dead = 0;
        self.wants_spare = false;
        self.bytes = self.chunks.first().map_or(0, |c| c.bytes);
        if let Some(c) = self.chunks.first() {
            self.uses[0].start(c.bytes);
        }
    }

    /// The address the next allocation gets (when it fits the current chunk).
    #[inline]
    fn position(&self) -> u64 {
        packed(Loc {
            chunk: self.cur as u32,
            off: self.used as u32,
        })
    }

    #[inline]
    fn is_sealed(&self, loc: Loc) -> bool {
        packed(loc) < self.sealed_below
    }

    /// Before the sealed record at `loc` is written in place: make its chunk this arena's own
    /// if an epoch's view shares it (first write there since the seal), and say whether the
    /// record has to join the current epoch's log (true once per epoch).
    ///
    /// Why copy whole chunks: a keyed job checkpointing every 100 ms updates nearly every
    /// record between two seals. Copying each record at its first update (a new record, its
    /// old one's live bit and its entry, each a miss) grew the arena by a copy of every
    /// record, and 1 M updates of 500 K keys with an epoch held cost 0.88-0.97 times the
    /// updates per CPU second without (`state_updates_under_snapshot`); with chunk copies,
    /// 0.97-1.01. A chunk copied once is one `memcpy`, and records stay put.
    #[inline]
    fn log_sealed(&mut self, loc: Loc) -> bool {
        let c = loc.chunk as usize;
        if self.uses[c].stamp != self.seals {
            self.own_chunk(c);
        }
        self.uses[c].log_once(loc.off)
    }

    /// Whether the sealed record at `loc` is in the current epoch's log.
    #[inline]
    fn is_logged(&self, loc: Loc) -> bool {
        self.uses[loc.chunk as usize].is_logged(loc.off, self.seals)
    }

    /// The first write this epoch below the seal mark in chunk `c`: copy the chunk if a view
    /// shares it (the view keeps the original, as it was at its seal), and start the chunk's
    /// logged bits for this epoch. Only a seal shares chunks, so the chunk stays this arena's
    /// own until the next one.
    #[cold]
    fn own_chunk(&mut self, c: usize) {
        if Arc::get_mut(&mut self.chunks[c]).is_none() {
            let old = &self.chunks[c];
            let copy = Chunk::new_in(old.pool, old.bytes / 16);
            // The current chunk is written only up to `used`; others are copied whole.
            let len = if c == self.cur { self.used } else { old.bytes };
            // SAFETY: both chunks hold `old.bytes >= len` bytes and are distinct mappings.
            // Nothing writes `old` any more (this arena writes only through `self.chunks`,
            // which is about to hold `copy`); the views that share it only read.
            unsafe { std::ptr::copy_nonoverlapping(old.ptr, copy.ptr, len) };
            self.away_bytes += old.bytes;
            self.away.push((Arc::downgrade(old), old.bytes));
            self.chunks[c] = Arc::new(copy);
        }
        let u = &mut self.uses[c];
        u.logged.clear();
        u.logged.resize(u.bits.len(), 0);
        u.stamp = self.seals;
    }

    /// The bytes of chunk `loc.chunk` from `loc.off` on (in a view, up to the seal mark).
    #[inline]
    fn chunk(&self, loc: Loc) -> &[u8] {
        let c = &self.chunks[loc.chunk as usize - self.base];
        let end = if self.view && u64::from(loc.chunk) == self.sealed_below >> 32 {
            (self.sealed_below as u32 as usize).min(c.bytes)
        } else {
            c.bytes
        };
        let off = (loc.off as usize).min(end);
        // SAFETY: `c.ptr` addresses `c.bytes` initialised bytes owned by the chunk, which the
        // `Arc` in `self` keeps alive for the borrow. Nothing writes them while the slice
        // lives: a memtable writes only through `chunk_mut` under `&mut self`, only above its
        // seal mark, and a view's slices end at that mark (see `Sealed`), so the bytes another
        // thread may be writing are never inside a slice of a view.
        unsafe { std::slice::from_raw_parts(c.ptr.add(off), end - off) }
    }

    /// The bytes of chunk `loc.chunk` from `loc.off` on, to write the record there: one above
    /// the seal mark, or a sealed one in a chunk [`Self::own_chunk`] made this arena's own.
    #[inline]
    fn chunk_mut(&mut self, loc: Loc) -> &mut [u8] {
        debug_assert!(!self.view, "write to a sealed epoch's view");
        debug_assert!(
            !self.is_sealed(loc) || self.uses[loc.chunk as usize].stamp == self.seals,
            "write to a sealed record of a chunk a view may share"
        );
        let c = &self.chunks[loc.chunk as usize - self.base];
        let off = (loc.off as usize).min(c.bytes);
        // SAFETY: as in `chunk` for validity. Uniqueness: `&mut self` excludes this arena's
        // other borrows. Below the seal mark the chunk is this arena's alone (`own_chunk`
        // copied it if a view shared it, and only a seal shares it again). At or above the
        // mark, views sharing the chunk read only records below their marks, which are at
        // most this one's (allocation order is address order): the slice starts at or above
        // every byte they read.
        unsafe { std::slice::from_raw_parts_mut(c.ptr.add(off), c.bytes - off) }
    }

    /// The key of the record at `loc`.
    #[inline]
    fn key(&self, loc: Loc) -> &[u8] {
        let r = self.chunk(loc);
        let klen = usize::from(u16::from_le_bytes([r[R_KEY_LEN], r[R_KEY_LEN + 1]]));
        &r[REC_HEADER..REC_HEADER + klen]
    }

    /// [`key_prefix`] of the key at `loc`, and the key's length. Reads 16 bytes whatever the
    /// length and masks off what follows the key (the rest of the record, or the next one):
    /// no copy of a variable length.
    #[inline]
    fn prefix_and_len(&self, loc: Loc) -> (u128, usize) {
        self.prefix_and_len_inlined(loc)
    }

    /// [`Self::prefix_and_len`], always inlined: for a pass over records in address order. In
    /// a flush of 1.6 M records that pass took 26-27 ms with the call, 16-19.5 ms without. The
    /// pass over an epoch's scattered records gained nothing inlined (snapshot jobs of 430 K
    /// records through buffered writes: 121-138 ms against 114-117; through `UringFs`: the
    /// same, 34.7-35.5 ms at best either way), so that one keeps the call.
    #[inline(always)]
    fn prefix_and_len_inlined(&self, loc: Loc) -> (u128, usize) {
        let r = self.chunk(loc);
        let klen = usize::from(u16::from_le_bytes([r[R_KEY_LEN], r[R_KEY_LEN + 1]]));
        match r.get(REC_HEADER..REC_HEADER + 16) {
            Some(b) => {
                let p = u128::from_be_bytes(b.try_into().expect("16 bytes"));
                let tail = u128::MAX.checked_shr(8 * klen as u32).unwrap_or(0);
                (p & !tail, klen)
            }
            None => (key_prefix(&r[REC_HEADER..REC_HEADER + klen]), klen),
        }
    }

    /// Key and value of the record at `loc`. Always inlined: a flush or snapshot job calls it
    /// once a record, and as a call (its result returned through memory) the snapshot job of
    /// 430 K records took 39.3-42.3 ms of CPU at best, inlined 34.8-36.7.
    #[inline(always)]
    fn record(&self, loc: Loc) -> (&[u8], ValueRef<'_>) {
        let r = self.chunk(loc);
        let h: &[u8; REC_HEADER] = r[..REC_HEADER].try_into().expect("header");
        let klen = usize::from(u16::from_le_bytes([h[R_KEY_LEN], h[R_KEY_LEN + 1]]));
        let vlen = u32::from_le_bytes([
            h[R_VAL_LEN],
            h[R_VAL_LEN + 1],
            h[R_VAL_LEN + 2],
            h[R_VAL_LEN + 3],
        ]) as usize;
        let expire_at_ms = u64::from_le_bytes([h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]]);
        let v = REC_HEADER + round16(klen);
        (
            &r[REC_HEADER..REC_HEADER + klen],
            ValueRef::new(
                &r[v..v + vlen],
                expire_at_ms,
                h[R_FLAGS] & REC_TOMBSTONE != 0,
            ),
        )
    }

    /// Value capacity of the record at `loc`.
    #[inline]
    fn capacity(&self, loc: Loc) -> usize {
        let r = self.chunk(loc);
        let vlen = u32::from_le_bytes([
            r[R_VAL_LEN],
            r[R_VAL_LEN + 1],
            r[R_VAL_LEN + 2],
            r[R_VAL_LEN + 3],
        ]) as usize;
        round16(vlen) + 16 * usize::from(r[R_SPARE])
    }

    /// Overwrite the value of the record at `loc`; the caller checked it fits. Returns the
    /// previous value length.
    #[inline]
    fn overwrite(&mut self, loc: Loc, value: &[u8], expire_at_ms: u64, tombstone: bool) -> usize {
        let cap = self.capacity(loc);
        debug_assert!(value.len() <= cap);
        let r = self.chunk_mut(loc);
        let klen = usize::from(u16::from_le_bytes([r[R_KEY_LEN], r[R_KEY_LEN + 1]]));
        let old = u32::from_le_bytes([
            r[R_VAL_LEN],
            r[R_VAL_LEN + 1],
            r[R_VAL_LEN + 2],
            r[R_VAL_LEN + 3],
        ]) as usize;
        r[R_EXPIRE..R_EXPIRE + 8].copy_from_slice(&expire_at_ms.to_le_bytes());
        r[R_VAL_LEN..R_VAL_LEN + 4].copy_from_slice(&(value.len() as u32).to_le_bytes());
        r[R_FLAGS] = u8::from(tombstone) * REC_TOMBSTONE;
        r[R_SPARE] = ((cap - round16(value.len())) / 16).min(255) as u8;
        let v = REC_HEADER + round16(klen);
        r[v..v + value.len()].copy_from_slice(value);
        old
    }

    /// Mark the (unsealed) record at `loc` as replaced within its epoch.
    #[inline]
    fn mark_dead(&mut self, loc: Loc) {
        self.dead += 1;
        self.chunk_mut(loc)[R_FLAGS] |= REC_DEAD;
    }

    #[inline]
    fn is_dead(&self, loc: Loc) -> bool {
        self.chunk(loc)[R_FLAGS] & REC_DEAD != 0
    }

    /// Allocate and fill a new record.
    fn new_record(&mut self, key: &[u8], value: &[u8], expire_at_ms: u64, tombstone: bool) -> Loc {
        let key16 = round16(key.len());
        let loc = self.alloc(REC_HEADER + key16 + round16(value.len()));
        let r = self.chunk_mut(loc);
        r[R_EXPIRE..R_EXPIRE + 8].copy_from_slice(&expire_at_ms.to_le_bytes());
        r[R_VAL_LEN..R_VAL_LEN + 4].copy_from_slice(&(value.len() as u32).to_le_bytes());
        r[R_KEY_LEN..R_KEY_LEN + 2].copy_from_slice(&(key.len() as u16).to_le_bytes());
        r[R_FLAGS] = u8::from(tombstone) * REC_TOMBSTONE;
        r[R_SPARE] = 0;
        r[REC_HEADER..REC_HEADER + key.len()].copy_from_slice(key);
        let v = REC_HEADER + key16;
        r[v..v + value.len()].copy_from_slice(value);
        loc
    }
}

/// A hash index slot: the low 32 bits of the key's xxh3 hash, the entry id and the record.
/// Keeping the hash in the slot means a probe rejects other keys without touching any record,
/// and growing the table never reads the records. `gen` tells live slots from those of an
/// earlier use of the table: clearing it is one increment, not a 16 MiB memset.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(16))]
struct Slot {
    h32: u32,
    id: u32,
    off: u32,
    chunk: u16,
    gen: u16,
}

// SAFETY: four integer fields filling 16 bytes without padding; every bit pattern is valid.
unsafe impl Pod for Slot {}

impl Slot {
    #[inline]
    fn loc(&self) -> Loc {
        Loc {
            chunk: u32::from(self.chunk),
            off: self.off,
        }
    }

    #[inline]
    fn set_loc(&mut self, loc: Loc) {
        debug_assert!(loc.chunk < u32::from(u16::MAX));
        self.chunk = loc.chunk as u16;
        self.off = loc.off;
    }
}

/// The memtable's hash index: open addressing with linear probing over 16-byte slots, four to
/// a cache line, at most 3/4 full.
///
/// Why not hashbrown: its control bytes live apart from its slots, so a lookup misses twice
/// (control group, then slot) before it reaches the record; here the tag is in the slot and a
/// lookup misses once before the record. The slot's address is known from the hash alone, so
/// a batch of lookups can prefetch it ([`Memtable::prefetch`]). Entries are never removed (a
/// delete is a tombstone record), so probing needs no deletion markers.
///
/// Growth is incremental: the full table becomes `old` and its entries move into the doubled
/// table [`MIGRATE_PER_PUT`] slots per put. Rehashing a million entries at once stalled the
/// shard for milliseconds, which was most of the keyed job's tail latency.
#[derive(Debug)]
struct Index {
    slots: ZeroedBuf<Slot>,
    mask: usize,
    /// Distinct keys, in both tables.
    len: usize,
    /// Slots whose `gen` differs are empty. Never 0, which is what fresh memory holds.
    gen: u16,
    /// The table before the last growth while its entries move over. A key is in exactly one
    /// of the two tables: lookups try `slots`, then `old`.
    old: Option<OldTable>,
}

#[derive(Debug)]
struct OldTable {
    slots: ZeroedBuf<Slot>,
    mask: usize,
    gen: u16,
    /// Slots below this have moved.
    next: usize,
}

/// Where a key's slot is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum At {
    New(usize),
    Old(usize),
}

impl Default for Index {
    fn default() -> Self {
        Index::with_capacity(MIN_INDEX_SLOTS)
    }
}

const MIN_INDEX_SLOTS: usize = 16;
/// Largest initial index: 64 Ki slots, 1 MiB.
const INITIAL_INDEX_SLOTS_MAX: usize = 1 << 16;
/// Old-table slots moved per put while growing. The doubled table takes 3/4 of the old
/// capacity in new keys before it must grow again, so any rate above 4/3 finishes in time;
/// 16 (four cache lines) finishes after capacity/16 puts and costs ~10 ns a put meanwhile.
const MIGRATE_PER_PUT: usize = 16;

/// Linear probing in `slots` for tag `h32`: `Ok` where `is_key` accepts, `Err` at the first
/// empty slot.
#[inline]
fn probe_in(
    slots: &[Slot],
    mask: usize,
    gen: u16,
    h32: u32,
    mut is_key: impl FnMut(Loc) -> bool,
) -> Result<usize, usize> {
    let mut i = h32 as usize & mask;
    loop {
        let s = &slots[i];
        if s.gen != gen {
            return Err(i);
        }
        if s.h32 == h32 && is_key(s.loc()) {
            return Ok(i);
        }
        i = (i + 1) & mask;
    }
}

impl Index {
    /// `cap` is rounded up to a power of two.
    fn with_capacity(cap: usize) -> Index {
        let cap = cap.max(MIN_INDEX_SLOTS).next_power_of_two();
        Index {
            slots: ZeroedBuf::new(cap),
            mask: cap - 1,
            len: 0,
            gen: 1,
            old: None,
        }
    }

    #[inline]
    fn bytes(&self) -> usize {
        let old = self.old.as_ref().map_or(0, |o| o.slots.len());
        (self.slots.len() + old) * std::mem::size_of::<Slot>()
    }

    /// Where the key with hash tag `h32` is (`Ok`), or the empty slot of the current table
    /// where it would go.
    #[inline]
    fn probe(&self, h32: u32, mut is_key: impl FnMut(Loc) -> bool) -> Result<At, usize> {
        match probe_in(&self.slots, self.mask, self.gen, h32, &mut is_key) {
            Ok(i) => Ok(At::New(i)),
            Err(empty) => match &self.old {
                // A moved key is found in the current table first, so a match here is one
                // that has not moved yet.
                Some(o) => match probe_in(&o.slots, o.mask, o.gen, h32, is_key) {
                    Ok(i) => Ok(At::Old(i)),
                    Err(_) => Err(empty),
                },
                None => Err(empty),
            },
        }
    }

    #[inline]
    fn slot(&self, at: At) -> &Slot {
        match (at, &self.old) {
            (At::New(i), _) => &self.slots[i],
            (At::Old(i), Some(o)) => &o.slots[i],
            (At::Old(_), None) => unreachable!("an old slot without an old table"),
        }
    }

    #[inline]
    fn slot_mut(&mut self, at: At) -> &mut Slot {
        match (at, &mut self.old) {
            (At::New(i), _) => &mut self.slots[i],
            (At::Old(i), Some(o)) => &mut o.slots[i],
            (At::Old(_), None) => unreachable!("an old slot without an old table"),
        }
    }

    /// True when one more entry would pass the load limit.
    #[inline]
    fn needs_growth(&self) -> bool {
        (self.len + 1) * 4 > self.slots.len() * 3
    }

    /// Fill the empty slot `i` of the current table (from [`Self::probe`]) with a new key.
    #[inline]
    fn fill(&mut self, i: usize, h32: u32, id: u32, loc: Loc) {
        self.place(i, h32, id, loc);
        self.len += 1;
    }

    #[inline]
    fn place(&mut self, i: usize, h32: u32, id: u32, loc: Loc) {
        let gen = self.gen;
        let s = &mut self.slots[i];
        *s = Slot {
            h32,
            id,
            off: 0,
            chunk: 0,
            gen,
        };
        s.set_loc(loc);
    }

    /// Make an empty index at least `cap` slots (a power of two) and fault all of it in.
    /// An index holding keys keeps its size (growing it would move them) and is only faulted
    /// in. Returns the bytes faulted in.
    fn prefault(&mut self, cap: usize) -> usize {
        if self.len == 0 && self.old.is_none() && cap > self.slots.len() {
            *self = Index::with_capacity(cap);
        }
        let old = self.old.as_mut().map_or(0, |o| o.slots.populate());
        self.slots.populate() + old
    }

    /// Double the table; its entries move over during the next puts ([`Self::migrate`]).
    #[cold]
    fn grow(&mut self) {
        self.migrate(usize::MAX);
        let cap = self.slots.len() * 2;
        let slots = std::mem::replace(&mut self.slots, ZeroedBuf::new(cap));
        self.old = Some(OldTable {
            slots,
            mask: self.mask,
            gen: self.gen,
            next: 0,
        });
        self.mask = cap - 1;
        self.gen = 1;
    }

    /// Move up to `n` old-table slots into the current table, re-placing them by their stored
    /// tag (records are not read). A moved slot keeps its content but lies below `next`, so
    /// lookups no longer find it there.
    #[inline]
    fn migrate(&mut self, n: usize) {
        let Some(mut o) = self.old.take() else {
            return;
        };
        let end = o.next.saturating_add(n).min(o.slots.len());
        for j in o.next..end {
            let s = o.slots[j];
            if s.gen == o.gen {
                let Err(i) = probe_in(&self.slots, self.mask, self.gen, s.h32, |_| false) else {
                    unreachable!("a probe that matches nothing ends at an empty slot")
                };
                self.place(i, s.h32, s.id, s.loc());
            }
        }
        o.next = end;
        if end < o.slots.len() {
            self.old = Some(o);
        }
    }

    /// Forget every entry, keeping the memory of the current table.
    fn clear(&mut self) {
        self.old = None;
        self.len = 0;
        self.gen = self.gen.wrapping_add(1);
        if self.gen == 0 {
            // Once every 65535 reuses: old slots could carry the next tag.
            self.slots.zero();
            self.gen = 1;
        }
    }

    #[inline]
    fn prefetch(&self, h32: u32) {
        prefetch_read(&self.slots[h32 as usize & self.mask]);
        if let Some(o) = &self.old {
            prefetch_read(&o.slots[h32 as usize & o.mask]);
        }
    }
}

/// A value as stored: bytes, expiry, tombstone flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ValueRef<'a> {
    pub bytes: &'a [u8],
    pub expire_at_ms: u64,
    /// 1 for a tombstone, else 0. A word, not a `bool`: a `bool`'s seven padding bytes were
    /// copied in two overlapping moves wherever an entry moved through the merge, and
    /// reading them back stalled on store forwarding (most of the compaction loop's samples).
    tombstone: u64,
}

impl<'a> ValueRef<'a> {
    #[inline]
    pub fn new(bytes: &'a [u8], expire_at_ms: u64, tombstone: bool) -> Self {
        ValueRef {
            bytes,
            expire_at_ms,
            tombstone: u64::from(tombstone),
        }
    }

    /// Whether this is a deletion.
    #[inline]
    pub fn tombstone(&self) -> bool {
        self.tombstone != 0
    }
}

/// Where a key was found in the mutable memtable: valid while the memtable's
/// [`Memtable::epoch`] is unchanged (a record moves only when its value outgrows it, which
/// changes the epoch; freezing replaces the memtable, whose epoch is unique).
///
/// Two plain words (the location packed), so that a call returns it in registers: as a
/// `u64` and a `Loc` it came back through memory, and the caller's 16-byte reload of the
/// callee's narrower stores missed store forwarding (three quarters of `Store::put_hinted`'s
/// samples in the checkpointed keyed count, where copy-on-write takes that path).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MemHint {
    epoch: u64,
    packed_loc: u64,
}

impl MemHint {
    #[inline]
    fn new(epoch: u64, loc: Loc) -> Self {
        MemHint {
            epoch,
            packed_loc: packed(loc),
        }
    }

    #[inline]
    fn loc(&self) -> Loc {
        Loc {
            chunk: (self.packed_loc >> 32) as u32,
            off: self.packed_loc as u32,
        }
    }
}

/// Largest number of sorted runs kept before the smallest ones are merged; with the size rule
/// in [`Memtable::prepare_scan`] there are O(log n) runs anyway, this only caps pathological
/// cases.
const MAX_RUNS: usize = 24;

#[derive(Debug, Default)]
pub(crate) struct Memtable {
    arena: Arena,
    /// Entry id -> record (ids are insertion order; scans and sorting use them).
    entries: MapVec<Loc>,
    index: Index,
    /// Sorted runs of entry ids, oldest (largest) first; each run is more than twice the size
    /// of the next one, so there are O(log n) of them and every id is merged O(log n) times.
    runs: Vec<Vec<u32>>,
    /// Ids appended since the last [`Memtable::prepare_scan`], unsorted.
    fresh: MapVec<u32>,
    /// Unique per memtable incarnation (set by the store) in the high 32 bits; the low bits
    /// count record moves and seals. See [`MemHint`].
    epoch: u64,
    /// Records written since the last [`Memtable::seal`]: new keys and moved records in
    /// allocation order, and sealed records at their first update in the epoch. What the next
    /// sealed epoch holds.
    log: MapVec<Loc>,
    /// A sealed epoch's log given back after its snapshot (see [`Self::give_log`]), the next
    /// epoch's log: a fresh one would fault its pages in on the shard's thread.
    spare_log: MapVec<Loc>,
}

/// The first 16 key bytes, zero padded, as a big-endian integer: comparing two of them orders
/// keys by their first 16 bytes (ties need a full comparison).
///
/// Built from two overlapping word loads rather than a copy into a zeroed buffer: the copy is
/// a `memcpy` call whose byte stores the following 16-byte load cannot forward from, which
/// stalled every segment writer and lookup step.
#[inline]
pub(crate) fn key_prefix(key: &[u8]) -> u128 {
    let n = key.len();
    let be64 = |b: &[u8]| u64::from_be_bytes(b[..8].try_into().expect("8 bytes"));
    let be32 = |b: &[u8]| u32::from_be_bytes(b[..4].try_into().expect("4 bytes"));
    let (hi, lo) = if n >= 16 {
        (be64(key), be64(&key[8..]))
    } else if n >= 8 {
        // The last 8 bytes end at the key's end; keep the n - 8 of them past byte 8.
        let tail = be64(&key[n - 8..]);
        (
            be64(key),
            tail.checked_shl(8 * (16 - n) as u32).unwrap_or(0),
        )
    } else if n >= 4 {
        let tail = u64::from(be32(&key[n - 4..]));
        let hi = u64::from(be32(key)) << 32 | tail.checked_shl(8 * (8 - n) as u32).unwrap_or(0);
        (hi, 0)
    } else {
        let mut hi = 0u64;
        for (i, &b) in key.iter().enumerate() {
            hi |= u64::from(b) << (56 - 8 * i);
        }
        (hi, 0)
    };
    u128::from(hi) << 64 | u128::from(lo)
}

/// Widest radix digit. Measured for 2 M keys: a pass costs about the same from 8 to 13 bits
/// and twice as much at 15 (the lines being written no longer fit the caches), so the widest
/// cheap digit makes the fewest passes.
const RADIX_BITS_MAX: u32 = 11;
/// Below this many keys, `sort_unstable` of the packed integers is cheaper than the radix
/// histograms.
const RADIX_MIN_KEYS: usize = 256;
/// Most fields of varying bits gathered from a prefix (each costs a shift, a mask and an or
/// per key); beyond it, the fields closest together are merged, constant bits included.
const FIELDS_MAX: usize = 4;
/// Keys sampled to guess which prefix bits vary (a sample costs ~0.4 ms, a wrong guess a
/// second packing pass, ~15 ms for 2 M keys).
const SAMPLE_KEYS: usize = 4096;
/// How far ahead of a bucket's write position a radix pass prefetches: one line.
const PREFETCH_ELEMS: usize = 8;
/// How many runs of tied keys ahead their records are prefetched.
const TIE_RUNS_AHEAD: usize = 8;

/// Bits needed to hold `x`.
#[inline]
fn bits_for(x: u64) -> u32 {
    u64::BITS - x.leading_zeros()
}

/// Packs a key's 16-byte prefix and a payload (what identifies the key: a record address, an
/// id) into one u64 whose integer order is the key order, as far as the prefix bits that fit
/// can tell: bits that are the same in every prefix of the set order nothing and are left out,
/// the others go above the payload, most significant first, as many as fit.
struct Packer {
    /// Where each field of varying bits goes, split at the middle of the prefix so that each
    /// is taken from one 64-bit half.
    fields: Vec<Field>,
    /// The prefix bits the fields hold (varying ones, and constant ones between close fields).
    held: u128,
    /// Bits the fields hold.
    key_bits: u32,
    /// How many of them (the most significant) fit above the payload.
    kept_bits: u32,
}

/// `(half >> shr & mask) << shl`, `half` the high or low 64 bits of the prefix.
#[derive(Debug, Clone, Copy)]
struct Field {
    high: bool,
    shr: u32,
    mask: u64,
    shl: u32,
}

impl Packer {
    /// For prefixes whose bitwise or is `or` and bitwise and is `and`.
    fn new(or: u128, and: u128, payload_bits: u32) -> Packer {
        debug_assert!(payload_bits < 64);
        let varying = or ^ and;
        // Runs of varying bits as (high, low) bit positions, most significant first.
        let mut runs: Vec<(u32, u32)> = Vec::new();
        for b in (0..u128::BITS).rev() {
            if varying >> b & 1 == 1 {
                match runs.last_mut() {
                    Some(r) if r.1 == b + 1 => r.1 = b,
                    _ => runs.push((b, b)),
                }
            }
        }
        while runs.len() > FIELDS_MAX {
            let i = (0..runs.len() - 1)
                .min_by_key(|&i| runs[i].1 - runs[i + 1].0)
                .expect("two runs");
            runs[i].1 = runs[i + 1].1;
            runs.remove(i + 1);
        }
        if let Some(i) = runs.iter().position(|&(hi, lo)| hi >= 64 && lo < 64) {
            let lo = runs[i].1;
            runs[i].1 = 64;
            runs.insert(i + 1, (63, lo));
        }
        let key_bits: u32 = runs.iter().map(|&(hi, lo)| hi - lo + 1).sum();
        let kept_bits = key_bits.min(u64::BITS - payload_bits);
        // The gathered bits `drop..key_bits` land at `payload_bits..`.
        let drop = key_bits - kept_bits;
        let mut held = 0;
        let mut dst = key_bits;
        let mut fields = Vec::new();
        for &(hi, lo) in &runs {
            let width = hi - lo + 1;
            held |= (u128::MAX >> (u128::BITS - width)) << lo;
            dst -= width;
            if dst + width <= drop {
                continue;
            }
            let cut = drop.saturating_sub(dst);
            fields.push(Field {
                high: lo >= 64,
                shr: lo % 64 + cut,
                mask: u64::MAX >> (u64::BITS - (width - cut)),
                shl: payload_bits + dst + cut - drop,
            });
        }
        Packer {
            fields,
            held,
            key_bits,
            kept_bits,
        }
    }

    #[inline]
    fn pack(&self, prefix: u128, payload: u64) -> u64 {
        let (hi, lo) = ((prefix >> 64) as u64, prefix as u64);
        let mut e = payload;
        for f in &self.fields {
            let half = if f.high { hi } else { lo };
            e |= (half >> f.shr & f.mask) << f.shl;
        }
        e
    }

    /// True when two different prefixes always pack differently.
    fn exact(&self) -> bool {
        self.kept_bits == self.key_bits
    }

    /// True when the fields hold every bit of `varying`: then the packed order is the prefix
    /// order (two prefixes first differ at a varying bit), or ties where bits did not fit.
    fn covers(&self, varying: u128) -> bool {
        varying & !self.held == 0
    }
}

/// Sort `n` distinct keys. `item(i)` gives the i-th key's 16-byte prefix ([`key_prefix`]),
/// its length, and a payload below `2^payload_bits` that identifies it; `key_of(payload)`
/// gives the key again and `prefetch_of(payload)` starts loading it. The result holds the
/// payloads in key order.
///
/// Why not a comparison sort of (prefix, payload) pairs: for 2 M keys it took 130-240 ms,
/// mostly branch misses and 32-byte moves; a radix pass moves 8 bytes a key and branches on
/// nothing, and the keys of one state share most prefix bits, so few passes remain (3 for
/// the benches' keys, ~30 ms in all). A crate (`rdst`, `voracious_radix_sort`) sorts all 64
/// bits of the packed keys, payload included, and took ~40 ms for the radix part alone where
/// this takes ~16. Memory: two u64 buffers of `n` while sorting, one after.
fn sort_by_key<'a>(
    n: usize,
    payload_bits: u32,
    item: impl Fn(usize) -> (u128, usize, u64),
    key_of: impl Fn(u64) -> &'a [u8],
    prefetch_of: impl Fn(u64),
) -> Sorted {
    // Which bits vary, guessed from a sample: one pass over the keys instead of two. The
    // packing pass checks the guess and packs again in the rare case it missed a bit.
    let (mut or, mut and) = (0u128, u128::MAX);
    for i in (0..n).step_by(n.div_ceil(SAMPLE_KEYS).max(1)) {
        let p = item(i).0;
        or |= p;
        and &= p;
    }
    // Every element is written below before any is read.
    let mut v = ZeroedBuf::<u64>::scratch(n);
    let mut guessed = true;
    let (packer, radix, len_min, len_max) = loop {
        let packer = Packer::new(or, and, payload_bits);
        let mut radix = (n >= RADIX_MIN_KEYS).then(|| Radix::new(payload_bits, packer.kept_bits));
        (or, and) = (0, u128::MAX);
        let (mut len_min, mut len_max) = (usize::MAX, 0);
        for (i, slot) in v.iter_mut().enumerate() {
            let (p, len, payload) = item(i);
            or |= p;
            and &= p;
            len_min = len_min.min(len);
            len_max = len_max.max(len);
            let e = packer.pack(p, payload);
            *slot = e;
            if let Some(r) = &mut radix {
                r.count(e);
            }
        }
        if packer.covers(or ^ and) {
            break (packer, radix, len_min, len_max);
        }
        assert!(guessed, "packing the exact varying bits holds them all");
        guessed = false;
    };
    match radix {
        Some(r) => r.sort(&mut v),
        None => v.sort_unstable(),
    }
    let payload_mask = (1u64 << payload_bits) - 1;
    // Distinct keys of one length up to 16 bytes have distinct prefixes; otherwise packed keys
    // can tie (a zero-padded prefix, bytes past the 16th, bits that did not fit).
    if !(packer.exact() && len_min == len_max && len_max <= 16) {
        sort_ties(
            &mut v,
            payload_bits,
            |e| key_of(e & payload_mask),
            |e| prefetch_of(e & payload_mask),
        );
    }
    Sorted { v, payload_mask }
}

/// Packed keys in key order; [`Sorted::payloads`] strips the key bits.
struct Sorted {
    v: ZeroedBuf<u64>,
    payload_mask: u64,
}

impl Sorted {
    fn payloads(&self) -> impl ExactSizeIterator<Item = u64> + '_ {
        self.v.iter().map(|&e| e & self.payload_mask)
    }
}

/// An LSD radix sort of u64s by bits `lo..lo + bits` (the bits above are zero), in passes of
/// at most [`RADIX_BITS_MAX`] bits. The caller counts the first digit while it fills the
/// buffer, and each pass counts the next digit while it moves the elements: no pass only
/// counts.
struct Radix {
    passes: u32,
    lo: u32,
    width: u32,
    first: Box<[u32; RADIX_BUCKETS]>,
}

const RADIX_BUCKETS: usize = 1 << RADIX_BITS_MAX;

impl Radix {
    fn new(lo: u32, bits: u32) -> Radix {
        let passes = bits.div_ceil(RADIX_BITS_MAX);
        Radix {
            passes,
            lo,
            width: bits.div_ceil(passes.max(1)),
            first: Box::new([0; RADIX_BUCKETS]),
        }
    }

    /// Count `e`, an element of the buffer to sort; every one is counted once.
    #[inline]
    fn count(&mut self, e: u64) {
        self.first[digit(e, self.lo, self.width)] += 1;
    }

    fn sort(&self, v: &mut ZeroedBuf<u64>) {
        let n = v.len();
        // The first pass writes every element before any is read.
        let mut tmp = ZeroedBuf::<u64>::scratch(n);
        let mut in_tmp = false;
        let mut counts = self.first.clone();
        let mut next_counts = Box::new([0u32; RADIX_BUCKETS]);
        for p in 0..self.passes {
            let shift = self.lo + p * self.width;
            // The bits of the next digit, if any (none: count nothing).
            let next = (p + 1 < self.passes).then(|| shift + self.width);
            let (src, dst) = if in_tmp {
                (&tmp, &mut *v)
            } else {
                (&*v, &mut tmp)
            };
            next_counts.fill(0);
            if counts.iter().any(|&k| k as usize == n) {
                // One digit value throughout: nothing would move, only count the next digit.
                if let Some(ns) = next {
                    for &e in src.iter() {
                        next_counts[digit(e, ns, self.width)] += 1;
                    }
                }
            } else {
                let mut cursor = [0u32; RADIX_BUCKETS];
                let mut sum = 0;
                for (c, &k) in cursor.iter_mut().zip(counts.iter()) {
                    *c = sum;
                    sum += k;
                }
                let w = self.width;
                match next {
                    Some(ns) => scatter(src, dst, &mut cursor, |e| {
                        next_counts[digit(e, ns, w)] += 1;
                        digit(e, shift, w)
                    }),
                    None => scatter(src, dst, &mut cursor, |e| digit(e, shift, w)),
                }
                in_tmp = !in_tmp;
            }
            std::mem::swap(&mut counts, &mut next_counts);
        }
        if in_tmp {
            std::mem::swap(v, &mut tmp);
        }
        // The next sort's buffer (or a segment writer's): its pages stay faulted in.
        tmp.recycle();
    }
}

/// Bits `shift..shift + width` of `e`.
#[inline]
fn digit(e: u64, shift: u32, width: u32) -> usize {
    // The modulo is free (a power of two) and lets the compiler drop the bounds check.
    ((e >> shift) as usize & ((1 << width) - 1)) % RADIX_BUCKETS
}

/// Move each element of `src` to `dst` at the cursor of its digit (`digit(e)`), advancing it.
#[inline]
fn scatter(
    src: &[u64],
    dst: &mut [u64],
    cursor: &mut [u32; RADIX_BUCKETS],
    mut digit: impl FnMut(u64) -> usize,
) {
    for &e in src {
        let c = &mut cursor[digit(e)];
        let i = *c as usize;
        dst[i] = e;
        // Each bucket writes its own stream of lines, too many for the hardware prefetcher:
        // without this every new line waits for memory (3x slower here).
        prefetch_read(dst.as_ptr().wrapping_add(i + PREFETCH_ELEMS));
        *c += 1;
    }
}

/// Order each run of elements of sorted `v` that are equal above the payload by their full
/// keys (`key_of` and `prefetch` take an element).
fn sort_ties<'a>(
    v: &mut [u64],
    payload_bits: u32,
    key_of: impl Fn(u64) -> &'a [u8],
    prefetch: impl Fn(u64),
) {
    let tied = |a: u64, b: u64| (a ^ b) >> payload_bits == 0;
    let mut runs: Vec<(u32, u32)> = Vec::new();
    let mut i = 0;
    while let Some(at) = v[i..].windows(2).position(|w| tied(w[0], w[1])) {
        let start = i + at;
        let end = start
            + 2
            + v[start + 2..]
                .iter()
                .take_while(|&&e| tied(e, v[start]))
                .count();
        runs.push((start as u32, end as u32));
        i = end;
    }
    // A run that only tied on the bits that fit is ordered by prefixes, each read once; equal
    // prefixes compare whole keys. Runs are short and their records scattered: loading those
    // of a run a few ahead overlaps the misses (40% less time for 2 M keys in runs of two).
    let mut keyed: Vec<(u128, u64)> = Vec::new();
    for (r, &(start, end)) in runs.iter().enumerate() {
        if let Some(&(s, e)) = runs.get(r + TIE_RUNS_AHEAD) {
            v[s as usize..e as usize].iter().for_each(|&e| prefetch(e));
        }
        let run = &mut v[start as usize..end as usize];
        keyed.clear();
        keyed.extend(run.iter().map(|&e| (key_prefix(key_of(e)), e)));
        keyed.sort_unstable_by(|a, b| a.0.cmp(&b.0).then_with(|| key_of(a.1).cmp(key_of(b.1))));
        for (slot, &(_, e)) in run.iter_mut().zip(&keyed) {
            *slot = e;
        }
    }
}

impl Memtable {
    /// A memtable for a budget of `budget_bytes`: arena chunks are a sixteenth of it, so that
    /// small budgets are not exceeded by the first chunk. The index starts at 1 MiB at most
    /// and doubles as entries come: a small state keeps a small, cache-resident index, and a
    /// large one pays a few rehashes once (a recycled memtable keeps its capacity).
    pub fn with_budget(budget_bytes: usize) -> Memtable {
        let slots = (budget_bytes / 4 / std::mem::size_of::<Slot>())
            .clamp(MIN_INDEX_SLOTS, INITIAL_INDEX_SLOTS_MAX);
        let mut m = Memtable {
            index: Index::with_capacity(if slots.is_power_of_two() {
                slots
            } else {
                slots.next_power_of_two() / 2
            }),
            ..Memtable::default()
        };
        m.arena.chunk_bytes = (budget_bytes / 16).clamp(CHUNK_BYTES_MIN, CHUNK_BYTES_MAX);
        m
    }

    /// [`Self::with_budget`] for the successor of `prev` at a freeze: its index starts at
    /// `prev`'s size (the keys a job keeps updating come back), so that it does not grow
    /// through every size below again. Each size is a fresh mapping whose pages fault on first
    /// touch (PLATFORM.md: 2.5-18.5 us a page on this VM) and each growth moves every slot:
    /// in the keyed job checkpointing every 100 ms, slot writes into fresh index tables and
    /// moves into grown ones were 45% of the shards' page-fault samples.
    pub fn successor_of(prev: &Memtable, budget_bytes: usize) -> Memtable {
        let mut m = Memtable::with_budget(budget_bytes);
        // The index's whole capacity counts against the budget; never more than half of it.
        let slots = prev
            .index
            .slots
            .len()
            .min(budget_bytes / 2 / std::mem::size_of::<Slot>());
        // A power of two at most `slots` (`with_capacity` rounds up).
        let slots = if slots.is_power_of_two() {
            slots
        } else {
            slots.next_power_of_two() / 2
        };
        if slots > m.index.slots.len() {
            m.index = Index::with_capacity(slots);
        }
        m
    }

    /// Slots of the current index table.
    #[cfg(test)]
    pub(crate) fn index_slots(&self) -> usize {
        self.index.slots.len()
    }

    #[cfg(test)]
    pub fn new() -> Memtable {
        Memtable::with_budget(64 << 20)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Give this memtable a new incarnation number (hints taken before are invalid).
    pub fn set_incarnation(&mut self, n: u64) {
        self.epoch = n << 32;
    }

    /// Memory for the budget: arena chunks in use, those it copied that sealed epochs still
    /// hold (as of the last [`Self::refresh_away`]), the entry table's, id lists' and log's
    /// capacity (a recycled memtable keeps it resident), the whole hash index, and what its
    /// flush will need to sort it ([`FLUSH_ORDER_BYTES`] an entry). A memtable out of chunk
    /// numbers reports itself over any budget.
    #[inline]
    pub fn approx_bytes(&self) -> usize {
        if self.arena.chunks.len() >= MAX_CHUNKS {
            return usize::MAX / 2;
        }
        let n = self.entries.len();
        self.arena.bytes
            + self.arena.away_bytes
            + self.tables_bytes()
            + self.tables_growth_bytes()
            + self.index.bytes()
            + n * FLUSH_ORDER_BYTES
    }

    /// The entry table, id lists and logs, by capacity. Every id is in exactly one sorted run
    /// or in `fresh`.
    #[inline]
    fn tables_bytes(&self) -> usize {
        let runs = self.entries.len() - self.fresh.len();
        (self.entries.capacity() + self.log.capacity() + self.spare_log.capacity())
            * std::mem::size_of::<Loc>()
            + (runs + self.fresh.capacity()) * 4
    }

    /// What the next new key adds to the tables: each full one doubles (`MapVec` grows so).
    /// Counted by [`Self::approx_bytes`] ahead of time, so that a memtable whose tables cannot
    /// double within its share freezes instead of growing past it. Counted after the growth,
    /// a memtable crossed its share by the doubling (a 64 MiB store froze at 262,145 entries
    /// with tables of 524,288), and, recycled with that capacity, every later one froze at
    /// 211,621 entries beside 6 MB of table it never used (10.5 MB held, 4.2 MB in use).
    #[inline]
    fn tables_growth_bytes(&self) -> usize {
        let full = |len: usize, cap: usize| if len == cap { cap } else { 0 };
        (full(self.entries.len(), self.entries.capacity())
            + full(self.log.len(), self.log.capacity()))
            * std::mem::size_of::<Loc>()
            + full(self.fresh.len(), self.fresh.capacity()) * 4
    }

    /// Take back the log of a sealed epoch whose snapshot is done, for the next seal.
    pub fn give_log(&mut self, log: MapVec<Loc>) {
        if log.capacity() > self.spare_log.capacity() {
            self.spare_log = log;
        }
    }

    /// Memory this memtable holds, used or not: every arena chunk, its tables, the index.
    /// What a recycled memtable kept for reuse costs.
    pub fn held_bytes(&self) -> usize {
        let chunks: usize = self.arena.chunks.iter().map(|c| c.bytes).sum();
        chunks + self.arena.away_bytes + self.tables_bytes() + self.index.bytes()
    }

    /// Drop from [`Self::approx_bytes`] the chunks this memtable copied whose sealed epochs
    /// are all done (their snapshot jobs let go). O(chunks copied and still counted).
    pub fn refresh_away(&mut self) {
        self.arena.refresh_away();
    }

    /// [`Self::approx_bytes`] with the chunks copied for sealed epochs counted as of now: for
    /// a frozen memtable, which cannot [`Self::refresh_away`]. O(chunks copied).
    pub fn approx_bytes_now(&self) -> usize {
        let away = &self.arena.away;
        let held: usize = away
            .iter()
            .filter(|(w, _)| w.strong_count() > 0)
            .map(|&(_, b)| b)
            .sum();
        self.approx_bytes() - self.arena.away_bytes + held
    }

    /// Fault in now the memory this memtable needs to fill `budget_bytes`, and return how many
    /// bytes that was: an index of the largest power of two at most budget / 48 slots (a sixth
    /// to a third of the budget), entry tables for 3/4 of its slots, and arena chunks for what
    /// the budget leaves less the flush's sort reserve (see [`Self::approx_bytes`]). Entries
    /// smaller than about 60 bytes with their table space (a 48-byte record of a 16-byte key
    /// and value) can fill the index before the budget; it then grows once as it would have
    /// without this.
    ///
    /// Why: left to fill lazily, a memtable takes its page faults inside the shard's loop,
    /// and a fresh 2 MiB page costs about a millisecond here (PLATFORM.md): the first second
    /// of a keyed job had steps of 10-37 ms, almost all in `clear_page_erms`. A recycled
    /// memtable keeps what this faulted in. The arena-chunk pool also gets chunks for the
    /// copies that seals cause (see the end), which the returned figure includes.
    pub fn prefault(&mut self, budget_bytes: usize) -> usize {
        let max_slots = (budget_bytes / 48).max(MIN_INDEX_SLOTS);
        let slots = if max_slots.is_power_of_two() {
            max_slots
        } else {
            max_slots.next_power_of_two() / 2
        };
        let faulted = self.index.prefault(slots);
        let entries = slots / 4 * 3;
        // The lengths are unchanged.
        self.fresh.reserve(entries.saturating_sub(self.fresh.len()));
        self.entries
            .reserve(entries.saturating_sub(self.entries.len()));
        self.log.reserve(entries.saturating_sub(self.log.len()));
        let tables = self.fresh.populate() + self.entries.populate() + self.log.populate();
        // The arena gets what the budget leaves beside index and tables, less the flush's sort
        // reserve: a quarter, as for 48-byte records (16 bytes of sort each).
        let arena = budget_bytes.saturating_sub(self.index.bytes() + self.tables_bytes()) / 4 * 3;
        let faulted = faulted + tables + self.arena.prefault(arena);
        // After a seal, the first write to each chunk the snapshot shares copies it into a
        // chunk from `ARENA_CHUNKS` (`Arena::own_chunk`), and a keyed job's updates reach every
        // chunk within milliseconds: with the pool empty, the first checkpoints faulted a fresh
        // 2 MiB page per chunk inside the shard's loop, runs of 10 ms of page faults after
        // each seal in the first second of the checkpointed latency run. So the pool gets as
        // many, faulted in now, as far as its bounds allow (64 MiB for the process).
        faulted + ARENA_CHUNKS.fill(self.arena.chunks.len(), HUGE_PAGE_BYTES)
    }

    /// Empty this memtable for reuse as a fresh one, keeping its memory: arena chunks, entry
    /// table and hash index capacity (no page faults, no rehashing on the next fill).
    pub fn recycle(&mut self) {
        self.arena.reset();
        self.arena.refresh_away();
        self.entries.clear();
        self.index.clear();
        self.runs.clear();
        self.fresh.clear();
        self.log.clear();
        self.epoch = self.epoch.wrapping_add(1);
    }

    /// Seal the records written since the last seal as an epoch (a snapshot's synchronous
    /// part): O(chunks), no copy. From now on the first write in an epoch to a chunk the
    /// epoch's view shares copies that chunk (see [`Arena::log_sealed`]), so the epoch stays
    /// as it was while a snapshot job reads it on another thread, and the memtable keeps
    /// serving every key: no lookup has to go past it afterwards, as it would after a freeze.
    /// `None` when nothing was written since the last seal.
    pub fn seal(&mut self) -> Option<Sealed> {
        self.arena.refresh_away();
        if self.log.is_empty() {
            return None;
        }
        let arena = &mut self.arena;
        // The epoch's records: those allocated since the previous mark, and sealed ones it
        // logged, in chunks stamped with this epoch. The view holds those chunks and no
        // others (a chunk it holds is copied at its next write), from the first of them on:
        // a memtable checkpointed for long may have many retired chunk numbers below.
        let first = (arena.sealed_below >> 32) as usize;
        let seals = arena.seals;
        let logged_in = |c: usize| arena.uses[c].stamp == seals && seals != 0;
        let lo = (0..first).find(|&c| logged_in(c)).unwrap_or(first);
        let chunks = (lo..=arena.cur)
            .map(|c| {
                if c >= first || logged_in(c) {
                    Arc::clone(&arena.chunks[c])
                } else {
                    retired_chunk()
                }
            })
            .collect();
        arena.sealed_below = arena.position();
        arena.seals += 1;
        let view = Arena {
            chunks,
            base: lo,
            uses: Vec::new(),
            emptied: Vec::new(),
            cur: arena.cur,
            chunk_bytes: arena.chunk_bytes,
            used: 0,
            bytes: 0,
            sealed_below: arena.sealed_below,
            seals: 0,
            away: Vec::new(),
            away_bytes: 0,
            view: true,
            dead: std::mem::take(&mut arena.dead),
            wants_spare: false,
        };
        // No allocation here (a map costs a system call in the snapshot's synchronous part):
        // the log given back by an earlier epoch, or an empty one that grows with the puts.
        let mut next = std::mem::take(&mut self.spare_log);
        next.clear();
        let log = std::mem::replace(&mut self.log, next);
        Some(Sealed { arena: view, log })
    }

    #[inline]
    fn find(&self, key: &[u8], hash: u64) -> Option<Loc> {
        // A recycled memtable is empty but has a large index: a probe would still miss the
        // cache on a random slot (reads of keys that live in segments pass here first).
        if self.index.len == 0 {
            return None;
        }
        let arena = &self.arena;
        let at = self
            .index
            .probe(hash as u32, |loc| bytes_eq(arena.key(loc), key))
            .ok()?;
        Some(self.index.slot(at).loc())
    }

    /// Start loading the index slot of `hash` into the cache: the first step of a batched
    /// lookup, issued a few keys ahead.
    #[inline]
    pub fn prefetch(&self, hash: u64) {
        if self.index.len > 0 {
            self.index.prefetch(hash as u32);
        }
    }

    /// Start loading the record that the slot of `hash` points at (the slot should already
    /// be cached, see [`Self::prefetch`]): the second step of a batched lookup. A tag match of
    /// another key only costs a useless prefetch. False when no slot has the tag.
    #[inline]
    pub fn prefetch_record(&self, hash: u64) -> bool {
        if self.index.len == 0 {
            return false;
        }
        let found = self.index.probe(hash as u32, |_| true);
        if let Ok(at) = found {
            let s = self.index.slot(at);
            if let Some(c) = self.arena.chunks.get(s.chunk as usize) {
                // Header, key and a small value span two lines when the record starts in the
                // last 16 bytes of one.
                let r = c.ptr.wrapping_add(s.off as usize);
                prefetch_read(r);
                prefetch_read(r.wrapping_add(48));
                if self.arena.is_sealed(s.loc()) {
                    // An update reads its logged bit (see `Arena::log_sealed`), scattered over
                    // a bitmap of a sixteenth of the arena's bytes.
                    if let Some(u) = self.arena.uses.get(s.chunk as usize) {
                        u.prefetch_logged(s.off);
                    }
                }
            }
        }
        found.is_ok()
    }

    pub fn put(&mut self, key: &[u8], value: &[u8], expire_at_ms: u64, tombstone: bool) {
        self.put_hashed(key, xxh3_64(key), value, expire_at_ms, tombstone);
    }

    /// [`Self::put`] with `hash = xxh3_64(key)` computed by the caller. Returns where the
    /// record is now.
    #[inline]
    pub fn put_hashed(
        &mut self,
        key: &[u8],
        hash: u64,
        value: &[u8],
        expire_at_ms: u64,
        tombstone: bool,
    ) -> MemHint {
        let hint = self.write(key, hash, value, expire_at_ms, tombstone);
        if self.arena.wants_spare {
            // Copies leave this record where it is (above the seal mark) but stale hints.
            self.make_spare();
            return MemHint::new(self.epoch, hint.loc());
        }
        hint
    }

    /// The write of [`Self::put_hashed`], before it sees to a spare chunk.
    fn write(
        &mut self,
        key: &[u8],
        hash: u64,
        value: &[u8],
        expire_at_ms: u64,
        tombstone: bool,
    ) -> MemHint {
        debug_assert!(key.len() <= usize::from(u16::MAX));
        let h32 = hash as u32;
        let Memtable {
            arena,
            entries,
            index,
            fresh,
            epoch,
            log,
            ..
        } = self;
        if index.needs_growth() {
            index.grow();
        }
        index.migrate(MIGRATE_PER_PUT);
        let found = {
            let a = &*arena;
            index.probe(h32, |loc| bytes_eq(a.key(loc), key))
        };
        match found {
            Ok(at) => {
                let slot = index.slot_mut(at);
                let mut loc = slot.loc();
                let sealed = arena.is_sealed(loc);
                if value.len() <= arena.capacity(loc) {
                    if sealed && arena.log_sealed(loc) {
                        log.push(loc);
                    }
                    arena.overwrite(loc, value, expire_at_ms, tombstone);
                } else {
                    // The value outgrew its record: write a new one (hints become stale).
                    // If the old one is in the log of the epoch being written, it is left
                    // out of it; a sealed one stays as it is for its epoch.
                    if !sealed || arena.is_logged(loc) {
                        arena.mark_dead(loc);
                    }
                    arena.release(loc);
                    let old = loc;
                    loc = arena.new_record(key, value, expire_at_ms, tombstone);
                    debug_assert!(packed(loc) > packed(old));
                    slot.set_loc(loc);
                    entries[slot.id as usize] = loc;
                    log.push(loc);
                    *epoch = epoch.wrapping_add(1);
                }
                MemHint::new(*epoch, loc)
            }
            Err(i) => {
                let loc = arena.new_record(key, value, expire_at_ms, tombstone);
                let id = entries.len() as u32;
                entries.push(loc);
                index.fill(i, h32, id, loc);
                fresh.push(id);
                log.push(loc);
                MemHint::new(*epoch, loc)
            }
        }
    }

    /// Bring the memtable under `target` bytes ([`Self::approx_bytes`]) without a freeze, if
    /// chunks that no sealed epoch reads any more can be reused: those whose records were all
    /// replaced since, and sparse ones (at most a quarter of their records live), whose live
    /// records are copied to the current position first. Does nothing unless that frees
    /// enough. True when the memtable fits `target`; hints taken before are stale.
    ///
    /// Why: records whose values outgrew them moved, and the chunks they left hold a few keys
    /// that did not grow for a while: they empty late, so the memtable would fill and freeze
    /// (and its flush, the lookups past it and fresh memory for its successor cost the job).
    pub fn make_room(&mut self, target: usize) -> bool {
        self.arena.refresh_away();
        self.arena.reclaim();
        let fixed = self.approx_bytes() - self.arena.bytes;
        let Some(need) = (self.arena.bytes + fixed).checked_sub(target) else {
            return true;
        };
        self.relocate_sparse(need) && self.approx_bytes() <= target
    }

    /// Bytes of the arena's chunks in use.
    #[inline]
    pub fn arena_bytes(&self) -> usize {
        self.arena.bytes
    }

    /// Bytes that come back once the sealed epochs reading them are dropped: chunks copied
    /// away from them, and replaced records in chunks below the seal mark that they still
    /// read (which [`Self::make_room`] may then reuse).
    pub fn held_replaced_bytes(&self) -> usize {
        let arena = &self.arena;
        let below = ((arena.sealed_below >> 32) as usize).min(arena.chunks.len());
        let replaced: usize = (0..below)
            .filter(|&c| arena.chunks[c].bytes == arena.chunk_bytes)
            .filter(|&c| Arc::strong_count(&arena.chunks[c]) > 1)
            .map(|c| arena.chunk_bytes - arena.chunk_bytes * arena.uses[c].live_share() / 1024)
            .sum();
        replaced + arena.away_bytes
    }

    /// Keep a spare chunk for the next one the arena takes, when a move took the last after a
    /// seal: the sparsest chunk no sealed epoch reads any more, if at most a quarter of it is
    /// live, is emptied into the current chunk (just started, so the copies fit) and retired.
    ///
    /// Why: [`Self::make_room`] runs only at the memtable's share, and until then every chunk
    /// that moves took was fresh memory (a first touch costs about a millisecond per 2 MiB
    /// here, often more).
    #[cold]
    fn make_spare(&mut self) {
        self.arena.wants_spare = false;
        self.arena.reclaim();
        if self.arena.cur + 1 == self.arena.chunks.len() {
            self.relocate_sparse(1);
        }
    }

    /// Copy the live records out of the sparsest unread chunks (at most a quarter live) until
    /// that frees at least `need` bytes, and retire them; nothing if it cannot. True if it
    /// did.
    fn relocate_sparse(&mut self, need: usize) -> bool {
        let arena = &mut self.arena;
        let std_bytes = arena.chunk_bytes;
        let below = ((arena.sealed_below >> 32) as usize).min(arena.chunks.len());
        // (share of the chunk live, in 1/1024ths; chunk), sparsest first.
        let mut sparse = Vec::new();
        for c in 0..below {
            let live = arena.uses[c].live_share();
            if arena.chunks[c].bytes == std_bytes && live <= 256 && arena.unread(c) {
                sparse.push((live, c as u32));
            }
        }
        sparse.sort_unstable();
        // What each frees once its live records are copied (into chunks that count already,
        // or into new ones).
        let (mut freed, mut take) = (0, 0);
        while freed < need && take < sparse.len() {
            freed += std_bytes - std_bytes * sparse[take].0 / 1024;
            take += 1;
        }
        if freed < need {
            return false;
        }
        sparse.truncate(take);
        let Memtable {
            arena,
            entries,
            index,
            epoch,
            log,
            ..
        } = self;
        let mut rec = Vec::new();
        for &(_, c) in &sparse {
            let offs: Vec<u32> = arena.uses[c as usize].live_offsets().collect();
            for off in offs {
                let old = Loc { chunk: c, off };
                let (k, v) = arena.record(old);
                let (klen, expire_at_ms, tombstone) = (k.len(), v.expire_at_ms, v.tombstone());
                rec.clear();
                rec.extend_from_slice(k);
                rec.extend_from_slice(v.bytes);
                let Ok(at) = index.probe(xxh3_64(&rec[..klen]) as u32, |l| l == old) else {
                    debug_assert!(false, "a live record is indexed");
                    continue;
                };
                // Unread: the epoch being written logged none of the chunk's records.
                debug_assert!(!arena.is_logged(old));
                let new = arena.new_record(&rec[..klen], &rec[klen..], expire_at_ms, tombstone);
                let slot = index.slot_mut(at);
                slot.set_loc(new);
                entries[slot.id as usize] = new;
                log.push(new);
                arena.release(old);
            }
        }
        *epoch = epoch.wrapping_add(1);
        arena.reclaim();
        true
    }

    /// Overwrite the value of the record `hint` points at, if the hint is current and the
    /// value fits; false otherwise (the caller then uses [`Self::put_hashed`]). The caller
    /// guarantees the hint was taken for the same key.
    #[inline]
    pub fn overwrite_hinted(
        &mut self,
        hint: MemHint,
        value: &[u8],
        expire_at_ms: u64,
        tombstone: bool,
    ) -> bool {
        let loc = hint.loc();
        if hint.epoch != self.epoch || value.len() > self.arena.capacity(loc) {
            return false;
        }
        if self.arena.is_sealed(loc) && self.arena.log_sealed(loc) {
            self.log.push(loc);
        }
        self.arena.overwrite(loc, value, expire_at_ms, tombstone);
        true
    }

    pub fn get_hashed(&self, key: &[u8], hash: u64) -> Option<ValueRef<'_>> {
        self.find(key, hash).map(|loc| self.arena.record(loc).1)
    }

    /// [`Self::get_hashed`], also returning where the record is (for
    /// [`Self::overwrite_hinted`]).
    #[inline]
    pub fn get_hinted(&self, key: &[u8], hash: u64) -> Option<(ValueRef<'_>, MemHint)> {
        self.find(key, hash)
            .map(|loc| (self.arena.record(loc).1, MemHint::new(self.epoch, loc)))
    }

    /// Key and value of entry id `i`.
    #[inline]
    pub fn entry(&self, i: u32) -> (&[u8], ValueRef<'_>) {
        self.arena.record(self.entries[i as usize])
    }

    /// Key and value of the record at `loc` (from [`Frozen::order`]).
    #[inline]
    pub fn record(&self, loc: Loc) -> (&[u8], ValueRef<'_>) {
        self.arena.record(loc)
    }

    #[inline]
    fn key_at(&self, i: u32) -> &[u8] {
        self.arena.key(self.entries[i as usize])
    }

    /// Sort ids by key (see [`sort_by_key`]).
    fn sort_ids(&self, ids: &mut [u32]) {
        #[cfg(test)]
        tests::SCAN_WORK.with(|w| w.set((w.get().0 + ids.len(), w.get().1)));
        if ids.len() < 2 {
            return;
        }
        let id_bits = bits_for(self.entries.len() as u64 - 1);
        let sorted = sort_by_key(
            ids.len(),
            id_bits,
            |i| {
                let (p, len) = self.arena.prefix_and_len(self.entries[ids[i] as usize]);
                (p, len, u64::from(ids[i]))
            },
            |id| self.key_at(id as u32),
            |id| self.prefetch_loc(self.entries[id as usize]),
        );
        for (slot, id) in ids.iter_mut().zip(sorted.payloads()) {
            *slot = id as u32;
        }
    }

    fn merge_ids(&self, a: &[u32], b: &[u32]) -> Vec<u32> {
        #[cfg(test)]
        tests::SCAN_WORK.with(|w| w.set((w.get().0, w.get().1 + a.len() + b.len())));
        let mut out = Vec::with_capacity(a.len() + b.len());
        let (mut i, mut j) = (0, 0);
        while i < a.len() && j < b.len() {
            if self.key_at(a[i]) <= self.key_at(b[j]) {
                out.push(a[i]);
                i += 1;
            } else {
                out.push(b[j]);
                j += 1;
            }
        }
        out.extend_from_slice(&a[i..]);
        out.extend_from_slice(&b[j..]);
        out
    }

    /// Make every run sorted: sort only the ids appended since the last call (O(f log f) for
    /// f new ids), push them as a run, and merge the newest runs while the older is not more
    /// than twice the newer (amortized O(log n) merges per id). A scan after a few appends
    /// therefore costs about the appends, not the memtable.
    pub fn prepare_scan(&mut self) {
        if !self.fresh.is_empty() {
            let mut ids = self.fresh.to_vec();
            self.fresh.clear();
            self.sort_ids(&mut ids);
            self.runs.push(ids);
        }
        while self.runs.len() >= 2 {
            let n = self.runs.len();
            if self.runs[n - 2].len() > 2 * self.runs[n - 1].len() && n <= MAX_RUNS {
                break;
            }
            let (Some(b), Some(a)) = (self.runs.pop(), self.runs.pop()) else {
                unreachable!("two runs")
            };
            self.runs.push(self.merge_ids(&a, &b));
        }
    }

    /// The sorted id runs; valid after [`Self::prepare_scan`] (no put in between).
    pub fn runs(&self) -> Vec<&[u32]> {
        debug_assert!(self.fresh.is_empty());
        self.runs.iter().map(Vec::as_slice).collect()
    }

    /// Every record in key order (used once per frozen memtable). Sorts record addresses
    /// taken straight from the entry table, so the result addresses records without the entry
    /// table, and a flush reads each record once, in a predictable order. The table lists
    /// records in allocation order, which is address order but for records that moved.
    fn full_order(&self) -> ZeroedBuf<Loc> {
        order_of(&self.arena, self.entries.len(), None, |i| self.entries[i])
    }

    /// Index of the first id in sorted run `ids` whose key is >= `key`.
    pub fn lower_bound(&self, ids: &[u32], key: &[u8]) -> usize {
        ids.partition_point(|&i| self.key_at(i) < key)
    }

    /// Index of the first record in sorted `locs` whose key is >= `key`.
    pub fn lower_bound_locs(&self, locs: &[Loc], key: &[u8]) -> usize {
        locs.partition_point(|&l| self.arena.key(l) < key)
    }

    /// Hint the CPU to load the record at `loc` (flushes read records in sorted order, which
    /// is random in the arena: loading a few ahead overlaps the misses).
    #[inline]
    pub fn prefetch_loc(&self, loc: Loc) {
        self.arena.prefetch_loc(loc);
    }
}

impl Arena {
    /// See [`Memtable::prefetch_loc`].
    #[inline]
    fn prefetch_loc(&self, loc: Loc) {
        // Records are 16-aligned, so a small one may still cross into the next line, where
        // its key or value would then miss: request both lines.
        let r = self.chunk(loc);
        prefetch_read(r.as_ptr());
        if let Some(next) = r.get(64) {
            prefetch_read(next);
        }
    }
}

/// The `n` records `loc_at(0..n)` of `arena`, in key order (keys must be distinct).
/// `ahead`: how many records ahead of the one read to prefetch, for records scattered over the
/// arena; `None` for records in address order, which the hardware prefetcher follows (a
/// software prefetch there only cost instructions: the sort of a 1.6 M record flush took
/// 37.4-38.5 ms with it, 33.2-34.2 ms without).
fn order_of(
    arena: &Arena,
    n: usize,
    ahead: Option<usize>,
    loc_at: impl Fn(usize) -> Loc,
) -> ZeroedBuf<Loc> {
    // A record address packed as (chunk, offset / 16) in as few bits as this arena needs.
    let chunks = &arena.chunks;
    let off_bits = bits_for(
        chunks
            .iter()
            .map(|c| c.bytes as u64 / 16)
            .max()
            .unwrap_or(1)
            - 1,
    );
    let chunk_bits = bits_for((arena.base + chunks.len()).max(1) as u64 - 1);
    let pack = |loc: Loc| u64::from(loc.chunk) << off_bits | u64::from(loc.off / 16);
    let unpack = |p: u64| Loc {
        chunk: (p >> off_bits) as u32,
        off: ((p & ((1 << off_bits) - 1)) * 16) as u32,
    };
    let sorted = sort_by_key(
        n,
        chunk_bits + off_bits,
        |i| {
            let loc = loc_at(i);
            let (p, len) = match ahead {
                // An epoch's log lists sealed records in update order, all over the arena
                // (the first load of each record was 59% of this sort in the checkpointed
                // keyed job).
                Some(ahead) => {
                    if i + ahead < n {
                        arena.prefetch_loc(loc_at(i + ahead));
                    }
                    arena.prefix_and_len(loc)
                }
                None => arena.prefix_and_len_inlined(loc),
            };
            (p, len, pack(loc))
        },
        |p| arena.key(unpack(p)),
        |p| arena.prefetch_loc(unpack(p)),
    );
    let mask = sorted.payload_mask;
    sorted.v.map_in_place(|e| unpack(e & mask))
}

/// The records one epoch of a memtable wrote, sealed by a snapshot ([`Memtable::seal`]):
/// what the snapshot writes as its incremental segment. Shares the arena chunks with the
/// memtable, which from then on writes only above the seal mark in a shared chunk (and copies
/// the chunk to write below it), so the job that writes the segment can read the records on
/// another thread while the shard goes on.
#[derive(Debug)]
pub(crate) struct Sealed {
    /// A read-only view of the memtable's chunks that hold the epoch's records.
    arena: Arena,
    /// The epoch's records (see `Memtable::log`), including records replaced within it.
    log: MapVec<Loc>,
}

impl Sealed {
    /// The epoch's live records in key order. A key has at most one: within an epoch its
    /// record is updated in place, and a record that moves is marked dead.
    ///
    /// The log's records are read front to back, prefetched [`SEQUENTIAL_AHEAD`] ahead (new
    /// records are in allocation order, so that is as far as a few lines of them). With no
    /// dead record (values
    /// that kept their size, as counters and fixed-size aggregates do) the log is the live set
    /// and the filtering pass is skipped: it was a sixth of the checkpointed keyed job's
    /// snapshot sorting, every record's first load.
    fn order(&self) -> ZeroedBuf<Loc> {
        let log = &self.log[..];
        if self.arena.dead == 0 {
            return order_of(&self.arena, log.len(), Some(SEQUENTIAL_AHEAD), |i| log[i]);
        }
        let mut live = MapVec::scratch_with_capacity(log.len());
        for (i, &l) in log.iter().enumerate() {
            if let Some(&ahead) = log.get(i + SEQUENTIAL_AHEAD) {
                self.arena.prefetch_loc(ahead);
            }
            if !self.arena.is_dead(l) {
                live.push(l);
            }
        }
        let order = order_of(&self.arena, live.len(), Some(SEQUENTIAL_AHEAD), |i| live[i]);
        live.recycle();
        order
    }
}

/// What waits for its flush: an immutable memtable, or a sealed epoch of one (then `mem` is
/// empty and lookups pass it by: the memtable it was sealed from is newer and holds every
/// one of its keys). `gen` orders frozen memtables and segments.
#[derive(Debug)]
pub(crate) struct Frozen {
    pub mem: Memtable,
    pub gen: u64,
    /// Which memtable of the store this is or was sealed from (the store's count).
    pub owner: u64,
    sealed: Option<Sealed>,
    order: OnceLock<Order>,
}

/// A frozen memtable's records in key order. Its mapping goes back to the scratch pool when
/// the frozen memtable goes (usually on a shard's thread), for the next flush's sort.
#[derive(Debug)]
struct Order(ZeroedBuf<Loc>);

impl Drop for Order {
    fn drop(&mut self) {
        std::mem::replace(&mut self.0, ZeroedBuf::new(0)).recycle();
    }
}

/// How many records ahead an ordered walk over a frozen memtable prefetches.
const PREFETCH_AHEAD: usize = 8;
/// How many records ahead a walk in allocation order (a sealed epoch's log) prefetches:
/// consecutive records share lines, so it can run further ahead for the same lines in flight.
const SEQUENTIAL_AHEAD: usize = 24;

impl Frozen {
    pub fn new(mem: Memtable, gen: u64) -> Frozen {
        Frozen {
            mem,
            gen,
            owner: 0,
            sealed: None,
            order: OnceLock::new(),
        }
    }

    /// A sealed epoch of memtable `owner`.
    pub fn sealed(s: Sealed, gen: u64, owner: u64) -> Frozen {
        Frozen {
            mem: Memtable::default(),
            gen,
            owner,
            sealed: Some(s),
            order: OnceLock::new(),
        }
    }

    /// A sealed epoch's log, once nothing reads the epoch.
    pub fn into_log(self) -> Option<MapVec<Loc>> {
        self.sealed.map(|s| s.log)
    }

    pub fn with_owner(mut self, owner: u64) -> Frozen {
        self.owner = owner;
        self
    }

    pub fn is_sealed(&self) -> bool {
        self.sealed.is_some()
    }

    fn arena(&self) -> &Arena {
        match &self.sealed {
            Some(s) => &s.arena,
            None => &self.mem.arena,
        }
    }

    /// Records in key order, computed once.
    pub fn order(&self) -> &[Loc] {
        &self
            .order
            .get_or_init(|| {
                Order(match &self.sealed {
                    Some(s) => s.order(),
                    None => self.mem.full_order(),
                })
            })
            .0
    }

    /// Number of entries (live records).
    pub fn len(&self) -> usize {
        match &self.sealed {
            Some(_) => self.order().len(),
            None => self.mem.len(),
        }
    }

    /// Every entry in key order, prefetching records a few ahead.
    pub fn entries(&self) -> impl Iterator<Item = (&[u8], ValueRef<'_>)> + '_ {
        let order = self.order();
        let arena = self.arena();
        order.iter().enumerate().map(move |(i, &loc)| {
            if let Some(&ahead) = order.get(i + PREFETCH_AHEAD) {
                arena.prefetch_loc(ahead);
            }
            arena.record(loc)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    thread_local! {
        /// (ids sorted by `sort_ids`, ids moved by `merge_ids`) on this thread: the scan
        /// work that `interleaved_put_and_scan_sorts_only_new_ids` bounds.
        pub(super) static SCAN_WORK: std::cell::Cell<(usize, usize)> =
            const { std::cell::Cell::new((0, 0)) };
    }
    use proptest::prelude::*;

    /// A sealed epoch lists each key it wrote once, in key order, with its last value of the
    /// epoch: copies of records an earlier epoch sealed, in-place overwrites, and records that
    /// moved because their value outgrew them (the dead ones stay out). An epoch without a
    /// move takes the shortcut past the filtering pass.
    #[test]
    fn a_sealed_epoch_lists_each_key_once_in_key_order() {
        let mut m = Memtable::with_budget(64 << 20);
        let key = |i: u32| i.to_be_bytes().to_vec();
        for i in 0..1000u32 {
            m.put(&key(i), &[1; 8], NO_EXPIRY, false);
        }
        let first = m.seal().expect("written");
        for i in (0..1000u32).step_by(2) {
            // A copy of the sealed record, then an overwrite of the copy.
            m.put(&key(i), &[2; 8], NO_EXPIRY, false);
            m.put(&key(i), &[3; 8], NO_EXPIRY, false);
        }
        for i in (0..1000u32).step_by(3) {
            // Even keys move (their copy is unsealed and too small), odd ones are copied.
            m.put(&key(i), &[4; 40], NO_EXPIRY, false);
        }
        let second = m.seal().expect("written");
        assert_eq!(first.arena.dead, 0);
        let want: Vec<_> = (0..1000u32).map(|i| (key(i), vec![1; 8])).collect();
        assert_eq!(listed(&first), want);
        assert_eq!(second.arena.dead, (0..1000).step_by(6).count());
        let want: Vec<_> = (0..1000u32)
            .filter_map(|i| match (i % 3, i % 2) {
                (0, _) => Some((key(i), vec![4; 40])),
                (_, 0) => Some((key(i), vec![3; 8])),
                _ => None,
            })
            .collect();
        assert_eq!(listed(&second), want);
    }

    /// Updates after a seal write records where they are: the first write in an epoch to a
    /// chunk that a sealed epoch's view shares copies the chunk, once, and the view keeps the
    /// records as they were at its seal. The arena does not grow; the copies count in the
    /// memtable's bytes until the views holding the originals are dropped. A chunk that no
    /// view holds any more is written without a copy.
    #[test]
    fn updates_after_a_seal_copy_each_shared_chunk_once_and_records_stay_put() {
        let key = |i: u32| i.to_be_bytes().to_vec();
        let big = |round: u64| vec![round as u8; 100 << 10];
        let n = 4000u32;
        // 64 KiB chunks; 48-byte records: every key fills 3 of them. One key's value is larger
        // than a chunk and has a chunk of its own.
        let fill = |m: &mut Memtable, round: u64| {
            for i in 0..n {
                m.put(&key(i), &round.to_le_bytes(), NO_EXPIRY, false);
            }
            m.put(&key(n), &big(round), NO_EXPIRY, false);
        };
        let want = |round: u64| -> Vec<(Vec<u8>, Vec<u8>)> {
            (0..=n)
                .map(|i| {
                    let v = if i == n {
                        big(round)
                    } else {
                        round.to_le_bytes().to_vec()
                    };
                    (key(i), v)
                })
                .collect()
        };
        let ptrs = |m: &Memtable| m.arena.chunks.iter().map(|c| c.ptr).collect::<Vec<_>>();
        let rounds = 30u64;

        // Each epoch is read while the next one is written, then dropped.
        let mut m = Memtable::with_budget(1 << 20);
        fill(&mut m, 0);
        assert_eq!(m.arena.chunk_bytes, 64 << 10);
        let (chunks, bytes) = (m.arena.chunks.len(), m.arena.bytes);
        assert_eq!(chunks, 4, "three of small records and the big value's");
        for round in 1..=rounds {
            let epoch = m.seal().expect("written");
            let (sealed, base) = (ptrs(&m), m.approx_bytes());
            fill(&mut m, round);
            let copied = ptrs(&m);
            assert!(
                sealed.iter().zip(&copied).all(|(a, b)| a != b),
                "round {round}: every chunk copied"
            );
            assert_eq!(m.arena.away_bytes, bytes, "round {round}");
            assert!(
                m.approx_bytes() >= base + bytes,
                "round {round}: copies count"
            );
            // Once per epoch: the same chunks take the next writes.
            fill(&mut m, round);
            assert_eq!(ptrs(&m), copied);
            assert_eq!(listed(&epoch), want(round - 1), "round {round}");
            drop(epoch);
            m.refresh_away();
            assert_eq!(m.arena.away_bytes, 0, "round {round}: the copies came back");
            assert_eq!((m.arena.chunks.len(), m.arena.bytes), (chunks, bytes));
        }
        for i in 0..=n {
            let v = m.get_hashed(&key(i), xxh3_64(&key(i))).expect("present");
            let w = if i == n {
                big(rounds)
            } else {
                rounds.to_le_bytes().to_vec()
            };
            assert_eq!(v.bytes, &w[..]);
        }
        // An epoch dropped before the next writes: no copy.
        drop(m.seal().expect("written"));
        let before = ptrs(&m);
        fill(&mut m, rounds + 1);
        assert_eq!(ptrs(&m), before);
        let epoch = m.seal().expect("written");
        assert_eq!(listed(&epoch), want(rounds + 1));

        // Epochs that stay read keep their chunks: each one's records are intact after the
        // others were written over and over, and each counts one arena of copies.
        let mut m = Memtable::with_budget(1 << 20);
        fill(&mut m, 0);
        let mut epochs = Vec::new();
        for round in 1..=rounds {
            epochs.push(m.seal().expect("written"));
            fill(&mut m, round);
        }
        assert_eq!((m.arena.chunks.len(), m.arena.bytes), (chunks, bytes));
        assert_eq!(m.arena.away_bytes, rounds as usize * bytes);
        assert!(m.approx_bytes() > m.arena.away_bytes + bytes);
        for (round, epoch) in epochs.iter().enumerate() {
            assert_eq!(listed(epoch), want(round as u64), "epoch {round}");
        }
        epochs.truncate(rounds as usize / 2);
        m.refresh_away();
        assert_eq!(m.arena.away_bytes, rounds as usize / 2 * bytes);
    }

    /// `make_room` copies the few live records of chunks no epoch reads any more and reuses
    /// those chunks; it leaves dense chunks, and chunks an epoch still reads, alone.
    #[test]
    fn make_room_copies_the_few_live_records_of_unread_chunks() {
        let key = |i: u32| i.to_be_bytes().to_vec();
        let n = 4000u32;
        // Every key at value 0 (48-byte records), sealed and read; then `share` of the keys
        // given a value that outgrows its record (moved to 80-byte ones).
        let setup = |share: u32| {
            let mut m = Memtable::with_budget(1 << 20);
            for i in 0..n {
                m.put(&key(i), &[0; 8], NO_EXPIRY, false);
            }
            let epoch = m.seal().expect("written");
            for i in (0..n).filter(|i| i % 10 < share) {
                m.put(&key(i), &[1; 40], NO_EXPIRY, false);
            }
            (m, epoch)
        };
        fn value(m: &Memtable, i: u32) -> &[u8] {
            let k = i.to_be_bytes();
            m.get_hashed(&k, xxh3_64(&k)).unwrap().bytes
        }
        let want = |i: u32, share: u32| {
            if i % 10 < share {
                vec![1; 40]
            } else {
                vec![0; 8]
            }
        };
        let chunk = 64 << 10;

        // 9 keys in 10 moved: the first epoch's chunks hold a tenth of their records live.
        let (mut m, epoch) = setup(9);
        let before = m.approx_bytes();
        assert!(!m.make_room(before - chunk), "the epoch is still read");
        assert_eq!(m.approx_bytes(), before);
        drop(epoch);
        // The second seal puts the moves' chunks below the mark as well (dense: 9 in 10).
        let second = m.seal().expect("written");
        drop(second);
        let h = xxh3_64(&key(0));
        let (_, hint) = m.get_hinted(&key(0), h).unwrap();
        assert!(m.make_room(before - 2 * chunk));
        assert!(m.approx_bytes() <= before - 2 * chunk);
        assert!(
            !m.overwrite_hinted(hint, &[5; 8], NO_EXPIRY, false),
            "hint went stale"
        );
        for i in 0..n {
            assert_eq!(value(&m, i), &want(i, 9)[..], "key {i}");
        }
        // The copies are in the next epoch, with the values they had: keys not updated since
        // the first epoch, from the chunks it reused.
        let copies = listed(&m.seal().expect("copied"));
        assert!(
            copies.len() >= 2 * chunk / 48 / 10 - 10,
            "{} copies",
            copies.len()
        );
        for (k, v) in copies {
            let i = u32::from_be_bytes(k.try_into().unwrap());
            assert_eq!((i % 10, v), (9, vec![0; 8]), "key {i}");
        }

        // 1 key in 10 moved: the first epoch's chunks are dense, nothing is done.
        let (mut m, epoch) = setup(1);
        drop(epoch);
        drop(m.seal());
        let before = m.approx_bytes();
        assert!(!m.make_room(before - chunk));
        assert_eq!(m.approx_bytes(), before);
        for i in 0..n {
            assert_eq!(value(&m, i), &want(i, 1)[..], "key {i}");
        }
    }

    /// Sixty rounds of updates to nine keys in ten, each sealed and its epoch read while the
    /// next is written: every epoch lists exactly its round's values, and the arena stays at
    /// the chunks the keys filled. (When sealed records were copied one by one, keys left
    /// alone for a while kept the chunks of the epochs they were last copied in: up to 7
    /// chunks here with a spare kept by emptying sparse ones, 11 without.)
    #[test]
    fn updates_after_seals_keep_the_arena_at_the_keys_chunks() {
        let key = |i: u32| i.to_be_bytes().to_vec();
        let n = 4000u32;
        let chunk = 64 << 10;
        let mut m = Memtable::with_budget(1 << 20);
        let mut last = vec![0u8; n as usize];
        for i in 0..n {
            m.put(&key(i), &[0; 8], NO_EXPIRY, false);
        }
        let mut held = None;
        let mut most = 0;
        for round in 1..=60u8 {
            // Nine keys in ten updated; the tenth left alone changes every eight rounds.
            let skip = u32::from(round / 8) % 10;
            for i in (0..n).filter(|i| i % 10 != skip) {
                m.put(&key(i), &[round; 8], NO_EXPIRY, false);
                last[i as usize] = round;
            }
            let epoch = m.seal().expect("written");
            // This round's updates and nothing else (the first epoch also has the first puts).
            let listed = listed(&epoch);
            let updated = (0..n).filter(|i| i % 10 != skip).count();
            assert_eq!(listed.len(), if round == 1 { n as usize } else { updated });
            for (k, v) in listed {
                let i = u32::from_be_bytes(k.try_into().unwrap());
                assert_eq!(v, vec![last[i as usize]; 8], "round {round}, key {i}");
            }
            // An epoch is read while the next one is written, as a snapshot job does.
            held = Some(epoch);
            most = most.max(m.arena.bytes / chunk);
        }
        drop(held);
        for i in 0..n {
            let k = key(i);
            let got = m.get_hashed(&k, xxh3_64(&k)).unwrap().bytes;
            assert_eq!(got, &[last[i as usize]; 8], "key {i}");
        }
        // The keys take 3 chunks (48-byte records, 64 KiB chunks).
        assert_eq!(most, 3, "chunks in use at most");
    }

    /// Records that move after seals (values that outgrow them) and take the arena's last
    /// spare chunk empty a sparse chunk no epoch reads for the next one: keys left alone for
    /// a while keep the chunks of the records they last moved to, which otherwise pile up
    /// until the memtable's share.
    #[test]
    fn moves_keep_a_spare_chunk_by_emptying_sparse_ones() {
        let key = |i: u32| i.to_be_bytes().to_vec();
        let n = 4000u32;
        let mut m = Memtable::with_budget(1 << 20);
        let mut last: Vec<Vec<u8>> = vec![vec![0; 8]; n as usize];
        for i in 0..n {
            m.put(&key(i), &last[i as usize], NO_EXPIRY, false);
        }
        let mut held = None;
        let mut most_garbage = 0;
        for round in 1..=40u32 {
            let epoch = m.seal().expect("written");
            // Nine keys in ten get a value 16 bytes longer than any before (each moves); the
            // tenth left alone changes every eight rounds, so the chunks it is in keep a
            // tenth of their records live that long.
            let skip = (round / 8) % 10;
            let v = vec![round as u8; 8 + 16 * round as usize];
            for i in (0..n).filter(|i| i % 10 != skip) {
                m.put(&key(i), &v, NO_EXPIRY, false);
                last[i as usize] = v.clone();
            }
            // An epoch is read while the next one is written, as a snapshot job does.
            held = Some(epoch);
            let live: usize = last
                .iter()
                .map(|v| REC_HEADER + round16(4) + round16(v.len()))
                .sum();
            most_garbage = most_garbage.max(m.arena.bytes.saturating_sub(live));
        }
        drop(held);
        for i in 0..n {
            let k = key(i);
            let got = m.get_hashed(&k, xxh3_64(&k)).unwrap().bytes;
            assert_eq!(got, &last[i as usize][..], "key {i}");
        }
        // The last rounds' moves fill about 38 chunks of 64 KiB each: the records that the
        // epoch still read and the round being written replaced are up to two rounds of them.
        // Sparse chunks emptied as spares are needed add little: 72 chunks at most here, 100
        // when they waited for their last live record to move (make_spare disabled).
        let chunk = m.arena.chunk_bytes;
        assert!(
            most_garbage <= 80 * chunk,
            "{} chunks of replaced records at most",
            most_garbage / chunk
        );
    }

    /// A chunk whose records all moved within the epoch being written is not reused before
    /// that epoch is sealed and read: its log still lists the dead records there.
    #[test]
    fn a_chunk_emptied_within_an_epoch_waits_for_its_seal() {
        let key = |i: u32| i.to_be_bytes().to_vec();
        let mut m = Memtable::with_budget(1 << 20);
        for round in 0..3u8 {
            // 48-byte records fill chunk after chunk, then each moves to an 80-byte one.
            for i in 0..3000u32 {
                m.put(&key(i), &[round; 8], NO_EXPIRY, false);
            }
            for i in 0..3000u32 {
                m.put(&key(i), &[round; 40], NO_EXPIRY, false);
            }
            let epoch = m.seal().expect("written");
            let want: Vec<_> = (0..3000u32).map(|i| (key(i), vec![round; 40])).collect();
            assert_eq!(listed(&epoch), want, "round {round}");
        }
    }

    /// A huge-page chunk's memory outlives its last holder in the pool, and the next chunk is
    /// made of it, contents and all (records are written before they are read); chunks of
    /// other sizes are not pooled.
    #[test]
    fn a_dropped_chunk_is_the_next_chunk() {
        static POOL: ScratchPool = ScratchPool::new(4, 8 << 20);
        let elems = HUGE_PAGE_BYTES / 16;
        let mut first = Chunk::new_in(&POOL, elems);
        first.populate();
        // SAFETY: the chunk is unshared and `ptr` addresses its `bytes` bytes.
        unsafe { first.ptr.add(4096).write(0xa5) };
        let ptr = first.ptr;
        // A sealed epoch's view shares it: the memtable letting go returns nothing yet.
        let view = Arc::new(first);
        let held = Arc::clone(&view);
        drop(held);
        assert_eq!(POOL.bytes(), 0);
        drop(view);
        assert_eq!(POOL.bytes(), HUGE_PAGE_BYTES);
        let next = Chunk::new_in(&POOL, elems);
        assert_eq!(POOL.bytes(), 0);
        assert_eq!(next.ptr, ptr);
        // SAFETY: as above.
        assert_eq!(unsafe { next.ptr.add(4096).read() }, 0xa5);
        drop(next);
        assert_eq!(POOL.bytes(), HUGE_PAGE_BYTES);
        drop(Chunk::new_in(&POOL, (64 << 10) / 16));
        assert_eq!(POOL.bytes(), HUGE_PAGE_BYTES);
    }

    /// A memtable that replaces a frozen one starts with its index size, at most half its
    /// budget, and never below what its budget alone gives.
    #[test]
    fn a_successor_starts_with_its_predecessors_index() {
        let mut prev = Memtable::with_budget(64 << 20);
        let start = prev.index_slots();
        for i in 0..200_000u32 {
            prev.put(&i.to_be_bytes(), &[1; 8], NO_EXPIRY, false);
        }
        let grown = prev.index_slots();
        assert!(grown > start, "the index grew: {start} -> {grown}");
        assert_eq!(Memtable::successor_of(&prev, 64 << 20).index_slots(), grown);
        // Half of a 4 MiB budget holds 128 Ki slots of 16 bytes.
        let small = Memtable::successor_of(&prev, 4 << 20).index_slots();
        assert!(
            small * std::mem::size_of::<Slot>() <= 2 << 20,
            "{small} slots"
        );
        assert!(
            small >= Memtable::with_budget(4 << 20).index_slots(),
            "never below what the budget gives"
        );
        assert_eq!(
            Memtable::successor_of(&Memtable::with_budget(64 << 20), 64 << 20).index_slots(),
            start
        );
    }

    /// While the index grows, some keys are in the old table and some in the new: lookups,
    /// updates in place and records that move (a longer value) must find the one slot of
    /// each key, and a key must never be inserted twice.
    #[test]
    fn keys_stay_findable_and_updatable_while_the_index_grows() {
        let mut m = Memtable::with_budget(1024);
        let mut model: std::collections::HashMap<u32, Vec<u8>> = Default::default();
        let mut saw_growth = 0;
        let check = |m: &Memtable, k: u32, want: &[u8]| {
            let kb = k.to_be_bytes();
            assert_eq!(
                m.get_hashed(&kb, xxh3_64(&kb)).unwrap().bytes,
                want,
                "key {k}"
            );
            assert!(m.prefetch_record(xxh3_64(&kb)));
        };
        for i in 0..40_000u32 {
            let v = i.to_le_bytes().to_vec();
            m.put(&i.to_be_bytes(), &v, NO_EXPIRY, false);
            model.insert(i, v);
            // Older keys, likely still in the old table: one updated in place, one moved.
            let (a, b) = (i / 2, i / 3);
            let va = vec![1u8; 4];
            m.put(&a.to_be_bytes(), &va, NO_EXPIRY, false);
            model.insert(a, va);
            let vb = vec![2u8; 4 + (i % 64) as usize];
            m.put(&b.to_be_bytes(), &vb, NO_EXPIRY, false);
            model.insert(b, vb);
            saw_growth += usize::from(m.index.old.is_some());
            for k in [i, a, b, i.wrapping_mul(7919) % (i + 1)] {
                check(&m, k, &model[&k]);
            }
        }
        assert!(saw_growth > 1000, "migrations were exercised: {saw_growth}");
        assert_eq!(m.len(), model.len());
        assert_eq!(m.index.len, model.len());
        for (&k, v) in &model {
            check(&m, k, v);
        }
        let absent = 99_999u32.to_be_bytes();
        assert!(m.get_hashed(&absent, xxh3_64(&absent)).is_none());
    }

    #[test]
    fn the_index_grows_and_reuse_forgets_every_key_even_when_generations_wrap() {
        let mut m = Memtable::with_budget(1024);
        assert_eq!(m.index.slots.len(), MIN_INDEX_SLOTS);
        for i in 0..5000u32 {
            m.put(&i.to_be_bytes(), &i.to_le_bytes(), NO_EXPIRY, false);
        }
        assert!(m.index.slots.len() >= 5000 * 4 / 3);
        for i in 0..5000u32 {
            let k = i.to_be_bytes();
            assert_eq!(
                m.get_hashed(&k, xxh3_64(&k)).unwrap().bytes,
                &i.to_le_bytes()
            );
            // Prefetching never changes what a lookup finds.
            m.prefetch(xxh3_64(&k));
            assert!(m.prefetch_record(xxh3_64(&k)));
        }
        let absent = 9999u64.to_be_bytes();
        assert!(m.get_hashed(&absent, xxh3_64(&absent)).is_none());
        let _ = m.prefetch_record(xxh3_64(&absent));
        // Each reuse is one generation; after 65535 of them the tag wraps and the slots are
        // really zeroed. No key of an earlier use may come back at any point.
        for round in 0..70_000u32 {
            m.recycle();
            if round % 9_973 == 0 || (65_530..=65_540).contains(&round) {
                for i in 0..5000u32 {
                    let k = i.to_be_bytes();
                    assert!(m.get_hashed(&k, xxh3_64(&k)).is_none(), "round {round}");
                }
            }
            let k = round.to_be_bytes();
            m.put(&k, b"v", NO_EXPIRY, false);
            assert_eq!(m.len(), 1);
        }
        let k = 69_999u32.to_be_bytes();
        assert_eq!(m.get_hashed(&k, xxh3_64(&k)).unwrap().bytes, b"v");
    }

    #[test]
    fn the_index_starts_small_and_its_whole_capacity_counts() {
        let mut m = Memtable::with_budget(64 << 20);
        assert_eq!(m.index.bytes(), 1 << 20);
        assert!(m.approx_bytes() >= 1 << 20);
        for i in 0..100_000u32 {
            m.put(&i.to_be_bytes(), &[0; 16], NO_EXPIRY, false);
        }
        // Grown at 98 304 keys to 256 Ki slots; the old table's slots are still moving over,
        // and both tables count.
        assert_eq!(m.index.bytes(), (4 << 20) + (2 << 20));
        for i in 100_000..120_000u32 {
            m.put(&i.to_be_bytes(), &[0; 16], NO_EXPIRY, false);
        }
        assert_eq!(m.index.bytes(), 4 << 20, "doubled twice, to 256 Ki slots");
        assert!(m.approx_bytes() >= (4 << 20) + 120_000 * 48);
    }

    #[test]
    fn update_in_place_and_grow() {
        let mut m = Memtable::new();
        m.put(b"k1", &[1; 8], NO_EXPIRY, false);
        let before = m.approx_bytes();
        for i in 0..1000u64 {
            m.put(b"k1", &i.to_le_bytes(), NO_EXPIRY, false);
        }
        assert_eq!(m.approx_bytes(), before, "same-size updates reuse the slot");
        let v = m.get_hashed(b"k1", xxh3_64(b"k1")).unwrap();
        assert_eq!(v.bytes, &999u64.to_le_bytes());
        assert_eq!(v.bytes.as_ptr() as usize % 16, 0, "values are 16-aligned");
        m.put(b"k1", &[7; 40], 5, false);
        let v = m.get_hashed(b"k1", xxh3_64(b"k1")).unwrap();
        assert_eq!((v.bytes, v.expire_at_ms), (&[7u8; 40][..], 5));
        m.put(b"k1", b"", NO_EXPIRY, true);
        assert!(m.get_hashed(b"k1", xxh3_64(b"k1")).unwrap().tombstone());
        assert_eq!(m.len(), 1);
    }

    #[test]
    fn a_prefaulted_memtable_fills_without_new_chunks_or_index_growth() {
        let budget = 8 << 20;
        let mut m = Memtable::with_budget(budget);
        let faulted = m.prefault(budget);
        assert!(
            faulted >= budget / 4 * 3,
            "faulted {faulted} of {budget}, less the flush's sort reserve"
        );
        let (chunks, slots) = (m.arena.chunks.len(), m.index.slots.len());
        assert_eq!(
            slots,
            1 << 17,
            "the largest power of two at most budget / 48"
        );
        // Accounted as a fresh memtable: the chunk in use, the tables and the index, not the
        // spare chunks.
        assert_eq!(
            m.approx_bytes(),
            m.arena.chunk_bytes + m.tables_bytes() + m.index.bytes()
        );
        let key = |i: u64| [&[0u8, 7][..], &i.to_be_bytes()].concat();
        let mut n = 0u64;
        while m.approx_bytes() < budget && !m.index.needs_growth() {
            m.put(&key(n), &n.to_le_bytes(), 0, false);
            n += 1;
        }
        // 48-byte records, 16 bytes of sort reserve, the tables and the index.
        assert!(n > 60_000, "filled {n} entries");
        assert_eq!(
            m.arena.chunks.len(),
            chunks,
            "no chunk allocated while filling"
        );
        assert_eq!(m.index.slots.len(), slots, "the index did not grow");
        for i in (0..n).step_by(7) {
            let v = m.get_hashed(&key(i), xxh3_64(&key(i))).expect("present");
            assert_eq!(v.bytes, &i.to_le_bytes());
        }
        // Prefaulting a memtable that holds entries keeps them and its index.
        m.prefault(budget);
        assert_eq!(m.len(), n as usize);
        assert_eq!(m.index.slots.len(), slots);
        let k = key(n - 1);
        assert!(m.get_hashed(&k, xxh3_64(&k)).is_some());
    }

    #[test]
    fn a_memtable_reaches_its_share_without_doubling_its_tables_past_it() {
        // Filled as the store fills it: until it counts its share. What it holds then, with
        // its flush's sort reserve, stays within the share but for the last arena chunk.
        let share = 8 << 20;
        let mut m = Memtable::with_budget(share);
        let key = |i: u64| [&[0u8, 7][..], &i.to_be_bytes()].concat();
        let mut n = 0u64;
        while m.approx_bytes() < share {
            m.put(&key(n), &n.to_le_bytes(), NO_EXPIRY, false);
            n += 1;
        }
        let held = m.held_bytes() + m.len() * FLUSH_ORDER_BYTES;
        assert!(
            held <= share + m.arena.chunk_bytes,
            "{n} entries hold {held} bytes against a share of {share} (tables of {})",
            m.entries.capacity()
        );
        // The tables were full, not grown: the next memtable reuses them at this size.
        assert_eq!(m.entries.len(), m.entries.capacity(), "{n} entries");
        for i in (0..n).step_by(11) {
            let v = m.get_hashed(&key(i), xxh3_64(&key(i))).expect("present");
            assert_eq!(v.bytes, &i.to_le_bytes());
        }
    }

    #[test]
    fn hints_go_stale_when_the_record_moves_or_the_memtable_is_reused() {
        let mut m = Memtable::new();
        m.set_incarnation(3);
        let h = xxh3_64(b"k");
        let hint = m.put_hashed(b"k", h, &[1; 8], NO_EXPIRY, false);
        assert_eq!(m.get_hinted(b"k", h).map(|(_, x)| x), Some(hint));
        assert!(
            m.overwrite_hinted(hint, &[2; 16], NO_EXPIRY, false),
            "fits its slot"
        );
        assert_eq!(m.get_hashed(b"k", h).unwrap().bytes, &[2; 16]);
        assert!(
            !m.overwrite_hinted(hint, &[3; 17], NO_EXPIRY, false),
            "does not fit"
        );
        // The record moves: the old hint is stale, even for values that would fit.
        let moved = m.put_hashed(b"k", h, &[4; 40], NO_EXPIRY, false);
        assert_ne!(moved, hint);
        assert!(!m.overwrite_hinted(hint, &[5; 1], NO_EXPIRY, false));
        assert_eq!(m.get_hashed(b"k", h).unwrap().bytes, &[4; 40]);
        // Shrinking keeps the capacity: growing back stays in place.
        assert!(m.overwrite_hinted(moved, &[6; 1], 9, true));
        let v = m.get_hashed(b"k", h).unwrap();
        assert_eq!(
            (v.bytes, v.expire_at_ms, v.tombstone()),
            (&[6u8][..], 9, true)
        );
        assert!(m.overwrite_hinted(moved, &[7; 48], NO_EXPIRY, false));
        assert_eq!(m.get_hashed(b"k", h).unwrap().bytes, &[7; 48]);
        m.recycle();
        assert!(!m.overwrite_hinted(moved, &[8; 1], NO_EXPIRY, false));
        let again = m.put_hashed(b"k", h, &[9; 8], NO_EXPIRY, false);
        m.set_incarnation(4);
        assert!(!m.overwrite_hinted(again, &[8; 1], NO_EXPIRY, false));
        assert_eq!(m.len(), 1);
    }

    #[test]
    fn scans_see_sorted_order_across_tail_merges() {
        let mut m = Memtable::new();
        let mut model = std::collections::BTreeSet::new();
        for round in 0..3 {
            for i in 0..5000u32 {
                let k = (i.wrapping_mul(2_654_435_761) ^ round).to_be_bytes();
                m.put(&k, b"v", NO_EXPIRY, false);
                model.insert(k.to_vec());
            }
            m.prepare_scan();
            let runs = m.runs();
            let mut all: Vec<Vec<u8>> = runs
                .iter()
                .flat_map(|r| r.iter())
                .map(|&i| m.entry(i).0.to_vec())
                .collect();
            for r in &runs {
                assert!(r.windows(2).all(|w| m.entry(w[0]).0 < m.entry(w[1]).0));
            }
            all.sort();
            assert_eq!(all, model.iter().cloned().collect::<Vec<_>>());
        }
        let f = Frozen::new(m, 1);
        let keys: Vec<Vec<u8>> = f.entries().map(|(k, _)| k.to_vec()).collect();
        assert_eq!(keys, model.into_iter().collect::<Vec<_>>());
    }

    #[test]
    fn interleaved_put_and_scan_sorts_only_new_ids() {
        // One put, one scan, many times: every scan must see every key in order, every run
        // must be sorted, the run count must stay logarithmic, and the work must not be
        // quadratic: each id is sorted once, and merges move each id O(log n) times (4000
        // rounds of a full re-sort would sort ~8M ids).
        SCAN_WORK.with(|w| w.set((0, 0)));
        let n = 4000u32;
        let mut m = Memtable::new();
        let mut model = std::collections::BTreeSet::new();
        for i in 0..n {
            let k = i.wrapping_mul(2_654_435_761).to_be_bytes();
            m.put(&k, b"v", NO_EXPIRY, false);
            model.insert(k.to_vec());
            m.prepare_scan();
            let runs = m.runs();
            assert!(runs.len() <= 2 + (usize::BITS - (i as usize + 1).leading_zeros()) as usize);
            for r in &runs {
                assert!(r.windows(2).all(|w| m.entry(w[0]).0 < m.entry(w[1]).0));
            }
            if i % 97 == 0 {
                let mut all: Vec<Vec<u8>> = runs
                    .iter()
                    .flat_map(|r| r.iter())
                    .map(|&i| m.entry(i).0.to_vec())
                    .collect();
                all.sort();
                assert_eq!(all, model.iter().cloned().collect::<Vec<_>>());
            }
        }
        let (sorted, merged) = SCAN_WORK.with(|w| w.get());
        assert_eq!(sorted, n as usize, "each id is sorted once");
        let log_n = (usize::BITS - (n as usize).leading_zeros()) as usize;
        assert!(merged <= n as usize * (log_n + 2), "{merged} ids merged");
        let f = Frozen::new(m, 1);
        let keys: Vec<Vec<u8>> = f.entries().map(|(k, _)| k.to_vec()).collect();
        assert_eq!(keys, model.into_iter().collect::<Vec<_>>());
    }

    #[test]
    fn prefix_ties_fall_back_to_full_keys() {
        let mut m = Memtable::new();
        let long_a = [7u8; 20];
        let mut long_b = [7u8; 20];
        long_b[19] = 6;
        for k in [&b"ab"[..], b"ab\0", b"a", &long_a, &long_b, &[7u8; 16], b""] {
            m.put(k, b"v", NO_EXPIRY, false);
        }
        let f = Frozen::new(m, 1);
        let keys: Vec<Vec<u8>> = f.entries().map(|(k, _)| k.to_vec()).collect();
        let mut want = keys.clone();
        want.sort();
        want.dedup();
        assert_eq!(keys, want);
        assert_eq!(keys.len(), 7);
    }

    /// Key sets for the sort properties: the shapes that make a prefix sort go wrong.
    fn key_sets() -> impl Strategy<Value = Vec<Vec<u8>>> {
        use proptest::collection::vec;
        prop_oneof![
            // None, one or two keys, the empty key included.
            vec(vec(any::<u8>(), 0..20), 0..3),
            // Random bytes, 2 to 40 of them: many keys longer than the 16-byte prefix.
            vec(vec(any::<u8>(), 2..40), 0..3000),
            // A long shared start and short tails: ties of the prefix, and few varying bits.
            (
                vec(any::<u8>(), 0..24),
                vec(vec(any::<u8>(), 0..4), 0..2000)
            )
                .prop_map(|(start, tails)| {
                    tails
                        .into_iter()
                        .map(|t| [start.as_slice(), &t].concat())
                        .collect()
                }),
            // Keys that are zero-padded prefixes of each other ([0, 1], [0, 1, 0, 0]).
            vec((vec(0u8..3, 1..6), 0usize..20), 0..600).prop_map(|keys| {
                keys.into_iter()
                    .map(|(mut k, zeros)| {
                        k.resize(k.len() + zeros, 0);
                        k
                    })
                    .collect()
            }),
            // Keys of one length made of 0s and 1s: a varying bit in every byte, more bits than
            // fit beside the record address, so packed keys tie although prefixes differ.
            (1..=16usize).prop_flat_map(|len| vec(vec(0u8..2, len), 0..1500)),
            // The engine's shape: key group, state id, user key (a counter or random bits).
            (
                vec((0u16..128, 1u16..3, any::<u64>()), 0..3000),
                any::<bool>()
            )
                .prop_map(|(keys, small)| {
                    keys.into_iter()
                        .map(|(kg, state, user)| {
                            let user = if small { user % 100_000 } else { user };
                            [
                                &kg.to_be_bytes()[..],
                                &state.to_be_bytes(),
                                &user.to_be_bytes(),
                            ]
                            .concat()
                        })
                        .collect()
                }),
        ]
    }

    /// A small budget means small arena chunks, many of them: wider record addresses, fewer
    /// key bits that fit beside them.
    fn memtable(small_chunks: bool) -> Memtable {
        Memtable::with_budget(if small_chunks { 1 << 16 } else { 64 << 20 })
    }

    /// `keys` distinct and in order: what every sort must produce.
    fn reference(keys: &[Vec<u8>]) -> Vec<Vec<u8>> {
        let set: std::collections::BTreeSet<Vec<u8>> = keys.iter().cloned().collect();
        set.into_iter().collect()
    }

    proptest! {
        #[test]
        fn full_order_is_key_order(keys in key_sets(), small_chunks: bool) {
            let mut m = memtable(small_chunks);
            for (i, k) in keys.iter().enumerate() {
                m.put(k, &(i as u32).to_le_bytes(), NO_EXPIRY, false);
            }
            let f = Frozen::new(m, 1);
            let mut got = Vec::new();
            for (k, v) in f.entries() {
                // The value is the key's own: record addresses survive packing.
                let i = u32::from_le_bytes(v.bytes.try_into().unwrap()) as usize;
                prop_assert_eq!(&keys[i][..], k);
                got.push(k.to_vec());
            }
            prop_assert_eq!(got, reference(&keys));
        }

        #[test]
        fn scan_runs_are_key_order(keys in key_sets(), small_chunks: bool, cut in 0.0..1.0f64) {
            // Two batches, a scan after each: the second sorts only its own ids.
            let mut m = memtable(small_chunks);
            let at = (keys.len() as f64 * cut) as usize;
            for batch in [&keys[..at], &keys[at..]] {
                for k in batch {
                    m.put(k, b"v", NO_EXPIRY, false);
                }
                m.prepare_scan();
            }
            let runs = m.runs();
            for r in &runs {
                prop_assert!(r.windows(2).all(|w| m.entry(w[0]).0 < m.entry(w[1]).0));
            }
            let mut got: Vec<Vec<u8>> = runs
                .iter()
                .flat_map(|r| r.iter())
                .map(|&i| m.entry(i).0.to_vec())
                .collect();
            got.sort();
            prop_assert_eq!(got, reference(&keys));
        }
    }

    #[test]
    fn a_bit_the_sample_missed_is_still_sorted() {
        // 3 * SAMPLE_KEYS keys sample every third; only an unsampled key has a 1 in its first
        // byte, so the first packing drops that byte and the sort must pack again.
        let n = 3 * SAMPLE_KEYS as u32;
        let mut m = Memtable::new();
        for i in 0..n {
            let first = u8::from(i == n - 2);
            let k = [&[first][..], &(i.wrapping_mul(2_654_435_761)).to_be_bytes()].concat();
            m.put(&k, b"v", NO_EXPIRY, false);
        }
        let f = Frozen::new(m, 1);
        let keys: Vec<Vec<u8>> = f.entries().map(|(k, _)| k.to_vec()).collect();
        assert_eq!(keys.len(), n as usize);
        assert!(keys.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(keys.last().unwrap()[0], 1);
    }

    #[test]
    fn key_prefix_is_the_zero_padded_first_16_bytes() {
        let bytes: Vec<u8> = (1..=40u8).map(|b| b.wrapping_mul(37)).collect();
        for n in 0..=40 {
            let key = &bytes[..n];
            let mut want = [0u8; 16];
            want[..n.min(16)].copy_from_slice(&key[..n.min(16)]);
            assert_eq!(key_prefix(key), u128::from_be_bytes(want), "length {n}");
        }
    }

    #[test]
    fn radix_passes_sort_by_their_bits_and_skip_constant_digits() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for (lo, bits, constant) in [(0, 64, 0), (20, 44, 0), (7, 30, 0x3ff << 17), (3, 5, 0)] {
            let top = if lo + bits == 64 {
                u64::MAX
            } else {
                (1 << (lo + bits)) - 1
            };
            let mut v = ZeroedBuf::<u64>::new(5000);
            let mut r = Radix::new(lo, bits);
            for e in v.iter_mut() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *e = x & top & !constant | constant;
                r.count(*e);
            }
            let mut want: Vec<u64> = v.iter().map(|&e| e >> lo).collect();
            want.sort_unstable();
            r.sort(&mut v);
            assert_eq!(v.iter().map(|&e| e >> lo).collect::<Vec<_>>(), want);
        }
    }

    /// A sealed epoch's live records, in key order.
    fn listed(s: &Sealed) -> Vec<(Vec<u8>, Vec<u8>)> {
        s.order()
            .iter()
            .map(|&l| {
                let (k, v) = s.arena.record(l);
                (k.to_vec(), v.bytes.to_vec())
            })
            .collect()
    }
}
