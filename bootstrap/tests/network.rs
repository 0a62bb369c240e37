//! Real swarms on loopback: discovery, blob transfer, hostile peers, seed recovery.

use std::collections::HashSet;
use std::time::Duration;

use anyhow::{Context, bail, ensure};
use pcp_bootstrap::testnet::{TestNet, TestNode};
use pcp_bootstrap::{BlobStore, Config, Event, PeerId};
use pcp_protocol::{Binding, BlobHash, Identity, RunId, seal};
use pcp_schema::{Heartbeat, Message};
use rand::{RngCore, SeedableRng, rngs::StdRng};
use tokio::time::{Instant, timeout};

fn quiet(_: &mut Config) {}

fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// Waits until every node's routing table holds every other node.
async fn all_discovered(net: &TestNet, within: Duration) -> anyhow::Result<Duration> {
    let start = Instant::now();
    let all: HashSet<PeerId> = net.nodes.iter().map(TestNode::peer_id).collect();
    loop {
        let mut missing = 0;
        for n in &net.nodes {
            let known: HashSet<PeerId> = n.node.routing_peers().await?.into_iter().collect();
            missing += all.iter().filter(|p| **p != n.peer_id() && !known.contains(p)).count();
        }
        if missing == 0 {
            return Ok(start.elapsed());
        }
        if start.elapsed() > within {
            bail!("{missing} routing entries still missing after {within:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A seed and `n` nodes that have all found each other.
async fn discovered_net(dir: &std::path::Path, n: usize) -> anyhow::Result<TestNet> {
    let mut net = TestNet::new(dir, quiet).await?;
    for _ in 0..n {
        net.add().await?;
    }
    all_discovered(&net, Duration::from_secs(10)).await?;
    Ok(net)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_nodes_find_each_other_within_10s() -> anyhow::Result<()> {
    init_tracing();
    let dir = tempfile::tempdir()?;
    let mut net = TestNet::new(dir.path(), quiet).await?;
    for _ in 0..20 {
        net.add().await?;
    }
    let took = all_discovered(&net, Duration::from_secs(10)).await?;
    eprintln!("21 nodes discovered each other in {took:?}");
    net.shutdown().await;
    Ok(())
}

fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut data = vec![0u8; len];
    StdRng::seed_from_u64(seed).fill_bytes(&mut data);
    data
}

async fn put(node: &TestNode, data: &[u8]) -> anyhow::Result<BlobHash> {
    let hash = BlobStore::open(&node.data_dir)?.put_bytes(data)?;
    node.node.provide(hash).await?;
    Ok(hash)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_mb_blob_from_several_providers_survives_the_origin_leaving() -> anyhow::Result<()> {
    init_tracing();
    let dir = tempfile::tempdir()?;
    let mut net = discovered_net(dir.path(), 4).await?;
    let data = random_bytes(50_000_000, 7);
    let (a, b, c, d) = (1, 2, 3, 4);
    let hash = put(&net.nodes[a], &data).await?;
    let t = Duration::from_secs(120);

    let rb = net.nodes[b].node.fetch(hash, t).await?;
    assert_eq!(rb.providers, 1, "only A had it");
    assert_eq!(std::fs::read(&rb.path)?, data);
    net.nodes[b].node.provide(hash).await?;

    let rc = net.nodes[c].node.fetch(hash, t).await?;
    assert_eq!(rc.bytes, 50_000_000);
    assert!(rc.providers >= 2, "A and B both had it, used {}", rc.providers);
    assert_eq!(std::fs::read(&rc.path)?, data);
    net.nodes[c].node.provide(hash).await?;

    net.remove(a).await; // node indices shift: d is now 3
    let rd = net.nodes[d - 1].node.fetch(hash, t).await?;
    assert!(rd.providers >= 1);
    assert_eq!(std::fs::read(&rd.path)?, data);
    net.shutdown().await;
    Ok(())
}

/// TCP only, where node 1 offers noise alone: TLS-preferring nodes fall back to noise
/// with it in both directions, and TLS nodes use TLS between themselves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_falls_back_to_noise_for_a_peer_without_tls() -> anyhow::Result<()> {
    init_tracing();
    let dir = tempfile::tempdir()?;
    let mut net = TestNet::new(dir.path(), |c: &mut Config| {
        c.listen = vec!["/ip4/127.0.0.1/tcp/0".parse().expect("valid literal multiaddr")];
        c.tcp_tls = !c.data_dir.ends_with("node-1");
    })
    .await?;
    let (noise_only, tls) = (net.add().await?, net.add().await?);
    all_discovered(&net, Duration::from_secs(10)).await?;
    let data = random_bytes(3_000_000, 11);
    let from_tls = put(&net.nodes[tls], &data).await?;
    let got = net.nodes[noise_only].node.fetch(from_tls, Duration::from_secs(30)).await?;
    assert_eq!(std::fs::read(&got.path)?, data);
    let data = random_bytes(3_000_000, 12);
    let from_noise = put(&net.nodes[noise_only], &data).await?;
    let got = net.nodes[tls].node.fetch(from_noise, Duration::from_secs(30)).await?;
    assert_eq!(std::fs::read(&got.path)?, data);
    net.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tampered_chunks_are_rejected_and_their_sender_banned() -> anyhow::Result<()> {
    init_tracing();
    let dir = tempfile::tempdir()?;
    // a small window spreads the chunks over both providers
    let mut net = TestNet::new(dir.path(), |c| c.chunk_window = 2).await?;
    for _ in 0..3 {
        net.add().await?;
    }
    all_discovered(&net, Duration::from_secs(10)).await?;
    let data = random_bytes(8 << 20, 9);
    let hash = put(&net.nodes[1], &data).await?;
    // node 2 stores the same blob, then its disk is corrupted: it serves bad chunks
    let evil = &net.nodes[2];
    let evil_store = BlobStore::open(&evil.data_dir)?;
    assert_eq!(evil_store.put_bytes(&data)?, hash);
    let flipped: Vec<u8> = data.iter().map(|b| !b).collect();
    std::fs::write(evil_store.path(&hash), flipped)?;
    evil.node.provide(hash).await?;
    let evil_peer = evil.peer_id();

    let c = &mut net.nodes[3];
    let report = c.node.fetch(hash, Duration::from_secs(60)).await?;
    assert_eq!(std::fs::read(&report.path)?, data, "only verified chunks were kept");
    assert_eq!(report.providers, 1);
    let stats = c.node.stats().await?;
    assert_eq!(stats.peers_banned, 1, "{stats:?}");
    assert!(stats.chunks_rejected >= 1);
    let mut rejected = false;
    while let Ok(e) = c.events.try_recv() {
        if let Event::MessageRejected { peer, reason } = e {
            assert_eq!(peer, evil_peer);
            assert!(reason.contains("failed verification"), "{reason}");
            rejected = true;
        }
    }
    assert!(rejected, "no message_rejected event for the tampering peer");
    ensure!(!c.node.connected_peers().await?.contains(&evil_peer), "banned peer still connected");
    net.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interrupted_download_resumes_from_the_chunks_on_disk() -> anyhow::Result<()> {
    init_tracing();
    let dir = tempfile::tempdir()?;
    let net = discovered_net(dir.path(), 2).await?;
    let data = random_bytes(10 << 20, 11);
    let hash = put(&net.nodes[1], &data).await?;
    let outboard = BlobStore::open(&net.nodes[1].data_dir)?.outboard(&hash)?.context("outboard of a stored blob")?;

    // a previous run of node 2 verified and wrote chunks 0..6 before it was interrupted
    let store = BlobStore::open(&net.nodes[2].data_dir)?;
    let mut partial = store.partial(hash, outboard)?;
    for (i, chunk) in (0..6).zip(data.chunks(pcp_schema::CHUNK_SIZE)) {
        partial.write_chunk(i, chunk)?;
    }
    drop(partial);

    let report = net.nodes[2].node.fetch(hash, Duration::from_secs(60)).await?;
    assert_eq!(report.chunks_fetched, 4, "only the missing chunks travel");
    assert_eq!(std::fs::read(&report.path)?, data);
    net.shutdown().await;
    Ok(())
}

fn identity(seed: u64) -> Identity {
    let mut secret = [0u8; 32];
    StdRng::seed_from_u64(seed).fill_bytes(&mut secret);
    Identity::from_secret(secret)
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// Publishes until gossipsub has a peer for the topic.
async fn publish(node: &TestNode, run: RunId, data: Vec<u8>) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        match node.node.publish(run, data.clone()).await {
            Ok(()) => return Ok(()),
            Err(e) if Instant::now() < deadline => {
                tracing::debug!("publish: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_gossip_is_rejected_and_counted() -> anyhow::Result<()> {
    init_tracing();
    let dir = tempfile::tempdir()?;
    let mut net = TestNet::new(dir.path(), quiet).await?;
    net.add().await?;
    net.add().await?;
    let run = RunId([42; 32]);
    net.nodes[1].node.subscribe(run).await?;
    net.nodes[2].node.subscribe(run).await?;
    let sender = net.nodes[1].peer_id();

    let alice = identity(1);
    let mallory = identity(2);
    let hb = Heartbeat { free_memory_bytes: 1, ..Heartbeat::new(run.0, 1, now_ms()) };
    let bind = |nonce| Binding { run, round: 1, nonce, unix_ms: now_ms() };
    // signed by mallory but claiming alice as signer
    let mut impostor = seal(&mallory, bind(1), &hb);
    impostor.header.signer = alice.public().0;
    // alice's signature over a different payload
    let mut forged = seal(&alice, bind(2), &hb);
    forged.payload = Heartbeat { round: 2, ..hb.clone() }.encode();
    let good = seal(&alice, bind(3), &hb);

    publish(&net.nodes[1], run, impostor.encode()).await?;
    publish(&net.nodes[1], run, forged.encode()).await?;
    publish(&net.nodes[1], run, good.encode()).await?;

    let receiver = &mut net.nodes[2];
    let mut rejected = 0;
    let mut accepted = 0;
    let deadline = Duration::from_secs(15);
    timeout(deadline, async {
        while rejected < 2 || accepted < 1 {
            match receiver.events.recv().await {
                Some(Event::MessageRejected { peer, reason }) => {
                    assert_eq!(peer, sender);
                    assert!(reason.contains("signature does not verify"), "{reason}");
                    rejected += 1;
                }
                Some(Event::Gossip { message, .. }) => {
                    assert_eq!(message.signer(), alice.public());
                    assert_eq!(message.decode::<Heartbeat>().ok(), Some(hb.clone()));
                    accepted += 1;
                }
                Some(_) => {}
                None => break,
            }
        }
    })
    .await
    .context("waiting for gossip verdicts")?;
    assert_eq!((rejected, accepted), (2, 1));
    assert_eq!(receiver.node.stats().await?.messages_rejected, 2);
    net.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_recovers_when_its_only_seed_restarts() -> anyhow::Result<()> {
    init_tracing();
    let dir = tempfile::tempdir()?;
    let mut net = discovered_net(dir.path(), 1).await?;
    let seed = net.nodes.remove(0);
    let (seed_dir, seed_addrs, seed_peer) = (seed.data_dir.clone(), seed.addrs.clone(), seed.peer_id());
    seed.stop().await;
    let node = &mut net.nodes[0];
    timeout(Duration::from_secs(10), async {
        while node.node.connected_peers().await.is_ok_and(|p| p.contains(&seed_peer)) {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .context("seed connection never dropped")?;
    while node.events.try_recv().is_ok() {}

    // the seed comes back on the same addresses with the same key
    let mut config = Config::loopback(seed_dir);
    config.listen = seed_addrs
        .iter()
        .map(|a| {
            let mut a = a.clone();
            a.pop();
            a
        })
        .collect();
    // the old sockets may take a moment to be released
    let rebind_deadline = Instant::now() + Duration::from_secs(10);
    let seed = loop {
        match TestNode::start(0, config.clone()).await {
            Ok(seed) => break seed,
            Err(e) if Instant::now() < rebind_deadline => {
                tracing::debug!("restarting the seed: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => return Err(e.into()),
        }
    };
    timeout(Duration::from_secs(15), async {
        loop {
            match node.events.recv().await {
                Some(Event::PeerConnected { peer, .. }) if peer == seed_peer => break,
                Some(_) => {}
                None => bail!("event stream ended"),
            }
        }
        Ok(())
    })
    .await
    .context("node never reconnected to the restarted seed")??;
    seed.stop().await;
    net.shutdown().await;
    Ok(())
}

/// Waits for the next DiLoCo request or rejection at `node`.
async fn next_request(node: &mut TestNode) -> anyhow::Result<Event> {
    timeout(Duration::from_secs(15), async {
        loop {
            match node.events.recv().await {
                Some(e @ (Event::Request { .. } | Event::MessageRejected { .. })) => return Ok(e),
                Some(_) => {}
                None => bail!("the node stopped"),
            }
        }
    })
    .await
    .context("waiting for a request")?
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signed_requests_are_verified_both_ways() -> anyhow::Result<()> {
    init_tracing();
    let dir = tempfile::tempdir()?;
    let mut net = discovered_net(dir.path(), 2).await?;
    let client_key = pcp_bootstrap::load_or_create(&net.nodes[1].data_dir)?;
    let server_key = pcp_bootstrap::load_or_create(&net.nodes[2].data_dir)?;
    let (client, server_peer) = (net.nodes[1].node.clone(), net.nodes[2].peer_id());
    let mallory = identity(9);
    let run = RunId([7; 32]);
    let hb = Heartbeat::new(run.0, 1, now_ms());
    let bind = |nonce| Binding { run, round: 1, nonce, unix_ms: now_ms() };

    // a request signed by the sender reaches the server, and its signed answer comes back
    let good = seal(&client_key, bind(1), &hb);
    let asking = tokio::spawn({
        let (client, good) = (client.clone(), good.clone());
        async move { client.request(server_peer, good).await }
    });
    let Event::Request { peer, id, message, .. } = next_request(&mut net.nodes[2]).await? else {
        bail!("expected a request");
    };
    ensure!(peer == net.nodes[1].peer_id() && message.signer() == client_key.public());
    let answer = pcp_schema::Ack::accept(run.0, 1);
    net.nodes[2].node.respond(id, seal(&server_key, bind(2), &answer)).await?;
    let verified = asking.await??;
    ensure!(verified.signer() == server_key.public());
    ensure!(verified.decode::<pcp_schema::Ack>()? == answer);

    // signed by someone else than the sending peer, or replayed: refused and counted
    let impostor = seal(&mallory, bind(3), &hb);
    for (envelope, why) in [(impostor, "not by the sending peer"), (good, "already seen")] {
        let asking = tokio::spawn({
            let client = client.clone();
            async move { client.request(server_peer, envelope).await }
        });
        match next_request(&mut net.nodes[2]).await? {
            Event::MessageRejected { reason, .. } => ensure!(reason.contains(why), "{reason}"),
            other => bail!("expected a rejection ({why}), got {other:?}"),
        }
        ensure!(asking.await?.is_err(), "a refused request gets no answer");
    }
    ensure!(net.nodes[2].node.stats().await?.messages_rejected == 2);

    // an answer signed by someone else than the answering peer is refused
    let asking = tokio::spawn({
        let (client, envelope) = (client.clone(), seal(&client_key, bind(4), &hb));
        async move { client.request(server_peer, envelope).await }
    });
    let Event::Request { id, .. } = next_request(&mut net.nodes[2]).await? else { bail!("expected a request") };
    net.nodes[2].node.respond(id, seal(&mallory, bind(5), &answer)).await?;
    match asking.await? {
        Err(pcp_bootstrap::RequestError::Rejected { reason, .. }) => {
            ensure!(reason.contains("not by the sending peer"), "{reason}")
        }
        other => bail!("expected the answer to be rejected, got {other:?}"),
    }
    net.shutdown().await;
    Ok(())
}

/// The swarm tells admission of every connection: a worker connected to the seed is
/// admitted up to the cap of its address, and the cap counts loopback when told to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_identities_are_capped_per_address_of_their_connection() -> anyhow::Result<()> {
    init_tracing();
    let dir = tempfile::tempdir()?;
    let net = discovered_net(dir.path(), 2).await?;
    let admission = net.nodes[0].node.admission();
    let run = RunId([5; 32]);
    admission.serve(run, 10);
    let key = |i: usize| pcp_bootstrap::key_of(&net.nodes[i].peer_id()).context("an ed25519 peer id");
    let (first, second) = (key(1)?, key(2)?);
    let stranger = identity(9).public();
    ensure!(matches!(admission.admit_worker(run, stranger, 1), Err(pcp_bootstrap::AdmitError::NotConnected { .. })));
    // loopback is exempt by default
    admission.admit_worker(run, first, 1)?;
    admission.admit_worker(run, second, 1)?;
    admission.forget(run, first);
    admission.forget(run, second);

    admission.count_loopback(true);
    admission.admit_worker(run, first, 1)?;
    let refused = admission.admit_worker(run, second, 1).err().map(|e| e.to_string()).unwrap_or_default();
    ensure!(refused.contains("127.0.0.1 already has 1 worker identities"), "{refused}");
    ensure!(!admission.is_known(run, second));
    admission.forget(run, first);
    admission.admit_worker(run, second, 1)?;
    net.shutdown().await;
    Ok(())
}

/// A contribution is read only from a participant of the open round of a run the node
/// serves, and only up to the run's size; anything else is refused after its signed head, reported once
/// per peer with a count, and the sender's request fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contributions_are_read_only_from_participants_of_the_open_round() -> anyhow::Result<()> {
    init_tracing();
    let dir = tempfile::tempdir()?;
    let mut net = discovered_net(dir.path(), 2).await?;
    let client_key = pcp_bootstrap::load_or_create(&net.nodes[1].data_dir)?;
    let (client, server_peer) = (net.nodes[1].node.clone(), net.nodes[2].peer_id());
    let run = RunId([5; 32]);
    let contribution = |len: usize| pcp_schema::Contribution {
        run: run.0,
        round: 1,
        inner_steps: 1,
        samples: 1,
        pseudo_gradient: pcp_schema::ParameterRef { name: "delta".into(), shard: 0, blob: [0; 32], size: len as u64 },
        loss: 1.0,
        delta: vec![7; len],
        bytes_down: 0,
        term: 0,
        params_hash: [0; 32],
        train_ms: 0,
        wall_ms: 0,
        sent_unix_ms: 0,
        slice_hashes: Vec::new(),
    };
    let mut nonce = 0;
    let mut send = |len: usize| {
        nonce += 1;
        let envelope = seal(&client_key, Binding { run, round: 1, nonce, unix_ms: now_ms() }, &contribution(len));
        let client = client.clone();
        tokio::spawn(async move { client.request(server_peer, envelope).await })
    };

    // the server serves no run: refused before the payload is read
    let asking = send(100_000);
    match next_request(&mut net.nodes[2]).await? {
        Event::MessageRejected { reason, .. } => ensure!(reason.contains("does not serve"), "{reason}"),
        other => bail!("expected a rejection, got {other:?}"),
    }
    ensure!(asking.await?.is_err(), "a refused contribution gets no answer");

    // served, and a participant of the open round: read up to the run's size, and not beyond
    let server = net.nodes[2].node.clone();
    server.admission().serve(run, 200_000);
    server.admission().open_round(run, 1, &[client_key.public()]);
    let asking = send(100_000);
    let Event::Request { message, .. } = next_request(&mut net.nodes[2]).await? else { bail!("expected a request") };
    ensure!(message.decode::<pcp_schema::Contribution>()?.delta.len() == 100_000);
    drop(asking);
    let asking = send(300_000);
    match next_request(&mut net.nodes[2]).await? {
        Event::MessageRejected { reason, .. } => ensure!(reason.contains("exceeds its limit of 200000"), "{reason}"),
        other => bail!("expected a rejection, got {other:?}"),
    }
    ensure!(asking.await?.is_err());
    ensure!(server.stats().await?.messages_rejected == 2);
    net.shutdown().await;
    Ok(())
}

/// Replayed heads: a participant's contribution, captured and sent by another peer,
/// is refused after its head and takes none of the participant's permits for the round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_head_takes_none_of_its_signers_permits() -> anyhow::Result<()> {
    init_tracing();
    let dir = tempfile::tempdir()?;
    let mut net = discovered_net(dir.path(), 3).await?;
    let worker_key = pcp_bootstrap::load_or_create(&net.nodes[1].data_dir)?;
    let (worker, thief, server_peer) = (net.nodes[1].node.clone(), net.nodes[3].node.clone(), net.nodes[2].peer_id());
    let run = RunId([6; 32]);
    let server = net.nodes[2].node.clone();
    server.admission().serve(run, 200_000);
    server.admission().open_round(run, 1, &[worker_key.public()]);
    let contribution = pcp_schema::Contribution {
        run: run.0,
        round: 1,
        inner_steps: 1,
        samples: 1,
        pseudo_gradient: pcp_schema::ParameterRef { name: "delta".into(), shard: 0, blob: [0; 32], size: 100_000 },
        loss: 1.0,
        delta: vec![7; 100_000],
        bytes_down: 0,
        term: 0,
        params_hash: [0; 32],
        train_ms: 0,
        wall_ms: 0,
        sent_unix_ms: 0,
        slice_hashes: Vec::new(),
    };
    let sealed = |nonce| seal(&worker_key, Binding { run, round: 1, nonce, unix_ms: now_ms() }, &contribution);
    let send = |from: &pcp_bootstrap::Node, envelope| {
        let from = from.clone();
        tokio::spawn(async move { from.request(server_peer, envelope).await })
    };

    // the participant's own contributions, captured: the thief sends them first, again
    // and again, before the participant does
    let (first, retry) = (sealed(1), sealed(2));
    for captured in [&first, &retry, &first, &retry] {
        ensure!(send(&thief, captured.clone()).await?.is_err(), "a replayed head gets no answer");
    }
    match next_request(&mut net.nodes[2]).await? {
        Event::MessageRejected { peer, reason } => {
            ensure!(peer == net.nodes[3].peer_id(), "the refusal is the sender's, not the signer's: {peer}");
            ensure!(reason.contains("not by the sending peer"), "{reason}");
        }
        other => bail!("expected the replays to be refused, got {other:?}"),
    }

    // the participant still has both its permits for the round: its contribution and a retry
    for (envelope, nonce) in [(first, 1), (retry, 2)] {
        let asking = send(&worker, envelope);
        let Event::Request { peer, id, message, .. } = next_request(&mut net.nodes[2]).await? else {
            bail!("expected the participant's contribution {nonce} to be read");
        };
        ensure!(peer == net.nodes[1].peer_id() && message.binding().nonce == nonce);
        let ack = pcp_schema::Ack::accept(run.0, 1);
        let server_key = pcp_bootstrap::load_or_create(&net.nodes[2].data_dir)?;
        server.respond(id, seal(&server_key, Binding { run, round: 1, nonce, unix_ms: now_ms() }, &ack)).await?;
        ensure!(asking.await?.is_ok(), "the participant gets its answer");
    }
    // and no third
    ensure!(send(&worker, sealed(3)).await?.is_err(), "a third contribution in one round is refused");
    net.shutdown().await;
    Ok(())
}

/// Waits until `node`'s routing table holds `peer`.
async fn routes_to(node: &TestNode, peer: PeerId, within: Duration) -> anyhow::Result<Duration> {
    let start = Instant::now();
    while !node.node.routing_peers().await?.contains(&peer) {
        ensure!(start.elapsed() < within, "{} has no route to {peer} after {within:?}", node.peer_id());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(start.elapsed())
}

/// A node that serves the DHT from the start, as a run's coordinator candidate does,
/// is known to a node that joins through the same seed right after it (before any
/// AutoNAT verdict on it), and that node reaches it once the seed is gone: the leader
/// that introduced a run's workers and candidates may die first thing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_candidate_is_reached_through_the_dht_after_the_seed_that_introduced_it_dies() -> anyhow::Result<()> {
    init_tracing();
    let dir = tempfile::tempdir()?;
    let mut net = TestNet::new(dir.path(), quiet).await?;
    let mut config = Config::loopback(dir.path().join("candidate"));
    config.bootstrap = net.seed_addrs();
    config.dht_server = true;
    let mut candidate = TestNode::start(1, config).await?;
    // about 50 ms here; a node waiting for AutoNAT to confirm its address (its first
    // probe comes after about 5 s) is routed to only then
    routes_to(&net.nodes[0], candidate.peer_id(), Duration::from_secs(2)).await?;
    let joined = net.add().await?;
    let known_after = routes_to(&net.nodes[joined], candidate.peer_id(), Duration::from_secs(2)).await?;
    tracing::info!("the new node routes to the candidate {known_after:?} after joining");

    net.nodes.remove(0).stop().await;
    let worker = &net.nodes[0];
    let key = pcp_bootstrap::load_or_create(&worker.data_dir)?;
    let candidate_key = pcp_bootstrap::load_or_create(&candidate.data_dir)?;
    let run = RunId([3; 32]);
    let hb = Heartbeat::new(run.0, 1, now_ms());
    let bind = |nonce| Binding { run, round: 1, nonce, unix_ms: now_ms() };
    let asking = tokio::spawn({
        let (client, to, envelope) = (worker.node.clone(), candidate.peer_id(), seal(&key, bind(1), &hb));
        async move { client.request(to, envelope).await }
    });
    let Event::Request { id, .. } = next_request(&mut candidate).await? else { bail!("expected a request") };
    let answer = pcp_schema::Ack::accept(run.0, 1);
    candidate.node.respond(id, seal(&candidate_key, bind(2), &answer)).await?;
    ensure!(asking.await??.decode::<pcp_schema::Ack>()? == answer);
    candidate.stop().await;
    net.shutdown().await;
    Ok(())
}
