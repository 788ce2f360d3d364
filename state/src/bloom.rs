//! Blocked bloom filter, one per segment. Format (the filter block's payload, little-endian):
//!
//! ```text
//! offset size field
//!      0    1 version (1)
//!      1    1 k: bits set per key (1..=16)
//!      2    2 reserved, 0
//!      4    4 block count n (>= 1); each block is 64 bytes = 512 bits
//!      8    8 reserved, 0
//!     16 64*n bit blocks
//! ```
//!
//! A key's hash is `h = xxh3_64(key)` (seed 0). Block `b = ((h >> 32) * n) >> 32`. With
//! `h1 = h as u32` and `h2 = ((h * 0x9E3779B97F4A7C15) >> 32) as u32 | 1`, probe `i` in `0..k`
//! sets bit `(h1 + i * h2) mod 512` (wrapping u32 arithmetic) of block `b`: byte `bit / 8`,
//! bit `bit % 8` (LSB first). One cache line per lookup.

use std::path::Path;

use crate::error::StateError;
use crate::hugemem::ZeroedBuf;
use crate::segment::malformed;

pub(crate) const BLOOM_VERSION: u8 = 1;
pub(crate) const BLOOM_HEADER_LEN: usize = 16;
const BLOCK_BYTES: usize = 64;

fn probes(hash: u64, k: u8) -> impl Iterator<Item = u32> {
    let h1 = hash as u32;
    let h2 = ((hash.wrapping_mul(0x9E37_79B9_7F4A_7C15)) >> 32) as u32 | 1;
    (0..u32::from(k)).map(move |i| h1.wrapping_add(i.wrapping_mul(h2)) % 512)
}

fn block_of(hash: u64, blocks: u32) -> usize {
    (((hash >> 32) * u64::from(blocks)) >> 32) as usize
}

/// A segment's bloom filter. The bit blocks live in anonymous memory of their own, not in the
/// segment's map: there they are 64-byte aligned (one cache line per probe; in the file they
/// are only 16-aligned) and, from 2 MiB on, on transparent huge pages (a probe of a filter on
/// the file's 4 KiB pages costs a TLB miss on top of the cache miss). The on-disk format is
/// unchanged: [`Bloom::header`] and [`Bloom::bits`] are what the filter block holds.
#[derive(Debug)]
pub(crate) struct Bloom {
    k: u8,
    blocks: u32,
    bits: ZeroedBuf<u8>,
}

impl Bloom {
    /// An empty filter sized for `keys` keys at `bits_per_key`.
    pub fn empty(keys: u64, bits_per_key: u32) -> Result<Bloom, StateError> {
        let bits = (keys * u64::from(bits_per_key)).max(1);
        let blocks = u32::try_from(bits.div_ceil(512).max(1)).unwrap_or(u32::MAX);
        // A blocked filter wants fewer probes than the classic ln2 * bits/key.
        let k = ((f64::from(bits_per_key) * 0.6).round() as u8).clamp(1, 16);
        Ok(Bloom {
            k,
            blocks,
            bits: ZeroedBuf::new(blocks as usize * BLOCK_BYTES),
        })
    }

    /// A filter holding `hashes` (xxh3_64 of each key), sized exactly for them.
    pub fn build(hashes: &[u64], bits_per_key: u32) -> Result<Bloom, StateError> {
        let mut b = Bloom::empty(hashes.len() as u64, bits_per_key)?;
        for &h in hashes {
            b.insert(h);
        }
        Ok(b)
    }

    /// Set the bits of `hash`.
    #[inline]
    pub fn insert(&mut self, hash: u64) {
        let base = block_of(hash, self.blocks) * BLOCK_BYTES;
        let block = &mut self.bits[base..base + BLOCK_BYTES];
        for bit in probes(hash, self.k) {
            block[(bit / 8) as usize] |= 1 << (bit % 8);
        }
    }

    /// Hint the CPU to load the cache line `hash` maps to (a writer inserts a few keys later,
    /// and batched lookups test a few keys later, so the misses of consecutive keys overlap).
    #[inline]
    pub fn prefetch(&self, hash: u64) {
        crate::segment::prefetch(&self.bits[block_of(hash, self.blocks) * BLOCK_BYTES..]);
    }

    /// Parse and copy the filter block payload `payload` (header, bit blocks, then the block's
    /// zero padding) found at file offset `payload_offset` of `path`.
    pub fn parse(path: &Path, payload: &[u8], payload_offset: usize) -> Result<Bloom, StateError> {
        let bad = |o: usize, r: &'static str| malformed(path, payload_offset + o, r);
        if payload.len() < BLOOM_HEADER_LEN {
            return Err(bad(0, "bloom header truncated"));
        }
        if payload[0] != BLOOM_VERSION {
            return Err(bad(0, "unsupported bloom version"));
        }
        let k = payload[1];
        if !(1..=16).contains(&k) {
            return Err(bad(1, "bloom k out of range"));
        }
        let blocks = u32::from_le_bytes([payload[4], payload[5], payload[6], payload[7]]);
        let bits_len = blocks as usize * BLOCK_BYTES;
        if blocks == 0 || payload.len() - BLOOM_HEADER_LEN < bits_len {
            return Err(bad(4, "bloom block count does not match its length"));
        }
        let mut bits = ZeroedBuf::new(bits_len);
        bits.copy_from_slice(&payload[BLOOM_HEADER_LEN..BLOOM_HEADER_LEN + bits_len]);
        Ok(Bloom { k, blocks, bits })
    }

    /// The filter block payload's header (see the module docs).
    pub fn header(&self) -> [u8; BLOOM_HEADER_LEN] {
        let mut h = [0u8; BLOOM_HEADER_LEN];
        h[0] = BLOOM_VERSION;
        h[1] = self.k;
        h[4..8].copy_from_slice(&self.blocks.to_le_bytes());
        h
    }

    /// The bit blocks, as the filter block payload holds them after the header.
    pub fn bits(&self) -> &[u8] {
        &self.bits
    }

    /// False means the key is certainly absent.
    #[inline]
    pub fn may_contain(&self, hash: u64) -> bool {
        let base = block_of(hash, self.blocks) * BLOCK_BYTES;
        let Some(block) = self.bits.get(base..base + BLOCK_BYTES) else {
            return true;
        };
        probes(hash, self.k).all(|bit| block[(bit / 8) as usize] & (1 << (bit % 8)) != 0)
    }

    pub fn bytes(&self) -> usize {
        self.bits.len()
    }

    #[cfg(test)]
    pub fn try_clone(&self) -> Result<Bloom, StateError> {
        let mut bits = ZeroedBuf::new(self.bits.len());
        bits.copy_from_slice(&self.bits);
        Ok(Bloom {
            k: self.k,
            blocks: self.blocks,
            bits,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use xxhash_rust::xxh3::xxh3_64;

    #[test]
    fn no_false_negatives_and_low_false_positive_rate() {
        let hashes: Vec<u64> = (0..20_000u64).map(|i| xxh3_64(&i.to_le_bytes())).collect();
        let built = Bloom::build(&hashes, 10).unwrap();
        let mut payload = built.header().to_vec();
        payload.extend_from_slice(built.bits());
        let b = Bloom::parse(Path::new("t"), &payload, 0).unwrap();
        assert!(hashes.iter().all(|&h| b.may_contain(h)));
        let fp = (20_000..120_000u64)
            .filter(|i| b.may_contain(xxh3_64(&i.to_le_bytes())))
            .count();
        assert!(fp < 3_000, "false positive rate {} / 100000", fp);
    }

    #[test]
    fn golden_layout() {
        // One key, one block: pins the documented probe formula.
        let h = 0x0123_4567_89ab_cdefu64;
        let b = Bloom::build(&[h], 10).unwrap();
        let mut p = b.header().to_vec();
        p.extend_from_slice(b.bits());
        assert_eq!(&p[..8], &[1, 6, 0, 0, 1, 0, 0, 0]);
        let set: Vec<u32> = (0..512u32)
            .filter(|bit| p[16 + (bit / 8) as usize] & (1 << (bit % 8)) != 0)
            .collect();
        let mut want: Vec<u32> = probes(h, 6).collect();
        want.sort();
        want.dedup();
        assert_eq!(set, want);
        let h1 = h as u32;
        let h2 = ((h.wrapping_mul(0x9E37_79B9_7F4A_7C15)) >> 32) as u32 | 1;
        assert_eq!(want.len(), 6);
        assert!(want.contains(&(h1 % 512)));
        assert!(want.contains(&(h1.wrapping_add(h2) % 512)));
    }
}
