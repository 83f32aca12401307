// A CPU emulator of the CUDA driver API, as much of it as tandem's GPU code calls through cudarc,
// built as a `libcuda.so` that a test process finds first on LD_LIBRARY_PATH. A test double:
// it runs `kernels/cuda/*.cu` (compiled for the host, `cuda_emu.h`) so the GPU suite checks the
// kernels, their launch configurations and arguments, the device-memory bookkeeping and the
// GPU forward on a machine with no GPU. It proves nothing about speed or the hardware's memory
// model; scripts/gpu-check.sh on a real GPU does.
//
// Execution: each thread block runs on one host thread, its CUDA threads as fibers switched at
// __syncthreads and warp shuffles (in thread order and reverse order by turns); blocks spread
// over a few host threads. Checks a GPU would not
// make: a barrier that cannot complete (divergent __syncthreads), a full-mask shuffle with a
// lane that is not live, a pointer argument outside every allocation, a copy that runs past
// one, a block over 1024 threads, a kernel missing from the loaded PTX. Device allocations end
// at a guard page and start filled with 0xff bytes (NaN in f32, f16 and bf16), so reads past
// the end fault and reads of unwritten memory show.
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace tandem_emu {

struct dim3;
struct Kernel {
    const char* name;
    void (*call)(void** params);
    bool (*check)(void** params, const char* name);
};
extern const Kernel kKernels[];
extern const int kNumKernels;

[[noreturn]] void die(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    std::fputs("tandem CUDA emulator: ", stderr);
    std::vfprintf(stderr, fmt, ap);
    std::fputc('\n', stderr);
    va_end(ap);
    std::abort();
}

// ---- device memory -------------------------------------------------------------------------

struct Alloc {
    char* base;
    size_t map_len;
    size_t size;
};
std::mutex mem_mutex;
std::map<uintptr_t, Alloc> allocs;  // by the address handed out

constexpr size_t kPage = 4096;

uintptr_t device_alloc(size_t size) {
    size_t data_pages = (size + kPage - 1) / kPage;
    if (data_pages == 0) data_pages = 1;
    size_t len = (data_pages + 1) * kPage;
    void* m = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (m == MAP_FAILED) return 0;
    char* base = static_cast<char*>(m);
    mprotect(base + data_pages * kPage, kPage, PROT_NONE);
    char* p = base + data_pages * kPage - ((size + 15) / 16) * 16;
    std::memset(p, 0xff, size);
    std::lock_guard<std::mutex> g(mem_mutex);
    allocs[(uintptr_t)p] = Alloc{base, len, size};
    return (uintptr_t)p;
}

bool device_free(uintptr_t p) {
    std::lock_guard<std::mutex> g(mem_mutex);
    auto it = allocs.find(p);
    if (it == allocs.end()) return false;
    munmap(it->second.base, it->second.map_len);
    allocs.erase(it);
    return true;
}

// Whether [p, p + n) lies inside one allocation (n = 0: p inside or at the start of one).
bool device_range(uintptr_t p, size_t n) {
    std::lock_guard<std::mutex> g(mem_mutex);
    auto it = allocs.upper_bound(p);
    if (it == allocs.begin()) return false;
    --it;
    uintptr_t start = it->first, end = start + it->second.size;
    return p >= start && (n == 0 ? (p < end || p == start) : p + n <= end);
}

// ---- fibers --------------------------------------------------------------------------------

extern "C" void tandem_emu_switch(void** save_sp, void* to_sp);
asm(R"(
    .text
    .globl tandem_emu_switch
    .type tandem_emu_switch, @function
tandem_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size tandem_emu_switch, .-tandem_emu_switch
)");

}  // namespace tandem_emu

#include "cuda_emu.h"

namespace tandem_emu {

thread_local const BlockInfo* current_block = nullptr;
thread_local const dim3* current_thread = nullptr;

enum class State : unsigned char { Ready, AtBlockBarrier, AtWarpBarrier, Done };

struct Fiber {
    void* sp;
    dim3 tid;
    int lane, warp;
    State state;
};

struct Launch {
    const Kernel* kernel;
    void** params;
    dim3 grid, block;
    size_t smem;
    std::atomic<uint64_t> next{0};
    uint64_t blocks() const { return (uint64_t)grid.x * grid.y * grid.z; }
};

constexpr size_t kStack = 64 * 1024;

// One host thread's running block.
struct BlockRun {
    BlockInfo info;
    const Launch* launch = nullptr;
    std::vector<Fiber> fibers;
    std::vector<char*> stacks;
    std::vector<uint64_t> lanes;
    std::vector<unsigned char> smem;
    void* sched_sp = nullptr;
    int cur = 0;
};
thread_local BlockRun run_state;

void park(State s) {
    BlockRun& r = run_state;
    Fiber& f = r.fibers[r.cur];
    f.state = s;
    tandem_emu_switch(&f.sp, r.sched_sp);
}

[[noreturn]] void fiber_main() {
    BlockRun& r = run_state;
    r.launch->kernel->call(r.launch->params);
    Fiber& f = r.fibers[r.cur];
    f.state = State::Done;
    tandem_emu_switch(&f.sp, r.sched_sp);
    __builtin_unreachable();
}

void* initial_sp(char* stack) {
    auto top = (uintptr_t)(stack + kStack) & ~(uintptr_t)15;
    auto* s = (uintptr_t*)top;
    s[-1] = 0;                       // fiber_main's return address: never used
    s[-2] = (uintptr_t)&fiber_main;  // where tandem_emu_switch's `ret` goes
    for (int i = 3; i <= 8; i++) s[-i] = 0;  // rbp rbx r12 r13 r14 r15
    return s - 8;
}

void syncthreads() { park(State::AtBlockBarrier); }

uint64_t shfl_xor(unsigned int mask, uint64_t bits, int lane_mask) {
    BlockRun& r = run_state;
    int me = r.cur, n = (int)r.fibers.size();
    const Fiber& f = r.fibers[me];
    if (mask != 0xffffffffu) die("%s: __shfl_xor_sync with a partial mask is not emulated",
                                 r.launch->kernel->name);
    int base = f.warp * 32;
    if (base + 32 > n)
        die("%s: full-mask shuffle in a partial warp (block of %d threads)", r.launch->kernel->name,
            n);
    r.lanes[me] = bits;
    park(State::AtWarpBarrier);
    for (int l = base; l < base + 32; l++)
        if (r.fibers[l].state == State::Done)
            die("%s: full-mask shuffle while lane %d of warp %d has exited", r.launch->kernel->name,
                l - base, f.warp);
    uint64_t out = r.lanes[base + ((f.lane ^ lane_mask) & 31)];
    park(State::AtWarpBarrier);
    return out;
}

void* dynamic_smem() { return run_state.smem.data(); }

void run_block(const Launch& l, uint64_t b) {
    BlockRun& r = run_state;
    int n = (int)(l.block.x * l.block.y * l.block.z);
    r.launch = &l;
    r.info.grid_dim = l.grid;
    r.info.block_dim = l.block;
    r.info.block_idx = dim3{(unsigned)(b % l.grid.x), (unsigned)(b / l.grid.x % l.grid.y),
                            (unsigned)(b / ((uint64_t)l.grid.x * l.grid.y))};
    while ((int)r.stacks.size() < n) r.stacks.push_back(static_cast<char*>(std::malloc(kStack)));
    r.fibers.resize(n);
    r.lanes.assign(n, 0);
    r.smem.assign(l.smem, 0xff);
    for (int i = 0; i < n; i++) {
        Fiber& f = r.fibers[i];
        f.tid = dim3{i % l.block.x, i / l.block.x % l.block.y, i / (l.block.x * l.block.y)};
        f.lane = i % 32;
        f.warp = i / 32;
        f.state = State::Ready;
        f.sp = initial_sp(r.stacks[i]);
    }
    current_block = &r.info;
    // Between two barriers the threads run one after another, in thread order and in reverse
    // order by turns, so a missing barrier shows whichever side of it the reader is on.
    for (bool reverse = false;; reverse = !reverse) {
        for (int j = 0; j < n; j++) {
            int i = reverse ? n - 1 - j : j;
            if (r.fibers[i].state != State::Ready) continue;
            r.cur = i;
            current_thread = &r.fibers[i].tid;
            tandem_emu_switch(&r.sched_sp, r.fibers[i].sp);
        }
        // Every fiber has exited or waits at a barrier: release what can complete.
        int live = 0, at_block = 0;
        for (const Fiber& f : r.fibers) {
            live += f.state != State::Done;
            at_block += f.state == State::AtBlockBarrier;
        }
        if (live == 0) break;
        bool released = false;
        if (at_block == live) {
            for (Fiber& f : r.fibers)
                if (f.state == State::AtBlockBarrier) f.state = State::Ready;
            released = true;
        } else {
            for (int w = 0; w * 32 < n; w++) {
                int wl = 0, ww = 0;
                for (int i = w * 32; i < std::min(n, w * 32 + 32); i++) {
                    wl += r.fibers[i].state != State::Done;
                    ww += r.fibers[i].state == State::AtWarpBarrier;
                }
                if (wl > 0 && ww == wl) {
                    for (int i = w * 32; i < std::min(n, w * 32 + 32); i++)
                        r.fibers[i].state = State::Ready;
                    released = true;
                }
            }
        }
        if (!released)
            die("%s: block (%u,%u,%u) cannot go on: %d threads wait at __syncthreads, %d live "
                "(divergent barrier)",
                l.kernel->name, r.info.block_idx.x, r.info.block_idx.y, r.info.block_idx.z,
                at_block, live);
    }
    current_block = nullptr;
    current_thread = nullptr;
}

void run_blocks(Launch& l) {
    for (;;) {
        uint64_t b = l.next.fetch_add(1);
        if (b >= l.blocks()) return;
        run_block(l, b);
    }
}

// Host threads that run blocks beside the launching one.
struct Pool {
    std::mutex m;
    std::condition_variable start, done;
    Launch* job = nullptr;
    uint64_t generation = 0;
    int busy = 0;
    int workers = 0;

    Pool() {
        unsigned hw = std::thread::hardware_concurrency();
        workers = (int)std::min(hw > 1 ? hw - 1 : 0u, 7u);
        for (int i = 0; i < workers; i++) std::thread([this] { work(); }).detach();
    }

    void work() {
        uint64_t seen = 0;
        for (;;) {
            Launch* l;
            {
                std::unique_lock<std::mutex> g(m);
                start.wait(g, [&] { return generation != seen; });
                seen = generation;
                l = job;
            }
            run_blocks(*l);
            std::lock_guard<std::mutex> g(m);
            if (--busy == 0) done.notify_all();
        }
    }

    void run(Launch& l) {
        if (workers == 0 || l.blocks() < 4) {
            run_blocks(l);
            return;
        }
        {
            std::lock_guard<std::mutex> g(m);
            job = &l;
            busy = workers;
            generation++;
        }
        start.notify_all();
        run_blocks(l);
        std::unique_lock<std::mutex> g(m);
        done.wait(g, [&] { return busy == 0; });
        job = nullptr;
    }
};

Pool& pool() {
    static Pool* p = new Pool();  // never destroyed: its threads wait until the process exits
    return *p;
}

// ---- argument unpacking for the kernel table -----------------------------------------------

template <class F>
struct Sig;
template <class... A>
struct Sig<void (*)(A...)> {
    template <void (*F)(A...), size_t... I>
    static void call_at(void** p, std::index_sequence<I...>) {
        F(*static_cast<std::remove_reference_t<A>*>(p[I])...);
    }
    template <void (*F)(A...)>
    static void call(void** p) {
        call_at<F>(p, std::index_sequence_for<A...>{});
    }
    template <size_t... I>
    static bool check_at(void** p, const char* name, std::index_sequence<I...>) {
        bool ok = true;
        auto one = [&](auto* arg, size_t i) {
            using T = std::remove_pointer_t<decltype(arg)>;
            if constexpr (std::is_pointer_v<T>) {
                if (!device_range((uintptr_t)*arg, 0)) {
                    std::fprintf(stderr,
                                 "tandem CUDA emulator: %s: argument %zu (%p) is not device "
                                 "memory\n",
                                 name, i, (void*)*arg);
                    ok = false;
                }
            }
        };
        (one(static_cast<std::remove_reference_t<A>*>(p[I]), I), ...);
        return ok;
    }
    static bool check(void** p, const char* name) {
        return check_at(p, name, std::index_sequence_for<A...>{});
    }
};

}  // namespace tandem_emu

#define TANDEM_EMU_KERNEL(ns, fn)                                        \
    tandem_emu::Kernel {                                                 \
        #fn, &tandem_emu::Sig<decltype(&ns::fn)>::call<&ns::fn>,         \
            &tandem_emu::Sig<decltype(&ns::fn)>::check                   \
    }

// ---- the driver API --------------------------------------------------------------------------

using CUresult = int;
using CUdeviceptr = unsigned long long;
enum : int {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_IMAGE = 200,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701,
};

namespace {

int g_context_token, g_stream_token, g_event_token;
struct Module {
    std::string ptx;
};

CUresult bad(const char* what, CUresult code) {
    std::fprintf(stderr, "tandem CUDA emulator: %s\n", what);
    return code;
}

// With TANDEM_CUDA_EMU_LOG set, the first launch of each kernel in each process appends
// "<pid> <kernel>" to that file, so a test can see which processes ran on the emulator.
void log_launch(const char* kernel) {
    static std::mutex m;
    static std::set<std::string> seen;
    const char* path = std::getenv("TANDEM_CUDA_EMU_LOG");
    if (!path) return;
    std::lock_guard<std::mutex> g(m);
    if (!seen.insert(kernel).second) return;
    if (FILE* f = std::fopen(path, "a")) {
        std::fprintf(f, "%d %s\n", (int)getpid(), kernel);
        std::fclose(f);
    }
}

CUresult copy_checked(void* dst, const void* src, size_t n, bool dst_dev, bool src_dev) {
    if (dst_dev && !tandem_emu::device_range((uintptr_t)dst, n))
        return bad("copy: destination range is not inside one allocation",
                   CUDA_ERROR_INVALID_VALUE);
    if (src_dev && !tandem_emu::device_range((uintptr_t)src, n))
        return bad("copy: source range is not inside one allocation", CUDA_ERROR_INVALID_VALUE);
    std::memmove(dst, src, n);
    return CUDA_SUCCESS;
}

}  // namespace

#define API extern "C" __attribute__((visibility("default")))

API CUresult cuInit(unsigned int) { return CUDA_SUCCESS; }
API CUresult cuDriverGetVersion(int* v) {
    *v = 13000;
    return CUDA_SUCCESS;
}
API CUresult cuDeviceGetCount(int* n) {
    *n = 1;
    return CUDA_SUCCESS;
}
API CUresult cuDeviceGet(int* dev, int ordinal) {
    if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
    *dev = 0;
    return CUDA_SUCCESS;
}
API CUresult cuDeviceGetName(char* name, int len, int) {
    std::snprintf(name, (size_t)len, "tandem CUDA emulator (CPU)");
    return CUDA_SUCCESS;
}
API CUresult cuDeviceTotalMem_v2(size_t* bytes, int) {
    *bytes = (size_t)16 << 30;
    return CUDA_SUCCESS;
}
API CUresult cuMemGetInfo_v2(size_t* free, size_t* total) {
    *free = *total = (size_t)16 << 30;
    return CUDA_SUCCESS;
}
API CUresult cuDeviceGetAttribute(int* v, int attribute, int) {
    switch (attribute) {
        case 1: *v = 1024; break;                // max threads per block
        case 2: *v = 1024; break;                // max block dim x
        case 3: *v = 1024; break;                // max block dim y
        case 4: *v = 64; break;                  // max block dim z
        case 5: *v = 0x7fffffff; break;          // max grid dim x
        case 6: case 7: *v = 65535; break;       // max grid dim y, z
        case 8: *v = 48 * 1024; break;           // shared memory per block
        case 10: *v = 32; break;                 // warp size
        case 16: *v = 4; break;                  // multiprocessors
        case 75: *v = 9; break;                  // compute capability: the kernels are compiled
        case 76: *v = 0; break;                  //   to PTX for sm_90, as on an H200
        case 115: *v = 0; break;                 // memory pools: plain cuMemAlloc
        default: *v = 0;
    }
    return CUDA_SUCCESS;
}
API CUresult cuDevicePrimaryCtxRetain(void** ctx, int) {
    *ctx = &g_context_token;
    return CUDA_SUCCESS;
}
API CUresult cuDevicePrimaryCtxRelease_v2(int) { return CUDA_SUCCESS; }
API CUresult cuCtxSetCurrent(void*) { return CUDA_SUCCESS; }
API CUresult cuCtxGetCurrent(void** ctx) {
    *ctx = &g_context_token;
    return CUDA_SUCCESS;
}
API CUresult cuCtxSynchronize() { return CUDA_SUCCESS; }

// Streams and events: every call runs to completion before it returns, so these only keep
// their handles apart.
API CUresult cuStreamCreate(void** s, unsigned int) {
    *s = &g_stream_token;
    return CUDA_SUCCESS;
}
API CUresult cuStreamDestroy_v2(void*) { return CUDA_SUCCESS; }
API CUresult cuStreamSynchronize(void*) { return CUDA_SUCCESS; }
API CUresult cuStreamWaitEvent(void*, void*, unsigned int) { return CUDA_SUCCESS; }
API CUresult cuEventCreate(void** e, unsigned int) {
    *e = &g_event_token;
    return CUDA_SUCCESS;
}
API CUresult cuEventDestroy_v2(void*) { return CUDA_SUCCESS; }
API CUresult cuEventRecord(void*, void*) { return CUDA_SUCCESS; }
API CUresult cuEventSynchronize(void*) { return CUDA_SUCCESS; }
API CUresult cuEventQuery(void*) { return CUDA_SUCCESS; }

API CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t n) {
    *p = tandem_emu::device_alloc(n);
    return *p ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}
API CUresult cuMemAllocAsync(CUdeviceptr* p, size_t n, void*) { return cuMemAlloc_v2(p, n); }
API CUresult cuMemFree_v2(CUdeviceptr p) {
    return tandem_emu::device_free(p) ? CUDA_SUCCESS
                                      : bad("free of an address never allocated",
                                            CUDA_ERROR_INVALID_VALUE);
}
API CUresult cuMemFreeAsync(CUdeviceptr p, void*) { return cuMemFree_v2(p); }
API CUresult cuMemHostAlloc(void** p, size_t n, unsigned int) {
    *p = std::malloc(n ? n : 1);
    return *p ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}
API CUresult cuMemFreeHost(void* p) {
    std::free(p);
    return CUDA_SUCCESS;
}
// Host memory registered with the device (page-locked and mapped): the same address serves
// both sides, as with unified addressing on a GPU. Only registered ranges are mapped.
std::mutex g_registered_lock;
std::map<uintptr_t, size_t> g_registered;
API CUresult cuMemHostRegister_v2(void* p, size_t n, unsigned int) {
    std::lock_guard<std::mutex> g(g_registered_lock);
    if (!p || !n) return bad("host register: empty range", CUDA_ERROR_INVALID_VALUE);
    if (!g_registered.emplace((uintptr_t)p, n).second)
        return bad("host register: registered twice", CUDA_ERROR_INVALID_VALUE);
    return CUDA_SUCCESS;
}
API CUresult cuMemHostUnregister(void* p) {
    std::lock_guard<std::mutex> g(g_registered_lock);
    return g_registered.erase((uintptr_t)p) ? CUDA_SUCCESS
                                            : bad("host unregister: not registered",
                                                  CUDA_ERROR_INVALID_VALUE);
}
API CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr* d, void* p, unsigned int) {
    std::lock_guard<std::mutex> g(g_registered_lock);
    auto it = g_registered.upper_bound((uintptr_t)p);
    if (it == g_registered.begin() || (uintptr_t)p >= std::prev(it)->first + std::prev(it)->second)
        return bad("host device pointer: not registered", CUDA_ERROR_INVALID_VALUE);
    *d = (CUdeviceptr)p;
    return CUDA_SUCCESS;
}
API CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
    return copy_checked((void*)dst, src, n, true, false);
}
API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, void*) {
    return cuMemcpyHtoD_v2(dst, src, n);
}
API CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) {
    return copy_checked(dst, (const void*)src, n, false, true);
}
API CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, void*) {
    return cuMemcpyDtoH_v2(dst, src, n);
}
API CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    return copy_checked((void*)dst, (const void*)src, n, true, true);
}
API CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, void*) {
    return cuMemcpyDtoD_v2(dst, src, n);
}
API CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char v, size_t n) {
    if (!tandem_emu::device_range(dst, n))
        return bad("memset: range is not inside one allocation", CUDA_ERROR_INVALID_VALUE);
    std::memset((void*)dst, v, n);
    return CUDA_SUCCESS;
}
API CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, void*) {
    return cuMemsetD8_v2(dst, v, n);
}

API CUresult cuModuleLoadData(void** module, const void* image) {
    const char* ptx = static_cast<const char*>(image);
    if (!std::strstr(ptx, ".version") || !std::strstr(ptx, ".target"))
        return bad("module image is not PTX", CUDA_ERROR_INVALID_IMAGE);
    *module = new Module{ptx};
    return CUDA_SUCCESS;
}
API CUresult cuModuleUnload(void* module) {
    delete static_cast<Module*>(module);
    return CUDA_SUCCESS;
}
// A kernel is found when the loaded PTX defines it (NVRTC compiled it) and the emulator has
// it (compiled for the host from the same source).
API CUresult cuModuleGetFunction(void** f, void* module, const char* name) {
    std::string entry = std::string(".entry ") + name + "(";
    if (static_cast<Module*>(module)->ptx.find(entry) == std::string::npos)
        return bad("kernel not in the module's PTX", CUDA_ERROR_NOT_FOUND);
    for (int i = 0; i < tandem_emu::kNumKernels; i++) {
        if (std::strcmp(tandem_emu::kKernels[i].name, name) == 0) {
            *f = (void*)&tandem_emu::kKernels[i];
            return CUDA_SUCCESS;
        }
    }
    return bad("kernel not compiled into the emulator", CUDA_ERROR_NOT_FOUND);
}
API CUresult cuFuncSetAttribute(void*, int, int) { return CUDA_SUCCESS; }
API CUresult cuFuncGetAttribute(int* v, int, void*) {
    *v = 0;
    return CUDA_SUCCESS;
}

API CUresult cuLaunchKernel(void* f, unsigned int gx, unsigned int gy, unsigned int gz,
                            unsigned int bx, unsigned int by, unsigned int bz, unsigned int smem,
                            void*, void** params, void** extra) {
    auto* k = static_cast<const tandem_emu::Kernel*>(f);
    if (extra != nullptr) return bad("launch: `extra` arguments are not emulated", 1);
    if (!gx || !gy || !gz || !bx || !by || !bz || gy > 65535 || gz > 65535)
        return bad("launch: empty or oversized grid", CUDA_ERROR_INVALID_VALUE);
    if ((unsigned long long)bx * by * bz > 1024 || bz > 64)
        return bad("launch: more than 1024 threads in a block", CUDA_ERROR_INVALID_VALUE);
    if (smem > 227 * 1024) return bad("launch: too much shared memory", 701);
    if (!k->check(params, k->name)) return CUDA_ERROR_ILLEGAL_ADDRESS;
    log_launch(k->name);
    // One launch at a time, as one stream runs them (and the block pool serves one launch).
    static std::mutex launching;
    std::lock_guard<std::mutex> one_at_a_time(launching);
    tandem_emu::Launch l;
    l.kernel = k;
    l.params = params;
    l.grid = {gx, gy, gz};
    l.block = {bx, by, bz};
    l.smem = smem;
    tandem_emu::pool().run(l);
    return CUDA_SUCCESS;
}

API CUresult cuGetErrorName(CUresult e, const char** s) {
    static const std::map<int, const char*> names = {
        {0, "CUDA_SUCCESS"},
        {1, "CUDA_ERROR_INVALID_VALUE"},
        {2, "CUDA_ERROR_OUT_OF_MEMORY"},
        {101, "CUDA_ERROR_INVALID_DEVICE"},
        {200, "CUDA_ERROR_INVALID_IMAGE"},
        {500, "CUDA_ERROR_NOT_FOUND"},
        {700, "CUDA_ERROR_ILLEGAL_ADDRESS"},
        {701, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"},
    };
    auto it = names.find(e);
    *s = it == names.end() ? "CUDA_ERROR_UNKNOWN" : it->second;
    return CUDA_SUCCESS;
}
API CUresult cuGetErrorString(CUresult e, const char** s) { return cuGetErrorName(e, s); }

// The kernels themselves and their table, generated by kernels::cuda::emu from kernels/cuda.
#include "kernels_gen.inc"
