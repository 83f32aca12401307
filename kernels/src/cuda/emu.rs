//! The CUDA emulator: a CPU stand-in for the CUDA driver and cuBLAS (`kernels/emu/`), so the GPU
//! suite runs on machines without a GPU. A test double, named as one: it runs the real
//! `kernels/cuda/*.cu` sources (compiled for the host by the system C++ compiler, every CUDA
//! thread a fiber) behind a `libcuda.so` and `libcublas.so` that a child test process finds first
//! on `LD_LIBRARY_PATH`, while cudarc, NVRTC (real: the PTX must define each kernel) and all of
//! tandem's GPU code run unchanged. It checks arithmetic, launch shapes, arguments and device
//! memory bookkeeping (see `emu/driver.cpp` for what it catches); it proves nothing about speed
//! or the hardware's memory model, which `scripts/gpu-check.sh` on a GPU does.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::{err, fxhash, source, FUNCTIONS};
use crate::KernelError;

const HEADER: &str = include_str!("../../emu/cuda_emu.h");
const DRIVER: &str = include_str!("../../emu/driver.cpp");
const CUBLAS: &str = include_str!("../../emu/cublas.cpp");

/// The kernel sources for the host: each in its own namespace (they share helper names), its
/// `extern __shared__` array pointed at the block's dynamic shared memory, and the table the
/// driver looks kernels up in.
fn generated() -> String {
    let mut out = String::from("#define TANDEM_CUDA_EMU 1\n");
    let mut table = String::new();
    for (name, fns) in FUNCTIONS {
        let mut src = source(name).unwrap_or_default();
        while let Some(at) = src.find("extern __shared__ ") {
            let end = at + src[at..].find(';').unwrap_or(0);
            let decl = src[at + "extern __shared__ ".len()..end].trim().to_string();
            let (ty, var) = decl.split_once(' ').unwrap_or(("float", "smem"));
            let var = var.trim_end_matches("[]");
            let repl = format!("{ty}* {var} = static_cast<{ty}*>(tandem_emu::dynamic_smem())");
            src.replace_range(at..end, &repl);
        }
        out += &format!("namespace emu_{name} {{\n{src}\n}}\n");
        for f in fns.iter() {
            table += &format!("    TANDEM_EMU_KERNEL(emu_{name}, {f}),\n");
        }
    }
    let n = FUNCTIONS.iter().map(|(_, f)| f.len()).sum::<usize>();
    out + &format!(
        "namespace tandem_emu {{\nconst Kernel kKernels[] = {{\n{table}}};\nconst int kNumKernels = {n};\n}}\n"
    )
}

fn compile(dir: &Path, args: &[&str]) -> Result<(), KernelError> {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let out = Command::new(&cxx)
        .current_dir(dir)
        .args(args)
        .output()
        .map_err(|e| err(&format!("CUDA emulator: running {cxx}"), e))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(err(
            &format!("CUDA emulator: {cxx} {}", args.join(" ")),
            String::from_utf8_lossy(&out.stderr),
        ))
    }
}

/// Builds the emulator's `libcuda.so` and `libcublas.so` under `dir` (once per version of the
/// sources) and returns the directory that holds them.
pub fn build(dir: &Path) -> Result<PathBuf, KernelError> {
    let gen = generated();
    let key = fxhash(format!("{HEADER}{DRIVER}{CUBLAS}{gen}").as_bytes());
    let out = dir.join(format!("cuda-emu-{key:016x}"));
    if out.join("libcuda.so").exists() && out.join("libcublas.so").exists() {
        return Ok(out);
    }
    let tmp = dir.join(format!("cuda-emu-{key:016x}.{}", std::process::id()));
    let io = |e: std::io::Error| err("CUDA emulator: writing its sources", e);
    std::fs::create_dir_all(&tmp).map_err(io)?;
    for (name, text) in [
        ("cuda_emu.h", HEADER),
        ("driver.cpp", DRIVER),
        ("cublas.cpp", CUBLAS),
        ("kernels_gen.inc", gen.as_str()),
    ] {
        std::fs::write(tmp.join(name), text).map_err(io)?;
    }
    let common = ["-std=c++20", "-g", "-fPIC", "-shared", "-pthread", "-I."];
    compile(
        &tmp,
        &[&common[..], &["-O2", "driver.cpp", "-o", "libcuda.so"]].concat(),
    )?;
    compile(
        &tmp,
        &[
            &common[..],
            &[
                "-O3",
                "-march=native",
                "-fopenmp",
                "cublas.cpp",
                "-o",
                "libcublas.so",
            ],
        ]
        .concat(),
    )?;
    // Another process may have built the same version meanwhile: either copy will do.
    if std::fs::rename(&tmp, &out).is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    Ok(out)
}

/// The environment of a process that should find the emulator built in `lib` (by [`build`])
/// instead of a driver: the emulator first on `LD_LIBRARY_PATH`, then libnvrtc from
/// `~/.cache/tandem/nvrtc/lib` (where `.ci/run` puts it) and the inherited path;
/// `TANDEM_CUDA_EMU=1` so programs can say they run on it.
pub fn environment(lib: &Path) -> Vec<(String, String)> {
    let mut path = vec![lib.display().to_string()];
    if let Some(home) = std::env::var_os("HOME") {
        let nvrtc = PathBuf::from(home).join(".cache/tandem/nvrtc/lib");
        if nvrtc.is_dir() {
            path.push(nvrtc.display().to_string());
        }
    }
    if let Ok(p) = std::env::var("LD_LIBRARY_PATH") {
        path.push(p);
    }
    vec![
        ("LD_LIBRARY_PATH".into(), path.join(":")),
        ("TANDEM_CUDA_EMU".into(), "1".into()),
    ]
}

/// Runs the calling test binary's ignored GPU tests again in a child process on the emulator
/// (`TANDEM_GPU=1 TANDEM_CUDA_EMU=1`, the emulator first on `LD_LIBRARY_PATH`, libnvrtc from
/// `~/.cache/tandem/nvrtc/lib` or the path), skipping tests whose names contain `skip` (the
/// caller). Returns the child's output; `Err` with it when a test failed or fewer or more than
/// `expected` tests passed.
pub fn run_gpu_tests(build_dir: &Path, skip: &str, expected: usize) -> Result<String, String> {
    let lib = build(build_dir).map_err(|e| e.to_string())?;
    eprintln!("CUDA emulator: {}", lib.display());
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let out = Command::new(exe)
        .args(["--include-ignored", "--test-threads=1", "--skip", skip])
        .env("TANDEM_GPU", "1")
        .envs(environment(&lib))
        .output()
        .map_err(|e| e.to_string())?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let passed = text.lines().filter(|l| l.ends_with("... ok")).count();
    if !out.status.success() {
        Err(format!(
            "the GPU tests failed on the CUDA emulator:\n{text}"
        ))
    } else if passed != expected {
        Err(format!(
            "{passed} GPU tests passed on the CUDA emulator, not {expected}:\n{text}"
        ))
    } else {
        Ok(text)
    }
}
