//! The kernels' thread pool and the instruction set chosen at run time.
//!
//! A forward pass is a few hundred short parallel regions (a batch-1 decode step of SmolLM2 has
//! ~150, 10-50 µs each), so a region's start must cost far less than a wake-up through the
//! kernel. The pool's workers spin on an epoch counter for [`SPIN`] after each region and only
//! then sleep on a condition variable; the calling thread takes items too. Items are claimed one
//! at a time from a counter tagged with the region's epoch, so a worker late for one region can
//! never take an item of the next. Which thread runs an item never changes its result: every
//! kernel computes an item the same way wherever it runs.

use std::cell::UnsafeCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Arc, Condvar, Mutex, OnceLock, TryLockError};
use std::time::{Duration, Instant};

use crate::KernelError;

/// How long an idle worker spins before it sleeps.
const SPIN: Duration = Duration::from_micros(200);

static POOL: OnceLock<Pool> = OnceLock::new();
static THREADS: AtomicUsize = AtomicUsize::new(0);

/// Sets the number of kernel threads (default: all cores). Must be called before the first
/// kernel runs; later calls with another number are an error.
pub fn set_threads(n: usize) -> Result<(), KernelError> {
    THREADS.store(n, SeqCst);
    let have = threads();
    if n != 0 && have != n {
        return Err(KernelError::Unavailable(format!(
            "the kernel thread pool already runs {have} threads"
        )));
    }
    Ok(())
}

/// The number of threads kernels run on (the caller included).
pub fn threads() -> usize {
    pool().threads
}

/// Runs `f(i)` for every `i` in `0..n` on the kernel threads, the caller among them, and returns
/// when all are done. A call made while another region runs (from another thread, or from inside
/// an item) runs its items on the calling thread alone. A panic in an item is raised here.
pub fn for_each(n: usize, f: impl Fn(usize) + Sync) {
    let p = pool();
    if n <= 1 || p.threads == 1 {
        return (0..n).for_each(f);
    }
    let _region = match p.region.try_lock() {
        Ok(g) => g,
        Err(TryLockError::WouldBlock) => return (0..n).for_each(f),
        Err(TryLockError::Poisoned(e)) => e.into_inner(),
    };
    p.shared.run(n, &f);
}

/// Runs `f(i, chunk)` for the `i`-th chunk of `size` elements of `data` (the last may be shorter).
pub fn for_each_chunk_mut<T: Send>(
    data: &mut [T],
    size: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    let len = data.len();
    let base = SendPtr(data.as_mut_ptr());
    for_each(len.div_ceil(size.max(1)), |i| {
        let start = i * size;
        let n = size.min(len - start);
        // SAFETY: chunk i is `start..start + n` of `data`, which is borrowed mutably for this
        // call; chunks are disjoint and each index is run once.
        let chunk = unsafe { std::slice::from_raw_parts_mut(base.get().add(start), n) };
        f(i, chunk)
    });
}

/// A raw pointer handed to the items of one region, each of which touches its own elements.
pub(crate) struct SendPtr<T: ?Sized>(pub(crate) *mut T);
// SAFETY: used only to hand disjoint parts of one buffer to the items of a region.
unsafe impl<T: ?Sized> Send for SendPtr<T> {}
// SAFETY: as above; no two items write the same element.
unsafe impl<T: ?Sized> Sync for SendPtr<T> {}
impl<T: ?Sized> Clone for SendPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T: ?Sized> Copy for SendPtr<T> {}
impl<T: ?Sized> SendPtr<T> {
    /// The pointer (a method, so that closures capture the whole `SendPtr`).
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}

fn pool() -> &'static Pool {
    POOL.get_or_init(|| {
        let n = match THREADS.load(SeqCst) {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        Pool::start(n)
    })
}

struct Pool {
    threads: usize,
    /// Held by the thread whose region runs.
    region: Mutex<()>,
    shared: Arc<Shared>,
}

/// The job of the running region: a type-erased `&dyn Fn(usize)`, valid while the region runs.
type Job = *const (dyn Fn(usize) + Sync);

struct Shared {
    /// The region's epoch in the high 32 bits, the next unclaimed item in the low 32.
    state: AtomicU64,
    /// The number of items of the running region.
    items: AtomicUsize,
    /// Items finished in the running region.
    done: AtomicUsize,
    job: UnsafeCell<Option<Job>>,
    panicked: AtomicBool,
    sleepers: AtomicUsize,
    sleep: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written only by the thread holding `Pool::region` before it publishes a new
// epoch (Release), and read by workers only after they claimed an item of that epoch (Acquire);
// the writer waits for every claimed item before it writes again.
unsafe impl Sync for Shared {}
// SAFETY: as above.
unsafe impl Send for Shared {}

impl Pool {
    fn start(threads: usize) -> Pool {
        let shared = Arc::new(Shared {
            state: AtomicU64::new(0),
            items: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            job: UnsafeCell::new(None),
            panicked: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            sleep: Mutex::new(()),
            wake: Condvar::new(),
        });
        for i in 1..threads {
            let s = Arc::clone(&shared);
            std::thread::Builder::new()
                .name(format!("tandem-kernel-{i}"))
                .spawn(move || s.work())
                .expect("kernel thread starts");
        }
        Pool {
            threads,
            region: Mutex::new(()),
            shared,
        }
    }
}

impl Shared {
    /// Runs one region (the caller holds `Pool::region`).
    fn run(&self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        let epoch = self.open(n, f);
        self.take(epoch);
        let mut spins = 0u32;
        while self.done.load(Acquire) < n {
            spins += 1;
            if spins.is_multiple_of(4096) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        if self.panicked.swap(false, Relaxed) {
            panic!("a kernel item panicked on a pool thread");
        }
    }

    /// Starts a region of `n` items of `f` (the caller holds `Pool::region`, and waits for
    /// every item before `f` goes): closes the last epoch, sets the region up, publishes its
    /// epoch and wakes sleeping workers. Returns the epoch.
    fn open(&self, n: usize, f: &(dyn Fn(usize) + Sync)) -> u64 {
        let last = self.state.load(Relaxed) >> 32;
        self.close(last);
        // SAFETY: the lifetime is erased only for the duration of the region: `run` returns after
        // every item claimed in this epoch has finished, and later claims fail on the epoch.
        let job: Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(f) };
        self.prepare(n, job);
        let epoch = (last + 1) & 0xffff_ffff;
        self.publish(epoch);
        epoch
    }

    /// Lets the prepared region's items be claimed, waking the workers asleep.
    fn publish(&self, epoch: u64) {
        self.state.store(epoch << 32, SeqCst);
        if self.sleepers.load(SeqCst) > 0 {
            let _g = self.sleep.lock().unwrap_or_else(|e| e.into_inner());
            self.wake.notify_all();
        }
    }

    /// Closes `epoch` before the next region's count is written: a worker that read the last
    /// region's state just before it ended sees the next region's larger `items` beside its
    /// stale state — without this its claim would succeed on that state, and run the next job's
    /// item before the epoch is published, counted twice in `done` (a region returning with an
    /// item still running). Its claim now fails: the state it compares with is gone.
    fn close(&self, epoch: u64) {
        self.state.store(epoch << 32 | 0xffff_ffff, SeqCst);
    }

    /// Writes the next region's job and counts (between [`Shared::close`] and its publication).
    fn prepare(&self, n: usize, job: Job) {
        // SAFETY: no item of an earlier epoch is running (every one finished before its `run`
        // returned) and the last epoch is closed, so nobody reads `job`.
        unsafe { *self.job.get() = Some(job) };
        self.items.store(n, Relaxed);
        self.done.store(0, Relaxed);
    }

    /// Claims and runs items of `epoch` until none is left.
    fn take(&self, epoch: u64) {
        let mut s = self.state.load(Acquire);
        while let Some(i) = self.claim(&mut s, epoch) {
            // SAFETY: an item of `epoch` is claimed, so its region is still running and `job` is
            // its job.
            let job = unsafe { (*self.job.get()).expect("a running region has a job") };
            // SAFETY: as above, `job` points to the region's closure, alive until `done` counts
            // this item.
            if catch_unwind(AssertUnwindSafe(|| unsafe { (*job)(i) })).is_err() {
                self.panicked.store(true, Relaxed);
            }
            self.done.fetch_add(1, Release);
            s = self.state.load(Acquire);
        }
    }

    /// Claims the next item of `epoch`, starting from the state `s` last read; `None` when the
    /// epoch has none left (or is over).
    fn claim(&self, s: &mut u64, epoch: u64) -> Option<usize> {
        loop {
            let i = (*s & 0xffff_ffff) as usize;
            if *s >> 32 != epoch || i >= self.items.load(Relaxed) {
                return None;
            }
            match self
                .state
                .compare_exchange_weak(*s, *s + 1, Acquire, Acquire)
            {
                Ok(_) => return Some(i),
                Err(now) => *s = now,
            }
        }
    }

    /// A worker: waits for each new epoch (spinning, then asleep) and takes its items.
    fn work(&self) {
        let mut seen = 0;
        loop {
            let epoch = self.wait(seen);
            seen = epoch;
            self.take(epoch);
        }
    }

    fn wait(&self, seen: u64) -> u64 {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            let e = self.state.load(Acquire) >> 32;
            if e != seen {
                return e;
            }
            spins += 1;
            if !spins.is_multiple_of(256) || start.elapsed() < SPIN {
                std::hint::spin_loop();
                continue;
            }
            let mut g = self.sleep.lock().unwrap_or_else(|e| e.into_inner());
            self.sleepers.fetch_add(1, SeqCst);
            while self.state.load(SeqCst) >> 32 == seen {
                g = self.wake.wait(g).unwrap_or_else(|e| e.into_inner());
            }
            self.sleepers.fetch_sub(1, SeqCst);
            return self.state.load(Acquire) >> 32;
        }
    }
}

/// The instruction set the CPU kernels use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// Portable Rust.
    Scalar,
    /// x86-64 AVX2 with FMA and F16C.
    Avx2,
}

/// The instruction set chosen for this process: the best the CPU has, unless the environment
/// variable `TANDEM_ISA=scalar` asks for the portable kernels (`TANDEM_ISA=avx2`: AVX2 without
/// the VNNI matmul kernels, see [`vnni`]; `TANDEM_ISA=vnni`: without the 512-bit ones, see
/// [`avx512`]).
pub fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        if std::env::var("TANDEM_ISA").is_ok_and(|v| v == "scalar") {
            return Isa::Scalar;
        }
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            return Isa::Avx2;
        }
        Isa::Scalar
    })
}

/// Whether the quantised matmul kernels use AVX-512 VNNI's dot-product instruction (at 256
/// bits, with AVX-512 VL): on AVX2 machines that have it, unless `TANDEM_ISA` says `avx2` or
/// `scalar`. Outputs are bitwise the same either way.
pub fn vnni() -> bool {
    static VNNI: OnceLock<bool> = OnceLock::new();
    *VNNI.get_or_init(|| {
        if isa() != Isa::Avx2 || std::env::var("TANDEM_ISA").is_ok_and(|v| v == "avx2") {
            return false;
        }
        #[cfg(target_arch = "x86_64")]
        return is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl");
        #[cfg(not(target_arch = "x86_64"))]
        false
    })
}

/// Whether the packed matmul kernels prefetch the next tile's weights as they go (see
/// `packed::avx512::ahead`): yes, unless `TANDEM_PREFETCH=off` (to measure it on a new CPU in
/// one binary; any value but `on` and `off` is said on stderr, not ignored silently). Outputs
/// are bitwise the same either way.
pub fn prefetch_weights() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| match std::env::var("TANDEM_PREFETCH").as_deref() {
        Ok("off") => false,
        Ok("on") | Err(_) => true,
        Ok(v) => {
            eprintln!(
                "TANDEM_PREFETCH={v:?} is neither \"on\" nor \"off\": the weights are prefetched"
            );
            true
        }
    })
}

/// Whether the quantised matmul kernels run at 512 bits (two interleaved groups a vector, with
/// AVX-512 F, BW, VL and VNNI): where [`vnni`] holds and the CPU has them, unless
/// `TANDEM_ISA=vnni` asks for the 256-bit VNNI kernels. Outputs are bitwise the same either way.
pub fn avx512() -> bool {
    static WIDE: OnceLock<bool> = OnceLock::new();
    *WIDE.get_or_init(|| {
        if !vnni() || std::env::var("TANDEM_ISA").is_ok_and(|v| v == "vnni") {
            return false;
        }
        #[cfg(target_arch = "x86_64")]
        return is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw");
        #[cfg(not(target_arch = "x86_64"))]
        false
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_item_runs_once_and_nested_or_concurrent_regions_run_on_their_caller() {
        for n in [0, 1, 2, 3, 17, 1000] {
            let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
            for_each(n, |i| {
                // A nested region runs on the thread that calls it.
                let inner = AtomicUsize::new(0);
                for_each(3, |_| {
                    inner.fetch_add(1, Relaxed);
                });
                hits[i].fetch_add(inner.load(Relaxed), Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Relaxed) == 3), "n = {n}");
        }
        let total = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..200 {
                        for_each(7, |i| {
                            total.fetch_add(i, Relaxed);
                        });
                    }
                });
            }
        });
        assert_eq!(total.load(Relaxed), 4 * 200 * 21);
    }

    /// The interleaving a preempted worker can hit: it read the state as the last region's
    /// last item finished, and checks it against `items` after the caller wrote the next
    /// region's larger count but before it published the epoch. Its claim must fail (it used to
    /// succeed and run the next region's item uncounted by the epoch: the region then returned
    /// with an item still running). Stepped by hand on one thread, so it never depends on timing.
    #[test]
    fn a_worker_late_from_the_last_region_claims_nothing_of_the_next() {
        let p = Pool::start(1);
        let sh = &p.shared;
        let first = AtomicUsize::new(0);
        sh.run(2, &|_| {
            first.fetch_add(1, Relaxed);
        });
        assert_eq!(first.load(Relaxed), 2);
        let mut stale = sh.state.load(Acquire);
        let last = stale >> 32;
        // The caller starts the next region of 4 items, up to just before publishing it.
        let hits: Vec<AtomicUsize> = (0..4).map(|_| AtomicUsize::new(0)).collect();
        let f = |i: usize| {
            hits[i].fetch_add(1, Relaxed);
        };
        let f: &(dyn Fn(usize) + Sync) = &f;
        sh.close(last);
        // SAFETY: as in `open`: the region is run to its end below, while `f` lives.
        sh.prepare(4, unsafe {
            std::mem::transmute::<&(dyn Fn(usize) + Sync), Job>(f)
        });
        assert_eq!(
            sh.claim(&mut stale, last),
            None,
            "the late worker claims nothing"
        );
        sh.publish(last + 1);
        sh.take(last + 1);
        assert!(hits.iter().all(|h| h.load(Relaxed) == 1));
        assert_eq!(sh.done.load(Relaxed), 4);
    }

    #[test]
    fn chunks_cover_the_slice_and_a_panic_reaches_the_caller() {
        let mut v = vec![0usize; 1001];
        for_each_chunk_mut(&mut v, 64, |i, c| c.iter_mut().for_each(|x| *x += i + 1));
        assert!(v.iter().enumerate().all(|(j, &x)| x == j / 64 + 1));
        let r = catch_unwind(|| for_each(64, |i| assert!(i != 63, "item 63")));
        assert!(r.is_err());
        // The pool still works after it.
        let sum = AtomicUsize::new(0);
        for_each(64, |i| {
            sum.fetch_add(i, Relaxed);
        });
        assert_eq!(sum.load(Relaxed), 63 * 64 / 2);
    }
}
