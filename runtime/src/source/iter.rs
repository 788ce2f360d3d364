//! A source from an iterator made on each shard.

use std::sync::Arc;

use super::{Source, SourceError, SourcePoll, SourceReader};

/// Reads the items of an iterator that `make(shard, shards)` creates on each shard. Its
/// position is the number of items taken, so a restore re-creates the iterator and skips them:
/// `make` must be deterministic for the restore to be exact.
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

struct IterReader<I, F> {
    iter: I,
    taken: u64,
    make: Arc<F>,
    shard: usize,
    shards: usize,
}

impl<T, I, F> SourceReader<T> for IterReader<I, F>
where
    T: 'static,
    I: Iterator<Item = T> + 'static,
    F: Fn(usize, usize) -> I + Send + Sync + 'static,
{
    fn poll(&mut self, out: &mut Vec<T>, max: usize) -> Result<SourcePoll, SourceError> {
        let before = out.len();
        out.extend(self.iter.by_ref().take(max));
        let n = out.len() - before;
        self.taken += n as u64;
        Ok(if n < max {
            SourcePoll::Finished
        } else {
            SourcePoll::Ready
        })
    }

    fn position(&self) -> Vec<u8> {
        self.taken.to_le_bytes().to_vec()
    }

    fn seek(&mut self, position: &[u8]) -> Result<(), SourceError> {
        let n = <[u8; 8]>::try_from(position)
            .map(u64::from_le_bytes)
            .map_err(|_| {
                SourceError::BadPosition(format!("{} bytes, expected 8", position.len()))
            })?;
        self.iter = (self.make)(self.shard, self.shards);
        for i in 0..n {
            if self.iter.next().is_none() {
                return Err(SourceError::BadPosition(format!(
                    "position {n} is past the end of the iterator ({i} items)"
                )));
            }
        }
        self.taken = n;
        Ok(())
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
            iter: (self.make)(shard, shards),
            taken: 0,
            make: self.make.clone(),
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
}
