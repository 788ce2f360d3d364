//! Single-threaded behaviour of the ring: layout, wrap-around, backpressure, close,
//! announcements, peek_range, alignment, oversized frames.
#![cfg(not(loom))]

use weir_ring::{frame_bytes, ring, Consumer, FrameKind, FrameTooLarge, Frames, Header, Producer};

/// Drains every committed frame, returning (kind, ts, payload) and checking payload alignment.
fn drain(c: &mut Consumer) -> Vec<(FrameKind, i64, Vec<u8>)> {
    let mut out = Vec::new();
    while let Some(r) = c.read() {
        assert_eq!(r.as_slice().as_ptr() as usize % 16, 0);
        for f in r.frames() {
            assert_eq!(
                f.payload.as_ptr() as usize % 16,
                0,
                "payload not 16-aligned"
            );
            out.push((f.kind, f.ts, f.payload.to_vec()));
        }
        r.release_all();
    }
    out
}

fn payload(seq: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| (seq as usize * 31 + i) as u8).collect()
}

#[test]
fn header_layout_matches_the_documented_bytes() {
    // 5-byte record, kind 1, flags 0x80, key group 0x0102, ts -2.
    let h = Header::record(0x0102, -2).with_flags(0x80).encode(5);
    let want: [u8; 16] = [
        0x05, 0x00, 0x00, 0x00, 0x01, 0x80, 0x02, 0x01, 0xFE, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF,
        0xFF,
    ];
    assert_eq!(h, want);
    assert_eq!(Header::barrier(9).encode(0)[4], 3);
    assert_eq!(Header::watermark(0).encode(0)[4], 2);
    assert_eq!(Header::end_of_stream().encode(0)[4], 4);
    assert_eq!(Header::user_control(0).encode(0)[4], 5);
    assert_eq!(frame_bytes(0), 16);
    assert_eq!(frame_bytes(1), 32);
    assert_eq!(frame_bytes(16), 32);
    assert_eq!(frame_bytes(17), 48);
    // The iterator decodes the fixture.
    let mut bytes = vec![0u8; 32];
    bytes[..16].copy_from_slice(&want);
    bytes[16..21].copy_from_slice(b"abcde");
    let f = Frames::new(&bytes).next().unwrap();
    assert_eq!(
        (f.kind, f.flags, f.key_group, f.ts, f.payload),
        (FrameKind::Record, 0x80, 0x0102, -2, &b"abcde"[..])
    );
}

#[test]
fn wraps_around_with_frames_of_many_sizes() {
    let (mut p, mut c) = ring(4096);
    let mut seq = 0u64;
    let mut expect = 0u64;
    let sizes = [
        0usize,
        1,
        7,
        15,
        16,
        17,
        31,
        48,
        63,
        64,
        100,
        255,
        333,
        1000,
        2047 - 16,
    ];
    for round in 0..2000 {
        // Write a few frames of varied sizes, then drain; positions cross the end many times.
        for k in 0..(round % 4 + 1) {
            let len = sizes[(round * 7 + k) % sizes.len()];
            let data = payload(seq, len);
            if p.push(Header::record(seq as u16, seq as i64), &data)
                .unwrap()
            {
                seq += 1;
            }
        }
        for (kind, ts, data) in drain(&mut c) {
            assert_eq!(kind, FrameKind::Record);
            assert_eq!(ts as u64, expect);
            let len = data.len();
            assert_eq!(data, payload(expect, len));
            expect += 1;
        }
        assert_eq!(c.read_position(), p.write_position());
    }
    assert_eq!(expect, seq);
    assert!(
        p.write_position() > 20 * 4096,
        "the test must wrap many times"
    );
}

#[test]
fn a_full_ring_returns_none_and_drops_nothing() {
    let (mut p, mut c) = ring(4096);
    let data = [7u8; 48]; // 64-byte frames
    let mut pushed = 0;
    while p.push(Header::record(0, pushed), &data).unwrap() {
        pushed += 1;
    }
    assert_eq!(pushed, 4096 / 64);
    assert_eq!(p.free_bytes(), 0);
    assert!(p.reserve(16).unwrap().is_none());
    // Free one frame: exactly one more fits.
    let r = c.read().unwrap();
    let mut it = r.frames();
    it.next().unwrap();
    let n = it.consumed();
    r.release(n);
    assert!(p.push(Header::record(0, pushed), &data).unwrap());
    pushed += 1;
    assert!(!p.push(Header::record(0, pushed), &data).unwrap());
    let got = drain(&mut c);
    assert_eq!(got.len() as i64, pushed - 1);
    for (i, (_, ts, _)) in got.iter().enumerate() {
        assert_eq!(*ts, i as i64 + 1);
    }
}

#[test]
fn reservation_wraps_when_the_tail_end_is_too_short() {
    let (mut p, mut c) = ring(4096);
    // Fill to 4096 - 64, drain, then ask for 128: the 64-byte tail end is skipped.
    let data = vec![1u8; 4096 - 64 - 16];
    assert!(
        p.push(Header::record(0, 1), &data).is_err(),
        "larger than capacity/2"
    );
    for _ in 0..2 {
        assert!(p
            .push(Header::record(0, 1), &vec![1u8; 2048 - 16 - 32])
            .unwrap());
    }
    assert_eq!(p.write_position(), 4096 - 64);
    drain(&mut c);
    let mut r = p.reserve(128).unwrap().unwrap();
    assert_eq!(r.position(), 4096);
    assert_eq!(r.as_mut_slice().as_ptr() as usize % 64, 0);
    assert_eq!(
        r.len(),
        4096 - 64,
        "region runs from offset 0 up to the head"
    );
    let mut w = r.into_writer();
    w.push(Header::watermark(42), &[9; 100]).unwrap();
    w.commit();
    assert_eq!(p.write_position(), 4096 + 128);
    let got = drain(&mut c);
    assert_eq!(got, vec![(FrameKind::Watermark, 42, vec![9; 100])]);
    assert_eq!(c.read_position(), 4096 + 128);
}

#[test]
fn uncommitted_reservations_publish_nothing() {
    let (mut p, mut c) = ring(4096);
    {
        let mut w = p.writer(64).unwrap().unwrap();
        w.push(Header::record(1, 1), b"x").unwrap();
        // dropped without commit
    }
    assert!(c.read().is_none());
    let r = p.reserve(16).unwrap().unwrap();
    r.commit(0);
    assert!(c.read().is_none());
    assert_eq!(p.write_position(), 0);
    // A wrap that is reserved but not committed leaves no marker behind either.
    assert!(p.push(Header::record(0, 0), &vec![0u8; 2048 - 16]).unwrap());
    assert!(p
        .push(Header::record(0, 0), &vec![0u8; 2048 - 32 - 16])
        .unwrap());
    drain(&mut c);
    assert!(
        p.writer(64).unwrap().is_some(),
        "reserved (with a skip) and dropped"
    );
    assert_eq!(p.write_position(), 4096 - 32);
    assert!(c.read().is_none());
}

#[test]
fn close_semantics() {
    let (mut p, mut c) = ring(4096);
    assert!(!c.is_closed());
    assert!(p.push(Header::end_of_stream(), &[]).unwrap());
    p.close();
    p.close(); // idempotent
    assert!(!c.is_closed(), "a frame is still unread");
    let r = c.read().unwrap();
    r.release_all();
    assert!(c.is_closed());
    assert!(c.read().is_none());

    // Dropping the producer closes too; the consumer still reads what was committed.
    let (mut p, mut c) = ring(4096);
    assert!(p.push(Header::record(0, 5), b"last").unwrap());
    drop(p);
    assert!(!c.is_closed());
    assert_eq!(drain(&mut c).len(), 1);
    assert!(c.is_closed());

    // The producer learns that the consumer is gone.
    let (p, c) = ring(4096);
    assert!(!p.is_consumer_gone());
    drop(c);
    assert!(p.is_consumer_gone());
}

#[test]
#[should_panic(expected = "reserve after close")]
fn reserve_after_close_panics() {
    let (mut p, _c) = ring(4096);
    p.close();
    let _ = p.reserve(16);
}

#[test]
fn announcements() {
    let (mut p, mut c) = ring(4096);
    assert_eq!(c.announcement(), None);
    assert!(p.push(Header::record(0, 0), &[1; 40]).unwrap());
    let pos1 = p.write_position();
    assert!(p.push(Header::barrier(1), &[]).unwrap());
    p.announce(1, pos1);
    assert_eq!(c.announcement(), Some((1, pos1)));
    assert!(p.push(Header::record(0, 1), &[2; 40]).unwrap());
    let pos2 = p.write_position();
    p.announce(2, pos2);
    assert_eq!(c.announcement(), Some((2, pos2)));
    // An aligned consumer acts when its read position reaches the announced position.
    let (b, at) = c.announcement().unwrap();
    assert_eq!(b, 2);
    let mut reached = false;
    while let Some(r) = c.read() {
        let n = r.len();
        r.release(n);
        reached |= c.read_position() >= at;
    }
    assert!(reached);
}

#[test]
#[should_panic(expected = "announced after barrier")]
fn announcement_ids_must_grow() {
    let (mut p, _c) = ring(4096);
    p.announce(3, 0);
    p.announce(3, 0);
}

#[test]
#[should_panic(expected = "beyond write position")]
fn announcement_beyond_the_write_position_panics() {
    let (mut p, _c) = ring(4096);
    p.announce(1, 16);
}

#[test]
fn peek_range_across_the_wrap() {
    let (mut p, mut c) = ring(4096);
    // Park the positions near the end: 3968 bytes written and read.
    assert!(p.push(Header::record(0, 0), &[0; 2048 - 16]).unwrap());
    assert!(p.push(Header::record(0, 0), &[0; 1920 - 16]).unwrap());
    drain(&mut c);
    assert_eq!(c.read_position(), 3968);
    // 128 bytes are left before the end: one 80-byte frame, then a 112-byte frame wraps
    // (48 bytes skipped).
    assert!(p.push(Header::record(1, 10), &[10; 64]).unwrap());
    assert!(p.push(Header::record(2, 11), &[11; 96]).unwrap());
    assert!(p.push(Header::record(3, 12), &[12; 16]).unwrap());
    let upto = p.write_position();
    p.announce(7, upto);
    assert_eq!(upto, 3968 + 80 + 48 + 112 + 32);
    let (_, at) = c.announcement().unwrap();
    let (a, b) = c.peek_range(at);
    assert_eq!(a.len(), 80, "first part ends before the wrap marker");
    assert_eq!(b.len(), 144);
    assert_eq!(a.as_ptr() as usize % 16, 0);
    assert_eq!(b.as_ptr() as usize % 16, 0);
    let ts: Vec<i64> = Frames::new(a).chain(Frames::new(b)).map(|f| f.ts).collect();
    assert_eq!(ts, [10, 11, 12]);
    // A range that stops before the end is one slice; a stale position gives nothing.
    let (a, b) = c.peek_range(3968 + 80);
    assert_eq!((a.len(), b.len()), (80, 0));
    assert_eq!(c.peek_range(0), (&[][..], &[][..]));
    // Peeking does not consume.
    let got = drain(&mut c);
    assert_eq!(got.iter().map(|g| g.1).collect::<Vec<_>>(), [10, 11, 12]);
    assert_eq!(c.peek_range(upto), (&[][..], &[][..]));
}

#[test]
#[should_panic(expected = "beyond committed position")]
fn peek_range_beyond_the_tail_panics() {
    let (_p, c) = ring(4096);
    let _ = c.peek_range(16);
}

#[test]
fn oversized_frames_are_a_typed_error() {
    let (mut p, _c) = ring(8192);
    assert_eq!(p.max_frame_bytes(), 4096);
    let err = p
        .push(Header::record(0, 0), &[0; 4096 - 16 + 1])
        .unwrap_err();
    assert_eq!(
        err,
        FrameTooLarge {
            requested_bytes: 4096 + 16,
            max_bytes: 4096
        }
    );
    assert!(err.to_string().contains("capacity / 2"));
    assert!(p.reserve(4097).is_err());
    // Exactly capacity / 2 always fits a drained ring, from any position.
    let (mut p, mut c) = ring(8192);
    for shift in 0..40 {
        assert!(
            p.push(Header::record(0, 0), &[0; 4096 - 16]).unwrap(),
            "shift {shift}"
        );
        assert_eq!(drain(&mut c).len(), 1);
        assert!(p.push(Header::record(0, 0), &vec![0; shift * 16]).unwrap());
        assert_eq!(drain(&mut c).len(), 1);
    }
}

#[test]
fn push_with_serializes_in_place_and_rolls_back_on_error() {
    let (mut p, mut c) = ring(4096);
    let mut w = p.writer(64).unwrap().unwrap();
    w.push_with::<()>(Header::record(5, 1), |area| {
        assert_eq!(area.as_ptr() as usize % 16, 0);
        area[..3].copy_from_slice(b"abc");
        Ok(3)
    })
    .unwrap();
    let before = w.bytes_written();
    let err = w.push_with(Header::record(5, 2), |_| Err::<usize, _>("out of space"));
    assert_eq!(err, Err(weir_ring::PushWithError::Payload("out of space")));
    assert_eq!(w.bytes_written(), before);
    w.commit();
    let got = drain(&mut c);
    assert_eq!(got, vec![(FrameKind::Record, 1, b"abc".to_vec())]);
}

#[test]
fn producer_and_consumer_are_send() {
    fn send<T: Send>() {}
    send::<Producer>();
    send::<Consumer>();
}

#[test]
#[should_panic(expected = "power of two")]
fn capacity_must_be_a_power_of_two() {
    let _ = ring(5000);
}

#[test]
#[should_panic(expected = "bad kind byte")]
fn a_corrupt_frame_header_panics_instead_of_misreading() {
    let mut bytes = [0u8; 32];
    bytes[..16].copy_from_slice(&Header::record(0, 0).encode(4));
    bytes[4] = 0x42;
    let _ = Frames::new(&bytes).count();
}

#[test]
#[should_panic(expected = "overruns the slice")]
fn a_frame_longer_than_its_slice_panics() {
    let bytes = Header::record(0, 0).encode(64);
    let _ = Frames::new(&bytes).count();
}

#[cfg(debug_assertions)]
#[test]
#[should_panic(expected = "bad kind byte")]
fn committing_raw_bytes_that_are_not_frames_is_caught_in_debug_builds() {
    let (mut p, _c) = ring(4096);
    let mut r = p.reserve(32).unwrap().unwrap();
    r.as_mut_slice()[..16].copy_from_slice(&weir_ring::Header::record(0, 0).encode(0));
    r.as_mut_slice()[4] = weir_ring::KIND_WRAP;
    r.commit(16);
}

#[test]
fn deferred_commits_become_visible_only_when_published() {
    let (mut p, mut c) = ring(4096);
    for i in 0..3u8 {
        let mut w = p.writer(32).expect("fits").expect("room");
        w.push(Header::record(0, i64::from(i)), &[i; 8])
            .expect("room");
        w.commit_deferred();
    }
    assert!(c.read().is_none(), "nothing published yet");
    p.publish();
    let r = c.read().expect("published");
    assert_eq!(r.frames().map(|f| f.ts).collect::<Vec<_>>(), vec![0, 1, 2]);
    r.release_all();
    // An announcement publishes what it points at.
    let mut w = p.writer(32).expect("fits").expect("room");
    w.push(Header::record(0, 9), &[9; 8]).expect("room");
    w.commit_deferred();
    let pos = p.write_position();
    p.announce(1, pos);
    assert_eq!(c.announcement(), Some((1, pos)));
    let (a, b) = c.peek_range(pos);
    assert_eq!(a.len() + b.len(), 32);
    // Closing publishes too.
    let mut w = p.writer(32).expect("fits").expect("room");
    w.push(Header::record(0, 10), &[1; 8]).expect("room");
    w.commit_deferred();
    p.close();
    let r = c.read().expect("published at close");
    assert_eq!(r.frames().count(), 2);
}
