//! How a run's parameters split: their tensors' sizes, the shards a round's
//! parameters are published in, and the Streaming DiLoCo fragments.

use std::ops::Range;

use pcp_protocol::diloco::fragments;
use pcp_schema::RunManifest;

use crate::diloco::wire;

/// The tensors' layout of a run.
#[derive(Debug)]
pub(super) struct Layout {
    /// Elements of each tensor.
    pub(super) sizes: Vec<usize>,
    /// The tensors of each parameter shard a round is published in.
    pub(super) shards: Vec<Range<usize>>,
    /// The tensors of each Streaming DiLoCo fragment (one: all).
    pub(super) fragments: Vec<Range<usize>>,
}

impl Layout {
    /// The layout `manifest` declares.
    pub(super) fn of(manifest: &RunManifest) -> anyhow::Result<Self> {
        let sizes = wire::sizes(manifest);
        let shards = wire::shard_ranges(manifest)?;
        let fragments = fragments::split(&sizes, manifest.fragments.max(1) as usize)?;
        Ok(Self { sizes, shards, fragments })
    }
}
