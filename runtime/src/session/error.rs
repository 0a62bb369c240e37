//! One error enum per session operation.

use crate::device::Device;
use crate::session::BufferId;
use crate::tensor::DType;

/// Why [`Session::load`](crate::Session::load) failed.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The backend's driver is not compiled into this build.
    #[error("backend {device} is not available in this build (available: {available})")]
    Unavailable {
        /// The backend asked for.
        device: Device,
        /// The backends this build has, comma-separated.
        available: String,
    },
    /// The vendor library is missing or sees no device.
    #[error(transparent)]
    Probe(crate::device::ProbeError),
    /// The driver is built in, but no usable device was found or it failed to start.
    #[error("backend {device} (IREE driver {driver}) has no usable device: {message}")]
    Device {
        /// The backend asked for.
        device: Device,
        /// The IREE driver name.
        driver: &'static str,
        /// IREE's reason, on one line.
        message: String,
    },
    /// The bytes are not a VMFB this runtime can load.
    #[error("invalid VMFB ({len} bytes): {message}")]
    Module {
        /// The size of the rejected module.
        len: usize,
        /// IREE's reason, on one line.
        message: String,
    },
    /// The runtime thread could not be started.
    #[error("cannot start the {device} runtime thread: {source}")]
    Spawn {
        /// The backend asked for.
        device: Device,
        /// The OS error.
        source: std::io::Error,
    },
    /// The runtime thread died before it answered.
    #[error("the {device} runtime thread exited while loading")]
    Exited {
        /// The backend asked for.
        device: Device,
    },
}

/// Why [`Session::invoke`](crate::Session::invoke) failed.
#[derive(Debug, thiserror::Error)]
pub enum InvokeError {
    /// The module exports no function of that name.
    #[error("no function `{function}` in the module: {message}")]
    UnknownFunction {
        /// The fully qualified name asked for, e.g. `module.train_step`.
        function: String,
        /// IREE's reason, on one line.
        message: String,
    },
    /// The call passed the wrong number of arguments.
    #[error("`{function}` takes {expected} arguments, got {actual}")]
    Arity {
        /// The function called.
        function: String,
        /// The number of parameters the function declares.
        expected: usize,
        /// The number of arguments passed.
        actual: usize,
    },
    /// One argument has the wrong shape or type, or could not be uploaded.
    #[error("`{function}` argument {index}: {message}")]
    Argument {
        /// The function called.
        function: String,
        /// The zero-based argument position.
        index: usize,
        /// What is wrong with it, on one line.
        message: String,
    },
    /// A [`Buffer`](crate::Buffer) argument belongs to another session.
    #[error("`{function}` argument {index}: buffer {id} belongs to another session")]
    ForeignBuffer {
        /// The function called.
        function: String,
        /// The zero-based argument position.
        index: usize,
        /// The buffer passed.
        id: BufferId,
    },
    /// The call itself failed on the device.
    #[error("`{function}` failed: {message}")]
    Call {
        /// The function called.
        function: String,
        /// IREE's reason, on one line.
        message: String,
    },
    /// The session's runtime thread is gone.
    #[error("cannot invoke `{function}`: the runtime thread has stopped")]
    Closed {
        /// The function called.
        function: String,
    },
}

/// Why [`Session::upload`](crate::Session::upload) failed.
#[derive(Debug, thiserror::Error)]
pub enum UploadError {
    /// The device refused the allocation or copy.
    #[error("cannot upload a {dtype} tensor of shape {shape:?}: {message}")]
    Device {
        /// The element type.
        dtype: DType,
        /// The shape.
        shape: Vec<usize>,
        /// IREE's reason, on one line.
        message: String,
    },
    /// The session's runtime thread is gone.
    #[error("cannot upload: the runtime thread has stopped")]
    Closed,
}

/// Why [`Session::download`](crate::Session::download) failed.
#[derive(Debug, thiserror::Error)]
pub enum DownloadError {
    /// The buffer belongs to another session.
    #[error("buffer {id} belongs to another session")]
    ForeignBuffer {
        /// The buffer asked for.
        id: BufferId,
    },
    /// The buffer's element type has no host representation here.
    #[error("buffer {id} holds {dtype} elements; only f32, i32 and i64 can be downloaded")]
    Unsupported {
        /// The buffer asked for.
        id: BufferId,
        /// Its element type.
        dtype: DType,
    },
    /// The device-to-host copy failed.
    #[error("cannot download buffer {id}: {message}")]
    Read {
        /// The buffer asked for.
        id: BufferId,
        /// IREE's reason, on one line.
        message: String,
    },
    /// The session's runtime thread is gone.
    #[error("cannot download buffer {id}: the runtime thread has stopped")]
    Closed {
        /// The buffer asked for.
        id: BufferId,
    },
}

/// Why [`Session::stats`](crate::Session::stats) failed.
#[derive(Debug, thiserror::Error)]
pub enum StatsError {
    /// The session's runtime thread is gone.
    #[error("cannot read device stats: the runtime thread has stopped")]
    Closed,
}
