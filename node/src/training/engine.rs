//! The device side of training: a compiled `train_step` module loaded in an
//! IREE session, with parameters and optimizer state resident on the device.

use anyhow::Context as _;
use pcp_runtime::{Arg, Buffer, Device, HostTensor, Session};

use crate::training::data::Batch;

/// A training module on a device, holding parameters and optimizer state.
#[derive(Debug)]
pub(crate) struct Engine {
    session: Session,
    shapes: Vec<Vec<usize>>,
    params: Vec<Buffer>,
    state: Vec<Buffer>,
    int64: bool,
    /// Micro-batches per step, and the zero accumulator `grad_step` starts from
    /// (empty without accumulation).
    micro_batches: usize,
    zeros: Vec<Buffer>,
    /// The layout the module has `eval_sparse` for ([`Self::screens_sparse`]).
    sparse_screen: Option<pcp_graph::SparseScreen>,
}

/// Tensors held on an engine's device, one buffer each, in the model's
/// parameter order: the round's parameters a screen starts from.
#[derive(Clone, Debug)]
pub(crate) struct Resident(Vec<Buffer>);

/// A contribution on an engine's device, which a screen moves the round's
/// parameters by ([`Engine::eval_moved`]).
#[derive(Debug)]
pub(crate) enum Moved {
    /// One dense tensor a parameter (`eval_moved`).
    Dense(Vec<Buffer>),
    /// Each parameter's kept indices, then its values (`eval_sparse`).
    Sparse(Vec<Buffer>),
}

impl Engine {
    /// Loads `vmfb` on `device` and uploads the initial parameters and
    /// optimizer state (`state_per_param` tensors per parameter; zeros when
    /// `state` is `None`). `int64` says whether the data inputs are i64.
    pub(crate) async fn new(
        device: Device,
        vmfb: Vec<u8>,
        shapes: Vec<Vec<usize>>,
        params: Vec<Vec<f32>>,
        state: Option<Vec<Vec<f32>>>,
        state_per_param: usize,
        int64: bool,
    ) -> anyhow::Result<Self> {
        let session = Session::load(device, vmfb).await?;
        let state = state.unwrap_or_else(|| {
            (0..state_per_param).flat_map(|_| shapes.iter().map(|s| vec![0.0; s.iter().product()])).collect()
        });
        let mut engine = Self {
            session,
            shapes,
            params: Vec::new(),
            state: Vec::new(),
            int64,
            micro_batches: 1,
            zeros: Vec::new(),
            sparse_screen: None,
        };
        engine.params = engine.upload_all(params).await?;
        let state_shapes: Vec<Vec<usize>> = (0..state_per_param).flat_map(|_| engine.shapes.clone()).collect();
        engine.state = engine.upload(state, &state_shapes).await?;
        Ok(engine)
    }

    async fn upload_all(&self, tensors: Vec<Vec<f32>>) -> anyhow::Result<Vec<Buffer>> {
        let shapes = self.shapes.clone();
        self.upload(tensors, &shapes).await
    }

    async fn upload(&self, tensors: Vec<Vec<f32>>, shapes: &[Vec<usize>]) -> anyhow::Result<Vec<Buffer>> {
        anyhow::ensure!(tensors.len() == shapes.len(), "expected {} tensors, got {}", shapes.len(), tensors.len());
        let mut out = Vec::with_capacity(tensors.len());
        for (data, shape) in tensors.into_iter().zip(shapes) {
            out.push(self.session.upload(HostTensor::f32(shape.clone(), data)?).await?);
        }
        Ok(out)
    }

    fn data_args(&self, batch: &Batch) -> anyhow::Result<Vec<Arg>> {
        let shape = batch.shape().to_vec();
        Ok(if self.int64 {
            vec![
                HostTensor::i64(shape.clone(), batch.inputs_i64())?.into(),
                HostTensor::i64(shape, batch.targets_i64())?.into(),
            ]
        } else {
            vec![
                HostTensor::i32(shape.clone(), batch.inputs_i32())?.into(),
                HostTensor::i32(shape, batch.targets_i32())?.into(),
            ]
        })
    }

    /// Splits every batch into `k` micro-batches whose gradients are summed
    /// before one optimizer update: the module must have `grad_step` and
    /// `apply_step` and take micro-batches of a `k`th of the batch.
    pub(crate) async fn accumulate(&mut self, k: usize) -> anyhow::Result<()> {
        self.micro_batches = k.max(1);
        self.zeros = if k > 1 {
            let zeros = self.shapes.iter().map(|s| vec![0.0; s.iter().product()]).collect();
            self.upload_all(zeros).await?
        } else {
            Vec::new()
        };
        Ok(())
    }

    /// One optimizer step (`step` is 1-based); returns the batch's loss.
    pub(crate) async fn step(&mut self, step: u64, lr: f32, batch: &Batch) -> anyhow::Result<f32> {
        if self.micro_batches > 1 {
            return self.accumulated_step(step, lr, batch).await;
        }
        let mut args: Vec<Arg> = self.params.iter().chain(&self.state).map(|b| Arg::from(b.clone())).collect();
        args.push(HostTensor::scalar_f32(step as f32).into());
        args.push(HostTensor::scalar_f32(lr).into());
        args.extend(self.data_args(batch)?);
        let mut outputs = self.session.invoke("module.train_step", args).await?;
        let n = self.params.len();
        let loss = outputs.pop().context("train_step returned nothing")?;
        anyhow::ensure!(outputs.len() == n + self.state.len(), "train_step returned {} tensors", outputs.len() + 1);
        self.state = outputs.split_off(n);
        self.params = outputs;
        scalar(&self.session, &loss).await
    }

    /// A step as micro-batches: `grad_step` sums each one's gradient into the
    /// accumulator, then `apply_step` updates with their mean. The loss is the
    /// micro-batches' mean, which is the batch's.
    async fn accumulated_step(&mut self, step: u64, lr: f32, batch: &Batch) -> anyhow::Result<f32> {
        let k = self.micro_batches;
        let n = self.params.len();
        let mut acc = self.zeros.clone();
        let mut total = 0.0;
        for micro in batch.split(k) {
            let mut args: Vec<Arg> = self.params.iter().chain(&acc).map(|b| Arg::from(b.clone())).collect();
            args.extend(self.data_args(&micro)?);
            let mut outputs = self.session.invoke("module.grad_step", args).await?;
            let loss = outputs.pop().context("grad_step returned nothing")?;
            anyhow::ensure!(outputs.len() == n, "grad_step returned {} tensors", outputs.len() + 1);
            acc = outputs;
            total += scalar(&self.session, &loss).await?;
        }
        let mut args: Vec<Arg> = self.params.iter().chain(&self.state).map(|b| Arg::from(b.clone())).collect();
        args.push(HostTensor::scalar_f32(step as f32).into());
        args.push(HostTensor::scalar_f32(lr).into());
        args.push(HostTensor::scalar_f32(1.0 / k as f32).into());
        args.extend(acc.into_iter().map(Arg::from));
        let mut outputs = self.session.invoke("module.apply_step", args).await?;
        anyhow::ensure!(outputs.len() == n + self.state.len(), "apply_step returned {} tensors", outputs.len());
        self.state = outputs.split_off(n);
        self.params = outputs;
        Ok(total / k as f32)
    }

    /// The loss on `batch` without updating anything (the mean over its
    /// micro-batches when accumulating).
    pub(crate) async fn eval(&self, batch: &Batch) -> anyhow::Result<f32> {
        self.eval_with(&self.params, batch).await
    }

    /// The loss on `batch` at host `params`, uploaded for this call, leaving the
    /// engine's own parameters as they are: the tests' reference for
    /// [`Self::eval_moved`].
    #[cfg(test)]
    pub(crate) async fn eval_at(&self, params: Vec<Vec<f32>>, batch: &Batch) -> anyhow::Result<f32> {
        let buffers = self.upload_all(params).await?;
        self.eval_with(&buffers, batch).await
    }

    /// `params` uploaded to stay on the device: the base a screen moves from
    /// ([`Self::eval_moved`]).
    pub(crate) async fn resident(&self, params: Vec<Vec<f32>>) -> anyhow::Result<Resident> {
        Ok(Resident(self.upload_all(params).await?))
    }

    /// The top-k layout this engine's module has `eval_sparse` for (the run's
    /// encoding), if any.
    pub(crate) fn sparse_screen(&self) -> Option<pcp_graph::SparseScreen> {
        self.sparse_screen
    }

    /// Says the module has `eval_sparse` for `layout` (built with it).
    pub(crate) fn screens_sparse(&mut self, layout: Option<pcp_graph::SparseScreen>) {
        self.sparse_screen = layout;
    }

    /// A dense contribution uploaded, one tensor a parameter.
    pub(crate) async fn moved_dense(&self, delta: Vec<Vec<f32>>) -> anyhow::Result<Moved> {
        Ok(Moved::Dense(self.upload_all(delta).await?))
    }

    /// A sparse contribution uploaded: each parameter's kept flat `indices`
    /// (`[m, 1]`) and `values` (`[m]`), as [`Self::sparse_screen`]'s layout keeps.
    pub(crate) async fn moved_sparse(&self, indices: Vec<Vec<i32>>, values: Vec<Vec<f32>>) -> anyhow::Result<Moved> {
        anyhow::ensure!(
            indices.len() == self.shapes.len() && values.len() == self.shapes.len(),
            "a sparse contribution of {} tensors, the model has {}",
            indices.len(),
            self.shapes.len()
        );
        let mut out = Vec::with_capacity(2 * indices.len());
        for i in indices {
            let m = i.len();
            out.push(self.session.upload(HostTensor::i32(vec![m, 1], i)?).await?);
        }
        for v in values {
            let m = v.len();
            out.push(self.session.upload(HostTensor::f32(vec![m], v)?).await?);
        }
        Ok(Moved::Sparse(out))
    }

    /// The loss on `batch` at `base` + `alpha` × `delta`, moved on the device
    /// (`eval_moved`, or `eval_sparse` for a sparse one): `delta` is the one upload.
    pub(crate) async fn eval_moved(
        &self,
        base: &Resident,
        delta: &Moved,
        alpha: f32,
        batch: &Batch,
    ) -> anyhow::Result<f32> {
        let (function, delta) = match delta {
            Moved::Dense(d) => ("module.eval_moved", d),
            Moved::Sparse(d) => ("module.eval_sparse", d),
        };
        let mut total = 0.0;
        for micro in batch.split(self.micro_batches) {
            let mut args: Vec<Arg> = base.0.iter().chain(delta).map(|b| Arg::from(b.clone())).collect();
            args.push(HostTensor::scalar_f32(alpha).into());
            args.extend(self.data_args(&micro)?);
            let outputs = self.session.invoke(function, args).await?;
            total += scalar(&self.session, outputs.first().context("the screen's loss: nothing returned")?).await?;
        }
        Ok(total / self.micro_batches as f32)
    }

    async fn eval_with(&self, params: &[Buffer], batch: &Batch) -> anyhow::Result<f32> {
        let mut total = 0.0;
        for micro in batch.split(self.micro_batches) {
            let mut args: Vec<Arg> = params.iter().map(|b| Arg::from(b.clone())).collect();
            args.extend(self.data_args(&micro)?);
            let outputs = self.session.invoke("module.eval_loss", args).await?;
            total += scalar(&self.session, outputs.first().context("eval_loss returned nothing")?).await?;
        }
        Ok(total / self.micro_batches as f32)
    }

    /// Logits for `inputs` ([batch, block] token ids), flattened.
    pub(crate) async fn logits(&self, inputs: HostTensor) -> anyhow::Result<Vec<f32>> {
        let mut args: Vec<Arg> = self.params.iter().map(|b| Arg::from(b.clone())).collect();
        args.push(inputs.into());
        let outputs = self.session.invoke("module.logits", args).await?;
        Ok(self.session.download(outputs.first().context("logits returned nothing")?).await?.into_f32()?)
    }

    /// Values in each parameter tensor, in order.
    pub(crate) fn sizes(&self) -> Vec<usize> {
        self.shapes.iter().map(|s| s.iter().product()).collect()
    }

    /// Downloads the parameters.
    pub(crate) async fn params(&self) -> anyhow::Result<Vec<Vec<f32>>> {
        download_all(&self.session, &self.params).await
    }

    /// Downloads the optimizer state.
    pub(crate) async fn state(&self) -> anyhow::Result<Vec<Vec<f32>>> {
        download_all(&self.session, &self.state).await
    }

    /// Replaces the parameters (optimizer state is kept): a DiLoCo worker
    /// starting a round.
    pub(crate) async fn set_params(&mut self, params: Vec<Vec<f32>>) -> anyhow::Result<()> {
        self.params = self.upload_all(params).await?;
        Ok(())
    }
}

async fn scalar(session: &Session, buffer: &Buffer) -> anyhow::Result<f32> {
    session.download(buffer).await?.into_f32()?.first().copied().context("empty loss tensor")
}

async fn download_all(session: &Session, buffers: &[Buffer]) -> anyhow::Result<Vec<Vec<f32>>> {
    let mut out = Vec::with_capacity(buffers.len());
    for b in buffers {
        out.push(session.download(b).await?.into_f32()?);
    }
    Ok(out)
}
