//! Checksummed block framing shared by weir's formats.
//!
//! A block is a 24-byte header followed by the payload. The CRC covers the header's first 20
//! bytes and the payload, so a stale or misdirected block (valid CRC, wrong place) is caught by
//! comparing the header's file id and block index with what the reader expects.
//!
//! ```text
//! offset size field
//!      0    8 file id          u64 LE (segment id, checkpoint id, ...)
//!      8    4 block index      u32 LE (position of the block in its file)
//!     12    1 kind             u8     (format specific)
//!     13    1 checksum algo    u8     (1 = CRC-32/IEEE, crc32fast)
//!     14    2 reserved         0
//!     16    4 payload length   u32 LE
//!     20    4 crc32            u32 LE over bytes 0..20 of the header, then the payload
//!     24    n payload
//! ```

use std::path::Path;

use crate::error::FormatError;

/// The checksum-algorithm byte for CRC-32/IEEE (crc32fast; check value 0xcbf43926).
pub const CHECKSUM_CRC32_IEEE: u8 = 1;
/// Size of a block header.
pub const BLOCK_HEADER_LEN: usize = 24;

/// CRC-32/IEEE over the concatenation of `parts`.
pub fn crc32(parts: &[&[u8]]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    for p in parts {
        h.update(p);
    }
    h.finalize()
}

/// A decoded block header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHeader {
    pub file_id: u64,
    pub block_index: u32,
    pub kind: u8,
    pub payload_len: u32,
}

/// Append a framed block (`header | payload`) to `out`.
pub fn encode_block(out: &mut Vec<u8>, header: BlockHeader, payload: &[u8]) {
    assert_eq!(header.payload_len as usize, payload.len(), "payload length");
    let start = out.len();
    out.extend_from_slice(&header.file_id.to_le_bytes());
    out.extend_from_slice(&header.block_index.to_le_bytes());
    out.push(header.kind);
    out.push(CHECKSUM_CRC32_IEEE);
    out.extend_from_slice(&[0, 0]);
    out.extend_from_slice(&header.payload_len.to_le_bytes());
    let crc = crc32(&[&out[start..start + 20], payload]);
    out.extend_from_slice(&crc.to_le_bytes());
    out.extend_from_slice(payload);
}

/// Decode and verify the block starting at `bytes[0]`, which sits at `offset` in `file`.
/// Checks the checksum byte, the length, the CRC, and that the header names `expect` (file id,
/// block index, kind). Returns the payload.
pub fn decode_block<'a>(
    file: &Path,
    bytes: &'a [u8],
    offset: u64,
    expect: BlockHeader,
) -> Result<&'a [u8], FormatError> {
    if bytes.len() < BLOCK_HEADER_LEN {
        return Err(FormatError::Truncated {
            file: file.to_owned(),
            offset,
            needed: BLOCK_HEADER_LEN as u64,
            available: bytes.len() as u64,
        });
    }
    let algo = bytes[13];
    if algo != CHECKSUM_CRC32_IEEE {
        return Err(FormatError::UnsupportedChecksum {
            file: file.to_owned(),
            offset: offset + 13,
            found: algo,
        });
    }
    let len = u32::from_le_bytes([bytes[16], bytes[17], bytes[18], bytes[19]]) as usize;
    // A caller that knows the length (from an index, or metadata) learns of a damaged length
    // field here, named as such: past the end of the file it read as a truncated file ("need
    // 4278191176 bytes"), which it is not.
    if expect.payload_len != u32::MAX && len as u64 != u64::from(expect.payload_len) {
        return Err(FormatError::Malformed {
            file: file.to_owned(),
            offset: offset + 16,
            reason: format!(
                "the block's payload length field says {len} bytes where {} are expected (a \
                 damaged header, or not the block that belongs here)",
                expect.payload_len
            ),
        });
    }
    let available = bytes.len() - BLOCK_HEADER_LEN;
    if len > available {
        return Err(FormatError::Truncated {
            file: file.to_owned(),
            offset: offset + BLOCK_HEADER_LEN as u64,
            needed: len as u64,
            available: available as u64,
        });
    }
    let payload = &bytes[BLOCK_HEADER_LEN..BLOCK_HEADER_LEN + len];
    let expected = u32::from_le_bytes([bytes[20], bytes[21], bytes[22], bytes[23]]);
    let actual = crc32(&[&bytes[..20], payload]);
    if expected != actual {
        return Err(FormatError::ChecksumMismatch {
            file: file.to_owned(),
            offset,
            expected,
            actual,
        });
    }
    let mut id = [0u8; 8];
    id.copy_from_slice(&bytes[0..8]);
    let file_id = u64::from_le_bytes(id);
    let block_index = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
    let checks = [
        ("file id", expect.file_id, file_id),
        (
            "block index",
            u64::from(expect.block_index),
            u64::from(block_index),
        ),
        ("block kind", u64::from(expect.kind), u64::from(bytes[12])),
        ("payload length", u64::from(expect.payload_len), len as u64),
    ];
    for (i, (field, want, got)) in checks.into_iter().enumerate() {
        // payload_len u32::MAX in `expect` means "any length".
        if i == 3 && expect.payload_len == u32::MAX {
            continue;
        }
        if want != got {
            return Err(FormatError::Misdirected {
                file: file.to_owned(),
                offset,
                field,
                expected: want,
                found: got,
            });
        }
    }
    Ok(payload)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hdr(len: u32) -> BlockHeader {
        BlockHeader {
            file_id: 7,
            block_index: 3,
            kind: 1,
            payload_len: len,
        }
    }

    #[test]
    fn crc_is_ieee() {
        assert_eq!(crc32(&[b"123456789"]), 0xcbf4_3926);
        assert_eq!(crc32(&[b"1234", b"56789"]), 0xcbf4_3926);
    }

    #[test]
    fn round_trip_and_every_flip_detected() {
        let mut buf = Vec::new();
        encode_block(&mut buf, hdr(5), b"hello");
        let f = Path::new("f");
        assert_eq!(decode_block(f, &buf, 100, hdr(u32::MAX)).unwrap(), b"hello");
        for i in 0..buf.len() {
            for bit in 0..8 {
                let mut b = buf.clone();
                b[i] ^= 1 << bit;
                let err = decode_block(f, &b, 100, hdr(u32::MAX)).unwrap_err();
                assert_eq!(err.file(), f);
                assert!(err.offset() >= 100 && err.offset() < 100 + buf.len() as u64);
            }
        }
        for cut in 0..buf.len() {
            assert!(decode_block(f, &buf[..cut], 0, hdr(u32::MAX)).is_err());
        }
    }

    /// A damaged length field is named as one (at its offset), not as a truncated file.
    #[test]
    fn a_length_field_unlike_the_expected_is_named() {
        let mut buf = Vec::new();
        encode_block(&mut buf, hdr(5), b"hello");
        buf[18] ^= 0xff;
        let e = decode_block(Path::new("f"), &buf, 100, hdr(5)).unwrap_err();
        assert!(
            matches!(&e, FormatError::Malformed { offset: 116, reason, .. }
                if reason.contains("payload length field says 16711685 bytes where 5")),
            "{e}"
        );
        // A block cut short under an intact header is still a truncated one.
        let mut buf = Vec::new();
        encode_block(&mut buf, hdr(5), b"hello");
        let e = decode_block(Path::new("f"), &buf[..26], 100, hdr(5)).unwrap_err();
        assert!(
            matches!(
                e,
                FormatError::Truncated {
                    offset: 124,
                    needed: 5,
                    available: 2,
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn misdirected_block_is_rejected() {
        let mut buf = Vec::new();
        encode_block(&mut buf, hdr(2), b"ab");
        let mut other = hdr(u32::MAX);
        other.block_index = 4;
        assert!(matches!(
            decode_block(Path::new("f"), &buf, 0, other),
            Err(FormatError::Misdirected {
                field: "block index",
                ..
            })
        ));
    }
}
