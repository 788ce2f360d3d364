//! The shard's keyed state as operators use it: the shard's [`weir_state::KeyedBackend`], and
//! the background thread that runs its flushes and compactions.
//!
//! Processing never waits for state I/O (DESIGN invariant 5): a full memtable is frozen in
//! place (microseconds), and the frozen memtable's flush to a segment, like every compaction,
//! runs as a `Send` job on the shard's maintenance thread; the shard installs the finished job
//! between two steps of its loop.

use std::cell::RefCell;
use std::path::Path;
use std::rc::Rc;
use std::sync::mpsc;
use std::sync::Arc;

use weir_io::Fs;
use weir_state::{JobDone, KeyGroupRange, KeyedBackend, Store, StoreConfig};

use crate::config::JobConfig;
use crate::data::Data;
use crate::error::{JobError, StartError};

pub use weir_state::StateError;

/// A registered state: its full name (operator uid and state name). The store derives the
/// state's id from it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct StateId(pub Rc<str>);

type Job = Box<dyn FnOnce() -> JobDone + Send>;

struct Maintenance {
    jobs: mpsc::Sender<Job>,
    done: mpsc::Receiver<JobDone>,
    in_flight: bool,
    thread: Option<std::thread::JoinHandle<()>>,
}

struct Inner {
    be: KeyedBackend,
    names: Vec<String>,
    shard: usize,
    maint: Option<Maintenance>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(mut m) = self.maint.take() {
            drop(m.jobs);
            if let Some(t) = m.thread.take() {
                let _ = t.join();
            }
        }
    }
}

/// The keyed state of one shard, shared by the keyed operators on it.
#[derive(Clone)]
pub struct ShardState {
    inner: Rc<RefCell<Inner>>,
}

impl ShardState {
    /// Opens the shard's store under `dir/shard-<n>` with `fs`. With `background`, flushes and
    /// compactions run on a maintenance thread; without (the test driver), inline.
    pub(crate) fn open(
        dir: &Path,
        shard: usize,
        config: &JobConfig,
        fs: Arc<dyn Fs>,
        background: bool,
    ) -> Result<Self, StartError> {
        let path = dir.join(format!("shard-{shard}"));
        let store_config = StoreConfig {
            memtable_budget_bytes: config.memtable_budget_bytes,
            max_parallelism: config.max_parallelism,
            ..StoreConfig::default()
        };
        let store = Store::open(fs, &path, store_config).map_err(|e| StartError::State {
            shard,
            reason: format!("{}: {e}", path.display()),
        })?;
        let range =
            KeyGroupRange::for_shard(shard as u16, config.shards as u16, config.max_parallelism);
        let be = KeyedBackend::new(store, range);
        let maint = if background {
            let (jtx, jrx) = mpsc::channel::<Job>();
            let (dtx, drx) = mpsc::channel::<JobDone>();
            let thread = std::thread::Builder::new()
                .name(format!("weir-maint-{shard}"))
                .spawn(move || {
                    while let Ok(job) = jrx.recv() {
                        if dtx.send(job()).is_err() {
                            break;
                        }
                    }
                })
                .map_err(|e| StartError::State {
                    shard,
                    reason: format!("maintenance thread: {e}"),
                })?;
            Some(Maintenance {
                jobs: jtx,
                done: drx,
                in_flight: false,
                thread: Some(thread),
            })
        } else {
            None
        };
        Ok(Self {
            inner: Rc::new(RefCell::new(Inner {
                be,
                names: Vec::new(),
                shard,
                maint,
            })),
        })
    }

    /// Opens the shard's store on the real file system through io_uring, with a maintenance
    /// thread.
    pub(crate) fn new(dir: &Path, shard: usize, config: &JobConfig) -> Result<Self, StartError> {
        let fs = weir_io::UringFs::new().map_err(|e| StartError::IoUringUnavailable {
            reason: e.to_string(),
        })?;
        Self::open(dir, shard, config, Arc::new(fs), true)
    }

    /// Installs finished background work and hands out the next job. Never waits.
    pub(crate) fn maintain(&self) -> Result<Option<JobError>, JobError> {
        let mut guard = self.inner.borrow_mut();
        let inner = &mut *guard;
        let fail = |shard: usize, e: StateError| JobError::Operator {
            operator: "state".into(),
            shard,
            message: e.to_string(),
        };
        match &mut inner.maint {
            Some(m) => {
                if m.in_flight {
                    match m.done.try_recv() {
                        Ok(done) => {
                            m.in_flight = false;
                            inner
                                .be
                                .store_mut()
                                .install(done)
                                .map_err(|e| fail(inner.shard, e))?;
                        }
                        Err(mpsc::TryRecvError::Empty) => return Ok(None),
                        Err(mpsc::TryRecvError::Disconnected) => {
                            return Err(JobError::Operator {
                                operator: "state".into(),
                                shard: inner.shard,
                                message: "the maintenance thread stopped".into(),
                            })
                        }
                    }
                }
                let store = inner.be.store_mut();
                if !store.needs_maintenance() {
                    return Ok(None);
                }
                let job: Option<Job> = match store.flush_job() {
                    Some(j) => Some(Box::new(move || JobDone::from(j.run()))),
                    None => store
                        .compaction_job()
                        .map(|j| Box::new(move || JobDone::from(j.run())) as Job),
                };
                if let Some(job) = job {
                    if m.jobs.send(job).is_err() {
                        return Err(JobError::Operator {
                            operator: "state".into(),
                            shard: inner.shard,
                            message: "the maintenance thread stopped".into(),
                        });
                    }
                    m.in_flight = true;
                }
                Ok(None)
            }
            None => {
                let store = inner.be.store_mut();
                if store.needs_maintenance() {
                    store
                        .run_pending_maintenance()
                        .map_err(|e| fail(inner.shard, e))?;
                }
                Ok(None)
            }
        }
    }

    /// The id of state `name` (an operator's uid and the state's name).
    pub(crate) fn state_id(&self, name: &str) -> StateId {
        let mut i = self.inner.borrow_mut();
        // Registering checks that no two names share an id.
        let _ = i.be.value_state::<u8>(name);
        if !i.names.iter().any(|n| n == name) {
            i.names.push(name.to_string());
        }
        StateId(Rc::from(name))
    }

    fn with<R>(&self, kg: u16, key: &[u8], ns: &[u8], f: impl FnOnce(&mut KeyedBackend) -> R) -> R {
        let mut i = self.inner.borrow_mut();
        let be = &mut i.be;
        be.set_current_key_bytes(kg, key);
        be.set_namespace(ns);
        f(be)
    }

    pub(crate) fn value_get<V: Data>(
        &self,
        id: &StateId,
        kg: u16,
        key: &[u8],
        ns: &[u8],
    ) -> Result<Option<V>, StateError> {
        self.with(kg, key, ns, |be| be.value_state::<V>(&id.0).value(be))
    }

    pub(crate) fn value_put<V: Data>(
        &self,
        id: &StateId,
        kg: u16,
        key: &[u8],
        ns: &[u8],
        v: &V,
    ) -> Result<(), StateError> {
        self.with(kg, key, ns, |be| be.value_state::<V>(&id.0).update(be, v))
    }

    pub(crate) fn delete(
        &self,
        id: &StateId,
        kg: u16,
        key: &[u8],
        ns: &[u8],
    ) -> Result<(), StateError> {
        self.with(kg, key, ns, |be| {
            be.value_state::<u8>(&id.0).clear(be);
            Ok(())
        })
    }

    pub(crate) fn list_clear(
        &self,
        id: &StateId,
        kg: u16,
        key: &[u8],
        ns: &[u8],
    ) -> Result<(), StateError> {
        self.with(kg, key, ns, |be| {
            be.list_state::<u8>(&id.0).clear(be);
            Ok(())
        })
    }

    pub(crate) fn list_append<V: Data>(
        &self,
        id: &StateId,
        kg: u16,
        key: &[u8],
        ns: &[u8],
        v: &V,
    ) -> Result<(), StateError> {
        self.with(kg, key, ns, |be| be.list_state::<V>(&id.0).add(be, v))
    }

    pub(crate) fn list_get<V: Data>(
        &self,
        id: &StateId,
        kg: u16,
        key: &[u8],
        ns: &[u8],
    ) -> Result<Vec<V>, StateError> {
        self.with(kg, key, ns, |be| be.list_state::<V>(&id.0).get(be))
    }
}
