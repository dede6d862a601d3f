"""Errors fivar raises at users. Every message names the variant and, for spec errors, file:line:col."""


class FivarError(Exception):
    """A problem with how fivar was asked to do something (bad shapes, missing params, build failure)."""


class FivarSpecError(FivarError):
    """A variant spec that fivar cannot accept; points at the offending source location."""

    def __init__(self, message: str, *, variant: str | None = None, filename: str | None = None,
                 line: int | None = None, col: int | None = None, construct: str | None = None,
                 allowed: str | None = None):
        self.variant, self.filename, self.line, self.col = variant, filename, line, col
        self.construct, self.allowed, self.reason = construct, allowed, message
        where = ""
        if filename is not None:
            where = f"{filename}:{line}:{(col or 0) + 1}: "
        who = f"variant '{variant}': " if variant else ""
        text = f"{where}{who}{message}"
        if allowed:
            text += f"\n  allowed: {allowed}"
        super().__init__(text)


class FivarBuildError(FivarError):
    """nvcc/ninja failed on sources fivar generated. Always a fivar bug; the log path is attached."""
