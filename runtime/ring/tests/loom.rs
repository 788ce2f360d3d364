//! Model checks of the ring's atomic protocol with loom. Run with
//! `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=/work/main/target-loom cargo test -p weir-ring --release --test loom`.
//!
//! Under loom every 16-byte slot of the buffer has a loom cell; write and read regions hold
//! its access guards, so a producer write and a consumer read of the same slot that are not
//! ordered by the head/tail protocol fail the model (as would a lost or reordered frame).
#![cfg(loom)]

use loom::thread;
use weir_ring::{ring, FrameKind, Frames, Header};

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    // Exhaustive (no preemption bound): each model finishes in about a second in release.
    b.preemption_bound = None;
    b.check(f);
}

/// Payload of frame `i`: `i + 1` repeated `len` times.
fn payload(i: u8, len: usize) -> Vec<u8> {
    vec![i + 1; len]
}

/// Frames of 32, 16 and 32 bytes through a 64-byte ring: the third does not fit before the
/// buffer end, so it needs the first released (backpressure) and wraps (16-byte skip).
const LENS: [usize; 3] = [8, 0, 16];

#[test]
fn three_frames_with_backpressure_and_a_wrap() {
    model(|| {
        let (mut p, mut c) = ring(64);
        let producer = thread::spawn(move || {
            for (i, &len) in LENS.iter().enumerate() {
                let data = payload(i as u8, len);
                while !p.push(Header::record(i as u16, i as i64), &data).unwrap() {
                    thread::yield_now();
                }
            }
            assert_eq!(p.write_position(), 32 + 16 + 16 + 32);
        });
        let mut got = 0usize;
        while got < LENS.len() {
            let Some(r) = c.read() else {
                thread::yield_now();
                continue;
            };
            // Release frame by frame to exercise partial releases.
            let mut it = r.frames();
            let f = it.next().expect("a region holds a frame");
            assert_eq!(f.kind, FrameKind::Record);
            assert_eq!(f.ts, got as i64);
            assert_eq!(f.key_group, got as u16);
            assert_eq!(f.payload, &payload(got as u8, LENS[got])[..]);
            got += 1;
            let n = it.consumed();
            r.release(n);
        }
        producer.join().unwrap();
        assert!(c.read().is_none());
        assert_eq!(c.read_position(), 96);
        assert!(c.is_closed());
    });
}

#[test]
fn batch_commit_and_close() {
    model(|| {
        let (mut p, mut c) = ring(64);
        let producer = thread::spawn(move || {
            let mut w = p.writer(64 / 2).unwrap().expect("empty ring");
            w.push(Header::record(0, 0), &[1; 4]).unwrap();
            w.push(Header::barrier(9), &[]).unwrap();
            w.commit();
            p.close();
        });
        let mut seen = Vec::new();
        loop {
            if let Some(r) = c.read() {
                seen.extend(r.frames().map(|f| (f.kind, f.ts, f.payload.to_vec())));
                r.release_all();
            } else if c.is_closed() {
                break;
            } else {
                thread::yield_now();
            }
        }
        producer.join().unwrap();
        assert_eq!(
            seen,
            vec![
                (FrameKind::Record, 0, vec![1; 4]),
                (FrameKind::Barrier, 9, vec![])
            ]
        );
    });
}

#[test]
fn announcement_makes_the_range_up_to_it_readable() {
    model(|| {
        let (mut p, c) = ring(64);
        let producer = thread::spawn(move || {
            assert!(p.push(Header::record(0, 5), &[7; 16]).unwrap());
            assert!(p.push(Header::barrier(1), &[]).unwrap());
            let at = p.write_position();
            p.announce(1, at);
            p
        });
        let seen = loop {
            if let Some(a) = c.announcement() {
                break a;
            }
            thread::yield_now();
        };
        assert_eq!(seen, (1, 48));
        let (a, b) = c.peek_range(seen.1);
        assert!(b.is_empty());
        let frames: Vec<_> = Frames::new(a)
            .map(|f| (f.kind, f.ts, f.payload.len()))
            .collect();
        assert_eq!(
            frames,
            vec![(FrameKind::Record, 5, 16), (FrameKind::Barrier, 1, 0)]
        );
        drop(producer.join().unwrap());
    });
}

/// Two frames committed separately but published together: the consumer sees neither or both
/// (one Release store covers both), and every byte of each.
#[test]
fn deferred_commits_publish_together() {
    model(|| {
        let (mut p, mut c) = ring(64);
        let producer = thread::spawn(move || {
            let mut w = p.writer(16).unwrap().expect("empty ring");
            w.push(Header::record(0, 1), &[3; 4]).unwrap();
            w.commit_deferred();
            let mut w = p.writer(16).unwrap().expect("room");
            w.push(Header::record(0, 2), &[4; 4]).unwrap();
            w.commit_deferred();
            p.publish();
            p.close();
        });
        let mut seen = Vec::new();
        loop {
            if let Some(r) = c.read() {
                let frames: Vec<_> = r.frames().map(|f| (f.ts, f.payload.to_vec())).collect();
                if seen.is_empty() {
                    assert_eq!(frames.len(), 2, "both frames are published at once");
                }
                seen.extend(frames);
                r.release_all();
            } else if c.is_closed() {
                break;
            } else {
                thread::yield_now();
            }
        }
        producer.join().unwrap();
        assert_eq!(seen, vec![(1, vec![3; 4]), (2, vec![4; 4])]);
    });
}
