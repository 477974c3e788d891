//! A heap buffer whose address is 4096-aligned, because O_DIRECT rejects (EINVAL) any buffer
//! that is not aligned to the logical block size, and the device contract makes that alignment
//! mandatory for every implementation so tests on `MemDevice` catch what O_DIRECT would.

use std::alloc::{self, Layout};
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use crate::BLOCK_SIZE;

/// A heap buffer aligned to 4096 bytes, as O_DIRECT needs. Its length is a multiple of
/// [`BLOCK_SIZE`] (possibly zero) and never changes.
pub struct AlignedBuf {
    /// Dangling (but still 4096-aligned) when `len == 0`: nothing is allocated then.
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively (like Vec<u8>); `&AlignedBuf` only hands
// out `&[u8]`, so sharing between threads is as safe as sharing a `&[u8]`.
unsafe impl Send for AlignedBuf {}
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocates `len` zeroed bytes.
    ///
    /// # Panics
    /// If `len` is not a multiple of [`BLOCK_SIZE`] (a caller bug: every device I/O is in whole
    /// blocks), or if the allocation fails (as `Vec` does).
    pub fn new_zeroed(len: usize) -> AlignedBuf {
        // SAFETY: zeroed memory is initialized.
        unsafe { Self::allocate(len, true) }
    }

    /// Allocates a buffer holding a copy of `data` (whose length must be a multiple of
    /// [`BLOCK_SIZE`]).
    pub fn from_slice(data: &[u8]) -> AlignedBuf {
        // SAFETY: every byte is written below, before the buffer can be read.
        let buf = unsafe { Self::allocate(data.len(), false) };
        if !data.is_empty() {
            // SAFETY: a fresh allocation of `data.len()` bytes cannot overlap `data`.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), buf.ptr.as_ptr(), data.len()) };
        }
        buf
    }

    /// # Safety
    /// Unless `zeroed`, the caller writes all `len` bytes before any is read.
    unsafe fn allocate(len: usize, zeroed: bool) -> AlignedBuf {
        assert!(
            crate::check::is_block_aligned(len as u64),
            "AlignedBuf length {len} is not a multiple of {BLOCK_SIZE}"
        );
        if len == 0 {
            return AlignedBuf {
                ptr: Self::dangling(),
                len: 0,
            };
        }
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe {
            if zeroed {
                alloc::alloc_zeroed(layout)
            } else {
                alloc::alloc(layout)
            }
        };
        let Some(ptr) = NonNull::new(raw) else {
            alloc::handle_alloc_error(layout)
        };
        AlignedBuf { ptr, len }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn layout(len: usize) -> Layout {
        // Fails only for a length near isize::MAX, which no caller can have a use for: treat it
        // like Vec's capacity overflow.
        match Layout::from_size_align(len, BLOCK_SIZE) {
            Ok(layout) => layout,
            Err(_) => panic!("AlignedBuf of {len} bytes exceeds the address space"),
        }
    }

    fn dangling() -> NonNull<u8> {
        /// Exists only to give `NonNull::dangling` a 4096-byte alignment.
        #[repr(align(4096))]
        struct Page;
        // Never dereferenced: a zero-length slice only needs a non-null, aligned address.
        NonNull::<Page>::dangling().cast::<u8>()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.len != 0 {
            // SAFETY: allocated in `new_zeroed` with exactly this layout.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) }
        }
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised bytes we own (or is dangling with len 0).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `deref`, and `&mut self` guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl AsRef<[u8]> for AlignedBuf {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl AsMut<[u8]> for AlignedBuf {
    fn as_mut(&mut self) -> &mut [u8] {
        self
    }
}

impl Clone for AlignedBuf {
    fn clone(&self) -> AlignedBuf {
        AlignedBuf::from_slice(self)
    }
}

impl PartialEq for AlignedBuf {
    fn eq(&self, other: &AlignedBuf) -> bool {
        self[..] == other[..]
    }
}

impl Eq for AlignedBuf {}

impl fmt::Debug for AlignedBuf {
    /// Prints the length and address only: dumping megabytes of data helps nobody.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .field("ptr", &self.ptr)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_aligned_and_sized() {
        for blocks in [1usize, 2, 3, 256] {
            let buf = AlignedBuf::new_zeroed(blocks * BLOCK_SIZE);
            assert_eq!(buf.len(), blocks * BLOCK_SIZE);
            assert_eq!(buf.as_ptr() as usize % BLOCK_SIZE, 0);
            assert!(buf.iter().all(|&b| b == 0));
        }
    }

    #[test]
    fn zero_length_is_allowed() {
        let buf = AlignedBuf::new_zeroed(0);
        assert!(buf.is_empty());
        assert_eq!(buf.as_ptr() as usize % BLOCK_SIZE, 0);
        let copy = buf.clone();
        assert_eq!(copy.len(), 0);
    }

    #[test]
    #[should_panic(expected = "not a multiple")]
    fn unaligned_length_panics() {
        let _ = AlignedBuf::new_zeroed(100);
    }

    #[test]
    fn clone_is_deep_and_aligned() {
        let mut buf = AlignedBuf::new_zeroed(2 * BLOCK_SIZE);
        buf[0] = 7;
        buf[BLOCK_SIZE + 1] = 9;
        let copy = buf.clone();
        buf[0] = 1;
        assert_eq!(copy[0], 7);
        assert_eq!(copy[BLOCK_SIZE + 1], 9);
        assert_ne!(copy.as_ptr(), buf.as_ptr());
        assert_eq!(copy.as_ptr() as usize % BLOCK_SIZE, 0);
    }

    #[test]
    fn send_sync_debug() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<AlignedBuf>();
        let text = format!("{:?}", AlignedBuf::new_zeroed(BLOCK_SIZE));
        assert!(text.contains("4096"));
    }
}
