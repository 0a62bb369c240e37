//! Training data: tokenizers, token files and seeded batch sampling.
//!
//! A corpus is either text, tokenized at the character level ([`Vocab::Char`],
//! whose vocabulary is saved as JSON with the run) or the byte level
//! ([`Vocab::Byte`], 256 tokens), or a pre-tokenized `.bin` file of `u16`
//! tokens in the nanoGPT or llm.c layout, read through `mmap`. A [`Sampler`]
//! draws `[batch, block]` windows and their next-token targets from one
//! [`Split`] with a seeded PRNG whose state goes into checkpoints.

mod sampler;
mod tokens;
mod vocab;

pub(crate) use sampler::{Batch, Sampler, SamplerState};
pub(crate) use tokens::{Split, TokenFormat, Tokens};
pub(crate) use vocab::Vocab;
