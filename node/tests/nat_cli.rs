//! Volunteers behind home routers (issue 24): `pcp-node` processes in a NAT lab of
//! network namespaces (`support/nat.rs`): a public "internet" with a seed (and, for
//! DiLoCo, a shepherd), and home routers that masquerade their LANs, one of them
//! symmetric. Root only: elsewhere the tests print why and pass, unless
//! `PCP_REQUIRE_NETNS=1` (as `scripts/test.sh` sets).
//!
//! - Two workers behind two endpoint-independent NATs: a 50 MB blob crosses on a
//!   hole-punched direct connection, not through the relay.
//! - Behind the symmetric NAT the punch fails and the same blob comes through the
//!   relay, within the relay's per-circuit byte limit.
//! - A shepherd behind a router, reachable only through its relay address, runs three
//!   workers (one public, one behind a router, one behind the symmetric NAT) through
//!   five rounds.
//! - A candidate behind a router takes over when the public shepherd is killed, and
//!   the workers (behind routers) follow it.
//! - Issue 39: ONE public node, a cloud VM behind a 1:1 NAT, and two home routers
//!   with stateful firewalls. With `--external-address` it relays, and the two home
//!   nodes hole punch and move a 50 MB blob directly; without, every node concerned
//!   says, in one line naming the flag, why no relay address comes.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

#[path = "support/namespaces.rs"]
mod namespaces;
#[path = "support/nat.rs"]
mod nat;

use nat::{Filter, Host, Mapping, NatLab};

#[path = "support/common.rs"]
mod common;
use common::corpus;

/// Starting a node: joining, and for DiLoCo fetching the model, compiling (cached)
/// and loading it.
const SETUP: Duration = Duration::from_secs(180);
/// A few rounds of τ=10 on two shared cores.
const ROUNDS: Duration = Duration::from_secs(300);
/// The blob: 50 MB of noise.
const BLOB: usize = 50_000_000;
/// The relay's default per-circuit byte limit (README, "Behind a home router").
const CIRCUIT_BYTES: u64 = 256 << 20;

/// The test's directory: data directories, events and logs; kept (and named on
/// stderr) when `PCP_KEEP_TEST_DIR=1`, to read after a failure.
fn workdir() -> tempfile::TempDir {
    let keep = std::env::var("PCP_KEEP_TEST_DIR").is_ok_and(|v| v == "1");
    let dir = tempfile::Builder::new().prefix("pcp-nat-").disable_cleanup(keep).tempdir().expect("tempdir");
    if keep {
        eprintln!("keeping {}", dir.path().display());
    }
    dir
}

/// One test at a time: they share two cores, and the punches' timing is theirs.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn pcp_node() -> PathBuf {
    std::env::var_os("PCP_NODE").map_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_pcp-node")), PathBuf::from)
}

/// A `pcp-node` process in the lab, killed (SIGKILL) when dropped; stdout and stderr
/// go to files beside its events, and their tails are printed when a test fails.
struct Proc {
    child: Child,
    name: String,
    log: PathBuf,
}

impl Proc {
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits for the process to exit; panics unless it succeeds within `timeout`.
    fn wait_success(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                assert!(status.success(), "{} exited with {status}", self.name);
                return;
            }
            assert!(Instant::now() < deadline, "{} did not exit within {timeout:?}", self.name);
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            for path in [self.log.with_extension("out"), self.log.clone()] {
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                let lines: Vec<&str> = text.lines().collect();
                let tail = lines[lines.len().saturating_sub(12)..].join("\n");
                eprintln!("--- the last lines of {} ({}):\n{tail}", self.name, path.display());
            }
        }
    }
}

/// A test's nodes in a lab: data directories, events and logs under `dir`.
struct Net<'a> {
    lab: &'a NatLab,
    dir: &'a Path,
}

impl Net<'_> {
    fn events(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.jsonl"))
    }

    fn data(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }

    /// `pcp-node ARGS` on `host`, with data directory, events and logs named `name`.
    fn start(&self, host: &Host, name: &str, args: &[&str]) -> Proc {
        let mut args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        if args.first().is_none_or(|a| a.starts_with('-')) {
            args.extend([
                "--data-dir".into(),
                self.data(name),
                "--events".into(),
                self.events(name).display().to_string(),
            ]);
        }
        let log = self.dir.join(format!("{name}.log"));
        let file = |path: &Path| std::fs::File::create(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let mut command = self.lab.cmd(host, pcp_node());
        let child = command
            .args(&args)
            .env("PCP_ARTIFACT_CACHE", std::env::temp_dir().join("pcp-test-artifact-cache").join("artifacts"))
            .env("RUST_LOG", "warn,pcp_bootstrap=info,pcp_node=info,libp2p_kad=error")
            .stdin(Stdio::null())
            .stdout(file(&log.with_extension("out")))
            .stderr(file(&log))
            .spawn()
            .unwrap_or_else(|e| panic!("{name} does not start: {e}"));
        Proc { child, name: name.to_owned(), log }
    }

    /// A seed on public host `host`, listening on QUIC and TCP port 4001; its address.
    fn seed(&self, host: &Host, name: &str, extra: &[&str]) -> (Proc, String) {
        let quic = format!("/ip4/{}/udp/4001/quic-v1", host.addr);
        let tcp = format!("/ip4/{}/tcp/4001", host.addr);
        let mut args = vec!["--no-train", "--listen", &quic, "--listen", &tcp];
        args.extend(extra);
        let proc = self.start(host, name, &args);
        let peer = self.peer(name);
        (proc, format!("{quic}/p2p/{peer}"))
    }

    /// The node's peer id, once it listens.
    fn peer(&self, name: &str) -> String {
        let e = wait_for(&self.events(name), &format!("{name} to listen"), SETUP, |e| e["event"] == "listening");
        e["peer"].as_str().expect("peer").to_owned()
    }

    /// Waits until `name` holds a relay reservation; returns the event.
    fn reserved(&self, name: &str) -> Value {
        wait_for(&self.events(name), &format!("{name}'s relay reservation"), Duration::from_secs(90), |e| {
            e["event"] == "relay_reserved"
        })
    }
}

/// BLOB bytes of seeded noise stored in `name`'s blob store (`pcp-node blob put`,
/// before the node starts); the bytes and their hash.
fn put_blob(net: &Net<'_>, dir: &Path, name: &str, seed: u64) -> (Vec<u8>, String) {
    let blob = dir.join("blob.bin");
    let mut data = vec![0u8; BLOB];
    rand::RngCore::fill_bytes(&mut <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(seed), &mut data);
    std::fs::File::create(&blob).and_then(|mut f| f.write_all(&data)).expect("the blob file");
    let put = Command::new(pcp_node())
        .args(["blob", "put", &blob.display().to_string(), "--data-dir", &net.data(name)])
        .output()
        .expect("blob put runs");
    assert!(put.status.success(), "blob put: {}", String::from_utf8_lossy(&put.stderr));
    (data, String::from_utf8_lossy(&put.stdout).trim().to_owned())
}

fn events(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path).unwrap_or_default().lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
}

fn find(path: &Path, name: &str) -> Vec<Value> {
    events(path).into_iter().filter(|e| e["event"] == name).collect()
}

/// Waits until an event of `path` satisfies `pred` and returns it.
fn wait_for(path: &Path, what: &str, timeout: Duration, pred: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(e) = events(path).into_iter().find(&pred) {
            return e;
        }
        if Instant::now() >= deadline {
            let all = events(path);
            let tail: Vec<String> = all[all.len().saturating_sub(30)..].iter().map(Value::to_string).collect();
            panic!(
                "timed out after {timeout:?} waiting for {what} in {}; its last events:\n{}",
                path.display(),
                tail.join("\n")
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Bytes the public hosts `hosts` moved (received plus sent) so far.
fn moved(lab: &NatLab, hosts: &[Host]) -> u64 {
    hosts.iter().map(|h| lab.bytes(h)).map(|(rx, tx)| rx + tx).sum()
}

/// The lab itself: routers NAT as home routers do. One LAN socket talking to two
/// public hosts shows them one public port behind the endpoint-independent NAT and
/// two behind the symmetric one; unsolicited packets are dropped; and two
/// endpoint-independent NATs let a simultaneous UDP exchange through (a hole punch).
#[test]
fn the_lab_maps_and_filters_like_home_routers() {
    let _one = serial();
    let Some(lab) = NatLab::for_test(
        2,
        &[(Mapping::EndpointIndependent, 1), (Mapping::EndpointIndependent, 1), (Mapping::Symmetric, 1)],
    ) else {
        return;
    };
    let (p1, p2) = (lab.udp(&lab.public(1)), lab.udp(&lab.public(2)));
    for s in [&p1, &p2] {
        s.set_read_timeout(Some(Duration::from_millis(500))).expect("timeout");
    }
    let seen_from = |host: &Host| {
        let s = lab.udp(host);
        s.set_read_timeout(Some(Duration::from_millis(500))).expect("timeout");
        let mut ports = Vec::new();
        for public in [&p1, &p2] {
            s.send_to(b"hello", public.local_addr().expect("addr")).expect("send");
            let mut buf = [0u8; 16];
            let (_, from) = public.recv_from(&mut buf).expect("the public host hears a LAN host");
            ports.push(from);
        }
        (s, ports)
    };
    let (a, a_seen) = seen_from(&lab.private(1, 1));
    assert_eq!(a_seen[0], a_seen[1], "endpoint-independent: one public address and port for both");
    assert_eq!(a_seen[0].ip(), std::net::IpAddr::V4(lab.router_wan(1)));
    let (_, c_seen) = seen_from(&lab.private(3, 1));
    assert_ne!(c_seen[0].port(), c_seen[1].port(), "symmetric: a port per destination");

    // an answer gets in; the same port from another socket does not
    p1.send_to(b"back", a_seen[0]).expect("send");
    let mut buf = [0u8; 16];
    a.set_read_timeout(Some(Duration::from_millis(500))).expect("timeout");
    assert!(a.recv_from(&mut buf).is_ok(), "the answer comes through");
    let stranger = lab.udp(&lab.public(1));
    stranger.send_to(b"spam", a_seen[0]).expect("send");
    assert!(a.recv_from(&mut buf).is_err(), "an unsolicited packet is dropped");

    // a hole punch between the two endpoint-independent NATs
    let (a, a_at) = seen_from(&lab.private(1, 1));
    let (b, b_at) = seen_from(&lab.private(2, 1));
    for s in [&a, &b] {
        s.set_read_timeout(Some(Duration::from_millis(200))).expect("timeout");
    }
    let mut got = (false, false);
    for _ in 0..10 {
        a.send_to(b"punch", b_at[0]).expect("send");
        b.send_to(b"punch", a_at[0]).expect("send");
        got.0 |= a.recv_from(&mut buf).is_ok();
        got.1 |= b.recv_from(&mut buf).is_ok();
    }
    assert_eq!(got, (true, true), "both sides of the punch hear each other");
}

/// 50 MB between two workers behind two home routers, then behind the symmetric one.
#[test]
fn a_blob_crosses_two_nats_hole_punched_and_a_symmetric_one_through_the_relay() {
    let _one = serial();
    let routers = [(Mapping::EndpointIndependent, 1), (Mapping::EndpointIndependent, 1), (Mapping::Symmetric, 1)];
    let Some(lab) = NatLab::for_test(2, &routers) else { return };
    let dir = workdir();
    let net = Net { lab: &lab, dir: dir.path() };
    let publics = [lab.public(1), lab.public(2)];
    let (_seed, seed) = net.seed(&publics[0], "seed", &[]);
    let _p2 = net.start(&publics[1], "p2", &["--no-train", "--bootstrap", &seed]);

    // worker B (router 2) serves the blob once a relay holds its reservation
    let (data, hash) = put_blob(&net, dir.path(), "b", 24);
    let _b = net.start(&lab.private(2, 1), "b", &["--no-train", "--bootstrap", &seed]);
    let b = net.peer("b");
    let reserved = net.reserved("b");
    assert_eq!(reserved["limit_bytes"].as_u64(), Some(CIRCUIT_BYTES), "{reserved}");
    let private =
        wait_for(&net.events("b"), "b to know it is private", SETUP, |e| e["event"] == "reachability_changed");
    assert_eq!(private["reachability"], "private", "{private}");

    // worker A (router 1): a direct, hole-punched connection carries every chunk
    let fetch = |name: &str, host: &Host| -> (Value, u64, f64) {
        let before = moved(&lab, &publics);
        let out = dir.path().join(format!("{name}.bin"));
        let started = Instant::now();
        let args = ["blob", "get", &hash, "-o", &out.display().to_string(), "--bootstrap", &seed, "--timeout", "240"];
        let mut args: Vec<&str> = args.to_vec();
        let (data_dir, events) = (net.data(name), net.events(name).display().to_string());
        args.extend(["--data-dir", &data_dir, "--events", &events]);
        let mut get = net.start(host, name, &args);
        get.wait_success(Duration::from_secs(300));
        let seconds = started.elapsed().as_secs_f64();
        assert!(std::fs::read(&out).expect("the fetched blob") == data, "{name} fetched the blob intact");
        let fetched = find(&net.events(name), "blob_fetched").pop().expect("a blob_fetched event");
        (fetched, moved(&lab, &publics) - before, seconds)
    };
    let (fetched, through_publics, seconds) = fetch("a", &lab.private(1, 1));
    eprintln!("A fetched 50 MB in {seconds:.1} s; the public hosts moved {} KiB meanwhile", through_publics >> 10);
    let a = net.events("a");
    let relayed = find(&a, "relayed_connection");
    assert!(relayed.iter().any(|e| e["peer"] == b.as_str()), "A first reached B through the relay: {relayed:?}");
    // Both sides dial at once; libp2p reports the punch on the side whose own dial became the
    // direct connection, which may be either (CI once saw only B's report).
    let a_id = net.peer("a");
    let punched_ok = |events: &[Value], peer: &str| events.iter().any(|e| e["peer"] == peer && e["result"] == "ok");
    let (by_a, by_b) = (find(&a, "hole_punched"), find(&net.events("b"), "hole_punched"));
    assert!(
        punched_ok(&by_a, &b) || punched_ok(&by_b, &a_id),
        "a hole punch between A and B: A reported {by_a:?}, B reported {by_b:?}"
    );
    assert_eq!(fetched["chunks"], 48, "{fetched}");
    assert_eq!(fetched["chunks_relayed"], 0, "no chunk came through the relay: {fetched}");
    assert!(through_publics < 8 << 20, "the relays carried {through_publics} bytes of a 50 MB fetch");

    // worker C (router 3, symmetric): the punch fails, the relay carries it all
    let (fetched, through_publics, seconds) = fetch("c", &lab.private(3, 1));
    eprintln!(
        "C fetched 50 MB in {seconds:.1} s through the relay; the public hosts moved {} MiB",
        through_publics >> 20
    );
    let c = net.events("c");
    assert!(find(&c, "relayed_connection").iter().any(|e| e["peer"] == b.as_str()), "C reached B through the relay");
    assert!(
        !find(&c, "hole_punched").iter().any(|e| e["peer"] == b.as_str() && e["result"] == "ok"),
        "no hole punch through a symmetric NAT"
    );
    assert_eq!(fetched["chunks_relayed"], 48, "every chunk through the relay: {fetched}");
    // the relay received and forwarded every byte: twice the blob went through its ports
    assert!(through_publics > 2 * BLOB as u64, "the relays moved only {through_publics} bytes");
    for relay in ["seed", "p2"] {
        let cut: Vec<Value> = find(&net.events(relay), "relay_circuit")
            .into_iter()
            .filter(|e| e["reason"].as_str().is_some_and(|r| r.contains("Max circuit bytes")))
            .collect();
        assert!(cut.is_empty(), "{relay} cut a circuit at its byte limit: {cut:?}");
    }

    // what `pcp-node status` tells the two volunteers
    let status = |name: &str, host: &Host| -> String {
        let mut cmd = lab.cmd(host, pcp_node());
        let out = cmd
            .args(["status", "--bootstrap", &seed, "--wait", "40", "--data-dir", &net.data(name)])
            .output()
            .expect("status runs");
        assert!(out.status.success(), "{name}: status: {}", String::from_utf8_lossy(&out.stderr));
        let said = String::from_utf8_lossy(&out.stdout).into_owned();
        eprintln!("pcp-node status of {name}:\n{said}");
        said
    };
    let a_status = status("a", &lab.private(1, 1));
    assert!(a_status.contains("reachability: private"), "{a_status}");
    assert!(a_status.contains("NAT: endpoint-independent"), "{a_status}");
    assert!(a_status.contains("relayed: /ip4/198.18.0."), "{a_status}");
    let c_status = status("c", &lab.private(3, 1));
    assert!(c_status.contains("NAT: symmetric"), "{c_status}");
}

/// Issue 39's network: ONE public node, a cloud VM (its interface holds 10.10.0.1; the
/// cloud's 1:1 NAT gives it 198.18.0.1), as the seed and only relay; two home routers
/// that filter statefully (policy drop, accept from the LAN and what is established
/// or related) and masquerade; B behind router 2 holds a 50 MB blob.
struct OnePublic<'a> {
    net: Net<'a>,
    _seed: Proc,
    _b: Proc,
    /// The seed's address, to bootstrap from.
    seed: String,
    /// The blob and its hash.
    data: Vec<u8>,
    hash: String,
}

impl<'a> OnePublic<'a> {
    /// Starts the seed (with `seed_args`) and B.
    fn start(lab: &'a NatLab, dir: &'a Path, seed_args: &[&str]) -> Self {
        let net = Net { lab, dir };
        let vm = lab.cloud_vm(1).unwrap_or_else(|e| panic!("{e}"));
        let (quic, tcp) = (format!("/ip4/{}/udp/4001/quic-v1", vm.addr), format!("/ip4/{}/tcp/4001", vm.addr));
        let mut args = vec!["--no-train", "--listen", &quic, "--listen", &tcp];
        args.extend(seed_args);
        let seed_proc = net.start(&vm, "seed", &args);
        let seed = format!("/ip4/{}/udp/4001/quic-v1/p2p/{}", lab.public(1).addr, net.peer("seed"));
        let (data, hash) = put_blob(&net, dir, "b", 39);
        let b = net.start(&lab.private(2, 1), "b", &["--no-train", "--bootstrap", &seed]);
        Self { net, _seed: seed_proc, _b: b, seed, data, hash }
    }

    /// A (router 1) runs `blob get` with a `timeout`; its `blob_fetched` event, or
    /// its stderr when it failed.
    fn fetch(&self, timeout: u64) -> Result<Value, String> {
        let out = self.net.dir.join("a.bin");
        let (data_dir, events_at) = (self.net.data("a"), self.net.events("a").display().to_string());
        let (out_at, timeout_s) = (out.display().to_string(), timeout.to_string());
        let mut args = vec!["blob", "get", &self.hash, "-o", &out_at, "--bootstrap", &self.seed];
        args.extend(["--timeout", &timeout_s, "--data-dir", &data_dir, "--events", &events_at]);
        let mut get = self.net.start(&self.net.lab.private(1, 1), "a", &args);
        let deadline = Instant::now() + Duration::from_secs(timeout + 30);
        let status = loop {
            if let Some(status) = get.child.try_wait().expect("wait") {
                break status;
            }
            assert!(Instant::now() < deadline, "blob get outlived its --timeout {timeout}");
            std::thread::sleep(Duration::from_millis(100));
        };
        if !status.success() {
            return Err(std::fs::read_to_string(self.net.dir.join("a.log")).unwrap_or_default());
        }
        assert!(std::fs::read(&out).expect("the fetched blob") == self.data, "A fetched the blob intact");
        Ok(find(&self.net.events("a"), "blob_fetched").pop().expect("a blob_fetched event"))
    }
}

/// The lab of [`OnePublic`].
fn one_public_lab() -> Option<NatLab> {
    let routers = [(Mapping::EndpointIndependent, 1), (Mapping::EndpointIndependent, 1)];
    NatLab::for_test_with(1, &routers, Filter::Stateful)
}

/// Issue 39: one public node is enough. Declared with `--external-address`, the
/// cloud VM's public address is confirmed at once: the relay answers B's reservation
/// with it, A reaches B through it, the two home nodes punch a hole through their
/// stateful firewalls, and the 50 MB blob crosses on the direct connection.
#[test]
fn one_public_node_with_external_address_relays_and_two_home_nodes_hole_punch() {
    let _one = serial();
    let Some(lab) = one_public_lab() else { return };
    let dir = workdir();
    let started = Instant::now();
    let public = lab.public(1).addr;
    let (quic, tcp) = (format!("/ip4/{public}/udp/4001/quic-v1"), format!("/ip4/{public}/tcp/4001"));
    let one = OnePublic::start(&lab, dir.path(), &["--external-address", &quic, "--external-address", &tcp]);
    let net = &one.net;
    let seed_events = net.events("seed");
    let public_at = wait_for(&seed_events, "the seed to take its declared address", SETUP, |e| {
        e["event"] == "reachability_changed" && e["reachability"] == "public"
    });
    assert_eq!(public_at["addr"], quic.as_str(), "{public_at}");
    let reserved = net.reserved("b");
    assert!(reserved["addr"].as_str().is_some_and(|a| a.starts_with(&quic)), "B's relay address: {reserved}");
    std::thread::sleep(Duration::from_secs(6)); // B announces its blob again (rescan every 5 s)

    let fetched = one.fetch(120).unwrap_or_else(|log| panic!("A's fetch failed:\n{log}"));
    let (a, b) = (net.events("a"), net.events("b"));
    let (a_id, b_id) = (net.peer("a"), net.peer("b"));
    let relayed = find(&a, "relayed_connection");
    assert!(relayed.iter().any(|e| e["peer"] == b_id.as_str()), "A first reached B through the relay: {relayed:?}");
    // libp2p reports the punch on the side whose own dial became the direct connection
    let ok = |events: &Path, peer: &str| -> Vec<Value> {
        find(events, "hole_punched").into_iter().filter(|e| e["peer"] == peer && e["result"] == "ok").collect()
    };
    let punches: Vec<Value> = ok(&a, &b_id).into_iter().chain(ok(&b, &a_id)).collect();
    let punched_at = punches.iter().filter_map(|e| e["t"].as_f64()).fold(f64::INFINITY, f64::min);
    assert!(punched_at.is_finite(), "a hole punch between A and B: {:?}", find(&a, "hole_punched"));
    assert_eq!(fetched["chunks"], 48, "{fetched}");
    assert_eq!(fetched["chunks_relayed"], 0, "no chunk came through the relay: {fetched}");
    let a_start = find(&a, "listening").first().and_then(|e| e["t"].as_f64()).expect("A listened");
    let relayed_at = relayed.iter().filter_map(|e| e["t"].as_f64()).fold(f64::INFINITY, f64::min);
    let seconds = fetched["seconds"].as_f64().expect("seconds");
    eprintln!(
        "one public node: hole punched {:.2} s after A started ({:.3} s after its relayed connection); \
         50 MB in {seconds:.2} s = {:.1} MB/s; test {:.1} s",
        punched_at - a_start,
        punched_at - relayed_at,
        BLOB as f64 / 1e6 / seconds,
        started.elapsed().as_secs_f64()
    );
}

/// The same network without `--external-address`: the cloud VM sees only its private
/// address and no peer dials it back, so its relay answers reservations with no
/// address. B says so in one line naming the flag (once in its log; in its
/// `relay_lost` events), as do the seed and `pcp-node status`, and A cannot fetch.
#[test]
fn one_public_node_without_external_address_names_the_flag() {
    let _one = serial();
    let Some(lab) = one_public_lab() else { return };
    let dir = workdir();
    let started = Instant::now();
    let one = OnePublic::start(&lab, dir.path(), &[]);
    let net = &one.net;
    let seed = net.peer("seed");
    let lost = wait_for(&net.events("b"), "B's reservation to fail", SETUP, |e| e["event"] == "relay_lost");
    let reason = lost["reason"].as_str().expect("reason");
    assert!(reason.contains(&seed) && reason.contains("--external-address"), "{lost}");
    assert!(find(&net.events("b"), "relay_reserved").is_empty(), "no relay took B's reservation");
    let failed = one.fetch(15).expect_err("no peer can reach B");
    assert!(failed.contains("0 providers known"), "{failed}");
    let lines = |name: &str| -> Vec<String> {
        let log = std::fs::read_to_string(net.dir.join(format!("{name}.log"))).expect("log");
        log.lines().filter(|l| l.contains("--external-address")).map(String::from).collect()
    };
    let (b_lines, seed_lines) = (lines("b"), lines("seed"));
    let losses = find(&net.events("b"), "relay_lost").len();
    eprintln!(
        "B lost {losses} reservations; it said:\n{}\nthe seed said:\n{}",
        b_lines.join("\n"),
        seed_lines.join("\n")
    );
    assert!(losses >= 2, "B tried again: {losses} relay_lost events");
    // once from the swarm, and once in the node's own words (as every relay loss)
    let warned: Vec<&String> = b_lines.iter().filter(|l| l.contains("WARN")).collect();
    assert_eq!(warned.len(), 1, "B warns once, however often the reservation fails: {b_lines:?}");
    assert!(b_lines.len() <= 2, "B says it once, however often the reservation fails: {b_lines:?}");
    assert!(warned[0].contains("has no confirmed public address"), "{b_lines:?}");
    assert_eq!(seed_lines.len(), 1, "the seed says it once: {seed_lines:?}");
    // and `pcp-node status` on a home machine says why it has no relay address
    let out = lab
        .cmd(&lab.private(1, 1), pcp_node())
        .args(["status", "--bootstrap", &one.seed, "--wait", "15", "--data-dir", &net.data("s")])
        .output()
        .expect("status runs");
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "status: {}", String::from_utf8_lossy(&out.stderr));
    eprintln!("pcp-node status:\n{said}");
    let line = said.lines().find(|l| l.starts_with("relayed: ")).unwrap_or_default();
    assert!(line.contains("no relay reservation") && line.contains("--external-address"), "{said}");
    eprintln!("test {:.1} s", started.elapsed().as_secs_f64());
}

/// `--shepherd` on the demo corpus: nanogpt-small, τ=10, `extra`.
fn shepherd_args<'a>(corpus: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["--shepherd", "--pow-bits", "0", "--model", "nanogpt-small", "--tau", "10", "--data", corpus];
    // the shepherd's own screen (open runs default to committees of 3)
    args.extend(["--screeners", "0"]);
    args.extend(extra);
    args
}

/// The rounds of `path` completed so far, by number.
fn completed_rounds(path: &Path) -> Vec<Value> {
    find(path, "round_completed")
}

/// Whether `name`'s events hold a successful hole punch with `peer`.
fn punched(net: &Net, name: &str, peer: &str) -> bool {
    find(&net.events(name), "hole_punched").iter().any(|e| e["peer"] == peer && e["result"] == "ok")
}

/// A shepherd behind a home router, reachable only at its relay address, runs three
/// workers through five rounds: one public (the shepherd's own hole punch reaches
/// it), one behind another home router (hole punched), one behind the symmetric NAT
/// (relayed throughout).
#[test]
fn a_shepherd_behind_a_nat_runs_three_workers_through_its_relay() {
    let _one = serial();
    let routers = [(Mapping::EndpointIndependent, 1), (Mapping::EndpointIndependent, 1), (Mapping::Symmetric, 1)];
    let Some(lab) = NatLab::for_test(2, &routers) else { return };
    let dir = workdir();
    let net = Net { lab: &lab, dir: dir.path() };
    let corpus = corpus();
    let (_seed, seed) = net.seed(&lab.public(1), "seed", &[]);
    let mut args = shepherd_args(&corpus, &["--rounds", "5", "--min-workers", "3", "--bootstrap", &seed]);
    args.extend(["--heartbeat-timeout-ms", "10000"]);
    let _shepherd = net.start(&lab.private(1, 1), "shepherd", &args);
    let shepherd = net.peer("shepherd");
    let reserved = net.reserved("shepherd");
    let relay_addr = reserved["addr"].as_str().expect("addr").to_owned();
    assert!(relay_addr.starts_with("/ip4/198.18.0.1/"), "the seed relays for the shepherd: {relay_addr}");
    let own: Vec<Value> = find(&net.events("shepherd"), "listening");
    assert!(
        own.iter()
            .all(|e| e["addr"].as_str().is_some_and(|a| !a.starts_with("/ip4/198.18.") || a.contains("/p2p-circuit"))),
        "the shepherd has no public address of its own: {own:?}"
    );
    let workers = [("w1", lab.public(2)), ("w2", lab.private(2, 1)), ("w3", lab.private(3, 1))];
    let _workers: Vec<Proc> =
        workers.iter().map(|(name, host)| net.start(host, name, &["--bootstrap", &seed])).collect();
    let ids: Vec<String> = workers.iter().map(|(name, _)| net.peer(name)).collect();

    wait_for(&net.events("shepherd"), "round 5 to complete", SETUP + ROUNDS, |e| {
        e["event"] == "round_completed" && e["round"] == 5
    });
    let rounds = completed_rounds(&net.events("shepherd"));
    assert_eq!(rounds.iter().map(|r| r["round"].as_u64().expect("round")).collect::<Vec<_>>(), [1, 2, 3, 4, 5]);
    for r in &rounds {
        assert_eq!(r["contributors"], 3, "every worker contributed to round {}: {r}", r["round"]);
    }
    let ev = net.events("shepherd");
    let private = find(&ev, "reachability_changed");
    assert!(private.iter().any(|e| e["reachability"] == "private"), "{private:?}");
    assert!(!private.iter().any(|e| e["reachability"] == "public"), "the shepherd was never reachable directly");
    // every worker first reached it through the relay
    for ((name, _), id) in workers.iter().zip(&ids) {
        let relayed = find(&net.events(name), "relayed_connection");
        assert!(
            relayed.iter().any(|e| e["peer"] == shepherd.as_str()),
            "{name} reached the shepherd through the relay"
        );
        eprintln!("{name}: punched {}", punched(&net, name, &shepherd) || punched(&net, "shepherd", id));
    }
    // the home router's worker got a direct connection; the symmetric one could not
    assert!(punched(&net, "w2", &shepherd) || punched(&net, "shepherd", &ids[1]), "w2 and the shepherd punched a hole");
    assert!(!punched(&net, "w3", &shepherd) && !punched(&net, "shepherd", &ids[2]), "no punch through a symmetric NAT");
}

/// A public shepherd names a candidate behind a home router; workers train, one
/// public, one behind another home router, one behind the symmetric NAT. The
/// shepherd is killed during round 3: the candidate leads from round 2's state, and
/// every worker follows it and contributes to its rounds.
#[test]
fn a_candidate_behind_a_nat_takes_over_and_the_workers_follow() {
    let _one = serial();
    let routers = [(Mapping::EndpointIndependent, 1), (Mapping::EndpointIndependent, 1), (Mapping::Symmetric, 1)];
    let Some(lab) = NatLab::for_test(3, &routers) else { return };
    let dir = workdir();
    let net = Net { lab: &lab, dir: dir.path() };
    let corpus = corpus();
    let (_seed, seed) = net.seed(&lab.public(1), "seed", &[]);
    let candidate_dir = net.data("candidate");
    std::fs::create_dir_all(&candidate_dir).expect("candidate dir");
    let mut args = shepherd_args(&corpus, &["--rounds", "7", "--min-workers", "3", "--bootstrap", &seed]);
    args.extend(["--lease-ms", "4000", "--heartbeat-timeout-ms", "5000", "--candidate", &candidate_dir]);
    let mut shepherd = net.start(&lab.public(2), "shepherd", &args);
    let run = wait_for(&net.events("shepherd"), "the run to start", SETUP, |e| e["event"] == "run_started")["run"]
        .as_str()
        .expect("run id")
        .to_owned();
    let _candidate = net.start(&lab.private(1, 1), "candidate", &["--candidate", "--run", &run, "--bootstrap", &seed]);
    let candidate = net.peer("candidate");
    net.reserved("candidate");
    wait_for(&net.events("candidate"), "the candidate to stand by", SETUP, |e| e["event"] == "standby");
    let workers = [("w1", lab.public(3)), ("w2", lab.private(2, 1)), ("w3", lab.private(3, 1))];
    let _workers: Vec<Proc> =
        workers.iter().map(|(name, host)| net.start(host, name, &["--bootstrap", &seed])).collect();
    let ids: Vec<String> = workers.iter().map(|(name, _)| net.peer(name)).collect();

    wait_for(&net.events("shepherd"), "round 3 to start", SETUP + ROUNDS, |e| {
        e["event"] == "round_started" && e["round"] == 3
    });
    wait_for(&net.events("candidate"), "round 2's state", ROUNDS, |e| {
        e["event"] == "state_replicated" && e["round"].as_u64().is_some_and(|r| r >= 2)
    });
    shepherd.kill();
    let killed = Instant::now();
    let elected =
        wait_for(&net.events("candidate"), "the candidate to lead", ROUNDS, |e| e["event"] == "shepherd_elected");
    eprintln!("the candidate leads {:.1} s after the kill: {elected}", killed.elapsed().as_secs_f64());
    assert_eq!(elected["peer"], candidate.as_str(), "{elected}");
    for (name, _) in &workers {
        let followed = wait_for(&net.events(name), &format!("{name} to follow the candidate"), ROUNDS, |e| {
            e["event"] == "leader_followed" && e["peer"] == candidate.as_str()
        });
        eprintln!("{name} follows the candidate: {followed}");
    }
    // every worker contributes to the candidate's rounds
    for ((name, _), id) in workers.iter().zip(&ids) {
        let sent = wait_for(&net.events("candidate"), &format!("{name} to contribute to the candidate"), ROUNDS, |e| {
            e["event"] == "contribution_received" && e["peer"] == id.as_str() && e["accepted"] == true
        });
        assert!(sent["round"].as_u64().is_some_and(|r| r > 2), "{name} trained the candidate's round: {sent}");
    }
    let relayed = find(&net.events("w3"), "relayed_connection");
    assert!(
        relayed.iter().any(|e| e["peer"] == candidate.as_str()),
        "the symmetric NAT's worker reaches the candidate through a relay: {relayed:?}"
    );
}
