//! A seeded, deterministic generator source.

use std::sync::{Arc, OnceLock};
use std::time::Instant;

use super::{Source, SourceError, SourcePoll, SourceReader};

/// SplitMix64: a tiny, well-mixed generator; record `i` of a seed is always the same value,
/// which is what makes a generator replayable from a checkpointed index.
pub fn splitmix64(seed: u64, index: u64) -> u64 {
    let mut z = seed
        .wrapping_add(index.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Generates records `f(index, random)` for `index` in `0..total` (or without end), where
/// `random = splitmix64(seed, index)`. Shard `s` of `n` produces the indices `s, s+n, s+2n, ..`.
/// Optionally throttled to a rate per shard.
pub struct GeneratorSource<F> {
    total: Option<u64>,
    seed: u64,
    rate_per_sec: Option<u64>,
    origin: Option<ScheduleStart>,
    f: Arc<F>,
}

/// The origin of a generator's fixed schedule, set once and shared by every shard's reader
/// and by whoever measures against the schedule. Until it is set, a throttled generator on
/// this schedule makes nothing. A benchmark sets it once [`crate::JobHandle::status`] says the
/// job runs, so that startup (state memory faulted in, state restored) is not counted as
/// latency.
#[derive(Clone, Debug, Default)]
pub struct ScheduleStart(Arc<OnceLock<Instant>>);

impl ScheduleStart {
    /// A schedule not started yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// A schedule that starts at `origin`.
    pub fn at(origin: Instant) -> Self {
        let s = Self::new();
        s.start_at(origin);
        s
    }

    /// Starts the schedule at `origin`; false (and no change) if it had started already.
    pub fn start_at(&self, origin: Instant) -> bool {
        self.0.set(origin).is_ok()
    }

    /// The origin, once set.
    pub fn get(&self) -> Option<Instant> {
        self.0.get().copied()
    }
}

impl<F> GeneratorSource<F> {
    pub fn new(total: Option<u64>, seed: u64, f: F) -> Self {
        Self {
            total,
            seed,
            rate_per_sec: None,
            origin: None,
            f: Arc::new(f),
        }
    }

    /// Limits each shard's reader to `records_per_sec`.
    pub fn with_rate_per_shard(mut self, records_per_sec: u64) -> Self {
        self.rate_per_sec = Some(records_per_sec);
        self
    }

    /// Schedules the throttled records from `origin` instead of from each reader's first
    /// poll: the `k`-th record of every shard (index `shard + k * shards`) is due at
    /// `origin + k / rate`, and none is made before it is due, also after a restore (which
    /// keeps each split of the first run on its schedule, also where a reader took over
    /// several: it then makes `rate` records per second for each). A job
    /// that stamps records with their due time measures latency from when each record should
    /// have entered, so the time a shard could not poll its source counts too (no
    /// coordinated omission).
    pub fn with_schedule_origin(self, origin: Instant) -> Self {
        self.with_schedule(ScheduleStart::at(origin))
    }

    /// As [`Self::with_schedule_origin`], from an origin set later (see [`ScheduleStart`]).
    pub fn with_schedule(mut self, start: ScheduleStart) -> Self {
        self.origin = Some(start);
        self
    }
}

/// One residue class of the indices, `first, first + step, ..`: the records one reader of the
/// first run made. A reader makes its own at the first start and, after a restore onto another
/// number of shards, those of the old readers it took over (never fewer, never split), as
/// Flink's sequence source reassigns its splits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Split {
    first: u64,
    /// The next index to make.
    next: u64,
    /// Past the end of a bounded generator, or the u64 index space used up.
    done: bool,
}

struct GenReader<F> {
    /// The splits this reader makes, all of `step`, with distinct `first`s below it.
    splits: Vec<Split>,
    step: u64,
    /// The reader's shard and shard count: what a position in the 8-byte form (one index,
    /// written before splits could move) is relative to.
    shard: u64,
    shards: u64,
    total: Option<u64>,
    seed: u64,
    rate_per_sec: Option<u64>,
    /// The fixed schedule, if any; `started` caches its origin once set.
    origin: Option<ScheduleStart>,
    started: Option<Instant>,
    /// Records made since the reader's first poll: what a throttled reader without an
    /// origin has made of its budget (with one, each split's position says how far along
    /// the schedule it is).
    emitted: u64,
    /// The last poll's records by split (`first`, count), for [`SourceReader::splits`].
    runs: Vec<(u64, usize)>,
    f: Arc<F>,
}

/// The first byte of a position with its splits (an 8-byte position is one index).
const POSITION_SPLITS: u8 = 1;
/// Bytes of a position's head (format, step, split count) and of each split (first, next,
/// done).
const POSITION_HEAD: usize = 1 + 8 + 4;
const POSITION_SPLIT: usize = 8 + 8 + 1;

impl<F> GenReader<F> {
    /// Whether `next` is a position split `first` of `step` could stand at: one of its
    /// indices, at most one step past the last of a bounded generator.
    fn reachable(&self, first: u64, step: u64, next: u64) -> bool {
        let ours = next >= first && (next - first).is_multiple_of(step);
        let past_end = self.total.is_some_and(|t| next > t && next - t >= step);
        ours && !past_end
    }

    /// A split at `next`, done if that is the end.
    fn split_at(&self, first: u64, next: u64) -> Split {
        Split {
            first,
            next,
            done: self.total.is_some_and(|t| next >= t),
        }
    }

    /// The splits of `position`, taken by old reader `old_shard` of `old_shards`: the 8-byte
    /// form is that reader's one split. Returns the step with them.
    fn decode(
        &self,
        old_shard: u64,
        old_shards: u64,
        position: &[u8],
    ) -> Result<(u64, Vec<Split>), SourceError> {
        if let Ok(b) = <[u8; 8]>::try_from(position) {
            let next = u64::from_le_bytes(b);
            if old_shard >= old_shards || !self.reachable(old_shard, old_shards, next) {
                return Err(SourceError::BadPosition(format!(
                    "index {next} is not a position of generator shard {old_shard} of \
                     {old_shards}{}",
                    self.total
                        .map_or(String::new(), |t| format!(" over {t} records")),
                )));
            }
            return Ok((old_shards, vec![self.split_at(old_shard, next)]));
        }
        let bad = |what: String| SourceError::BadPosition(format!("generator position: {what}"));
        if position.len() < POSITION_HEAD || position[0] != POSITION_SPLITS {
            return Err(bad(format!(
                "{} bytes starting {:?}, neither one index (8 bytes) nor splits (format {POSITION_SPLITS})",
                position.len(),
                position.first()
            )));
        }
        let u64_at = |at: usize| u64::from_le_bytes(position[at..at + 8].try_into().expect("8"));
        let step = u64_at(1);
        let count = u32::from_le_bytes(position[9..13].try_into().expect("4")) as usize;
        // A count from the bytes never sizes anything before it is checked against them.
        let body = position.len() - POSITION_HEAD;
        if !body.is_multiple_of(POSITION_SPLIT) || body / POSITION_SPLIT != count {
            return Err(bad(format!(
                "{} bytes do not hold the {count} splits it counts",
                position.len()
            )));
        }
        if step == 0 {
            return Err(bad("step 0".into()));
        }
        let mut splits = Vec::with_capacity(count);
        for k in 0..count {
            let at = POSITION_HEAD + k * POSITION_SPLIT;
            let (first, next, done) = (u64_at(at), u64_at(at + 8), position[at + 16]);
            if first >= step || done > 1 || !self.reachable(first, step, next) {
                return Err(bad(format!(
                    "split {k} (first {first}, next {next}, done {done}) is not one of step \
                     {step}{}",
                    self.total
                        .map_or(String::new(), |t| format!(" over {t} records")),
                )));
            }
            let mut split = self.split_at(first, next);
            split.done |= done == 1;
            splits.push(split);
        }
        Ok((step, splits))
    }

    /// Makes the splits of `positions` (each with the old shard it was read on) this
    /// reader's: they must all be of one step, no split twice (two would repeat records).
    fn take_splits(
        &mut self,
        old_shards: u64,
        positions: &[(usize, &[u8])],
    ) -> Result<(), SourceError> {
        let mut step = None;
        let mut splits: Vec<Split> = Vec::new();
        for &(old_shard, position) in positions {
            let (s, mut more) = self.decode(old_shard as u64, old_shards, position)?;
            // A reader with no splits (one a scale-up left idle) says nothing of the step.
            if more.is_empty() {
                continue;
            }
            if *step.get_or_insert(s) != s {
                return Err(SourceError::BadPosition(format!(
                    "generator positions of old shard {old_shard} split the indices by {s}, \
                     others by {}",
                    step.unwrap_or(s)
                )));
            }
            splits.append(&mut more);
        }
        let mut firsts: Vec<u64> = splits.iter().map(|s| s.first).collect();
        firsts.sort_unstable();
        if let Some(w) = firsts.windows(2).find(|w| w[0] == w[1]) {
            return Err(SourceError::BadPosition(format!(
                "generator split {} is in two positions",
                w[0]
            )));
        }
        if let Some(step) = step {
            self.step = step;
        }
        // With a fixed schedule, each split goes on where its position lies on it.
        self.splits = splits;
        Ok(())
    }
}

impl<T: 'static, F: Fn(u64, u64) -> T + Send + Sync + 'static> SourceReader<T> for GenReader<F> {
    fn poll(&mut self, out: &mut Vec<T>, max: usize) -> Result<SourcePoll, SourceError> {
        self.runs.clear();
        let mut budget = max as u64;
        if let Some(rate) = self.rate_per_sec {
            let started = match (self.started, &self.origin) {
                (Some(s), _) => s,
                (None, None) => *self.started.get_or_insert(Instant::now()),
                (None, Some(o)) => match o.get() {
                    Some(s) => *self.started.get_or_insert(s),
                    None => return Ok(SourcePoll::Idle),
                },
            };
            let allowed =
                (started.elapsed().as_nanos() as u64).saturating_mul(rate) / 1_000_000_000;
            let due = if self.origin.is_some() {
                // The schedule is each split's: its k-th record is due at origin + k / rate.
                // A reader that took over several splits owes each what it fell behind (their
                // sum against one split's schedule stalled it for the job's age before the
                // restore, times the old shards less one).
                let step = self.step;
                self.splits
                    .iter()
                    .filter(|s| !s.done)
                    .map(|s| allowed.saturating_sub((s.next - s.first) / step))
                    .fold(0u64, u64::saturating_add)
            } else {
                allowed.saturating_sub(self.emitted)
            };
            budget = budget.min(due);
            if budget == 0 {
                return Ok(SourcePoll::Idle);
            }
        }
        let (step, total) = (self.step, self.total);
        if let [only] = self.splits.as_mut_slice() {
            // One split (no rescale): the loop the generator always ran.
            if !only.done {
                let (f, seed) = (&self.f, self.seed);
                let mut next = only.next;
                let mut made = 0;
                while made < budget {
                    out.push(f(next, splitmix64(seed, next)));
                    made += 1;
                    match next.checked_add(step) {
                        Some(n) if total.is_none_or(|t| n < t) => next = n,
                        Some(n) => {
                            next = n;
                            only.done = true;
                            break;
                        }
                        // The u64 index space is used up: the split ends there.
                        None => {
                            only.done = true;
                            break;
                        }
                    }
                }
                only.next = next;
                self.emitted += made;
                if made > 0 {
                    self.runs.push((only.first, made as usize));
                }
            }
            return Ok(if only.done {
                SourcePoll::Finished
            } else {
                SourcePoll::Ready
            });
        }
        while budget > 0 {
            // The unfinished split with the lowest next index makes records until it passes
            // the next lowest (index order across splits; one split runs through the budget).
            let mut live = self.splits.iter_mut().filter(|s| !s.done);
            let Some(mut cur) = live.next() else { break };
            let mut until = u64::MAX;
            for s in live {
                if s.next < cur.next {
                    until = cur.next;
                    cur = s;
                } else {
                    until = until.min(s.next);
                }
            }
            match self.runs.last_mut() {
                Some((first, _)) if *first == cur.first => {}
                _ => self.runs.push((cur.first, 0)),
            }
            let run = &mut self.runs.last_mut().expect("pushed").1;
            while budget > 0 && cur.next <= until {
                out.push((self.f)(cur.next, splitmix64(self.seed, cur.next)));
                self.emitted += 1;
                budget -= 1;
                *run += 1;
                match cur.next.checked_add(step) {
                    Some(n) if total.is_none_or(|t| n < t) => cur.next = n,
                    Some(n) => {
                        cur.next = n;
                        cur.done = true;
                        break;
                    }
                    // The u64 index space is used up: the split ends there.
                    None => {
                        cur.done = true;
                        break;
                    }
                }
            }
        }
        if self.splits.iter().all(|s| s.done) {
            return Ok(SourcePoll::Finished);
        }
        Ok(SourcePoll::Ready)
    }

    /// A split is named by its first index (unique among the splits of one step).
    fn splits(&self, runs: &mut Vec<(u64, usize)>, live: &mut Vec<u64>) -> bool {
        runs.extend(self.runs.iter().filter(|r| r.1 > 0));
        live.extend(self.splits.iter().filter(|s| !s.done).map(|s| s.first));
        true
    }

    fn position(&self) -> Vec<u8> {
        let mut p = Vec::with_capacity(POSITION_HEAD + self.splits.len() * POSITION_SPLIT);
        p.push(POSITION_SPLITS);
        p.extend_from_slice(&self.step.to_le_bytes());
        p.extend_from_slice(&(self.splits.len() as u32).to_le_bytes());
        for s in &self.splits {
            p.extend_from_slice(&s.first.to_le_bytes());
            p.extend_from_slice(&s.next.to_le_bytes());
            p.push(u8::from(s.done));
        }
        p
    }

    /// A position of this reader's own shard (an 8-byte one is relative to it).
    fn seek(&mut self, position: &[u8]) -> Result<(), SourceError> {
        self.take_splits(self.shards, &[(self.shard as usize, position)])
    }

    /// Takes over the old readers' splits: with fewer shards than before a reader makes
    /// several, with more some make none (a split is never divided, so records keep their
    /// split's order and nothing is made twice).
    fn restore(
        &mut self,
        old_shards: usize,
        positions: &[(usize, &[u8])],
    ) -> Result<(), SourceError> {
        self.take_splits(old_shards as u64, positions)
    }
}

impl<T: 'static, F: Fn(u64, u64) -> T + Send + Sync + 'static> Source<T> for GeneratorSource<F> {
    fn create_reader(
        &self,
        shard: usize,
        shards: usize,
    ) -> Result<Box<dyn SourceReader<T>>, SourceError> {
        let first = shard as u64;
        Ok(Box::new(GenReader {
            splits: vec![Split {
                first,
                next: first,
                done: self.total.is_some_and(|t| first >= t),
            }],
            step: shards as u64,
            shard: first,
            shards: shards as u64,
            total: self.total,
            seed: self.seed,
            rate_per_sec: self.rate_per_sec,
            origin: self.origin.clone(),
            started: None,
            emitted: 0,
            runs: Vec::new(),
            f: self.f.clone(),
        }))
    }

    fn name(&self) -> &str {
        "generator"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_split_indices_and_are_deterministic() {
        let g = GeneratorSource::new(Some(10), 42, |i, r| (i, r));
        let mut all = Vec::new();
        for s in 0..3 {
            let mut r = g.create_reader(s, 3).expect("reader");
            let mut out = Vec::new();
            while r.poll(&mut out, 2).expect("poll") != SourcePoll::Finished {}
            all.extend(out);
        }
        all.sort();
        assert_eq!(
            all.iter().map(|x| x.0).collect::<Vec<_>>(),
            (0..10).collect::<Vec<_>>()
        );
        assert!(all.iter().all(|(i, r)| *r == splitmix64(42, *i)));
    }

    #[test]
    fn seek_resumes_at_index() {
        let g = GeneratorSource::new(Some(100), 1, |i, _| i);
        let mut r = g.create_reader(0, 1).expect("reader");
        let mut out = Vec::new();
        r.poll(&mut out, 10).expect("poll");
        let pos = r.position();
        let mut r2 = g.create_reader(0, 1).expect("reader");
        r2.seek(&pos).expect("seek");
        out.clear();
        r2.poll(&mut out, 3).expect("poll");
        assert_eq!(out, vec![10, 11, 12]);
    }

    /// Positions no reader of this shard could have reached are errors: another shard's
    /// index (before, shard 0 of 2 seeked to 5 emitted 5, 7, 9: shard 1's records), one past
    /// the end, and one so high that the next step overflowed (a panic in debug builds, a
    /// wrap to 0 in release). The last index of the u64 space ends the generator.
    #[test]
    fn seek_refuses_positions_of_other_shards_and_past_the_end() {
        let bounded = GeneratorSource::new(Some(9), 1, |i, _| i);
        let mut r = bounded.create_reader(0, 2).expect("reader");
        for bad in [5u64, 1, 12, u64::MAX - 1] {
            let e = r.seek(&bad.to_le_bytes()).expect_err("not shard 0's");
            assert!(e.to_string().contains(&format!("index {bad}")), "{e}");
        }
        // 10 is one step past the last index (8): where a finished reader stands.
        r.seek(&10u64.to_le_bytes()).expect("the end");
        let mut out = Vec::new();
        assert_eq!(r.poll(&mut out, 4).expect("poll"), SourcePoll::Finished);
        assert!(out.is_empty());
        r.seek(&4u64.to_le_bytes()).expect("shard 0's");
        r.poll(&mut out, 2).expect("poll");
        assert_eq!(out, [4, 6]);

        let unbounded = GeneratorSource::new(None, 1, |i, _| i);
        let mut r = unbounded.create_reader(1, 2).expect("reader");
        r.seek(&u64::MAX.to_le_bytes())
            .expect("shard 1's last index");
        out.clear();
        assert_eq!(r.poll(&mut out, 4).expect("poll"), SourcePoll::Finished);
        assert_eq!(out, [u64::MAX]);
        assert_eq!(r.poll(&mut out, 4).expect("poll"), SourcePoll::Finished);
        assert_eq!(out, [u64::MAX], "nothing after the last index");
    }

    /// Reads `r` until it finished, `batch` records a poll.
    fn drain(r: &mut Box<dyn SourceReader<u64>>, batch: usize) -> Vec<u64> {
        let mut out = Vec::new();
        while r.poll(&mut out, batch).expect("poll") != SourcePoll::Finished {}
        out
    }

    /// Readers of a restore onto another number of shards take over the old readers' splits
    /// (old shard `s` to new shard `s % shards`): every index is made exactly once over the
    /// runs, whatever the shard counts, also through a second rescale. Before, a reader
    /// seeked to an old position of another step was refused, or (when the index happened to
    /// fit the new step) made other shards' records while a reader with no old position
    /// started over from its first index.
    #[test]
    fn a_restore_onto_another_number_of_shards_makes_every_index_once() {
        let total = 1000;
        let g = GeneratorSource::new(Some(total), 7, |i, _| i);
        for (first, second, third) in [(2, 3, 1), (3, 2, 5), (4, 1, 2), (2, 2, 3)] {
            let mut made = Vec::new();
            // Run 1 on `first` shards: shard s makes 10 * (s + 1) records.
            let mut positions: Vec<Vec<u8>> = (0..first)
                .map(|s| {
                    let mut r = g.create_reader(s, first).expect("reader");
                    r.poll(&mut made, 10 * (s + 1)).expect("poll");
                    r.position()
                })
                .collect();
            // Run 2 on `second` shards, from those positions; a few polls each.
            let mut old = first;
            for shards in [second, third] {
                positions = (0..shards)
                    .map(|s| {
                        let mine = super::super::taken_over(&positions, shards, s);
                        let mut r = g.create_reader(s, shards).expect("reader");
                        r.restore(old, &mine).expect("restore");
                        if shards == third {
                            made.extend(drain(&mut r, 7));
                        } else {
                            r.poll(&mut made, 25).expect("poll");
                        }
                        r.position()
                    })
                    .collect();
                old = shards;
            }
            made.sort_unstable();
            assert_eq!(
                made,
                (0..total).collect::<Vec<_>>(),
                "{first} -> {second} -> {third}"
            );
        }
    }

    /// A reader tells the split of each record it made, for watermarks per split: its own
    /// split's first index as one run; after a restore onto fewer shards, runs in index order
    /// across the splits it took over, and the splits it has not finished.
    #[test]
    fn a_reader_tells_the_splits_of_its_records() {
        let g = GeneratorSource::new(Some(40), 3, |i, _| i);
        let splits = |r: &dyn SourceReader<u64>| {
            let (mut runs, mut live) = (Vec::new(), Vec::new());
            assert!(r.splits(&mut runs, &mut live));
            (runs, live)
        };
        let mut own = g.create_reader(1, 2).expect("reader");
        let mut out = Vec::new();
        own.poll(&mut out, 4).expect("poll");
        assert_eq!(out, [1, 3, 5, 7]);
        assert_eq!(splits(own.as_ref()), (vec![(1, 4)], vec![1]));

        // Old shard 0 stood at 10, old shard 1 at 3: the merged reader makes 3, 5, 7, 9 of
        // split 1 first, then both in turn.
        let a = g.create_reader(0, 2).expect("reader");
        let mut a_pos = a.position();
        a_pos[POSITION_HEAD + 8..POSITION_HEAD + 16].copy_from_slice(&10u64.to_le_bytes());
        let mut b_pos = own.position();
        b_pos[POSITION_HEAD + 8..POSITION_HEAD + 16].copy_from_slice(&3u64.to_le_bytes());
        let mut r = g.create_reader(0, 1).expect("reader");
        r.restore(2, &[(0, &a_pos), (1, &b_pos)]).expect("restore");
        assert_eq!(splits(r.as_ref()), (vec![], vec![0, 1]), "before any poll");
        out.clear();
        r.poll(&mut out, 7).expect("poll");
        assert_eq!(out, [3, 5, 7, 9, 10, 11, 12]);
        assert_eq!(
            splits(r.as_ref()),
            (vec![(1, 4), (0, 1), (1, 1), (0, 1)], vec![0, 1])
        );
        out.clear();
        while r.poll(&mut out, 100).expect("poll") != SourcePoll::Finished {}
        assert_eq!(out.len(), 40 - 13);
        let (runs, live) = splits(r.as_ref());
        assert_eq!(runs.iter().map(|r| r.1).sum::<usize>(), out.len());
        assert!(live.is_empty(), "both splits finished: {live:?}");
    }

    /// Forged or foreign positions of splits are errors, never records made twice or lost:
    /// a split in two positions, splits of different steps, a split whose first index is not
    /// below its step, a next index off its split, and a count the bytes do not hold.
    #[test]
    fn bad_split_positions_are_refused() {
        let g = GeneratorSource::new(Some(100), 1, |i, _| i);
        let pos = |s: usize, n: usize| g.create_reader(s, n).expect("reader").position();
        let (a, b) = (pos(0, 2), pos(1, 2));
        let mut r = g.create_reader(0, 1).expect("reader");
        let e = r.restore(2, &[(0, &a), (0, &a)]).expect_err("twice");
        assert!(e.to_string().contains("split 0 is in two positions"), "{e}");
        let e = r
            .restore(3, &[(0, &a), (1, &pos(1, 3))])
            .expect_err("steps");
        assert!(e.to_string().contains("split the indices by 3"), "{e}");
        let mut forged = b.clone();
        forged[13..21].copy_from_slice(&2u64.to_le_bytes());
        let e = r.restore(2, &[(1, &forged)]).expect_err("first past step");
        assert!(e.to_string().contains("split 0 (first 2"), "{e}");
        let mut forged = b.clone();
        forged[21..29].copy_from_slice(&4u64.to_le_bytes());
        let e = r
            .restore(2, &[(1, &forged)])
            .expect_err("next off the split");
        assert!(e.to_string().contains("next 4"), "{e}");
        let mut forged = b.clone();
        forged[9..13].copy_from_slice(&u32::MAX.to_le_bytes());
        let e = r.restore(2, &[(1, &forged)]).expect_err("count");
        assert!(e.to_string().contains("do not hold"), "{e}");
        // The reader is unchanged by a refused restore: it makes its own split.
        assert_eq!(drain(&mut r, 50), (0..100).collect::<Vec<_>>());
    }

    #[test]
    fn a_schedule_origin_holds_records_until_due_and_survives_a_seek() {
        // An origin an hour ahead: nothing is due, however slow this thread is.
        let later = GeneratorSource::new(None, 1, |i, _| i)
            .with_rate_per_shard(1000)
            .with_schedule_origin(Instant::now() + std::time::Duration::from_secs(3600));
        let mut r = later.create_reader(1, 2).expect("reader");
        let mut out = Vec::new();
        assert_eq!(r.poll(&mut out, 100).expect("poll"), SourcePoll::Idle);
        assert!(out.is_empty(), "nothing before the origin");
        let origin = Instant::now() + std::time::Duration::from_millis(20);
        // 1000 records/s per shard: record k of a shard is due at origin + k ms.
        let g = GeneratorSource::new(None, 1, |i, _| i)
            .with_rate_per_shard(1000)
            .with_schedule_origin(origin);
        let mut r = g.create_reader(1, 2).expect("reader");
        let wait_until = |ms: u64| {
            while Instant::now() < origin + std::time::Duration::from_millis(ms) {
                std::thread::yield_now();
            }
        };
        wait_until(30);
        r.poll(&mut out, 1000).expect("poll");
        let made = out.len() as u64;
        let due = (origin.elapsed().as_millis() as u64) + 1;
        assert!(made >= 30 && made <= due, "{made} records made, {due} due");
        assert!(out.iter().enumerate().all(|(k, &i)| i == 1 + 2 * k as u64));
        // A restored reader at the same position is as far along the schedule: it makes what
        // fell due since (at least 10 records, 10 ms later), not a burst from the start.
        let pos = r.position();
        let mut r2 = g.create_reader(1, 2).expect("reader");
        r2.seek(&pos).expect("seek");
        wait_until(made + 10);
        out.clear();
        r2.poll(&mut out, 1000).expect("poll");
        let due_now = origin.elapsed().as_millis() as u64 + 1;
        assert!(
            out.len() >= 10 && made + out.len() as u64 <= due_now,
            "{} more after the seek, {due_now} due in all",
            out.len()
        );
        assert!(out
            .iter()
            .enumerate()
            .all(|(k, &i)| i == 1 + 2 * (made + k as u64)));
    }

    /// A reader that a restore onto fewer shards gave several splits keeps each on the
    /// schedule: 100 ms after the origin at 1000 records/s, two splits 80 records along
    /// each owe 20 each. Before, their 160 records were held against one split's 100, and
    /// the reader made nothing for another 60 ms (on a job's scale, for as long as it had
    /// run before the restore).
    #[test]
    fn a_reader_of_several_splits_keeps_each_on_the_schedule() {
        let origin = Instant::now() - std::time::Duration::from_millis(100);
        let g = GeneratorSource::new(None, 1, |i, _| i)
            .with_rate_per_shard(1000)
            .with_schedule_origin(origin);
        let positions: Vec<Vec<u8>> = (0..2)
            .map(|s| {
                let mut r = g.create_reader(s, 2).expect("reader");
                let mut out = Vec::new();
                r.poll(&mut out, 80).expect("poll");
                assert_eq!(out.len(), 80);
                r.position()
            })
            .collect();
        let mut r = g.create_reader(0, 1).expect("reader");
        r.restore(2, &super::super::taken_over(&positions, 1, 0))
            .expect("restore");
        let mut out = Vec::new();
        r.poll(&mut out, 1000).expect("poll");
        let due = 2 * (origin.elapsed().as_millis() as u64 + 1 - 80);
        assert!(
            out.len() >= 40 && out.len() as u64 <= due,
            "{} records made, {due} due",
            out.len()
        );
        // Index order across both: 160, 161, .. (each split's next ones).
        assert!(out.iter().enumerate().all(|(k, &i)| i == 160 + k as u64));
    }

    #[test]
    fn a_schedule_started_later_makes_nothing_until_then_and_is_shared() {
        let start = ScheduleStart::new();
        let g = GeneratorSource::new(None, 1, |i, _| i)
            .with_rate_per_shard(1000)
            .with_schedule(start.clone());
        let (mut r0, mut r1) = (
            g.create_reader(0, 2).expect("reader"),
            g.create_reader(1, 2).expect("reader"),
        );
        let mut out = Vec::new();
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert_eq!(r0.poll(&mut out, 100).expect("poll"), SourcePoll::Idle);
        assert!(out.is_empty(), "nothing before the schedule starts");
        // Started 50 ms in the past: both readers owe 50 records at once (the schedule runs
        // from the origin, not from when they were made or first polled).
        let origin = Instant::now() - std::time::Duration::from_millis(50);
        assert!(start.start_at(origin));
        assert!(!start.start_at(Instant::now()), "an origin is set once");
        assert_eq!(start.get(), Some(origin));
        r0.poll(&mut out, 1000).expect("poll");
        let made0 = out.len();
        out.clear();
        r1.poll(&mut out, 1000).expect("poll");
        let due = origin.elapsed().as_millis() as usize + 1;
        assert!((50..=due).contains(&made0), "{made0} made, {due} due");
        assert!(
            (50..=due).contains(&out.len()),
            "{} made, {due} due",
            out.len()
        );
        assert!(out.iter().enumerate().all(|(k, &i)| i == 1 + 2 * k as u64));
    }
}
