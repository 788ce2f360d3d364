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

/// An empty filter payload sized for `keys` keys at `bits_per_key`.
pub(crate) fn empty(keys: u64, bits_per_key: u32) -> Vec<u8> {
    let bits = (keys * u64::from(bits_per_key)).max(1);
    let blocks = bits.div_ceil(512).max(1) as u32;
    // A blocked filter wants fewer probes than the classic ln2 * bits/key.
    let k = ((f64::from(bits_per_key) * 0.6).round() as u8).clamp(1, 16);
    let mut out = vec![0u8; BLOOM_HEADER_LEN + blocks as usize * BLOCK_BYTES];
    out[0] = BLOOM_VERSION;
    out[1] = k;
    out[4..8].copy_from_slice(&blocks.to_le_bytes());
    out
}

/// Set the bits of `hash` in a payload made by [`empty`].
#[inline]
pub(crate) fn insert(out: &mut [u8], hash: u64) {
    let k = out[1];
    let blocks = u32::from_le_bytes([out[4], out[5], out[6], out[7]]);
    let base = BLOOM_HEADER_LEN + block_of(hash, blocks) * BLOCK_BYTES;
    let block = &mut out[base..base + BLOCK_BYTES];
    for bit in probes(hash, k) {
        block[(bit / 8) as usize] |= 1 << (bit % 8);
    }
}

/// Build the filter payload for `hashes` (xxh3_64 of each key).
pub(crate) fn build(hashes: &[u64], bits_per_key: u32) -> Vec<u8> {
    let mut out = empty(hashes.len() as u64, bits_per_key);
    for &h in hashes {
        insert(&mut out, h);
    }
    out
}

/// A validated filter inside a segment map: `bits` is the bit array's byte range.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bloom {
    pub k: u8,
    pub blocks: u32,
    pub bits_offset: usize,
}

impl Bloom {
    /// Parse the header of `payload` (at `payload_offset` in the file). `Err(reason)` if invalid.
    pub fn parse(payload: &[u8], payload_offset: usize) -> Result<Bloom, (usize, &'static str)> {
        if payload.len() < BLOOM_HEADER_LEN {
            return Err((0, "bloom header truncated"));
        }
        if payload[0] != BLOOM_VERSION {
            return Err((0, "unsupported bloom version"));
        }
        let k = payload[1];
        if !(1..=16).contains(&k) {
            return Err((1, "bloom k out of range"));
        }
        let blocks = u32::from_le_bytes([payload[4], payload[5], payload[6], payload[7]]);
        if blocks == 0 || payload.len() != BLOOM_HEADER_LEN + blocks as usize * BLOCK_BYTES {
            return Err((4, "bloom block count does not match its length"));
        }
        Ok(Bloom {
            k,
            blocks,
            bits_offset: payload_offset + BLOOM_HEADER_LEN,
        })
    }

    /// False means the key is certainly absent. `file` is the whole mapped segment.
    #[inline]
    pub fn may_contain(&self, file: &[u8], hash: u64) -> bool {
        let base = self.bits_offset + block_of(hash, self.blocks) * BLOCK_BYTES;
        let Some(block) = file.get(base..base + BLOCK_BYTES) else {
            return true;
        };
        probes(hash, self.k).all(|bit| block[(bit / 8) as usize] & (1 << (bit % 8)) != 0)
    }

    pub fn bytes(&self) -> usize {
        self.blocks as usize * BLOCK_BYTES
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use xxhash_rust::xxh3::xxh3_64;

    #[test]
    fn no_false_negatives_and_low_false_positive_rate() {
        let hashes: Vec<u64> = (0..20_000u64).map(|i| xxh3_64(&i.to_le_bytes())).collect();
        let payload = build(&hashes, 10);
        let b = Bloom::parse(&payload, 0).unwrap();
        assert!(hashes.iter().all(|&h| b.may_contain(&payload, h)));
        let fp = (20_000..120_000u64)
            .filter(|i| b.may_contain(&payload, xxh3_64(&i.to_le_bytes())))
            .count();
        assert!(fp < 3_000, "false positive rate {} / 100000", fp);
    }

    #[test]
    fn golden_layout() {
        // One key, one block: pins the documented probe formula.
        let h = 0x0123_4567_89ab_cdefu64;
        let p = build(&[h], 10);
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
