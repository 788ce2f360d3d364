//! Two keyed inputs with shared keyed state: the basis of joins.
//!
//! Both inputs are tagged ([`Either`]), merged and partitioned by their common key, so one
//! operator instance sees both inputs' records of a key on one shard, in each input's order.

use std::sync::Arc;

use rkyv::{Archive, Deserialize, Serialize};

use crate::data::Data;
use crate::keyed::{
    Key, KeyedContext, KeyedProcessFunction, KeyedStream, ProcessStream, TimeDomain,
};

/// A record of the first (`Left`) or second (`Right`) input of a connected stream.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum Either<A, B> {
    Left(A),
    Right(B),
}

/// Logic over two keyed inputs (Flink's KeyedCoProcessFunction).
pub trait CoProcessFunction<K, A, B, O>: Send + Sync + 'static {
    fn process_left(&self, rec: A, ctx: &mut KeyedContext<'_, K, O>);
    fn process_right(&self, rec: B, ctx: &mut KeyedContext<'_, K, O>);
    fn on_timer(&self, _timestamp: i64, _domain: TimeDomain, _ctx: &mut KeyedContext<'_, K, O>) {}
}

/// Two keyed streams with the same key type.
pub struct ConnectedStreams<A, B, K> {
    left: KeyedStream<A, K>,
    right: KeyedStream<B, K>,
}

struct CoAdapter<F, A, B> {
    f: F,
    _p: std::marker::PhantomData<fn(A, B)>,
}

impl<K, A, B, O, F> KeyedProcessFunction<K, Either<A, B>, O> for CoAdapter<F, A, B>
where
    A: 'static,
    B: 'static,
    F: CoProcessFunction<K, A, B, O>,
{
    fn process_element(&self, rec: Either<A, B>, ctx: &mut KeyedContext<'_, K, O>) {
        match rec {
            Either::Left(a) => self.f.process_left(a, ctx),
            Either::Right(b) => self.f.process_right(b, ctx),
        }
    }

    fn on_timer(&self, timestamp: i64, domain: TimeDomain, ctx: &mut KeyedContext<'_, K, O>) {
        self.f.on_timer(timestamp, domain, ctx)
    }
}

impl<A, B, K> ConnectedStreams<A, B, K>
where
    A: Data,
    B: Data,
    Either<A, B>: Data,
    K: Key,
{
    pub(crate) fn new(left: KeyedStream<A, K>, right: KeyedStream<B, K>) -> Self {
        Self { left, right }
    }

    /// Applies `f` to both inputs' records, keyed.
    pub fn process<O: Data>(self, f: impl CoProcessFunction<K, A, B, O>) -> ProcessStream<O> {
        let (kl, kr) = (self.left.key.clone(), self.right.key.clone());
        let merged = self
            .left
            .up
            .map(Either::<A, B>::Left)
            .union(self.right.up.map(Either::<A, B>::Right));
        let key: crate::keyed::KeyFn<Either<A, B>, K> = Arc::new(move |e: &Either<A, B>| match e {
            Either::Left(a) => kl(a),
            Either::Right(b) => kr(b),
        });
        KeyedStream::new(merged, key).process(CoAdapter {
            f,
            _p: std::marker::PhantomData,
        })
    }
}
