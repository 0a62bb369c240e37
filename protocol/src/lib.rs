//! pcp's protocol core.
//!
//! Pure: no sockets, no clocks, no randomness. Every time-dependent step
//! takes `now` as an argument, so simulations are deterministic.

pub mod diloco;
