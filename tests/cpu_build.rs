//! The ptxas report: every kernel on every compiled architecture, and no spills.
//! (Not built with the `emulator` feature: that build compiles no GPU code and has no report.)
#![cfg(not(feature = "emulator"))]

use tpfuse::build_info;

#[test]
fn every_kernel_is_built_for_every_architecture() {
    let archs: Vec<_> = build_info::architectures()
        .into_iter()
        .filter(|a| a.starts_with("sm_"))
        .collect();
    assert!(!archs.is_empty(), "no SASS architecture was compiled");
    let report = build_info::kernel_resources();
    let kernels = build_info::kernels();
    for expected in [
        "tpfuse::reduce_ranks_kernel<float>",
        "tpfuse::reduce_ranks_kernel<__half>",
        "tpfuse::reduce_ranks_kernel<__nv_bfloat16>",
    ] {
        assert!(
            kernels.iter().any(|k| k == expected),
            "{expected} missing from {kernels:?}"
        );
    }
    for arch in &archs {
        for kernel in &kernels {
            assert!(
                report
                    .iter()
                    .any(|r| r.arch == *arch && r.kernel == *kernel),
                "{kernel} has no ptxas entry for {arch}"
            );
        }
    }
    assert_eq!(report.len(), archs.len() * kernels.len());
}

#[test]
fn the_kernel_list_names_every_kernel_of_the_build() {
    // device::load_kernels loads the kernels of cuda/kernel_list.cu's list: one left out would
    // load at its first use, which may wait for every kernel running on its device.
    assert_eq!(
        build_info::kernel_count(),
        build_info::kernels().len(),
        "tpfuse_kernel_count() against the kernels of the ptxas report"
    );
}

#[test]
fn no_kernel_spills_registers() {
    let spills: Vec<_> = build_info::kernel_resources()
        .into_iter()
        .filter(|k| k.spills())
        .collect();
    assert!(spills.is_empty(), "kernels that spill: {spills:#?}");
}

#[test]
fn the_kernels_use_registers_and_no_stack() {
    // A zero register count would mean the report was not parsed.
    for k in build_info::kernel_resources() {
        assert!(k.registers > 0, "{k:?}");
        assert_eq!(k.stack, 0, "{} uses a stack frame on {}", k.kernel, k.arch);
    }
}

#[test]
fn the_runtime_version_is_known() {
    let (major, _) = build_info::cudart_version();
    assert!(major >= 12, "cudart {major}");
}

/// The CPU emulator counts each kernel's registers and static shared memory toward an SM's room
/// from cuda/emu/kernel_resources.inc (scripts/kernel-resources.sh writes it from this report).
/// It must never be kinder than the GPU: every kernel of the report on sm_90a, the architecture
/// the emulator models, is in the table with no fewer registers and no less static shared memory.
#[test]
fn the_emulators_kernel_table_covers_every_kernel_on_sm_90a() {
    let table: Vec<(String, u32, u32)> = include_str!("../cuda/emu/kernel_resources.inc")
        .lines()
        .filter_map(|line| {
            let inner = line.trim().strip_prefix("{\"")?.strip_suffix("},")?;
            let (name, rest) = inner.split_once("\", ")?;
            let (registers, smem) = rest.split_once(", ")?;
            Some((
                name.to_string(),
                registers.parse().ok()?,
                smem.parse().ok()?,
            ))
        })
        .collect();
    assert!(
        !table.is_empty(),
        "cuda/emu/kernel_resources.inc holds no kernel"
    );
    let rows: Vec<_> = build_info::kernel_resources()
        .into_iter()
        .filter(|k| k.arch == "sm_90a")
        .collect();
    for k in &rows {
        // "tpfuse::gemm::gemm_sm80_kernel<__half, ...>" -> "gemm_sm80_kernel".
        let base = k.kernel.split('<').next().unwrap_or_default();
        let base = base.rsplit("::").next().unwrap_or_default();
        let entry = table.iter().find(|(name, _, _)| name == base);
        let Some((_, registers, smem)) = entry else {
            panic!("{} is missing from cuda/emu/kernel_resources.inc (run scripts/kernel-resources.sh)", k.kernel);
        };
        assert!(
            *registers >= k.registers && *smem >= k.shared,
            "cuda/emu/kernel_resources.inc gives {base} {registers} registers and {smem} B of static \
             shared memory, ptxas {} and {} B for {} (run scripts/kernel-resources.sh)",
            k.registers,
            k.shared,
            k.kernel
        );
    }
}
