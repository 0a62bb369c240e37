//! What a training step needs: the [`model`] (a preset or an imported module), the
//! [`data`] (corpus, tokenizer, sampler), the [`engine`] that runs the compiled step
//! on a device, [`checkpoint`]s and the experiment [`config`].

pub(crate) mod checkpoint;
pub(crate) mod config;
pub(crate) mod data;
pub(crate) mod device;
pub(crate) mod engine;
pub(crate) mod memory;
pub(crate) mod model;
pub(crate) mod schedule;
