//! Compute backends and the IREE HAL drivers behind them.

mod probe;

pub use probe::{DeviceInfo, ProbeError, detect_arch, library_override, probe, vendor_library};

use std::fmt;
use std::str::FromStr;
use std::sync::OnceLock;

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
    /// pcp's build turns on IREE's CUDA, HIP and Vulkan drivers
    /// (`runtime/cmake/gpu-drivers.cmake`); this asks IREE's driver registry
    /// rather than trusting that, once per process. A compiled-in driver can still
    /// find no hardware: see [`probe`].
    pub fn is_available(self) -> bool {
        match self {
            Device::Cpu => true,
            Device::Cuda | Device::Rocm | Device::Vulkan => {
                static REGISTERED: OnceLock<Vec<&'static str>> = OnceLock::new();
                REGISTERED.get_or_init(registered_gpu_drivers).contains(&self.driver())
            }
            // eerie-sys enables Metal on Apple silicon only.
            Device::Metal => cfg!(all(target_os = "macos", target_arch = "aarch64")),
        }
    }

    /// Checks that this backend can run here: its driver is in the build, its vendor
    /// library loads and sees a device. The error is one line naming what is missing
    /// (`backend rocm: libamdhip64.so not found (install ROCm 6.x)`).
    pub fn check(self) -> Result<Vec<DeviceInfo>, ProbeError> {
        if !self.is_available() {
            return Err(ProbeError::NotBuilt { device: self, available: available_names() });
        }
        probe(self)
    }
}

/// The GPU drivers IREE's registry holds in this binary. A driver that is not
/// registered fails with "no driver … registered"; any other failure (no
/// library, no device) means it is there.
fn registered_gpu_drivers() -> Vec<&'static str> {
    use eerie::runtime::{DeviceSpec, Driver, Runtime};
    [Device::Cuda, Device::Rocm, Device::Vulkan]
        .into_iter()
        .map(Device::driver)
        .filter(|driver| match Runtime::new(DeviceSpec::new(Driver::custom(*driver))) {
            Ok(_) => true,
            Err(error) => {
                let text = error.to_string();
                !(text.contains("no driver") && text.contains("registered"))
            }
        })
        .collect()
}

/// The names of [`available_devices`], comma-separated.
pub fn available_names() -> String {
    available_devices().into_iter().map(Device::name).collect::<Vec<_>>().join(", ")
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
    fn the_build_has_cpu_cuda_rocm_and_vulkan() {
        let devices = available_devices();
        assert_eq!(devices.first(), Some(&Device::Cpu));
        for gpu in [Device::Cuda, Device::Rocm, Device::Vulkan] {
            assert!(devices.contains(&gpu), "{gpu} driver missing from the build: {devices:?}");
        }
    }

    /// Without the vendor library (an override pointing nowhere, so this holds on a
    /// GPU machine too) the error names the library and what to install.
    #[test]
    fn a_missing_vendor_library_is_named() {
        // SAFETY: this test binary sets these variables before any probe reads them,
        // and no other test reads them.
        unsafe {
            std::env::set_var("PCP_HIP_LIBRARY", "/nonexistent/libamdhip64.so");
            std::env::set_var("PCP_CUDA_LIBRARY", "/nonexistent/libcuda.so.1");
        }
        let rocm = Device::Rocm.check().unwrap_err().to_string();
        assert_eq!(rocm, "backend rocm: /nonexistent/libamdhip64.so not found (install ROCm 6.x)");
        let cuda = detect_arch(Device::Cuda).unwrap_err().to_string();
        assert_eq!(cuda, "backend cuda: /nonexistent/libcuda.so.1 not found (install the NVIDIA driver)");
    }
}
