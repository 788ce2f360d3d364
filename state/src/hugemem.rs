//! Zeroed buffers for what lookups probe at random (the memtable's arena chunks and hash index,
//! segment block indexes and bloom filter bits), backed by transparent huge pages when large.
//!
//! Why: the memtable is read and written at random. With 4 KiB pages every probe of a 16 MiB
//! index or a 64 MiB arena is a TLB miss as well as a cache miss, and the first touch of each
//! page is a fault that costs microseconds on a VM (PLATFORM.md). A 2 MiB page is one fault
//! and one TLB entry for 512 small pages. Machines run THP in `madvise` mode by default, so
//! the buffer asks for it; where THP is off the advice fails harmlessly and the buffer is an
//! ordinary anonymous mapping.

use std::marker::PhantomData;

/// Buffers at least this large are advised to use huge pages (for the whole ones they fill).
pub(crate) const HUGE_PAGE_BYTES: usize = 2 << 20;

/// Plain old data: every bit pattern (in particular all zeros) is a valid value, no padding
/// bytes, no drop glue.
///
/// # Safety
/// Implement only for types that satisfy the above.
pub(crate) unsafe trait Pod: Copy + 'static {}

// SAFETY: integers have no padding and every bit pattern is valid.
unsafe impl Pod for u8 {}
// SAFETY: as for u8.
unsafe impl Pod for u32 {}
// SAFETY: as for u8.
unsafe impl Pod for u64 {}
// SAFETY: as for u8.
unsafe impl Pod for u128 {}

/// One cache line: heap buffers are made of these, so every buffer starts on a line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

enum Backing {
    Heap(Vec<Line>),
    Map(memmap2::MmapMut),
}

/// A fixed-length, zero-initialised slice of `T`, 64-byte (cache line) aligned (but see
/// [`ZeroedBuf::scratch`]).
pub(crate) struct ZeroedBuf<T: Pod> {
    backing: Backing,
    len: usize,
    /// Made by `scratch` from a used mapping: bytes past `len` are not known to be zero.
    dirty: bool,
    _t: PhantomData<T>,
}

impl<T: Pod> std::fmt::Debug for ZeroedBuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZeroedBuf")
            .field("len", &self.len)
            .field("huge", &matches!(self.backing, Backing::Map(_)))
            .finish()
    }
}

/// Buffers at least this large are their own anonymous mapping: fresh pages read as zero
/// without being written, so making one costs a system call, not a memset. Through the
/// allocator a 1 MiB index came from reused heap memory that `calloc` had to clear: 150 us,
/// the whole synchronous part of the first snapshot.
const MAP_BYTES: usize = 64 << 10;

fn zeroed_lines(n: usize) -> Vec<Line> {
    vec![Line([0; 64]); n]
}

impl<T: Pod> ZeroedBuf<T> {
    /// `len` zeroed elements. Panics only where `Vec` would (allocation failure aborts).
    pub fn new(len: usize) -> ZeroedBuf<T> {
        assert!(
            std::mem::align_of::<T>() <= 16,
            "ZeroedBuf aligns to 16 bytes"
        );
        let bytes = len * std::mem::size_of::<T>();
        let backing = if bytes >= MAP_BYTES {
            // From 2 MiB, whole huge pages of address space, so that the kernel aligns the
            // mapping to one (it does for anonymous mappings that are a multiple of the huge
            // page size); the tail beyond `bytes` is never touched, so it costs no memory.
            let map_len = if bytes >= HUGE_PAGE_BYTES {
                bytes.div_ceil(HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
            } else {
                bytes
            };
            match memmap2::MmapMut::map_anon(map_len) {
                Ok(m) => {
                    #[cfg(target_os = "linux")]
                    {
                        // Huge pages only where they are filled completely, so the last
                        // partial one does not waste memory. Advice only: without THP the
                        // mapping works with small pages.
                        let full = bytes / HUGE_PAGE_BYTES * HUGE_PAGE_BYTES;
                        if full > 0 {
                            let _ = m.advise_range(memmap2::Advice::HugePage, 0, full);
                        }
                    }
                    Backing::Map(m)
                }
                Err(_) => Backing::Heap(zeroed_lines(bytes.div_ceil(64))),
            }
        } else {
            Backing::Heap(zeroed_lines(bytes.div_ceil(64)))
        };
        ZeroedBuf {
            backing,
            len,
            dirty: false,
            _t: PhantomData,
        }
    }

    /// `len` elements of unspecified value (every bit pattern is a valid `T`), for a buffer
    /// that is written before it is read: the sort's buffers, a segment writer's write
    /// buffers. From 2 MiB it reuses a mapping given back with [`Self::recycle`], if one is
    /// large enough (see [`ScratchPool`]).
    ///
    /// Why: every flush and snapshot made these fresh, and a fresh 2 MiB page costs its fault
    /// and zeroing: 1 ms (PLATFORM.md) to 15 ms (a busy host) per page. A flush of 2 M entries
    /// faulted ~40 MB of them, more than it took to write its 77 MB segment.
    pub fn scratch(len: usize) -> ZeroedBuf<T> {
        ZeroedBuf::scratch_in(&SCRATCH, len)
    }

    /// [`Self::scratch`] from `pool`.
    pub fn scratch_in(pool: &ScratchPool, len: usize) -> ZeroedBuf<T> {
        let bytes = len * std::mem::size_of::<T>();
        if bytes < HUGE_PAGE_BYTES {
            return ZeroedBuf::new(len);
        }
        match pool.take(bytes) {
            Some(m) => ZeroedBuf {
                backing: Backing::Map(m),
                len,
                dirty: true,
                _t: PhantomData,
            },
            None => ZeroedBuf::new(len),
        }
    }

    /// Give this buffer's mapping to the scratch pool (see [`Self::scratch`]) instead of
    /// unmapping it; small heap-backed buffers are freed as usual.
    pub fn recycle(self) {
        self.recycle_into(&SCRATCH);
    }

    /// [`Self::recycle`] into `pool`.
    pub fn recycle_into(self, pool: &ScratchPool) {
        if let Backing::Map(m) = self.backing {
            if m.len() >= HUGE_PAGE_BYTES {
                pool.give(m);
            }
        }
    }

    #[inline]
    fn base(&self) -> *const u8 {
        match &self.backing {
            Backing::Heap(v) => v.as_ptr().cast(),
            Backing::Map(m) => m.as_ptr(),
        }
    }

    #[inline]
    fn base_mut(&mut self) -> *mut u8 {
        match &mut self.backing {
            Backing::Heap(v) => v.as_mut_ptr().cast(),
            Backing::Map(m) => m.as_mut_ptr(),
        }
    }

    /// Fault every page in for writing now, keeping the contents. Returns the bytes covered.
    ///
    /// Why: the first write to a page of a fresh mapping is a fault that allocates and zeroes
    /// it, about a millisecond per 2 MiB page on this VM (PLATFORM.md), and a read first maps
    /// the shared zero page, so the write faults anyway. Done ahead of time, off the path whose
    /// latency matters, the later writes fault no more. Heap-backed buffers were written when
    /// they were made.
    pub fn populate(&mut self) -> usize {
        let bytes = self.len * std::mem::size_of::<T>();
        if let Backing::Map(m) = &mut self.backing {
            #[cfg(target_os = "linux")]
            if m.advise(memmap2::Advice::PopulateWrite).is_ok() {
                return bytes;
            }
            // Kernels before 5.14 lack MADV_POPULATE_WRITE: touch one byte per small page.
            let p = m.as_mut_ptr();
            for off in (0..bytes).step_by(4096) {
                // SAFETY: `off < bytes` lies inside the mapping (see `new`), which this buffer
                // owns exclusively (`&mut self`); the byte is read and written back unchanged,
                // volatile so that the touch is not optimised away.
                unsafe {
                    let b = p.add(off);
                    b.write_volatile(b.read_volatile());
                }
            }
        }
        bytes
    }

    /// Grow to `len` elements (at least the current length) where the buffer is, keeping its
    /// contents; the new elements are zero. Returns false when it cannot (heap-backed, not
    /// Linux, or the kernel refused); the buffer is then unchanged.
    ///
    /// Why: a mapping grows with `mremap`, which moves the page tables instead of copying the
    /// contents into fresh pages (each fault on a fresh page costs microseconds on this VM),
    /// and the pages beyond the old end are zero-fill-on-demand like a new mapping's.
    fn grow_in_place(&mut self, len: usize) -> bool {
        #[cfg(target_os = "linux")]
        if let Backing::Map(m) = &mut self.backing {
            let bytes = len * std::mem::size_of::<T>();
            let old_bytes = self.len * std::mem::size_of::<T>();
            if self.dirty {
                // A used mapping: what becomes visible of its old extent is zeroed here (the
                // pages a remap adds are zero).
                let end = bytes.min(m.len());
                if end > old_bytes {
                    m[old_bytes..end].fill(0);
                }
            }
            if bytes <= m.len() {
                // The mapping's tail past the old length was never written (or was zeroed
                // just now): zeroes.
                self.len = len;
                return true;
            }
            let map_len = bytes.div_ceil(HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES;
            let old_len = m.len();
            if old_len >= HUGE_PAGE_BYTES {
                // Advice on part of a mapping splits it in the kernel, and mremap cannot grow
                // a range of several pieces (EFAULT). The whole old range lies inside the new
                // length, so it will be filled: advise all of it, which joins the pieces.
                let _ = m.advise_range(memmap2::Advice::HugePage, 0, old_len);
            }
            // SAFETY: an anonymous private mapping, so no part of it lies past the end of a
            // file; `&mut self` means no slice into it is alive, so moving it invalidates no
            // reference (every access goes through `base` again).
            let moved = unsafe { m.remap(map_len, memmap2::RemapOptions::new().may_move(true)) };
            if moved.is_err() {
                return false;
            }
            // As in `new`: huge pages where they will be filled, now over the new range too.
            let full = bytes / HUGE_PAGE_BYTES * HUGE_PAGE_BYTES;
            let from = old_len / HUGE_PAGE_BYTES * HUGE_PAGE_BYTES;
            if full > from {
                let _ = m.advise_range(memmap2::Advice::HugePage, from, full - from);
            }
            self.len = len;
            return true;
        }
        let _ = len;
        false
    }

    /// The buffer as `U`s of the same size, each made by `f` from the `T` in its place: no
    /// second buffer (a fresh one costs its page faults again, PLATFORM.md).
    pub fn map_in_place<U: Pod>(mut self, f: impl Fn(T) -> U) -> ZeroedBuf<U> {
        assert_eq!(std::mem::size_of::<T>(), std::mem::size_of::<U>());
        assert!(
            std::mem::align_of::<U>() <= 16,
            "ZeroedBuf aligns to 16 bytes"
        );
        let p = self.base_mut();
        for i in 0..self.len {
            // SAFETY: element `i < len` lies within the backing, which is 64-byte aligned (see
            // `deref`) and so aligned for both types of this one size; the `T` there is
            // initialised and read before its bytes are overwritten with a `U`, and every bit
            // pattern is valid for both (Pod), so the buffer stays initialised as `U`s.
            unsafe {
                let t = p.cast::<T>().add(i).read();
                p.cast::<U>().add(i).write(f(t));
            }
        }
        ZeroedBuf {
            backing: self.backing,
            len: self.len,
            dirty: self.dirty,
            _t: PhantomData,
        }
    }

    /// Zero every element again (for reuse when a cheaper reset is not possible).
    pub fn zero(&mut self) {
        let bytes = self.len * std::mem::size_of::<T>();
        let p = self.base_mut();
        // SAFETY: the backing holds at least `bytes` writable bytes (see `new`), and zero is a
        // valid `T` (Pod).
        unsafe { std::ptr::write_bytes(p, 0, bytes) };
    }
}

impl<T: Pod> std::ops::Deref for ZeroedBuf<T> {
    type Target = [T];
    #[inline]
    fn deref(&self) -> &[T] {
        // SAFETY: the backing is at least `len * size_of::<T>()` bytes, 64-byte aligned (a
        // `Vec<Line>` or a page-aligned mapping) which satisfies `T`'s alignment (checked in
        // `new`), initialised (zeroed when mapped or allocated, then only written through
        // this type or an earlier `ZeroedBuf` of a pooled mapping), and every bit pattern is a
        // valid `T` (Pod). The borrow of `self` bounds the slice's lifetime.
        unsafe { std::slice::from_raw_parts(self.base().cast::<T>(), self.len) }
    }
}

impl<T: Pod> std::ops::DerefMut for ZeroedBuf<T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut [T] {
        let len = self.len;
        // SAFETY: as in `deref`; the unique borrow of `self` makes the slice unique.
        unsafe { std::slice::from_raw_parts_mut(self.base_mut().cast::<T>(), len) }
    }
}

/// Mappings given back for reuse by [`ZeroedBuf::scratch`], at most [`SCRATCH_POOL_MAX`] of
/// them and [`SCRATCH_POOL_BYTES`] in all, shared by the process's threads: a frozen
/// memtable's key order is made by a flush on a maintenance thread but usually dropped on a
/// shard's thread, and the next flush's sort takes it back.
///
/// What it holds is what the stores' jobs need at once: a flush or a snapshot's epoch holds
/// up to four (the sort's two buffers, then the key order and the writer's two), and each
/// store's maintenance thread runs one job at a time, so twelve maps serve three stores'
/// jobs running together. Its bytes are memory that the stores' budgets set aside for their
/// flushes (`memtables_budget`, the sort reserve in `Memtable::prefault`): the store's memory
/// figure stays the same (`weir-bench state`, `state_memory`). With room for four maps, the
/// checkpointed keyed job's two stores missed the pool on 145 of 434 takes and faulted each
/// of those in fresh (a tenth of the maintenance threads' samples).
pub(crate) struct ScratchPool {
    maps: std::sync::Mutex<Vec<memmap2::MmapMut>>,
    max: usize,
    max_bytes: usize,
}

/// See [`ScratchPool`].
const SCRATCH_POOL_MAX: usize = 12;
/// See [`ScratchPool`]: the sort buffers and write buffers of a flush of 2 M entries.
const SCRATCH_POOL_BYTES: usize = 48 << 20;

#[cfg(test)]
thread_local! {
    /// Pooled mappings this thread took that held data (a nonzero byte among their first
    /// 64): tests of writers on used buffers check that they really got one.
    pub(crate) static TAKEN_DIRTY: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

static SCRATCH: ScratchPool = ScratchPool::new(SCRATCH_POOL_MAX, SCRATCH_POOL_BYTES);

/// Memtable arena chunks whose last holder let go, for the next chunk an arena needs (see
/// `memtable::Chunk`). A memtable that is recycled keeps its chunks, but those a sealed epoch
/// still reads are left to the snapshot job, which drops them on its thread when it is done;
/// before this pool they went back to the kernel, and the memtable faulted fresh ones in.
/// In the keyed job checkpointing every 100 ms that was 30% of what checkpoints added to the
/// shards' CPU (`clear_page_erms` under `Arena::new_record`). 64 MiB: two shards' arenas grow
/// by about that much between two checkpoints of that job, and it is a sixth of two default
/// stores' memtable budgets.
pub(crate) static ARENA_CHUNKS: ScratchPool = ScratchPool::new(ARENA_POOL_MAX, ARENA_POOL_BYTES);
const ARENA_POOL_BYTES: usize = 64 << 20;
const ARENA_POOL_MAX: usize = ARENA_POOL_BYTES / HUGE_PAGE_BYTES;

impl ScratchPool {
    pub(crate) const fn new(max: usize, max_bytes: usize) -> ScratchPool {
        ScratchPool {
            maps: std::sync::Mutex::new(Vec::new()),
            max,
            max_bytes,
        }
    }

    fn maps(&self) -> std::sync::MutexGuard<'_, Vec<memmap2::MmapMut>> {
        self.maps.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The smallest pooled mapping of at least `bytes`. When none is large enough the largest
    /// one goes back to the kernel, so that the pool and the fresh buffer together hold no
    /// more than before.
    fn take(&self, bytes: usize) -> Option<memmap2::MmapMut> {
        let mut p = self.maps();
        let best = (0..p.len())
            .filter(|&i| p[i].len() >= bytes)
            .min_by_key(|&i| p[i].len());
        match best {
            Some(i) => {
                let m = p.swap_remove(i);
                #[cfg(test)]
                TAKEN_DIRTY
                    .with(|c| c.set(c.get() + usize::from(m.iter().take(64).any(|&b| b != 0))));
                Some(m)
            }
            None => {
                if let Some(i) = (0..p.len()).max_by_key(|&i| p[i].len()) {
                    drop(p.swap_remove(i));
                }
                None
            }
        }
    }

    fn give(&self, m: memmap2::MmapMut) {
        let mut p = self.maps();
        p.push(m);
        // Over the limits, the smallest go first: the large ones are the expensive ones.
        while p.len() > self.max || p.iter().map(|m| m.len()).sum::<usize>() > self.max_bytes {
            let Some(i) = (0..p.len()).min_by_key(|&i| p[i].len()) else {
                break;
            };
            drop(p.swap_remove(i));
        }
    }

    /// Add up to `n` new mappings of `bytes` each, faulted in, while the pool's bounds leave
    /// room for them; the bytes faulted in.
    pub(crate) fn fill(&self, n: usize, bytes: usize) -> usize {
        let mut faulted = 0;
        for _ in 0..n {
            {
                let p = self.maps();
                let held: usize = p.iter().map(|m| m.len()).sum();
                if p.len() >= self.max || held + bytes > self.max_bytes {
                    break;
                }
            }
            let mut b = ZeroedBuf::<u8>::new(bytes);
            faulted += b.populate();
            b.recycle_into(self);
        }
        faulted
    }

    #[cfg(test)]
    pub(crate) fn bytes(&self) -> usize {
        self.maps().iter().map(|m| m.len()).sum()
    }
}

/// A growable vector of `T` on [`ZeroedBuf`]s: from 64 KiB its buffer is an anonymous mapping
/// of its own, given back to the kernel when the vector grows or drops.
///
/// Why not `Vec`: glibc serves later allocations below the size of the largest mapped buffer
/// freed so far (up to 32 MiB) from its arenas, and keeps what they free. The segment writers'
/// and memtables' growing vectors (block index bytes, block offsets, entry tables: megabytes
/// each, freed after every flush or compaction) left 36-70 MB resident but unused in a store
/// with a 64 MiB memtable budget (`weir-bench state`, `state_memory`; `malloc_stats`).
pub(crate) struct MapVec<T: Pod> {
    buf: ZeroedBuf<T>,
    len: usize,
}

impl<T: Pod> std::fmt::Debug for MapVec<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MapVec")
            .field("len", &self.len)
            .field("capacity", &self.buf.len())
            .finish()
    }
}

impl<T: Pod> Default for MapVec<T> {
    fn default() -> Self {
        MapVec::new()
    }
}

impl<T: Pod> MapVec<T> {
    pub fn new() -> MapVec<T> {
        MapVec::with_capacity(0)
    }

    pub fn with_capacity(n: usize) -> MapVec<T> {
        MapVec {
            buf: ZeroedBuf::new(n),
            len: 0,
        }
    }

    /// An empty vector whose capacity comes from [`ZeroedBuf::scratch`] (a vector reads only
    /// what it wrote, so stale bytes past its length are never seen).
    pub fn scratch_with_capacity(n: usize) -> MapVec<T> {
        MapVec {
            buf: ZeroedBuf::scratch(n),
            len: 0,
        }
    }

    /// Give the buffer back for reuse (see [`ZeroedBuf::recycle`]).
    pub fn recycle(self) {
        self.buf.recycle();
    }

    pub fn capacity(&self) -> usize {
        self.buf.len()
    }

    /// Room for `additional` more elements (at least doubling, as `Vec` grows).
    pub fn reserve(&mut self, additional: usize) {
        let need = self.len + additional;
        if need > self.buf.len() {
            self.grow(need);
        }
    }

    #[cold]
    fn grow(&mut self, need: usize) {
        let cap = need.max(self.buf.len() * 2).max(16);
        if self.buf.grow_in_place(cap) {
            return;
        }
        let mut buf = ZeroedBuf::new(cap);
        buf[..self.len].copy_from_slice(&self.buf[..self.len]);
        self.buf = buf;
    }

    #[inline]
    pub fn push(&mut self, x: T) {
        if self.len == self.buf.len() {
            self.grow(self.len + 1);
        }
        self.buf[self.len] = x;
        self.len += 1;
    }

    #[inline]
    pub fn extend_from_slice(&mut self, xs: &[T]) {
        self.reserve(xs.len());
        self.buf[self.len..self.len + xs.len()].copy_from_slice(xs);
        self.len += xs.len();
    }

    /// The next `n` elements, appended: whatever the buffer held there (stale elements of an
    /// earlier use, or zeros) until the caller writes them.
    #[inline]
    pub fn append(&mut self, n: usize) -> &mut [T] {
        self.reserve(n);
        let at = self.len;
        self.len += n;
        &mut self.buf[at..at + n]
    }

    /// Set the length to `n`, filling new elements with `value`.
    pub fn resize(&mut self, n: usize, value: T) {
        if n > self.len {
            self.reserve(n - self.len);
            self.buf[self.len..n].fill(value);
        }
        self.len = n;
    }

    /// Fault in the whole capacity now, keeping the contents (see
    /// [`ZeroedBuf::populate`]); the bytes covered.
    pub fn populate(&mut self) -> usize {
        self.buf.populate()
    }

    pub fn truncate(&mut self, n: usize) {
        self.len = self.len.min(n);
    }

    pub fn clear(&mut self) {
        self.len = 0;
    }
}

impl<T: Pod> std::ops::Deref for MapVec<T> {
    type Target = [T];
    #[inline]
    fn deref(&self) -> &[T] {
        &self.buf[..self.len]
    }
}

impl<T: Pod> std::ops::DerefMut for MapVec<T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.buf[..self.len]
    }
}

/// Hint the CPU to bring the cache line at `p` into L1 (a no-op where there is no such
/// instruction). Never faults, whatever the address.
#[inline(always)]
pub(crate) fn prefetch_read<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    prefetch_hint::<{ std::arch::x86_64::_MM_HINT_T0 }, T>(p);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Hint the CPU to bring the cache line at `p` into L2, not L1 (a no-op where there is no
/// such instruction). Never faults, whatever the address. For many lines requested at once
/// of which only some are read (a data block a binary search will visit): see
/// `Segment::prefetch_block`.
#[inline(always)]
pub(crate) fn prefetch_read_l2<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    prefetch_hint::<{ std::arch::x86_64::_MM_HINT_T1 }, T>(p);
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_hint<const HINT: i32, T>(p: *const T) {
    // SAFETY: prefetch is a hint; it does not dereference the pointer architecturally and never
    // faults, even for an invalid address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<HINT>(p.cast::<i8>());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `fill` adds faulted-in mappings up to the pool's count and byte bounds, and they are
    /// what the next buffers of that size get.
    #[test]
    fn filling_the_pool_stops_at_its_bounds() {
        let pool = ScratchPool::new(3, 8 * HUGE_PAGE_BYTES);
        assert_eq!(pool.fill(5, HUGE_PAGE_BYTES), 3 * HUGE_PAGE_BYTES);
        assert_eq!(pool.bytes(), 3 * HUGE_PAGE_BYTES);
        assert_eq!(pool.fill(1, HUGE_PAGE_BYTES), 0, "full by count");
        let bytes_bound = ScratchPool::new(8, 2 * HUGE_PAGE_BYTES);
        assert_eq!(bytes_bound.fill(5, HUGE_PAGE_BYTES), 2 * HUGE_PAGE_BYTES);
        let b = ZeroedBuf::<u128>::scratch_in(&pool, HUGE_PAGE_BYTES / 16);
        assert_eq!(pool.bytes(), 2 * HUGE_PAGE_BYTES, "taken from the pool");
        b.recycle_into(&pool);
        assert_eq!(pool.bytes(), 3 * HUGE_PAGE_BYTES);
    }

    #[test]
    fn the_scratch_pool_hands_out_the_smallest_fit_within_its_limits() {
        // A pool of its own: tests on other threads use the process's.
        let pool = ScratchPool::new(4, 20 * HUGE_PAGE_BYTES);
        let map = |pages: usize| memmap2::MmapMut::map_anon(pages * HUGE_PAGE_BYTES).unwrap();
        for pages in [6usize, 1, 5, 2, 4, 3] {
            pool.give(map(pages));
        }
        // Four at most and 20 pages in all, the smallest dropped first: 6, 5, 4, 3 are 18.
        assert_eq!(pool.bytes(), 18 * HUGE_PAGE_BYTES);
        let m = pool.take(3 * HUGE_PAGE_BYTES + 1).expect("a fit");
        assert_eq!(m.len(), 4 * HUGE_PAGE_BYTES, "the smallest that fits");
        assert_eq!(pool.bytes(), 14 * HUGE_PAGE_BYTES);
        // Nothing fits: the largest goes back to the kernel, so the pool and the fresh
        // mapping the caller makes hold no more than before.
        assert!(pool.take(7 * HUGE_PAGE_BYTES).is_none());
        assert_eq!(pool.bytes(), 8 * HUGE_PAGE_BYTES);
    }

    #[test]
    fn a_scratch_buffer_is_any_bytes_but_grows_with_zeroes() {
        // A used mapping as `scratch` hands it out: stale bytes throughout.
        let n = HUGE_PAGE_BYTES / 8 * 3;
        let mut m = memmap2::MmapMut::map_anon(2 * HUGE_PAGE_BYTES).unwrap();
        m.fill(0xAB);
        let b = ZeroedBuf::<u64> {
            backing: Backing::Map(m),
            len: n / 2,
            dirty: true,
            _t: PhantomData,
        };
        assert_eq!(b[0], 0xABAB_ABAB_ABAB_ABAB);
        let mut v = MapVec::<u64> { buf: b, len: n / 2 };
        // Within the mapping, then past it (a remap): either way the new part reads zero.
        for extra in [1000, n] {
            let len = v.len;
            v.reserve(extra);
            let cap = v.capacity();
            assert!(v.buf[len..cap].iter().all(|&x| x == 0), "grown to {cap}");
            v.resize(len + extra, 1);
        }
        assert!(
            v[..n / 2].iter().all(|&x| x == 0xABAB_ABAB_ABAB_ABAB),
            "kept"
        );
        v.recycle();
        // Small buffers never come from the pool: zeroed as always.
        let small = ZeroedBuf::<u8>::scratch(1000);
        assert!(small.iter().all(|&x| x == 0));
    }

    #[test]
    fn map_in_place_converts_every_element_of_either_backing() {
        for len in [3usize, MAP_BYTES / 8 + 5] {
            let mut b = ZeroedBuf::<u64>::new(len);
            for (i, x) in b.iter_mut().enumerate() {
                *x = (i as u64) << 32 | 7;
            }
            let m = b.map_in_place(|x| x.rotate_left(32) as u32 as u64 * 3);
            assert_eq!(m.len(), len);
            assert!(m.iter().enumerate().all(|(i, &x)| x == i as u64 * 3));
        }
    }

    #[test]
    fn small_and_huge_buffers_are_zeroed_aligned_and_writable() {
        for len in [2usize, 100, MAP_BYTES / 16 + 1, (HUGE_PAGE_BYTES / 16) + 3] {
            let mut b = ZeroedBuf::<u128>::new(len);
            assert_eq!(b.len(), len);
            assert!(b.iter().all(|&x| x == 0));
            assert_eq!(b.as_ptr() as usize % 64, 0);
            b[len - 1] = 7;
            b[0] = 9;
            assert_eq!((b[0], b[len - 1]), (9, 7));
            b.zero();
            assert!(b.iter().all(|&x| x == 0));
            b[len / 2] = 5;
            assert_eq!(b.populate(), len * 16);
            assert_eq!(b[len / 2], 5, "populating keeps the contents");
            assert_eq!(b.iter().filter(|&&x| x != 0).count(), 1);
        }
    }

    /// A mapped buffer grows where it is (`mremap`): contents kept, new elements zero, and
    /// still aligned and writable; a heap buffer does not (its vector copies instead).
    #[test]
    fn mapped_buffers_grow_in_place_keeping_contents() {
        let small = MAP_BYTES / 16 + 1;
        let mut b = ZeroedBuf::<u128>::new(small);
        for (i, x) in b.iter_mut().enumerate() {
            *x = i as u128 + 1;
        }
        for len in [
            small + 1,
            HUGE_PAGE_BYTES / 16 + 3,
            3 * HUGE_PAGE_BYTES / 16 + 1,
        ] {
            assert!(b.grow_in_place(len), "grows to {len}");
            assert_eq!(b.len(), len);
            assert_eq!(b.as_ptr() as usize % 64, 0);
            assert!(b[..small]
                .iter()
                .enumerate()
                .all(|(i, &x)| x == i as u128 + 1));
            assert!(b[small..].iter().all(|&x| x == 0), "new elements are zero");
        }
        // A mapping advised in part (huge pages only where it is full) is two pieces in the
        // kernel; it grows all the same, and again.
        let part = HUGE_PAGE_BYTES / 16 + 3;
        let mut p = ZeroedBuf::<u128>::new(part);
        p[part - 1] = 9;
        for len in [5 * HUGE_PAGE_BYTES / 16 + 1, 9 * HUGE_PAGE_BYTES / 16 + 1] {
            assert!(p.grow_in_place(len), "a split mapping grows to {len}");
            assert_eq!((p[part - 1], p[len - 1]), (9, 0));
        }
        let mut h = ZeroedBuf::<u128>::new(4);
        assert!(!h.grow_in_place(small));
        assert_eq!(h.len(), 4);
        let mut v = MapVec::<u128>::new();
        for i in 0..3 * HUGE_PAGE_BYTES as u128 / 16 {
            v.push(i);
        }
        assert!(v.iter().enumerate().all(|(i, &x)| x == i as u128));
    }

    proptest::proptest! {
        #[test]
        fn map_vec_behaves_as_vec(
            ops in proptest::collection::vec((0u8..5, 0u64..1 << 40, 0usize..20_000), 0..60),
        ) {
            let (mut m, mut v) = (MapVec::<u64>::new(), Vec::<u64>::new());
            for (op, x, n) in ops {
                match op {
                    0 => { m.push(x); v.push(x); }
                    1 => {
                        let xs: Vec<u64> = (0..n as u64).map(|i| i ^ x).collect();
                        m.extend_from_slice(&xs);
                        v.extend_from_slice(&xs);
                    }
                    2 => { m.resize(n, x); v.resize(n, x); }
                    3 => { m.truncate(n); v.truncate(n); }
                    _ => {
                        if let Some(e) = m.first_mut() { *e = x; }
                        if let Some(e) = v.first_mut() { *e = x; }
                    }
                }
                proptest::prop_assert_eq!(&m[..], &v[..]);
                proptest::prop_assert!(m.capacity() >= m.len());
            }
            m.clear();
            proptest::prop_assert!(m.is_empty());
        }
    }
}
