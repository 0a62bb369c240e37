//! `pcp-node bench blob`: blob transfer between two in-process nodes on loopback, next to
//! raw TCP loopback throughput measured in the same run.

use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Args, ValueEnum};
use pcp_bootstrap::testnet::TestNet;
use pcp_bootstrap::{BlobStore, Config, Multiaddr};
use rand::RngCore;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Blob transfer throughput vs raw TCP loopback.
#[derive(Debug, Args)]
pub(crate) struct BlobArgs {
    /// Blob size in MB (10^6 bytes).
    #[arg(long, default_value_t = 200)]
    size_mb: u64,
    /// Transports to measure (`all`: QUIC, TCP with TLS, TCP with noise).
    #[arg(long, value_enum, default_value_t = Transport::All)]
    transport: Transport,
    /// Chunk requests in flight per provider.
    #[arg(long, default_value_t = Config::new(std::path::PathBuf::new()).chunk_window)]
    chunk_window: usize,
    /// Rounds of measurements: each round measures raw TCP and then every transport once,
    /// and the report gives the median (and range) of each.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=100))]
    repeat: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Transport {
    /// QUIC (TLS 1.3 inside, ChaCha20-Poly1305).
    Quic,
    /// TCP as pcp nodes use it: TLS 1.3 (AES-GCM with AES instructions) and yamux.
    Tcp,
    /// TCP with noise (ChaCha20-Poly1305) and yamux, the fallback for other peers.
    TcpNoise,
    /// All three.
    #[value(alias = "both")]
    All,
}

impl Transport {
    fn label(self) -> &'static str {
        match self {
            Transport::Quic => "QUIC",
            Transport::Tcp => "TCP+TLS+yamux",
            Transport::TcpNoise | Transport::All => "TCP+noise+yamux",
        }
    }
}

const MB: f64 = 1e6;

/// Plain TCP over loopback; with `sink`, the receiver also writes what it reads to a file.
/// MB/s, and CPU seconds per GB.
async fn raw_tcp(data: &[u8], sink: Option<&std::path::Path>) -> anyhow::Result<(f64, f64)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let len = data.len();
    let mut file = match sink {
        Some(p) => Some(std::fs::File::create(p)?),
        None => None,
    };
    let server = async move {
        let (mut s, _) = listener.accept().await?;
        let mut buf = vec![0u8; 1 << 20];
        let mut got = 0;
        while got < len {
            let n = s.read(&mut buf).await?;
            anyhow::ensure!(n > 0, "raw tcp: stream ended early");
            if let Some(f) = file.as_mut() {
                std::io::Write::write_all(f, &buf[..n])?;
            }
            got += n;
        }
        s.write_all(&[1]).await?;
        anyhow::Ok(())
    };
    let client = async move {
        let mut c = tokio::net::TcpStream::connect(addr).await?;
        c.set_nodelay(true)?;
        let start = Instant::now();
        for chunk in data.chunks(1 << 20) {
            c.write_all(chunk).await?;
        }
        let mut ack = [0u8; 1];
        c.read_exact(&mut ack).await?;
        anyhow::Ok(start.elapsed())
    };
    let cpu = cpu_seconds();
    let (s, elapsed) = tokio::join!(server, client);
    let cpu = cpu_seconds() - cpu;
    s?;
    Ok((len as f64 / MB / elapsed?.as_secs_f64(), cpu / (len as f64 / 1e9)))
}

/// CPU time this process has used so far (every thread, user and system), in seconds.
fn cpu_seconds() -> f64 {
    // SAFETY: getrusage only writes the struct it is given.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
        return f64::NAN;
    }
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    secs(usage.ru_utime) + secs(usage.ru_stime)
}

/// One fetch: MB/s, and CPU seconds per GB (both nodes together).
async fn pcp_blob(data: &[u8], transport: Transport, window: usize) -> anyhow::Result<(f64, f64)> {
    let dir = tempfile::tempdir()?;
    let listen: Multiaddr = if transport == Transport::Quic {
        "/ip4/127.0.0.1/udp/0/quic-v1".parse()?
    } else {
        "/ip4/127.0.0.1/tcp/0".parse()?
    };
    let tcp_tls = transport == Transport::Tcp;
    let mut net = TestNet::new(dir.path(), move |c: &mut Config| {
        c.listen = vec![listen.clone()];
        c.chunk_window = window;
        c.tcp_tls = tcp_tls;
    })
    .await?;
    let a = net.add().await?;
    let hash = BlobStore::open(&net.nodes[0].data_dir)?.put_bytes(data)?;
    net.nodes[0].node.provide(hash).await?;
    let cpu = cpu_seconds();
    let report = net.nodes[a].node.fetch(hash, Duration::from_secs(600)).await?;
    let cpu = cpu_seconds() - cpu;
    anyhow::ensure!(report.bytes == data.len() as u64, "fetched size differs");
    net.shutdown().await;
    Ok((data.len() as f64 / MB / report.seconds, cpu / (data.len() as f64 / 1e9)))
}

/// The median of `xs` (not empty).
fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 }
}

/// `median (min–max)` of `xs` (not empty).
fn spread(xs: &[f64]) -> String {
    let min = xs.iter().copied().fold(f64::INFINITY, f64::min);
    let max = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{:8.1} MB/s ({min:.0}–{max:.0})", median(xs))
}

/// Runs a benchmark.
pub(crate) async fn run(args: &BlobArgs) -> anyhow::Result<()> {
    let BlobArgs { size_mb, transport, chunk_window, repeat } = *args;
    let mut data = vec![0u8; usize::try_from(size_mb * 1_000_000).context("size")?];
    rand::thread_rng().fill_bytes(&mut data);
    let transports: Vec<Transport> = [Transport::Quic, Transport::Tcp, Transport::TcpNoise]
        .into_iter()
        .filter(|t| transport == Transport::All || transport == *t)
        .collect();
    println!("blob of {size_mb} MB between two nodes on loopback, median of {repeat} rounds (min–max)");
    let dir = tempfile::tempdir()?;
    let (to_disk, _) = raw_tcp(&data, Some(&dir.path().join("sink"))).await?;
    drop(dir);
    let mut raw = Vec::new();
    let mut raw_cpu = Vec::new();
    let mut fetched = vec![Vec::new(); transports.len()];
    let mut cpu = vec![Vec::new(); transports.len()];
    for round in 1..=repeat {
        let (mbps, cpu_per_gb) = raw_tcp(&data, None).await?;
        raw.push(mbps);
        raw_cpu.push(cpu_per_gb);
        for ((t, results), cpu) in transports.iter().zip(&mut fetched).zip(&mut cpu) {
            let (mbps, cpu_per_gb) = pcp_blob(&data, *t, chunk_window).await?;
            results.push(mbps);
            cpu.push(cpu_per_gb);
        }
        let line: Vec<String> = transports
            .iter()
            .zip(&fetched)
            .filter_map(|(t, r)| Some(format!("{} {:.0}", t.label(), r.last()?)))
            .collect();
        tracing::info!("round {round}: raw TCP {:.0}, {} MB/s", raw.last().copied().unwrap_or(0.0), line.join(", "));
    }
    let tcp = median(&raw);
    println!("raw TCP loopback:                   {}, {:.2} CPU-s per GB", spread(&raw), median(&raw_cpu));
    println!("raw TCP loopback, written to disk:  {to_disk:8.1} MB/s (one round, reference)");
    for ((t, results), cpu) in transports.iter().zip(&fetched).zip(&cpu) {
        let name = t.label();
        let mbps = median(results);
        println!(
            "pcp blob fetch ({name:>15}):   {} = {:.0}% of raw TCP (verified, written to disk), \
             {:.2} CPU-s per GB",
            spread(results),
            100.0 * mbps / tcp,
            median(cpu)
        );
    }
    Ok(())
}
