//! Build script: CUDA kernels -> one static library; bindgen -> NCCL and kernel C ABI.
//!
//! 1. Finds nvcc (NVCC, CUDA_HOME, CUDA_PATH, nvcc on PATH, /usr/local/cuda).
//! 2. Compiles every `cuda/*.cu` for the architectures in `TPFUSE_CUDA_ARCHS` (default:
//!    sm_80, sm_86, sm_89, sm_90a, sm_100a, sm_120a and compute_80 PTX), trimmed to what this
//!    nvcc supports, with `-Xptxas -v`; the compiler is configured by `cc`, which also archives
//!    the objects and links the static CUDA runtime. The ptxas resource report (registers,
//!    spills, stack, shared memory per kernel and architecture) is kept in OUT_DIR for
//!    `tpfuse doctor --build`.
//! 3. Runs bindgen on `nccl.h` (loaded at run time through libloading) and `cuda/tpfuse.h`.
//!
//! When nvcc, nccl.h or libclang is missing it fails with one message that says what is
//! missing and how to install it.
//!
//! With the `emulator` feature, step 2 is replaced: every `cuda/*.cu` and `cuda/emu/*.cpp` is
//! compiled as host C++ (`-x c++ -DTPFUSE_EMULATOR`) into `libtpfuse_emu.so`, the CPU emulator
//! with tpfuse's kernels (no CUDA toolkit, driver or GPU needed; no ptxas report), and bindgen
//! also reads `cuda/emu/tpfuse_emu.h`. The compile is a generated script, OUT_DIR/emu/build.sh
//! CUDA_DIR OUT, that scripts/mutants.sh reruns on mutated copies of cuda/.
//! `TPFUSE_CUDA_DIR` makes either build read another copy of cuda/.

use std::env;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

const DEFAULT_ARCHS: &str = "sm_80,sm_86,sm_89,sm_90a,sm_100a,sm_120a,compute_80";
/// The CUDA 13.0 and NCCL wheels from PyPI that build tpfuse without a system toolkit; the same
/// pins as scripts/setup.sh (tests/cpu_build.rs checks).
const WHEELS: &str = "nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 \
     nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 nvidia-nccl-cu13==2.28.9";

/// What to run when something is missing.
fn install_hint() -> String {
    format!(
        "To install what is missing, one of:
  - a CUDA toolkit from NVIDIA (13.0 or newer; 12.8 or newer for a driver older than R580),
    with its bin/ on PATH (or CUDA_HOME set; cudarc's build runs the `nvcc` on PATH), and NCCL
    (libnccl-dev, or NCCL_HOME);
  - no root needed, the pinned wheels from PyPI (found in python3's site-packages):
      python3 -m pip install {WHEELS}
      export PATH=\"$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])')/cu13/bin:$PATH\"
  - in a checkout of tpfuse: eval \"$(scripts/setup.sh)\" (the wheels into .venv, and libclang).
libclang for bindgen: apt-get install libclang-dev (or set LIBCLANG_PATH)."
    )
}

fn main() {
    for var in [
        "NVCC",
        "CUDA_HOME",
        "CUDA_PATH",
        "PATH",
        "NCCL_INCLUDE_DIR",
        "NCCL_HOME",
        "TPFUSE_CUDA_ARCHS",
        "LIBCLANG_PATH",
        "TPFUSE_CUDA_DIR",
        "TPFUSE_EMU_CXXFLAGS",
        "TPFUSE_SKIP_KERNELS",
        "TPFUSE_EMU_KERNEL_CXXFLAGS",
        "CXX",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let cuda_dir =
        PathBuf::from(env::var("TPFUSE_CUDA_DIR").unwrap_or_else(|_| "cuda".to_string()));
    println!("cargo:rerun-if-changed={}", cuda_dir.display());
    println!("cargo:rerun-if-changed=build.rs");
    let emulator = env::var_os("CARGO_FEATURE_EMULATOR").is_some();
    if emulator && env::var_os("CARGO_FEATURE_GPU_TESTS").is_some() {
        eprintln!(
            "\ntpfuse build: the features `emulator` (kernels on the CPU) and `gpu-tests` (kernels \
             on a GPU) exclude each other: a run with both could pass emulated kernels off as GPU \
             results. Enable one.\n"
        );
        std::process::exit(1);
    }
    if emulator {
        build_for_emulator(&cuda_dir);
        return;
    }

    let nvcc = find_nvcc();
    let nccl_include = nvcc.as_ref().ok().and_then(|n| find_nccl_include(Some(n)));
    let libclang = check_libclang();

    let mut missing = Vec::new();
    if let Err(e) = &nvcc {
        missing.push(e.clone());
    }
    if nvcc.is_ok() && nccl_include.is_none() {
        missing.push(
            "nccl.h (searched NCCL_INCLUDE_DIR, NCCL_HOME/include, the CUDA toolkit's include, \
             the nvidia-nccl wheel beside it, /usr/include, /usr/local/include)"
                .to_string(),
        );
    }
    if let Err(e) = &libclang {
        missing.push(e.clone());
    }
    if !missing.is_empty() {
        eprintln!(
            "\ntpfuse build: missing {}.\n{}\n",
            missing.join("; and "),
            install_hint()
        );
        std::process::exit(1);
    }
    let nvcc = nvcc.unwrap_or_else(|_| unreachable!());
    let nccl_include = nccl_include.unwrap_or_else(|| unreachable!());
    let cuda_root = nvcc
        .parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .unwrap_or_default();
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));

    let archs = if skip_kernels() {
        write_report(&[], &out);
        vec!["none (TPFUSE_SKIP_KERNELS)".to_string()]
    } else {
        let archs = select_archs(&nvcc);
        compile_kernels(&nvcc, &cuda_root, &nccl_include, &archs, &cuda_dir, &out);
        archs
    };
    generate_bindings(&cuda_root.join("include"), &nccl_include, &cuda_dir, &out);

    println!("cargo:rustc-env=TPFUSE_BUILD_ARCHS={}", archs.join(","));
    println!("cargo:rustc-env=TPFUSE_BUILD_NVCC={}", nvcc.display());
    println!(
        "cargo:rustc-env=TPFUSE_BUILD_NVCC_VERSION={}",
        nvcc_release(&nvcc)
    );
    println!(
        "cargo:rustc-env=TPFUSE_BUILD_NCCL_HEADER={}",
        nccl_include.join("nccl.h").display()
    );
}

fn run_capture(cmd: &mut Command) -> Option<String> {
    let out = cmd.output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

fn find_nvcc() -> Result<PathBuf, String> {
    let executable = |p: PathBuf| p.is_file().then_some(p);
    let candidates = [
        env::var_os("NVCC").map(PathBuf::from),
        env::var_os("CUDA_HOME").map(|d| PathBuf::from(d).join("bin/nvcc")),
        env::var_os("CUDA_PATH").map(|d| PathBuf::from(d).join("bin/nvcc")),
        env::var_os("PATH").and_then(|path| {
            env::split_paths(&path)
                .map(|d| d.join("nvcc"))
                .find(|p| p.is_file())
        }),
        Some(PathBuf::from("/usr/local/cuda/bin/nvcc")),
    ];
    candidates
        .into_iter()
        .flatten()
        .chain(wheel_dirs().into_iter().map(|d| d.join("cu13/bin/nvcc")))
        .find_map(executable)
        .ok_or_else(|| {
            "nvcc (searched NVCC, CUDA_HOME, CUDA_PATH, PATH, /usr/local/cuda, the nvidia wheels \
             of python3 and of the crate's .venv)"
                .to_string()
        })
}

/// The `nvidia` package directories of the CUDA wheels: python3's (`pip install
/// nvidia-cuda-nvcc==...`) and the crate's own .venv (scripts/setup.sh).
fn wheel_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = run_capture(
        Command::new("python3").args(["-c", "import nvidia\nfor p in nvidia.__path__: print(p)"]),
    )
    .map(|out| out.lines().map(PathBuf::from).collect())
    .unwrap_or_default();
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/lib");
    if let Ok(pythons) = std::fs::read_dir(venv) {
        dirs.extend(
            pythons
                .flatten()
                .map(|p| p.path().join("site-packages/nvidia")),
        );
    }
    dirs
}

/// The directory holding nccl.h: explicit settings first, then the toolkit, the Python
/// wheel layout next to it (`site-packages/nvidia/{cu13,nccl}`), then the system.
/// Cargo's job count for this build (NUM_JOBS), else the cores.
fn jobs() -> usize {
    env::var("NUM_JOBS")
        .ok()
        .and_then(|n| n.parse().ok())
        .or_else(|| std::thread::available_parallelism().ok().map(usize::from))
        .unwrap_or(1)
        .max(1)
}

/// `f` of every item, at most `jobs` at a time, in the items' order.
fn in_parallel<T: Sync, R: Send>(items: &[T], jobs: usize, f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let done = std::sync::Mutex::new(Vec::with_capacity(items.len()));
    std::thread::scope(|s| {
        for _ in 0..jobs.min(items.len()) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(item) = items.get(i) else { break };
                let r = f(item);
                done.lock().expect("a compile thread panicked").push((i, r));
            });
        }
    });
    let mut done = done.into_inner().expect("a compile thread panicked");
    done.sort_by_key(|(i, _)| *i);
    done.into_iter().map(|(_, r)| r).collect()
}

fn find_nccl_include(nvcc: Option<&Path>) -> Option<PathBuf> {
    let root = nvcc
        .and_then(|n| n.parent()?.parent())
        .map(Path::to_path_buf);
    let mut dirs: Vec<PathBuf> = Vec::new();
    dirs.extend(env::var_os("NCCL_INCLUDE_DIR").map(PathBuf::from));
    dirs.extend(env::var_os("NCCL_HOME").map(|d| PathBuf::from(d).join("include")));
    if let Some(root) = root {
        dirs.push(root.join("include"));
        if let Some(nvidia) = root.parent() {
            dirs.push(nvidia.join("nccl/include"));
        }
    }
    dirs.push("/usr/include".into());
    dirs.push("/usr/local/include".into());
    dirs.into_iter().find(|d| d.join("nccl.h").is_file())
}

fn check_libclang() -> Result<(), String> {
    // bindgen panics when it cannot load libclang; turn that into one clear message.
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let found = std::panic::catch_unwind(bindgen::clang_version);
    std::panic::set_hook(prev);
    match found {
        Ok(v) if v.parsed.is_some() => Ok(()),
        _ => Err(
            "libclang for bindgen (apt-get install libclang-dev, or set LIBCLANG_PATH)".to_string(),
        ),
    }
}

fn nvcc_release(nvcc: &Path) -> String {
    run_capture(Command::new(nvcc).arg("--version"))
        .and_then(|v| {
            v.lines()
                .find_map(|l| l.split("release ").nth(1))
                .map(|r| r.split(',').next().unwrap_or(r).trim().to_string())
        })
        .unwrap_or_else(|| "unknown".to_string())
}

/// The requested architectures that this nvcc can build ("sm_90a" needs sm_90 in
/// `--list-gpu-code`, "compute_80" needs compute_80 in `--list-gpu-arch`).
fn select_archs(nvcc: &Path) -> Vec<String> {
    let requested = env::var("TPFUSE_CUDA_ARCHS").unwrap_or_else(|_| DEFAULT_ARCHS.to_string());
    let codes = run_capture(Command::new(nvcc).arg("--list-gpu-code")).unwrap_or_default();
    let virt = run_capture(Command::new(nvcc).arg("--list-gpu-arch")).unwrap_or_default();
    let mut chosen = Vec::new();
    for raw in requested
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        let arch = if raw.starts_with("sm_") || raw.starts_with("compute_") {
            raw.to_string()
        } else {
            format!("sm_{raw}")
        };
        let base = arch.trim_end_matches(['a', 'f']);
        let list = if arch.starts_with("compute_") {
            &virt
        } else {
            &codes
        };
        if list.split_whitespace().any(|c| c == base) {
            chosen.push(arch);
        } else {
            println!("cargo:warning=tpfuse: {arch} skipped, this nvcc cannot build it");
        }
    }
    if chosen.is_empty() {
        eprintln!(
            "\ntpfuse build: none of the architectures in TPFUSE_CUDA_ARCHS ({requested}) is \
             supported by {}.\n",
            nvcc.display()
        );
        std::process::exit(1);
    }
    chosen
}

/// The `-gencode` of an architecture. The other 8.x GPUs (sm_86, sm_89) take their SASS from
/// compute_80's PTX: the kernels use no instruction newer than sm_80 and test no
/// `__CUDA_ARCH__`, so compute_80's PTX serves them, and nvcc's front end runs once for the
/// three instead of three times (ptxas still compiles and schedules for each GPU).
fn gencode(arch: &str) -> String {
    match arch.strip_prefix("compute_") {
        Some(n) => format!("-gencode=arch=compute_{n},code=compute_{n}"),
        None => {
            let n = arch.trim_start_matches("sm_");
            let virtual_arch = match n {
                "86" | "89" => "80",
                n => n,
            };
            format!("-gencode=arch=compute_{virtual_arch},code=sm_{n}")
        }
    }
}

fn compile_kernels(
    nvcc: &Path,
    cuda_root: &Path,
    nccl_include: &Path,
    archs: &[String],
    cuda_dir: &Path,
    out: &Path,
) {
    let mut sources: Vec<PathBuf> = std::fs::read_dir(cuda_dir)
        .expect("the crate has a cuda/ directory")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    sources.sort();

    let mut build = cc::Build::new();
    build
        .cuda(true)
        .cudart("static")
        .compiler(nvcc)
        .no_default_flags(true)
        .include(cuda_dir)
        .include(nccl_include)
        .flag("-std=c++17")
        .flag("-O3")
        .flag("-Xcompiler=-fPIC")
        .flag("-Xptxas=-v")
        // No implicit contraction of a multiply and an add into an FMA: the kernels' bits are
        // those the emulator (g++ -ffp-contract=off) and the host references compute; an FMA
        // is written as fmaf (cuda/fp_contraction.cu, tests/gpu_arithmetic.rs).
        .flag("--fmad=false")
        .flag("--expt-relaxed-constexpr")
        .warnings(false);
    for arch in archs {
        build.flag(gencode(arch));
    }
    let compiler = build.get_compiler();

    // Each .cu is compiled by its own nvcc, with the command cc configured, so that the ptxas
    // report of each file is captured whole (nvcc's own --threads would interleave it); at most
    // cargo's job count (NUM_JOBS) at a time.
    let compile = |src: &PathBuf| {
        let obj = out.join(format!(
            "{}.o",
            src.file_stem().unwrap_or_default().to_string_lossy()
        ));
        let output = compiler
            .to_command()
            .arg("-c")
            .arg(src)
            .arg("-o")
            .arg(&obj)
            .output()
            .unwrap_or_else(|e| panic!("tpfuse build: could not run {}: {e}", nvcc.display()));
        (src.clone(), obj, output)
    };
    // The largest files first (the longest compiles: gemm_all_reduce.cu takes a third of the
    // build), so that no long compile starts last; the results in file order.
    let mut by_size = sources.clone();
    by_size.sort_by_key(|p| std::cmp::Reverse(std::fs::metadata(p).map_or(0, |m| m.len())));
    let mut results = in_parallel(&by_size, jobs(), compile);
    results.sort_by(|a, b| a.0.cmp(&b.0));

    let mut rows = Vec::new();
    for (src, obj, output) in &results {
        let stderr = String::from_utf8_lossy(&output.stderr);
        if !output.status.success() {
            eprintln!("{stderr}");
            eprintln!("\ntpfuse build: nvcc failed on {}\n", src.display());
            std::process::exit(1);
        }
        rows.extend(parse_ptxas(&stderr, src));
        build.object(obj);
    }
    for row in &rows {
        if row.spill_stores > 0 || row.spill_loads > 0 {
            println!(
                "cargo:warning=tpfuse: {} spills on {} ({} B stores, {} B loads)",
                row.kernel, row.arch, row.spill_stores, row.spill_loads
            );
        }
    }
    write_report(&rows, out);

    // Only objects: cc archives them and prints the static cudart link line.
    build.compile("tpfuse_kernels");
    // The wheel layout keeps libcudart_static.a in <root>/lib; a toolkit in lib64 or
    // targets/<arch>-linux/lib.
    for dir in [
        "lib",
        "lib64",
        "targets/x86_64-linux/lib",
        "targets/sbsa-linux/lib",
    ] {
        let d = cuda_root.join(dir);
        if d.join("libcudart_static.a").is_file() {
            println!("cargo:rustc-link-search=native={}", d.display());
        }
    }
    for lib in ["stdc++", "dl", "rt", "pthread"] {
        println!("cargo:rustc-link-lib={lib}");
    }
}

struct PtxasRow {
    arch: String,
    kernel: String,
    registers: u32,
    spill_stores: u32,
    spill_loads: u32,
    stack: u32,
    shared: u32,
    source: String,
}

/// Parses `ptxas -v` output: "Compiling entry function 'K' for 'sm_X'", then the
/// "Function properties for K" line (stack, spills), then "Used N registers ... smem" (and,
/// where K calls functions out of line, "N bytes cumulative stack size"). ptxas lists an
/// out-of-line function's own properties once, after whichever entry it compiled first (or
/// before any): those count for every entry of the file on the architecture compiled around
/// them (all of them when none is), the most stack and the sum of spills, so that a callee's
/// frame or spills never go unseen.
fn parse_ptxas(text: &str, src: &Path) -> Vec<PtxasRow> {
    let number_before = |line: &str, unit: &str| -> u32 {
        line.split(',')
            .find(|part| part.contains(unit))
            .and_then(|part| part.split_whitespace().find_map(|w| w.parse().ok()))
            .unwrap_or(0)
    };
    let mut rows: Vec<PtxasRow> = Vec::new();
    // (arch or None, stack, spill stores, spill loads) of the out-of-line functions.
    let mut callees: Vec<(Option<String>, u32, u32, u32)> = Vec::new();
    let mut current: Option<PtxasRow> = None;
    let mut mangled = String::new();
    let mut properties_of_entry = false;
    for line in text.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            if let Some(row) = current.take() {
                rows.push(row);
            }
            let mut parts = rest.split('\'');
            mangled = parts.next().unwrap_or_default().to_string();
            let arch = parts.nth(1).unwrap_or_default().to_string();
            current = Some(PtxasRow {
                arch,
                kernel: mangled.clone(),
                registers: 0,
                spill_stores: 0,
                spill_loads: 0,
                stack: 0,
                shared: 0,
                source: src.display().to_string(),
            });
        } else if let Some(name) = line.split("Function properties for ").nth(1) {
            properties_of_entry = current.is_some() && name.trim() == mangled;
        } else if line.contains("spill stores") {
            let (stack, stores, loads) = (
                number_before(line, "stack frame"),
                number_before(line, "spill stores"),
                number_before(line, "spill loads"),
            );
            match current.as_mut() {
                Some(row) if properties_of_entry => {
                    row.stack = row.stack.max(stack);
                    row.spill_stores += stores;
                    row.spill_loads += loads;
                }
                row => callees.push((row.map(|r| r.arch.clone()), stack, stores, loads)),
            }
        } else if let Some(row) = current.as_mut() {
            if line.contains("Used") && line.contains("registers") {
                row.registers = number_before(line, "registers");
                row.shared = number_before(line, "smem");
                row.stack = row.stack.max(number_before(line, "cumulative stack size"));
            }
        }
    }
    rows.extend(current);
    for (arch, stack, stores, loads) in callees {
        for row in rows
            .iter_mut()
            .filter(|r| arch.as_ref().map_or(true, |a| *a == r.arch))
        {
            row.stack = row.stack.max(stack);
            row.spill_stores += stores;
            row.spill_loads += loads;
        }
    }
    rows
}

fn demangle(names: &[String]) -> Vec<String> {
    let joined = names.join("\n");
    let child = Command::new("c++filt")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn();
    let demangled = child.ok().and_then(|mut c| {
        use std::io::Write;
        c.stdin.take()?.write_all(joined.as_bytes()).ok()?;
        let out = c.wait_with_output().ok()?;
        Some(String::from_utf8_lossy(&out.stdout).into_owned())
    });
    match demangled {
        Some(d) if d.lines().count() == names.len() => d.lines().map(short_kernel_name).collect(),
        _ => names.to_vec(),
    }
}

/// "void ns::(anonymous namespace)::k<float>(args)" -> "ns::k<float>".
fn short_kernel_name(demangled: &str) -> String {
    let name = demangled.replace("(anonymous namespace)::", "");
    let name = name.strip_prefix("void ").unwrap_or(&name);
    name.split('(').next().unwrap_or(name).to_string()
}

/// OUT_DIR/ptxas_report.tsv: arch, kernel, registers, spill stores, spill loads, stack, smem.
fn write_report(rows: &[PtxasRow], out: &Path) {
    let pretty = demangle(&rows.iter().map(|r| r.kernel.clone()).collect::<Vec<_>>());
    let mut tsv =
        String::from("arch\tkernel\tregisters\tspill_stores\tspill_loads\tstack\tsmem\tsource\n");
    for (row, name) in rows.iter().zip(pretty) {
        let _ = writeln!(
            tsv,
            "{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}",
            row.arch,
            name,
            row.registers,
            row.spill_stores,
            row.spill_loads,
            row.stack,
            row.shared,
            row.source
        );
    }
    std::fs::write(out.join("ptxas_report.tsv"), tsv).expect("write ptxas report");
}

/// bindgen on nccl.h and on the kernels' C ABI. `cuda_include` holds the cuda_runtime.h that
/// nccl.h includes: the toolkit's, or the emulator's shim.
fn generate_bindings(cuda_include: &Path, nccl_include: &Path, cuda_dir: &Path, out: &Path) {
    let nccl = bindgen::Builder::default()
        .header(nccl_include.join("nccl.h").display().to_string())
        .clang_arg(format!("-I{}", nccl_include.display()))
        .clang_arg(format!("-I{}", cuda_include.display()))
        .allowlist_function("nccl.*")
        .allowlist_type("nccl.*")
        .allowlist_var("NCCL_.*")
        .dynamic_library_name("NcclLib")
        .dynamic_link_require_all(false)
        .derive_default(true)
        .layout_tests(false)
        .generate()
        .unwrap_or_else(|e| {
            eprintln!(
                "\ntpfuse build: bindgen could not read {}: {e}\n",
                nccl_include.join("nccl.h").display()
            );
            std::process::exit(1);
        });
    nccl.write_to_file(out.join("nccl_bindings.rs"))
        .expect("write NCCL bindings");

    let kernels = bindgen::Builder::default()
        .header(cuda_dir.join("tpfuse.h").display().to_string())
        .allowlist_function("tpfuse_.*")
        .allowlist_type("tpfuse_.*")
        .allowlist_var("TPFUSE_.*")
        .layout_tests(false)
        .generate()
        .unwrap_or_else(|e| {
            eprintln!("\ntpfuse build: bindgen could not read cuda/tpfuse.h: {e}\n");
            std::process::exit(1);
        });
    kernels
        .write_to_file(out.join("kernel_bindings.rs"))
        .expect("write kernel bindings");
}

/// `TPFUSE_SKIP_KERNELS=1`: bindings only, no kernel compiled (nvcc or the emulator's C++):
/// for `cargo check`, `clippy` and `doc`, which do not link (CI's lints and docs). A build
/// that links fails.
fn skip_kernels() -> bool {
    env::var("TPFUSE_SKIP_KERNELS").is_ok_and(|v| v == "1")
}

/// The `emulator` build: cuda/ as host C++ in libtpfuse_emu.so (see the module docs).
fn build_for_emulator(cuda_dir: &Path) {
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let nvcc = find_nvcc().ok();
    // nccl.h only for bindgen and nccl_config.cu; no toolkit is needed.
    let nccl_include = find_nccl_include(nvcc.as_deref());
    let mut missing = Vec::new();
    if nccl_include.is_none() {
        missing.push(
            "nccl.h (searched NCCL_INCLUDE_DIR, NCCL_HOME/include, the CUDA toolkit, \
             /usr/include, /usr/local/include)"
                .to_string(),
        );
    }
    if let Err(e) = check_libclang() {
        missing.push(e);
    }
    if !Path::new("/usr/include/boost/context/detail/fcontext.hpp").is_file() {
        missing.push("boost.context (apt-get install libboost-context-dev)".to_string());
    }
    if !missing.is_empty() {
        eprintln!(
            "\ntpfuse build (emulator): missing {}.\n{}\n",
            missing.join("; and "),
            install_hint()
        );
        std::process::exit(1);
    }
    let nccl_include = nccl_include.unwrap_or_else(|| unreachable!());
    let emu = out.join("emu");
    std::fs::create_dir_all(&emu).expect("create OUT_DIR/emu");
    let cxx = cc::Build::new()
        .cpp(true)
        .get_compiler()
        .path()
        .to_path_buf();
    let script = emulator_build_script(&cxx, &nccl_include);
    let script_path = emu.join("build.sh");
    std::fs::write(&script_path, script).expect("write OUT_DIR/emu/build.sh");
    let compiled = skip_kernels()
        || Command::new("bash")
            .arg(&script_path)
            .arg(cuda_dir)
            .arg(&emu)
            .status()
            .unwrap_or_else(|e| panic!("tpfuse build: could not run bash: {e}"))
            .success();
    if !compiled {
        eprintln!(
            "\ntpfuse build: compiling {} for the emulator failed (see above)\n",
            cuda_dir.display()
        );
        std::process::exit(1);
    }
    println!("cargo:rustc-link-search=native={}", emu.display());
    println!("cargo:rustc-link-lib=dylib=tpfuse_emu");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", emu.display());
    println!("cargo:rustc-env=TPFUSE_EMU_LIB_DIR={}", emu.display());

    generate_bindings(&cuda_dir.join("emu/include"), &nccl_include, cuda_dir, &out);
    let emu_bindings = bindgen::Builder::default()
        .header(cuda_dir.join("emu/tpfuse_emu.h").display().to_string())
        .allowlist_function("tpfuse_emu_.*")
        .allowlist_type("tpfuse_emu_.*")
        .allowlist_var("TPFUSE_EMU_.*")
        .derive_default(true)
        .layout_tests(false)
        .generate()
        .unwrap_or_else(|e| {
            eprintln!("\ntpfuse build: bindgen could not read cuda/emu/tpfuse_emu.h: {e}\n");
            std::process::exit(1);
        });
    emu_bindings
        .write_to_file(out.join("emu_bindings.rs"))
        .expect("write emulator bindings");

    // No GPU code was built: an empty ptxas report, and the build facts say so.
    write_report(&[], &out);
    println!("cargo:rustc-env=TPFUSE_BUILD_ARCHS=");
    println!(
        "cargo:rustc-env=TPFUSE_BUILD_NVCC=none (CPU emulator: {})",
        cxx.display()
    );
    println!("cargo:rustc-env=TPFUSE_BUILD_NVCC_VERSION=none");
    println!(
        "cargo:rustc-env=TPFUSE_BUILD_NCCL_HEADER={}",
        nccl_include.join("nccl.h").display()
    );
}

/// The compile of the emulator library as a script: `build.sh CUDA_DIR OUT` builds
/// OUT/libtpfuse_emu.so from CUDA_DIR/*.cu and CUDA_DIR/emu/*.cpp, one compiler per core.
/// Read from the environment when it runs (build.rs and the scripts that rerun it):
/// `TPFUSE_EMU_CXXFLAGS`, flags added to every unit and to the link
/// (`scripts/emulator-asan.sh`: `-fsanitize=address`); `TPFUSE_EMU_KERNEL_CXXFLAGS`, added to
/// the kernel units `cuda/*.cu` only; `TPFUSE_EMU_KEEP_OBJECTS=1`, compile only the units
/// whose object is not already in OUT/obj, with the precompiled headers in OUT/pch
/// (`scripts/mutants.sh`: a mutant starts from the baseline's objects less those its edits
/// reach, with the same flags).
fn emulator_build_script(cxx: &Path, nccl_include: &Path) -> String {
    format!(
        r#"#!/usr/bin/env bash
# Generated by tpfuse's build.rs (feature `emulator`): cuda/ as host C++ for the CPU emulator.
# usage: build.sh CUDA_DIR OUT   -> OUT/libtpfuse_emu.so
#   TPFUSE_EMU_CXXFLAGS         added to every unit and to the link
#   TPFUSE_EMU_KERNEL_CXXFLAGS  added to the kernel units (CUDA_DIR/*.cu)
#   TPFUSE_EMU_KEEP_OBJECTS=1   compile only the units without an object in OUT/obj (same flags)
set -euo pipefail
cuda=$(cd "$1" && pwd)
out=$2
mkdir -p "$out/obj"
[ "${{TPFUSE_EMU_KEEP_OBJECTS:-0}}" = 1 ] || rm -rf "$out"/obj/*.o "$out/pch"
read -r -a extra <<<"${{TPFUSE_EMU_CXXFLAGS:-}}"
read -r -a kernel_extra <<<"${{TPFUSE_EMU_KERNEL_CXXFLAGS:-}}"
flags=(-std=c++17 -O2 -g -fPIC -fno-strict-aliasing -ffp-contract=off -DTPFUSE_EMULATOR
       -Wno-unknown-pragmas -I"$cuda/emu/include" -I"$cuda" -I"$cuda/emu" -I"{nccl}" "${{extra[@]}}")
# cargo's job count (NUM_JOBS, set for build scripts), else the cores.
jobs_max=${{NUM_JOBS:-$(nproc 2>/dev/null || echo 2)}}
# The standard headers (emu/std_headers.hpp, some 55,000 lines), precompiled once for the kernel
# units' flags and once for the others' (made when a unit first needs it, or again when the
# list changed; a build that keeps objects keeps them, so it must use the same flags): 0.5 to
# 1.5 s less per unit at -O0. g++ takes a .gch only when the flags allow it, and otherwise
# parses the header (-Winvalid-pch says so).
pch() {{
  local dir="$out/pch/$1"
  shift
  if [ ! -f "$dir/std_headers.hpp.gch" ] || ! cmp -s "$cuda/emu/std_headers.hpp" "$dir/std_headers.hpp"; then
    mkdir -p "$dir"
    cp "$cuda/emu/std_headers.hpp" "$dir/std_headers.hpp"
    "{cxx}" "${{flags[@]}}" "$@" -x c++-header "$dir/std_headers.hpp" -o "$dir/next.gch"
    mv "$dir/next.gch" "$dir/std_headers.hpp.gch"
  fi
}}
for src in "$cuda"/*.cu "$cuda"/emu/*.cpp; do
  obj="$out/obj/$(basename "$src").o"
  [ -f "$obj" ] && continue
  unit=()
  kind=host
  # A kernel's locals (its registers) start as the 0xFE pattern, not the zeros of a fresh
  # fiber stack: a kernel that reads a register it never wrote gets garbage, as a GPU may give.
  case $src in *.cu) unit=(-ftrivial-auto-var-init=pattern "${{kernel_extra[@]}}") kind=kernel ;; esac
  pch "$kind" "${{unit[@]}}"
  while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n; done
  "{cxx}" -x c++ "${{flags[@]}}" "${{unit[@]}}" -Winvalid-pch -include "$out/pch/$kind/std_headers.hpp" -c "$src" -o "$obj" &
done
while [ -n "$(jobs -rp)" ]; do wait -n; done
for src in "$cuda"/*.cu "$cuda"/emu/*.cpp; do
  [ -f "$out/obj/$(basename "$src").o" ] || {{ echo "emulator build: $src failed" >&2; exit 1; }}
done
# The soname is libcuda.so: cudarc's dlopen("libcuda.so") then finds this library, already
# loaded by the binary that links it, and takes the emulated driver API from it.
"{cxx}" -shared -o "$out/libtpfuse_emu.so.tmp" "$out"/obj/*.o -Wl,-soname,libcuda.so -lboost_context -pthread "${{extra[@]}}"
mv "$out/libtpfuse_emu.so.tmp" "$out/libtpfuse_emu.so"
ln -sf libtpfuse_emu.so "$out/libcuda.so"
"#,
        cxx = cxx.display(),
        nccl = nccl_include.display(),
    )
}
