//! The IREE runtime for pcp: devices, VMFB sessions and device-resident state.
//!
//! A [`Session`] loads one compiled VMFB on one [`Device`]. eerie's runtime
//! handles are `!Send`, so each session owns them on a dedicated thread and
//! the [`Session`] value is a cheap, cloneable handle that talks to it over a
//! bounded channel.
//!
//! Tensors live on the device: [`Session::invoke`] takes [`Arg`]s (host
//! tensors to upload, or [`Buffer`]s returned by an earlier call) and returns
//! every output as a device-resident [`Buffer`]. Parameters and optimizer
//! state therefore stay on the device across steps; only what the caller asks
//! for with [`Session::download`] (a loss scalar, a checkpoint) crosses back to
//! the host. A [`Buffer`] frees its device memory when its last clone drops.
//! On the cpu device that memory is host memory from Rust's global allocator;
//! [`HostAllocator`] keeps a step's large blocks for the next step.
//!
//! # Backends
//!
//! One build runs every backend: `cpu` (IREE's `local-task` driver), `cuda`,
//! `rocm` (IREE's `hip` driver) and `vulkan`; `metal` comes with Apple-silicon
//! builds. eerie 0.7 builds IREE's runtime without the HIP driver and offers no
//! switch for it, so `runtime/cmake/gpu-drivers.cmake` (a CMake toolchain file,
//! which cmake-rs takes from `CMAKE_TOOLCHAIN_FILE` in `.cargo/config.toml`)
//! turns the GPU drivers on, compiled against headers that `scripts/setup.sh`
//! takes from PyPI's triton wheel. Each driver `dlopen`s its vendor library when
//! a device is created, so the binary builds and runs without any GPU SDK.
//! [`probe`] asks that library first, so a missing one is a one-line
//! [`ProbeError`] naming it; [`available_devices`] lists what this build has.
//!
//! # Building
//!
//! eerie-sys builds the IREE runtime from its vendored sources with CMake
//! (>= 3.26; `.cargo/config.toml` points `CMAKE` at the venv's PyPI `cmake`)
//! and generates bindings with bindgen (`LIBCLANG_PATH`). From an empty target
//! directory, `cargo build -p pcp-runtime` took about 4 minutes on 2 shared
//! cores, most of it the CMake build of the runtime. Tests compile their
//! modules with `.venv/bin/iree-compile` (override with `IREE_COMPILE`).
//!
//! # Example
//!
//! ```no_run
//! # async fn demo(vmfb: Vec<u8>) -> Result<(), Box<dyn std::error::Error>> {
//! use pcp_runtime::{Device, HostTensor, Session};
//!
//! let session = Session::load(Device::Cpu, vmfb).await?;
//! let w = session.upload(HostTensor::f32(vec![4], vec![1.0; 4])?).await?;
//! let x = HostTensor::f32(vec![4], vec![0.5; 4])?;
//! let outputs = session.invoke("module.step", vec![w.into(), x.into()]).await?;
//! let loss = session.download(&outputs[1]).await?.into_f32()?;
//! # let _ = loss;
//! # Ok(())
//! # }
//! ```

mod device;
mod host_alloc;
mod session;
mod tensor;

pub use device::{
    Device, DeviceInfo, ParseDeviceError, ProbeError, available_devices, available_names, detect_arch,
    library_override, probe, vendor_library,
};
pub use host_alloc::HostAllocator;
pub use session::{
    Arg, Buffer, BufferId, DeviceStats, DownloadError, InvokeError, LoadError, Session, StatsError, UploadError,
};
pub use tensor::{DType, HostTensor, TensorData, TensorError};
