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
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use weir_io::{decode_block, encode_block, BlockHeader, FormatError, Fs, FsFile, Mapped};
use weir_io::{BLOCK_HEADER_LEN, CHECKSUM_CRC32_IEEE};
use xxhash_rust::xxh3::xxh3_64;

use crate::bloom::{self, Bloom};
use crate::error::StateError;
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

/// One in this many block prefixes forms the first level of the block search.
const TOP_STRIDE: usize = 32;

/// Writer buffer flushed to the file in pieces of at least this size.
const WRITE_BUFFER_BYTES: usize = 4 << 20;

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

/// Description of a written segment: what the writer computed, so that opening it needs no
/// second pass over its structure (see [`Segment::open_written`]).
#[derive(Debug, Clone)]
pub(crate) struct Written {
    pub path: PathBuf,
    pub id: u64,
    pub size_bytes: u64,
    pub crc32: u32,
    pub entry_count: u64,
    blocks: Vec<BlockInfo>,
    bloom: Bloom,
    key_groups: Option<KeyGroupRange>,
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
    buf: Vec<u8>,
    flushed: u64,
    file_crc: crc32fast::Hasher,
    /// Start of the open data block in `buf`, and its entry offsets (relative to payload).
    block_start: Option<usize>,
    entry_offsets: Vec<u32>,
    block_index: u32,
    index: Vec<u8>,
    /// Data blocks written so far; `last_key.0` is relative to the index payload until
    /// [`SegmentWriter::finish`] knows where the index lands.
    blocks: Vec<BlockInfo>,
    hashes: Vec<u64>,
    /// The filter built as keys arrive, when `expected_keys` was given.
    filter: Option<Vec<u8>>,
    entry_count: u64,
    last_key: Vec<u8>,
    last_prefix: u128,
    kg_first: Option<u16>,
}

impl SegmentWriter {
    pub fn create(
        fs: &dyn Fs,
        path: &Path,
        id: u64,
        opts: WriterOptions,
    ) -> Result<Self, StateError> {
        let file = fs.create(path)?;
        let mut buf = Vec::with_capacity(WRITE_BUFFER_BYTES + opts.block_target_bytes * 2);
        buf.extend_from_slice(&FILE_MAGIC);
        buf.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        buf.push(CHECKSUM_CRC32_IEEE);
        buf.extend_from_slice(&[0; 5]);
        buf.extend_from_slice(&id.to_le_bytes());
        buf.extend_from_slice(&[0; 4]);
        let crc = weir_io::crc32(&[&buf[..FH_CRC]]);
        buf.extend_from_slice(&crc.to_le_bytes());
        debug_assert_eq!(buf.len(), FILE_HEADER_LEN);
        let mut index = Vec::new();
        index.extend_from_slice(&[0; INDEX_HEADER_LEN]);
        Ok(SegmentWriter {
            file,
            path: path.to_owned(),
            id,
            opts,
            buf,
            flushed: 0,
            file_crc: crc32fast::Hasher::new(),
            block_start: None,
            entry_offsets: Vec::new(),
            block_index: 0,
            index,
            blocks: Vec::new(),
            hashes: Vec::new(),
            filter: opts
                .expected_keys
                .map(|n| bloom::empty(n.max(1), opts.bloom_bits_per_key)),
            entry_count: 0,
            last_key: Vec::new(),
            last_prefix: 0,
            kg_first: None,
        })
    }

    fn abs(&self) -> u64 {
        self.flushed + self.buf.len() as u64
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
                || (pk == self.last_prefix && key > self.last_key.as_slice()),
            "segment keys must be strictly ascending"
        );
        self.last_prefix = pk;
        if self.block_start.is_none() {
            self.block_start = Some(self.buf.len());
            self.buf
                .extend_from_slice(&[0; BLOCK_HEADER_LEN + DATA_HEADER_LEN]);
        }
        let Some(start) = self.block_start else {
            unreachable!()
        };
        let payload_start = start + BLOCK_HEADER_LEN;
        self.entry_offsets
            .push((self.buf.len() - payload_start) as u32);
        self.buf
            .extend_from_slice(&(key.len() as u16).to_le_bytes());
        self.buf.push(if v.tombstone { FLAG_TOMBSTONE } else { 0 });
        self.buf.push(0);
        self.buf
            .extend_from_slice(&(v.bytes.len() as u32).to_le_bytes());
        self.buf.extend_from_slice(&v.expire_at_ms.to_le_bytes());
        self.buf.extend_from_slice(key);
        let pad = (VALUE_ALIGN - (self.abs() as usize % VALUE_ALIGN)) % VALUE_ALIGN;
        self.buf.resize(self.buf.len() + pad, 0);
        self.buf.extend_from_slice(v.bytes);
        let h = xxh3_64(key);
        match &mut self.filter {
            Some(f) => bloom::insert(f, h),
            None => self.hashes.push(h),
        }
        if self.kg_first.is_none() {
            self.kg_first = Some(key_group_of(key));
        }
        self.entry_count += 1;
        self.last_key.clear();
        self.last_key.extend_from_slice(key);
        if self.buf.len() - start >= self.opts.block_target_bytes {
            self.finish_data_block()?;
        }
        Ok(())
    }

    /// Pad the open block's payload so the next block starts aligned, then fill its header.
    fn seal_block(&mut self, start: usize, block_index: u32, kind: u8) {
        let total = self.buf.len() - start;
        let pad = (BLOCK_ALIGN - total % BLOCK_ALIGN) % BLOCK_ALIGN;
        self.buf.resize(self.buf.len() + pad, 0);
        let payload_len = (self.buf.len() - start - BLOCK_HEADER_LEN) as u32;
        let (head, payload) = self.buf[start..].split_at_mut(BLOCK_HEADER_LEN);
        head[0..8].copy_from_slice(&self.id.to_le_bytes());
        head[8..12].copy_from_slice(&block_index.to_le_bytes());
        head[12] = kind;
        head[13] = CHECKSUM_CRC32_IEEE;
        head[14..16].copy_from_slice(&[0, 0]);
        head[16..20].copy_from_slice(&payload_len.to_le_bytes());
        let crc = weir_io::crc32(&[&head[..20], payload]);
        head[20..24].copy_from_slice(&crc.to_le_bytes());
    }

    fn finish_data_block(&mut self) -> Result<(), StateError> {
        let Some(start) = self.block_start.take() else {
            return Ok(());
        };
        let payload_start = start + BLOCK_HEADER_LEN;
        let table_off = (self.buf.len() - payload_start) as u32;
        let count = self.entry_offsets.len() as u32;
        for &o in &self.entry_offsets {
            self.buf.extend_from_slice(&o.to_le_bytes());
        }
        self.entry_offsets.clear();
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
        let payload = block_offset as usize + BLOCK_HEADER_LEN;
        self.blocks.push(BlockInfo {
            payload,
            count,
            table: payload + table_off as usize,
            last_key: (self.index.len(), self.last_key.len()),
        });
        self.index.extend_from_slice(&self.last_key);
        self.block_index += 1;
        if self.buf.len() >= WRITE_BUFFER_BYTES {
            self.flush_buf()?;
        }
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

    /// Write index, filter and footer, fsync. The file is complete and immutable afterwards.
    pub fn finish(mut self) -> Result<Written, StateError> {
        self.finish_data_block()?;
        let data_blocks = self.block_index;
        // Index block.
        self.index[0..4].copy_from_slice(&data_blocks.to_le_bytes());
        let pad = (BLOCK_ALIGN - (BLOCK_HEADER_LEN + self.index.len()) % BLOCK_ALIGN) % BLOCK_ALIGN;
        self.index.resize(self.index.len() + pad, 0);
        let index_offset = self.abs();
        let index = std::mem::take(&mut self.index);
        encode_block(
            &mut self.buf,
            BlockHeader {
                file_id: self.id,
                block_index: data_blocks,
                kind: KIND_INDEX,
                payload_len: index.len() as u32,
            },
            &index,
        );
        let index_len = (self.abs() - index_offset) as u32;
        // Filter block (its payload is a multiple of 16 plus 16: 24 + payload needs padding).
        let mut filter = match self.filter.take() {
            Some(f) => f,
            None => bloom::build(&self.hashes, self.opts.bloom_bits_per_key),
        };
        let pad = (BLOCK_ALIGN - (BLOCK_HEADER_LEN + filter.len()) % BLOCK_ALIGN) % BLOCK_ALIGN;
        let filter_bits_len = filter.len();
        filter.resize(filter_bits_len + pad, 0);
        let filter_offset = self.abs();
        encode_block(
            &mut self.buf,
            BlockHeader {
                file_id: self.id,
                block_index: data_blocks + 1,
                kind: KIND_FILTER,
                payload_len: filter.len() as u32,
            },
            &filter,
        );
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
        self.file.sync()?;
        let index_payload = index_offset as usize + BLOCK_HEADER_LEN;
        let mut blocks = std::mem::take(&mut self.blocks);
        for b in &mut blocks {
            b.last_key.0 += index_payload;
        }
        let filter_payload = filter_offset as usize + BLOCK_HEADER_LEN;
        let bloom = Bloom::parse(&filter[..filter_bits_len], filter_payload)
            .map_err(|(o, r)| malformed(&self.path, filter_payload + o, r))?;
        Ok(Written {
            path: self.path.clone(),
            id: self.id,
            size_bytes: self.flushed,
            crc32: self.file_crc.clone().finalize(),
            entry_count: self.entry_count,
            blocks,
            bloom,
            key_groups: (self.entry_count > 0)
                .then(|| KeyGroupRange::new(self.kg_first.unwrap_or(0), last_kg)),
        })
    }
}

#[derive(Debug, Clone, Copy)]
struct BlockInfo {
    /// File offset of the payload.
    payload: usize,
    count: u32,
    /// File offset of the entry offset table.
    table: usize,
    last_key: (usize, usize),
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
    blocks: Vec<BlockInfo>,
    /// `key_prefix` of each block's last key (the in-memory search index of the blocks).
    prefixes: Vec<u128>,
    /// Every `TOP_STRIDE`-th entry of `prefixes`: a small first level that stays in cache.
    top: Vec<u128>,
    bloom: Bloom,
    fs: Arc<dyn Fs>,
    /// Set when no store needs the file any more; the last reference then deletes it.
    obsolete: AtomicBool,
    /// Cleared when the store shuts down so that files retained snapshots name survive.
    deletable: AtomicBool,
}

impl Drop for Segment {
    fn drop(&mut self) {
        if self.obsolete.load(Ordering::Acquire) && self.deletable.load(Ordering::Acquire) {
            if let Err(e) = self.fs.remove(&self.path) {
                tracing::warn!("removing obsolete segment {}: {e}", self.path.display());
            }
        }
    }
}

fn malformed(path: &Path, offset: usize, reason: impl Into<String>) -> StateError {
    StateError::Format(FormatError::Malformed {
        file: path.to_owned(),
        offset: offset as u64,
        reason: reason.into(),
    })
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
        let empty = f[F_FLAGS] & FOOTER_FLAG_EMPTY != 0;
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
                block_index: data_blocks + 1,
                kind: KIND_FILTER,
                payload_len: (filter_len - BLOCK_HEADER_LEN.min(filter_len)) as u32,
            },
        )?;
        let bloom_payload_off = filter_offset + BLOCK_HEADER_LEN;
        let bloom_bytes_len = {
            // The bloom payload may carry zero padding after its bit blocks.
            let blocks = if filter_payload.len() >= 8 {
                rd_u32(filter_payload, 4) as usize
            } else {
                0
            };
            (bloom::BLOOM_HEADER_LEN + blocks * 64).min(filter_payload.len())
        };
        let bloom = Bloom::parse(&filter_payload[..bloom_bytes_len], bloom_payload_off)
            .map_err(|(o, r)| malformed(p, bloom_payload_off + o, r))?;
        // Index.
        let io = index_offset + BLOCK_HEADER_LEN;
        if index_payload.len() < INDEX_HEADER_LEN || rd_u32(index_payload, 0) != data_blocks {
            return Err(malformed(p, io, "index block count differs from footer"));
        }
        let mut blocks = Vec::with_capacity(data_blocks as usize);
        let mut pos = INDEX_HEADER_LEN;
        let mut expect_off = FILE_HEADER_LEN;
        let mut total = 0u64;
        let mut prev_key: Option<(usize, usize)> = None;
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
            let info = verify_data_block(p, b, boff + BLOCK_HEADER_LEN, payload, &mut prev_key)?;
            let last = prev_key.unwrap_or((0, 0));
            if b[last.0..last.0 + last.1] != b[kstart..kstart + klen] {
                return Err(malformed(
                    p,
                    io + pos - klen,
                    "index key differs from block's last key",
                ));
            }
            total += u64::from(info.count);
            blocks.push(BlockInfo {
                last_key: (kstart, klen),
                ..info
            });
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
            let first_key = &b[blocks[0].payload..];
            let fk = rd_u32(b, blocks[0].table) as usize + ENTRY_HEADER_LEN;
            let _ = first_key;
            let first =
                u16::from_be_bytes([b[blocks[0].payload + fk], b[blocks[0].payload + fk + 1]]);
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
        let crc32 = weir_io::crc32(&[b]);
        let size_bytes = len as u64;
        Ok(Segment {
            id,
            path: p.to_owned(),
            size_bytes,
            crc32,
            entry_count,
            key_groups,
            prefixes: Vec::new(),
            top: Vec::new(),
            map,
            blocks,
            bloom,
            fs,
            obsolete: AtomicBool::new(false),
            deletable: AtomicBool::new(owned),
        }
        .with_search_index())
    }

    /// Open a segment this process has just written and fsynced, without a second pass over
    /// its structure: the writer produced it and knows its blocks, filter and totals. What
    /// the reader would check again is the bytes themselves, so the whole file's CRC-32 is
    /// computed from the map and compared with the writer's (a device or cache returning other
    /// bytes than written is caught here, before the segment is used), and the size too.
    /// Segments from anywhere else (restore) go through [`Segment::open`].
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
        let crc32 = weir_io::crc32(&[&map]);
        if crc32 != w.crc32 {
            return Err(mismatch(
                "crc32 of the written segment",
                u64::from(w.crc32),
                u64::from(crc32),
            ));
        }
        Ok(Segment {
            id: w.id,
            path: w.path,
            size_bytes: w.size_bytes,
            crc32,
            entry_count: w.entry_count,
            key_groups: w.key_groups,
            map,
            blocks: w.blocks,
            prefixes: Vec::new(),
            top: Vec::new(),
            bloom: w.bloom,
            fs,
            obsolete: AtomicBool::new(false),
            deletable: AtomicBool::new(true),
        }
        .with_search_index())
    }

    fn with_search_index(mut self) -> Segment {
        let prefixes: Vec<u128> = self
            .blocks
            .iter()
            .map(|b| key_prefix(self.block_last_key(b)))
            .collect();
        self.top = prefixes.iter().step_by(TOP_STRIDE).copied().collect();
        self.prefixes = prefixes;
        self
    }

    pub fn mark_obsolete(&self) {
        self.obsolete.store(true, Ordering::Release);
    }

    pub fn keep_file(&self) {
        self.deletable.store(false, Ordering::Release);
    }

    pub fn index_bytes(&self) -> usize {
        self.blocks.len() * std::mem::size_of::<BlockInfo>()
            + (self.prefixes.len() + self.top.len()) * std::mem::size_of::<u128>()
    }

    pub fn filter_bytes(&self) -> usize {
        self.bloom.bytes()
    }

    #[inline]
    fn entry_key(&self, blk: &BlockInfo, i: u32) -> &[u8] {
        let b: &[u8] = &self.map;
        let e = blk.payload + rd_u32(b, blk.table + 4 * i as usize) as usize;
        let klen = usize::from(rd_u16(b, e + E_KEY_LEN));
        &b[e + ENTRY_HEADER_LEN..e + ENTRY_HEADER_LEN + klen]
    }

    fn entry(&self, blk: &BlockInfo, i: u32) -> (&[u8], ValueRef<'_>) {
        let b: &[u8] = &self.map;
        let e = blk.payload + rd_u32(b, blk.table + 4 * i as usize) as usize;
        let klen = usize::from(rd_u16(b, e + E_KEY_LEN));
        let vlen = rd_u32(b, e + E_VAL_LEN) as usize;
        let k = e + ENTRY_HEADER_LEN;
        let v = (k + klen).div_ceil(VALUE_ALIGN) * VALUE_ALIGN;
        (
            &b[k..k + klen],
            ValueRef {
                bytes: &b[v..v + vlen],
                expire_at_ms: rd_u64(b, e + E_EXPIRE_AT_MS),
                tombstone: b[e + E_FLAGS] & FLAG_TOMBSTONE != 0,
            },
        )
    }

    fn block_last_key(&self, blk: &BlockInfo) -> &[u8] {
        &self.map[blk.last_key.0..blk.last_key.0 + blk.last_key.1]
    }

    /// Index of the first block whose last key is >= `key`. Searches the 16-byte key
    /// prefixes in memory (a small first level, then a run of `TOP_STRIDE`); only blocks whose
    /// prefix ties with the key's compare full keys in the map.
    fn find_block(&self, key: &[u8]) -> usize {
        let pk = key_prefix(key);
        let t = self.top.partition_point(|&p| p < pk);
        // prefixes[(t-1)*S] < pk <= prefixes[t*S] (where they exist).
        let lo = if t == 0 { 0 } else { (t - 1) * TOP_STRIDE + 1 };
        let hi = (t * TOP_STRIDE).min(self.prefixes.len());
        let mut bi = lo + self.prefixes[lo..hi.max(lo)].partition_point(|&p| p < pk);
        while bi < self.blocks.len()
            && self.prefixes[bi] == pk
            && self.block_last_key(&self.blocks[bi]) < key
        {
            bi += 1;
        }
        bi
    }

    /// Position of the first entry with key >= `key`: (block, entry).
    fn seek(&self, key: &[u8]) -> (usize, u32) {
        self.seek_in(self.find_block(key), key)
    }

    /// Position of the first entry >= `key` in block `bi` (from [`Self::find_block`]).
    fn seek_in(&self, bi: usize, key: &[u8]) -> (usize, u32) {
        if bi == self.blocks.len() {
            return (bi, 0);
        }
        let blk = &self.blocks[bi];
        let (mut lo, mut hi) = (0u32, blk.count);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if self.entry_key(blk, mid) < key {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        (bi, lo)
    }

    /// Load one byte of every cache line of the block's entries and table: independent loads
    /// that miss in parallel, instead of one dependent miss per binary-search step.
    #[inline]
    fn touch_block(&self, blk: &BlockInfo) {
        let b: &[u8] = &self.map;
        let end = (blk.table + 4 * blk.count as usize).min(b.len());
        let mut acc = 0u8;
        let mut off = blk.payload;
        while off < end {
            acc ^= b[off];
            off += 64;
        }
        std::hint::black_box(acc);
    }

    /// Point lookup; `hash` is `xxh3_64(key)`.
    pub fn get(&self, key: &[u8], hash: u64) -> Probe<'_> {
        if !self.bloom.may_contain(&self.map, hash) {
            return Probe::BloomNegative;
        }
        let bi = self.find_block(key);
        if bi == self.blocks.len() {
            return Probe::Absent;
        }
        self.touch_block(&self.blocks[bi]);
        let (bi, i) = self.seek_in(bi, key);
        if bi == self.blocks.len() {
            return Probe::Absent;
        }
        let (k, v) = self.entry(&self.blocks[bi], i);
        if k == key {
            Probe::Found(v)
        } else {
            Probe::Absent
        }
    }

    /// Iterate entries with key >= `start`.
    pub fn iter_from(&self, start: &[u8]) -> SegmentIter<'_> {
        let (block, idx) = self.seek(start);
        SegmentIter {
            seg: self,
            block,
            idx,
        }
    }
}

/// Forward iteration over a segment.
#[derive(Debug)]
pub(crate) struct SegmentIter<'a> {
    seg: &'a Segment,
    block: usize,
    idx: u32,
}

impl<'a> Iterator for SegmentIter<'a> {
    type Item = (&'a [u8], ValueRef<'a>);
    fn next(&mut self) -> Option<Self::Item> {
        loop {
            let blk = self.seg.blocks.get(self.block)?;
            if self.idx < blk.count {
                let out = self.seg.entry(blk, self.idx);
                self.idx += 1;
                return Some(out);
            }
            self.block += 1;
            self.idx = 0;
        }
    }
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
/// Advances `prev_key` (file range of the previous key) and checks strict key order.
fn verify_data_block(
    p: &Path,
    file: &[u8],
    po: usize,
    payload: &[u8],
    prev_key: &mut Option<(usize, usize)>,
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
        last_key: (0, 0),
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
        let mut w = SegmentWriter::create(
            &StdFs,
            &p,
            1,
            WriterOptions {
                block_target_bytes: 4096,
                bloom_bits_per_key: 10,
                expected_keys: None,
            },
        )
        .unwrap();
        let v = ValueRef {
            bytes: &42u64.to_le_bytes(),
            expire_at_ms: NO_EXPIRY,
            tombstone: false,
        };
        w.add(&[0, 5, 0, 1, 0, 0, 0, 1, b'a'], v).unwrap();
        let t = ValueRef {
            bytes: &[],
            expire_at_ms: NO_EXPIRY,
            tombstone: true,
        };
        w.add(&[0, 5, 0, 1, 0, 0, 0, 1, b'b'], t).unwrap();
        w.finish().unwrap();
        p
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
        match seg.get(&key, xxh3_64(&key)) {
            Probe::Found(v) => {
                assert_eq!(v.bytes, &42u64.to_le_bytes());
                // Values are 16-aligned in the file, so in the map.
                assert_eq!(v.bytes.as_ptr() as usize % VALUE_ALIGN, 0);
            }
            other => panic!("{other:?}"),
        }
        let key_b = [0, 5, 0, 1, 0, 0, 0, 1, b'b'];
        assert!(matches!(
            seg.get(&key_b, xxh3_64(&key_b)),
            Probe::Found(ValueRef {
                tombstone: true,
                ..
            })
        ));
        let absent = [0, 5, 0, 1, 0, 0, 0, 1, b'c'];
        assert!(!matches!(
            seg.get(&absent, xxh3_64(&absent)),
            Probe::Found(_)
        ));
    }

    /// Keys sharing their first 16 bytes across many small blocks: the prefix index must fall
    /// back to full keys on ties. The writer-described open must agree with the full
    /// verification, and a byte changed after writing must be caught by it.
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
            let opts = WriterOptions {
                block_target_bytes: 128,
                bloom_bits_per_key: 10,
                expected_keys: expected,
            };
            let mut w = SegmentWriter::create(&StdFs, &p, 7, opts).unwrap();
            for i in 0..3000u32 {
                let v = i.to_le_bytes();
                let vr = ValueRef {
                    bytes: &v,
                    expire_at_ms: NO_EXPIRY,
                    tombstone: false,
                };
                w.add(&key(i), vr).unwrap();
            }
            let written = w.finish().unwrap();
            let fs: Arc<dyn Fs> = Arc::new(StdFs);
            let full = Segment::open(fs.clone(), &p, Some(7), false).unwrap();
            let fast = Segment::open_written(fs.clone(), written.clone()).unwrap();
            fast.keep_file();
            assert!(full.blocks.len() > 100);
            assert_eq!(
                (fast.entry_count, fast.crc32, fast.key_groups),
                (full.entry_count, full.crc32, full.key_groups)
            );
            for seg in [&full, &fast] {
                for i in 0..3000u32 {
                    let k = key(i);
                    match seg.get(&k, xxh3_64(&k)) {
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
                        seg.get(&absent, xxh3_64(&absent)),
                        Probe::Found(_)
                    ));
                }
                let from: Vec<Vec<u8>> =
                    seg.iter_from(&key(1500)).map(|(k, _)| k.to_vec()).collect();
                assert_eq!(from.len(), 1500);
                assert_eq!(from[0], key(1500));
                assert_eq!(seg.iter_from(&[0, 4]).count(), 0);
                assert_eq!(seg.iter_from(&[]).count(), 3000);
            }
            drop((full, fast));
            // A byte that differs from what was written: the writer's CRC catches it.
            let mut bytes = std::fs::read(&p).unwrap();
            bytes[100] ^= 1;
            std::fs::remove_file(&p).unwrap();
            std::fs::write(&p, &bytes).unwrap();
            let fs: Arc<dyn Fs> = Arc::new(StdFs);
            match Segment::open_written(fs, written) {
                Err(StateError::HandleMismatch { what, .. }) => assert!(what.contains("crc32")),
                other => panic!("{other:?}"),
            }
        }
    }
}
