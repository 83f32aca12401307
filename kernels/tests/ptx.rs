//! Every CUDA kernel compiles to PTX through NVRTC for sm_80 (A100) and sm_90 (H100/H200),
//! on any machine with libnvrtc — no GPU needed — so a kernel that does not compile fails CI.
//! `.ci/run` installs libnvrtc from the `nvidia-cuda-nvrtc` wheel and puts it on
//! LD_LIBRARY_PATH.
#![cfg(feature = "cuda")]

#[test]
fn every_kernel_compiles_to_ptx_for_sm80_and_sm90() {
    for arch in ["sm_80", "sm_90"] {
        let ptx = kernels::cuda::compile_all(arch).unwrap_or_else(|e| panic!("{arch}: {e}"));
        let all: String = ptx.iter().map(|(_, p)| p.as_str()).collect();
        assert!(all.contains(&format!(".target {arch}")), "{arch}");
        for f in [
            "embedding_bf16",
            "rms_norm",
            "gather_rows",
            "rope",
            "silu_mul",
            "dequant_q4_0",
            "dequant_q4_1",
            "dequant_q8_0",
            "dequant_q4_k",
            "dequant_q6_k",
            "paged_attention",
            "store_kv",
            "pack_kv",
            "unpack_kv",
            "copy_pages",
            "page_from_host",
            "argmax_rows",
            "sample_top_k_top_p",
        ] {
            assert!(
                all.contains(&format!(".entry {f}(")),
                "{arch}: no kernel {f}"
            );
        }
    }
}
