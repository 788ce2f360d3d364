//! The in-memory search index over a segment's data blocks (built from the index block, never
//! stored). A point lookup is bounded by memory latency, so the index is laid out to cost
//! one cache miss: a guide table maps the high bits of a key's 16-byte prefix to the short run
//! of blocks that can hold it, and each block's last-key prefix sits beside its file offset, so
//! the block the run points at is addressed without another load.

use crate::hugemem::{prefetch_read, Pod, ZeroedBuf};

/// One data block: the `key_prefix` of its last key and its payload's file offset, in one
/// 32-byte record (two to a cache line: buffers start on a line).
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub(crate) struct BlockRef {
    pub prefix: u128,
    pub offset: u64,
    _pad: u64,
}

// SAFETY: two integers and an explicit pad field fill the 32 bytes, so there are no padding
// bytes, and every bit pattern is a valid value.
unsafe impl Pod for BlockRef {}

/// Guide table size: about one bucket per block, at most 2^20 buckets (4 MiB).
const MAX_GUIDE_BITS: u32 = 20;

#[derive(Debug)]
pub(crate) struct BlockIndex {
    blocks: ZeroedBuf<BlockRef>,
    /// `guide[r]` = the first block whose last prefix is >= the smallest prefix of bucket `r`;
    /// one more entry than there are buckets. The block a prefix `p` of bucket `r` needs (the
    /// first whose last prefix is >= p) is in `guide[r]..=guide[r + 1]`.
    guide: ZeroedBuf<u32>,
    /// Bucket of `p` is `(p - base) >> shift` (prefixes below `base` go to bucket 0, above
    /// the last block's prefix to the last bucket).
    base: u128,
    shift: u32,
}

impl BlockIndex {
    /// Index blocks with last-key prefixes `prefixes` (ascending) at payload offsets `offsets`.
    pub fn new(offsets: &[u64], prefixes: &[u128]) -> BlockIndex {
        debug_assert_eq!(offsets.len(), prefixes.len());
        debug_assert!(prefixes.windows(2).all(|w| w[0] <= w[1]));
        let refs: Vec<BlockRef> = offsets
            .iter()
            .zip(prefixes)
            .map(|(&offset, &prefix)| BlockRef {
                prefix,
                offset,
                _pad: 0,
            })
            .collect();
        let n = refs.len();
        let (base, last) = match (prefixes.first(), prefixes.last()) {
            (Some(&f), Some(&l)) => (f, l),
            _ => (0, 0),
        };
        let bits = (usize::BITS - n.max(1).leading_zeros()).min(MAX_GUIDE_BITS);
        let span = last - base;
        // The smallest shift that puts `span` into `bits` bits.
        let shift = (128 - span.leading_zeros()).saturating_sub(bits);
        let buckets = ((span >> shift) + 1) as usize;
        let mut guide = ZeroedBuf::<u32>::new(buckets + 1);
        let mut b = 0usize;
        for (r, g) in guide.iter_mut().enumerate() {
            // Smallest prefix of bucket r: base + (r << shift), saturating for the sentinel.
            let lo = (r as u128)
                .checked_mul(1u128 << shift)
                .and_then(|x| base.checked_add(x))
                .unwrap_or(u128::MAX);
            while b < n && prefixes[b] < lo {
                b += 1;
            }
            *g = b as u32;
        }
        BlockIndex {
            blocks: ZeroedBuf::from_slice(&refs),
            guide,
            base,
            shift,
        }
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn bytes(&self) -> usize {
        self.blocks.len() * std::mem::size_of::<BlockRef>()
            + self.guide.len() * std::mem::size_of::<u32>()
    }

    #[inline]
    pub fn offset(&self, bi: usize) -> u64 {
        self.blocks[bi].offset
    }

    #[inline]
    pub fn prefix(&self, bi: usize) -> u128 {
        self.blocks[bi].prefix
    }

    /// The guide bucket of `pk`.
    #[inline]
    fn bucket(&self, pk: u128) -> usize {
        if pk <= self.base {
            0
        } else {
            (((pk - self.base) >> self.shift) as usize).min(self.guide.len() - 2)
        }
    }

    /// The blocks that can hold `pk`: the answer of [`Self::lower_bound`] is in `lo..=hi-1`
    /// or is `hi` itself only when `hi == len()`.
    #[inline]
    fn candidates(&self, pk: u128) -> (usize, usize) {
        let r = self.bucket(pk);
        let lo = self.guide[r] as usize;
        let hi = (self.guide[r + 1] as usize + 1).min(self.blocks.len());
        (lo, hi)
    }

    /// Index of the first block whose last prefix is >= `pk` (`len()` if none).
    #[inline]
    pub fn lower_bound(&self, pk: u128) -> usize {
        if self.blocks.is_empty() {
            return 0;
        }
        let (lo, hi) = self.candidates(pk);
        lo + self.blocks[lo..hi].partition_point(|b| b.prefix < pk)
    }

    /// Batched lookups, step one: start loading the guide entry of `pk`.
    #[inline]
    pub fn prefetch_guide(&self, pk: u128) {
        if !self.blocks.is_empty() {
            prefetch_read(&self.guide[self.bucket(pk)]);
        }
    }

    /// Batched lookups, step two (once the guide entry is loaded): start loading the block
    /// records that [`Self::lower_bound`] will compare.
    #[inline]
    pub fn prefetch_candidates(&self, pk: u128) {
        if self.blocks.is_empty() {
            return;
        }
        let (lo, hi) = self.candidates(pk);
        // Two records per line; the run is one or two records for keys spread as hashes are.
        for b in self.blocks[lo..hi].iter().step_by(2).take(4) {
            prefetch_read(b);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn check(prefixes: &[u128], probes: &[u128]) {
        let offsets: Vec<u64> = (0..prefixes.len() as u64).collect();
        let ix = BlockIndex::new(&offsets, prefixes);
        for &p in probes.iter().chain(prefixes) {
            let want = prefixes.partition_point(|&x| x < p);
            assert_eq!(ix.lower_bound(p), want, "probe {p:#x}");
            for q in [p.wrapping_sub(1), p.wrapping_add(1)] {
                assert_eq!(ix.lower_bound(q), prefixes.partition_point(|&x| x < q));
            }
        }
        for (i, &p) in prefixes.iter().enumerate() {
            assert_eq!((ix.offset(i), ix.prefix(i)), (i as u64, p));
        }
    }

    #[test]
    fn edges() {
        check(&[], &[0, 1, u128::MAX]);
        check(&[5], &[0, 5, 6, u128::MAX]);
        check(&[0, 0, 0], &[0, 1, u128::MAX]);
        check(&[u128::MAX], &[0, u128::MAX]);
        check(&[0, u128::MAX], &[0, 1, u128::MAX - 1, u128::MAX]);
        // Repeated prefixes (long keys sharing 16 bytes) span several blocks.
        check(&[1, 7, 7, 7, 7, 9], &[6, 7, 8]);
    }

    proptest! {
        #[test]
        fn lower_bound_matches_binary_search(
            mut prefixes in proptest::collection::vec(any::<u128>(), 0..300),
            skew in 0u32..120,
            probes in proptest::collection::vec(any::<u128>(), 0..50),
        ) {
            // Skewed sets: most prefixes share high bits, as keys of one key group do.
            for p in prefixes.iter_mut().step_by(2) {
                *p >>= skew;
            }
            prefixes.sort_unstable();
            let probes: Vec<u128> = probes.into_iter().map(|p| p >> skew).collect();
            check(&prefixes, &probes);
        }
    }
}
