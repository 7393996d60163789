"""Following an instance (`--wait`, `wait`, `watch`): its watch stream read, its state changes and
steps printed as they happen, until a state, a spec generation applied, or a deadline."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import Any

from controlplane.cli.client import Api, WaitTimeout, instance_path
from controlplane.cli.common import cell_text
from controlplane.cli.render import step_summary
from controlplane.core import lifecycle

TERMINAL = lifecycle.INSTANCE.terminal


class Follower:
    """Prints, as they happen, an instance's state changes and steps, with the time since it started."""

    def __init__(self, as_json: bool) -> None:
        # Machine-readable output follows: the lines are not printed.
        self.quiet = as_json
        self.started = time.monotonic()
        self.last_state: str | None = None
        # (step, attempt, state) lines printed: each once.
        self.printed: set[tuple[str, int, str]] = set()
        self.warned_overdue = False

    def _print(self, text: str) -> None:
        if not self.quiet:
            print(f"[{time.monotonic() - self.started:6.1f}s] {text}", flush=True)

    def instance(self, instance: dict[str, Any]) -> None:
        if instance["state"] != self.last_state:
            info = instance.get("state_info") or {}
            label = f" ({info['label']})" if info.get("label") else ""
            self._print(f"{instance['state']}{label}")
            self.last_state = instance["state"]
        progress = instance.get("progress")
        if progress:
            for step in progress["steps"]:
                if step["state"] != "pending":  # under way before following started
                    self._step_line(step["name"], step["label"], max(1, step["attempts"]), step)
            self._overdue(progress)

    def step(self, event: dict[str, Any]) -> None:
        state = {"started": "running", "finished": "done", "failed": "failed"}[event["event"]]
        step = {
            "state": state,
            "attempts": event["attempt"],
            "duration_s": event["duration_s"],
            "expected_s": None,
            "failure": event.get("failure"),
        }
        self._step_line(event["step"], event["label"], event["attempt"], step)
        if event.get("progress"):
            self._overdue(event["progress"])

    def _step_line(self, name: str, label: str, attempt: int, step: dict[str, Any]) -> None:
        key = (name, attempt, step["state"])
        ended = {(name, attempt, "done"), (name, attempt, "failed")}
        # Each line once, and never a start after that attempt's end (a late or replayed event).
        if key in self.printed or (step["state"] == "running" and ended & self.printed):
            return
        self.printed.add(key)
        if step["state"] == "running":
            text = f"started (attempt {attempt})" if attempt > 1 else "started"
        else:
            text = step_summary({**step, "attempts": attempt})
        self._print(f"  {label}: {text}")

    def _overdue(self, progress: dict[str, Any]) -> None:
        if progress.get("overdue") and not self.warned_overdue:
            self.warned_overdue = True
            expected = progress.get("expected_by")
            self._print(f"  taking longer than expected (expected by {expected and cell_text(expected)})")


def _updates(
    api: Api, ref: str, follower: Follower | None = None, deadline: float | None = None
) -> Iterator[dict[str, Any]]:
    """The instance as it is now, then as it is after each change its watch stream announces; its
    steps go to `follower` as they happen. WaitTimeout at `deadline`. A name is looked up once: by
    id from then on, since a deleted instance's name may soon mean another one, or several."""
    first = api.request("GET", f"/v1/instances/{instance_path(ref)}")
    yield first
    path = f"/v1/instances/{instance_path(str(first['id']))}"
    for name, data in api.stream_events(str(first["id"]), deadline=deadline):
        if name == "step":
            if follower is not None:
                follower.step(data)
            continue
        yield api.request("GET", path)


def follow(
    api: Api, ref: str, until: tuple[str, ...], quiet: bool, deadline: float | None = None
) -> dict[str, Any]:
    """Print each state change and step until the instance reaches one of `until` (or a terminal
    state); WaitTimeout (exit code 5) at `deadline`, saying where it is."""
    follower = Follower(quiet)
    instance: dict[str, Any] = {}
    try:
        for instance in _updates(api, ref, follower, deadline):
            follower.instance(instance)
            if instance["state"] in until or instance["state"] in TERMINAL:
                break
    except WaitTimeout:
        where = f" (it is {instance['state']})" if instance else ""
        name = instance.get("name") or ref
        raise WaitTimeout(f"timed out waiting for {name} to be {' or '.join(until)}{where}") from None
    return instance


def wait_for_generation(
    api: Api,
    instance_id: str,
    generation: int,
    quiet: bool,
    deadline: float,
    *,
    plan: str,
    through_suspension: bool,
) -> dict[str, Any]:
    """The instance once spec `generation` is applied, given up, or can no longer be; or, unless
    `through_suspension`, as soon as it is suspended (said at once on stderr: the change waits
    for the instance to resume). WaitTimeout at `deadline`."""
    told = False
    instance: dict[str, Any] = {}
    follower = Follower(quiet)  # the same lines as `create --wait`: state changes and steps
    try:
        for instance in _updates(api, instance_id, follower, deadline):
            follower.instance(instance)
            done = instance["observed_generation"] >= generation and instance["state"] == "ready"
            given_up = (instance.get("failed_generation") or 0) >= generation
            if done or given_up or instance["state"] in (*TERMINAL, "degraded"):
                return instance
            if instance["state"] == "suspended" and not told:
                told = True
                line = _suspended_line(instance, plan, generation, through_suspension)
                print(line, file=sys.stderr, flush=True)
                if not through_suspension:
                    return instance
    except WaitTimeout:
        where = f" (it is {instance['state']})" if instance else ""
        raise WaitTimeout(
            f"timed out waiting for the resize of {instance.get('name', instance_id)}{where}"
        ) from None
    return instance


def _suspended_line(instance: dict[str, Any], plan: str, generation: int, waiting: bool) -> str:
    held = "suspended by a billing hold" if instance.get("billing_hold") else "suspended"
    until = "once the hold ends and it resumes" if instance.get("billing_hold") else "once it resumes"
    then = "waiting for that (--wait-for-resume)" if waiting else "pass --wait-for-resume to wait for that"
    return (
        f"controlplane: resize to {plan} is recorded (spec generation {generation});"
        f" {instance['id']} is {held}: the change is applied {until}; {then}"
    )
