//! Regenerate the shipped kernel images `kernels/bin/sm_90.cubin` and `kernels/bin/sm_100.cubin`
//! (with the SHA-256 of the sources and options they were made from) using NVRTC itself, with
//! exactly the options the backend uses at run time. Needs only `libnvrtc.so.13` on the loader
//! path (e.g. from the `nvidia-cuda-nvrtc` wheel: `LD_LIBRARY_PATH=<wheel>/nvidia/cu13/lib`), no GPU:
//!
//! ```sh
//! cargo run --release --example build_kernels
//! ```

use nvfp4_probe::backend::cuda::image;

fn main() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/bin");
    for (arch, _, _) in image::SHIPPED {
        let bin = match image::compile(arch) {
            Ok(b) => b,
            Err(e) => {
                eprintln!("{arch}: {e}");
                std::process::exit(1);
            }
        };
        let cubin = dir.join(format!("{arch}.cubin"));
        std::fs::write(&cubin, &bin).expect("write the CUBIN");
        std::fs::write(
            dir.join(format!("{arch}.sha256")),
            image::fingerprint(arch) + "\n",
        )
        .expect("write the fingerprint");
        println!("wrote {} ({} bytes)", cubin.display(), bin.len());
    }
}
