//! Property test: random reserve/commit/read/release sequences agree with a `VecDeque` model,
//! and backpressure happens exactly when the positions say the ring has no room.
#![cfg(not(loom))]

use std::collections::VecDeque;

use proptest::prelude::*;
use weir_ring::{frame_bytes, ring, Frames, Header};

const CAP: usize = 4096;

#[derive(Clone, Debug)]
enum Op {
    /// Reserve room for the first frame, push as many as fit, commit or drop.
    Write { lens: Vec<usize>, commit: bool },
    /// Read up to `max` frames and release them.
    Read { max: usize },
    /// Peek everything committed and compare with the model.
    PeekAll,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (prop::collection::vec(prop_oneof![0usize..64, 0usize..700, Just(CAP / 2 - 16)], 1..8), prop::bool::weighted(0.9))
            .prop_map(|(lens, commit)| Op::Write { lens, commit }),
        3 => (0usize..12).prop_map(|max| Op::Read { max }),
        1 => Just(Op::PeekAll),
    ]
}

fn payload(seq: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (seq as usize ^ i.wrapping_mul(7)) as u8)
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    #[test]
    fn ring_matches_a_vecdeque(ops in prop::collection::vec(op(), 1..200)) {
        let (mut p, mut c) = ring(CAP);
        let mut model: VecDeque<(u64, Vec<u8>)> = VecDeque::new();
        let mut seq = 0u64;
        for op in ops {
            match op {
                Op::Write { lens, commit } => {
                    let need = frame_bytes(lens[0]);
                    let pos = p.write_position();
                    let used = (pos - c.read_position()) as usize;
                    let idx = pos as usize % CAP;
                    let skip = if CAP - idx >= need { 0 } else { CAP - idx };
                    let fits = skip + need <= CAP - used;
                    let Some(region) = p.reserve(need).unwrap() else {
                        prop_assert!(!fits, "None although {} bytes are free (need {need}, skip {skip})", CAP - used);
                        continue;
                    };
                    prop_assert!(fits, "a region although the ring has no room");
                    prop_assert!(region.len() >= need && region.len() <= CAP - used - skip);
                    prop_assert_eq!(region.position(), pos + skip as u64);
                    let mut w = region.into_writer();
                    let mut pushed = Vec::new();
                    for (k, &len) in lens.iter().enumerate() {
                        let data = payload(seq + k as u64, len);
                        if w.push(Header::record(0, (seq + k as u64) as i64), &data).is_err() {
                            prop_assert!(frame_bytes(len) > w.remaining());
                            break;
                        }
                        pushed.push(data);
                    }
                    if commit {
                        let n = w.commit();
                        prop_assert_eq!(p.write_position(), pos + (skip + n) as u64);
                        for data in pushed {
                            model.push_back((seq, data));
                            seq += 1;
                        }
                    } else {
                        let _ = w; // dropped uncommitted
                        prop_assert_eq!(p.write_position(), pos);
                    }
                }
                Op::Read { max } => {
                    let Some(r) = c.read() else {
                        prop_assert!(model.is_empty());
                        prop_assert_eq!(c.read_position(), p.write_position());
                        continue;
                    };
                    let mut it = r.frames();
                    for _ in 0..max {
                        let Some(f) = it.next() else { break };
                        prop_assert_eq!(f.payload.as_ptr() as usize % 16, 0);
                        let (ts, data) = model.pop_front().expect("model has the frame");
                        prop_assert_eq!(f.ts as u64, ts);
                        prop_assert_eq!(f.payload, &data[..]);
                    }
                    let n = it.consumed();
                    r.release(n);
                }
                Op::PeekAll => {
                    let (a, b) = c.peek_range(p.write_position());
                    let seen: Vec<(u64, Vec<u8>)> = Frames::new(a)
                        .chain(Frames::new(b))
                        .map(|f| (f.ts as u64, f.payload.to_vec()))
                        .collect();
                    prop_assert_eq!(&seen, &model.iter().cloned().collect::<Vec<_>>());
                }
            }
        }
        // Drain: everything committed arrives, in order.
        while let Some(r) = c.read() {
            for f in r.frames() {
                let (ts, data) = model.pop_front().expect("model has the frame");
                prop_assert_eq!(f.ts as u64, ts);
                prop_assert_eq!(f.payload, &data[..]);
            }
            r.release_all();
        }
        prop_assert!(model.is_empty());
        prop_assert_eq!(c.read_position(), p.write_position());
        drop(p);
        prop_assert!(c.is_closed());
    }
}
