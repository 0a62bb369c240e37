//! Model-size presets: parameter counts, wire sizes and FLOPs per step.
//!
//! The presets are GPT-2-architecture transformers (learned position
//! embeddings, pre-LayerNorm blocks with a 4× MLP, biases everywhere, a final
//! LayerNorm, and a bias-free LM head that is untied from the token embedding
//! for the nanoGPT presets, as in pcp's built-in models, and tied for
//! `gpt2-124m`, as in GPT-2). Training FLOPs per step follow Kaplan et al.
//! (2020): `6 × params × tokens` for the matmuls of forward and backward, plus
//! `6 × layers × context × width × tokens` for attention's score and value
//! products.

use pcp_protocol::diloco::compress::Encoding;
use serde::Serialize;

/// A model as the simulator sees it: sizes, not values.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ModelSpec {
    /// Preset name or `custom`.
    pub name: String,
    /// Element count of every parameter tensor, in order.
    pub tensor_sizes: Vec<u64>,
    /// Tokens one worker trains on per inner step (batch × context).
    pub tokens_per_step: u64,
    /// Training FLOPs of one inner step.
    pub flops_per_step: f64,
}

/// A GPT-2-style transformer's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gpt2Shape {
    /// Vocabulary size.
    pub vocab: u64,
    /// Blocks.
    pub layers: u64,
    /// Embedding width.
    pub width: u64,
    /// Context length (tokens per sequence).
    pub context: u64,
    /// Sequences per step.
    pub batch: u64,
    /// Whether the LM head reuses the token embedding.
    pub tied_head: bool,
}

impl Gpt2Shape {
    /// Every parameter tensor's element count, in the order nanoGPT declares them.
    pub fn tensor_sizes(&self) -> Vec<u64> {
        let (v, d, t) = (self.vocab, self.width, self.context);
        let mut sizes = vec![v * d, t * d];
        for _ in 0..self.layers {
            // ln_1, attention qkv and projection, ln_2, MLP up and down
            sizes.extend([d, d, d * 3 * d, 3 * d, d * d, d, d, d, d * 4 * d, 4 * d, 4 * d * d, d]);
        }
        sizes.extend([d, d]);
        if !self.tied_head {
            sizes.push(d * v);
        }
        sizes
    }

    /// The model spec: sizes, tokens and FLOPs per step.
    pub fn spec(&self, name: &str) -> ModelSpec {
        let tensor_sizes = self.tensor_sizes();
        let params: u64 = tensor_sizes.iter().sum();
        let tokens = self.batch * self.context;
        let flops = 6.0 * params as f64 * tokens as f64
            + 6.0 * (self.layers * self.context * self.width) as f64 * tokens as f64;
        ModelSpec { name: name.to_owned(), tensor_sizes, tokens_per_step: tokens, flops_per_step: flops }
    }
}

/// The built-in model presets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ModelPreset {
    /// pcp's nanoGPT-small: 2 layers, width 64, context 32, batch 64, 65 characters (110,464 parameters).
    NanogptSmall,
    /// pcp's nanoGPT-medium: 4 layers, width 256, context 128, batch 64, 65 characters.
    NanogptMedium,
    /// GPT-2 small: 12 layers, width 768, context 1024, batch 8, vocabulary 50,257, tied head (124.4M).
    #[value(name = "gpt2-124m")]
    #[serde(rename = "gpt2-124m")]
    Gpt2_124m,
}

impl ModelPreset {
    /// The preset's shape.
    pub fn shape(self) -> Gpt2Shape {
        match self {
            Self::NanogptSmall => {
                Gpt2Shape { vocab: 65, layers: 2, width: 64, context: 32, batch: 64, tied_head: false }
            }
            Self::NanogptMedium => {
                Gpt2Shape { vocab: 65, layers: 4, width: 256, context: 128, batch: 64, tied_head: false }
            }
            Self::Gpt2_124m => {
                Gpt2Shape { vocab: 50_257, layers: 12, width: 768, context: 1024, batch: 8, tied_head: true }
            }
        }
    }

    /// The preset's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::NanogptSmall => "nanogpt-small",
            Self::NanogptMedium => "nanogpt-medium",
            Self::Gpt2_124m => "gpt2-124m",
        }
    }

    /// The preset called `name`.
    pub fn parse(name: &str) -> Option<Self> {
        [Self::NanogptSmall, Self::NanogptMedium, Self::Gpt2_124m].into_iter().find(|p| p.name() == name)
    }

    /// The preset's spec.
    pub fn spec(self) -> ModelSpec {
        self.shape().spec(self.name())
    }
}

impl ModelSpec {
    /// Total parameters.
    pub fn params(&self) -> u64 {
        self.tensor_sizes.iter().sum()
    }

    /// A spec with `params` parameters in one tensor (for `--params`); FLOPs scale with it.
    pub fn with_params(&self, params: u64) -> Self {
        let scale = params as f64 / self.params().max(1) as f64;
        Self {
            name: "custom".into(),
            tensor_sizes: vec![params],
            tokens_per_step: self.tokens_per_step,
            flops_per_step: self.flops_per_step * scale,
        }
    }

    /// Bytes of `compress::encode(params, encoding)` for this model: a 10-byte
    /// header, 4 bytes of length per tensor (plus a 4-byte scale for int8) and
    /// the values; sparse: exactly its layout's length. The parameters blob is
    /// always fp32.
    pub fn encoded_bytes(&self, encoding: Encoding) -> u64 {
        let (per, extra) = match encoding {
            Encoding::F32 => (4, 0),
            Encoding::Bf16 => (2, 0),
            Encoding::Int8 => (1, 4),
            Encoding::Sparse(s) => {
                let sizes: Vec<usize> = self.tensor_sizes.iter().map(|n| *n as usize).collect();
                return s.up.encoded_len(&sizes) as u64;
            }
        };
        10 + self.tensor_sizes.iter().map(|n| 4 + extra + per * n).sum::<u64>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pcp_protocol::diloco::compress;

    #[test]
    fn preset_parameter_counts() {
        // 0.44 MB of fp32 pseudo-gradient per round in pcp's DiLoCo benchmark.
        assert_eq!(ModelPreset::NanogptSmall.spec().params(), 110_464);
        let gpt2 = ModelPreset::Gpt2_124m.spec().params();
        assert!((124_000_000..125_000_000).contains(&gpt2), "{gpt2}");
        let medium = ModelPreset::NanogptMedium.spec();
        assert_eq!(medium.params(), 2 * 65 * 256 + 128 * 256 + 4 * (12 * 256 * 256 + 13 * 256) + 2 * 256);
        // about 168 GFLOP a step for medium, as measured from pcp's IR
        assert!((150e9..190e9).contains(&medium.flops_per_step), "{}", medium.flops_per_step);
    }

    #[test]
    fn wire_sizes_match_the_real_encoder() {
        let spec = Gpt2Shape { vocab: 7, layers: 1, width: 4, context: 3, batch: 1, tied_head: false }.spec("t");
        let tensors: Vec<Vec<f32>> = spec.tensor_sizes.iter().map(|n| vec![0.5; *n as usize]).collect();
        let sparse = Encoding::Sparse(pcp_protocol::diloco::sparse::Settings::default());
        for enc in [Encoding::F32, Encoding::Bf16, Encoding::Int8, sparse] {
            assert_eq!(spec.encoded_bytes(enc), compress::encode(&tensors, enc).len() as u64, "{enc:?}");
        }
    }
}
