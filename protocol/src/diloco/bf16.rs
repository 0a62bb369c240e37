//! bfloat16: the top half of an f32, as the dense bf16 encoding and the sparse
//! encoding's tables carry it.

/// Rounds to nearest even (NaN stays NaN).
pub(crate) fn to_bf16(v: f32) -> u16 {
    let bits = v.to_bits();
    if v.is_nan() {
        return ((bits >> 16) as u16) | 0x40;
    }
    let round = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(round) >> 16) as u16
}

/// Exact.
pub(crate) fn from_bf16(v: u16) -> f32 {
    f32::from_bits(u32::from(v) << 16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_to_nearest_even_and_keeps_nan() {
        assert_eq!(from_bf16(to_bf16(1.0)), 1.0);
        assert_eq!(from_bf16(to_bf16(-2.5)), -2.5);
        // 1 + 2^-8 is halfway between two bf16 values: rounds to the even one, 1.0
        assert_eq!(from_bf16(to_bf16(1.0 + 1.0 / 256.0)), 1.0);
        assert!(from_bf16(to_bf16(f32::NAN)).is_nan());
    }
}
