//! Compute backends and the IREE HAL drivers behind them.

use std::fmt;
use std::str::FromStr;

/// A compute backend a node can offer, as typed on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Device {
    /// The host CPU, through IREE's multi-threaded `local-task` driver.
    Cpu,
    /// NVIDIA GPUs through IREE's `cuda` driver.
    Cuda,
    /// AMD GPUs through IREE's `hip` driver.
    Rocm,
    /// Any Vulkan GPU through IREE's `vulkan` driver.
    Vulkan,
    /// Apple GPUs through IREE's `metal` driver.
    Metal,
}

impl Device {
    /// Every backend, in display order.
    pub const ALL: [Device; 5] = [Device::Cpu, Device::Cuda, Device::Rocm, Device::Vulkan, Device::Metal];

    /// The name used on the command line and in messages (`cpu`, `rocm`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
            Device::Rocm => "rocm",
            Device::Vulkan => "vulkan",
            Device::Metal => "metal",
        }
    }

    /// The IREE HAL driver that runs this backend.
    pub fn driver(self) -> &'static str {
        match self {
            Device::Cpu => "local-task",
            Device::Cuda => "cuda",
            Device::Rocm => "hip",
            Device::Vulkan => "vulkan",
            Device::Metal => "metal",
        }
    }

    /// Whether this build of the runtime contains the backend's driver.
    ///
    /// A compiled-in driver can still fail to find hardware at load time.
    pub fn is_available(self) -> bool {
        match self {
            Device::Cpu => true,
            Device::Cuda => cfg!(feature = "cuda"),
            // eerie-sys always builds the IREE runtime without the HIP driver.
            Device::Rocm => false,
            Device::Vulkan => cfg!(feature = "vulkan"),
            // eerie-sys enables Metal on Apple silicon only.
            Device::Metal => cfg!(all(target_os = "macos", target_arch = "aarch64")),
        }
    }
}

/// The backends whose drivers are compiled into this build, `cpu` first.
pub fn available_devices() -> Vec<Device> {
    Device::ALL.into_iter().filter(|device| device.is_available()).collect()
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A backend name that is not one of `cpu|cuda|rocm|vulkan|metal`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown backend `{0}` (expected one of cpu, cuda, rocm, vulkan, metal)")]
pub struct ParseDeviceError(String);

impl FromStr for Device {
    type Err = ParseDeviceError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "cpu" | "local-task" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda),
            "rocm" | "hip" => Ok(Device::Rocm),
            "vulkan" => Ok(Device::Vulkan),
            "metal" => Ok(Device::Metal),
            _ => Err(ParseDeviceError(s.to_owned())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_display_round_trip() {
        for device in Device::ALL {
            assert_eq!(device.to_string().parse::<Device>(), Ok(device));
        }
        assert_eq!("HIP".parse::<Device>(), Ok(Device::Rocm));
        assert_eq!(" cpu ".parse::<Device>(), Ok(Device::Cpu));
    }

    #[test]
    fn unknown_backend_is_named() {
        let err = "tpu".parse::<Device>().unwrap_err();
        assert_eq!(err.to_string(), "unknown backend `tpu` (expected one of cpu, cuda, rocm, vulkan, metal)");
    }

    #[test]
    fn cpu_is_always_available_and_rocm_never() {
        let devices = available_devices();
        assert_eq!(devices.first(), Some(&Device::Cpu));
        assert!(!devices.contains(&Device::Rocm));
        assert_eq!(devices.contains(&Device::Cuda), cfg!(feature = "cuda"));
    }
}
