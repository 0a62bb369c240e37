//! Resolving `--model`: a built-in preset or a StableHLO file, with the
//! parameter layout and initialisation the trainer needs.

use std::path::Path;

use anyhow::Context as _;
use pcp_graph::TensorType;
use pcp_graph::models::{Init, ParamSpec};
use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{RngCore, SeedableRng};

/// A model ready to be turned into a training step.
#[derive(Clone, Debug)]
pub(crate) struct Model {
    /// What `--model` said.
    pub(crate) source: String,
    /// The loss module (`@main`, maybe `@logits`).
    pub(crate) module: pcp_graph::Module,
    /// Parameters in argument order.
    pub(crate) params: Vec<ParamSpec>,
    /// Data inputs: `[batch, block]` integer tensors (input ids, targets).
    pub(crate) data: Vec<TensorType>,
}

impl Model {
    /// Loads a preset (`nanogpt-small`, `nanogpt-medium`) sized for
    /// `vocab_size`, or a `.mlir` file.
    pub(crate) fn load(source: &str, vocab_size: usize) -> anyhow::Result<Self> {
        Self::load_with_batch(source, vocab_size, None)
    }

    /// Like [`Model::load`], with `batch` sequences per step instead of the preset's
    /// (a `.mlir` file's batch is fixed by its signature).
    pub(crate) fn load_with_batch(source: &str, vocab_size: usize, batch: Option<usize>) -> anyhow::Result<Self> {
        if let Some(mut config) = pcp_graph::models::preset(source) {
            if let Some(b) = batch {
                anyhow::ensure!(b > 0, "the batch size must be at least 1");
                config.batch_size = b;
            }
            let built = pcp_graph::models::nanogpt(&config.with_vocab_size(vocab_size))?;
            return Ok(Self {
                source: source.to_owned(),
                module: built.module,
                params: built.params,
                data: built.data.into_iter().map(|(_, t)| t).collect(),
            });
        }
        let path = Path::new(source);
        if batch.is_some() {
            anyhow::bail!("--batch applies to the presets; the batch of {source} is fixed by its signature");
        }
        if !path.exists() {
            anyhow::bail!("unknown model {source:?}: not a preset (nanogpt-small, nanogpt-medium) and no such file");
        }
        let module = pcp_graph::import_file(path)?;
        let f = pcp_graph::autodiff::inline_calls(&module, "main").with_context(|| source.to_owned())?;
        let sig = pcp_graph::autodiff::signature(&f).with_context(|| source.to_owned())?;
        let params = external_params(&sig.params.iter().map(|(_, t)| t.clone()).collect::<Vec<_>>());
        Ok(Self { source: source.to_owned(), module, params, data: sig.data.iter().map(|(_, t)| t.clone()).collect() })
    }

    /// `(batch, block)` from the first data input.
    pub(crate) fn batch_block(&self) -> anyhow::Result<(usize, usize)> {
        match self.data.first().map(|t| t.shape.as_slice()) {
            Some([b, t]) => Ok((*b as usize, *t as usize)),
            _ => anyhow::bail!("model {} must take [batch, block] token inputs, found {:?}", self.source, self.data),
        }
    }

    /// Fresh parameters from `seed`.
    pub(crate) fn init(&self, seed: u64) -> Vec<Vec<f32>> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        self.params
            .iter()
            .map(|p| {
                let n = p.ty.elements() as usize;
                match p.init {
                    Init::Zeros => vec![0.0; n],
                    Init::Ones => vec![1.0; n],
                    Init::Normal { std } => (0..n).map(|_| (normal(&mut rng) * std) as f32).collect(),
                }
            })
            .collect()
    }
}

/// Initialisation for a model we only know by its signature, in the
/// PyTorch export order: matrices N(0, 0.02); a pair of equal-length vectors
/// is a LayerNorm (ones, zeros); any other vector is a bias (zeros).
fn external_params(types: &[TensorType]) -> Vec<ParamSpec> {
    let mut specs = Vec::new();
    let mut i = 0;
    while i < types.len() {
        let t = &types[i];
        let pair = t.rank() == 1 && types.get(i + 1).is_some_and(|n| n == t);
        if pair {
            specs.push(ParamSpec { name: format!("p{i}"), ty: t.clone(), init: Init::Ones });
            specs.push(ParamSpec { name: format!("p{}", i + 1), ty: t.clone(), init: Init::Zeros });
            i += 2;
            continue;
        }
        let init = if t.rank() >= 2 { Init::Normal { std: 0.02 } } else { Init::Zeros };
        specs.push(ParamSpec { name: format!("p{i}"), ty: t.clone(), init });
        i += 1;
    }
    specs
}

/// A standard normal sample (Box-Muller).
fn normal(rng: &mut ChaCha8Rng) -> f64 {
    let u = |rng: &mut ChaCha8Rng| ((rng.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    let (a, b) = (u(rng), u(rng));
    (-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn external_init_follows_pytorch_order() {
        let t = |s: &str| TensorType::parse(s).expect("type");
        let specs =
            external_params(&[t("tensor<65x64xf32>"), t("tensor<64xf32>"), t("tensor<64xf32>"), t("tensor<65xf32>")]);
        let inits: Vec<Init> = specs.iter().map(|s| s.init).collect();
        assert_eq!(inits, vec![Init::Normal { std: 0.02 }, Init::Ones, Init::Zeros, Init::Zeros]);
    }

    #[test]
    fn normal_samples_have_unit_variance() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let xs: Vec<f64> = (0..20000).map(|_| normal(&mut rng)).collect();
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / xs.len() as f64;
        assert!(mean.abs() < 0.03 && (var - 1.0).abs() < 0.05, "mean {mean} var {var}");
    }
}
