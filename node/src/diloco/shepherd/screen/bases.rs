//! The parameters a carried contribution is scored at ([`Bases`]).

use pcp_protocol::diloco::Tensors;

use crate::training::engine::Resident;

/// The parameters the open round and the one before it opened with. Under
/// overlapped rounds a contribution that comes after its round closed is carried
/// into the next and scored at the open round's parameters, where the round
/// applies it. An honest one often overshoots there: the update it was late for
/// already moved along much the same direction. In `bench/sleepers.sh --nodes 21
/// --hostile 9 --tau 10 -- --screen-share 0`'s honest run 13 of 16 honest
/// contributions refused as no improvement were carried ones, each a catch that
/// cost its sender its rating and a round sitting out. So a carried contribution
/// the screen refuses is scored again at the parameters its own round opened
/// with, where it was computed: if it passes there it is refused as late, which
/// catches no one; if not, the refusal stands. (Scoring carried contributions
/// at their own round's parameters alone let them all through, and the same
/// run's fp32 loss rose from 2.90 to 3.72 over rounds 2–4 as the stale updates
/// were applied.) It holds two copies of the parameters besides the state
/// machine's: the open round's, which becomes the prior at the next open, and
/// the prior; and each on the engine's device once a screen needed it.
#[derive(Debug, Default)]
pub(super) struct Bases {
    pub(super) open: Option<(u64, Tensors)>,
    /// The round before's, with its loss on the open round's batch once known.
    pub(super) prior: Option<Prior>,
    /// The open round's parameters on the engine's device, once a screen needed
    /// them: uploaded once a round, not once a contribution.
    pub(super) resident: Option<(u64, Resident)>,
}

/// The parameters the round before opened with.
#[derive(Debug)]
pub(super) struct Prior {
    pub(super) round: u64,
    pub(super) params: Tensors,
    /// Their loss on the open round's batch, once known.
    pub(super) before: Option<f32>,
    /// On the engine's device, once a screen needed them.
    pub(super) resident: Option<Resident>,
}
