//! What a checkpoint holds of each shard, encoded with rkyv into the metadata's sections and
//! validated when read back (DESIGN invariant 7: bytes from disk are validated).

use rkyv::rancor::Error as RkyvError;
use rkyv::{Archive, Deserialize, Serialize};

/// The error type of decoding from disk: it keeps what failed validation and where in release
/// builds too (`rancor::Error` keeps that only with debug assertions, and said "failed
/// without error information" about a damaged checkpoint). Only failures allocate it.
type DecodeError = rkyv::rancor::BoxedError;

/// A whole file in checkpoint storage (an uploaded segment).
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct FileRefData {
    pub path: String,
    pub size_bytes: u64,
    pub crc32: u32,
}

/// A logical file inside a merged physical file (channel state, small state).
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct LogicalRefData {
    pub physical: String,
    pub offset: u64,
    pub size_bytes: u64,
    pub first_block: u32,
    pub crc32: u32,
}

/// What kind of participant wrote a part.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum PartKind {
    /// A source reader's position.
    Source,
    /// A keyed operator: its store's snapshot handle, the files it uses, and its timers.
    Keyed,
    /// A sink's pre-committed transaction.
    Sink,
    /// A watermark generator's largest timestamp.
    Watermark,
    /// In-flight records of an exchange input, captured by an unaligned checkpoint.
    Channel,
}

impl PartKind {
    /// How `weir checkpoints inspect` and errors name the kind.
    pub fn name(self) -> &'static str {
        match self {
            PartKind::Source => "source",
            PartKind::Keyed => "keyed",
            PartKind::Sink => "sink",
            PartKind::Watermark => "watermark",
            PartKind::Channel => "channel",
        }
    }
}

/// One participant's contribution to a checkpoint.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Part {
    pub operator: String,
    pub kind: PartKind,
    /// Small state, inline.
    pub bytes: Vec<u8>,
    /// Whole files in shared storage.
    pub files: Vec<FileRefData>,
    /// Logical files in merged physical files.
    pub logical: Vec<LogicalRefData>,
}

/// Everything one shard contributed to a checkpoint.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
pub struct ShardSnapshot {
    pub shard: u32,
    pub parts: Vec<Part>,
}

/// The job-wide facts a restore needs.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct JobSnapshot {
    pub shards: u32,
    pub max_parallelism: u16,
    /// [`SECTIONS_VERSION`] of the writer.
    pub format_version: u32,
}

/// The current version of the runtime's sections.
pub const SECTIONS_VERSION: u32 = 1;

/// Section name of the job facts.
pub const JOB_SECTION: &str = "weir/job";

/// Section name of shard `s`.
pub fn shard_section(s: usize) -> String {
    format!("weir/shard-{s:04}")
}

pub fn encode<T>(v: &T) -> Vec<u8>
where
    T: for<'a> Serialize<
        rkyv::api::high::HighSerializer<
            rkyv::util::AlignedVec,
            rkyv::ser::allocator::ArenaHandle<'a>,
            RkyvError,
        >,
    >,
{
    match rkyv::to_bytes::<RkyvError>(v) {
        Ok(b) => b.to_vec(),
        Err(e) => panic!("serializing checkpoint structures into memory cannot fail: {e}"),
    }
}

/// Decodes a section read from disk: copied to aligned memory and validated first.
pub fn decode_shard(bytes: &[u8]) -> Result<ShardSnapshot, String> {
    let mut aligned = rkyv::util::AlignedVec::<16>::with_capacity(bytes.len());
    aligned.extend_from_slice(bytes);
    rkyv::from_bytes::<ShardSnapshot, DecodeError>(&aligned).map_err(|e| e.to_string())
}

/// Decodes any rkyv value read from disk: copied to aligned memory and validated first.
pub fn decode_any<T>(bytes: &[u8]) -> Result<T, String>
where
    T: rkyv::Archive,
    T::Archived: for<'a> rkyv::bytecheck::CheckBytes<rkyv::api::high::HighValidator<'a, DecodeError>>
        + rkyv::Deserialize<T, rkyv::api::high::HighDeserializer<DecodeError>>,
{
    let mut aligned = rkyv::util::AlignedVec::<16>::with_capacity(bytes.len());
    aligned.extend_from_slice(bytes);
    rkyv::from_bytes::<T, DecodeError>(&aligned).map_err(|e| e.to_string())
}

pub fn decode_job(bytes: &[u8]) -> Result<JobSnapshot, String> {
    let mut aligned = rkyv::util::AlignedVec::<16>::with_capacity(bytes.len());
    aligned.extend_from_slice(bytes);
    rkyv::from_bytes::<JobSnapshot, DecodeError>(&aligned).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_snapshot_round_trips_and_rejects_garbage() {
        let s = ShardSnapshot {
            shard: 3,
            parts: vec![Part {
                operator: "sum".into(),
                kind: PartKind::Keyed,
                bytes: vec![1, 2, 3],
                files: vec![FileRefData {
                    path: "shared/x".into(),
                    size_bytes: 10,
                    crc32: 7,
                }],
                logical: vec![],
            }],
        };
        let b = encode(&s);
        assert_eq!(decode_shard(&b).expect("valid"), s);
        let mut bad = b.clone();
        let n = bad.len();
        bad[n - 4..].copy_from_slice(&[0xff; 4]);
        // The error says what failed, in release builds too.
        let e = decode_shard(&bad).expect_err("a pointer out of range");
        assert!(e.contains("pointer"), "{e}");
        assert!(!e.contains("without error information"), "{e}");
        assert!(decode_shard(&b[..n / 2]).is_err());
    }
}
