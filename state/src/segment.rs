//! Immutable segment files: writer and validated, memory-mapped reader.
//!
//! The byte layout is documented in `docs/segment-format.md`; [`layout`] holds every offset as
//! a constant (the single source of truth; the doc's hex fixture is decoded by a test).
//!
//! A segment is verified completely when opened (every block's CRC, the structure of every
//! block, key order, footer totals). After that, lookups and iteration index the map directly:
//! everything they touch was checked. Files are written once, sequentially, fsynced, and then
//! only mapped, exactly their length, never written or truncated again.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use weir_io::{decode_block, BlockHeader, FormatError, Fs, FsFile, Mapped, ReadAhead};
use weir_io::{BLOCK_HEADER_LEN, CHECKSUM_CRC32_IEEE};
use xxhash_rust::xxh3::xxh3_64;

use crate::block_index::BlockIndex;
use crate::bloom::Bloom;
use crate::error::StateError;
use crate::hugemem::{prefetch_read, prefetch_read_l2, MapVec, ZeroedBuf};
use crate::key::{key_group_of, KeyGroupRange};
use crate::memtable::{key_prefix, ValueRef};

/// Offsets and sizes of the segment format (version 1). See `docs/segment-format.md`.
pub mod layout {
    pub const FILE_MAGIC: [u8; 8] = *b"WEIRSEG\0";
    pub const FORMAT_VERSION: u16 = 1;

    pub const FILE_HEADER_LEN: usize = 32;
    pub const FH_MAGIC: usize = 0;
    pub const FH_VERSION: usize = 8;
    pub const FH_CHECKSUM_ALGO: usize = 10;
    pub const FH_SEGMENT_ID: usize = 16;
    pub const FH_CRC: usize = 28;

    pub const KIND_DATA: u8 = 1;
    pub const KIND_INDEX: u8 = 2;
    pub const KIND_FILTER: u8 = 3;
    /// Every block starts at a multiple of this (payloads are zero-padded to keep it).
    pub const BLOCK_ALIGN: usize = 16;
    /// Values start at file offsets that are multiples of this (rkyv reads them in place).
    pub const VALUE_ALIGN: usize = 16;

    /// Data block payload: entry count (u32), offset of the entry offset table (u32).
    pub const DATA_HEADER_LEN: usize = 8;
    pub const ENTRY_HEADER_LEN: usize = 16;
    pub const E_KEY_LEN: usize = 0;
    pub const E_FLAGS: usize = 2;
    pub const E_VAL_LEN: usize = 4;
    pub const E_EXPIRE_AT_MS: usize = 8;
    pub const FLAG_TOMBSTONE: u8 = 1;

    /// Index block payload: block count (u32), reserved (u32), then per data block
    /// `offset u64 | length u32 | last key length u16 | reserved u16 | last key`.
    pub const INDEX_HEADER_LEN: usize = 8;
    pub const INDEX_ENTRY_FIXED_LEN: usize = 16;

    pub const FOOTER_LEN: usize = 64;
    pub const FOOTER_MAGIC: [u8; 4] = *b"WSGF";
    pub const F_MAGIC: usize = 0;
    pub const F_VERSION: usize = 4;
    pub const F_CHECKSUM_ALGO: usize = 6;
    pub const F_FLAGS: usize = 7;
    pub const F_SEGMENT_ID: usize = 8;
    pub const F_ENTRY_COUNT: usize = 16;
    pub const F_INDEX_OFFSET: usize = 24;
    pub const F_INDEX_LEN: usize = 32;
    pub const F_DATA_BLOCKS: usize = 36;
    pub const F_FILTER_OFFSET: usize = 40;
    pub const F_FILTER_LEN: usize = 48;
    pub const F_KG_FIRST: usize = 52;
    pub const F_KG_LAST: usize = 54;
    pub const F_CRC: usize = 60;
    pub const FOOTER_FLAG_EMPTY: u8 = 1;
}
use layout::*;

/// The writer writes the file in pieces of exactly this size, at multiples of it (see
/// `SegmentWriter::flush_aligned`); only the last piece is shorter. One huge page: the buffer
/// is memory outside the memtable budget for every running flush and compaction (4 MiB
/// measured the same write bandwidth).
const WRITE_BUFFER_BYTES: usize = 2 << 20;

/// Memory a segment writer holds beyond its first buffer: the second one, which fills while
/// the first is written behind (`SegmentWriter::flush_aligned`).
pub(crate) fn write_behind_buffer_bytes(block_target_bytes: usize) -> usize {
    WRITE_BUFFER_BYTES + 2 * block_target_bytes
}

/// The writer ends a data block early, padding it to the next multiple of this file offset,
/// when the next entry would make it cross one: a lookup then touches one 4 KiB page of the
/// map (one TLB miss) instead of two.
const PAGE_BYTES: usize = 4096;
/// ... but only when that padding is at most this many bytes (large entries may cross).
const PAGE_PAD_MAX: usize = 256;

/// How many keys ahead of its insertion the writer prefetches a key's bloom filter line.
const BLOOM_PREFETCH_AHEAD: usize = 16;

/// Hint the CPU to load the cache line at the start of `b` (a no-op if `b` is empty).
#[inline]
pub(crate) fn prefetch(b: &[u8]) {
    if !b.is_empty() {
        prefetch_read(b.as_ptr());
    }
}

fn rd_u16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}
fn rd_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
fn rd_u64(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

/// Index and filter memory of one segment from its writer's start until the store installs
/// it, added to a store-wide total ([`crate::StoreMetrics::building_bytes`]): the block index
/// and bloom filter a flush or compaction builds are held beside those of the segments it
/// replaces.
#[derive(Debug)]
pub(crate) struct BuildGauge {
    total: Arc<AtomicUsize>,
    mine: AtomicUsize,
}

impl BuildGauge {
    pub fn new(total: Arc<AtomicUsize>) -> BuildGauge {
        BuildGauge {
            total,
            mine: AtomicUsize::new(0),
        }
    }

    /// This segment now holds `bytes`.
    pub fn set(&self, bytes: usize) {
        let old = self.mine.swap(bytes, Ordering::Relaxed);
        if bytes >= old {
            self.total.fetch_add(bytes - old, Ordering::Relaxed);
        } else {
            self.total.fetch_sub(old - bytes, Ordering::Relaxed);
        }
    }
}

impl Drop for BuildGauge {
    fn drop(&mut self) {
        self.set(0);
    }
}

/// Description of a written segment: what the writer computed, so that opening it needs no
/// second pass over its structure (see [`Segment::open_written`]).
#[derive(Debug)]
pub(crate) struct Written {
    pub path: PathBuf,
    pub id: u64,
    pub size_bytes: u64,
    pub crc32: u32,
    pub entry_count: u64,
    /// File offset of each data block's payload.
    offsets: MapVec<u64>,
    /// `key_prefix` of each data block's last key.
    prefixes: MapVec<u128>,
    /// Where the data blocks end (the index block's offset).
    data_end: u64,
    bloom: Bloom,
    pub key_groups: Option<KeyGroupRange>,
    gauge: Option<BuildGauge>,
}

impl Written {
    /// The written file, not opened: for a holder that only names it. The block index and
    /// filter the writer built are freed here, and no map is made.
    pub fn into_file(self, fs: Arc<dyn Fs>) -> Arc<SegmentFile> {
        SegmentFile::new(fs, self.path, true)
    }
}

#[cfg(test)]
fn copy_of<T: crate::hugemem::Pod>(v: &MapVec<T>) -> MapVec<T> {
    let mut c = MapVec::with_capacity(v.len());
    c.extend_from_slice(v);
    c
}

#[cfg(test)]
impl Written {
    fn try_clone(&self) -> Result<Written, StateError> {
        Ok(Written {
            path: self.path.clone(),
            offsets: copy_of(&self.offsets),
            prefixes: copy_of(&self.prefixes),
            bloom: self.bloom.try_clone()?,
            gauge: None,
            ..*self
        })
    }
}

/// Tuning of the writer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WriterOptions {
    pub block_target_bytes: usize,
    pub bloom_bits_per_key: u32,
    /// Upper bound of the keys the writer will be given (sizes the bloom filter up front so
    /// no per-key hash list is kept); `None`: unknown, hashes are kept and the filter is
    /// sized exactly at the end.
    pub expected_keys: Option<u64>,
}

pub(crate) struct SegmentWriter {
    file: Box<dyn FsFile>,
    path: PathBuf,
    id: u64,
    opts: WriterOptions,
    /// Fixed capacity (`WRITE_BUFFER_BYTES` and two blocks): what does not fit is written from
    /// where it is.
    buf: MapVec<u8>,
    /// The buffer of the piece written before the one in flight (`FsFile::write_behind`), for
    /// the next piece.
    spare: Option<MapVec<u8>>,
    flushed: u64,
    file_crc: crc32fast::Hasher,
    /// Start of the open data block in `buf`, and its entry offsets (relative to payload).
    block_start: Option<usize>,
    entry_offsets: Vec<u32>,
    block_index: u32,
    index: MapVec<u8>,
    /// Data blocks written so far: payload offsets and last-key prefixes.
    offsets: MapVec<u64>,
    prefixes: MapVec<u128>,
    hashes: Vec<u64>,
    /// The filter built as keys arrive, when `expected_keys` was given. Each key's hash is
    /// inserted `BLOOM_PREFETCH_AHEAD` keys after its line was prefetched.
    filter: Option<Bloom>,
    pending: [u64; BLOOM_PREFETCH_AHEAD],
    entry_count: u64,
    /// The last key of the last finished data block, copied when the block is finished.
    last_key: Vec<u8>,
    /// The last key added, while its block is open: where it lies in `buf`, and its length.
    /// (Copying every key out was a fifth of the writer's time for small entries.)
    open_last_key: (usize, usize),
    last_prefix: u128,
    kg_first: Option<u16>,
    gauge: Option<BuildGauge>,
}

fn round16(n: usize) -> usize {
    n.div_ceil(16) * 16
}

/// `dst.copy_from_slice(src)`, as two overlapping fixed-size copies when `src` is 4 to 32
/// bytes long (keys and small values): those compile to a few moves, where a copy of a length
/// known only at run time is a call into `memcpy`.
#[inline(always)]
fn copy_bytes(dst: &mut [u8], src: &[u8]) {
    let n = src.len();
    match n {
        16..=32 => {
            dst[..16].copy_from_slice(&src[..16]);
            dst[n - 16..n].copy_from_slice(&src[n - 16..]);
        }
        8..=15 => {
            dst[..8].copy_from_slice(&src[..8]);
            dst[n - 8..n].copy_from_slice(&src[n - 8..]);
        }
        4..=7 => {
            dst[..4].copy_from_slice(&src[..4]);
            dst[n - 4..n].copy_from_slice(&src[n - 4..]);
        }
        _ => dst.copy_from_slice(src),
    }
}

// SAFETY: a `MapVec`'s bytes live in its `ZeroedBuf`, which is replaced only when the vector
// grows; `bytes` borrows them without growing, and a box the file owns is not mutated.
unsafe impl weir_io::WriteBuf for MapVec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
        self
    }
}

/// A block header (see `weir_io::encode_block`) with its CRC over the header's first 20
/// bytes and then the payload, given as the `payload` pieces in order. One pass over the
/// payload after the header: combining a separately computed payload CRC (`crc32fast`'s
/// `combine`) cost more per block than reading the block again (measured with 1 KiB blocks).
fn block_header(id: u64, block_index: u32, kind: u8, payload: &[&[u8]]) -> [u8; BLOCK_HEADER_LEN] {
    let payload_len: usize = payload.iter().map(|p| p.len()).sum();
    let payload_len = payload_len as u32;
    let mut head = [0u8; BLOCK_HEADER_LEN];
    head[0..8].copy_from_slice(&id.to_le_bytes());
    head[8..12].copy_from_slice(&block_index.to_le_bytes());
    head[12] = kind;
    head[13] = CHECKSUM_CRC32_IEEE;
    head[16..20].copy_from_slice(&payload_len.to_le_bytes());
    let mut crc = crc32fast::Hasher::new();
    crc.update(&head[..20]);
    for p in payload {
        crc.update(p);
    }
    head[20..24].copy_from_slice(&crc.finalize().to_le_bytes());
    head
}

impl SegmentWriter {
    pub fn create(
        fs: &dyn Fs,
        path: &Path,
        id: u64,
        opts: WriterOptions,
    ) -> Result<Self, StateError> {
        let filter = match opts.expected_keys {
            Some(n) => Some(Bloom::empty(n.max(1), opts.bloom_bits_per_key)?),
            None => None,
        };
        // Written in aligned 2 MiB pieces from mapped buffers (`flush_aligned`), then read
        // through a map only: the pieces may bypass the page cache.
        let file = fs.create_direct(path)?;
        // From the scratch pool: an earlier writer's buffer, its pages faulted in.
        let mut buf =
            MapVec::scratch_with_capacity(WRITE_BUFFER_BYTES + opts.block_target_bytes * 2);
        buf.extend_from_slice(&FILE_MAGIC);
        buf.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        buf.push(CHECKSUM_CRC32_IEEE);
        buf.extend_from_slice(&[0; 5]);
        buf.extend_from_slice(&id.to_le_bytes());
        buf.extend_from_slice(&[0; 4]);
        let crc = weir_io::crc32(&[&buf[..FH_CRC]]);
        buf.extend_from_slice(&crc.to_le_bytes());
        debug_assert_eq!(buf.len(), FILE_HEADER_LEN);
        let mut index = MapVec::new();
        index.extend_from_slice(&[0; INDEX_HEADER_LEN]);
        Ok(SegmentWriter {
            file,
            path: path.to_owned(),
            id,
            opts,
            buf,
            spare: None,
            flushed: 0,
            file_crc: crc32fast::Hasher::new(),
            block_start: None,
            entry_offsets: Vec::new(),
            block_index: 0,
            index,
            offsets: MapVec::new(),
            prefixes: MapVec::new(),
            hashes: Vec::new(),
            filter,
            pending: [0; BLOOM_PREFETCH_AHEAD],
            entry_count: 0,
            last_key: Vec::new(),
            open_last_key: (0, 0),
            last_prefix: 0,
            kg_first: None,
            gauge: None,
        })
    }

    /// Count this writer's index and filter memory in `total` until its segment is installed
    /// ([`Segment::installed`]).
    pub fn count_in(&mut self, total: Arc<AtomicUsize>) {
        let g = BuildGauge::new(total);
        g.set(self.building_bytes());
        self.gauge = Some(g);
    }

    /// Index and filter memory held so far: the index block, block list and bloom filter.
    fn building_bytes(&self) -> usize {
        self.index.capacity()
            + self.offsets.capacity() * 8
            + self.prefixes.capacity() * 16
            + self.filter.as_ref().map_or(0, Bloom::bytes)
    }

    fn abs(&self) -> u64 {
        self.flushed + self.buf.len() as u64
    }

    /// The last key added so far.
    fn last_key(&self) -> &[u8] {
        match self.block_start {
            Some(_) => {
                let (at, n) = self.open_last_key;
                &self.buf[at..at + n]
            }
            None => &self.last_key,
        }
    }

    /// Append an entry; keys must be strictly ascending and start with their key group.
    pub fn add(&mut self, key: &[u8], v: ValueRef<'_>) -> Result<(), StateError> {
        assert!(
            key.len() >= 2 && key.len() <= usize::from(u16::MAX),
            "bad key length"
        );
        // Strict order, checked on 16-byte prefixes first (full keys only on a tie).
        let pk = key_prefix(key);
        assert!(
            self.entry_count == 0
                || pk > self.last_prefix
                || (pk == self.last_prefix && key > self.last_key()),
            "segment keys must be strictly ascending"
        );
        let abs = self.abs() as usize;
        let value_at = round16(abs + ENTRY_HEADER_LEN + key.len());
        if let Some(start) = self.block_start {
            // End the block at the page boundary rather than let this entry cross it.
            let n = self.entry_offsets.len();
            let page_end = ((self.flushed as usize + start) / PAGE_BYTES + 1) * PAGE_BYTES;
            let close_end = round16(abs + 4 * n);
            let with_entry_end = round16(value_at + v.bytes.len() + 4 * (n + 1));
            if n > 0
                && close_end <= page_end
                && with_entry_end > page_end
                && page_end - close_end <= PAGE_PAD_MAX
            {
                self.finish_data_block(Some(page_end as u64))?;
            }
        }
        self.last_prefix = pk;
        let start = match self.block_start {
            Some(start) => start,
            None => {
                let start = self.buf.len();
                self.block_start = Some(start);
                self.buf
                    .extend_from_slice(&[0; BLOCK_HEADER_LEN + DATA_HEADER_LEN]);
                start
            }
        };
        let payload_start = start + BLOCK_HEADER_LEN;
        let abs = self.abs() as usize;
        let value_at = round16(abs + ENTRY_HEADER_LEN + key.len()) - abs;
        let at = self.buf.len();
        self.entry_offsets.push((at - payload_start) as u32);
        let mut head = [0u8; ENTRY_HEADER_LEN];
        head[E_KEY_LEN..E_KEY_LEN + 2].copy_from_slice(&(key.len() as u16).to_le_bytes());
        head[E_FLAGS] = if v.tombstone() { FLAG_TOMBSTONE } else { 0 };
        head[E_VAL_LEN..E_VAL_LEN + 4].copy_from_slice(&(v.bytes.len() as u32).to_le_bytes());
        head[E_EXPIRE_AT_MS..E_EXPIRE_AT_MS + 8].copy_from_slice(&v.expire_at_ms.to_le_bytes());
        // The entry in place, in fixed-size pieces where it can (small `memcpy` and `memset`
        // calls were a fifth of the writer's time). The 16 bytes before the value are zeroed
        // first: they hold all of its padding (under 16 bytes) and start at the entry's byte 2
        // or later (the value starts 16 + key length or more bytes in). The header and the key,
        // written next, overwrite what of them is theirs.
        let out = self.buf.append(value_at + v.bytes.len());
        out[value_at - 16..value_at].fill(0);
        out[..ENTRY_HEADER_LEN].copy_from_slice(&head);
        copy_bytes(
            &mut out[ENTRY_HEADER_LEN..ENTRY_HEADER_LEN + key.len()],
            key,
        );
        copy_bytes(&mut out[value_at..], v.bytes);
        self.open_last_key = (at + ENTRY_HEADER_LEN, key.len());
        let h = xxh3_64(key);
        match &mut self.filter {
            Some(f) => {
                let slot = self.entry_count as usize % BLOOM_PREFETCH_AHEAD;
                if self.entry_count >= BLOOM_PREFETCH_AHEAD as u64 {
                    f.insert(self.pending[slot]);
                }
                f.prefetch(h);
                self.pending[slot] = h;
            }
            None => self.hashes.push(h),
        }
        if self.kg_first.is_none() {
            self.kg_first = Some(key_group_of(key));
        }
        self.entry_count += 1;
        if self.buf.len() - start >= self.opts.block_target_bytes {
            self.finish_data_block(None)?;
        }
        Ok(())
    }

    /// Pad the open block's payload so the next block starts aligned, then fill its header.
    fn seal_block(&mut self, start: usize, block_index: u32, kind: u8) {
        let total = self.buf.len() - start;
        let pad = (BLOCK_ALIGN - total % BLOCK_ALIGN) % BLOCK_ALIGN;
        self.buf.resize(self.buf.len() + pad, 0);
        let head = block_header(
            self.id,
            block_index,
            kind,
            &[&self.buf[start + BLOCK_HEADER_LEN..]],
        );
        self.buf[start..start + BLOCK_HEADER_LEN].copy_from_slice(&head);
    }

    /// Write the open block's entry table and seal it; with `end_at`, zero-pad its payload so
    /// that the next block starts at that file offset (a page boundary).
    fn finish_data_block(&mut self, end_at: Option<u64>) -> Result<(), StateError> {
        let Some(start) = self.block_start.take() else {
            return Ok(());
        };
        let (at, n) = self.open_last_key;
        self.last_key.clear();
        self.last_key.extend_from_slice(&self.buf[at..at + n]);
        let payload_start = start + BLOCK_HEADER_LEN;
        let table_off = (self.buf.len() - payload_start) as u32;
        let count = self.entry_offsets.len() as u32;
        self.buf.reserve(4 * self.entry_offsets.len());
        for &o in &self.entry_offsets {
            self.buf.extend_from_slice(&o.to_le_bytes());
        }
        self.entry_offsets.clear();
        if let Some(end) = end_at {
            let pad = end.saturating_sub(self.abs()) as usize;
            self.buf.resize(self.buf.len() + pad, 0);
        }
        self.buf[payload_start..payload_start + 4].copy_from_slice(&count.to_le_bytes());
        self.buf[payload_start + 4..payload_start + 8].copy_from_slice(&table_off.to_le_bytes());
        self.seal_block(start, self.block_index, KIND_DATA);
        let block_offset = self.flushed + start as u64;
        let block_len = (self.buf.len() - start) as u32;
        self.index.extend_from_slice(&block_offset.to_le_bytes());
        self.index.extend_from_slice(&block_len.to_le_bytes());
        self.index
            .extend_from_slice(&(self.last_key.len() as u16).to_le_bytes());
        self.index.extend_from_slice(&[0, 0]);
        self.index.extend_from_slice(&self.last_key);
        let cap = self.offsets.capacity();
        self.offsets.push(block_offset + BLOCK_HEADER_LEN as u64);
        self.prefixes.push(self.last_prefix);
        if self.offsets.capacity() != cap {
            if let Some(g) = &self.gauge {
                g.set(self.building_bytes());
            }
        }
        self.block_index += 1;
        if self.buf.len() >= WRITE_BUFFER_BYTES {
            self.flush_aligned()?;
        }
        Ok(())
    }

    /// Write exactly the buffer's first `WRITE_BUFFER_BYTES` and keep the rest (less than a
    /// block) for the next write. Every data write thus starts at a multiple of 2 MiB and is
    /// 2 MiB long, so the page cache can hold the data in 2 MiB folios, which the kernel maps
    /// with one TLB entry each: readers' lookups then skip a page walk (which costs more than
    /// the cache miss itself on a VM). Misaligned writes leave the file in small folios.
    ///
    /// The piece is written behind (`FsFile::write_behind`): the copy into the page cache and
    /// the start of its writeback overlap the encoding of the next piece, in a second buffer
    /// (a flush of 2 M entries waited 12-13 ms of its ~90 ms for these writes). `finish`'s
    /// sync then waits for the tail only.
    fn flush_aligned(&mut self) -> Result<(), StateError> {
        debug_assert!(self.block_start.is_none());
        debug_assert_eq!(self.flushed % WRITE_BUFFER_BYTES as u64, 0);
        let n = WRITE_BUFFER_BYTES;
        let mut next = self
            .spare
            .take()
            .unwrap_or_else(|| MapVec::scratch_with_capacity(self.buf.capacity()));
        next.clear();
        next.extend_from_slice(&self.buf[n..]);
        self.buf.truncate(n);
        self.file_crc.update(&self.buf);
        let piece = std::mem::replace(&mut self.buf, next);
        if let Some(back) = self.file.write_behind(self.flushed, Box::new(piece))? {
            self.spare = back.into_any().downcast::<MapVec<u8>>().ok().map(|b| *b);
        }
        self.flushed += n as u64;
        Ok(())
    }

    fn flush_buf(&mut self) -> Result<(), StateError> {
        debug_assert!(self.block_start.is_none());
        if self.buf.is_empty() {
            return Ok(());
        }
        self.file.write_at(self.flushed, &self.buf)?;
        self.file_crc.update(&self.buf);
        self.flushed += self.buf.len() as u64;
        self.buf.clear();
        Ok(())
    }

    /// Append `bytes` to the buffer if they fit with room for a block's padding and the
    /// footer; otherwise write the buffer and then `bytes` from where they are (not copied).
    fn append_or_write(&mut self, bytes: &[u8]) -> Result<(), StateError> {
        if self.buf.len() + bytes.len() + BLOCK_ALIGN + FOOTER_LEN <= self.buf.capacity() {
            self.buf.extend_from_slice(bytes);
            return Ok(());
        }
        self.flush_buf()?;
        self.file.write_at(self.flushed, bytes)?;
        self.file_crc.update(bytes);
        self.flushed += bytes.len() as u64;
        Ok(())
    }

    /// Write index, filter and footer, fsync. The file is complete and immutable afterwards.
    pub fn finish(mut self) -> Result<Written, StateError> {
        self.finish_data_block(None)?;
        let data_blocks = self.block_index;
        // Index block.
        self.index[0..4].copy_from_slice(&data_blocks.to_le_bytes());
        let pad = (BLOCK_ALIGN - (BLOCK_HEADER_LEN + self.index.len()) % BLOCK_ALIGN) % BLOCK_ALIGN;
        self.index.resize(self.index.len() + pad, 0);
        let index_offset = self.abs();
        let head = block_header(self.id, data_blocks, KIND_INDEX, &[&self.index]);
        self.buf.extend_from_slice(&head);
        let index = std::mem::take(&mut self.index);
        self.append_or_write(&index)?;
        drop(index);
        let index_len = (self.abs() - index_offset) as u32;
        // Filter block: header, bloom header, bit blocks, zero padding.
        let bloom = match self.filter.take() {
            Some(mut f) => {
                // The hashes still waiting for their insertion.
                let n = self.entry_count;
                for i in n.saturating_sub(BLOOM_PREFETCH_AHEAD as u64)..n {
                    f.insert(self.pending[i as usize % BLOOM_PREFETCH_AHEAD]);
                }
                f
            }
            None => Bloom::build(
                &std::mem::take(&mut self.hashes),
                self.opts.bloom_bits_per_key,
            )?,
        };
        let bloom_head = bloom.header();
        let bits_len = bloom.bits().len();
        let pad = (BLOCK_ALIGN - (BLOCK_HEADER_LEN + bloom_head.len() + bits_len) % BLOCK_ALIGN)
            % BLOCK_ALIGN;
        let zeros = [0u8; BLOCK_ALIGN];
        let filter_offset = self.abs();
        let head = block_header(
            self.id,
            data_blocks + 1,
            KIND_FILTER,
            &[&bloom_head, bloom.bits(), &zeros[..pad]],
        );
        self.buf.extend_from_slice(&head);
        self.buf.extend_from_slice(&bloom_head);
        self.append_or_write(bloom.bits())?;
        self.buf.extend_from_slice(&zeros[..pad]);
        let filter_len = (self.abs() - filter_offset) as u32;
        // Footer.
        let last_kg = if self.entry_count > 0 {
            key_group_of(&self.last_key)
        } else {
            0
        };
        let mut f = [0u8; FOOTER_LEN];
        f[F_MAGIC..F_MAGIC + 4].copy_from_slice(&FOOTER_MAGIC);
        f[F_VERSION..F_VERSION + 2].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        f[F_CHECKSUM_ALGO] = CHECKSUM_CRC32_IEEE;
        f[F_FLAGS] = if self.entry_count == 0 {
            FOOTER_FLAG_EMPTY
        } else {
            0
        };
        f[F_SEGMENT_ID..F_SEGMENT_ID + 8].copy_from_slice(&self.id.to_le_bytes());
        f[F_ENTRY_COUNT..F_ENTRY_COUNT + 8].copy_from_slice(&self.entry_count.to_le_bytes());
        f[F_INDEX_OFFSET..F_INDEX_OFFSET + 8].copy_from_slice(&index_offset.to_le_bytes());
        f[F_INDEX_LEN..F_INDEX_LEN + 4].copy_from_slice(&index_len.to_le_bytes());
        f[F_DATA_BLOCKS..F_DATA_BLOCKS + 4].copy_from_slice(&data_blocks.to_le_bytes());
        f[F_FILTER_OFFSET..F_FILTER_OFFSET + 8].copy_from_slice(&filter_offset.to_le_bytes());
        f[F_FILTER_LEN..F_FILTER_LEN + 4].copy_from_slice(&filter_len.to_le_bytes());
        f[F_KG_FIRST..F_KG_FIRST + 2].copy_from_slice(&self.kg_first.unwrap_or(0).to_le_bytes());
        f[F_KG_LAST..F_KG_LAST + 2].copy_from_slice(&last_kg.to_le_bytes());
        let crc = weir_io::crc32(&[&f[..F_CRC]]);
        f[F_CRC..].copy_from_slice(&crc.to_le_bytes());
        self.buf.extend_from_slice(&f);
        self.flush_buf()?;
        let behind = self.file.wait_behind()?;
        // Both write buffers go back to the pool for the next writer on this thread.
        let behind = behind.and_then(|b| b.into_any().downcast::<MapVec<u8>>().ok());
        for b in [behind.map(|b| *b), self.spare.take()]
            .into_iter()
            .flatten()
        {
            b.recycle();
        }
        std::mem::take(&mut self.buf).recycle();
        self.file.sync()?;
        Ok(Written {
            path: self.path.clone(),
            id: self.id,
            size_bytes: self.flushed,
            crc32: self.file_crc.clone().finalize(),
            entry_count: self.entry_count,
            offsets: std::mem::take(&mut self.offsets),
            prefixes: std::mem::take(&mut self.prefixes),
            data_end: index_offset,
            bloom,
            key_groups: (self.entry_count > 0)
                .then(|| KeyGroupRange::new(self.kg_first.unwrap_or(0), last_kg)),
            gauge: self.gauge.take(),
        })
    }
}

/// A data block as verification found it.
#[derive(Debug, Clone, Copy)]
struct BlockInfo {
    /// File offset of the payload.
    payload: usize,
    count: u32,
    /// File offset of the entry offset table.
    table: usize,
}

/// A lookup's outcome, with the bloom filter's verdict for metrics.
#[derive(Debug)]
pub(crate) enum Probe<'a> {
    BloomNegative,
    Absent,
    Found(ValueRef<'a>),
}

/// An open, verified segment. Deleted from disk on drop only if marked obsolete and owned.
#[derive(Debug)]
pub(crate) struct Segment {
    pub id: u64,
    pub path: PathBuf,
    pub size_bytes: u64,
    pub crc32: u32,
    pub entry_count: u64,
    pub key_groups: Option<KeyGroupRange>,
    map: Mapped,
    /// Each data block's payload offset and last-key prefix, with a guide table over the
    /// prefixes (the in-memory search index; entry count and table offset are read from the
    /// payload header: verified, and on the page the lookup touches anyway).
    index: BlockIndex,
    /// Where the data blocks end.
    data_end: usize,
    bloom: Bloom,
    /// Which data blocks have passed their CRC check (see [`Segment::open_written`]).
    checked: CheckedBlocks,
    file: Arc<SegmentFile>,
    /// Counts the index and filter of a flush's or compaction's output until installed.
    building: Option<BuildGauge>,
}

/// One bit per data block: set once the block's header and CRC have been checked against the
/// mapped bytes. Relaxed atomics: a bit only says that the (immutable, mapped) block was
/// found intact; two readers racing on a block both check it, which is harmless.
#[derive(Debug)]
struct CheckedBlocks(Box<[AtomicU64]>);

impl CheckedBlocks {
    fn new(blocks: usize, checked: bool) -> CheckedBlocks {
        let word = if checked { u64::MAX } else { 0 };
        CheckedBlocks(
            (0..blocks.div_ceil(64))
                .map(|_| AtomicU64::new(word))
                .collect(),
        )
    }

    #[inline]
    fn has(&self, bi: usize) -> bool {
        self.0[bi / 64].load(Ordering::Relaxed) & (1 << (bi % 64)) != 0
    }

    fn set(&self, bi: usize) {
        self.0[bi / 64].fetch_or(1 << (bi % 64), Ordering::Relaxed);
    }

    fn bytes(&self) -> usize {
        self.0.len() * 8
    }
}

/// A segment's file on disk, shared by the open segment and by whatever else names it
/// without reading it (a snapshot chain): deleted when the last holder lets go, if it was
/// marked obsolete and this store owns it.
#[derive(Debug)]
pub(crate) struct SegmentFile {
    path: PathBuf,
    fs: Arc<dyn Fs>,
    /// Set when no store needs the file any more; the last reference then deletes it.
    obsolete: AtomicBool,
    /// Cleared when the store shuts down so that files retained snapshots name survive.
    deletable: AtomicBool,
}

impl SegmentFile {
    fn new(fs: Arc<dyn Fs>, path: PathBuf, owned: bool) -> Arc<SegmentFile> {
        Arc::new(SegmentFile {
            path,
            fs,
            obsolete: AtomicBool::new(false),
            deletable: AtomicBool::new(owned),
        })
    }

    pub fn mark_obsolete(&self) {
        self.obsolete.store(true, Ordering::Release);
    }

    pub fn keep_file(&self) {
        self.deletable.store(false, Ordering::Release);
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for SegmentFile {
    fn drop(&mut self) {
        if self.obsolete.load(Ordering::Acquire) && self.deletable.load(Ordering::Acquire) {
            if let Err(e) = self.fs.remove(&self.path) {
                tracing::warn!("removing obsolete segment {}: {e}", self.path.display());
            }
        }
    }
}

pub(crate) fn malformed(path: &Path, offset: usize, reason: impl Into<String>) -> StateError {
    StateError::Format(FormatError::Malformed {
        file: path.to_owned(),
        offset: offset as u64,
        reason: reason.into(),
    })
}

/// Where the segment file `path` fails its own checks (header, every block's CRC and
/// structure, index, filter, footer): the error names the failing part's offset. `None` if the
/// file cannot be mapped, does not start with the segment magic, or checks out. A
/// [`weir_io::RawDiagnose`]: the checkpoint reader calls it when a segment that a checkpoint
/// holds raw fails its whole-file CRC, which cannot say where the file changed.
pub fn diagnose_segment(fs: &dyn Fs, path: &Path) -> Option<FormatError> {
    let map = fs.map_readonly(path).ok()?;
    // Only a file that says it is a segment is judged as one: another kind of file would get
    // a misleading "bad magic" (a segment with a damaged magic keeps offset 0).
    if map.get(FH_MAGIC..FH_MAGIC + 8) != Some(&FILE_MAGIC[..]) {
        return None;
    }
    match Segment::verified(path, map, None) {
        Err(StateError::Format(e)) => Some(e),
        _ => None,
    }
}

impl Segment {
    /// Map and completely verify a segment file. `expect_id`, when given, must match.
    /// `owned`: whether this store may delete the file once it is obsolete.
    pub fn open(
        fs: Arc<dyn Fs>,
        path: &Path,
        expect_id: Option<u64>,
        owned: bool,
    ) -> Result<Segment, StateError> {
        let map = fs.map_readonly(path)?;
        let segment = Self::verified(path, map, expect_id)?;
        Ok(segment(SegmentFile::new(fs, path.to_owned(), owned)))
    }

    /// Check the whole of the mapped segment file `map`; on success, what makes the
    /// [`Segment`] once given its file.
    fn verified(
        path: &Path,
        map: Mapped,
        expect_id: Option<u64>,
    ) -> Result<impl FnOnce(Arc<SegmentFile>) -> Segment, StateError> {
        let b: &[u8] = &map;
        let len = b.len();
        let p = path;
        let trunc = |offset: usize, needed: usize| {
            StateError::Format(FormatError::Truncated {
                file: p.to_owned(),
                offset: offset as u64,
                needed: needed as u64,
                available: len.saturating_sub(offset) as u64,
            })
        };
        if len < FILE_HEADER_LEN {
            return Err(trunc(0, FILE_HEADER_LEN));
        }
        // File header: magic, version, algorithm, then CRC.
        if b[FH_MAGIC..FH_MAGIC + 8] != FILE_MAGIC {
            return Err(FormatError::BadMagic {
                file: p.to_owned(),
                offset: 0,
                found: rd_u64(b, 0),
            }
            .into());
        }
        check_version_algo(p, b, FH_VERSION, FH_CHECKSUM_ALGO, 0)?;
        check_crc(p, &b[..FILE_HEADER_LEN], FH_CRC, 0)?;
        let id = rd_u64(b, FH_SEGMENT_ID);
        if let Some(want) = expect_id {
            misdirected(p, FH_SEGMENT_ID, "segment id", want, id)?;
        }
        if len < FILE_HEADER_LEN + FOOTER_LEN {
            return Err(trunc(FILE_HEADER_LEN, FOOTER_LEN));
        }
        // Footer.
        let fo = len - FOOTER_LEN;
        let f = &b[fo..];
        if f[F_MAGIC..F_MAGIC + 4] != FOOTER_MAGIC {
            return Err(FormatError::BadMagic {
                file: p.to_owned(),
                offset: fo as u64,
                found: u64::from(rd_u32(f, F_MAGIC)),
            }
            .into());
        }
        check_version_algo(p, f, F_VERSION, F_CHECKSUM_ALGO, fo)?;
        check_crc(p, f, F_CRC, fo)?;
        misdirected(
            p,
            fo + F_SEGMENT_ID,
            "footer segment id",
            id,
            rd_u64(f, F_SEGMENT_ID),
        )?;
        let entry_count = rd_u64(f, F_ENTRY_COUNT);
        let index_offset = rd_u64(f, F_INDEX_OFFSET) as usize;
        let index_len = rd_u32(f, F_INDEX_LEN) as usize;
        let data_blocks = rd_u32(f, F_DATA_BLOCKS);
        let filter_offset = rd_u64(f, F_FILTER_OFFSET) as usize;
        let filter_len = rd_u32(f, F_FILTER_LEN) as usize;
        if f[F_FLAGS] & !FOOTER_FLAG_EMPTY != 0 {
            return Err(malformed(p, fo + F_FLAGS, "unknown footer flag bits"));
        }
        let empty = f[F_FLAGS] & FOOTER_FLAG_EMPTY != 0;
        // The flag must say what the count says: an "empty" segment with entries read as one
        // without key groups, which a restore skips (its entries lost without an error).
        if empty != (entry_count == 0) {
            return Err(malformed(
                p,
                fo + F_FLAGS,
                "the empty flag disagrees with the entry count",
            ));
        }
        let kg = (rd_u16(f, F_KG_FIRST), rd_u16(f, F_KG_LAST));
        // Region layout: header | data blocks | index | filter | footer, contiguous.
        if index_offset < FILE_HEADER_LEN
            || index_offset.checked_add(index_len) != Some(filter_offset)
            || filter_offset.checked_add(filter_len) != Some(fo)
        {
            return Err(malformed(
                p,
                fo + F_INDEX_OFFSET,
                "footer region offsets inconsistent",
            ));
        }
        // The filter block's index follows the data blocks'.
        let Some(filter_block) = data_blocks.checked_add(1) else {
            return Err(malformed(
                p,
                fo + F_DATA_BLOCKS,
                "data block count too large",
            ));
        };
        let index_payload = decode_block(
            p,
            &b[index_offset..filter_offset],
            index_offset as u64,
            BlockHeader {
                file_id: id,
                block_index: data_blocks,
                kind: KIND_INDEX,
                payload_len: (index_len - BLOCK_HEADER_LEN.min(index_len)) as u32,
            },
        )?;
        let filter_payload = decode_block(
            p,
            &b[filter_offset..fo],
            filter_offset as u64,
            BlockHeader {
                file_id: id,
                block_index: filter_block,
                kind: KIND_FILTER,
                payload_len: (filter_len - BLOCK_HEADER_LEN.min(filter_len)) as u32,
            },
        )?;
        let bloom = Bloom::parse(p, filter_payload, filter_offset + BLOCK_HEADER_LEN)?;
        // Index.
        let io = index_offset + BLOCK_HEADER_LEN;
        if index_payload.len() < INDEX_HEADER_LEN || rd_u32(index_payload, 0) != data_blocks {
            return Err(malformed(p, io, "index block count differs from footer"));
        }
        // Sized by what the index can hold, not by the count the file states (which must not
        // size an allocation: 4 G blocks aborted the process).
        let blocks_max = (data_blocks as usize).min(index_payload.len() / INDEX_ENTRY_FIXED_LEN);
        let mut offsets = Vec::with_capacity(blocks_max);
        let mut prefixes = Vec::with_capacity(blocks_max);
        let mut first_key: Option<(usize, usize)> = None;
        let mut pos = INDEX_HEADER_LEN;
        let mut expect_off = FILE_HEADER_LEN;
        let mut total = 0u64;
        let mut prev_key: Option<(usize, usize)> = None;
        let mut hashes = Vec::new();
        // The whole file's CRC, fed each region while it is in cache from its own check: the
        // blocks are contiguous (checked below), so this is the file in order. A second pass
        // over a restored gigabyte cost ~0.1 s per shard in page-cache reads.
        let mut whole = crc32fast::Hasher::new();
        whole.update(&b[..FILE_HEADER_LEN]);
        for i in 0..data_blocks {
            if pos + INDEX_ENTRY_FIXED_LEN > index_payload.len() {
                return Err(malformed(p, io + pos, "index entry truncated"));
            }
            let boff = rd_u64(index_payload, pos) as usize;
            let blen = rd_u32(index_payload, pos + 8) as usize;
            let klen = usize::from(rd_u16(index_payload, pos + 12));
            let kstart = io + pos + INDEX_ENTRY_FIXED_LEN;
            if boff != expect_off || blen < BLOCK_HEADER_LEN || boff + blen > index_offset {
                return Err(malformed(p, io + pos, "index block offset/length invalid"));
            }
            if pos + INDEX_ENTRY_FIXED_LEN + klen > index_payload.len() {
                return Err(malformed(p, io + pos, "index key truncated"));
            }
            pos += INDEX_ENTRY_FIXED_LEN + klen;
            expect_off = boff + blen;
            let payload = decode_block(
                p,
                &b[boff..boff + blen],
                boff as u64,
                BlockHeader {
                    file_id: id,
                    block_index: i,
                    kind: KIND_DATA,
                    payload_len: (blen - BLOCK_HEADER_LEN) as u32,
                },
            )?;
            let info = verify_data_block(
                p,
                b,
                boff + BLOCK_HEADER_LEN,
                payload,
                &mut prev_key,
                (&bloom, &mut hashes),
            )?;
            whole.update(&b[boff..boff + blen]);
            if first_key.is_none() {
                let e = info.payload + rd_u32(b, info.table) as usize;
                first_key = Some((e + ENTRY_HEADER_LEN, usize::from(rd_u16(b, e + E_KEY_LEN))));
            }
            let last = prev_key.unwrap_or((0, 0));
            if b[last.0..last.0 + last.1] != b[kstart..kstart + klen] {
                return Err(malformed(
                    p,
                    io + pos - klen,
                    "index key differs from block's last key",
                ));
            }
            total += u64::from(info.count);
            offsets.push(info.payload as u64);
            prefixes.push(key_prefix(&b[kstart..kstart + klen]));
        }
        if expect_off != index_offset {
            return Err(malformed(p, io, "data blocks do not reach the index"));
        }
        if total != entry_count {
            return Err(malformed(
                p,
                fo + F_ENTRY_COUNT,
                "entry count differs from blocks",
            ));
        }
        let key_groups = if empty || entry_count == 0 {
            None
        } else {
            let f = first_key.unwrap_or((0, 2));
            let first = u16::from_be_bytes([b[f.0], b[f.0 + 1]]);
            let l = prev_key.unwrap_or((0, 2));
            let last = u16::from_be_bytes([b[l.0], b[l.0 + 1]]);
            if (first, last) != kg {
                return Err(malformed(
                    p,
                    fo + F_KG_FIRST,
                    "key group range differs from keys",
                ));
            }
            Some(KeyGroupRange::new(first, last))
        };
        whole.update(&b[index_offset..]);
        let crc32 = whole.finalize();
        debug_assert_eq!(crc32, weir_io::crc32(&[b]));
        let size_bytes = len as u64;
        let path = p.to_owned();
        Ok(move |file| Segment {
            id,
            path,
            size_bytes,
            crc32,
            entry_count,
            key_groups,
            map,
            index: BlockIndex::new(&offsets, &prefixes),
            data_end: index_offset,
            bloom,
            // Every block was checked above, its structure too.
            checked: CheckedBlocks::new(offsets.len(), true),
            file,
            building: None,
        })
    }

    /// Open a segment this process has just written and fsynced, without a pass over it: the
    /// writer produced it and knows its blocks, filter and totals, which stay in memory. What
    /// a reader would check again is the bytes of the data blocks, the only part of the file
    /// it reads: each block's header and CRC are checked the first time a read touches it
    /// (see [`Segment::blk`]), so a device or cache returning other bytes than written is
    /// caught before they are used, and only for what is read. A whole-file check here read
    /// every segment back from the device (its pieces bypass the page cache) and took 30-50%
    /// of a flush's wall time. The size is checked here. Segments from anywhere else (restore)
    /// go through [`Segment::open`].
    pub fn open_written(fs: Arc<dyn Fs>, w: Written) -> Result<Segment, StateError> {
        let map = fs.map_readonly(&w.path)?;
        let mismatch = |what, expected: u64, actual: u64| StateError::HandleMismatch {
            file: w.path.clone(),
            what,
            expected,
            actual,
        };
        if map.len() as u64 != w.size_bytes {
            return Err(mismatch(
                "size of the written segment",
                w.size_bytes,
                map.len() as u64,
            ));
        }
        let index = BlockIndex::new(&w.offsets, &w.prefixes);
        let checked = CheckedBlocks::new(w.offsets.len(), false);
        let building = w.gauge;
        if let Some(g) = &building {
            g.set(index.bytes() + checked.bytes() + w.bloom.bytes());
        }
        Ok(Segment {
            id: w.id,
            file: SegmentFile::new(fs, w.path.clone(), true),
            path: w.path,
            size_bytes: w.size_bytes,
            crc32: w.crc32,
            entry_count: w.entry_count,
            key_groups: w.key_groups,
            map,
            index,
            data_end: w.data_end as usize,
            bloom: w.bloom,
            checked,
            building,
        })
    }

    /// The store holds this segment now and counts its index and filter itself.
    pub fn installed(&self) {
        if let Some(g) = &self.building {
            g.set(0);
        }
    }

    pub fn mark_obsolete(&self) {
        self.file.mark_obsolete();
    }

    pub fn keep_file(&self) {
        self.file.keep_file();
    }

    /// The file, for a holder that names it without reading it.
    pub fn file(&self) -> Arc<SegmentFile> {
        self.file.clone()
    }

    pub fn index_bytes(&self) -> usize {
        self.index.bytes() + self.checked.bytes()
    }

    pub fn filter_bytes(&self) -> usize {
        self.bloom.bytes()
    }

    /// Number of data blocks.
    fn block_count(&self) -> usize {
        self.index.len()
    }

    /// Data block `bi` (< `block_count`): payload offset, entry count and table offset. The
    /// block's CRC is checked the first time (see [`Self::open_written`]).
    #[inline]
    fn blk(&self, bi: usize) -> Result<Blk, StateError> {
        if !self.checked.has(bi) {
            self.check_block(bi)?;
        }
        Ok(self.blk_checked(bi))
    }

    /// Check data block `bi`'s header (file id, block index, kind, length) and CRC.
    #[cold]
    #[inline(never)]
    fn check_block(&self, bi: usize) -> Result<(), StateError> {
        let (start, payload, end) = self.block_span(bi);
        let b: &[u8] = &self.map;
        let Some(bytes) = b
            .get(start..end)
            .filter(|_| start < payload && payload <= end)
        else {
            return Err(malformed(&self.path, start, "data block outside the file"));
        };
        decode_block(
            &self.path,
            bytes,
            start as u64,
            BlockHeader {
                file_id: self.id,
                block_index: bi as u32,
                kind: KIND_DATA,
                payload_len: (end - payload) as u32,
            },
        )?;
        self.checked.set(bi);
        Ok(())
    }

    /// File offsets of data block `bi`'s start, payload and end. Blocks are contiguous, each
    /// payload after its header (as the writer laid them out); the last ends at the index.
    #[inline]
    fn block_span(&self, bi: usize) -> (usize, usize, usize) {
        let payload = self.index.offset(bi) as usize;
        (
            payload.saturating_sub(BLOCK_HEADER_LEN),
            payload,
            self.block_end(bi),
        )
    }

    /// Where data block `bi` ends (see [`Self::block_span`]).
    #[inline]
    fn block_end(&self, bi: usize) -> usize {
        if bi + 1 < self.block_count() {
            (self.index.offset(bi + 1) as usize).saturating_sub(BLOCK_HEADER_LEN)
        } else {
            self.data_end
        }
    }

    /// [`Self::blk`] of a block already checked.
    #[inline]
    fn blk_checked(&self, bi: usize) -> Blk {
        let b: &[u8] = &self.map;
        let payload = self.index.offset(bi) as usize;
        Blk {
            payload,
            count: rd_u32(b, payload),
            table: payload + rd_u32(b, payload + 4) as usize,
        }
    }

    #[inline]
    fn entry_key(&self, blk: &Blk, i: u32) -> &[u8] {
        let b: &[u8] = &self.map;
        let e = blk.payload + rd_u32(b, blk.table + 4 * i as usize) as usize;
        let klen = usize::from(rd_u16(b, e + E_KEY_LEN));
        &b[e + ENTRY_HEADER_LEN..e + ENTRY_HEADER_LEN + klen]
    }

    #[inline]
    fn entry(&self, blk: &Blk, i: u32) -> (&[u8], ValueRef<'_>) {
        let b: &[u8] = &self.map;
        let e = blk.payload + rd_u32(b, blk.table + 4 * i as usize) as usize;
        let klen = usize::from(rd_u16(b, e + E_KEY_LEN));
        let vlen = rd_u32(b, e + E_VAL_LEN) as usize;
        let k = e + ENTRY_HEADER_LEN;
        let v = (k + klen).div_ceil(VALUE_ALIGN) * VALUE_ALIGN;
        (
            &b[k..k + klen],
            ValueRef::new(
                &b[v..v + vlen],
                rd_u64(b, e + E_EXPIRE_AT_MS),
                b[e + E_FLAGS] & FLAG_TOMBSTONE != 0,
            ),
        )
    }

    fn block_last_key(&self, bi: usize) -> Result<&[u8], StateError> {
        let blk = self.blk(bi)?;
        Ok(self.entry_key(&blk, blk.count - 1))
    }

    /// Index of the first block whose last key is >= `key`. Searches the 16-byte key
    /// prefixes in memory (see [`BlockIndex`]); only blocks whose prefix ties with the key's
    /// compare full keys in the map.
    #[inline]
    fn find_block(&self, key: &[u8]) -> Result<usize, StateError> {
        let pk = key_prefix(key);
        let mut bi = self.index.lower_bound(pk);
        while bi < self.block_count()
            && self.index.prefix(bi) == pk
            && self.block_last_key(bi)? < key
        {
            bi += 1;
        }
        Ok(bi)
    }

    /// Position of the first entry with key >= `key`: (block, entry).
    fn seek(&self, key: &[u8]) -> Result<(usize, u32), StateError> {
        let bi = self.find_block(key)?;
        if bi == self.block_count() {
            return Ok((bi, 0));
        }
        Ok((bi, self.lower_bound(&self.blk(bi)?, key)))
    }

    /// Index of the first entry >= `key` in `blk`.
    #[inline]
    fn lower_bound(&self, blk: &Blk, key: &[u8]) -> u32 {
        let (mut lo, mut hi) = (0u32, blk.count);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if self.entry_key(blk, mid) < key {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// Request every cache line of data block `bi` at once (its extent is known from the
    /// in-memory offsets, before its header is read): the misses overlap instead of costing
    /// one dependent miss per binary-search step. Blocks are small and do not cross a page
    /// (see the writer), so this is one page walk and a few lines.
    ///
    /// Into L2, not L1: the search reads about half of the lines. Why the L1 hint was
    /// slower is not measured, only that it was: two stores of the same 10 M keys (1 KiB
    /// blocks) in one process, batched gets alternated, ran at 3.02-3.37 M/s against
    /// 2.25-3.02 with L1 hints, and with the stores' roles swapped at 2.21-2.96 against
    /// 2.05-2.61 (ahead in each of 10 rounds both times).
    #[inline]
    fn prefetch_block(&self, bi: usize) {
        let start = self.index.offset(bi) as usize;
        let end = if bi + 1 < self.block_count() {
            self.index.offset(bi + 1) as usize - BLOCK_HEADER_LEN
        } else {
            self.data_end
        };
        let b: &[u8] = &self.map;
        let mut off = start & !63;
        while off < end {
            prefetch_read_l2(b[off..end].as_ptr());
            off += 64;
        }
    }

    /// Point lookup; `hash` is `xxh3_64(key)`.
    pub fn get(&self, key: &[u8], hash: u64) -> Result<Probe<'_>, StateError> {
        if !self.bloom.may_contain(hash) {
            return Ok(Probe::BloomNegative);
        }
        let bi = self.find_block(key)?;
        if bi == self.block_count() {
            return Ok(Probe::Absent);
        }
        self.prefetch_block(bi);
        self.get_in_block(key, bi)
    }

    // Batched lookups (see `Store::multi_get`) split `get` into steps, each issued some keys
    // after the previous one, so that each step finds its memory loaded and the misses of
    // neighbouring keys overlap instead of adding up.

    /// Step one: start loading the filter line and the guide entry of `key`.
    #[inline]
    pub fn batch_start(&self, hash: u64, pk: u128) {
        self.bloom.prefetch(hash);
        self.index.prefetch_guide(pk);
    }

    /// Step two: test the filter; if it may hold the key, start loading the block records.
    #[inline]
    pub fn batch_filter(&self, hash: u64, pk: u128) -> bool {
        let maybe = self.bloom.may_contain(hash);
        if maybe {
            self.index.prefetch_candidates(pk);
        }
        maybe
    }

    /// Step three: find the block and start loading it; `None` if no block can hold `key`.
    #[inline]
    pub fn batch_locate(&self, key: &[u8]) -> Result<Option<u32>, StateError> {
        let bi = self.find_block(key)?;
        Ok((bi < self.block_count()).then(|| {
            self.prefetch_block(bi);
            bi as u32
        }))
    }

    /// Last step: search block `bi` (from [`Self::batch_locate`]) for `key`.
    pub fn get_in_block(&self, key: &[u8], bi: usize) -> Result<Probe<'_>, StateError> {
        let blk = self.blk(bi)?;
        let i = self.lower_bound(&blk, key);
        if i == blk.count {
            return Ok(Probe::Absent);
        }
        let (k, v) = self.entry(&blk, i);
        Ok(if k == key {
            Probe::Found(v)
        } else {
            Probe::Absent
        })
    }

    /// Iterate entries with key >= `start`. A block that fails its check ends the iteration;
    /// the error is then in [`SegmentIter::take_error`].
    pub fn iter_from(&self, start: &[u8]) -> SegmentIter<'_> {
        let mut it = SegmentIter {
            seg: self,
            block: self.block_count(),
            ahead: 0,
            cur: None,
            idx: 0,
            failed: None,
        };
        let opened = self.seek(start).and_then(|(block, idx)| {
            let cur = if block < self.block_count() {
                Some(self.blk(block)?)
            } else {
                None
            };
            Ok((block, idx, cur))
        });
        match opened {
            Ok((block, idx, cur)) => {
                (it.block, it.idx, it.cur) = (block, idx, cur);
                it.ahead = cur.map_or(0, |b| b.payload);
            }
            Err(e) => it.failed = Some(e),
        }
        it
    }
}

/// A data block, as a lookup addresses it.
#[derive(Debug, Clone, Copy)]
struct Blk {
    /// File offset of the payload.
    payload: usize,
    count: u32,
    /// File offset of the entry offset table.
    table: usize,
}

/// Forward iteration over a segment.
#[derive(Debug)]
pub(crate) struct SegmentIter<'a> {
    seg: &'a Segment,
    block: usize,
    cur: Option<Blk>,
    idx: u32,
    /// File offset up to which the data has been prefetched (see [`SCAN_PREFETCH_BYTES`]).
    ahead: usize,
    /// The block check that ended the iteration, if one did. Kept aside rather than in the
    /// items: a compaction moves every entry through several iterators, and an item the size
    /// of an error made each of them slower.
    failed: Option<StateError>,
}

impl SegmentIter<'_> {
    /// Why the iteration ended early, if it did (a block failed its check).
    pub fn take_error(&mut self) -> Option<StateError> {
        self.failed.take()
    }
}

/// How far ahead of the current block a forward iteration prefetches the file's data. The
/// next entry's location is a chain of dependent loads (block header, entry table, entry);
/// a compaction reads several segments at once, more streams than the hardware prefetcher
/// follows, and each new 4 KiB page would otherwise start with a miss on each of them.
const SCAN_PREFETCH_BYTES: usize = 2048;
/// Lines prefetched per entry returned: more than an entry's bytes, so the distance builds
/// up, but little for a short scan.
const SCAN_PREFETCH_LINES: usize = 2;

impl<'a> Iterator for SegmentIter<'a> {
    type Item = (&'a [u8], ValueRef<'a>);
    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let blk = self.cur?;
            if self.idx < blk.count {
                let b: &[u8] = &self.seg.map;
                for _ in 0..SCAN_PREFETCH_LINES {
                    if self.ahead >= blk.payload + SCAN_PREFETCH_BYTES {
                        break;
                    }
                    if let Some(rest) = b.get(self.ahead..) {
                        prefetch(rest);
                    }
                    self.ahead += 64;
                }
                let out = self.seg.entry(&blk, self.idx);
                self.idx += 1;
                return Some(out);
            }
            self.block += 1;
            self.idx = 0;
            self.cur = None;
            if self.block < self.seg.block_count() {
                match self.seg.blk(self.block) {
                    Ok(b) => self.cur = Some(b),
                    Err(e) => {
                        self.failed = Some(e);
                        return None;
                    }
                }
            }
        }
    }
}

/// Bytes a [`SegmentStream`] reads at a time (more for a block that is larger).
const STREAM_WINDOW_BYTES: usize = 256 << 10;

/// A segment's entries front to back, read from its file into a buffer of the stream's own,
/// reused from read to read (direct reads where the file system has them, see
/// [`Fs::open_direct`]): for a compaction, which reads each input once. Through the map every
/// page would come from the device into a fresh page-cache page, and the first touch of one
/// costs microseconds on this VM (PLATFORM.md): 26% of the maintenance thread in the updates
/// benchmark was that stall.
///
/// Each block's header and CRC are checked in the buffer, as read (the map's check bits speak
/// for the map's bytes and are left alone); entry offsets are bounds-checked against their
/// block, so a block that lies about them is an error, not a panic. An entry is borrowed from
/// the buffer until the next call ([`Self::next_entry`] lends it).
///
/// The next window is read ahead into a second buffer ([`FsFile::read_ahead`]) while the
/// merge works through the current one. Without it each read's wait was added to the
/// compaction: the updates bench's final drain took 0.79-0.90 s against 0.50-0.54 s with it.
pub(crate) struct SegmentStream {
    seg: Arc<Segment>,
    file: Box<dyn FsFile>,
    buf: ZeroedBuf<u8>,
    /// The second window buffer, when no read ahead holds it.
    spare: Option<ZeroedBuf<u8>>,
    /// File offset of the window being read ahead, and the read if it finished at once.
    ahead_at: Option<usize>,
    ready: Option<ReadAhead>,
    /// Windows that came from a read ahead (for tests).
    ahead_used: usize,
    /// File offset of `buf[0]` (a multiple of [`weir_io::DIRECT_ALIGN`]) and the valid bytes
    /// from there.
    win_off: usize,
    win_len: usize,
    /// The next block to load.
    next_block: usize,
    /// The current block's payload, as offsets into `buf`: start, entry count, table start,
    /// end.
    cur: Option<(usize, u32, usize, usize)>,
    idx: u32,
    failed: Option<StateError>,
}

impl std::fmt::Debug for SegmentStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SegmentStream")
            .field("segment", &self.seg.path)
            .field("next_block", &self.next_block)
            .finish_non_exhaustive()
    }
}

impl SegmentStream {
    /// Open `seg`'s file through `fs` for a front-to-back read.
    pub fn new(fs: &dyn Fs, seg: Arc<Segment>) -> Result<SegmentStream, StateError> {
        let file = fs.open_direct(&seg.path)?;
        Ok(SegmentStream {
            seg,
            file,
            buf: ZeroedBuf::new(STREAM_WINDOW_BYTES),
            spare: None,
            ahead_at: None,
            ready: None,
            ahead_used: 0,
            win_off: 0,
            win_len: 0,
            next_block: 0,
            cur: None,
            idx: 0,
            failed: None,
        })
    }

    /// Why the stream ended early, if it did (a read failed, or a block failed its check).
    pub fn take_error(&mut self) -> Option<StateError> {
        self.failed.take()
    }

    /// The next entry, or `None` at the end or after an error ([`Self::take_error`]).
    #[inline]
    pub fn next_entry(&mut self) -> Option<(&[u8], ValueRef<'_>)> {
        loop {
            if let Some((payload, _, table, end)) = self.cur.filter(|c| self.idx < c.1) {
                let i = self.idx;
                self.idx += 1;
                match entry_in(&self.buf[..end], payload, table, i) {
                    Some((k, klen, v, vlen, expire_at_ms, tombstone)) => {
                        let b: &[u8] = &self.buf;
                        return Some((
                            &b[k..k + klen],
                            ValueRef::new(&b[v..v + vlen], expire_at_ms, tombstone),
                        ));
                    }
                    None => {
                        let at = self.win_off + payload;
                        self.fail(malformed(
                            &self.seg.path,
                            at,
                            "entry outside its data block",
                        ));
                        return None;
                    }
                }
            }
            self.cur = None;
            if self.next_block >= self.seg.block_count() {
                return None;
            }
            match self.load(self.next_block) {
                Ok(c) => {
                    self.cur = Some(c);
                    self.idx = 0;
                    self.next_block += 1;
                }
                Err(e) => {
                    self.fail(e);
                    return None;
                }
            }
        }
    }

    fn fail(&mut self, e: StateError) {
        self.failed = Some(e);
        self.cur = None;
        self.next_block = usize::MAX;
    }

    /// Bring block `bi` into the buffer and check it; its payload as offsets into `buf`.
    #[cold]
    fn load(&mut self, bi: usize) -> Result<(usize, u32, usize, usize), StateError> {
        let seg = Arc::clone(&self.seg);
        let (start, payload, end) = seg.block_span(bi);
        if !(start < payload && payload <= end && end as u64 <= seg.size_bytes) {
            return Err(malformed(&seg.path, start, "data block outside the file"));
        }
        if start < self.win_off || end > self.win_off + self.win_len {
            let align = weir_io::DIRECT_ALIGN;
            let off = start / align * align;
            let need = (end - off).div_ceil(align) * align;
            self.win_len = 0;
            let ahead = self.take_ahead()?;
            let n = match ahead {
                Some((buf, at, n)) if at == off && off + n >= end => {
                    self.spare = Some(std::mem::replace(&mut self.buf, buf));
                    self.ahead_used += 1;
                    n
                }
                other => {
                    if let Some((buf, _, _)) = other {
                        self.spare = Some(buf);
                    }
                    if need > self.buf.len() {
                        // A block larger than the window (a large value): a buffer that holds
                        // it.
                        self.buf = ZeroedBuf::new(need);
                    }
                    self.file.read_upto(off as u64, &mut self.buf)?
                }
            };
            self.win_off = off;
            self.win_len = n;
            self.read_ahead_after(bi)?;
            if off + n < end {
                return Err(StateError::Format(FormatError::Truncated {
                    file: seg.path.clone(),
                    offset: (off + n) as u64,
                    needed: (end - off - n) as u64,
                    available: 0,
                }));
            }
        }
        let (s, e) = (start - self.win_off, end - self.win_off);
        let body = decode_block(
            &seg.path,
            &self.buf[s..e],
            start as u64,
            BlockHeader {
                file_id: seg.id,
                block_index: bi as u32,
                kind: KIND_DATA,
                payload_len: (end - payload) as u32,
            },
        )?;
        let p = s + BLOCK_HEADER_LEN;
        let (count, table) = match (le_u32(body, 0), le_u32(body, 4)) {
            (Some(c), Some(t)) => (c, t as usize),
            _ => return Err(malformed(&seg.path, payload, "data block header")),
        };
        if (table as u64 + 4 * u64::from(count)) > body.len() as u64 {
            return Err(malformed(
                &seg.path,
                payload,
                "entry table outside its block",
            ));
        }
        Ok((p, count, p + table, p + body.len()))
    }
}

impl SegmentStream {
    /// The window read ahead, if one was started: buffer, file offset, bytes.
    fn take_ahead(&mut self) -> Result<Option<(ZeroedBuf<u8>, usize, usize)>, StateError> {
        if self.ahead_at.take().is_none() {
            return Ok(None);
        }
        let r = match self.ready.take() {
            Some(r) => Some(r),
            None => self.file.wait_ahead()?,
        };
        Ok(r.and_then(|r| {
            let (at, n) = (r.offset as usize, r.len);
            r.buf
                .into_any()
                .downcast::<ZeroedBuf<u8>>()
                .ok()
                .map(|b| (*b, at, n))
        }))
    }

    /// Start reading the window that holds the first block after `bi` which the current
    /// window does not hold whole.
    fn read_ahead_after(&mut self, bi: usize) -> Result<(), StateError> {
        let seg = &*self.seg;
        let count = seg.block_count();
        let win_end = self.win_off + self.win_len;
        // Block ends ascend: the first one past the window.
        let (mut lo, mut hi) = (bi, count);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if seg.block_end(mid) > win_end {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        if lo >= count {
            return Ok(());
        }
        let (start, _, end) = seg.block_span(lo);
        let align = weir_io::DIRECT_ALIGN;
        let off = start / align * align;
        if off >= seg.data_end || end.saturating_sub(off) > STREAM_WINDOW_BYTES {
            // Past the data, or a block larger than a window: read when needed.
            return Ok(());
        }
        let buf = self
            .spare
            .take()
            .filter(|b| b.len() == STREAM_WINDOW_BYTES)
            .unwrap_or_else(|| ZeroedBuf::new(STREAM_WINDOW_BYTES));
        self.ready = self.file.read_ahead(off as u64, Box::new(buf))?;
        self.ahead_at = Some(off);
        Ok(())
    }
}

// SAFETY: a `ZeroedBuf`'s memory is a mapping or a heap allocation of its own, which moving
// the value does not move; `deref_mut` returns that same memory every time, and nothing else
// reaches it while the value is owned by a read.
unsafe impl weir_io::ReadBuf for ZeroedBuf<u8> {
    fn bytes_mut(&mut self) -> &mut [u8] {
        self
    }
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
        self
    }
}

#[inline]
fn le_u16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

#[inline]
fn le_u32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

#[inline]
fn le_u64(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

/// Entry `i` of the block whose payload starts at `payload` and whose entry table starts at
/// `table` in `b` (which ends where the block does): key start and length, value start and
/// length, expiry, tombstone. `None` if any part lies outside `b`.
#[inline]
fn entry_in(
    b: &[u8],
    payload: usize,
    table: usize,
    i: u32,
) -> Option<(usize, usize, usize, usize, u64, bool)> {
    let e = payload + le_u32(b, table + 4 * i as usize)? as usize;
    let klen = usize::from(le_u16(b, e + E_KEY_LEN)?);
    let vlen = le_u32(b, e + E_VAL_LEN)? as usize;
    let expire = le_u64(b, e + E_EXPIRE_AT_MS)?;
    let flags = *b.get(e + E_FLAGS)?;
    let k = e + ENTRY_HEADER_LEN;
    // `b` starts at a multiple of the alignment in the file, so offsets into it align alike.
    let v = (k + klen).div_ceil(VALUE_ALIGN) * VALUE_ALIGN;
    if v.checked_add(vlen)? > b.len() {
        return None;
    }
    Some((k, klen, v, vlen, expire, flags & FLAG_TOMBSTONE != 0))
}

fn check_version_algo(
    p: &Path,
    b: &[u8],
    ver_at: usize,
    algo_at: usize,
    base: usize,
) -> Result<(), StateError> {
    let v = rd_u16(b, ver_at);
    if v != FORMAT_VERSION {
        return Err(FormatError::UnsupportedVersion {
            file: p.to_owned(),
            offset: (base + ver_at) as u64,
            found: v,
            supported: FORMAT_VERSION,
        }
        .into());
    }
    if b[algo_at] != CHECKSUM_CRC32_IEEE {
        return Err(FormatError::UnsupportedChecksum {
            file: p.to_owned(),
            offset: (base + algo_at) as u64,
            found: b[algo_at],
        }
        .into());
    }
    Ok(())
}

fn check_crc(p: &Path, region: &[u8], crc_at: usize, base: usize) -> Result<(), StateError> {
    let expected = rd_u32(region, crc_at);
    let actual = weir_io::crc32(&[&region[..crc_at]]);
    if expected != actual {
        return Err(FormatError::ChecksumMismatch {
            file: p.to_owned(),
            offset: base as u64,
            expected,
            actual,
        }
        .into());
    }
    Ok(())
}

fn misdirected(
    p: &Path,
    at: usize,
    field: &'static str,
    want: u64,
    got: u64,
) -> Result<(), StateError> {
    if want != got {
        return Err(FormatError::Misdirected {
            file: p.to_owned(),
            offset: at as u64,
            field,
            expected: want,
            found: got,
        }
        .into());
    }
    Ok(())
}

/// Check a data block's structure. `po` is the payload's file offset; `file` the whole map.
/// Advances `prev_key` (file range of the previous key) and checks strict key order. Every
/// key must pass the segment's bloom filter (`bloom`; `hashes` is scratch space): a filter
/// that disagrees with the keys (a key or the filter changed and the CRCs written again)
/// would make point reads miss keys that scans return.
fn verify_data_block(
    p: &Path,
    file: &[u8],
    po: usize,
    payload: &[u8],
    prev_key: &mut Option<(usize, usize)>,
    (bloom, hashes): (&Bloom, &mut Vec<(u64, usize)>),
) -> Result<BlockInfo, StateError> {
    if payload.len() < DATA_HEADER_LEN {
        return Err(malformed(p, po, "data block header truncated"));
    }
    let count = rd_u32(payload, 0);
    let table = rd_u32(payload, 4) as usize;
    if count == 0 || table < DATA_HEADER_LEN || table + 4 * count as usize > payload.len() {
        return Err(malformed(p, po, "data block entry table out of range"));
    }
    let mut prev_end = DATA_HEADER_LEN;
    for i in 0..count as usize {
        let e = rd_u32(payload, table + 4 * i) as usize;
        if e != prev_end || e + ENTRY_HEADER_LEN > table {
            return Err(malformed(p, po + table + 4 * i, "entry offset invalid"));
        }
        let klen = usize::from(rd_u16(payload, e + E_KEY_LEN));
        let vlen = rd_u32(payload, e + E_VAL_LEN) as usize;
        let k = e + ENTRY_HEADER_LEN;
        let v_abs = (po + k + klen).div_ceil(VALUE_ALIGN) * VALUE_ALIGN;
        let v = v_abs - po;
        if klen < 2 || v.checked_add(vlen).is_none_or(|end| end > table) {
            return Err(malformed(p, po + e, "entry key/value out of range"));
        }
        if payload[e + E_FLAGS] & !FLAG_TOMBSTONE != 0 || payload[e + 3] != 0 {
            return Err(malformed(p, po + e + E_FLAGS, "unknown entry flags"));
        }
        let key = &payload[k..k + klen];
        if let Some((pk, pl)) = *prev_key {
            if key <= &file[pk..pk + pl] {
                return Err(malformed(p, po + k, "keys not strictly ascending"));
            }
        }
        *prev_key = Some((po + k, klen));
        prev_end = v + vlen;
        // Tested after the loop, so that the filter lines of a block's keys load together.
        let h = xxh3_64(key);
        bloom.prefetch(h);
        hashes.push((h, po + k));
    }
    for (h, at) in hashes.drain(..) {
        if !bloom.may_contain(h) {
            return Err(malformed(
                p,
                at,
                "key absent from the segment's bloom filter",
            ));
        }
    }
    if prev_end != table {
        return Err(malformed(
            p,
            po + table,
            "entry table does not follow the entries",
        ));
    }
    Ok(BlockInfo {
        payload: po,
        count,
        table: po + table,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memtable::NO_EXPIRY;
    use weir_io::StdFs;

    /// The fixture of `docs/segment-format.md`: two entries, one a tombstone.
    fn write_fixture(dir: &Path) -> PathBuf {
        let p = dir.join("fixture.wseg");
        let mut w = SegmentWriter::create(&StdFs, &p, 1, opts(4096, None)).unwrap();
        let forty_two = 42u64.to_le_bytes();
        let v = ValueRef::new(&forty_two, NO_EXPIRY, false);
        w.add(&[0, 5, 0, 1, 0, 0, 0, 1, b'a'], v).unwrap();
        let t = ValueRef::new(&[], NO_EXPIRY, true);
        w.add(&[0, 5, 0, 1, 0, 0, 0, 1, b'b'], t).unwrap();
        w.finish().unwrap();
        p
    }

    /// Writer options with 10 bloom bits per key.
    fn opts(block_target_bytes: usize, expected_keys: Option<u64>) -> WriterOptions {
        WriterOptions {
            block_target_bytes,
            bloom_bits_per_key: 10,
            expected_keys,
        }
    }

    /// Write buffers come from the scratch pool with whatever an earlier user left in them:
    /// none of it may reach the file. Filled with garbage first, the pool's mappings still
    /// give the document's fixture byte for byte.
    #[test]
    fn a_writer_on_used_scratch_buffers_writes_the_same_bytes() {
        // The pool is the process's: a test on another thread may take the garbage buffers
        // first. Tries until this writer got a used one, checking the bytes every time.
        let mut reused = false;
        for _ in 0..20 {
            let dir = tempfile::tempdir().unwrap();
            for _ in 0..2 {
                let mut b = crate::hugemem::ZeroedBuf::<u8>::new(
                    WRITE_BUFFER_BYTES + 2 * 4096 + crate::hugemem::HUGE_PAGE_BYTES,
                );
                b.fill(0xA5);
                b.recycle();
            }
            let before = crate::hugemem::TAKEN_DIRTY.with(|c| c.get());
            let p = write_fixture(dir.path());
            assert_eq!(std::fs::read(&p).unwrap(), doc_fixture());
            if crate::hugemem::TAKEN_DIRTY.with(|c| c.get()) > before {
                reused = true;
                break;
            }
        }
        assert!(reused, "the writer never got a used buffer from the pool");
    }

    fn doc_fixture() -> Vec<u8> {
        let doc = include_str!("../../docs/segment-format.md");
        let start = doc.find("<!-- fixture-begin -->").expect("fixture marker");
        let end = doc.find("<!-- fixture-end -->").expect("fixture marker");
        let mut out = Vec::new();
        for line in doc[start..end].lines().filter(|l| l.starts_with("0x")) {
            // "0x0000: 57 45 ..." -- address, then hex bytes.
            let bytes = line.split(':').nth(1).unwrap_or("");
            for h in bytes.split_whitespace() {
                out.push(u8::from_str_radix(h, 16).expect("hex byte"));
            }
        }
        out
    }

    #[test]
    fn doc_fixture_decodes_and_matches_the_writer() {
        let dir = tempfile::tempdir().unwrap();
        let written = std::fs::read(write_fixture(dir.path())).unwrap();
        let fixture = doc_fixture();
        if std::env::var_os("WEIR_PRINT_FIXTURE").is_some() {
            for (i, c) in written.chunks(16).enumerate() {
                let hex: Vec<String> = c.iter().map(|b| format!("{b:02x}")).collect();
                println!("0x{:04x}: {}", i * 16, hex.join(" "));
            }
        }
        assert_eq!(fixture, written, "docs/segment-format.md fixture is stale");
        let p = dir.path().join("from-doc.wseg");
        std::fs::write(&p, &fixture).unwrap();
        let seg = Segment::open(Arc::new(StdFs), &p, Some(1), false).unwrap();
        assert_eq!(seg.entry_count, 2);
        assert_eq!(seg.key_groups, Some(KeyGroupRange::new(5, 5)));
        let b: &[u8] = &fixture;
        // Offsets stated in the doc, checked through the layout constants.
        assert_eq!(&b[FH_MAGIC..FH_MAGIC + 8], b"WEIRSEG\0");
        let fo = b.len() - FOOTER_LEN;
        assert_eq!(&b[fo..fo + 4], b"WSGF");
        assert_eq!(rd_u64(b, fo + F_INDEX_OFFSET), 0xa0);
        assert_eq!(rd_u64(b, fo + F_FILTER_OFFSET), 0xe0);
        let key = [0, 5, 0, 1, 0, 0, 0, 1, b'a'];
        match seg.get(&key, xxh3_64(&key)).unwrap() {
            Probe::Found(v) => {
                assert_eq!(v.bytes, &42u64.to_le_bytes());
                // Values are 16-aligned in the file, so in the map.
                assert_eq!(v.bytes.as_ptr() as usize % VALUE_ALIGN, 0);
            }
            other => panic!("{other:?}"),
        }
        let key_b = [0, 5, 0, 1, 0, 0, 0, 1, b'b'];
        assert!(matches!(
            seg.get(&key_b, xxh3_64(&key_b)).unwrap(),
            Probe::Found(v) if v.tombstone()
        ));
        let absent = [0, 5, 0, 1, 0, 0, 0, 1, b'c'];
        assert!(!matches!(
            seg.get(&absent, xxh3_64(&absent)).unwrap(),
            Probe::Found(_)
        ));
    }

    /// Small entries: every data block lies within one 4 KiB page of the file (the writer pads
    /// a block to the page end rather than cross it), and such a file, written in several
    /// aligned pieces, passes the full verification and reads back every key.
    #[test]
    fn data_blocks_stay_within_pages() {
        // Over 2 write buffers, so that blocks straddle the buffer's aligned writes.
        const N: u64 = 160_000;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("pages.wseg");
        let opts = opts(1500, Some(N));
        let key = |i: u64| {
            let mut k = vec![0u8, 1, 0, 1];
            k.extend_from_slice(&(i * 3).to_be_bytes());
            k
        };
        let mut w = SegmentWriter::create(&StdFs, &p, 3, opts).unwrap();
        for i in 0..N {
            // Values of varying length so entries do not tile pages evenly.
            let v = vec![i as u8; (i % 40) as usize];
            let vr = ValueRef::new(&v, NO_EXPIRY, false);
            w.add(&key(i), vr).unwrap();
        }
        let written = w.finish().unwrap();
        assert!(written.size_bytes > 2 * WRITE_BUFFER_BYTES as u64);
        let seg = Segment::open(Arc::new(StdFs), &p, Some(3), false).unwrap();
        assert!(seg.block_count() > 200);
        for bi in 0..seg.block_count() {
            let start = seg.index.offset(bi) as usize - BLOCK_HEADER_LEN;
            let end = if bi + 1 < seg.block_count() {
                seg.index.offset(bi + 1) as usize - BLOCK_HEADER_LEN
            } else {
                seg.data_end
            };
            assert_eq!(
                start / PAGE_BYTES,
                (end - 1) / PAGE_BYTES,
                "block {bi} crosses a page"
            );
        }
        for i in 0..N {
            let k = key(i);
            match seg.get(&k, xxh3_64(&k)).unwrap() {
                Probe::Found(v) => assert_eq!(v.bytes, &vec![i as u8; (i % 40) as usize][..]),
                other => panic!("{i}: {other:?}"),
            }
        }
        assert_eq!(seg.iter_from(&[]).count() as u64, N);
    }

    /// Keys of every length from 2 to 40 bytes, many sharing their first 16 bytes (ordered only
    /// by the bytes after them), and values of 0 to 40 bytes read back exactly, across many
    /// small blocks; a key that is not above the previous one is refused, within a block and
    /// as the first key of the next (when the previous key is no longer in the open block).
    #[test]
    fn keys_and_values_of_every_small_length_read_back_and_order_is_enforced() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("lengths.wseg");
        let opts = opts(256, None);
        // A shared 16-byte stem, then a big-endian counter and a tail that varies the length.
        let key = |i: u32| {
            let mut k = vec![0u8, 7];
            k.extend_from_slice(&[0xAB; 14]);
            k.extend_from_slice(&i.to_be_bytes());
            k.extend(std::iter::repeat_n(i as u8, (i % 21) as usize));
            k
        };
        let mut entries: Vec<(Vec<u8>, Vec<u8>)> = (0..2_000u32)
            .map(|i| (key(i), vec![(i * 7) as u8; (i % 41) as usize]))
            .collect();
        // Short keys too: 2..16 bytes, each of its own length and below the stem.
        for n in 2..16usize {
            let mut k = vec![0u8, 7];
            k.extend(std::iter::repeat_n(n as u8, n - 2));
            entries.push((k, vec![n as u8; n]));
        }
        entries.sort();
        let mut w = SegmentWriter::create(&StdFs, &p, 9, opts).unwrap();
        for (k, v) in &entries {
            w.add(k, ValueRef::new(v, NO_EXPIRY, false)).unwrap();
        }
        w.finish().unwrap();
        let seg = Segment::open(Arc::new(StdFs), &p, Some(9), false).unwrap();
        assert!(seg.block_count() > 50);
        let read: Vec<(Vec<u8>, Vec<u8>)> = seg
            .iter_from(&[])
            .map(|(k, v)| (k.to_vec(), v.bytes.to_vec()))
            .collect();
        assert_eq!(read, entries);

        // Out of order: a repeat of the previous key, right after it and as the first key of
        // a new block.
        let refused = |at_block_start: bool| {
            let p = dir.path().join(format!("order-{at_block_start}.wseg"));
            let mut w = SegmentWriter::create(&StdFs, &p, 10, opts).unwrap();
            let big = vec![1u8; 300];
            let (k1, k2) = (key(1), key(2));
            w.add(&k1, ValueRef::new(&[], NO_EXPIRY, false)).unwrap();
            let v2 = if at_block_start { &big[..] } else { &[][..] };
            w.add(&k2, ValueRef::new(v2, NO_EXPIRY, false)).unwrap();
            // The big value filled the block, so it was finished after `k2`.
            assert_eq!(w.block_start.is_none(), at_block_start);
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                w.add(&k2, ValueRef::new(&[], NO_EXPIRY, false))
            }))
            .is_err()
        };
        assert!(refused(false));
        assert!(refused(true));
    }

    /// io_uring, or `None` where it is unavailable and `WEIR_ALLOW_NO_URING` is set: without
    /// the variable the io_uring tests fail rather than pass having checked nothing.
    fn uring_or_skip() -> Option<weir_io::UringFs> {
        match weir_io::UringFs::new() {
            Ok(u) => Some(u),
            Err(e) => {
                assert!(
                    std::env::var_os("WEIR_ALLOW_NO_URING").is_some(),
                    "{e} (set WEIR_ALLOW_NO_URING=1 to skip the io_uring tests)"
                );
                eprintln!("skipping: {e}");
                None
            }
        }
    }

    /// A stream yields exactly what the map's iterator does, across windows and past a block
    /// larger than its window, through io_uring's direct reads and plain ones; a changed byte
    /// ends it with the block's offset.
    #[test]
    fn a_stream_reads_what_the_map_iterates() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("stream.wseg");
        let opts = opts(1024, Some(50_000));
        let mut w = SegmentWriter::create(&StdFs, &p, 5, opts).unwrap();
        for i in 0..50_000u32 {
            let mut k = vec![0u8, 2];
            k.extend_from_slice(&i.to_be_bytes());
            let len = if i == 30_000 {
                STREAM_WINDOW_BYTES + 12_345
            } else {
                (i % 50) as usize
            };
            let v = vec![i as u8; len];
            let vr = ValueRef::new(&v, if i % 7 == 0 { 99 } else { NO_EXPIRY }, i % 11 == 0);
            w.add(&k, vr).unwrap();
        }
        w.finish().unwrap();
        let mut fss: Vec<Arc<dyn Fs>> = vec![Arc::new(StdFs)];
        if let Some(u) = uring_or_skip() {
            fss.push(Arc::new(u));
        }
        for fs in &fss {
            let seg = Arc::new(Segment::open(fs.clone(), &p, Some(5), false).unwrap());
            let want: Vec<(Vec<u8>, Vec<u8>, u64, bool)> = seg
                .iter_from(&[])
                .map(|(k, v)| (k.to_vec(), v.bytes.to_vec(), v.expire_at_ms, v.tombstone()))
                .collect();
            assert_eq!(want.len(), 50_000);
            let mut st = SegmentStream::new(&**fs, seg.clone()).unwrap();
            let mut got = Vec::new();
            while let Some((k, v)) = st.next_entry() {
                got.push((k.to_vec(), v.bytes.to_vec(), v.expire_at_ms, v.tombstone()));
            }
            assert!(st.take_error().is_none());
            assert!(
                st.ahead_used >= 3,
                "{fs:?}: windows read ahead: {}",
                st.ahead_used
            );
            assert_eq!(got.len(), want.len(), "{fs:?}");
            assert!(got == want, "{fs:?}: the stream differs from the map");
        }
        // A byte of a block in the second window changes on disk.
        let seg = Arc::new(Segment::open(Arc::new(StdFs), &p, Some(5), false).unwrap());
        let bi = (0..seg.block_count())
            .find(|&b| seg.index.offset(b) as usize > STREAM_WINDOW_BYTES + 4096)
            .unwrap();
        let at = seg.index.offset(bi) + 20;
        weir_io::FaultyFs::flip_bit(&p, at, 3).unwrap();
        for fs in &fss {
            let mut st = SegmentStream::new(&**fs, seg.clone()).unwrap();
            let mut n = 0usize;
            while st.next_entry().is_some() {
                n += 1;
            }
            let e = st.take_error().expect("the changed block fails");
            let start = seg.index.offset(bi) - BLOCK_HEADER_LEN as u64;
            assert!(
                matches!(
                    &e,
                    StateError::Format(FormatError::ChecksumMismatch { offset, .. })
                        if *offset == start
                ),
                "{e}"
            );
            assert!(n > 0 && n < 50_000);
            assert!(st.next_entry().is_none(), "an ended stream stays ended");
        }
    }

    /// A segment of several write pieces, written behind through io_uring, is byte for byte
    /// the one written with plain writes, and verifies when opened.
    #[test]
    fn a_segment_written_behind_through_io_uring_equals_one_written_in_place() {
        let Some(uring) = uring_or_skip() else { return };
        let uring: Arc<dyn Fs> = Arc::new(uring);
        let dir = tempfile::tempdir().unwrap();
        let value = [0x3cu8; 1000];
        let n = 20_000u32; // about 11 MB: five pieces and a tail
        let mut files = Vec::new();
        for (name, fs) in [("std", Arc::new(StdFs) as Arc<dyn Fs>), ("uring", uring)] {
            let p = dir.path().join(format!("{name}.wseg"));
            let opts = opts(1024, Some(u64::from(n)));
            let mut w = SegmentWriter::create(&*fs, &p, 11, opts).unwrap();
            for i in 0..n {
                let mut k = vec![0u8, 5, 0, 1];
                k.extend_from_slice(&i.to_be_bytes());
                let vr = ValueRef::new(&value[..(i as usize % 1000) + 1], NO_EXPIRY, false);
                w.add(&k, vr).unwrap();
            }
            let written = w.finish().unwrap();
            assert!(written.size_bytes > 4 * WRITE_BUFFER_BYTES as u64);
            let seg = Segment::open_written(fs.clone(), written).unwrap();
            seg.keep_file();
            drop(seg);
            // Full verification of every block, index, filter and footer.
            let full = Segment::open(fs, &p, Some(11), false).unwrap();
            full.keep_file();
            assert_eq!(full.entry_count, u64::from(n));
            files.push(std::fs::read(&p).unwrap());
        }
        assert!(
            files[0] == files[1],
            "the two writers wrote different bytes"
        );
    }

    /// `diagnose_segment` names the block a changed byte is in, whichever part of the file it
    /// is (data block, index, filter, footer), and nothing for an intact segment, a file that
    /// is not a segment, or a segment whose magic is what changed.
    #[test]
    fn diagnose_names_the_block_a_changed_byte_is_in() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("d.wseg");
        let opts = opts(128, Some(2000));
        let mut w = SegmentWriter::create(&StdFs, &p, 9, opts).unwrap();
        for i in 0..2000u32 {
            let mut k = vec![0u8, 1, 0, 1];
            k.extend_from_slice(&i.to_be_bytes());
            w.add(&k, ValueRef::new(&i.to_le_bytes(), NO_EXPIRY, false))
                .unwrap();
        }
        w.finish().unwrap();
        assert_eq!(diagnose_segment(&StdFs, &p), None);
        let good = std::fs::read(&p).unwrap();
        // Where each block starts: walk the headers (each names its payload length).
        let mut starts = Vec::new();
        let mut at = FILE_HEADER_LEN;
        while at + FOOTER_LEN < good.len() {
            starts.push(at);
            at += BLOCK_HEADER_LEN + rd_u32(&good, at + 16) as usize;
        }
        assert_eq!(at + FOOTER_LEN, good.len());
        assert!(starts.len() > 100);
        let len = good.len();
        for flip in [
            FILE_HEADER_LEN + 3,
            len / 3,
            len / 2 + 5,
            len - FOOTER_LEN - 9,
        ] {
            let mut b = good.clone();
            b[flip] ^= 0x10;
            std::fs::write(&p, &b).unwrap();
            let block = *starts.iter().rev().find(|&&s| s <= flip).unwrap();
            match diagnose_segment(&StdFs, &p) {
                Some(FormatError::ChecksumMismatch { file, offset, .. }) => {
                    assert_eq!((file, offset), (p.clone(), block as u64), "flip at {flip}")
                }
                other => panic!("flip at {flip}: {other:?}"),
            }
        }
        // The footer's own CRC.
        let mut b = good.clone();
        b[len - 10] ^= 0x10;
        std::fs::write(&p, &b).unwrap();
        assert!(matches!(diagnose_segment(&StdFs, &p),
                Some(FormatError::ChecksumMismatch { offset, .. }) if offset == (len - FOOTER_LEN) as u64));
        let mut b = good.clone();
        b[2] ^= 0x10;
        std::fs::write(&p, &b).unwrap();
        assert_eq!(diagnose_segment(&StdFs, &p), None, "magic changed");
        std::fs::write(&p, b"not a segment at all, but long enough to map").unwrap();
        assert_eq!(diagnose_segment(&StdFs, &p), None);
        std::fs::remove_file(&p).unwrap();
        assert_eq!(diagnose_segment(&StdFs, &p), None, "missing");
    }

    /// Keys sharing their first 16 bytes across many small blocks: the prefix index must fall
    /// back to full keys on ties. The writer-described open must agree with the full
    /// verification, and a byte changed after writing must be caught by it.
    /// Footer flags changed with the footer's CRC written again: the empty flag on a segment
    /// with entries (opened as one without key groups, which a restore skips) and unknown
    /// bits are errors at the flags' offset; the intact file opens.
    #[test]
    fn forged_footer_flags_are_errors_at_their_offset() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f.wseg");
        let opts = opts(256, None);
        let mut w = SegmentWriter::create(&StdFs, &p, 3, opts).unwrap();
        for i in 0..20u32 {
            let mut k = vec![0u8, 2, 0, 1];
            k.extend_from_slice(&i.to_be_bytes());
            w.add(&k, ValueRef::new(&[1; 16], NO_EXPIRY, false))
                .unwrap();
        }
        w.finish().unwrap();
        let good = std::fs::read(&p).unwrap();
        let fs: Arc<dyn Fs> = Arc::new(StdFs);
        assert!(Segment::open(fs.clone(), &p, Some(3), false).is_ok());
        let fo = good.len() - FOOTER_LEN;
        for flags in [FOOTER_FLAG_EMPTY, 0x10, 0x80 | FOOTER_FLAG_EMPTY] {
            let mut b = good.clone();
            b[fo + F_FLAGS] = flags;
            let crc = weir_io::crc32(&[&b[fo..fo + F_CRC]]);
            b[fo + F_CRC..fo + F_CRC + 4].copy_from_slice(&crc.to_le_bytes());
            std::fs::write(&p, &b).unwrap();
            match Segment::open(fs.clone(), &p, Some(3), false) {
                Err(StateError::Format(FormatError::Malformed { offset, .. })) => {
                    assert_eq!(offset, (fo + F_FLAGS) as u64, "flags {flags:#x}")
                }
                other => panic!("flags {flags:#x}: {other:?}"),
            }
        }
    }

    /// The writer's whole-file CRC (what checkpoints name a segment file by) is the CRC of the
    /// bytes on disk: across 2 MiB pieces (a block's tail moves to the next piece), and with a
    /// filter too large for the buffer (written from where it is).
    #[test]
    fn the_file_crc_is_the_crc_of_the_bytes_written() {
        let dir = tempfile::tempdir().unwrap();
        for (expected, entries) in [(None, 90_000u32), (Some(4_000_000), 90_000)] {
            let p = dir.path().join(format!("s{}.wseg", expected.is_some()));
            let opts = opts(1000, expected);
            let mut w = SegmentWriter::create(&StdFs, &p, 7, opts).unwrap();
            for i in 0..entries {
                let mut k = vec![0u8, 3];
                k.extend_from_slice(&i.to_be_bytes());
                let v = [i as u8; 48];
                w.add(&k, ValueRef::new(&v, NO_EXPIRY, false)).unwrap();
            }
            let written = w.finish().unwrap();
            let bytes = std::fs::read(&p).unwrap();
            assert!(bytes.len() > 3 * WRITE_BUFFER_BYTES, "{}", bytes.len());
            assert_eq!(written.size_bytes, bytes.len() as u64);
            assert_eq!(written.crc32, crc32fast::hash(&bytes), "{expected:?}");
        }
    }

    #[test]
    fn open_written_matches_full_verification_and_catches_changed_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let key = |i: u32| {
            let mut k = vec![0u8, 3, 0, 1];
            k.extend_from_slice(&[9u8; 14]); // 18-byte common prefix
            k.extend_from_slice(&(i * 2).to_be_bytes());
            k
        };
        for expected in [None, Some(5000)] {
            let p = dir.path().join(format!("s{}.wseg", expected.is_some()));
            let opts = opts(128, expected);
            let mut w = SegmentWriter::create(&StdFs, &p, 7, opts).unwrap();
            for i in 0..3000u32 {
                let v = i.to_le_bytes();
                let vr = ValueRef::new(&v, NO_EXPIRY, false);
                w.add(&key(i), vr).unwrap();
            }
            let written = w.finish().unwrap();
            let fs: Arc<dyn Fs> = Arc::new(StdFs);
            let full = Segment::open(fs.clone(), &p, Some(7), false).unwrap();
            let fast = Segment::open_written(fs.clone(), written.try_clone().unwrap()).unwrap();
            fast.keep_file();
            assert!(full.block_count() > 100);
            assert_eq!(
                (fast.entry_count, fast.crc32, fast.key_groups),
                (full.entry_count, full.crc32, full.key_groups)
            );
            for seg in [&full, &fast] {
                for i in 0..3000u32 {
                    let k = key(i);
                    match seg.get(&k, xxh3_64(&k)).unwrap() {
                        Probe::Found(v) => assert_eq!(v.bytes, &i.to_le_bytes()),
                        other => panic!("{i}: {other:?}"),
                    }
                    let absent = {
                        let mut a = key(i);
                        let n = a.len();
                        a[n - 1] += 1;
                        a
                    };
                    assert!(!matches!(
                        seg.get(&absent, xxh3_64(&absent)).unwrap(),
                        Probe::Found(_)
                    ));
                }
                let from: Vec<Vec<u8>> =
                    seg.iter_from(&key(1500)).map(|(k, _)| k.to_vec()).collect();
                assert_eq!(from.len(), 1500);
                assert_eq!(from[0], key(1500));
                let mut it = seg.iter_from(&[0, 4]);
                assert_eq!(it.by_ref().count(), 0);
                assert!(it.take_error().is_none());
                let mut it = seg.iter_from(&[]);
                assert_eq!(it.by_ref().count(), 3000);
                assert!(it.take_error().is_none());
            }
            let bad_block = 3;
            let bad_key = full.entry_key(&full.blk_checked(bad_block), 0).to_vec();
            drop((full, fast));
            // A byte that differs from what was written: the block's CRC catches it when a
            // read first touches the block, naming file and block offset; other blocks read.
            let at = written.offsets[bad_block] as usize + 5;
            let block_start = written.offsets[bad_block] - BLOCK_HEADER_LEN as u64;
            let mut bytes = std::fs::read(&p).unwrap();
            bytes[at] ^= 1;
            std::fs::remove_file(&p).unwrap();
            std::fs::write(&p, &bytes).unwrap();
            let fs: Arc<dyn Fs> = Arc::new(StdFs);
            let seg = Segment::open_written(fs, written).unwrap();
            seg.keep_file();
            let caught = |r: Result<(), StateError>| match r {
                Err(StateError::Format(FormatError::ChecksumMismatch { file, offset, .. })) => {
                    assert_eq!((file, offset), (p.clone(), block_start));
                }
                other => panic!("{other:?}"),
            };
            caught(seg.get(&bad_key, xxh3_64(&bad_key)).map(drop));
            // Every read path: the error each time, never the block's entries.
            caught(seg.get_in_block(&bad_key, bad_block).map(drop));
            let mut it = seg.iter_from(&bad_key);
            assert_eq!(it.by_ref().count(), 0);
            caught(it.take_error().map_or(Ok(()), Err));
            // A scan from the start yields the blocks before it, then ends with the error.
            let mut it = seg.iter_from(&[]);
            let before = it.by_ref().count();
            assert!(before > 0 && before < 3000, "{before}");
            caught(it.take_error().map_or(Ok(()), Err));
            // A block before it (these keys tie on their prefixes, so a lookup of a later key
            // compares last keys block by block from the first, and meets the bad one).
            match seg.get(&key(0), xxh3_64(&key(0))).unwrap() {
                Probe::Found(v) => assert_eq!(v.bytes, &0u32.to_le_bytes()),
                other => panic!("{other:?}"),
            }
        }
    }
}
