//! The in-memory search index over a segment's data blocks (built from the index block, never
//! stored). A point lookup is bounded by memory latency, so the index is laid out to cost
//! one cache miss: a guide table maps bits of a key's 16-byte prefix (which ones: below) to
//! the short run of blocks that can hold it, and each block's last-key prefix sits beside its
//! file offset, so the block the run points at is addressed without another load.
//!
//! The guide's bits are the highest bits in which the segment's prefixes differ, not the
//! highest bits of the prefix: keyed-state keys are `key group | state id | user key`, and a
//! big-endian integer user key leaves dozens of constant bits between the key-group bits and
//! the user key's low bytes. Interpolating over the whole span put each key group's blocks in
//! one bucket, and a lookup binary-searched thousands of block records.

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
/// The guide's bits are gathered from at most this many runs of adjacent prefix bits.
const MAX_RUNS: usize = 4;

/// Which prefix bits make a key's guide bucket: the `bits` highest bits that vary among the
/// indexed prefixes, as runs of adjacent bits, highest run first.
///
/// Why this is order-preserving: every indexed prefix has the same value (`constant`) in each
/// bit outside `varying`. Take a prefix `p` that also has those values in every such bit
/// above the lowest gathered one (`check`). The highest bit in which `p` and an indexed prefix
/// `b` differ is then either a gathered bit, which orders both `p`, `b` and their buckets the
/// same way, or a bit below every gathered one, where their buckets are equal. So
/// `bucket(b) < bucket(p)` implies `b < p` and `bucket(b) > bucket(p)` implies `b > p`. Any
/// other `p` is placed exactly between two buckets (see [`Gather::slot`]).
#[derive(Debug, Clone, Copy, Default)]
struct Gather {
    /// (lowest bit, length) of each run.
    runs: [(u8, u8); MAX_RUNS],
    nruns: usize,
    bits: u32,
    /// Constant bits above the lowest gathered bit, and their common value.
    check: u128,
    constant: u128,
}

impl Gather {
    /// Gather up to `want` of the highest bits in which `prefixes` differ.
    fn new(prefixes: &[u128], want: u32) -> Gather {
        let Some(&first) = prefixes.first() else {
            return Gather::default();
        };
        let varying = prefixes.iter().fold(0u128, |m, &p| m | (p ^ first));
        let mut g = Gather::default();
        let mut bit = 128u32;
        while g.bits < want && g.nruns < MAX_RUNS {
            // The next run: from the highest varying bit below `bit`, down while bits vary.
            let rest = varying & low_mask(bit);
            if rest == 0 {
                break;
            }
            let top = 127 - rest.leading_zeros();
            let mut lo = top;
            while lo > 0 && g.bits + (top - lo + 1) < want && (varying >> (lo - 1)) & 1 == 1 {
                lo -= 1;
            }
            g.runs[g.nruns] = (lo as u8, (top - lo + 1) as u8);
            g.nruns += 1;
            g.bits += top - lo + 1;
            bit = lo;
        }
        if g.bits > 0 {
            g.check = !varying & !low_mask(bit);
            g.constant = first & g.check;
        }
        g
    }

    /// Where `pk` falls among the guide's buckets (see [`Slot`]).
    #[inline]
    fn slot(&self, pk: u128) -> Slot {
        let mut r = 0usize;
        for &(lo, len) in &self.runs[..self.nruns] {
            r = (r << len) | ((pk >> lo) as usize & ((1usize << len) - 1));
        }
        let d = (pk ^ self.constant) & self.check;
        if d == 0 {
            return Slot::In(r);
        }
        // `pk` differs from every indexed prefix first at constant bit `h`. Above `h` it
        // differs from them only in gathered bits, so the buckets that agree with it there
        // (any gathered bits below `h`) hold prefixes all below `pk` (if `pk` has a 1 at `h`)
        // or all above it.
        let h = 127 - d.leading_zeros();
        let below: u32 = self.runs[..self.nruns]
            .iter()
            .map(|&(lo, len)| h.saturating_sub(u32::from(lo)).min(u32::from(len)))
            .sum();
        let low = (1usize << below) - 1;
        if (pk >> h) & 1 == 1 {
            Slot::After(r | low)
        } else {
            Slot::Before(r & !low)
        }
    }
}

/// Where a prefix falls among the guide's buckets.
enum Slot {
    /// In bucket `r`: its block is in `guide[r]..=guide[r + 1]`.
    In(usize),
    /// Above every indexed prefix of buckets up to `r`, below all others: its block is
    /// `guide[r + 1]`.
    After(usize),
    /// Below every indexed prefix of buckets from `r` on, above all others: its block is
    /// `guide[r]`.
    Before(usize),
}

/// The bits below bit `bit` (all of them for 128).
fn low_mask(bit: u32) -> u128 {
    if bit >= 128 {
        u128::MAX
    } else {
        (1u128 << bit) - 1
    }
}

#[derive(Debug)]
pub(crate) struct BlockIndex {
    blocks: ZeroedBuf<BlockRef>,
    /// `guide[r]` = the first block whose bucket is >= `r`; one more entry than there are
    /// buckets. The block a prefix `p` of bucket `r` needs (the first whose last prefix is
    /// >= p) is in `guide[r]..=guide[r + 1]`.
    guide: ZeroedBuf<u32>,
    gather: Gather,
}

impl BlockIndex {
    /// Index blocks with last-key prefixes `prefixes` (ascending) at payload offsets `offsets`.
    pub fn new(offsets: &[u64], prefixes: &[u128]) -> BlockIndex {
        debug_assert_eq!(offsets.len(), prefixes.len());
        debug_assert!(prefixes.windows(2).all(|w| w[0] <= w[1]));
        // Filled in place: a transient `Vec` of this size would stay in the allocator's
        // arena (see `MapVec`).
        let mut blocks = ZeroedBuf::<BlockRef>::new(offsets.len());
        for (b, (&offset, &prefix)) in blocks.iter_mut().zip(offsets.iter().zip(prefixes)) {
            *b = BlockRef {
                prefix,
                offset,
                _pad: 0,
            };
        }
        let n = blocks.len();
        let bits = (usize::BITS - n.max(1).leading_zeros()).min(MAX_GUIDE_BITS);
        let gather = Gather::new(prefixes, bits);
        let buckets = 1usize << gather.bits;
        let mut guide = ZeroedBuf::<u32>::new(buckets + 1);
        let mut b = 0usize;
        for (r, g) in guide.iter_mut().enumerate() {
            // Every indexed prefix is in a bucket, non-decreasing along the blocks.
            while b < n && matches!(gather.slot(prefixes[b]), Slot::In(rb) if rb < r) {
                b += 1;
            }
            *g = b as u32;
        }
        BlockIndex {
            blocks,
            guide,
            gather,
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

    /// The blocks that can hold `pk`: the answer of [`Self::lower_bound`] is in `lo..=hi-1`
    /// or is `hi` itself only when `hi == len()`.
    #[inline]
    fn candidates(&self, pk: u128) -> (usize, usize) {
        match self.gather.slot(pk) {
            Slot::In(r) => {
                let lo = self.guide[r] as usize;
                let hi = (self.guide[r + 1] as usize + 1).min(self.blocks.len());
                (lo, hi)
            }
            Slot::After(r) => {
                let at = self.guide[r + 1] as usize;
                (at, at)
            }
            Slot::Before(r) => {
                let at = self.guide[r] as usize;
                (at, at)
            }
        }
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
            let r = match self.gather.slot(pk) {
                Slot::In(r) | Slot::Before(r) => r,
                Slot::After(r) => r + 1,
            };
            prefetch_read(&self.guide[r]);
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

        #[test]
        fn lower_bound_matches_binary_search_over_keyed_state_keys(
            users in proptest::collection::vec((0u128..128, 0u128..1 << 24), 1..300),
            probes in proptest::collection::vec((0u128..256, 0u128..1 << 26, 0u128..3), 0..50),
        ) {
            // `key group | state id | big-endian u64 user key`: constant bits between the
            // varying key-group bits and the user key's low bytes. Probes also come from
            // other key groups, state ids and larger users (constant bits that differ).
            let key = |kg: u128, state: u128, user: u128| kg << 112 | state << 96 | user << 32;
            let mut prefixes: Vec<u128> = users.iter().map(|&(kg, u)| key(kg, 1, u)).collect();
            prefixes.sort_unstable();
            let probes: Vec<u128> = probes.iter().map(|&(kg, u, s)| key(kg, s, u)).collect();
            check(&prefixes, &probes);
        }
    }

    #[test]
    fn keyed_state_keys_get_a_bucket_per_block() {
        // 128 key groups x 4096 users: interpolating over the whole prefix range used to put
        // each key group in one bucket; gathering the varying bits gives runs of <= 2 blocks.
        let prefixes: Vec<u128> = (0..128u128)
            .flat_map(|kg| (0..4096u128).map(move |u| kg << 112 | 1 << 96 | (u * 37) << 32))
            .collect();
        let offsets: Vec<u64> = (0..prefixes.len() as u64).collect();
        let ix = BlockIndex::new(&offsets, &prefixes);
        for &p in prefixes.iter().step_by(97) {
            let (lo, hi) = ix.candidates(p);
            assert!(hi - lo <= 2, "prefix {p:#x}: candidates {lo}..{hi}");
            assert_eq!(ix.lower_bound(p), prefixes.partition_point(|&x| x < p));
        }
    }
}
