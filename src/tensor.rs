//! A plain row-major f32 tensor. BF16 storage is modelled by rounding values to BF16 while
//! keeping them in f32 (exact: every BF16 value is an f32).
//!
//! The values ([`Data`]) live on the host, on a device, or both: the CUDA backend leaves an op's
//! output on the device and the next op reads it there, so activations cross the bus only when
//! host code reads them. Reading `data` (through `Deref`) fetches device-only values once and
//! keeps them; writing (`DerefMut`) drops the device copy, so the two never disagree.

use std::sync::{Arc, Mutex, OnceLock};

/// Values held in device memory (implemented by the CUDA backend). Read-only once made.
#[allow(clippy::len_without_is_empty)]
pub trait DeviceValues: Send + Sync {
    /// Device address of the first element.
    fn ptr(&self) -> u64;
    /// Number of f32 elements.
    fn len(&self) -> usize;
    /// The device state this memory belongs to (`Gpu::id`).
    fn owner(&self) -> usize;
    /// Copy the values to the host (waits for the work that writes them).
    fn to_host(&self) -> std::result::Result<Vec<f32>, String>;
}

static DEVICE_ERROR: Mutex<Option<String>> = Mutex::new(None);

/// The first failure of a device → host read made through `Deref` (which cannot return an
/// error: the values read as NaN instead); the runner checks after every op.
pub fn take_device_error() -> Option<String> {
    DEVICE_ERROR.lock().ok().and_then(|mut e| e.take())
}

/// A tensor's values: on the host, on a device, or both (then equal).
pub struct Data {
    host: OnceLock<Vec<f32>>,
    dev: OnceLock<Arc<dyn DeviceValues>>,
    /// Whether every value is a BF16 value, when a producer knows it (device rounding).
    bf16_exact: OnceLock<bool>,
}

impl Data {
    /// Values that exist only on a device so far.
    pub fn from_device(d: Arc<dyn DeviceValues>) -> Data {
        let dev = OnceLock::new();
        let _ = dev.set(d);
        Data {
            host: OnceLock::new(),
            dev,
            bf16_exact: OnceLock::new(),
        }
    }
    /// Number of elements (without fetching device values).
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> usize {
        match (self.host.get(), self.dev.get()) {
            (Some(h), _) => h.len(),
            (None, Some(d)) => d.len(),
            (None, None) => 0,
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The device copy, if any.
    pub fn device(&self) -> Option<&Arc<dyn DeviceValues>> {
        self.dev.get()
    }
    /// Attach a device copy of host values (ignored if one is attached already).
    pub fn attach_device(&self, d: Arc<dyn DeviceValues>) {
        debug_assert_eq!(d.len(), self.len());
        let _ = self.dev.set(d);
    }
    /// Which values these are while they live: the device copy's allocation, else the host
    /// values' (None when empty). Clones sharing a device copy have the same identity; a copy
    /// attached or fetched later may change it, never make two different values equal.
    pub fn identity(&self) -> Option<(bool, usize)> {
        if let Some(d) = self.dev.get() {
            return Some((true, Arc::as_ptr(d) as *const u8 as usize));
        }
        let h = self.host.get()?;
        (!h.is_empty()).then_some((false, h.as_ptr() as usize))
    }
    /// Whether the values are on the host already.
    pub fn on_host(&self) -> bool {
        self.host.get().is_some()
    }
    /// Known BF16-exactness (set by producers that rounded on the device).
    pub fn known_bf16_exact(&self) -> Option<bool> {
        self.bf16_exact.get().copied()
    }
    pub fn set_bf16_exact(&self, exact: bool) {
        let _ = self.bf16_exact.set(exact);
    }
    fn host_values(&self) -> &Vec<f32> {
        self.host.get_or_init(|| match self.dev.get() {
            Some(d) => d.to_host().unwrap_or_else(|e| {
                if let Ok(mut slot) = DEVICE_ERROR.lock() {
                    slot.get_or_insert(e);
                }
                vec![f32::NAN; d.len()]
            }),
            None => Vec::new(),
        })
    }
    /// The host values, taking them out.
    pub fn into_vec(mut self) -> Vec<f32> {
        self.host_values();
        self.host.take().unwrap_or_default()
    }
}

impl From<Vec<f32>> for Data {
    fn from(v: Vec<f32>) -> Data {
        let host = OnceLock::new();
        let _ = host.set(v);
        Data {
            host,
            dev: OnceLock::new(),
            bf16_exact: OnceLock::new(),
        }
    }
}

impl FromIterator<f32> for Data {
    fn from_iter<I: IntoIterator<Item = f32>>(it: I) -> Data {
        Data::from(it.into_iter().collect::<Vec<f32>>())
    }
}

impl<'a> IntoIterator for &'a Data {
    type Item = &'a f32;
    type IntoIter = std::slice::Iter<'a, f32>;
    fn into_iter(self) -> Self::IntoIter {
        self.host_values().iter()
    }
}

impl std::ops::Deref for Data {
    type Target = Vec<f32>;
    fn deref(&self) -> &Vec<f32> {
        self.host_values()
    }
}

impl std::ops::DerefMut for Data {
    fn deref_mut(&mut self) -> &mut Vec<f32> {
        self.host_values();
        // the host values are about to change: the device copy and what was known go stale
        self.dev.take();
        self.bf16_exact.take();
        self.host.get_mut().expect("host values fetched above")
    }
}

impl Clone for Data {
    fn clone(&self) -> Data {
        Data {
            host: self.host.clone(),
            dev: self.dev.clone(),
            bf16_exact: self.bf16_exact.clone(),
        }
    }
}

impl std::fmt::Debug for Data {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.host_values().fmt(f)
    }
}

impl PartialEq for Data {
    fn eq(&self, o: &Data) -> bool {
        self.host_values() == o.host_values()
    }
}

impl PartialEq<Vec<f32>> for Data {
    fn eq(&self, o: &Vec<f32>) -> bool {
        self.host_values() == o
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub data: Data,
}

impl Tensor {
    pub fn new(shape: Vec<usize>, data: impl Into<Data>) -> Self {
        let data = data.into();
        assert_eq!(
            shape.iter().product::<usize>(),
            data.len(),
            "shape {shape:?} does not match {} elements",
            data.len()
        );
        Tensor { shape, data }
    }
    pub fn zeros(shape: Vec<usize>) -> Self {
        let n = shape.iter().product();
        Tensor {
            shape,
            data: vec![0.0; n].into(),
        }
    }
    pub fn numel(&self) -> usize {
        self.data.len()
    }
    /// Size of the last dimension (1 for a scalar).
    pub fn cols(&self) -> usize {
        *self.shape.last().unwrap_or(&1)
    }
    /// Product of all but the last dimension.
    pub fn rows(&self) -> usize {
        if self.shape.is_empty() {
            1
        } else {
            self.numel() / self.cols().max(1)
        }
    }
    /// Rows `ids` of a 2-D tensor, [ids.len(), cols]; `None` when an id is past the last row
    /// or the tensor is not 2-D.
    pub fn select_rows(&self, ids: &[u32]) -> Option<Tensor> {
        if self.shape.len() != 2 || ids.iter().any(|&i| i as usize >= self.shape[0]) {
            return None;
        }
        let mut out = Vec::with_capacity(ids.len() * self.cols());
        for &i in ids {
            out.extend_from_slice(self.row(i as usize));
        }
        Some(Tensor::new(vec![ids.len(), self.cols()], out))
    }
    pub fn row(&self, r: usize) -> &[f32] {
        let c = self.cols();
        &self.data[r * c..(r + 1) * c]
    }
    pub fn row_mut(&mut self, r: usize) -> &mut [f32] {
        let c = self.cols();
        &mut self.data[r * c..(r + 1) * c]
    }
    pub fn reshape(mut self, shape: Vec<usize>) -> Self {
        assert_eq!(shape.iter().product::<usize>(), self.numel());
        self.shape = shape;
        self
    }
    /// A tensor of this one's shape with the last dimension replaced by `n` (a linear layer's output).
    pub fn with_last_dim(&self, n: usize, data: impl Into<Data>) -> Tensor {
        let mut shape = self.shape.clone();
        if let Some(last) = shape.last_mut() {
            *last = n;
        }
        Tensor::new(shape, data)
    }
    /// Round every element to BF16 in place.
    pub fn round_bf16(&mut self) {
        crate::numerics::bf16::round_slice(&mut self.data);
    }
    pub fn rounded_bf16(mut self) -> Self {
        self.round_bf16();
        self
    }
}

#[cfg(test)]
mod data_tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Device values kept in host memory, counting how often they are read back.
    struct Fake {
        v: Vec<f32>,
        reads: Arc<AtomicUsize>,
        fail: bool,
    }
    impl DeviceValues for Fake {
        fn ptr(&self) -> u64 {
            self.v.as_ptr() as u64
        }
        fn len(&self) -> usize {
            self.v.len()
        }
        fn owner(&self) -> usize {
            7
        }
        fn to_host(&self) -> std::result::Result<Vec<f32>, String> {
            self.reads.fetch_add(1, Ordering::SeqCst);
            if self.fail {
                Err("cuda: copy to host: simulated".into())
            } else {
                Ok(self.v.clone())
            }
        }
    }

    fn fake(v: Vec<f32>, fail: bool) -> (Data, Arc<AtomicUsize>) {
        let reads = Arc::new(AtomicUsize::new(0));
        let d = Data::from_device(Arc::new(Fake {
            v,
            reads: reads.clone(),
            fail,
        }));
        (d, reads)
    }

    #[test]
    fn device_values_are_read_once_and_only_when_host_code_reads_them() {
        let (d, reads) = fake(vec![1.5, -2.0, 3.25], false);
        let t = Tensor::new(vec![3, 1], d);
        // shape checks, clones and the device address need no read
        assert_eq!(t.numel(), 3);
        assert_eq!(t.rows(), 3);
        let c = t.clone();
        assert!(c.data.device().is_some() && !c.data.on_host());
        assert_eq!(reads.load(Ordering::SeqCst), 0);
        // the first host read fetches, later ones do not
        assert_eq!(t.data[1], -2.0);
        assert_eq!(t.data.iter().sum::<f32>(), 2.75);
        assert_eq!(reads.load(Ordering::SeqCst), 1);
        assert!(t.data.on_host() && t.data.device().is_some());
        // the clone made before the read reads on its own
        assert_eq!(c.data, vec![1.5, -2.0, 3.25]);
        assert_eq!(reads.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn writing_drops_the_device_copy_and_what_was_known() {
        let (d, _) = fake(vec![1.0, 2.0], false);
        d.set_bf16_exact(true);
        let mut t = Tensor::new(vec![2], d);
        assert_eq!(t.data.known_bf16_exact(), Some(true));
        t.data[0] = 1.0000001;
        assert!(
            t.data.device().is_none(),
            "stale device copy kept after a write"
        );
        assert_eq!(t.data.known_bf16_exact(), None);
        assert_eq!(t.data, vec![1.0000001, 2.0]);
        // rounding goes through the same path
        t.round_bf16();
        assert_eq!(t.data, vec![1.0, 2.0]);
    }

    #[test]
    fn a_failed_read_gives_nan_and_is_reported_once() {
        let (d, _) = fake(vec![1.0; 4], false);
        drop(d);
        let (d, _) = fake(vec![1.0; 4], true);
        assert!(d.iter().all(|v| v.is_nan()));
        let e = take_device_error().expect("the failure is recorded");
        assert!(e.contains("simulated"), "{e}");
        assert!(take_device_error().is_none());
    }

    #[test]
    fn host_values_convert_and_attach_a_device_copy() {
        let d: Data = vec![0.5f32, 0.25].into();
        assert!(d.on_host() && d.device().is_none() && d.len() == 2);
        let (dev, reads) = fake(vec![0.5, 0.25], false);
        d.attach_device(dev.device().unwrap().clone());
        assert!(d.device().is_some());
        assert_eq!(d.clone().into_vec(), vec![0.5, 0.25]);
        assert_eq!(
            reads.load(Ordering::SeqCst),
            0,
            "host values are read from the host"
        );
        let e: Data = std::iter::empty::<f32>().collect();
        assert!(e.is_empty());
    }
}
