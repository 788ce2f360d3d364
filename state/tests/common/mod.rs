//! Helpers shared by the store's integration tests.

use weir_state::Store;

/// A keyed-state key: key group, state id 1, a 2-byte user key.
pub fn key(kg: u16, user: u16) -> Vec<u8> {
    let mut k = kg.to_be_bytes().to_vec();
    k.extend_from_slice(&1u16.to_be_bytes());
    k.extend_from_slice(&user.to_be_bytes());
    k
}

/// Every visible entry of `store`, in key order.
pub fn all(store: &mut Store) -> Vec<(Vec<u8>, Vec<u8>)> {
    store
        .scan_range(&[], None)
        .map(|e| {
            let (k, f) = e.expect("scan");
            (k.to_vec(), f.value.to_vec())
        })
        .collect()
}
