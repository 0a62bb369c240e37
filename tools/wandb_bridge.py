#!/usr/bin/env python3
"""pcp -> Weights & Biases: log pcp-node's JSONL events to a wandb run.

pcp-node starts this script itself when wandb is enabled (see docs/running-a-run.md,
"Weights & Biases") and writes every event to its stdin, one JSON object per
line, as `--events FILE` would. It can also follow an events file:

    tail -n +1 -f events.jsonl | python tools/wandb_bridge.py --project pcp-distributed

The wandb run starts with the first event worth logging (so a standby candidate
that never leads creates no run) and finishes at the end of the input. Lines
that are not JSON objects are skipped with a warning on stderr.

`--dump RUN.wandb` prints an offline run's (`WANDB_MODE=offline`) project,
name, config, history and summary as one JSON object, without syncing it.
"""

import argparse
import json
import math
import os
import signal
import struct
import sys

# Series use the names of pcp's Prometheus metrics (`pcp-node --metrics-addr`),
# without the `pcp_` prefix; `round` and `step` are their x-axes.
ROUND_FIELDS = {
    "contributors": "round_contributors",
    "mean_loss": "round_mean_loss",
    "val_loss": "val_loss",
    "seconds": "round_seconds",
    "bytes_in": "round_bytes_in",
    "bytes_out": "round_bytes_out",
    "norm_bound": "round_norm_bound",
}
STEP_FIELDS = {"loss": "train_loss", "lr": "lr", "tokens_per_s": "tokens_per_second"}
MAX_WARNINGS = 10


def warn(message):
    print(f"wandb_bridge: {message}", file=sys.stderr, flush=True)


def number(value):
    """A JSON number as a float, or None for null, strings and booleans."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value


class Mapper:
    """Turns pcp events into wandb actions: ("config", dict), ("log", dict)
    and ("summary", dict). Counters (rejections, clips, peers, workers) add up
    over the run and are logged with each round."""

    def __init__(self):
        self.counters = {
            "contributions_rejected": 0,
            "contributions_clipped": 0,
            "messages_rejected": 0,
            "blob_fetched_bytes": 0,
        }
        self.gauges = {"peers": 0, "workers": 0}

    def feed(self, event):
        name = event.get("event")
        handler = getattr(self, "on_" + name, None) if isinstance(name, str) else None
        return handler(event) if handler else []

    def on_round_completed(self, e):
        r = number(e.get("round"))
        if r is None:
            return []
        metrics = {"round": int(r)}
        for field, key in ROUND_FIELDS.items():
            v = number(e.get(field))
            if v is not None:
                metrics[key] = v
        if isinstance(e.get("excluded"), list):
            metrics["round_excluded"] = len(e["excluded"])
        metrics.update(self.counters)
        metrics.update(self.gauges)
        return [("log", metrics)]

    def on_step(self, e):
        s = number(e.get("step"))
        if s is None:
            return []
        metrics = {"step": int(s)}
        for field, key in STEP_FIELDS.items():
            v = number(e.get(field))
            if v is not None:
                metrics[key] = v
        return [("log", metrics)]

    def on_eval(self, e):
        s, v = number(e.get("step")), number(e.get("val_loss"))
        return [("log", {"step": int(s), "val_loss": v})] if s is not None and v is not None else []

    def on_run_started(self, e):
        keys = ("run", "model", "rounds", "tau", "resumed_round")
        return [("config", {f"pcp_{k}": e[k] for k in keys if e.get(k) is not None})]

    def on_shepherd_elected(self, e):
        return [("summary", {"leader_term": e.get("term")})] if e.get("term") is not None else []

    def on_run_finished(self, e):
        # a worker's run_finished (in `sim`, one process) has no val_loss
        if "val_loss" not in e:
            return []
        summary = {"rounds_completed": e.get("rounds"), "run_seconds": e.get("seconds")}
        if number(e.get("val_loss")) is not None:
            summary["final_val_loss"] = e["val_loss"]
        return [("summary", {k: v for k, v in summary.items() if v is not None})]

    def on_contribution_rejected(self, _e):
        self.counters["contributions_rejected"] += 1
        return []

    def on_contribution_clipped(self, _e):
        self.counters["contributions_clipped"] += 1
        return []

    def on_message_rejected(self, _e):
        self.counters["messages_rejected"] += 1
        return []

    def on_blob_fetched(self, e):
        self.counters["blob_fetched_bytes"] += int(number(e.get("bytes")) or 0)
        return []

    def on_peer_connected(self, _e):
        self.gauges["peers"] += 1
        return []

    def on_peer_disconnected(self, _e):
        self.gauges["peers"] = max(0, self.gauges["peers"] - 1)
        return []

    def on_worker_joined(self, _e):
        self.gauges["workers"] += 1
        return []

    def on_worker_left(self, _e):
        self.gauges["workers"] = max(0, self.gauges["workers"] - 1)
        return []


class Bridge:
    """Applies a Mapper's actions to the `wandb` module, starting the run with
    the first of them."""

    def __init__(self, wandb, init_args):
        self.wandb = wandb
        self.init_args = init_args
        self.run = None
        self.axes = {}
        self.warnings = 0

    def warn(self, message):
        if self.warnings < MAX_WARNINGS:
            warn(message)
        elif self.warnings == MAX_WARNINGS:
            warn("more warnings are not shown")
        self.warnings += 1

    def start(self):
        if self.run is None:
            self.run = self.wandb.init(**self.init_args)
            self.wandb.define_metric("round")
            self.wandb.define_metric("step")

    def apply(self, actions):
        for kind, payload in actions:
            if not payload:
                continue
            self.start()
            if kind == "config":
                self.run.config.update(payload, allow_val_change=True)
            elif kind == "summary":
                for k, v in payload.items():
                    self.run.summary[k] = v
            elif kind == "log":
                axis = "round" if "round" in payload else "step"
                for key in payload:
                    if key not in ("round", "step") and key not in self.axes:
                        self.axes[key] = axis
                        self.wandb.define_metric(key, step_metric=axis)
                self.wandb.log({k: v for k, v in payload.items() if not _nan(v)})

    def finish(self):
        if self.run is not None:
            self.wandb.finish()


def _nan(value):
    return isinstance(value, float) and math.isnan(value)


def run(lines, bridge, mapper):
    """Feeds every line to the bridge; returns how many were malformed."""
    malformed = 0
    for number_, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            event = json.loads(line)
            if not isinstance(event, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            malformed += 1
            bridge.warn(f"line {number_} skipped: {str(e).splitlines()[0][:120]}")
            continue
        try:
            bridge.apply(mapper.feed(event))
        except Exception as e:  # wandb errors must not stop the stream
            if bridge.run is None:
                raise
            bridge.warn(f"event {event.get('event')!r} not logged: {type(e).__name__}: {e}")
    return malformed


def events_from_stdin():
    """Stdin as lines; fd 0 becomes /dev/null so that processes wandb starts do
    not hold the pipe open (pcp-node sees the bridge exit as a closed pipe)."""
    fd = os.dup(0)  # not inherited by children
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    return os.fdopen(fd, "r", encoding="utf-8", errors="replace")


def dump(path):
    """An offline run file as a dict: the W&B record log (32 KiB blocks of
    checksummed chunks) of `wandb_internal_pb2.Record`s."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a wandb run file")
    out = {"project": None, "name": None, "entity": None, "job_type": None}
    out.update(config={}, history=[], summary={})

    def items(entries):
        return {e.key or "/".join(e.nested_key): json.loads(e.value_json) for e in entries}

    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (2, 3):  # first, middle
            pending += chunk
            continue
        if kind not in (1, 4):  # full, last
            continue
        record = pb.Record()
        record.ParseFromString(pending + chunk)
        pending = b""
        which = record.WhichOneof("record_type")
        if which == "run":
            run = record.run
            out.update(project=run.project, name=run.display_name, entity=run.entity, job_type=run.job_type)
            out["config"].update(items(record.run.config.update))
        elif which == "config":
            out["config"].update(items(record.config.update))
        elif which == "history":
            out["history"].append(items(record.history.item))
        elif which == "summary":
            out["summary"].update(items(record.summary.update))
    out["config"].pop("_wandb", None)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="wandb_bridge.py", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--project", help="wandb project [default: $WANDB_PROJECT, else pcp-distributed]")
    p.add_argument("--entity", help="wandb team or user [default: yours]")
    p.add_argument("--name", help="the run's name [default: wandb picks one]")
    p.add_argument("--job-type", help="shepherd, sim or train")
    p.add_argument("--config", default="{}", help="the run's config as a JSON object")
    p.add_argument("--dump", metavar="RUN.wandb", help="print an offline run as JSON and exit")
    args = p.parse_args(argv)
    if args.dump:
        print(json.dumps(dump(args.dump), indent=1, sort_keys=True))
        return 0
    # pcp-node ends the stream when it stops; a Ctrl-C meant for it must not
    # cut the run short here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    lines = events_from_stdin()
    try:
        import wandb
    except ImportError as e:
        warn(f"cannot import wandb ({e}); install it (scripts/setup.sh); not reporting to wandb")
        return 1
    try:
        config = json.loads(args.config)
    except ValueError:
        warn("--config is not JSON; starting the run without it")
        config = {}
    init_args = {
        "project": args.project or os.environ.get("WANDB_PROJECT") or "pcp-distributed",
        "entity": args.entity,
        "name": args.name,
        "job_type": args.job_type,
        "config": config if isinstance(config, dict) else {},
    }
    bridge = Bridge(wandb, {k: v for k, v in init_args.items() if v is not None})
    try:
        malformed = run(lines, bridge, Mapper())
    except Exception as e:
        warn(f"cannot start the wandb run: {type(e).__name__}: {e}; not reporting to wandb")
        return 1
    if malformed:
        warn(f"{malformed} malformed line(s) skipped")
    bridge.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
