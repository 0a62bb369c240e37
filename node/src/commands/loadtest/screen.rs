//! Synthetic screeners in `pcp-node loadtest` (`--screen-ms MS`): each synthetic
//! worker sits on the screening committees the shepherd draws (`--screeners`),
//! reads the leader's screen requests as a worker does, and answers each after
//! `MS` milliseconds, a screener's modelled forward passes, with losses that pass
//! it. They compute nothing: every member reports the same [`LOSSES`], so
//! committees agree, and a shepherd's spot check would catch them all (run it with
//! `--screen-spot-rate 0`). What this measures is the shepherd: its committees'
//! requests, waits and verdicts under a round of a thousand contributions.

use std::time::Duration;

use anyhow::Context as _;
use pcp_bootstrap::{Event, Node, PeerId};
use pcp_protocol::RunId;
use pcp_protocol::diloco::compress::{self, Encoding};
use pcp_schema::{MessageKind, ScreenReport, ScreenRequest};

use crate::diloco::wire::Signer;

/// The losses a synthetic screener reports (before, after, reversed): a gain every
/// member agrees on.
pub(super) const LOSSES: (f32, f32, f32) = (4.0, 3.99, 4.01);

/// Reads `shepherd`'s screen requests for `run`, of a model of tensors `sizes`
/// whose contributions are encoded `encoding`, as a worker does.
pub(super) fn enlist(
    node: &Node,
    shepherd: PeerId,
    run: RunId,
    (sizes, encoding): (&[usize], Encoding),
) -> anyhow::Result<()> {
    let key = pcp_bootstrap::key_of(&shepherd).context("the shepherd's peer id names no key")?;
    let len = compress::encoded_len(sizes, encoding) + crate::diloco::screen_request_overhead(sizes.len());
    node.admission().screen_for(run, key, len);
    Ok(())
}

/// Answers `request` (an [`Event::Request`]) if it is `run`'s screen request: its
/// report signed now and sent after `delay`. Anything else is left unanswered.
/// Returns whether it answers.
pub(super) fn answer(node: &Node, signer: &mut Signer, run: RunId, request: Event, delay: Duration) -> bool {
    let Event::Request { id, message, .. } = request else { return false };
    let screen = match message.kind() {
        MessageKind::ScreenRequest => message.decode::<ScreenRequest>().ok().filter(|s| s.run == run.0),
        _ => None,
    };
    let Some(screen) = screen else {
        node.leave_unanswered(id);
        return false;
    };
    let (before, after, reversed) = LOSSES;
    let report =
        ScreenReport { run: run.0, round: screen.round, contribution: screen.contribution, before, after, reversed };
    let envelope = signer.seal(run, screen.round, &report);
    let node = node.clone();
    tokio::spawn(async move {
        tokio::time::sleep(delay).await;
        if let Err(e) = node.respond(id, envelope).await {
            tracing::debug!("answering a screen request: {e}");
        }
    });
    true
}
