//! Finding a run and joining it: the DHT's providers, the hello (with a proof of
//! work where the run asks one), and the manifest's checks.

use std::path::Path;
use std::time::Duration;

use pcp_bootstrap::{Node, PeerId};
use pcp_protocol::election::Succession;
use pcp_protocol::{PublicKey, RunId};
use pcp_schema::{Ack, ArtifactRef, Backend, Capabilities, MessageKind, NodeHello, RunManifest};
use tokio_util::sync::CancellationToken;

use super::{WorkerPlan, pow};
use crate::diloco::wire::{self, Signer};

/// How often a worker without a run asks the DHT again.
const DISCOVERY_RETRY: Duration = Duration::from_secs(2);

/// A run this worker joined.
#[derive(Debug, Clone)]
pub(super) struct Joined {
    pub(super) shepherd: PeerId,
    pub(super) shepherd_key: PublicKey,
    pub(super) manifest: RunManifest,
    pub(super) artifact: ArtifactRef,
    /// The run's coordinator candidates, in the order they take terms.
    pub(super) succession: Succession,
}

/// Finds a run and joins it: the signed manifest with an artifact for this node.
pub(super) async fn discover(
    plan: &WorkerPlan,
    (node, data_dir): (&Node, &Path),
    signer: &mut Signer,
    cancel: &CancellationToken,
) -> anyhow::Result<Option<Joined>> {
    let key = plan.run.map_or_else(wire::runs_key, wire::run_key);
    let mut said = false;
    loop {
        let providers = node.providers(key, 8).await?;
        for peer in providers {
            match join(plan, (node, data_dir), signer, peer).await {
                Ok(joined) => return Ok(Some(joined)),
                Err(JoinError::Fatal(e)) => return Err(e),
                Err(JoinError::Skip(reason)) => tracing::debug!(%peer, "not joining: {reason}"),
            }
        }
        if !said && plan.verbose {
            println!("looking for a run to join (asking the DHT every {} s)…", DISCOVERY_RETRY.as_secs());
            said = true;
        }
        tokio::select! {
            () = cancel.cancelled() => return Ok(None),
            () = tokio::time::sleep(DISCOVERY_RETRY) => {}
        }
    }
}

#[derive(Debug)]
enum JoinError {
    /// Try another shepherd, or later.
    Skip(String),
    /// The shepherd cannot serve this node at all.
    Fatal(anyhow::Error),
}

async fn join(
    plan: &WorkerPlan,
    (node, data_dir): (&Node, &Path),
    signer: &mut Signer,
    peer: PeerId,
) -> Result<Joined, JoinError> {
    let me = signer.identity().public();
    // the proof of work kept for the run named, if any (see `pow`)
    let kept = plan.run.and_then(|run| pow::cached(data_dir, run, &me)).map_or(0, |(nonce, _)| nonce);
    let hello = NodeHello {
        peer: me.0,
        protocol_version: wire::PROTOCOL_VERSION,
        agent: format!("pcp-node/{}", env!("CARGO_PKG_VERSION")),
        capabilities: Capabilities {
            backends: vec![Backend { name: plan.backend.clone(), targets: vec![plan.target.clone()] }],
            free_memory_bytes: plan.free_memory.0,
            aggregate: plan.aggregate,
        },
        certificate: plan.certificate.clone(),
        pow_nonce: kept,
    };
    // a hello is for whichever run the shepherd runs: bound to the zero run id
    let envelope = signer.seal(plan.run.unwrap_or(RunId([0; 32])), 0, &hello);
    let mut answer = node.request(peer, envelope).await.map_err(|e| JoinError::Skip(e.to_string()))?;
    // an open run that asks a proof of work of each identity: solve it, and say hello
    // again (asked for more while it solved, go on from the nonce found)
    let mut tries = 0;
    while let Some((run, bits)) = pow_asked(&answer) {
        tries += 1;
        if tries > pow::MAX_TRIES {
            return Err(JoinError::Skip(format!("run {run} still asks a proof of work of {bits} bits")));
        }
        let nonce = pow::solve(data_dir, run, me, bits).await.map_err(|e| JoinError::Skip(format!("{e:#}")))?;
        let hello = NodeHello { pow_nonce: nonce, ..hello.clone() };
        let envelope = signer.seal(plan.run.unwrap_or(RunId([0; 32])), 0, &hello);
        answer = node.request(peer, envelope).await.map_err(|e| JoinError::Skip(e.to_string()))?;
    }
    match answer.kind() {
        MessageKind::RunManifest => {
            let manifest: RunManifest = answer.decode().map_err(|e| JoinError::Skip(e.to_string()))?;
            let run = RunId(manifest.run);
            let creator = PublicKey(manifest.shepherd);
            let candidates: Vec<PublicKey> = manifest.candidates.iter().map(|k| PublicKey(*k)).collect();
            // the id binds the creator and the candidates: a successor's manifest is checked against it
            if pcp_protocol::election::run_id(&creator, &manifest.model_hash, &manifest.salt, &candidates) != run {
                return Err(JoinError::Skip(format!("the manifest of run {run} does not hash to its id")));
            }
            let succession = Succession::new(run, creator, &candidates);
            if !succession.contains(&answer.signer()) {
                return Err(JoinError::Skip("the manifest is signed by a key that is not a candidate".into()));
            }
            // the run's gossip is its candidates' alone (`Admission::may_gossip`)
            node.admission().candidates(run, succession.order());
            if plan.run.is_some_and(|r| r.0 != manifest.run) {
                return Err(JoinError::Skip(format!("{peer} runs {}", RunId(manifest.run))));
            }
            let wanted = |a: &&ArtifactRef| a.backend == plan.backend && a.target == plan.target;
            let Some(artifact) = manifest.artifacts.iter().find(wanted).cloned() else {
                return Err(JoinError::Skip("the manifest has no artifact for this backend".into()));
            };
            Ok(Joined { shepherd: peer, shepherd_key: answer.signer(), manifest, artifact, succession })
        }
        MessageKind::Ack => {
            let ack: Ack = answer.decode().map_err(|e| JoinError::Skip(e.to_string()))?;
            match ack.code {
                pcp_schema::AckCode::NoArtifact => Err(JoinError::Fatal(anyhow::anyhow!("{}", ack.reason))),
                _ => Err(JoinError::Skip(ack.reason)),
            }
        }
        other => Err(JoinError::Skip(format!("answered a hello with {}", other.tag()))),
    }
}

/// A shepherd's refusal that asks a proof of work: its run and the bits it needs (at
/// most [`pcp_protocol::admit::MAX_POW_BITS`]; a run that asks more is not joined).
fn pow_asked(answer: &pcp_protocol::Verified) -> Option<(RunId, u8)> {
    if answer.kind() != MessageKind::Ack {
        return None;
    }
    let ack: Ack = answer.decode().ok()?;
    let bits = ack.pow_bits;
    let asked = ack.code == pcp_schema::AckCode::ProofOfWork && bits <= pcp_protocol::admit::MAX_POW_BITS;
    asked.then_some((RunId(ack.run), bits))
}
