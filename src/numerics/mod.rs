//! Number formats, bit-exact. The CPU code here IS the reference: every other path
//! (the served emulation, CUDA kernels) is tested against it.
//!
//! One file per format. Decoders are total functions (every byte has a value, NaN included);
//! encoders say which producer's behaviour they reproduce.

pub mod bf16;
pub mod e2m1;
pub mod e4m3;
pub mod fp8_block;
pub mod mxfp4;
pub mod nvfp4;
pub mod swizzle;
pub mod ue8m0;
