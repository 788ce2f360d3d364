//! Forged segments: files changed after they were written and then given matching CRCs again
//! (a writer with a bug, an edit by hand), so that every checksum passes and only the
//! structural checks stand between the change and the reader. Restore must refuse such a file
//! with a typed error naming it, or, where the change left a well-formed segment, the store
//! must hold exactly what the file says (checked against a decoder written from
//! `docs/segment-format.md`) through gets, batched gets, scans and a full compaction, without
//! a panic.
//!
//! `WEIR_PROPTEST_CASES` sets the number of forged files (default 64).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use proptest::prelude::*;
use weir_io::StdFs;
use weir_state::{
    segment_layout as L, KeyGroupRange, SnapshotHandle, StateError, Store, StoreConfig,
};

mod common;
use common::{all, key};

const MAX_PARALLELISM: u16 = 8;
/// The restored stores' clock: entries that expire at or before it are invisible.
const NOW_MS: u64 = 1_000_000;

fn config() -> StoreConfig {
    StoreConfig {
        memtable_budget_bytes: 256 << 10,
        block_target_bytes: 256,
        max_parallelism: MAX_PARALLELISM,
        ..StoreConfig::default()
    }
}

fn cases() -> u32 {
    std::env::var("WEIR_PROPTEST_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(64)
}

/// One snapshot of a single segment with several data blocks: values of several lengths (so
/// that entries start at every 16-byte phase), tombstones, and entries with a TTL.
fn one_segment(root: &Path) -> (SnapshotHandle, PathBuf) {
    let mut s = Store::open(Arc::new(StdFs), &root.join("src"), config()).unwrap();
    s.set_now_ms(NOW_MS - 500);
    s.set_ttl(1, Some(1000));
    for u in 0..48u16 {
        let len = usize::from(u % 7) * 5;
        s.put(&key(u % MAX_PARALLELISM, u), &vec![u as u8; len]);
    }
    for u in (0..48u16).step_by(5) {
        s.delete(&key(u % MAX_PARALLELISM, u));
    }
    let h = s.snapshot(1).run().unwrap();
    assert_eq!(h.segments.len(), 1);
    let p = h.segments[0].path.clone();
    (h, p)
}

/// Restore `h` into a new store at `dir`, with every key group.
fn restore(dir: &Path, h: &SnapshotHandle) -> Result<Store, StateError> {
    Store::restore(
        Arc::new(StdFs),
        dir,
        config(),
        std::slice::from_ref(h),
        KeyGroupRange::all(MAX_PARALLELISM),
    )
}

fn rd(b: &[u8], at: usize, n: usize) -> Option<u64> {
    let s = b.get(at..at.checked_add(n)?)?;
    let mut x = [0u8; 8];
    x[..n].copy_from_slice(s);
    Some(u64::from_le_bytes(x))
}

/// An entry as the file states it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    key: Vec<u8>,
    tombstone: bool,
    expire_at_ms: u64,
    value: Vec<u8>,
}

/// Every entry of segment file `b`, in file order, decoded by the format document alone (no
/// check beyond bounds: only files the store accepted are decoded). `None` if a length or
/// offset points outside the file.
fn decode(b: &[u8]) -> Option<Vec<Entry>> {
    let fo = b.len().checked_sub(L::FOOTER_LEN)?;
    let index_off = rd(b, fo + L::F_INDEX_OFFSET, 8)? as usize;
    let blocks = rd(b, fo + L::F_DATA_BLOCKS, 4)? as usize;
    let mut out = Vec::new();
    let mut pos = index_off + weir_io::BLOCK_HEADER_LEN + L::INDEX_HEADER_LEN;
    for _ in 0..blocks {
        let block = rd(b, pos, 8)? as usize;
        let klen = rd(b, pos + 12, 2)? as usize;
        pos += L::INDEX_ENTRY_FIXED_LEN + klen;
        let payload = block + weir_io::BLOCK_HEADER_LEN;
        let count = rd(b, payload, 4)? as usize;
        let table = payload + rd(b, payload + 4, 4)? as usize;
        for i in 0..count {
            let e = payload + rd(b, table + 4 * i, 4)? as usize;
            let klen = rd(b, e + L::E_KEY_LEN, 2)? as usize;
            let flags = *b.get(e + L::E_FLAGS)?;
            let vlen = rd(b, e + L::E_VAL_LEN, 4)? as usize;
            let expire_at_ms = rd(b, e + L::E_EXPIRE_AT_MS, 8)?;
            let k = e + L::ENTRY_HEADER_LEN;
            let v = (k + klen).div_ceil(L::VALUE_ALIGN) * L::VALUE_ALIGN;
            out.push(Entry {
                key: b.get(k..k + klen)?.to_vec(),
                tombstone: flags & L::FLAG_TOMBSTONE != 0,
                expire_at_ms,
                value: b.get(v..v.checked_add(vlen)?)?.to_vec(),
            });
        }
    }
    Some(out)
}

/// Where the blocks of pristine segment `b` start, and the offsets of its structural fields
/// (lengths, counts, offsets, flags, expiry times, key bytes): where a forger's change is
/// most likely to mislead a reader that trusts the file.
fn layout(b: &[u8]) -> (Vec<usize>, Vec<usize>) {
    let fo = b.len() - L::FOOTER_LEN;
    let index_off = rd(b, fo + L::F_INDEX_OFFSET, 8).unwrap() as usize;
    let filter_off = rd(b, fo + L::F_FILTER_OFFSET, 8).unwrap() as usize;
    let blocks = rd(b, fo + L::F_DATA_BLOCKS, 4).unwrap() as usize;
    let bh = weir_io::BLOCK_HEADER_LEN;
    let mut starts = Vec::new();
    let mut fields = vec![L::FH_VERSION, L::FH_SEGMENT_ID];
    for f in [
        L::F_FLAGS,
        L::F_SEGMENT_ID,
        L::F_ENTRY_COUNT,
        L::F_INDEX_OFFSET,
        L::F_INDEX_LEN,
        L::F_DATA_BLOCKS,
        L::F_FILTER_OFFSET,
        L::F_FILTER_LEN,
        L::F_KG_FIRST,
        L::F_KG_FIRST + 1,
        L::F_KG_LAST,
        L::F_KG_LAST + 1,
    ] {
        fields.push(fo + f);
    }
    // Index block: count, then each entry's offset, length, key length and last key.
    let ip = index_off + bh;
    starts.push(index_off);
    fields.extend([index_off + 8, index_off + 12, index_off + 16, ip]);
    let mut pos = ip + L::INDEX_HEADER_LEN;
    for _ in 0..blocks {
        let block = rd(b, pos, 8).unwrap() as usize;
        let klen = rd(b, pos + 12, 2).unwrap() as usize;
        fields.extend([pos, pos + 1, pos + 8, pos + 9, pos + 12]);
        fields.extend(pos + 16..pos + 16 + klen);
        pos += L::INDEX_ENTRY_FIXED_LEN + klen;
        // Data block: framing, count, table offset, table, each entry's header and key.
        starts.push(block);
        fields.extend([block + 8, block + 12, block + 16, block + 17]);
        let payload = block + bh;
        let count = rd(b, payload, 4).unwrap() as usize;
        let table = payload + rd(b, payload + 4, 4).unwrap() as usize;
        fields.extend([payload, payload + 4, payload + 5]);
        for i in 0..count {
            fields.extend([table + 4 * i, table + 4 * i + 1]);
            let e = payload + rd(b, table + 4 * i, 4).unwrap() as usize;
            let klen = rd(b, e, 2).unwrap() as usize;
            fields.extend([
                e + L::E_KEY_LEN,
                e + L::E_KEY_LEN + 1,
                e + L::E_FLAGS,
                e + L::E_VAL_LEN,
                e + L::E_VAL_LEN + 1,
                e + L::E_EXPIRE_AT_MS,
                e + L::E_EXPIRE_AT_MS + 7,
            ]);
            fields.extend(e + L::ENTRY_HEADER_LEN..e + L::ENTRY_HEADER_LEN + klen);
        }
    }
    // Filter block: framing, version, k, block count.
    starts.push(filter_off);
    fields.extend([filter_off + 16, filter_off + bh, filter_off + bh + 1]);
    fields.extend([filter_off + bh + 4, filter_off + bh + 5]);
    starts.sort_unstable();
    (starts, fields)
}

/// Give forged file `b` valid CRCs again: the file header's, each block's (at the pristine
/// file's block `starts`, over the payload length the block now states when that fits in the
/// file) and the footer's.
fn fix_crcs(b: &mut [u8], starts: &[usize]) {
    let crc = crc32fast::hash(&b[..L::FH_CRC]);
    b[L::FH_CRC..L::FH_CRC + 4].copy_from_slice(&crc.to_le_bytes());
    let bh = weir_io::BLOCK_HEADER_LEN;
    for &s in starts {
        let p = rd(b, s + 16, 4).unwrap() as usize;
        let Some(payload) = b.get(s + bh..s + bh + p) else {
            continue;
        };
        let mut h = crc32fast::Hasher::new();
        h.update(&b[s..s + 20]);
        h.update(payload);
        let crc = h.finalize();
        b[s + 20..s + 24].copy_from_slice(&crc.to_le_bytes());
    }
    let fo = b.len() - L::FOOTER_LEN;
    let crc = crc32fast::hash(&b[fo..fo + L::F_CRC]);
    b[fo + L::F_CRC..fo + L::F_CRC + 4].copy_from_slice(&crc.to_le_bytes());
}

/// Write `b` as the segment file `p` and make its handle `h` agree with it (size, CRC, the
/// footer's entry count), so that only the file's own checks can refuse it.
fn install(p: &Path, h: &mut SnapshotHandle, b: &[u8]) {
    std::fs::write(p, b).unwrap();
    let seg = &mut h.segments[0];
    seg.size_bytes = b.len() as u64;
    seg.crc32 = crc32fast::hash(b);
    seg.entry_count = rd(b, b.len() - L::FOOTER_LEN + L::F_ENTRY_COUNT, 8).unwrap();
}

/// [`fix_crcs`], then [`install`]: a forged file in place.
fn forge(p: &Path, h: &mut SnapshotHandle, b: &mut [u8], starts: &[usize]) {
    fix_crcs(b, starts);
    install(p, h, b);
}

/// One change: at a structural field (`pick` chooses one, when `structural`) or anywhere
/// (`anywhere`, a fraction of the file), the byte there is replaced as `how` says.
#[derive(Debug, Clone)]
struct Change {
    structural: bool,
    pick: usize,
    anywhere: f64,
    how: How,
}

#[derive(Debug, Clone)]
enum How {
    Set(u8),
    Plus(u8),
    Minus(u8),
    Flip(u8),
    /// The byte and the three after it all ones: a length, count or offset near 4 G.
    Ones,
}

fn change() -> impl Strategy<Value = Change> {
    let how = prop_oneof![
        any::<u8>().prop_map(How::Set),
        (1u8..=16).prop_map(How::Plus),
        (1u8..=16).prop_map(How::Minus),
        (0u8..8).prop_map(How::Flip),
        Just(How::Ones),
    ];
    (any::<bool>(), any::<usize>(), 0.0..1.0f64, how).prop_map(
        |(structural, pick, anywhere, how)| Change {
            structural,
            pick,
            anywhere,
            how,
        },
    )
}

/// A refusal that says which file: a typed format error naming `file`, or a disagreement of
/// `file` with its handle.
fn named_error(e: &StateError, file: &Path) -> bool {
    match e {
        StateError::Format(f) => f.file() == file,
        StateError::HandleMismatch { file: f, .. } => f == file,
        _ => false,
    }
}

/// Visible entries: key, value.
type Pairs = Vec<(Vec<u8>, Vec<u8>)>;

/// The visible entries of decoded `entries` (key order is the file's): no tombstone, not
/// expired at `NOW_MS`.
fn visible(entries: &[Entry]) -> Pairs {
    entries
        .iter()
        .filter(|e| !e.tombstone && e.expire_at_ms > NOW_MS)
        .map(|e| (e.key.clone(), e.value.clone()))
        .collect()
}

/// Everything `store` shows through a scan, or the scan's error.
fn scanned(store: &mut Store) -> Result<Pairs, StateError> {
    store
        .scan_range(&[], None)
        .map(|e| e.map(|(k, f)| (k.to_vec(), f.value.to_vec())))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn a_forged_segment_is_refused_or_read_as_it_says(
        changes in proptest::collection::vec(change(), 1..4)
    ) {
        let root = tempfile::tempdir().unwrap();
        let (mut h, p) = one_segment(root.path());
        let pristine = std::fs::read(&p).unwrap();
        let (starts, fields) = layout(&pristine);
        let mut b = pristine.clone();
        for c in &changes {
            let at = if c.structural {
                fields[c.pick % fields.len()]
            } else {
                ((c.anywhere * b.len() as f64) as usize).min(b.len() - 1)
            };
            match c.how {
                How::Set(x) => b[at] = x,
                How::Plus(d) => b[at] = b[at].wrapping_add(d),
                How::Minus(d) => b[at] = b[at].wrapping_sub(d),
                How::Flip(bit) => b[at] ^= 1 << bit,
                How::Ones => {
                    let end = (at + 4).min(b.len());
                    b[at..end].fill(0xff);
                }
            }
        }
        forge(&p, &mut h, &mut b, &starts);
        let restored = restore(&root.path().join("restored"), &h);
        let mut store = match restored {
            Err(e) => {
                prop_assert!(named_error(&e, &p), "refused without naming {}: {e}", p.display());
                return Ok(());
            }
            Ok(s) => s,
        };
        store.set_now_ms(NOW_MS);
        // Accepted: the file must be a segment as the format document describes it.
        let entries = decode(&b);
        prop_assert!(entries.is_some(), "accepted a file whose offsets leave it");
        let entries = entries.unwrap();
        let keys: Vec<&[u8]> = entries.iter().map(|e| &e.key[..]).collect();
        prop_assert!(keys.windows(2).all(|w| w[0] < w[1]), "accepted keys out of order");
        let want = visible(&entries);
        prop_assert_eq!(scanned(&mut store).unwrap(), want.clone());
        for e in &entries {
            let got = store.get(&e.key).unwrap().map(|f| f.value.to_vec());
            let shown = !e.tombstone && e.expire_at_ms > NOW_MS;
            prop_assert_eq!(got, shown.then(|| e.value.clone()), "get of {:?}", e.key);
        }
        let mut batch = vec![None; entries.len()];
        store
            .multi_get(&keys, |i, f| batch[i] = f.map(|f| f.value.to_vec()))
            .unwrap();
        let want_batch: Vec<Option<Vec<u8>>> = entries
            .iter()
            .map(|e| (!e.tombstone && e.expire_at_ms > NOW_MS).then(|| e.value.clone()))
            .collect();
        prop_assert_eq!(batch, want_batch);
        store.flush_and_compact_all().unwrap();
        prop_assert_eq!(scanned(&mut store).unwrap(), want);
    }
}

/// The forger above is not a no-op: a change to a structural field, with the CRCs fixed, is
/// caught by the structure checks (not by a CRC), and the unchanged file restores.
#[test]
fn the_forger_reaches_the_structure_checks() {
    let root = tempfile::tempdir().unwrap();
    let (mut h, p) = one_segment(root.path());
    let pristine = std::fs::read(&p).unwrap();
    let (starts, _) = layout(&pristine);
    // The first data block's entry count, one higher: its table then ends inside its padding
    // or past its payload.
    let count_at = starts[0] + weir_io::BLOCK_HEADER_LEN;
    let mut b = pristine.clone();
    b[count_at] += 1;
    forge(&p, &mut h, &mut b, &starts);
    let e = restore(&root.path().join("r1"), &h).expect_err("a forged entry count is refused");
    let f = e.as_format().expect("a format error");
    assert_eq!(f.file(), p.as_path());
    assert!(
        !matches!(f, weir_state::FormatError::ChecksumMismatch { .. }),
        "the CRCs were fixed, so a structure check must catch it: {f}"
    );
    // The fixed CRCs of an unchanged file are its own.
    let mut same = pristine.clone();
    fix_crcs(&mut same, &starts);
    assert_eq!(same, pristine);
    install(&p, &mut h, &pristine);
    let mut s = restore(&root.path().join("r2"), &h).unwrap();
    s.set_now_ms(NOW_MS);
    assert_eq!(all(&mut s), visible(&decode(&pristine).unwrap()));
}

/// A key changed in place, still in order and with every CRC fixed, is refused because the
/// bloom filter does not hold it: accepted, point reads of it would say it is absent while
/// scans return it.
#[test]
fn a_key_its_filter_does_not_hold_is_refused_naming_the_key() {
    let root = tempfile::tempdir().unwrap();
    let (mut h, p) = one_segment(root.path());
    let pristine = std::fs::read(&p).unwrap();
    let (starts, _) = layout(&pristine);
    // The first entry's key is key group 0, user 0; its last byte becomes 1 (user 8 follows).
    let payload = starts[0] + weir_io::BLOCK_HEADER_LEN;
    let first = payload + L::DATA_HEADER_LEN;
    let klen = rd(&pristine, first + L::E_KEY_LEN, 2).unwrap() as usize;
    let last_byte = first + L::ENTRY_HEADER_LEN + klen - 1;
    assert_eq!(
        &pristine[first + L::ENTRY_HEADER_LEN..=last_byte],
        &key(0, 0)[..]
    );
    let mut b = pristine.clone();
    b[last_byte] = 1;
    forge(&p, &mut h, &mut b, &starts);
    let e =
        restore(&root.path().join("r"), &h).expect_err("a key the filter does not hold is refused");
    let f = e.as_format().expect("a format error");
    assert_eq!(f.file(), p.as_path());
    assert_eq!(f.offset(), (first + L::ENTRY_HEADER_LEN) as u64, "{f}");
    assert!(f.to_string().contains("bloom filter"), "{f}");
}

/// A block count from the file (footer and index agreeing, CRCs fixed) does not size an
/// allocation: 4 G blocks is an error naming the footer or the index, not an aborted process
/// (nor, for the largest count, an overflow of the filter block's index).
#[test]
fn a_forged_block_count_is_an_error_not_an_allocation() {
    let root = tempfile::tempdir().unwrap();
    let (mut h, p) = one_segment(root.path());
    let pristine = std::fs::read(&p).unwrap();
    let (starts, _) = layout(&pristine);
    let fo = pristine.len() - L::FOOTER_LEN;
    let index_off = rd(&pristine, fo + L::F_INDEX_OFFSET, 8).unwrap() as usize;
    let filter_off = rd(&pristine, fo + L::F_FILTER_OFFSET, 8).unwrap() as usize;
    for count in [u32::MAX, u32::MAX - 1] {
        let mut b = pristine.clone();
        let count_at = index_off + weir_io::BLOCK_HEADER_LEN;
        for at in [fo + L::F_DATA_BLOCKS, count_at] {
            b[at..at + 4].copy_from_slice(&count.to_le_bytes());
        }
        // The index and filter blocks' framing names their block index: the data block count
        // and one past it.
        b[index_off + 8..index_off + 12].copy_from_slice(&count.to_le_bytes());
        b[filter_off + 8..filter_off + 12].copy_from_slice(&count.wrapping_add(1).to_le_bytes());
        forge(&p, &mut h, &mut b, &starts);
        let e = restore(&root.path().join(format!("r{count}")), &h)
            .expect_err("4 G data blocks in a file of a few KiB");
        let f = e.as_format().expect("a format error");
        assert_eq!(f.file(), p.as_path());
        let at = f.offset() as usize;
        assert!(
            (index_off..filter_off).contains(&at) || at >= fo,
            "{count}: {f}"
        );
    }
}

/// A handle whose key groups differ from its segment's (which it names for a restore to skip
/// segments outside the range) is refused once the segment is opened, naming the file.
#[test]
fn a_handle_whose_key_groups_differ_from_its_segment_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let (h, p) = one_segment(root.path());
    let kg = h.segments[0].key_groups.expect("keys");
    for (n, forged) in [
        KeyGroupRange::new(kg.first + 1, kg.last),
        KeyGroupRange::new(kg.first, kg.last - 1),
    ]
    .into_iter()
    .enumerate()
    {
        let mut h = h.clone();
        h.segments[0].key_groups = Some(forged);
        let e = restore(&root.path().join(format!("r{n}")), &h).expect_err("key groups differ");
        assert!(
            matches!(&e, StateError::HandleMismatch { file, what, .. }
                if file == &p && what.contains("key group")),
            "{e}"
        );
    }
}
