//! bf16 constants rewritten as the f32 constants they widen to, whatever their form.

use std::fmt::Write as _;

use crate::ir::attr::{matching_close, split_top_level};
use crate::ir::{ElementType, FloatType, Function, Op};

/// The constant ops a StableHLO module holds tensors in.
const CONSTANTS: &[&str] = &["stablehlo.constant", "arith.constant"];

/// Why a bf16 constant could not be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Bf16ConstantError {
    /// A `dense_resource` names a blob the module's resource section does not hold.
    #[error(
        "@{function}: the bf16 constant at {location} reads resource {resource:?}, which the module's dialect_resources do not hold"
    )]
    MissingResource {
        /// The function.
        function: String,
        /// The constant's location.
        location: String,
        /// The resource's name.
        resource: String,
    },
    /// The blob is not an alignment followed by the constant's elements.
    #[error("@{function}: the bf16 constant at {location} reads resource {resource:?}, which is malformed: {reason}")]
    MalformedResource {
        /// The function.
        function: String,
        /// The constant's location.
        location: String,
        /// The resource's name.
        resource: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The constant's value is in no form this rewrite reads.
    #[error("@{function}: cannot read the bf16 constant at {location} ({value}): {reason}")]
    Unreadable {
        /// The function.
        function: String,
        /// The constant's location.
        location: String,
        /// The `value` attribute, shortened.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
}

/// Why a value could not be read, before the error names its constant.
enum Unread {
    Missing(String),
    Malformed(String, String),
    Other(String),
}

/// Rewrites each bf16 constant of `f` (dense, splat, hex or `dense_resource`, the
/// latter read from `resources`, the module's `{-# … #-}` section) as an f32
/// constant holding the widened values, which are exact, and a `stablehlo.convert`
/// back to bf16 that writes the old value. IREE's bf16 promotion turns that convert
/// into the identity; [`super::emulate_bf16`] keeps it as one ([`is_bf16_exact`]).
/// IREE's promotion itself leaves a `dense_resource` bf16 constant's attribute as it
/// was, and the constant then fails to verify ("all of {value, result} have same type").
pub(crate) fn widen_constants(f: &mut Function, resources: Option<&str>) -> Result<(), Bf16ConstantError> {
    let bf16 = ElementType::Float(FloatType::Bf16);
    // read every constant first, so that an unreadable one leaves `f` as it was
    let mut widened = Vec::new();
    for (i, op) in f.ops.iter().enumerate() {
        if let [r] = op.results.as_slice()
            && CONSTANTS.contains(&op.name.as_str())
            && f.ty(*r).element == bf16
        {
            let value = op.attr("value").unwrap_or_default();
            let bits = read_bf16(value, f.ty(*r).elements(), resources)
                .map_err(|unread| named(unread, &f.name, &op.location(), value))?;
            widened.push((i, bits));
        }
    }
    let mut widened = widened.into_iter().peekable();
    let mut rewritten = Vec::with_capacity(f.ops.len() + widened.len());
    for (i, mut op) in std::mem::take(&mut f.ops).into_iter().enumerate() {
        let Some((_, bits)) = widened.next_if(|(w, _)| *w == i) else {
            rewritten.push(op);
            continue;
        };
        let old = op.results[0];
        let wide = f.ty(old).with_element(ElementType::Float(FloatType::F32));
        let attr = format!("{} : {wide}", f32_dense(&bits));
        for (key, text) in op.props.iter_mut().chain(op.attrs.iter_mut()) {
            if key == "value" {
                text.clone_from(&attr);
            }
        }
        let fresh = f.new_value(wide);
        op.results = vec![fresh];
        let loc = op.loc.clone();
        rewritten.push(op);
        rewritten.push(super::super::op("stablehlo.convert", vec![fresh], old, loc));
    }
    f.ops = rewritten;
    Ok(())
}

/// The error for a constant in `function` at `location` whose `value` could not be read.
fn named(unread: Unread, function: &str, location: &str, value: &str) -> Bf16ConstantError {
    let function = function.to_owned();
    let location = location.to_owned();
    match unread {
        Unread::Missing(resource) => Bf16ConstantError::MissingResource { function, location, resource },
        Unread::Malformed(resource, reason) => {
            Bf16ConstantError::MalformedResource { function, location, resource, reason }
        }
        Unread::Other(reason) => {
            let mut short: String = value.chars().take(80).collect();
            if short.len() < value.len() {
                short.push('…');
            }
            let value = short;
            Bf16ConstantError::Unreadable { function, location, value, reason }
        }
    }
}

/// Whether `op` is an f32 constant whose every value is a bf16 value (as
/// [`widen_constants`] writes them), so converting it to bf16 rounds nothing.
pub(crate) fn is_bf16_exact(f: &Function, op: &Op) -> bool {
    let f32 = ElementType::Float(FloatType::F32);
    let ([r], true) = (op.results.as_slice(), CONSTANTS.contains(&op.name.as_str())) else {
        return false;
    };
    if f.ty(*r).element != f32 {
        return false;
    }
    let Some(attr) = op.attr("value").and_then(|v| v.rsplit_once(" : ")).map(|(a, _)| a.trim()) else {
        return false;
    };
    let Some(hex) = attr.strip_prefix("dense<\"0x").and_then(|h| h.strip_suffix("\">")) else {
        return false;
    };
    match decode_hex(hex) {
        Some(bytes) if bytes.len().is_multiple_of(4) => {
            bytes.chunks_exact(4).all(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) & 0xffff == 0)
        }
        _ => false,
    }
}

/// An f32 `dense<…>` attribute (without its type) of `bits` widened: a hex string
/// of little-endian f32s (one value is a splat), or `dense<>` for no values.
fn f32_dense(bits: &[u16]) -> String {
    if bits.is_empty() {
        return "dense<>".to_owned();
    }
    let mut out = String::with_capacity(bits.len() * 8 + 10);
    out.push_str("dense<\"0x");
    for b in bits {
        for byte in (u32::from(*b) << 16).to_le_bytes() {
            let _ = write!(out, "{byte:02X}");
        }
    }
    out.push_str("\">");
    out
}

/// The bf16 bits a `value` attribute holds: `elements` of them, or one for a splat.
fn read_bf16(value: &str, elements: i64, resources: Option<&str>) -> Result<Vec<u16>, Unread> {
    let other = |reason: &str| Unread::Other(reason.to_owned());
    let attr = value.rsplit_once(" : ").map_or(value, |(a, _)| a).trim();
    let elements = usize::try_from(elements).map_err(|_| other("the tensor has no static size"))?;
    if let Some(key) = attr.strip_prefix("dense_resource<").and_then(|k| k.strip_suffix('>')) {
        let key = unquote(key.trim());
        let blob = resources.and_then(|r| resource_blob(r, &key)).ok_or_else(|| Unread::Missing(key.clone()))?;
        return resource_bf16(&blob, elements).map_err(|reason| Unread::Malformed(key, reason));
    }
    let body = attr
        .strip_prefix("dense<")
        .and_then(|b| b.strip_suffix('>'))
        .ok_or_else(|| other("not a dense or dense_resource attribute"))?
        .trim();
    let bits = if let Some(hex) = body.strip_prefix('"').and_then(|b| b.strip_suffix('"')) {
        let digits = hex.strip_prefix("0x").or_else(|| hex.strip_prefix("0X")).ok_or_else(|| other("not hex"))?;
        let bytes = decode_hex(digits).ok_or_else(|| other("bad hex digits"))?;
        if !bytes.len().is_multiple_of(2) {
            return Err(other("an odd number of bytes"));
        }
        bytes.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect::<Vec<_>>()
    } else {
        let literals = body.split(['[', ']', ',']).map(str::trim).filter(|s| !s.is_empty());
        literals.map(bf16_literal).collect::<Option<Vec<_>>>().ok_or_else(|| other("not a bf16 literal"))?
    };
    if bits.len() == elements || (bits.len() == 1 && elements > 0) {
        Ok(bits)
    } else {
        Err(Unread::Other(format!("{} values for {elements} elements", bits.len())))
    }
}

/// The elements of a resource blob: a little-endian u32 alignment, then the
/// elements' bytes, 2 a bf16.
fn resource_bf16(blob: &str, elements: usize) -> Result<Vec<u16>, String> {
    let digits = blob.strip_prefix("0x").or_else(|| blob.strip_prefix("0X")).ok_or("the blob is not hex")?;
    let bytes = decode_hex(digits).ok_or("the blob has bad hex digits")?;
    let (alignment, data) = bytes.split_at_checked(4).ok_or("the blob has no 4-byte alignment header")?;
    let alignment = u32::from_le_bytes([alignment[0], alignment[1], alignment[2], alignment[3]]);
    if !alignment.is_power_of_two() {
        return Err(format!("alignment {alignment} is not a power of two"));
    }
    if data.len() != 2 * elements {
        return Err(format!("{} bytes for {elements} bf16 elements ({} bytes)", data.len(), 2 * elements));
    }
    Ok(data.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect())
}

/// The blob of builtin resource `key` in a `{-# dialect_resources: { builtin: { … } } #-}` section.
fn resource_blob(section: &str, key: &str) -> Option<String> {
    let start = section.find("dialect_resources")?;
    let open = start + section[start..].find('{')?;
    let close = matching_close(section, open)?;
    let dialects = split_top_level(&section[open + 1..close - 1], b',');
    let builtin = dialects.into_iter().find_map(|d| {
        let (name, rest) = d.split_once(':')?;
        (name.trim() == "builtin").then_some(rest.trim())
    })?;
    let inner = builtin.strip_prefix('{')?.strip_suffix('}')?;
    split_top_level(inner, b',').into_iter().find_map(|entry| {
        let (name, blob) = split_entry(entry)?;
        (name == key).then(|| unquote(blob))
    })
}

/// `name: "blob"` (the name bare or quoted) as (unquoted name, blob text).
fn split_entry(entry: &str) -> Option<(String, &str)> {
    let entry = entry.trim();
    let (name, rest) = if let Some(quoted) = entry.strip_prefix('"') {
        let end = quoted.find('"')?;
        (&quoted[..end], &quoted[end + 1..])
    } else {
        let colon = entry.find(':')?;
        (&entry[..colon], &entry[colon..])
    };
    Some((unquote(name.trim()), rest.trim().strip_prefix(':')?.trim()))
}

fn unquote(text: &str) -> String {
    text.strip_prefix('"').and_then(|t| t.strip_suffix('"')).unwrap_or(text).to_owned()
}

fn decode_hex(digits: &str) -> Option<Vec<u8>> {
    if !digits.len().is_multiple_of(2) {
        return None;
    }
    (0..digits.len()).step_by(2).map(|i| u8::from_str_radix(digits.get(i..i + 2)?, 16).ok()).collect()
}

/// A bf16 element literal: a hex bit pattern (`0x7FC0`, MLIR's form for NaN and
/// infinities) or a decimal, rounded to the nearest bf16 (MLIR prints bf16 values
/// with enough digits to read back exactly).
fn bf16_literal(text: &str) -> Option<u16> {
    if let Some(hex) = text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
        return u16::from_str_radix(hex, 16).ok();
    }
    let value: f64 = text.parse().ok()?;
    let bits = (value as f32).to_bits();
    if (value as f32).is_nan() {
        return Some((bits >> 16) as u16 | 0x40);
    }
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1));
    Some((rounded >> 16) as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 1, -2, 0.5, 3, 0.25, -1.5, 1.5 and 0.10009765625 in bf16.
    const TABLE: [u16; 8] = [0x3f80, 0xc000, 0x3f00, 0x4040, 0x3e80, 0xbfc0, 0x3fc0, 0x3dcd];
    /// TABLE's bytes, little-endian.
    const TABLE_HEX: &str = "803F00C0003F4040803EC0BFC03FCD3D";
    /// TABLE widened to f32, as little-endian hex.
    const WIDE_HEX: &str = "0000803F000000C00000003F000040400000803E0000C0BF0000C03F0000CD3D";

    fn section(blob: &str) -> String {
        format!("{{-#\n  dialect_resources: {{\n    builtin: {{\n      \"torch.rope\": \"{blob}\"\n    }}\n  }}\n#-}}")
    }

    fn rope_module(op: &str, resources: &str) -> String {
        format!(
            r#"func.func @main(%arg0: tensor<1x4x1x2xf32>) -> tensor<1x4x1x2xf32> {{
  %table = {op} dense_resource<"torch.rope"> : tensor<1x4x1x2xbf16>
  %x = stablehlo.convert %arg0 : (tensor<1x4x1x2xf32>) -> tensor<1x4x1x2xbf16>
  %rot = stablehlo.multiply %x, %table : tensor<1x4x1x2xbf16>
  %wide = stablehlo.convert %rot : (tensor<1x4x1x2xbf16>) -> tensor<1x4x1x2xf32>
  return %wide : tensor<1x4x1x2xf32>
}}
{resources}"#
        )
    }

    #[test]
    fn every_form_reads_the_same_bf16_bits() {
        let resources = section(&format!("0x02000000{TABLE_HEX}"));
        let ty = ": tensor<1x4x1x2xbf16>";
        let forms = [
            format!("dense_resource<\"torch.rope\"> {ty}"),
            format!("dense<\"0x{TABLE_HEX}\"> {ty}"),
            format!(
                "dense<[[[[1.000000e+00, -2.000000e+00]], [[5.000000e-01, 3.000000e+00]], \
                 [[2.500000e-01, -1.500000e+00]], [[1.500000e+00, 1.000980e-01]]]]> {ty}"
            ),
            format!("dense<[[[[0x3F80, 0xC000]], [[0x3F00, 0x4040]], [[0x3E80, 0xBFC0]], [[0x3FC0, 0x3DCD]]]]> {ty}"),
        ];
        for form in forms {
            assert!(read_bf16(&form, 8, Some(&resources)).is_ok_and(|bits| bits == TABLE), "{form}");
        }
        assert!(read_bf16(&format!("dense<1.000980e-01> {ty}"), 8, None).is_ok_and(|b| b == [0x3dcd]));
        assert_eq!(bf16_literal("0x7FC0"), Some(0x7fc0));
        assert_eq!(bf16_literal("3.004060e+38"), Some(0x7f62));
        assert_eq!(f32_dense(&TABLE), format!("dense<\"0x{WIDE_HEX}\">"));
    }

    /// A resource-backed table becomes the f32 constant of its values widened, read
    /// through a convert that SPIR-V's emulation keeps exact (no rounding).
    #[test]
    fn a_resource_backed_constant_becomes_its_values_in_f32() -> anyhow::Result<()> {
        let bf16 = ElementType::Float(FloatType::Bf16);
        for op in ["stablehlo.constant", "arith.constant"] {
            let module = crate::import_str("rope.mlir", &rope_module(op, &section(&format!("0x02000000{TABLE_HEX}"))))?;
            let mut f = module.functions[0].clone();
            assert!(crate::iree::legalize_for_spirv(&mut f, module.resources.as_deref())?, "{op}: emulated");
            assert!(f.ops.iter().flat_map(|o| &o.results).all(|r| f.ty(*r).element != bf16), "{op}: no bf16 left");
            let constant = f.ops.iter().find(|o| o.name == op).expect("the constant");
            assert_eq!(constant.attr("value"), Some(format!("dense<\"0x{WIDE_HEX}\"> : tensor<1x4x1x2xf32>").as_str()));
            let readers = |v| f.ops.iter().filter(move |o| o.operands.contains(&v));
            let converts: Vec<&Op> = readers(constant.results[0]).collect();
            assert!(converts.len() == 1 && converts[0].name == "stablehlo.convert", "{op}: {converts:?}");
            let names: Vec<&str> = readers(converts[0].results[0]).map(|o| o.name.as_str()).collect();
            assert_eq!(names, ["stablehlo.multiply"], "{op}: the table is read as it is, not rounded");
            // two roundings: the argument's convert to bf16 and the multiply's
            let roundings = f.ops.iter().filter(|o| o.name == "stablehlo.shift_right_logical").count();
            assert_eq!(roundings, 2, "{op}");
            // and the result parses and verifies
            let text = crate::Module { functions: vec![f], resources: module.resources.clone() }.to_mlir();
            crate::import_str("rewritten.mlir", &text)?;
        }
        Ok(())
    }

    #[test]
    fn a_missing_or_malformed_resource_is_one_line_naming_it() -> anyhow::Result<()> {
        let cases = [
            (section(&format!("0x02000000{TABLE_HEX}")).replace("torch.rope", "other"), "do not hold"),
            (section(&format!("0x02000000{}", &TABLE_HEX[4..])), "14 bytes for 8 bf16 elements"),
            (section("0x0200"), "no 4-byte alignment header"),
            (section(&format!("0x03000000{TABLE_HEX}")), "alignment 3"),
        ];
        // a readable bf16 constant before the table: left as it was too
        let text = rope_module("stablehlo.constant", "").replace(
            "  %rot = stablehlo.multiply %x, %table",
            "  %half = stablehlo.constant dense<5.000000e-01> : tensor<1x4x1x2xbf16>\n  \
             %y = stablehlo.multiply %x, %half : tensor<1x4x1x2xbf16>\n  \
             %rot = stablehlo.multiply %y, %table",
        );
        for (resources, why) in cases {
            let mut module = crate::import_str("rope.mlir", &text)?;
            assert_eq!(module.functions[0].ops.iter().filter(|o| o.name == "stablehlo.constant").count(), 2);
            module.resources = Some(resources);
            let mut f = module.functions[0].clone();
            let before = f.clone();
            let err = crate::iree::legalize_for_spirv(&mut f, module.resources.as_deref()).expect_err(why);
            let text = err.to_string();
            assert!(text.contains(why) && text.contains("\"torch.rope\"") && text.contains("@main"), "{text}");
            assert!(text.contains(":2:12") && !text.contains('\n'), "names the constant's line: {text}");
            assert_eq!(f, before, "left as it was");
        }
        let mut f = crate::import_str("rope.mlir", &rope_module("stablehlo.constant", ""))?.functions.remove(0);
        let err = widen_constants(&mut f, None).expect_err("no resource section");
        assert!(matches!(err, Bf16ConstantError::MissingResource { ref resource, .. } if resource == "torch.rope"));
        Ok(())
    }
}
