//! The keyed state API operators see.
//!
//! Shape: a [`KeyedBackend`] owns the shard's [`Store`] and the *current key* and *namespace*
//! (set by the runtime before each record or timer). State handles are small `Copy` values
//! obtained once by name (`backend.value_state::<u64>("count")`) and used with the backend:
//!
//! ```ignore
//! let count = backend.value_state::<u64>("count");
//! backend.set_current_key(&user_id);
//! let n = count.get(&mut backend)?.map_or(0, |v| v.to_native());
//! count.update(&mut backend, &(n + 1))?;
//! ```
//!
//! A state's id is derived from its name (`1 + xxh3_64(name) % 0xFFFE`), so it is the same on
//! every shard and after restore without any registry; two names of one backend that collide
//! panic at registration (rename one). Id `0xFFFF` ([`TIMER_STATE_ID`]) holds timers.
//!
//! Values are rkyv 0.8 archives. Reads return `&Archived<V>` in place: bytes from a memtable
//! (written by this process, 16-aligned in the arena) are accessed unchecked; bytes from a
//! segment file are validated first (DESIGN invariant 7). The hot path (get and update of a
//! `ValueState<u64>` whose key is in the memtable) does not allocate: keys are built in a
//! reused buffer and values serialized into a reused aligned buffer, and a same-size value is
//! overwritten in place.
//!
//! Namespaces (windows): [`KeyedBackend::set_namespace`] scopes every state access and timer
//! registration until changed; the empty namespace is the default.

use std::collections::BTreeSet;
use std::marker::PhantomData;

use rkyv::api::high::{HighDeserializer, HighSerializer, HighValidator};
use rkyv::bytecheck::CheckBytes;
use rkyv::rancor;
use rkyv::ser::allocator::{Arena, ArenaHandle};
use rkyv::ser::sharing::Share;
use rkyv::ser::Serializer;
use rkyv::util::AlignedVec;
use rkyv::{Archive, Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64;

use crate::error::StateError;
use crate::key::{
    bytes_eq, encode_state_key, key_group_for, KeyCodec, KeyGroup, KeyGroupRange, MAX_KEY_BYTES,
};
use crate::memtable::MemHint;
use crate::store::{Found, SnapshotJob, Store};

/// State id reserved for timers.
pub const TIMER_STATE_ID: u16 = 0xFFFF;
/// The id under which [`KeyedBackend::state_types`] records the operator's key type: the
/// timers' id, which no named state takes (names hash to 1..=0xFFFE), and timers are kept
/// by key.
pub const KEY_TYPE_ID: u16 = TIMER_STATE_ID;

/// What a state value must be: rkyv-archivable with validation and deserialization.
pub trait StateValue:
    Archive<
        Archived: for<'a> CheckBytes<HighValidator<'a, rancor::BoxedError>>
                      + Deserialize<Self, HighDeserializer<rancor::Error>>,
    > + for<'a> Serialize<HighSerializer<AlignedVec, ArenaHandle<'a>, rancor::Error>>
    + Sized
    + 'static
{
}

impl<T> StateValue for T where
    T: Archive<
            Archived: for<'a> CheckBytes<HighValidator<'a, rancor::BoxedError>>
                          + Deserialize<T, HighDeserializer<rancor::Error>>,
        > + for<'a> Serialize<HighSerializer<AlignedVec, ArenaHandle<'a>, rancor::Error>>
        + 'static
{
}

/// Timer domains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum TimeDomain {
    EventTime = 0,
    ProcessingTime = 1,
}

/// A due timer, as popped.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Timer {
    pub time_ms: u64,
    pub key_group: KeyGroup,
    /// The encoded key ([`KeyCodec`] bytes) the timer was registered for.
    pub key: Vec<u8>,
    pub namespace: Vec<u8>,
}

/// Keyed state of one shard over a [`Store`] (see the module docs).
#[derive(Debug)]
pub struct KeyedBackend {
    store: Store,
    range: KeyGroupRange,
    max_parallelism: u16,
    key_group: KeyGroup,
    key: Vec<u8>,
    ns: Vec<u8>,
    kbuf: Vec<u8>,
    /// Scratch key of [`Self::prefetch_value`].
    pbuf: Vec<u8>,
    /// The state id whose plain key (no suffix) `kbuf` holds for the current key and
    /// namespace, with its hash; `None` when `kbuf` holds anything else.
    kbuf_state: Option<u16>,
    kbuf_hash: u64,
    /// Where `kbuf`'s key sits in the mutable memtable, if known (see [`Store::put_hinted`]).
    hint: Option<MemHint>,
    vbuf: AlignedVec,
    /// Scratch space of the rkyv serializer, reused (no thread-local lookup per value).
    ser_arena: SerArena,
    names: std::collections::HashMap<u16, String>,
    /// The handle type (kind and value type) each state id was first read or written with in
    /// this process: `access` reads in-memory values unchecked as that type, so another type
    /// must not reach them (see [`Self::check_type`]).
    types: std::collections::HashMap<u16, (std::any::TypeId, &'static str)>,
    /// Each used state's [`Described::described`] kind and value type, by id, with its name:
    /// what checkpoints record ([`Self::state_types`]).
    described: std::collections::HashMap<u16, String>,
    /// The kind and value type a restored checkpoint recorded for each state (name, kind and
    /// type), checked at each state's first use ([`Self::restore_state_types`]); under
    /// [`KEY_TYPE_ID`], the key type ([`Self::set_key_type`]).
    restored_types: std::collections::HashMap<u16, (String, String)>,
    /// The last check that passed: accesses mostly repeat it.
    last_type: Option<(u16, std::any::TypeId)>,
    timers: [BTreeSet<Timer>; 2],
}

/// rkyv's serializer arena, with a `Debug` that prints nothing of interest.
#[derive(Default)]
struct SerArena(Arena);

impl std::fmt::Debug for SerArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SerArena")
    }
}

fn ser_err(state_id: u16, e: rancor::Error) -> StateError {
    StateError::Serialize {
        state_id,
        reason: e.to_string(),
    }
}

/// Access an archived value: trusted bytes unchecked, bytes from disk validated.
fn access<'a, V: StateValue>(state_id: u16, f: Found<'a>) -> Result<&'a V::Archived, StateError> {
    let aligned = (f.value.as_ptr() as usize) & 15 == 0;
    if f.in_memory && aligned {
        // SAFETY: `in_memory` bytes were produced by rkyv's high-level serializer
        // (`KeyedBackend::serialize`) for this state's value type in this process: every
        // read and write of a state id first passes `KeyedBackend::check_type`, which holds
        // it to the one handle type (kind and value type) of its first use. They sit
        // 16-aligned in the memtable arena, unchanged since.
        return Ok(unsafe { rkyv::access_unchecked::<V::Archived>(f.value) });
    }
    rkyv::access::<V::Archived, rancor::BoxedError>(f.value).map_err(|e| StateError::BadValue {
        state_id,
        source_desc: if f.in_memory {
            "memtable"
        } else {
            "segment file"
        }
        .to_owned(),
        reason: e.to_string(),
    })
}

fn deser<V: StateValue>(a: &V::Archived, state_id: u16) -> Result<V, StateError> {
    rkyv::deserialize::<V, rancor::Error>(a).map_err(|e| ser_err(state_id, e))
}

impl KeyedBackend {
    /// A backend over `store` for the key groups `range`; rebuilds the timer queues from the
    /// store (so a restored store brings its timers back).
    pub fn new(mut store: Store, range: KeyGroupRange) -> Result<KeyedBackend, StateError> {
        let max_parallelism = store.config().max_parallelism;
        let mut timers: [BTreeSet<Timer>; 2] = [BTreeSet::new(), BTreeSet::new()];
        for kg in range.first..=range.last {
            let mut prefix = Vec::with_capacity(4);
            prefix.extend_from_slice(&kg.to_be_bytes());
            prefix.extend_from_slice(&TIMER_STATE_ID.to_be_bytes());
            for e in store.scan_prefix(&prefix) {
                let (k, _) = e?;
                if let Some((domain, t)) = decode_timer_key(k) {
                    timers[domain as usize].insert(t);
                }
            }
        }
        Ok(KeyedBackend {
            store,
            range,
            max_parallelism,
            key_group: range.first,
            key: Vec::new(),
            ns: Vec::new(),
            kbuf: Vec::new(),
            pbuf: Vec::new(),
            kbuf_state: None,
            kbuf_hash: 0,
            hint: None,
            vbuf: AlignedVec::new(),
            ser_arena: SerArena::default(),
            names: Default::default(),
            types: Default::default(),
            described: Default::default(),
            restored_types: Default::default(),
            last_type: None,
            timers,
        })
    }

    /// That state `id` is read or written through handle type `H` (its kind and value
    /// type), as at its first use in this process: values written as one type and read as
    /// another would be read out of bounds (in-memory values are accessed unchecked).
    /// A state's first use in this process also checks it against the kind and value type a
    /// restored checkpoint recorded for it: restored values are only checked structurally,
    /// which bytes of another type with the same layout pass (a `u64` read as an `f64`).
    #[inline]
    fn check_type<H: Described + 'static>(&mut self, id: u16) -> Result<(), StateError> {
        let t = std::any::TypeId::of::<H>();
        if self.last_type == Some((id, t)) {
            return Ok(());
        }
        let now = std::any::type_name::<H>();
        let name = |be: &Self| {
            be.names
                .get(&id)
                .cloned()
                .unwrap_or_else(|| format!("id {id}"))
        };
        let (first_t, first) = match self.types.get(&id) {
            Some(&first) => first,
            None => {
                let d = H::described();
                if let Some((_, was)) = self.restored_types.get(&id) {
                    if *was != d {
                        return Err(StateError::RestoredTypeMismatch {
                            state: name(self),
                            restored: was.clone(),
                            now: d,
                        });
                    }
                }
                self.described.insert(id, d);
                self.types.insert(id, (t, now));
                (t, now)
            }
        };
        if first_t != t {
            return Err(StateError::TypeMismatch {
                state: name(self),
                first,
                now,
            });
        }
        self.last_type = Some((id, t));
        Ok(())
    }

    /// Every state's id, name, and kind and value type (`value<u64>`, `list<..>`,
    /// `map<.., ..>`), for a checkpoint to record: those used in this process, and those a
    /// restore recorded and this process has not used yet (so that a later restore still
    /// checks them). Sorted by id.
    pub fn state_types(&self) -> Vec<(u16, String, String)> {
        // The key type is in `described` under `KEY_TYPE_ID` (no name).
        let mut out: Vec<(u16, String, String)> = self
            .described
            .iter()
            .map(|(&id, d)| {
                let name = self
                    .names
                    .get(&id)
                    .or_else(|| self.restored_types.get(&id).map(|(n, _)| n))
                    .cloned()
                    .unwrap_or_default();
                (id, name, d.clone())
            })
            .collect();
        for (&id, (name, d)) in &self.restored_types {
            if !self.described.contains_key(&id) {
                out.push((id, name.clone(), d.clone()));
            }
        }
        out.sort_by_key(|e| e.0);
        out
    }

    /// The kinds and value types a checkpoint recorded ([`Self::state_types`]): each state's
    /// first use is checked against them, and a state used as another kind or value type is
    /// [`StateError::RestoredTypeMismatch`], as Flink refuses an incompatible serializer on
    /// restore. The first record of an id wins (the parts of all old shards agree).
    pub fn restore_state_types(&mut self, types: impl IntoIterator<Item = (u16, String, String)>) {
        for (id, name, d) in types {
            self.restored_types.entry(id).or_insert((name, d));
        }
    }

    /// That the operator keys its state by `described` (`key<u64>`: `key<` and
    /// [`short_type_name`] of the key type), which checkpoints record beside the states'
    /// types. A restored checkpoint that recorded another key type is
    /// [`StateError::RestoredKeyTypeMismatch`], as Flink refuses an incompatible key
    /// serializer on restore: keys of another type encode to other bytes (and key groups),
    /// so every restored state and timer would be lost, or its key read as another. Call it
    /// before the first access. A checkpoint written before key types were recorded has
    /// none, and nothing is checked.
    pub fn set_key_type(&mut self, described: String) -> Result<(), StateError> {
        if let Some((_, was)) = self.restored_types.get(&KEY_TYPE_ID) {
            if *was != described {
                return Err(StateError::RestoredKeyTypeMismatch {
                    restored: was.clone(),
                    now: described,
                });
            }
        }
        self.described.insert(KEY_TYPE_ID, described);
        Ok(())
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    pub fn store_mut(&mut self) -> &mut Store {
        // The caller may change anything, even replace the store: forget cached positions.
        self.invalidate_key();
        &mut self.store
    }

    pub fn into_store(self) -> Store {
        self.store
    }

    pub fn key_group_range(&self) -> KeyGroupRange {
        self.range
    }

    /// The caller's clock for TTL (see [`Store::set_now_ms`]).
    pub fn set_now_ms(&mut self, now_ms: u64) {
        self.store.set_now_ms(now_ms);
    }

    /// Set the current key; its key group is computed from its encoding.
    pub fn set_current_key<K: KeyCodec + ?Sized>(&mut self, key: &K) {
        self.invalidate_key();
        self.key.clear();
        key.encode_key(&mut self.key);
        self.key_group = key_group_for(&self.key, self.max_parallelism);
        debug_assert!(
            self.range.contains(self.key_group),
            "key outside this shard's key groups"
        );
    }

    /// Set the current key from its encoding and known key group (the runtime computed it).
    pub fn set_current_key_bytes(&mut self, key_group: KeyGroup, key_bytes: &[u8]) {
        if key_group == self.key_group && bytes_eq(key_bytes, &self.key) {
            return;
        }
        self.invalidate_key();
        self.key.clear();
        self.key.extend_from_slice(key_bytes);
        self.key_group = key_group;
    }

    pub fn current_key_group(&self) -> KeyGroup {
        self.key_group
    }

    pub fn current_key_bytes(&self) -> &[u8] {
        &self.key
    }

    /// Scope state and timers to a namespace (a window); empty = none.
    pub fn set_namespace(&mut self, ns: &[u8]) {
        if bytes_eq(ns, &self.ns) {
            return;
        }
        self.invalidate_key();
        self.ns.clear();
        self.ns.extend_from_slice(ns);
    }

    /// Encode a typed namespace with [`KeyCodec`].
    pub fn set_namespace_of<N: KeyCodec + ?Sized>(&mut self, ns: &N) {
        self.invalidate_key();
        self.ns.clear();
        ns.encode_key(&mut self.ns);
    }

    fn register(&mut self, name: &str) -> u16 {
        match self.try_state_id(name) {
            Ok(id) => id,
            Err(e) => panic!("{e}"),
        }
    }

    /// [`Self::state_id`], with two names that hash to one id an error rather than a panic.
    pub fn try_state_id(&mut self, name: &str) -> Result<u16, StateError> {
        let id = 1 + (xxh3_64(name.as_bytes()) % 0xFFFE) as u16;
        match self.names.get(&id) {
            Some(prev) if prev != name => Err(StateError::NameCollision {
                first: prev.clone(),
                second: name.to_owned(),
            }),
            Some(_) => Ok(id),
            None => {
                self.names.insert(id, name.to_owned());
                Ok(id)
            }
        }
    }

    /// Register `name` (as the typed constructors do) and return its state id, for the
    /// `from_id` constructors of the handles. Panics when another registered name hashes to
    /// the same id ([`Self::try_state_id`] returns that as an error).
    pub fn state_id(&mut self, name: &str) -> u16 {
        self.register(name)
    }

    /// Expire entries of a state `ttl_ms` after their last write (invisible, then compacted away).
    pub fn set_ttl(&mut self, state_id: u16, ttl_ms: Option<u64>) {
        self.store.set_ttl(state_id, ttl_ms);
    }

    pub fn value_state<V: StateValue>(&mut self, name: &str) -> ValueState<V> {
        ValueState {
            id: self.register(name),
            _v: PhantomData,
        }
    }

    pub fn list_state<V: StateValue>(&mut self, name: &str) -> ListState<V> {
        ListState {
            id: self.register(name),
            _v: PhantomData,
        }
    }

    pub fn map_state<K: KeyCodec, V: StateValue>(&mut self, name: &str) -> MapState<K, V> {
        MapState {
            id: self.register(name),
            _v: PhantomData,
        }
    }

    pub fn reducing_state<V: StateValue, F: Fn(V, V) -> V>(
        &mut self,
        name: &str,
        reduce: F,
    ) -> ReducingState<V, F> {
        ReducingState {
            id: self.register(name),
            reduce,
            _v: PhantomData,
        }
    }

    pub fn aggregating_state<A: AggregateFunction>(
        &mut self,
        name: &str,
        agg: A,
    ) -> AggregatingState<A> {
        AggregatingState {
            id: self.register(name),
            agg,
        }
    }

    /// Forget the cached store key, its hash and memtable position.
    #[inline]
    fn invalidate_key(&mut self) {
        self.kbuf_state = None;
        self.hint = None;
    }

    /// The store key of value-like state `state_id` for the current key and namespace in
    /// `kbuf`, and its hash in `kbuf_hash`; reused while key, namespace and state are the same
    /// (a `value()` then `update()` of one record builds and hashes the key once).
    #[inline]
    fn value_key(&mut self, state_id: u16) {
        if self.kbuf_state == Some(state_id) {
            return;
        }
        self.build_key(state_id);
        self.kbuf_hash = xxh3_64(&self.kbuf);
        self.kbuf_state = Some(state_id);
    }

    /// Look up the value key built by [`Self::value_key`], remembering its memtable position.
    /// Always inlined: returned through memory, the `Result` of a `Found` was reloaded at odd
    /// offsets that missed store forwarding (see [`Store::get_mem_hinted`]).
    #[inline(always)]
    fn get_value(&mut self) -> Result<Option<Found<'_>>, StateError> {
        let (found, hint) = match self.store.get_mem_hinted(&self.kbuf, self.kbuf_hash) {
            Some((found, hint)) => (found, Some(hint)),
            None => self.store.get_hinted_cold(&self.kbuf, self.kbuf_hash)?,
        };
        self.hint = hint;
        Ok(found)
    }

    /// Serialize `v` into the reused aligned buffer with the reused arena.
    #[inline]
    fn serialize<V: StateValue>(&mut self, state_id: u16, v: &V) -> Result<(), StateError> {
        let mut buf = std::mem::take(&mut self.vbuf);
        buf.clear();
        // What `to_bytes_in_with_alloc` does, here where it is inlined: called, it read the
        // arena handle the caller had just stored in pieces, a load that missed store
        // forwarding (most of that call's samples in the keyed count).
        let mut ser = Serializer::new(buf, self.ser_arena.0.acquire(), Share::new());
        let r = rkyv::api::serialize_using::<_, rancor::Error>(v, &mut ser);
        self.vbuf = ser.into_writer();
        r.map(|_| ()).map_err(|e| ser_err(state_id, e))
    }

    /// Store `v` under the value key built by [`Self::value_key`], in place when possible.
    #[inline]
    fn put_value_hinted<V: StateValue>(&mut self, state_id: u16, v: &V) -> Result<(), StateError> {
        self.serialize(state_id, v)?;
        self.hint = self
            .store
            .put_hinted(&self.kbuf, self.kbuf_hash, &self.vbuf, self.hint);
        Ok(())
    }

    /// Build the store key prefix of `state_id` for the current key and namespace in `kbuf`.
    /// Start loading what a lookup of value-like state `state_id` for key `key_bytes` (in
    /// `key_group`, namespace `ns`) will touch, and return the store key's hash for
    /// [`Self::prefetch_record`]. The current key is left alone: a keyed operator calls this
    /// for records a few places ahead of the one it processes, so that their cache misses
    /// overlap instead of following one another.
    pub fn prefetch_value(
        &mut self,
        state_id: u16,
        key_group: KeyGroup,
        key_bytes: &[u8],
        ns: &[u8],
    ) -> u64 {
        self.pbuf.clear();
        encode_state_key(&mut self.pbuf, key_group, state_id, ns, key_bytes);
        let hash = xxh3_64(&self.pbuf);
        self.store.prefetch(hash);
        hash
    }

    /// Step two of [`Self::prefetch_value`], a few records later: load the record itself.
    #[inline]
    pub fn prefetch_record(&self, hash: u64) {
        self.store.prefetch_record(hash);
    }

    fn build_key(&mut self, state_id: u16) {
        self.invalidate_key();
        self.kbuf.clear();
        encode_state_key(
            &mut self.kbuf,
            self.key_group,
            state_id,
            &self.ns,
            &self.key,
        );
    }

    fn put_value<V: StateValue>(&mut self, state_id: u16, v: &V) -> Result<(), StateError> {
        self.serialize(state_id, v)?;
        self.store.put(&self.kbuf, &self.vbuf);
        Ok(())
    }

    fn delete_prefix(&mut self) -> Result<(), StateError> {
        let keys: Vec<Vec<u8>> = self
            .store
            .scan_prefix(&self.kbuf)
            .map(|e| e.map(|(k, _)| k.to_vec()))
            .collect::<Result<_, _>>()?;
        for k in keys {
            self.store.delete(&k);
        }
        Ok(())
    }

    // --- timers --------------------------------------------------------------------------

    fn timer_store_key(&self, domain: TimeDomain, t: &Timer) -> Vec<u8> {
        let mut k = Vec::with_capacity(17 + t.key.len() + t.namespace.len());
        k.extend_from_slice(&t.key_group.to_be_bytes());
        k.extend_from_slice(&TIMER_STATE_ID.to_be_bytes());
        k.push(domain as u8);
        k.extend_from_slice(&t.time_ms.to_be_bytes());
        k.extend_from_slice(&(t.key.len() as u16).to_be_bytes());
        k.extend_from_slice(&t.key);
        k.extend_from_slice(&(t.namespace.len() as u16).to_be_bytes());
        k.extend_from_slice(&t.namespace);
        k
    }

    fn current_timer(&self, time_ms: u64) -> Timer {
        Timer {
            time_ms,
            key_group: self.key_group,
            key: self.key.clone(),
            namespace: self.ns.clone(),
        }
    }

    /// Register a timer for the current key and namespace (idempotent). Timers are stored in
    /// the store too, so snapshots include them.
    pub fn register_timer(&mut self, domain: TimeDomain, time_ms: u64) {
        let t = self.current_timer(time_ms);
        let k = self.timer_store_key(domain, &t);
        if self.timers[domain as usize].insert(t) {
            self.store.put(&k, &[]);
        }
    }

    /// Delete a timer of the current key and namespace, if registered.
    pub fn delete_timer(&mut self, domain: TimeDomain, time_ms: u64) {
        let t = self.current_timer(time_ms);
        if self.timers[domain as usize].remove(&t) {
            let k = self.timer_store_key(domain, &t);
            self.store.delete(&k);
        }
    }

    /// Remove and return the earliest timer with `time_ms <= up_to_ms`.
    pub fn pop_due(&mut self, domain: TimeDomain, up_to_ms: u64) -> Option<Timer> {
        let set = &mut self.timers[domain as usize];
        if set.first()?.time_ms > up_to_ms {
            return None;
        }
        let t = set.pop_first()?;
        let k = self.timer_store_key(domain, &t);
        self.store.delete(&k);
        Some(t)
    }

    /// Time of the earliest timer.
    pub fn next_timer_ms(&self, domain: TimeDomain) -> Option<u64> {
        self.timers[domain as usize].first().map(|t| t.time_ms)
    }

    pub fn timer_count(&self, domain: TimeDomain) -> usize {
        self.timers[domain as usize].len()
    }

    /// Synchronous part of a snapshot (seals the memtable); run the job anywhere.
    pub fn snapshot(&mut self, checkpoint_id: u64) -> SnapshotJob {
        self.store.snapshot(checkpoint_id)
    }
}

fn decode_timer_key(k: &[u8]) -> Option<(TimeDomain, Timer)> {
    let mut s = k;
    let kg = u16::decode_key(&mut s)?;
    if u16::decode_key(&mut s)? != TIMER_STATE_ID {
        return None;
    }
    let domain = match u8::decode_key(&mut s)? {
        0 => TimeDomain::EventTime,
        1 => TimeDomain::ProcessingTime,
        _ => return None,
    };
    let time_ms = u64::decode_key(&mut s)?;
    let kl = usize::from(u16::decode_key(&mut s)?);
    let key = s.get(..kl)?.to_vec();
    s = &s[kl..];
    let nl = usize::from(u16::decode_key(&mut s)?);
    let namespace = s.get(..nl)?.to_vec();
    Some((
        domain,
        Timer {
            time_ms,
            key_group: kg,
            key,
            namespace,
        },
    ))
}

/// What the typed handles that are only an id share: `Clone` and `Copy` (whatever their type
/// parameters), and construction from a cached id. `state_handle!(Name[impl generics][type
/// arguments])`.
macro_rules! state_handle {
    ($name:ident [$($gen:tt)*] [$($arg:tt)*]) => {
        impl<$($gen)*> Clone for $name<$($arg)*> {
            fn clone(&self) -> Self {
                *self
            }
        }

        impl<$($gen)*> Copy for $name<$($arg)*> {}

        impl<$($gen)*> $name<$($arg)*> {
            /// A handle for the state whose id is `id`, without hashing its name: cache the
            /// id once (from [`Self::id`] of a handle obtained by name, or
            /// [`KeyedBackend::state_id`]) and build typed handles from it on every access for
            /// free. The id must come from a registration of this same state name (ids depend
            /// on the name only, so a registration on any backend of the job will do), and the
            /// value type must be the one the state is always used with: as with handles
            /// obtained by name, values this process wrote are read in place unchecked, which
            /// relies on one value type per state.
            pub const fn from_id(id: u16) -> Self {
                $name {
                    id,
                    _v: PhantomData,
                }
            }

            pub fn id(&self) -> u16 {
                self.id
            }
        }
    };
}

/// A handle type's kind and value type by name, as checkpoints record them (`value<u64>`,
/// `map<u32, Option<Event>>`). Type names are [`std::any::type_name`]'s without their module
/// paths ([`short_type_name`]): a type renamed reads as another, as a renamed class does in
/// Flink's serializer snapshots, but one moved between modules (by its crate, or by std, as
/// `IpAddr` moved from `std::net` to `core::net` in Rust 1.77) reads as itself.
pub(crate) trait Described {
    fn described() -> String;
}

/// `type_name::<T>()` with every path cut to its last segment: `core::option::Option<my::Foo>`
/// is `Option<Foo>`, `(u64, alloc::vec::Vec<u8>)` is `(u64, Vec<u8>)`.
pub fn short_type_name<T: ?Sized>() -> String {
    let full = std::any::type_name::<T>();
    let mut out = String::with_capacity(full.len());
    // Where the path being read starts in `out`: a `::` drops what of it came before.
    let mut path_start = 0;
    let mut chars = full.chars().peekable();
    while let Some(c) = chars.next() {
        if c == ':' && chars.peek() == Some(&':') {
            chars.next();
            out.truncate(path_start);
        } else if c.is_alphanumeric() || c == '_' {
            out.push(c);
        } else {
            out.push(c);
            path_start = out.len();
        }
    }
    out
}

impl<V> Described for ValueState<V> {
    fn described() -> String {
        format!("value<{}>", short_type_name::<V>())
    }
}

impl<V> Described for ListState<V> {
    fn described() -> String {
        format!("list<{}>", short_type_name::<V>())
    }
}

impl<K: ?Sized, V> Described for MapState<K, V> {
    fn described() -> String {
        format!(
            "map<{}, {}>",
            short_type_name::<K>(),
            short_type_name::<V>()
        )
    }
}

/// A single value per key (and namespace).
#[derive(Debug)]
pub struct ValueState<V> {
    id: u16,
    _v: PhantomData<fn() -> V>,
}

state_handle!(ValueState[V][V]);

impl<V: StateValue> ValueState<V> {
    /// The archived value of the current key, if any.
    #[inline]
    pub fn get<'a>(&self, be: &'a mut KeyedBackend) -> Result<Option<&'a V::Archived>, StateError> {
        be.check_type::<Self>(self.id)?;
        be.value_key(self.id);
        match be.get_value()? {
            Some(f) => access::<V>(self.id, f).map(Some),
            None => Ok(None),
        }
    }

    /// The value, deserialized.
    pub fn value(&self, be: &mut KeyedBackend) -> Result<Option<V>, StateError> {
        match self.get(be)? {
            Some(a) => deser::<V>(a, self.id).map(Some),
            None => Ok(None),
        }
    }

    /// Set the value of the current key. After a [`Self::get`] or [`Self::value`] of the same
    /// key and namespace, the key is neither rebuilt nor hashed nor looked up again: a value
    /// of the same archived size is overwritten in place.
    pub fn update(&self, be: &mut KeyedBackend, v: &V) -> Result<(), StateError> {
        be.check_type::<Self>(self.id)?;
        be.value_key(self.id);
        be.put_value_hinted(self.id, v)
    }

    /// Read-modify-write of the current key's value with one lookup: `f` gets the archived
    /// value (`None` if absent) and returns the new value, which is stored (in place when it
    /// has the same archived size). The keyed-count path is
    /// `count.update_with(be, |old| old.map_or(0, |n| n.to_native()) + 1)`.
    pub fn update_with(
        &self,
        be: &mut KeyedBackend,
        f: impl FnOnce(Option<&V::Archived>) -> V,
    ) -> Result<(), StateError> {
        let next = f(self.get(be)?);
        self.update(be, &next)
    }

    pub fn clear(&self, be: &mut KeyedBackend) {
        be.build_key(self.id);
        be.store.delete(&be.kbuf);
    }
}

/// A list per key: `add` appends without reading.
#[derive(Debug)]
pub struct ListState<V> {
    id: u16,
    _v: PhantomData<fn() -> V>,
}

state_handle!(ListState[V][V]);

impl<V: StateValue> ListState<V> {
    pub fn add(&self, be: &mut KeyedBackend, v: &V) -> Result<(), StateError> {
        be.check_type::<Self>(self.id)?;
        be.build_key(self.id);
        let seq = be.store.next_seq();
        be.kbuf.extend_from_slice(&seq.to_be_bytes());
        be.put_value(self.id, v)
    }

    /// Visit the archived elements in insertion order.
    pub fn for_each(
        &self,
        be: &mut KeyedBackend,
        mut f: impl FnMut(&V::Archived),
    ) -> Result<(), StateError> {
        be.check_type::<Self>(self.id)?;
        be.build_key(self.id);
        let prefix = std::mem::take(&mut be.kbuf);
        let mut res = Ok(());
        for e in be.store.scan_prefix(&prefix) {
            let found = match e {
                Ok((_, found)) => found,
                Err(e) => {
                    res = Err(e);
                    break;
                }
            };
            match access::<V>(self.id, found) {
                Ok(a) => f(a),
                Err(e) => {
                    res = Err(e);
                    break;
                }
            }
        }
        be.kbuf = prefix;
        res
    }

    pub fn get(&self, be: &mut KeyedBackend) -> Result<Vec<V>, StateError> {
        let mut out = Vec::new();
        let mut err = None;
        self.for_each(be, |a| match deser::<V>(a, self.id) {
            Ok(v) => out.push(v),
            Err(e) => err = Some(e),
        })?;
        err.map_or(Ok(out), Err)
    }

    pub fn clear(&self, be: &mut KeyedBackend) -> Result<(), StateError> {
        be.build_key(self.id);
        be.delete_prefix()
    }

    /// Replace the list.
    pub fn update(&self, be: &mut KeyedBackend, values: &[V]) -> Result<(), StateError> {
        self.clear(be)?;
        for v in values {
            self.add(be, v)?;
        }
        Ok(())
    }
}

type MapMarker<K, V> = fn() -> (Box<K>, V);

/// A map per key.
#[derive(Debug)]
pub struct MapState<K: ?Sized, V> {
    id: u16,
    _v: PhantomData<MapMarker<K, V>>,
}

state_handle!(MapState[K: ?Sized, V][K, V]);

impl<K: KeyCodec + ?Sized + 'static, V: StateValue> MapState<K, V> {
    fn build(&self, be: &mut KeyedBackend, mk: &K) -> Result<(), StateError> {
        let len = mk.encoded_len();
        if len > MAX_KEY_BYTES {
            return Err(StateError::KeyTooLong {
                what: "map key",
                len,
                max: MAX_KEY_BYTES,
            });
        }
        be.build_key(self.id);
        mk.encode_key(&mut be.kbuf);
        Ok(())
    }

    pub fn get<'a>(
        &self,
        be: &'a mut KeyedBackend,
        mk: &K,
    ) -> Result<Option<&'a V::Archived>, StateError> {
        be.check_type::<Self>(self.id)?;
        self.build(be, mk)?;
        match be.store.get(&be.kbuf)? {
            Some(f) => access::<V>(self.id, f).map(Some),
            None => Ok(None),
        }
    }

    /// The entry `mk`, deserialized (see [`Self::get`] for the archived view).
    pub fn value(&self, be: &mut KeyedBackend, mk: &K) -> Result<Option<V>, StateError> {
        match self.get(be, mk)? {
            Some(a) => deser::<V>(a, self.id).map(Some),
            None => Ok(None),
        }
    }

    pub fn contains(&self, be: &mut KeyedBackend, mk: &K) -> Result<bool, StateError> {
        self.build(be, mk)?;
        Ok(be.store.get(&be.kbuf)?.is_some())
    }

    pub fn put(&self, be: &mut KeyedBackend, mk: &K, v: &V) -> Result<(), StateError> {
        be.check_type::<Self>(self.id)?;
        self.build(be, mk)?;
        be.put_value(self.id, v)
    }

    pub fn remove(&self, be: &mut KeyedBackend, mk: &K) -> Result<(), StateError> {
        self.build(be, mk)?;
        be.store.delete(&be.kbuf);
        Ok(())
    }

    /// Visit entries in map-key order.
    pub fn for_each(
        &self,
        be: &mut KeyedBackend,
        mut f: impl FnMut(K::Owned, &V::Archived),
    ) -> Result<(), StateError> {
        be.check_type::<Self>(self.id)?;
        be.build_key(self.id);
        let prefix = std::mem::take(&mut be.kbuf);
        let mut res = Ok(());
        for e in be.store.scan_prefix(&prefix) {
            let (k, found) = match e {
                Ok(kf) => kf,
                Err(e) => {
                    res = Err(e);
                    break;
                }
            };
            let mut rest = &k[prefix.len()..];
            let Some(mk) = K::decode_key(&mut rest) else {
                res = Err(StateError::BadValue {
                    state_id: self.id,
                    source_desc: "map key".to_owned(),
                    reason: "map key does not decode".to_owned(),
                });
                break;
            };
            match access::<V>(self.id, found) {
                Ok(a) => f(mk, a),
                Err(e) => {
                    res = Err(e);
                    break;
                }
            }
        }
        be.kbuf = prefix;
        res
    }

    pub fn entries(&self, be: &mut KeyedBackend) -> Result<Vec<(K::Owned, V)>, StateError> {
        let mut out = Vec::new();
        let mut err = None;
        self.for_each(be, |k, a| match deser::<V>(a, self.id) {
            Ok(v) => out.push((k, v)),
            Err(e) => err = Some(e),
        })?;
        err.map_or(Ok(out), Err)
    }

    pub fn clear(&self, be: &mut KeyedBackend) -> Result<(), StateError> {
        be.build_key(self.id);
        be.delete_prefix()
    }
}

/// A value combined with each added one by a reduce function.
#[derive(Debug, Clone, Copy)]
pub struct ReducingState<V, F> {
    id: u16,
    reduce: F,
    _v: PhantomData<fn() -> V>,
}

impl<V: StateValue, F: Fn(V, V) -> V> ReducingState<V, F> {
    /// A handle for state id `id` with `reduce`, without hashing the name; the id contract
    /// of [`ValueState::from_id`] applies.
    pub fn from_id(id: u16, reduce: F) -> Self {
        ReducingState {
            id,
            reduce,
            _v: PhantomData,
        }
    }

    pub fn id(&self) -> u16 {
        self.id
    }

    pub fn add(&self, be: &mut KeyedBackend, v: V) -> Result<(), StateError> {
        let cur = ValueState::<V> {
            id: self.id,
            _v: PhantomData,
        };
        let next = match cur.value(be)? {
            Some(old) => (self.reduce)(old, v),
            None => v,
        };
        cur.update(be, &next)
    }

    pub fn get<'a>(&self, be: &'a mut KeyedBackend) -> Result<Option<&'a V::Archived>, StateError> {
        ValueState::<V> {
            id: self.id,
            _v: PhantomData,
        }
        .get(be)
    }

    pub fn clear(&self, be: &mut KeyedBackend) {
        ValueState::<V> {
            id: self.id,
            _v: PhantomData,
        }
        .clear(be)
    }
}

/// An aggregation: inputs are added to an accumulator; results are computed from it.
pub trait AggregateFunction {
    type In;
    type Acc: StateValue;
    type Out;
    fn create_accumulator(&self) -> Self::Acc;
    fn add(&self, value: &Self::In, acc: &mut Self::Acc);
    fn result(&self, acc: &Self::Acc) -> Self::Out;
}

/// State holding an accumulator of an [`AggregateFunction`].
#[derive(Debug, Clone, Copy)]
pub struct AggregatingState<A> {
    id: u16,
    agg: A,
}

impl<A: AggregateFunction> AggregatingState<A> {
    /// A handle for state id `id` with `agg`, without hashing the name; the id contract of
    /// [`ValueState::from_id`] applies.
    pub fn from_id(id: u16, agg: A) -> Self {
        AggregatingState { id, agg }
    }

    pub fn id(&self) -> u16 {
        self.id
    }

    pub fn add(&self, be: &mut KeyedBackend, v: &A::In) -> Result<(), StateError> {
        let cur = ValueState::<A::Acc> {
            id: self.id,
            _v: PhantomData,
        };
        let mut acc = cur
            .value(be)?
            .unwrap_or_else(|| self.agg.create_accumulator());
        self.agg.add(v, &mut acc);
        cur.update(be, &acc)
    }

    pub fn get(&self, be: &mut KeyedBackend) -> Result<Option<A::Out>, StateError> {
        let cur = ValueState::<A::Acc> {
            id: self.id,
            _v: PhantomData,
        };
        Ok(cur.value(be)?.map(|acc| self.agg.result(&acc)))
    }

    pub fn clear(&self, be: &mut KeyedBackend) {
        ValueState::<A::Acc> {
            id: self.id,
            _v: PhantomData,
        }
        .clear(be)
    }
}
