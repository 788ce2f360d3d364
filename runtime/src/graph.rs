//! The job graph and how it becomes operators on each shard.
//!
//! A [`Stream`](crate::Stream) is a *factory*: given the downstream collector on a shard, it
//! builds its operator and asks its upstream to do the same, down to a head. A head is what a
//! shard's loop drives: a source reader, or the reading end of an exchange. Exchanges (key_by,
//! rebalance, broadcast) cut the chain: their writers are the tail of the upstream chain, their
//! readers the head of the downstream one. Each head knows the exchange writers of its own chain
//! (its [`Gate`]) and stops pulling input while one of them cannot hand its batch to a ring:
//! that is backpressure, per chain, so that two chains on a shard never wait on each other.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;

use crate::config::JobConfig;
use crate::error::{JobError, StartError};
use crate::exchange::ExchangeEndpoints;
use crate::metrics::Registry;
use crate::operator::Out;

/// What a head's step achieved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HeadStatus {
    /// Records or events moved.
    Progress,
    /// Nothing to do now.
    Idle,
    /// Output is full: a ring has no room for this chain's pending batch.
    Blocked,
    /// The input ended and everything was handed on.
    Done,
}

/// A driver of one chain on one shard.
pub(crate) trait Head: 'static {
    /// Moves up to one batch of input through the chain. `now_ms` is processing time.
    fn step(&mut self, now_ms: i64) -> Result<HeadStatus, JobError>;
    /// The operator that heads the chain (a source or an exchange), as metrics name it: a
    /// panic in the chain is reported with it.
    fn name(&self) -> &str;
}

/// Something at the end of a chain that may hold output it could not hand over yet.
pub(crate) trait Flush {
    /// Publishes what was written and tries to hand over pending output. True when nothing is
    /// pending any more.
    fn flush(&self) -> bool;
}

/// The exchange writers at the end of one chain, and the barrier blocks on its way (an input
/// of a union that delivered a barrier waits for the other inputs). A union's inputs each get
/// a child gate of the gate below the union.
#[derive(Default)]
pub(crate) struct Gate {
    writers: RefCell<Vec<Rc<dyn Flush>>>,
    blockers: RefCell<Vec<Rc<std::cell::Cell<bool>>>>,
    parent: Option<Rc<Gate>>,
}

impl Gate {
    pub fn child_of(parent: Rc<Gate>) -> Self {
        Self {
            parent: Some(parent),
            ..Self::default()
        }
    }

    pub fn register(&self, w: Rc<dyn Flush>) {
        self.writers.borrow_mut().push(w);
    }

    pub fn add_blocker(&self, b: Rc<std::cell::Cell<bool>>) {
        self.blockers.borrow_mut().push(b);
    }

    /// True when every writer of the chain has handed over all its output.
    pub fn flush(&self) -> bool {
        let mut all = true;
        for w in self.writers.borrow().iter() {
            all &= w.flush();
        }
        if let Some(p) = &self.parent {
            all &= p.flush();
        }
        all
    }

    /// True while a barrier alignment downstream holds this chain's input back.
    pub fn is_blocked(&self) -> bool {
        self.blockers.borrow().iter().any(|b| b.get())
            || self.parent.as_ref().is_some_and(|p| p.is_blocked())
    }
}

/// A failure that an operator deep in a chain records for its head to report (a chain's
/// `collect` returns nothing, so that the hot path has no error plumbing).
#[derive(Clone, Default)]
pub(crate) struct FailCell(Rc<RefCell<Option<JobError>>>);

impl FailCell {
    pub fn fail(&self, e: JobError) {
        let mut slot = self.0.borrow_mut();
        if slot.is_none() {
            *slot = Some(e);
        }
    }

    pub fn take(&self) -> Option<JobError> {
        self.0.borrow_mut().take()
    }
}

/// Everything a factory needs to build its operator on one shard.
pub(crate) struct BuildCtx {
    pub shard: usize,
    pub shards: usize,
    pub config: Arc<JobConfig>,
    pub heads: Vec<Box<dyn Head>>,
    /// The gate of the chain being built; a head takes it, leaving a fresh one.
    pub gate: Rc<Gate>,
    pub exchanges: ExchangeEndpoints,
    pub metrics: Arc<Registry>,
    pub fail: FailCell,
    /// Where this shard's operators keep their state stores.
    pub state_dir: std::path::PathBuf,
    /// Stores through io_uring with a maintenance thread (shards), or std::fs inline (the
    /// test driver).
    pub real_io: bool,
    /// Every store opened on the shard: the loop runs their background work.
    pub states: Vec<crate::keyed::ShardState>,
    /// Checkpointing, when the job has it.
    pub checkpoint: Option<crate::checkpoint::shard::ShardCheckpointRef>,
    /// The checkpoint the job restores from, if any.
    pub restore: Option<Arc<crate::checkpoint::restore::RestoreState>>,
    /// Monotonic origin shared by every shard (latency markers).
    pub epoch: std::time::Instant,
    /// The job's maintenance threads, which [`crate::JobHandle::wait`] waits for.
    pub maintenance: Arc<crate::backend::MaintenanceThreads>,
    /// Pushed by each timestamp assigner of the chain being built: the heads that drive the
    /// chain (one, or one per input of a union) tell them the source and split of each record
    /// (an exchange head's records are one split). Any other head drops them.
    pub split_tags: Vec<Rc<crate::time::SplitTags>>,
    /// Set when the attempt stops (the user's cancel, another shard's failure). Heads read it
    /// between records, so a batch of slow user calls does not hold a stop back by the whole
    /// batch (1024 calls of a 5 ms sink held a cancel 4.2 s).
    pub stop: Arc<std::sync::atomic::AtomicBool>,
}

impl BuildCtx {
    /// Takes the gate of the chain that a head about to be built drives.
    pub fn take_gate(&mut self) -> Rc<Gate> {
        // The chain ends at this head; the next one built is another chain's.
        self.split_tags.clear();
        std::mem::take(&mut self.gate)
    }

    /// Opens the state store of operator `name` on this shard, restored from the job's restore
    /// checkpoint when there is one.
    pub fn open_state(&mut self, name: &str) -> Result<crate::keyed::ShardState, StartError> {
        let s = crate::keyed::ShardState::open_for(self, name)?;
        self.states.push(s.clone());
        Ok(s)
    }
}

/// Builds one sink-terminated pipeline on a shard.
pub(crate) type Root = Arc<dyn Fn(&mut BuildCtx) -> Result<(), StartError> + Send + Sync>;

/// Builds an operator chain ending in the given downstream collector.
pub(crate) type Factory<T> =
    Arc<dyn Fn(&mut BuildCtx, Out<T>) -> Result<(), StartError> + Send + Sync>;

/// The graph a [`Job`](crate::Job) collects while the user builds streams.
#[derive(Default)]
pub(crate) struct Graph {
    pub roots: Vec<Root>,
    pub exchanges: usize,
    pub names: Vec<String>,
}

impl Graph {
    /// A unique default operator name: the kind and an index. [`Stream::uid`](crate::Stream::uid)
    /// may replace it before the job starts.
    pub fn name(&mut self, kind: &str) -> Name {
        let name = format!("{kind}-{}", self.names.len());
        self.names.push(name.clone());
        Arc::new(std::sync::Mutex::new(name))
    }

    /// Registers a user-given uid; uids name state and must be unique.
    pub fn uid(&mut self, uid: &str) -> Result<String, String> {
        if self.names.iter().any(|n| n == uid) {
            return Err(format!("operator uid `{uid}` is used twice"));
        }
        self.names.push(uid.to_string());
        Ok(uid.to_string())
    }

    pub fn new_exchange(&mut self) -> usize {
        self.exchanges += 1;
        self.exchanges - 1
    }
}

pub(crate) type GraphRef = Rc<RefCell<Graph>>;

/// An operator's name, settable by `uid` until the job starts; factories read it when they
/// build the operator on a shard.
pub(crate) type Name = Arc<std::sync::Mutex<String>>;

/// The current value of a name.
pub(crate) fn name_of(n: &Name) -> String {
    n.lock().unwrap_or_else(|p| p.into_inner()).clone()
}
