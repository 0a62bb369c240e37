//! Strangers attacking a `pcp-node` process: memory before authentication and
//! connection starvation. The node under attack is a real process, so its resident
//! memory is measured apart from the attackers'.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use futures::prelude::*;
use libp2p::request_response::{self, ProtocolSupport};
use libp2p::swarm::SwarmEvent;
use libp2p::{Multiaddr, PeerId, StreamProtocol};
use pcp_bootstrap::{Config, Event, Node};
use pcp_protocol::{Binding, Identity, RunId, head_of, seal};
use pcp_schema::{Contribution, Heartbeat, MAX_CONTRIBUTION, Message, ParameterRef};
use tokio::time::{Instant, timeout};

#[path = "support/process.rs"]
mod process;

/// A `pcp-node --no-train` process listening on loopback (TCP and QUIC), and its addresses.
struct Target {
    child: Child,
    peer: PeerId,
    tcp: Multiaddr,
    quic: Multiaddr,
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_target(dir: &Path) -> anyhow::Result<Target> {
    let events = dir.join("events.jsonl");
    let mut child = Command::new(env!("CARGO_BIN_EXE_pcp-node"))
        .args(["--no-train", "--listen", "/ip4/127.0.0.1/tcp/0", "--listen", "/ip4/127.0.0.1/udp/0/quic-v1"])
        .arg("--data-dir")
        .arg(dir.join("target"))
        .arg("--events")
        .arg(&events)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    // the node prints its addresses once it listens
    let stdout = child.stdout.take().context("stdout")?;
    let (peer, tcp, quic) = process::listen_addresses(BufReader::new(stdout).lines())?;
    Ok(Target { child, peer, tcp, quic })
}

/// A codec that writes whatever bytes it is given and reads nothing back.
#[derive(Debug, Clone, Default)]
struct Raw;

impl request_response::Codec for Raw {
    type Protocol = StreamProtocol;
    type Request = Vec<u8>;
    type Response = ();

    async fn read_request<T: AsyncRead + Unpin + Send>(
        &mut self,
        _: &StreamProtocol,
        _: &mut T,
    ) -> std::io::Result<Vec<u8>> {
        Err(std::io::ErrorKind::Unsupported.into())
    }
    async fn read_response<T: AsyncRead + Unpin + Send>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
    ) -> std::io::Result<()> {
        let mut byte = [0u8; 1];
        let _ = io.read(&mut byte).await?;
        Ok(())
    }
    async fn write_request<T: AsyncWrite + Unpin + Send>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
        req: Vec<u8>,
    ) -> std::io::Result<()> {
        io.write_all(&req).await?;
        io.close().await
    }
    async fn write_response<T: AsyncWrite + Unpin + Send>(
        &mut self,
        _: &StreamProtocol,
        _: &mut T,
        (): (),
    ) -> std::io::Result<()> {
        Ok(())
    }
}

const JUNK: usize = 32 << 20;

/// The frames an attacker sends, each followed by junk up to 32 MiB: a frame of the
/// old protocol's maximum size, a validly signed head announcing a maximum-size
/// contribution, and one announcing a maximum-size heartbeat.
fn frames(attacker: &Identity) -> Vec<Vec<u8>> {
    let run = RunId([3; 32]);
    let binding = |nonce| Binding { run, round: 1, nonce, unix_ms: 1 };
    let contribution = Contribution {
        run: run.0,
        round: 1,
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
    let heartbeat = Heartbeat::new(run.0, 1, 1);
    let mut contribution_head = head_of(&seal(attacker, binding(1), &contribution));
    contribution_head.payload_len = MAX_CONTRIBUTION as u64;
    let mut heartbeat_head = head_of(&seal(attacker, binding(2), &heartbeat));
    heartbeat_head.payload_len = 64 << 10;
    let framed = |head: Vec<u8>| {
        let mut frame = (head.len() as u32).to_be_bytes().to_vec();
        frame.extend_from_slice(&head);
        frame
    };
    let old_style = (512u32 << 20).to_be_bytes().to_vec();
    [old_style, framed(contribution_head.encode()), framed(heartbeat_head.encode())]
        .into_iter()
        .map(|mut frame| {
            frame.resize(JUNK, 0xa5);
            frame
        })
        .collect()
}

/// One attacker: its own identity and connection (QUIC), `streams` requests at once
/// on the DiLoCo protocol. Returns the bytes it tried to send.
async fn attack(target: PeerId, addr: Multiaddr, seed: u8, streams: usize) -> anyhow::Result<u64> {
    let identity = Identity::from_secret([seed; 32]);
    let key = pcp_bootstrap::keypair(&identity);
    let protocol = pcp_bootstrap::RPC_PROTOCOL;
    let mut swarm = libp2p::SwarmBuilder::with_existing_identity(key)
        .with_tokio()
        .with_quic()
        .with_behaviour(|_| {
            request_response::Behaviour::<Raw>::new(
                [(protocol, ProtocolSupport::Outbound)],
                request_response::Config::default()
                    .with_request_timeout(Duration::from_secs(20))
                    .with_max_concurrent_streams(streams),
            )
        })?
        .build();
    swarm.dial(addr.with(libp2p::multiaddr::Protocol::P2p(target)))?;
    let frames = frames(&identity);
    let mut sent = 0u64;
    for i in 0..streams {
        let frame = frames[i % frames.len()].clone();
        sent += frame.len() as u64;
        swarm.behaviour_mut().send_request(&target, frame);
    }
    let mut open = streams;
    while open > 0 {
        match swarm.select_next_some().await {
            SwarmEvent::Behaviour(request_response::Event::OutboundFailure { .. })
            | SwarmEvent::Behaviour(request_response::Event::Message { .. }) => open -= 1,
            SwarmEvent::OutgoingConnectionError { error, .. } => bail!("attacker {seed} could not connect: {error}"),
            _ => {}
        }
    }
    Ok(sent)
}

/// A node on loopback that joins through `seed`, and its event stream.
async fn honest(
    dir: &Path,
    seed: Multiaddr,
    quic_only: bool,
) -> anyhow::Result<(Node, tokio::sync::mpsc::Receiver<Event>, tokio::task::JoinHandle<()>)> {
    let identity = Identity::from_secret(rand::random());
    let mut config = Config::loopback(dir.to_path_buf());
    config.bootstrap = vec![seed];
    if quic_only {
        config.listen.retain(|a| a.to_string().contains("quic"));
    }
    let (node, events, event_loop) = Node::new(&identity, config)?;
    let cancel = tokio_util::sync::CancellationToken::new();
    let task = tokio::spawn(async move { event_loop.run(cancel).await });
    Ok((node, events, task))
}

/// 1 GiB of maximum-size frames from 4 strangers × 8 streams: the node stays up, its
/// memory grows by less than 128 MiB, and a fresh peer can still look up a provider
/// through it in the DHT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stranger_cannot_exhaust_a_nodes_memory() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let target = start_target(dir.path())?;
    let pid = target.child.id();
    let seed = target.quic.clone().with(libp2p::multiaddr::Protocol::P2p(target.peer));
    // a provider of a blob, known to the target before the attack
    let (provider, _provider_events, _p) = honest(&dir.path().join("provider"), seed.clone(), false).await?;
    let blob = dir.path().join("blob");
    std::fs::write(&blob, b"still reachable")?;
    let store = pcp_bootstrap::BlobStore::open(&dir.path().join("provider"))?;
    let (hash, _) = store.put_file(&blob)?;
    provider.provide(hash).await?;

    let before = process::memory(pid, "VmRSS:")?;
    let started = Instant::now();
    let attacks: Vec<_> = (0..4u8).map(|i| tokio::spawn(attack(target.peer, target.quic.clone(), 40 + i, 8))).collect();
    let mut sent = 0;
    for a in attacks {
        sent += timeout(Duration::from_secs(120), a).await.context("an attacker hung")???;
    }
    let seconds = started.elapsed().as_secs_f64();
    let peak = process::memory(pid, "VmHWM:")?;
    let after = process::memory(pid, "VmRSS:")?;
    eprintln!(
        "attack: {} MiB attempted in {seconds:.1} s; target RSS {} MiB before, peak {} MiB, {} MiB after",
        sent >> 20,
        before >> 20,
        peak >> 20,
        after >> 20
    );
    ensure!(sent >= 1 << 30, "the attack tried {sent} bytes");
    ensure!(peak.saturating_sub(before) < 128 << 20, "RSS grew from {before} to a peak of {peak} bytes");

    // the node is up and still routes: a fresh peer finds the provider through it
    let (fresh, _fresh_events, _f) = honest(&dir.path().join("fresh"), seed, false).await?;
    let found = timeout(Duration::from_secs(30), async {
        loop {
            if fresh.providers(hash, 4).await?.contains(&provider.peer_id()) {
                return anyhow::Ok(());
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    })
    .await;
    ensure!(matches!(found, Ok(Ok(()))), "no DHT lookup through the attacked node: {found:?}");
    Ok(())
}

/// 100 silent TCP sockets hold the node's TCP handshake budget; a node joining over
/// QUIC still connects within 5 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_tcp_sockets_do_not_keep_quic_joins_out() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let target = start_target(dir.path())?;
    let port = target
        .tcp
        .iter()
        .find_map(|p| match p {
            libp2p::multiaddr::Protocol::Tcp(port) => Some(port),
            _ => None,
        })
        .context("tcp port")?;
    let silent: Vec<std::net::TcpStream> =
        (0..100).filter_map(|_| std::net::TcpStream::connect(("127.0.0.1", port)).ok()).collect();
    ensure!(silent.len() >= 64, "only {} sockets connected", silent.len());

    let seed = target.quic.clone().with(libp2p::multiaddr::Protocol::P2p(target.peer));
    let started = Instant::now();
    let (_joiner, mut events, _task) = honest(&dir.path().join("joiner"), seed, true).await?;
    let connected = timeout(Duration::from_secs(5), async {
        while let Some(event) = events.recv().await {
            if matches!(&event, Event::PeerConnected { peer, .. } if *peer == target.peer) {
                return true;
            }
        }
        false
    })
    .await;
    ensure!(connected == Ok(true), "no QUIC connection within 5 s while {} TCP sockets were silent", silent.len());
    eprintln!(
        "joined over QUIC in {:.2} s beside {} silent TCP sockets",
        started.elapsed().as_secs_f64(),
        silent.len()
    );
    drop(silent);
    Ok(())
}
