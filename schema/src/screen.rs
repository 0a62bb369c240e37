//! Screening committees on the wire: the shepherd's request that a screener score
//! one contribution, and the screener's signed losses.

use crate::codec::{self, DecodeError, MAX_CONTRIBUTION, MAX_CONTROL_MESSAGE, Message, fixed, list_len, malformed};
use crate::wire::pcp_capnp::{screen_report, screen_request};

/// The shepherd asks a screener to score one contribution of the open round on a
/// batch of the withheld split: everything the screener needs to apply it as the
/// round would, besides the round's parameters, which it holds.
#[derive(Debug, Clone, PartialEq)]
pub struct ScreenRequest {
    /// Run id.
    pub run: [u8; 32],
    /// The open round: its parameters are what the contribution is scored at.
    pub round: u64,
    /// blake3 of the encoded pseudo-gradient: the contribution's id.
    pub contribution: [u8; 32],
    /// The round the contribution was made for (its encoding's seed and fragment).
    pub contribution_round: u64,
    /// The parameters blob it is scored at.
    pub params_hash: [u8; 32],
    /// The pseudo-gradient, encoded as its sender sent it.
    pub delta: Vec<u8>,
    /// The round's per-tensor L2 bounds (infinite: none).
    pub tensor_bounds: Vec<f64>,
    /// The round's per-element clips (infinite: none).
    pub element_bounds: Vec<f32>,
    /// The global norm bound's scale, applied after the per-tensor bounds.
    pub bound_scale: f32,
    /// The scale the outer step applies the contribution at.
    pub outer_scale: f32,
    /// The batch's windows.
    pub rows: u32,
    /// `rows` × (block + 1) tokens, row-major.
    pub windows: Vec<u16>,
    /// An aggregated contribution: its sender's key and its
    /// shards' slice hashes, in shard order, fetched from its shards'
    /// aggregators (`holders`) or else the sender (its id is
    /// `pcp_protocol::diloco::aggregation::sliced_id` of them, and `delta` is
    /// empty).
    pub slices: Option<([u8; 32], Vec<[u8; 32]>)>,
    /// With `slices`: each shard's aggregators, in shard order, which hold its
    /// slice and serve it before its sender does (empty: the sender alone). At
    /// most [`MAX_HOLDERS`] a shard.
    pub holders: Vec<Vec<[u8; 32]>>,
}

/// The most aggregators a [`ScreenRequest`] names for one shard.
pub const MAX_HOLDERS: usize = 16;

impl Message for ScreenRequest {
    const NAME: &'static str = "ScreenRequest";
    const MAX_SIZE: usize = MAX_CONTRIBUTION;

    fn encode(&self) -> Vec<u8> {
        let mut message = capnp::message::Builder::new_default();
        let mut root = message.init_root::<screen_request::Builder<'_>>();
        root.set_run(&self.run[..]);
        root.set_round(self.round);
        root.set_contribution(&self.contribution[..]);
        root.set_contribution_round(self.contribution_round);
        root.set_params_hash(&self.params_hash[..]);
        root.set_delta(&self.delta);
        let mut tensor = root.reborrow().init_tensor_bounds(list_len(self.tensor_bounds.len()));
        for (i, b) in (0..).zip(&self.tensor_bounds) {
            tensor.set(i, *b);
        }
        let mut element = root.reborrow().init_element_bounds(list_len(self.element_bounds.len()));
        for (i, b) in (0..).zip(&self.element_bounds) {
            element.set(i, *b);
        }
        root.set_bound_scale(self.bound_scale);
        root.set_outer_scale(self.outer_scale);
        root.set_rows(self.rows);
        let windows: Vec<u8> = self.windows.iter().flat_map(|t| t.to_le_bytes()).collect();
        root.set_windows(&windows);
        if let Some((sender, hashes)) = &self.slices {
            root.set_sender(&sender[..]);
            let mut list = root.reborrow().init_slice_hashes(list_len(hashes.len()));
            for (i, h) in (0..).zip(hashes) {
                list.set(i, &h[..]);
            }
            let mut holders = root.reborrow().init_slice_holders(list_len(self.holders.len()));
            for (i, shard) in (0..).zip(&self.holders) {
                let mut keys = holders.reborrow().init(i, list_len(shard.len()));
                for (j, k) in (0..).zip(shard) {
                    keys.set(j, &k[..]);
                }
            }
        }
        codec::words(&message)
    }

    fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        const W: &str = ScreenRequest::NAME;
        codec::read(W, bytes, Self::MAX_SIZE, |m| {
            let r = m.get_root::<screen_request::Reader<'_>>().map_err(|e| malformed(W, e))?;
            let rows = r.get_rows();
            let raw = r.get_windows().map_err(|e| malformed(W, e))?;
            // whole u16 tokens, in whole rows of at least two (a window and its target)
            let tokens = raw.len() / 2;
            if rows == 0 || raw.len() % 2 != 0 || tokens % rows as usize != 0 || tokens / (rows as usize) < 2 {
                return Err(DecodeError::Invalid {
                    what: W,
                    field: "windows",
                    reason: format!("{} bytes are not {rows} rows of two or more u16 tokens", raw.len()),
                });
            }
            let windows = raw.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect();
            let list = r.get_slice_hashes().map_err(|e| malformed(W, e))?;
            let slices = if list.is_empty() {
                None
            } else {
                let mut hashes = Vec::with_capacity(list.len() as usize);
                for h in list.iter() {
                    hashes.push(fixed(W, "sliceHashes", h.map_err(|e| malformed(W, e))?)?);
                }
                Some((fixed(W, "sender", r.get_sender().map_err(|e| malformed(W, e))?)?, hashes))
            };
            let list = r.get_slice_holders().map_err(|e| malformed(W, e))?;
            let shards = slices.as_ref().map_or(0, |(_, h)| h.len());
            let invalid = |reason| DecodeError::Invalid { what: W, field: "sliceHolders", reason };
            if !list.is_empty() && list.len() as usize != shards {
                return Err(invalid(format!("{} shards' holders for {shards} slices", list.len())));
            }
            let mut holders = Vec::with_capacity(list.len() as usize);
            for keys in list.iter() {
                let keys = keys.map_err(|e| malformed(W, e))?;
                if keys.len() as usize > MAX_HOLDERS {
                    return Err(invalid(format!("{} holders of one slice, more than {MAX_HOLDERS}", keys.len())));
                }
                let mut shard = Vec::with_capacity(keys.len() as usize);
                for k in keys.iter() {
                    shard.push(fixed(W, "sliceHolders", k.map_err(|e| malformed(W, e))?)?);
                }
                holders.push(shard);
            }
            Ok(Self {
                run: fixed(W, "run", r.get_run().map_err(|e| malformed(W, e))?)?,
                round: r.get_round(),
                contribution: fixed(W, "contribution", r.get_contribution().map_err(|e| malformed(W, e))?)?,
                contribution_round: r.get_contribution_round(),
                params_hash: fixed(W, "paramsHash", r.get_params_hash().map_err(|e| malformed(W, e))?)?,
                delta: r.get_delta().map_err(|e| malformed(W, e))?.to_vec(),
                tensor_bounds: r.get_tensor_bounds().map_err(|e| malformed(W, e))?.iter().collect(),
                element_bounds: r.get_element_bounds().map_err(|e| malformed(W, e))?.iter().collect(),
                bound_scale: r.get_bound_scale(),
                outer_scale: r.get_outer_scale(),
                rows,
                windows,
                slices,
                holders,
            })
        })
    }
}

/// A screener's held-out losses for one contribution: its answer to a
/// [`ScreenRequest`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScreenReport {
    /// Run id.
    pub run: [u8; 32],
    /// The request's round.
    pub round: u64,
    /// The contribution scored.
    pub contribution: [u8; 32],
    /// The loss at the round's parameters.
    pub before: f32,
    /// With the contribution applied.
    pub after: f32,
    /// With it applied reversed.
    pub reversed: f32,
}

impl Message for ScreenReport {
    const NAME: &'static str = "ScreenReport";
    const MAX_SIZE: usize = MAX_CONTROL_MESSAGE;

    fn encode(&self) -> Vec<u8> {
        let mut message = capnp::message::Builder::new_default();
        let mut root = message.init_root::<screen_report::Builder<'_>>();
        root.set_run(&self.run[..]);
        root.set_round(self.round);
        root.set_contribution(&self.contribution[..]);
        root.set_before(self.before);
        root.set_after(self.after);
        root.set_reversed(self.reversed);
        codec::words(&message)
    }

    fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        const W: &str = ScreenReport::NAME;
        codec::read(W, bytes, Self::MAX_SIZE, |m| {
            let r = m.get_root::<screen_report::Reader<'_>>().map_err(|e| malformed(W, e))?;
            Ok(Self {
                run: fixed(W, "run", r.get_run().map_err(|e| malformed(W, e))?)?,
                round: r.get_round(),
                contribution: fixed(W, "contribution", r.get_contribution().map_err(|e| malformed(W, e))?)?,
                before: r.get_before(),
                after: r.get_after(),
                reversed: r.get_reversed(),
            })
        })
    }
}
