//! `pcp-node devices`: the backends in this build and the devices each sees.

use std::io::Write as _;

use pcp_runtime::Device;

use crate::Failure;
use crate::commands::join::Usage;

/// Prints one block per backend: its IREE driver, whether it is in this build, and
/// the devices its vendor library sees (name, architecture, memory), or why none.
/// `--target` is what a worker on that backend compiles for when none is given.
pub(crate) fn run() -> Result<(), Failure> {
    let mut out = std::io::stdout().lock();
    for device in Device::ALL {
        write!(out, "{:<7} (IREE driver {}): ", device.name(), device.driver())?;
        match device.check() {
            Ok(found) => {
                let default = match (device, found.first().and_then(|d| d.arch.clone())) {
                    (Device::Cpu, _) => "host".to_owned(),
                    (_, Some(arch)) => arch,
                    (_, None) => "none (IREE's portable baseline)".to_owned(),
                };
                writeln!(out, "{} device{}, default --target {default}", found.len(), plural(found.len()))?;
                for info in found {
                    writeln!(out, "  {info}")?;
                }
            }
            Err(reason) => writeln!(out, "none: {}", strip_backend(&reason.to_string(), device))?,
        }
    }
    Ok(())
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

/// `backend rocm: X` → `X` (the line already starts with the backend).
fn strip_backend(reason: &str, device: Device) -> String {
    reason.strip_prefix(&format!("backend {}: ", device.name())).unwrap_or(reason).to_owned()
}

/// `--backend` and `--target` as a node runs them: the backend's driver must be in
/// this build and, for a GPU, its vendor library must load and see a device
/// (`backend rocm: libamdhip64.so not found (install ROCm 6.x)`). cuda and rocm
/// without `--target` compile for the first device's architecture. The target
/// name is checked against the backend's accepted names.
/// Every error is a [`Usage`] error (exit code 2).
pub(crate) fn resolve(backend: &str, target: Option<&str>) -> anyhow::Result<(Device, pcp_graph::Target)> {
    crate::training::device::resolve(backend, target).map_err(|e| Usage(e.to_string()).into())
}
