"""A stand-in for ``schedule.build_work_list`` that the Gluon launch tests put in its place: it
counts the list's launches and keeps their arguments, then runs the real kernel."""

from __future__ import annotations

from thd.ops.attention.gluon import schedule


class WorkListBuilds:
    """``schedule.build_work_list`` that counts its launches, keeps their arguments and runs them."""

    def __init__(self) -> None:
        self.real = schedule.build_work_list
        self.launches = 0
        self.given: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid: tuple):  # type: ignore[no-untyped-def]
        self.launches += 1
        launch = self.real[grid]

        def record(*args: object, **kwargs: object) -> None:
            self.given.append((args, kwargs))
            launch(*args, **kwargs)

        return record
