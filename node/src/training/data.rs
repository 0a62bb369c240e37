//! Training data: tokenizers, token files and seeded batch sampling.
//!
//! A corpus is either text, tokenized at the character level ([`Vocab::Char`],
//! whose vocabulary is saved as JSON with the run) or the byte level
//! ([`Vocab::Byte`], 256 tokens), or a pre-tokenized `.bin` file of `u16`
//! tokens in the nanoGPT or llm.c layout, read through `mmap`. A [`Sampler`]
//! draws `[batch, block]` windows and their next-token targets from one
//! [`Split`] with a seeded PRNG whose state goes into checkpoints.

use std::path::{Path, PathBuf};

use anyhow::Context as _;

mod sampler;
mod tokens;
mod vocab;

pub(crate) use sampler::{Batch, Sampler, SamplerState};
pub(crate) use tokens::{Split, TokenFormat, Tokens};
pub(crate) use vocab::Vocab;

/// The corpus, tokenized and split.
pub(crate) struct Corpus {
    pub(crate) vocab: Vocab,
    pub(crate) train: Split,
    pub(crate) val: Split,
}

impl std::fmt::Debug for Corpus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Corpus").field("train", &self.train.len()).field("val", &self.val.len()).finish()
    }
}

impl Corpus {
    /// Reads `path` with `tokenizer`, reusing `vocab` when resuming.
    pub(crate) fn load(path: &Path, tokenizer: &str, vocab: Option<Vocab>, val_fraction: f64) -> anyhow::Result<Self> {
        let (vocab, tokens) = match tokenizer {
            "char" | "byte" => {
                let vocab = match (vocab, tokenizer) {
                    (Some(v), _) => v,
                    (None, "byte") => Vocab::Byte,
                    (None, _) => {
                        let text = std::fs::read_to_string(path)
                            .with_context(|| format!("cannot read corpus {}", path.display()))?;
                        Vocab::chars_of(&text)?
                    }
                };
                let tokens = Tokens::from_text_file(path, &vocab)?;
                (vocab, tokens)
            }
            "u16" | "bin" => {
                let tokens = Tokens::open_bin(path, TokenFormat::Detect)?;
                (vocab.unwrap_or(Vocab::Byte), tokens)
            }
            other => anyhow::bail!("unknown tokenizer {other:?}; expected char, byte or u16"),
        };
        let (train, val) = tokens.split(val_fraction)?;
        Ok(Self { vocab, train, val })
    }
}

/// The default corpus: shared/ next to the checkout, or setup's copy.
pub(crate) fn default_corpus() -> Option<PathBuf> {
    let candidates = ["../shared/data/tiny_shakespeare.txt", ".data/tiny_shakespeare.txt"];
    let roots = [std::env::current_dir().ok(), std::env::current_exe().ok()];
    roots
        .into_iter()
        .flatten()
        .flat_map(|r| r.ancestors().map(Path::to_path_buf).collect::<Vec<_>>())
        .flat_map(|dir| candidates.map(|c| dir.join(c)))
        .find(|p| p.is_file())
}
