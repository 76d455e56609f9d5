//! How the kernels' floating point is compiled, on a GPU (`gpu-tests`) and on the CPU emulator
//! (`emulator`) alike: a multiply and an add written apart are two roundings (nvcc
//! `--fmad=false`; the emulator's g++ `-ffp-contract=off`), `fmaf` one. The bits the docs
//! promise (fused = unfused, the host's exact references) rest on the two builds agreeing.

mod common;
use common::gpu::gpu_stream;

gpu_tests! {
    /// (1 + 2^-12)² - (1 + 2^-11) is 2^-24 exactly: 0 when the product is rounded first (it
    /// rounds to even, to 1 + 2^-11), 2^-24 when fused.
    a_multiply_and_an_add_written_apart_are_not_contracted => {
        let (separate, fused) = tpfuse::build_info::fp_contraction(&gpu_stream())
            .expect("the contraction probe");
        assert_eq!(separate.to_bits(), 0f32.to_bits(), "a * b + c was contracted: {separate:e}");
        assert_eq!(fused, 2f32.powi(-24), "fmaf(a, b, c) was not fused");
    };
}
