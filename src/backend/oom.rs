//! A device allocation that fails during a run, said as what it is. The CUDA backend's
//! allocations fail with the driver's `CUDA_ERROR_OUT_OF_MEMORY` inside a backend error
//! ("cuda: alloc N B: DriverError(CUDA_ERROR_OUT_OF_MEMORY, …)"), which read as "backend
//! unavailable" although the backend works and only the run is too big for the device. The
//! runner passes every op's error through [`explain`]: an allocation failure becomes
//! [`Error::DeviceMemory`] (exit 2, like every error) naming the op, the bytes asked, the
//! device's free and total memory, and the options that make the run smaller.

use crate::Error;

/// The driver's name of the error, as cudarc's `DriverError` prints it.
const OOM: &str = "CUDA_ERROR_OUT_OF_MEMORY";

/// Whether `e` is a failed device allocation, with the bytes it asked for when the message
/// says ("alloc N B"): `Some(None)` for an out-of-memory error of unknown size.
pub fn failed_alloc(e: &Error) -> Option<Option<u64>> {
    let Error::Backend(m) = e else {
        return None;
    };
    if !m.contains(OOM) {
        return None;
    }
    let asked = m
        .split("alloc ")
        .nth(1)
        .and_then(|r| r.split_once(" B"))
        .and_then(|(n, _)| n.trim().parse().ok());
    Some(asked)
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

/// The error of an allocation of `asked` bytes (if known) that failed while op `op` ran, with
/// the device's (free, total) bytes at that point (if known).
pub fn describe(op: &str, asked: Option<u64>, mem: Option<(u64, u64)>) -> Error {
    let what = match asked {
        Some(b) => format!("an allocation of {} ({b} bytes)", gib(b)),
        None => "an allocation".to_string(),
    };
    let room = match mem {
        Some((free, total)) => format!("{} free of {}", gib(free), gib(total)),
        None => "the free memory unknown".to_string(),
    };
    Error::DeviceMemory(format!(
        "the device ran out of memory while running op {op}: {what} failed with {room}; \
         make the run smaller: a device budget with --mem-gib GIB or query chunks with \
         --chunk N, fewer tokens (--seq-len) or fewer layers (--layers)"
    ))
}

/// `e` as the run reports it: a failed device allocation becomes [`Error::DeviceMemory`] with
/// the device's free and total memory now (the failed op's buffers are back in the run's pool,
/// which the driver still counts as used); any other error is returned unchanged.
pub fn explain(e: Error, op: &str, backend: &super::Backend) -> Error {
    let Some(asked) = failed_alloc(&e) else {
        return e;
    };
    describe(op, asked, backend.device_memory())
}

#[cfg(test)]
mod tests {
    /// No device: the estimate and the explanation without device memory.
    const CPU: crate::backend::Backend = crate::backend::Backend::Cpu;
    use super::*;

    /// The backend's message of a failed allocation (`Gpu::alloc`: "cuda: {what}: {driver
    /// error:?}", what = "alloc {bytes} B") as the H200 printed it at 65,536 tokens.
    fn alloc_failure(bytes: u64) -> Error {
        Error::Backend(format!(
            "cuda: alloc {bytes} B: DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")"
        ))
    }

    #[test]
    fn an_allocation_failure_names_the_op_the_bytes_and_what_to_try() {
        let e = explain(alloc_failure(68_719_476_736), "L3.attn", &CPU);
        assert!(matches!(e, Error::DeviceMemory(_)), "{e:?}");
        assert_eq!(e.exit_code(), 2);
        let m = e.to_string();
        for want in [
            "ran out of memory",
            "L3.attn",
            "64.00 GiB",
            "68719476736 bytes",
            "--mem-gib",
            "--chunk",
        ] {
            assert!(m.contains(want), "`{want}` missing: {m}");
        }
        assert!(!m.contains("unavailable"), "{m}");
        let m = describe("x", Some(1 << 30), Some((512 << 20, 140 << 30))).to_string();
        assert!(
            m.contains("1.00 GiB") && m.contains("0.50 GiB free of 140.00 GiB"),
            "{m}"
        );
    }

    #[test]
    fn other_errors_pass_unchanged_and_an_unknown_size_is_said() {
        let other = Error::Backend(
            "cuda: launch attn_core: DriverError(CUDA_ERROR_LAUNCH_FAILED, \"x\")".into(),
        );
        let m = other.to_string();
        assert_eq!(explain(other, "op", &CPU).to_string(), m);
        let u = Error::usage("--chunk 0");
        assert!(matches!(explain(u, "op", &CPU), Error::Usage(_)));
        let e = Error::Backend(
            "cuda: staging: DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")".into(),
        );
        assert_eq!(failed_alloc(&e), Some(None));
        assert!(explain(e, "op", &CPU)
            .to_string()
            .contains("an allocation failed"));
        assert_eq!(failed_alloc(&alloc_failure(17)), Some(Some(17)));
    }
}
