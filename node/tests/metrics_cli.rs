//! `--metrics-addr`: Prometheus text served while a `pcp-node sim` runs.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[path = "support/common.rs"]
mod common;
use common::corpus;

fn free_port() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("local addr")
}

/// One HTTP/1.1 GET: the status code and the body.
fn get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(stream, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let status = response.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    let body = response.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default();
    Ok((status, body))
}

/// `name{labels} value` lines into a map (comments and `# EOF` skipped).
fn parse(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series.to_owned(), value.parse().ok()?))
        })
        .collect()
}

#[test]
fn a_sim_serves_its_metrics_while_it_runs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let addr = free_port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_pcp-node"))
        .args(["sim", "--nodes", "3", "--rounds", "3", "--tau", "10", "--data", &corpus()])
        .args(["--metrics-addr", &addr.to_string(), "--data-dir", dir.path().to_str().expect("utf8")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawns");
    let started = Instant::now();
    let mut seen = BTreeMap::new();
    while started.elapsed() < Duration::from_secs(300) {
        if let Ok((200, body)) = get(addr, "/metrics") {
            assert!(body.ends_with("# EOF\n"), "OpenMetrics text ends with # EOF: {body}");
            seen = parse(&body);
            if seen.get("pcp_rounds_completed_total").is_some_and(|v| *v >= 1.0) {
                break;
            }
        }
        if child.try_wait().expect("wait").is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let (status, _) = get(addr, "/").unwrap_or((0, String::new()));
    let _ = child.kill();
    let _ = child.wait();
    assert!(seen.get("pcp_rounds_completed_total").is_some_and(|v| *v >= 1.0), "{seen:?}");
    assert_eq!(seen.get("pcp_round_contributors"), Some(&2.0), "{seen:?}");
    for series in ["pcp_val_loss", "pcp_round_mean_loss", "pcp_round_bytes_in", "pcp_round_seconds"] {
        assert!(seen.get(series).is_some_and(|v| *v > 0.0), "{series} in {seen:?}");
    }
    assert!(seen.get("pcp_peers").is_some_and(|v| *v >= 2.0), "{seen:?}");
    assert_eq!(seen.get("pcp_workers"), Some(&2.0), "{seen:?}");
    assert!(seen.contains_key("pcp_messages_rejected_total"), "{seen:?}");
    assert_eq!(status, 404, "only /metrics is served");
}

#[test]
fn a_taken_metrics_port_is_a_one_line_error_and_offline_commands_refuse_the_flag() {
    let taken = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr").to_string();
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(env!("CARGO_BIN_EXE_pcp-node"))
        .args(["sim", "--nodes", "2", "--rounds", "1", "--metrics-addr", &addr])
        .args(["--data-dir", dir.path().to_str().expect("utf8")])
        .output()
        .expect("runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains(&format!("--metrics-addr {addr}")) && stderr.trim().lines().count() == 1, "{stderr}");

    let out = Command::new(env!("CARGO_BIN_EXE_pcp-node"))
        .args(["--metrics-addr", "127.0.0.1:9", "devices"])
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--metrics-addr is not an option of `pcp-node devices`"));
}
