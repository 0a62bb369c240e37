//! What a run tells: the typed `--events` record ([`events`]), Prometheus
//! [`metrics`], the [`wandb`] bridge, the dashboard ([`tui`]) and [`progress`] bars.
//! Every event passes through [`events::Events::emit`], which feeds the others.

pub(crate) mod events;
pub(crate) mod metrics;
pub(crate) mod progress;
pub(crate) mod tui;
pub(crate) mod wandb;
