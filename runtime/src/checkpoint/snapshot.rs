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
    /// An operator's watermark: a timestamp assigner's largest timestamp and the watermark
    /// it sent (two `i64`, little-endian), or a keyed operator's watermark (one).
    Watermark,
    /// In-flight records of an exchange input, captured by an unaligned checkpoint, with the
    /// watermark and idleness frames among them (checkpoints written before those were kept
    /// hold the records alone, and restore as they did).
    Channel,
    /// An exchange input's watermark valve (its per-input watermarks) when it took an
    /// unaligned checkpoint: what its channel state is replayed on top of. Inline bytes,
    /// little-endian: `version u8 = 1 | emitted i64 | inputs u32 | inputs × (watermark i64 |
    /// flags u8: bit 0 idle, bit 1 aligned)`.
    Valve,
    /// A keyed operator's states: each one's id, name, and kind and value type
    /// (`value<u64>`), an rkyv archive of `backend::StateTypesPart`. A restore refuses a state
    /// used as another kind or value type (`StateError::RestoredTypeMismatch`).
    StateTypes,
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
            PartKind::Valve => "valve",
            PartKind::StateTypes => "state-types",
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

/// The runtime's sections of a checkpoint's metadata, decoded and checked against each other.
#[derive(Debug)]
pub struct Sections {
    pub job: JobSnapshot,
    /// Shard `s` is `shards[s]`, from section [`shard_section`]`(s)`.
    pub shards: Vec<ShardSnapshot>,
}

/// What is wrong with one of the runtime's sections of a checkpoint's metadata. Displayed as
/// `_metadata section <name>: <problem>`; a restore puts the checkpoint id in front.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SectionError {
    pub section: String,
    pub problem: String,
}

impl std::fmt::Display for SectionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} section {}: {}",
            weir_io::METADATA_FILE,
            self.section,
            self.problem
        )
    }
}

/// The shard whose section is named `name`, if `name` is [`shard_section`] of one (exactly:
/// `weir/shard-1` and `weir/shard-+0001` are not shard 1's name).
fn shard_of_section(name: &str) -> Option<usize> {
    let s: usize = name.strip_prefix("weir/shard-")?.parse().ok()?;
    (shard_section(s) == name).then_some(s)
}

/// Decodes the runtime's sections (those named `weir/...`) of a checkpoint's metadata and
/// checks what the metadata's CRC cannot: a forged or corrupt checkpoint with valid CRCs.
/// The job section's `format_version` is [`SECTIONS_VERSION`] (the only version there has
/// been), `1 <= shards <= max_parallelism` (what a job's configuration allows), the shard
/// sections are exactly `0..shards`, each once, and each says it is its own shard. Without
/// these a lowered `shards` dropped the state of the shards past it and restored a job with
/// wrong results, and a version this build never wrote was read as its own.
pub fn decode_sections(sections: &[(String, Vec<u8>)]) -> Result<Sections, SectionError> {
    let err = |section: &str, problem: String| SectionError {
        section: section.to_owned(),
        problem,
    };
    let mut job_bytes = None;
    // Indexed by the sections present, never by a count from the file (a forged one asked
    // for 4 G shards, which aborted the process when it sized an allocation).
    let mut shard_bytes = std::collections::BTreeMap::new();
    for (name, bytes) in sections {
        // Other sections are not the runtime's.
        if !name.starts_with("weir/") {
            continue;
        }
        // Storage keeps sections in a list: a second one of a name would be ignored.
        let first = if name == JOB_SECTION {
            job_bytes.replace(bytes.as_slice()).is_none()
        } else if let Some(s) = shard_of_section(name) {
            shard_bytes.insert(s, bytes.as_slice()).is_none()
        } else {
            return Err(err(
                name,
                format!("not one of the runtime's sections ({JOB_SECTION}, weir/shard-NNNN)"),
            ));
        };
        if !first {
            return Err(err(name, "appears more than once".into()));
        }
    }
    let job_bytes = job_bytes.ok_or_else(|| err(JOB_SECTION, "missing".into()))?;
    let job = decode_job(job_bytes).map_err(|e| err(JOB_SECTION, e))?;
    // First: what the other fields mean depends on it.
    if job.format_version != SECTIONS_VERSION {
        return Err(err(
            JOB_SECTION,
            format!(
                "field format_version is {}; this build reads version {SECTIONS_VERSION}",
                job.format_version
            ),
        ));
    }
    if job.shards == 0 {
        return Err(err(
            JOB_SECTION,
            "field shards is 0; a checkpoint has at least one shard".into(),
        ));
    }
    if job.shards > u32::from(job.max_parallelism) {
        return Err(err(
            JOB_SECTION,
            format!(
                "field shards is {}, more than field max_parallelism {} (a job has at most \
                 one shard per key group)",
                job.shards, job.max_parallelism
            ),
        ));
    }
    let shards = job.shards as usize;
    if let Some((&extra, _)) = shard_bytes.range(shards..).next() {
        return Err(err(
            &shard_section(extra),
            format!(
                "not a shard of the checkpoint: field shards of section {JOB_SECTION} is {shards}"
            ),
        ));
    }
    // All keys are below `shards`: one is missing iff there are fewer, and then the first
    // gap is within the first `len + 1` indexes.
    if shard_bytes.len() < shards {
        let missing = (0..shards)
            .zip(shard_bytes.keys())
            .find(|(s, k)| s != *k)
            .map_or(shard_bytes.len(), |(s, _)| s);
        return Err(err(
            &shard_section(missing),
            format!("missing: field shards of section {JOB_SECTION} is {shards}"),
        ));
    }
    let mut decoded = Vec::new();
    for (s, bytes) in shard_bytes {
        let name = shard_section(s);
        let snap = decode_shard(bytes).map_err(|e| err(&name, e))?;
        // Restore takes a shard's index from its section; the two must agree.
        if snap.shard as usize != s {
            return Err(err(
                &name,
                format!("field shard is {}; the section is shard {s}'s", snap.shard),
            ));
        }
        decoded.push(snap);
    }
    Ok(Sections {
        job,
        shards: decoded,
    })
}

/// [`decode_sections`] of `m`'s sections, then every file a part references checked against
/// the metadata's own file lists ([`check_references`]): what a restore, `weir checkpoints
/// verify` and `inspect` read.
pub fn decode_metadata(m: &weir_io::CheckpointMetadata) -> Result<Sections, SectionError> {
    let sections = decode_sections(&m.sections)?;
    check_references(&sections, &m.files, &m.logical_files)?;
    Ok(sections)
}

/// Checks that every file a shard's parts reference (whole files, logical files, and those
/// that a keyed or channel part's own bytes name, which its restore reads) is one the
/// metadata lists, with the same size and CRC. Verification reads the listed files only and
/// garbage collection keeps only those, so a reference past the lists (a forged metadata
/// with its CRC written again) named a file nobody had verified and that `retain` may delete.
pub fn check_references(
    sections: &Sections,
    files: &[weir_io::FileRef],
    logical: &[weir_io::LogicalFileRef],
) -> Result<(), SectionError> {
    let files: std::collections::HashSet<&weir_io::FileRef> = files.iter().collect();
    let logical: std::collections::HashSet<&weir_io::LogicalFileRef> = logical.iter().collect();
    let listed_file = |section: &str, p: &Part, f: &FileRefData| {
        if files.contains(&super::store::to_ref(f)) {
            return Ok(());
        }
        Err(SectionError {
            section: section.to_owned(),
            problem: format!(
                "part {} ({}) references file {} ({} bytes, crc {:08x}), which the \
                 metadata's list of files does not name",
                p.operator,
                p.kind.name(),
                f.path,
                f.size_bytes,
                f.crc32
            ),
        })
    };
    let listed_logical = |section: &str, p: &Part, l: &LogicalRefData| {
        if logical.contains(&super::store::to_logical(l)) {
            return Ok(());
        }
        Err(SectionError {
            section: section.to_owned(),
            problem: format!(
                "part {} ({}) references logical file {} at offset {} ({} bytes, crc {:08x}), \
                 which the metadata's list of logical files does not name",
                p.operator,
                p.kind.name(),
                l.physical,
                l.offset,
                l.size_bytes,
                l.crc32
            ),
        })
    };
    for (s, snap) in sections.shards.iter().enumerate() {
        let section = shard_section(s);
        for p in &snap.parts {
            for f in &p.files {
                listed_file(&section, p, f)?;
            }
            for l in &p.logical {
                listed_logical(&section, p, l)?;
            }
            // The references a restore reads are those inside the part's own bytes.
            let bad_bytes = |e: String| SectionError {
                section: section.clone(),
                problem: format!("part {} ({}): {e}", p.operator, p.kind.name()),
            };
            match p.kind {
                PartKind::Channel => {
                    let c: super::ChannelPart = decode_any(&p.bytes).map_err(bad_bytes)?;
                    for (_, l) in &c.inputs {
                        listed_logical(&section, p, l)?;
                    }
                }
                PartKind::Keyed => {
                    let k: crate::backend::KeyedPart = decode_any(&p.bytes).map_err(bad_bytes)?;
                    for (_, f) in &k.segments {
                        listed_file(&section, p, f)?;
                    }
                }
                PartKind::Source
                | PartKind::Sink
                | PartKind::Watermark
                | PartKind::Valve
                | PartKind::StateTypes => {}
            }
        }
    }
    Ok(())
}

/// A checkpoint's metadata of `sections` listing `files` and `logical`, for tests of what
/// reads it.
#[cfg(test)]
pub(crate) fn metadata_for_test(
    checkpoint_id: u64,
    sections: Vec<(String, Vec<u8>)>,
    files: Vec<weir_io::FileRef>,
    logical_files: Vec<weir_io::LogicalFileRef>,
) -> weir_io::CheckpointMetadata {
    weir_io::CheckpointMetadata {
        job_id: "job".into(),
        checkpoint_id,
        kind: weir_io::CheckpointKind::Checkpoint,
        trigger_timestamp_ms: 0,
        completion_timestamp_ms: 0,
        new_bytes: 0,
        files,
        logical_files,
        sections,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Logical files are checked as whole files are: those of a part's list, and those a
    /// channel part's own bytes name (its restore reads those), each field compared.
    #[test]
    fn logical_files_a_part_or_its_channel_state_names_must_be_listed() {
        let l = LogicalRefData {
            physical: "taskowned/3-00000000000000a1-merged".into(),
            offset: 40,
            size_bytes: 100,
            first_block: 0,
            crc32: 9,
        };
        let listed = vec![super::super::store::to_logical(&l)];
        let job = JobSnapshot {
            shards: 1,
            max_parallelism: 128,
            format_version: SECTIONS_VERSION,
        };
        let channel = |inputs: Vec<(u32, LogicalRefData)>, logical| Part {
            operator: "exchange".into(),
            kind: PartKind::Channel,
            bytes: encode(&super::super::ChannelPart { inputs }),
            files: Vec::new(),
            logical,
        };
        let check = |part: Part, logical: &[weir_io::LogicalFileRef]| {
            let shard = ShardSnapshot {
                shard: 0,
                parts: vec![part],
            };
            let sections = vec![
                (JOB_SECTION.to_string(), encode(&job)),
                (shard_section(0), encode(&shard)),
            ];
            decode_metadata(&metadata_for_test(
                1,
                sections,
                Vec::new(),
                logical.to_vec(),
            ))
        };
        check(channel(vec![(0, l.clone())], vec![l.clone()]), &listed).expect("listed");
        let e = check(channel(vec![(0, l.clone())], vec![l.clone()]), &[]).expect_err("unlisted");
        assert_eq!(e.section, "weir/shard-0000");
        assert_eq!(
            e.problem,
            "part exchange (channel) references logical file \
             taskowned/3-00000000000000a1-merged at offset 40 (100 bytes, crc 00000009), which \
             the metadata's list of logical files does not name"
        );
        // Named only inside the channel part's bytes, another block of the same file.
        let other = LogicalRefData {
            first_block: 1,
            ..l.clone()
        };
        let e = check(channel(vec![(0, other)], vec![l.clone()]), &listed)
            .expect_err("a channel input off the list");
        assert!(e.problem.contains("logical file taskowned/"), "{e}");
        let garbage = Part {
            bytes: vec![0xff; 3],
            ..channel(Vec::new(), Vec::new())
        };
        let e = check(garbage, &listed).expect_err("channel bytes that do not decode");
        assert!(e.problem.starts_with("part exchange (channel): "), "{e}");
    }

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
