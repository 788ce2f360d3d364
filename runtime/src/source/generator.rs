//! A seeded, deterministic generator source.

use std::sync::Arc;
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
    origin: Option<Instant>,
    f: Arc<F>,
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
    pub fn with_schedule_origin(mut self, origin: Instant) -> Self {
        self.origin = Some(origin);
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
    origin: Option<Instant>,
    started: Option<Instant>,
    /// Records made since the schedule started (with an origin: since index `first`).
    emitted: u64,
    f: Arc<F>,
}

impl<T: 'static, F: Fn(u64, u64) -> T + Send + Sync + 'static> SourceReader<T> for GenReader<F> {
    fn poll(&mut self, out: &mut Vec<T>, max: usize) -> Result<SourcePoll, SourceError> {
        let mut budget = max as u64;
        if let Some(rate) = self.rate_per_sec {
            let started = match self.origin {
                Some(o) => o,
                None => *self.started.get_or_insert_with(Instant::now),
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
            self.next += self.step;
            self.emitted += 1;
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
            origin: self.origin,
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

    #[test]
    fn a_schedule_origin_holds_records_until_due_and_survives_a_seek() {
        let origin = Instant::now() + std::time::Duration::from_millis(200);
        // 1000 records/s per shard: record k of a shard is due at origin + k ms.
        let g = GeneratorSource::new(None, 1, |i, _| i)
            .with_rate_per_shard(1000)
            .with_schedule_origin(origin);
        let mut r = g.create_reader(1, 2).expect("reader");
        let mut out = Vec::new();
        assert_eq!(r.poll(&mut out, 100).expect("poll"), SourcePoll::Idle);
        assert!(out.is_empty(), "nothing before the origin");
        while Instant::now() < origin + std::time::Duration::from_millis(30) {
            std::thread::yield_now();
        }
        r.poll(&mut out, 1000).expect("poll");
        let made = out.len() as u64;
        let due = (origin.elapsed().as_millis() as u64) + 1;
        assert!(made >= 30 && made <= due, "{made} records made, {due} due");
        assert!(out.iter().enumerate().all(|(k, &i)| i == 1 + 2 * k as u64));
        // A restored reader at the same position is as far along the schedule: it makes only
        // what fell due since, not a burst from the start.
        let pos = r.position();
        let mut r2 = g.create_reader(1, 2).expect("reader");
        r2.seek(&pos).expect("seek");
        out.clear();
        r2.poll(&mut out, 1000).expect("poll");
        let due_now = origin.elapsed().as_millis() as u64 + 1;
        assert!(
            made + out.len() as u64 <= due_now,
            "{} more after the seek, {due_now} due in all",
            out.len()
        );
        assert!(out.first().is_none_or(|&i| i == 1 + 2 * made));
    }
}
