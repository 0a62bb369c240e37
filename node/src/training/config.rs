//! Experiment configuration: PCP's `experiment.json` keys plus pcp's own.
//! Command-line flags override the file; unknown keys are warned about.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Keys PCP's experiment files use.
const PCP_KEYS: &[&str] = &[
    "model_path",
    "data_path",
    "tokenizer",
    "sampling",
    "dtype",
    "learning_rate",
    "tau",
    "outer_loop_steps",
    "nesterov_momentum",
    "max_epochs",
    "wandb_project",
    "wandb_entity",
    "wandb_run_name",
    "wandb_api_key",
];

/// An experiment: what to train, on what, and how.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub(crate) struct Experiment {
    /// A built-in preset (`nanogpt-small`, `nanogpt-medium`) or a `.mlir` path.
    pub(crate) model: Option<String>,
    /// PCP's key for the model file.
    pub(crate) model_path: Option<String>,
    /// The text or token file.
    pub(crate) data_path: Option<String>,
    /// `char`, `byte`, or `u16` (token `.bin` files).
    pub(crate) tokenizer: String,
    /// PCP's sampling key; pcp always samples random windows.
    pub(crate) sampling: String,
    /// Parameter dtype; only `f32` is supported.
    pub(crate) dtype: String,
    /// The matmuls' precision: `f32`, or `bf16` (mixed precision: matmuls and
    /// attention in bf16, parameters, optimizer state and loss in f32).
    pub(crate) precision: String,
    /// Activations the backward recomputes instead of keeping: `none`,
    /// `attention`, `elementwise` (the default: the matmuls' outputs kept, the
    /// cheap ops between them recomputed) or `blocks` (see `pcp_graph::recompute`).
    pub(crate) recompute: String,
    /// Attention: `fused` (one op, a flash-style backward; the default) or
    /// `naive` (the model's own ops, `T × T` probabilities kept).
    pub(crate) attention: String,
    /// Peak inner learning rate.
    pub(crate) learning_rate: f64,
    /// Floor of the cosine schedule.
    pub(crate) min_lr: f64,
    /// Linear warmup steps.
    pub(crate) warmup_steps: u64,
    /// Inner steps for `train` (single node).
    pub(crate) steps: u64,
    /// Seed for initialisation and data order.
    pub(crate) seed: u64,
    /// Evaluate every this many steps (0: never).
    pub(crate) eval_interval: u64,
    /// Batches per evaluation (a shepherd's each round; 0: it does not validate).
    pub(crate) eval_batches: u64,
    /// Checkpoint every this many steps (0: only at the end).
    pub(crate) checkpoint_interval: u64,
    /// Fraction of the data held out for validation.
    pub(crate) val_fraction: f64,
    /// AdamW β1.
    pub(crate) beta1: f64,
    /// AdamW β2.
    pub(crate) beta2: f64,
    /// AdamW ε.
    pub(crate) eps: f64,
    /// Decoupled weight decay on matrices.
    pub(crate) weight_decay: f64,
    /// Global gradient-norm clip (0: off).
    pub(crate) grad_clip: f64,
    /// Sequences per batch for the presets (their default when unset).
    pub(crate) batch_size: Option<usize>,
    /// A preset's vocabulary, when larger than the corpus's (a load test of
    /// gpt2-124m's shapes, 50257, on a character corpus): the extra rows are never
    /// a target. Unset: the corpus's.
    pub(crate) vocab_size: Option<usize>,
    /// DiLoCo inner steps per round.
    pub(crate) tau: u64,
    /// DiLoCo rounds.
    pub(crate) outer_loop_steps: u64,
    /// Outer Nesterov learning rate.
    pub(crate) outer_lr: f64,
    /// Outer Nesterov momentum.
    pub(crate) nesterov_momentum: f64,
    /// PCP's epoch cap; pcp counts steps instead.
    pub(crate) max_epochs: Option<u64>,
    /// The Weights & Biases project [default: `pcp-distributed`]; see [`crate::observe::wandb`].
    pub(crate) wandb_project: Option<String>,
    /// The wandb team or user [default: the key's].
    pub(crate) wandb_entity: Option<String>,
    /// The wandb run's name [default: one wandb picks].
    pub(crate) wandb_run_name: Option<String>,
    /// The wandb API key, else `WANDB_API_KEY`; without either, pcp does not
    /// report to wandb. Never logged, written to a checkpoint or put on a command line.
    #[serde(skip_serializing)]
    pub(crate) wandb_api_key: Option<String>,
}

impl Default for Experiment {
    fn default() -> Self {
        Self {
            model: None,
            model_path: None,
            data_path: None,
            tokenizer: "char".into(),
            sampling: "random".into(),
            dtype: "f32".into(),
            precision: "f32".into(),
            recompute: "elementwise".into(),
            attention: "fused".into(),
            learning_rate: 3e-3,
            min_lr: 1e-4,
            warmup_steps: 100,
            steps: 1000,
            seed: 1337,
            eval_interval: 250,
            eval_batches: 8,
            checkpoint_interval: 0,
            val_fraction: 0.1,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.1,
            grad_clip: 1.0,
            batch_size: None,
            vocab_size: None,
            tau: 10,
            outer_loop_steps: 100,
            outer_lr: 0.7,
            nesterov_momentum: 0.9,
            max_epochs: None,
            wandb_project: None,
            wandb_entity: None,
            wandb_run_name: None,
            wandb_api_key: None,
        }
    }
}

impl Experiment {
    /// The vocabulary a preset is built with for a corpus of `corpus` tokens: the
    /// larger of it and `vocab_size`.
    pub(crate) fn vocab(&self, corpus: usize) -> usize {
        self.vocab_size.map_or(corpus, |v| v.max(corpus))
    }

    /// Loads `path`, logging a warning for each unknown key.
    pub(crate) fn load_warned(path: &Path) -> anyhow::Result<Self> {
        let (experiment, warnings) = Self::load(path)?;
        for w in warnings {
            tracing::warn!("{w}");
        }
        Ok(experiment)
    }

    /// Applies the flags `train` and `--shepherd` share.
    pub(crate) fn override_with(
        &mut self,
        model: Option<&String>,
        data: Option<&PathBuf>,
        lr: Option<f64>,
        seed: Option<u64>,
    ) {
        if let Some(m) = model {
            self.model = Some(m.clone());
        }
        if let Some(d) = data {
            self.data_path = Some(d.display().to_string());
        }
        self.learning_rate = lr.unwrap_or(self.learning_rate);
        self.seed = seed.unwrap_or(self.seed);
    }

    /// Sets the precision (`--precision`), checking its name.
    pub(crate) fn set_precision(&mut self, precision: Option<&str>) -> anyhow::Result<()> {
        if let Some(p) = precision {
            self.precision = p.to_owned();
        }
        let parsed: pcp_graph::Precision = self.precision.parse()?;
        self.precision = parsed.name().to_owned();
        Ok(())
    }

    /// Sets the recomputation (`--recompute`), checking its name.
    pub(crate) fn set_recompute(&mut self, recompute: Option<&str>) -> anyhow::Result<()> {
        if let Some(r) = recompute {
            self.recompute = r.to_owned();
        }
        let parsed: pcp_graph::Recompute = self.recompute.parse()?;
        self.recompute = parsed.name().to_owned();
        Ok(())
    }

    /// Sets the attention (`--attention`), checking its name.
    pub(crate) fn set_attention(&mut self, attention: Option<&str>) -> anyhow::Result<()> {
        if let Some(a) = attention {
            self.attention = a.to_owned();
        }
        let parsed: pcp_graph::Attention = self.attention.parse()?;
        self.attention = parsed.name().to_owned();
        Ok(())
    }

    /// Every key the file may use.
    fn known_keys() -> Vec<String> {
        let defaults = serde_json::to_value(Self::default()).unwrap_or_default();
        let mut keys: Vec<String> = defaults.as_object().map(|o| o.keys().cloned().collect()).unwrap_or_default();
        keys.extend(PCP_KEYS.iter().map(|k| (*k).to_owned()));
        keys
    }

    /// Loads `path`, resolving relative model and data paths against the
    /// file's directory and its parents (PCP's files name paths relative to
    /// the repository root). Returns the warnings about unknown keys.
    pub(crate) fn load(path: &Path) -> anyhow::Result<(Self, Vec<String>)> {
        let text =
            std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("cannot read config {}: {e}", path.display()))?;
        let value: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| anyhow::anyhow!("config {} is not valid JSON: {e}", path.display()))?;
        let object =
            value.as_object().ok_or_else(|| anyhow::anyhow!("config {} must be a JSON object", path.display()))?;
        let known = Self::known_keys();
        let warnings: Vec<String> = object
            .keys()
            .filter(|k| !known.contains(k))
            .map(|k| format!("config {}: unknown key {k:?} ignored", path.display()))
            .collect();
        let mut experiment: Self =
            serde_json::from_value(value.clone()).map_err(|e| anyhow::anyhow!("config {}: {e}", path.display()))?;
        let base = path.parent().unwrap_or(Path::new("."));
        for field in [&mut experiment.model_path, &mut experiment.data_path] {
            if let Some(p) = field.as_mut() {
                *p = resolve(base, p).display().to_string();
            }
        }
        if experiment.model.is_none() {
            experiment.model = experiment.model_path.clone();
        }
        Ok((experiment, warnings))
    }
}

/// `relative` against `base` or one of its ancestors, else as given.
fn resolve(base: &Path, relative: &str) -> PathBuf {
    let p = Path::new(relative);
    if p.is_absolute() {
        return p.to_owned();
    }
    base.ancestors().map(|dir| dir.join(p)).find(|c| c.exists()).unwrap_or_else(|| p.to_owned())
}

/// The optimizer for `experiment`.
pub(crate) fn step_config(e: &Experiment) -> pcp_graph::StepConfig {
    pcp_graph::StepConfig {
        optimizer: pcp_graph::Optimizer::AdamW {
            beta1: e.beta1,
            beta2: e.beta2,
            eps: e.eps,
            weight_decay: e.weight_decay,
        },
        clip_norm: (e.grad_clip > 0.0).then_some(e.grad_clip),
        // checked when the experiment was resolved; an unknown name cannot get here
        precision: e.precision.parse().unwrap_or_default(),
        // checked likewise
        recompute: e.recompute.parse().unwrap_or_default(),
        accumulate: false,
        // checked likewise
        attention: e.attention.parse().unwrap_or_default(),
        // a run's screens: set from its encoding where it builds its step
        sparse_screen: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loads_pcps_experiment_file() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/models/pcp_experiment_nanogpt_small.json");
        let (e, warnings) = Experiment::load(&path).expect("loads");
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(e.tau, 10);
        assert_eq!(e.outer_loop_steps, 100);
        assert!((e.learning_rate - 6e-4).abs() < 1e-12);
        let model = e.model.expect("model");
        assert!(model.ends_with("nanogpt_small.mlir") && Path::new(&model).exists(), "{model}");
        assert!(Path::new(&e.data_path.expect("data")).exists());
    }

    #[test]
    fn warns_on_unknown_keys_and_rejects_bad_types() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("e.json");
        std::fs::write(&p, r#"{"learning_rate": 0.01, "bogus_key": 3}"#).expect("write");
        let (e, warnings) = Experiment::load(&p).expect("loads");
        assert_eq!(e.learning_rate, 0.01);
        assert_eq!(warnings.len(), 1);
        assert!(warnings[0].contains("bogus_key"));
        std::fs::write(&p, r#"{"tau": "ten"}"#).expect("write");
        let err = Experiment::load(&p).expect_err("bad type").to_string();
        assert!(err.contains("e.json") && !err.contains('\n'), "{err}");
    }
}
