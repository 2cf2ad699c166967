"""Errors raised by the release tool; only ``__main__`` turns them into output."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "BuildFailed",
    "InvalidVersionInput",
    "Issue",
    "ReleaseError",
    "RepackError",
    "WheelVerificationError",
]


class ReleaseError(Exception):
    """Base class of every error the release tool reports (CLI exit status 1)."""

    code = "release-error"

    @property
    def issues(self) -> list[Issue]:
        return []


class InvalidVersionInput(ReleaseError, ValueError):
    """``VERSION.txt`` (or a version argument) is not a single valid PEP 440 version."""

    code = "invalid-version"


class BuildFailed(ReleaseError):
    """The build backend failed or produced an artifact that does not match the project."""

    code = "build-failed"

    def __init__(self, message: str, exception: BaseException | None = None) -> None:
        super().__init__(message)
        self.exception = exception


class RepackError(ReleaseError):
    """A repack was refused (unsafe input, collision, policy)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Issue:
    """One finding of a checker: which artifact, which member or field, expected vs actual."""

    code: str
    artifact: str
    where: str
    detail: str

    def __str__(self) -> str:
        return f"{self.artifact}: {self.code}: {self.where}: {self.detail}"

    def as_dict(self) -> dict[str, str]:
        return {"code": self.code, "artifact": self.artifact, "where": self.where, "detail": self.detail}


class WheelVerificationError(ReleaseError):
    """One or more checks failed; :attr:`issues` lists every one of them."""

    code = "verification-failed"

    def __init__(self, message: str, issues: Sequence[Issue]) -> None:
        super().__init__(message)
        self._issues = list(issues)

    @property
    def issues(self) -> list[Issue]:
        return self._issues

    @property
    def codes(self) -> set[str]:
        return {issue.code for issue in self._issues}
