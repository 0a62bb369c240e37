//! `--metrics-addr HOST:PORT`: the node's state as Prometheus (OpenMetrics) text
//! at `http://HOST:PORT/metrics`, for a scraper or `curl`.
//!
//! The series are fed by the same events as `--events FILE` (see
//! [`crate::observe::events::Events::emit`]), so the two never disagree: every emitted
//! event passes through [`observe`], whether or not an events file was given.
//! The registry is process-wide: `pcp-node sim` runs every node in one process,
//! and its metrics are those of the whole simulated network (rounds and losses
//! come from its one shepherd; peers and bytes add up over its nodes).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::OnceLock;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::task::JoinSet;

use crate::observe::events::kinds::Event;

/// Scrapes served at once; more connections are closed at once.
const MAX_CONNECTIONS: usize = 16;
/// How long a scraper may take to send its request and read the answer.
const CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);

type Labels = Vec<(String, String)>;
type FloatGauge = Gauge<f64, AtomicU64>;

/// The contributions' series.
#[derive(Debug, Default)]
struct Contributions {
    bytes_up: Counter,
    bytes_down: Counter,
    rejected: Family<Labels, Counter>,
    clipped: Counter,
    bounded: Counter,
    discounted: Counter,
}

/// The aggregators' series (`--aggregators`).
#[derive(Debug, Default)]
struct Aggregation {
    shards: Counter,
    recomputed: Counter,
    disputes: Counter,
    seconds: FloatGauge,
}

/// The shepherd's screen's series (`--screen score`).
#[derive(Debug, Default)]
struct Screening {
    seconds: FloatGauge,
    share: FloatGauge,
    /// Contributions the screen decided on, by outcome: `screened`, `skipped` (a
    /// rated peer not drawn past the budget), `over_budget` (refused unscreened).
    contributions: Family<Labels, Counter>,
    /// Screens decided by committees (`--screeners`), by who decided: `committee`
    /// or `shepherd`.
    decided: Family<Labels, Counter>,
    /// Screeners caught lying.
    caught: Counter,
}

/// Every series pcp exports.
#[derive(Debug)]
struct Metrics {
    registry: Registry,
    rounds: Counter,
    contributors: Gauge,
    mean_loss: FloatGauge,
    utilization: FloatGauge,
    val_loss: FloatGauge,
    train_loss: FloatGauge,
    tokens_per_second: FloatGauge,
    round_seconds: FloatGauge,
    round_bytes_in: Gauge,
    round_bytes_out: Gauge,
    round_update_bytes: Gauge,
    contributions: Contributions,
    aggregation: Aggregation,
    screening: Screening,
    messages_rejected: Counter,
    peers: Gauge,
    workers: Gauge,
    fetched_bytes: Counter,
    fetch_seconds: Counter<f64, AtomicU64>,
}

impl Metrics {
    fn new() -> Self {
        let mut registry = Registry::with_prefix("pcp");
        let metrics = Self {
            registry: Registry::default(),
            rounds: Counter::default(),
            contributors: Gauge::default(),
            mean_loss: FloatGauge::default(),
            utilization: FloatGauge::default(),
            val_loss: FloatGauge::default(),
            train_loss: FloatGauge::default(),
            tokens_per_second: FloatGauge::default(),
            round_seconds: FloatGauge::default(),
            round_bytes_in: Gauge::default(),
            round_bytes_out: Gauge::default(),
            round_update_bytes: Gauge::default(),
            contributions: Contributions::default(),
            aggregation: Aggregation::default(),
            screening: Screening::default(),
            messages_rejected: Counter::default(),
            peers: Gauge::default(),
            workers: Gauge::default(),
            fetched_bytes: Counter::default(),
            fetch_seconds: Counter::default(),
        };
        let r = &mut registry;
        r.register("rounds_completed", "DiLoCo rounds the shepherd completed", metrics.rounds.clone());
        r.register("round_contributors", "Contributions averaged in the last round", metrics.contributors.clone());
        r.register(
            "utilization",
            "Seconds in inner steps over wall seconds in the last round (a worker's own; a shepherd's contributors' together)",
            metrics.utilization.clone(),
        );
        r.register("round_mean_loss", "Mean inner loss of the last round's contributions", metrics.mean_loss.clone());
        r.register("val_loss", "Validation loss after the last round (or eval)", metrics.val_loss.clone());
        r.register("train_loss", "Loss of the last training step (pcp-node train)", metrics.train_loss.clone());
        r.register("tokens_per_second", "Training throughput of the last step", metrics.tokens_per_second.clone());
        r.register("round_seconds", "Duration of the last round", metrics.round_seconds.clone());
        r.register(
            "round_bytes_in",
            "Bytes of contributions received in the last round",
            metrics.round_bytes_in.clone(),
        );
        r.register("round_bytes_out", "Bytes served to workers in the last round", metrics.round_bytes_out.clone());
        r.register(
            "round_update_bytes",
            "Bytes of the last round's sparse update (0: dense runs publish parameters only)",
            metrics.round_update_bytes.clone(),
        );
        r.register(
            "contribution_bytes_up",
            "Bytes of contributions sent (a worker) or received (a shepherd)",
            metrics.contributions.bytes_up.clone(),
        );
        r.register(
            "contribution_bytes_down",
            "Parameter bytes workers fetched for the rounds they contributed to (their reports)",
            metrics.contributions.bytes_down.clone(),
        );
        let c = &metrics.contributions;
        r.register("contributions_rejected", "Contributions refused, by reason", c.rejected.clone());
        r.register("contributions_clipped", "Contributions scaled down to the norm bound", c.clipped.clone());
        r.register(
            "contributions_bounded",
            "Contributions the per-tensor bounds changed (values clipped, tensors scaled down)",
            c.bounded.clone(),
        );
        r.register(
            "contributions_discounted",
            "Contributions counted at less than their samples (probation, or a rating below the median)",
            c.discounted.clone(),
        );
        let a = &metrics.aggregation;
        r.register("shards_aggregated", "Shard means signed (an aggregator) or taken (a shepherd)", a.shards.clone());
        r.register(
            "shards_recomputed",
            "Shards the shepherd summed itself (a dispute, late votes, or a spot check)",
            a.recomputed.clone(),
        );
        r.register(
            "aggregate_disputes",
            "Shards whose aggregators lied or fell silent, and slices whose reports did",
            a.disputes.clone(),
        );
        r.register(
            "shard_aggregation_seconds",
            "Seconds from a round's close to its last shard mean (a shepherd) or to a signed mean (an aggregator)",
            a.seconds.clone(),
        );
        let s = &metrics.screening;
        r.register("screen_seconds", "Seconds the last round spent screening contributions", s.seconds.clone());
        r.register("screen_share", "The share of the last round spent screening", s.share.clone());
        r.register(
            "screen_contributions",
            "Contributions the score screen decided on, by outcome: screened, skipped (a rated peer not drawn past the \
             budget) or over_budget (refused unscreened); screened over all is the share screened",
            s.contributions.clone(),
        );
        r.register(
            "screen_decided",
            "Contributions screened by committees, by who decided: committee (every member agreeing) or shepherd \
             (no committee, a spot check, a disagreement or a silence); committee over all is the committees' share",
            s.decided.clone(),
        );
        r.register("screeners_caught", "Screeners whose losses contradicted the shepherd's own", s.caught.clone());
        r.register("messages_rejected", "Requests refused before they were read", metrics.messages_rejected.clone());
        r.register("peers", "Connected peers", metrics.peers.clone());
        r.register("workers", "Workers the shepherd counts as live", metrics.workers.clone());
        r.register("blob_fetched_bytes", "Bytes of blobs fetched from the network", metrics.fetched_bytes.clone());
        r.register("blob_fetch_seconds", "Seconds spent fetching those blobs", metrics.fetch_seconds.clone());
        Self { registry, ..metrics }
    }

    fn observe(&self, event: &Event) {
        let finite = |v: f64| v.is_finite().then_some(v);
        match event {
            Event::RoundCompleted(e) => {
                self.rounds.inc();
                let gauges = [
                    (&self.contributors, e.contributors),
                    (&self.round_bytes_in, e.bytes_in),
                    (&self.round_bytes_out, e.bytes_out),
                    (&self.round_update_bytes, e.update_bytes),
                ];
                for (gauge, v) in gauges {
                    gauge.set(i64::try_from(v).unwrap_or(i64::MAX));
                }
                let floats = [
                    (&self.mean_loss, finite(e.mean_loss)),
                    (&self.val_loss, finite(e.val_loss)),
                    (&self.round_seconds, finite(e.seconds)),
                    (&self.utilization, e.utilization),
                ];
                for (gauge, value) in floats {
                    if let Some(v) = value {
                        gauge.set(v);
                    }
                }
            }
            Event::Eval(e) => {
                if let Some(v) = finite(e.val_loss) {
                    self.val_loss.set(v);
                }
            }
            Event::Step(e) => {
                if let Some(v) = finite(e.loss) {
                    self.train_loss.set(v);
                }
                if let Some(v) = finite(e.tokens_per_s) {
                    self.tokens_per_second.set(v);
                }
            }
            Event::ContributionReceived(e) => {
                self.contributions.bytes_up.inc_by(e.bytes);
                self.contributions.bytes_down.inc_by(e.bytes_down);
            }
            Event::ContributionSent(e) => {
                if let Some(v) = e.utilization {
                    self.utilization.set(v);
                }
                self.contributions.bytes_up.inc_by(e.bytes_up);
                self.contributions.bytes_down.inc_by(e.bytes_down);
            }
            Event::ContributionRejected(e) => {
                self.contributions.rejected.get_or_create(&vec![("reason".into(), reason_kind(&e.reason))]).inc();
            }
            Event::ContributionClipped(_) => {
                self.contributions.clipped.inc();
            }
            Event::ContributionBounded(_) => {
                self.contributions.bounded.inc();
            }
            Event::ContributionDiscounted(_) => {
                self.contributions.discounted.inc();
            }
            Event::ShardAggregated(e) => {
                self.aggregation.shards.inc();
                if e.recomputed {
                    self.aggregation.recomputed.inc();
                }
                if let Some(v) = finite(e.seconds) {
                    self.aggregation.seconds.set(v);
                }
            }
            Event::AggregateDisputed(_) => {
                self.aggregation.disputes.inc();
            }
            Event::ScreenRound(e) => {
                self.screening.seconds.set(e.seconds);
                self.screening.share.set(e.share);
                for (outcome, n) in [("screened", e.screened), ("skipped", e.skipped), ("over_budget", e.over_budget)] {
                    self.screening.contributions.get_or_create(&vec![("outcome".into(), outcome.into())]).inc_by(n);
                }
            }
            Event::ScreenDecided(e) => {
                self.screening.decided.get_or_create(&vec![("source".into(), e.source.clone())]).inc();
            }
            Event::ScreenerCaught(_) => {
                self.screening.caught.inc();
            }
            Event::MessageRejected(_) => {
                self.messages_rejected.inc();
            }
            Event::PeerConnected(_) => {
                self.peers.inc();
            }
            Event::WorkerJoined(_) => {
                self.workers.inc();
            }
            Event::WorkerLeft(_) => {
                self.workers.dec();
            }
            Event::BlobFetched(e) => {
                self.fetched_bytes.inc_by(e.bytes);
                if let Some(v) = finite(e.seconds) {
                    self.fetch_seconds.inc_by(v);
                }
            }
            _ => {}
        }
    }

    fn text(&self) -> String {
        let mut out = String::new();
        // writing to a String cannot fail
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

/// A short label for a rejection: its reason up to the first `:` or `(`, at most
/// 40 characters (`no improvement`, `non-finite value in tensor 0`, `late`, …),
/// so that the label set stays small whatever the reasons carry.
fn reason_kind(reason: &str) -> String {
    let end = reason.find([':', '(']).unwrap_or(reason.len());
    let kind = reason[..end].trim();
    let kind: String = kind.chars().take(40).collect();
    if kind.is_empty() { "other".into() } else { kind }
}

static METRICS: OnceLock<Metrics> = OnceLock::new();

/// Counts an emitted event, once a metrics server was started in this process.
pub(crate) fn observe(event: &Event) {
    if let Some(metrics) = METRICS.get() {
        metrics.observe(event);
    }
}

/// The metrics endpoint; stops when dropped.
#[derive(Debug)]
pub(crate) struct Server {
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Why the endpoint could not start.
#[derive(Debug, thiserror::Error)]
#[error("--metrics-addr {addr}: {reason}")]
pub(crate) struct ServeError {
    addr: SocketAddr,
    reason: String,
}

/// Serves `/metrics` on `addr` (port 0 picks one) until the returned server is
/// dropped; nothing without an address.
pub(crate) async fn serve(addr: Option<SocketAddr>) -> Result<Option<Server>, ServeError> {
    let Some(addr) = addr else { return Ok(None) };
    let failed = |e: std::io::Error| ServeError { addr, reason: e.to_string() };
    let listener = TcpListener::bind(addr).await.map_err(failed)?;
    let addr = listener.local_addr().map_err(failed)?;
    let metrics = METRICS.get_or_init(Metrics::new);
    let task = tokio::spawn(accept(listener, metrics));
    tracing::info!("metrics at http://{addr}/metrics");
    Ok(Some(Server { task }))
}

async fn accept(listener: TcpListener, metrics: &'static Metrics) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                if connections.len() >= MAX_CONNECTIONS {
                    continue; // dropping the stream closes it
                }
                connections.spawn(async move {
                    let service = hyper::service::service_fn(move |request| respond(metrics, request));
                    let connection = hyper::server::conn::http1::Builder::new()
                        .timer(TokioTimer::new())
                        .header_read_timeout(CONNECTION_TIMEOUT)
                        .serve_connection(TokioIo::new(stream), service);
                    let _ = tokio::time::timeout(CONNECTION_TIMEOUT, connection).await;
                });
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

async fn respond(metrics: &Metrics, request: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let (status, content_type, body) = if request.method() == Method::GET && request.uri().path() == "/metrics" {
        (StatusCode::OK, "application/openmetrics-text; version=1.0.0; charset=utf-8", metrics.text())
    } else {
        (StatusCode::NOT_FOUND, "text/plain; charset=utf-8", "pcp serves only GET /metrics\n".to_owned())
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    if let Ok(value) = hyper::header::HeaderValue::from_str(content_type) {
        response.headers_mut().insert(hyper::header::CONTENT_TYPE, value);
    }
    Ok(response)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    impl Metrics {
        /// Observes the event `name` with `fields`, as it is written.
        fn observe_named(&self, name: &str, fields: &serde_json::Value) {
            self.observe(&Event::named(name, fields.clone()));
        }
    }

    #[test]
    fn events_become_series() {
        let m = Metrics::new();
        m.observe_named(
            "round_completed",
            &json!({"round": 1, "contributors": 3, "mean_loss": 2.5, "val_loss": 2.25, "seconds": 1.5,
                    "bytes_in": 1000, "bytes_out": 2000, "update_bytes": 300, "utilization": 0.75}),
        );
        m.observe_named("contribution_received", &json!({"bytes": 40, "bytes_down": 300}));
        m.observe_named("contribution_received", &json!({"bytes": 40, "bytes_down": 4000}));
        m.observe_named("contribution_rejected", &json!({"reason": "no improvement: held-out loss 2.0 with it"}));
        m.observe_named("contribution_rejected", &json!({"reason": "no improvement: held-out loss 3.0 with it"}));
        m.observe_named("contribution_rejected", &json!({"reason": "non-finite value in tensor 0"}));
        m.observe_named("peer_connected", &json!({}));
        m.observe_named("peer_connected", &json!({}));
        m.observe_named("blob_fetched", &json!({"bytes": 4096, "seconds": 0.5}));
        m.observe_named("shard_aggregated", &json!({"round": 2, "shard": 0, "recomputed": false, "seconds": 0.25}));
        m.observe_named("shard_aggregated", &json!({"round": 2, "shard": 1, "recomputed": true, "seconds": 1.5}));
        m.observe_named("aggregate_disputed", &json!({"round": 2, "shard": 1, "liars": ["a"]}));
        for (screened, skipped) in [(8, 0), (9, 3)] {
            m.observe_named(
                "screen_round",
                &json!({"round": 1, "screened": screened, "skipped": skipped, "over_budget": 1, "seconds": 2.5,
                        "share": 0.25, "hidden": true, "commit": "", "seed": ""}),
            );
        }
        for source in ["committee", "committee", "shepherd"] {
            m.observe_named("screen_decided", &json!({"round": 2, "source": source, "passed": true}));
        }
        m.observe_named("screener_caught", &json!({"round": 2, "screener": "a"}));
        let text = m.text();
        for line in [
            "pcp_rounds_completed_total 1",
            "pcp_round_contributors 3",
            "pcp_val_loss 2.25",
            "pcp_round_bytes_in 1000",
            "pcp_round_update_bytes 300",
            "pcp_utilization 0.75",
            "pcp_contribution_bytes_up_total 80",
            "pcp_contribution_bytes_down_total 4300",
            "pcp_contributions_rejected_total{reason=\"no improvement\"} 2",
            "pcp_contributions_rejected_total{reason=\"non-finite value in tensor 0\"} 1",
            "pcp_peers 2",
            "pcp_blob_fetched_bytes_total 4096",
            "pcp_blob_fetch_seconds_total 0.5",
            "pcp_shards_aggregated_total 2",
            "pcp_shards_recomputed_total 1",
            "pcp_aggregate_disputes_total 1",
            "pcp_shard_aggregation_seconds 1.5",
            "pcp_screen_seconds 2.5",
            "pcp_screen_share 0.25",
            "pcp_screen_contributions_total{outcome=\"screened\"} 17",
            "pcp_screen_contributions_total{outcome=\"skipped\"} 3",
            "pcp_screen_contributions_total{outcome=\"over_budget\"} 2",
            "pcp_screen_decided_total{source=\"committee\"} 2",
            "pcp_screen_decided_total{source=\"shepherd\"} 1",
            "pcp_screeners_caught_total 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing from\n{text}");
        }
        assert!(text.ends_with("# EOF\n"));
    }

    #[test]
    fn reasons_become_short_labels() {
        assert_eq!(reason_kind("late: round 3 closed"), "late");
        assert_eq!(reason_kind("norm 4.0 above the round's bound (x)"), "norm 4.0 above the round's bound");
        assert_eq!(reason_kind(""), "other");
        assert_eq!(reason_kind(&"x".repeat(100)).len(), 40);
    }
}
