//! One test of a file at a time: tests that time rounds of several processes
//! would otherwise share this machine's two cores with another such test, and
//! their deadlines (not their logic) decide whether they pass.

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Held for a test's whole run.
pub(crate) fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
