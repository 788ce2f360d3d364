//! weir's keyed state: an LSM store per keyed operator and shard on memory-mapped, CRC-checked segment files,
//! key groups, and the keyed state API operators use.
//!
//! * [`Store`]: memtable, frozen memtables, segments, size-tiered compaction, snapshots.
//! * [`KeyedBackend`]: the operator-facing API (value, list, map, reducing, aggregating state,
//!   namespaces for windows, timers) over a store.
//!
//! **Architecture invariant:** `state` never spawns a task and never reads the clock.

mod block_index;
mod bloom;
mod error;
mod handle;
mod hugemem;
mod key;
mod keyed;
mod memtable;
mod segment;
mod store;

pub use error::{FormatError, IoError, StateError};
pub use handle::{SegmentRef, SnapshotHandle};
pub use key::{
    key_group_for, KeyCodec, KeyGroup, KeyGroupRange, DEFAULT_MAX_PARALLELISM, MAX_KEY_BYTES,
};
pub use keyed::{
    short_type_name, AggregateFunction, AggregatingState, KeyedBackend, ListState, MapState,
    ReducingState, StateValue, TimeDomain, Timer, ValueState, KEY_TYPE_ID, TIMER_STATE_ID,
};
pub use segment::{diagnose_segment, layout as segment_layout};
pub use store::{
    CompactionDone, CompactionJob, FlushDone, FlushJob, Found, JobDone, RestoreReport, ScanIter,
    SnapshotJob, Store, StoreConfig, StoreMetrics,
};
