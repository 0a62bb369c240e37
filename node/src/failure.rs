//! The error every command returns, with the exit code it maps to.

/// An error with the exit code it maps to: 2 for bad input, 1 otherwise.
#[derive(Debug)]
pub(crate) struct Failure {
    code: u8,
    error: anyhow::Error,
}

impl Failure {
    /// Bad input from the user: exit code 2.
    pub(crate) fn input(error: impl Into<anyhow::Error>) -> Self {
        Self { code: 2, error: error.into() }
    }

    /// What went wrong.
    pub(crate) fn error(&self) -> &anyhow::Error {
        &self.error
    }

    /// The error, without its exit code.
    pub(crate) fn into_error(self) -> anyhow::Error {
        self.error
    }
}

impl<E: Into<anyhow::Error>> From<E> for Failure {
    fn from(error: E) -> Self {
        let error = error.into();
        let code = if error.downcast_ref::<crate::commands::join::Usage>().is_some() { 2 } else { 1 };
        Self { code, error }
    }
}

impl Failure {
    /// The exit code: 2 for bad input, 1 otherwise.
    pub(crate) fn code(&self) -> u8 {
        self.code
    }
}
