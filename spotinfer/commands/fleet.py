"""`spotinfer fleet`: the cloud side of a spot fleet (list, scale, replace, drill, notices).

    spotinfer fleet list    --cloud aws --fleet-name prod --region us-east-1
    spotinfer fleet scale   --cloud gcp --fleet-name prod --region us-central1 --project p --workers 6
    spotinfer fleet fallback --cloud aws ... [--workers N]     (on-demand fallback group)
    spotinfer fleet fallback --cloud aws ... --auto [--every S] (size it from the spot side)
    spotinfer fleet replace --cloud aws ... i-0abc i-0def      (or --lost)
    spotinfer fleet drill   --cloud aws ...                    (FIS spot interruption)
    spotinfer fleet drill   --cloud gcp ... [--target NAME]    (simulateMaintenanceEvent)
    spotinfer fleet drill-status --cloud aws ... DRILL_ID
    spotinfer fleet notices --cloud aws ... [--follow]         (EventBridge notices, JSON lines)

The location flags (--fleet-name, --region, ...) are derived from the fields of
``spotinfer.fleet.config``; the cloud SDKs are imported by the handlers only.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import signal
import sys
import threading
import time
import typing
from collections.abc import Iterator, Sequence
from typing import Any

from common.errors import UserError
from spotinfer.fleet.adapter import Fleet, connect_fleet, fleet_class, registered_clouds
from spotinfer.fleet.config import AwsFleetConfig, GcpFleetConfig
from spotinfer.fleet.errors import FleetError
from spotinfer.fleet.fallback import FallbackDecision, autoscale_fallback, autoscale_rounds

DRILL_POLL_INTERVAL_SECONDS = 10.0


def _location_flags() -> dict[str, str]:
    """Every config field of every cloud, once each, with its help (per cloud where it differs)."""
    helps: dict[str, dict[str, str]] = {}
    for cloud, config_class in (("aws", AwsFleetConfig), ("gcp", GcpFleetConfig)):
        for config_field in dataclasses.fields(config_class):
            helps.setdefault(config_field.name, {})[cloud] = config_field.metadata.get("help", "")
    return {
        name: next(iter(by_cloud.values()))
        if len(set(by_cloud.values())) == 1
        else "; ".join(f"{cloud.upper()}: {text}" for cloud, text in by_cloud.items())
        for name, by_cloud in helps.items()
    }


def _flag(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _add_location_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cloud", required=True, choices=registered_clouds(), help="the cloud")
    for name, help_text in _location_flags().items():
        parser.add_argument(_flag(name), dest=name, default=None, help=help_text)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "fleet",
        help="list, scale, repair and drill a spot fleet in AWS or GCP",
        description=(
            "Operate the worker fleet that infra/terraform created: workers are found by the "
            "fleet's tag (AWS) or label (GCP)."
        ),
    )
    actions = parser.add_subparsers(dest="fleet_action", metavar="ACTION", required=True)

    listing = actions.add_parser("list", help="the fleet's workers and their states")
    _add_location_flags(listing)
    listing.set_defaults(func=run_list)

    scale = actions.add_parser("scale", help="set the number of workers")
    _add_location_flags(scale)
    scale.add_argument("--workers", required=True, help="the number of workers wanted")
    scale.set_defaults(func=run_scale)

    fallback = actions.add_parser(
        "fallback", help="show or set the number of on-demand fallback workers"
    )
    _add_location_flags(fallback)
    fallback.add_argument(
        "--workers",
        default=None,
        help="the number of fallback workers wanted (0 releases them); without it, show the group",
    )
    fallback.add_argument(
        "--auto",
        action="store_true",
        help="size the group from the spot side: cover the spot workers' shortfall (up to its "
        "maximum), release it all once they are back",
    )
    fallback.add_argument(
        "--every",
        default=None,
        metavar="SECONDS",
        help="with --auto: repeat every SECONDS until interrupted (SIGINT / SIGTERM)",
    )
    fallback.set_defaults(func=run_fallback)

    replace = actions.add_parser(
        "replace", help="replace workers with fresh ones (capacity is kept)"
    )
    _add_location_flags(replace)
    replace.add_argument("instances", nargs="*", help="instance ids (AWS) or names (GCP)")
    replace.add_argument(
        "--lost", action="store_true", help="replace every stopped or unhealthy worker"
    )
    replace.set_defaults(func=run_replace)

    drill = actions.add_parser(
        "drill", help="start a preemption drill (AWS FIS / GCP simulated maintenance)"
    )
    _add_location_flags(drill)
    drill.add_argument(
        "--target",
        default=None,
        help="AWS: FIS template id (default: the one tagged with the fleet); "
        "GCP: instance name (default: the first running spot worker)",
    )
    drill.add_argument(
        "--wait-seconds",
        default="0",
        help="poll the drill until it ends or this many seconds pass (default: 0, no wait)",
    )
    drill.set_defaults(func=run_drill)

    status = actions.add_parser("drill-status", help="the state of a drill")
    _add_location_flags(status)
    status.add_argument("drill_id", help="the id `spotinfer fleet drill` printed")
    status.set_defaults(func=run_drill_status)

    notices = actions.add_parser(
        "notices", help="spot notices of the fleet's workers (AWS: EventBridge queue)"
    )
    _add_location_flags(notices)
    notices.add_argument("--queue-url", default=None, help="default: the queue FLEET-spot-notices")
    notices.add_argument("--wait-seconds", default="20", help="long-poll wait, 0-20 (default 20)")
    notices.add_argument("--follow", action="store_true", help="keep reading until interrupted")
    notices.set_defaults(func=run_notices)


# ---- helpers ------------------------------------------------------------------------------


def _whole_number(flag: str, text: str, minimum: int = 0) -> int:
    try:
        value = int(text)
    except ValueError:
        raise UserError(f"{flag} must be a whole number, got {text!r}") from None
    if value < minimum:
        raise UserError(f"{flag} must be at least {minimum}, got {value}")
    return value


def _config(args: argparse.Namespace) -> Any:
    config_class = fleet_class(args.cloud).config_class
    config_fields = dataclasses.fields(config_class)
    missing = [
        _flag(config_field.name)
        for config_field in config_fields
        if config_field.default is dataclasses.MISSING and getattr(args, config_field.name) is None
    ]
    if missing:
        raise UserError(f"--cloud {args.cloud} needs {', '.join(missing)}")
    # Flags arrive as text; a whole-number field (GCP's fallback_max_count) is converted here.
    hints = typing.get_type_hints(config_class)
    given = {
        config_field.name: _whole_number(_flag(config_field.name), value)
        if int in typing.get_args(hints[config_field.name])
        else value
        for config_field in config_fields
        if (value := getattr(args, config_field.name)) is not None
    }
    try:
        return config_class(**given)
    except ValueError as error:
        raise UserError(str(error)) from error


def _connect(args: argparse.Namespace) -> Fleet:
    try:
        return connect_fleet(args.cloud, _config(args))
    except FleetError as error:
        raise UserError(str(error)) from error


def _print_rows(rows: Sequence[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        print(json.dumps(list(rows), indent=2))
        return
    if not rows:
        print("(none)")
        return
    columns = list(rows[0])
    widths = {
        column: max(len(column), *(len(str(row[column])) for row in rows)) for column in columns
    }
    print("  ".join(column.upper().ljust(widths[column]) for column in columns).rstrip())
    for row in rows:
        print("  ".join(str(row[column]).ljust(widths[column]) for column in columns).rstrip())


# ---- handlers -----------------------------------------------------------------------------


def run_list(args: argparse.Namespace) -> int:
    fleet = _connect(args)
    try:
        workers = fleet.list_workers()
    except FleetError as error:
        raise UserError(str(error)) from error
    _print_rows([worker.as_row() for worker in workers], args.json)
    return 0


def run_scale(args: argparse.Namespace) -> int:
    worker_count = _whole_number("--workers", args.workers)
    fleet = _connect(args)
    try:
        fleet.set_capacity(worker_count)
    except FleetError as error:
        raise UserError(str(error)) from error
    print(f"asked {args.cloud} for {worker_count} workers")
    return 0


def run_fallback(args: argparse.Namespace) -> int:
    if args.every is not None and not args.auto:
        raise UserError("--every repeats --auto; pass --auto too")
    if args.auto and args.workers is not None:
        raise UserError("--auto sizes the fallback group itself; drop --workers")
    if args.auto:
        every_seconds = None if args.every is None else _whole_number("--every", args.every, 1)
        return _autoscale(_connect(args), every_seconds, args.json)
    worker_count = None if args.workers is None else _whole_number("--workers", args.workers)
    fleet = _connect(args)
    try:
        if worker_count is None:
            _print_rows([fleet.fallback_capacity().as_row()], args.json)
            return 0
        fleet.set_fallback_capacity(worker_count)
    except FleetError as error:
        raise UserError(str(error)) from error
    print(f"asked {args.cloud} for {worker_count} fallback workers")
    return 0


def _print_decision(decision: FallbackDecision, as_json: bool, stamped: bool) -> None:
    if as_json:
        print(json.dumps(decision.as_row()), flush=True)
        return
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S ") if stamped else ""
    print(f"{stamp}{decision.describe()}", flush=True)


def _autoscale(fleet: Fleet, every_seconds: int | None, as_json: bool) -> int:
    if every_seconds is None:
        try:
            decision = autoscale_fallback(fleet)
        except FleetError as error:
            raise UserError(str(error)) from error
        _print_decision(decision, as_json, stamped=False)
        return 0
    stop = threading.Event()
    with _stopped_by_signals(stop):
        for outcome in autoscale_rounds(fleet, every_seconds, stop):
            if isinstance(outcome, FleetError):
                print(
                    f"fallback round failed, retrying in {every_seconds} s: {outcome}",
                    file=sys.stderr,
                    flush=True,
                )
            else:
                _print_decision(outcome, as_json, stamped=True)
    print("stopped", file=sys.stderr)
    return 0


@contextlib.contextmanager
def _stopped_by_signals(stop: threading.Event) -> Iterator[None]:
    """SIGINT and SIGTERM set ``stop`` while inside; the previous handlers come back after."""

    def handle(signum: int, frame: Any) -> None:
        # Set from another thread: the handler runs in the main thread, which may hold the
        # Event's (non-reentrant) lock inside stop.wait() at that moment.
        threading.Thread(target=stop.set, daemon=True).start()

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_replace(args: argparse.Namespace) -> int:
    if bool(args.instances) == bool(args.lost):
        raise UserError("name the instances to replace, or pass --lost (not both)")
    fleet = _connect(args)
    try:
        replaced = fleet.replace_lost() if args.lost else fleet.replace(args.instances)
    except FleetError as error:
        raise UserError(str(error)) from error
    if args.json:
        print(json.dumps({"replaced": replaced}))
    else:
        print(f"replacing: {' '.join(replaced)}" if replaced else "nothing to replace")
    return 0


def run_drill(args: argparse.Namespace) -> int:
    wait_seconds = _whole_number("--wait-seconds", args.wait_seconds)
    fleet = _connect(args)
    try:
        drill = fleet.start_drill(args.target)
        deadline = time.monotonic() + wait_seconds
        while not drill.state.is_final and time.monotonic() < deadline:
            time.sleep(min(DRILL_POLL_INTERVAL_SECONDS, max(0.0, deadline - time.monotonic())))
            drill = fleet.drill_status(drill.drill_id)
    except FleetError as error:
        raise UserError(str(error)) from error
    _print_rows([drill.as_row()], args.json)
    if not args.json:
        print(
            f"follow it with: spotinfer fleet drill-status --cloud {args.cloud} ... {drill.drill_id}"
        )
    return 0


def run_drill_status(args: argparse.Namespace) -> int:
    fleet = _connect(args)
    try:
        drill = fleet.drill_status(args.drill_id)
    except FleetError as error:
        raise UserError(str(error)) from error
    _print_rows([drill.as_row()], args.json)
    return 0


def run_notices(args: argparse.Namespace) -> int:
    from spotinfer.fleet.aws import AwsFleet

    wait_seconds = _whole_number("--wait-seconds", args.wait_seconds)
    fleet = _connect(args)
    if not isinstance(fleet, AwsFleet):
        raise UserError(
            "notices are read from the AWS EventBridge queue; on GCP each worker's daemon "
            "reads its own notice from the metadata server"
        )
    try:
        while True:
            # JSON lines: one notice per line, flushed, so it can be piped while following.
            for notice in fleet.receive_notices(args.queue_url, wait_seconds):
                print(json.dumps(notice.as_row()), flush=True)
            if not args.follow:
                return 0
    except FleetError as error:
        raise UserError(str(error)) from error
    finally:
        sys.stdout.flush()
