//! The runtime thread: owns eerie's `!Send` objects and serves [`Command`]s.

use std::collections::HashMap;
use std::sync::Arc;

use eerie::runtime::{DeviceSpec, Driver, Function, Program, Runtime, RuntimeError, Value};
use tokio::sync::{mpsc, oneshot};

use super::{
    Arg, Buffer, BufferId, BufferInner, Command, DeviceStats, DownloadError, Graveyard, InvokeError, LoadError,
    UploadError,
};
use crate::device::Device;
use crate::tensor::{DType, HostTensor, TensorData};

/// Loads the module, reports on `ready`, then serves `queue` until every
/// [`Session`](super::Session) handle is gone.
pub(super) fn run(
    device: Device,
    session: u64,
    module: Vec<u8>,
    graveyard: Arc<Graveyard>,
    mut queue: mpsc::Receiver<Command>,
    ready: oneshot::Sender<Result<(), LoadError>>,
) {
    let mut worker = match Worker::load(device, session, &module, graveyard) {
        Ok(worker) => worker,
        Err(error) => {
            // The caller may have stopped waiting; nothing else to tell.
            let _ = ready.send(Err(error));
            return;
        }
    };
    drop(module);
    if ready.send(Ok(())).is_err() {
        return;
    }
    while let Some(command) = queue.blocking_recv() {
        worker.free_dropped();
        worker.serve(command);
    }
    tracing::debug!(%device, session, "runtime thread stopped");
}

/// The IREE state of one session. Fields drop in order: buffers and functions
/// before the program, the program before the runtime.
struct Worker {
    buffers: HashMap<BufferId, Value>,
    functions: HashMap<String, Function>,
    program: Program,
    runtime: Runtime,
    session: u64,
    next_buffer: u64,
    graveyard: Arc<Graveyard>,
}

impl Worker {
    fn load(device: Device, session: u64, module: &[u8], graveyard: Arc<Graveyard>) -> Result<Self, LoadError> {
        let driver = device.driver();
        let runtime = Runtime::new(DeviceSpec::new(Driver::custom(driver))).map_err(|error| LoadError::Device {
            device,
            driver,
            message: one_line(&error),
        })?;
        if module.is_empty() {
            return Err(LoadError::Module { len: 0, message: "the module is empty".to_owned() });
        }
        let program = runtime
            .load_vmfb(module)
            .map_err(|error| LoadError::Module { len: module.len(), message: one_line(&error) })?;
        Ok(Self {
            buffers: HashMap::new(),
            functions: HashMap::new(),
            program,
            runtime,
            session,
            next_buffer: 1,
            graveyard,
        })
    }

    fn free_dropped(&mut self) {
        for id in self.graveyard.exhume() {
            self.buffers.remove(&id);
        }
    }

    fn serve(&mut self, command: Command) {
        // A caller that stopped waiting dropped its receiver; any buffers in
        // the unsent reply are buried and freed on the next command.
        match command {
            Command::Upload { tensor, reply } => {
                let _ = reply.send(self.upload(tensor));
            }
            Command::Invoke { function, args, reply } => {
                let _ = reply.send(self.invoke(&function, args));
            }
            Command::Download { buffer, reply } => {
                let _ = reply.send(self.download(&buffer));
            }
            Command::Stats { reply } => {
                let _ = reply.send(self.stats());
            }
        }
    }

    fn stats(&self) -> DeviceStats {
        DeviceStats { buffers: self.buffers.len(), bytes: self.buffers.values().map(byte_length).sum() }
    }

    fn adopt(&mut self, value: Value) -> Buffer {
        let (dtype, shape) = describe(&value);
        let id = BufferId(self.next_buffer);
        self.next_buffer += 1;
        self.buffers.insert(id, value);
        Buffer {
            inner: Arc::new(BufferInner {
                id,
                session: self.session,
                dtype,
                shape,
                graveyard: Arc::clone(&self.graveyard),
            }),
        }
    }

    fn to_device(&self, tensor: &HostTensor) -> Result<Value, RuntimeError> {
        let shape = tensor.shape();
        Ok(match tensor.data() {
            TensorData::F32(data) => Value::F32(self.runtime.buffer_view(shape, data)?),
            TensorData::I32(data) => Value::I32(self.runtime.buffer_view(shape, data)?),
            TensorData::I64(data) => Value::I64(self.runtime.buffer_view(shape, data)?),
        })
    }

    fn upload(&mut self, tensor: HostTensor) -> Result<Buffer, UploadError> {
        let value = self.to_device(&tensor).map_err(|error| UploadError::Device {
            dtype: tensor.dtype(),
            shape: tensor.shape().to_vec(),
            message: one_line(&error),
        })?;
        Ok(self.adopt(value))
    }

    fn invoke(&mut self, name: &str, args: Vec<Arg>) -> Result<Vec<Buffer>, InvokeError> {
        let mut inputs = Vec::with_capacity(args.len());
        for (index, arg) in args.iter().enumerate() {
            let value = match arg {
                Arg::Host(tensor) => self.to_device(tensor).map_err(|error| InvokeError::Argument {
                    function: name.to_owned(),
                    index,
                    message: one_line(&error),
                })?,
                Arg::Device(buffer) => {
                    self.buffers.get(&buffer.id()).cloned().ok_or_else(|| InvokeError::Argument {
                        function: name.to_owned(),
                        index,
                        message: format!("buffer {} is no longer on the device", buffer.id()),
                    })?
                }
            };
            inputs.push(value);
        }
        if !self.functions.contains_key(name) {
            let function = self.program.function(name).map_err(|error| InvokeError::UnknownFunction {
                function: name.to_owned(),
                message: one_line(&error),
            })?;
            self.functions.insert(name.to_owned(), function);
        }
        let function = self.functions.get(name).ok_or_else(|| InvokeError::UnknownFunction {
            function: name.to_owned(),
            message: "not resolved".to_owned(),
        })?;
        let outputs = function.invoke(inputs).map_err(|error| classify(name, &one_line(&error)))?;
        Ok(outputs.into_iter().map(|value| self.adopt(value)).collect())
    }

    fn download(&self, buffer: &Buffer) -> Result<HostTensor, DownloadError> {
        let id = buffer.id();
        let value = self
            .buffers
            .get(&id)
            .ok_or_else(|| DownloadError::Read { id, message: "the buffer is no longer on the device".to_owned() })?;
        let read_error = |error: RuntimeError| DownloadError::Read { id, message: one_line(&error) };
        let data = match value {
            Value::F32(view) => TensorData::F32(view.read().map_err(read_error)?),
            Value::I32(view) => TensorData::I32(view.read().map_err(read_error)?),
            Value::I64(view) => TensorData::I64(view.read().map_err(read_error)?),
            other => {
                return Err(DownloadError::Unsupported { id, dtype: describe(other).0 });
            }
        };
        HostTensor::new(buffer.shape().to_vec(), data)
            .map_err(|error| DownloadError::Read { id, message: error.to_string() })
    }
}

/// The element type and shape of a device value.
fn describe(value: &Value) -> (DType, Vec<usize>) {
    match value {
        Value::Bool(view) => (DType::Bool, view.shape()),
        Value::U8(view) => (DType::U8, view.shape()),
        Value::U16(view) => (DType::U16, view.shape()),
        Value::U32(view) => (DType::U32, view.shape()),
        Value::U64(view) => (DType::U64, view.shape()),
        Value::I8(view) => (DType::I8, view.shape()),
        Value::I16(view) => (DType::I16, view.shape()),
        Value::I32(view) => (DType::I32, view.shape()),
        Value::I64(view) => (DType::I64, view.shape()),
        Value::F32(view) => (DType::F32, view.shape()),
        Value::F64(view) => (DType::F64, view.shape()),
    }
}

/// The size of a device value in bytes.
fn byte_length(value: &Value) -> usize {
    match value {
        Value::Bool(view) => view.byte_length(),
        Value::U8(view) => view.byte_length(),
        Value::U16(view) => view.byte_length(),
        Value::U32(view) => view.byte_length(),
        Value::U64(view) => view.byte_length(),
        Value::I8(view) => view.byte_length(),
        Value::I16(view) => view.byte_length(),
        Value::I32(view) => view.byte_length(),
        Value::I64(view) => view.byte_length(),
        Value::F32(view) => view.byte_length(),
        Value::F64(view) => view.byte_length(),
    }
}

/// Reduces an IREE status (source location, message, context, stack) to the
/// message itself, on one line.
fn one_line(error: &RuntimeError) -> String {
    let text = error.to_string();
    let text = text.strip_prefix("IREE runtime error: ").unwrap_or(&text);
    // eerie prints an IREE status as `Status: "<Debug-escaped text>"`.
    let text = match text.strip_prefix("Status: \"").and_then(|quoted| quoted.strip_suffix('"')) {
        Some(quoted) => unescape(quoted),
        None => text.to_owned(),
    };
    let first = text.lines().map(str::trim).find(|line| !line.is_empty()).unwrap_or("unknown IREE error");
    // Drop a leading `path/to/file.c:123: ` source location.
    let first = match first.split_once(": ") {
        Some((location, rest))
            if location
                .rsplit_once(':')
                .is_some_and(|(file, line)| file.contains('.') && line.chars().all(|c| c.is_ascii_digit())) =>
        {
            rest
        }
        _ => first,
    };
    // Drop IREE's call-stack context after the message proper.
    let end = ["; while ", "; invoking function "]
        .iter()
        .filter_map(|marker| first.find(marker))
        .min()
        .unwrap_or(first.len());
    first[..end].trim_end_matches([';', ' ']).to_owned()
}

/// Undoes `str`'s `Debug` escaping for the escapes IREE messages contain.
fn unescape(quoted: &str) -> String {
    let mut text = String::with_capacity(quoted.len());
    let mut chars = quoted.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            text.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => text.push('\n'),
            Some('t') => text.push('\t'),
            Some('r') => text.push('\r'),
            Some('0') => text.push('\0'),
            Some(other) => text.push(other),
            None => text.push('\\'),
        }
    }
    text
}

/// Turns IREE's invocation failure into an error naming the argument at fault.
fn classify(function: &str, message: &str) -> InvokeError {
    let function = function.to_owned();
    // Skip the status code, e.g. `INVALID_ARGUMENT; `.
    let body = match message.split_once("; ") {
        Some((code, rest)) if code.chars().all(|c| c.is_ascii_uppercase() || c == '_') => rest,
        _ => message,
    };
    if let Some(counts) = body.strip_prefix("input list and function mismatch; expected ")
        && let Some((expected, rest)) = counts.split_once(" arguments but passed ")
        && let (Ok(expected), Ok(actual)) = (expected.parse(), rest.trim().parse())
    {
        return InvokeError::Arity { function, expected, actual };
    }
    if let Some(rest) = body.strip_prefix("input") {
        let digits = rest.chars().take_while(char::is_ascii_digit).count();
        if let Ok(index) = rest[..digits].parse() {
            return InvokeError::Argument { function, index, message: rest[digits..].trim().to_owned() };
        }
    }
    InvokeError::Call { function, message: message.to_owned() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_assertions_name_the_argument() {
        let message = "INVALID_ARGUMENT; input1 shape dimension 0 mismatch; expected 4 but have 3";
        match classify("module.step", message) {
            InvokeError::Argument { function, index, message } => {
                assert_eq!(function, "module.step");
                assert_eq!(index, 1);
                assert_eq!(message, "shape dimension 0 mismatch; expected 4 but have 3");
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn arity_mismatch_is_parsed() {
        let message = "INVALID_ARGUMENT; input list and function mismatch; expected 2 arguments but passed 1";
        assert!(matches!(classify("module.step", message), InvokeError::Arity { expected: 2, actual: 1, .. }));
    }

    #[test]
    fn escaped_status_text_is_unescaped() {
        assert_eq!(unescape(r#"a\nb \"c\" d\\e"#), "a\nb \"c\" d\\e");
    }

    #[test]
    fn other_failures_keep_the_message() {
        let error = classify("module.step", "RESOURCE_EXHAUSTED; out of memory");
        assert_eq!(error.to_string(), "`module.step` failed: RESOURCE_EXHAUSTED; out of memory");
    }
}
