//! NAT traversal between real swarms on loopback: a reservation on a relay, a blob
//! fetched through the relay, a relayed connection turned into a direct one by hole
//! punching (DCUtR), a circuit the relay cuts at its byte limit, and a relay whose
//! public address is declared (`NatConfig::external_addresses`).
//!
//! Loopback has no NAT: every hole punch works, and nothing but the tests' own dials
//! makes a connection relayed. `node/tests/nat_cli.rs` runs the same behind real NATs.

use std::time::Duration;

use anyhow::{Context, bail, ensure};
use pcp_bootstrap::multiaddr::Protocol;
use pcp_bootstrap::testnet::TestNode;
use pcp_bootstrap::{BlobStore, Config, Event, Multiaddr, RelayLimits, RelayService};
use rand::{RngCore, SeedableRng, rngs::StdRng};
use tokio::time::Instant;

fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// Waits for an event of `node` that `pred` picks, draining the others.
async fn wait_event<T>(
    node: &mut TestNode,
    what: &str,
    within: Duration,
    mut pred: impl FnMut(&Event) -> Option<T>,
) -> anyhow::Result<T> {
    let deadline = Instant::now() + within;
    loop {
        let event = tokio::time::timeout_at(deadline, node.events.recv())
            .await
            .with_context(|| format!("no {what} within {within:?}"))?
            .context("the node stopped")?;
        if let Some(found) = pred(&event) {
            return Ok(found);
        }
    }
}

/// A relay on loopback and a node holding a reservation on it; returns both and the
/// node's relayed address (ending in `/p2p/<node>`), once the reservation is accepted.
async fn relay_and_reserved(
    dir: &std::path::Path,
    limits: RelayLimits,
    hole_punching: bool,
) -> anyhow::Result<(TestNode, TestNode, Multiaddr, Option<u64>)> {
    let mut config = Config::loopback(dir.join("relay"));
    config.nat.relay_limits = limits;
    let relay = TestNode::start(0, config).await?;
    let relay_addr = relay.addrs.iter().find(|a| a.to_string().contains("/quic-v1")).context("quic")?.clone();

    let mut config = Config::loopback(dir.join("b"));
    config.bootstrap = vec![relay_addr.clone()];
    config.nat.relays = vec![relay_addr.clone()];
    config.nat.hole_punching = hole_punching;
    let mut b = TestNode::start(1, config).await?;
    // the relay serves once a peer has dialled it back; B retries until then
    let (addr, limit) = wait_event(&mut b, "a reservation", Duration::from_secs(60), |e| match e {
        Event::RelayReserved { addr, limit_bytes, .. } => Some((addr.clone(), *limit_bytes)),
        _ => None,
    })
    .await?;
    ensure!(addr.iter().any(|p| p == Protocol::P2pCircuit), "{addr} is not a relayed address");
    let addr = addr.with(Protocol::P2p(b.peer_id()));
    Ok((relay, b, addr, limit))
}

/// A node with no seed that reaches `target` only through its relayed address.
async fn dialer(dir: &std::path::Path, hole_punching: bool, target: &Multiaddr) -> anyhow::Result<TestNode> {
    let mut config = Config::loopback(dir.join("a"));
    config.nat.hole_punching = hole_punching;
    let mut a = TestNode::start(2, config).await?;
    a.node.dial(target.clone()).await?;
    let relayed = wait_event(&mut a, "a relayed connection", Duration::from_secs(20), |e| match e {
        Event::RelayedConnection { addr, inbound: false, relay, .. } => Some((addr.clone(), *relay)),
        _ => None,
    })
    .await?;
    ensure!(relayed.1.is_some(), "the relayed address names its relay: {}", relayed.0);
    Ok(a)
}

fn put(node: &TestNode, len: usize) -> anyhow::Result<pcp_protocol::BlobHash> {
    let mut data = vec![0u8; len];
    StdRng::seed_from_u64(len as u64).fill_bytes(&mut data);
    Ok(BlobStore::open(&node.data_dir)?.put_bytes(&data)?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blob_is_fetched_through_a_relay_within_its_documented_limits() -> anyhow::Result<()> {
    init_tracing();
    let dir = tempfile::tempdir()?;
    let (mut relay, b, b_relayed, limit) = relay_and_reserved(dir.path(), RelayLimits::default(), false).await?;
    assert_eq!(limit, Some(256 << 20), "the reservation carries the default circuit limit");
    let hash = put(&b, 3 << 20)?;
    let a = dialer(dir.path(), false, &b_relayed).await?;
    let report = a.node.fetch_from(hash, vec![b.peer_id()], Duration::from_secs(60)).await?;
    assert_eq!(report.chunks_fetched, 3);
    assert_eq!(report.chunks_relayed, 3, "no hole punching: every chunk came through the relay");
    let opened = wait_event(&mut relay, "a circuit", Duration::from_secs(5), |e| match e {
        Event::Relayed(RelayService::Circuit { src, dst, state: "opened", .. }) => Some((*src, *dst)),
        _ => None,
    })
    .await?;
    assert_eq!(opened, (a.peer_id(), b.peer_id()));
    for n in [a, b, relay] {
        n.stop().await;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hole_punch_replaces_the_relayed_connection_before_the_blob_moves() -> anyhow::Result<()> {
    init_tracing();
    let dir = tempfile::tempdir()?;
    let (relay, b, b_relayed, _) = relay_and_reserved(dir.path(), RelayLimits::default(), true).await?;
    let hash = put(&b, 4 << 20)?;
    let mut a = dialer(dir.path(), true, &b_relayed).await?;
    let fetch = a.node.clone();
    let b_peer = b.peer_id();
    let fetched = tokio::spawn(async move { fetch.fetch_from(hash, vec![b_peer], Duration::from_secs(60)).await });
    let punched = wait_event(&mut a, "a hole punch", Duration::from_secs(30), |e| match e {
        Event::HolePunched { result, .. } => Some(result.clone()),
        _ => None,
    })
    .await?;
    let direct = match punched {
        Ok(addr) => addr,
        Err(e) => bail!("the hole punch failed on loopback: {e}"),
    };
    assert!(!direct.iter().any(|p| p == Protocol::P2pCircuit), "{direct} is direct");
    let report = fetched.await??;
    assert_eq!(report.chunks_fetched, 4);
    assert_eq!(report.chunks_relayed, 0, "the chunks waited for the direct connection");
    let status = a.node.net_status().await?;
    assert_eq!((status.direct_peers >= 1, status.relayed_peers), (true, 0), "{status:?}");
    for n in [a, b, relay] {
        n.stop().await;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_cuts_a_circuit_at_its_byte_limit() -> anyhow::Result<()> {
    init_tracing();
    let dir = tempfile::tempdir()?;
    let limits = RelayLimits { max_circuit_bytes: 256 << 10, ..RelayLimits::default() };
    let (mut relay, b, b_relayed, limit) = relay_and_reserved(dir.path(), limits, false).await?;
    assert_eq!(limit, Some(256 << 10));
    let hash = put(&b, 2 << 20)?;
    let a = dialer(dir.path(), false, &b_relayed).await?;
    let fetch = a.node.clone();
    let b_peer = b.peer_id();
    // a 1 MiB chunk cannot cross a 256 KiB circuit
    let fetched = tokio::spawn(async move { fetch.fetch_from(hash, vec![b_peer], Duration::from_secs(30)).await });
    let reason = wait_event(&mut relay, "the circuit to close", Duration::from_secs(30), |e| match e {
        Event::Relayed(RelayService::Circuit { state: "closed", reason, .. }) => Some(reason.clone()),
        _ => None,
    })
    .await?;
    let reason = reason.context("closed without a reason")?;
    assert!(reason.contains("Max circuit bytes"), "{reason}");
    // what came through the relay fits its limit: no whole chunk
    if let Ok(Ok(report)) = fetched.await {
        assert_eq!(report.chunks_relayed, 0, "{report:?}");
    }
    for n in [a, b, relay] {
        n.stop().await;
    }
    Ok(())
}

/// A relay whose address is declared takes it as confirmed at once: it says it is
/// public at that address, and the reservation it grants carries it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declared_external_address_is_confirmed_and_given_in_reservations() -> anyhow::Result<()> {
    init_tracing();
    let dir = tempfile::tempdir()?;
    let port = std::net::UdpSocket::bind("127.0.0.1:0")?.local_addr()?.port();
    let quic: Multiaddr = format!("/ip4/127.0.0.1/udp/{port}/quic-v1").parse()?;
    let mut config = Config::loopback(dir.path().join("relay"));
    config.listen = vec![quic.clone()];
    config.nat.external_addresses = vec![quic.clone()];
    let mut relay = TestNode::start(0, config).await?;
    let public = wait_event(&mut relay, "reachability", Duration::from_secs(5), |e| match e {
        Event::Reachability(r) => Some(r.clone()),
        _ => None,
    })
    .await?;
    assert_eq!(public, pcp_bootstrap::Reachability::Public(quic.clone()));
    assert_eq!(relay.node.net_status().await?.external, vec![quic.clone()]);
    assert_eq!(relay.node.external_addrs().await?, vec![quic.clone()]);

    let relay_addr = quic.clone().with(Protocol::P2p(relay.peer_id()));
    let mut config = Config::loopback(dir.path().join("b"));
    config.bootstrap = vec![relay_addr.clone()];
    config.nat.relays = vec![relay_addr.clone()];
    let mut b = TestNode::start(1, config).await?;
    // (a listener opened before the connection to the relay is up closes at once, and
    // is opened again: losses that do not say the relay lacks an address)
    let mut lost = Vec::new();
    let addr = wait_event(&mut b, "a reservation", Duration::from_secs(20), |e| match e {
        Event::RelayReserved { addr, .. } => Some(addr.clone()),
        Event::RelayLost { reason, .. } => {
            lost.push(reason.clone());
            None
        }
        _ => None,
    })
    .await?;
    assert!(!lost.iter().any(|r| r.contains("public address")), "the reservation carried the address: {lost:?}");
    assert!(addr.to_string().starts_with(&relay_addr.to_string()), "{addr}");
    for n in [b, relay] {
        n.stop().await;
    }
    Ok(())
}
