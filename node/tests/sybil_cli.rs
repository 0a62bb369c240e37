//! Sybils against a shepherd process: fresh identities, each of which says hello like a
//! worker and then opens contribution streams that announce the run's largest
//! contribution and send all of it but the last byte. Before contribution permits went
//! only to the open round's participants, 40 of them raised a nanogpt-medium shepherd's
//! memory by over a GiB and kept honest workers out. The shepherd is a real process, so
//! its resident memory is measured apart from the attackers'.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use futures::prelude::*;
use libp2p::request_response::{self, ProtocolSupport};
use libp2p::swarm::SwarmEvent;
use libp2p::{Multiaddr, PeerId, StreamProtocol};
use pcp_protocol::{Binding, Identity, RunId, head_of, seal};
use pcp_schema::{
    Backend, Capabilities, Contribution, FrameHead, MAX_CONTROL_MESSAGE, MAX_FRAME_HEAD, Message, NodeHello,
    ParameterRef, RunManifest,
};
use serde_json::Value;
use tokio::time::{Instant, timeout};
use tokio_util::sync::CancellationToken;

#[path = "support/common.rs"]
mod common;
use common::corpus;

#[path = "support/process.rs"]
mod process;

/// Sybil identities, and the contribution streams each opens.
const SYBILS: usize = 16;
const STREAMS: usize = 2;
/// The most the shepherd's resident memory may grow under the attack.
const MAX_GROWTH: u64 = 256 << 20;
/// The bound on every wait for the run.
const LONG: Duration = Duration::from_secs(300);

/// A `pcp-node` process, killed when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(args: &[String]) -> anyhow::Result<(Proc, std::io::Lines<BufReader<std::process::ChildStdout>>)> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_pcp-node"))
        .args(args)
        .env("PCP_ARTIFACT_CACHE", std::env::temp_dir().join("pcp-test-artifact-cache").join("artifacts"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let stdout = child.stdout.take().context("stdout")?;
    Ok((Proc(child), BufReader::new(stdout).lines()))
}

fn events(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path).unwrap_or_default().lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}

/// The first event in `path` that satisfies `pred`, waiting at most [`LONG`].
async fn wait_for(path: &Path, what: &str, pred: impl Fn(&Value) -> bool) -> anyhow::Result<Value> {
    let deadline = Instant::now() + LONG;
    loop {
        if let Some(e) = events(path).into_iter().find(&pred) {
            return Ok(e);
        }
        ensure!(Instant::now() < deadline, "no {what} in {} within {LONG:?}", path.display());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// What a Sybil sends: a whole hello frame, or a contribution head followed by all but
/// the last byte of the payload it announces, after which the stream is held open
/// until the attack ends.
#[derive(Debug)]
enum Ask {
    Hello(Vec<u8>),
    Flood { head: Vec<u8>, len: usize },
}

/// A Sybil's codec: writes [`Ask`]s and reads an answer's raw bytes.
#[derive(Debug, Clone)]
struct Sybil {
    /// Ends the held streams.
    over: CancellationToken,
    /// Payload bytes the shepherd took before it refused.
    sent: Arc<AtomicU64>,
}

impl request_response::Codec for Sybil {
    type Protocol = StreamProtocol;
    type Request = Ask;
    type Response = Vec<u8>;

    async fn read_request<T: AsyncRead + Unpin + Send>(
        &mut self,
        _: &StreamProtocol,
        _: &mut T,
    ) -> std::io::Result<Ask> {
        Err(std::io::ErrorKind::Unsupported.into())
    }

    async fn read_response<T: AsyncRead + Unpin + Send>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
    ) -> std::io::Result<Vec<u8>> {
        let mut answer = Vec::new();
        io.take((4 + MAX_FRAME_HEAD + MAX_CONTROL_MESSAGE) as u64).read_to_end(&mut answer).await?;
        Ok(answer)
    }

    async fn write_request<T: AsyncWrite + Unpin + Send>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
        ask: Ask,
    ) -> std::io::Result<()> {
        match ask {
            Ask::Hello(frame) => {
                io.write_all(&frame).await?;
                io.close().await
            }
            Ask::Flood { head, len } => {
                io.write_all(&head).await?;
                let chunk = vec![0xa5u8; 256 << 10];
                let mut left = len - 1;
                while left > 0 {
                    let n = left.min(chunk.len());
                    io.write_all(&chunk[..n]).await?;
                    io.flush().await?;
                    self.sent.fetch_add(n as u64, Ordering::Relaxed);
                    left -= n;
                }
                self.over.cancelled().await;
                Err(std::io::Error::other("held until the attack ended"))
            }
        }
    }

    async fn write_response<T: AsyncWrite + Unpin + Send>(
        &mut self,
        _: &StreamProtocol,
        _: &mut T,
        _: Vec<u8>,
    ) -> std::io::Result<()> {
        Ok(())
    }
}

fn framed(head: &FrameHead, payload: &[u8]) -> Vec<u8> {
    let head = head.encode();
    let mut frame = (head.len() as u32).to_be_bytes().to_vec();
    frame.extend_from_slice(&head);
    frame.extend_from_slice(payload);
    frame
}

/// The run a signed manifest answer names.
fn manifest_run(answer: &[u8]) -> anyhow::Result<RunId> {
    ensure!(answer.len() > 4, "an empty answer");
    let len = u32::from_be_bytes(answer[..4].try_into()?) as usize;
    let head = FrameHead::decode(answer.get(4..4 + len).context("a truncated head")?)?;
    let payload = answer[4 + len..].to_vec();
    let verified = pcp_protocol::verify(head.with_payload(payload))?;
    Ok(RunId(verified.decode::<RunManifest>()?.run))
}

/// What one Sybil got: its peer id, and how many of its streams ended before the attack did.
struct Outcome {
    peer: PeerId,
    refused: usize,
}

/// One Sybil: a fresh identity on its own QUIC connection says hello as a worker for
/// `backend` (the shepherd answers with the run's manifest), then opens [`STREAMS`]
/// contribution streams for `round` announcing `len` bytes each.
async fn sybil(
    shepherd: (PeerId, Multiaddr),
    backend: Backend,
    round: u64,
    len: usize,
    codec: Sybil,
) -> anyhow::Result<Outcome> {
    let identity = Identity::from_secret(rand::random());
    let mut swarm = libp2p::SwarmBuilder::with_existing_identity(pcp_bootstrap::keypair(&identity))
        .with_tokio()
        .with_quic()
        .with_behaviour(|_| {
            request_response::Behaviour::with_codec(
                codec.clone(),
                [(pcp_bootstrap::RPC_PROTOCOL, ProtocolSupport::Outbound)],
                request_response::Config::default()
                    .with_request_timeout(Duration::from_secs(600))
                    .with_max_concurrent_streams(STREAMS + 1),
            )
        })?
        .build();
    let peer = *swarm.local_peer_id();
    let (target, addr) = shepherd;
    swarm.dial(addr.with(libp2p::multiaddr::Protocol::P2p(target)))?;
    let now = || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    let hello = NodeHello {
        peer: identity.public().0,
        protocol_version: 1,
        agent: "sybil".into(),
        capabilities: Capabilities { backends: vec![backend], free_memory_bytes: 0, aggregate: false },
        certificate: Vec::new(),
        pow_nonce: 0,
    };
    let envelope = seal(&identity, Binding { run: RunId([0; 32]), round: 0, nonce: 1, unix_ms: now() }, &hello);
    swarm.behaviour_mut().send_request(&target, Ask::Hello(framed(&head_of(&envelope), &envelope.payload)));
    let run = loop {
        match swarm.select_next_some().await {
            SwarmEvent::Behaviour(request_response::Event::Message {
                message: request_response::Message::Response { response, .. },
                ..
            }) => break manifest_run(&response).context("the hello's answer")?,
            SwarmEvent::Behaviour(request_response::Event::OutboundFailure { error, .. }) => {
                bail!("sybil {peer}: hello failed: {error}")
            }
            SwarmEvent::OutgoingConnectionError { error, .. } => bail!("sybil {peer} could not connect: {error}"),
            _ => {}
        }
    };
    // the largest contribution the run reads, signed by this sybil, for the open round
    let contribution = Contribution {
        run: run.0,
        round,
        inner_steps: 1,
        samples: 1,
        pseudo_gradient: ParameterRef { name: "delta".into(), shard: 0, blob: [0; 32], size: 0 },
        loss: 0.0,
        delta: Vec::new(),
        bytes_down: 0,
        term: 0,
        params_hash: [0; 32],
        train_ms: 0,
        wall_ms: 0,
        sent_unix_ms: 0,
        slice_hashes: Vec::new(),
    };
    for nonce in 0..STREAMS as u64 {
        let envelope = seal(&identity, Binding { run, round, nonce: 2 + nonce, unix_ms: now() }, &contribution);
        let mut head = head_of(&envelope);
        head.payload_len = len as u64;
        swarm.behaviour_mut().send_request(&target, Ask::Flood { head: framed(&head, &[]), len });
    }
    let (mut open, mut refused) = (STREAMS, 0);
    while open > 0 {
        match swarm.select_next_some().await {
            SwarmEvent::Behaviour(request_response::Event::OutboundFailure { .. }) => {
                open -= 1;
                if !codec.over.is_cancelled() {
                    refused += 1;
                }
            }
            SwarmEvent::Behaviour(request_response::Event::Message { .. }) => open -= 1,
            _ => {}
        }
    }
    Ok(Outcome { peer, refused })
}

/// 16 Sybils each say hello to a shepherd of nanogpt-medium and open 2 contribution
/// streams of the run's largest size during a round: the shepherd's memory grows by
/// less than 256 MiB, it reads none of them, and the honest worker's contribution to
/// that round is accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sybils_cannot_fill_a_shepherds_memory() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = |name: &str| dir.path().join(name).display().to_string();
    let shepherd_events = dir.path().join("shepherd.jsonl");
    let worker_events = dir.path().join("worker.jsonl");
    let args: Vec<String> = [
        "--shepherd",
        "--pow-bits",
        "0",
        "--model",
        "nanogpt-medium",
        "--min-workers",
        "1",
        "--rounds",
        "3",
        "--tau",
        "2",
        "--screen",
        "norm",
        "--encoding",
        "fp32",
        "--no-overlap",
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
        "--listen",
        "/ip4/127.0.0.1/udp/0/quic-v1",
    ]
    .map(String::from)
    .into_iter()
    .chain(["--data".into(), corpus(), "--data-dir".into(), path("shepherd")])
    .chain(["--events".into(), shepherd_events.display().to_string()])
    .collect();
    let (shepherd, lines) = spawn(&args)?;
    let pid = shepherd.0.id();
    let (shepherd_peer, tcp, quic) = process::listen_addresses(lines)?;
    let bootstrap = tcp.with(libp2p::multiaddr::Protocol::P2p(shepherd_peer)).to_string();
    let worker_args = ["--bootstrap", &bootstrap, "--listen", "/ip4/127.0.0.1/tcp/0", "--data-dir", &path("worker")]
        .map(String::from)
        .into_iter()
        .chain(["--events".into(), worker_events.display().to_string()])
        .collect::<Vec<_>>();
    let (_worker, worker_lines) = spawn(&worker_args)?;
    std::thread::spawn(move || for _ in worker_lines {});

    // round 1 is done (its contribution's memory is in the baseline) and round 2 open
    let joined = wait_for(&worker_events, "run_joined", |e| e["event"] == "run_joined").await?;
    let sent = wait_for(&worker_events, "a contribution", |e| e["event"] == "contribution_sent").await?;
    wait_for(&shepherd_events, "round 2", |e| e["event"] == "round_started" && e["round"] == 2).await?;
    let honest = wait_for(&shepherd_events, "the worker", |e| e["event"] == "worker_joined").await?["peer"].clone();
    let backend = Backend {
        name: joined["backend"].as_str().context("backend")?.to_owned(),
        targets: vec![joined["target"].as_str().context("target")?.to_owned()],
    };
    // the run's largest contribution: fp32 values and the room the shepherd allows beside them
    let len = sent["param_bytes"].as_u64().context("param_bytes")? as usize + 4096;

    let before = process::memory(pid, "VmRSS:")?;
    let done = Arc::new(AtomicBool::new(false));
    let sampler = std::thread::spawn({
        let done = done.clone();
        move || {
            let mut peak = 0;
            while !done.load(Ordering::Relaxed) {
                peak = peak.max(process::memory(pid, "VmRSS:").unwrap_or(0));
                std::thread::sleep(Duration::from_millis(10));
            }
            peak
        }
    });
    let codec = Sybil { over: CancellationToken::new(), sent: Arc::default() };
    let started = Instant::now();
    let attacks: Vec<_> = (0..SYBILS)
        .map(|_| tokio::spawn(sybil((shepherd_peer, quic.clone()), backend.clone(), 2, len, codec.clone())))
        .collect();

    // the honest worker's contribution to round 2 is accepted, and the round completes
    let received = wait_for(&shepherd_events, "the worker's round-2 contribution", |e| {
        e["event"] == "contribution_received" && e["round"] == 2 && e["peer"] == honest
    })
    .await?;
    ensure!(received["accepted"] == true, "the honest contribution was refused: {received}");
    wait_for(&shepherd_events, "round 2 completed", |e| e["event"] == "round_completed" && e["round"] == 2).await?;
    let seconds = started.elapsed().as_secs_f64();
    codec.over.cancel();
    let mut outcomes = Vec::new();
    for a in attacks {
        outcomes.push(timeout(Duration::from_secs(60), a).await.context("a sybil hung")???);
    }
    done.store(true, Ordering::Relaxed);
    let peak = sampler.join().map_err(|_| anyhow::anyhow!("the sampler panicked"))?;
    let refused: usize = outcomes.iter().map(|o| o.refused).sum();
    let taken = codec.sent.load(Ordering::Relaxed);
    eprintln!(
        "{SYBILS} sybils x {STREAMS} streams of {} MiB: {refused} refused before the round ended, {} MiB written; \
         shepherd RSS {} MiB before, peak {} MiB (+{} MiB) over {seconds:.1} s",
        len >> 20,
        taken >> 20,
        before >> 20,
        peak >> 20,
        peak.saturating_sub(before) >> 20,
    );
    ensure!(peak.saturating_sub(before) < MAX_GROWTH, "RSS grew from {before} to a peak of {peak} bytes");

    // the shepherd read none of the sybils' contributions, and said why
    let all = events(&shepherd_events);
    let sybils: Vec<String> = outcomes.iter().map(|o| o.peer.to_string()).collect();
    let from_sybil = |e: &&Value| e["peer"].as_str().is_some_and(|p| sybils.iter().any(|s| s == p));
    ensure!(
        !all.iter().filter(from_sybil).any(|e| e["event"] == "contribution_received"),
        "a sybil's contribution was read"
    );
    let rejected =
        wait_for(&shepherd_events, "a sybil's refusal", |e| e["event"] == "message_rejected" && from_sybil(&e)).await?;
    let reason = rejected["reason"].as_str().unwrap_or_default();
    ensure!(reason.contains("not a participant"), "{rejected}");
    Ok(())
}
