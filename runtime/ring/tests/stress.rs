//! Two threads, one million frames of varying sizes with a sequence number: order and content
//! arrive intact through backpressure and wrap-around. Runs unpinned (more threads than cores
//! is fine).
#![cfg(not(loom))]

use std::thread;

use weir_ring::{frame_bytes, ring, FrameKind, Header};

const FRAMES: u64 = 1_000_000;

fn len_of(seq: u64) -> usize {
    // 8..=263 bytes, skewed small, deterministic.
    8 + ((seq.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as usize)
}

/// A byte pattern; frame `seq` carries `seq` then `PATTERN[seq % 64..]` (memcpy/memcmp cheap
/// even in debug builds).
fn pattern() -> Vec<u8> {
    (0..400u32)
        .map(|i| (i.wrapping_mul(37) ^ (i >> 3)) as u8)
        .collect()
}

fn fill(pattern: &[u8], seq: u64, out: &mut [u8]) {
    out[..8].copy_from_slice(&seq.to_le_bytes());
    let off = (seq % 64) as usize;
    let n = out.len() - 8;
    out[8..].copy_from_slice(&pattern[off..off + n]);
}

#[test]
fn one_million_frames_across_threads() {
    let (mut p, mut c) = ring(16 * 1024);
    let pattern = pattern();
    let pat = pattern.clone();
    let producer = thread::spawn(move || {
        let mut seq = 0u64;
        let mut scratch = [0u8; 300];
        while seq < FRAMES {
            let Some(mut w) = p.writer(frame_bytes(len_of(seq))).unwrap() else {
                std::hint::spin_loop();
                thread::yield_now();
                continue;
            };
            // Batches of up to 4 KiB.
            while seq < FRAMES && w.bytes_written() < 4096 {
                let len = len_of(seq);
                fill(&pat, seq, &mut scratch[..len]);
                if w.push(
                    Header::record((seq % 65_536) as u16, seq as i64),
                    &scratch[..len],
                )
                .is_err()
                {
                    break;
                }
                seq += 1;
            }
            w.commit();
        }
        assert!(p.push(Header::end_of_stream(), &[]).is_ok());
        // `p` drops here: close.
    });
    let mut expect = 0u64;
    let mut want = [0u8; 300];
    let mut eos = false;
    loop {
        let Some(r) = c.read() else {
            if c.is_closed() {
                break;
            }
            thread::yield_now();
            continue;
        };
        for f in r.frames() {
            if f.kind == FrameKind::EndOfStream {
                eos = true;
                continue;
            }
            assert_eq!(f.kind, FrameKind::Record);
            assert_eq!(f.ts as u64, expect, "out of order");
            assert_eq!(f.key_group, (expect % 65_536) as u16);
            assert_eq!(f.payload.as_ptr() as usize % 16, 0);
            let len = len_of(expect);
            fill(&pattern, expect, &mut want[..len]);
            assert_eq!(f.payload, &want[..len], "payload of frame {expect}");
            expect += 1;
        }
        r.release_all();
    }
    producer.join().unwrap();
    assert!(eos);
    assert_eq!(expect, FRAMES);
}
