//! A source from an iterator made on each shard.

use std::sync::Arc;

use super::{Source, SourceError, SourcePoll, SourceReader};

/// Reads the items of an iterator that `make(shard, shards)` creates on each shard. Its
/// position is the number of items taken, so a restore re-creates the iterator and skips them:
/// `make` must be deterministic for the restore to be exact. A restore onto another number of
/// shards makes each old shard's iterator again, as `make(old shard, old shard count)`, on the
/// shard that takes it over, so the items are those of the first run's split.
pub struct IterSource<F> {
    make: Arc<F>,
}

impl<F> IterSource<F> {
    pub fn new(make: F) -> Self {
        Self {
            make: Arc::new(make),
        }
    }
}

/// One shard's iterator of a run: `make(shard, shards)`, of which `taken` items were read.
struct Part<I> {
    shard: u64,
    shards: u64,
    iter: I,
    taken: u64,
    /// The iterator ended.
    done: bool,
}

/// The iterators a reader reads, in turn: its own shard's at the first start and, after a
/// restore onto another number of shards, those of the old readers it took over (each made
/// again as it was made then, and read on from where it stood). In turn, a batch of each,
/// rather than one to its end before the next: their watermark is the least of theirs, and a
/// part that is empty (`from_vec`'s on every shard but the first) would otherwise hold it
/// back until every part before it ended.
struct IterReader<I, F> {
    parts: Vec<Part<I>>,
    /// The part the next poll reads first.
    cur: usize,
    make: Arc<F>,
    shard: usize,
    shards: usize,
    /// The last poll's records by part (its split id, count), for [`SourceReader::splits`].
    runs: Vec<(u64, usize)>,
}

impl<I> Part<I> {
    /// The part's split id: its shard and shard count, which no other part shares.
    fn split(&self) -> u64 {
        (self.shards << 32) | self.shard
    }
}

/// The first byte of a position with its parts (an 8-byte position is one count).
const POSITION_PARTS: u8 = 1;
/// Bytes of a position's head (format, part count) and of each part (shard, shards, taken).
const POSITION_HEAD: usize = 1 + 4;
const POSITION_PART: usize = 8 * 3;

impl<T, I, F> IterReader<I, F>
where
    I: Iterator<Item = T>,
    F: Fn(usize, usize) -> I,
{
    /// `make(shard, shards)` with its first `taken` items skipped.
    fn part(&self, shard: u64, shards: u64, taken: u64) -> Result<Part<I>, SourceError> {
        let (s, n) = (usize::try_from(shard), usize::try_from(shards));
        let (Ok(s), Ok(n)) = (s, n) else {
            return Err(SourceError::BadPosition(format!(
                "iterator of shard {shard} of {shards}"
            )));
        };
        if s >= n {
            return Err(SourceError::BadPosition(format!(
                "iterator of shard {shard} of {shards}: no such shard"
            )));
        }
        let mut iter = (self.make)(s, n);
        for i in 0..taken {
            if iter.next().is_none() {
                return Err(SourceError::BadPosition(format!(
                    "position {taken} is past the end of the iterator of shard {shard} of \
                     {shards} ({i} items)"
                )));
            }
        }
        Ok(Part {
            shard,
            shards,
            iter,
            taken,
            done: false,
        })
    }

    /// The parts of `position`, read by old reader `old_shard` of `old_shards`: the 8-byte
    /// form is that reader's own iterator.
    fn decode(
        &self,
        old_shard: usize,
        old_shards: usize,
        position: &[u8],
    ) -> Result<Vec<Part<I>>, SourceError> {
        if let Ok(b) = <[u8; 8]>::try_from(position) {
            let taken = u64::from_le_bytes(b);
            return Ok(vec![self.part(
                old_shard as u64,
                old_shards as u64,
                taken,
            )?]);
        }
        let bad = |what: String| SourceError::BadPosition(format!("iterator position: {what}"));
        if position.len() < POSITION_HEAD || position[0] != POSITION_PARTS {
            return Err(bad(format!(
                "{} bytes starting {:?}, neither a count (8 bytes) nor parts (format {POSITION_PARTS})",
                position.len(),
                position.first()
            )));
        }
        let count = u32::from_le_bytes(position[1..5].try_into().expect("4")) as usize;
        // A count from the bytes never sizes anything before it is checked against them.
        let body = position.len() - POSITION_HEAD;
        if !body.is_multiple_of(POSITION_PART) || body / POSITION_PART != count {
            return Err(bad(format!(
                "{} bytes do not hold the {count} parts it counts",
                position.len()
            )));
        }
        let u64_at = |at: usize| u64::from_le_bytes(position[at..at + 8].try_into().expect("8"));
        (0..count)
            .map(|k| {
                let at = POSITION_HEAD + k * POSITION_PART;
                self.part(u64_at(at), u64_at(at + 8), u64_at(at + 16))
            })
            .collect()
    }

    /// Makes the parts of `positions` (each with the old shard it was read on) this reader's:
    /// no iterator twice (it would repeat its items).
    fn take_parts(
        &mut self,
        old_shards: usize,
        positions: &[(usize, &[u8])],
    ) -> Result<(), SourceError> {
        let mut parts = Vec::new();
        for &(old_shard, position) in positions {
            parts.extend(self.decode(old_shard, old_shards, position)?);
        }
        let mut ids: Vec<(u64, u64)> = parts.iter().map(|p| (p.shard, p.shards)).collect();
        ids.sort_unstable();
        if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
            return Err(SourceError::BadPosition(format!(
                "the iterator of shard {} of {} is in two positions",
                w[0].0, w[0].1
            )));
        }
        self.parts = parts;
        self.cur = 0;
        Ok(())
    }
}

impl<T, I, F> SourceReader<T> for IterReader<I, F>
where
    T: 'static,
    I: Iterator<Item = T> + 'static,
    F: Fn(usize, usize) -> I + Send + Sync + 'static,
{
    fn poll(&mut self, out: &mut Vec<T>, max: usize) -> Result<SourcePoll, SourceError> {
        self.runs.clear();
        let before = out.len();
        // Part `cur` fills the batch, or ends and the next one goes on; the next poll starts
        // at the part after the last one read.
        for k in 0..self.parts.len() {
            let i = (self.cur + k) % self.parts.len();
            let part = &mut self.parts[i];
            if part.done {
                continue;
            }
            let room = max - (out.len() - before);
            let had = out.len();
            out.extend(part.iter.by_ref().take(room));
            let n = out.len() - had;
            part.taken += n as u64;
            if n > 0 {
                self.runs.push((part.split(), n));
            }
            if n < room {
                part.done = true;
            } else {
                self.cur = (i + 1) % self.parts.len();
                return Ok(SourcePoll::Ready);
            }
        }
        Ok(SourcePoll::Finished)
    }

    /// An iterator is live until a poll found its end.
    fn splits(&self, runs: &mut Vec<(u64, usize)>, live: &mut Vec<u64>) -> bool {
        runs.extend_from_slice(&self.runs);
        live.extend(self.parts.iter().filter(|p| !p.done).map(Part::split));
        true
    }

    fn position(&self) -> Vec<u8> {
        let mut p = Vec::with_capacity(POSITION_HEAD + self.parts.len() * POSITION_PART);
        p.push(POSITION_PARTS);
        p.extend_from_slice(&(self.parts.len() as u32).to_le_bytes());
        for part in &self.parts {
            for x in [part.shard, part.shards, part.taken] {
                p.extend_from_slice(&x.to_le_bytes());
            }
        }
        p
    }

    /// A position of this reader's own shard (an 8-byte one is its iterator's count).
    fn seek(&mut self, position: &[u8]) -> Result<(), SourceError> {
        self.take_parts(self.shards, &[(self.shard, position)])
    }

    /// Takes over the old readers' iterators, each made again by `make` with the shard and
    /// shard count it was made for, and read on from its count.
    fn restore(
        &mut self,
        old_shards: usize,
        positions: &[(usize, &[u8])],
    ) -> Result<(), SourceError> {
        self.take_parts(old_shards, positions)
    }
}

impl<T, I, F> Source<T> for IterSource<F>
where
    T: 'static,
    I: Iterator<Item = T> + 'static,
    F: Fn(usize, usize) -> I + Send + Sync + 'static,
{
    fn create_reader(
        &self,
        shard: usize,
        shards: usize,
    ) -> Result<Box<dyn SourceReader<T>>, SourceError> {
        Ok(Box::new(IterReader {
            parts: vec![Part {
                shard: shard as u64,
                shards: shards as u64,
                iter: (self.make)(shard, shards),
                taken: 0,
                done: false,
            }],
            cur: 0,
            make: self.make.clone(),
            runs: Vec::new(),
            shard,
            shards,
        }))
    }

    fn name(&self) -> &str {
        "iter"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_in_batches_and_resumes_from_position() {
        let src =
            IterSource::new(|shard: usize, _| (0..10u32).map(move |i| i + shard as u32 * 100));
        let mut r = src.create_reader(1, 2).expect("reader");
        let mut out = Vec::new();
        assert_eq!(r.poll(&mut out, 4).expect("poll"), SourcePoll::Ready);
        assert_eq!(out, vec![100, 101, 102, 103]);
        let pos = r.position();
        let mut r2 = src.create_reader(1, 2).expect("reader");
        r2.seek(&pos).expect("seek");
        out.clear();
        assert_eq!(r2.poll(&mut out, 100).expect("poll"), SourcePoll::Finished);
        assert_eq!(out, (104..110).collect::<Vec<_>>());
        assert!(r2.seek(&[1, 2]).is_err());
        assert!(r2.seek(&99u64.to_le_bytes()).is_err());
    }

    /// A reader tells the split of each item it read, for watermarks per split: each
    /// iterator (part) is a split named by its shard and shard count. The parts are read in
    /// turn, a batch of each, and one is live until a poll found its end: an empty part (here
    /// the third, as `from_vec` makes on every shard but the first) is found at once, and
    /// does not hold the others' watermark back while they run.
    #[test]
    fn a_reader_tells_the_iterator_of_each_item() {
        let src = IterSource::new(|shard: usize, _| {
            let n = if shard == 2 { 0 } else { 3 };
            (0..n).map(move |i| i + shard as u32 * 10)
        });
        let positions: Vec<Vec<u8>> = (0..3)
            .map(|s| src.create_reader(s, 3).expect("reader").position())
            .collect();
        let mut r = src.create_reader(0, 1).expect("reader");
        r.restore(3, &super::super::taken_over(&positions, 1, 0))
            .expect("restore");
        let id = |s: u64| (3u64 << 32) | s;
        let splits = |r: &dyn SourceReader<u32>| {
            let (mut runs, mut live) = (Vec::new(), Vec::new());
            assert!(r.splits(&mut runs, &mut live));
            (runs, live)
        };
        assert_eq!(splits(r.as_ref()), (vec![], vec![id(0), id(1), id(2)]));
        let mut out = Vec::new();
        assert_eq!(r.poll(&mut out, 2).expect("poll"), SourcePoll::Ready);
        assert_eq!(
            splits(r.as_ref()),
            (vec![(id(0), 2)], vec![id(0), id(1), id(2)])
        );
        r.poll(&mut out, 2).expect("poll");
        assert_eq!(
            splits(r.as_ref()),
            (vec![(id(1), 2)], vec![id(0), id(1), id(2)])
        );
        // The third part ends at once, the first next: both give way in the same poll.
        r.poll(&mut out, 2).expect("poll");
        assert_eq!(
            splits(r.as_ref()),
            (vec![(id(0), 1), (id(1), 1)], vec![id(1)])
        );
        assert_eq!(out, [0, 1, 10, 11, 2, 12]);
        assert_eq!(r.poll(&mut out, 2).expect("poll"), SourcePoll::Finished);
        assert_eq!(splits(r.as_ref()), (vec![], vec![]));
    }

    /// A restore onto another number of shards makes the old shards' iterators again on the
    /// shards that take them over (old shard `s` to new shard `s % shards`), each as it was
    /// made and read on from its count: every item exactly once, through two rescales, also
    /// for an iterator that splits by the shard count. Before, a reader seeked its own new
    /// iterator by another iterator's count (other items), a shard with no old position
    /// started over, and one given two positions was refused.
    #[test]
    fn a_restore_onto_another_number_of_shards_reads_every_item_once() {
        let src =
            IterSource::new(|shard: usize, shards: usize| (shard as u32..100).step_by(shards));
        for (first, second, third) in [(2, 3, 1), (3, 2, 4), (1, 3, 2)] {
            let mut got = Vec::new();
            let mut positions: Vec<Vec<u8>> = (0..first)
                .map(|s| {
                    let mut r = src.create_reader(s, first).expect("reader");
                    r.poll(&mut got, 5 + s).expect("poll");
                    r.position()
                })
                .collect();
            let mut old = first;
            for shards in [second, third] {
                positions = (0..shards)
                    .map(|s| {
                        let mine = super::super::taken_over(&positions, shards, s);
                        let mut r = src.create_reader(s, shards).expect("reader");
                        r.restore(old, &mine).expect("restore");
                        let batch = if shards == third { 1000 } else { 4 };
                        r.poll(&mut got, batch).expect("poll");
                        r.position()
                    })
                    .collect();
                old = shards;
            }
            got.sort_unstable();
            assert_eq!(
                got,
                (0..100).collect::<Vec<_>>(),
                "{first} -> {second} -> {third}"
            );
        }
        // The same iterator in two positions would repeat its items.
        let mut r = src.create_reader(0, 1).expect("reader");
        let p = src.create_reader(0, 2).expect("reader").position();
        let e = r.restore(2, &[(0, &p), (0, &p)]).expect_err("twice");
        assert!(
            e.to_string().contains("shard 0 of 2 is in two positions"),
            "{e}"
        );
        let mut forged = p.clone();
        forged[5..13].copy_from_slice(&2u64.to_le_bytes());
        let e = r.restore(2, &[(0, &forged)]).expect_err("no such shard");
        assert!(e.to_string().contains("no such shard"), "{e}");
    }
}
