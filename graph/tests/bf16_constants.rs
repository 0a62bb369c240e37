//! bf16 constants of every form (dense, splat, hex, `dense_resource`) compile for
//! every GPU backend, SPIR-V's bf16 emulation included (issue 39: torch-mlir's
//! rotary tables are resource-backed bf16 constants).

use pcp_graph::{Backend, StepConfig, Target, compile, import_str, train_step};

/// bf16 bits of the rotary-like table, in order.
const TABLE: [u16; 8] = [0x3f80, 0xc000, 0x3f00, 0x4040, 0x3e80, 0xbfc0, 0x3fc0, 0x3dcd];

/// The table as an MLIR resource blob: a 4-byte little-endian alignment, then the
/// elements' bytes, little-endian.
fn blob() -> String {
    let mut hex = String::from("0x02000000");
    for bits in TABLE {
        for byte in bits.to_le_bytes() {
            hex.push_str(&format!("{byte:02X}"));
        }
    }
    hex
}

/// A loss reading `table` (a constant's attribute) as a `tensor<1x4x1x2xbf16>` in a
/// multiply, then summing in f32; `resources` is the module's trailing section.
fn loss_module(op: &str, table: &str, resources: &str) -> String {
    format!(
        r#"func.func @main(%arg0: tensor<1x4x1x2xf32>) -> tensor<f32> {{
  %table = {op} {table} : tensor<1x4x1x2xbf16>
  %x = stablehlo.convert %arg0 : (tensor<1x4x1x2xf32>) -> tensor<1x4x1x2xbf16>
  %rot = stablehlo.multiply %x, %table : tensor<1x4x1x2xbf16>
  %wide = stablehlo.convert %rot : (tensor<1x4x1x2xbf16>) -> tensor<1x4x1x2xf32>
  %zero = stablehlo.constant dense<0.0> : tensor<f32>
  %sum = stablehlo.reduce(%wide init: %zero) applies stablehlo.add across dimensions = [0, 1, 2, 3] : (tensor<1x4x1x2xf32>, tensor<f32>) -> tensor<f32>
  return %sum : tensor<f32>
}}
{resources}"#
    )
}

fn resource_module(op: &str) -> String {
    let resources =
        format!("{{-#\n  dialect_resources: {{\n    builtin: {{\n      rope: \"{}\"\n    }}\n  }}\n#-}}", blob());
    loss_module(op, "dense_resource<rope>", &resources)
}

/// torch-mlir's form: a resource-backed bf16 table, read in a training step, compiles
/// for Vulkan (RDNA3) as it does for CUDA.
#[test]
fn a_resource_backed_bf16_constant_compiles_for_vulkan_and_cuda() -> anyhow::Result<()> {
    for op in ["stablehlo.constant", "arith.constant"] {
        let module = import_str("rope.mlir", &resource_module(op))?;
        let step = train_step(&module, "main", &StepConfig::default())?;
        for (backend, name) in [(Backend::Vulkan, "rdna3"), (Backend::Cuda, "sm_80")] {
            let target = Target::parse(backend, Some(name))?;
            let artifact = compile(&step.module, &target, None).map_err(|e| anyhow::anyhow!("{op}: {e}"))?;
            assert!(!artifact.vmfb.is_empty(), "{op} for {target}");
        }
    }
    Ok(())
}

/// A bf16 reduction keeps SPIR-V's emulation away, so IREE promotes bf16 to f32: the
/// resource-backed table, rewritten as f32, compiles that way too.
#[test]
fn a_resource_backed_bf16_constant_compiles_when_iree_promotes_bf16() -> anyhow::Result<()> {
    let text = resource_module("stablehlo.constant").replace(
        "  %wide = stablehlo.convert %rot : (tensor<1x4x1x2xbf16>) -> tensor<1x4x1x2xf32>\n",
        "  %zb = stablehlo.constant dense<0.0> : tensor<bf16>\n  \
         %rows = stablehlo.reduce(%rot init: %zb) applies stablehlo.add across dimensions = [3] : (tensor<1x4x1x2xbf16>, tensor<bf16>) -> tensor<1x4x1xbf16>\n  \
         %wide = stablehlo.convert %rows : (tensor<1x4x1xbf16>) -> tensor<1x4x1xf32>\n",
    );
    let text = text.replace(
        "(tensor<1x4x1x2xf32>, tensor<f32>) -> tensor<f32>",
        "(tensor<1x4x1xf32>, tensor<f32>) -> tensor<f32>",
    );
    let text = text.replace("dimensions = [0, 1, 2, 3]", "dimensions = [0, 1, 2]");
    let module = import_str("rope.mlir", &text)?;
    let target = Target::parse(Backend::Vulkan, Some("rdna3"))?;
    let artifact = compile(&module, &target, None)?;
    assert!(artifact.flags.iter().any(|f| f == "--iree-input-promote-bf16-to-f32"), "{:?}", artifact.flags);
    Ok(())
}

/// A table whose resource is missing is a one-line error naming it, not a panic.
#[test]
fn a_missing_resource_is_named() -> anyhow::Result<()> {
    let text = resource_module("stablehlo.constant").replace("rope: ", "other: ");
    let module = import_str("rope.mlir", &text)?;
    let target = Target::parse(Backend::Vulkan, Some("rdna3"))?;
    let err = compile(&module, &target, None).expect_err("no blob for the table").to_string();
    assert!(err.contains("\"rope\"") && err.contains("@main") && !err.contains('\n'), "{err}");
    Ok(())
}

/// Dense, splat and hex-encoded bf16 constants compile for Vulkan too.
#[test]
fn dense_splat_and_hex_bf16_constants_compile_for_vulkan() -> anyhow::Result<()> {
    let hex: String = TABLE.iter().flat_map(|b| b.to_le_bytes()).map(|b| format!("{b:02X}")).collect();
    let tables = [
        "dense<[[[[1.0, -2.0]], [[0.5, 3.0]], [[0.25, -1.5]], [[1.5, 0.1]]]]>".to_owned(),
        "dense<1.5>".to_owned(),
        format!("dense<\"0x{hex}\">"),
    ];
    let target = Target::parse(Backend::Vulkan, Some("rdna3"))?;
    for table in tables {
        let module = import_str("table.mlir", &loss_module("stablehlo.constant", &table, ""))?;
        let step = train_step(&module, "main", &StepConfig::default())?;
        let artifact = compile(&step.module, &target, None).map_err(|e| anyhow::anyhow!("{table}: {e}"))?;
        assert!(!artifact.vmfb.is_empty(), "{table}");
    }
    Ok(())
}
