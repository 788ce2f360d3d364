//! Ingress: host threads hand batches of records to a running job.
//!
//! A shard never waits for a host thread and a host thread never wakes a shard per record:
//! host threads push whole batches into a bounded queue, and the shards poll it between their
//! other work (PLATFORM.md: one cross-thread wake costs tens of microseconds).

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};

use super::{Source, SourceError, SourcePoll, SourceReader};

struct Queue<T> {
    batches: VecDeque<Vec<T>>,
    /// Closed by the host ([`Ingress::close`]), or no job reads the queue any more (its
    /// [`IngressSource`] went with the job): pushes are refused, and a host thread blocked
    /// on a full queue wakes (it waited for good once the job had ended).
    closed: bool,
}

struct Shared<T> {
    q: Mutex<Queue<T>>,
    not_full: Condvar,
    capacity_batches: usize,
}

/// The host side of an ingress: push batches, then [`Ingress::close`].
pub struct Ingress<T> {
    shared: Arc<Shared<T>>,
}

impl<T> Clone for Ingress<T> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

/// The job side of an ingress. Records are not replayable, so after a restore an ingress
/// continues with what host threads push next (at-least-once at best; use a replayable source
/// for exactly-once).
pub struct IngressSource<T> {
    shared: Arc<Shared<T>>,
}

/// The queue was closed, or the job that read it ended.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("the ingress is closed")]
pub struct Closed;

/// A bounded ingress holding at most `capacity_batches` batches.
pub fn ingress<T>(capacity_batches: usize) -> (Ingress<T>, IngressSource<T>) {
    let shared = Arc::new(Shared {
        q: Mutex::new(Queue {
            batches: VecDeque::new(),
            closed: false,
        }),
        not_full: Condvar::new(),
        capacity_batches: capacity_batches.max(1),
    });
    (
        Ingress {
            shared: shared.clone(),
        },
        IngressSource { shared },
    )
}

impl<T> Ingress<T> {
    /// Pushes a batch, waiting while the queue is full (backpressure on the host thread).
    pub fn push_batch(&self, batch: Vec<T>) -> Result<(), Closed> {
        let mut q = self.shared.q.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if q.closed {
                return Err(Closed);
            }
            if q.batches.len() < self.shared.capacity_batches {
                q.batches.push_back(batch);
                return Ok(());
            }
            q = self
                .shared
                .not_full
                .wait(q)
                .unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Pushes a batch if there is room; gives it back otherwise.
    pub fn try_push_batch(&self, batch: Vec<T>) -> Result<(), (Vec<T>, Option<Closed>)> {
        let mut q = self.shared.q.lock().unwrap_or_else(|p| p.into_inner());
        if q.closed {
            return Err((batch, Some(Closed)));
        }
        if q.batches.len() >= self.shared.capacity_batches {
            return Err((batch, None));
        }
        q.batches.push_back(batch);
        Ok(())
    }

    /// Ends the input: the job's sources finish once the queue is drained.
    pub fn close(&self) {
        let mut q = self.shared.q.lock().unwrap_or_else(|p| p.into_inner());
        q.closed = true;
        self.shared.not_full.notify_all();
    }
}

struct IngressReader<T> {
    shared: Arc<Shared<T>>,
    current: std::vec::IntoIter<T>,
}

impl<T: Send + 'static> SourceReader<T> for IngressReader<T> {
    fn poll(&mut self, out: &mut Vec<T>, max: usize) -> Result<SourcePoll, SourceError> {
        let before = out.len();
        loop {
            out.extend(self.current.by_ref().take(max - (out.len() - before)));
            if out.len() - before >= max {
                return Ok(SourcePoll::Ready);
            }
            let mut q = self.shared.q.lock().unwrap_or_else(|p| p.into_inner());
            match q.batches.pop_front() {
                Some(b) => {
                    drop(q);
                    self.shared.not_full.notify_one();
                    self.current = b.into_iter();
                }
                None if q.closed => {
                    return Ok(if out.len() > before {
                        SourcePoll::Ready
                    } else {
                        SourcePoll::Finished
                    })
                }
                None => {
                    return Ok(if out.len() > before {
                        SourcePoll::Ready
                    } else {
                        SourcePoll::Idle
                    })
                }
            }
        }
    }

    fn position(&self) -> Vec<u8> {
        Vec::new()
    }

    fn seek(&mut self, _position: &[u8]) -> Result<(), SourceError> {
        Ok(())
    }
}

/// The job that read the queue ended (or it was never given to one): nothing will take the
/// batches, so pushes are refused from now on.
impl<T> Drop for IngressSource<T> {
    fn drop(&mut self) {
        let mut q = self.shared.q.lock().unwrap_or_else(|p| p.into_inner());
        q.closed = true;
        self.shared.not_full.notify_all();
    }
}

impl<T: Send + 'static> Source<T> for IngressSource<T> {
    fn create_reader(
        &self,
        _shard: usize,
        _shards: usize,
    ) -> Result<Box<dyn SourceReader<T>>, SourceError> {
        Ok(Box::new(IngressReader {
            shared: self.shared.clone(),
            current: Vec::new().into_iter(),
        }))
    }

    fn name(&self) -> &str {
        "ingress"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_flow_and_close_finishes() {
        let (tx, src) = ingress::<u32>(2);
        let mut r = src.create_reader(0, 1).expect("reader");
        let mut out = Vec::new();
        assert_eq!(r.poll(&mut out, 10).expect("poll"), SourcePoll::Idle);
        tx.push_batch(vec![1, 2, 3]).expect("push");
        tx.push_batch(vec![4]).expect("push");
        assert!(tx.try_push_batch(vec![5]).is_err(), "bounded");
        assert_eq!(r.poll(&mut out, 2).expect("poll"), SourcePoll::Ready);
        assert_eq!(r.poll(&mut out, 10).expect("poll"), SourcePoll::Ready);
        assert_eq!(out, vec![1, 2, 3, 4]);
        tx.close();
        assert_eq!(r.poll(&mut out, 10).expect("poll"), SourcePoll::Finished);
        assert_eq!(tx.push_batch(vec![9]), Err(Closed));
    }

    #[test]
    fn a_full_queue_blocks_the_host_until_the_shard_takes_a_batch() {
        let (tx, src) = ingress::<u32>(1);
        tx.push_batch(vec![1]).expect("push");
        let tx2 = tx.clone();
        let t = std::thread::spawn(move || tx2.push_batch(vec![2]));
        // The host stays blocked while nothing is taken. (A push that did not block would
        // return within this time; one that blocks is never finished here, however slow the
        // machine: the check cannot fail spuriously.)
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!t.is_finished(), "push_batch returned with the queue full");
        let mut r = src.create_reader(0, 1).expect("reader");
        let mut out = Vec::new();
        // A lost wake-up fails here rather than hanging the suite.
        let give_up = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while out.len() < 2 {
            assert!(
                std::time::Instant::now() < give_up,
                "the host was never woken"
            );
            r.poll(&mut out, 10).expect("poll");
            std::thread::yield_now();
        }
        t.join().expect("join").expect("push");
        assert_eq!(out, vec![1, 2]);
    }
}
