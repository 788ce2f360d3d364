//! Unaligned checkpoints at an exchange input (Flink's unaligned checkpoints).
//!
//! When barrier `n` is announced on any input ring (or an aligned checkpoint waited longer
//! than its alignment timeout), the input snapshots at once: it sends the barrier down its
//! chain ahead of the data still queued in its rings, and captures, per input, the record
//! frames the barrier overtook — for an announced input, the ring bytes between its read
//! position and the announced position, straight from ring memory; for an input not yet
//! announced, the frames it reads until its barrier arrives. The watermark and idleness
//! frames among those records are captured with them, in order, and the input's watermark
//! valve (`InputMerger`) is snapshotted as the barrier goes down (a [`PartKind::Valve`]
//! part), as Flink's in-flight buffers carry watermarks in-band. The captured frames are
//! still processed normally. They are written to checkpoint storage as channel state in the
//! background; on restore they are replayed before any new input: on as many shards as the
//! checkpoint had, the valve restored and each input's frames in order, records down the
//! chain and watermark frames through the valve, so that the replay is a run the inputs
//! could have had: each input's records and watermarks in their order, from the valve the
//! barrier left. The order between inputs is not recorded (ring bytes are captured before
//! they are read), and the replay goes input by input: with frames captured on several
//! inputs, a record that was late can be on time in the replay, as in another order of
//! reading them. On another number of shards the records alone are replayed (their inputs
//! are merged or split), the valve starting afresh.

use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use rkyv::util::AlignedVec;
use weir_ring::Header;
use weir_state::KeyGroupRange;

use crate::checkpoint::shard::ShardCheckpointRef;
use crate::checkpoint::snapshot::{self, Part, PartKind};
use crate::checkpoint::store::CheckpointStore;
use crate::checkpoint::ChannelPart;
use crate::data::{read_validated, Data};
use crate::error::{JobError, StartError};
use crate::graph::BuildCtx;
use crate::operator::{Event, ValveState};

const HEADER: usize = weir_ring::HEADER_BYTES;
const KIND_RECORD: u8 = weir_ring::FrameKind::Record as u8;
const KIND_WATERMARK: u8 = weir_ring::FrameKind::Watermark as u8;
/// The flag bits a watermark frame may carry (`exchange::FLAG_IDLE`).
const WATERMARK_FLAGS: u8 = crate::exchange::FLAG_IDLE;

/// Walks frames of bytes that may come from disk: every header is checked against the
/// slice's bounds, so malformed bytes are an error, not a panic.
pub(crate) fn walk_frames(bytes: &[u8], mut f: impl FnMut(Frame<'_>)) -> Result<(), String> {
    let mut off = 0usize;
    while off < bytes.len() {
        let h = bytes
            .get(off..off + HEADER)
            .ok_or_else(|| format!("truncated frame header at offset {off}"))?;
        let len = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize;
        let kind = h[4];
        let flags = h[5];
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
        f(Frame {
            offset: off,
            kind,
            flags,
            key_group: kg,
            ts,
            payload,
        });
        off += total;
    }
    Ok(())
}

/// A frame [`walk_frames`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Frame<'a> {
    /// Where it starts in the walked bytes.
    pub offset: usize,
    pub kind: u8,
    pub flags: u8,
    pub key_group: u16,
    pub ts: i64,
    pub payload: &'a [u8],
}

/// What [`Channels::replay`] hands back, with the input it came from.
pub(crate) enum Replayed<T> {
    /// A record and its timestamp: down the chain.
    Record(T, i64),
    /// A watermark or idleness change: through the input's valve.
    Event(Event),
}

/// The bytes of a [`PartKind::Valve`] part: `version u8 = 1 | emitted i64 | inputs u32 |
/// inputs × (watermark i64 | flags u8: bit 0 idle, bit 1 aligned)`, little-endian.
pub(crate) fn encode_valve(v: &ValveState) -> Vec<u8> {
    let mut out = Vec::with_capacity(13 + 9 * v.inputs.len());
    out.push(1);
    out.extend_from_slice(&v.emitted.to_le_bytes());
    out.extend_from_slice(&(v.inputs.len() as u32).to_le_bytes());
    for &(w, idle, aligned) in &v.inputs {
        out.extend_from_slice(&w.to_le_bytes());
        out.push(u8::from(idle) | (u8::from(aligned) << 1));
    }
    out
}

/// Decodes [`encode_valve`]'s bytes, which come from disk: anything else is an error.
pub(crate) fn decode_valve(b: &[u8]) -> Result<ValveState, String> {
    let i64_at = |o: usize| {
        b.get(o..o + 8)
            .map(|s| i64::from_le_bytes(s.try_into().expect("8 bytes")))
    };
    match b.first() {
        Some(1) => {}
        Some(v) => return Err(format!("watermark valve: version {v}, expected 1")),
        None => return Err("watermark valve: no bytes".into()),
    }
    let (Some(emitted), Some(n)) = (
        i64_at(1),
        b.get(9..13)
            .map(|s| u32::from_le_bytes(s.try_into().expect("4 bytes")) as usize),
    ) else {
        return Err(format!("watermark valve: {} bytes, cut short", b.len()));
    };
    // Checked before anything is sized by the count.
    if (b.len() - 13) as u64 != 9 * n as u64 {
        return Err(format!(
            "watermark valve: {} bytes for {n} inputs, expected {}",
            b.len(),
            13u64 + 9 * n as u64
        ));
    }
    let mut inputs = Vec::with_capacity(n);
    for i in 0..n {
        let o = 13 + 9 * i;
        let w = i64_at(o).expect("length checked");
        let flags = b[o + 8];
        if flags & !3 != 0 {
            return Err(format!("watermark valve: input {i} has flags {flags:#04x}"));
        }
        inputs.push((w, flags & 1 != 0, flags & 2 != 0));
    }
    Ok(ValveState { emitted, inputs })
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
    /// Restored frames to replay before new input: records, and (on as many shards as the
    /// checkpoint had) the watermark frames among them.
    replay: AlignedVec<16>,
    replay_off: usize,
    /// The input each stretch of `replay` came from: (input, end offset), in order.
    replay_inputs: Vec<(usize, usize)>,
    replay_segment: usize,
    /// The restored watermark valve, for the exchange to take.
    valve: Option<ValveState>,
}

impl Channels {
    /// An exchange input's channels; `inputs` is its number of input rings.
    pub fn new(ctx: &BuildCtx, name: &str, keyed: bool, inputs: usize) -> Result<Self, StartError> {
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
        let mut replay_inputs = Vec::new();
        let mut valve = None;
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
            // On as many shards as the checkpoint had, this shard's inputs are the old shard
            // of its index's: its valve and the watermarks in its channel state are restored
            // and replayed. On another number, inputs merge or split, and their watermarks
            // would not be one input's: records alone are replayed, the valve starts afresh
            // (ARCHITECTURE.md, checkpoint protocol, item 7).
            let same = r.shards.len() == ctx.shards;
            for (old, part) in r.parts(name, PartKind::Valve) {
                if !(same && old == ctx.shard) {
                    continue;
                }
                let v = decode_valve(&part.bytes).map_err(err)?;
                if v.inputs.len() != inputs {
                    return Err(err(format!(
                        "watermark valve of {} inputs, the exchange has {inputs}",
                        v.inputs.len()
                    )));
                }
                valve = Some(v);
            }
            for (old, part) in r.parts(name, PartKind::Channel) {
                let cp: ChannelPart = snapshot::decode_any(&part.bytes).map_err(err)?;
                let in_order = same && old == ctx.shard;
                for (input, logical) in &cp.inputs {
                    let input = *input as usize;
                    if in_order && input >= inputs {
                        return Err(err(format!(
                            "channel state of input {input}, the exchange has {inputs}"
                        )));
                    }
                    // Verified against its CRC before a byte is used.
                    let bytes = r.reader.read_logical(logical).map_err(err)?;
                    // Keyed exchanges: a record goes to the shard that owns its key group now;
                    // others: an old consumer's records go to one new shard.
                    let mine = |kg| {
                        if keyed {
                            range.contains(kg)
                        } else {
                            old % ctx.shards == ctx.shard
                        }
                    };
                    load_frames(
                        &bytes,
                        input,
                        in_order,
                        mine,
                        &mut replay,
                        &mut replay_inputs,
                    )
                    .map_err(|e| err(format!("input {input}: {e}")))?;
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
            replay_inputs,
            replay_segment: 0,
            valve,
        })
    }

    /// The restored watermark valve, once: the exchange's merger takes it over before it
    /// replays the channel state.
    pub fn take_valve(&mut self) -> Option<ValveState> {
        self.valve.take()
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
    /// delivered the barrier already, or ended). `valve` is the input's watermark valve as
    /// the barrier went down, stored beside the channel state.
    pub fn start(&mut self, id: u64, done: Vec<bool>, valve: ValveState) {
        let n = done.len();
        self.last_id = id;
        self.capture = Some(Capture {
            id,
            done,
            bytes: vec![Vec::new(); n],
        });
        if let Some(c) = &self.checkpoint {
            let mut c = c.borrow_mut();
            c.attach(
                id,
                Part {
                    operator: self.name.clone(),
                    kind: PartKind::Valve,
                    bytes: encode_valve(&valve),
                    files: Vec::new(),
                    logical: Vec::new(),
                },
            );
            c.report_async_start(id, 0);
        }
    }

    /// A record frame read from `input` while capturing.
    pub fn capture_record(&mut self, input: usize, kg: u16, ts: i64, payload: &[u8]) {
        if let Some(c) = &mut self.capture {
            if !c.done[input] {
                push_frame_vec(&mut c.bytes[input], Header::record(kg, ts), payload);
            }
        }
    }

    /// A watermark frame (a watermark, or an idleness change with `FLAG_IDLE`) read from
    /// `input` while capturing: kept in order with the records around it.
    pub fn capture_watermark(&mut self, input: usize, flags: u8, ts: i64) {
        if let Some(c) = &mut self.capture {
            if !c.done[input] {
                push_frame_vec(
                    &mut c.bytes[input],
                    Header::watermark(ts).with_flags(flags),
                    &[],
                );
            }
        }
    }

    /// The ring bytes up to `input`'s announced barrier (whole frames, this process's own
    /// memory): captures their records and watermark frames, in order, and ends capture of
    /// that input.
    pub fn capture_ring(&mut self, input: usize, a: &[u8], b: &[u8]) {
        if let Some(c) = &mut self.capture {
            if c.done[input] {
                return;
            }
            for part in [a, b] {
                // Ring memory holds only frames the writers produced; a malformed one would be
                // a broken invariant of the ring, reported by walk_frames as an error string.
                let r = walk_frames(part, |f| match f.kind {
                    KIND_RECORD => {
                        push_frame_vec(&mut c.bytes[input], record_header(&f), f.payload)
                    }
                    KIND_WATERMARK => {
                        push_frame_vec(&mut c.bytes[input], watermark_header(&f), &[])
                    }
                    _ => {}
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

    /// Replays up to `budget` restored frames, each with the input it came from: records
    /// (validated: they came from disk) and watermark frames, in their order.
    pub fn replay<T: Data>(
        &mut self,
        budget: usize,
        mut emit: impl FnMut(usize, Replayed<T>),
    ) -> Result<usize, JobError> {
        let mut n = 0;
        while n < budget && self.replay_off < self.replay.len() {
            let off = self.replay_off;
            while self
                .replay_inputs
                .get(self.replay_segment)
                .is_some_and(|&(_, end)| end <= off)
            {
                self.replay_segment += 1;
            }
            let input = self
                .replay_inputs
                .get(self.replay_segment)
                .map_or(0, |&(i, _)| i);
            // Frames this process wrote into `replay` from walked (bounds-checked) frames.
            let h = &self.replay[off..off + HEADER];
            let len = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize;
            let (kind, flags) = (h[4], h[5]);
            let ts = i64::from_le_bytes([h[8], h[9], h[10], h[11], h[12], h[13], h[14], h[15]]);
            let payload = &self.replay[off + HEADER..off + HEADER + len];
            let item = if kind == KIND_WATERMARK {
                Replayed::Event(crate::exchange::watermark_event(flags, ts))
            } else {
                let rec = read_validated::<T>(payload).map_err(|e| JobError::Operator {
                    operator: self.name.clone(),
                    shard: self.shard,
                    message: format!("restored channel state does not decode: {e}"),
                })?;
                Replayed::Record(rec, ts)
            };
            self.replay_off += weir_ring::frame_bytes(len);
            emit(input, item);
            n += 1;
        }
        if !self.has_replay() {
            self.replay = AlignedVec::new();
            self.replay_off = 0;
            self.replay_inputs = Vec::new();
            self.replay_segment = 0;
        }
        Ok(n)
    }
}

/// Appends input `input`'s restored channel state `bytes` (from disk) to the frames to
/// replay: its records for which `mine(key group)` holds, and with `in_order` (the input is
/// this shard's own, on as many shards as before) its watermark frames, in their order.
fn load_frames(
    bytes: &[u8],
    input: usize,
    in_order: bool,
    mine: impl Fn(u16) -> bool,
    replay: &mut AlignedVec<16>,
    replay_inputs: &mut Vec<(usize, usize)>,
) -> Result<(), String> {
    let start = replay.len();
    let mut bad = None;
    walk_frames(bytes, |f| {
        if f.kind == KIND_RECORD && mine(f.key_group) {
            push_frame(replay, record_header(&f), f.payload);
        } else if f.kind == KIND_WATERMARK && in_order {
            if !f.payload.is_empty() || f.flags & !WATERMARK_FLAGS != 0 {
                bad.get_or_insert(format!(
                    "malformed watermark frame at offset {} (flags {:#04x}, {} payload bytes)",
                    f.offset,
                    f.flags,
                    f.payload.len()
                ));
            }
            push_frame(replay, watermark_header(&f), &[]);
        }
    })?;
    if let Some(e) = bad {
        return Err(e);
    }
    if replay.len() > start {
        replay_inputs.push((input, replay.len()));
    }
    Ok(())
}

/// The header of walked record frame `f`.
fn record_header(f: &Frame<'_>) -> Header {
    Header::record(f.key_group, f.ts)
}

/// The header of walked watermark frame `f` (its flags kept: idleness changes).
fn watermark_header(f: &Frame<'_>) -> Header {
    Header::watermark(f.ts).with_flags(f.flags)
}

fn push_frame(out: &mut AlignedVec<16>, header: Header, payload: &[u8]) {
    let header = header.encode(payload.len() as u32);
    out.extend_from_slice(&header);
    out.extend_from_slice(payload);
    let pad = weir_ring::frame_bytes(payload.len()) - HEADER - payload.len();
    out.extend_from_slice(&[0u8; 16][..pad]);
}

fn push_frame_vec(out: &mut Vec<u8>, header: Header, payload: &[u8]) {
    let header = header.encode(payload.len() as u32);
    out.extend_from_slice(&header);
    out.extend_from_slice(payload);
    let pad = weir_ring::frame_bytes(payload.len()) - HEADER - payload.len();
    out.extend_from_slice(&[0u8; 16][..pad]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::operator::InputMerger;

    /// Channels of an exchange, without checkpointing or restore.
    fn bare() -> Channels {
        Channels {
            unaligned_after: Some(Duration::ZERO),
            name: "exchange".into(),
            shard: 0,
            capture: None,
            last_id: 0,
            writes: Vec::new(),
            checkpoint: None,
            store: None,
            replay: AlignedVec::new(),
            replay_off: 0,
            replay_inputs: Vec::new(),
            replay_segment: 0,
            valve: None,
        }
    }

    /// A record frame of `v` at event time `ts`, as an exchange writer writes it.
    fn record(out: &mut Vec<u8>, v: u64, ts: i64) {
        let mut buf = AlignedVec::<16>::new();
        buf.resize(64, 0);
        let mut arena = rkyv::ser::allocator::Arena::new();
        let len = crate::data::serialize_into(&v, &mut buf, &mut arena).expect("fits");
        push_frame_vec(out, Header::record(7, ts), &buf[..len]);
    }

    fn watermark(out: &mut Vec<u8>, w: i64) {
        push_frame_vec(out, Header::watermark(w), &[]);
    }

    fn idle(out: &mut Vec<u8>, idle: bool) {
        push_frame_vec(
            out,
            Header::watermark(i64::from(idle)).with_flags(crate::exchange::FLAG_IDLE),
            &[],
        );
    }

    /// What the head hands down the chain while it replays: records, and the valve's output.
    #[derive(Debug, PartialEq)]
    enum Out {
        Rec(u64, i64),
        Ev(Event),
    }

    /// Replays `ch` through `merger` as the exchange head does.
    fn replay_all(ch: &mut Channels, merger: &mut InputMerger) -> Vec<Out> {
        let mut out = Vec::new();
        while ch.has_replay() {
            ch.replay::<u64>(2, |input, item| match item {
                Replayed::Record(v, ts) => out.push(Out::Rec(v, ts)),
                Replayed::Event(ev) => merger.on_event(input, ev, &mut |e| out.push(Out::Ev(e))),
            })
            .expect("replay");
        }
        out
    }

    /// The defect this fixes: ring bytes `[watermark 100][record ts 50]` overtaken by an
    /// unaligned barrier were captured as the record alone, and a restore counted it (after
    /// the restore nothing had moved the watermark past it). Now the watermark frames are
    /// captured in order with the records (from ring memory and from frames read while
    /// capturing), the valve is restored, and the replay hands the watermark to the valve
    /// before the record, as the run before the failure did.
    #[test]
    fn watermark_frames_are_captured_and_replayed_in_order_with_records() {
        // Two inputs: input 0 announced its barrier (ring capture), input 1 not yet (frames
        // read while capturing).
        let mut merger = InputMerger::new(2);
        let mut sink = |_| {};
        merger.on_event(0, Event::Watermark(20), &mut sink);
        merger.on_event(1, Event::Watermark(30), &mut sink);
        let valve = merger.valve();
        assert_eq!(valve.emitted, 20);
        let mut ch = bare();
        ch.start(5, vec![false, false], valve.clone());
        let mut ring = Vec::new();
        record(&mut ring, 1, 100);
        watermark(&mut ring, 100);
        record(&mut ring, 2, 50);
        // Split where the ring wraps: between frames.
        let cut = weir_ring::frame_bytes(8);
        ch.capture_ring(0, &ring[..cut], &ring[cut..]);
        assert!(!ch.capturing(0) && ch.capturing(1));
        let mut live = Vec::new();
        record(&mut live, 3, 120);
        // The payload as the ring's frame iterator hands it over: without the padding.
        ch.capture_record(1, 7, 120, &live[HEADER..HEADER + 8]);
        ch.capture_watermark(1, crate::exchange::FLAG_IDLE, 1);
        ch.capture_watermark(1, 0, 110);
        ch.input_done(1);
        let bytes = ch.capture.take().expect("capturing").bytes;

        // The captured streams: every frame, in order.
        let kinds = |b: &[u8]| {
            let mut v = Vec::new();
            walk_frames(b, |f| v.push((f.kind, f.flags, f.ts))).expect("whole frames");
            v
        };
        assert_eq!(kinds(&bytes[0]), vec![(1, 0, 100), (2, 0, 100), (1, 0, 50)]);
        assert_eq!(kinds(&bytes[1]), vec![(1, 0, 120), (2, 1, 1), (2, 0, 110)]);

        // The restore: the valve as the barrier went down, then each input's frames.
        let valve = decode_valve(&encode_valve(&valve)).expect("round trip");
        let mut restored = bare();
        for (i, b) in bytes.iter().enumerate() {
            load_frames(
                b,
                i,
                true,
                |_| true,
                &mut restored.replay,
                &mut restored.replay_inputs,
            )
            .expect("valid");
        }
        let mut fresh = InputMerger::new(2);
        // What downstream had last from the valve goes again first.
        assert_eq!(fresh.restore_valve(&valve), vec![Event::Watermark(20)]);
        let got = replay_all(&mut restored, &mut fresh);
        assert_eq!(
            got,
            vec![
                Out::Rec(1, 100),
                // Input 0 at 100, input 1 at 30: the valve holds 30, which it had not sent.
                Out::Ev(Event::Watermark(30)),
                Out::Rec(2, 50),
                Out::Rec(3, 120),
                // Input 1 idle: input 0's 100 alone counts.
                Out::Ev(Event::Watermark(100)),
                // Input 1 active again at 110, not behind: the minimum stays 100.
            ]
        );
        // A failure-free run fed the same frames from the same valve says the same.
        let mut live = InputMerger::new(2);
        live.on_event(0, Event::Watermark(20), &mut sink);
        live.on_event(1, Event::Watermark(30), &mut sink);
        let mut want = Vec::new();
        for (i, b) in bytes.iter().enumerate() {
            walk_frames(b, |f| {
                if f.kind == KIND_RECORD {
                    let v = read_validated::<u64>(f.payload).expect("record");
                    want.push(Out::Rec(v, f.ts));
                } else {
                    let ev = crate::exchange::watermark_event(f.flags, f.ts);
                    live.on_event(i, ev, &mut |e| want.push(Out::Ev(e)));
                }
            })
            .expect("valid");
        }
        assert_eq!(got, want);
        assert_eq!(fresh.valve(), live.valve());
        // Every input idle: the watermark, then the idleness.
        let mut m = InputMerger::new(2);
        m.on_event(0, Event::Watermark(20), &mut sink);
        m.on_event(1, Event::Idle(true), &mut sink);
        let mut told = Vec::new();
        m.on_event(0, Event::Idle(true), &mut |e| told.push(e));
        assert_eq!(told, vec![Event::Idle(true)]);
        let v = decode_valve(&encode_valve(&m.valve())).expect("round trip");
        let mut r = InputMerger::new(2);
        assert_eq!(
            r.restore_valve(&v),
            vec![Event::Watermark(20), Event::Idle(true)]
        );
        // The restored valve acts as the one it was taken from.
        let (mut a, mut b) = (Vec::new(), Vec::new());
        m.on_event(1, Event::Watermark(25), &mut |e| a.push(e));
        r.on_event(1, Event::Watermark(25), &mut |e| b.push(e));
        assert_eq!(a, b);
        assert_eq!(a, vec![Event::Idle(false), Event::Watermark(25)]);
    }

    /// A restore onto another number of shards replays the records alone, and so does one
    /// of a checkpoint written before watermark frames were captured (records only).
    #[test]
    fn records_alone_replay_without_the_inputs_order() {
        let mut b = Vec::new();
        record(&mut b, 1, 100);
        watermark(&mut b, 100);
        idle(&mut b, true);
        record(&mut b, 2, 50);
        let mut ch = bare();
        load_frames(
            &b,
            0,
            false,
            |_| true,
            &mut ch.replay,
            &mut ch.replay_inputs,
        )
        .expect("valid");
        let mut m = InputMerger::new(1);
        assert_eq!(
            replay_all(&mut ch, &mut m),
            vec![Out::Rec(1, 100), Out::Rec(2, 50)]
        );
        // Old format: records only; replayed in order as before, nothing else.
        let mut old = Vec::new();
        record(&mut old, 1, 100);
        record(&mut old, 2, 50);
        let mut ch = bare();
        load_frames(
            &old,
            0,
            true,
            |_| true,
            &mut ch.replay,
            &mut ch.replay_inputs,
        )
        .expect("valid");
        assert_eq!(
            replay_all(&mut ch, &mut m),
            vec![Out::Rec(1, 100), Out::Rec(2, 50)]
        );
    }

    /// Restored bytes come from disk: a malformed watermark frame or valve is an error.
    #[test]
    fn malformed_watermark_frames_and_valves_are_errors() {
        let mut b = Vec::new();
        watermark(&mut b, 100);
        b[5] = 0x80;
        let mut ch = bare();
        let e = load_frames(&b, 0, true, |_| true, &mut ch.replay, &mut ch.replay_inputs)
            .expect_err("unknown flag");
        assert!(e.contains("malformed watermark frame at offset 0"), "{e}");
        let mut b = Vec::new();
        push_frame_vec(&mut b, Header::watermark(1), b"x");
        let e = load_frames(&b, 0, true, |_| true, &mut ch.replay, &mut ch.replay_inputs)
            .expect_err("a payload");
        assert!(e.contains("1 payload bytes"), "{e}");

        let v = ValveState {
            emitted: 7,
            inputs: vec![(7, false, true), (i64::MAX, true, false)],
        };
        let bytes = encode_valve(&v);
        assert_eq!(bytes.len(), 13 + 2 * 9);
        assert_eq!(decode_valve(&bytes).expect("valid"), v);
        for cut in 0..bytes.len() {
            assert!(decode_valve(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut long = bytes.clone();
        long.push(0);
        assert!(decode_valve(&long).is_err());
        let mut bad = bytes.clone();
        bad[0] = 2;
        assert!(decode_valve(&bad).unwrap_err().contains("version 2"));
        let mut bad = bytes.clone();
        bad[9..13].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode_valve(&bad).is_err());
        let mut bad = bytes.clone();
        bad[13 + 8] = 4;
        assert!(decode_valve(&bad).unwrap_err().contains("flags"));
    }

    #[test]
    fn walking_rejects_malformed_frames_without_panicking() {
        let mut v = Vec::new();
        push_frame_vec(&mut v, Header::record(3, 42), b"hello world");
        push_frame_vec(&mut v, Header::record(4, 43), b"");
        let mut seen = Vec::new();
        walk_frames(&v, |f| {
            seen.push((f.kind, f.key_group, f.ts, f.payload.to_vec()))
        })
        .expect("valid");
        assert_eq!(
            seen,
            vec![(1, 3, 42, b"hello world".to_vec()), (1, 4, 43, vec![])]
        );
        for cut in 1..v.len() {
            if cut % 16 != 0 || cut == 16 {
                assert!(walk_frames(&v[..cut], |_| {}).is_err(), "cut at {cut}");
            }
        }
        let mut bad = v.clone();
        bad[0..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(walk_frames(&bad, |_| {}).is_err());
        let mut bad = v.clone();
        bad[4] = 0xEE;
        assert!(walk_frames(&bad, |_| {}).is_err());
    }
}
