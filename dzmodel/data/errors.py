"""One exception type for bad data: the message names the file or field."""


class DataError(ValueError):
    """A dataset, file or config field that cannot be used. The message says which and why."""
