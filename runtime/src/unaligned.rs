//! Unaligned checkpoints at an exchange input (Flink's unaligned checkpoints).
//!
//! When barrier `n` is announced on any input ring (or an aligned checkpoint waited longer
//! than its alignment timeout), the input snapshots at once: it sends the barrier down its
//! chain ahead of the data still queued in its rings, and captures, per input, the record
//! frames the barrier overtook — for an announced input, the ring bytes between its read
//! position and the announced position, straight from ring memory; for an input not yet
//! announced, the frames it reads until its barrier arrives. The captured frames are still
//! processed normally. They are written to checkpoint storage as channel state in the
//! background; on restore they are replayed before any new input.

use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use rkyv::util::AlignedVec;
use weir_state::KeyGroupRange;

use crate::checkpoint::shard::ShardCheckpointRef;
use crate::checkpoint::snapshot::{self, Part, PartKind};
use crate::checkpoint::store::CheckpointStore;
use crate::checkpoint::ChannelPart;
use crate::data::{read_validated, Data};
use crate::error::{JobError, StartError};
use crate::graph::BuildCtx;

const HEADER: usize = weir_ring::HEADER_BYTES;
const KIND_RECORD: u8 = 1;

/// Walks frames of bytes that may come from disk: every header is checked against the
/// slice's bounds, so malformed bytes are an error, not a panic.
pub(crate) fn walk_frames(
    bytes: &[u8],
    mut f: impl FnMut(u8, u16, i64, &[u8]),
) -> Result<(), String> {
    let mut off = 0usize;
    while off < bytes.len() {
        let h = bytes
            .get(off..off + HEADER)
            .ok_or_else(|| format!("truncated frame header at offset {off}"))?;
        let len = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize;
        let kind = h[4];
        let kg = u16::from_le_bytes([h[6], h[7]]);
        let ts = i64::from_le_bytes([h[8], h[9], h[10], h[11], h[12], h[13], h[14], h[15]]);
        let total = weir_ring::frame_bytes(len);
        let payload = bytes.get(off + HEADER..off + HEADER + len).ok_or_else(|| {
            format!("frame at offset {off} claims {len} payload bytes beyond the end")
        })?;
        if off + total > bytes.len() {
            return Err(format!("frame at offset {off} is cut short"));
        }
        // The wrap marker never reaches captured bytes; anything but known kinds is corrupt.
        if !(1..=5).contains(&kind) {
            return Err(format!("bad frame kind {kind} at offset {off}"));
        }
        f(kind, kg, ts, payload);
        off += total;
    }
    Ok(())
}

struct Capture {
    id: u64,
    done: Vec<bool>,
    bytes: Vec<Vec<u8>>,
}

type WriteResult = (u64, Result<Part, String>, u64);

/// An exchange input's unaligned-checkpoint bookkeeping and restored channel state.
pub(crate) struct Channels {
    /// `Some(timeout)` when unaligned checkpoints are on.
    pub unaligned_after: Option<Duration>,
    name: String,
    shard: usize,
    capture: Option<Capture>,
    last_id: u64,
    writes: Vec<mpsc::Receiver<WriteResult>>,
    checkpoint: Option<ShardCheckpointRef>,
    store: Option<Arc<dyn CheckpointStore>>,
    /// Restored record frames to replay before new input.
    replay: AlignedVec<16>,
    replay_off: usize,
}

impl Channels {
    pub fn new(ctx: &BuildCtx, name: &str, keyed: bool) -> Result<Self, StartError> {
        let unaligned_after = crate::checkpoint::unaligned_after(ctx);
        let store = ctx
            .checkpoint
            .as_ref()
            .map(|c| c.borrow().shared.store.clone());
        if unaligned_after.is_some() {
            if let Some(c) = &ctx.checkpoint {
                c.borrow_mut().register();
            }
        }
        let mut replay = AlignedVec::<16>::new();
        if let Some(r) = &ctx.restore {
            let range = KeyGroupRange::for_shard(
                ctx.shard as u16,
                ctx.shards as u16,
                ctx.config.max_parallelism,
            );
            let err = |e: String| StartError::Restore {
                reason: format!(
                    "checkpoint {}: channel state of `{name}`: {e}",
                    r.checkpoint_id
                ),
            };
            for (old, part) in r.parts(name, PartKind::Channel) {
                let cp: ChannelPart = snapshot::decode_any(&part.bytes).map_err(err)?;
                for (_, logical) in &cp.inputs {
                    // Verified against its CRC before a byte is used.
                    let bytes = r.reader.read_logical(logical).map_err(err)?;
                    // Keyed exchanges: a record goes to the shard that owns its key group now;
                    // others: an old consumer's records go to one new shard.
                    walk_frames(&bytes, |kind, kg, ts, payload| {
                        let mine = if keyed {
                            range.contains(kg)
                        } else {
                            old % ctx.shards == ctx.shard
                        };
                        if kind == KIND_RECORD && mine {
                            push_frame(&mut replay, kg, ts, payload);
                        }
                    })
                    .map_err(err)?;
                }
            }
        }
        Ok(Self {
            unaligned_after,
            name: name.to_string(),
            shard: ctx.shard,
            capture: None,
            last_id: 0,
            writes: Vec::new(),
            checkpoint: ctx.checkpoint.clone(),
            store,
            replay,
            replay_off: 0,
        })
    }

    /// The newest checkpoint taken unaligned here: its in-band barriers are already handled.
    pub fn last_id(&self) -> u64 {
        self.last_id
    }

    pub fn capturing(&self, input: usize) -> bool {
        self.capture.as_ref().is_some_and(|c| !c.done[input])
    }

    pub fn active_id(&self) -> Option<u64> {
        self.capture.as_ref().map(|c| c.id)
    }

    /// Starts capturing for unaligned checkpoint `id`; inputs in `done` need no capture (they
    /// delivered the barrier already, or ended).
    pub fn start(&mut self, id: u64, done: Vec<bool>) {
        let n = done.len();
        self.last_id = id;
        self.capture = Some(Capture {
            id,
            done,
            bytes: vec![Vec::new(); n],
        });
        if let Some(c) = &self.checkpoint {
            c.borrow_mut().report_async_start(id, 0);
        }
    }

    /// A record frame read from `input` while capturing.
    pub fn capture_record(&mut self, input: usize, kg: u16, ts: i64, payload: &[u8]) {
        if let Some(c) = &mut self.capture {
            if !c.done[input] {
                push_frame_vec(&mut c.bytes[input], kg, ts, payload);
            }
        }
    }

    /// The ring bytes up to `input`'s announced barrier (whole frames, this process's own
    /// memory): captures their records and ends capture of that input.
    pub fn capture_ring(&mut self, input: usize, a: &[u8], b: &[u8]) {
        if let Some(c) = &mut self.capture {
            if c.done[input] {
                return;
            }
            for part in [a, b] {
                // Ring memory holds only frames the writers produced; a malformed one would be
                // a broken invariant of the ring, reported by walk_frames as an error string.
                let r = walk_frames(part, |kind, kg, ts, payload| {
                    if kind == KIND_RECORD {
                        push_frame_vec(&mut c.bytes[input], kg, ts, payload);
                    }
                });
                debug_assert!(r.is_ok(), "ring bytes are whole frames: {r:?}");
            }
            c.done[input] = true;
        }
    }

    pub fn input_done(&mut self, input: usize) {
        if let Some(c) = &mut self.capture {
            c.done[input] = true;
        }
    }

    /// When every input's capture is complete, writes the channel state in the background.
    pub fn maybe_finish(&mut self) {
        let complete = self
            .capture
            .as_ref()
            .is_some_and(|c| c.done.iter().all(|d| *d));
        if !complete {
            return;
        }
        let Some(c) = self.capture.take() else { return };
        let (Some(store), Some(ckpt)) = (self.store.clone(), &self.checkpoint) else {
            return;
        };
        let inflight: u64 = c.bytes.iter().map(|b| b.len() as u64).sum();
        ckpt.borrow_mut().record_alignment(c.id, 0, inflight);
        let (tx, rx) = mpsc::channel();
        let (name, shard, id) = (self.name.clone(), self.shard, c.id);
        // Channel state is written off the shard thread: processing never waits for I/O.
        let spawned = std::thread::Builder::new()
            .name(format!("weir-chan-{shard}"))
            .spawn(move || {
                crate::backend::background_priority();
                let t0 = Instant::now();
                let r = (|| {
                    let mut part = ChannelPart::default();
                    let mut logical = Vec::new();
                    for (i, bytes) in c.bytes.iter().enumerate() {
                        if bytes.is_empty() {
                            continue;
                        }
                        let l = store.write_small(id, shard, bytes)?;
                        logical.push(l.clone());
                        part.inputs.push((i as u32, l));
                    }
                    Ok(Part {
                        operator: name,
                        kind: PartKind::Channel,
                        bytes: snapshot::encode(&part),
                        files: Vec::new(),
                        logical,
                    })
                })();
                let _ = tx.send((id, r, t0.elapsed().as_nanos() as u64));
            });
        match spawned {
            Ok(_) => self.writes.push(rx),
            Err(e) => ckpt.borrow_mut().report_async_done(
                id,
                Err(format!("channel state writer thread: {e}")),
                0,
            ),
        }
    }

    /// An aligned checkpoint passed this input: its channel state is empty.
    pub fn aligned(&mut self, id: u64) {
        if self.unaligned_after.is_none() {
            return;
        }
        if let Some(c) = &self.checkpoint {
            let part = Part {
                operator: self.name.clone(),
                kind: PartKind::Channel,
                bytes: snapshot::encode(&ChannelPart::default()),
                files: Vec::new(),
                logical: Vec::new(),
            };
            c.borrow_mut().report(id, part, 0);
        }
    }

    /// Reports channel-state writes that finished.
    pub fn poll(&mut self) {
        let Some(ckpt) = &self.checkpoint else { return };
        self.writes.retain(|rx| match rx.try_recv() {
            Ok((id, r, ns)) => {
                ckpt.borrow_mut().report_async_done(id, r, ns);
                false
            }
            Err(mpsc::TryRecvError::Empty) => true,
            Err(mpsc::TryRecvError::Disconnected) => false,
        });
    }

    pub fn has_replay(&self) -> bool {
        self.replay_off < self.replay.len()
    }

    /// Replays up to `budget` restored records (validated: they came from disk).
    pub fn replay<T: Data>(
        &mut self,
        budget: usize,
        mut emit: impl FnMut(T, i64),
    ) -> Result<usize, JobError> {
        let mut n = 0;
        while n < budget && self.replay_off < self.replay.len() {
            let off = self.replay_off;
            let h = &self.replay[off..off + HEADER];
            let len = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize;
            let ts = i64::from_le_bytes([h[8], h[9], h[10], h[11], h[12], h[13], h[14], h[15]]);
            let payload = &self.replay[off + HEADER..off + HEADER + len];
            let rec = read_validated::<T>(payload).map_err(|e| JobError::Operator {
                operator: self.name.clone(),
                shard: self.shard,
                message: format!("restored channel state does not decode: {e}"),
            })?;
            self.replay_off += weir_ring::frame_bytes(len);
            emit(rec, ts);
            n += 1;
        }
        if !self.has_replay() {
            self.replay = AlignedVec::new();
            self.replay_off = 0;
        }
        Ok(n)
    }
}

fn push_frame(out: &mut AlignedVec<16>, kg: u16, ts: i64, payload: &[u8]) {
    let header = weir_ring::Header::record(kg, ts).encode(payload.len() as u32);
    out.extend_from_slice(&header);
    out.extend_from_slice(payload);
    let pad = weir_ring::frame_bytes(payload.len()) - HEADER - payload.len();
    out.extend_from_slice(&[0u8; 16][..pad]);
}

fn push_frame_vec(out: &mut Vec<u8>, kg: u16, ts: i64, payload: &[u8]) {
    let header = weir_ring::Header::record(kg, ts).encode(payload.len() as u32);
    out.extend_from_slice(&header);
    out.extend_from_slice(payload);
    let pad = weir_ring::frame_bytes(payload.len()) - HEADER - payload.len();
    out.extend_from_slice(&[0u8; 16][..pad]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn walking_rejects_malformed_frames_without_panicking() {
        let mut v = Vec::new();
        push_frame_vec(&mut v, 3, 42, b"hello world");
        push_frame_vec(&mut v, 4, 43, b"");
        let mut seen = Vec::new();
        walk_frames(&v, |k, kg, ts, p| seen.push((k, kg, ts, p.to_vec()))).expect("valid");
        assert_eq!(
            seen,
            vec![(1, 3, 42, b"hello world".to_vec()), (1, 4, 43, vec![])]
        );
        for cut in 1..v.len() {
            if cut % 16 != 0 || cut == 16 {
                assert!(
                    walk_frames(&v[..cut], |_, _, _, _| {}).is_err(),
                    "cut at {cut}"
                );
            }
        }
        let mut bad = v.clone();
        bad[0..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(walk_frames(&bad, |_, _, _, _| {}).is_err());
        let mut bad = v.clone();
        bad[4] = 0xEE;
        assert!(walk_frames(&bad, |_, _, _, _| {}).is_err());
    }
}
