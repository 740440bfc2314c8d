//! Backend selection: a machine without CUDA never panics; `auto` falls back with one line saying
//! why, an explicit `--backend cuda` and `selftest` exit 2 with the reason. (On a machine with a
//! usable GPU the same tests check that the CUDA backend is picked instead.)

use assert_cmd::Command;

fn bin() -> Command {
    Command::cargo_bin("nvfp4-probe").expect("binary")
}

fn gpu() -> Option<String> {
    nvfp4_probe::backend::open_cuda().err()
}

#[test]
fn auto_backend_says_where_it_runs() {
    let out = bin()
        .args(["run", "--layers", "0..1", "--seq-len", "16", "--quiet"])
        .output()
        .expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(matches!(out.status.code(), Some(0) | Some(1)), "{err}");
    match gpu() {
        Some(why) => assert!(err.contains(&format!("backend: cpu ({why})")), "{err}"),
        None => assert!(err.contains("backend: cuda on "), "{err}"),
    }
}

#[test]
fn explicit_cuda_without_a_device_exits_2_with_the_reason() {
    let out = bin()
        .args([
            "run",
            "--layers",
            "0..1",
            "--seq-len",
            "16",
            "--quiet",
            "--backend",
            "cuda",
        ])
        .output()
        .expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    match gpu() {
        Some(why) => {
            assert_eq!(out.status.code(), Some(2), "{err}");
            assert!(
                err.contains("--backend cuda:") && err.contains(&why),
                "{err}"
            );
            assert!(!err.contains("panicked"), "{err}");
        }
        None => assert!(matches!(out.status.code(), Some(0) | Some(1)), "{err}"),
    }
}

#[test]
fn selftest_needs_a_gpu_and_refuses_the_cpu_backend() {
    let out = bin()
        .args(["selftest", "--backend", "cpu"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--backend cuda"));
    if let Some(why) = gpu() {
        let out = bin().args(["selftest"]).output().expect("run");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains(&why), "{err}");
    }
}
