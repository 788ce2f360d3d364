//! Sources: where records enter a job.
//!
//! A [`Source`] is a description shared by every shard; at job start each shard asks it for a
//! [`SourceReader`] of its own. A reader hands out records in batches into a buffer that the
//! shard reuses, so a source costs no allocation per record. A reader's position is opaque
//! bytes, taken with a checkpoint barrier and given back on restore.

use std::path::PathBuf;

mod file;
mod generator;
mod ingress;
mod iter;

pub use file::{ErrorPolicy, FileFormat, FileSource, Location};
pub use generator::{splitmix64, GeneratorSource, ScheduleStart};
pub use ingress::{ingress, Closed, Ingress, IngressSource};
pub use iter::IterSource;

/// What a poll of a reader found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourcePoll {
    /// Zero or more records were appended; poll again.
    Ready,
    /// Nothing is available now; poll again later (the shard may idle meanwhile).
    Idle,
    /// The source is exhausted: it will append nothing more.
    Finished,
}

/// A source's error. Each variant names what failed and where.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SourceError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{file}:{line}: malformed record: {reason}")]
    Malformed {
        file: PathBuf,
        line: u64,
        reason: String,
    },
    #[error("{file}: unknown column `{column}` (columns: {available})")]
    UnknownColumn {
        file: PathBuf,
        column: String,
        available: String,
    },
    #[error("source position is not valid for this source: {0}")]
    BadPosition(String),
    /// A file the source keeps for itself (a dead-letter start record) does not decode.
    #[error("{file}: offset {offset}: {reason}")]
    Corrupt {
        file: PathBuf,
        offset: u64,
        reason: String,
    },
    #[error("{0}")]
    Other(String),
}

/// One shard's reader of a source.
pub trait SourceReader<T>: 'static {
    /// Appends up to `max` records to `out` (which the caller clears between polls).
    fn poll(&mut self, out: &mut Vec<T>, max: usize) -> Result<SourcePoll, SourceError>;

    /// The position just after the last record appended so far, as opaque bytes.
    fn position(&self) -> Vec<u8>;

    /// Continues from a position that [`SourceReader::position`] returned earlier.
    fn seek(&mut self, position: &[u8]) -> Result<(), SourceError>;

    /// Called once, right after the reader is made (before [`Self::restore`] and
    /// [`Self::start`]), when the job takes checkpoints: its
    /// positions will be taken at barriers ([`Self::snapshot_position`]) and the checkpoints
    /// that complete reported ([`Self::notify_checkpoint_complete`]), and a failed attempt
    /// restarts from the newest complete checkpoint (or from the beginning before there is
    /// one). A reader that must keep what it read until a checkpoint covers it (an
    /// [`IngressSource`]'s: its input cannot be read again) keeps nothing without this call.
    fn enable_checkpointing(&mut self) {}

    /// The position at checkpoint `checkpoint_id`'s barrier, as [`Self::position`] (the
    /// default). A reader that acts on [`Self::notify_checkpoint_complete`] remembers it
    /// under the id, as Flink's `snapshotState(checkpointId)` does.
    fn snapshot_position(&mut self, checkpoint_id: u64) -> Vec<u8> {
        let _ = checkpoint_id;
        self.position()
    }

    /// Checkpoint `checkpoint_id` and every earlier one are complete (durable): nothing
    /// before the position its barrier took is read again, unless the job is restored from
    /// an older checkpoint (which a sink that committed since refuses without
    /// `with_allow_fallback`; a reader that let go of its input, an ingress's, refuses it
    /// even then, with `SourceError::BadPosition`). Called between polls, with the newest
    /// completed id only (ids in between may be skipped), as Flink's
    /// `notifyCheckpointComplete`.
    fn notify_checkpoint_complete(&mut self, checkpoint_id: u64) {
        let _ = checkpoint_id;
    }

    /// Called once the reader is made and, when the job restores a checkpoint, after
    /// [`Self::restore`], before the first [`Self::poll`] or [`Self::position`]: for work that
    /// depends on whether the reader starts from the beginning or from a restored position
    /// (as Flink's `SourceReader#start` follows the restore of its splits). An error fails
    /// the job's start, as one from [`Source::create_reader`] does.
    ///
    /// [`FileSource`] reads its dead-letter start record here, and only when it starts from
    /// the beginning: a restored position says where to cut the dead-letter file instead, so a
    /// damaged record does not stop a restore that does not need it.
    fn start(&mut self) -> Result<(), SourceError> {
        Ok(())
    }

    /// For watermarks per split: a reader that reads several splits (one that a restore onto
    /// fewer shards gave the splits of several old readers) says which split each record of
    /// the last [`Self::poll`] came from, as `(split, records)` runs in the order it appended
    /// them, into `runs`, and which of its splits it has not finished, into `live` (both
    /// cleared by the caller), and returns true. A split's id must be the same on whichever
    /// reader reads it, before and after a restore. The runtime's timestamp assigner then
    /// tracks each split's largest timestamp and sends the least of them (as Flink's sources
    /// do with a watermark strategy), so that records of a split that lags behind another are
    /// not late for being read after it. Also called once before the first poll, with no
    /// records: `runs` then stays empty. A live split holds the watermark back while it sends
    /// nothing, unless the strategy has an idle timeout (`WatermarkStrategy::with_idleness`,
    /// then each split goes idle on its own): a reader should leave out of `live` a split it
    /// knows has ended.
    ///
    /// The default, false, makes the reader's records one stream to the timestamp assigner:
    /// right for a reader that never reads more than one split.
    fn splits(&self, runs: &mut Vec<(u64, usize)>, live: &mut Vec<u64>) -> bool {
        let _ = (runs, live);
        false
    }

    /// Continues after a restore from the positions of the readers of a checkpoint taken on
    /// `old_shards` shards that this reader takes over: old shard `s` goes to new shard
    /// `s % shards` (as keyed state goes by key group), so with as many shards as before each
    /// reader gets its own old position, with fewer it gets several, and with more some get
    /// none. `positions` holds `(old shard, position)` for each, empty positions (readers
    /// that had nothing to record) left out; it is called only when the checkpoint holds
    /// positions of this source.
    ///
    /// The default suits a source read on one shard (the others' readers empty, such as
    /// [`FileSource`]): no position means nothing to read here, one is [`Self::seek`], and
    /// several are refused. A source whose readers split the input among shards must take
    /// over the old readers' splits instead (as [`GeneratorSource`] and [`IterSource`] do):
    /// seeking a reader made for one split to another split's position would skip records
    /// and repeat others.
    fn restore(
        &mut self,
        old_shards: usize,
        positions: &[(usize, &[u8])],
    ) -> Result<(), SourceError> {
        match positions {
            [] => Ok(()),
            [(_, position)] => self.seek(position),
            _ => Err(SourceError::BadPosition(format!(
                "{} positions of a checkpoint taken on {old_shards} shards fall to one \
                 reader, and this source cannot merge them: restore onto as many shards as \
                 before, or more",
                positions.len()
            ))),
        }
    }
}

/// A source description, shared by every shard.
pub trait Source<T>: Send + Sync + 'static {
    /// The reader for `shard` of `shards`. A source that cannot split returns a reader with data
    /// on one shard and finished readers elsewhere.
    fn create_reader(
        &self,
        shard: usize,
        shards: usize,
    ) -> Result<Box<dyn SourceReader<T>>, SourceError>;

    /// A short name for metrics and errors.
    fn name(&self) -> &str {
        "source"
    }
}

/// The positions of `old` (one per old shard, in shard order) that shard `shard` of `shards`
/// takes over in a restore: those of the old shards `s` with `s % shards == shard`, as the
/// runtime hands them to [`SourceReader::restore`].
#[cfg(test)]
pub(crate) fn taken_over(old: &[Vec<u8>], shards: usize, shard: usize) -> Vec<(usize, &[u8])> {
    old.iter()
        .enumerate()
        .filter(|(s, _)| s % shards == shard)
        .map(|(s, p)| (s, p.as_slice()))
        .collect()
}

/// A reader that has nothing, for shards a source does not read on.
#[derive(Debug, Default)]
pub struct EmptyReader;

impl<T: 'static> SourceReader<T> for EmptyReader {
    fn poll(&mut self, _out: &mut Vec<T>, _max: usize) -> Result<SourcePoll, SourceError> {
        Ok(SourcePoll::Finished)
    }
    fn position(&self) -> Vec<u8> {
        Vec::new()
    }
    fn seek(&mut self, _position: &[u8]) -> Result<(), SourceError> {
        Ok(())
    }
}
