"""`spotinfer batch`: offline jobs through the coordinator's Batch API.

    spotinfer batch submit FILE.jsonl [--endpoint /v1/completions] [--no-wait]
    spotinfer batch status BATCH_ID        spotinfer batch list
    spotinfer batch results BATCH_ID [--out FILE] [--errors FILE]
    spotinfer batch cancel BATCH_ID

`submit` uploads the file, starts the job and, unless told not to, follows it with a
progress bar until it ends (Ctrl-C leaves the job running: it lives in the cluster).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from common.errors import UserError

DEFAULT_HTTP_URL = "http://127.0.0.1:8000"
POLL_SECONDS = 1.0
FINAL = ("completed", "failed", "expired", "cancelled")


def register(subparsers: Any) -> None:
    batch: argparse.ArgumentParser = subparsers.add_parser(
        "batch", help="offline jobs (JSONL in, JSONL out) through the Batch API"
    )
    actions = batch.add_subparsers(dest="action", metavar="ACTION", required=True)
    submit = actions.add_parser("submit", help="upload FILE.jsonl and run it as a batch job")
    submit.add_argument("file", type=Path)
    submit.add_argument(
        "--endpoint",
        default="",
        help="/v1/completions or /v1/chat/completions (default: the file's url)",
    )
    submit.add_argument("--no-wait", action="store_true", help="print the job id and leave")
    status = actions.add_parser("status", help="a job's state and request counts")
    status.add_argument("batch_id")
    actions.add_parser("list", help="the most recent jobs")
    results = actions.add_parser("results", help="write a job's output (and error) file")
    results.add_argument("batch_id")
    results.add_argument("--out", type=Path, default=None, help="default: stdout")
    results.add_argument("--errors", type=Path, default=None, help="the error file, if any")
    cancel = actions.add_parser("cancel", help="cancel a job (finished lines are kept)")
    cancel.add_argument("batch_id")
    for parser in (submit, status, results, cancel, actions.choices["list"]):
        parser.add_argument(
            "--url",
            default=os.environ.get("SPOTINFER_HTTP_URL", DEFAULT_HTTP_URL),
            help=f"the coordinator's HTTP front (env SPOTINFER_HTTP_URL; {DEFAULT_HTTP_URL})",
        )
        parser.add_argument("--ca-file", default=os.environ.get("SPOTINFER_CA_FILE", ""))
        parser.add_argument("--api-key", default=os.environ.get("SPOTINFER_API_KEY", ""))
    batch.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from spotinfer.batch_client import BatchApiError, BatchClient

    client = BatchClient(args.url, args.api_key, args.ca_file)
    try:
        return int(_ACTIONS[args.action](client, args))
    except BatchApiError as exc:
        raise UserError(str(exc)) from exc
    except OSError as exc:
        raise UserError(f"cannot reach the coordinator's HTTP front at {args.url}: {exc}") from exc


def _submit(client: Any, args: argparse.Namespace) -> int:
    try:
        content = args.file.read_bytes()
    except OSError as exc:
        raise UserError(f"{args.file}: {exc}") from exc
    endpoint = args.endpoint or _first_url(content)
    uploaded = client.upload(args.file.name, content)
    job = client.create(uploaded["id"], endpoint)
    print(f"batch {job['id']} ({job['request_counts']['total']} requests, {endpoint})")
    if args.no_wait:
        return 0
    job = follow(client, job)
    _print_job(job)
    return 0 if job["status"] == "completed" else 1


def _first_url(content: bytes) -> str:
    for raw in content.decode(errors="replace").splitlines():
        if raw.strip():
            try:
                return str(json.loads(raw).get("url", "/v1/completions"))
            except (ValueError, AttributeError):
                break
    return "/v1/completions"


def follow(client: Any, job: dict[str, Any]) -> dict[str, Any]:
    """A rich progress bar of the job's finished requests until it ends."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[state]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns) as progress:
        counts = job["request_counts"]
        task = progress.add_task(job["id"], total=counts["total"], state=job["status"])
        while True:
            counts = job["request_counts"]
            moved = job.get("spotinfer", {})
            state = f"{job['status']}, {counts['failed']} failed, {moved.get('migrated_lines', 0)} moved"
            progress.update(task, completed=counts["completed"] + counts["failed"], state=state)
            if job["status"] in FINAL:
                return job
            time.sleep(POLL_SECONDS)
            try:
                job = client.get(job["id"])
            except OSError:  # the coordinator restarting: the job goes on
                continue


def _print_job(job: dict[str, Any]) -> None:
    counts = job["request_counts"]
    print(
        f"{job['id']}: {job['status']}; {counts['completed']}/{counts['total']} completed, "
        f"{counts['failed']} failed; output {job.get('output_file_id') or '-'}, "
        f"errors {job.get('error_file_id') or '-'}; {json.dumps(job.get('spotinfer', {}))}"
    )


def _status(client: Any, args: argparse.Namespace) -> int:
    _print_job(client.get(args.batch_id))
    return 0


def _list(client: Any, args: argparse.Namespace) -> int:
    for job in client.page()["data"]:
        _print_job(job)
    return 0


def _results(client: Any, args: argparse.Namespace) -> int:
    job = client.get(args.batch_id)
    if job["status"] not in FINAL:
        raise UserError(f"batch {args.batch_id} is {job['status']}: no results yet")
    output = client.content(job["output_file_id"]) if job.get("output_file_id") else b""
    if args.out is None:
        sys.stdout.write(output.decode())
    else:
        args.out.write_bytes(output)
    if args.errors is not None and job.get("error_file_id"):
        args.errors.write_bytes(client.content(job["error_file_id"]))
    return 0


def _cancel(client: Any, args: argparse.Namespace) -> int:
    _print_job(client.cancel(args.batch_id))
    return 0


_ACTIONS = {
    "submit": _submit,
    "status": _status,
    "list": _list,
    "results": _results,
    "cancel": _cancel,
}
