//! Sending a contribution to the followed leader: sent again when lost on the way
//! while its round is open, abandoned when an announcement makes it moot.

use std::time::Duration;

use pcp_bootstrap::{Node, RequestError};
use pcp_protocol::diloco::follower::Opening;
use pcp_protocol::diloco::sparse::SparseTensors;
use pcp_protocol::{PublicKey, RunId, Verified};
use pcp_schema::{Ack, Contribution, Message as _};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::Leader;
use super::heartbeats::{HEARTBEAT, Latest, newer_arrives, newer_round, superseded};
use crate::diloco::wire::Signer;

/// A contribution lost on the way is sent again, this many times in all, while its
/// round is open.
const MAX_SENDS: u32 = 8;
/// How long a contribution's answer is still awaited once an announcement made
/// it moot: the close that sent the announcement may also have acknowledged it.
const ANSWER_GRACE: Duration = Duration::from_secs(1);

/// A contribution ready to send, and what its sender must remember.
#[derive(Debug)]
pub(super) struct Outgoing {
    pub(super) contribution: Contribution,
    /// The sparse entries it takes from the error feedback (given back if refused).
    pub(super) sent: Option<SparseTensors>,
    pub(super) trained_s: f64,
    /// A late attacker's: sent only after its round closed.
    pub(super) late: bool,
    /// An aggregated round's: its slices, each with its shard's first replica,
    /// sent once the shepherd took the commitment ([`super::slices`]).
    pub(super) slices: Vec<(pcp_bootstrap::PeerId, pcp_schema::Slice)>,
}

/// How a sent contribution fared.
#[derive(Debug)]
pub(super) struct Delivery {
    pub(super) accepted: bool,
    pub(super) reason: String,
    pub(super) wire_bytes: u64,
}

/// Where contributions go: the node, the followed leader, and the announcements
/// that make a send moot.
#[derive(Clone, Debug)]
pub(super) struct Courier {
    pub(super) node: Node,
    pub(super) run: RunId,
    pub(super) leader: watch::Receiver<Leader>,
    pub(super) latest: watch::Receiver<Latest>,
    pub(super) cancel: CancellationToken,
    /// A volunteer aggregator's: its own slices go here, not over the network.
    pub(super) own_slices: Option<tokio::sync::mpsc::Sender<pcp_schema::Slice>>,
}

impl Courier {
    /// Waits until the round after `this` is announced, and a moment more (a late
    /// attacker's send time).
    pub(super) async fn after_close(&self, this: Opening) {
        let mut watching = self.latest.clone();
        newer_arrives(&mut watching, this).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    /// Sends `contribution` to the followed leader. A send to a leader that died (or
    /// refused it unread) must not hold up the round that replaces it: an
    /// announcement that makes it moot abandons it ([`superseded`]). One lost on
    /// the way (a cut link, a leader busy past the timeout) is sent again while the
    /// round is open, so that the round does not wait on it for good. `None`:
    /// cancelled.
    pub(super) async fn deliver(
        &self,
        signer: &mut Signer,
        contribution: &Contribution,
        this: Opening,
    ) -> Option<Delivery> {
        let r = contribution.round;
        let mut envelope = signer.seal(self.run, r, contribution);
        let wire_bytes = envelope.encode().len() as u64;
        let mut watching = self.latest.clone();
        let mut tries = 0u32;
        let answer = loop {
            let (to, to_key) = *self.leader.borrow();
            let request = self.node.request(to, envelope);
            tokio::pin!(request);
            let answer = tokio::select! {
                () = self.cancel.cancelled() => return None,
                answer = &mut request => Some((answer, to_key)),
                () = superseded(&mut watching, this) => tokio::select! {
                    // the leader's answer and the announcement its close sent race
                    // (gossip can win): an answer already on its way still counts
                    () = self.cancel.cancelled() => return None,
                    answer = &mut request => Some((answer, to_key)),
                    () = tokio::time::sleep(ANSWER_GRACE) => None,
                },
            };
            tries += 1;
            match answer {
                Some((Err(e @ (RequestError::Failed { .. } | RequestError::Busy { .. })), _))
                    if tries < MAX_SENDS && !newer_round(&self.latest, this) =>
                {
                    tracing::warn!("round {r}: sending the contribution failed ({e}); sending it again");
                    tokio::select! {
                        () = self.cancel.cancelled() => return None,
                        () = newer_arrives(&mut watching, this) => break None,
                        () = tokio::time::sleep(HEARTBEAT * 2) => {}
                    }
                    envelope = signer.seal(self.run, r, contribution);
                }
                other => break other,
            }
        };
        let (accepted, reason) = match answer {
            Some((answer, to_key)) => ack_of(answer, to_key),
            None => (false, "abandoned: a newer announcement made it moot before the answer".to_owned()),
        };
        Some(Delivery { accepted, reason, wire_bytes })
    }
}

fn ack_of(answer: Result<Verified, RequestError>, shepherd: PublicKey) -> (bool, String) {
    match answer {
        Ok(v) if v.signer() == shepherd => match v.decode::<Ack>() {
            Ok(ack) => (ack.accepted, ack.reason),
            Err(e) => (false, format!("unreadable answer: {e}")),
        },
        Ok(_) => (false, "answer signed by someone else".into()),
        Err(e) => (false, e.to_string()),
    }
}
