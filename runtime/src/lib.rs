//! weir's runtime: the API that services embed to run stream-processing jobs.
//!
//! A [`Job`] is built from sources, transformations and sinks, then started on shards (one
//! pinned glommio executor thread per core). Operators that need no exchange are chained on a
//! shard as plain calls; exchanges (`key_by`, `rebalance`, `broadcast`) move records between
//! shards through single-producer single-consumer rings as rkyv-archived bytes.
//!
//! ```no_run
//! use weir_runtime::{Job, JobConfig};
//! let job = Job::new(JobConfig::new().with_shards(2));
//! let sums = job
//!     .from_vec((0..1000u64).map(|i| (i % 10, i)).collect())
//!     .key_by(|(k, _)| *k)
//!     .reduce(|(k, a), (_, b)| (k, a + b))
//!     .collect();
//! job.run().expect("job");
//! assert_eq!(sums.take().len(), 1000);
//! ```

mod backend;
pub mod checkpoint;
mod config;
mod data;
mod error;
mod exchange;
mod graph;
mod join;
mod keyed;
mod metrics;
mod operator;
pub mod platform;
mod shard;
pub mod sink;
pub mod source;
mod stream;
pub mod testing;
mod time;
mod unaligned;
mod window;

pub use config::{
    JobConfig, Pinning, RestoreFrom, MAX_BATCH_RECORDS, MAX_IDLE_SLEEP_US, MAX_INTERVAL_MS,
    MAX_IO_MEMORY_BYTES, MAX_MEMTABLE_BUDGET_BYTES, MIN_MEMTABLE_BUDGET_BYTES,
};
pub use data::Data;
pub use error::{JobError, SavepointError, StartError};
pub use join::{CoProcessFunction, ConnectedStreams, Either};
pub use keyed::{
    shard_for_key_group, AggregateFunction, FnProcess, KeyedContext, KeyedProcessFunction,
    KeyedStream, ProcessStream, TimeDomain,
};
pub use metrics::{HeadMetrics, JobMetrics, LatencySummary, OperatorMetrics, StateMetrics};
pub use shard::{JobHandle, JobStatus, JobSummary, StatusChange, STATE_STALL};
pub use stream::{Job, Stream, StreamSink};
pub use time::WatermarkStrategy;
pub use weir_state::KeyCodec;
pub use window::{window_start, Window, WindowAssigner, WindowRangeError, WindowedStream};
