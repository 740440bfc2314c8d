//! Swizzled scale-factor layouts of the serving kernels (NVFP4.md §5). Checkpoints store scales
//! linear; only engines swizzle.
