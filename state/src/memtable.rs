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

use std::sync::OnceLock;

use xxhash_rust::xxh3::xxh3_64;

use crate::hugemem::{prefetch_read, Pod, ZeroedBuf, HUGE_PAGE_BYTES};

/// Largest arena chunk (one huge page); bigger values get a chunk of their own.
const CHUNK_BYTES_MAX: usize = HUGE_PAGE_BYTES;
/// Most chunks a memtable may have: slots store the chunk in 16 bits. A memtable with this
/// many chunks reports itself full (see [`Memtable::approx_bytes`]), so the store freezes it.
const MAX_CHUNKS: usize = u16::MAX as usize - 1;
/// Smallest arena chunk.
const CHUNK_BYTES_MIN: usize = 4096;

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

#[inline]
fn round16(n: usize) -> usize {
    n.div_ceil(16) * 16
}

/// Where a record lives: arena chunk and byte offset (a multiple of 16).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Loc {
    chunk: u32,
    off: u32,
}

#[derive(Debug, Default)]
struct Arena {
    // u128 elements make every chunk 16-byte aligned.
    chunks: Vec<ZeroedBuf<u128>>,
    /// The chunk allocations come from; chunks after it are recycled spares, not yet used.
    cur: usize,
    chunk_bytes: usize,
    used: usize,
    /// Bytes of the chunks in use (`chunks[..=cur]`).
    bytes: usize,
}

impl Arena {
    #[inline]
    fn alloc(&mut self, len: usize) -> Loc {
        let len16 = round16(len);
        let fits = self
            .chunks
            .get(self.cur)
            .is_some_and(|c| c.len() * 16 - self.used >= len16);
        if !fits {
            self.next_chunk(len16);
        }
        let loc = Loc {
            chunk: self.cur as u32,
            off: self.used as u32,
        };
        self.used += len16;
        loc
    }

    #[cold]
    fn next_chunk(&mut self, len16: usize) {
        let next = if self.chunks.is_empty() {
            0
        } else {
            self.cur + 1
        };
        let spare_fits = self.chunks.get(next).is_some_and(|c| c.len() * 16 >= len16);
        if !spare_fits {
            let n = len16.max(self.chunk_bytes) / 16;
            self.chunks.push(ZeroedBuf::new(n));
            // Chunks after `cur` are unused spares: moving one does not move any data in use.
            let last = self.chunks.len() - 1;
            self.chunks.swap(next, last);
        }
        self.cur = next;
        self.used = 0;
        self.bytes += self.chunks[next].len() * 16;
    }

    /// Forget every allocation but keep the standard-size chunks for reuse (their pages are
    /// already faulted in: PLATFORM.md, first touch costs microseconds per page here).
    fn reset(&mut self) {
        let std_len = self.chunk_bytes / 16;
        self.chunks.retain(|c| c.len() == std_len);
        self.cur = 0;
        self.used = 0;
        self.bytes = self.chunks.first().map_or(0, |c| c.len() * 16);
    }

    #[inline]
    fn chunk(&self, loc: Loc) -> &[u8] {
        let c = &self.chunks[loc.chunk as usize];
        // SAFETY: u128 has no padding and every bit pattern of u8 is valid; the byte view covers
        // exactly the same allocation, and alignment of u8 is 1.
        let all = unsafe { std::slice::from_raw_parts(c.as_ptr().cast::<u8>(), c.len() * 16) };
        &all[loc.off as usize..]
    }

    #[inline]
    fn chunk_mut(&mut self, loc: Loc) -> &mut [u8] {
        let c = &mut self.chunks[loc.chunk as usize];
        // SAFETY: as in `chunk`; the unique borrow of the chunk is carried over.
        let all =
            unsafe { std::slice::from_raw_parts_mut(c.as_mut_ptr().cast::<u8>(), c.len() * 16) };
        &mut all[loc.off as usize..]
    }

    /// The key of the record at `loc`.
    #[inline]
    fn key(&self, loc: Loc) -> &[u8] {
        let r = self.chunk(loc);
        let klen = usize::from(u16::from_le_bytes([r[R_KEY_LEN], r[R_KEY_LEN + 1]]));
        &r[REC_HEADER..REC_HEADER + klen]
    }

    /// Key and value of the record at `loc`.
    #[inline]
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
            ValueRef {
                bytes: &r[v..v + vlen],
                expire_at_ms,
                tombstone: h[R_FLAGS] & REC_TOMBSTONE != 0,
            },
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
#[derive(Debug)]
struct Index {
    slots: ZeroedBuf<Slot>,
    mask: usize,
    len: usize,
    /// Slots whose `gen` differs are empty. Never 0, which is what fresh memory holds.
    gen: u16,
}

impl Default for Index {
    fn default() -> Self {
        Index::with_capacity(MIN_INDEX_SLOTS)
    }
}

const MIN_INDEX_SLOTS: usize = 16;
/// Largest initial index: 64 Ki slots, 1 MiB.
const INITIAL_INDEX_SLOTS_MAX: usize = 1 << 16;

impl Index {
    /// `cap` is rounded up to a power of two.
    fn with_capacity(cap: usize) -> Index {
        let cap = cap.max(MIN_INDEX_SLOTS).next_power_of_two();
        Index {
            slots: ZeroedBuf::new(cap),
            mask: cap - 1,
            len: 0,
            gen: 1,
        }
    }

    #[inline]
    fn bytes(&self) -> usize {
        self.slots.len() * std::mem::size_of::<Slot>()
    }

    /// Where the key with hash tag `h32` is (`Ok`), or the empty slot where it would go.
    #[inline]
    fn probe(&self, h32: u32, mut is_key: impl FnMut(Loc) -> bool) -> Result<usize, usize> {
        let mut i = h32 as usize & self.mask;
        loop {
            let s = &self.slots[i];
            if s.gen != self.gen {
                return Err(i);
            }
            if s.h32 == h32 && is_key(s.loc()) {
                return Ok(i);
            }
            i = (i + 1) & self.mask;
        }
    }

    /// True when one more entry would pass the load limit.
    #[inline]
    fn needs_growth(&self) -> bool {
        (self.len + 1) * 4 > self.slots.len() * 3
    }

    /// Fill the empty slot `i` (from [`Self::probe`]).
    #[inline]
    fn fill(&mut self, i: usize, h32: u32, id: u32, loc: Loc) {
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
        self.len += 1;
    }

    /// Double the table, re-placing slots by their stored tag (records are not read).
    #[cold]
    fn grow(&mut self) {
        let mut next = Index::with_capacity(self.slots.len() * 2);
        for s in self.slots.iter().filter(|s| s.gen == self.gen) {
            let Err(i) = next.probe(s.h32, |_| false) else {
                unreachable!("a probe that matches nothing ends at an empty slot")
            };
            next.fill(i, s.h32, s.id, s.loc());
        }
        *self = next;
    }

    /// Forget every entry, keeping the memory.
    fn clear(&mut self) {
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
    }
}

/// A value as stored: bytes, expiry, tombstone flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ValueRef<'a> {
    pub bytes: &'a [u8],
    pub expire_at_ms: u64,
    pub tombstone: bool,
}

/// Where a key was found in the mutable memtable: valid while the memtable's
/// [`Memtable::epoch`] is unchanged (a record moves only when its value outgrows it, which
/// changes the epoch; freezing replaces the memtable, whose epoch is unique).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MemHint {
    epoch: u64,
    loc: Loc,
}

/// Largest number of sorted runs kept before the smallest ones are merged; with the size rule
/// in [`Memtable::prepare_scan`] there are O(log n) runs anyway, this only caps pathological
/// cases.
const MAX_RUNS: usize = 24;

#[derive(Debug, Default)]
pub(crate) struct Memtable {
    arena: Arena,
    /// Entry id -> record (ids are insertion order; scans and sorting use them).
    entries: Vec<Loc>,
    index: Index,
    /// Sorted runs of entry ids, oldest (largest) first; each run is more than twice the size
    /// of the next one, so there are O(log n) of them and every id is merged O(log n) times.
    runs: Vec<Vec<u32>>,
    /// Ids appended since the last [`Memtable::prepare_scan`], unsorted.
    fresh: Vec<u32>,
    /// Unique per memtable incarnation (set by the store) in the high 32 bits; the low bits
    /// count record moves. See [`MemHint`].
    epoch: u64,
}

/// The first 16 key bytes, zero padded, as a big-endian integer: comparing two of them orders
/// keys by their first 16 bytes (ties need a full comparison).
#[inline]
pub(crate) fn key_prefix(key: &[u8]) -> u128 {
    let mut b = [0u8; 16];
    let n = key.len().min(16);
    b[..n].copy_from_slice(&key[..n]);
    u128::from_be_bytes(b)
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

    /// Memory in use, for the budget: arena chunks in use, entry table, the whole hash index
    /// and order vectors (every id is in exactly one run or `fresh`). Entry-table capacity a
    /// recycled memtable keeps beyond that is not counted: it is bounded by what the previous
    /// memtable used. A memtable out of chunk numbers reports itself over any budget.
    #[inline]
    pub fn approx_bytes(&self) -> usize {
        if self.arena.chunks.len() >= MAX_CHUNKS {
            return usize::MAX / 2;
        }
        let n = self.entries.len();
        self.arena.bytes + n * (std::mem::size_of::<Loc>() + 4) + self.index.bytes()
    }

    /// Empty this memtable for reuse as a fresh one, keeping its memory: arena chunks, entry
    /// table and hash index capacity (no page faults, no rehashing on the next fill).
    pub fn recycle(&mut self) {
        self.arena.reset();
        self.entries.clear();
        self.index.clear();
        self.runs.clear();
        self.fresh.clear();
        self.epoch = self.epoch.wrapping_add(1);
    }

    #[inline]
    fn find(&self, key: &[u8], hash: u64) -> Option<Loc> {
        // A recycled memtable is empty but has a large index: a probe would still miss the
        // cache on a random slot (reads of keys that live in segments pass here first).
        if self.index.len == 0 {
            return None;
        }
        let arena = &self.arena;
        let i = self
            .index
            .probe(hash as u32, |loc| arena.key(loc) == key)
            .ok()?;
        Some(self.index.slots[i].loc())
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
        if let Ok(i) = found {
            let s = &self.index.slots[i];
            if let Some(c) = self.arena.chunks.get(s.chunk as usize) {
                // Header, key and a small value span two lines when the record starts in the
                // last 16 bytes of one.
                let r = c.as_ptr().wrapping_add(s.off as usize / 16);
                prefetch_read(r);
                prefetch_read(r.wrapping_add(3));
            }
        }
        found.is_ok()
    }

    pub fn put(&mut self, key: &[u8], value: &[u8], expire_at_ms: u64, tombstone: bool) {
        self.put_hashed(key, xxh3_64(key), value, expire_at_ms, tombstone);
    }

    /// [`Self::put`] with `hash = xxh3_64(key)` computed by the caller. Returns where the
    /// record is now.
    pub fn put_hashed(
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
            ..
        } = self;
        if index.needs_growth() {
            index.grow();
        }
        let found = {
            let a = &*arena;
            index.probe(h32, |loc| a.key(loc) == key)
        };
        match found {
            Ok(i) => {
                let slot = &mut index.slots[i];
                let mut loc = slot.loc();
                if value.len() <= arena.capacity(loc) {
                    arena.overwrite(loc, value, expire_at_ms, tombstone);
                } else {
                    // The value outgrew its record: move the record (hints become stale).
                    loc = arena.new_record(key, value, expire_at_ms, tombstone);
                    slot.set_loc(loc);
                    entries[slot.id as usize] = loc;
                    *epoch = epoch.wrapping_add(1);
                }
                MemHint { epoch: *epoch, loc }
            }
            Err(i) => {
                let loc = arena.new_record(key, value, expire_at_ms, tombstone);
                let id = entries.len() as u32;
                entries.push(loc);
                index.fill(i, h32, id, loc);
                fresh.push(id);
                MemHint { epoch: *epoch, loc }
            }
        }
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
        if hint.epoch != self.epoch || value.len() > self.arena.capacity(hint.loc) {
            return false;
        }
        self.arena
            .overwrite(hint.loc, value, expire_at_ms, tombstone);
        true
    }

    pub fn get_hashed(&self, key: &[u8], hash: u64) -> Option<ValueRef<'_>> {
        self.find(key, hash).map(|loc| self.arena.record(loc).1)
    }

    /// [`Self::get_hashed`], also returning where the record is (for
    /// [`Self::overwrite_hinted`]).
    #[inline]
    pub fn get_hinted(&self, key: &[u8], hash: u64) -> Option<(ValueRef<'_>, MemHint)> {
        self.find(key, hash).map(|loc| {
            (
                self.arena.record(loc).1,
                MemHint {
                    epoch: self.epoch,
                    loc,
                },
            )
        })
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

    /// Sort ids by key: on (16-byte key prefix, id) pairs, so that most comparisons are one
    /// integer comparison without touching the arena; ties compare the full keys.
    fn sort_ids(&self, ids: &mut [u32]) {
        if ids.len() < 2 {
            return;
        }
        let mut keyed: Vec<(u128, u32)> = ids
            .iter()
            .map(|&i| (key_prefix(self.key_at(i)), i))
            .collect();
        keyed.sort_unstable_by(|a, b| {
            a.0.cmp(&b.0)
                .then_with(|| self.key_at(a.1).cmp(self.key_at(b.1)))
        });
        for (slot, (_, i)) in ids.iter_mut().zip(keyed) {
            *slot = i;
        }
    }

    fn merge_ids(&self, a: &[u32], b: &[u32]) -> Vec<u32> {
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
            let mut fresh = std::mem::take(&mut self.fresh);
            self.sort_ids(&mut fresh);
            self.runs.push(fresh);
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

    /// Every record in key order (used once per frozen memtable). Sorts (16-byte prefix,
    /// record) pairs taken straight from the entry table, so the result addresses records
    /// without the entry table, and a flush reads each record once, in a predictable order.
    fn full_order(&self) -> Vec<Loc> {
        let mut keyed: Vec<(u128, Loc)> = self
            .entries
            .iter()
            .map(|&loc| (key_prefix(self.arena.key(loc)), loc))
            .collect();
        keyed.sort_unstable_by(|a, b| {
            a.0.cmp(&b.0)
                .then_with(|| self.arena.key(a.1).cmp(self.arena.key(b.1)))
        });
        keyed.into_iter().map(|(_, loc)| loc).collect()
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
        prefetch_read(self.arena.chunk(loc).as_ptr());
    }
}

/// An immutable memtable waiting for its flush. `gen` orders frozen memtables and segments.
#[derive(Debug)]
pub(crate) struct Frozen {
    pub mem: Memtable,
    pub gen: u64,
    order: OnceLock<Vec<Loc>>,
}

/// How many records ahead an ordered walk over a frozen memtable prefetches.
const PREFETCH_AHEAD: usize = 8;

impl Frozen {
    pub fn new(mem: Memtable, gen: u64) -> Frozen {
        Frozen {
            mem,
            gen,
            order: OnceLock::new(),
        }
    }

    /// Records in key order, computed once.
    pub fn order(&self) -> &[Loc] {
        self.order.get_or_init(|| self.mem.full_order())
    }

    /// Every entry in key order, prefetching records a few ahead.
    pub fn entries(&self) -> impl Iterator<Item = (&[u8], ValueRef<'_>)> + '_ {
        let order = self.order();
        order.iter().enumerate().map(move |(i, &loc)| {
            if let Some(&ahead) = order.get(i + PREFETCH_AHEAD) {
                self.mem.prefetch_loc(ahead);
            }
            self.mem.record(loc)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(m.index.bytes(), 4 << 20, "doubled twice, to 256 Ki slots");
        assert!(m.approx_bytes() >= (4 << 20) + 100_000 * 48);
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
        assert!(m.get_hashed(b"k1", xxh3_64(b"k1")).unwrap().tombstone);
        assert_eq!(m.len(), 1);
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
            (v.bytes, v.expire_at_ms, v.tombstone),
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
        // One put, one scan, many times: every scan must see every key in order, the run
        // count must stay logarithmic, and the work must not be quadratic (4000 rounds of a
        // full re-sort would be ~8M key sorts; this finishes in milliseconds).
        let mut m = Memtable::new();
        let mut model = std::collections::BTreeSet::new();
        for i in 0..4000u32 {
            let k = i.wrapping_mul(2_654_435_761).to_be_bytes();
            m.put(&k, b"v", NO_EXPIRY, false);
            model.insert(k.to_vec());
            m.prepare_scan();
            let runs = m.runs();
            assert!(runs.len() <= 2 + (usize::BITS - (i as usize + 1).leading_zeros()) as usize);
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
}
