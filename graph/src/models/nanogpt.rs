//! nanoGPT (GPT-2 architecture) as StableHLO: token and position
//! embeddings, pre-LayerNorm blocks of causal multi-head self-attention and a
//! GELU MLP, a final LayerNorm and an untied language-model head.

use super::{BuildError, BuiltModel, Init, ParamSpec};
use crate::ir::{Builder, ElementType, FloatType, Function, Module, TensorType, ValueId};

const F32: ElementType = ElementType::Float(FloatType::F32);
const LAYER_NORM_EPS: f64 = 1e-5;
const INIT_STD: f64 = 0.02;

/// The shape of a nanoGPT model and of its training batches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NanoGptConfig {
    /// Transformer blocks.
    pub n_layer: usize,
    /// Attention heads per block; must divide `n_embd`.
    pub n_head: usize,
    /// Embedding width.
    pub n_embd: usize,
    /// Context length: the sequence length of every batch.
    pub block_size: usize,
    /// Vocabulary size (the tokenizer decides it).
    pub vocab_size: usize,
    /// Sequences per batch.
    pub batch_size: usize,
    /// Whether linear layers and LayerNorms have biases.
    pub bias: bool,
}

impl NanoGptConfig {
    /// PCP's small configuration: 2 layers, width 64, 4 heads, context 32,
    /// batch 64, 65 characters.
    pub fn small() -> Self {
        Self { n_layer: 2, n_head: 4, n_embd: 64, block_size: 32, vocab_size: 65, batch_size: 64, bias: true }
    }

    /// PCP's medium configuration: 4 layers, width 256, 8 heads, context
    /// 128, batch 64, 65 characters.
    pub fn medium() -> Self {
        Self { n_layer: 4, n_head: 8, n_embd: 256, block_size: 128, vocab_size: 65, batch_size: 64, bias: true }
    }

    /// GPT-2 small's shape: 12 layers, width 768, 12 heads, context 1024, batch 8.
    /// GPT-2's 50,257-token vocabulary is padded to 50,304, a multiple of 64, as
    /// nanoGPT does: the head's matmuls then tile evenly, which IREE's ROCm
    /// code generation needs (with 50,257 rows one dispatch asks for 80 KiB of
    /// shared memory, over the 64 KiB limit). 124M parameters (163M with
    /// nanoGPT's untied head); with the demo corpus's 65 characters, 85M.
    pub fn gpt2_124m() -> Self {
        Self { n_layer: 12, n_head: 12, n_embd: 768, block_size: 1024, vocab_size: 50304, batch_size: 8, bias: true }
    }

    /// The same configuration with another vocabulary size.
    pub fn with_vocab_size(self, vocab_size: usize) -> Self {
        Self { vocab_size, ..self }
    }

    fn validate(&self) -> Result<(), BuildError> {
        let fail = |reason: String| Err(BuildError::Config { model: "nanoGPT", reason });
        for (name, value) in [
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("n_embd", self.n_embd),
            ("block_size", self.block_size),
            ("vocab_size", self.vocab_size),
            ("batch_size", self.batch_size),
        ] {
            if value == 0 {
                return fail(format!("{name} must be positive"));
            }
        }
        if !self.n_embd.is_multiple_of(self.n_head) {
            return fail(format!("n_embd {} is not a multiple of n_head {}", self.n_embd, self.n_head));
        }
        // The largest activations: logits, MLP hidden states and attention scores.
        let widest =
            self.vocab_size.max(self.n_embd.saturating_mul(4)).max(self.n_head.saturating_mul(self.block_size));
        let elements = self.batch_size.checked_mul(self.block_size).and_then(|n| n.checked_mul(widest));
        if elements.is_none_or(|n| n > i32::MAX as usize) {
            return fail("activations of batch_size × block_size × width would exceed 2^31 elements".to_owned());
        }
        Ok(())
    }
}

/// Argument indices of one block's parameters.
#[derive(Debug)]
struct BlockParams {
    ln_1: (usize, Option<usize>),
    c_attn: (usize, Option<usize>),
    attn_proj: (usize, Option<usize>),
    ln_2: (usize, Option<usize>),
    c_fc: (usize, Option<usize>),
    mlp_proj: (usize, Option<usize>),
}

/// Argument indices of every parameter.
#[derive(Debug)]
struct Layout {
    wte: usize,
    wpe: usize,
    blocks: Vec<BlockParams>,
    ln_f: (usize, Option<usize>),
    lm_head: usize,
}

fn layout(c: &NanoGptConfig) -> (Vec<ParamSpec>, Layout) {
    let d = c.n_embd as i64;
    let mut specs = Vec::new();
    let mut push = |name: String, shape: Vec<i64>, init: Init| {
        specs.push(ParamSpec { name, ty: TensorType::new(shape, F32), init });
        specs.len() - 1
    };
    let normal = Init::Normal { std: INIT_STD };
    let residual = Init::Normal { std: INIT_STD / (2.0 * c.n_layer as f64).sqrt() };
    let wte = push("transformer.wte.weight".into(), vec![c.vocab_size as i64, d], normal);
    let wpe = push("transformer.wpe.weight".into(), vec![c.block_size as i64, d], normal);
    let layer_norm = |push: &mut dyn FnMut(String, Vec<i64>, Init) -> usize, prefix: &str| {
        let w = push(format!("{prefix}.weight"), vec![d], Init::Ones);
        let b = c.bias.then(|| push(format!("{prefix}.bias"), vec![d], Init::Zeros));
        (w, b)
    };
    let linear = |push: &mut dyn FnMut(String, Vec<i64>, Init) -> usize, prefix: &str, out: i64, inp: i64, init| {
        let w = push(format!("{prefix}.weight"), vec![out, inp], init);
        let b = c.bias.then(|| push(format!("{prefix}.bias"), vec![out], Init::Zeros));
        (w, b)
    };
    let mut blocks = Vec::new();
    for i in 0..c.n_layer {
        let p = format!("transformer.h.{i}");
        blocks.push(BlockParams {
            ln_1: layer_norm(&mut push, &format!("{p}.ln_1")),
            c_attn: linear(&mut push, &format!("{p}.attn.c_attn"), 3 * d, d, normal),
            attn_proj: linear(&mut push, &format!("{p}.attn.c_proj"), d, d, residual),
            ln_2: layer_norm(&mut push, &format!("{p}.ln_2")),
            c_fc: linear(&mut push, &format!("{p}.mlp.c_fc"), 4 * d, d, normal),
            mlp_proj: linear(&mut push, &format!("{p}.mlp.c_proj"), d, 4 * d, residual),
        });
    }
    let ln_f = layer_norm(&mut push, "transformer.ln_f");
    let lm_head = push("lm_head.weight".into(), vec![c.vocab_size as i64, d], normal);
    (specs, Layout { wte, wpe, blocks, ln_f, lm_head })
}

/// Builds nanoGPT for `config`.
///
/// The module holds `@main(params…, input_ids, targets) -> tensor<f32>`, the
/// mean next-token cross-entropy over every position, and
/// `@logits(params…, input_ids) -> tensor<B×T×V×f32>`, the same forward pass
/// without the loss. Token ids are `tensor<B×T×i32>`.
pub fn nanogpt(config: &NanoGptConfig) -> Result<BuiltModel, BuildError> {
    config.validate()?;
    let (params, layout) = layout(config);
    let ids = TensorType::new(vec![config.batch_size as i64, config.block_size as i64], ElementType::Int("i32".into()));
    let mut arg_types: Vec<TensorType> = params.iter().map(|p| p.ty.clone()).collect();
    arg_types.push(ids.clone());

    let mut logits_fn = Function::new("logits", &arg_types);
    {
        let args = logits_fn.args.clone();
        let mut b = Builder::new(&mut logits_fn, None);
        let flat = forward(&mut b, config, &layout, &args, args[params.len()]);
        let (bs, t, v) = (config.batch_size as i64, config.block_size as i64, config.vocab_size as i64);
        let logits = b.reshape(flat, &[bs, t, v]);
        logits_fn.results = vec![logits];
    }

    arg_types.push(ids.clone());
    let mut main = Function::new("main", &arg_types);
    {
        let args = main.args.clone();
        let targets = args[args.len() - 1];
        let mut b = Builder::new(&mut main, None);
        let logits = forward(&mut b, config, &layout, &args, args[params.len()]);
        b.set_loc(Some("loc(\"nanogpt.loss\")".into()));
        let loss = cross_entropy(&mut b, logits, targets);
        main.results = vec![loss];
    }

    for f in [&mut main, &mut logits_fn] {
        f.eliminate_dead_code();
        crate::iree::legalize(f);
    }
    Ok(BuiltModel {
        module: Module { functions: vec![main, logits_fn], resources: None },
        params,
        data: vec![("input_ids".into(), ids.clone()), ("targets".into(), ids)],
    })
}

/// [`nanogpt`]'s module as generic-form MLIR text.
pub fn emit_mlir(config: &NanoGptConfig) -> Result<String, BuildError> {
    Ok(nanogpt(config)?.module.to_mlir())
}

/// The logits, `[B·T, V]`, of token ids `ids: [B, T]`; `args` starts with the parameters.
fn forward(b: &mut Builder<'_>, c: &NanoGptConfig, l: &Layout, args: &[ValueId], ids: ValueId) -> ValueId {
    let (bs, t, d) = (c.batch_size as i64, c.block_size as i64, c.n_embd as i64);
    b.set_loc(Some("loc(\"nanogpt.embedding\")".into()));
    let gather_props = vec![
        (
            "dimension_numbers".to_owned(),
            "#stablehlo.gather<offset_dims = [2], collapsed_slice_dims = [0], start_index_map = [0], index_vector_dim = 2>"
                .to_owned(),
        ),
        ("indices_are_sorted".to_owned(), "false".to_owned()),
        ("slice_sizes".to_owned(), crate::ir::attr::i64_array(&[1, d])),
    ];
    let tok = b.op("stablehlo.gather", &[args[l.wte], ids], gather_props, None, TensorType::new(vec![bs, t, d], F32));
    let pos = b.broadcast_in_dim(args[l.wpe], &[1, 2], &[bs, t, d]);
    let x = b.add(tok, pos);
    let mut x = b.reshape(x, &[bs * t, d]);

    // The causal mask, shared by every layer: key position <= query position.
    let square = TensorType::new(vec![t, t], ElementType::Int("i32".into()));
    let iota = |b: &mut Builder<'_>, dim: i64| {
        b.op("stablehlo.iota", &[], vec![("iota_dimension".into(), format!("{dim} : i64"))], None, square.clone())
    };
    let (query, key) = (iota(b, 0), iota(b, 1));
    let causal = b.compare(key, query, "LE");

    let param = |p: (usize, Option<usize>)| (args[p.0], p.1.map(|i| args[i]));
    for (i, block) in l.blocks.iter().enumerate() {
        b.set_loc(Some(format!("loc(\"nanogpt.h.{i}.attn\")")));
        let h = layer_norm(b, x, param(block.ln_1));
        let a = attention(b, c, h, causal, param(block.c_attn), param(block.attn_proj));
        x = b.add(x, a);
        b.set_loc(Some(format!("loc(\"nanogpt.h.{i}.mlp\")")));
        let h = layer_norm(b, x, param(block.ln_2));
        let h = linear(b, h, param(block.c_fc));
        let h = crate::gelu::build(b, h);
        let m = linear(b, h, param(block.mlp_proj));
        x = b.add(x, m);
    }
    b.set_loc(Some("loc(\"nanogpt.lm_head\")".into()));
    let x = layer_norm(b, x, param(l.ln_f));
    linear(b, x, (args[l.lm_head], None))
}

/// `x · wᵀ + bias` for `x: [N, in]`, `w: [out, in]` (PyTorch's layout).
fn linear(b: &mut Builder<'_>, x: ValueId, (w, bias): (ValueId, Option<ValueId>)) -> ValueId {
    let y = b.dot_general(x, w, &[], &[], &[1], &[1], F32);
    match bias {
        Some(bias) => {
            let shape = b.ty(y).shape;
            let bias = b.broadcast_in_dim(bias, &[1], &shape);
            b.add(y, bias)
        }
        None => y,
    }
}

/// LayerNorm over the last dimension of `x: [N, D]` (biased variance).
fn layer_norm(b: &mut Builder<'_>, x: ValueId, (w, bias): (ValueId, Option<ValueId>)) -> ValueId {
    let shape = b.ty(x).shape;
    let d = shape[1] as f64;
    let sum = b.reduce_sum(x, &[1]);
    let mean = b.scale(sum, 1.0 / d);
    let mean = b.broadcast_in_dim(mean, &[0], &shape);
    let centered = b.sub(x, mean);
    let square = b.mul(centered, centered);
    let var = b.reduce_sum(square, &[1]);
    let var = b.scale(var, 1.0 / d);
    let eps = b.splat_like(LAYER_NORM_EPS, var);
    let var = b.add(var, eps);
    let rstd = b.unary_op("stablehlo.rsqrt", var);
    let rstd = b.broadcast_in_dim(rstd, &[0], &shape);
    let normed = b.mul(centered, rstd);
    let w = b.broadcast_in_dim(w, &[1], &shape);
    let y = b.mul(normed, w);
    match bias {
        Some(bias) => {
            let bias = b.broadcast_in_dim(bias, &[1], &shape);
            b.add(y, bias)
        }
        None => y,
    }
}

/// Causal multi-head self-attention of `x: [B·T, D]` with a fused qkv projection.
fn attention(
    b: &mut Builder<'_>,
    c: &NanoGptConfig,
    x: ValueId,
    causal: ValueId,
    c_attn: (ValueId, Option<ValueId>),
    c_proj: (ValueId, Option<ValueId>),
) -> ValueId {
    let (bs, t, d, nh) = (c.batch_size as i64, c.block_size as i64, c.n_embd as i64, c.n_head as i64);
    let hd = d / nh;
    let qkv = linear(b, x, c_attn);
    // [B·T, 3D] → [B, T, 3, H, hd]: q, k and v are consecutive D-wide slices.
    let qkv = b.reshape(qkv, &[bs, t, 3, nh, hd]);
    let part = |b: &mut Builder<'_>, i: i64| {
        let s = b.slice(qkv, &[0, 0, i, 0, 0], &[bs, t, i + 1, nh, hd], &[1; 5]);
        b.reshape(s, &[bs, t, nh, hd])
    };
    let (q, k, v) = (part(b, 0), part(b, 1), part(b, 2));
    // scores[b, h, i, j] = q[b, i, h, :] · k[b, j, h, :] / √hd
    let scores = b.dot_general(q, k, &[0, 2], &[0, 2], &[3], &[3], F32);
    let scores = b.scale(scores, 1.0 / (hd as f64).sqrt());
    let shape = [bs, nh, t, t];
    let mask = b.broadcast_in_dim(causal, &[2, 3], &shape);
    let neg_inf = b.splat(f64::NEG_INFINITY, &TensorType::new(shape.to_vec(), F32));
    let scores = b.select(mask, scores, neg_inf);
    let probs = softmax_last(b, scores);
    // y[b, h, i, :] = Σ_j probs[b, h, i, j] · v[b, j, h, :]
    let y = b.dot_general(probs, v, &[0, 1], &[0, 2], &[3], &[1], F32);
    let y = b.transpose(y, &[0, 2, 1, 3]);
    let y = b.reshape(y, &[bs * t, d]);
    linear(b, y, c_proj)
}

/// Softmax over the last dimension, shifted by the row maximum.
fn softmax_last(b: &mut Builder<'_>, x: ValueId) -> ValueId {
    let shape = b.ty(x).shape;
    let last = shape.len() as i64 - 1;
    let kept: Vec<i64> = (0..last).collect();
    let max = b.reduce(x, &[last], "stablehlo.maximum", f64::NEG_INFINITY);
    let max = b.broadcast_in_dim(max, &kept, &shape);
    let shifted = b.sub(x, max);
    let e = b.unary_op("stablehlo.exponential", shifted);
    let sum = b.reduce_sum(e, &[last]);
    let sum = b.broadcast_in_dim(sum, &kept, &shape);
    b.div(e, sum)
}

/// Mean cross-entropy of `logits: [N, V]` against `targets: [B, T]` (N = B·T),
/// through a max-shifted log-softmax.
fn cross_entropy(b: &mut Builder<'_>, logits: ValueId, targets: ValueId) -> ValueId {
    let shape = b.ty(logits).shape;
    let (n, v) = (shape[0], shape[1]);
    let max = b.reduce(logits, &[1], "stablehlo.maximum", f64::NEG_INFINITY);
    let max = b.broadcast_in_dim(max, &[0], &shape);
    let shifted = b.sub(logits, max);
    let e = b.unary_op("stablehlo.exponential", shifted);
    let sum = b.reduce_sum(e, &[1]);
    let log_sum = b.unary_op("stablehlo.log", sum);
    // The target's shifted logit, picked with a one-hot mask.
    let targets = b.reshape(targets, &[n]);
    let targets = b.broadcast_in_dim(targets, &[0], &shape);
    let classes = b.op(
        "stablehlo.iota",
        &[],
        vec![("iota_dimension".into(), "1 : i64".into())],
        None,
        TensorType::new(vec![n, v], ElementType::Int("i32".into())),
    );
    let hit = b.compare(classes, targets, "EQ");
    let one_hot = b.convert(hit, &F32);
    let picked = b.mul(shifted, one_hot);
    let picked = b.reduce_sum(picked, &[1]);
    let nll = b.sub(log_sum, picked);
    let total = b.sum_all(nll);
    let count = b.splat_like(n as f64, total);
    b.div(total, count)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::differentiate;

    /// Parameters per the GPT-2 layout: wte, wpe, per block 2 LayerNorms and
    /// 4 linears, the final LayerNorm and the head.
    fn expected_params(c: &NanoGptConfig) -> usize {
        let per_block = if c.bias { 12 } else { 6 };
        let ln_f = if c.bias { 2 } else { 1 };
        2 + c.n_layer * per_block + ln_f + 1
    }

    fn expected_elements(c: &NanoGptConfig) -> i64 {
        let (d, v, t, l) = (c.n_embd as i64, c.vocab_size as i64, c.block_size as i64, c.n_layer as i64);
        let b = i64::from(c.bias);
        let block =
            2 * (d + b * d) + (3 * d * d + b * 3 * d) + (d * d + b * d) + (4 * d * d + b * 4 * d) + (4 * d * d + b * d);
        v * d + t * d + l * block + (d + b * d) + v * d
    }

    fn tiny(bias: bool) -> NanoGptConfig {
        NanoGptConfig { n_layer: 2, n_head: 4, n_embd: 32, block_size: 8, vocab_size: 11, batch_size: 4, bias }
    }

    #[test]
    fn presets_by_name() {
        assert_eq!(crate::models::preset("nanogpt-small"), Some(NanoGptConfig::small()));
        assert_eq!(crate::models::preset("nanogpt-medium"), Some(NanoGptConfig::medium()));
        assert_eq!(crate::models::preset("nanogpt-large"), None);
        assert_eq!(NanoGptConfig::medium().with_vocab_size(50304).vocab_size, 50304);
    }

    #[test]
    fn signatures_have_the_configured_shapes() {
        for c in [NanoGptConfig::small(), NanoGptConfig::medium(), tiny(false), tiny(true)] {
            let model = nanogpt(&c).expect("builds");
            assert_eq!(model.params.len(), expected_params(&c), "{c:?}");
            assert_eq!(model.parameter_count(), expected_elements(&c), "{c:?}");
            let ids = format!("tensor<{}x{}xi32>", c.batch_size, c.block_size);
            let main = model.module.function("main").expect("@main");
            let types: Vec<String> = main.arg_types().iter().map(ToString::to_string).collect();
            assert_eq!(types.len(), model.params.len() + 2);
            for (p, t) in model.params.iter().zip(&types) {
                assert_eq!(p.ty.to_string(), *t, "{}", p.name);
            }
            assert_eq!(types[types.len() - 2..], [ids.clone(), ids.clone()]);
            assert_eq!(main.result_types()[0].to_string(), "tensor<f32>");
            let logits = model.module.function("logits").expect("@logits");
            assert_eq!(logits.arg_types().len(), model.params.len() + 1);
            assert_eq!(
                logits.result_types()[0].to_string(),
                format!("tensor<{}x{}x{}xf32>", c.batch_size, c.block_size, c.vocab_size)
            );
            crate::import::verify("nanogpt", &model.module).expect("verifies with melior");
        }
    }

    #[test]
    fn gpt2_initialisation() {
        let model = nanogpt(&NanoGptConfig::small()).expect("builds");
        let init = |name: &str| model.params.iter().find(|p| p.name == name).map(|p| p.init);
        let residual = Init::Normal { std: 0.02 / 2.0 };
        assert_eq!(init("transformer.wte.weight"), Some(Init::Normal { std: 0.02 }));
        assert_eq!(init("transformer.h.1.attn.c_attn.weight"), Some(Init::Normal { std: 0.02 }));
        assert_eq!(init("transformer.h.1.attn.c_proj.weight"), Some(residual));
        assert_eq!(init("transformer.h.0.mlp.c_proj.weight"), Some(residual));
        assert_eq!(init("transformer.h.0.mlp.c_fc.bias"), Some(Init::Zeros));
        assert_eq!(init("transformer.ln_f.weight"), Some(Init::Ones));
        assert_eq!(init("transformer.ln_f.bias"), Some(Init::Zeros));
        assert_eq!(init("lm_head.weight"), Some(Init::Normal { std: 0.02 }));
        assert_eq!(model.params.last().map(|p| p.ty.to_string()).as_deref(), Some("tensor<65x64xf32>"));
    }

    #[test]
    fn differentiates_within_three_times_the_forward() {
        for c in [NanoGptConfig::small(), NanoGptConfig::medium(), tiny(false)] {
            let model = nanogpt(&c).expect("builds");
            let gradient = differentiate(&model.module, "main").expect("differentiates");
            assert_eq!(gradient.signature.params.len(), model.params.len());
            assert_eq!(gradient.signature.data.len(), 2);
            assert!(
                gradient.gradient_ops <= 3 * gradient.forward_ops,
                "{c:?}: {} gradient ops for {} forward ops",
                gradient.gradient_ops,
                gradient.forward_ops
            );
            let grad = gradient.module.function("main_grad").expect("@main_grad");
            for (k, p) in model.params.iter().enumerate() {
                assert_eq!(grad.ty(grad.results[k + 1]), &p.ty, "gradient of {}", p.name);
            }
            crate::import::verify("nanogpt_grad", &gradient.module).expect("gradient verifies with melior");
        }
    }

    #[test]
    fn bad_configurations_are_named() {
        let err = nanogpt(&NanoGptConfig { n_head: 5, ..NanoGptConfig::small() }).expect_err("64 % 5 != 0");
        assert_eq!(err.to_string(), "invalid nanoGPT configuration: n_embd 64 is not a multiple of n_head 5");
        let err = nanogpt(&NanoGptConfig { n_layer: 0, ..NanoGptConfig::small() }).expect_err("no layers");
        assert!(err.to_string().contains("n_layer must be positive"), "{err}");
        let err = nanogpt(&NanoGptConfig { batch_size: 1 << 40, ..NanoGptConfig::small() }).expect_err("huge");
        assert!(err.to_string().contains("exceed 2^31 elements"), "{err}");
    }
}
