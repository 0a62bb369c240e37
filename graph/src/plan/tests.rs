use super::*;

#[test]
fn contractions_are_priced_from_their_names() {
    let flops = |n| contraction_flops(n);
    assert_eq!(
        flops("train_step_dispatch_104_matmul_8192x3072x768_bf16xbf16xf32"),
        Some(2.0 * 8192.0 * 3072.0 * 768.0)
    );
    assert_eq!(
        flops("train_step_dispatch_7_batch_matmul_96x128x64x1024_f32"),
        Some(2.0 * 96.0 * 128.0 * 64.0 * 1024.0)
    );
    assert_eq!(flops("train_step_dispatch_9_matmul_like_2048x65x64_bf16xbf16xf32"), Some(2.0 * 2048.0 * 65.0 * 64.0));
    assert_eq!(flops("train_step_dispatch_103_elementwise_2359296_f32xbf16"), None);
    assert_eq!(flops("train_step_dispatch_3_reduction_2048x64_f32"), None);
    assert!(is_low_precision_contraction("d_1_matmul_8x8x8_bf16xbf16xf32"));
    assert!(!is_low_precision_contraction("d_1_matmul_8x8x8_f32"));
    assert!(!is_low_precision_contraction("d_1_elementwise_8_bf16xbf16"));
}

#[test]
fn launches_count_the_function_s_dispatch_sites_in_either_form() {
    let pretty = r#"
  util.func public @eval_loss(%arg0: !hal.buffer_view) -> !hal.buffer_view {
      stream.cmd.dispatch @e_0::@e_0_reduction_8_f32 {
  }
  util.func public @train_step(%arg0: !hal.buffer_view) -> !hal.buffer_view {
      stream.cmd.dispatch @d_0::@d_0_matmul_8x8x8_f32(%c0 : i32) {
      stream.cmd.dispatch @d_1::@d_1_elementwise_64_f32 {
      stream.cmd.dispatch @d_0::@d_0_matmul_8x8x8_f32(%c1 : i32) {
  }"#;
    assert_eq!(
        launches(pretty, "train_step"),
        [("d_0_matmul_8x8x8_f32".to_owned(), 2), ("d_1_elementwise_64_f32".to_owned(), 1)]
    );
    assert_eq!(launches(pretty, "eval_loss"), [("e_0_reduction_8_f32".to_owned(), 1)]);
    let generic = r#"    "util.func"() <{function_type = (!hal.buffer_view) -> !hal.buffer_view, sym_name = "train_step", sym_visibility = "public"}> ({
        "stream.cmd.dispatch"(%1, %2) <{entry_points = [@d_5::@d_5_matmul_4x4x4_f32], operandSegmentSizes = array<i32: 0>}> ({"#;
    assert_eq!(launches(generic, "train_step"), [("d_5_matmul_4x4x4_f32".to_owned(), 1)]);
    assert!(launches(generic, "logits").is_empty());
}

#[test]
fn bytes_are_what_an_executable_loads_and_stores() {
    let sources = r#""hal.executable"() <{sym_name = "d_1"}> ({
    "hal.executable.export"() <{layout = #hal.pipeline.layout<constants = 0>, ordinal = 0 : index, sym_name = "d_1_elementwise_2048_f32xbf16"}> ({
        %6 = "iree_tensor_ext.dispatch.tensor.load"(%4) <{static_sizes = array<i64: 2048>}> : (!iree_tensor_ext.dispatch.tensor<readonly:tensor<4096xf32>>) -> tensor<2048xf32> loc(unknown)
        "iree_tensor_ext.dispatch.tensor.store"(%8, %5) <{static_sizes = array<i64: 2048>}> : (tensor<2048xbf16>, !iree_tensor_ext.dispatch.tensor<writeonly:tensor<2048xbf16>>) -> () loc(unknown)
"hal.executable"() <{sym_name = "d_2"}> ({
    "hal.executable.export"() <{ordinal = 0 : index, sym_name = "d_2_reduction_8x8_f32"}> ({
        %6 = "iree_tensor_ext.dispatch.tensor.load"(%4) : (!iree_tensor_ext.dispatch.tensor<readonly:tensor<8x8xf32>>) -> tensor<8x8xf32>
"#;
    let bytes = binding_bytes(sources);
    assert_eq!(
        bytes["d_1_elementwise_2048_f32xbf16"],
        2048.0 * 4.0 + 2048.0 * 2.0,
        "the slice read, not the whole binding"
    );
    assert_eq!(bytes["d_2_reduction_8x8_f32"], 256.0);
}

#[test]
fn matrix_instructions_are_found_per_kernel() {
    let ptx = ".visible .entry d_1_matmul_8x8x8_bf16xbf16xf32(\n\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1}, {%r1}, {%r2}, {%f2};\n}\n.visible .entry d_2_elementwise_8_f32(\n\tadd.f32 %f1, %f2, %f3;\n}\n";
    let rocm = "train_step_dispatch_3_matmul_8x8x8_bf16xbf16xf32:\n\tv_mfma_f32_16x16x16_bf16 a[0:3], v[0:1], v[2:3], a[0:3]\n\t.amdhsa_kernel train_step_dispatch_3_matmul_8x8x8_bf16xbf16xf32\ntrain_step_dispatch_4_elementwise_8_f32:\n\tv_add_f32 v0, v1, v2\n";
    let used = matrix_use(ptx, rocm);
    assert_eq!(used.get("d_1_matmul_8x8x8_bf16xbf16xf32"), Some(&true));
    assert_eq!(used.get("d_2_elementwise_8_f32"), Some(&false));
    assert_eq!(used.get("train_step_dispatch_3_matmul_8x8x8_bf16xbf16xf32"), Some(&true));
    assert_eq!(used.get("train_step_dispatch_4_elementwise_8_f32"), Some(&false));
}

#[test]
fn the_roofline_is_the_longer_of_work_and_bytes() {
    let peak = Peak { device: "test", bf16_tflops: 1000.0, f32_tflops: 50.0, memory_gbs: 1000.0 };
    let matmul = Dispatch {
        name: "m".into(),
        launches: 2,
        flops: 2e12,
        bytes: 1e6,
        low_precision: true,
        matrix_instructions: Some(true),
    };
    assert!((matmul.roofline_s(&peak) - 2e-3).abs() < 1e-12, "compute-bound at 1000 TFLOP/s");
    let f32 = Dispatch { low_precision: false, ..matmul.clone() };
    assert!((f32.roofline_s(&peak) - 4e-2).abs() < 1e-12, "f32 at 50 TFLOP/s");
    let copy = Dispatch { flops: 0.0, bytes: 1e9, ..matmul.clone() };
    assert!((copy.roofline_s(&peak) - 1e-3).abs() < 1e-12, "memory-bound at 1000 GB/s");
    let plan = Plan {
        target: Target::parse(Backend::Cuda, Some("sm_80")).expect("target"),
        function: "f".into(),
        dispatches: vec![matmul, copy],
        peak: Some(peak),
    };
    assert!((plan.roofline_s().expect("priced") - (2.0 * 2e-3 + 2.0 * 1e-3)).abs() < 1e-12);
    assert_eq!(plan.launches(), 4);
}

/// nanogpt-small's bf16 step for CUDA: every dispatch found, its matmuls on `mma`.
#[test]
fn nanogpt_small_plans_for_cuda() -> anyhow::Result<()> {
    let model = crate::nanogpt(&crate::NanoGptConfig::small())?.module;
    let config = crate::StepConfig { precision: crate::Precision::Bf16, ..crate::StepConfig::default() };
    let step = crate::train_step(&model, "main", &config)?;
    let plan = plan(&step.module, &Target::parse(Backend::Cuda, Some("sm_80"))?, "train_step")?;
    assert!(plan.launches() > 50, "{} launches", plan.launches());
    let matmuls: Vec<&Dispatch> = plan.dispatches.iter().filter(|d| d.low_precision).collect();
    assert!(!matmuls.is_empty());
    assert!(matmuls.iter().all(|d| d.matrix_instructions == Some(true)), "{matmuls:#?}");
    assert!(plan.dispatches.iter().all(|d| d.bytes > 0.0 || d.name.contains("memcpy")), "{:#?}", plan.dispatches);
    assert!(plan.roofline_s().is_some_and(|s| s > 0.0));
    Ok(())
}
