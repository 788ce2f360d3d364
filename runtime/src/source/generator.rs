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
    /// `origin + k / rate`, and none is made before it is due, also after a restore. A job
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

struct GenReader<F> {
    /// This shard's first index.
    first: u64,
    next: u64,
    step: u64,
    total: Option<u64>,
    seed: u64,
    rate_per_sec: Option<u64>,
    /// The fixed schedule, if any; `started` caches its origin once set.
    origin: Option<ScheduleStart>,
    started: Option<Instant>,
    /// Records made since the schedule started (with an origin: since index `first`).
    emitted: u64,
    f: Arc<F>,
}

impl<T: 'static, F: Fn(u64, u64) -> T + Send + Sync + 'static> SourceReader<T> for GenReader<F> {
    fn poll(&mut self, out: &mut Vec<T>, max: usize) -> Result<SourcePoll, SourceError> {
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
            budget = budget.min(allowed.saturating_sub(self.emitted));
            if budget == 0 {
                return Ok(SourcePoll::Idle);
            }
        }
        for _ in 0..budget {
            if self.total.is_some_and(|t| self.next >= t) {
                return Ok(SourcePoll::Finished);
            }
            out.push((self.f)(self.next, splitmix64(self.seed, self.next)));
            self.emitted += 1;
            match self.next.checked_add(self.step) {
                Some(n) => self.next = n,
                // The u64 index space is used up: an unbounded generator ends there.
                None => {
                    self.total = Some(self.next);
                    return Ok(SourcePoll::Finished);
                }
            }
        }
        if self.total.is_some_and(|t| self.next >= t) {
            return Ok(SourcePoll::Finished);
        }
        Ok(SourcePoll::Ready)
    }

    fn position(&self) -> Vec<u8> {
        self.next.to_le_bytes().to_vec()
    }

    fn seek(&mut self, position: &[u8]) -> Result<(), SourceError> {
        let next = <[u8; 8]>::try_from(position)
            .map(u64::from_le_bytes)
            .map_err(|_| {
                SourceError::BadPosition(format!("{} bytes, expected 8", position.len()))
            })?;
        // A position this reader could have reached: one of its shard's indices (first, then
        // every `step`), at most one step past the last. Another one (a forged position, or
        // one from a checkpoint taken on another number of shards) would emit other shards'
        // records and skip its own.
        let ours = next >= self.first && (next - self.first).is_multiple_of(self.step);
        let past_end = self
            .total
            .is_some_and(|t| next > t && next - t >= self.step);
        if !ours || past_end {
            return Err(SourceError::BadPosition(format!(
                "index {next} is not a position of generator shard {} of {}{}",
                self.first,
                self.step,
                self.total
                    .map_or(String::new(), |t| format!(" over {t} records")),
            )));
        }
        self.next = next;
        if self.origin.is_some() {
            // The fixed schedule goes on where the restored position lies on it.
            self.emitted = next.saturating_sub(self.first) / self.step;
        }
        Ok(())
    }
}

impl<T: 'static, F: Fn(u64, u64) -> T + Send + Sync + 'static> Source<T> for GeneratorSource<F> {
    fn create_reader(
        &self,
        shard: usize,
        shards: usize,
    ) -> Result<Box<dyn SourceReader<T>>, SourceError> {
        Ok(Box::new(GenReader {
            first: shard as u64,
            next: shard as u64,
            step: shards as u64,
            total: self.total,
            seed: self.seed,
            rate_per_sec: self.rate_per_sec,
            origin: self.origin.clone(),
            started: None,
            emitted: 0,
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
