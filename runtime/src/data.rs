//! The record contract: what a type needs to flow through weir.
//!
//! Records that cross shards are serialized once, with rkyv, straight into ring memory; the
//! consumer reads the archived bytes in place and, where a user function takes the record by
//! value, materializes it with rkyv's deserializer (a field copy for plain data, no allocation).
//! Records that stay on one shard are passed as plain values.

use rkyv::api::high::{HighDeserializer, HighSerializer, HighValidator};
use rkyv::bytecheck::CheckBytes;
use rkyv::rancor::Error as RkyvError;
use rkyv::ser::allocator::{Arena, ArenaHandle};
use rkyv::ser::sharing::Share;
use rkyv::ser::writer::Buffer;
use rkyv::ser::Serializer;
use rkyv::util::AlignedVec;
use rkyv::{Archive, Deserialize, Serialize};

/// The error type of validating bytes from outside the process: it says what failed and
/// where in release builds too (`rancor::Error` does only with debug assertions, and said
/// "failed without error information"). Only failures allocate it.
pub type ValidateError = rkyv::rancor::BoxedError;

/// A type that can be a record of a stream: derive `rkyv::Archive`, `rkyv::Serialize`,
/// `rkyv::Deserialize` and `Clone`. Implemented for every such type.
pub trait Data:
    Archive<
        Archived: Deserialize<Self, HighDeserializer<RkyvError>>
                      + for<'a> CheckBytes<HighValidator<'a, ValidateError>>,
    > + for<'a, 'b> Serialize<HighSerializer<Buffer<'b>, ArenaHandle<'a>, RkyvError>>
    + for<'a> Serialize<HighSerializer<AlignedVec<16>, ArenaHandle<'a>, RkyvError>>
    + Clone
    + Send
    + 'static
{
}

impl<T> Data for T where
    T: Archive<
            Archived: Deserialize<T, HighDeserializer<RkyvError>>
                          + for<'a> CheckBytes<HighValidator<'a, ValidateError>>,
        > + for<'a, 'b> Serialize<HighSerializer<Buffer<'b>, ArenaHandle<'a>, RkyvError>>
        + for<'a> Serialize<HighSerializer<AlignedVec<16>, ArenaHandle<'a>, RkyvError>>
        + Clone
        + Send
        + 'static
{
}

/// Serializes `value` into `out`, which must start 16-aligned, with the caller's scratch
/// `arena` (rkyv's `to_bytes_in` looks a thread-local one up per call: 2.4% of the keyed
/// count's shard time). Returns the number of bytes written, or `None` when `out` is too
/// small (the caller retries with more room).
#[inline]
pub(crate) fn serialize_into<T: Data>(
    value: &T,
    out: &mut [u8],
    arena: &mut Arena,
) -> Option<usize> {
    // `to_bytes_in_with_alloc`, spelled out so that it is inlined here (called, it reloaded
    // the arena handle its caller had just stored in pieces: a missed store forward).
    let mut ser = Serializer::new(Buffer::from(out), arena.acquire(), Share::new());
    rkyv::api::serialize_using::<_, RkyvError>(value, &mut ser).ok()?;
    Some(ser.into_writer().len())
}

/// Reads a record that this process serialized into ring memory.
///
/// # Safety
/// `bytes` must be exactly the bytes that [`serialize_into`] wrote for a `T`, in memory this
/// process owns, starting 16-aligned (DESIGN invariant 7: our own memory is not validated).
#[inline]
pub(crate) unsafe fn read_trusted<T: Data>(bytes: &[u8]) -> T {
    // SAFETY: the caller guarantees that `bytes` holds an archived `T` we wrote, aligned.
    let archived = unsafe { rkyv::access_unchecked::<rkyv::Archived<T>>(bytes) };
    match rkyv::deserialize::<T, RkyvError>(archived) {
        Ok(v) => v,
        // Deserializing data we serialized ourselves fails only on allocation failure.
        Err(e) => panic!("deserializing a record this process wrote failed: {e}"),
    }
}

/// Reads a record from bytes that came from outside this process (disk, another process):
/// validated first.
pub(crate) fn read_validated<T: Data>(bytes: &[u8]) -> Result<T, ValidateError> {
    let archived = rkyv::access::<rkyv::Archived<T>, ValidateError>(bytes)?;
    rkyv::deserialize::<T, RkyvError>(archived).map_err(rkyv::rancor::Source::new)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq)]
    struct Bid {
        auction: u64,
        bidder: u64,
        price: u64,
        url: String,
    }

    #[repr(C, align(16))]
    struct Aligned([u8; 256]);

    #[test]
    fn round_trip_in_place_and_validated() {
        let bid = Bid {
            auction: 7,
            bidder: 9,
            price: 1234,
            url: "https://example.com/x".into(),
        };
        let mut buf = Aligned([0; 256]);
        let n = serialize_into(&bid, &mut buf.0, &mut Arena::new()).expect("fits");
        // SAFETY: we just serialized a `Bid` into this aligned buffer.
        let back: Bid = unsafe { read_trusted(&buf.0[..n]) };
        assert_eq!(back, bid);
        let checked: Bid = read_validated(&buf.0[..n]).expect("valid");
        assert_eq!(checked, bid);
    }

    #[test]
    fn too_small_buffer_is_none_not_panic() {
        let mut buf = Aligned([0; 256]);
        assert!(serialize_into(&"x".repeat(1000), &mut buf.0, &mut Arena::new()).is_none());
    }

    #[test]
    fn corrupt_bytes_are_rejected_when_validated() {
        let mut buf = Aligned([0; 256]);
        let n = serialize_into(
            &"a string too long to be inlined".to_string(),
            &mut buf.0,
            &mut Arena::new(),
        )
        .expect("fits");
        // Point the string's relative offset far outside the buffer.
        for b in &mut buf.0[n - 4..n] {
            *b = 0x7f;
        }
        let e = read_validated::<String>(&buf.0[..n]).expect_err("offset out of range");
        // What failed, in release builds too.
        let e = e.to_string();
        assert!(e.contains("pointer"), "{e}");
        assert!(!e.contains("without error information"), "{e}");
    }

    #[test]
    fn golden_bytes_of_archived_u64_pair() {
        // The archived layout is what rings and state carry: pin it (little-endian, no padding).
        let mut buf = Aligned([0; 256]);
        let n = serialize_into(&(1u64, 2u64), &mut buf.0, &mut Arena::new()).expect("fits");
        assert_eq!(
            &buf.0[..n],
            &[1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0]
        );
    }
}
