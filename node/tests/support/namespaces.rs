//! Network namespaces for the test labs (`netns.rs`, one flat LAN; `nat.rs`, home
//! routers): making and deleting them, running `ip` and friends with one-line
//! errors, and binding a socket inside one.

use std::net::{Ipv4Addr, UdpSocket};
use std::path::Path;
use std::process::Command;

/// The namespaces a lab created so far: deleted, the last made first, when
/// dropped (also after a failed build). Kills nothing: stop the processes first.
#[derive(Debug, Default)]
pub(crate) struct Namespaces {
    made: Vec<String>,
}

impl Namespaces {
    /// Creates namespace `name` (replacing one that a test process which died with
    /// this pid left behind: nothing else uses the name); the error says why not.
    pub(crate) fn add(&mut self, name: &str) -> Result<(), String> {
        let _ = ip(&["netns", "del", name]);
        ip(&["netns", "add", name]).map_err(|e| {
            // SAFETY: geteuid has no preconditions and cannot fail.
            let euid = unsafe { libc::geteuid() };
            let why = if euid == 0 { String::new() } else { format!("not root (euid {euid}); ") };
            format!("{why}cannot create network namespaces (needs CAP_SYS_ADMIN): {e}")
        })?;
        self.made.push(name.to_owned());
        Ok(())
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        // the last made first: a lab's switch or internet, made first, goes last and
        // takes the veth ends still in it
        for name in self.made.iter().rev() {
            if let Err(e) = ip(&["netns", "del", name]) {
                eprintln!("deleting network namespace {name}: {e}");
            }
        }
    }
}

/// Runs `ip ARGS`; the error is the command and what it printed, on one line.
pub(crate) fn ip(args: &[&str]) -> Result<(), String> {
    let mut all = vec!["ip"];
    all.extend_from_slice(args);
    run(&all)
}

/// Runs a command; the error is the command and what it printed, on one line.
pub(crate) fn run(args: &[&str]) -> Result<(), String> {
    let short = || args.join(" ").split_whitespace().collect::<Vec<_>>().join(" ");
    let out = Command::new(args[0]).args(&args[1..]).output().map_err(|e| format!("`{}`: {e}", short()))?;
    if out.status.success() {
        return Ok(());
    }
    let said = String::from_utf8_lossy(&out.stderr);
    Err(format!("`{}` failed ({}): {}", short(), out.status, said.split_whitespace().collect::<Vec<_>>().join(" ")))
}

/// Deletes the namespaces of labs whose test process died without dropping them:
/// `<tag>NN<pid>-…` where no process `pid` runs.
pub(crate) fn remove_stale(tag: &str) {
    let Ok(dir) = std::fs::read_dir("/run/netns") else { return };
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(tag) else { continue };
        let Some((head, _)) = rest.split_once('-') else { continue };
        if head.len() < 3 || !head.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let pid = &head[2..];
        if !Path::new("/proc").join(pid).exists() {
            let _ = ip(&["netns", "del", &name]);
        }
    }
}

/// A UDP socket bound at `addr` in namespace `ns`, on an ephemeral port, made by a
/// thread that enters it: sockets keep their namespace, so the test's own threads
/// can probe the lab's links with it.
pub(crate) fn udp_in(ns: &str, addr: Ipv4Addr) -> UdpSocket {
    use std::os::fd::AsRawFd;
    let path = Path::new("/run/netns").join(ns);
    std::thread::spawn(move || {
        let ns = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        // SAFETY: a valid namespace fd; setns changes only this thread's network
        // namespace, and the thread ends after binding.
        let entered = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(entered, 0, "entering {}: {}", path.display(), std::io::Error::last_os_error());
        UdpSocket::bind((addr, 0)).unwrap_or_else(|e| panic!("binding {addr} in its namespace: {e}"))
    })
    .join()
    .expect("the namespace thread")
}
