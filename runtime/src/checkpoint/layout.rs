//! A checkpoint's runtime sections, decoded for reading (`weir checkpoints inspect`): the
//! job's shape and what every participant of every shard put into the checkpoint.

use super::snapshot::{decode_metadata, Sections};

/// What a checkpoint's runtime sections say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointLayout {
    /// Shards of the job that took the checkpoint.
    pub shards: u32,
    /// Its key-group count: a restore needs the same.
    pub max_parallelism: u16,
    /// Version of the runtime's section encoding.
    pub format_version: u32,
    /// Every part, shard by shard, in the order the shard reported them.
    pub parts: Vec<PartLayout>,
}

/// One participant's part of a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartLayout {
    pub shard: u32,
    /// The operator's uid.
    pub operator: String,
    /// `source`, `keyed`, `sink`, `watermark` or `channel`.
    pub kind: &'static str,
    /// Bytes of small state held inline in the metadata.
    pub inline_bytes: u64,
    /// Whole files in `shared/` (path relative to the job directory, content bytes).
    pub files: Vec<(String, u64)>,
    /// Logical files inside merged physical files (physical path, content bytes).
    pub logical: Vec<(String, u64)>,
}

/// Decodes (and validates, as a restore does) the runtime's sections of a checkpoint's
/// metadata. An error names the section that is missing, does not decode, disagrees with
/// another, or references a file the metadata's file lists do not name.
pub fn layout(m: &weir_io::CheckpointMetadata) -> Result<CheckpointLayout, String> {
    let Sections { job, shards } = decode_metadata(m).map_err(|e| e.to_string())?;
    let mut parts = Vec::new();
    for (s, snap) in shards.into_iter().enumerate() {
        parts.extend(snap.parts.into_iter().map(|p| {
            PartLayout {
                shard: s as u32,
                operator: p.operator,
                kind: p.kind.name(),
                inline_bytes: p.bytes.len() as u64,
                files: p
                    .files
                    .into_iter()
                    .map(|f| (f.path, f.size_bytes))
                    .collect(),
                logical: p
                    .logical
                    .into_iter()
                    .map(|l| (l.physical, l.size_bytes))
                    .collect(),
            }
        }));
    }
    Ok(CheckpointLayout {
        shards: job.shards,
        max_parallelism: job.max_parallelism,
        format_version: job.format_version,
        parts,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::snapshot::{
        encode, metadata_for_test, shard_section, FileRefData, JobSnapshot, Part, PartKind,
        ShardSnapshot, JOB_SECTION, SECTIONS_VERSION,
    };

    #[test]
    fn layout_lists_every_shards_parts_and_names_a_missing_or_bad_section() {
        let job = JobSnapshot {
            shards: 2,
            max_parallelism: 128,
            format_version: SECTIONS_VERSION,
        };
        let part = |operator: &str, kind, files: Vec<FileRefData>| Part {
            operator: operator.into(),
            kind,
            bytes: vec![1, 2, 3],
            files,
            logical: Vec::new(),
        };
        let seg = FileRefData {
            path: "shared/1-x-seg".into(),
            size_bytes: 4096,
            crc32: 7,
        };
        // A keyed part's bytes name its segments' files too (what its restore reads).
        let keyed = crate::backend::KeyedPart {
            handle: Vec::new(),
            segments: vec![(1, seg.clone())],
            timers: Vec::new(),
        };
        let keyed_bytes = encode(&keyed);
        let s0 = ShardSnapshot {
            shard: 0,
            parts: vec![
                part("input", PartKind::Source, Vec::new()),
                Part {
                    bytes: keyed_bytes.clone(),
                    ..part("sum", PartKind::Keyed, vec![seg.clone()])
                },
            ],
        };
        let s1 = ShardSnapshot {
            shard: 1,
            parts: vec![part("input", PartKind::Source, Vec::new())],
        };
        let mut sections = vec![
            (JOB_SECTION.to_string(), encode(&job)),
            (shard_section(0), encode(&s0)),
            (shard_section(1), encode(&s1)),
        ];
        let listed = vec![crate::checkpoint::store::to_ref(&seg)];
        let meta = |sections: &[(String, Vec<u8>)]| {
            metadata_for_test(1, sections.to_vec(), listed.clone(), Vec::new())
        };
        let l = layout(&meta(&sections)).expect("layout");
        assert_eq!((l.shards, l.max_parallelism), (2, 128));
        let got: Vec<_> = l
            .parts
            .iter()
            .map(|p| (p.shard, p.operator.as_str(), p.kind, p.inline_bytes))
            .collect();
        assert_eq!(
            got,
            vec![
                (0, "input", "source", 3),
                (0, "sum", "keyed", keyed_bytes.len() as u64),
                (1, "input", "source", 3)
            ]
        );
        assert_eq!(l.parts[1].files, vec![("shared/1-x-seg".to_string(), 4096)]);

        // A part's file must be listed, with its size and CRC: verification and GC go by
        // the list.
        let unlisted = metadata_for_test(1, sections.clone(), Vec::new(), Vec::new());
        let e = layout(&unlisted).expect_err("a file the metadata does not list");
        assert_eq!(
            e,
            "_metadata section weir/shard-0000: part sum (keyed) references file \
             shared/1-x-seg (4096 bytes, crc 00000007), which the metadata's list of files \
             does not name"
        );
        let mut other_crc = listed.clone();
        other_crc[0].crc32 = 8;
        let e = layout(&metadata_for_test(
            1,
            sections.clone(),
            other_crc,
            Vec::new(),
        ))
        .expect_err("a file listed with another CRC");
        assert!(e.contains("shared/1-x-seg"), "{e}");
        // Named only inside the keyed part's bytes, which its restore reads.
        let elsewhere = FileRefData {
            path: "shared/2-y-seg".into(),
            ..seg.clone()
        };
        let mut forged = s0.clone();
        forged.parts[1].bytes = encode(&crate::backend::KeyedPart {
            segments: vec![(1, elsewhere)],
            ..keyed
        });
        let mut with_forged = sections.clone();
        with_forged[1].1 = encode(&forged);
        let e = layout(&meta(&with_forged)).expect_err("a segment file off the list");
        assert!(
            e.contains("part sum (keyed) references file shared/2-y-seg"),
            "{e}"
        );

        sections[2].1.truncate(3);
        let e = layout(&meta(&sections)).expect_err("bad section");
        assert!(e.contains("weir/shard-0001"), "{e}");
        sections.pop();
        let e = layout(&meta(&sections)).expect_err("missing section");
        assert_eq!(
            e,
            "_metadata section weir/shard-0001: missing: field shards of section weir/job is 2"
        );
    }
}
