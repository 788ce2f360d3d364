//! A checkpoint's runtime sections, decoded for reading (`weir checkpoints inspect`): the
//! job's shape and what every participant of every shard put into the checkpoint.

use super::snapshot::{decode_sections, Sections};

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

/// Decodes (and validates, as a restore does: `decode_sections`) the runtime's sections of a
/// checkpoint's metadata. An error names the section that is missing, does not decode, or
/// disagrees with another.
pub fn layout(sections: &[(String, Vec<u8>)]) -> Result<CheckpointLayout, String> {
    let Sections { job, shards } = decode_sections(sections).map_err(|e| e.to_string())?;
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
        encode, shard_section, FileRefData, JobSnapshot, Part, PartKind, ShardSnapshot,
        JOB_SECTION, SECTIONS_VERSION,
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
        let s0 = ShardSnapshot {
            shard: 0,
            parts: vec![
                part("input", PartKind::Source, Vec::new()),
                part("sum", PartKind::Keyed, vec![seg]),
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
        let l = layout(&sections).expect("layout");
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
                (0, "sum", "keyed", 3),
                (1, "input", "source", 3)
            ]
        );
        assert_eq!(l.parts[1].files, vec![("shared/1-x-seg".to_string(), 4096)]);

        sections[2].1.truncate(3);
        let e = layout(&sections).expect_err("bad section");
        assert!(e.contains("weir/shard-0001"), "{e}");
        sections.pop();
        let e = layout(&sections).expect_err("missing section");
        assert_eq!(
            e,
            "_metadata section weir/shard-0001: missing: field shards of section weir/job is 2"
        );
    }
}
