//! Ranked tensor types, as MLIR prints them (`tensor<2x3xf32>`).

use std::fmt;

/// The element type of a tensor.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ElementType {
    /// A floating-point type: `f16`, `bf16`, `f32`, `f64`.
    Float(FloatType),
    /// A signless, signed or unsigned integer type (`i1`, `i64`, `ui8`, …).
    Int(String),
    /// Anything else (`complex<f32>`, `!quant…`), kept verbatim.
    Other(String),
}

/// Floating-point element types that gradients flow through.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FloatType {
    /// IEEE half precision.
    F16,
    /// bfloat16.
    Bf16,
    /// IEEE single precision.
    F32,
    /// IEEE double precision.
    F64,
}

impl FloatType {
    /// The MLIR spelling.
    pub fn name(self) -> &'static str {
        match self {
            Self::F16 => "f16",
            Self::Bf16 => "bf16",
            Self::F32 => "f32",
            Self::F64 => "f64",
        }
    }

    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            Self::F16 | Self::Bf16 => 2,
            Self::F32 => 4,
            Self::F64 => 8,
        }
    }

    /// An exact MLIR hex literal for `value` in this type.
    pub fn hex_literal(self, value: f64) -> String {
        match self {
            Self::F64 => format!("0x{:016X}", value.to_bits()),
            Self::F32 => format!("0x{:08X}", (value as f32).to_bits()),
            // Round through f32; the values we emit (0, ±1, 0.5, -inf) are exact.
            Self::Bf16 => format!("0x{:04X}", (value as f32).to_bits() >> 16),
            Self::F16 => format!("0x{:04X}", f32_to_f16_bits(value as f32)),
        }
    }
}

fn f32_to_f16_bits(value: f32) -> u16 {
    let bits = value.to_bits();
    let sign = ((bits >> 16) & 0x8000) as u16;
    let exponent = ((bits >> 23) & 0xff) as i32;
    let mantissa = bits & 0x007f_ffff;
    if exponent == 0xff {
        return sign | 0x7c00 | if mantissa != 0 { 0x200 } else { 0 };
    }
    let unbiased = exponent - 127 + 15;
    if unbiased >= 0x1f {
        sign | 0x7c00
    } else if unbiased <= 0 {
        sign
    } else {
        sign | ((unbiased as u16) << 10) | ((mantissa >> 13) as u16)
    }
}

impl ElementType {
    /// Parses an MLIR element type spelling.
    pub fn parse(text: &str) -> Self {
        match text {
            "f16" => Self::Float(FloatType::F16),
            "bf16" => Self::Float(FloatType::Bf16),
            "f32" => Self::Float(FloatType::F32),
            "f64" => Self::Float(FloatType::F64),
            t if is_int_type(t) => Self::Int(t.to_owned()),
            t => Self::Other(t.to_owned()),
        }
    }

    /// The float type, if this is one.
    pub fn float(&self) -> Option<FloatType> {
        match self {
            Self::Float(f) => Some(*f),
            _ => None,
        }
    }

    /// The MLIR spelling.
    pub fn name(&self) -> &str {
        match self {
            Self::Float(f) => f.name(),
            Self::Int(t) | Self::Other(t) => t,
        }
    }

    /// Bytes per element as stored (booleans and unknown types: one).
    pub fn bytes(&self) -> usize {
        match self {
            Self::Float(f) => f.bytes(),
            Self::Int(t) => {
                t.trim_start_matches(|c: char| c.is_ascii_alphabetic()).parse::<usize>().map_or(1, |b| b.div_ceil(8))
            }
            Self::Other(_) => 1,
        }
    }
}

fn is_int_type(t: &str) -> bool {
    let digits = t.strip_prefix("ui").or_else(|| t.strip_prefix("si")).or_else(|| t.strip_prefix('i'));
    digits.is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
}

impl fmt::Display for ElementType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A statically shaped, ranked tensor type.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TensorType {
    /// Dimension sizes, outermost first.
    pub shape: Vec<i64>,
    /// The element type.
    pub element: ElementType,
}

/// Why a type could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TypeError {
    /// A `?` dimension.
    #[error("dynamic shape {0} is not supported; export with static shapes")]
    Dynamic(String),
    /// Not a ranked tensor.
    #[error("type {0} is not a ranked tensor")]
    NotTensor(String),
}

impl TensorType {
    /// A tensor type of `shape` and `element`.
    pub fn new(shape: Vec<i64>, element: ElementType) -> Self {
        Self { shape, element }
    }

    /// A rank-0 tensor of `element`.
    pub fn scalar(element: ElementType) -> Self {
        Self::new(Vec::new(), element)
    }

    /// The same element type with another shape.
    pub fn with_shape(&self, shape: Vec<i64>) -> Self {
        Self::new(shape, self.element.clone())
    }

    /// The same shape with another element type.
    pub fn with_element(&self, element: ElementType) -> Self {
        Self::new(self.shape.clone(), element)
    }

    /// Rank.
    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// Number of elements.
    pub fn elements(&self) -> i64 {
        self.shape.iter().product()
    }

    /// Bytes of the tensor (0 for a dynamic shape).
    pub fn bytes(&self) -> u64 {
        self.elements().max(0) as u64 * self.element.bytes() as u64
    }

    /// Whether the element type is floating point.
    pub fn is_float(&self) -> bool {
        self.element.float().is_some()
    }

    /// Parses `tensor<2x3xf32>` or `tensor<f32>`.
    pub fn parse(text: &str) -> Result<Self, TypeError> {
        let text = text.trim();
        let inner = text
            .strip_prefix("tensor<")
            .and_then(|t| t.strip_suffix('>'))
            .ok_or_else(|| TypeError::NotTensor(text.to_owned()))?;
        if inner.starts_with('*') || inner.contains(',') {
            return Err(TypeError::NotTensor(text.to_owned()));
        }
        let mut shape = Vec::new();
        let mut rest = inner;
        loop {
            let digits = rest.bytes().take_while(|b| b.is_ascii_digit() || *b == b'?').count();
            if digits == 0 || rest.as_bytes().get(digits) != Some(&b'x') {
                break;
            }
            let dim = &rest[..digits];
            if dim.contains('?') {
                return Err(TypeError::Dynamic(text.to_owned()));
            }
            shape.push(dim.parse().map_err(|_| TypeError::NotTensor(text.to_owned()))?);
            rest = &rest[digits + 1..];
        }
        Ok(Self::new(shape, ElementType::parse(rest)))
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("tensor<")?;
        for d in &self.shape {
            write!(f, "{d}x")?;
        }
        write!(f, "{}>", self.element)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        for t in ["tensor<2x3xf32>", "tensor<f32>", "tensor<64x32xi64>", "tensor<0x4xbf16>", "tensor<2xi1>"] {
            assert_eq!(TensorType::parse(t).expect(t).to_string(), t);
        }
        assert_eq!(TensorType::parse("tensor<f64>").expect("f64").element.float(), Some(FloatType::F64));
        assert!(TensorType::parse("tensor<2xui8>").expect("ui8").element.float().is_none());
    }

    #[test]
    fn rejects_dynamic_and_unranked() {
        assert!(matches!(TensorType::parse("tensor<?x3xf32>"), Err(TypeError::Dynamic(_))));
        assert!(matches!(TensorType::parse("tensor<*xf32>"), Err(TypeError::NotTensor(_))));
        assert!(matches!(TensorType::parse("memref<3xf32>"), Err(TypeError::NotTensor(_))));
    }

    #[test]
    fn hex_literals_are_exact() {
        assert_eq!(FloatType::F32.hex_literal(0.5), "0x3F000000");
        assert_eq!(FloatType::F32.hex_literal(f64::NEG_INFINITY), "0xFF800000");
        assert_eq!(FloatType::F64.hex_literal(1.0), "0x3FF0000000000000");
        assert_eq!(FloatType::Bf16.hex_literal(1.0), "0x3F80");
        assert_eq!(FloatType::F16.hex_literal(1.0), "0x3C00");
        assert_eq!(FloatType::F16.hex_literal(-0.5), "0xB800");
    }
}
