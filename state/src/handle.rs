//! [`SnapshotHandle`]: what a snapshot of a store consists of, in a stable binary encoding.
//!
//! ```text
//! offset size field
//!      0    4 magic "WSNH"
//!      4    2 version (1)
//!      6    1 checksum algorithm (1 = CRC-32/IEEE)
//!      7    1 reserved 0
//!      8    8 checkpoint id
//!     16    8 next sequence number (list-state element counter)
//!     24    2 max parallelism
//!     26    2 reserved 0
//!     28    4 segment count n
//!     32      n segment records:
//!               segment id u64 | size u64 | crc32 u32 | entry count u64 | flags u8
//!               (bit0 new since the previous snapshot, bit1 has key groups) |
//!               key group first u16 | key group last u16 | path length u16 | path (UTF-8)
//!    end    4 crc32 of everything before
//! ```

use std::path::PathBuf;

use crate::error::StateError;
use crate::key::KeyGroupRange;

const MAGIC: [u8; 4] = *b"WSNH";
const VERSION: u16 = 1;

/// One segment file a snapshot needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentRef {
    pub path: PathBuf,
    pub segment_id: u64,
    pub size_bytes: u64,
    /// CRC-32 of the whole file.
    pub crc32: u32,
    pub entry_count: u64,
    pub key_groups: Option<KeyGroupRange>,
    /// Not part of the previous completed snapshot of this store (incremental upload).
    pub is_new: bool,
}

/// The durable description of one store snapshot: its segments, oldest first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotHandle {
    pub checkpoint_id: u64,
    pub next_seq: u64,
    pub max_parallelism: u16,
    pub segments: Vec<SegmentRef>,
}

impl SnapshotHandle {
    /// Bytes of all segments, and of the new ones only.
    pub fn sizes_bytes(&self) -> (u64, u64) {
        let all = self.segments.iter().map(|s| s.size_bytes).sum();
        let new = self
            .segments
            .iter()
            .filter(|s| s.is_new)
            .map(|s| s.size_bytes)
            .sum();
        (all, new)
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut o = Vec::new();
        o.extend_from_slice(&MAGIC);
        o.extend_from_slice(&VERSION.to_le_bytes());
        o.push(weir_io::CHECKSUM_CRC32_IEEE);
        o.push(0);
        o.extend_from_slice(&self.checkpoint_id.to_le_bytes());
        o.extend_from_slice(&self.next_seq.to_le_bytes());
        o.extend_from_slice(&self.max_parallelism.to_le_bytes());
        o.extend_from_slice(&[0, 0]);
        o.extend_from_slice(&(self.segments.len() as u32).to_le_bytes());
        for s in &self.segments {
            o.extend_from_slice(&s.segment_id.to_le_bytes());
            o.extend_from_slice(&s.size_bytes.to_le_bytes());
            o.extend_from_slice(&s.crc32.to_le_bytes());
            o.extend_from_slice(&s.entry_count.to_le_bytes());
            o.push(u8::from(s.is_new) | (u8::from(s.key_groups.is_some()) << 1));
            let kg = s.key_groups.unwrap_or(KeyGroupRange { first: 0, last: 0 });
            o.extend_from_slice(&kg.first.to_le_bytes());
            o.extend_from_slice(&kg.last.to_le_bytes());
            let path = s.path.to_string_lossy();
            assert!(path.len() <= usize::from(u16::MAX), "segment path too long");
            o.extend_from_slice(&(path.len() as u16).to_le_bytes());
            o.extend_from_slice(path.as_bytes());
        }
        let crc = weir_io::crc32(&[&o]);
        o.extend_from_slice(&crc.to_le_bytes());
        o
    }

    pub fn from_bytes(b: &[u8]) -> Result<SnapshotHandle, StateError> {
        let bad = |offset: usize, reason: &str| StateError::BadHandle {
            offset: offset as u64,
            reason: reason.to_owned(),
        };
        if b.len() < 36 {
            return Err(bad(0, "truncated"));
        }
        if b[..4] != MAGIC {
            return Err(bad(0, "bad magic"));
        }
        let body = &b[..b.len() - 4];
        let want = u32::from_le_bytes(b[b.len() - 4..].try_into().map_err(|_| bad(0, "crc"))?);
        if weir_io::crc32(&[body]) != want {
            return Err(bad(b.len() - 4, "checksum mismatch"));
        }
        if u16::from_le_bytes([b[4], b[5]]) != VERSION {
            return Err(bad(4, "unsupported version"));
        }
        if b[6] != weir_io::CHECKSUM_CRC32_IEEE {
            return Err(bad(6, "unsupported checksum algorithm"));
        }
        // A cell, so that errors can name the offset of the field just read.
        let pos = std::cell::Cell::new(8);
        let take = |n: usize| -> Result<&[u8], StateError> {
            let at = pos.get();
            let s = body.get(at..at + n).ok_or_else(|| bad(at, "truncated"))?;
            pos.set(at + n);
            Ok(s)
        };
        let u64_of = |s: &[u8]| u64::from_le_bytes(s.try_into().unwrap_or([0; 8]));
        let u16_of = |s: &[u8]| u16::from_le_bytes([s[0], s[1]]);
        let checkpoint_id = u64_of(take(8)?);
        let next_seq = u64_of(take(8)?);
        let max_parallelism = u16_of(take(2)?);
        take(2)?;
        let n = u32::from_le_bytes(take(4)?.try_into().unwrap_or([0; 4]));
        let mut segments = Vec::new();
        for _ in 0..n {
            let segment_id = u64_of(take(8)?);
            let size_bytes = u64_of(take(8)?);
            let crc32 = u32::from_le_bytes(take(4)?.try_into().unwrap_or([0; 4]));
            let entry_count = u64_of(take(8)?);
            let flags_at = pos.get();
            let flags = take(1)?[0];
            if flags & !3 != 0 {
                return Err(bad(flags_at, "unknown segment flag bits"));
            }
            let range_at = pos.get();
            let first = u16_of(take(2)?);
            let last = u16_of(take(2)?);
            let plen = usize::from(u16_of(take(2)?));
            let path_at = pos.get();
            let path =
                std::str::from_utf8(take(plen)?).map_err(|_| bad(path_at, "path is not UTF-8"))?;
            let key_groups = if flags & 2 != 0 {
                if first > last {
                    return Err(bad(range_at, "empty key group range"));
                }
                Some(KeyGroupRange { first, last })
            } else if entry_count > 0 {
                // A restore skips a segment without key groups as empty: entries without a
                // range would be dropped without a word.
                return Err(bad(
                    flags_at,
                    "a segment with entries has no key group range",
                ));
            } else {
                None
            };
            segments.push(SegmentRef {
                path: PathBuf::from(path),
                segment_id,
                size_bytes,
                crc32,
                entry_count,
                key_groups,
                is_new: flags & 1 != 0,
            });
        }
        if pos.get() != body.len() {
            return Err(bad(pos.get(), "trailing bytes"));
        }
        Ok(SnapshotHandle {
            checkpoint_id,
            next_seq,
            max_parallelism,
            segments,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_corruption() {
        let h = SnapshotHandle {
            checkpoint_id: 9,
            next_seq: 77,
            max_parallelism: 128,
            segments: vec![SegmentRef {
                path: PathBuf::from("/x/seg-1.wseg"),
                segment_id: 1,
                size_bytes: 4096,
                crc32: 0xdead_beef,
                entry_count: 12,
                key_groups: Some(KeyGroupRange::new(3, 9)),
                is_new: true,
            }],
        };
        let b = h.to_bytes();
        assert_eq!(SnapshotHandle::from_bytes(&b).unwrap(), h);
        for i in 0..b.len() {
            let mut c = b.clone();
            c[i] ^= 0x10;
            assert!(
                SnapshotHandle::from_bytes(&c).is_err(),
                "flip at {i} undetected"
            );
        }
        for cut in 0..b.len() {
            assert!(SnapshotHandle::from_bytes(&b[..cut]).is_err());
        }
    }

    /// Fields changed with the CRC written again: a segment with entries but no key-group
    /// range (a restore skipped it as empty, losing its entries without an error), unknown
    /// flag bits and an empty range are errors at the field's offset.
    #[test]
    fn forged_segment_flags_are_errors_at_their_offset() {
        let h = SnapshotHandle {
            checkpoint_id: 9,
            next_seq: 77,
            max_parallelism: 128,
            segments: vec![SegmentRef {
                path: PathBuf::from("seg-1.wseg"),
                segment_id: 1,
                size_bytes: 4096,
                crc32: 7,
                entry_count: 48,
                key_groups: Some(KeyGroupRange::new(0, 7)),
                is_new: true,
            }],
        };
        let b = h.to_bytes();
        // Header 8, checkpoint id and next seq 16, max parallelism and reserved 4, count 4;
        // then the segment's id 8, size 8, CRC 4, entries 8: its flags.
        let flags_at = 8 + 16 + 4 + 4 + 28;
        assert_eq!(b[flags_at], 3);
        let forge = |at: usize, byte: u8| {
            let mut c = b.clone();
            c[at] = byte;
            let n = c.len() - 4;
            let crc = weir_io::crc32(&[&c[..n]]);
            c[n..].copy_from_slice(&crc.to_le_bytes());
            SnapshotHandle::from_bytes(&c)
        };
        let offset = |r: Result<SnapshotHandle, StateError>| match r {
            Err(StateError::BadHandle { offset, reason }) => (offset, reason),
            other => panic!("{other:?}"),
        };
        let (at, why) = offset(forge(flags_at, 1));
        assert_eq!(at, flags_at as u64, "{why}");
        assert!(why.contains("no key group range"), "{why}");
        assert_eq!(offset(forge(flags_at, 0x13)).0, flags_at as u64);
        // first (0) above last: the range's own offset.
        assert_eq!(offset(forge(flags_at + 1, 9)).0, flags_at as u64 + 1);
        // Without entries, no range is fine (an empty segment).
        let empty = SnapshotHandle {
            segments: vec![SegmentRef {
                entry_count: 0,
                key_groups: None,
                ..h.segments[0].clone()
            }],
            ..h.clone()
        };
        assert_eq!(
            SnapshotHandle::from_bytes(&empty.to_bytes()).unwrap(),
            empty
        );
    }
}
