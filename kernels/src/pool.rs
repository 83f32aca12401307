//! The kernels' thread pool and the instruction set chosen at run time.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use crate::KernelError;

static POOL: OnceLock<rayon::ThreadPool> = OnceLock::new();
static THREADS: AtomicUsize = AtomicUsize::new(0);

/// Sets the number of kernel threads (default: all cores). Must be called before the first
/// kernel runs; later calls with another number are an error.
pub fn set_threads(n: usize) -> Result<(), KernelError> {
    THREADS.store(n, Ordering::SeqCst);
    let have = pool().current_num_threads();
    if n != 0 && have != n {
        return Err(KernelError::Unavailable(format!(
            "the kernel thread pool already runs {have} threads"
        )));
    }
    Ok(())
}

/// The kernels' thread pool.
pub fn pool() -> &'static rayon::ThreadPool {
    POOL.get_or_init(|| {
        let n = match THREADS.load(Ordering::SeqCst) {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        };
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .thread_name(|i| format!("tandem-kernel-{i}"))
            .build()
            .expect("kernel thread pool starts")
    })
}

/// Runs `f` on the kernel pool, so that the parallel kernels it calls are scheduled among the
/// pool's workers without a cross-thread handoff per kernel.
pub fn install<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    let p = pool();
    if p.current_thread_index().is_some() {
        f()
    } else {
        p.install(f)
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
/// the VNNI matmul kernels, see [`vnni`]).
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
