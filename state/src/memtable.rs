//! The memtable: a hash index over an arena of key and value bytes, sorted only when needed.
//!
//! Why a hash index and not a sorted map: the keyed-count path updates the same keys again and
//! again; a hash probe plus an in-place overwrite of a same-size value costs one cache miss,
//! where a sorted insert costs a tree walk per record (measured in `benches/src/state.rs`,
//! `memtable_hash_vs_btree`). Order is produced lazily: new keys are appended to an unsorted
//! tail; a scan sorts the tail and merges it into the sorted run when it grows; a frozen
//! memtable is sorted once, by the first scan or by its flush.
//!
//! Values start 16-byte aligned in the arena so rkyv can read them in place.

use std::sync::OnceLock;

use hashbrown::HashTable;
use xxhash_rust::xxh3::xxh3_64;

/// Largest arena chunk; bigger values get a chunk of their own.
const CHUNK_BYTES_MAX: usize = 1 << 20;
/// Smallest arena chunk.
const CHUNK_BYTES_MIN: usize = 4096;

/// Expiry value meaning "never expires".
pub(crate) const NO_EXPIRY: u64 = u64::MAX;

#[derive(Debug, Clone, Copy)]
struct Loc {
    chunk: u32,
    off: u32,
}

#[derive(Debug, Default)]
struct Arena {
    // u128 elements make every chunk 16-byte aligned.
    chunks: Vec<Box<[u128]>>,
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
        let len16 = len.div_ceil(16) * 16;
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
            self.chunks.push(vec![0u128; n].into_boxed_slice());
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

    fn chunk_bytes(c: &[u128]) -> &[u8] {
        // SAFETY: u128 has no padding and every bit pattern of u8 is valid; the byte view covers
        // exactly the same allocation, and alignment of u8 is 1.
        unsafe { std::slice::from_raw_parts(c.as_ptr().cast::<u8>(), c.len() * 16) }
    }

    fn chunk_bytes_mut(c: &mut [u128]) -> &mut [u8] {
        // SAFETY: as in `chunk_bytes`; the unique borrow of the chunk is carried over.
        unsafe { std::slice::from_raw_parts_mut(c.as_mut_ptr().cast::<u8>(), c.len() * 16) }
    }

    fn get(&self, loc: Loc, len: usize) -> &[u8] {
        let c = Self::chunk_bytes(&self.chunks[loc.chunk as usize]);
        &c[loc.off as usize..loc.off as usize + len]
    }

    fn get_mut(&mut self, loc: Loc, len: usize) -> &mut [u8] {
        let c = Self::chunk_bytes_mut(&mut self.chunks[loc.chunk as usize]);
        &mut c[loc.off as usize..loc.off as usize + len]
    }
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    expire_at_ms: u64,
    key: Loc,
    val: Loc,
    val_len: u32,
    /// Value slot capacity in bytes (a multiple of 16).
    val_cap: u32,
    key_len: u16,
    tombstone: bool,
}

/// A hash index slot: entry id and the low 32 bits of the key's xxh3 hash. Keeping the hash in
/// the slot means a probe rejects other keys without touching the entry table, and growing the
/// table never reads the entries (no cache miss per entry on a resize).
#[derive(Debug, Clone, Copy)]
struct Slot {
    id: u32,
    h32: u32,
}

/// The table hash of a slot: both halves from the same 32 bits, so that hashbrown's bucket
/// position (low bits) and tag (top 7 bits) can be recomputed from the slot alone.
#[inline]
fn table_hash(h32: u32) -> u64 {
    u64::from(h32) | (u64::from(h32) << 32)
}

/// A value as stored: bytes, expiry, tombstone flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ValueRef<'a> {
    pub bytes: &'a [u8],
    pub expire_at_ms: u64,
    pub tombstone: bool,
}

/// Largest number of sorted runs kept before the smallest ones are merged; with the size rule
/// in [`Memtable::prepare_scan`] there are O(log n) runs anyway, this only caps pathological
/// cases.
const MAX_RUNS: usize = 24;

#[derive(Debug, Default)]
pub(crate) struct Memtable {
    arena: Arena,
    entries: Vec<Entry>,
    index: HashTable<Slot>,
    /// Sorted runs of entry ids, oldest (largest) first; each run is more than twice the size
    /// of the next one, so there are O(log n) of them and every id is merged O(log n) times.
    runs: Vec<Vec<u32>>,
    /// Ids appended since the last [`Memtable::prepare_scan`], unsorted.
    fresh: Vec<u32>,
    value_bytes: usize,
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
    /// small budgets are not exceeded by the first chunk.
    pub fn with_budget(budget_bytes: usize) -> Memtable {
        let mut m = Memtable::default();
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

    /// Memory in use, for the budget: arena chunks in use, entry table, hash index (at
    /// hashbrown's 7/8 load) and order vectors (every id is in exactly one run or `fresh`).
    /// Capacity a recycled memtable keeps beyond that is not counted: it is bounded by what
    /// the previous memtable used.
    #[inline]
    pub fn approx_bytes(&self) -> usize {
        let n = self.entries.len();
        self.arena.bytes
            + n * (std::mem::size_of::<Entry>() + 4)
            + (n + n / 7) * (std::mem::size_of::<Slot>() + 1)
    }

    /// Empty this memtable for reuse as a fresh one, keeping its memory: arena chunks, entry
    /// table and hash index capacity (no page faults, no rehashing on the next fill).
    pub fn recycle(&mut self) {
        self.arena.reset();
        self.entries.clear();
        self.index.clear();
        self.runs.clear();
        self.fresh.clear();
        self.value_bytes = 0;
    }

    #[inline]
    fn key_of(&self, e: &Entry) -> &[u8] {
        self.arena.get(e.key, usize::from(e.key_len))
    }

    #[inline]
    fn find(&self, key: &[u8], hash: u64) -> Option<u32> {
        let h32 = hash as u32;
        self.index
            .find(table_hash(h32), |s| {
                s.h32 == h32 && self.key_of(&self.entries[s.id as usize]) == key
            })
            .map(|s| s.id)
    }

    pub fn put(&mut self, key: &[u8], value: &[u8], expire_at_ms: u64, tombstone: bool) {
        self.put_hashed(key, xxh3_64(key), value, expire_at_ms, tombstone);
    }

    /// [`Self::put`] with `hash = xxh3_64(key)` computed by the caller.
    pub fn put_hashed(
        &mut self,
        key: &[u8],
        hash: u64,
        value: &[u8],
        expire_at_ms: u64,
        tombstone: bool,
    ) {
        debug_assert!(key.len() <= usize::from(u16::MAX));
        match self.find(key, hash) {
            Some(i) => {
                let Memtable { arena, entries, .. } = self;
                let e = &mut entries[i as usize];
                if value.len() > e.val_cap as usize {
                    e.val = arena.alloc(value.len());
                    e.val_cap = value.len().div_ceil(16) as u32 * 16;
                }
                self.value_bytes = self.value_bytes + value.len() - e.val_len as usize;
                e.val_len = value.len() as u32;
                e.expire_at_ms = expire_at_ms;
                e.tombstone = tombstone;
                let (val, len) = (e.val, e.val_len as usize);
                arena.get_mut(val, len).copy_from_slice(value);
            }
            None => {
                // Key and value in one allocation: the value starts at the next multiple of 16.
                let key16 = key.len().div_ceil(16) * 16;
                let val_cap = value.len().div_ceil(16) * 16;
                let k = self.arena.alloc(key16 + val_cap);
                let v = Loc {
                    chunk: k.chunk,
                    off: k.off + key16 as u32,
                };
                {
                    let slot = self.arena.get_mut(k, key16 + value.len());
                    slot[..key.len()].copy_from_slice(key);
                    slot[key16..].copy_from_slice(value);
                }
                let idx = self.entries.len() as u32;
                self.entries.push(Entry {
                    expire_at_ms,
                    key: k,
                    val: v,
                    key_len: key.len() as u16,
                    val_len: value.len() as u32,
                    val_cap: val_cap as u32,
                    tombstone,
                });
                let h32 = hash as u32;
                self.index
                    .insert_unique(table_hash(h32), Slot { id: idx, h32 }, |s| {
                        table_hash(s.h32)
                    });
                self.fresh.push(idx);
                self.value_bytes += value.len() + key.len();
            }
        }
    }

    pub fn get_hashed(&self, key: &[u8], hash: u64) -> Option<ValueRef<'_>> {
        self.find(key, hash).map(|i| self.value_at(i))
    }

    #[inline]
    fn value_at(&self, i: u32) -> ValueRef<'_> {
        let e = &self.entries[i as usize];
        ValueRef {
            bytes: self.arena.get(e.val, e.val_len as usize),
            expire_at_ms: e.expire_at_ms,
            tombstone: e.tombstone,
        }
    }

    #[inline]
    pub fn entry(&self, i: u32) -> (&[u8], ValueRef<'_>) {
        (self.key_of(&self.entries[i as usize]), self.value_at(i))
    }

    #[inline]
    fn key_at(&self, i: u32) -> &[u8] {
        self.key_of(&self.entries[i as usize])
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

    /// All ids in key order (used once per frozen memtable).
    fn full_order(&self) -> Vec<u32> {
        let mut fresh = self.fresh.clone();
        self.sort_ids(&mut fresh);
        let mut acc = fresh;
        for r in self.runs.iter().rev() {
            acc = self.merge_ids(r, &acc);
        }
        acc
    }

    /// Index of the first id in sorted run `ids` whose key is >= `key`.
    pub fn lower_bound(&self, ids: &[u32], key: &[u8]) -> usize {
        ids.partition_point(|&i| self.key_at(i) < key)
    }
}

/// An immutable memtable waiting for its flush. `gen` orders frozen memtables and segments.
#[derive(Debug)]
pub(crate) struct Frozen {
    pub mem: Memtable,
    pub gen: u64,
    order: OnceLock<Vec<u32>>,
}

impl Frozen {
    pub fn new(mem: Memtable, gen: u64) -> Frozen {
        Frozen {
            mem,
            gen,
            order: OnceLock::new(),
        }
    }

    /// Entry ids in key order, computed once.
    pub fn order(&self) -> &[u32] {
        self.order.get_or_init(|| self.mem.full_order())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let keys: Vec<Vec<u8>> = f
            .order()
            .iter()
            .map(|&i| f.mem.entry(i).0.to_vec())
            .collect();
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
        let keys: Vec<Vec<u8>> = f
            .order()
            .iter()
            .map(|&i| f.mem.entry(i).0.to_vec())
            .collect();
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
        let keys: Vec<Vec<u8>> = f
            .order()
            .iter()
            .map(|&i| f.mem.entry(i).0.to_vec())
            .collect();
        let mut want = keys.clone();
        want.sort();
        want.dedup();
        assert_eq!(keys, want);
        assert_eq!(keys.len(), 7);
    }
}
