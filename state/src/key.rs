//! Key groups and the key layout.
//!
//! A stored key is `key group (u16 BE) | state id (u16 BE) | namespace length (u16 BE) |
//! namespace | user key length (u16 BE) | user key | [map key]`. The key group comes first so a
//! key-group range is one contiguous scan; lengths make every part prefix-free, so "all entries
//! of one state for one key and namespace" is also one prefix scan.

use xxhash_rust::xxh3::xxh3_64;

/// Default maximum parallelism (number of key groups), as in Flink.
pub const DEFAULT_MAX_PARALLELISM: u16 = 128;

/// A key group: the unit of state redistribution.
pub type KeyGroup = u16;

/// The key group of an encoded key: `xxh3_64(key) % max_parallelism`. Stable across versions:
/// changing it would scatter restored state.
#[inline]
pub fn key_group_for(key_bytes: &[u8], max_parallelism: u16) -> KeyGroup {
    assert!(max_parallelism > 0, "max parallelism must be positive");
    let h = xxh3_64(key_bytes);
    let mp = u64::from(max_parallelism);
    // The same value as `h % mp`: a mask where that is exact (the default, 128, and every
    // power of two). A 64-bit division costs tens of cycles and ran three times per record
    // on the keyed path (routing, lookahead, processing).
    if mp.is_power_of_two() {
        (h & (mp - 1)) as u16
    } else {
        (h % mp) as u16
    }
}

/// `a == b` for the short keys of the keyed path, without a call to `memcmp`. Store keys of
/// a keyed operator's value state are 8 to 32 bytes: compared here as overlapping 8-byte
/// words, the comparison stays inline (the call took 2% of the keyed count's shard time).
/// Also never hands `memcmp` an empty slice, whose dangling pointer made glibc's AVX-512
/// version take a microcode assist of hundreds of cycles for length 0 (the keyed path
/// compares the usually empty namespace on every access).
#[inline]
pub(crate) fn bytes_eq(a: &[u8], b: &[u8]) -> bool {
    let n = a.len();
    if n != b.len() {
        return false;
    }
    let word = |s: &[u8], at: usize| u64::from_ne_bytes(s[at..at + 8].try_into().expect("8 bytes"));
    match n {
        0..8 => a.iter().zip(b).all(|(x, y)| x == y),
        8..=16 => word(a, 0) == word(b, 0) && word(a, n - 8) == word(b, n - 8),
        // Bytes 0..16 and n-16..n: every byte, as n - 16 <= 16.
        17..=32 => {
            word(a, 0) == word(b, 0)
                && word(a, 8) == word(b, 8)
                && word(a, n - 16) == word(b, n - 16)
                && word(a, n - 8) == word(b, n - 8)
        }
        _ => a == b,
    }
}

/// An inclusive range of key groups `first..=last`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KeyGroupRange {
    pub first: KeyGroup,
    pub last: KeyGroup,
}

impl KeyGroupRange {
    pub fn new(first: KeyGroup, last: KeyGroup) -> Self {
        assert!(first <= last, "empty key group range {first}..={last}");
        KeyGroupRange { first, last }
    }

    /// All key groups of `max_parallelism`.
    pub fn all(max_parallelism: u16) -> Self {
        KeyGroupRange::new(0, max_parallelism - 1)
    }

    /// The contiguous range of shard `shard` of `shards` (Flink's
    /// `computeKeyGroupRangeForOperatorIndex`). Panics if the shard would own no key group.
    pub fn for_shard(shard: u16, shards: u16, max_parallelism: u16) -> Self {
        assert!(shards > 0 && shard < shards && shards <= max_parallelism);
        let (s, n, m) = (
            u32::from(shard),
            u32::from(shards),
            u32::from(max_parallelism),
        );
        let first = (s * m).div_ceil(n);
        let last = ((s + 1) * m - 1) / n;
        KeyGroupRange::new(first as u16, last as u16)
    }

    /// The shard of `shards` that owns key group `kg` (inverse of [`Self::for_shard`]).
    pub fn shard_for(kg: KeyGroup, shards: u16, max_parallelism: u16) -> u16 {
        (u32::from(kg) * u32::from(shards) / u32::from(max_parallelism)) as u16
    }

    pub fn contains(&self, kg: KeyGroup) -> bool {
        self.first <= kg && kg <= self.last
    }

    pub fn intersects(&self, other: &KeyGroupRange) -> bool {
        self.first <= other.last && other.first <= self.last
    }

    pub fn len(&self) -> usize {
        usize::from(self.last - self.first) + 1
    }

    pub fn is_empty(&self) -> bool {
        false
    }
}

/// The key group stored in the first two bytes of a store key.
pub(crate) fn key_group_of(key: &[u8]) -> KeyGroup {
    u16::from_be_bytes([key[0], key[1]])
}

/// Stable, order-preserving, prefix-free byte encoding of keys (byte order of encodings equals
/// the natural order of values). Integers are big-endian (signed with the sign bit flipped);
/// byte strings escape `0x00` as `00 FF` and end with `00 00`; tuples concatenate.
pub trait KeyCodec {
    /// The owned type decoding yields (`String` for `&str`).
    type Owned;
    fn encode_key(&self, out: &mut Vec<u8>);
    /// Decode from the front of `input`, advancing it. `None` if malformed.
    fn decode_key(input: &mut &[u8]) -> Option<Self::Owned>;
    /// How many bytes [`Self::encode_key`] appends: what [`MAX_KEY_BYTES`] bounds.
    fn encoded_len(&self) -> usize {
        let mut v = Vec::new();
        self.encode_key(&mut v);
        v.len()
    }
}

/// The longest encoded key, namespace or map key that keyed state takes. A store key holds
/// the three with 10 bytes of fields, and its length is a u16 (segment entries, memtable
/// records); 16 KiB each leaves room for all three at once. A longer one is an error
/// (`StateError::KeyTooLong`, or the keyed operator's failure), never a cut key.
pub const MAX_KEY_BYTES: usize = 16 * 1024;

/// [`KeyCodec::encoded_len`] of bytes: each zero byte is escaped, and two bytes end them.
fn encoded_bytes_len(b: &[u8]) -> usize {
    b.len() + b.iter().filter(|&&x| x == 0).count() + 2
}

fn take<'a>(input: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
    if input.len() < n {
        return None;
    }
    let (a, b) = input.split_at(n);
    *input = b;
    Some(a)
}

macro_rules! unsigned_codec {
    ($($t:ty),*) => {$(
        impl KeyCodec for $t {
            type Owned = $t;
            fn encode_key(&self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_be_bytes());
            }
            fn decode_key(input: &mut &[u8]) -> Option<$t> {
                let b = take(input, std::mem::size_of::<$t>())?;
                Some(<$t>::from_be_bytes(b.try_into().ok()?))
            }
        }
    )*};
}
unsigned_codec!(u8, u16, u32, u64, u128);

macro_rules! signed_codec {
    ($($t:ty => $u:ty),*) => {$(
        impl KeyCodec for $t {
            type Owned = $t;
            fn encode_key(&self, out: &mut Vec<u8>) {
                let flipped = (*self as $u) ^ (1 << (<$u>::BITS - 1));
                out.extend_from_slice(&flipped.to_be_bytes());
            }
            fn decode_key(input: &mut &[u8]) -> Option<$t> {
                let b = take(input, std::mem::size_of::<$t>())?;
                let u = <$u>::from_be_bytes(b.try_into().ok()?);
                Some((u ^ (1 << (<$u>::BITS - 1))) as $t)
            }
        }
    )*};
}
signed_codec!(i8 => u8, i16 => u16, i32 => u32, i64 => u64, i128 => u128);

impl KeyCodec for bool {
    type Owned = bool;
    fn encode_key(&self, out: &mut Vec<u8>) {
        out.push(u8::from(*self));
    }
    fn decode_key(input: &mut &[u8]) -> Option<bool> {
        match take(input, 1)?[0] {
            0 => Some(false),
            1 => Some(true),
            _ => None,
        }
    }
}

fn encode_bytes(b: &[u8], out: &mut Vec<u8>) {
    for &x in b {
        out.push(x);
        if x == 0 {
            out.push(0xFF);
        }
    }
    out.extend_from_slice(&[0, 0]);
}

fn decode_bytes(input: &mut &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    let mut i = 0;
    loop {
        let x = *input.get(i)?;
        if x == 0 {
            match *input.get(i + 1)? {
                0 => {
                    *input = &input[i + 2..];
                    return Some(out);
                }
                0xFF => {
                    out.push(0);
                    i += 2;
                }
                _ => return None,
            }
        } else {
            out.push(x);
            i += 1;
        }
    }
}

impl KeyCodec for [u8] {
    type Owned = Vec<u8>;
    fn encode_key(&self, out: &mut Vec<u8>) {
        encode_bytes(self, out);
    }
    fn encoded_len(&self) -> usize {
        encoded_bytes_len(self)
    }
    fn decode_key(input: &mut &[u8]) -> Option<Vec<u8>> {
        decode_bytes(input)
    }
}

impl KeyCodec for Vec<u8> {
    type Owned = Vec<u8>;
    fn encode_key(&self, out: &mut Vec<u8>) {
        encode_bytes(self, out);
    }
    fn encoded_len(&self) -> usize {
        encoded_bytes_len(self)
    }
    fn decode_key(input: &mut &[u8]) -> Option<Vec<u8>> {
        decode_bytes(input)
    }
}

impl KeyCodec for str {
    type Owned = String;
    fn encode_key(&self, out: &mut Vec<u8>) {
        encode_bytes(self.as_bytes(), out);
    }
    fn encoded_len(&self) -> usize {
        encoded_bytes_len(self.as_bytes())
    }
    fn decode_key(input: &mut &[u8]) -> Option<String> {
        String::from_utf8(decode_bytes(input)?).ok()
    }
}

impl KeyCodec for String {
    type Owned = String;
    fn encode_key(&self, out: &mut Vec<u8>) {
        encode_bytes(self.as_bytes(), out);
    }
    fn encoded_len(&self) -> usize {
        encoded_bytes_len(self.as_bytes())
    }
    fn decode_key(input: &mut &[u8]) -> Option<String> {
        str::decode_key(input)
    }
}

impl<T: KeyCodec + ?Sized> KeyCodec for &T {
    type Owned = T::Owned;
    fn encode_key(&self, out: &mut Vec<u8>) {
        (**self).encode_key(out);
    }
    fn encoded_len(&self) -> usize {
        (**self).encoded_len()
    }
    fn decode_key(input: &mut &[u8]) -> Option<T::Owned> {
        T::decode_key(input)
    }
}

macro_rules! tuple_codec {
    ($($n:ident),*) => {
        impl<$($n: KeyCodec),*> KeyCodec for ($($n,)*) {
            type Owned = ($($n::Owned,)*);
            #[allow(non_snake_case)]
            fn encode_key(&self, out: &mut Vec<u8>) {
                let ($($n,)*) = self;
                $($n.encode_key(out);)*
            }
            fn decode_key(input: &mut &[u8]) -> Option<Self::Owned> {
                Some(($($n::decode_key(input)?,)*))
            }
        }
    };
}
tuple_codec!(A);
tuple_codec!(A, B);
tuple_codec!(A, B, C);
tuple_codec!(A, B, C, D);

/// Append the store-key prefix of one state for one key and namespace.
#[inline]
pub(crate) fn encode_state_key(
    out: &mut Vec<u8>,
    kg: KeyGroup,
    state_id: u16,
    ns: &[u8],
    key: &[u8],
) {
    assert!(ns.len() <= usize::from(u16::MAX) && key.len() <= usize::from(u16::MAX));
    if ns.is_empty() {
        // The keyed operators' case. The four 2-byte fields go as one 8-byte store, and an
        // 8-byte user key as another: xxh3 reads the key back at once as 8-byte words, and
        // words over several smaller stores missed store forwarding (half the samples of
        // the keyed count's key hashing).
        let head = (u64::from(kg) << 48) | (u64::from(state_id) << 32) | key.len() as u64;
        out.extend_from_slice(&head.to_be_bytes());
        match <&[u8; 8]>::try_from(key) {
            Ok(word) => out.extend_from_slice(word),
            Err(_) => out.extend_from_slice(key),
        }
        return;
    }
    out.extend_from_slice(&kg.to_be_bytes());
    out.extend_from_slice(&state_id.to_be_bytes());
    out.extend_from_slice(&(ns.len() as u16).to_be_bytes());
    out.extend_from_slice(ns);
    out.extend_from_slice(&(key.len() as u16).to_be_bytes());
    out.extend_from_slice(key);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn bytes_eq_is_slice_equality_at_every_length_and_position() {
        let empty: &[u8] = &[];
        assert!(bytes_eq(empty, &Vec::new()));
        assert!(!bytes_eq(empty, b"a"));
        assert!(!bytes_eq(b"a", empty));
        for n in 0..=40usize {
            let a: Vec<u8> = (0..n as u8).map(|i| i.wrapping_mul(37) ^ 0x5a).collect();
            assert!(bytes_eq(&a, &a.clone()), "length {n}");
            // A difference in any one byte, whichever word it falls in, is seen.
            for i in 0..n {
                let mut b = a.clone();
                b[i] ^= 0x80;
                assert!(!bytes_eq(&a, &b), "length {n}, byte {i}");
            }
            let mut longer = a.clone();
            longer.push(0);
            assert!(!bytes_eq(&a, &longer), "length {n}");
        }
    }

    proptest! {
        #[test]
        fn state_keys_are_their_fields_in_order(
            kg: u16,
            id: u16,
            ns in proptest::collection::vec(any::<u8>(), 0..3),
            key in proptest::collection::vec(any::<u8>(), 0..12),
        ) {
            let mut want = Vec::new();
            for field in [kg, id, ns.len() as u16] {
                want.extend_from_slice(&field.to_be_bytes());
            }
            want.extend_from_slice(&ns);
            want.extend_from_slice(&(key.len() as u16).to_be_bytes());
            want.extend_from_slice(&key);
            let mut got = vec![0xee];
            encode_state_key(&mut got, kg, id, &ns, &key);
            prop_assert_eq!(&got[0], &0xee);
            prop_assert_eq!(&got[1..], &want[..]);
        }

        #[test]
        fn bytes_eq_agrees_with_slice_eq(
            a in proptest::collection::vec(0u8..4, 0..40),
            b in proptest::collection::vec(0u8..4, 0..40),
        ) {
            prop_assert_eq!(bytes_eq(&a, &b), a == b);
        }
    }

    fn enc<T: KeyCodec + ?Sized>(v: &T) -> Vec<u8> {
        let mut o = Vec::new();
        v.encode_key(&mut o);
        o
    }

    #[test]
    fn shard_ranges_partition_key_groups() {
        for shards in 1..=20u16 {
            let mut next = 0u16;
            for s in 0..shards {
                let r = KeyGroupRange::for_shard(s, shards, 128);
                assert_eq!(r.first, next);
                for kg in r.first..=r.last {
                    assert_eq!(KeyGroupRange::shard_for(kg, shards, 128), s);
                }
                next = r.last + 1;
            }
            assert_eq!(next, 128);
        }
    }

    #[test]
    fn key_group_is_stable() {
        // Pinned: a change would scatter restored state across the wrong shards.
        assert_eq!(
            key_group_for(&enc(&42u64), 128),
            (xxh3_64(&42u64.to_be_bytes()) % 128) as u16
        );
        assert_eq!(xxh3_64(b""), 0x2d06_8005_38d3_94c2);
    }

    proptest! {
        /// The mask used for powers of two is the modulo the format pins, for every max
        /// parallelism (powers of two or not) and key.
        #[test]
        fn key_group_is_the_hash_modulo_max_parallelism(key: Vec<u8>, mp in 1u16..=u16::MAX, shift in 0u32..16) {
            prop_assert_eq!(key_group_for(&key, mp), (xxh3_64(&key) % u64::from(mp)) as u16);
            let pow2 = 1u16 << shift;
            prop_assert_eq!(key_group_for(&key, pow2), (xxh3_64(&key) % u64::from(pow2)) as u16);
        }

        #[test]
        fn integer_order_preserved(a: i64, b: i64, c: u32, d: u32) {
            prop_assert_eq!(a.cmp(&b), enc(&a).cmp(&enc(&b)));
            prop_assert_eq!(c.cmp(&d), enc(&c).cmp(&enc(&d)));
            prop_assert_eq!(i64::decode_key(&mut enc(&a).as_slice()), Some(a));
        }

        #[test]
        fn string_and_tuple_order_preserved(a: Vec<u8>, b: Vec<u8>, x: String, n: i16, m: i16) {
            prop_assert_eq!(a.cmp(&b), enc(&a).cmp(&enc(&b)));
            let ta = (a.clone(), n, true, x.as_str());
            let tb = (b.clone(), m, true, x.as_str());
            prop_assert_eq!(ta.cmp(&tb), enc(&ta).cmp(&enc(&tb)));
            let e = enc(&ta);
            let mut s = e.as_slice();
            let back = <(Vec<u8>, i16, bool, &str)>::decode_key(&mut s).unwrap();
            prop_assert!(s.is_empty());
            prop_assert_eq!(back, (a, n, true, x.clone()));
        }

        /// Any bytes decode to a key or to `None` (never a panic), and a key decoded from
        /// bytes encodes back to exactly the bytes it took: one key, one encoding, so equal
        /// keys are equal bytes in the store and a scan meets each once. The bytes are an
        /// encoded key with up to three bytes replaced (by 0, 1, 0xFF mostly).
        #[test]
        fn decoding_any_bytes_is_canonical(
            a: Vec<u8>,
            n: i16,
            t: bool,
            x: String,
            changes in proptest::collection::vec(
                (any::<proptest::sample::Index>(),
                 prop_oneof![Just(0u8), Just(1u8), Just(0xFFu8), any::<u8>()]),
                0..4,
            ),
        ) {
            let mut b = enc(&(a, n, t, x.as_str()));
            for (at, v) in changes {
                let i = at.index(b.len());
                b[i] = v;
            }
            let mut rest = b.as_slice();
            if let Some(k) = <(Vec<u8>, i16, bool, String)>::decode_key(&mut rest) {
                let used = b.len() - rest.len();
                prop_assert_eq!(enc(&(k.0, k.1, k.2, k.3.as_str())), b[..used].to_vec());
            }
        }
    }
}
