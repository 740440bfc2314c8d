//! The kernels' machine code: shipped CUBINs for the architectures we serve on, NVRTC otherwise.
//!
//! Compiling `kernels/*.cu` with NVRTC at start cost a fresh GPU machine several seconds (the
//! front end, then the driver's JIT of the PTX); a warm machine reads its PTX cache. So the
//! binary carries CUBINs (SASS, no JIT) made by NVRTC itself from these very sources with these
//! very options, for `sm_90` (H100/H200) and `sm_100` (B200), under `kernels/bin/`. Each CUBIN is
//! used only when the SHA-256 of (sources, options) recorded beside it equals the one of the
//! sources compiled into this binary; otherwise, on another architecture, or when the driver
//! refuses the image, the kernels are compiled by NVRTC as before (PTX cached under
//! `~/.cache/nvfp4-probe`). A unit test fails when a kernel source changes and the shipped
//! images were not regenerated (`cargo run --release --example build_kernels` with an NVRTC
//! library on the loader path; no GPU needed).

use std::path::PathBuf;

use cudarc::nvrtc::{result as nrt, sys as nsys};
use sha2::{Digest, Sha256};

/// The device source, embedded in the binary.
pub const KERNEL_SOURCE: [&str; 4] = [
    include_str!("../../../kernels/formats.cu"),
    include_str!("../../../kernels/quant.cu"),
    include_str!("../../../kernels/stats.cu"),
    include_str!("../../../kernels/layer.cu"),
];

/// Architectures with a shipped image, and the image with the hash it was made from.
pub const SHIPPED: [(&str, &[u8], &str); 2] = [
    (
        "sm_90",
        include_bytes!("../../../kernels/bin/sm_90.cubin"),
        include_str!("../../../kernels/bin/sm_90.sha256"),
    ),
    (
        "sm_100",
        include_bytes!("../../../kernels/bin/sm_100.cubin"),
        include_str!("../../../kernels/bin/sm_100.sha256"),
    ),
];

/// NVRTC options of every compile: exact IEEE arithmetic (no FTZ, no FMA contraction, correctly
/// rounded division and square root), which the bit-for-bit agreement with the CPU reference
/// relies on; then the target (`compute_XY` gives PTX, `sm_XY` a CUBIN).
fn options(arch: &str) -> Vec<String> {
    vec![
        "--ftz=false".into(),
        "--prec-sqrt=true".into(),
        "--prec-div=true".into(),
        "--fmad=false".into(),
        format!("--gpu-architecture={arch}"),
    ]
}

/// The whole source as one translation unit.
pub fn source() -> String {
    KERNEL_SOURCE.concat()
}

/// SHA-256 (hex) of the sources and the options for `arch` (`sm_90`, `compute_90`, …).
pub fn fingerprint(arch: &str) -> String {
    let mut h = Sha256::new();
    h.update(source().as_bytes());
    for o in options(arch) {
        h.update(b"\0");
        h.update(o.as_bytes());
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// The shipped CUBIN for a device of compute capability `maj.min`, when it was made from the
/// sources in this binary.
pub fn shipped(maj: i32, min: i32) -> Option<&'static [u8]> {
    let arch = format!("sm_{maj}{min}");
    SHIPPED
        .iter()
        .find(|(a, _, _)| *a == arch)
        .filter(|(a, img, hash)| !img.is_empty() && hash.trim() == fingerprint(a))
        .map(|(_, img, _)| *img)
}

fn nvrtc_err(what: &str, e: impl std::fmt::Debug) -> crate::Error {
    crate::Error::Backend(format!("cuda: {what}: {e:?}"))
}

/// Compile the sources for `arch` with NVRTC: PTX text for `compute_XY`, a CUBIN for `sm_XY`.
pub fn compile(arch: &str) -> crate::Result<Vec<u8>> {
    let src = std::ffi::CString::new(source())
        .map_err(|_| nvrtc_err("kernel source", "contains a NUL byte"))?;
    let prog = nrt::create_program(&src, None).map_err(|e| nvrtc_err("NVRTC create", e))?;
    let opts = options(arch);
    let out = (|| {
        if let Err(e) = unsafe { nrt::compile_program(prog, &opts) } {
            let log = unsafe { nrt::get_program_log(prog) }
                .map(|l| {
                    let b: Vec<u8> = l.iter().map(|&c| c as u8).take_while(|&c| c != 0).collect();
                    String::from_utf8_lossy(&b).into_owned()
                })
                .unwrap_or_default();
            return Err(nvrtc_err(
                &format!("NVRTC compile for {arch}"),
                format!("{e:?}: {log}"),
            ));
        }
        if arch.starts_with("sm_") {
            let mut n = 0usize;
            unsafe { nsys::nvrtcGetCUBINSize(prog, &mut n) }
                .result()
                .map_err(|e| nvrtc_err("NVRTC CUBIN size", e))?;
            let mut buf = vec![0u8; n];
            unsafe { nsys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut _) }
                .result()
                .map_err(|e| nvrtc_err("NVRTC CUBIN", e))?;
            Ok(buf)
        } else {
            let ptx = unsafe { nrt::get_ptx(prog) }.map_err(|e| nvrtc_err("NVRTC PTX", e))?;
            Ok(ptx
                .iter()
                .map(|&c| c as u8)
                .take_while(|&c| c != 0)
                .collect())
        }
    })();
    let _ = unsafe { nrt::destroy_program(prog) };
    out
}

/// Where a PTX compiled at run time is cached (per source and architecture).
pub fn ptx_cache_path(arch: &str) -> Option<PathBuf> {
    let dir = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?
        .join("nvfp4-probe");
    Some(dir.join(format!("kernels-{arch}-{}.ptx", &fingerprint(arch)[..16])))
}

/// The cached PTX text, when present.
pub fn cached_ptx(arch: &str) -> Option<String> {
    let t = std::fs::read_to_string(ptx_cache_path(arch)?).ok()?;
    t.contains(".entry").then_some(t)
}

/// Best effort: a cache that cannot be written only costs the next start a compile.
pub fn store_ptx(arch: &str, ptx: &str) {
    let Some(path) = ptx_cache_path(arch) else {
        return;
    };
    if let Some(d) = path.parent() {
        let _ = std::fs::create_dir_all(d);
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    if std::fs::write(&tmp, ptx).is_ok() && std::fs::rename(&tmp, &path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shipped images were made from the kernel sources in this tree with these options:
    /// editing a `.cu` file without regenerating them fails here (and the binary would fall back
    /// to NVRTC at run time rather than run stale machine code).
    #[test]
    fn shipped_images_match_the_sources() {
        for (arch, img, hash) in SHIPPED {
            assert!(
                img.len() > 4 && &img[..4] == b"\x7fELF",
                "kernels/bin/{arch}.cubin is not an ELF image"
            );
            assert_eq!(
                hash.trim(),
                fingerprint(arch),
                "kernels/bin/{arch}.cubin was made from other kernel sources or options: \
                 regenerate with `cargo run --release --example build_kernels` (needs libnvrtc.so.13)"
            );
        }
    }

    #[test]
    fn fingerprint_depends_on_architecture() {
        assert_ne!(fingerprint("sm_90"), fingerprint("sm_100"));
        assert_eq!(fingerprint("sm_90").len(), 64);
    }
}
