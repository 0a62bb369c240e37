//! What a backend can see on this machine, asked of the vendor's own library.
//!
//! IREE's CUDA, HIP and Vulkan drivers `dlopen` their vendor library when a
//! device is created, and say little when it is missing. pcp opens the same
//! library first, so a volunteer reads `backend rocm: libamdhip64.so not found
//! (install ROCm 6.x)` instead, and so that `pcp-node devices` and a worker
//! without `--target` learn each GPU's name, architecture and memory:
//!
//! * cuda: `libcuda.so.1` (the driver API: `cuDeviceGetName`, compute
//!   capability, `cuDeviceTotalMem_v2`), architecture `sm_XY`;
//! * rocm: `libamdhip64.so` (`hipDeviceGetName`, `hipDeviceTotalMem`), with the
//!   architecture (`gfx942`) from the kernel driver's topology in
//!   `/sys/class/kfd/kfd/topology/nodes/*/properties` (`gfx_target_version`);
//! * vulkan: `libvulkan.so.1` (`vkEnumeratePhysicalDevices`, the device's
//!   name and its device-local heaps); no architecture: Vulkan artifacts are
//!   compiled for IREE's portable baseline unless `--target` names one.

use std::ffi::{c_char, c_int, c_uint};
use std::fmt;
use std::path::Path;

use libloading::{Library, Symbol};

use crate::device::Device;

/// One GPU a backend can see.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The device's ordinal for the backend.
    pub ordinal: usize,
    /// The vendor's name for it (`NVIDIA H100 80GB HBM3`).
    pub name: String,
    /// The architecture a target is compiled for (`sm_90`, `gfx942`), when known.
    pub arch: Option<String>,
    /// Device memory in bytes, when known.
    pub memory: Option<u64>,
}

impl fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.ordinal, self.name)?;
        if let Some(arch) = &self.arch {
            write!(f, ", {arch}")?;
        }
        if let Some(bytes) = self.memory {
            write!(f, ", {:.1} GiB", bytes as f64 / (1u64 << 30) as f64)?;
        }
        Ok(())
    }
}

/// Why a backend sees no device.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProbeError {
    /// The vendor library is not installed (or not on the loader's path).
    #[error("backend {device}: {library} not found ({hint})")]
    Library {
        /// The backend.
        device: Device,
        /// The library that did not load.
        library: String,
        /// What to install.
        hint: &'static str,
    },
    /// The library loaded but lacks an entry point pcp uses.
    #[error("backend {device}: {library} has no {symbol} (too old a driver?)")]
    Symbol {
        /// The backend.
        device: Device,
        /// The library.
        library: &'static str,
        /// The missing function.
        symbol: &'static str,
    },
    /// The library answered with an error.
    #[error("backend {device}: {call} failed: {message}")]
    Call {
        /// The backend.
        device: Device,
        /// The call.
        call: &'static str,
        /// The vendor's error.
        message: String,
    },
    /// The driver works and sees no device.
    #[error("backend {device}: no device found ({library} loaded)")]
    NoDevice {
        /// The backend.
        device: Device,
        /// The library that loaded.
        library: &'static str,
    },
    /// The backend's IREE driver is not compiled into this build.
    #[error("backend {device} is not available in this build (available: {available})")]
    NotBuilt {
        /// The backend.
        device: Device,
        /// The backends this build has, comma-separated.
        available: String,
    },
    /// This backend has no probe on this platform.
    #[error("backend {device}: not supported on this platform")]
    Unsupported {
        /// The backend.
        device: Device,
    },
}

/// The vendor library each GPU backend loads, and what to install when it is missing.
pub fn vendor_library(device: Device) -> Option<(&'static [&'static str], &'static str)> {
    match device {
        Device::Cuda => Some((&["libcuda.so.1", "libcuda.so"], "install the NVIDIA driver")),
        Device::Rocm => {
            Some((&["libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so.5"], "install ROCm 6.x"))
        }
        Device::Vulkan => Some((
            &["libvulkan.so.1", "libvulkan.so"],
            "install a Vulkan loader and driver, e.g. Debian's libvulkan1 and mesa-vulkan-drivers",
        )),
        Device::Cpu | Device::Metal => None,
    }
}

/// The devices `device`'s vendor library sees, or why it sees none. The cpu
/// backend is the host (one device, no architecture: IREE targets the host CPU).
pub fn probe(device: Device) -> Result<Vec<DeviceInfo>, ProbeError> {
    match device {
        Device::Cpu => Ok(vec![DeviceInfo { ordinal: 0, name: host_cpu_name(), arch: None, memory: host_memory() }]),
        Device::Cuda => {
            let lib = open(device)?;
            cuda(device, &lib)
        }
        Device::Rocm => {
            let lib = open(device)?;
            hip(device, &lib)
        }
        Device::Vulkan => {
            let lib = open(device)?;
            vulkan(device, &lib)
        }
        Device::Metal => Err(ProbeError::Unsupported { device }),
    }
}

/// The architecture of `device`'s first GPU (`sm_90`, `gfx942`), for a worker
/// started without `--target`.
pub fn detect_arch(device: Device) -> Result<String, ProbeError> {
    let devices = probe(device)?;
    let first = devices.first().ok_or(ProbeError::NoDevice { device, library: library_name(device) })?;
    first.arch.clone().ok_or(ProbeError::Call {
        device,
        call: "architecture detection",
        message: format!("{} reports no architecture; pass --target", first.name),
    })
}

fn library_name(device: Device) -> &'static str {
    vendor_library(device).and_then(|(names, _)| names.first().copied()).unwrap_or("the vendor library")
}

/// The environment variable that names `device`'s vendor library explicitly.
pub fn library_override(device: Device) -> Option<&'static str> {
    match device {
        Device::Cuda => Some("PCP_CUDA_LIBRARY"),
        Device::Rocm => Some("PCP_HIP_LIBRARY"),
        Device::Vulkan => Some("PCP_VULKAN_LIBRARY"),
        Device::Cpu | Device::Metal => None,
    }
}

/// Opens `device`'s vendor library: the path in its [`library_override`] variable
/// when set, else the first of its usual names that loads.
pub(crate) fn open(device: Device) -> Result<Library, ProbeError> {
    let Some((names, hint)) = vendor_library(device) else {
        return Err(ProbeError::Unsupported { device });
    };
    if let Some(path) = library_override(device).and_then(std::env::var_os) {
        // SAFETY: as below; the user chose this library for this backend.
        return unsafe { Library::new(&path) }.map_err(|_| ProbeError::Library {
            device,
            library: path.to_string_lossy().into_owned(),
            hint,
        });
    }
    for name in names {
        // SAFETY: loading a vendor driver library runs its initialisers; these are
        // the same libraries IREE's drivers load, for the same purpose.
        if let Ok(lib) = unsafe { Library::new(name) } {
            return Ok(lib);
        }
    }
    Err(ProbeError::Library { device, library: names[0].to_owned(), hint })
}

fn symbol<'l, T>(device: Device, lib: &'l Library, name: &'static str) -> Result<Symbol<'l, T>, ProbeError> {
    // SAFETY: each caller names the symbol's C signature as `T`, from the vendor's
    // documented API (CUDA driver API, HIP runtime API).
    unsafe { lib.get::<T>(name.as_bytes()) }.map_err(|_| ProbeError::Symbol {
        device,
        library: library_name(device),
        symbol: name,
    })
}

/// A C string the vendor wrote into `buf`.
fn c_string(buf: &[u8]) -> String {
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).trim().to_owned()
}

type CuInit = unsafe extern "C" fn(c_uint) -> c_int;
type CuDeviceGetCount = unsafe extern "C" fn(*mut c_int) -> c_int;
type CuDeviceGet = unsafe extern "C" fn(*mut c_int, c_int) -> c_int;
type CuDeviceGetName = unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int;
type CuDeviceGetAttribute = unsafe extern "C" fn(*mut c_int, c_int, c_int) -> c_int;
type CuDeviceTotalMem = unsafe extern "C" fn(*mut usize, c_int) -> c_int;
type CuGetErrorString = unsafe extern "C" fn(c_int, *mut *const c_char) -> c_int;

/// `CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR` and `_MINOR`.
const CU_CC_MAJOR: c_int = 75;
const CU_CC_MINOR: c_int = 76;
/// `CUDA_ERROR_NO_DEVICE`.
const CUDA_ERROR_NO_DEVICE: c_int = 100;

fn cuda(device: Device, lib: &Library) -> Result<Vec<DeviceInfo>, ProbeError> {
    let init: Symbol<CuInit> = symbol(device, lib, "cuInit")?;
    let count: Symbol<CuDeviceGetCount> = symbol(device, lib, "cuDeviceGetCount")?;
    let get: Symbol<CuDeviceGet> = symbol(device, lib, "cuDeviceGet")?;
    let name: Symbol<CuDeviceGetName> = symbol(device, lib, "cuDeviceGetName")?;
    let attribute: Symbol<CuDeviceGetAttribute> = symbol(device, lib, "cuDeviceGetAttribute")?;
    let total: Symbol<CuDeviceTotalMem> = symbol(device, lib, "cuDeviceTotalMem_v2")?;
    let describe = |code: c_int| -> String {
        let Ok(text) = symbol::<CuGetErrorString>(device, lib, "cuGetErrorString") else {
            return format!("CUDA error {code}");
        };
        let mut ptr: *const c_char = std::ptr::null();
        // SAFETY: cuGetErrorString stores a pointer to a static string.
        if unsafe { text(code, &mut ptr) } != 0 || ptr.is_null() {
            return format!("CUDA error {code}");
        }
        // SAFETY: a NUL-terminated static string from the driver.
        unsafe { std::ffi::CStr::from_ptr(ptr) }.to_string_lossy().into_owned()
    };
    let check = |call: &'static str, code: c_int| -> Result<(), ProbeError> {
        match code {
            0 => Ok(()),
            CUDA_ERROR_NO_DEVICE => Err(ProbeError::NoDevice { device, library: "libcuda.so.1" }),
            _ => Err(ProbeError::Call { device, call, message: describe(code) }),
        }
    };
    // SAFETY (this block's calls): the CUDA driver API as documented, with valid
    // out-pointers and buffer lengths.
    check("cuInit", unsafe { init(0) })?;
    let mut n: c_int = 0;
    check("cuDeviceGetCount", unsafe { count(&mut n) })?;
    let mut devices = Vec::new();
    for ordinal in 0..n.max(0) {
        let mut handle: c_int = 0;
        check("cuDeviceGet", unsafe { get(&mut handle, ordinal) })?;
        let mut buf = [0u8; 256];
        check("cuDeviceGetName", unsafe { name(buf.as_mut_ptr().cast(), buf.len() as c_int, handle) })?;
        let (mut major, mut minor) = (0, 0);
        check("cuDeviceGetAttribute", unsafe { attribute(&mut major, CU_CC_MAJOR, handle) })?;
        check("cuDeviceGetAttribute", unsafe { attribute(&mut minor, CU_CC_MINOR, handle) })?;
        let mut bytes: usize = 0;
        let memory = (unsafe { total(&mut bytes, handle) } == 0).then_some(bytes as u64);
        devices.push(DeviceInfo {
            ordinal: ordinal as usize,
            name: c_string(&buf),
            arch: Some(format!("sm_{major}{minor}")),
            memory,
        });
    }
    if devices.is_empty() {
        return Err(ProbeError::NoDevice { device, library: "libcuda.so.1" });
    }
    Ok(devices)
}

type HipInit = unsafe extern "C" fn(c_uint) -> c_int;
type HipGetDeviceCount = unsafe extern "C" fn(*mut c_int) -> c_int;
type HipDeviceGet = unsafe extern "C" fn(*mut c_int, c_int) -> c_int;
type HipDeviceGetName = unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int;
type HipDeviceTotalMem = unsafe extern "C" fn(*mut usize, c_int) -> c_int;
type HipGetErrorString = unsafe extern "C" fn(c_int) -> *const c_char;

/// `hipErrorNoDevice`.
const HIP_ERROR_NO_DEVICE: c_int = 100;

fn hip(device: Device, lib: &Library) -> Result<Vec<DeviceInfo>, ProbeError> {
    let init: Symbol<HipInit> = symbol(device, lib, "hipInit")?;
    let count: Symbol<HipGetDeviceCount> = symbol(device, lib, "hipGetDeviceCount")?;
    let get: Symbol<HipDeviceGet> = symbol(device, lib, "hipDeviceGet")?;
    let name: Symbol<HipDeviceGetName> = symbol(device, lib, "hipDeviceGetName")?;
    let total: Symbol<HipDeviceTotalMem> = symbol(device, lib, "hipDeviceTotalMem")?;
    let describe = |code: c_int| -> String {
        let Ok(text) = symbol::<HipGetErrorString>(device, lib, "hipGetErrorString") else {
            return format!("HIP error {code}");
        };
        // SAFETY: hipGetErrorString returns a static NUL-terminated string or null.
        let ptr = unsafe { text(code) };
        if ptr.is_null() {
            return format!("HIP error {code}");
        }
        // SAFETY: non-null, NUL-terminated, static.
        unsafe { std::ffi::CStr::from_ptr(ptr) }.to_string_lossy().into_owned()
    };
    let check = |call: &'static str, code: c_int| -> Result<(), ProbeError> {
        match code {
            0 => Ok(()),
            HIP_ERROR_NO_DEVICE => Err(ProbeError::NoDevice { device, library: "libamdhip64.so" }),
            _ => Err(ProbeError::Call { device, call, message: describe(code) }),
        }
    };
    let arches = kfd_arches(Path::new(KFD_TOPOLOGY));
    // SAFETY (this block's calls): the HIP runtime API as documented, with valid
    // out-pointers and buffer lengths.
    check("hipInit", unsafe { init(0) })?;
    let mut n: c_int = 0;
    check("hipGetDeviceCount", unsafe { count(&mut n) })?;
    let mut devices = Vec::new();
    for ordinal in 0..n.max(0) {
        let mut handle: c_int = 0;
        check("hipDeviceGet", unsafe { get(&mut handle, ordinal) })?;
        let mut buf = [0u8; 256];
        check("hipDeviceGetName", unsafe { name(buf.as_mut_ptr().cast(), buf.len() as c_int, handle) })?;
        let mut bytes: usize = 0;
        let memory = (unsafe { total(&mut bytes, handle) } == 0).then_some(bytes as u64);
        devices.push(DeviceInfo {
            ordinal: ordinal as usize,
            name: c_string(&buf),
            // HIP orders visible GPUs as the kernel driver's topology does.
            arch: arches.get(ordinal as usize).cloned(),
            memory,
        });
    }
    if devices.is_empty() {
        return Err(ProbeError::NoDevice { device, library: "libamdhip64.so" });
    }
    Ok(devices)
}

/// `VkInstanceCreateInfo`, with no application info, layers or extensions.
#[repr(C)]
struct VkInstanceCreateInfo {
    s_type: u32,
    p_next: *const std::ffi::c_void,
    flags: u32,
    p_application_info: *const std::ffi::c_void,
    enabled_layer_count: u32,
    pp_enabled_layer_names: *const *const c_char,
    enabled_extension_count: u32,
    pp_enabled_extension_names: *const *const c_char,
}

type VkHandle = *mut std::ffi::c_void;
type VkCreateInstance =
    unsafe extern "C" fn(*const VkInstanceCreateInfo, *const std::ffi::c_void, *mut VkHandle) -> i32;
type VkDestroyInstance = unsafe extern "C" fn(VkHandle, *const std::ffi::c_void);
type VkEnumeratePhysicalDevices = unsafe extern "C" fn(VkHandle, *mut u32, *mut VkHandle) -> i32;
type VkGetProperties = unsafe extern "C" fn(VkHandle, *mut u8);

/// `VkPhysicalDeviceProperties` is 824 bytes, `VkPhysicalDeviceMemoryProperties`
/// 520; the buffers are larger and 8-byte aligned.
const VK_PROPERTIES_BYTES: usize = 1024;
/// `deviceName[256]` follows five `uint32_t`s.
const VK_DEVICE_NAME: std::ops::Range<usize> = 20..276;
/// `memoryHeapCount` and the 16-byte `VkMemoryHeap`s after it.
const VK_HEAP_COUNT: usize = 260;
const VK_HEAPS: usize = 264;

fn vulkan(device: Device, lib: &Library) -> Result<Vec<DeviceInfo>, ProbeError> {
    let create: Symbol<VkCreateInstance> = symbol(device, lib, "vkCreateInstance")?;
    let destroy: Symbol<VkDestroyInstance> = symbol(device, lib, "vkDestroyInstance")?;
    let enumerate: Symbol<VkEnumeratePhysicalDevices> = symbol(device, lib, "vkEnumeratePhysicalDevices")?;
    let properties: Symbol<VkGetProperties> = symbol(device, lib, "vkGetPhysicalDeviceProperties")?;
    let memory: Symbol<VkGetProperties> = symbol(device, lib, "vkGetPhysicalDeviceMemoryProperties")?;
    let info = VkInstanceCreateInfo {
        s_type: 1, // VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO
        p_next: std::ptr::null(),
        flags: 0,
        p_application_info: std::ptr::null(),
        enabled_layer_count: 0,
        pp_enabled_layer_names: std::ptr::null(),
        enabled_extension_count: 0,
        pp_enabled_extension_names: std::ptr::null(),
    };
    let mut instance: VkHandle = std::ptr::null_mut();
    // SAFETY: a valid create-info with nothing enabled, no allocator, an out-pointer.
    let code = unsafe { create(&info, std::ptr::null(), &mut instance) };
    if code != 0 || instance.is_null() {
        return Err(ProbeError::Call { device, call: "vkCreateInstance", message: format!("VkResult {code}") });
    }
    let mut count: u32 = 0;
    // SAFETY: the count query, then a buffer of that many handles.
    let mut handles = Vec::new();
    let code = unsafe { enumerate(instance, &mut count, std::ptr::null_mut()) };
    if code == 0 && count > 0 {
        handles = vec![std::ptr::null_mut(); count as usize];
        // SAFETY: `handles` holds `count` slots.
        unsafe { enumerate(instance, &mut count, handles.as_mut_ptr()) };
        handles.truncate(count as usize);
    }
    let mut devices = Vec::new();
    for (ordinal, handle) in handles.into_iter().enumerate() {
        let mut props = vec![0u64; VK_PROPERTIES_BYTES / 8];
        let mut heaps = vec![0u64; VK_PROPERTIES_BYTES / 8];
        // SAFETY: both structs fit their 8-byte aligned buffers.
        unsafe {
            properties(handle, props.as_mut_ptr().cast());
            memory(handle, heaps.as_mut_ptr().cast());
        }
        let props: Vec<u8> = props.iter().flat_map(|w| w.to_ne_bytes()).collect();
        let heaps: Vec<u8> = heaps.iter().flat_map(|w| w.to_ne_bytes()).collect();
        let u32_at = |b: &[u8], at: usize| u32::from_ne_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
        let u64_at = |b: &[u8], at: usize| u64::from_ne_bytes(std::array::from_fn(|i| b[at + i]));
        let heap_count = u32_at(&heaps, VK_HEAP_COUNT).min(16) as usize;
        // device-local heaps (VK_MEMORY_HEAP_DEVICE_LOCAL_BIT)
        let local: u64 = (0..heap_count)
            .map(|i| VK_HEAPS + 16 * i)
            .filter(|at| u32_at(&heaps, at + 8) & 1 == 1)
            .map(|at| u64_at(&heaps, at))
            .sum();
        devices.push(DeviceInfo {
            ordinal,
            name: c_string(&props[VK_DEVICE_NAME]),
            arch: None,
            memory: (local > 0).then_some(local),
        });
    }
    // SAFETY: the instance was created above and nothing derived from it lives on.
    unsafe { destroy(instance, std::ptr::null()) };
    if devices.is_empty() {
        return Err(ProbeError::NoDevice { device, library: "libvulkan.so.1" });
    }
    Ok(devices)
}

/// Where the amdgpu kernel driver describes each compute node.
const KFD_TOPOLOGY: &str = "/sys/class/kfd/kfd/topology/nodes";

/// The `gfx` names of the GPU nodes under `topology`, in node order (CPU nodes,
/// whose `gfx_target_version` is 0, are skipped).
fn kfd_arches(topology: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(topology) else {
        return Vec::new();
    };
    let mut nodes: Vec<(u64, String)> = entries
        .flatten()
        .filter_map(|e| {
            let index = e.file_name().to_str()?.parse::<u64>().ok()?;
            let text = std::fs::read_to_string(e.path().join("properties")).ok()?;
            let version = text.lines().find_map(|l| l.strip_prefix("gfx_target_version "))?.trim().parse().ok()?;
            gfx_name(version).map(|name| (index, name))
        })
        .collect();
    nodes.sort();
    nodes.into_iter().map(|(_, name)| name).collect()
}

/// `gfx_target_version` (major·10000 + minor·100 + stepping) as LLVM's name:
/// 90402 → `gfx942`, 90010 → `gfx90a`, 110000 → `gfx1100`. 0 (a CPU) → `None`.
fn gfx_name(version: u64) -> Option<String> {
    if version == 0 {
        return None;
    }
    let (major, minor, stepping) = (version / 10000, (version / 100) % 100, version % 100);
    (minor < 16 && stepping < 16).then(|| format!("gfx{major}{minor:x}{stepping:x}"))
}

fn host_cpu_name() -> String {
    let model = std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|t| {
        t.lines().find_map(|l| l.strip_prefix("model name")).map(|l| l.trim_start_matches([' ', '\t', ':']).to_owned())
    });
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    format!("{} ({threads} threads)", model.unwrap_or_else(|| std::env::consts::ARCH.to_owned()))
}

fn host_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 =
        text.lines().find_map(|l| l.strip_prefix("MemTotal:"))?.trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gfx_names_from_kfd_versions() {
        assert_eq!(gfx_name(90402).as_deref(), Some("gfx942"));
        assert_eq!(gfx_name(90010).as_deref(), Some("gfx90a"));
        assert_eq!(gfx_name(110000).as_deref(), Some("gfx1100"));
        assert_eq!(gfx_name(120001).as_deref(), Some("gfx1201"));
        assert_eq!(gfx_name(0), None);
    }

    #[test]
    fn kfd_topology_lists_gpu_nodes_in_order() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        for (node, version) in [(0, 0), (1, 90402), (2, 90402), (10, 110000)] {
            let path = dir.path().join(node.to_string());
            std::fs::create_dir_all(&path)?;
            std::fs::write(path.join("properties"), format!("cpu_cores_count 0\ngfx_target_version {version}\n"))?;
        }
        assert_eq!(kfd_arches(dir.path()), ["gfx942", "gfx942", "gfx1100"]);
        assert!(kfd_arches(&dir.path().join("missing")).is_empty());
        Ok(())
    }

    #[test]
    fn the_host_is_a_device() -> anyhow::Result<()> {
        let host = probe(Device::Cpu)?;
        assert_eq!(host.len(), 1);
        assert!(host[0].memory.is_some_and(|m| m > 0));
        Ok(())
    }
}
