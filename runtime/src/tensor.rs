//! Host-side tensors: what goes into and comes out of a [`Session`](crate::Session).

use std::fmt;

/// The element type of a tensor, on the host or on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 8-bit boolean.
    Bool,
    /// Unsigned 8-bit integer.
    U8,
    /// Unsigned 16-bit integer.
    U16,
    /// Unsigned 32-bit integer.
    U32,
    /// Unsigned 64-bit integer.
    U64,
    /// Signed 8-bit integer.
    I8,
    /// Signed 16-bit integer.
    I16,
    /// Signed 32-bit integer.
    I32,
    /// Signed 64-bit integer.
    I64,
    /// 32-bit float.
    F32,
    /// 64-bit float.
    F64,
}

impl DType {
    /// The MLIR spelling of the type (`f32`, `i64`, `i1`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::Bool => "i1",
            DType::U8 => "ui8",
            DType::U16 => "ui16",
            DType::U32 => "ui32",
            DType::U64 => "ui64",
            DType::I8 => "i8",
            DType::I16 => "i16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::F32 => "f32",
            DType::F64 => "f64",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The elements of a host tensor, row-major.
#[derive(Debug, Clone, PartialEq)]
pub enum TensorData {
    /// 32-bit floats.
    F32(Vec<f32>),
    /// 32-bit signed integers.
    I32(Vec<i32>),
    /// 64-bit signed integers.
    I64(Vec<i64>),
}

impl TensorData {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            TensorData::F32(_) => DType::F32,
            TensorData::I32(_) => DType::I32,
            TensorData::I64(_) => DType::I64,
        }
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        match self {
            TensorData::F32(data) => data.len(),
            TensorData::I32(data) => data.len(),
            TensorData::I64(data) => data.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A host tensor whose element count does not match its shape, or that is
/// read as the wrong element type.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TensorError {
    /// The data has a different number of elements than the shape.
    #[error("tensor of shape {shape:?} needs {expected} elements, got {actual}")]
    Length {
        /// The declared shape.
        shape: Vec<usize>,
        /// The element count the shape implies.
        expected: usize,
        /// The element count supplied.
        actual: usize,
    },
    /// The shape's element count overflows `usize`.
    #[error("tensor shape {shape:?} is too large")]
    Overflow {
        /// The declared shape.
        shape: Vec<usize>,
    },
    /// The tensor holds another element type than the one asked for.
    #[error("tensor holds {actual} elements, not {expected}")]
    DType {
        /// The element type asked for.
        expected: DType,
        /// The element type held.
        actual: DType,
    },
}

/// A dense row-major tensor in host memory. A scalar has an empty shape.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    shape: Vec<usize>,
    data: TensorData,
}

impl HostTensor {
    /// A tensor of `shape` holding `data`, checking the element count.
    pub fn new(shape: Vec<usize>, data: TensorData) -> Result<Self, TensorError> {
        let expected = shape
            .iter()
            .try_fold(1usize, |product, &dim| product.checked_mul(dim))
            .ok_or_else(|| TensorError::Overflow { shape: shape.clone() })?;
        if expected != data.len() {
            return Err(TensorError::Length { shape, expected, actual: data.len() });
        }
        Ok(Self { shape, data })
    }

    /// An `f32` tensor.
    pub fn f32(shape: Vec<usize>, data: Vec<f32>) -> Result<Self, TensorError> {
        Self::new(shape, TensorData::F32(data))
    }

    /// An `i32` tensor.
    pub fn i32(shape: Vec<usize>, data: Vec<i32>) -> Result<Self, TensorError> {
        Self::new(shape, TensorData::I32(data))
    }

    /// An `i64` tensor.
    pub fn i64(shape: Vec<usize>, data: Vec<i64>) -> Result<Self, TensorError> {
        Self::new(shape, TensorData::I64(data))
    }

    /// An `f32` scalar (shape `[]`).
    pub fn scalar_f32(value: f32) -> Self {
        Self { shape: Vec::new(), data: TensorData::F32(vec![value]) }
    }

    /// The dimensions.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }

    /// The elements.
    pub fn data(&self) -> &TensorData {
        &self.data
    }

    /// The elements and shape, by value.
    pub fn into_parts(self) -> (Vec<usize>, TensorData) {
        (self.shape, self.data)
    }

    /// The elements as `f32`s.
    pub fn into_f32(self) -> Result<Vec<f32>, TensorError> {
        match self.data {
            TensorData::F32(data) => Ok(data),
            other => Err(mismatch(DType::F32, &other)),
        }
    }

    /// The elements as `i32`s.
    pub fn into_i32(self) -> Result<Vec<i32>, TensorError> {
        match self.data {
            TensorData::I32(data) => Ok(data),
            other => Err(mismatch(DType::I32, &other)),
        }
    }

    /// The elements as `i64`s.
    pub fn into_i64(self) -> Result<Vec<i64>, TensorError> {
        match self.data {
            TensorData::I64(data) => Ok(data),
            other => Err(mismatch(DType::I64, &other)),
        }
    }
}

fn mismatch(expected: DType, actual: &TensorData) -> TensorError {
    TensorError::DType { expected, actual: actual.dtype() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_must_match_data() {
        assert!(HostTensor::f32(vec![2, 2], vec![0.0; 4]).is_ok());
        let err = HostTensor::f32(vec![2, 3], vec![0.0; 4]).unwrap_err();
        assert_eq!(err.to_string(), "tensor of shape [2, 3] needs 6 elements, got 4");
        let scalar = HostTensor::scalar_f32(1.5);
        assert!(scalar.shape().is_empty());
        assert_eq!(scalar.into_f32(), Ok(vec![1.5]));
    }

    #[test]
    fn overflowing_shape_is_rejected() {
        let err = HostTensor::i64(vec![usize::MAX, 2], vec![]).unwrap_err();
        assert!(matches!(err, TensorError::Overflow { .. }));
    }

    #[test]
    fn wrong_element_type_is_named() {
        let err = HostTensor::i32(vec![1], vec![3]).unwrap().into_f32().unwrap_err();
        assert_eq!(err.to_string(), "tensor holds i32 elements, not f32");
    }
}
