//! A plain row-major f32 tensor. BF16 storage is modelled by rounding values to BF16 while
//! keeping them in f32 (exact: every BF16 value is an f32).

#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl Tensor {
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Self {
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
            data: vec![0.0; n],
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
    pub fn with_last_dim(&self, n: usize, data: Vec<f32>) -> Tensor {
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
