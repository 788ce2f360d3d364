//! The one place where the ring picks its atomics: `std` normally, `loom` under `--cfg loom`.
//!
//! Under loom the ring's byte buffer is still reached through a raw pointer, but every
//! 16-byte slot also has a `loom::cell::UnsafeCell<()>` whose access guards the regions hold
//! (see [`SlotCells`]), so loom checks that no producer write and consumer read of one slot
//! are unordered.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::Arc;
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::Arc;

/// Busy-wait hint; under loom it yields so the model checker can switch threads.
#[inline]
pub(crate) fn spin_hint() {
    #[cfg(loom)]
    loom::thread::yield_now();
    #[cfg(not(loom))]
    std::hint::spin_loop();
}

/// Per-slot access trackers for loom (one per 16-byte slot of the buffer).
#[cfg(loom)]
pub(crate) struct SlotCells {
    cells: Box<[loom::cell::UnsafeCell<()>]>,
}

#[cfg(loom)]
impl SlotCells {
    pub(crate) fn new(slots: usize) -> Self {
        Self {
            cells: (0..slots)
                .map(|_| loom::cell::UnsafeCell::new(()))
                .collect(),
        }
    }

    /// Guards marking bytes `[start, start + len)` of the buffer as being written.
    pub(crate) fn write(&self, start: usize, len: usize) -> Vec<loom::cell::MutPtr<()>> {
        let first = start / crate::frame::FRAME_ALIGN;
        let end = (start + len).div_ceil(crate::frame::FRAME_ALIGN);
        self.cells[first..end].iter().map(|c| c.get_mut()).collect()
    }

    /// Guards marking bytes `[start, start + len)` of the buffer as being read.
    pub(crate) fn read(&self, start: usize, len: usize) -> Vec<loom::cell::ConstPtr<()>> {
        let first = start / crate::frame::FRAME_ALIGN;
        let end = (start + len).div_ceil(crate::frame::FRAME_ALIGN);
        self.cells[first..end].iter().map(|c| c.get()).collect()
    }
}

/// Pads and aligns a value to 128 bytes (two cache lines: Zen and Intel prefetch line pairs),
/// so the producer's and the consumer's hot fields never share a line.
#[derive(Default)]
#[repr(align(128))]
pub(crate) struct CachePadded<T>(pub(crate) T);

impl<T> std::ops::Deref for CachePadded<T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        &self.0
    }
}
