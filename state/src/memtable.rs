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
/// Tail length above which a scan merges the tail into the sorted run.
const TAIL_MERGE_MIN: usize = 4096;

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
    chunk_bytes: usize,
    used: usize,
    bytes: usize,
}

impl Arena {
    fn alloc(&mut self, len: usize) -> Loc {
        let len16 = len.div_ceil(16) * 16;
        let fits = self
            .chunks
            .last()
            .is_some_and(|c| c.len() * 16 - self.used >= len16);
        if !fits {
            let n = len16.max(self.chunk_bytes) / 16;
            self.chunks.push(vec![0u128; n].into_boxed_slice());
            self.used = 0;
            self.bytes += n * 16;
        }
        let loc = Loc {
            chunk: (self.chunks.len() - 1) as u32,
            off: self.used as u32,
        };
        self.used += len16;
        loc
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
    hash: u64,
    expire_at_ms: u64,
    key: Loc,
    val: Loc,
    key_len: u32,
    val_len: u32,
    val_cap: u32,
    tombstone: bool,
}

/// A value as stored: bytes, expiry, tombstone flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ValueRef<'a> {
    pub bytes: &'a [u8],
    pub expire_at_ms: u64,
    pub tombstone: bool,
}

#[derive(Debug, Default)]
pub(crate) struct Memtable {
    arena: Arena,
    entries: Vec<Entry>,
    index: HashTable<u32>,
    sorted: Vec<u32>,
    tail: Vec<u32>,
    tail_sorted: bool,
    value_bytes: usize,
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

    /// Memory held, for the budget: arena, entry table, hash index and order vectors.
    pub fn approx_bytes(&self) -> usize {
        self.arena.bytes
            + self.entries.capacity() * std::mem::size_of::<Entry>()
            + self.index.capacity() * (std::mem::size_of::<u32>() + 1)
            + (self.sorted.capacity() + self.tail.capacity()) * 4
    }

    fn key_of(&self, e: &Entry) -> &[u8] {
        self.arena.get(e.key, e.key_len as usize)
    }

    pub fn put(&mut self, key: &[u8], value: &[u8], expire_at_ms: u64, tombstone: bool) {
        let hash = xxh3_64(key);
        let Memtable {
            arena,
            entries,
            index,
            ..
        } = self;
        let found = index
            .find(hash, |&i| {
                let e = &entries[i as usize];
                e.hash == hash && arena.get(e.key, e.key_len as usize) == key
            })
            .copied();
        match found {
            Some(i) => {
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
                let k = arena.alloc(key.len());
                arena.get_mut(k, key.len()).copy_from_slice(key);
                let v = arena.alloc(value.len());
                arena.get_mut(v, value.len()).copy_from_slice(value);
                let idx = entries.len() as u32;
                entries.push(Entry {
                    hash,
                    expire_at_ms,
                    key: k,
                    val: v,
                    key_len: key.len() as u32,
                    val_len: value.len() as u32,
                    val_cap: value.len().div_ceil(16) as u32 * 16,
                    tombstone,
                });
                index.insert_unique(hash, idx, |&i| entries[i as usize].hash);
                self.tail.push(idx);
                self.tail_sorted = false;
                self.value_bytes += value.len() + key.len();
            }
        }
    }

    pub fn get_hashed(&self, key: &[u8], hash: u64) -> Option<ValueRef<'_>> {
        let i = *self.index.find(hash, |&i| {
            let e = &self.entries[i as usize];
            e.hash == hash && self.key_of(e) == key
        })?;
        Some(self.value_at(i))
    }

    fn value_at(&self, i: u32) -> ValueRef<'_> {
        let e = &self.entries[i as usize];
        ValueRef {
            bytes: self.arena.get(e.val, e.val_len as usize),
            expire_at_ms: e.expire_at_ms,
            tombstone: e.tombstone,
        }
    }

    pub fn entry(&self, i: u32) -> (&[u8], ValueRef<'_>) {
        (self.key_of(&self.entries[i as usize]), self.value_at(i))
    }

    fn sort_ids(&self, ids: &mut [u32]) {
        ids.sort_unstable_by(|&a, &b| {
            self.key_of(&self.entries[a as usize])
                .cmp(self.key_of(&self.entries[b as usize]))
        });
    }

    fn merge_ids(&self, a: &[u32], b: &[u32]) -> Vec<u32> {
        let mut out = Vec::with_capacity(a.len() + b.len());
        let (mut i, mut j) = (0, 0);
        while i < a.len() && j < b.len() {
            if self.entry(a[i]).0 <= self.entry(b[j]).0 {
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

    /// Make `sorted` and `tail` each sorted, merging the tail in when it is large.
    pub fn prepare_scan(&mut self) {
        if !self.tail_sorted {
            let mut tail = std::mem::take(&mut self.tail);
            self.sort_ids(&mut tail);
            self.tail = tail;
            self.tail_sorted = true;
        }
        if self.tail.len() >= TAIL_MERGE_MIN && self.tail.len() * 8 >= self.sorted.len() {
            self.sorted = self.merge_ids(&self.sorted, &self.tail);
            self.tail.clear();
        }
    }

    /// The two sorted id runs; valid after [`Self::prepare_scan`].
    pub fn runs(&self) -> (&[u32], &[u32]) {
        debug_assert!(self.tail_sorted || self.tail.is_empty());
        (&self.sorted, &self.tail)
    }

    /// All ids in key order (used once per frozen memtable).
    fn full_order(&self) -> Vec<u32> {
        let mut tail = self.tail.clone();
        if !self.tail_sorted {
            self.sort_ids(&mut tail);
        }
        self.merge_ids(&self.sorted, &tail)
    }

    /// Index of the first id in sorted run `ids` whose key is >= `key`.
    pub fn lower_bound(&self, ids: &[u32], key: &[u8]) -> usize {
        ids.partition_point(|&i| self.entry(i).0 < key)
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
            let (a, b) = m.runs();
            let mut all: Vec<Vec<u8>> = a.iter().chain(b).map(|&i| m.entry(i).0.to_vec()).collect();
            assert!(a.windows(2).all(|w| m.entry(w[0]).0 < m.entry(w[1]).0));
            assert!(b.windows(2).all(|w| m.entry(w[0]).0 < m.entry(w[1]).0));
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
}
