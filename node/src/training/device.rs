//! Which device and compile target a node trains on: `--backend` and `--target`,
//! checked against what this build and machine have.

use pcp_runtime::Device;

/// The device for `backend` and the compile target: `target` when given, else for
/// CUDA and ROCm the first device's architecture. The target name is checked against
/// the backend's accepted names; every error names the backend or target.
pub(crate) fn resolve(backend: &str, target: Option<&str>) -> anyhow::Result<(Device, pcp_graph::Target)> {
    let device: Device = backend.parse()?;
    let kind: pcp_graph::Backend = backend.parse()?;
    if device != Device::Cpu {
        device.check()?;
    } else if !device.is_available() {
        anyhow::bail!("backend cpu is not available in this build");
    }
    let detected = match (target, device) {
        (Some(t), _) if !t.trim().is_empty() => None,
        (_, Device::Cuda | Device::Rocm) => {
            let arch = pcp_runtime::detect_arch(device)?;
            tracing::info!("backend {device}: detected --target {arch}");
            Some(arch)
        }
        _ => None,
    };
    let target = pcp_graph::Target::parse(kind, detected.as_deref().or(target))?;
    Ok((device, target))
}

/// Where a node runs an engine: the device and the compile target `--backend`
/// and `--target` name ([`resolve`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Placement {
    pub(crate) device: Device,
    pub(crate) target: pcp_graph::Target,
}

impl Placement {
    /// The host CPU.
    pub(crate) fn cpu() -> Self {
        Self { device: Device::Cpu, target: pcp_graph::Target::host() }
    }

    /// `--backend` and `--target`, checked ([`resolve`]).
    pub(crate) fn resolve(backend: &str, target: Option<&str>) -> anyhow::Result<Self> {
        let (device, target) = resolve(backend, target)?;
        Ok(Self { device, target })
    }
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.target.fmt(f)
    }
}
