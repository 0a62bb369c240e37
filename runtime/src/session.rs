//! A loaded VMFB on one device, owned by a dedicated runtime thread.

mod error;
mod worker;

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::{mpsc, oneshot};

use crate::device::{self, Device, available_names};
use crate::tensor::{DType, HostTensor};

pub use error::{DownloadError, InvokeError, LoadError, StatsError, UploadError};

/// How many requests may queue for a runtime thread before callers wait.
const QUEUE_DEPTH: usize = 16;

/// Distinguishes sessions so a buffer cannot be passed to the wrong one.
static NEXT_SESSION: AtomicU64 = AtomicU64::new(1);

/// The id of a device-resident buffer, unique within its session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufferId(u64);

impl fmt::Display for BufferId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// Ids of buffers whose last handle dropped; the runtime thread frees them.
#[derive(Debug, Default)]
struct Graveyard(Mutex<Vec<BufferId>>);

impl Graveyard {
    fn bury(&self, id: BufferId) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).push(id);
    }

    fn exhume(&self) -> Vec<BufferId> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// An opaque handle to a tensor that lives on a session's device.
///
/// Cloning is cheap; the device memory is freed when the last clone drops.
#[derive(Clone)]
pub struct Buffer {
    inner: Arc<BufferInner>,
}

struct BufferInner {
    id: BufferId,
    session: u64,
    dtype: DType,
    shape: Vec<usize>,
    graveyard: Arc<Graveyard>,
}

impl Drop for BufferInner {
    fn drop(&mut self) {
        self.graveyard.bury(self.id);
    }
}

impl Buffer {
    /// The buffer's id within its session.
    pub fn id(&self) -> BufferId {
        self.inner.id
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.inner.dtype
    }

    /// The dimensions; a scalar has none.
    pub fn shape(&self) -> &[usize] {
        &self.inner.shape
    }
}

impl fmt::Debug for Buffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Buffer({} {}{:?})", self.inner.id, self.inner.dtype, self.inner.shape)
    }
}

/// One argument of [`Session::invoke`].
#[derive(Debug, Clone)]
pub enum Arg {
    /// A host tensor, uploaded for this call only.
    Host(HostTensor),
    /// A buffer already on the device, e.g. an output of the previous step.
    Device(Buffer),
}

impl From<HostTensor> for Arg {
    fn from(tensor: HostTensor) -> Self {
        Arg::Host(tensor)
    }
}

impl From<Buffer> for Arg {
    fn from(buffer: Buffer) -> Self {
        Arg::Device(buffer)
    }
}

impl From<&Buffer> for Arg {
    fn from(buffer: &Buffer) -> Self {
        Arg::Device(buffer.clone())
    }
}

/// What a session holds on its device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DeviceStats {
    /// Live buffers (parameters, optimizer state, outputs not yet dropped).
    pub buffers: usize,
    /// Their total size in bytes.
    pub bytes: usize,
}

/// A request to the runtime thread.
#[derive(Debug)]
enum Command {
    Upload { tensor: HostTensor, reply: oneshot::Sender<Result<Buffer, UploadError>> },
    Invoke { function: String, args: Vec<Arg>, reply: oneshot::Sender<Result<Vec<Buffer>, InvokeError>> },
    Download { buffer: Buffer, reply: oneshot::Sender<Result<HostTensor, DownloadError>> },
    Stats { reply: oneshot::Sender<DeviceStats> },
}

/// A VMFB loaded on one device.
///
/// A cheap, cloneable handle to the runtime thread that owns the IREE
/// objects. The thread stops when the last handle drops; buffers still held
/// then become inert.
#[derive(Debug, Clone)]
pub struct Session {
    device: Device,
    id: u64,
    commands: mpsc::Sender<Command>,
}

impl Session {
    /// Starts a runtime thread on `device` and loads the VMFB `module` into it.
    pub async fn load(device: Device, module: Vec<u8>) -> Result<Self, LoadError> {
        if !device.is_available() {
            return Err(LoadError::Unavailable { device, available: available_names() });
        }
        if device != Device::Cpu {
            // the vendor library and a device, named in one line, before IREE tries
            device::probe(device).map_err(LoadError::Probe)?;
        }
        let id = NEXT_SESSION.fetch_add(1, Ordering::Relaxed);
        let (commands, queue) = mpsc::channel(QUEUE_DEPTH);
        let (ready, loaded) = oneshot::channel();
        let graveyard = Arc::new(Graveyard::default());
        std::thread::Builder::new()
            .name(format!("pcp-runtime-{device}-{id}"))
            .spawn(move || worker::run(device, id, module, graveyard, queue, ready))
            .map_err(|source| LoadError::Spawn { device, source })?;
        loaded.await.map_err(|_| LoadError::Exited { device })??;
        tracing::debug!(%device, session = id, "loaded VMFB");
        Ok(Self { device, id, commands })
    }

    /// The backend this session runs on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Copies a host tensor to the device, e.g. initial parameters.
    pub async fn upload(&self, tensor: HostTensor) -> Result<Buffer, UploadError> {
        let (reply, answer) = oneshot::channel();
        self.commands.send(Command::Upload { tensor, reply }).await.map_err(|_| UploadError::Closed)?;
        answer.await.map_err(|_| UploadError::Closed)?
    }

    /// Calls the exported `function` (e.g. `module.train_step`).
    ///
    /// Host arguments are uploaded for this call; every output stays on the
    /// device and comes back as a [`Buffer`].
    pub async fn invoke(&self, function: &str, args: Vec<Arg>) -> Result<Vec<Buffer>, InvokeError> {
        let closed = || InvokeError::Closed { function: function.to_owned() };
        for (index, arg) in args.iter().enumerate() {
            if let Arg::Device(buffer) = arg
                && buffer.inner.session != self.id
            {
                return Err(InvokeError::ForeignBuffer { function: function.to_owned(), index, id: buffer.id() });
            }
        }
        let (reply, answer) = oneshot::channel();
        let command = Command::Invoke { function: function.to_owned(), args, reply };
        self.commands.send(command).await.map_err(|_| closed())?;
        answer.await.map_err(|_| closed())?
    }

    /// Copies a device buffer back to the host (for a loss, a sync or a checkpoint).
    pub async fn download(&self, buffer: &Buffer) -> Result<HostTensor, DownloadError> {
        let id = buffer.id();
        if buffer.inner.session != self.id {
            return Err(DownloadError::ForeignBuffer { id });
        }
        let (reply, answer) = oneshot::channel();
        let command = Command::Download { buffer: buffer.clone(), reply };
        self.commands.send(command).await.map_err(|_| DownloadError::Closed { id })?;
        answer.await.map_err(|_| DownloadError::Closed { id })?
    }

    /// Counts the buffers this session holds on its device, after freeing
    /// those whose handles were dropped.
    pub async fn stats(&self) -> Result<DeviceStats, StatsError> {
        let (reply, answer) = oneshot::channel();
        self.commands.send(Command::Stats { reply }).await.map_err(|_| StatsError::Closed)?;
        answer.await.map_err(|_| StatsError::Closed)
    }
}
