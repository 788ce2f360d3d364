//! A deterministic, single-threaded driver for testing jobs without shards or io_uring.
//!
//! The driver builds the job's operators on the calling thread as one shard would, feeds them
//! the records, watermarks and processing time the test chooses, and collects what reaches
//! the sink. Exchanges still go through a real ring (one shard to itself), so records take
//! the same serialize-and-read-in-place path as in a running job.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use crate::config::JobConfig;
use crate::data::Data;
use crate::error::{JobError, StartError};
use crate::graph::{BuildCtx, Factory, FailCell, Head, HeadStatus};
use crate::operator::{Event, Out, NO_TS};
use crate::sink::{Sink, SinkWriter};
use crate::stream::{Job, Stream};

enum Item<I> {
    Record(I, i64),
    Watermark(i64),
    End,
}

type Queue<I> = Arc<Mutex<VecDeque<Item<I>>>>;
type Output<O> = Arc<Mutex<Vec<(O, i64)>>>;

/// Drives a job built from one input stream to one output stream.
pub struct TestDriver<I, O> {
    input: Queue<I>,
    output: Output<O>,
    heads: Vec<Box<dyn Head>>,
    done: Vec<bool>,
    fail: FailCell,
    /// The message of the panic in user code that failed the driver: every later run
    /// returns it, as a failed job stays failed.
    failed: Option<String>,
    now_ms: i64,
    states: Vec<crate::keyed::ShardState>,
    /// Keeps what the operators were built with alive; its registry holds their counters.
    ctx: BuildCtx,
    _state_dir: tempfile::TempDir,
}

impl<I: Data, O: Data> TestDriver<I, O> {
    /// Builds `job(input)` with the default test configuration.
    pub fn new(job: impl FnOnce(Stream<I>) -> Stream<O>) -> Result<Self, StartError> {
        Self::with_config(JobConfig::new().with_shards(1), job)
    }

    /// Builds `job(input)` with `config` (its shard count is ignored: the driver is one shard).
    pub fn with_config(
        config: JobConfig,
        job: impl FnOnce(Stream<I>) -> Stream<O>,
    ) -> Result<Self, StartError> {
        let config = JobConfig {
            shards: 1,
            ..config
        };
        config.validate()?;
        let input: Queue<I> = Arc::default();
        let output: Output<O> = Arc::default();
        let j = Job::new(config.clone());
        let q = input.clone();
        let factory: Factory<I> = Arc::new(move |ctx: &mut BuildCtx, down: Out<I>| {
            let head = DriverHead {
                input: q.clone(),
                down,
                gate: ctx.take_gate(),
                batch: ctx.config.batch_records,
                last_ms: i64::MIN,
                ended: false,
            };
            ctx.heads.push(Box::new(head));
            Ok(())
        });
        let name = j.graph.borrow_mut().name("driver");
        let out_stream = job(j.stream(factory, name));
        out_stream.sink(DriverSink {
            out: output.clone(),
        });
        if let Some(e) = j.errors.borrow().first() {
            return Err(StartError::Config {
                key: "graph".into(),
                reason: e.clone(),
            });
        }
        let graph = std::mem::take(&mut *j.graph.borrow_mut());
        let mut endpoints = crate::exchange::wire(graph.exchanges, 1, config.ring_capacity_bytes);
        // The driver needs no io_uring: its store uses std::fs in a temporary directory.
        let state_dir = tempfile::Builder::new()
            .prefix("weir-driver-")
            .tempdir()
            .map_err(|source| StartError::StateDir {
                path: std::env::temp_dir(),
                source,
            })?;
        let config = Arc::new(config);
        let mut ctx = BuildCtx {
            shard: 0,
            shards: 1,
            state_dir: state_dir.path().to_path_buf(),
            real_io: false,
            states: Vec::new(),
            checkpoint: None,
            restore: None,
            config,
            heads: Vec::new(),
            gate: Default::default(),
            exchanges: endpoints.remove(0),
            metrics: crate::metrics::Registry::new(),
            fail: FailCell::default(),
            epoch: std::time::Instant::now(),
            maintenance: Default::default(),
            split_tags: Vec::new(),
            stop: Default::default(),
        };
        for root in &graph.roots {
            root(&mut ctx)?;
            ctx.gate = Default::default();
        }
        let heads = std::mem::take(&mut ctx.heads);
        let states = std::mem::take(&mut ctx.states);
        Ok(Self {
            input,
            output,
            done: vec![false; heads.len()],
            heads,
            fail: ctx.fail.clone(),
            failed: None,
            now_ms: 0,
            states,
            ctx,
            _state_dir: state_dir,
        })
    }

    /// The operators' metrics so far, as [`crate::JobHandle::metrics`] gives a job's (every
    /// operator on shard 0): records in, out and dropped (late records, skipped input).
    pub fn metrics(&self) -> crate::metrics::JobMetrics {
        self.ctx.metrics.snapshot()
    }

    fn push_item(&mut self, item: Item<I>) {
        self.input
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push_back(item);
    }

    /// Queues a record without an event timestamp.
    pub fn push(&mut self, rec: I) {
        self.push_item(Item::Record(rec, NO_TS));
    }

    /// Queues a record with an event timestamp.
    pub fn push_at(&mut self, rec: I, ts: i64) {
        self.push_item(Item::Record(rec, ts));
    }

    /// Queues a watermark.
    pub fn watermark(&mut self, ts: i64) {
        self.push_item(Item::Watermark(ts));
    }

    /// Sets processing time; timers due by then fire on the next run.
    pub fn set_processing_time(&mut self, now_ms: i64) {
        self.now_ms = now_ms;
    }

    /// Runs every operator until nothing moves. A panic in user code is an error
    /// ([`JobError::Panic`]), as in a real job, not a panic of the caller; the driver is
    /// failed from then on.
    pub fn run_until_idle(&mut self) -> Result<(), JobError> {
        if let Some(message) = &self.failed {
            return Err(JobError::Panic {
                shard: 0,
                message: message.clone(),
            });
        }
        // A step's panic comes back as an error naming its chain; any other (a store's
        // maintenance) is caught here.
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.run_steps()));
        let r = run.unwrap_or_else(|p| {
            Err(JobError::Panic {
                shard: 0,
                message: crate::shard::panic_message(&*p),
            })
        });
        if let Err(JobError::Panic { message, .. }) = &r {
            self.failed = Some(message.clone());
        }
        r
    }

    fn run_steps(&mut self) -> Result<(), JobError> {
        loop {
            let mut progress = false;
            for (h, d) in self.heads.iter_mut().zip(self.done.iter_mut()) {
                if *d {
                    continue;
                }
                let now = self.now_ms;
                let s = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| h.step(now)))
                    .map_err(|p| JobError::Panic {
                    shard: 0,
                    message: crate::shard::in_chain(&*p, h.name()),
                })??;
                if let Some(e) = self.fail.take() {
                    return Err(e);
                }
                match s {
                    HeadStatus::Progress => progress = true,
                    HeadStatus::Done => *d = true,
                    HeadStatus::Idle | HeadStatus::Blocked => {}
                }
            }
            for st in &self.states {
                st.maintain()?;
            }
            if !progress {
                return Ok(());
            }
        }
    }

    /// Runs until idle and takes the records that reached the sink.
    pub fn drain(&mut self) -> Result<Vec<O>, JobError> {
        Ok(self
            .drain_with_timestamps()?
            .into_iter()
            .map(|(o, _)| o)
            .collect())
    }

    /// Runs until idle and takes the records that reached the sink, with their timestamps.
    pub fn drain_with_timestamps(&mut self) -> Result<Vec<(O, Option<i64>)>, JobError> {
        self.run_until_idle()?;
        let v = std::mem::take(&mut *self.output.lock().unwrap_or_else(|p| p.into_inner()));
        Ok(v.into_iter()
            .map(|(o, ts)| (o, (ts != NO_TS).then_some(ts)))
            .collect())
    }

    /// Ends the input (with a final watermark, as a finite source does) and drains.
    pub fn finish(&mut self) -> Result<Vec<O>, JobError> {
        self.push_item(Item::End);
        self.drain()
    }
}

struct DriverHead<I> {
    input: Queue<I>,
    down: Out<I>,
    gate: std::rc::Rc<crate::graph::Gate>,
    batch: usize,
    last_ms: i64,
    ended: bool,
}

impl<I: 'static> Head for DriverHead<I> {
    fn name(&self) -> &str {
        "driver"
    }

    fn step(&mut self, now_ms: i64) -> Result<HeadStatus, JobError> {
        if !self.gate.flush() {
            return Ok(HeadStatus::Blocked);
        }
        if self.ended {
            return Ok(HeadStatus::Done);
        }
        let mut moved = false;
        if now_ms != self.last_ms {
            self.last_ms = now_ms;
            self.down.processing_time(now_ms);
            moved = true;
        }
        for _ in 0..self.batch {
            let item = self
                .input
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .pop_front();
            match item {
                None => break,
                Some(Item::Record(r, ts)) => self.down.collect(r, ts),
                Some(Item::Watermark(w)) => self.down.event(Event::Watermark(w)),
                Some(Item::End) => {
                    self.down.event(Event::Watermark(i64::MAX));
                    self.down.event(Event::EndOfInput);
                    self.ended = true;
                    moved = true;
                    break;
                }
            }
            moved = true;
        }
        self.gate.flush();
        Ok(if moved {
            HeadStatus::Progress
        } else {
            HeadStatus::Idle
        })
    }
}

struct DriverSink<O> {
    out: Output<O>,
}

struct DriverWriter<O> {
    out: Output<O>,
}

impl<O: Send + 'static> SinkWriter<O> for DriverWriter<O> {
    fn write(&mut self, rec: O, ts: i64) -> std::io::Result<()> {
        self.out
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((rec, ts));
        Ok(())
    }
    fn finish(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<O: Send + 'static> Sink<O> for DriverSink<O> {
    fn create_writer(
        &self,
        _shard: usize,
        _shards: usize,
    ) -> Result<Box<dyn SinkWriter<O>>, StartError> {
        Ok(Box::new(DriverWriter {
            out: self.out.clone(),
        }))
    }
    fn name(&self) -> &str {
        "driver_sink"
    }
}
