//! What a job restores from: a complete checkpoint's metadata, decoded and validated, and a
//! reader of the files it references.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::{Arc, Mutex};

use weir_state::KeyGroupRange;

use super::snapshot::{
    decode_metadata, FileRefData, LogicalRefData, Part, PartKind, Sections, ShardSnapshot,
};

/// Reads files of one checkpoint (or savepoint), verifying every CRC before returning a byte.
pub(crate) trait CheckpointReader: Send + Sync {
    /// Gives the new file `dest` the content of `f`: a raw file becomes a hard link once its
    /// length is checked, without reading it; a framed one is copied, verified, without being
    /// held in memory (`dest` is removed on error). For segments only, after the checkpoint
    /// verified: the store that opens `dest` checks every block, then size and whole-file CRC
    /// against its handle, which the caller has compared with `f`. The storage's error, typed:
    /// an I/O error (`CheckpointError::Io`) is one a restart may pass.
    fn link_file_to(&self, f: &FileRefData, dest: &Path) -> Result<(), weir_io::CheckpointError>;
    /// Where `f` is: what an error about a link to it names as well.
    fn path_of(&self, f: &FileRefData) -> std::path::PathBuf;
    fn read_logical(&self, f: &LogicalRefData) -> Result<Vec<u8>, String>;
}

/// A decoded checkpoint to restore from.
pub(crate) struct RestoreState {
    pub checkpoint_id: u64,
    pub shards: Vec<ShardSnapshot>,
    pub reader: Arc<dyn CheckpointReader>,
    /// The shard this restore state is handed to and the job's shard count now.
    pub new_shards: usize,
    /// The (operator, kind) pairs the job's operators asked for while they were built: what
    /// the restore hands to someone ([`Self::unclaimed`]).
    claimed: Mutex<BTreeSet<(String, u8)>>,
    /// The checkpoint is a complete one of the job's own checkpoint storage (a failover, or
    /// `--restore latest`): its shared files may be referenced by the job's next checkpoints
    /// instead of uploaded again.
    pub files_in_job_storage: bool,
}

impl RestoreState {
    /// Decodes the runtime's sections of a checkpoint's metadata, checked against each other
    /// and against the metadata's file lists ([`decode_metadata`]) and against the job. An
    /// error names the checkpoint, the `_metadata` section and what is wrong with it.
    pub fn decode(
        m: &weir_io::CheckpointMetadata,
        reader: Arc<dyn CheckpointReader>,
        new_shards: usize,
        max_parallelism: u16,
    ) -> Result<Self, String> {
        let checkpoint_id = m.checkpoint_id;
        let Sections { job, shards } =
            decode_metadata(m).map_err(|e| format!("checkpoint {checkpoint_id}: {e}"))?;
        if job.max_parallelism != max_parallelism {
            return Err(format!(
                "checkpoint {checkpoint_id} was taken with max parallelism {}, the job has {max_parallelism}: key groups would not match",
                job.max_parallelism
            ));
        }
        Ok(Self {
            checkpoint_id,
            shards,
            reader,
            new_shards,
            claimed: Mutex::default(),
            files_in_job_storage: false,
        })
    }

    /// The operators (uid and kind of state) that hold state in this checkpoint but that no
    /// operator of the job asked for: restoring would drop their state without a word.
    /// Parts without content (a source that had not started, a sink with nothing pending)
    /// and watermarks do not count. Sorted, each once.
    pub fn unclaimed(&self) -> Vec<(String, PartKind)> {
        let claimed = self.claimed.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<(String, PartKind)> = Vec::new();
        for p in self.shards.iter().flat_map(|s| s.parts.iter()) {
            let empty = p.bytes.is_empty() && p.files.is_empty() && p.logical.is_empty();
            // A watermark left behind costs nothing but lateness decisions right after the
            // restore (the operator starts as Flink's do, from no watermark), and timestamp
            // assigners are often left without a uid: their generated names must not make a
            // changed job's restore fail.
            let watermark = p.kind == PartKind::Watermark;
            if empty || watermark || claimed.contains(&(p.operator.clone(), p.kind as u8)) {
                continue;
            }
            if !out.iter().any(|(o, k)| *o == p.operator && *k == p.kind) {
                out.push((p.operator.clone(), p.kind));
            }
        }
        out.sort_by(|a, b| (&a.0, a.1 as u8).cmp(&(&b.0, b.1 as u8)));
        out
    }

    /// Every part of `operator` of `kind`, with the old shard that wrote it. Notes that the
    /// job has that operator (see [`Self::unclaimed`]).
    pub fn parts<'a>(
        &'a self,
        operator: &'a str,
        kind: PartKind,
    ) -> impl Iterator<Item = (usize, &'a Part)> + 'a {
        self.claimed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert((operator.to_owned(), kind as u8));
        self.shards.iter().enumerate().flat_map(move |(s, snap)| {
            snap.parts
                .iter()
                .filter(move |p| p.kind == kind && p.operator == operator)
                .map(move |p| (s, p))
        })
    }

    /// The parts of keyed operator `operator` that new shard `shard` takes over for what
    /// belongs to its key groups as a whole (its watermark): those of every old shard whose
    /// key-group range meets the new shard's, as its keyed state, and the records a restore
    /// sends it, come from those shards.
    pub fn parts_for_key_groups<'a>(
        &'a self,
        operator: &'a str,
        kind: PartKind,
        shard: usize,
        max_parallelism: u16,
    ) -> Vec<&'a Part> {
        let mine = KeyGroupRange::for_shard(shard as u16, self.new_shards as u16, max_parallelism);
        let old = self.shards.len() as u16;
        self.parts(operator, kind)
            .filter(|(s, _)| {
                KeyGroupRange::for_shard(*s as u16, old, max_parallelism).intersects(&mine)
            })
            .map(|(_, p)| p)
            .collect()
    }

    /// How many old shards new shard `shard` takes over key groups of (whose range meets its
    /// own), as [`Self::parts_for_key_groups`] reads them.
    pub fn old_shards_for_key_groups(&self, shard: usize, max_parallelism: u16) -> usize {
        let mine = KeyGroupRange::for_shard(shard as u16, self.new_shards as u16, max_parallelism);
        let old = self.shards.len() as u16;
        (0..old)
            .filter(|s| KeyGroupRange::for_shard(*s, old, max_parallelism).intersects(&mine))
            .count()
    }

    /// How many old shards new shard `shard` takes over for state that is not keyed, as
    /// [`Self::parts_for_shard`] reads them.
    pub fn old_shards_for_shard(&self, shard: usize) -> usize {
        (0..self.shards.len())
            .filter(|s| s % self.new_shards == shard)
            .count()
    }

    /// The parts of `operator` that new shard `shard` takes over for state that is not keyed
    /// (sources, sinks, watermark generators): the same shard index, or, after a rescale, old
    /// shards `shard, shard + new_shards, ..`.
    pub fn parts_for_shard<'a>(
        &'a self,
        operator: &'a str,
        kind: PartKind,
        shard: usize,
    ) -> Vec<&'a Part> {
        self.parts(operator, kind)
            .filter(|(s, _)| s % self.new_shards == shard)
            .map(|(_, p)| p)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::snapshot::{
        encode, metadata_for_test, shard_section, JobSnapshot, JOB_SECTION, SECTIONS_VERSION,
    };

    struct NoFiles;

    impl CheckpointReader for NoFiles {
        fn link_file_to(&self, f: &FileRefData, _: &Path) -> Result<(), weir_io::CheckpointError> {
            Err(weir_io::CheckpointError::MissingReusedFile {
                checkpoint_id: 0,
                path: f.path.clone().into(),
            })
        }
        fn path_of(&self, _: &FileRefData) -> std::path::PathBuf {
            std::path::PathBuf::new()
        }
        fn read_logical(&self, _: &LogicalRefData) -> Result<Vec<u8>, String> {
            Err("no files".into())
        }
    }

    fn job_v(shards: u32, format_version: u32) -> (String, Vec<u8>) {
        let j = JobSnapshot {
            shards,
            max_parallelism: 128,
            format_version,
        };
        (JOB_SECTION.to_owned(), encode(&j))
    }

    fn job(shards: u32) -> (String, Vec<u8>) {
        job_v(shards, SECTIONS_VERSION)
    }

    fn shard(s: u32) -> (String, Vec<u8>) {
        let snap = ShardSnapshot {
            shard: s,
            parts: Vec::new(),
        };
        (shard_section(s as usize), encode(&snap))
    }

    fn decode(sections: &[(String, Vec<u8>)]) -> Result<RestoreState, String> {
        let m = metadata_for_test(7, sections.to_vec(), Vec::new(), Vec::new());
        RestoreState::decode(&m, Arc::new(NoFiles), 2, 128)
    }

    /// After a rescale a keyed operator's watermark part comes from every old shard whose
    /// key groups the new shard takes, not from old shard `s % shards` alone: 3 shards onto 2,
    /// new shard 1 takes key groups of old shards 1 and 2 (43..=85 and 86..=127 of 128), so
    /// its watermark must be the least of theirs. With the old rule it took old shard 1's
    /// only, ran ahead of old shard 2's, and dropped records replayed to old shard 2's key
    /// groups as late (restore equivalence, seed 29: 1 run in 30 lost a record's windows).
    /// An old shard with no watermark part had seen nothing (its values all `i64::MIN`): a
    /// new shard that takes its input over starts at `i64::MIN`, not at the least of the
    /// parts that exist. From 2 shards onto 1, old shard 0's watermark (499) alone made the
    /// records of old shard 1's split, not yet read, late: 475 of 500 were dropped.
    #[test]
    fn a_missing_watermark_part_counts_as_nothing_seen() {
        let watermark = |s: u32, values: &[i64]| {
            let snap = ShardSnapshot {
                shard: s,
                parts: vec![Part {
                    operator: "wm".into(),
                    kind: PartKind::Watermark,
                    bytes: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
                    files: Vec::new(),
                    logical: Vec::new(),
                }],
            };
            (shard_section(s as usize), encode(&snap))
        };
        let sections = vec![job(2), watermark(0, &[2000, 499]), shard(1)];
        let restore = |new_shards| {
            let m = metadata_for_test(7, sections.clone(), Vec::new(), Vec::new());
            RestoreState::decode(&m, Arc::new(NoFiles), new_shards, 128).expect("decodes")
        };
        let values = |r: &RestoreState, shard, keyed| {
            if keyed {
                crate::time::restored_values_from::<2>(r, shard, 128, "wm", keyed).expect("values")
            } else {
                let g = crate::time::restored_generator_from(r, shard, "wm").expect("values");
                [g.max_ts, g.emitted]
            }
        };
        let one = restore(1);
        assert_eq!(
            values(&one, 0, false),
            [i64::MIN; 2],
            "old shard 1 saw nothing"
        );
        assert_eq!(values(&one, 0, true), [i64::MIN; 2]);
        // Onto 2: each takes its own.
        let two = restore(2);
        assert_eq!(values(&two, 0, false), [2000, 499]);
        assert_eq!(values(&two, 1, false), [i64::MIN; 2]);
    }

    /// A timestamp assigner's part holds, after its largest timestamp and the watermark it
    /// sent, each source's splits with their largest timestamps, keyed by the source's name.
    /// A restore onto fewer shards hands a new shard the splits of every old shard whose
    /// source positions it takes, each with its own timestamp (the watermark then follows the
    /// least of them, not the first split read); the least of the watermarks sent, as before.
    /// A part that does not decode is an error naming the checkpoint, the operator and the
    /// byte, never a panic or an allocation its bytes do not hold.
    #[test]
    fn a_timestamp_assigner_takes_the_splits_of_the_old_shards_it_takes() {
        let part_bytes = |head: [i64; 2], sources: &[(&str, &[(u64, i64)])]| {
            let mut b: Vec<u8> = head.iter().flat_map(|v| v.to_le_bytes()).collect();
            for (name, splits) in sources {
                b.extend_from_slice(&(name.len() as u32).to_le_bytes());
                b.extend_from_slice(name.as_bytes());
                b.extend_from_slice(&(splits.len() as u32).to_le_bytes());
                for (id, max) in *splits {
                    b.extend_from_slice(&id.to_le_bytes());
                    b.extend_from_slice(&max.to_le_bytes());
                }
            }
            b
        };
        let watermark = |s: u32, bytes: Vec<u8>| {
            let snap = ShardSnapshot {
                shard: s,
                parts: vec![Part {
                    operator: "wm".into(),
                    kind: PartKind::Watermark,
                    bytes,
                    files: Vec::new(),
                    logical: Vec::new(),
                }],
            };
            (shard_section(s as usize), encode(&snap))
        };
        let sections = vec![
            job(3),
            // Shard 0 reads splits 0 and 3 of `a` (a restore merged them before) and split 0
            // of `b` (a union); shards 1 and 2 their own splits of `a`.
            watermark(
                0,
                part_bytes(
                    [700, 600],
                    &[("a", &[(0, 900), (3, 700)]), ("b", &[(0, 800)])],
                ),
            ),
            watermark(1, part_bytes([4000, 3900], &[("a", &[(1, 4000)])])),
            // A forged or foreign part naming split 0 of `a` as well: the lesser is kept.
            watermark(
                2,
                part_bytes([1500, 1400], &[("a", &[(2, 1500), (0, 500)])]),
            ),
        ];
        let restore = |new_shards| {
            let m = metadata_for_test(7, sections.clone(), Vec::new(), Vec::new());
            RestoreState::decode(&m, Arc::new(NoFiles), new_shards, 128).expect("decodes")
        };
        let split = |s: &str, id: u64, max: i64| (s.to_owned(), id, max);
        let one = crate::time::restored_generator_from(&restore(1), 0, "wm").expect("one");
        assert_eq!((one.max_ts, one.emitted), (700, 600));
        assert_eq!(
            one.splits,
            [
                split("a", 0, 500),
                split("a", 1, 4000),
                split("a", 2, 1500),
                split("a", 3, 700),
                split("b", 0, 800)
            ]
        );
        let two = restore(2);
        let g0 = crate::time::restored_generator_from(&two, 0, "wm").expect("shard 0");
        assert_eq!((g0.max_ts, g0.emitted), (700, 600));
        assert_eq!(
            g0.splits,
            [
                split("a", 0, 500),
                split("a", 2, 1500),
                split("a", 3, 700),
                split("b", 0, 800)
            ]
        );
        let g1 = crate::time::restored_generator_from(&two, 1, "wm").expect("shard 1");
        assert_eq!(
            (g1.max_ts, g1.emitted, g1.splits),
            (4000, 3900, vec![split("a", 1, 4000)])
        );

        let good = part_bytes([1, 1], &[("src", &[(5, 1)])]);
        let mut count_too_high = good.clone();
        count_too_high[16 + 4 + 3..16 + 4 + 3 + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        let mut not_utf8 = good.clone();
        not_utf8[16 + 4] = 0xff;
        for (bytes, what) in [
            (good[..8].to_vec(), "16-byte head"),
            (good[..18].to_vec(), "length is cut"),
            (good[..22].to_vec(), "name is cut"),
            (good[..25].to_vec(), "count is cut"),
            (
                good[..good.len() - 1].to_vec(),
                "fewer bytes than the splits",
            ),
            (count_too_high, "fewer bytes than the splits"),
            (not_utf8, "not UTF-8"),
        ] {
            let sections = vec![job(1), watermark(0, bytes)];
            let m = metadata_for_test(7, sections, Vec::new(), Vec::new());
            let r = RestoreState::decode(&m, Arc::new(NoFiles), 1, 128).expect("decodes");
            let e = crate::time::restored_generator_from(&r, 0, "wm").expect_err(what);
            let e = e.to_string();
            assert!(
                e.contains("checkpoint 7") && e.contains("`wm`") && e.contains(what),
                "{what}: {e}"
            );
        }
        let sections = vec![job(1), watermark(0, good)];
        let m = metadata_for_test(7, sections, Vec::new(), Vec::new());
        let r = RestoreState::decode(&m, Arc::new(NoFiles), 1, 128).expect("decodes");
        let g = crate::time::restored_generator_from(&r, 0, "wm").expect("good");
        assert_eq!(g.splits, [split("src", 5, 1)]);
    }

    #[test]
    fn keyed_watermarks_come_from_every_old_shard_whose_key_groups_move_in() {
        let watermark = |s: u32, w: i64| {
            let snap = ShardSnapshot {
                shard: s,
                parts: vec![Part {
                    operator: "win".into(),
                    kind: PartKind::Watermark,
                    bytes: w.to_le_bytes().to_vec(),
                    files: Vec::new(),
                    logical: Vec::new(),
                }],
            };
            (shard_section(s as usize), encode(&snap))
        };
        let sections = [
            job(3),
            watermark(0, 100),
            watermark(1, 500),
            watermark(2, 50),
        ];
        let m = metadata_for_test(7, sections.to_vec(), Vec::new(), Vec::new());
        let r = RestoreState::decode(&m, Arc::new(NoFiles), 2, 128).expect("decodes");
        let values = |parts: Vec<&Part>| -> Vec<i64> {
            parts
                .iter()
                .map(|p| i64::from_le_bytes(p.bytes[..8].try_into().expect("8 bytes")))
                .collect()
        };
        let keyed = |shard| values(r.parts_for_key_groups("win", PartKind::Watermark, shard, 128));
        assert_eq!(keyed(0), vec![100, 500]);
        assert_eq!(keyed(1), vec![500, 50]);
        // What a source's splits follow (old shard s to new shard s % 2).
        let by_index = |shard| values(r.parts_for_shard("win", PartKind::Watermark, shard));
        assert_eq!(by_index(0), vec![100, 50]);
        assert_eq!(by_index(1), vec![500]);
        // Onto more shards, and onto the same number: only the old shards that held the key
        // groups.
        let m = metadata_for_test(7, sections.to_vec(), Vec::new(), Vec::new());
        let r4 = RestoreState::decode(&m, Arc::new(NoFiles), 4, 128).expect("decodes");
        let keyed4 =
            |shard| values(r4.parts_for_key_groups("win", PartKind::Watermark, shard, 128));
        assert_eq!(
            (keyed4(0), keyed4(1), keyed4(2), keyed4(3)),
            (vec![100], vec![100, 500], vec![500, 50], vec![50])
        );
        let m = metadata_for_test(7, sections.to_vec(), Vec::new(), Vec::new());
        let r3 = RestoreState::decode(&m, Arc::new(NoFiles), 3, 128).expect("decodes");
        for (shard, w) in [(0, 100), (1, 500), (2, 50)] {
            assert_eq!(
                values(r3.parts_for_key_groups("win", PartKind::Watermark, shard, 128)),
                vec![w]
            );
        }
    }

    /// A shard count from the metadata (valid CRCs, any value) names a missing section; it
    /// never sizes an allocation up front.
    #[test]
    fn a_forged_shard_count_is_an_error_naming_the_missing_section() {
        for shards in [128, 3] {
            let e = decode(&[job(shards), shard(0)])
                .err()
                .expect("sections missing");
            assert_eq!(
                e,
                format!(
                    "checkpoint 7: _metadata section weir/shard-0001: missing: field shards of \
                     section weir/job is {shards}"
                )
            );
        }
        let e = decode(&[job(u32::MAX), shard(0)]).err().expect("too many");
        assert_eq!(
            e,
            "checkpoint 7: _metadata section weir/job: field shards is 4294967295, more than \
             field max_parallelism 128 (a job has at most one shard per key group)"
        );
        let r = decode(&[job(1), shard(0)]).expect("decodes");
        assert_eq!(r.shards.len(), 1);
    }

    /// What the metadata's CRC cannot catch (forged sections with valid CRCs), each an error
    /// naming the checkpoint, `_metadata`, the section and the field. Lowering `shards`
    /// dropped the state of the shards past it, and the job ran to the end with wrong sums.
    #[test]
    fn inconsistent_sections_are_errors_naming_section_and_field() {
        type Section = (String, Vec<u8>);
        let e = |sections: &[Section]| decode(sections).err().expect("refused");
        let other = ("user/extra".to_owned(), vec![1, 2, 3]);
        let cases: Vec<(Vec<Section>, &str)> = vec![
            (
                vec![job(1), shard(0), shard(1)],
                "weir/shard-0001: not a shard of the checkpoint: field shards of section \
                 weir/job is 1",
            ),
            (
                vec![job(0), shard(0), shard(1)],
                "weir/job: field shards is 0; a checkpoint has at least one shard",
            ),
            (
                vec![job(2), shard(0), shard(1), shard(2)],
                "weir/shard-0002: not a shard of the checkpoint: field shards of section \
                 weir/job is 2",
            ),
            (
                vec![job(2), shard(1)],
                "weir/shard-0000: missing: field shards of section weir/job is 2",
            ),
            (
                vec![job_v(2, 99), shard(0), shard(1)],
                "weir/job: field format_version is 99; this build reads version 1",
            ),
            (
                vec![job(2), shard(0), shard(1), shard(1)],
                "weir/shard-0001: appears more than once",
            ),
            (
                vec![job(2), shard(0), shard(1), job(2)],
                "weir/job: appears more than once",
            ),
            (
                vec![job(2), shard(0), ("weir/shard-1".into(), shard(1).1)],
                "weir/shard-1: not one of the runtime's sections (weir/job, weir/shard-NNNN)",
            ),
            (
                vec![job(2), shard(0), (shard_section(1), shard(0).1)],
                "weir/shard-0001: field shard is 0; the section is shard 1's",
            ),
            (vec![shard(0), other.clone()], "weir/job: missing"),
        ];
        for (sections, want) in cases {
            assert_eq!(
                e(&sections),
                format!("checkpoint 7: _metadata section {want}")
            );
        }
        // Sections that are not the runtime's are not its to check.
        let r = decode(&[other, job(2), shard(1), shard(0)]).expect("decodes");
        assert_eq!(
            r.shards.iter().map(|s| s.shard).collect::<Vec<_>>(),
            vec![0, 1]
        );
    }

    /// A watermark no operator takes is not state a restore refuses to drop (a timestamp
    /// assigner's generated name may change with the job); a source position is.
    #[test]
    fn unclaimed_state_leaves_watermarks_out() {
        let part = |operator: &str, kind| Part {
            operator: operator.into(),
            kind,
            bytes: 7i64.to_le_bytes().to_vec(),
            files: Vec::new(),
            logical: Vec::new(),
        };
        let snap = ShardSnapshot {
            shard: 0,
            parts: vec![
                part("watermarks", PartKind::Watermark),
                part("input", PartKind::Source),
            ],
        };
        let r = decode(&[job(1), (shard_section(0), encode(&snap))]).expect("decodes");
        assert_eq!(r.unclaimed(), vec![("input".to_string(), PartKind::Source)]);
    }
}
