//! The fused training step: forward, gradient and optimizer update in one
//! function, so parameters and optimizer state never leave the device.
//!
//! ```text
//! train_step(params…, opt_state…, step, lr, data…) -> (params'…, opt_state'…, loss)
//! eval_loss(params…, data…) -> loss
//! logits(…)                   (copied when the model defines @logits)
//! ```
//!
//! `step` is the 1-based step count and `lr` the learning rate, both `f32`
//! scalars computed on the host (so schedules need no recompilation).
//!
//! With [`StepConfig::accumulate`], two more functions split the step for
//! gradient accumulation over micro-batches (a batch that does not fit the
//! device runs as k micro-batches of the model's batch):
//!
//! ```text
//! grad_step(params…, acc…, data…) -> (acc + ∇loss…, loss)
//! apply_step(params…, opt_state…, step, lr, scale, acc…) -> (params'…, opt_state'…)
//! ```
//!
//! `apply_step` updates with the gradient `scale · acc` (`scale = 1/k`: the mean
//! of the micro-batches' gradients, which for equal micro-batches is the whole
//! batch's), clipped and applied exactly as `train_step` does.

use crate::attention::Attention;
use crate::autodiff::{GradError, Signature, inline_calls, signature};
use crate::ir::{Builder, ElementType, Function, Module, TensorType, ValueId};
use crate::precision::{Precision, mixed_precision};
use crate::recompute::Recompute;

/// The inner optimizer fused into `train_step`.
#[derive(Clone, Debug, PartialEq)]
pub enum Optimizer {
    /// Adam with decoupled weight decay and bias correction (PyTorch's and
    /// optax's `adamw`).
    AdamW {
        /// First-moment decay.
        beta1: f64,
        /// Second-moment decay.
        beta2: f64,
        /// Added to the second-moment root.
        eps: f64,
        /// Decoupled weight decay, applied to parameters of rank ≥ 2.
        weight_decay: f64,
    },
    /// SGD with momentum (PyTorch's `SGD`, no dampening).
    Sgd {
        /// Momentum coefficient.
        momentum: f64,
        /// L2 weight decay added to the gradient, for parameters of rank ≥ 2.
        weight_decay: f64,
    },
}

impl Default for Optimizer {
    fn default() -> Self {
        Self::AdamW { beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1 }
    }
}

impl Optimizer {
    /// State tensors per parameter: AdamW keeps m and v, SGD one buffer.
    pub fn state_per_param(&self) -> usize {
        match self {
            Self::AdamW { .. } => 2,
            Self::Sgd { .. } => 1,
        }
    }
}

/// How to build the step.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepConfig {
    /// The optimizer.
    pub optimizer: Optimizer,
    /// Clip gradients to this global L2 norm.
    pub clip_norm: Option<f64>,
    /// The matmuls' precision ([`crate::precision`]): applied to the forward
    /// before autodiff, so parameters, optimizer state and loss stay f32.
    pub precision: Precision,
    /// Which activations the backward recomputes instead of keeping.
    pub recompute: Recompute,
    /// Also build `grad_step` and `apply_step`, for gradient accumulation.
    pub accumulate: bool,
    /// Attention fused with a flash-style backward, or as the model writes it.
    pub attention: Attention,
    /// Also build `eval_sparse` for contributions in this top-k layout.
    pub sparse_screen: Option<SparseScreen>,
}

/// A top-k sparse layout: `k` entries kept in every chunk of `chunk` elements
/// (a tensor's last, shorter chunk keeps its share, at least one). A screen
/// uploads a contribution in it as each tensor's kept indices and values,
/// which `eval_sparse` scatters on the device, so its host makes nothing the
/// size of the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SparseScreen {
    /// Elements a chunk.
    pub chunk: u32,
    /// Entries kept a full chunk.
    pub k: u32,
}

impl SparseScreen {
    /// Entries kept in a tensor of `n` elements.
    pub fn kept_in(&self, n: usize) -> usize {
        let (c, k) = (self.chunk.max(1) as usize, self.k as usize);
        let kept = |len: usize| if len == 0 { 0 } else { (len * k).div_ceil(c).clamp(1, len) };
        (n / c) * kept(c) + kept(n % c)
    }
}

/// A module with `train_step`, `eval_loss`, `eval_moved` and maybe `logits`.
#[derive(Clone, Debug)]
pub struct TrainModule {
    /// The functions.
    pub module: Module,
    /// The loss function's signature (parameters, data, loss).
    pub signature: Signature,
    /// Optimizer state tensors per parameter.
    pub state_per_param: usize,
    /// Bytes of the forward values `train_step`'s backward reads: the
    /// activations a step keeps (fewer with [`StepConfig::recompute`]).
    pub saved_activation_bytes: u64,
}

/// Builds the training module for `entry` of `model`.
pub fn train_step(model: &Module, entry: &str, config: &StepConfig) -> Result<TrainModule, GradError> {
    let mut forward = inline_calls(model, entry)?;
    if config.attention == Attention::Fused {
        crate::attention::fuse(&mut forward);
    }
    crate::gelu::fuse(&mut forward);
    mixed_precision(&mut forward, config.precision);
    let sig = signature(&forward)?;
    let param_types: Vec<TensorType> = sig.params.iter().map(|(_, t)| t.clone()).collect();
    let data_types: Vec<TensorType> = sig.data.iter().map(|(_, t)| t.clone()).collect();
    let k = config.optimizer.state_per_param();
    let scalar = TensorType::scalar(sig.loss.element.clone());

    // train_step(params, state…, step, lr, data)
    let mut arg_types = param_types.clone();
    for _ in 0..k {
        arg_types.extend(param_types.iter().cloned());
    }
    arg_types.push(scalar.clone());
    arg_types.push(scalar.clone());
    arg_types.extend(data_types.iter().cloned());
    let mut step_fn = Function::new("train_step", &arg_types);
    let n = param_types.len();
    let params: Vec<ValueId> = step_fn.args[..n].to_vec();
    let state: Vec<Vec<ValueId>> = (0..k).map(|s| step_fn.args[n * (s + 1)..n * (s + 2)].to_vec()).collect();
    let (step, lr) = (step_fn.args[n * (k + 1)], step_fn.args[n * (k + 1) + 1]);
    let data: Vec<ValueId> = step_fn.args[n * (k + 1) + 2..].to_vec();
    let loss = splice(&forward, &sig, &params, &data, &mut step_fn)?;
    let forward_values = step_fn.ops.iter().flat_map(|op| op.results.iter().copied()).collect();
    let grads = crate::autodiff::backward_recomputing(&mut step_fn, loss, &params, config.recompute)?;
    let mut b = Builder::new(&mut step_fn, None);
    let (new_params, new_state) = clip_and_update(&mut b, config, &params, grads, &state, step, lr);
    step_fn.results = new_params.into_iter().chain(new_state.into_iter().flatten()).chain([loss]).collect();
    step_fn.eliminate_dead_code();
    let saved_activation_bytes = crate::recompute::saved_bytes(&step_fn, &forward_values);
    let mut functions = vec![step_fn];
    if config.accumulate {
        functions.push(grad_step(&forward, &sig, config.recompute)?);
        functions.push(apply_step(&param_types, config, &scalar));
    }

    // eval_loss(params, data)
    let mut eval_types = param_types;
    eval_types.extend(data_types);
    let mut eval = Function::new("eval_loss", &eval_types);
    let (p, d) = (eval.args[..n].to_vec(), eval.args[n..].to_vec());
    let eval_loss = splice(&forward, &sig, &p, &d, &mut eval)?;
    eval.results = vec![eval_loss];
    eval.eliminate_dead_code();
    let moved = eval_moved(&forward, &sig, &scalar)?;

    functions.insert(1, eval);
    functions.insert(2, moved);
    if let Some(layout) = config.sparse_screen {
        functions.insert(3, eval_sparse(&forward, &sig, &scalar, layout)?);
    }
    if entry != "logits" && model.function("logits").is_some() {
        let mut logits = inline_calls(model, "logits")?;
        if config.attention == Attention::Fused {
            crate::attention::fuse(&mut logits);
        }
        crate::gelu::fuse(&mut logits);
        mixed_precision(&mut logits, config.precision);
        logits.eliminate_dead_code();
        functions.push(logits);
    }
    for f in &mut functions {
        crate::iree::legalize(f);
    }
    Ok(TrainModule {
        module: Module { functions, resources: model.resources.clone() },
        signature: sig,
        state_per_param: k,
        saved_activation_bytes,
    })
}

/// `eval_moved(params…, delta…, alpha, data…) -> loss`: the loss at
/// params + alpha × delta, the parameters moved on the device. A screen scores a
/// contribution with the round's parameters resident and only the contribution
/// uploaded, so its host copies nothing the size of the model a pass.
fn eval_moved(forward: &Function, sig: &Signature, scalar: &TensorType) -> Result<Function, GradError> {
    let param_types: Vec<TensorType> = sig.params.iter().map(|(_, t)| t.clone()).collect();
    let n = param_types.len();
    let mut arg_types = param_types.clone();
    arg_types.extend(param_types.iter().cloned());
    arg_types.push(scalar.clone());
    arg_types.extend(sig.data.iter().map(|(_, t)| t.clone()));
    let mut f = Function::new("eval_moved", &arg_types);
    let (params, delta, alpha, data) =
        (f.args[..n].to_vec(), f.args[n..2 * n].to_vec(), f.args[2 * n], f.args[2 * n + 1..].to_vec());
    let mut b = Builder::new(&mut f, None);
    let moved: Vec<ValueId> = params
        .iter()
        .zip(&delta)
        .map(|(p, d)| {
            let step = scale_by(&mut b, *d, alpha);
            b.add(*p, step)
        })
        .collect();
    let loss = splice(forward, sig, &moved, &data, &mut f)?;
    f.results = vec![loss];
    f.eliminate_dead_code();
    Ok(f)
}

/// `eval_sparse(params…, indices…, values…, alpha, data…) -> loss`: the loss at
/// params + alpha × delta, where each tensor's delta is its `values` at its flat
/// `indices` (i32, `[m, 1]`, m its [`SparseScreen::kept_in`]; ascending and
/// distinct, which the caller checks) and zero elsewhere, scattered on the
/// device.
fn eval_sparse(
    forward: &Function,
    sig: &Signature,
    scalar: &TensorType,
    layout: SparseScreen,
) -> Result<Function, GradError> {
    let param_types: Vec<TensorType> = sig.params.iter().map(|(_, t)| t.clone()).collect();
    let n = param_types.len();
    let kept: Vec<i64> = param_types.iter().map(|t| layout.kept_in(t.elements().max(0) as usize) as i64).collect();
    let mut arg_types = param_types.clone();
    arg_types.extend(kept.iter().map(|m| TensorType::new(vec![*m, 1], ElementType::Int("i32".into()))));
    arg_types.extend(param_types.iter().zip(&kept).map(|(t, m)| TensorType::new(vec![*m], t.element.clone())));
    arg_types.push(scalar.clone());
    arg_types.extend(sig.data.iter().map(|(_, t)| t.clone()));
    let mut f = Function::new("eval_sparse", &arg_types);
    let (params, indices, values) = (f.args[..n].to_vec(), f.args[n..2 * n].to_vec(), f.args[2 * n..3 * n].to_vec());
    let (alpha, data) = (f.args[3 * n], f.args[3 * n + 1..].to_vec());
    let mut b = Builder::new(&mut f, None);
    let mut moved = Vec::with_capacity(n);
    for (((p, i), v), t) in params.iter().zip(&indices).zip(&values).zip(&param_types) {
        let flat = t.with_shape(vec![t.elements()]);
        let zeros = b.splat(0.0, &flat);
        let region = crate::ir::binary_region("stablehlo.add", &TensorType::scalar(t.element.clone()));
        let props = vec![
            ("indices_are_sorted".to_owned(), "true".to_owned()),
            (
                "scatter_dimension_numbers".to_owned(),
                "#stablehlo.scatter<inserted_window_dims = [0], scatter_dims_to_operand_dims = [0], index_vector_dim = 1>"
                    .to_owned(),
            ),
            ("unique_indices".to_owned(), "true".to_owned()),
        ];
        let dense = b.op("stablehlo.scatter", &[zeros, *i, *v], props, Some(region), flat);
        let dense = b.reshape(dense, &t.shape);
        let step = scale_by(&mut b, dense, alpha);
        moved.push(b.add(*p, step));
    }
    let loss = splice(forward, sig, &moved, &data, &mut f)?;
    f.results = vec![loss];
    f.eliminate_dead_code();
    Ok(f)
}

/// `grad_step(params…, acc…, data…) -> (acc + ∇loss…, loss)`.
fn grad_step(forward: &Function, sig: &Signature, recompute: Recompute) -> Result<Function, GradError> {
    let param_types: Vec<TensorType> = sig.params.iter().map(|(_, t)| t.clone()).collect();
    let mut arg_types = param_types.clone();
    arg_types.extend(param_types.iter().cloned());
    arg_types.extend(sig.data.iter().map(|(_, t)| t.clone()));
    let mut f = Function::new("grad_step", &arg_types);
    let n = param_types.len();
    let (params, acc, data) = (f.args[..n].to_vec(), f.args[n..2 * n].to_vec(), f.args[2 * n..].to_vec());
    let loss = splice(forward, sig, &params, &data, &mut f)?;
    let grads = crate::autodiff::backward_recomputing(&mut f, loss, &params, recompute)?;
    let mut b = Builder::new(&mut f, None);
    let sums: Vec<ValueId> = acc.iter().zip(&grads).map(|(a, g)| b.add(*a, *g)).collect();
    f.results = sums.into_iter().chain([loss]).collect();
    f.eliminate_dead_code();
    Ok(f)
}

/// `apply_step(params…, opt_state…, step, lr, scale, acc…) -> (params'…, opt_state'…)`.
fn apply_step(param_types: &[TensorType], config: &StepConfig, scalar: &TensorType) -> Function {
    let k = config.optimizer.state_per_param();
    let n = param_types.len();
    let mut arg_types: Vec<TensorType> = Vec::new();
    for _ in 0..=k {
        arg_types.extend(param_types.iter().cloned());
    }
    arg_types.extend([scalar.clone(), scalar.clone(), scalar.clone()]);
    arg_types.extend(param_types.iter().cloned());
    let mut f = Function::new("apply_step", &arg_types);
    let params: Vec<ValueId> = f.args[..n].to_vec();
    let state: Vec<Vec<ValueId>> = (0..k).map(|s| f.args[n * (s + 1)..n * (s + 2)].to_vec()).collect();
    let at = n * (k + 1);
    let (step, lr, scale) = (f.args[at], f.args[at + 1], f.args[at + 2]);
    let acc: Vec<ValueId> = f.args[at + 3..].to_vec();
    let mut b = Builder::new(&mut f, None);
    let grads: Vec<ValueId> = acc.iter().map(|a| scale_by(&mut b, *a, scale)).collect();
    let (new_params, new_state) = clip_and_update(&mut b, config, &params, grads, &state, step, lr);
    f.results = new_params.into_iter().chain(new_state.into_iter().flatten()).collect();
    f.eliminate_dead_code();
    f
}

/// Clips `grads` as `config` says and applies its optimizer.
fn clip_and_update(
    b: &mut Builder<'_>,
    config: &StepConfig,
    params: &[ValueId],
    grads: Vec<ValueId>,
    state: &[Vec<ValueId>],
    step: ValueId,
    lr: ValueId,
) -> (Vec<ValueId>, Vec<Vec<ValueId>>) {
    let grads = match config.clip_norm {
        Some(max_norm) => clip(b, &grads, max_norm),
        None => grads,
    };
    update(b, &config.optimizer, params, &grads, state, step, lr)
}

/// Copies the (inlined) forward into `into`, its parameters and data taken
/// from `params` and `data`; returns the loss.
fn splice(
    forward: &Function,
    sig: &Signature,
    params: &[ValueId],
    data: &[ValueId],
    into: &mut Function,
) -> Result<ValueId, GradError> {
    let mut args = vec![ValueId(0); forward.args.len()];
    for ((i, _), v) in sig.params.iter().zip(params) {
        args[*i] = *v;
    }
    for ((i, _), v) in sig.data.iter().zip(data) {
        args[*i] = *v;
    }
    let module = Module { functions: vec![forward.clone()], resources: None };
    let results = crate::autodiff::inline_with_args(&module, &forward.name, &args, into)?;
    Ok(results[0])
}

/// Scales every gradient by min(1, max_norm / ‖g‖) over all of them.
fn clip(b: &mut Builder<'_>, grads: &[ValueId], max_norm: f64) -> Vec<ValueId> {
    let Some(first) = grads.first() else { return Vec::new() };
    let scalar = TensorType::scalar(b.ty(*first).element);
    let mut total = b.splat(0.0, &scalar);
    for g in grads {
        let sq = b.mul(*g, *g);
        let s = b.sum_all(sq);
        total = b.add(total, s);
    }
    let norm = b.unary_op("stablehlo.sqrt", total);
    let max = b.splat(max_norm, &scalar);
    let ratio = b.div(max, norm);
    let over = b.compare(norm, max, "GT");
    let one = b.splat(1.0, &scalar);
    let scale = b.select(over, ratio, one);
    grads.iter().map(|g| scale_by(b, *g, scale)).collect()
}

fn scale_by(b: &mut Builder<'_>, x: ValueId, scalar: ValueId) -> ValueId {
    let shape = b.ty(x).shape;
    let s = b.broadcast_in_dim(scalar, &[], &shape);
    b.mul(x, s)
}

fn update(
    b: &mut Builder<'_>,
    optimizer: &Optimizer,
    params: &[ValueId],
    grads: &[ValueId],
    state: &[Vec<ValueId>],
    step: ValueId,
    lr: ValueId,
) -> (Vec<ValueId>, Vec<Vec<ValueId>>) {
    let scalar = b.ty(step);
    let mut new_params = Vec::new();
    match *optimizer {
        Optimizer::AdamW { beta1, beta2, eps, weight_decay } => {
            // Scalars shared by every parameter.
            let one = b.splat(1.0, &scalar);
            let b1 = b.splat(beta1, &scalar);
            let b2 = b.splat(beta2, &scalar);
            let b1t = b.pow(b1, step);
            let b2t = b.pow(b2, step);
            let bc1 = b.sub(one, b1t);
            let bc2 = b.sub(one, b2t);
            let step_size = b.div(lr, bc1);
            let bc2_root = b.unary_op("stablehlo.sqrt", bc2);
            let wd = b.splat(weight_decay, &scalar);
            let lr_wd = b.mul(lr, wd);
            let decay = b.sub(one, lr_wd);
            let (mut ms, mut vs) = (Vec::new(), Vec::new());
            for (i, (&p, &g)) in params.iter().zip(grads).enumerate() {
                let (m, v) = (state[0][i], state[1][i]);
                let mb = b.scale(m, beta1);
                let gb = b.scale(g, 1.0 - beta1);
                let m2 = b.add(mb, gb);
                let vb = b.scale(v, beta2);
                let gg = b.mul(g, g);
                let ggb = b.scale(gg, 1.0 - beta2);
                let v2 = b.add(vb, ggb);
                let root = b.unary_op("stablehlo.sqrt", v2);
                let root = scale_div(b, root, bc2_root);
                let eps_t = b.splat_like(eps, root);
                let denom = b.add(root, eps_t);
                let ratio = b.div(m2, denom);
                let delta = scale_by(b, ratio, step_size);
                let decayed = if weight_decay != 0.0 && b.ty(p).rank() >= 2 { scale_by(b, p, decay) } else { p };
                new_params.push(b.sub(decayed, delta));
                ms.push(m2);
                vs.push(v2);
            }
            (new_params, vec![ms, vs])
        }
        Optimizer::Sgd { momentum, weight_decay } => {
            let mut bufs = Vec::new();
            for (i, (&p, &g)) in params.iter().zip(grads).enumerate() {
                let g = if weight_decay != 0.0 && b.ty(p).rank() >= 2 {
                    let d = b.scale(p, weight_decay);
                    b.add(g, d)
                } else {
                    g
                };
                let mb = b.scale(state[0][i], momentum);
                let buf = b.add(mb, g);
                let delta = scale_by(b, buf, lr);
                new_params.push(b.sub(p, delta));
                bufs.push(buf);
            }
            (new_params, vec![bufs])
        }
    }
}

/// `x / s` for a scalar `s`.
fn scale_div(b: &mut Builder<'_>, x: ValueId, scalar: ValueId) -> ValueId {
    let shape = b.ty(x).shape;
    let s = b.broadcast_in_dim(scalar, &[], &shape);
    b.div(x, s)
}
