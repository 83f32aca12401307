//! Selecting a device: a GPU asked for where there is none — no driver, or a build without the
//! `cuda` feature — is a clear error at start, never a panic (cudarc itself panics when libcuda
//! cannot be loaded). Runs in both builds; skipped on a GPU machine (`TANDEM_GPU` set).

use kernels::Device;

#[test]
fn asking_for_a_gpu_where_there_is_none_is_a_clear_error() {
    if std::env::var_os("TANDEM_GPU").is_some() {
        return;
    }
    let e = Device::parse("cuda:0").unwrap_err().to_string();
    let why = if cfg!(feature = "cuda") {
        "no driver (libcuda)"
    } else {
        "built without CUDA"
    };
    assert!(e.contains(why), "cuda:0 → {e}");
    for (name, want) in [
        ("cuda:x", "expected cuda:N"),
        ("tpu", "unknown device \"tpu\""),
    ] {
        let e = Device::parse(name).unwrap_err().to_string();
        assert!(e.contains(want), "{name} → {e}");
    }
    assert!(Device::parse("cpu").is_ok());
}
