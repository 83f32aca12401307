//! Memory for the big buffers a forward pass streams (the packed weights, the KV cache, the
//! bandwidth probe): anonymous mappings that ask Linux for 2 MiB pages (`MADV_HUGEPAGE`, which
//! transparent huge pages honour in their default `madvise` mode). With 4 KiB pages a batch-1
//! decode step, which reads every weight once, misses the TLB every 4 KiB and the hardware
//! prefetchers stop at every page boundary. Where the kernel gives no huge pages the memory is
//! ordinary, so nothing depends on getting them.

use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

/// The huge page size asked for.
const HUGE: usize = 2 << 20;

/// Element types whose all-zero bytes are a valid value (what a fresh mapping holds).
pub trait Zeroable: Copy + Send + Sync + 'static {}
impl Zeroable for u8 {}
impl Zeroable for u16 {}
impl Zeroable for u64 {}
impl Zeroable for f32 {}
impl Zeroable for half::f16 {}

/// A zero-filled buffer of `len` values in its own mapping, 2 MiB-aligned.
pub struct HugeBuf<T: Zeroable> {
    ptr: NonNull<T>,
    len: usize,
    map: Mapping,
}

// SAFETY: HugeBuf owns its memory like a Vec<T>; T is Send + Sync.
unsafe impl<T: Zeroable> Send for HugeBuf<T> {}
// SAFETY: as above; shared access is read-only through `Deref`.
unsafe impl<T: Zeroable> Sync for HugeBuf<T> {}

impl<T: Zeroable> HugeBuf<T> {
    /// `len` zeros. Memory is claimed as it is first touched, as for `vec![0; len]`.
    pub fn zeroed(len: usize) -> HugeBuf<T> {
        let map = Mapping::new(len * std::mem::size_of::<T>());
        HugeBuf {
            ptr: map.start.cast(),
            len,
            map,
        }
    }
}

impl<T: Zeroable> Deref for HugeBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: the mapping holds `len` zero-initialised (valid: `Zeroable`) values, aligned
        // to 2 MiB, alive while `self` is.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Zeroable> DerefMut for HugeBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as for `deref`; `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Zeroable> std::fmt::Debug for HugeBuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "HugeBuf({} values, {} bytes mapped)",
            self.len, self.map.len
        )
    }
}

/// Bytes carved from a shared chunk of huge-page memory: many small weight matrices share 2 MiB
/// pages (a matrix of 300 KB in a mapping of its own would get none). The chunk is unmapped
/// when its last slice goes.
#[derive(Clone)]
pub struct SharedBytes {
    chunk: Arc<HugeBuf<u8>>,
    start: usize,
    len: usize,
}

impl Deref for SharedBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `start..start + len` lies within the chunk and was written before this value
        // existed; only other, disjoint ranges are written later (see `copy_of`). No reference
        // to the whole chunk is ever made.
        unsafe { std::slice::from_raw_parts(self.chunk.ptr.as_ptr().add(self.start), self.len) }
    }
}

impl SharedBytes {
    /// A copy of `bytes` in the current chunk (or a new one of at least 32 MiB), 64-byte
    /// aligned.
    pub fn copy_of(bytes: &[u8]) -> SharedBytes {
        static CURRENT: Mutex<Option<(Arc<HugeBuf<u8>>, usize)>> = Mutex::new(None);
        let mut cur = CURRENT.lock().unwrap_or_else(|e| e.into_inner());
        let len = bytes.len();
        let fits = |(c, used): &(Arc<HugeBuf<u8>>, usize)| used.next_multiple_of(64) + len <= c.len;
        if !cur.as_ref().is_some_and(fits) {
            *cur = Some((Arc::new(HugeBuf::zeroed(len.max(32 << 20))), 0));
        }
        let (chunk, used) = cur.as_mut().expect("a chunk was just made");
        let start = used.next_multiple_of(64);
        // SAFETY: bytes start..start + len of the chunk lie within it and were never handed out
        // (`used` only grows); no `SharedBytes` reads them before this write, made under the
        // lock that hands them out.
        unsafe {
            let dst = chunk.ptr.as_ptr().add(start);
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, len);
        }
        *used = start + len;
        SharedBytes {
            chunk: Arc::clone(chunk),
            start,
            len,
        }
    }
}

/// An anonymous private mapping, its start 2 MiB-aligned, advised to use huge pages.
struct Mapping {
    base: *mut libc::c_void,
    len: usize,
    start: NonNull<u8>,
}

impl Mapping {
    fn new(bytes: usize) -> Mapping {
        if bytes == 0 {
            return Mapping {
                base: std::ptr::null_mut(),
                len: 0,
                start: NonNull::<u64>::dangling().cast(),
            };
        }
        let size = bytes.next_multiple_of(HUGE);
        let len = size + HUGE;
        // SAFETY: a fresh anonymous mapping; no existing memory is touched.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            std::alloc::handle_alloc_error(
                std::alloc::Layout::from_size_align(len, HUGE).expect("a valid layout"),
            );
        }
        let skip = (base as usize).next_multiple_of(HUGE) - base as usize;
        // SAFETY: `skip < HUGE`, so `start..start + size` lies within the mapping.
        let start = unsafe { (base as *mut u8).add(skip) };
        #[cfg(target_os = "linux")]
        // SAFETY: advice on memory this mapping owns; failure (no THP) leaves ordinary pages.
        unsafe {
            libc::madvise(start.cast(), size, libc::MADV_HUGEPAGE);
        }
        Mapping {
            base,
            len,
            start: NonNull::new(start).expect("mmap returned a non-null mapping"),
        }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: `base..base + len` is the mapping made in `new`, unmapped once, here.
            unsafe { libc::munmap(self.base, self.len) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_zeroed_aligned_and_shared_bytes_are_copies() {
        let mut b = HugeBuf::<f32>::zeroed(1_000_000);
        assert!(b.iter().all(|v| *v == 0.0));
        assert_eq!(b.as_ptr() as usize % HUGE, 0);
        b[999_999] = 1.5;
        assert_eq!(b[999_999], 1.5);
        let empty = HugeBuf::<u8>::zeroed(0);
        assert!(empty.is_empty());
        let a: Vec<u8> = (0..300_000u32).map(|i| (i * 7) as u8).collect();
        let (x, y) = (SharedBytes::copy_of(&a), SharedBytes::copy_of(&a[..1000]));
        assert_eq!(&x[..], &a[..]);
        assert_eq!(&y[..], &a[..1000]);
        assert_eq!(x.as_ptr() as usize % 64, 0);
        assert_eq!(y.as_ptr() as usize % 64, 0);
        let big = vec![3u8; 40 << 20];
        assert_eq!(&SharedBytes::copy_of(&big)[..], &big[..]);
    }
}
