//! Releasing blobs on real swarms: deleted at once when nobody reads them, deferred
//! while a transfer does (kept when stored or fetched again meanwhile), and never
//! under a fetch in progress.

use std::collections::HashSet;
use std::time::Duration;

use anyhow::{Context, bail};
use pcp_bootstrap::testnet::{TestNet, TestNode};
use pcp_bootstrap::{BlobStore, Config, PeerId, Released};
use pcp_protocol::BlobHash;
use rand::{RngCore, SeedableRng, rngs::StdRng};
use tokio::time::Instant;

/// How long a served or fetched blob counts as in transfer in these tests.
const LINGER: Duration = Duration::from_secs(3);

fn linger(c: &mut Config) {
    c.transfer_linger = LINGER;
}

fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut data = vec![0u8; len];
    StdRng::seed_from_u64(seed).fill_bytes(&mut data);
    data
}

/// A seed and `n` nodes that have all found each other.
async fn net(dir: &std::path::Path, n: usize, tweak: fn(&mut Config)) -> anyhow::Result<TestNet> {
    let mut net = TestNet::new(dir, tweak).await?;
    for _ in 0..n {
        net.add().await?;
    }
    let all: HashSet<PeerId> = net.nodes.iter().map(TestNode::peer_id).collect();
    let start = Instant::now();
    loop {
        let mut missing = 0;
        for node in &net.nodes {
            let known: HashSet<PeerId> = node.node.routing_peers().await?.into_iter().collect();
            missing += all.iter().filter(|p| **p != node.peer_id() && !known.contains(p)).count();
        }
        if missing == 0 {
            return Ok(net);
        }
        if start.elapsed() > Duration::from_secs(10) {
            bail!("{missing} routing entries still missing after 10 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn put(node: &TestNode, data: &[u8]) -> anyhow::Result<BlobHash> {
    let hash = BlobStore::open(&node.data_dir)?.put_bytes(data)?;
    node.node.provide(hash).await?;
    Ok(hash)
}

fn has(node: &TestNode, hash: &BlobHash) -> anyhow::Result<bool> {
    Ok(BlobStore::open(&node.data_dir)?.contains(hash))
}

/// Waits until `node` no longer holds `hash`; how long it took.
async fn gone(node: &TestNode, hash: &BlobHash, within: Duration) -> anyhow::Result<Duration> {
    let start = Instant::now();
    while has(node, hash)? {
        if start.elapsed() > within {
            bail!("blob {hash} still in the store after {within:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(start.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn released_blobs_go_at_once_unless_a_transfer_reads_them() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let net = net(dir.path(), 2, linger).await?;
    let (a, b) = (&net.nodes[1], &net.nodes[2]);
    let (x, y, w) = (random_bytes(3 << 20, 1), random_bytes(1 << 20, 2), random_bytes(1 << 20, 3));
    let (hx, hy, hw) = (put(a, &x).await?, put(a, &y).await?, put(a, &w).await?);

    // nobody reads Y: it goes at once; a blob that is not there is counted as absent
    let released = a.node.release(vec![hy, BlobHash::of(b"never stored")]).await?;
    assert_eq!(released, Released { removed: 1, absent: 1, bytes: (1 << 20) + 8 + 32, ..Released::default() });
    assert!(!has(a, &hy)?);

    // B just fetched X from A: both releases wait for the transfer to be over
    let fetched = b.node.fetch_from(hx, vec![a.peer_id()], Duration::from_secs(30)).await?;
    assert_eq!(std::fs::read(&fetched.path)?, x);
    let released = a.node.release(vec![hx]).await?;
    assert_eq!((released.removed, released.deferred, released.bytes), (0, 1, 3 << 20), "served just now");
    let released = b.node.release(vec![hx]).await?;
    assert_eq!((released.removed, released.deferred), (0, 1), "fetched just now");
    assert!(has(a, &hx)? && has(b, &hx)?, "deferred blobs are still there");

    // W is released while in transfer, then stored again: the new copy stays; so
    // does V, which A's owner fetches (from A's own store) after releasing it
    let v = random_bytes(1 << 20, 5);
    let hv = put(a, &v).await?;
    for h in [hw, hv] {
        b.node.fetch_from(h, vec![a.peer_id()], Duration::from_secs(30)).await?;
        assert_eq!(a.node.release(vec![h]).await?.deferred, 1);
    }
    put(a, &w).await?;
    assert_eq!(a.node.fetch(hv, Duration::from_secs(5)).await?.providers, 0, "V was still here");

    let took = gone(a, &hx, LINGER + Duration::from_secs(5)).await?;
    gone(b, &hx, LINGER + Duration::from_secs(5)).await?;
    assert!(took >= LINGER / 2, "X went after {took:?}, before its transfer lingered out");
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(has(a, &hw)?, "a blob stored again after its release is kept");
    assert!(has(a, &hv)?, "a blob fetched again after its release is kept");
    let stats = a.node.stats().await?;
    assert_eq!(stats.blobs_removed, 2, "{stats:?}");
    assert!(stats.bytes_removed > (4 << 20), "{stats:?}");
    net.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blob_released_mid_transfer_is_served_to_the_end() -> anyhow::Result<()> {
    fn slow(c: &mut Config) {
        c.transfer_linger = LINGER;
        c.chunk_window = 1; // one chunk at a time: the release lands mid-transfer
    }
    let dir = tempfile::tempdir()?;
    let net = net(dir.path(), 2, slow).await?;
    let (a, b) = (&net.nodes[1], &net.nodes[2]);
    let data = random_bytes(24 << 20, 4);
    let hash = put(a, &data).await?;
    let fetcher = b.node.clone();
    let from = a.peer_id();
    let fetch = tokio::spawn(async move { fetcher.fetch_from(hash, vec![from], Duration::from_secs(60)).await });
    let start = Instant::now();
    while a.node.stats().await?.chunks_served == 0 {
        if start.elapsed() > Duration::from_secs(20) {
            bail!("A served no chunk within 20 s");
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let released = a.node.release(vec![hash]).await?;
    assert_eq!((released.removed, released.deferred), (0, 1), "a peer is fetching it");
    let report = fetch.await.context("the fetch task")??;
    assert_eq!(std::fs::read(&report.path)?, data, "the fetch finished from the released blob");
    assert!(a.node.stats().await?.chunks_served >= 24, "every chunk came from A");
    gone(a, &hash, LINGER + Duration::from_secs(5)).await?;
    assert!(has(b, &hash)?, "the fetcher keeps its copy");
    net.shutdown().await;
    Ok(())
}
