use super::*;
use crate::ir::{Builder, ElementType, FloatType, Function, TensorType};
use crate::models::NanoGptConfig;

fn tiny(block_size: usize) -> NanoGptConfig {
    NanoGptConfig { n_layer: 2, n_head: 4, n_embd: 32, block_size, vocab_size: 11, batch_size: 2, bias: true }
}

fn attention_ops(f: &Function) -> Vec<&crate::ir::Op> {
    f.ops.iter().filter(|op| op.name == OP).collect()
}

#[test]
fn names_parse_and_old_files_read_as_fused() {
    assert_eq!("fused".parse::<Attention>(), Ok(Attention::Fused));
    assert_eq!("naive".parse::<Attention>(), Ok(Attention::Naive));
    assert_eq!("".parse::<Attention>(), Ok(Attention::Fused));
    let err = "flash".parse::<Attention>().expect_err("unknown").to_string();
    assert_eq!(err, "unknown attention \"flash\"; expected fused or naive");
}

/// nanoGPT's attention, one per layer, causal, with GPT-2's `1/√d` and no mask
/// operand; the scores, softmax and both matmuls are gone from the forward.
#[test]
fn each_nanogpt_layer_fuses_into_one_causal_op() -> anyhow::Result<()> {
    for (t, strip) in [(8, 8), (256, 256), (1024, STRIP_ROWS)] {
        let model = crate::nanogpt(&tiny(t))?;
        let mut f = crate::autodiff::inline_calls(&model.module, "main")?;
        let matmuls = |f: &Function| f.ops.iter().filter(|op| op.name == "stablehlo.dot_general").count();
        let exps = |f: &Function| f.ops.iter().filter(|op| op.name == "stablehlo.exponential").count();
        let (before, softmaxes) = (matmuls(&f), exps(&f));
        assert_eq!(fuse(&mut f), 2);
        assert_eq!(matmuls(&f), before - 4, "both attention matmuls of each layer are inside the op");
        assert_eq!(exps(&f), softmaxes - 2, "only the loss's softmax is left outside");
        for op in attention_ops(&f) {
            let spec = Spec::of(op).expect("spec");
            assert!(spec.causal && !spec.masked && !spec.bf16, "{spec:?}");
            assert!((spec.scale - 1.0 / 8f64.sqrt()).abs() < 1e-7, "{spec:?}");
            assert_eq!(spec.strip, strip, "T = {t}");
            assert_eq!(op.operands.len(), 3);
            assert_eq!(f.ty(op.results[0]).shape, vec![2, 4, t as i64, 8]);
            assert_eq!(f.ty(op.results[1]).shape, vec![2, 4, t as i64]);
        }
        assert_eq!(fuse(&mut f), 0, "fusing twice changes nothing");
        let mut expanded = f.clone();
        assert_eq!(expand(&mut expanded), 2);
        assert!(attention_ops(&expanded).is_empty());
        let strips = expanded.ops.iter().filter(|op| op.name == "stablehlo.exponential").count();
        assert_eq!(strips, 1 + 2 * (t as i64 / strip) as usize, "the loss's, and one per strip and layer");
        let module = crate::Module { functions: vec![expanded], resources: None };
        crate::import::verify("expanded", &module)?;
    }
    Ok(())
}

/// A fused step keeps a third of the naive step's activations at T = 1024, and
/// its module verifies in f32 and bf16.
#[test]
fn a_fused_step_keeps_no_square_tensor() -> anyhow::Result<()> {
    let model = crate::nanogpt(&tiny(1024))?;
    let step = |attention, precision| {
        let config = crate::StepConfig { attention, precision, ..Default::default() };
        crate::train_step(&model.module, "main", &config)
    };
    let (fused, naive) =
        (step(Attention::Fused, crate::Precision::F32)?, step(Attention::Naive, crate::Precision::F32)?);
    assert!(
        3 * fused.saved_activation_bytes < naive.saved_activation_bytes,
        "fused keeps {} B, naive {} B",
        fused.saved_activation_bytes,
        naive.saved_activation_bytes
    );
    let square = (2 * 4 * 1024 * 1024 * 4) as u64;
    assert!(fused.saved_activation_bytes < square, "less than one [B, H, T, T] tensor in all");
    let bf16 = step(Attention::Fused, crate::Precision::Bf16)?;
    for m in [&fused.module, &bf16.module] {
        assert!(!m.to_mlir().contains(OP), "expanded before compilation");
        crate::import::verify("step", m)?;
    }
    let bf16_dots = bf16.module.functions[0]
        .ops
        .iter()
        .filter(|op| op.name == "stablehlo.dot_general")
        .filter(|op| bf16.module.functions[0].ty(op.operands[0]).element == ElementType::Float(FloatType::Bf16))
        .count();
    let all_dots = bf16.module.functions[0].ops.iter().filter(|op| op.name == "stablehlo.dot_general").count();
    assert_eq!(bf16_dots, all_dots, "attention's matmuls read bf16 as the linear layers' do");
    Ok(())
}

/// `q·kᵀ` with a general mask argument fuses with the mask as an operand; a
/// softmax over another dimension, or one without the product with `v`, does not.
#[test]
fn general_masks_fuse_and_other_shapes_do_not() -> anyhow::Result<()> {
    let f32 = ElementType::Float(FloatType::F32);
    let x = TensorType::new(vec![3, 16, 8], f32.clone());
    let mask = TensorType::new(vec![3, 16, 16], ElementType::Int("i1".into()));
    let build = |softmax_dim: i64, with_v: bool| {
        let mut f = Function::new("main", &[x.clone(), x.clone(), x.clone(), mask.clone()]);
        let (q, k, v, m) = (f.args[0], f.args[1], f.args[2], f.args[3]);
        let mut b = Builder::new(&mut f, None);
        let s = b.dot_general(q, k, &[0], &[0], &[2], &[2], f32.clone());
        let s = b.scale(s, 0.25);
        let neg_inf = b.splat_like(f64::NEG_INFINITY, s);
        let s = b.select(m, s, neg_inf);
        let shape = b.ty(s).shape;
        let kept: Vec<i64> = (0..3).filter(|d| *d != softmax_dim).collect();
        let max = b.reduce(s, &[softmax_dim], "stablehlo.maximum", f64::NEG_INFINITY);
        let max = b.broadcast_in_dim(max, &kept, &shape);
        let shifted = b.sub(s, max);
        let e = b.unary_op("stablehlo.exponential", shifted);
        let sum = b.reduce_sum(e, &[softmax_dim]);
        let sum = b.broadcast_in_dim(sum, &kept, &shape);
        let p = b.div(e, sum);
        let out = if with_v { b.dot_general(p, v, &[0], &[0], &[2], &[1], f32.clone()) } else { p };
        let loss = b.sum_all(out);
        f.results = vec![loss];
        f
    };
    let mut general = build(2, true);
    assert_eq!(fuse(&mut general), 1);
    let op = attention_ops(&general)[0];
    let spec = Spec::of(op).expect("spec");
    assert!(spec.masked && !spec.causal && spec.scale == 0.25 && spec.strip == 16, "{spec:?}");
    assert_eq!(op.operands[3], general.args[3], "the mask argument itself");
    let mut grad = general.clone();
    let loss = grad.results[0];
    let wrt = grad.args[..3].to_vec();
    let grads = crate::autodiff::backward(&mut grad, loss, &wrt)?;
    grad.results = std::iter::once(loss).chain(grads).collect();
    expand(&mut grad);
    crate::import::verify("masked", &crate::Module { functions: vec![grad], resources: None })?;

    for (dim, with_v) in [(1, true), (2, false)] {
        let mut other = build(dim, with_v);
        assert_eq!(fuse(&mut other), 0, "softmax over {dim}, product with v: {with_v}");
    }
    Ok(())
}

/// PCP's torch-exported models: attention around a `B·H` batch reshaped to
/// `B, H` for the softmax, a float mask compared to zero (`select(mask == 0, -∞,
/// s)`) and the scale as an `arith.constant`. Every layer fuses, with the
/// negated mask as an operand, and the step still builds and verifies.
#[test]
fn exported_models_fuse_every_layer() -> anyhow::Result<()> {
    for (name, layers) in [("nanogpt_small.mlir", 2), ("nanogpt_medium.mlir", 4)] {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/models").join(name);
        let module = crate::import_file(&path)?;
        let mut f = crate::autodiff::inline_calls(&module, "main")?;
        assert_eq!(fuse(&mut f), layers, "{name}");
        for op in attention_ops(&f) {
            let spec = Spec::of(op).expect("spec");
            let d = *f.ty(op.operands[0]).shape.last().expect("rank") as f64;
            assert!(spec.masked && !spec.causal, "{name}: {spec:?}");
            assert!((spec.scale - 1.0 / d.sqrt()).abs() < 1e-7, "{name}: {spec:?}, head dim {d}");
            assert_eq!(op.operands.len(), 4, "{name}: the mask is an operand");
        }
        let step = crate::train_step(&module, "main", &crate::StepConfig::default())?;
        crate::import::verify(name, &step.module)?;
    }
    Ok(())
}
