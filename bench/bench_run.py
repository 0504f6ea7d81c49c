"""One scenario of ``prefixgate bench``: every system in turn on a fresh fleet, with a progress bar."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from bench.replay import TraceReplayConfig, TurnResult
from bench.system_run import run_system
from bench.traces import TraceSession

if TYPE_CHECKING:  # psutil (the ``bench`` extra) is imported only when a benchmark runs
    from bench.systems import FleetConfig, SystemSpec


class ScenarioRun:
    """The systems of one scenario (one speed, one pressure), run one after the other."""

    def __init__(
        self,
        name: str,
        systems: Sequence[SystemSpec],
        sessions: list[TraceSession],
        fleet: FleetConfig,
        replay: TraceReplayConfig,
        n_requests: int,
        args: argparse.Namespace,
    ) -> None:
        self.name = name
        self.systems = systems
        self.sessions = sessions
        self.fleet = fleet
        self.replay = replay
        self.n_requests = n_requests
        self.args = args

    def run(self, prefixgate_args: Sequence[str]) -> tuple[dict[str, dict[str, Any]], bool]:
        """Each system's summary (``{"failed": why}`` for one that did not finish), and whether any
        failed or had errors."""
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        results: dict[str, dict[str, Any]] = {}
        failed = False
        with Progress(
            TextColumn("{task.description:<48}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[hits]}"),
        ) as progress:
            for spec in self.systems:
                task = progress.add_task(f"{self.name}: {spec.name}", total=self.n_requests, hits="")
                tally = [0, 0]

                def on_turn(turn: TurnResult, task: Any = task, tally: list[int] = tally) -> None:
                    tally[0] += turn.prompt_tokens
                    tally[1] += turn.cached_tokens
                    hits = f"hit rate {tally[1] / tally[0]:.3f}" if tally[0] else ""
                    progress.update(task, advance=1, hits=hits)

                try:
                    results[spec.name] = run_system(
                        spec,
                        self.sessions,
                        self.fleet,
                        self.replay,
                        self.args.out,
                        on_turn,
                        prefixgate_args,
                        self.args.prefixgate_root,
                    )
                except Exception as exc:  # one system failing must not lose the others' results
                    results[spec.name] = {"failed": f"{type(exc).__name__}: {exc}"}
                    failed = True
                if results[spec.name].get("errors"):
                    failed = True
                progress.update(task, total=progress.tasks[task].completed)  # stop its clock
        return results, failed

    def plots(self, results: dict[str, dict[str, Any]]) -> None:
        done = {n: r for n, r in results.items() if "failed" not in r}
        if not done:
            return
        from bench.plots import write_plots

        bound = next(iter(done.values()))["bound"]
        paths = write_plots(self.name, done, bound, self.args.out)
        print("plots: " + ", ".join(str(p) for p in paths))
